"""The HTTP side of the front door: CONNECT, absolute-form ``http://`` forwarding, errors.

h11 does the framing in both directions (request heads, bodies, keep-alive,
and its refusals of ambiguous framing), so no byte of HTTP is parsed by hand
here.  Forwarding removes the hop-by-hop and ``Proxy-*`` headers, makes
``Host`` the URI's authority, adds nothing (never a credential: tokens are
injected only on the TLS path of issue 4), and streams bodies both ways with
back-pressure.  ``Upgrade`` is not forwarded on this path.
"""

from __future__ import annotations

import re
from http import HTTPStatus
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import h11
from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IHalfCloseableProtocol
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from zope.interface import implementer

from agentsandbox.egress.proxy import Refusal, RefusalError, refusalOf

if TYPE_CHECKING:
    from agentsandbox.egress.proxy import FrontDoor, Grant

#: Largest request or response head accepted (h11 refuses longer ones).
MAX_HEAD = 64 * 1024

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"upgrade",
    }
)
#: Framing headers are never dropped because a ``Connection`` header lists
#: them: the body must be framed the way it was sent.
FRAMING = frozenset({b"content-length", b"transfer-encoding"})

_PORT = re.compile(r"^[1-9][0-9]{0,4}$")
_NOT_IN_HOST = re.compile(r"[/@?#\\ \t]")

#: The common case, a complete CONNECT head in one segment with plain header
#: lines, is recognised by this strict pattern without building an h11
#: connection (a third of a tunnel's setup cost).  Anything it does not match
#: exactly (obs-fold, odd spacing, a body, a split head) goes to h11, which
#: decides.  Header values are visible ASCII with inner spaces or tabs, as
#: RFC 9110 field-content allows, minus obs-text.
_FAST_CONNECT = re.compile(
    rb"CONNECT ([!-~]{1,300}) HTTP/1\.[01]\r\n"
    rb"((?:[!#$%&'*+.^_`|~0-9A-Za-z-]+:[ \t]*(?:[!-~]+(?:[ \t]+[!-~]+)*)?[ \t]*\r\n){0,100})"
    rb"\r\n"
)
_BODY_HEADERS = re.compile(rb"(?im)^(content-length|transfer-encoding)[ \t]*:")

NOT_A_PROXY_REQUEST = (
    "this is the sandbox's egress proxy: it forwards http:// URLs (absolute-form requests) "
    "and tunnels everything else with CONNECT host:port"
)


