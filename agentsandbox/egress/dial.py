"""The one dial: connecting to a checked address, the next one tried when one fails.

The front door's tunnels (``proxy.py``) and the injector's upstream pool
(``inject.py``) both reach an origin through here, so "could not connect" is
written once (``couldNotConnect``) and every dial tries the checked addresses in
the resolver's order.  ``TCPDialer`` is the default ``IDialer``: an endpoint when
called, or a connect of its own straight into a tunnel's ``UpstreamProtocol``
(``dialTunnel``, ``_Connecting``), one Deferred, one wrapper protocol and one
reactor turn fewer per tunnel.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from twisted.internet import error
from twisted.internet.defer import Deferred, fail
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP6ClientEndpoint
from twisted.internet.interfaces import IStreamClientEndpoint
from twisted.internet.posixbase import PosixReactorBase
from twisted.internet.protocol import ClientFactory, Factory, Protocol
from twisted.python.failure import Failure
from zope.interface import implementer

from agentsandbox.allowlist import IPAddress, unwrapMapped
from agentsandbox.egress.grant import Refusal, RefusalError
from agentsandbox.egress.interfaces import IDialer
from agentsandbox.egress.privates import ENABLED as PRIVATES
from agentsandbox.egress.privates import peerAddress, serveConnected
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
    connection for a tunnel's ``UpstreamProtocol``, which reports its own
    ``connectionMade``: an endpoint would wrap the protocol in a forwarding
    one, one more call on every event of every tunnel.  On a real reactor the
    connect starts at once (``_Connecting``), not a turn later.
    """

    def __init__(self, reactor: Any, timeout: float = 30.0) -> None:
        self.reactor = reactor
        self.timeout = timeout
        #: Whether ``dial`` connects sockets itself (``_Connecting``) or asks ``connectTCP``.
        self.connectsItself = PRIVATES and isinstance(reactor, PosixReactorBase)

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
        ip = unwrapMapped(ip)
        if self.connectsItself:
            _Connecting.start(self.reactor, ip, port, protocol, failed, self.timeout)
            return
        # (A reactor without sockets of its own, such as a test's MemoryReactor,
        # or the private fast paths switched off: ``privates.ENABLED``.)
        # connectTCP takes IPv6 literals too; the address is never resolved again.
        self.reactor.connectTCP(str(ip), port, _DirectDial(protocol, failed), timeout=self.timeout)


def tcpDialer(reactor: Any, timeout: float = 30.0) -> TCPDialer:
    """The default dialer (see ``TCPDialer``)."""
    return TCPDialer(reactor, timeout)


class _Connecting:
    """One non-blocking ``connect(2)`` to a checked address, then the connected
    socket served as a Twisted TCP transport of ``protocol``.

    ``reactor.connectTCP`` starts its connect from a ``callLater(0)``, a reactor
    turn after the dial, and builds a connector, a client transport and a
    timeout around it; on a new tunnel that turn sits between the client's
    request and its ``200``.  Here the connect starts at once; the reactor
    reports the socket writable once the handshake ended, and ``SO_ERROR``
    says how, as in Twisted's own ``doConnect``.  The connected socket becomes
    the transport ``IReactorSocket.adoptStreamConnection`` would make of it
    (``privates.serveConnected``, as ``register.py`` serves the dispatcher's sockets), which
    the splice, the half-close and the reset handling already know.  Failures
    are Twisted's connect errors (``error.getConnectError``), so
    ``couldNotConnect`` says the same as before; one that ``connect`` reports at
    once is delivered from the next turn, as ``connectTCP`` delivered it.
    """

    def __init__(self, reactor: Any, sock: socket.socket, protocol: UpstreamProtocol,
                 failed: Callable[[Failure], None]) -> None:  # fmt: skip
        self.reactor = reactor
        self.sock = sock
        self.fd = sock.fileno()
        self.protocol = protocol
        self.failed: Callable[[Failure], None] | None = failed
        self.timer: Any = None

    @classmethod
    def start(cls, reactor: Any, ip: IPAddress, port: int, protocol: UpstreamProtocol,
              failed: Callable[[Failure], None], timeout: float) -> None:  # fmt: skip
        try:
            sock = socket.socket(socket.AF_INET if ip.version == 4 else socket.AF_INET6, socket.SOCK_STREAM)
        except OSError as e:
            reactor.callLater(0, failed, Failure(error.getConnectError((e.errno, e.strerror))))
            return
        sock.setblocking(False)
        # No Nagle from the first byte (egress/nodelay.py says why; the upstream's
        # connectionMade sets it again, for the dialers that are not this one).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        result = sock.connect_ex((str(ip), port))
        if result in (0, errno.EISCONN):
            cls(reactor, sock, protocol, failed)._connected()
            return
        if result not in (errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EALREADY):
            sock.close()
            reactor.callLater(0, failed, Failure(error.getConnectError((result, os.strerror(result)))))
            return
        pending = cls(reactor, sock, protocol, failed)
        pending.timer = reactor.callLater(timeout, pending._fail, error.TimeoutError())
        reactor.addWriter(pending)

    def fileno(self) -> int:
        return self.fd

    def logPrefix(self) -> str:
        return "dial"

    def doWrite(self) -> None:
        self.reactor.removeWriter(self)
        result = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if result:
            self._fail(error.getConnectError((result, os.strerror(result))))
        else:
            self._connected()

    def connectionLost(self, reason: Failure) -> None:
        # epoll reported an error or hang-up (a refusal that came as a reset), or
        # the reactor is stopping: the socket's own error says which, when it has one.
        try:
            result = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        except OSError:
            result = 0
        if result:
            self._fail(error.getConnectError((result, os.strerror(result))))
        else:
            self._fail(error.ConnectError(string=reason.getErrorMessage()))

    def _connected(self) -> None:
        try:
            peer = peerAddress(self.sock)
        except OSError as e:  # reset between the handshake and now
            self.reactor.callLater(0, self._fail, error.getConnectError((e.errno, e.strerror)))
            return
        if self.timer is not None and self.timer.active():
            self.timer.cancel()
        self.failed = None
        serveConnected(self.sock, self.protocol, peer, self.reactor, "dialled")

    def _fail(self, e: Exception) -> None:
        failed, self.failed = self.failed, None
        if failed is None:
            return
        if self.timer is not None and self.timer.active():
            self.timer.cancel()
        self.reactor.removeWriter(self)
        self.sock.close()
        failed(Failure(e))


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

