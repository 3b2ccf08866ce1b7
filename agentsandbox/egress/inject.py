"""TLS termination and header injection for the hosts that have an inject rule.

The proxy grants a tunnel to ``host:443`` and, when ``Injector.injects`` says
the host has a route now, hands the client's connection to
``Injector.terminate`` in the same breath.  The routes (and the CA made for
their hosts) are ``InjectionService``'s to swap on reload (``injection.py``).
From there:

1. The client gets our TLS: the host's leaf from the in-memory CA, whatever
   SNI it sent, ALPN ``http/1.1`` only (``tls.py``).
2. Each request head is checked with the house's one HTTP/1.1 grammar
   (``http11.py``, which the plain ``http://`` path uses too): RFC 9112 in one
   regular-expression pass, with the framing refusals h11 is lenient about.
   A refused head forwards nothing; chunked bodies are checked chunk by chunk
   and nothing of a pass over received bytes is forwarded unless all of it
   parsed.
3. Each request goes to the tunnel host whatever its ``Host`` header or
   absolute-form target says; every client ``Authorization`` (and the rule's
   own header) is removed, hop-by-hop headers (``http11.HOP_BY_HOP``, every
   ``Proxy-*`` and those ``Connection`` names) are dropped, the rule's header
   is set from the keeper's current token.  TRACE and CONNECT get 405.
   ``Upgrade`` passes only for websocket.
4. Upstream is a verified TLS connection (system roots, service-identity) to
   one of the addresses the proxy checked, kept alive and reused: a client
   connection holds one upstream connection for its life and returns it to a
   small per-host pool when it closes.
5. Response heads are parsed; bodies pass through framed by their
   Content-Length (counted) or chunking (checked per chunk and re-framed),
   each side pausing the other's reads when its send buffer fills, so a large
   push never sits in memory.  A response that lies about its length cuts the
   client's connection; bytes nobody asked for end the upstream connection.

The per-request path is deliberately lean (one parse per head, one write per
direction per pass, no per-event state machine): issue 4 asks for 20 times
mitmproxy's keep-alive rate, see ``bench/inject.py``.

Nothing here logs a header, a body or a token.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from service_identity import VerificationError
from twisted.internet import defer
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import (
    IDelayedCall,
    IHandshakeListener,
    IProtocol,
    IPushProducer,
    IReactorTime,
)
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from agentsandbox.config import InjectRule
from agentsandbox.egress.dial import dialInTurn
from agentsandbox.egress.grant import RefusalError, refusalOf
from agentsandbox.egress.http11 import (
    HOP_BY_HOP,
    ONE_HOST,
    Body,
    Refused,
    UntilClose,
    connectionTokens,
    forwardedLines,
    requestBody,
    responseBody,
    takeRequestHead,
    takeResponseHead,
)
from agentsandbox.egress.interfaces import IDialer, ITerminator, ITokenHolder
from agentsandbox.egress.rules import IPAddress
from agentsandbox.egress.tls import InjectionCA, upstreamContext, verifyUpstream
from agentsandbox.egress.tlsstream import TLSHandshakeError, TLSStream

log = Logger(namespace="agentsandbox.egress.inject")

HTTPS_PORT = 443

#: Request fields never forwarded from a terminated tunnel: the one hop-by-hop
#: table, plus Host (set to the tunnel's host) and every client Authorization
#: (the rule's header is set instead).
_NOT_FORWARDED = HOP_BY_HOP | {b"host", b"authorization"}
_REFUSED_METHODS = frozenset({b"TRACE", b"CONNECT"})

#: A pipelining client may not run further ahead than this while we answer.
MAX_READ_AHEAD = 256 * 1024


@dataclass
class Route:
    """An injected host: its rule and where its token comes from."""

    host: str
    rule: InjectRule
    keeper: ITokenHolder
    headerName: bytes = field(init=False)
    headerPrefix: bytes = field(init=False)
    hostLine: bytes = field(init=False)
    _lastToken: str | None = field(default=None, init=False)
    _lastValue: bytes = field(default=b"", init=False)
    _warned: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.headerName = self.rule.header.lower().encode("ascii")
        self.headerPrefix = self.headerName + b": "
        self.hostLine = b"host: " + self.host.encode("ascii") + b"\r\n"

    def headerValue(self) -> bytes | None:
        """The header value for the current token; None (and one warning) without one."""
        token = self.keeper.token()
        if token is None:
            if not self._warned:
                self._warned = True
                log.warn(
                    "egress: no token yet for {host} ({source}); its requests go out "
                    "without {header} until the token keeper has one",
                    host=self.host,
                    source=self.rule.token.describe(),
                    header=self.rule.header,
                )
            return None
        if token is not self._lastToken:
            self._lastValue = self.rule.render(token).encode("ascii")
            self._lastToken = token
            self._warned = False
        return self._lastValue


def routesFor(
    rules: Sequence[InjectRule], keeperFor: Callable[[InjectRule], ITokenHolder]
) -> dict[str, Route]:
    """host -> Route for every host of every rule."""
    routes: dict[str, Route] = {}
    for rule in rules:
        keeper = keeperFor(rule)
        for host in rule.hosts:
            routes[host] = Route(host, rule, keeper)
    return routes


@implementer(ITerminator)
class Injector:
    """Terminates tunnels to injected hosts and forwards their requests with the token.

    ``dialer`` reaches a checked address (the proxy's, or a test's that maps
    addresses to loopback); ``upstreamTrust`` is the upstream trust in PEM (the
    system's roots when None; tests pass their own CA here, never through
    config).  ``ca`` is None while no host is injected (``injects`` then says
    no to every host); ``swap`` takes new routes and their CA on reload.
    ``clock`` (default: ``reactor``) times the tunnel's idle timeout and the
    upstream's handshake and pool timeouts; the dials go through ``dialer``, so
    a test may hand in a ``task.Clock`` and keep real sockets.
    """

    def __init__(
        self,
        ca: InjectionCA | None,
        routes: Mapping[str, Route],
        dialer: IDialer,
        reactor: IReactorTime,
        upstreamTrust: bytes | None = None,
        idleTimeout: float = 300.0,
        upstreamIdleTimeout: float = 60.0,
        handshakeTimeout: float = 30.0,
        poolSize: int = 8,
        clock: IReactorTime | None = None,
    ) -> None:
        self.clock: IReactorTime = clock if clock is not None else reactor
        self._dialer = dialer
        self._upstreamTrust = upstreamTrust
        # Made at the first dial: loading the system roots costs a few MB.
        self._upstreamContext: ssl.SSLContext | None = None
        self.idleTimeout = idleTimeout
        self.upstreamIdleTimeout = upstreamIdleTimeout
        self.handshakeTimeout = handshakeTimeout
        self.poolSize = poolSize
        #: Requests sent upstream with the rule's header set, for ``status``.
        self.injectedRequests = 0
        self._idle: dict[str, list[_Upstream]] = {}
        #: Whether released upstreams go back to the pool; ``closeIdle`` ends it
        #: (a tunnel closed by the stopping proxy must not refill the pool).
        self.pooling = True
        self.ca = ca
        self.routes: Mapping[str, Route] = {}
        self.swap(ca, routes)

    # ------------------------------------------------------------------ config

    def swap(self, ca: InjectionCA | None, routes: Mapping[str, Route]) -> None:
        """Take new rules (and the CA made for their hosts); open tunnels keep theirs."""
        constrained = set(ca.hosts) if ca is not None else set()
        if not set(routes) <= constrained:
            missing = sorted(set(routes) - constrained)
            raise ValueError(f"the CA is not constrained to {', '.join(missing)}")
        self.ca = ca
        self.routes = dict(routes)

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(self.routes)

    # ------------------------------------------------------------------ ITerminator

    def injects(self, host: str, port: int) -> bool:
        """Whether a tunnel to ``host:port`` is terminated here: the routes in force now, port 443."""
        return port == HTTPS_PORT and host in self.routes

    def terminate(self, host: str, addresses: Sequence[IPAddress]) -> IProtocol:
        route = self.routes.get(host)
        if route is None or self.ca is None:
            raise KeyError(f"{host} has no inject rule")
        tunnel = _Tunnel(self, route, tuple(addresses))
        return TLSStream(self.ca.serverContext(host), tunnel, serverSide=True)

    # ------------------------------------------------------------------ upstream pool

    def _acquire(self, host: str, addresses: tuple[IPAddress, ...]) -> defer.Deferred[_Upstream]:
        idle = self._idle.get(host)
        while idle:
            upstream = idle.pop()
            if upstream.reusable() and upstream.address in addresses:
                upstream.leaveIdle()
                return defer.succeed(upstream)
            upstream.close()
        return self._dial(host, addresses)

    def _dial(self, host: str, addresses: tuple[IPAddress, ...]) -> defer.Deferred[_Upstream]:
        if self._upstreamContext is None:
            self._upstreamContext = upstreamContext(self._upstreamTrust)
        context = self._upstreamContext

        def streamTo(address: IPAddress) -> TLSStream:
            upstream = _Upstream(self, host, address)
            return TLSStream(context, upstream, serverSide=False, serverHostname=host, verify=verifyUpstream(host))

        def upstreamOf(tls: TLSStream) -> _Upstream:
            upstream = tls.wrapped
            assert isinstance(upstream, _Upstream)
            return upstream

        return dialInTurn(self._dialer, host, HTTPS_PORT, addresses, streamTo).addCallback(upstreamOf)

    def _release(self, upstream: _Upstream) -> None:
        idle = self._idle.setdefault(upstream.host, [])
        if self.pooling and upstream.reusable() and len(idle) < self.poolSize:
            idle.append(upstream)
            upstream.enterIdle(self.upstreamIdleTimeout)
        else:
            upstream.close()

    def _forget(self, upstream: _Upstream) -> None:
        idle = self._idle.get(upstream.host)
        if idle and upstream in idle:
            idle.remove(upstream)

    def closeIdle(self) -> defer.Deferred[None]:
        """Close every pooled upstream connection and pool no more (at service stop,
        until ``pooling`` is set again); fires when they are gone."""
        self.pooling = False
        closing = []
        for idle in self._idle.values():
            for upstream in list(idle):
                closing.append(upstream.whenLost())
                upstream.close()
        self._idle.clear()
        return defer.gatherResults(closing).addCallback(lambda _: None)


_CLOSED = Failure(ConnectionError("connection closed"))  # type: ignore[no-untyped-call,unused-ignore]


def _lostWhy(reason: Failure) -> str:
    """A short, token-free account of why an upstream connection ended."""
    value = reason.value
    if isinstance(value, ssl.SSLCertVerificationError):
        return f"TLS failed: the certificate was refused ({value.verify_message})"
    if isinstance(value, ssl.SSLError):
        what = value.reason or value.strerror or type(value).__name__
        return f"TLS failed: {what.replace('_', ' ').lower()}"
    if isinstance(value, TLSHandshakeError):
        return f"TLS failed: {value}"
    if isinstance(value, VerificationError):
        return f"TLS failed: the certificate does not name the host ({value})"
    return reason.getErrorMessage() or type(value).__name__


@implementer(IPushProducer)
class _Pauser:
    """Lets one side's send buffer pause the other side's reads."""

    def __init__(self, pause: Callable[[], None], resume: Callable[[], None]) -> None:
        self.pauseProducing = pause
        self.resumeProducing = resume

    def stopProducing(self) -> None:
        pass


class _Reads:
    """Pauses a transport's reads for any of several reasons at once."""

    def __init__(self) -> None:
        self.transport: Any = None
        self._reasons = 0

    def pause(self, reason: int) -> None:
        if not self._reasons and self.transport is not None:
            self.transport.pauseProducing()
        self._reasons |= reason

    def resume(self, reason: int) -> None:
        if not self._reasons & reason:
            return
        self._reasons &= ~reason
        if not self._reasons and self.transport is not None:
            self.transport.resumeProducing()