def errorReply(status: int, text: str) -> bytes:
    """The plain-text error every refusal gets: status, text/plain, length, close."""
    body = (text + "\n").encode("utf-8", "replace")
    phrase = HTTPStatus(status).phrase
    head = (
        f"HTTP/1.1 {status} {phrase}\r\n"
        "Content-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def parseAuthority(target: str) -> tuple[str, int] | None:
    """``host:port`` or ``[v6]:port`` (CONNECT's authority form), else None."""
    if target.startswith("["):
        close = target.find("]")
        if close < 0 or target[close + 1 : close + 2] != ":":
            return None
        host, port = target[1:close], target[close + 2 :]
    else:
        host, sep, port = target.rpartition(":")
        if not sep or ":" in host:
            return None
    if not host or not _PORT.match(port) or int(port) > 65535:
        return None
    if _NOT_IN_HOST.search(host):
        return None
    return host, int(port)


def forwardedHeaders(headers: Any, drop: frozenset[bytes] = frozenset()) -> list[tuple[bytes, bytes]]:
    listed: set[bytes] = set()
    for name, value in headers:
        if name == b"connection":
            listed |= {t.strip().lower() for t in value.split(b",")}
    listed -= FRAMING
    return [
        (name, value)
        for name, value in headers
        if name not in HOP_BY_HOP
        and name not in listed
        and name not in drop
        and not name.startswith(b"proxy-")
    ]


class HTTPHandler:
    """Reads request heads with h11 and serves CONNECT and absolute-form forwarding."""

    kind = "http"

    def __init__(self, door: FrontDoor) -> None:
        self.door = door
        self._conn: h11.Connection | None = None
        self.exchange: ForwardExchange | None = None
        self.waiting = False
        self.closed = False

    @property
    def conn(self) -> h11.Connection:
        """The h11 connection, made on first use (a fast-path CONNECT never needs one)."""
        if self._conn is None:
            self._conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        return self._conn

    def dataReceived(self, data: bytes) -> None:
        if self.waiting:
            self.door.buffered(data)
            return
        if self._conn is None:
            m = _FAST_CONNECT.match(data)
            if m is not None and not _BODY_HEADERS.search(m.group(2)):
                self.door.cancelHeaderTimer()
                self.connect(m.group(1).decode("ascii"), data[m.end() :])
                return
        self.conn.receive_data(data)
        self.process()

    def readConnectionLost(self) -> None:
        if self.waiting:
            return
        self.conn.receive_data(b"")
        self.process()
        if self.exchange is None and not self.closed:
            self.door.transport.loseConnection()

    def connectionLost(self, reason: Failure) -> None:
        self.closed = True
        if self.exchange is not None:
            self.exchange.clientLost()

    def process(self) -> None:
        while not self.closed and not self.door.gone:
            if self.exchange is not None:
                self.exchange.pumpRequest()
                return
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError as e:
                self.fail(e.error_status_hint, f"not a valid HTTP request: {e}", parse=True)
                return
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if isinstance(event, h11.ConnectionClosed):
                self.closed = True
                self.door.transport.loseConnection()
                return
            if isinstance(event, h11.Request):
                self.onRequest(event)
                continue
            self.fail(400, f"unexpected {type(event).__name__}", parse=True)
            return

    def fail(self, status: int, text: str, parse: bool = False) -> None:
        self.closed = True
        answer = errorReply(status if status >= 400 else 400, text)
        if parse:
            self.door.parseError("http", text, answer)
        else:
            self.door.transport.write(answer)
            self.door.transport.loseConnection()

    def onRequest(self, request: h11.Request) -> None:
        self.door.cancelHeaderTimer()
        try:
            target = request.target.decode("ascii")
        except UnicodeDecodeError:
            self.fail(400, "the request target is not ASCII", parse=True)
            return
        if request.method == b"CONNECT":
            if parseAuthority(target) is None:
                self.fail(400, f"CONNECT wants host:port, not {target!r}", parse=True)
                return
            try:
                event = self.conn.next_event()
                while event is not h11.PAUSED and not isinstance(event, h11.EndOfMessage):
                    event = self.conn.next_event()
                    if event is h11.NEED_DATA:
                        raise h11.RemoteProtocolError("a CONNECT request with a body")
            except h11.RemoteProtocolError as e:
                self.fail(400, f"not a valid CONNECT request: {e}", parse=True)
                return
            leftover, _ = self.conn.trailing_data
            self.connect(target, bytes(leftover))
            return
        if target[:7].lower() == "http://":
            self.exchange = ForwardExchange(self, request, target)
            self.exchange.start()
            return
        self.fail(400, NOT_A_PROXY_REQUEST, parse=True)

    def connect(self, target: str, leftover: bytes) -> None:
        """A complete CONNECT head for ``target``; ``leftover`` is what the client sent after it."""
        authority = parseAuthority(target)
        if authority is None:
            self.fail(400, f"CONNECT wants host:port, not {target!r}", parse=True)
            return
        self.waiting = True
        self.door.buffered(leftover)
        host, port = authority
        self.door.openTunnel("connect", host, port, self._granted, self._refused)

    def _granted(self) -> None:
        self.door.transport.write(b"HTTP/1.1 200 Connection established\r\n\r\n")

    def _refused(self, refusal: Refusal) -> None:
        self.fail(refusal.status, refusal.reason)

    def exchangeDone(self, reusable: bool) -> None:
        self.exchange = None
        if self.closed or self.door.gone:
            return
        if reusable and self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
            self.conn.start_next_cycle()
            self.door.armHeaderTimer()
            self.process()
        else:
            self.closed = True
            self.door.transport.loseConnection()


class ForwardExchange:
    """One absolute-form request forwarded to its origin, its response streamed back."""

    def __init__(self, handler: HTTPHandler, request: h11.Request, target: str) -> None:
        self.handler = handler
        self.door = handler.door
        self.request = request
        self.target = target
        self.upstream: ForwardUpstream | None = None
        self.grant: Grant | None = None
        self.responseStarted = False
        self.status: int | None = None
        self.up = 0
        self.down = 0
        self.done = False
        self.requestDone = False
        self.clientClosed = False

    def start(self) -> None:
        parts = urlsplit(self.target)
        try:
            host = parts.hostname
            port = parts.port or 80
        except ValueError:
            host = None
            port = 0
        if not host or parts.scheme.lower() != "http":
            self.handler.exchange = None
            self.handler.fail(400, f"{self.target!r} is not an http:// URL with a host", parse=True)
            return
        self.host, self.port = host, port
        netloc = parts.netloc.rpartition("@")[2]
        self.authority = netloc.encode("ascii")
        path = parts.path or "/"
        self.path = (path + ("?" + parts.query if parts.query else "")).encode("ascii")
        self.door.transport.pauseProducing()
        factory = self.door.factory
        config = self.door.config
        d = factory.decide(config, host, port)
        d.addCallback(self._granted)
        d.addErrback(self._refused)

    def _granted(self, grant: Grant) -> Deferred[Any]:
        self.grant = grant
        factory = self.door.factory
        return factory.connect(self.door.config, grant, ForwardUpstream(self))

    def _refused(self, f: Failure) -> None:
        factory = self.door.factory
        if f.check(RefusalError):
            r: Refusal = refusalOf(f)
        else:
            factory.log.failure("egress: forward setup failed", f)
            r = Refusal("dial", "the proxy failed to set up the request")
        event = "refused" if r.kind == "policy" else "failed"
        factory.record(
            event,
            kind="http",
            client=self.door.client,
            host=getattr(self, "host", None),
            port=getattr(self, "port", None),
            reason=r.reason,
            allow=r.allow,
            address=r.address,
        )
        self.done = True
        self.handler.exchange = None
        if not self.door.gone:
            self.handler.fail(r.status, r.reason)

    # ---------------------------------------------------------------- upstream connected
    def upstreamReady(self, upstream: ForwardUpstream) -> None:
        if self.door.gone or self.done:
            upstream.transport.abortConnection()
            return
        self.upstream = upstream
        headers = forwardedHeaders(self.request.headers, drop=frozenset({b"host"}))
        headers.insert(0, (b"host", self.authority))
        headers.append((b"connection", b"close"))
        upstream.transport.write(
            upstream.conn.send(h11.Request(method=self.request.method, target=self.path, headers=headers))
        )
        client = self.door.transport
        client.registerProducer(upstream.transport, True)
        upstream.transport.registerProducer(client, True)
        client.resumeProducing()
        self.pumpRequest()

    def pumpRequest(self) -> None:
        up = self.upstream
        if up is None or self.done:
            return
        conn = self.handler.conn
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as e:
                self.abort(f"bad request body framing: {e}", parse=True)
                return
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            try:
                if isinstance(event, h11.Data):
                    self.up += len(event.data)
                    up.transport.write(up.conn.send(event))
                elif isinstance(event, h11.EndOfMessage):
                    up.transport.write(up.conn.send(h11.EndOfMessage()))
                    self.requestDone = True
                elif isinstance(event, h11.ConnectionClosed):
                    if not self.requestDone:
                        self.abort("the client closed during its request")
                        return
                    # A client that half-closes after its request still gets the response.
                    self.clientClosed = True
                    return
            except h11.LocalProtocolError as e:
                self.abort(f"request body does not match its framing: {e}", parse=True)
                return

    def pumpResponse(self) -> None:
        up = self.upstream
        if up is None or self.done:
            return
        server = self.handler.conn
        client = self.door.transport
        while not self.done:
            try:
                event = up.conn.next_event()
            except h11.RemoteProtocolError as e:
                self.upstreamFailed(f"{self.host} sent an invalid response: {e}")
                return
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            try:
                if isinstance(event, h11.InformationalResponse):
                    if event.status_code == 100:
                        client.write(server.send(h11.InformationalResponse(status_code=100, headers=[])))
                elif isinstance(event, h11.Response):
                    self.responseStarted = True
                    self.status = event.status_code
                    headers = forwardedHeaders(event.headers)
                    client.write(
                        server.send(
                            h11.Response(status_code=event.status_code, headers=headers, reason=event.reason)
                        )
                    )
                elif isinstance(event, h11.Data):
                    self.down += len(event.data)
                    client.write(server.send(event))
                elif isinstance(event, h11.EndOfMessage):
                    client.write(server.send(h11.EndOfMessage()))
                    self.finish(reusable=not self.clientClosed)
                    return
                elif isinstance(event, h11.ConnectionClosed):
                    self.upstreamFailed(f"{self.host} closed before the response ended")
                    return
            except h11.LocalProtocolError as e:
                self.upstreamFailed(f"cannot relay {self.host}'s response: {e}")
                return

    def upstreamLost(self, reason: Failure) -> None:
        if self.done:
            return
        self.upstreamFailed(f"{self.host} closed the connection: {reason.getErrorMessage()}")

    def upstreamFailed(self, why: str) -> None:
        if self.done:
            return
        if not self.responseStarted and not self.door.gone:
            self._end(why)
            self.handler.fail(502, why)
        else:
            self.abort(why)

    def clientLost(self) -> None:
        if not self.done:
            self.abort("the client went away")

    def abort(self, why: str, parse: bool = False) -> None:
        if self.done:
            return
        self._end(why)
        if self.upstream is not None:
            self.upstream.transport.abortConnection()
        if parse and not self.door.gone:
            self.handler.closed = True
            self.door.parseError("http", why, b"" if self.responseStarted else errorReply(400, why))
        elif not self.door.gone:
            self.handler.closed = True
            self.door.transport.abortConnection()

    def finish(self, reusable: bool) -> None:
        self._end(None)
        if self.upstream is not None:
            self.upstream.transport.loseConnection()
        self.handler.exchangeDone(reusable)

    def _end(self, why: str | None) -> None:
        self.done = True
        client = self.door.transport
        try:
            client.unregisterProducer()
            if self.upstream is not None:
                self.upstream.transport.unregisterProducer()
        except Exception:  # already torn down
            pass
        client.resumeProducing()
        grant = self.grant
        self.door.factory.record(
            "forward",
            kind="http",
            client=self.door.client,
            host=getattr(self, "host", None),
            port=getattr(self, "port", None),
            via=("parent" if grant is not None and grant.viaParent else "direct"),
            status=self.status,
            reason=why,
            up=self.up,
            down=self.down,
        )
        if self.handler.exchange is self and why is not None:
            self.handler.exchange = None


class ForwardUpstream(Protocol):
    """The origin side of one forwarded request."""

    transport: Any

    def __init__(self, exchange: ForwardExchange) -> None:
        self.exchange = exchange
        self.conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)

    def connectionMade(self) -> None:
        self.exchange.upstreamReady(self)

    def dataReceived(self, data: bytes) -> None:
        self.conn.receive_data(data)
        self.exchange.pumpResponse()

    def connectionLost(self, reason: Failure = Failure(ConnectionDone())) -> None:  # noqa: B008
        if not self.exchange.done:
            self.conn.receive_data(b"")
            self.exchange.pumpResponse()
            self.exchange.upstreamLost(reason)


