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

What it owns, in layers (magic-wormhole's dilation layers it so: framer below
protocol):

* ``Injector``: the routes and CA in force, ``terminate`` (the proxy's
  ``ITerminator``), and the per-host pool of idle upstream connections, which
  the protocols reach only through ``IUpstreamPool`` (``acquire``,
  ``release``, ``forget``, ``injected``).
* ``_Tunnel``, the client's side: the terminated path's policy for each
  request head (version, method, target, ``Host``, the header set and the
  ones removed), the one ``_Exchange`` record of the request in flight (made
  per request, dropped when both ends are done), pairing with one upstream
  and the back-pressure between the two.
* ``_Upstream``, one verified TLS connection: handshake deadline, idle timer,
  whether it can be reused.
* Below both, ``http11.RequestFramer`` and ``http11.ResponseFramer`` own each
  message's framing state (where a head ends, the body framer, whether the
  connection carries another message, the switch to websocket); the
  protocols act on the parts they hand back.  The two protocols talk only
  through explicit methods (``sendRequest``/``send``/``pair``/``unpair`` one way,
  ``fromUpstream``/``upstreamLost`` the other).

The per-request path stays lean (one parse per head, one write per direction
per pass): issue 4 asks for 20 times mitmproxy's keep-alive rate, see
``bench/inject.py``.