_BY_PEER = 1  # the other side's send buffer is full
_BY_DIAL = 2  # no upstream yet
_BY_AHEAD = 4  # a pipelining client ran ahead


class _Tunnel(Protocol):
    """The client's side: decrypted HTTP/1.1 from one terminated tunnel.

    One request is in flight at a time: a pipelining client's next head waits
    in ``_buf`` until the response to the current one is done.
    """

    def __init__(self, injector: Injector, route: Route, addresses: tuple[IPAddress, ...]) -> None:
        self._injector = injector
        self._route = route
        self._host = route.host
        self._hostBytes = route.host.encode("ascii")
        self._addresses = addresses
        self._clock = injector.clock
        self._buf = bytearray()
        self._reads = _Reads()
        self._upstream: _Upstream | None = None
        self._queued: list[bytes] = []
        self._dialing = False
        self._method: bytes | None = None  # of a head not yet handed to an upstream
        self._forwarded = False  # some of the current request went upstream
        self._body: Body | None = None  # the current request's, while it is read
        self._requestDone = True
        self._responseDone = True
        self._responseStarted = False
        self._closeAfter = False
        self._upgrading = False
        self._switched = False
        self._closed = False
        self._gone = False
        self._lastActivity = 0.0
        self._timer: IDelayedCall | None = None
        self.pauser = _Pauser(lambda: self._reads.pause(_BY_PEER), lambda: self._reads.resume(_BY_PEER))

    # ------------------------------------------------------------------ connection

    def connectionMade(self) -> None:
        self._reads.transport = self.transport
        self._lastActivity = self._clock.seconds()
        self._timer = self._clock.callLater(self._injector.idleTimeout, self._checkIdle)

    def _checkIdle(self) -> None:
        idle = self._clock.seconds() - self._lastActivity
        timeout = self._injector.idleTimeout
        if idle >= timeout and self._requestDone and self._responseDone:
            self._timer = None
            self._close()
        else:
            self._timer = self._clock.callLater(max(timeout - idle, 1.0), self._checkIdle)

    def connectionLost(self, reason: Failure = _CLOSED) -> None:
        self._closed = True
        self._gone = True
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        self._letGoOfUpstream()

    # ------------------------------------------------------------------ client bytes

    def dataReceived(self, data: bytes) -> None:
        self._lastActivity = self._clock.seconds()
        if self._switched:
            if self._upstream is not None:
                self._upstream.transport.write(data)  # type: ignore[union-attr]
            return
        self._buf += data
        self._parse()

    def _parse(self) -> None:
        # Nothing of one pass over the received bytes goes upstream until all
        # of it parsed, so a bad chunk after a good head forwards nothing; a
        # finished request is forwarded before the next head is looked at.
        buf = self._buf
        out: list[bytes] = []
        try:
            while buf and not self._closed:
                if not self._requestDone:
                    body = self._body
                    assert body is not None
                    body.feed(buf, out)
                    if not body.done:
                        break  # all of it taken, or what is left is part of a chunk line
                    self._body = None
                    self._requestDone = True
                    self._forward(out)
                    out = []
                    if not self._maybeNextCycle():
                        break
                    continue
                if not self._responseDone or self._upgrading:
                    if len(buf) > MAX_READ_AHEAD:
                        self._reads.pause(_BY_AHEAD)
                    break
                if not self._startRequest(buf, out):
                    break
        except Refused as e:
            self._refuse(e.status, e.text)
            return
        if out and not self._closed:
            self._forward(out)

    def _startRequest(self, buf: bytearray, out: list[bytes]) -> bool:
        """Parse the next request head from ``buf`` into ``out``; False when it is not all here."""
        head = takeRequestHead(buf)
        if head is None:
            return False
        method, target = head.start
        if head.minor != 1:
            raise Refused(505, "only HTTP/1.1 is forwarded through the sandbox's proxy")
        if method in _REFUSED_METHODS:
            raise Refused(405, f"{method.decode('ascii')} is not forwarded through the sandbox's proxy")
        if target[:1] != b"/":
            origin = self._originForm(target)
            if origin is None:
                raise Refused(
                    400,
                    f"the tunnel to {self._host} takes only origin-form requests (/path) "
                    f"or https://{self._host}/path",
                )
            target = origin
        route = self._route
        own = route.headerName
        lines = [method, b" ", target, b" HTTP/1.1\r\n", route.hostLine]
        hosts = 0
        connection = False
        upgrade = None
        for name, value in head.fields:
            if name in _NOT_FORWARDED or (name[0] == 0x70 and name[:6] == b"proxy-"):
                if name == b"host":
                    hosts += 1
                elif name == b"connection":
                    connection = True
                elif name == b"upgrade":
                    upgrade = value
                continue
            if name != own:
                lines += (name, b": ", value, b"\r\n")
        if hosts != 1:
            raise Refused(400, ONE_HOST)
        closeAfter = upgrading = False
        if connection:
            named = connectionTokens(head.fields)
            closeAfter = b"close" in named
            if named & {n for n, _ in head.fields}:
                # (forwardedLines never drops the framing a Connection names)
                drop = frozenset({b"host", b"authorization", own})
                lines = [*lines[:5], forwardedLines(head.fields, drop)]
            if upgrade is not None and b"upgrade" in named and upgrade.lower() == b"websocket":
                lines += (b"connection: upgrade\r\nupgrade: ", upgrade, b"\r\n")
                upgrading = True
        if head.chunked:
            lines.append(b"transfer-encoding: chunked\r\n")
        injected = route.headerValue()
        if injected is not None:
            lines += (route.headerPrefix, injected, b"\r\n")
            self._injector.injectedRequests += 1
        lines.append(b"\r\n")
        out.append(b"".join(lines))
        self._method = method
        self._forwarded = False
        self._closeAfter = closeAfter
        self._upgrading = upgrading
        self._responseDone = False
        self._responseStarted = False
        self._body = requestBody(head)
        self._requestDone = self._body is None
        upstream = self._upstream
        if upstream is not None and not upstream.reusable():
            self._dropUpstream()
        return True

    def _originForm(self, target: bytes) -> bytes | None:
        low = target.lower()
        for prefix in (b"https://" + self._hostBytes, b"https://" + self._hostBytes + b":443"):
            if low.startswith(prefix):
                rest = target[len(prefix) :]
                if rest[:1] == b"/":
                    return rest
                if rest == b"":
                    return b"/"
        return None

    def _refuse(self, status: int, text: str) -> None:
        log.info("egress: refused a request to {host}: {status} {text}", host=self._host, status=status, text=text)
        if self._forwarded and not self._requestDone:
            # Half the request went upstream: that connection can never carry another.
            self._dropUpstream()
        self._method = None
        self._queued = []
        self._requestDone = self._responseDone = True
        self._sendError(status, text)

    def _sendError(self, status: int, text: str) -> None:
        transport = self.transport
        if transport is None or self._closed:
            return
        if not self._responseStarted:
            body = (text + "\n").encode("utf-8")
            transport.write(
                b"HTTP/1.1 %d %b\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n%b" % (status, _REASONS.get(status, b""), len(body), body)
            )
        self._close()

    def _close(self, abort: bool = False) -> None:
        """End the client's connection, letting go of the upstream first (a TLS
        transport with a producer registered would wait for it forever)."""
        self._closed = True
        self._letGoOfUpstream()
        if self.transport is not None and not self._gone:
            if abort:
                self.transport.abortConnection()  # type: ignore[attr-defined]
            else:
                self.transport.loseConnection()

    def _letGoOfUpstream(self) -> None:
        """Unpair the upstream: back to the pool when it finished its exchange, else closed."""
        upstream, self._upstream = self._upstream, None
        if upstream is not None:
            upstream.unpair()
            if self._requestDone and self._responseDone and not self._switched:
                self._injector._release(upstream)
            else:
                upstream.close()

    # ------------------------------------------------------------------ to upstream

    def _forward(self, out: list[bytes]) -> None:
        data = out[0] if len(out) == 1 else b"".join(out)
        if self._dialing:
            self._queued.append(data)
            return
        upstream = self._upstream
        if upstream is not None:
            method, self._method = self._method, None
            if method is not None:
                upstream.expect(method)
            self._forwarded = True
            upstream.transport.write(data)  # type: ignore[union-attr]
            return
        if self._method is None:
            # The upstream went away after answering; the rest of this
            # request's body has nowhere to go (and never starts a new one).
            return
        self._queued = [data]
        self._dialing = True
        self._reads.pause(_BY_DIAL)
        self._injector._acquire(self._host, self._addresses).addCallbacks(self._gotUpstream, self._noUpstream)

    def _gotUpstream(self, upstream: _Upstream) -> None:
        self._dialing = False
        queued, self._queued = self._queued, []
        if self._closed:
            self._injector._release(upstream)  # nothing was sent on it yet
            return
        self._upstream = upstream
        upstream.pair(self)
        if queued:
            self._forward(queued)
        self._reads.resume(_BY_DIAL)

    def _noUpstream(self, failure: Failure) -> None:
        self._dialing = False
        self._queued = []
        why = refusalOf(failure).reason if failure.check(RefusalError) else _lostWhy(failure)
        self._upstreamFailed(why)

    def _dropUpstream(self) -> None:
        upstream, self._upstream = self._upstream, None
        if upstream is not None:
            upstream.unpair()
            upstream.close()

    # ------------------------------------------------------------------ from upstream

    def fromUpstream(self, data: bytes, started: bool, ended: bool) -> None:
        """Response bytes for the client: ``started`` when they hold the final
        head, ``ended`` when they end the response."""
        if self._closed:
            return
        if started:
            self._responseStarted = True
            self._upgrading = False
        if data:
            self.transport.write(data)  # type: ignore[union-attr]
        if ended:
            self._responseDone = True
            if self._maybeNextCycle() and self._buf:
                self._parse()

    def upstreamSwitched(self, rest: bytes) -> None:
        """The upstream accepted a websocket upgrade: splice raw bytes from now on."""
        self._switched = True
        self._requestDone = self._responseDone = True
        if rest:
            self.transport.write(rest)  # type: ignore[union-attr]
        held = bytes(self._buf)
        self._buf.clear()
        self._reads.resume(_BY_AHEAD)
        if held and self._upstream is not None:
            self._upstream.transport.write(held)  # type: ignore[union-attr]

    def upstreamLost(self, why: str) -> None:
        """The paired upstream connection ended."""
        self._upstream = None
        if self._closed:
            return
        if self._switched:
            self._close()
        elif not self._responseDone:
            self._upstreamFailed(why)

    def _upstreamFailed(self, why: str) -> None:
        log.info("egress: {host}: {why}", host=self._host, why=why)
        if self._responseStarted:
            # Half a response is out: only a cut connection tells the client.
            self._close(abort=True)
            return
        self._requestDone = self._responseDone = True
        self._sendError(502, f"the sandbox's proxy reached no {self._host}: {why}")

    def _maybeNextCycle(self) -> bool:
        """Start the next request/response cycle when both ends of this one are done."""
        if not (self._requestDone and self._responseDone) or self._closed:
            return False
        upstream = self._upstream
        if upstream is not None and not upstream.reusable():
            self._dropUpstream()
        if self._closeAfter:
            self._close()
            return False
        self._responseStarted = False
        self._reads.resume(_BY_AHEAD)
        return True