@implementer(IHalfCloseableProtocol)
class ParentHandshake(Protocol):
    """CONNECT through the organisation's proxy, then hand the connection to ``inner``."""

    transport: Any

    def __init__(self, host: str, port: int, inner: Protocol) -> None:
        self.authority = (f"[{host}]:{port}" if ":" in host else f"{host}:{port}").encode("ascii")
        self.inner = inner
        self.ready: Deferred[Any] = Deferred()
        self.conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
        self.switched = False

    def connectionMade(self) -> None:
        request = h11.Request(method=b"CONNECT", target=self.authority, headers=[(b"host", self.authority)])
        self.transport.write(self.conn.send(request) + self.conn.send(h11.EndOfMessage()))

    def failed(self, f: Failure) -> None:
        if not self.ready.called:
            why = refusalOf(f).reason if f.check(RefusalError) else f.getErrorMessage()
            self.ready.errback(RefusalError(Refusal("parent", f"the parent proxy: {why}")))

    def dataReceived(self, data: bytes) -> None:
        if self.switched:
            self.inner.dataReceived(data)
            return
        self.conn.receive_data(data)
        try:
            event = self.conn.next_event()
        except h11.RemoteProtocolError as e:
            self._refuse(f"answered CONNECT {self.authority.decode()} with an invalid response ({e})")
            return
        if event is h11.NEED_DATA:
            return
        if not isinstance(event, h11.Response):
            self._refuse(f"answered CONNECT {self.authority.decode()} with {type(event).__name__}")
            return
        if not 200 <= event.status_code < 300:
            self._refuse(
                f"answered {event.status_code} {event.reason.decode('latin-1')} "
                f"to CONNECT {self.authority.decode()}"
            )
            return
        self.switched = True
        leftover, _ = self.conn.trailing_data
        self.dataReceived = self.inner.dataReceived  # type: ignore[method-assign]
        self.inner.makeConnection(self.transport)
        self.ready.callback(self.inner)
        if leftover:
            self.inner.dataReceived(bytes(leftover))

    def _refuse(self, why: str) -> None:
        self.transport.loseConnection()
        self.failed(Failure(RefusalError(Refusal("parent", why))))

    def readConnectionLost(self) -> None:
        if self.switched and IHalfCloseableProtocol.providedBy(self.inner):
            self.inner.readConnectionLost()
        else:
            self.transport.loseConnection()

    def writeConnectionLost(self) -> None:
        if self.switched and IHalfCloseableProtocol.providedBy(self.inner):
            self.inner.writeConnectionLost()

    def connectionLost(self, reason: Failure = Failure(ConnectionDone())) -> None:  # noqa: B008
        if self.switched:
            self.inner.connectionLost(reason)
        else:
            self.failed(Failure(RefusalError(Refusal("parent", f"closed before answering CONNECT ({reason.getErrorMessage()})"))))
