"""``TCP_NODELAY`` on every TCP leg the proxy owns.

A proxy writes what it was given as soon as it has it: the 100 bytes of a
response head, then its 900-byte body a moment later.  With Nagle's algorithm
on, the kernel holds that second small write until the first is acknowledged,
and a peer that is itself waiting for more delays its ACK (40 ms on Linux):
every such exchange waits ~40 ms, on loopback as anywhere (issue 25).  No leg
of this proxy ever wants its writes held back: the client's (bound, socket
activated or handed over by the dispatcher), each upstream (dialled directly,
through a parent proxy, for a forwarded request or the injector's pool), so
each sets ``TCP_NODELAY`` on its socket as it connects.  splice(2) moves bytes
between the same sockets later, which keep the option.

One ``setsockopt`` per socket: not on the listening socket alone, because a
socket handed over by the dispatcher or accepted from a listener systemd made
without ``NoDelay=yes`` would not have inherited it.
"""

from __future__ import annotations

from typing import Any


def noDelay(transport: Any) -> None:
    """Turn Nagle's algorithm off on ``transport``'s socket, when it is TCP.

    Transports without sockets (tests' in-memory ones, a TLS layer's wrapper)
    have no ``setTcpNoDelay`` and are left alone; a socket the peer already
    reset refuses the option, which no longer matters to it.
    """
    setter = getattr(transport, "setTcpNoDelay", None)
    if setter is not None:
        try:
            setter(True)
        except OSError:
            pass