_IDLE, _HEAD, _BODY, _SWITCHED = range(4)


@implementer(IHandshakeListener)
class _Upstream(Protocol):
    """One verified TLS connection to an injected host, speaking HTTP/1.1."""

    def __init__(self, injector: Injector, host: str, address: IPAddress) -> None:
        self._injector = injector
        self.host = host
        self.address = address
        self._clock = injector.clock
        self._tunnel: _Tunnel | None = None
        self._reads = _Reads()
        self._buf = bytearray()
        self._state = _IDLE
        self._method = b""
        self._body: Body | None = None  # the current response's, while it is read
        self._mustClose = False
        self._connected = False
        self._lost = False
        self._idleTimer: IDelayedCall | None = None
        self._handshakeTimer: IDelayedCall | None = None
        self._lostWaiters: list[defer.Deferred[None]] = []
        self.pauser = _Pauser(lambda: self._reads.pause(_BY_PEER), lambda: self._reads.resume(_BY_PEER))

    def whenLost(self) -> defer.Deferred[None]:
        if self._lost:
            return defer.succeed(None)
        d: defer.Deferred[None] = defer.Deferred()
        self._lostWaiters.append(d)
        return d

    def connectionMade(self) -> None:
        self._connected = True
        self._reads.transport = self.transport
        self._handshakeTimer = self._clock.callLater(self._injector.handshakeTimeout, self._handshakeExpired)

    def handshakeCompleted(self) -> None:
        if self._handshakeTimer is not None and self._handshakeTimer.active():
            self._handshakeTimer.cancel()
        self._handshakeTimer = None

    def _handshakeExpired(self) -> None:
        self._handshakeTimer = None
        self._lostWhy = f"no TLS handshake within {self._injector.handshakeTimeout:g}s"
        self.transport.abortConnection()  # type: ignore[union-attr]

    _lostWhy: str | None = None

    # ------------------------------------------------------------------ pairing

    def pair(self, tunnel: _Tunnel) -> None:
        self._tunnel = tunnel
        self.transport.registerProducer(tunnel.pauser, True)  # type: ignore[union-attr]
        tunnel.transport.registerProducer(self.pauser, True)  # type: ignore[union-attr]

    def unpair(self) -> None:
        tunnel, self._tunnel = self._tunnel, None
        if tunnel is None:
            return
        self._reads.resume(_BY_PEER)
        tunnel._reads.resume(_BY_PEER)
        if not self._lost:
            self.transport.unregisterProducer()  # type: ignore[union-attr]
        if not tunnel._gone and tunnel.transport is not None:
            tunnel.transport.unregisterProducer()  # type: ignore[attr-defined]

    def reusable(self) -> bool:
        """Connected, answered everything asked, and not told to close."""
        return self._connected and not self._lost and self._state is _IDLE and not self._mustClose

    def expect(self, method: bytes) -> None:
        """A request head goes out next: its response is what to read."""
        self._state = _HEAD
        self._method = method

    def enterIdle(self, timeout: float) -> None:
        self._idleTimer = self._clock.callLater(timeout, self.close)

    def leaveIdle(self) -> None:
        if self._idleTimer is not None and self._idleTimer.active():
            self._idleTimer.cancel()
        self._idleTimer = None

    def close(self) -> None:
        self.leaveIdle()
        self.unpair()
        if not self._lost and self.transport is not None:
            self.transport.loseConnection()

    # ------------------------------------------------------------------ bytes

    def dataReceived(self, data: bytes) -> None:
        if self._state is _SWITCHED:
            if self._tunnel is not None:
                self._tunnel.transport.write(data)  # type: ignore[union-attr]
            return
        buf = self._buf
        buf += data
        out: list[bytes] = []
        started = ended = False
        why = None
        try:
            while buf:
                state = self._state
                if state is _BODY:
                    body = self._body
                    assert body is not None
                    body.feed(buf, out)
                    if not body.done:
                        break  # all of it taken, or what is left is part of a chunk line
                    self._body = None
                    self._state = _IDLE
                    ended = True
                elif state is _HEAD:
                    kind = self._responseHead(buf, out)
                    if kind is None:
                        break
                    if kind is _SWITCHED:
                        self._switch(out)
                        return
                    if kind is not _HEAD:
                        started = True
                        ended = kind is _IDLE
                else:
                    raise Refused(502, "answered more than it was asked")
        except Refused as e:
            why = e.why
            self._mustClose = True
        tunnel = self._tunnel
        if tunnel is not None and (out or ended):
            tunnel.fromUpstream(out[0] if len(out) == 1 else b"".join(out), started, ended)
        if why is not None and not self._lost:
            self._lostWhy = why
            self.transport.abortConnection()  # type: ignore[union-attr]

    def _responseHead(self, buf: bytearray, out: list[bytes]) -> int | None:
        """Parse a response head from ``buf`` into ``out`` (for the client); the state
        it leads to, or None when the head is not all here."""
        head = takeResponseHead(buf)
        if head is None:
            return None
        status, reason = head.start
        tunnel = self._tunnel
        if status[0] == 0x31:  # 1xx
            if status == b"101":
                if tunnel is None or not tunnel._upgrading:
                    raise Refused(502, "switched protocols without being asked to")
                upgrade = head.values(b"upgrade")
                if [v.lower() for v in upgrade] != [b"websocket"]:
                    raise Refused(502, "switched to something other than websocket")
                out.append(
                    b"HTTP/1.1 101 %b\r\n%bconnection: upgrade\r\nupgrade: %b\r\n\r\n"
                    % (reason, forwardedLines(head.fields), upgrade[0])
                )
                return _SWITCHED
            out.append(b"HTTP/1.1 %b %b\r\n%b\r\n" % (status, reason, forwardedLines(head.fields)))
            return _HEAD
        extra = b""
        if head.minor == 0 or b"close" in connectionTokens(head.fields):
            self._mustClose = True
        body = responseBody(head, self._method)
        untilClose = isinstance(body, UntilClose)
        if head.chunked and body is not None:
            extra = b"transfer-encoding: chunked\r\n"
        elif untilClose:
            # Delimited by the upstream closing: so is the client's copy.
            self._mustClose = True
            extra = b"connection: close\r\n"
            if tunnel is not None:
                tunnel._closeAfter = True
        if tunnel is not None and tunnel._closeAfter and not untilClose:
            extra += b"connection: close\r\n"
        out.append(b"HTTP/1.1 %b %b\r\n%b%b\r\n" % (status, reason, forwardedLines(head.fields), extra))
        self._body = body
        self._state = state = _IDLE if body is None else _BODY
        return state

    def _switch(self, out: list[bytes]) -> None:
        self._state = _SWITCHED
        rest = bytes(self._buf)
        self._buf.clear()
        tunnel = self._tunnel
        if tunnel is not None:
            tunnel.fromUpstream(b"".join(out), True, False)
            tunnel.upstreamSwitched(rest)

    def connectionLost(self, reason: Failure = _CLOSED) -> None:
        self._lost = True
        self.leaveIdle()
        if self._handshakeTimer is not None and self._handshakeTimer.active():
            self._handshakeTimer.cancel()
        self._injector._forget(self)
        tunnel = self._tunnel
        if tunnel is not None:
            # Unregister from the client's transport first: a TLS transport
            # with a producer registered never finishes closing.
            self.unpair()
            if isinstance(self._body, UntilClose) and self._lostWhy is None and reason.check(ConnectionDone):
                # Only a close_notify ends a close-delimited body: a bare TCP
                # close may be a cut, which the client must see as one.
                self._state = _IDLE
                tunnel.fromUpstream(b"", False, True)
            tunnel.upstreamLost(self._lostWhy or _lostWhy(reason))
        waiters, self._lostWaiters = self._lostWaiters, []
        for d in waiters:
            d.callback(None)


_REASONS = {
    400: b"Bad Request",
    405: b"Method Not Allowed",
    413: b"Payload Too Large",
    431: b"Request Header Fields Too Large",
    501: b"Not Implemented",
    502: b"Bad Gateway",
    505: b"HTTP Version Not Supported",
}
