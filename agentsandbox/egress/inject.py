"""TLS termination and header injection for the hosts that have an inject rule.

The proxy grants a tunnel to ``host:443`` and, when ``host`` has an inject
rule, hands the client's connection to ``Injector.terminate``.  From there:

1. The client gets our TLS: the host's leaf from the in-memory CA, whatever
   SNI it sent, ALPN ``http/1.1`` only (``tls.py``).
2. Its HTTP/1.1 is parsed strictly with h11, plus the framing checks h11 is
   lenient about (a repeated or list-valued Content-Length, Content-Length
   with Transfer-Encoding, any Transfer-Encoding but ``chunked``, bare LF line
   ends, obsolete line folding).  A refused head forwards nothing.
3. Each request goes to the tunnel host whatever its ``Host`` header or
   absolute-form target says; every client ``Authorization`` (and the rule's
   own header) is removed, hop-by-hop headers are dropped, the rule's header
   is set from the keeper's current token.  TRACE and CONNECT get 405.
   ``Upgrade`` passes only for websocket.
4. Upstream is a verified TLS connection (system roots, service-identity) to
   one of the addresses the proxy checked, kept alive and reused: a client
   connection holds one upstream connection for its life and returns it to a
   small per-host pool when it closes.
5. Bodies stream both ways untouched, each side pausing the other's reads
   when its send buffer fills, so a large push never sits in memory.

Nothing here logs a header, a body or a token.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from typing import Protocol as TypingProtocol

import h11
from twisted.internet import defer, endpoints
from twisted.internet.interfaces import (
    IDelayedCall,
    IHandshakeListener,
    IProtocol,
    IPushProducer,
    IReactorTime,
)
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger
from twisted.protocols.tls import TLSMemoryBIOProtocol
from twisted.python.failure import Failure
from zope.interface import implementer

from agentsandbox.config import InjectRule
from agentsandbox.egress.compat import tlsFactory
from agentsandbox.egress.interfaces import Dialer, ITerminator
from agentsandbox.egress.rules import IPAddress
from agentsandbox.egress.tls import InjectionCA, upstreamCreator

log = Logger(namespace="agentsandbox.egress.inject")

HTTPS_PORT = 443

#: Request headers that never cross the proxy (RFC 9110 §7.6.1 plus the proxy's own).
_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authorization",
        b"proxy-authenticate",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"authorization",
    }
)
_RESPONSE_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
_REFUSED_METHODS = frozenset({b"TRACE", b"CONNECT"})
_CL_LINE = re.compile(rb"\n(?i:content-length):[ \t]*[0-9]+[ \t]*\r\n")
_TE_LINE = re.compile(rb"\n(?i:transfer-encoding):[ \t]*chunked[ \t]*\r\n")

#: A pipelining client may not run further ahead than this while we answer.
MAX_READ_AHEAD = 256 * 1024
MAX_HEAD = 64 * 1024


class TokenHolder(TypingProtocol):
    """What a route needs of a token keeper (``tokens.TokenKeeper`` is one)."""

    def token(self) -> str | None: ...


def headAnomaly(head: bytes) -> str | None:
    """Why a raw request head (as h11 accepted it) is still refused, or None.

    h11 merges a repeated identical Content-Length, accepts ``5, 5``, lets
    Transfer-Encoding win over Content-Length, and takes bare LF and obsolete
    folding; each is a request-smuggling shape, so each is refused here.
    """
    if head.count(b"\n") != head.count(b"\r\n"):
        return "a header line ends in a bare LF"
    if b"\n " in head or b"\n\t" in head:
        return "obsolete line folding in the header"
    low = head.lower()
    hasCL = b"\ncontent-length" in low
    hasTE = b"\ntransfer-encoding" in low
    if not (hasCL or hasTE):
        return None
    if hasCL and hasTE:
        return "Content-Length together with Transfer-Encoding"
    if hasCL:
        if low.count(b"\ncontent-length") > 1:
            return "more than one Content-Length"
        if _CL_LINE.search(head) is None:
            return "a malformed Content-Length"
        return None
    if low.count(b"\ntransfer-encoding") > 1:
        return "more than one Transfer-Encoding"
    if _TE_LINE.search(head) is None:
        return "a Transfer-Encoding other than exactly chunked"
    return None


@dataclass
class Route:
    """An injected host: its rule and where its token comes from."""

    host: str
    rule: InjectRule
    keeper: TokenHolder
    headerName: bytes = field(init=False)
    _lastToken: str | None = field(default=None, init=False)
    _lastValue: bytes = field(default=b"", init=False)
    _warned: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.headerName = self.rule.header.lower().encode("ascii")

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
    rules: Sequence[InjectRule], keeperFor: Callable[[InjectRule], TokenHolder]
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
    addresses to loopback); ``trustRoot`` is the upstream trust (the system's
    roots when None; tests pass their own CA here, never through config).
    """

    def __init__(
        self,
        ca: InjectionCA,
        routes: Mapping[str, Route],
        dialer: Dialer,
        reactor: IReactorTime,
        trustRoot: Any = None,
        idleTimeout: float = 300.0,
        upstreamIdleTimeout: float = 60.0,
        handshakeTimeout: float = 30.0,
        poolSize: int = 8,
    ) -> None:
        self._reactor = reactor
        self._dialer = dialer
        self._trustRoot = trustRoot
        self.idleTimeout = idleTimeout
        self.upstreamIdleTimeout = upstreamIdleTimeout
        self.handshakeTimeout = handshakeTimeout
        self.poolSize = poolSize
        #: Requests sent upstream with the rule's header set, for ``status``.
        self.injectedRequests = 0
        self._idle: dict[str, list[_Upstream]] = {}
        self._serverFactories: dict[str, Any] = {}
        self._clientFactories: dict[str, Any] = {}
        self.ca = ca
        self.routes: Mapping[str, Route] = {}
        self.swap(ca, routes)

    # ------------------------------------------------------------------ config

    def swap(self, ca: InjectionCA, routes: Mapping[str, Route]) -> None:
        """Take new rules (and the CA made for their hosts); open tunnels keep theirs."""
        if not set(routes) <= set(ca.hosts):
            missing = sorted(set(routes) - set(ca.hosts))
            raise ValueError(f"the CA is not constrained to {', '.join(missing)}")
        if ca is not self.ca:
            self._serverFactories = {}
        self.ca = ca
        self.routes = dict(routes)

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(self.routes)

    def injects(self, host: str, port: int) -> bool:
        """Whether a tunnel to ``host:port`` is terminated here."""
        return port == HTTPS_PORT and host in self.routes

    # ------------------------------------------------------------------ ITerminator

    def terminate(self, host: str, addresses: Sequence[IPAddress]) -> IProtocol:
        route = self.routes.get(host)
        if route is None:
            raise KeyError(f"{host} has no inject rule")
        factory = self._serverFactories.get(host)
        if factory is None:
            factory = self._serverFactories[host] = tlsFactory(
                self.ca.serverCreator(host), False, Factory(), self._reactor
            )
        tunnel = _Tunnel(self, route, tuple(addresses))
        return TLSMemoryBIOProtocol(factory, tunnel)  # type: ignore[no-untyped-call]

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
        factory = self._clientFactories.get(host)
        if factory is None:
            creator = upstreamCreator(host, self._trustRoot)
            factory = self._clientFactories[host] = tlsFactory(creator, True, Factory(), self._reactor)
        errors: list[str] = []

        def attempt(index: int) -> defer.Deferred[_Upstream]:
            if index >= len(addresses):
                why = "; ".join(errors) or "no address to dial"
                return defer.fail(UpstreamError(host, f"cannot connect ({why})"))
            address = addresses[index]
            upstream = _Upstream(self, host, address)
            tls = TLSMemoryBIOProtocol(factory, upstream)  # type: ignore[no-untyped-call]
            d: defer.Deferred[Any] = endpoints.connectProtocol(  # type: ignore[no-untyped-call]
                self._dialer(address, HTTPS_PORT), tls
            )

            def failed(f: Failure) -> defer.Deferred[_Upstream]:
                errors.append(f"{address}: {f.getErrorMessage()}")
                return attempt(index + 1)

            result: defer.Deferred[_Upstream] = d.addCallbacks(lambda _: upstream, failed)
            return result

        return attempt(0)

    def _release(self, upstream: _Upstream) -> None:
        idle = self._idle.setdefault(upstream.host, [])
        if upstream.reusable() and len(idle) < self.poolSize:
            idle.append(upstream)
            upstream.enterIdle(self.upstreamIdleTimeout)
        else:
            upstream.close()

    def _forget(self, upstream: _Upstream) -> None:
        idle = self._idle.get(upstream.host)
        if idle and upstream in idle:
            idle.remove(upstream)

    def closeIdle(self) -> defer.Deferred[None]:
        """Close every pooled upstream connection (at service stop); fires when they are gone."""
        closing = []
        for idle in self._idle.values():
            for upstream in list(idle):
                closing.append(upstream.whenLost())
                upstream.close()
        self._idle.clear()
        return defer.gatherResults(closing).addCallback(lambda _: None)