Nothing here logs a header, a body or a token.
"""

from __future__ import annotations

import json
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
from zope.interface import Attribute, Interface, implementer

from agentsandbox.allowlist import IPAddress
from agentsandbox.config import InjectRule
from agentsandbox.egress.dial import dialInTurn
from agentsandbox.egress.github import MAX_GRAPHQL_BODY
from agentsandbox.egress.grant import RefusalError, refusalOf
from agentsandbox.egress.http11 import (
    BY_LENGTH,
    CHUNKED,
    END,
    HOP_BY_HOP,
    ONE_HOST,
    SWITCHED,
    UNTIL_CLOSE,
    Part,
    Refused,
    RequestFramer,
    ResponseFramer,
    Started,
    forwardedLines,
)
from agentsandbox.egress.interfaces import IDialer, ITerminator, ITokenHolder
from agentsandbox.egress.leakscan import LeakScanner, tokenForms
from agentsandbox.egress.reqrules import METHOD_OVERRIDES, RequestPolicy
from agentsandbox.egress.tls import InjectionCA, upstreamContext, verifyUpstream
from agentsandbox.egress.tlsstream import TLSHandshakeError, TLSStream
from agentsandbox.oneshot import OneShotObserver

log = Logger(namespace="agentsandbox.egress.inject")

HTTPS_PORT = 443

#: Request fields never forwarded from a terminated tunnel: the one hop-by-hop
#: table, plus Host (set to the tunnel's host) and every client Authorization
#: (the rule's header is set instead).
_NOT_FORWARDED = HOP_BY_HOP | {b"host", b"authorization"}
#: The same, when responses are searched for the token: the client's
#: ``Accept-Encoding`` too (``identity`` is asked for, so the body can be read).
_NOT_FORWARDED_SCANNED = _NOT_FORWARDED | {b"accept-encoding"}
_REFUSED_METHODS = frozenset({b"TRACE", b"CONNECT"})

#: A pipelining client may not run further ahead than this while we answer.
MAX_READ_AHEAD = 256 * 1024


@dataclass
class Route:
    """An injected host: its rule and where its token comes from."""

    host: str
    rule: InjectRule
    keeper: ITokenHolder
    #: Whether responses are searched for the token (``leakscan.py``).
    scan: bool = True
    headerName: bytes = field(init=False)
    headerPrefix: bytes = field(init=False)
    hostLine: bytes = field(init=False)
    #: The request rules for this host; None when the rule has none.
    policy: RequestPolicy | None = field(init=False)
    notForwarded: frozenset[bytes] = field(init=False)
    _lastToken: str | None = field(default=None, init=False)
    _lastValue: bytes = field(default=b"", init=False)
    _warned: bool = field(default=False, init=False)
    _formsToken: str | None = field(default=None, init=False)
    _forms: tuple[bytes, ...] = field(default=(), init=False)

    def __post_init__(self) -> None:
        self.headerName = self.rule.header.lower().encode("ascii")
        self.headerPrefix = self.headerName + b": "
        self.hostLine = b"host: " + self.host.encode("ascii") + b"\r\n"
        self.policy = RequestPolicy(self.rule, self.host) if self.rule.decides else None
        notForwarded = _NOT_FORWARDED_SCANNED if self.scan else _NOT_FORWARDED
        # With rules, a method-override header is found in the one pass over the fields.
        self.notForwarded = notForwarded | METHOD_OVERRIDES if self.policy is not None else notForwarded

    def leakForms(self) -> tuple[bytes, ...]:
        """The forms of the current token a response must not carry (none without a token)."""
        token = self.keeper.token()
        if token is None:
            return ()
        if token is not self._formsToken:
            self._forms = tokenForms(token)
            self._formsToken = token
        return self._forms

    def active(self) -> bool:
        """Whether tunnels to this host are terminated now.

        A ``[[inject]]`` rule of the config always is (a request without its
        token goes out without the header, and ``doctor`` fails).  The built-in
        GitHub rule only while its keeper holds a token: until ``gh auth token``
        answers, GitHub's hosts are tunnelled like any allowed host, end to end.
        """
        return not self.rule.builtin or self.keeper.token() is not None

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
    rules: Sequence[InjectRule], keeperFor: Callable[[InjectRule], ITokenHolder], scan: bool = True
) -> dict[str, Route]:
    """host -> Route for every host of every rule (``scan=False``: responses are
    not searched for the token, for the benchmark's baseline only)."""
    routes: dict[str, Route] = {}
    for rule in rules:
        keeper = keeperFor(rule)
        for host in rule.hosts:
            routes[host] = Route(host, rule, keeper, scan)
    return routes


class IUpstreamPool(Interface):
    """What a terminated tunnel and its upstream connections ask of the injector."""

    idleTimeout = Attribute("Seconds a client connection may sit between exchanges before it is closed.")
    handshakeTimeout = Attribute("Seconds an upstream connection has for its TLS handshake.")

    def injected() -> None:
        """Count one request sent upstream with the rule's header set."""

    def record(
        event: str, host: str, method: bytes, target: bytes, reason: str, rule: str | None, client: str | None = None
    ) -> None:
        """One audit record of a terminated request (a refusal, a response withheld);
        ``client`` is the tunnel's client address, which names its session."""

    def acquire(host: str, addresses: tuple[IPAddress, ...]) -> defer.Deferred[_Upstream]:
        """A connected upstream to ``host``, pooled or dialled, at one of ``addresses``."""

    def release(upstream: _Upstream) -> None:
        """An unpaired upstream: back to the pool when it is reusable and there is room, else closed."""

    def forget(upstream: _Upstream) -> None:
        """``upstream``'s connection ended: it leaves the pool if it is there."""


@implementer(ITerminator, IUpstreamPool)
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
        #: Where refused requests and withheld responses are recorded
        #: (``AuditLog.record``'s signature); the service sets it.
        self.audit: Callable[..., object] | None = None
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
        """Whether a tunnel to ``host:port`` is terminated here: the routes in force now, port 443,
        and for the built-in GitHub rule only while its token is held (``Route.active``)."""
        if port != HTTPS_PORT:
            return False
        route = self.routes.get(host)
        return route is not None and route.active()

    def terminate(self, host: str, addresses: Sequence[IPAddress]) -> IProtocol:
        route = self.routes.get(host)
        if route is None or self.ca is None:
            raise KeyError(f"{host} has no inject rule")
        tunnel = _Tunnel(self, route, tuple(addresses), self.clock)
        return TLSStream(self.ca.serverContext(host), tunnel, serverSide=True)

    # ------------------------------------------------------------------ IUpstreamPool

    def injected(self) -> None:
        self.injectedRequests += 1

    def record(
        self, event: str, host: str, method: bytes, target: bytes, reason: str, rule: str | None, client: str | None = None
    ) -> None:
        if self.audit is None:
            return
        self.audit(
            event,
            kind="inject",
            host=host,
            port=HTTPS_PORT,
            method=method.decode("ascii", "replace"),
            path=target.decode("ascii", "replace"),
            reason=reason,
            rule=rule,
            client=client,
        )

    def acquire(self, host: str, addresses: tuple[IPAddress, ...]) -> defer.Deferred[_Upstream]:
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
            upstream = _Upstream(self, host, address, self.clock)
            return TLSStream(context, upstream, serverSide=False, serverHostname=host, verify=verifyUpstream(host))

        def upstreamOf(tls: TLSStream) -> _Upstream:
            upstream = tls.wrapped
            assert isinstance(upstream, _Upstream)
            return upstream

        return dialInTurn(self._dialer, host, HTTPS_PORT, addresses, streamTo).addCallback(upstreamOf)

    def release(self, upstream: _Upstream) -> None:
        idle = self._idle.setdefault(upstream.host, [])
        if self.pooling and upstream.reusable() and len(idle) < self.poolSize:
            idle.append(upstream)
            upstream.enterIdle(self.upstreamIdleTimeout)
        else:
            upstream.close()

    def forget(self, upstream: _Upstream) -> None:
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


@dataclass(slots=True)
class _Exchange:
    """One request on a terminated tunnel and its response, while either is under way.

    A tunnel holds one at a time (``_Tunnel._exchange``): made when a request
    head is read, dropped when both ends are done or the exchange fails, so no
    flag outlives the message it is about.
    """

    method: bytes  # the request's: what its response answers
    upgrade: bytes | None  # the protocol it asks to switch to (only ever websocket)
    closeAfter: bool  # the client's connection ends with this exchange
    target: bytes  # as sent upstream (origin form), for an audit record
    chunked: bool = False  # the response's body is chunked (the scanner re-frames it)
    #: The request as it would go upstream, held until its body decides (GraphQL under
    #: github.repos); None: forwarded as it comes.
    held: list[bytes] | None = None
    heldSize: int = 0
    heldChunked: bool = False
    forwarded: bool = False  # some of the request went upstream (its head first)
    requestDone: bool = False
    responseStarted: bool = False  # the final response head went to the client
    responseDone: bool = False


class _Tunnel(Protocol):
    """The client's side: decrypted HTTP/1.1 from one terminated tunnel.

    A ``RequestFramer`` reads the client's requests; this protocol applies the
    terminated path's policy to each head, rewrites it and forwards it and its
    body to the paired ``_Upstream``, and writes that upstream's responses back
    (``fromUpstream``).  One request is in flight at a time: a pipelining
    client's next head waits in the framer until the current exchange is done.
    """

    def __init__(
        self, pool: IUpstreamPool, route: Route, addresses: tuple[IPAddress, ...], clock: IReactorTime
    ) -> None:
        self._pool = pool
        self._route = route
        self._host = route.host
        self._hostBytes = route.host.encode("ascii")
        self._addresses = addresses
        self._clock = clock
        self._requests = RequestFramer()
        self._exchange: _Exchange | None = None
        self._reads = _Reads()
        self._upstream: _Upstream | None = None
        self._queued: list[bytes] = []
        self._dialing = False
        self._closed = False  # we closed (or the client did): nothing more is sent
        self._gone = False  # the client's connection is lost
        self._lastActivity = 0.0
        self._timer: IDelayedCall | None = None
        self._client = "?"
        #: Searches responses for the token's forms; None while not scanning.
        self._scanner: LeakScanner | None = None
        #: The request being refused asked for JSON: the refusal is {"message": ...}.
        self._jsonErrors = False
        self.pauser = _Pauser(lambda: self._reads.pause(_BY_PEER), lambda: self._reads.resume(_BY_PEER))

    # ------------------------------------------------------------------ connection

    def connectionMade(self) -> None:
        self._reads.transport = self.transport
        peer = self.transport.getPeer() if self.transport is not None else None
        #: The client's address as the proxy's records write it (it names the session).
        self._client = f"{getattr(peer, 'host', '?')}:{getattr(peer, 'port', 0)}"
        self._lastActivity = self._clock.seconds()
        self._timer = self._clock.callLater(self._pool.idleTimeout, self._checkIdle)

    def _checkIdle(self) -> None:
        idle = self._clock.seconds() - self._lastActivity
        timeout = self._pool.idleTimeout
        if idle >= timeout and self._exchange is None:
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
        if self._requests.switched:
            if self._upstream is not None:
                self._upstream.send(data)
            return
        self._take(self._requests.feed(data))

    def _take(self, parts: list[Part]) -> None:
        """Act on the parts of the client's stream the framer handed back.

        Nothing of one pass goes upstream unless all of it parsed (the framer
        hands a refusal back last, so it is seen first), so a bad chunk after a
        good head forwards nothing; a finished request is forwarded before the
        next head is read.
        """
        while parts and not self._closed:
            last = parts[-1]
            if isinstance(last, Refused):
                self._refuse(last.status, last.text)
                return
            out: list[bytes] = []
            ended = last is END  # (the framer waits after an END: it is always last)
            try:
                for part in parts:
                    if part.__class__ is bytes:
                        out.append(part)
                    elif part.__class__ is Started:
                        out.append(self._startRequest(part))
            except Refused as e:
                self._refuse(e.status, e.text)
                return
            if out:
                self._forward(out)
            exchange = self._exchange
            if not ended or exchange is None or self._closed:
                break  # (or the dial failed at once, and the client was answered)
            if exchange.held is not None and (not self._release(exchange) or self._closed):
                break
            exchange.requestDone = True
            if not (exchange.responseDone and self._exchangeDone()):
                break
            parts = self._requests.next()
        if self._requests.ahead > MAX_READ_AHEAD:
            self._reads.pause(_BY_AHEAD)

    def _startRequest(self, started: Started) -> bytes:
        """The head to send upstream for a request head the framer read (or
        ``Refused``); the request's exchange starts."""
        head = started.head
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
        notForwarded = route.notForwarded
        overridden = False
        for name, value in head.fields:
            if name in notForwarded or (name[0] == 0x70 and name[:6] == b"proxy-"):
                if name == b"host":
                    hosts += 1
                elif name == b"connection":
                    connection = True
                elif name == b"upgrade":
                    upgrade = value
                elif name in METHOD_OVERRIDES:
                    overridden = True
                continue
            if name != own:
                lines += (name, b": ", value, b"\r\n")
        if hosts != 1:
            raise Refused(400, ONE_HOST)
        policy = route.policy
        hold = False
        if policy is not None:
            decision = policy.decide(method, target, overridden)
            if decision.needsBody:
                hold = True
            elif not decision.allowed:
                rule = decision.rule.key if decision.rule is not None else decision.key
                self._pool.record("refused", self._host, method, target, decision.text, rule, self._client)
                self._jsonErrors = any(b"json" in v for v in head.values(b"accept"))
                raise Refused(403, decision.text)
        upgrading = None
        if connection:
            named = head.connection
            if named & {n for n, _ in head.fields}:
                # (forwardedLines never drops the framing a Connection names)
                drop = frozenset({b"host", b"authorization", own, *notForwarded - _NOT_FORWARDED})
                lines = [*lines[:5], forwardedLines(head, drop)]
            if upgrade is not None and b"upgrade" in named and upgrade.lower() == b"websocket":
                lines += (b"connection: upgrade\r\nupgrade: ", upgrade, b"\r\n")
                upgrading = b"websocket"
        if started.framing is CHUNKED:
            lines.append(b"transfer-encoding: chunked\r\n")
        injected = route.headerValue()
        if injected is not None:
            lines += (route.headerPrefix, injected, b"\r\n")
            self._pool.injected()
        if route.scan:
            # The body must be readable to be searched for the token.
            lines.append(b"accept-encoding: identity\r\n")
            forms = route.leakForms()
            scanner = self._scanner
            if not forms:
                self._scanner = None
            elif scanner is None or scanner.forms is not forms:
                self._scanner = LeakScanner(forms)
        lines.append(b"\r\n")
        # (The upstream held is reusable here: _exchangeDone drops one that is
        # not, and fromUpstream one that refused bytes between exchanges.)
        self._exchange = _Exchange(method, upgrading, self._requests.closing, target)
        if hold:
            self._exchange.held = []
            self._exchange.heldChunked = started.framing is CHUNKED
            self._jsonErrors = any(b"json" in v for v in head.values(b"accept"))
        return b"".join(lines)

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
        exchange, self._exchange = self._exchange, None
        if exchange is not None and exchange.forwarded and not exchange.requestDone:
            # Half the request went upstream: that connection can never carry another.
            self._dropUpstream()
        self._queued = []
        self._sendError(status, text, exchange is not None and exchange.responseStarted)

    def _sendError(self, status: int, text: str, responseStarted: bool) -> None:
        transport = self.transport
        if transport is None or self._closed:
            return
        if not responseStarted:
            if self._jsonErrors:
                # A JSON client shows an API's {"message": ...} (gh does; a text body it does not).
                body = json.dumps({"message": text}).encode("ascii") + b"\n"
                kind = b"application/json"
            else:
                body = (text + "\n").encode("utf-8")
                kind = b"text/plain; charset=utf-8"
            transport.write(
                b"HTTP/1.1 %d %b\r\ncontent-type: %b\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n%b" % (status, _REASONS.get(status, b""), kind, len(body), body)
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

    # ------------------------------------------------------------------ pairing

    def _pair(self, upstream: _Upstream) -> None:
        """Hold ``upstream`` for this connection: each side's full send buffer pauses the other's reads."""
        self._upstream = upstream
        upstream.pair(self)
        self.transport.registerProducer(upstream.pauser, True)  # type: ignore[union-attr]

    def _unpair(self) -> _Upstream | None:
        """Undo ``_pair`` (on both sides); the upstream that was held."""
        upstream, self._upstream = self._upstream, None
        if upstream is not None:
            upstream.unpair()
            self._reads.resume(_BY_PEER)
            if not self._gone and self.transport is not None:
                self.transport.unregisterProducer()  # type: ignore[attr-defined]
        return upstream

    def _letGoOfUpstream(self) -> None:
        """Unpair the upstream: back to the pool when it finished its exchange, else closed."""
        upstream = self._unpair()
        if upstream is not None:
            if self._exchange is None and not self._requests.switched:
                self._pool.release(upstream)
            else:
                upstream.close()

    def _dropUpstream(self) -> None:
        upstream = self._unpair()
        if upstream is not None:
            upstream.close()

    # ------------------------------------------------------------------ to upstream

    def _release(self, exchange: _Exchange) -> bool:
        """A held request is whole: its body decides whether it goes upstream."""
        held, exchange.held = exchange.held or [], None
        data = b"".join(held)
        body = data[data.index(b"\r\n\r\n") + 4 :]
        if exchange.heldChunked:
            body = _unchunk(body)
        policy = self._route.policy
        assert policy is not None
        decision = policy.decideBody(exchange.method, exchange.target, body)
        if not decision.allowed:
            self._pool.record(
                "refused", self._host, exchange.method, exchange.target, decision.text, decision.key, self._client
            )
            self._refuse(403, decision.text)
            return False
        self._forward([data])
        return True

    def _forward(self, out: list[bytes]) -> None:
        data = out[0] if len(out) == 1 else b"".join(out)
        held = self._exchange.held if self._exchange is not None else None
        if held is not None:
            assert self._exchange is not None
            held.append(data)
            self._exchange.heldSize += len(data)
            if self._exchange.heldSize > MAX_GRAPHQL_BODY:
                self._refuse(413, f"a GraphQL request to {self._host} over {MAX_GRAPHQL_BODY} bytes cannot be checked against github.repos")
            return
        if self._dialing:
            self._queued.append(data)
            return
        exchange = self._exchange
        assert exchange is not None
        upstream = self._upstream
        if upstream is not None:
            if exchange.forwarded:
                upstream.send(data)
            else:
                exchange.forwarded = True
                upstream.sendRequest(exchange.method, exchange.upgrade, data)
            return
        if exchange.forwarded:
            # The upstream went away after answering; the rest of this
            # request's body has nowhere to go (and never starts a new one).
            return
        self._queued = [data]
        self._dialing = True
        self._reads.pause(_BY_DIAL)
        self._pool.acquire(self._host, self._addresses).addCallbacks(self._gotUpstream, self._noUpstream)

    def _gotUpstream(self, upstream: _Upstream) -> None:
        self._dialing = False
        queued, self._queued = self._queued, []
        if self._closed:
            self._pool.release(upstream)  # nothing was sent on it yet
            return
        self._pair(upstream)
        if queued:
            self._forward(queued)
        self._reads.resume(_BY_DIAL)

    def _noUpstream(self, failure: Failure) -> None:
        self._dialing = False
        self._queued = []
        why = refusalOf(failure).reason if failure.check(RefusalError) else _lostWhy(failure)
        self._upstreamFailed(why)

    # ------------------------------------------------------------------ from upstream

    def fromUpstream(self, parts: list[Part]) -> None:
        """The parts of the upstream's responses its framer handed back: the
        client gets them in one write.  (A ``Refused`` is the upstream's to act
        on: it ends its connection, and ``upstreamLost`` follows.)"""
        if self._closed:
            return
        exchange = self._exchange
        if self._scanner is not None:
            self._fromUpstreamScanned(parts, exchange, self._scanner)
            return
        if exchange is None:
            if self._requests.switched:  # the other protocol's bytes
                for part in parts:
                    if part.__class__ is bytes:
                        self.transport.write(part)  # type: ignore[union-attr]
            elif isinstance(parts[-1], Refused):
                # Bytes between exchanges: that connection carries no next request.
                self._dropUpstream()
            return
        out: list[bytes] = []
        ended = switched = False
        for part in parts:
            if part.__class__ is bytes:
                out.append(part)
            elif part.__class__ is Started:
                out.append(self._responseHead(part, exchange))
            elif part is END:
                ended = True
            elif part is SWITCHED:
                switched = True
        self._deliver(out, switched, ended, exchange)

    def _deliver(self, out: list[bytes], switched: bool, ended: bool, exchange: _Exchange) -> None:
        """Write one read's worth of the response; then a switched protocol or the next exchange."""
        if out:
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))  # type: ignore[union-attr]
        if switched:
            self._switch()
        elif ended:
            exchange.responseDone = True
            if self._exchangeDone():
                parts = self._requests.next()
                if parts:
                    self._take(parts)

    def _fromUpstreamScanned(self, parts: list[Part], exchange: _Exchange | None, scanner: LeakScanner) -> None:
        """``fromUpstream`` with every head and body byte searched for the
        token's forms first: a hit passes none of it on, cuts the client's
        connection (or answers 502 when no response head went out yet) and is
        an audit record.  Chunked bodies are searched as their data, not their
        framing, and re-framed; what the scanner holds back goes out with the
        next read or at the body's end."""
        if exchange is None:
            if self._requests.switched:
                passedOn: list[bytes] = []
                for p in parts:
                    if isinstance(p, bytes):
                        passed = scanner.feed(p)
                        if passed is None:
                            self._leaked(None, "the websocket's bytes")
                            return
                        passedOn.append(passed)
                data = b"".join(passedOn)
                if data:
                    self.transport.write(data)  # type: ignore[union-attr]
            elif isinstance(parts[-1], Refused):
                self._dropUpstream()
            return
        if len(parts) == 3 and parts[2] is END and parts[0].__class__ is Started and parts[1].__class__ is bytes:
            # The usual keep-alive answer: a whole response in one read, searched in one pass.
            started = parts[0]
            if started.framing is BY_LENGTH and not started.informational and not scanner.holding:
                head = self._responseHead(started, exchange)
                data = head + parts[1]
                if scanner.whole(data) or _encoded(started):
                    exchange.responseStarted = False
                    self._withhold(exchange, [started], data, head, False)
                    return
                self.transport.write(data)  # type: ignore[union-attr]
                exchange.responseDone = True
                if self._exchangeDone():
                    parts = self._requests.next()
                    if parts:
                        self._take(parts)
                return
        startedBefore = exchange.responseStarted
        out: list[bytes] = []
        ended = switched = False
        for part in parts:
            if part.__class__ is bytes:
                assert isinstance(part, bytes)
                if exchange.chunked:
                    nl = part.index(b"\r\n")
                    payload = part[nl + 2 : -2]
                    if not payload:  # the last chunk
                        tail = scanner.end()
                        if tail:
                            out.append(b"%x\r\n%b\r\n" % (len(tail), tail))
                        out.append(part)
                        continue
                    passed = scanner.feed(payload)
                    if passed is None:
                        self._leaked(exchange, "the response body", startedBefore)
                        return
                    if passed:
                        out.append(b"%x\r\n%b\r\n" % (len(passed), passed))
                else:
                    passed = scanner.feed(part)
                    if passed is None:
                        self._leaked(exchange, "the response body", startedBefore)
                        return
                    if passed:
                        out.append(passed)
            elif part.__class__ is Started:
                started = part
                head = self._responseHead(started, exchange)
                if scanner.whole(head) or (not started.informational and _encoded(started)):
                    self._withhold(exchange, [started], head, head, startedBefore)
                    return
                scanner.end()
                if not started.informational:
                    exchange.chunked = started.framing is CHUNKED
                out.append(head)
            elif part is END:
                if not exchange.chunked:
                    tail = scanner.end()
                    if tail:
                        out.append(tail)
                ended = True
            elif part is SWITCHED:
                switched = True
        self._deliver(out, switched, ended, exchange)

    def _withhold(
        self, exchange: _Exchange, starts: list[Started], data: bytes, head: bytes, startedBefore: bool
    ) -> None:
        """A response head (and, in ``data``, maybe its body) that cannot go to the client."""
        started = starts[0]
        encoding = started.head.values(b"content-encoding")
        if _encoded(started):
            self._leaked(
                exchange,
                None,
                startedBefore,
                "the response is encoded (content-encoding: "
                + b", ".join(encoding).decode("ascii", "replace")
                + ") though identity was asked for, so it cannot be searched for the token",
            )
        else:
            scanner = self._scanner
            inHead = scanner is not None and scanner.whole(head)
            self._leaked(exchange, "the response head" if inHead else "the response body", startedBefore)

    def _leaked(
        self, exchange: _Exchange | None, where: str | None, startedBefore: bool = True, why: str | None = None
    ) -> None:
        """A response carried the token (in ``where``), or could not be searched
        (``why``): the client gets none of it, and the audit log says so."""
        scanner = self._scanner
        if why is None:
            form = scanner.found if scanner is not None else None
            token = self._route.keeper.token()
            what = "the token" if token is not None and form == token.encode() else "an encoding of the token"
            why = f"{where} carried {what}; it was withheld from the client and the connection cut"
        method, target = (exchange.method, exchange.target) if exchange is not None else (b"-", b"-")
        self._pool.record("withheld", self._host, method, target, why, None, self._client)
        self._exchange = None
        self._dropUpstream()
        if startedBefore:
            self._close(abort=True)
        else:
            self._sendError(502, f"the sandbox's proxy withheld a response of {self._host}: {why}", False)

    def _responseHead(self, started: Started, exchange: _Exchange) -> bytes:
        """The head the client gets for a response head the upstream's framer read."""
        head = started.head
        status, reason = head.start
        if started.informational:
            if status == b"101":
                return b"HTTP/1.1 101 %b\r\n%bconnection: upgrade\r\nupgrade: %b\r\n\r\n" % (
                    reason,
                    forwardedLines(head),
                    head.values(b"upgrade")[0],
                )
            return b"HTTP/1.1 %b %b\r\n%b\r\n" % (status, reason, forwardedLines(head))
        exchange.responseStarted = True
        framing = started.framing
        extra = b""
        if framing is CHUNKED:
            extra = b"transfer-encoding: chunked\r\n"
        elif framing is UNTIL_CLOSE:
            # Delimited by the upstream closing: so is the client's copy.
            extra = b"connection: close\r\n"
            exchange.closeAfter = True
        elif exchange.closeAfter:
            extra = b"connection: close\r\n"
        return b"HTTP/1.1 %b %b\r\n%b%b\r\n" % (status, reason, forwardedLines(head), extra)

    def _switch(self) -> None:
        """The upstream accepted a websocket upgrade: raw bytes both ways from now on."""
        self._exchange = None
        held = self._requests.switch()
        self._reads.resume(_BY_AHEAD)
        if held and self._upstream is not None:
            self._upstream.send(held)

    def upstreamLost(self, why: str) -> None:
        """The paired upstream connection ended."""
        self._unpair()
        if self._closed:
            return
        if self._requests.switched:
            self._close()
        elif self._exchange is not None and not self._exchange.responseDone:
            self._upstreamFailed(why)

    def _upstreamFailed(self, why: str) -> None:
        log.info("egress: {host}: {why}", host=self._host, why=why)
        exchange, self._exchange = self._exchange, None
        if exchange is not None and exchange.responseStarted:
            # Half a response is out: only a cut connection tells the client.
            self._close(abort=True)
            return
        self._sendError(502, f"the sandbox's proxy reached no {self._host}: {why}", False)

    def _exchangeDone(self) -> bool:
        """End the exchange if both its ends are done; whether the next one may start."""
        exchange = self._exchange
        if exchange is None or not (exchange.requestDone and exchange.responseDone) or self._closed:
            return False
        self._exchange = None
        upstream = self._upstream
        if upstream is not None and not upstream.reusable():
            self._dropUpstream()
        if exchange.closeAfter:
            self._close()
            return False
        self._reads.resume(_BY_AHEAD)
        return True


