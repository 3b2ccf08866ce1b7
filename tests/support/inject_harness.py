"""Wires the injector to the fake GitHub over real loopback sockets, without the proxy.

A "tunnel port" per injected host stands for a granted CONNECT: whatever
connects to it is handed to ``Injector.terminate(host, addresses)``, exactly as
the proxy does after answering 200.  Clients reach it with curl's
``--connect-to`` (or git's ``http.curloptResolve``), so they still send SNI and
verify the name they asked for.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

from cryptography import x509
from twisted.internet import defer, endpoints, utils
from twisted.internet.address import IPv4Address
from twisted.internet.interfaces import IListeningPort, IOpenSSLClientConnectionCreator
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import ILogObserver, globalLogPublisher
from twisted.protocols.policies import WrappingFactory
from zope.interface import implementer

from agentsandbox.config import GITHUB_HOSTS, InjectRule, githubRules
from agentsandbox.egress.compat import toX509
from agentsandbox.egress.inject import Injector, routesFor
from agentsandbox.egress.testing import FixedToken, MappedDialer, UpstreamPKI
from agentsandbox.egress.tls import InjectionCA
from tests.support.inject_github import FakeGitHub, documentationAddress, listenTLS

TOKEN = "ghu_" + "C4n4ryT0k3n" * 3 + "Zz"


class Tracked(WrappingFactory):
    """Counts a factory's open connections so cleanup can wait for every one to end."""

    def __init__(self, wrapped: Any) -> None:
        super().__init__(wrapped)
        self._waiters: list[defer.Deferred[None]] = []

    def unregisterProtocol(self, p: Any) -> None:
        super().unregisterProtocol(p)
        if not self.protocols:
            waiters, self._waiters = self._waiters, []
            for w in waiters:
                w.callback(None)

    def closeAll(self) -> defer.Deferred[None]:
        if not self.protocols:
            return defer.succeed(None)
        d: defer.Deferred[None] = defer.Deferred()
        self._waiters.append(d)
        for p in list(self.protocols):
            p.transport.abortConnection()
        return d


class _TunnelFactory(Factory):
    def __init__(self, injector: Injector, host: str, addresses: list[Any]) -> None:
        self.injector = injector
        self.host = host
        self.addresses = addresses

    def buildProtocol(self, addr: Any) -> Any:
        return self.injector.terminate(self.host, self.addresses)


@implementer(ILogObserver)
@dataclass
class LogCapture:
    lines: list[str] = field(default_factory=list)

    def __call__(self, event: dict[str, Any]) -> None:
        from twisted.logger import formatEvent

        self.lines.append(formatEvent(event))

    def start(self) -> None:
        globalLogPublisher.addObserver(self)

    def stop(self) -> None:
        globalLogPublisher.removeObserver(self)


class InjectHarness:
    def __init__(
        self,
        reactor: Any,
        rules: tuple[InjectRule, ...] | None = None,
        token: FixedToken | None = None,
        trustUpstream: bool = True,
    ) -> None:
        self.reactor = reactor
        self.rules = rules or githubRules()
        self.holder = token or FixedToken(TOKEN)
        self.dir = tempfile.mkdtemp(prefix="agentsandbox-inject-")
        self.gitRoot = os.path.join(self.dir, "git")
        os.makedirs(self.gitRoot)
        self.pki = UpstreamPKI.create()
        self.fake = FakeGitHub(token=TOKEN, gitRoot=self.gitRoot)
        self.ports: list[IListeningPort] = []
        hosts = [h for r in self.rules for h in r.hosts]
        self.tracked: list[Tracked] = []
        self.upstream = listenTLS(
            reactor, self.track(self.fake.site()), self.pki.serverOptions([*GITHUB_HOSTS, *hosts, "codeload.github.com"])
        )
        self.ports.append(self.upstream)
        self.dialer = MappedDialer(reactor)
        self.address = documentationAddress(10)
        upstreamHost = self.upstream.getHost()
        assert isinstance(upstreamHost, IPv4Address)
        self.dialer.map(self.address, upstreamHost.port)
        self.ca = InjectionCA.create(hosts, label="test")
        self.caFile = os.path.join(self.dir, "ca.pem")
        with open(self.caFile, "wb") as f:
            f.write(self.ca.pem)
        self.injector = Injector(
            self.ca,
            routesFor(self.rules, lambda rule: self.holder),
            self.dialer,
            reactor,
            upstreamTrust=self.pki.pem if trustUpstream else None,
        )
        self.tunnels: dict[str, int] = {}
        for host in hosts:
            port = reactor.listenTCP(
                0, self.track(_TunnelFactory(self.injector, host, [self.address])), interface="127.0.0.1"
            )
            self.ports.append(port)
            self.tunnels[host] = port.getHost().port

    def tunnelTo(self, host: str, addresses: list[Any]) -> int:
        """Another tunnel port for ``host`` whose upstream is at ``addresses``."""
        port = self.reactor.listenTCP(
            0, self.track(_TunnelFactory(self.injector, host, addresses)), interface="127.0.0.1"
        )
        self.ports.append(port)
        return int(port.getHost().port)

    def raw(self, host: str, data: bytes, sni: str | None = None, port: int | None = None,
            until: bytes | None = None) -> Any:
        return rawTLS(self.reactor, port or self.tunnels[host], data, AnySNI(self.ca.pem, sni or host), until)

    def track(self, factory: Any) -> Tracked:
        tracked = Tracked(factory)
        self.tracked.append(tracked)
        return tracked

    def connectTo(self, host: str) -> list[str]:
        return ["--connect-to", f"{host}:443:127.0.0.1:{self.tunnels[host]}"]

    def curl(self, *args: str, env: dict[str, str] | None = None) -> defer.Deferred[tuple[bytes, bytes, int]]:
        """Run real curl; the caller adds --connect-to and the URL."""
        argv = ["-sS", "--cacert", self.caFile, "--max-time", "60", *args]
        d: defer.Deferred[tuple[bytes, bytes, int]] = utils.getProcessOutputAndValue(
            "/usr/bin/curl", argv, env=env or _cleanEnv(), reactor=self.reactor
        )
        return d

    @defer.inlineCallbacks
    def close(self) -> Any:
        for port in self.ports:
            yield port.stopListening()
        yield self.injector.closeIdle()
        for tracked in self.tracked:
            yield tracked.closeAll()