_CLOSED = Failure(ConnectionError("connection closed"))  # type: ignore[no-untyped-call]


class UpstreamError(Exception):
    def __init__(self, host: str, why: str) -> None:
        super().__init__(f"{host}: {why}")
        self.host = host
        self.why = why


def _lostWhy(reason: Failure) -> str:
    """A short, token-free account of why an upstream connection ended."""
    value = reason.value
    args = getattr(value, "args", ())
    if type(value).__module__.startswith("OpenSSL") and args and isinstance(args[0], list):
        parts = [str(p[-1]) for p in args[0] if isinstance(p, tuple) and p]
        if parts:
            return "TLS failed: " + ", ".join(parts)
    if type(value).__name__ == "VerificationError":
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
    """The client's side: decrypted HTTP/1.1 from one terminated tunnel."""

    def __init__(self, injector: Injector, route: Route, addresses: tuple[IPAddress, ...]) -> None:
        self._injector = injector
        self._route = route
        self._host = route.host
        self._hostBytes = route.host.encode("ascii")
        self._addresses = addresses
        self._clock = injector._reactor
        self._conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        self._head: bytearray | None = bytearray()
        self._reads = _Reads()
        self._upstream: _Upstream | None = None
        self._pending: h11.Request | None = None
        self._queued: list[Any] = []
        self._batch: list[Any] = []
        self._dialing = False
        self._requestDone = True
        self._responseDone = True
        self._responseStarted = False
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
        upstream, self._upstream = self._upstream, None
        if upstream is not None:
            upstream.unpair()
            if self._requestDone and self._responseDone and not self._switched:
                self._injector._release(upstream)
            else:
                upstream.close()

    # ------------------------------------------------------------------ client bytes

    def dataReceived(self, data: bytes) -> None:
        self._lastActivity = self._clock.seconds()
        if self._switched:
            if self._upstream is not None:
                self._upstream.transport.write(data)  # type: ignore[union-attr]
            return
        if self._head is not None:
            self._head += data
        self._conn.receive_data(data)
        self._pump()

    def _pump(self) -> None:
        # Body events are batched for one pass over what arrived, so a framing
        # error found later in the same bytes (a bad chunk) still refuses a
        # request that nothing was forwarded for.
        conn = self._conn
        batch = self._batch
        while not self._closed:
            try:
                event: Any = conn.next_event()
            except h11.RemoteProtocolError as e:
                batch.clear()
                self._badRequest(e)
                return
            kind = type(event)
            if kind is h11.Data:
                batch.append(event)
            elif kind is h11.Request:
                if not self._onRequest(event):
                    return
            elif kind is h11.EndOfMessage:
                batch.append(event)
                self._flush()
                self._requestDone = True
                if self._maybeNextCycle():
                    continue
            elif event is h11.NEED_DATA:
                break
            elif event is h11.PAUSED:
                if len(conn.trailing_data[0]) > MAX_READ_AHEAD:
                    self._reads.pause(_BY_AHEAD)
                break
            elif kind is h11.ConnectionClosed:
                if self._requestDone and self._responseDone:
                    self._close()
                break
        if not self._closed:
            self._flush()

    def _flush(self) -> None:
        if self._pending is not None:
            self._dispatch()
        batch = self._batch
        if not batch:
            return
        if self._dialing:
            self._queued.extend(batch)
        elif self._upstream is not None:
            self._upstream.sendAll(batch)
        # else: the upstream went away after answering; the rest of the body has nowhere to go.
        batch.clear()

    def _onRequest(self, request: h11.Request) -> bool:
        head = self._head
        self._head = None
        if head is not None:
            consumed = len(head) - len(self._conn.trailing_data[0])
            if consumed > MAX_HEAD:
                self._refuse(431, f"refused: a request head over {MAX_HEAD} bytes")
                return False
            why = headAnomaly(bytes(head[:consumed]))
            if why is not None:
                self._refuse(400, f"refused: {why}")
                return False
        method = request.method
        if method in _REFUSED_METHODS:
            self._refuse(405, f"{method.decode('ascii', 'replace')} is not forwarded through the sandbox's proxy")
            return False
        target: bytes | None = request.target
        if request.target[:1] != b"/":
            target = self._originForm(request.target)
            if target is None:
                self._refuse(
                    400,
                    f"the tunnel to {self._host} takes only origin-form requests (/path) "
                    f"or https://{self._host}/path",
                )
                return False
        assert target is not None
        headers: list[tuple[bytes, bytes]] = [(b"host", self._hostBytes)]
        own = self._route.headerName
        connection = upgrade = None
        chunked = False
        for name, value in request.headers:
            if name in _HOP_BY_HOP:
                if name == b"connection":
                    connection = value
                elif name == b"upgrade":
                    upgrade = value
                elif name == b"transfer-encoding":
                    chunked = True
                continue
            if name != own:
                headers.append((name, value))
        if connection is not None:
            named = {t.strip().lower() for t in connection.split(b",")}
            headers = [(n, v) for n, v in headers if n not in named or n == b"host"]
            if upgrade is not None and b"upgrade" in named and upgrade.strip().lower() == b"websocket":
                headers += [(b"connection", b"upgrade"), (b"upgrade", upgrade)]
        if chunked:
            headers.append((b"transfer-encoding", b"chunked"))
        injected = self._route.headerValue()
        if injected is not None:
            headers.append((own, injected))
            self._injector.injectedRequests += 1
        self._requestDone = False
        self._responseDone = False
        self._responseStarted = False
        self._pending = h11.Request(method=method, target=target, headers=headers)
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

    def _badRequest(self, error: h11.RemoteProtocolError) -> None:
        status = error.error_status_hint or 400
        self._refuse(status, f"refused: {error}")

    def _refuse(self, status: int, text: str) -> None:
        log.info("egress: refused a request to {host}: {status} {text}", host=self._host, status=status, text=text)
        if self._pending is None and self._upstream is not None and not self._requestDone:
            # The request was already on its way: the upstream connection holds
            # half a request now, so it can never carry another.
            self._dropUpstream()
        self._pending = None
        self._requestDone = self._responseDone = True
        self._sendError(status, text)

    def _sendError(self, status: int, text: str) -> None:
        transport = self.transport
        if transport is None or self._closed:
            return
        conn = self._conn
        if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE) and not self._responseStarted:
            body = (text + "\n").encode("utf-8")
            try:
                transport.write(
                    conn.send(
                        h11.Response(
                            status_code=status,
                            headers=[
                                (b"content-type", b"text/plain; charset=utf-8"),
                                (b"content-length", str(len(body)).encode("ascii")),
                                (b"connection", b"close"),
                            ],
                            reason=_REASONS.get(status, b""),
                        )
                    )
                    or b""
                )
                transport.write(conn.send(h11.Data(data=body)) or b"")
                transport.write(conn.send(h11.EndOfMessage()) or b"")
            except h11.LocalProtocolError:
                pass
        self._close()

    def _close(self, abort: bool = False) -> None:
        """End the client's connection, letting go of the upstream first (a TLS
        transport with a producer registered would wait for it forever)."""
        self._closed = True
        upstream, self._upstream = self._upstream, None
        if upstream is not None:
            upstream.unpair()
            if self._requestDone and self._responseDone and not self._switched:
                self._injector._release(upstream)
            else:
                upstream.close()
        if self.transport is not None and not self._gone:
            if abort:
                self.transport.abortConnection()  # type: ignore[attr-defined]
            else:
                self.transport.loseConnection()

    # ------------------------------------------------------------------ to upstream

    def _dispatch(self) -> None:
        request = self._pending
        self._pending = None
        assert request is not None
        upstream = self._upstream
        if upstream is not None and upstream.reusable():
            upstream.send(request)
            return
        if upstream is not None:
            self._dropUpstream()
        self._queued.insert(0, request)
        self._dialing = True
        self._reads.pause(_BY_DIAL)
        self._injector._acquire(self._host, self._addresses).addCallbacks(self._gotUpstream, self._noUpstream)

    def _gotUpstream(self, upstream: _Upstream) -> None:
        self._dialing = False
        if self._closed:
            self._queued = []
            self._injector._release(upstream)  # nothing was sent on it yet
            return
        self._upstream = upstream
        upstream.pair(self)
        self._flushQueued()
        self._reads.resume(_BY_DIAL)

    def _noUpstream(self, failure: Failure) -> None:
        self._dialing = False
        self._queued = []
        why = failure.value.why if isinstance(failure.value, UpstreamError) else _lostWhy(failure)
        self._upstreamFailed(why)

    def _flushQueued(self) -> None:
        queued, self._queued = self._queued, []
        if self._upstream is not None and queued:
            self._upstream.sendAll(queued)

    def _dropUpstream(self) -> None:
        upstream, self._upstream = self._upstream, None
        if upstream is not None:
            upstream.unpair()
            upstream.close()

    # ------------------------------------------------------------------ from upstream

    def upstreamResponse(self, event: h11.Response | h11.InformationalResponse) -> None:
        if self._closed:
            return
        headers: list[tuple[bytes, bytes]] = []
        connection = None
        for name, value in event.headers:
            if name in _RESPONSE_HOP_BY_HOP:
                if name == b"connection":
                    connection = value
                continue
            headers.append((name, value))
        if connection is not None:
            named = {t.strip().lower() for t in connection.split(b",")}
            headers = [(n, v) for n, v in headers if n not in named]
        if type(event) is h11.InformationalResponse:
            if event.status_code == 101:
                upgrade = event.headers
                headers += [(b"connection", b"upgrade")] + [
                    (n, v) for n, v in upgrade if n == b"upgrade"
                ]
            try:
                self.transport.write(  # type: ignore[union-attr]
                    self._conn.send(
                        h11.InformationalResponse(status_code=event.status_code, headers=headers, reason=event.reason)
                    )
                    or b""
                )
            except h11.LocalProtocolError:
                self._upstreamFailed("answered with an informational response the client did not ask for")
            return
        self._responseStarted = True
        self.transport.write(  # type: ignore[union-attr]
            self._conn.send(h11.Response(status_code=event.status_code, headers=headers, reason=event.reason)) or b""
        )

    def upstreamData(self, data: bytes) -> None:
        if not self._closed:
            self.transport.writeSequence(self._conn.send_with_data_passthrough(h11.Data(data=data)) or [])  # type: ignore[union-attr]

    def upstreamEnd(self) -> None:
        if self._closed:
            return
        self.transport.write(self._conn.send(h11.EndOfMessage()) or b"")  # type: ignore[union-attr]
        self._responseDone = True
        self._maybeNextCycle()

    def upstreamSwitched(self, rest: bytes) -> None:
        """The upstream accepted a websocket upgrade: splice raw bytes from now on."""
        self._switched = True
        self._requestDone = self._responseDone = True
        trailing = self._conn.trailing_data[0]
        if rest:
            self.transport.write(rest)  # type: ignore[union-attr]
        if trailing and self._upstream is not None:
            self._upstream.transport.write(trailing)  # type: ignore[union-attr]

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
        if upstream is not None and not upstream.nextCycle():
            self._dropUpstream()
        conn = self._conn
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
            self._responseStarted = False
            self._head = bytearray(conn.trailing_data[0])
            self._reads.resume(_BY_AHEAD)
            return True
        if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE or conn.our_state is h11.DONE:
            self._close()
        return False

    def continueAfterResponse(self) -> None:
        """Parse what a pipelining client sent while we answered."""
        if self._conn.their_state is h11.IDLE and self._conn.trailing_data[0]:
            self._pump()