@implementer(IHandshakeListener)
class _Upstream(Protocol):
    """One verified TLS connection to an injected host, speaking HTTP/1.1.

    A ``ResponseFramer`` reads its responses; this protocol owns the
    connection (handshake deadline, idle timer in the pool, whether it can be
    reused) and hands what the framer read to the paired tunnel.
    """

    def __init__(self, pool: IUpstreamPool, host: str, address: IPAddress, clock: IReactorTime) -> None:
        self._pool = pool
        self.host = host
        self.address = address
        self._clock = clock
        self._tunnel: _Tunnel | None = None
        self._reads = _Reads()
        self._responses = ResponseFramer()
        self._connected = False
        self._lost = False
        self._idleTimer: IDelayedCall | None = None
        self._handshakeTimer: IDelayedCall | None = None
        self._lostObserver: OneShotObserver[None] = OneShotObserver()
        self.pauser = _Pauser(lambda: self._reads.pause(_BY_PEER), lambda: self._reads.resume(_BY_PEER))

    def whenLost(self) -> defer.Deferred[None]:
        return self._lostObserver.whenFired()

    def connectionMade(self) -> None:
        self._connected = True
        self._reads.transport = self.transport
        self._handshakeTimer = self._clock.callLater(self._pool.handshakeTimeout, self._handshakeExpired)

    def handshakeCompleted(self) -> None:
        if self._handshakeTimer is not None and self._handshakeTimer.active():
            self._handshakeTimer.cancel()
        self._handshakeTimer = None

    def _handshakeExpired(self) -> None:
        self._handshakeTimer = None
        self._lostWhy = f"no TLS handshake within {self._pool.handshakeTimeout:g}s"
        self.transport.abortConnection()  # type: ignore[union-attr]

    _lostWhy: str | None = None

    # ------------------------------------------------------------------ pairing

    def pair(self, tunnel: _Tunnel) -> None:
        """Serve ``tunnel``: its responses go to it, and its reads pause while our send buffer is full."""
        self._tunnel = tunnel
        self.transport.registerProducer(tunnel.pauser, True)  # type: ignore[union-attr]

    def unpair(self) -> None:
        """Undo ``pair`` on this side (the tunnel undoes its own)."""
        tunnel, self._tunnel = self._tunnel, None
        if tunnel is None:
            return
        self._reads.resume(_BY_PEER)
        if not self._lost:
            self.transport.unregisterProducer()  # type: ignore[union-attr]

    def reusable(self) -> bool:
        """Connected, answered everything asked, and not told to close."""
        return self._connected and not self._lost and self._responses.reusable

    def sendRequest(self, method: bytes, upgrade: bytes | None, data: bytes) -> None:
        """The start of a request (its head first) of ``method``, asking to switch
        to ``upgrade``, for the host: its response is what to read next."""
        self._responses.expect(method, upgrade)
        self.transport.write(data)  # type: ignore[union-attr]

    def send(self, data: bytes) -> None:
        """More of the request (or, once switched, the other protocol's bytes) for the host."""
        self.transport.write(data)  # type: ignore[union-attr]

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
        parts = self._responses.feed(data)
        if not parts:
            return
        tunnel = self._tunnel
        if tunnel is not None:
            tunnel.fromUpstream(parts)
        last = parts[-1]
        if isinstance(last, Refused) and not self._lost:
            self._lostWhy = last.why
            self.transport.abortConnection()  # type: ignore[union-attr]

    def connectionLost(self, reason: Failure = _CLOSED) -> None:
        self._lost = True
        self.leaveIdle()
        if self._handshakeTimer is not None and self._handshakeTimer.active():
            self._handshakeTimer.cancel()
        self._pool.forget(self)
        tunnel = self._tunnel
        if tunnel is not None:
            self.unpair()
            # Only a close_notify ends a close-delimited body: a bare TCP close
            # may be a cut, which the client must see as one.
            ended = self._responses.closed(self._lostWhy is None and reason.check(ConnectionDone) is not None)
            if ended:
                tunnel.fromUpstream(ended)
            tunnel.upstreamLost(self._lostWhy or _lostWhy(reason))
        self._lostObserver.fire(None)


def _encoded(started: Started) -> bool:
    """Whether a final response's body is content-coded (then it cannot be searched)."""
    for name, value in started.head.fields:
        if name == b"content-encoding" and value.strip().lower() != b"identity":
            return True
    return False


def _unchunk(framed: bytes) -> bytes:
    """The data of a body this module re-framed (``%x\\r\\n DATA \\r\\n`` ... ``0\\r\\n\\r\\n``)."""
    out: list[bytes] = []
    at = 0
    while True:
        nl = framed.index(b"\r\n", at)
        size = int(framed[at:nl], 16)
        if not size:
            return b"".join(out)
        out.append(framed[nl + 2 : nl + 2 + size])
        at = nl + 2 + size + 2


_REASONS = {
    400: b"Bad Request",
    403: b"Forbidden",
    405: b"Method Not Allowed",
    413: b"Payload Too Large",
    431: b"Request Header Fields Too Large",
    501: b"Not Implemented",
    502: b"Bad Gateway",
    505: b"HTTP Version Not Supported",
}
