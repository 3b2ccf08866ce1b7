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

Inside the proxy, the front door (``proxy.FrontDoor``) and the protocol
handlers that read a connection's request (``http.HTTPHandler``,
``socks.SocksHandler``) meet at two declared contracts: ``IFrontDoor``, all a
handler may ask of its door, and ``IDoorHandler``, all the door asks of a
handler.  The handlers import no proxy class, and the dispatcher's refusing
door (``dispatch._RefusingDoor``) is an ``IFrontDoor`` too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IProtocol, IStreamClientEndpoint
from twisted.python.failure import Failure
from zope.interface import Attribute, Interface

from agentsandbox.allowlist import IPAddress

if TYPE_CHECKING:
    from twisted.internet.protocol import Protocol

    from agentsandbox.egress.gate import Verdict
    from agentsandbox.egress.grant import Grant, Refusal


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


class IAskers(Interface):
    """Finds what process asks on a connection, for the person asked about it (issue 28)."""

    def find(client: tuple[str, int], server: tuple[str, int]) -> Deferred[str | None]:
        """``"PID COMM"`` of each process holding the client's end of the connection
        ``client`` -> ``server`` (comma-separated), or None when none is found.
        Never fails: what cannot be read is left out."""


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


class IFrontDoor(Interface):
    """What a protocol handler may ask of the connection it reads (``proxy.FrontDoor``)."""

    transport = Attribute(
        "The client's TCP transport (producer and half-close methods): handlers write "
        "their answers to it and pause it while an exchange is in flight."
    )
    client = Attribute("The client's address as the audit log writes it (HOST:PORT).")
    gone = Attribute("Whether the door is closed: the client went away, or the door refused it.")

    def armHeaderTimer() -> None:
        """Start waiting (``proxy.header_timeout``) for the next request head."""

    def cancelHeaderTimer() -> None:
        """A complete request head arrived: stop waiting for it."""

    def parseError(kind: str, why: str, answer: bytes) -> None:
        """A request the proxy cannot serve: audit it (``kind``: http | socks), send
        ``answer``, close."""

    def buffered(data: bytes) -> None:
        """Bytes the client sent after its tunnel request, before the tunnel opened."""

    def sessionRefusal(kind: str, password: bytes | None) -> str | None:
        """Attribute the connection to the session whose credential ``password`` is;
        why it is refused (already audited), or None."""

    def openTunnel(
        kind: str,
        host: str,
        port: int,
        granted: Callable[[], None],
        refused: Callable[[Refusal], None],
    ) -> None:
        """Decide ``host:port`` and open a tunnel: ``granted`` is called just before
        the client's bytes start flowing, ``refused`` (already audited) otherwise."""

    def decide(
        host: str, port: int, reserve: bool, then: Callable[[Verdict], None], kind: str = "forward"
    ) -> None:
        """Ask the connection's gate about ``host:port``; ``then`` gets the verdict,
        at once, once the name has resolved, or (an unlisted host under
        ``proxy.unlisted = "ask"``, held as a ``kind`` request) once the person
        answered.  A forwarded request reserves no slot."""

    def connect(grant: Grant, protocol: Protocol) -> Deferred[Any]:
        """Connect ``protocol`` upstream as ``grant`` says (the parent proxy, or each
        checked address in turn); fails with ``grant.RefusalError``."""

    def record(event: str, **fields: Any) -> None:
        """One audit record, attributed to the connection's session."""

    def logFailure(why: str, failure: Failure) -> None:
        """A bug in serving this connection: logged with ``why``, never raised."""


class IDoorHandler(Interface):
    """What the front door asks of the handler that reads a connection's request."""

    kind = Attribute("The protocol read, as audit records name it: http | socks.")

    def dataReceived(data: bytes) -> None:
        """The client's bytes, until the door splices or terminates the connection."""

    def readConnectionLost() -> None:
        """The client half-closed while the handler was still reading."""

    def connectionLost(reason: Failure) -> None:
        """The client's connection is gone."""