def _cleanEnv() -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp")}


# ---------------------------------------------------------------------- a raw TLS client


@implementer(IOpenSSLClientConnectionCreator)
class AnySNI:
    """A TLS client that trusts ``caPEM``, sends ``sni`` and checks no name: it
    shows which certificate the server picked."""

    def __init__(self, caPEM: bytes, sni: str, alpn: list[bytes] | None = None) -> None:
        from OpenSSL import SSL

        self.sni = sni.encode("ascii")
        ctx = SSL.Context(SSL.TLS_METHOD)
        store = ctx.get_cert_store()
        assert store is not None
        store.add_cert(toX509(x509.load_pem_x509_certificate(caPEM)))
        ctx.set_verify(SSL.VERIFY_PEER, lambda conn, cert, errno, depth, ok: bool(ok))
        if alpn:
            ctx.set_alpn_protos(alpn)
        self.ctx = ctx

    def clientConnectionForTLS(self, tlsProtocol: Any) -> Any:
        from OpenSSL import SSL

        conn = SSL.Connection(self.ctx, None)
        conn.set_tlsext_host_name(self.sni)
        conn.set_app_data(tlsProtocol)
        return conn


class RawClient(Protocol):
    """Sends bytes, collects everything until the server closes."""

    def __init__(self, data: bytes, until: bytes | None = None) -> None:
        self.data = data
        self.until = until
        self.received = bytearray()
        self.done: defer.Deferred[bytes] = defer.Deferred()
        self.peer: Any = None
        self.alpn: bytes | None = None

    def connectionMade(self) -> None:
        self.transport.write(self.data)  # type: ignore[union-attr]

    def dataReceived(self, data: bytes) -> None:
        if self.peer is None:
            tls = self.transport.getHandle()  # type: ignore[union-attr]
            self.peer = tls.get_peer_certificate()
            self.alpn = tls.get_alpn_proto_negotiated()
        self.received += data
        if self.until is not None and self.received.count(b"\r\n\r\n") and self.until in self.received:
            self.transport.loseConnection()  # type: ignore[union-attr]

    def connectionLost(self, reason: Any = None) -> None:
        if not self.done.called:
            self.done.callback(bytes(self.received))


def rawTLS(
    reactor: Any, port: int, data: bytes, creator: Any, until: bytes | None = None
) -> defer.Deferred[RawClient]:
    """Connect over TLS to a tunnel port, send ``data``, wait for the server to close."""
    client = RawClient(data, until)
    endpoint = endpoints.wrapClientTLS(creator, endpoints.TCP4ClientEndpoint(reactor, "127.0.0.1", port))
    d: defer.Deferred[Any] = endpoints.connectProtocol(endpoint, client)
    d.addCallback(lambda _: client.done)
    return d.addCallback(lambda _: client)
