"""The egress proxy's front door: one loopback port, SOCKS5 and HTTP, and the decisions.

Every accepted connection is first checked to come from our own Unix user
(``peer.py``), then its first byte picks the protocol: ``0x05`` is SOCKS5,
anything else HTTP (``http.py``), whose grammar refuses at once a first byte
no request can start with (a TLS ClientHello, a SOCKS4 request: 400, a
``parse`` record, closed; not left to the header timeout).  Both ask
``FrontDoor.openTunnel`` for a tunnel.  The decision is the gate's
(``gate.py``, sans IO: the name, a tunnel slot, the addresses, the parent
fallback); the door only resolves a name when the gate asks it to
(``gate.Resolve``), through the ``IResolver``.  A granted tunnel to a host the
``ITerminator`` says it ``injects`` (an inject rule, port 443) goes to it
(never dialled here), asked when the grant is made and handed over at once, so
the answer and the routes that serve it are the same; everything else is
dialled at the checked addresses in order, the next one tried when one fails,
directly or through ``proxy.parent``.  The door's ``Phase`` says which of
these it is in.

Each decision is one audit record.  The config and its gate are read from the
factory when a connection arrives (the factory swaps its gate when its
``ConfigHolder`` does), so a reload changes what new connections get and
leaves open tunnels alone, slots included.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from twisted.application.internet import StreamServerEndpointService
from twisted.application.service import MultiService, Service
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.endpoints import (
    HostnameEndpoint,
    serverFromString,
)
from twisted.internet.interfaces import (
    IHalfCloseableProtocol,
    IListeningPort,
    IProtocol,
    IReactorTime,
    IStreamServerEndpoint,
)
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from agentsandbox.allowlist import IPAddress, parseIP, unwrapMapped
from agentsandbox.audit import AuditLog
from agentsandbox.config import Config
from agentsandbox.egress.approvals import ApprovalRegistry, Outcome
from agentsandbox.egress.askers import ProcAskers
from agentsandbox.egress.dial import connectQuietly, dialInTurn, dialTunnel, tcpDialer
from agentsandbox.egress.gate import Ask, Gate, Observe, Resolve, Step, TunnelSlots, Verdict
from agentsandbox.egress.grant import Grant, Refusal, RefusalError, refusalOf
from agentsandbox.egress.http import HTTPHandler, ParentHandshake
from agentsandbox.egress.interfaces import (
    IAskers,
    ICountedTunnel,
    IDialer,
    IDoorHandler,
    IFrontDoor,
    IPeerChecker,
    IResolver,
    ITerminator,
)
from agentsandbox.egress.nodelay import noDelay
from agentsandbox.egress.peer import SameUserPeers
from agentsandbox.egress.register import DispatchRegistration
from agentsandbox.egress.resolve import ResolveError, SystemResolver
from agentsandbox.egress.sessions import SessionRegistry
from agentsandbox.egress.socks import SocksHandler
from agentsandbox.egress.splice import Tunnel, UpstreamProtocol, zeroCopy, zeroCopyAvailable
from agentsandbox.reload import ConfigHolder, asHolder

SOCKS_VERSION = 0x05

#: Bytes a tunnel moves on Twisted's copy loop before splice(2) takes it over.
ZERO_COPY_AFTER = 256 * 1024


#: Whether splice(2) can take tunnels over here (Linux, Python 3.10+).
_ZERO_COPY = zeroCopyAvailable()

#: The handler for a connection, by whether its first byte is SOCKS5's version.
#: The handlers know the door only as an ``IFrontDoor``, so nothing imports back.
HANDLERS: dict[bool, Callable[[IFrontDoor], IDoorHandler]] = {True: SocksHandler, False: HTTPHandler}


class Phase(enum.Enum):
    """Where a front door is: each phase says who reads the client's bytes.

    ``READING`` (a handler parses the request) → ``DECIDING`` (the gate, the
    resolver, the dial: the client's bytes are held) → ``SPLICED`` (a
    ``Tunnel`` copies them upstream) or ``TERMINATED`` (the ``ITerminator``'s
    protocol reads them) → ``CLOSED``.  A refused decision goes back to
    ``READING`` (the handler answers and closes); any phase may end in
    ``CLOSED``.  ``FrontDoor._become`` is the one place it changes.
    """

    READING = "reading"
    DECIDING = "deciding"
    SPLICED = "spliced"
    TERMINATED = "terminated"
    CLOSED = "closed"


def parseParent(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.port is None:
        raise ValueError(f"{url!r} is not http://HOST:PORT")
    return parts.hostname, parts.port


@implementer(IHalfCloseableProtocol, IFrontDoor)
class FrontDoor(Protocol):
    """One client connection: peer check, protocol choice, then a handler or a tunnel.

    Its ``phase`` (``Phase``) says who reads the client's bytes.  Once spliced
    or terminated, ``dataReceived`` is the reader's own bound method, set on
    the instance by ``_become``: the hot path is one attribute read and one
    call, with no phase test in between.
    """

    factory: EgressProxyFactory
    #: A TCP transport (ITCPTransport with producer and half-close methods).
    transport: Any

    def __init__(self, factory: EgressProxyFactory) -> None:
        self.factory = factory
        #: ``IFrontDoor.record``: the factory's own, bound (no second packing of the fields).
        self.record: Callable[..., None] = factory.record
        self.config: Config = factory.holder.current
        #: The gate of ``config``: the one this connection's decisions ask.
        self.gate: Gate = factory.gate
        self.phase = Phase.READING
        #: ``phase is Phase.CLOSED``, kept as a plain attribute: handlers read it per part.
        self.gone = False
        self.handler: IDoorHandler | None = None
        self.client = "?"
        #: (client address, our address) as the kernel gave them.
        self.ends: tuple[tuple[str, int], tuple[str, int]] = (("?", 0), ("?", 0))
        #: The client's bytes (and EOF) that came while ``DECIDING``, for the next reader.
        self.pending: list[bytes] = []
        self.pendingEOF = False
        self.tunnel: Tunnel | None = None
        self.terminated: IProtocol | None = None
        #: ``terminated`` when it takes half-closes (``IHalfCloseableProtocol``).
        self.halfClose: IHalfCloseableProtocol | None = None
        #: (kind, grant, when) of the terminated tunnel, for its audit record.
        self.terminatedAs: tuple[str, Grant, float] | None = None
        #: The person's answer this connection waits for (proxy.unlisted = "ask").
        self.held: Deferred[Outcome] | None = None
        self.paused = False
        self.headerDeadline: float | None = None

    # -------------------------------------------------------------- connection
    def _addresses(self) -> tuple[tuple[str, int], tuple[str, int]]:
        """(client address, our address), as the kernel gave them.

        A TCP server transport holds the address ``accept(2)`` returned, and an
        accepted socket's own address is its listener's when that listens on
        one address (not a wildcard), so the common case needs no system call.
        """
        transport = self.transport
        client = getattr(transport, "client", None)
        if type(client) is tuple:
            local = self.factory.localAddressOf(getattr(transport, "server", None))
            if local is not None:
                return (client[0], client[1]), local
        try:
            handle = self.transport.getHandle()
            peer, host = handle.getpeername(), handle.getsockname()
            return (peer[0], peer[1]), (host[0], host[1])
        except (AttributeError, OSError, TypeError, IndexError):
            p, h = self.transport.getPeer(), self.transport.getHost()
            return (getattr(p, "host", "?"), getattr(p, "port", 0)), (getattr(h, "host", "?"), getattr(h, "port", 0))

    def connectionMade(self) -> None:
        peer, host = self.ends = self._addresses()
        self.client = f"{peer[0]}:{peer[1]}"
        self.factory.sessions.connected(self.client)
        self.factory.doors.add(self)
        why = self.factory.peers.check(peer, host)
        if why is not None:
            self.factory.record("peer", client=self.client, reason=why)
            self._become(Phase.CLOSED)
            self.transport.abortConnection()
            return
        # However the socket came (bound port, socket activation, the dispatcher).
        noDelay(self.transport)
        self.armHeaderTimer()

    def armHeaderTimer(self) -> None:
        # A deadline the factory's sweep checks, not a DelayedCall per
        # connection: most heads arrive in the first segment.
        self.headerDeadline = self.factory.clock.seconds() + self.config.proxy.header_timeout

    def cancelHeaderTimer(self) -> None:
        self.headerDeadline = None

    def _headerTimeout(self) -> None:
        self.headerDeadline = None
        self.parseError(
            "http" if self.handler is None else self.handler.kind,
            f"no complete request within {self.config.proxy.header_timeout:g}s (proxy.header_timeout)",
            b"",
        )

    def _become(self, phase: Phase, receive: Callable[[bytes], None] | None = None) -> None:
        """The one place the door's phase changes.

        Spliced or terminated, ``receive`` (the tunnel's or the terminator's
        reader) takes the client's bytes from now on, straight from the
        transport: set on the instance, it shadows our ``dataReceived``.
        """
        if self.phase is Phase.CLOSED:
            return  # the last phase: nothing reopens a closed door
        self.phase = phase
        self.gone = phase is Phase.CLOSED
        if receive is not None:
            self.dataReceived = receive  # type: ignore[method-assign,assignment]

    def dataReceived(self, data: bytes) -> None:
        # READING and DECIDING only: the other phases read through ``_become``'s reader.
        if self.gone or not data:
            return
        handler = self.handler
        if handler is None:
            handler = self.handler = HANDLERS[data[0] == SOCKS_VERSION](self)
        try:
            handler.dataReceived(data)
        except Exception:
            # A parser bug must cost this one connection, never the proxy.
            self.factory.log.failure("egress: handler failed for {client}", client=self.client)
            self.parseError("internal", "the proxy failed to parse the request", b"")

    def readConnectionLost(self) -> None:
        match self.phase:
            case Phase.DECIDING:
                # The client said all it had to say before the tunnel opened (a
                # request, then EOF); the next reader gets the EOF (``_handOn``).
                self.pendingEOF = True
            case Phase.SPLICED:
                assert self.tunnel is not None
                self.tunnel.clientReadLost()
            case Phase.TERMINATED if self.halfClose is not None:
                self.halfClose.readConnectionLost()
            case Phase.READING if self.handler is not None:
                self.handler.readConnectionLost()
            case _:
                # No reader that takes a half-close: the connection ends.
                self.transport.loseConnection()

    def writeConnectionLost(self) -> None:
        if self.phase is Phase.TERMINATED and self.halfClose is not None:
            self.halfClose.writeConnectionLost()

    def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
        self._become(Phase.CLOSED)
        self.cancelHeaderTimer()
        held, self.held = self.held, None
        if held is not None:
            held.cancel()  # the registry withdraws the request: nobody waits for it any more
        self.factory.doors.discard(self)
        if self.tunnel is not None:
            self.tunnel.clientLost(reason)
        elif self.terminated is not None:
            self.terminated.connectionLost(reason)
        if self.handler is not None:
            self.handler.connectionLost(reason)
        if self.terminatedAs is not None:
            self.factory.terminatedClosed(self, self.terminatedAs)

    # -------------------------------------------------------------- IFrontDoor: for handlers
    def logFailure(self, why: str, failure: Failure) -> None:
        self.factory.log.failure("egress: {why} for {client}", failure, why=why, client=self.client)

    def connect(self, grant: Grant, protocol: Protocol) -> Deferred[Any]:
        return self.factory.connect(self.config, grant, protocol)

    def sessionRefusal(self, kind: str, password: bytes | None) -> str | None:
        """Attribute this connection to the session whose credential ``password`` is
        (``egress/sessions.py``); why it is refused when none is and
        ``proxy.require_session`` is set (then audited), else None."""
        if self.factory.sessions.attribute(self.client, password) is not None or not self.config.proxy.require_session:
            return None
        why = (
            "refused: this request carries no session credential the proxy knows, and proxy.require_session "
            "is true (start the command from a Claude Code session or `agentsandbox run`)"
        )
        self.factory.record("refused", kind=kind, client=self.client, reason=why)
        return why

    def parseError(self, kind: str, why: str, answer: bytes) -> None:
        """A request the proxy cannot serve: audit it, answer, close."""
        self.factory.record("parse", kind=kind, client=self.client, reason=why)
        if answer:
            self.transport.write(answer)
        self.transport.loseConnection()
        self._become(Phase.CLOSED)

    def buffered(self, data: bytes) -> None:
        """Bytes the client sent after its request, before the tunnel opened."""
        if data:
            self.pending.append(data)
            if sum(map(len, self.pending)) > 256 * 1024 and not self.paused:
                self.paused = True
                self.transport.pauseProducing()

    def resumeIfPaused(self) -> None:
        # Only undo our own pause: resuming a transport that already saw EOF
        # would read that EOF a second time.
        if self.paused:
            self.paused = False
            self.transport.resumeProducing()

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
        self._become(Phase.DECIDING)
        factory = self.factory

        def onGrant(grant: Grant) -> None:
            if self.gone:
                factory.release()
                return
            # One question, asked of the terminator that will serve the
            # tunnel, now: a reload between the connection's arrival and its
            # grant cannot make the two disagree.
            terminator = factory.terminator
            if terminator is not None:
                if terminator.injects(grant.host, grant.port):
                    self._terminate(kind, grant, terminator, granted)
                    return
            elif grant.port == 443 and self.config.injectFor(grant.host) is not None:
                self._noTerminator(kind, grant, refused)
                return

            def connected(upstream: UpstreamProtocol) -> None:
                try:
                    self._splice(kind, grant, upstream, granted)
                except Exception:
                    self._bug(Failure())

            def failed(f: Failure) -> None:
                try:
                    self._dialFailed(kind, grant, f, refused)
                except Exception:
                    self._bug(Failure())

            factory.connectTunnel(self.config, grant, UpstreamProtocol(), connected, failed)

        def onVerdict(verdict: Verdict) -> None:
            if isinstance(verdict, Grant):
                onGrant(verdict)
                return
            if not self.gone:
                self._become(Phase.READING)
            factory.record(
                "refused",
                kind=kind,
                client=self.client,
                host=host,
                port=port,
                reason=verdict.reason,
                allow=verdict.allow,
                address=verdict.address,
            )
            if not self.gone:
                refused(verdict)

        self.decide(host, port, True, onVerdict, kind)

    def decide(
        self, host: str, port: int, reserve: bool, then: Callable[[Verdict], None], kind: str = "forward"
    ) -> None:
        """Ask this connection's gate about ``host:port``; ``then`` gets the verdict,
        at once (no DNS needed) or once the name has resolved (the only Deferred
        of a decision: the resolver's), or once the person has answered for an
        unlisted host (``proxy.unlisted = "ask"``: ``_ask``)."""
        gate = self.gate
        try:
            step = gate.decide(host, port, reserve)
            if isinstance(step, Ask):
                self._ask(step, kind, then)
                return
            if isinstance(step, Observe):
                self._observe(step, kind)
                step = gate.observed(step)
        except Exception:
            self._bug(Failure())
            return
        self._step(step, then)

    def _step(self, step: Step, then: Callable[[Verdict], None]) -> None:
        if not isinstance(step, Resolve):
            if isinstance(step, Ask):  # (an approved step never asks again)
                step = step.refusal(step.name.reason)
            elif isinstance(step, Observe):  # (nor is an observed one observed again)
                step = Refusal("policy", step.name.reason, allow=step.name.allow)
            then(step)
            return
        gate = self.gate

        def resolved(addresses: Sequence[IPAddress]) -> None:
            then(gate.resolved(step, addresses))

        def unresolved(f: Failure) -> None:
            if f.check(ResolveError):
                then(gate.unresolved(step, f.getErrorMessage()))
                return
            gate.abandon(step)
            self._bug(f)

        self.factory.resolver.resolve(step.host, step.port).addCallbacks(resolved, unresolved).addErrback(self._bug)

    def _observe(self, observe: Observe, kind: str) -> None:
        """``proxy.unlisted = "observe"``: an unlisted host goes on, recorded as
        "would refuse" (the reason and the entry that would list it, which
        ``agentsandbox suggest`` reads) and told to ``watch``."""
        self.factory.record(
            "observed", kind=kind, client=self.client, host=observe.host, port=observe.port,
            reason=observe.name.reason, allow=observe.name.allow,
        )  # fmt: skip
        registry = self.factory.approvals
        if registry is not None:
            registry.observed(observe.host, observe.port, kind)

    def _ask(self, ask: Ask, kind: str, then: Callable[[Verdict], None]) -> None:
        """Hold an unlisted host for the person (``egress/approvals.py``): nothing is
        resolved or dialled before the answer.  Issue 28's one place in the door:
        the gate said ``Ask``; the registry's Outcome makes it a verdict."""
        registry = self.factory.approvals
        if registry is None:
            # No one to ask (a bare proxy, the dispatcher's door): not listed is refused.
            then(ask.refusal(ask.name.reason))
            return
        session = self.factory.sessions.of(self.client)

        def answered(outcome: Outcome) -> None:
            self.held = None
            if self.gone:
                return
            if not outcome.allowed:
                then(ask.refusal(outcome.text))
                return
            self._step(self.gate.approved(ask), then)

        def asking(holder: str | None) -> None:
            # The person sees what asks (egress/askers.py); a client gone
            # meanwhile is asked about no more.
            if self.gone:
                return
            process = ", ".join(p for p in (holder, None if session is None else f"session {session}") if p)
            held = self.held = registry.ask(ask.host, ask.port, kind, self.client, process or None)
            held.addCallbacks(answered, lambda f: f.trap(CancelledError)).addErrback(self._bug)

        self.factory.askers.find(*self.ends).addCallback(asking).addErrback(self._bug)

    def _bug(self, f: Failure) -> None:
        self.factory.log.failure("egress: tunnel setup failed for {client}", f, client=self.client)
        if not self.gone:
            self.transport.abortConnection()

    def _noTerminator(self, kind: str, grant: Grant, refused: Callable[[Refusal], None]) -> None:
        # A factory built without a terminator (a bare proxy) fails closed on
        # the hosts its config injects rather than opening them without the credential.
        self.factory.release()
        self._become(Phase.READING)
        r = Refusal(
            "inject",
            f"{grant.host}:443 has an inject rule ([[inject]] hosts), but this proxy runs without "
            "the TLS terminator that injects it, so the tunnel is refused rather than opened "
            "without the credential",
        )
        self.factory.record("refused", kind=kind, client=self.client, host=grant.host, port=443, reason=r.reason)
        refused(r)

    def _terminate(
        self, kind: str, grant: Grant, terminator: ITerminator, granted: Callable[[], None]
    ) -> None:
        granted()
        protocol = terminator.terminate(grant.host, grant.addresses)
        self.terminated = protocol
        if IHalfCloseableProtocol.providedBy(protocol):
            self.halfClose = protocol
        self.terminatedAs = (kind, grant, self.factory.clock.seconds())
        self._become(Phase.TERMINATED, protocol.dataReceived)
        protocol.makeConnection(self.transport)
        self._handOn(protocol.dataReceived, self.readConnectionLost)

    def _handOn(self, receive: Callable[[bytes], None], readLost: Callable[[], None]) -> None:
        """Give the granted connection's new reader what came while the grant
        was decided, then the client's EOF if it came too, and read again."""
        pending, self.pending = self.pending, []
        for chunk in pending:
            receive(chunk)
        self.resumeIfPaused()
        if self.pendingEOF:
            readLost()

    def _splice(
        self, kind: str, grant: Grant, upstream: UpstreamProtocol, granted: Callable[[], None]
    ) -> None:
        if self.gone:
            upstream.transport.loseConnection()
            self.factory.release()
            return
        granted()
        if grant.shown is not None:
            address: str | None = grant.shown
        else:
            address = getattr(upstream.transport.getPeer(), "host", None)
        started = self.factory.clock.seconds()

        def onClose(tunnel: Tunnel, why: str | None) -> None:
            self.factory.tunnelClosed(tunnel, kind, self.client, grant, address, why)

        tunnel = Tunnel(self.transport, upstream, onClose, self.config.proxy.idle_timeout, started)
        self.tunnel = tunnel
        self.factory.tunnels.add(tunnel)
        self._become(Phase.SPLICED, tunnel.fromClient)
        self._handOn(tunnel.fromClient, tunnel.clientReadLost)
        if not tunnel.closed:
            self.factory.handOff(tunnel)

    def _dialFailed(
        self, kind: str, grant: Grant, f: Failure, refused: Callable[[Refusal], None]
    ) -> None:
        if not self.gone:
            self._become(Phase.READING)
        self.factory.release()
        r = refusalOf(f) if f.check(RefusalError) else Refusal("dial", f.getErrorMessage())
        self.factory.record(
            "failed", kind=kind, client=self.client, host=grant.host, port=grant.port, reason=r.reason
        )
        if not self.gone:
            refused(r)


class EgressProxyFactory(Factory):
    """Builds front doors and owns what they share: policy, resolver, dialer, limits, audit.

    ``config`` is a Config or a ConfigHolder (live reload).  Every collaborator
    is injectable; the defaults are the system resolver, plain TCP to the
    checked address, the same-user peer check and no terminator.  ``clock``
    (default: the reactor) times the header deadline, idle tunnels and the
    durations in the audit log, so a test can advance a ``task.Clock`` past a
    timeout while the sockets stay real.
    """

    log = Logger(namespace="agentsandbox.egress")
    protocol = FrontDoor  # type: ignore[assignment]
    #: No "Starting factory <...>" lines: the service says where it listens itself.
    noisy = False

    def __init__(
        self,
        config: Config | ConfigHolder,
        reactor: Any,
        resolver: IResolver | None = None,
        dialer: IDialer | None = None,
        peers: IPeerChecker | None = None,
        terminator: ITerminator | None = None,
        audit: AuditLog | None = None,
        spliceFast: bool = True,
        zeroCopyAfter: int = ZERO_COPY_AFTER,
        clock: IReactorTime | None = None,
        askers: IAskers | None = None,
    ) -> None:
        self.holder = asHolder(config)
        self.zeroCopyAfter = zeroCopyAfter
        self.reactor = reactor
        self.clock: IReactorTime = clock if clock is not None else reactor
        self.resolver: IResolver = resolver if resolver is not None else SystemResolver(reactor)
        self.dialer: IDialer = dialer if dialer is not None else tcpDialer(reactor)
        self.peers: IPeerChecker = peers if peers is not None else SameUserPeers()
        #: What process asks, for a request held for the person (proxy.unlisted = "ask").
        self.askers: IAskers = askers if askers is not None else ProcAskers(reactor)
        self.terminator = terminator
        self.audit = audit
        self.spliceFast = spliceFast
        self.doors: set[FrontDoor] = set()
        self.tunnels: set[Tunnel] = set()
        self.zeroCopied = 0
        self._sweeper: Any = None
        self.slots = TunnelSlots()
        #: The decisions of the config in force: the gate a new connection asks.
        self.gate = Gate.ofConfig(self.holder.current, self.slots)
        self.holder.subscribe(self._configSwapped)
        self._localAddresses: dict[Any, tuple[str, int] | None] = {}
        #: Per-session credentials: the session of each client address (the service shares its own).
        self.sessions = SessionRegistry()
        #: Where unlisted hosts are held for the person under proxy.unlisted = "ask"
        #: (egress/approvals.py); None: asking is not wired, and such hosts are refused.
        self.approvals: ApprovalRegistry | None = None

    def buildProtocol(self, addr: Any) -> FrontDoor:  # type: ignore[override]
        return FrontDoor(self)

    def localAddressOf(self, port: Any) -> tuple[str, int] | None:
        """The address every connection accepted by ``port`` has; None when the
        port listens on a wildcard address (or is not a listening TCP port)."""
        known = self._localAddresses.get(port, False)
        if known is not False:
            return known  # type: ignore[return-value]
        found: tuple[str, int] | None = None
        try:
            host = port.getHost()
            text, number = host.host, host.port
        except AttributeError:
            pass
        else:
            ip = parseIP(text) if isinstance(text, str) else None
            if ip is not None and not ip.is_unspecified and unwrapMapped(ip) == ip and isinstance(number, int):
                found = (text, number)
        if port is not None:
            self._localAddresses[port] = found
        return found

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
                door.transport.abortConnection()

    def _scheduleSweep(self) -> None:
        proxy = self.holder.current.proxy
        interval = min(max(min(proxy.idle_timeout, proxy.header_timeout) / 4, 0.05), 15.0)
        self._sweeper = self.clock.callLater(interval, self._sweep)

    def _sweep(self) -> None:
        """Close connections past their header deadline and tunnels idle too long."""
        now = self.clock.seconds()
        for door in list(self.doors):
            deadline = door.headerDeadline
            if deadline is not None and now >= deadline and not door.gone:
                door._headerTimeout()
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
        session = self.sessions.of(fields.get("client"))
        if session is not None:
            fields["session"] = session
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
            duration=round(self.clock.seconds() - tunnel.startedAt, 3),
        )

    def terminatedClosed(self, door: FrontDoor, terminatedAs: tuple[str, Grant, float]) -> None:
        """A terminated tunnel's client connection ended: its slot is free, its record written."""
        kind, grant, started = terminatedAs
        self.release()
        # The bytes on the client's connection, counted by the terminator's
        # protocol where it reads and writes them (None when it does not count).
        counts = ICountedTunnel(door.terminated, None)
        self.record(
            "tunnel",
            kind=kind,
            client=door.client,
            host=grant.host,
            port=grant.port,
            via="inject",
            up=None if counts is None else counts.received,
            down=None if counts is None else counts.sent,
            duration=round(self.clock.seconds() - started, 3),
        )

    def handOff(self, tunnel: Tunnel) -> None:
        """A spliced tunnel is established; splice(2) takes it over once it carries volume.

        Short tunnels (a request, an answer) never pay for two pipes; a tunnel
        that has moved ``zeroCopyAfter`` bytes on the copy loop is handed to
        the kernel from then on.
        """
        if self.spliceFast and _ZERO_COPY:
            # A reactor turn, not a time: the hand-over must not wait for a test's clock.
            tunnel.onVolume(self.zeroCopyAfter, self._zeroCopy, self.reactor)

    def _zeroCopy(self, tunnel: Tunnel) -> None:
        if zeroCopy(tunnel, self.reactor):
            self.zeroCopied += 1

    # -------------------------------------------------------------- the gate
    def _configSwapped(self, old: Config, new: Config) -> None:
        # One gate per config; the slots go on to the new one, so open tunnels
        # keep theirs and give them back to whichever gate is current.
        self.gate = Gate.ofConfig(new, self.slots)

    @property
    def reserved(self) -> int:
        """Tunnel slots in use (``proxy.max_tunnels``), across reloads."""
        return self.slots.inUse

    def release(self) -> None:
        self.gate.release()

    def connectTunnel(
        self,
        config: Config,
        grant: Grant,
        protocol: UpstreamProtocol,
        connected: Callable[[UpstreamProtocol], None],
        failed: Callable[[Failure], None],
    ) -> None:
        """``connect`` for a tunnel, reporting through callbacks (``dial.dialTunnel``);
        ``failed`` gets a RefusalError either way."""
        if grant.viaParent and config.proxy.parent is not None:
            self.connect(config, grant, protocol).addCallbacks(connected, failed)
            return
        dialTunnel(self.dialer, grant.host, grant.port, grant.addresses, protocol, connected, failed)

    def connect(self, config: Config, grant: Grant, protocol: Protocol) -> Deferred[Any]:
        """Connect ``protocol`` upstream: the parent proxy, or each checked address in turn."""
        if grant.viaParent and config.proxy.parent is not None:
            phost, pport = parseParent(config.proxy.parent)
            endpoint = HostnameEndpoint(self.reactor, phost, pport, timeout=30)
            handshake = ParentHandshake(grant.host, grant.port, protocol)
            connectQuietly(endpoint, handshake).addErrback(handshake.failed)
            return handshake.ready
        return dialInTurn(self.dialer, grant.host, grant.port, grant.addresses, lambda _: protocol)


