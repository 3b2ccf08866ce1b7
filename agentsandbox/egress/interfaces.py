"""The contracts between the egress proxy's parts, as zope interfaces.

The front door (proxy.py) decides: it asks an ``IPeerChecker`` whether the
client may use the proxy at all, resolves names once through an ``IResolver``,
checks every address, and then either splices an opaque tunnel to a checked
address through an ``IDialer``, or hands the client's connection to an
``ITerminator`` when the terminator says it ``injects`` the host and port (an
inject rule, port 443).  That one question is the only answer to "is this host
terminated?": the proxy asks it at the moment it decides, and ``check host``
asks the same object the service would build.  The terminator (inject.py)
dials upstream through the same ``IDialer`` and asks each route's
``ITokenHolder`` for the token it sets; a terminated tunnel's byte counts reach
the audit record through ``ICountedTunnel``.  Tests inject every one of these,
so no config key can point the proxy somewhere else; ``agentsandbox.egress.testing``
ships the doubles (a table resolver, a dialer that maps addresses to loopback
ports, a peer check that allows everyone, a fixed token) that this package's
tests use and users' tests may too.
"""

from __future__ import annotations

from collections.abc import Sequence

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IProtocol, IStreamClientEndpoint
from zope.interface import Attribute, Interface

from agentsandbox.allowlist import IPAddress


class IResolver(Interface):
    """Resolves a host name once, to every A and AAAA answer."""

    def resolve(host: str, port: int) -> Deferred[Sequence[IPAddress]]:
        """All addresses ``host`` resolves to, in the resolver's order.

        Fails with ``agentsandbox.egress.resolve.ResolveError`` naming the host when
        nothing answers.
        """


class IDialer(Interface):
    """Reaches a checked address: the last hop, and the only one a test bends.

    The default (``dial.TCPDialer``) makes a TCP4/TCP6 client endpoint to
    exactly that address; tests map documentation addresses to loopback
    listeners, so the address rules the proxy applies stay real.
    """

    def __call__(ip: IPAddress, port: int) -> IStreamClientEndpoint:
        """The endpoint that connects to ``ip:port`` (never resolved again)."""


class IPeerChecker(Interface):
    """Decides whether the client on a connection may use the proxy."""

    def check(client: tuple[str, int], server: tuple[str, int]) -> str | None:
        """None when the peer at ``client`` (connected to our ``server`` address)
        may use the proxy, else the reason it may not, for the audit log."""


class ITokenHolder(Interface):
    """Where an inject route's token comes from (``tokens.TokenKeeper`` is one)."""

    def token() -> str | None:
        """The token in force now, or None while there is none yet."""


class ITerminator(Interface):
    """Serves a granted tunnel to an injected host with our own TLS."""

    def injects(host: str, port: int) -> bool:
        """Whether a granted tunnel to ``host:port`` goes to ``terminate``.

        ``host`` is the canonical tunnel host.  The answer follows reloads (the
        routes in force now); a caller that gets True calls ``terminate`` for
        that host before it returns to the reactor, so both see the same routes.
        """

    def terminate(host: str, addresses: Sequence[IPAddress]) -> IProtocol:
        """A fresh protocol for the client side of a granted tunnel.

        ``host`` is the canonical tunnel host, one ``injects`` just said yes
        to; ``addresses`` are the checked addresses the upstream may be
        dialled at, in order.  The proxy calls ``makeConnection`` with the
        client's transport and then feeds it every byte the client sends.
        When it provides ``ICountedTunnel``, the tunnel's audit record carries
        its counts.
        """


class ICountedTunnel(Interface):
    """A terminated tunnel's byte counts, read for its audit record when it closes.

    The protocol ``ITerminator.terminate`` returns may provide it (the
    injector's does); the record then says how many bytes went each way on the
    client's connection, else it leaves them out.
    """

    received = Attribute("Bytes received from the client so far, as they arrived (TLS records included).")
    sent = Attribute("Bytes written to the client so far, likewise.")
