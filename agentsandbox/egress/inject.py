"""TLS termination and header injection for the hosts that have an inject rule.

The proxy grants a tunnel to ``host:443`` and, when ``host`` has an inject
rule, hands the client's connection to ``Injector.terminate``.  From there:

1. The client gets our TLS: the host's leaf from the in-memory CA, whatever
   SNI it sent, ALPN ``http/1.1`` only (``tls.py``).
2. Each request head is checked strictly against RFC 9112's grammar in one
   regular-expression pass, with the framing refusals h11 is lenient about: a
   repeated or list-valued Content-Length, Content-Length with
   Transfer-Encoding, any Transfer-Encoding but ``chunked``, bare LF line ends,
   obsolete line folding, whitespace before a colon.  A refused head forwards
   nothing; chunked bodies are checked chunk by chunk and nothing of a pass
   over received bytes is forwarded unless all of it parsed.
3. Each request goes to the tunnel host whatever its ``Host`` header or
   absolute-form target says; every client ``Authorization`` (and the rule's
   own header) is removed, hop-by-hop headers are dropped, the rule's header
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

import re
import ssl
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from typing import Protocol as TypingProtocol

from service_identity import VerificationError
from twisted.internet import defer, endpoints
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
from agentsandbox.egress.interfaces import Dialer, ITerminator
from agentsandbox.egress.rules import IPAddress
from agentsandbox.egress.tls import InjectionCA, upstreamContext, verifyUpstream
from agentsandbox.egress.tlsstream import TLSHandshakeError, TLSStream

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

#: A pipelining client may not run further ahead than this while we answer.
MAX_READ_AHEAD = 256 * 1024
MAX_HEAD = 64 * 1024
#: A chunk-size line (size and extensions) longer than this is refused.
MAX_CHUNK_LINE = 4096

# RFC 9110/9112 grammar, checked over a whole head in one pass.  Field values
# are visible ASCII, obs-text, space and tab: no CR, LF, NUL or other control,
# so a bare LF, obsolete folding (a line starting with whitespace is not a
# token) and "Name : value" all fail the match.
_TOKEN = rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+"
_FIELDS = rb"(?:" + _TOKEN + rb":[\t \x21-\x7e\x80-\xff]*\r\n)*\r\n"
_REQUEST_HEAD = re.compile(rb"(" + _TOKEN + rb") ([\x21-\x7e]+) HTTP/1\.([01])\r\n" + _FIELDS)
_REQUEST_LINE = re.compile(rb"(" + _TOKEN + rb") ([\x21-\x7e]+) HTTP/1\.([01])")
_RESPONSE_HEAD = re.compile(rb"HTTP/1\.([01]) ([1-9][0-9][0-9])(?: ([\t \x21-\x7e\x80-\xff]*))?\r\n" + _FIELDS)
_FIELD_LINE = re.compile(_TOKEN + rb":[\t \x21-\x7e\x80-\xff]*")
_DIGITS = re.compile(rb"[0-9]{1,18}")
# Whitespace may follow the size or the extensions, never come between them:
# h11 refuses "5 ;ext" and this parser accepts nothing h11 refuses.
_CHUNK_LINE = re.compile(rb"([0-9A-Fa-f]{1,16})(?:;[\t \x21-\x7e\x80-\xff]*|[\t ]*)")


class Refused(Exception):
    """A message the injector will not forward: the HTTP status to answer and why."""

    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status = status
        self.why = why


@dataclass(frozen=True)
class Head:
    """A checked message head: start line, (lower-case name, value) fields, framing."""

    start: tuple[bytes, bytes]  # (method, target) of a request; (status, reason) of a response
    minor: int  # HTTP/1.<minor>
    fields: list[tuple[bytes, bytes]]
    length: int | None  # Content-Length, when given
    chunked: bool


def _fields(head: bytes) -> list[tuple[bytes, bytes]]:
    out = []
    for line in head.split(b"\r\n")[1:-2]:
        name, _, value = line.partition(b":")
        out.append((name.lower(), value.strip(b" \t")))
    return out


def _framing(fields: list[tuple[bytes, bytes]], refusal: int) -> tuple[int | None, bool]:
    """(Content-Length, chunked) from the fields, refusing every ambiguous shape."""
    lengths = [v for n, v in fields if n == b"content-length"]
    codings = [v for n, v in fields if n == b"transfer-encoding"]
    if not (lengths or codings):
        return None, False
    if lengths and codings:
        raise Refused(refusal, "Content-Length together with Transfer-Encoding")
    if len(lengths) > 1:
        raise Refused(refusal, "more than one Content-Length")
    if len(codings) > 1:
        raise Refused(refusal, "more than one Transfer-Encoding")
    if codings:
        if codings[0] != b"chunked":
            raise Refused(refusal, "a Transfer-Encoding other than exactly chunked")
        return None, True
    if _DIGITS.fullmatch(lengths[0]) is None:
        raise Refused(refusal, "a malformed Content-Length")
    return int(lengths[0]), False


def parseRequestHead(head: bytes) -> Head:
    """A request head (through its blank line), checked strictly, or ``Refused``."""
    match = _REQUEST_HEAD.fullmatch(head)
    if match is None:
        raise Refused(400, _whyMalformed(head))
    fields = _fields(head)
    length, chunked = _framing(fields, 400)
    return Head((match.group(1), match.group(2)), int(match.group(3)), fields, length, chunked)


def parseResponseHead(head: bytes) -> Head:
    """A response head (through its blank line), checked strictly, or ``Refused`` (502)."""
    match = _RESPONSE_HEAD.fullmatch(head)
    if match is None:
        raise Refused(502, "answered with a malformed response head")
    fields = _fields(head)
    length, chunked = _framing(fields, 502)
    return Head((match.group(2), match.group(3) or b""), int(match.group(1)), fields, length, chunked)


def _whyMalformed(head: bytes) -> str:
    if head.count(b"\n") != head.count(b"\r\n"):
        return "a header line ends in a bare LF"
    if b"\n " in head or b"\n\t" in head:
        return "obsolete line folding in the header"
    first, _, rest = head.partition(b"\r\n")
    if _REQUEST_LINE.fullmatch(first) is None:
        return "a malformed request line"
    for line in rest[:-4].split(b"\r\n") if rest[:-4] else ():
        if _FIELD_LINE.fullmatch(line) is None:
            if line.partition(b":")[0][-1:] in (b" ", b"\t"):
                return "whitespace before a header's colon"
            return "a malformed header line"
    return "a malformed request head"


def headAnomaly(head: bytes) -> str | None:
    """Why a request head is refused for its grammar or framing, or None."""
    try:
        parseRequestHead(head)
    except Refused as e:
        return e.why
    return None


class ChunkedBody:
    """Checks a chunked body as it streams, and re-frames it.

    Each run of chunk data goes out as a chunk of its own without extensions;
    the last chunk goes out as ``0\\r\\n\\r\\n`` (trailers are checked and
    dropped).  A malformed size line, a chunk not followed by CRLF, or a bad
    trailer raises ``Refused``.  The work is per chunk, not per byte.
    """

    _SIZE, _DATA, _DATA_END, _TRAILER, _DONE = range(5)

    def __init__(self, refusal: int) -> None:
        self._state = self._SIZE
        self._left = 0
        self._trailer = 0
        self._refusal = refusal

    @property
    def done(self) -> bool:
        return self._state == self._DONE

    def feed(self, buf: bytearray, out: list[bytes]) -> None:
        """Take what ``buf`` holds of the body (deleting it), appending re-framed bytes to ``out``."""
        pos = 0
        end = len(buf)
        refusal = self._refusal
        while pos < end:
            state = self._state
            if state == self._DATA:
                take = min(self._left, end - pos)
                out.append(b"%x\r\n%b\r\n" % (take, bytes(buf[pos : pos + take])))
                pos += take
                self._left -= take
                if not self._left:
                    self._state = self._DATA_END
            elif state == self._DATA_END:
                if end - pos < 2:
                    if buf[pos:end] != b"\r":
                        raise Refused(refusal, "a chunk not followed by CRLF")
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    raise Refused(refusal, "a chunk not followed by CRLF")
                pos += 2
                self._state = self._SIZE
            elif state == self._SIZE or state == self._TRAILER:
                nl = buf.find(b"\r\n", pos)
                if nl < 0:
                    tail = bytes(buf[pos:end])
                    if b"\n" in tail:
                        raise Refused(refusal, "a bare LF in the chunked body")
                    limit = MAX_CHUNK_LINE if state == self._SIZE else MAX_HEAD - self._trailer
                    if len(tail) > limit:
                        raise Refused(refusal, "an overlong line in the chunked body")
                    break
                line = bytes(buf[pos:nl])
                pos = nl + 2
                if state == self._SIZE:
                    match = _CHUNK_LINE.fullmatch(line)
                    if match is None:
                        raise Refused(refusal, "a malformed chunk size line")
                    size = int(match.group(1), 16)
                    if size:
                        self._left = size
                        self._state = self._DATA
                    else:
                        self._state = self._TRAILER
                elif not line:
                    out.append(b"0\r\n\r\n")
                    self._state = self._DONE
                    break
                else:
                    self._trailer += len(line) + 2
                    if _FIELD_LINE.fullmatch(line) is None or self._trailer > MAX_HEAD:
                        raise Refused(refusal, "a malformed trailer in the chunked body")
            else:
                break
        del buf[:pos]


class TokenHolder(TypingProtocol):
    """What a route needs of a token keeper (``tokens.TokenKeeper`` is one)."""

    def token(self) -> str | None: ...


@dataclass
class Route:
    """An injected host: its rule and where its token comes from."""

    host: str
    rule: InjectRule
    keeper: TokenHolder
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
    addresses to loopback); ``upstreamTrust`` is the upstream trust in PEM (the
    system's roots when None; tests pass their own CA here, never through
    config).
    """

    def __init__(
        self,
        ca: InjectionCA,
        routes: Mapping[str, Route],
        dialer: Dialer,
        reactor: IReactorTime,
        upstreamTrust: bytes | None = None,
        idleTimeout: float = 300.0,
        upstreamIdleTimeout: float = 60.0,
        handshakeTimeout: float = 30.0,
        poolSize: int = 8,
    ) -> None:
        self._reactor = reactor
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
        self.ca = ca
        self.routes: Mapping[str, Route] = {}
        self.swap(ca, routes)

    # ------------------------------------------------------------------ config

    def swap(self, ca: InjectionCA, routes: Mapping[str, Route]) -> None:
        """Take new rules (and the CA made for their hosts); open tunnels keep theirs."""
        if not set(routes) <= set(ca.hosts):
            missing = sorted(set(routes) - set(ca.hosts))
            raise ValueError(f"the CA is not constrained to {', '.join(missing)}")
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
        errors: list[str] = []

        def attempt(index: int) -> defer.Deferred[_Upstream]:
            if index >= len(addresses):
                why = "; ".join(errors) or "no address to dial"
                return defer.fail(UpstreamError(host, f"cannot connect ({why})"))
            address = addresses[index]
            upstream = _Upstream(self, host, address)
            if self._upstreamContext is None:
                self._upstreamContext = upstreamContext(self._upstreamTrust)
            tls = TLSStream(
                self._upstreamContext,
                upstream,
                serverSide=False,
                serverHostname=host,
                verify=verifyUpstream(host),
            )
            d: defer.Deferred[Any] = endpoints.connectProtocol(  # type: ignore[no-untyped-call,unused-ignore]
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


_CLOSED = Failure(ConnectionError("connection closed"))  # type: ignore[no-untyped-call,unused-ignore]


class UpstreamError(Exception):
    def __init__(self, host: str, why: str) -> None:
        super().__init__(f"{host}: {why}")
        self.host = host
        self.why = why


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


def _connectionTokens(fields: list[tuple[bytes, bytes]]) -> set[bytes]:
    return {t.strip().lower() for n, v in fields if n == b"connection" for t in v.split(b",")}


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
        self._clock = injector._reactor
        self._buf = bytearray()
        self._reads = _Reads()
        self._upstream: _Upstream | None = None
        self._queued: list[bytes] = []
        self._dialing = False
        self._method: bytes | None = None  # of a head not yet handed to an upstream
        self._forwarded = False  # some of the current request went upstream
        self._bodyLeft = 0
        self._chunked: ChunkedBody | None = None
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
                    chunked = self._chunked
                    if chunked is not None:
                        chunked.feed(buf, out)
                        if not chunked.done:
                            break  # what is left is part of a line: wait for the rest
                        self._chunked = None
                        self._requestDone = True
                    else:
                        take = min(self._bodyLeft, len(buf))
                        out.append(bytes(buf[:take]))
                        del buf[:take]
                        self._bodyLeft -= take
                        if not self._bodyLeft:
                            self._requestDone = True
                    if self._requestDone:
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
            self._refuse(e.status, f"refused: {e.why}")
            return
        if out and not self._closed:
            self._forward(out)

    def _startRequest(self, buf: bytearray, out: list[bytes]) -> bool:
        """Parse the next request head from ``buf`` into ``out``; False when it is not all here."""
        if buf and buf[0] in b"\r\n":
            # RFC 9112 §2.2 lets a server skip blank lines here, but h11 refuses
            # them, and this parser accepts nothing h11 refuses.
            raise Refused(400, "a blank line before the request line")
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > MAX_HEAD:
                raise Refused(431, f"a request head over {MAX_HEAD} bytes")
            if buf.count(b"\n") != buf.count(b"\r\n"):
                raise Refused(400, "a header line ends in a bare LF")
            return False
        if end + 4 > MAX_HEAD:
            raise Refused(431, f"a request head over {MAX_HEAD} bytes")
        head = parseRequestHead(bytes(buf[: end + 4]))
        del buf[: end + 4]
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
            if name in _HOP_BY_HOP:
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
            raise Refused(400, "a request needs exactly one Host header")
        closeAfter = upgrading = False
        if connection:
            named = _connectionTokens(head.fields)
            closeAfter = b"close" in named
            # Content-Length frames the body we forward: naming it in
            # Connection must not strip it (h11 frames by it regardless).
            dropped = named - {b"host", b"content-length"}
            if dropped & {n for n, _ in head.fields}:
                lines = lines[:5] + [
                    part
                    for n, v in head.fields
                    if n not in _HOP_BY_HOP and n != own and n not in dropped
                    for part in (n, b": ", v, b"\r\n")
                ]
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
        if head.chunked:
            self._chunked = ChunkedBody(400)
            self._requestDone = False
        elif head.length:
            self._bodyLeft = head.length
            self._requestDone = False
        else:
            self._requestDone = True
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
        why = failure.value.why if isinstance(failure.value, UpstreamError) else _lostWhy(failure)
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


_IDLE, _HEAD, _LENGTH, _CHUNKED, _UNTIL_CLOSE, _SWITCHED = range(6)
_NO_BODY_STATUSES = frozenset({b"204", b"304"})


@implementer(IHandshakeListener)
class _Upstream(Protocol):
    """One verified TLS connection to an injected host, speaking HTTP/1.1."""

    def __init__(self, injector: Injector, host: str, address: IPAddress) -> None:
        self._injector = injector
        self.host = host
        self.address = address
        self._clock = injector._reactor
        self._tunnel: _Tunnel | None = None
        self._reads = _Reads()
        self._buf = bytearray()
        self._state = _IDLE
        self._method = b""
        self._left = 0
        self._chunked: ChunkedBody | None = None
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
                if state is _LENGTH:
                    take = min(self._left, len(buf))
                    out.append(bytes(buf[:take]) if take < len(buf) else bytes(buf))
                    del buf[:take]
                    self._left -= take
                    if not self._left:
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
                elif state is _CHUNKED:
                    chunked = self._chunked
                    assert chunked is not None
                    chunked.feed(buf, out)
                    if not chunked.done:
                        break
                    self._chunked = None
                    self._state = _IDLE
                    ended = True
                elif state is _UNTIL_CLOSE:
                    out.append(bytes(buf))
                    buf.clear()
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
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > MAX_HEAD:
                raise Refused(502, f"answered with a head over {MAX_HEAD} bytes")
            return None
        head = parseResponseHead(bytes(buf[: end + 4]))
        del buf[: end + 4]
        status, reason = head.start
        tunnel = self._tunnel
        if status[0] == 0x31:  # 1xx
            if status == b"101":
                if tunnel is None or not tunnel._upgrading:
                    raise Refused(502, "switched protocols without being asked to")
                upgrade = [v for n, v in head.fields if n == b"upgrade"]
                if [v.lower() for v in upgrade] != [b"websocket"]:
                    raise Refused(502, "switched to something other than websocket")
                out.append(
                    b"HTTP/1.1 101 %b\r\n%bconnection: upgrade\r\nupgrade: %b\r\n\r\n"
                    % (reason, _responseFields(head), upgrade[0])
                )
                return _SWITCHED
            out.append(b"HTTP/1.1 %b %b\r\n%b\r\n" % (status, reason, _responseFields(head)))
            return _HEAD
        extra = b""
        if head.minor == 0 or b"close" in _connectionTokens(head.fields):
            self._mustClose = True
        if self._method == b"HEAD" or status in _NO_BODY_STATUSES:
            state = _IDLE
        elif head.chunked:
            self._chunked = ChunkedBody(502)
            state = _CHUNKED
            extra = b"transfer-encoding: chunked\r\n"
        elif head.length is not None:
            self._left = head.length
            state = _LENGTH if head.length else _IDLE
        else:
            # Delimited by the upstream closing: so is the client's copy.
            self._mustClose = True
            state = _UNTIL_CLOSE
            extra = b"connection: close\r\n"
            if tunnel is not None:
                tunnel._closeAfter = True
        if tunnel is not None and tunnel._closeAfter and state is not _UNTIL_CLOSE:
            extra += b"connection: close\r\n"
        out.append(b"HTTP/1.1 %b %b\r\n%b%b\r\n" % (status, reason, _responseFields(head), extra))
        self._state = state
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
            if self._state is _UNTIL_CLOSE and self._lostWhy is None and reason.check(ConnectionDone):
                # Only a close_notify ends a close-delimited body: a bare TCP
                # close may be a cut, which the client must see as one.
                self._state = _IDLE
                tunnel.fromUpstream(b"", False, True)
            tunnel.upstreamLost(self._lostWhy or _lostWhy(reason))
        waiters, self._lostWaiters = self._lostWaiters, []
        for d in waiters:
            d.callback(None)


def _responseFields(head: Head) -> bytes:
    """A response's fields as the client gets them: hop-by-hop ones and those
    its Connection header names dropped."""
    fields = head.fields
    drop: Any = _RESPONSE_HOP_BY_HOP
    for name, _ in fields:
        if name == b"connection":
            # Never Content-Length: the client's copy is framed by it.
            drop = _RESPONSE_HOP_BY_HOP | (_connectionTokens(fields) - {b"content-length"})
            break
    return b"".join([b"%b: %b\r\n" % (n, v) for n, v in fields if n not in drop])


_REASONS = {
    400: b"Bad Request",
    405: b"Method Not Allowed",
    413: b"Payload Too Large",
    431: b"Request Header Fields Too Large",
    501: b"Not Implemented",
    502: b"Bad Gateway",
    505: b"HTTP Version Not Supported",
}