def hostPort(address: Any) -> str:
    """A Twisted address as people write it: ``127.0.0.1:3190``, ``[::1]:3190``."""
    host, port = getattr(address, "host", None), getattr(address, "port", None)
    if not isinstance(host, str) or not isinstance(port, int):
        return str(address)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@implementer(IStreamServerEndpoint)
class _Announcing:
    """An endpoint that tells ``ProxyService`` its port, or why there is none.

    ``StreamServerEndpointService`` keeps the listen Deferred to itself (and
    logs a failure as a traceback); through this the service's ``listening``
    carries the port or the failure, said once by whoever runs the service.
    """

    def __init__(self, endpoint: IStreamServerEndpoint, listened: Callable[[IListeningPort], None], failed: Callable[[Failure], None]) -> None:
        self.endpoint = endpoint
        self.listened = listened
        self.failed = failed

    def listen(self, factory: Any) -> Deferred[Any]:
        def listened(port: IListeningPort) -> IListeningPort:
            self.listened(port)
            return port

        def failed(failure: Failure) -> None:
            # Handled here: the service's ``listening`` carries it.
            self.failed(failure)

        d: Deferred[Any] = self.endpoint.listen(factory)
        return d.addCallbacks(listened, failed)


class ProxyService(MultiService):
    """Listens on ``proxy.listen`` (default ``tcp:PORT:interface=127.0.0.1``) with the factory,
    or, when the system dispatcher's registration socket ``dispatchSocket`` exists
    (and ``proxy.listen`` is not set), registers there and serves the connections
    it hands over (``register.py``) instead of binding the port.

    Which one is decided at each start, and is this service's one child: a
    ``StreamServerEndpointService`` or a ``DispatchRegistration``."""

    log = Logger(namespace="agentsandbox.egress")

    def __init__(
        self,
        factory: EgressProxyFactory,
        endpoint: str | None = None,
        dispatchSocket: str | None = None,
        awaitDispatcher: str | None = None,
    ) -> None:
        super().__init__()
        self.factory = factory
        self.endpoint = endpoint
        self.dispatchSocket = dispatchSocket
        #: On a package machine (``machine.Machine.package``): why the service waits for the
        #: dispatcher when its socket is missing, and how the admin starts it.  The shared
        #: port is the dispatcher's there; a service that bound it would keep the dispatcher
        #: (and every other user) out.
        self.awaitDispatcher = awaitDispatcher
        self.port: IListeningPort | None = None
        #: The registration with the dispatcher, when the service uses one.
        self.registration: DispatchRegistration | None = None
        #: Fires with the listening port, or the registration once first registered.
        self.listening: Deferred[Any] | None = None
        #: This start's child: the listening service or the registration.
        self._connections: Service | None = None

    def _configChanged(self, old: Config, new: Config) -> None:
        if self.endpoint is None and old.proxy.endpoint != new.proxy.endpoint:
            self.log.warn(
                "{source}: proxy.listen/proxy.port changed to {new}; the proxy keeps listening "
                "on {old} until agentsandbox restarts (systemctl --user restart agentsandbox)",
                source=new.source,
                new=new.proxy.endpoint,
                old=old.proxy.endpoint,
            )

    def usesDispatcher(self) -> bool:
        """Whether this start registers with the dispatcher rather than binding the port."""
        config = self.factory.holder.current
        path = self.dispatchSocket
        if self.endpoint is not None or config.proxy.listen is not None or path is None:
            return False
        return os.path.exists(path) or self.awaitDispatcher is not None

    def privilegedStartService(self) -> None:
        # Nothing binds before startService: the service checks its layout
        # first (``AgentSandbox.startService``), and the child is chosen there.
        Service.privilegedStartService(self)

    def startService(self) -> None:
        if self._connections is not None:
            # The last start's child; this start decides again.
            self.removeService(self._connections)
        self.listening = Deferred()
        self._connections = self._registration(self.listening) if self.usesDispatcher() else self._listener(self.listening)
        self.addService(self._connections)
        self.factory.holder.subscribe(self._configChanged)
        super().startService()

    def _listener(self, first: Deferred[Any]) -> Service:
        description = self.endpoint or self.factory.holder.current.proxy.endpoint

        def listened(port: IListeningPort) -> None:
            self.port = port
            self.log.info("egress proxy listening on {where}", where=self.address)
            first.callback(port)

        endpoint = _Announcing(serverFromString(self.factory.reactor, description), listened, first.errback)
        return StreamServerEndpointService(endpoint, self.factory)

    @property
    def address(self) -> str | None:
        """Where the proxy listens, as ``HOST:PORT`` (``[V6]:PORT``); None while it does not."""
        if self.port is None:
            return None
        return hostPort(self.port.getHost())

    def _registration(self, first: Deferred[Any]) -> Service:
        assert self.dispatchSocket is not None

        def registered(registration: Any) -> None:
            if not first.called:
                first.callback(registration)

        self.registration = DispatchRegistration(
            self.factory, self.dispatchSocket, self.factory.reactor, onRegistered=registered
        )
        if os.path.exists(self.dispatchSocket) or self.awaitDispatcher is None:
            self.log.info("egress proxy: registering with the dispatcher on {path} instead of binding the port", path=self.dispatchSocket)
        else:
            self.log.warn(
                "egress proxy: no dispatcher on {path} yet; {why}; the service waits for it and "
                "registers when it starts (it serves nothing meanwhile)",
                path=self.dispatchSocket, why=self.awaitDispatcher,
            )  # fmt: skip
        return self.registration

    def figures(self) -> dict[str, Any]:
        """How the proxy gets its connections, for ``status``."""
        if self.registration is not None:
            return {"mode": "dispatcher", "listening": None, "dispatcher": self.registration.figures()}
        return {"mode": "direct", "listening": self.address}

    def stopService(self) -> Deferred[Any]:
        self.factory.holder.unsubscribe(self._configChanged)
        self.factory.closeAll()
        stopped: Deferred[Any] = super().stopService()
        self.registration = None
        self.port = None
        return stopped
