"""The HTTP side of the front door: CONNECT, absolute-form ``http://`` forwarding, errors.

Every byte of HTTP here is read with the house's one HTTP/1.1 grammar,
``http11.py``, the same module the terminated TLS path uses: so this path
refuses exactly what that one refuses (CL+TE, duplicate or list lengths, any
coding but ``chunked``, obs-fold, bare LF, controls in values, whitespace
before a colon, ...) with the same ``400 refused: <what>`` texts.

Below the protocol, the framers own the framing state, as on the
terminated path: the handler reads the client's requests with an
``http11.RequestFramer`` (one at a time: a pipelining client's next request
waits in it until the answer is done; CONNECT's leftover is what it held) and
each exchange reads its origin's response with an ``http11.ResponseFramer``
(expecting no upgrade: a ``101`` is refused).  The one body loop is theirs;
this module acts on the parts they hand back, and the audit record's
``up``/``down`` are their ``payload`` counts.

A request head is parsed whole before anything else happens.  CONNECT (HTTP/1.1
or 1.0, which Python 3.11's ``http.client`` sends; no body) opens a tunnel.
An absolute-form ``http://`` request (HTTP/1.1 only, exactly one ``Host``) is
forwarded: the head goes to the origin rebuilt from the parsed fields (the
hop-by-hop table, every ``Proxy-*`` and what ``Connection`` names dropped,
``Host`` made the URI's authority, ``Connection: close`` added, nothing else:
never a credential; tokens are injected only on the TLS path of issue 4).
A body is checked and passed as it is framed (counted by ``Content-Length``,
or chunk by chunk and re-framed), starting before the origin is dialled, so a
bad chunk in the first segment reaches no origin.  The response is read with
the same grammar and streamed back the same way, with back-pressure both
ways; towards the client the connection is kept alive.  ``Upgrade`` is not
forwarded on this path.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IHalfCloseableProtocol
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from zope.interface import implementer

from agentsandbox.allowlist import parseAuthority as rulesAuthority
from agentsandbox.egress.grant import Refusal, RefusalError, refusalOf
from agentsandbox.egress.http11 import (
    CHUNKED,
    END,
    UNTIL_CLOSE,
    Head,
    Part,
    Refused,
    RequestFramer,
    ResponseFramer,
    Started,
    forwardedLines,
    oneHost,
    takeResponseHead,
)
from agentsandbox.egress.interfaces import IDoorHandler, IFrontDoor
from agentsandbox.egress.nodelay import noDelay
from agentsandbox.egress.privates import writeNow
from agentsandbox.egress.sessions import passwordOf

if TYPE_CHECKING:
    from agentsandbox.egress.gate import Verdict
    from agentsandbox.egress.grant import Grant

#: A pipelining client may not run further ahead than this while we answer.
MAX_READ_AHEAD = 256 * 1024

_HOST_ONLY = frozenset({b"host"})

NOT_A_PROXY_REQUEST = (
    "this is the sandbox's egress proxy: it forwards http:// URLs (absolute-form requests) "
    "and tunnels everything else with CONNECT host:port"
)
ONLY_HTTP11 = Refused(505, "only HTTP/1.1 is forwarded through the sandbox's proxy")


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
    """``host:port`` or ``[v6]:port`` (CONNECT's authority form), else None: ``rules.parseAuthority``,
    the one reading ``agentsandbox check host`` uses too."""
    return rulesAuthority(target)


@implementer(IDoorHandler)
class HTTPHandler:
    """Reads the client's requests (an ``http11.RequestFramer``) and serves
    CONNECT and absolute-form forwarding.

    One exchange at a time: a pipelining client's next request waits in the
    framer until the response to the current one is done (``next``).
    """

    kind = "http"

    def __init__(self, door: IFrontDoor) -> None:
        self.door = door
        self.requests = RequestFramer()
        self.exchange: ForwardExchange | None = None
        self.closed = False
        self.clientDone = False  # the client half-closed
        self.aheadPaused = False

    def dataReceived(self, data: bytes) -> None:
        requests = self.requests
        if requests.switched:  # CONNECT: what the client sends goes to the door
            self.door.buffered(data)
            return
        if self.closed:
            return
        # (An upload body with nothing held comes back as ``data`` itself: no copy.)
        self._take(requests.feed(data))

    def readConnectionLost(self) -> None:
        if self.requests.switched:
            return
        self.clientDone = True
        exchange = self.exchange
        if exchange is not None and not exchange.requestDone:
            exchange.abort("the client closed during its request")
            return
        self._idle()

    def connectionLost(self, reason: Failure) -> None:
        self.closed = True
        if self.exchange is not None:
            self.exchange.clientLost()

    def _take(self, parts: list[Part]) -> None:
        """Act on the parts of the client's stream the framer handed back, in order.

        A head's own refusals (CONNECT with a body, not ``http://``, ...) come
        before its body's; the body bytes of one pass go on in one write, and
        none of them if the pass ends refused (the framer hands a refusal back
        last).  A new request's origin is dialled only after the body that came
        with its head was checked: a bad chunk in the first segment reaches no
        origin.
        """
        out: list[bytes] = []
        started: ForwardExchange | None = None
        for part in parts:
            if self.closed or self.door.gone:
                return
            if part.__class__ is bytes:
                out.append(part)
            elif part.__class__ is Started:
                self.onRequest(part.head)
                started = self.exchange
            elif isinstance(part, Refused):
                exchange = self.exchange
                if exchange is not None:
                    exchange.abort(part.text, parse=True, status=part.status)
                else:
                    self.fail(part.status, part.text, parse=True)
                return
        exchange = self.exchange
        if exchange is not None:
            if out:
                exchange.sendUp(out[0] if len(out) == 1 else b"".join(out))
            if exchange is started and not exchange.done:
                exchange.dial()
        if self.exchange is not None:
            self.checkAhead()
        else:
            self._idle()

    def checkAhead(self) -> None:
        """Stop reading a pipelining client that runs too far ahead of its answers."""
        if (
            self.exchange is not None
            and self.requests.ahead > MAX_READ_AHEAD
            and not self.aheadPaused
            and not self.closed
            and not self.door.gone
        ):
            self.aheadPaused = True
            self.door.transport.pauseProducing()

    def _idle(self) -> None:
        """With no exchange, at the client's EOF: close, or refuse the head it cut short."""
        if self.exchange is not None or not self.clientDone or self.closed or self.door.gone:
            return
        if self.requests.buffered:
            self.fail(400, "refused: the connection ended inside a request head", parse=True)
        else:
            self.closed = True
            self.door.transport.loseConnection()

    def fail(self, status: int, text: str, parse: bool = False) -> None:
        self.closed = True
        answer = errorReply(status if status >= 400 else 400, text)
        if parse:
            self.door.parseError("http", text, answer)
        else:
            self.door.transport.write(answer)
            self.door.transport.loseConnection()

    def onRequest(self, head: Head) -> None:
        self.door.cancelHeaderTimer()
        method, rawTarget = head.start
        target = rawTarget.decode("ascii")  # the grammar admits visible ASCII only
        given = head.values(b"proxy-authorization")
        refused = self.door.sessionRefusal(
            "connect" if method == b"CONNECT" else "http", passwordOf(given[0]) if len(given) == 1 else None
        )
        if refused is not None:
            self.fail(407, refused)
            return
        if method == b"CONNECT":
            if head.chunked or head.length:
                self.fail(400, "refused: a CONNECT request with a body", parse=True)
                return
            self.connect(target)
            return
        if target[:7].lower() != "http://":
            self.fail(400, NOT_A_PROXY_REQUEST, parse=True)
            return
        if head.minor != 1:
            self.fail(ONLY_HTTP11.status, ONLY_HTTP11.text, parse=True)
            return
        try:
            oneHost(head)
        except Refused as e:
            self.fail(e.status, e.text, parse=True)
            return
        exchange = ForwardExchange(self, head, target)
        self.exchange = exchange
        exchange.start()

    def connect(self, target: str) -> None:
        """A complete CONNECT head for ``target``: the framer switches, and
        what the client sent after the head goes to the door."""
        authority = parseAuthority(target)
        if authority is None:
            self.fail(400, f"CONNECT wants host:port, not {target!r}", parse=True)
            return
        self.door.buffered(self.requests.switch())
        host, port = authority
        self.door.openTunnel("connect", host, port, self._granted, self._refused)

    def _granted(self) -> None:
        writeNow(self.door.transport, b"HTTP/1.1 200 Connection established\r\n\r\n")

    def _refused(self, refusal: Refusal) -> None:
        self.fail(refusal.status, refusal.reason)

    def exchangeDone(self, reusable: bool) -> None:
        self.exchange = None
        if self.closed or self.door.gone:
            return
        if not reusable:
            self.closed = True
            self.door.transport.loseConnection()
            return
        if self.aheadPaused:
            self.aheadPaused = False
            self.door.transport.resumeProducing()
        self.door.armHeaderTimer()
        self._take(self.requests.next())


class ForwardExchange:
    """One absolute-form request forwarded to its origin, its response streamed back.

    The request is read by the handler's ``RequestFramer``, the response by
    this exchange's own ``ResponseFramer``; what is done and how many body
    bytes passed are theirs to say.
    """

    def __init__(self, handler: HTTPHandler, head: Head, target: str) -> None:
        self.handler = handler
        self.door = handler.door
        self.head = head
        self.method = head.start[0]
        self.target = target
        self.upstream: ForwardUpstream | None = None
        self.grant: Grant | None = None
        self.host: str | None = None
        self.port: int | None = None
        # (HTTP/1.1 only here, so: the request said Connection: close.)
        self.closeAfter = handler.requests.closing
        self.queued: list[bytes] = []  # for the origin, until it is connected
        self.responses = ResponseFramer()
        self.status: int | None = None  # of the final response, once its head is read
        self.done = False

    @property
    def requestDone(self) -> bool:
        """The request was read to its end (while this is the handler's exchange)."""
        return self.handler.requests.waiting

    @property
    def responseStarted(self) -> bool:
        """The final response's head went to the client."""
        return self.status is not None

    # ---------------------------------------------------------------- the request
    def start(self) -> None:
        """Check the URL and queue the head for the origin (``dial`` follows)."""
        # The URL's authority is read by the same parser as CONNECT's (port 80
        # when absent): urlsplit would read ':0' as "no port" (so 80) and
        # ':0080' as 80 while the origin is sent the authority as written.
        try:
            parts = urlsplit(self.target)
        except ValueError:  # "Invalid IPv6 URL"
            parts = urlsplit("http:")
        netloc = parts.netloc.rpartition("@")[2]
        parsed = None
        if netloc.startswith("[") or netloc.count(":") <= 1:
            parsed = rulesAuthority(netloc, 80)
        host, port = parsed if parsed is not None else (None, 0)
        if not host:  # (the scheme is http: onRequest checked)
            self.done = True
            self.handler.exchange = None
            self.handler.fail(400, f"{self.target!r} is not an http:// URL with a host", parse=True)
            return
        self.host, self.port = host, port
        authority = netloc.encode("ascii")
        path = (parts.path or "/") + ("?" + parts.query if parts.query else "")
        head = self.head
        lines = [self.method, b" ", path.encode("ascii"), b" HTTP/1.1\r\nhost: ", authority, b"\r\n"]
        lines.append(forwardedLines(head, _HOST_ONLY))
        if head.chunked:
            lines.append(b"transfer-encoding: chunked\r\n")
        lines.append(b"connection: close\r\n\r\n")
        self.queued.append(b"".join(lines))

    def dial(self) -> None:
        """Decide and dial the origin (the handler calls this once the body
        that came with the head was checked and queued)."""
        host, port = self.host, self.port
        assert host is not None and port is not None  # (start read them)
        self.door.transport.pauseProducing()
        self.door.decide(host, port, False, self._decided, "forward")

    def sendUp(self, data: bytes) -> None:
        """Request body bytes the framer passed: to the origin, or queued until it is connected."""
        if self.done:
            return
        upstream = self.upstream
        if upstream is None:
            self.queued.append(data)
        else:
            writeNow(upstream.transport, data)

    def _decided(self, verdict: Verdict) -> None:
        if isinstance(verdict, Refusal):
            self._refused(verdict)
            return
        self.grant = verdict
        self.door.connect(verdict, ForwardUpstream(self)).addErrback(self._dialFailed)

    def _dialFailed(self, f: Failure) -> None:
        # The dial's errback carries a RefusalError (could not connect, the parent said no).
        if f.check(RefusalError):
            self._refused(refusalOf(f))
            return
        self.door.logFailure("forward setup failed", f)
        self._refused(Refusal("dial", "the proxy failed to set up the request"))

    def _refused(self, r: Refusal) -> None:
        if self.done:
            return
        event = "refused" if r.kind == "policy" else "failed"
        self.door.record(
            event,
            kind="http",
            client=self.door.client,
            host=self.host,
            port=self.port,
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
        # (No upgrade is asked for on this path: a 101 is refused.)
        self.responses.expect(self.method)
        queued, self.queued = self.queued, []
        writeNow(upstream.transport, b"".join(queued))
        client = self.door.transport
        client.registerProducer(upstream.transport, True)
        upstream.transport.registerProducer(client, True)
        client.resumeProducing()
        self.handler.checkAhead()

    # ---------------------------------------------------------------- the response
    def fromUpstream(self, data: bytes) -> None:
        if self.done:
            return
        parts = self.responses.feed(data)
        if len(parts) == 1 and parts[0].__class__ is bytes:
            writeNow(self.door.transport, parts[0])  # a read of body (often ``data`` itself)
            return
        out: list[bytes] = []
        ended = False
        why = None
        for part in parts:
            if part.__class__ is bytes:
                out.append(part)
            elif part.__class__ is Started:
                out.append(self._responseHead(part))
            elif part is END:
                # (What follows was never asked for: the origin is closed.)
                ended = True
                break
            elif isinstance(part, Refused):
                why = part.why
        if out:
            writeNow(self.door.transport, out[0] if len(out) == 1 else b"".join(out))
        if why is not None:
            self.upstreamFailed(f"{self.host} sent an invalid response: {why}")
        elif ended:
            self._responseEnded()

    def _responseHead(self, started: Started) -> bytes:
        """The head the client gets for a response head the framer read."""
        head = started.head
        status, reason = head.start
        if started.informational:  # (never a 101: the framer refuses one nobody asked for)
            return b"HTTP/1.1 %b %b\r\n%b\r\n" % (status, reason, forwardedLines(head))
        framing = started.framing
        extra = b""
        if framing is UNTIL_CLOSE:
            # Delimited by the origin closing: so is the client's copy.
            self.closeAfter = True
            extra = b"connection: close\r\n"
        else:
            if framing is CHUNKED:
                extra = b"transfer-encoding: chunked\r\n"
            if self.closeAfter:
                extra += b"connection: close\r\n"
        self.status = int(status)
        return b"HTTP/1.1 %b %b\r\n%b%b\r\n" % (status, reason, forwardedLines(head), extra)

    def _responseEnded(self) -> None:
        self.finish(reusable=self.requestDone and not self.closeAfter)

    def upstreamLost(self, reason: Failure) -> None:
        if self.done:
            return
        # A body delimited by the close ends cleanly only on ConnectionDone.
        if self.responses.closed(reason.check(ConnectionDone) is not None):
            self._responseEnded()
            return
        self.upstreamFailed(f"{self.host} closed the connection: {reason.getErrorMessage()}")

    def upstreamFailed(self, why: str) -> None:
        if self.done:
            return
        if not self.responseStarted and not self.door.gone:
            self._end(why)
            if self.upstream is not None:
                self.upstream.transport.abortConnection()
            self.handler.fail(502, why)
        else:
            self.abort(why)

    def clientLost(self) -> None:
        if not self.done:
            self.abort("the client went away")

    def abort(self, why: str, parse: bool = False, status: int = 400) -> None:
        if self.done:
            return
        self._end(why)
        if self.upstream is not None:
            self.upstream.transport.abortConnection()
        if self.door.gone:
            return
        self.handler.closed = True
        if parse:
            self.door.parseError("http", why, b"" if self.responseStarted else errorReply(status, why))
        else:
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
        self.door.record(
            "forward",
            kind="http",
            client=self.door.client,
            host=self.host,
            port=self.port,
            via=("parent" if grant is not None and grant.viaParent else "direct"),
            status=self.status,
            reason=why,
            # Payload bytes of the bodies (the chunked framing not counted):
            # the framers still hold this exchange's request and response.
            up=self.handler.requests.payload,
            down=self.responses.payload,
        )
        if self.handler.exchange is self and why is not None:
            self.handler.exchange = None


class ForwardUpstream(Protocol):
    """The origin side of one forwarded request."""

    transport: Any

    def __init__(self, exchange: ForwardExchange) -> None:
        self.exchange = exchange

    def connectionMade(self) -> None:
        noDelay(self.transport)
        self.exchange.upstreamReady(self)

    def dataReceived(self, data: bytes) -> None:
        self.exchange.fromUpstream(data)

    def connectionLost(self, reason: Failure = Failure(ConnectionDone())) -> None:  # noqa: B008
        self.exchange.upstreamLost(reason)


@implementer(IHalfCloseableProtocol)
class ParentHandshake(Protocol):
    """CONNECT through the organisation's proxy, then hand the connection to ``inner``."""

    transport: Any

    def __init__(self, host: str, port: int, inner: Protocol) -> None:
        self.authority = (f"[{host}]:{port}" if ":" in host else f"{host}:{port}").encode("ascii")
        self.inner = inner
        self.ready: Deferred[Any] = Deferred()
        self.buf = bytearray()
        self.switched = False

    def connectionMade(self) -> None:
        noDelay(self.transport)
        writeNow(self.transport, b"CONNECT %b HTTP/1.1\r\nhost: %b\r\n\r\n" % (self.authority, self.authority))

    def failed(self, f: Failure) -> None:
        if not self.ready.called:
            why = refusalOf(f).reason if f.check(RefusalError) else f.getErrorMessage()
            self.ready.errback(RefusalError(Refusal("parent", f"the parent proxy: {why}")))

    def dataReceived(self, data: bytes) -> None:
        if self.switched:
            self.inner.dataReceived(data)
            return
        self.buf += data
        try:
            head = takeResponseHead(self.buf)
        except Refused as e:
            self._refuse(f"answered CONNECT {self.authority.decode()} with an invalid response ({e.why})")
            return
        if head is None:
            return
        status, reason = head.start
        if not status.startswith(b"2"):
            self._refuse(
                f"answered {status.decode()} {reason.decode('latin-1')} to CONNECT {self.authority.decode()}"
            )
            return
        self.switched = True
        leftover = self.buf
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
