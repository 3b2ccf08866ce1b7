"""The egress proxy's front door: one loopback port, SOCKS5 and HTTP, and the decisions.

Every accepted connection is first checked to come from our own Unix user
(``peer.py``), then its first byte picks the protocol: ``0x05`` is SOCKS5,
anything else HTTP (``http.py``).  Both ask ``FrontDoor.openTunnel`` for a
tunnel, which decides in this order:

1. the name against ``sandbox.domains`` (``AllowList.byName``), no DNS;
2. the cap on concurrent tunnels (``proxy.max_tunnels``);
3. the name resolved once (``IResolver``), every address classified
   (``rules.decideAddress``): refused ranges pass only through CIDR/IP entries;
4. injected hosts on 443 go to the ``ITerminator`` (never dialled here);
   everything else is dialled at the checked addresses in order, the next one
   tried when one fails, directly or through ``proxy.parent``.

Each decision is one audit record.  The config is read from a ``ConfigHolder``
when a connection arrives, so a reload changes what new connections get and
leaves open tunnels alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from twisted.application.service import Service
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.endpoints import (
    HostnameEndpoint,
    TCP4ClientEndpoint,
    TCP6ClientEndpoint,
    connectProtocol,
    serverFromString,
)
from twisted.internet.interfaces import (
    IHalfCloseableProtocol,
    IListeningPort,
    IProtocol,
    IStreamClientEndpoint,
)
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from agentsandbox.audit import AuditLog
from agentsandbox.config import Config
from agentsandbox.egress.interfaces import Dialer, IResolver, ITerminator
from agentsandbox.egress.peer import PeerChecker, SameUserPeers
from agentsandbox.egress.resolve import (
    ResolveError,
    SystemResolver,
    decideAddresses,
    decideHost,
)
from agentsandbox.egress.rules import IPAddress, classifyAddress, suggestEntry, unwrapMapped
from agentsandbox.egress.splice import Tunnel, UpstreamProtocol
from agentsandbox.reload import ConfigHolder, asHolder

SOCKS_VERSION = 0x05


@dataclass(frozen=True)
class Refusal:
    """Why a tunnel was not opened.  ``kind`` picks the HTTP status and SOCKS code."""

    kind: str  # policy | limit | resolve | dial | parent | inject
    reason: str
    allow: str | None = None
    address: str | None = None

    @property
    def status(self) -> int:
        return {"policy": 403, "inject": 403, "limit": 503, "resolve": 502, "dial": 502, "parent": 502}[
            self.kind
        ]


class RefusalError(Exception):
    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.reason)
        self.refusal = refusal


@dataclass(frozen=True)
class Grant:
    """A tunnel the policy allows: where it may go."""

    host: str
    port: int
    addresses: tuple[IPAddress, ...]
    entry: str
    viaParent: bool


def tcpDialer(reactor: Any, timeout: float = 30.0) -> Dialer:
    """The default dialer: a TCP connection to exactly the checked address."""

    def dial(ip: IPAddress, port: int) -> IStreamClientEndpoint:
        ip = unwrapMapped(ip)
        if ip.version == 4:
            return TCP4ClientEndpoint(reactor, str(ip), port, timeout=timeout)
        return TCP6ClientEndpoint(reactor, str(ip), port, timeout=timeout)

    return dial


def parseParent(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.port is None:
        raise ValueError(f"{url!r} is not http://HOST:PORT")
    return parts.hostname, parts.port


@implementer(IHalfCloseableProtocol)
class FrontDoor(Protocol):
    """One client connection: peer check, protocol choice, then a handler or a tunnel."""

    factory: EgressProxyFactory

    def __init__(self, factory: EgressProxyFactory) -> None:
        self.factory = factory
        self.config: Config = factory.holder.current
        self.handler: Any = None
        self.client = "?"
        self.pending: list[bytes] = []
        self.gone = False
        self.tunnel: Tunnel | None = None
        self.terminated: IProtocol | None = None
        self.awaiting = False
        self.pendingEOF = False
        self._headerTimer: Any = None

    # -------------------------------------------------------------- connection
    def connectionMade(self) -> None:
        peer, host = self.transport.getPeer(), self.transport.getHost()  # type: ignore[union-attr]
        self.client = f"{getattr(peer, 'host', '?')}:{getattr(peer, 'port', '?')}"
        self.factory.doors.add(self)
        why = self.factory.peers.check((peer.host, peer.port), (host.host, host.port))  # type: ignore[attr-defined]
        if why is not None:
            self.factory.record("peer", client=self.client, reason=why)
            self.gone = True
            self.transport.abortConnection()  # type: ignore[union-attr]
            return
        self.armHeaderTimer()

    def armHeaderTimer(self) -> None:
        self.cancelHeaderTimer()
        self._headerTimer = self.factory.reactor.callLater(
            self.config.proxy.header_timeout, self._headerTimeout
        )

    def cancelHeaderTimer(self) -> None:
        if self._headerTimer is not None and self._headerTimer.active():
            self._headerTimer.cancel()
        self._headerTimer = None

    def _headerTimeout(self) -> None:
        self._headerTimer = None
        self.parseError(
            "http" if self.handler is None else self.handler.kind if hasattr(self.handler, "kind") else "socks",
            f"no complete request within {self.config.proxy.header_timeout:g}s (proxy.header_timeout)",
            b"",
        )

    def dataReceived(self, data: bytes) -> None:
        if self.gone or not data:
            return
        if self.handler is None:
            if data[0] == SOCKS_VERSION:
                from agentsandbox.egress.socks import SocksHandler

                self.handler = SocksHandler(self)
            else:
                from agentsandbox.egress.http import HTTPHandler

                self.handler = HTTPHandler(self)
        try:
            self.handler.dataReceived(data)
        except Exception:
            # A parser bug must cost this one connection, never the proxy.
            self.factory.log.failure("egress: handler failed for {client}", client=self.client)
            self.parseError("internal", "the proxy failed to parse the request", b"")

    def readConnectionLost(self) -> None:
        if self.awaiting:
            # The client said all it had to say before the tunnel opened (a
            # request, then EOF); deliver the EOF once the tunnel exists.
            self.pendingEOF = True
        elif self.tunnel is not None:
            self.tunnel.clientReadLost()
        elif self.terminated is not None:
            if IHalfCloseableProtocol.providedBy(self.terminated):
                self.terminated.readConnectionLost()  # type: ignore[attr-defined]
            else:
                self.transport.loseConnection()  # type: ignore[union-attr]
        elif self.handler is not None and hasattr(self.handler, "readConnectionLost"):
            self.handler.readConnectionLost()
        else:
            self.transport.loseConnection()  # type: ignore[union-attr]

    def writeConnectionLost(self) -> None:
        if self.terminated is not None and IHalfCloseableProtocol.providedBy(self.terminated):
            self.terminated.writeConnectionLost()  # type: ignore[attr-defined]

    def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
        self.gone = True
        self.cancelHeaderTimer()
        self.factory.doors.discard(self)
        if self.tunnel is not None:
            self.tunnel.clientLost(reason)
        elif self.terminated is not None:
            self.terminated.connectionLost(reason)
        if self.handler is not None and hasattr(self.handler, "connectionLost"):
            self.handler.connectionLost(reason)

    # -------------------------------------------------------------- helpers for handlers
    def parseError(self, kind: str, why: str, answer: bytes) -> None:
        """A request the proxy cannot serve: audit it, answer, close."""
        self.factory.record("parse", kind=kind, client=self.client, reason=why)
        if answer:
            self.transport.write(answer)  # type: ignore[union-attr]
        self.transport.loseConnection()  # type: ignore[union-attr]
        self.gone = True

    def buffered(self, data: bytes) -> None:
        """Bytes the client sent after its request, before the tunnel opened."""
        if data:
            self.pending.append(data)
            if sum(map(len, self.pending)) > 256 * 1024:
                self.transport.pauseProducing()  # type: ignore[union-attr]

    # -------------------------------------------------------------- tunnels
    def openTunnel(
        self,
        kind: str,
        host: str,
        port: int,
        granted: Callable[[], None],
        refused: Callable[[Refusal], None],
    ) -> None:
        """Decide ``host:port``; on success call ``granted`` then splice, else ``refused``."""
        self.cancelHeaderTimer()
        self.awaiting = True
        factory = self.factory
        d = factory.decide(self.config, host, port, reserve=True)

        def onGrant(grant: Grant) -> Deferred[Any] | None:
            if self.gone:
                self.awaiting = False
                factory.release()
                return None
            rule = self.config.injectFor(grant.host)
            if rule is not None and grant.port == 443:
                return self._terminate(kind, grant, granted, refused)
            return factory.connect(self.config, grant, UpstreamProtocol()).addCallbacks(
                lambda upstream: self._splice(kind, grant, upstream, granted),
                lambda f: self._dialFailed(kind, grant, f, refused),
            )

        def onRefusal(f: Failure) -> None:
            f.trap(RefusalError)
            self.awaiting = False
            r: Refusal = f.value.refusal
            factory.record(
                "refused",
                kind=kind,
                client=self.client,
                host=host,
                port=port,
                reason=r.reason,
                allow=r.allow,
                address=r.address,
            )
            if not self.gone:
                refused(r)

        d.addCallbacks(onGrant, onRefusal)
        d.addErrback(self._bug)

    def _bug(self, f: Failure) -> None:
        self.factory.log.failure("egress: tunnel setup failed for {client}", f, client=self.client)
        if not self.gone:
            self.transport.abortConnection()  # type: ignore[union-attr]

    def _terminate(
        self, kind: str, grant: Grant, granted: Callable[[], None], refused: Callable[[Refusal], None]
    ) -> None:
        terminator = self.factory.terminator
        if terminator is None:
            self.factory.release()
            r = Refusal(
                "inject",
                f"{grant.host}:443 has an inject rule ([[inject]] hosts), but this proxy runs without "
                "the TLS terminator that injects it, so the tunnel is refused rather than opened "
                "without the credential",
            )
            self.factory.record("refused", kind=kind, client=self.client, host=grant.host, port=443, reason=r.reason)
            refused(r)
            return
        self.awaiting = False
        granted()
        protocol = terminator.terminate(grant.host, grant.addresses)
        self.terminated = protocol
        started = self.factory.reactor.seconds()
        counted = {"up": 0}
        original = protocol.dataReceived

        def feed(data: bytes) -> None:
            counted["up"] += len(data)
            original(data)

        self.dataReceived = feed  # type: ignore[method-assign]
        protocol.makeConnection(self.transport)
        self.factory.onTerminated(self, kind, grant, started, counted)
        pending, self.pending = self.pending, []
        for chunk in pending:
            feed(chunk)
        self.transport.resumeProducing()  # type: ignore[union-attr]
        if self.pendingEOF:
            self.readConnectionLost()

    def _splice(
        self, kind: str, grant: Grant, upstream: UpstreamProtocol, granted: Callable[[], None]
    ) -> None:
        if self.gone:
            self.awaiting = False
            upstream.transport.loseConnection()  # type: ignore[union-attr]
            self.factory.release()
            return
        self.awaiting = False
        granted()
        peer = upstream.transport.getPeer()  # type: ignore[union-attr]
        address = getattr(peer, "host", None)
        started = self.factory.reactor.seconds()

        def onClose(tunnel: Tunnel, why: str | None) -> None:
            self.factory.tunnelClosed(tunnel, kind, self.client, grant, address, why)

        tunnel = Tunnel(self.transport, upstream, onClose, self.config.proxy.idle_timeout, started)
        self.tunnel = tunnel
        self.factory.tunnels.add(tunnel)
        self.dataReceived = tunnel.fromClient  # type: ignore[method-assign]
        pending, self.pending = self.pending, []
        for chunk in pending:
            tunnel.fromClient(chunk)
        self.transport.resumeProducing()  # type: ignore[union-attr]
        if self.pendingEOF:
            tunnel.clientReadLost()
        if not tunnel.closed:
            self.factory.handOff(tunnel)

    def _dialFailed(
        self, kind: str, grant: Grant, f: Failure, refused: Callable[[Refusal], None]
    ) -> None:
        self.awaiting = False
        self.factory.release()
        r = f.value.refusal if f.check(RefusalError) else Refusal("dial", f.getErrorMessage())
        self.factory.record(
            "failed", kind=kind, client=self.client, host=grant.host, port=grant.port, reason=r.reason
        )
        if not self.gone:
            refused(r)


class EgressProxyFactory(Factory):
    """Builds front doors and owns what they share: policy, resolver, dialer, limits, audit.

    ``config`` is a Config or a ConfigHolder (live reload).  Every collaborator
    is injectable; the defaults are the system resolver, plain TCP to the
    checked address, the same-user peer check and no terminator.
    """

    log = Logger(namespace="agentsandbox.egress")
    protocol = FrontDoor  # type: ignore[assignment]

    def __init__(
        self,
        config: Config | ConfigHolder,
        reactor: Any,
        resolver: IResolver | None = None,
        dialer: Dialer | None = None,
        peers: PeerChecker | None = None,
        terminator: ITerminator | None = None,
        audit: AuditLog | None = None,
        spliceFast: bool = True,
    ) -> None:
        self.holder = asHolder(config)
        self.reactor = reactor
        self.resolver: IResolver = resolver if resolver is not None else SystemResolver(reactor)
        self.dialer: Dialer = dialer if dialer is not None else tcpDialer(reactor)
        self.peers: PeerChecker = peers if peers is not None else SameUserPeers()
        self.terminator = terminator
        self.audit = audit
        self.spliceFast = spliceFast
        self.doors: set[FrontDoor] = set()
        self.tunnels: set[Tunnel] = set()
        self.reserved = 0
        self.zeroCopied = 0
        self._sweeper: Any = None

    def buildProtocol(self, addr: Any) -> FrontDoor:
        return FrontDoor(self)

    # -------------------------------------------------------------- lifecycle
    def startFactory(self) -> None:
        self._scheduleSweep()

    def stopFactory(self) -> None:
        if self._sweeper is not None and self._sweeper.active():
            self._sweeper.cancel()
        self._sweeper = None

    def closeAll(self, why: str = "the proxy is stopping") -> None:
        for tunnel in list(self.tunnels):
            tunnel.close(why)
        for door in list(self.doors):
            if door.transport is not None:
                door.transport.abortConnection()  # type: ignore[attr-defined]

    def _scheduleSweep(self) -> None:
        interval = min(max(self.holder.current.proxy.idle_timeout / 4, 0.25), 15.0)
        self._sweeper = self.reactor.callLater(interval, self._sweep)

    def _sweep(self) -> None:
        now = self.reactor.seconds()
        for tunnel in list(self.tunnels):
            total = tunnel.up + tunnel.down
            if total != tunnel.idleMark:
                tunnel.idleMark = total
                tunnel.idleSince = now
            elif now - tunnel.idleSince >= tunnel.idleTimeout:
                tunnel.close(f"idle for {tunnel.idleTimeout:g}s (proxy.idle_timeout)")
        self._scheduleSweep()

    # -------------------------------------------------------------- audit
    def record(self, event: str, **fields: Any) -> None:
        if self.audit is not None:
            self.audit.record(event, **fields)
        elif event != "tunnel":
            self.log.info("egress: {event} {fields}", event=event, fields=fields)

    def tunnelClosed(
        self, tunnel: Tunnel, kind: str, client: str, grant: Grant, address: str | None, why: str | None
    ) -> None:
        self.tunnels.discard(tunnel)
        self.release()
        self.record(
            "tunnel",
            kind=kind,
            client=client,
            host=grant.host,
            port=grant.port,
            address=address,
            via="parent" if grant.viaParent else "direct",
            reason=why,
            up=tunnel.up,
            down=tunnel.down,
            duration=round(self.reactor.seconds() - tunnel.startedAt, 3),
        )

    def onTerminated(
        self, door: FrontDoor, kind: str, grant: Grant, started: float, counted: dict[str, int]
    ) -> None:
        def closed(_: object) -> None:
            self.release()
            self.record(
                "tunnel",
                kind=kind,
                client=door.client,
                host=grant.host,
                port=grant.port,
                via="inject",
                up=counted["up"],
                duration=round(self.reactor.seconds() - started, 3),
            )

        original = door.connectionLost

        def lost(reason: Failure = None) -> None:  # type: ignore[assignment]
            original(reason)
            closed(None)

        door.connectionLost = lost  # type: ignore[method-assign]

    def handOff(self, tunnel: Tunnel) -> None:
        """A spliced tunnel is established; a faster copier may take it over."""
        if self.spliceFast:
            from agentsandbox.egress.splice import zeroCopy

            if zeroCopy(tunnel, self.reactor):
                self.zeroCopied += 1

    # -------------------------------------------------------------- limits
    def release(self) -> None:
        self.reserved = max(0, self.reserved - 1)

    # -------------------------------------------------------------- decisions
    def decide(self, config: Config, host: str, port: int, reserve: bool = False) -> Deferred[Grant]:
        """Grant or refuse ``host:port`` under ``config`` (fails with RefusalError)."""
        allow = config.sandbox.allowList
        name = decideHost(allow, host, port)
        if not name.allowed:
            suggestion = None
            if "not on the sandbox's allow list" in name.reason:
                suggestion = suggestEntry(name.host, port)
            return fail(RefusalError(Refusal("policy", name.reason, allow=suggestion)))
        if reserve:
            if self.reserved >= config.proxy.max_tunnels:
                return fail(
                    RefusalError(
                        Refusal(
                            "limit",
                            f"{config.proxy.max_tunnels} tunnels are open, the most proxy.max_tunnels "
                            f"allows; {name.host}:{port} was not opened",
                        )
                    )
                )
            self.reserved += 1
        literal = name.literal
        if literal is not None:
            d: Deferred[Sequence[IPAddress]] = succeed([literal])
        else:
            d = self.resolver.resolve(name.host, port)

        def checked(addresses: Sequence[IPAddress]) -> Grant:
            decisions = decideAddresses(allow, name, addresses)
            ok = tuple(x.address for x in decisions if x.allowed)
            if not ok:
                first = decisions[0]
                shown = unwrapMapped(first.address)
                allowText = f"{shown}:{port}" if shown.version == 4 else f"[{shown}]:{port}"
                reason = "; ".join(x.reason for x in decisions)
                raise RefusalError(Refusal("policy", reason, allow=allowText, address=str(first.address)))
            viaParent = config.proxy.parent is not None and any(
                classifyAddress(a) is None for a in ok
            )
            return Grant(name.host, port, ok, name.entry.text if name.entry else "", viaParent)

        def unresolved(f: Failure) -> Grant:
            f.trap(ResolveError)
            if config.proxy.parent is not None:
                # Names only the organisation's resolver knows: the parent resolves them.
                return Grant(name.host, port, (), name.entry.text if name.entry else "", True)
            raise RefusalError(Refusal("resolve", f.getErrorMessage()))

        d.addCallbacks(checked, unresolved)

        def unreserve(f: Failure) -> Failure:
            if reserve:
                self.release()
            return f

        d.addErrback(unreserve)
        return d  # type: ignore[return-value]

    def connect(self, config: Config, grant: Grant, protocol: Protocol) -> Deferred[Any]:
        """Connect ``protocol`` upstream: the parent proxy, or each checked address in turn."""
        if grant.viaParent and config.proxy.parent is not None:
            from agentsandbox.egress.http import ParentHandshake

            phost, pport = parseParent(config.proxy.parent)
            endpoint = HostnameEndpoint(self.reactor, phost, pport, timeout=30)
            handshake = ParentHandshake(grant.host, grant.port, protocol)
            connectProtocol(endpoint, handshake).addErrback(handshake.failed)
            return handshake.ready

        errors: list[str] = []
        result: Deferred[Any] = Deferred()

        def attempt(i: int) -> None:
            if i >= len(grant.addresses):
                result.errback(
                    RefusalError(
                        Refusal(
                            "dial",
                            f"could not connect to {grant.host}:{grant.port} ({'; '.join(errors)})",
                        )
                    )
                )
                return
            ip = grant.addresses[i]
            try:
                endpoint = self.dialer(ip, grant.port)
                d = connectProtocol(endpoint, protocol)
            except Exception as e:
                errors.append(f"{ip}: {e}")
                attempt(i + 1)
                return

            def failed(f: Failure) -> None:
                errors.append(f"{ip}: {f.getErrorMessage()}")
                attempt(i + 1)

            d.addCallbacks(result.callback, failed)

        attempt(0)
        return result


class ProxyService(Service):
    """Listens on ``proxy.listen`` (default ``tcp:PORT:interface=127.0.0.1``) with the factory."""

    log = Logger(namespace="agentsandbox.egress")

    def __init__(self, factory: EgressProxyFactory, endpoint: str | None = None) -> None:
        self.factory = factory
        self.endpoint = endpoint
        self.port: IListeningPort | None = None
        self.listening: Deferred[IListeningPort] | None = None

    def startService(self) -> None:
        super().startService()
        description = self.endpoint or self.factory.holder.current.proxy.endpoint
        ep = serverFromString(self.factory.reactor, description)
        d = ep.listen(self.factory)

        def listening(port: IListeningPort) -> IListeningPort:
            self.port = port
            self.log.info("egress proxy listening on {where}", where=port.getHost())
            return port

        self.listening = d.addCallback(listening)

    def stopService(self) -> Deferred[None] | None:  # type: ignore[override]
        super().stopService()
        self.factory.closeAll()
        if self.port is not None:
            port, self.port = self.port, None
            return port.stopListening()  # type: ignore[return-value]
        return None
