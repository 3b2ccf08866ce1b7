"""The one room where the proxy uses Twisted's private parts, and the one switch back.

Twisted's socket transports queue every write and every half-close for the
next reactor turn, and build their transports only around sockets they
accepted or connected themselves.  The proxy's hot paths go around that, each
by reading or setting a few attributes of ``twisted.internet.tcp`` transports
that Twisted 22.4 and current releases share, and each falls back to the
public call when a transport lacks them:

- ``writeNow`` sends a write at once when nothing is queued before it (a
  queued write costs two ``epoll_ctl`` calls, a dispatch and a turn of latency
  per hop); ``WriteThrough`` does it for a TLS layer's ciphertext;
- ``shutWrite`` half-closes at once when nothing waits to be written;
- ``takeOutput``/``writeOpen`` let the zero-copy hand-over (``splice.zeroCopy``)
  take what Twisted still had buffered;
- ``peerAddress``/``serveConnected`` make a ``tcp.Server`` of a socket already
  connected (``dial._Connecting``, one reactor turn sooner than
  ``connectTCP``) or already held (``register``, without the ``dup`` of
  ``adoptStreamConnection``).

``AGENTSANDBOX_TWISTED_PRIVATES=0`` in the environment when this module is
first imported turns all of it off (``ENABLED``): plain ``write``,
``loseWriteConnection``, Twisted's copy loop instead of splice(2),
``connectTCP`` and ``adoptStreamConnection``.  It is read once: the callers
bind the chosen functions at import, so a hot path costs the same one call
either way.  ``tests/test_privates.py`` runs the proxy with it off.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from twisted.internet import tcp
from twisted.internet.abstract import FileDescriptor
from zope.interface import directlyProvides, providedBy

#: The environment variable that turns the private fast paths off ("0").
SWITCH = "AGENTSANDBOX_TWISTED_PRIVATES"
#: Whether the fast paths below may use Twisted's private attributes; read once.
ENABLED: bool = os.environ.get(SWITCH, "1") != "0"


# --------------------------------------------------------------------------- writes


def _writeNow(transport: Any, data: bytes) -> None:
    try:
        queued = (
            transport._tempDataBuffer
            or len(transport.dataBuffer) > transport.offset
            or not transport.connected
            or transport.disconnecting
            or transport._writeDisconnecting
            or transport._writeDisconnected
        )
        send = transport.writeSomeData
    except AttributeError:
        transport.write(data)
        return
    if queued or not data:
        transport.write(data)
        return
    sent = send(data)
    if not isinstance(sent, int):
        # The connection is gone; the transport's own write finds out and
        # reports it through connectionLost as usual.
        transport.write(data)
    elif sent < len(data):
        transport.write(data[sent:])


def _write(transport: Any, data: bytes) -> None:
    transport.write(data)


#: ``transport.write(data)``, sent before returning when nothing is queued.
#: Sending at once is safe only when the transport has nothing buffered
#: (order) and is still open for writing; otherwise, and for whatever the
#: socket did not take, the transport's own ``write`` queues as usual, so
#: back-pressure (a streaming producer paused when the buffer fills),
#: half-close and close work unchanged.  A transport without these attributes
#: (a test's in-memory one, a TLS layer) gets its own ``write``.
writeNow = _writeNow if ENABLED else _write

#: What a FileDescriptor transport must have for ``WriteThrough`` to send
#: directly; both Twisted 22.4 and 26 have all of them.
_FD_ATTRIBUTES = ("writeSomeData", "dataBuffer", "offset", "_tempDataBuffer", "connected", "disconnecting")


class WriteThrough:
    """A transport that sends a write at once when nothing is queued before it.

    Under a TLS layer, Twisted's queued writes were a third of the
    terminating path's cost per request.  Everything but
    ``write``/``writeSequence`` is the wrapped transport's.
    """

    def __init__(self, transport: Any) -> None:
        self._transport = transport
        directlyProvides(self, *providedBy(transport))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def write(self, data: bytes) -> None:
        _writeNow(self._transport, data)

    def writeSequence(self, data: Any) -> None:
        self.write(b"".join(data))


def writeThrough(transport: Any) -> Any:
    """``transport`` wrapped in ``WriteThrough`` when it is a socket transport that allows it."""
    if ENABLED and isinstance(transport, FileDescriptor) and all(hasattr(transport, a) for a in _FD_ATTRIBUTES):
        return WriteThrough(transport)
    return transport


# --------------------------------------------------------------------------- half-close


def _shutWrite(transport: Any) -> None:
    try:
        idle = (
            type(transport).__module__ == "twisted.internet.tcp"
            and not getattr(transport, "TLS", False)
            and transport.connected
            and not transport.disconnecting
            and not transport._writeDisconnecting
            and not transport._writeDisconnected
            and len(transport.dataBuffer) == transport.offset
            and not transport._tempDataLen
            and callable(transport._closeWriteConnection)
        )
    except AttributeError:
        idle = False
    if not idle:
        transport.loseWriteConnection()
        return
    transport.stopWriting()
    transport._writeDisconnecting = True
    transport._writeDisconnected = True
    transport._closeWriteConnection()


def _loseWriteConnection(transport: Any) -> None:
    transport.loseWriteConnection()


#: ``transport.loseWriteConnection()``, at once when nothing waits to be written.
#:
#: Twisted half-closes from its next ``doWrite``: a reactor turn, two epoll
#: changes and a zero-byte send before the ``shutdown(SHUT_WR)``, for every
#: tunnel whose client ends its side first.  With an empty write buffer this
#: does what that branch of ``doWrite`` does, now; the transport's state says
#: write-disconnected as before, so a later ``loseConnection`` closes at once
#: (Twisted's own path after a half-close).  Anything other than a plain
#: Twisted TCP transport with an empty buffer gets ``loseWriteConnection``.
shutWrite = _shutWrite if ENABLED else _loseWriteConnection


# --------------------------------------------------------------------------- the zero-copy hand-over


def writeOpen(transport: Any) -> bool:
    """Whether ``transport`` has not begun to half-close (a splice would write past it)."""
    return not (getattr(transport, "_writeDisconnecting", False) or getattr(transport, "_writeDisconnected", False))


def takeOutput(transport: Any) -> bytes | None:
    """What Twisted has buffered to write on ``transport``, or None if its buffers look unfamiliar."""
    try:
        head = bytes(transport.dataBuffer[transport.offset :])
        tail = b"".join(transport._tempDataBuffer)
    except (AttributeError, TypeError):
        return None
    return head + tail


def clearOutput(transport: Any) -> None:
    """Empties ``transport``'s write buffers: their bytes went with ``takeOutput``."""
    transport.dataBuffer = b""
    transport.offset = 0
    transport._tempDataBuffer = []
    transport._tempDataLen = 0


# --------------------------------------------------------------------------- transports of held sockets


def peerAddress(sock: socket.socket) -> tuple[Any, ...]:
    """The peer of a connected TCP socket in Twisted's form (an IPv6 one keeps its scope)."""
    return tcp._getpeername(sock)  # type: ignore[no-any-return]


def serveConnected(sock: socket.socket, protocol: Any, peer: tuple[Any, ...], reactor: Any, how: str) -> Any:
    """A ``tcp.Server`` transport of ``protocol`` on the connected ``sock``, connected.

    The construction ``IReactorSocket.adoptStreamConnection`` makes (Twisted's
    ``tcp.Server._fromConnectedSocket``, unchanged from 22.4 to now), on the
    socket itself: no ``dup``, no second socket object.  Server's own
    ``__init__`` makes it non-blocking, as it does an accepted socket; no Port,
    as Twisted's own adoption passes none.  ``how`` ends its ``repr``.
    """
    transport = tcp.Server(sock, protocol, peer, None, peer[1], reactor)  # type: ignore[arg-type]
    transport.repstr = f"<{protocol.__class__.__name__} #{transport.sessionno} {how}>"
    protocol.makeConnection(transport)
    return transport