@implementer(IHandshakeListener)
class _Upstream(Protocol):
    """One verified TLS connection to an injected host, speaking HTTP/1.1."""

    def __init__(self, injector: Injector, host: str, address: IPAddress) -> None:
        self._injector = injector
        self.host = host
        self.address = address
        self._clock = injector._reactor
        self._conn = h11.Connection(h11.CLIENT)
        self._tunnel: _Tunnel | None = None
        self._reads = _Reads()
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
        return self._connected and not self._lost and self._conn.our_state is h11.IDLE

    def enterIdle(self, timeout: float) -> None:
        self._idleTimer = self._clock.callLater(timeout, self.close)

    def leaveIdle(self) -> None:
        if self._idleTimer is not None and self._idleTimer.active():
            self._idleTimer.cancel()
        self._idleTimer = None

    def nextCycle(self) -> bool:
        conn = self._conn
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE and not self._lost:
            conn.start_next_cycle()
            return True
        return False

    def close(self) -> None:
        self.leaveIdle()
        self.unpair()
        if not self._lost and self.transport is not None:
            self.transport.loseConnection()

    # ------------------------------------------------------------------ bytes

    def send(self, event: Any) -> None:
        if self._lost:
            return
        try:
            data = self._conn.send_with_data_passthrough(event)
        except h11.LocalProtocolError as e:
            self._lostWhy = f"cannot forward the request ({e})"
            self.transport.abortConnection()  # type: ignore[union-attr]
            return
        if data:
            self.transport.writeSequence(data)  # type: ignore[union-attr]

    def sendAll(self, events: list[Any]) -> None:
        if self._lost:
            return
        send = self._conn.send_with_data_passthrough
        out: list[bytes] = []
        try:
            for event in events:
                out += send(event) or ()
        except h11.LocalProtocolError as e:
            self._lostWhy = f"cannot forward the request ({e})"
            self.transport.abortConnection()  # type: ignore[union-attr]
            return
        self.transport.writeSequence(out)  # type: ignore[union-attr]

    def dataReceived(self, data: bytes) -> None:
        conn = self._conn
        conn.receive_data(data)
        tunnel = self._tunnel
        while True:
            try:
                event: Any = conn.next_event()
            except h11.RemoteProtocolError as e:
                self._lostWhy = f"answered with broken HTTP ({e})"
                self.transport.abortConnection()  # type: ignore[union-attr]
                return
            kind = type(event)
            if kind is h11.Data:
                if tunnel is not None:
                    tunnel.upstreamData(event.data)
            elif kind is h11.Response or kind is h11.InformationalResponse:
                if tunnel is not None:
                    tunnel.upstreamResponse(event)
                if kind is h11.InformationalResponse and event.status_code == 101:
                    self._switch(tunnel)
                    return
            elif kind is h11.EndOfMessage:
                if tunnel is not None:
                    tunnel.upstreamEnd()
                    tunnel.continueAfterResponse()
                    tunnel = self._tunnel
            elif event is h11.NEED_DATA or event is h11.PAUSED or kind is h11.ConnectionClosed:
                return

    def _switch(self, tunnel: _Tunnel | None) -> None:
        rest = self._conn.trailing_data[0]
        self.dataReceived = self._rawReceived  # type: ignore[method-assign]
        if tunnel is not None:
            tunnel.upstreamSwitched(rest)

    def _rawReceived(self, data: bytes) -> None:
        if self._tunnel is not None:
            self._tunnel.transport.write(data)  # type: ignore[union-attr]

    def connectionLost(self, reason: Failure = _CLOSED) -> None:
        self._lost = True
        self.leaveIdle()
        if self._handshakeTimer is not None and self._handshakeTimer.active():
            self._handshakeTimer.cancel()
        self._injector._forget(self)
        tunnel, self._tunnel = self._tunnel, None
        if tunnel is not None:
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
}
