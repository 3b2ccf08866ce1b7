"""The one dial: connecting to a checked address, the next one tried when one fails.

The front door's tunnels (``proxy.py``) and the injector's upstream pool
(``inject.py``) both reach an origin through here, so "could not connect" is
written once (``couldNotConnect``) and every dial tries the checked addresses in
the resolver's order.  ``TCPDialer`` is the default ``IDialer``: an endpoint when
called, or ``reactor.connectTCP`` straight into a tunnel's ``UpstreamProtocol``
(``dialTunnel``), one Deferred and one wrapper protocol fewer per tunnel.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from twisted.internet.defer import Deferred, fail
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP6ClientEndpoint
from twisted.internet.interfaces import IStreamClientEndpoint
from twisted.internet.protocol import ClientFactory, Factory, Protocol
from twisted.python.failure import Failure
from zope.interface import implementer

from agentsandbox.egress.grant import Refusal, RefusalError
from agentsandbox.egress.interfaces import IDialer
from agentsandbox.egress.rules import IPAddress, unwrapMapped
from agentsandbox.egress.splice import UpstreamProtocol

P = TypeVar("P", bound=Protocol)


def couldNotConnect(host: str, port: int, errors: Sequence[str]) -> RefusalError:
    """The one refusal for a dial that reached none of ``host``'s checked addresses;
    ``errors`` holds one ``ADDRESS: why`` per address tried."""
    why = "; ".join(errors) or "no address to dial"
    return RefusalError(Refusal("dial", f"could not connect to {host}:{port} ({why})"))


@implementer(IDialer)
class TCPDialer:
    """The default dialer: a TCP connection to exactly the checked address.

    Called like any ``IDialer`` it returns an endpoint.  ``dial`` makes the same
    connection straight through ``reactor.connectTCP`` for a tunnel's
    ``UpstreamProtocol``, which reports its own ``connectionMade``: an endpoint
    would wrap the protocol in a forwarding one, one more call on every event
    of every tunnel.
    """

    def __init__(self, reactor: Any, timeout: float = 30.0) -> None:
        self.reactor = reactor
        self.timeout = timeout

    def __call__(self, ip: IPAddress, port: int) -> IStreamClientEndpoint:
        ip = unwrapMapped(ip)
        if ip.version == 4:
            return TCP4ClientEndpoint(self.reactor, str(ip), port, timeout=self.timeout)
        return TCP6ClientEndpoint(self.reactor, str(ip), port, timeout=self.timeout)

    def dial(
        self,
        ip: IPAddress,
        port: int,
        protocol: UpstreamProtocol,
        connected: Callable[[UpstreamProtocol], None],
        failed: Callable[[Failure], None],
    ) -> None:
        """Connect ``protocol`` to ``ip:port``: ``connected(protocol)`` once it is,
        or ``failed`` with the reason an endpoint would give."""
        protocol.onConnected = connected
        # connectTCP takes IPv6 literals too; the address is never resolved again.
        self.reactor.connectTCP(str(unwrapMapped(ip)), port, _DirectDial(protocol, failed), timeout=self.timeout)


def tcpDialer(reactor: Any, timeout: float = 30.0) -> TCPDialer:
    """The default dialer (see ``TCPDialer``)."""
    return TCPDialer(reactor, timeout)


class _DirectDial(ClientFactory):
    """``TCPDialer.dial``'s factory: the one protocol, and the dial's failure."""

    noisy = False

    def __init__(self, protocol: UpstreamProtocol, failed: Callable[[Failure], None]) -> None:
        self._protocol = protocol
        self._failed: Callable[[Failure], None] | None = failed

    def buildProtocol(self, addr: Any) -> Protocol:
        return self._protocol

    def clientConnectionFailed(self, connector: Any, reason: Failure) -> None:
        failed, self._failed = self._failed, None
        if failed is not None:
            failed(reason)


class _OneShot(Factory):
    """Connects one protocol; quiet, since a tunnel's start is in the audit log already."""

    noisy = False

    def __init__(self, protocol: Protocol) -> None:
        self._protocol = protocol

    def buildProtocol(self, addr: Any) -> Protocol:
        return self._protocol


def connectQuietly(endpoint: IStreamClientEndpoint, protocol: Protocol) -> Deferred[Any]:
    """``connectProtocol`` without Twisted's two "Starting/Stopping factory" lines per dial."""
    return endpoint.connect(_OneShot(protocol))


def _dialOne(dialer: IDialer, ip: IPAddress, port: int, protocol: Protocol) -> Deferred[Any]:
    if isinstance(dialer, TCPDialer) and isinstance(protocol, UpstreamProtocol):
        d: Deferred[Any] = Deferred()
        dialer.dial(ip, port, protocol, d.callback, d.errback)
        return d
    return connectQuietly(dialer(ip, port), protocol)


def dialInTurn(
    dialer: IDialer,
    host: str,
    port: int,
    addresses: Sequence[IPAddress],
    protocolFor: Callable[[IPAddress], P],
) -> Deferred[P]:
    """Connect to each checked address of ``host`` in turn until one answers.

    ``protocolFor(address)`` gives the protocol for each attempt (a tunnel reuses
    one; the injector makes a fresh TLS stream per address).  Fires with the
    connected protocol, or fails with ``couldNotConnect`` naming every address tried.
    """
    errors: list[str] = []

    def attempt(index: int) -> Deferred[P]:
        # Each failed attempt chains the next: a dial to one address (the
        # common case) is the one Deferred the connection makes, no more.
        if index >= len(addresses):
            return fail(couldNotConnect(host, port, errors))
        ip = addresses[index]
        protocol = protocolFor(ip)

        def failed(f: Failure) -> Deferred[P]:
            errors.append(f"{ip}: {f.getErrorMessage()}")
            return attempt(index + 1)

        try:
            d = _dialOne(dialer, ip, port, protocol)
        except Exception as e:
            errors.append(f"{ip}: {e}")
            return attempt(index + 1)
        return d.addCallbacks(lambda _: protocol, failed)

    return attempt(0)


def dialTunnel(
    dialer: IDialer,
    host: str,
    port: int,
    addresses: Sequence[IPAddress],
    protocol: UpstreamProtocol,
    connected: Callable[[UpstreamProtocol], None],
    failed: Callable[[Failure], None],
) -> None:
    """``dialInTurn`` for a tunnel's upstream, reporting through callbacks.

    The common case, one checked address and the default dialer, makes no
    Deferred at all; ``failed`` gets ``couldNotConnect`` either way.
    """
    if len(addresses) != 1 or not isinstance(dialer, TCPDialer):
        dialInTurn(dialer, host, port, addresses, lambda _: protocol).addCallbacks(connected, failed)
        return
    ip = addresses[0]

    def dialFailed(f: Failure) -> None:
        failed(Failure(couldNotConnect(host, port, [f"{ip}: {f.getErrorMessage()}"])))

    try:
        dialer.dial(ip, port, protocol, connected, dialFailed)
    except Exception as e:
        failed(Failure(couldNotConnect(host, port, [f"{ip}: {e}"])))

