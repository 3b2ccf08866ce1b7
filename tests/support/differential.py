"""The differential tests' shared parts: h11 as the reference reader, the
injector's reading of the same bytes, the checks that compare them, and the
hypothesis strategies that generate the streams (valid and near-valid HTTP/1.1).

Used by ``test_inject_differential.py`` (the injector against h11, whose
docstring says what is checked and why), ``test_http11_differential.py``
(``http11``'s framers and the forward path against h11) and
``test_egress_framing.py``.
"""

from __future__ import annotations

import ipaddress
import signal
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import h11
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from twisted.internet.error import ConnectionDone, ConnectionLost
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from zope.interface.verify import verifyObject

from agentsandbox.config import EnvSource, InjectRule
from agentsandbox.egress.http11 import END, MAX_HEAD, Part, Started
from agentsandbox.egress.inject import IUpstreamPool, Route, _Tunnel
from agentsandbox.egress.testing import FixedToken, MemoryUpstreamPool, memoryTunnel

HOST = "api.example.com"
HOST_BYTES = HOST.encode("ascii")
TOKEN = "differential-t0k3n"
# A rule with a header of its own (not Authorization), so removing the
# client's copy of the rule's header is part of what is checked.
RULE = InjectRule(
    hosts=(HOST,), header="X-Api-Key", format="{token}", token=EnvSource(env="UNUSED")
)
ADDRESS = ipaddress.ip_address("127.0.0.1")

#: What the upstream answers each forwarded request with, so the injector
#: moves on to a pipelined next request.
NEXT_PLEASE = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"

EXAMPLES = settings(
    max_examples=2_000,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)

#: Request headers the injector removes or sets on purpose (RFC 9110 §7.6.1's
#: hop-by-hop fields, the client's credentials and the rule's own header,
#: Host, the proxy's own fields, and Accept-Encoding, set to identity so a
#: response can be searched for the token); everything else must arrive as sent.
REQUEST_EXEMPT = frozenset(
    {
        b"host",
        b"accept-encoding",
        b"authorization",
        b"x-api-key",
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authorization",
        b"proxy-authenticate",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
#: Framing and hop-by-hop field names spelled with "_": h11 reads each as an
#: ordinary field; every reader here refuses it on purpose (issue 23).
SPELLED_WITH_UNDERSCORE = frozenset(
    {
        b"content_length",
        b"transfer_encoding",
        b"keep_alive",
        b"proxy_authenticate",
        b"proxy_authorization",
        b"proxy_connection",
    }
)
#: How that refusal's text ends.
UNDERSCORE_REFUSAL = "where _ is taken for -"


def refusedOnPurpose(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether h11's reading of a message holds a field every reader here refuses on purpose."""
    return any(n in SPELLED_WITH_UNDERSCORE for n, _ in headers)


def refusal(why: str, stream: bytes) -> str:
    """The tally's name for a refusal of what h11 reads: ``why``, or the class refused on
    purpose, which is given only to a stream holding a field line of that class."""
    if UNDERSCORE_REFUSAL not in why:
        return why
    low = stream.lower()
    assert any(b"\r\n" + name + b":" in low for name in SPELLED_WITH_UNDERSCORE), (
        f"refused for a name spelled with _ that the stream does not hold: {why}"
    )
    return "on purpose, a framing or hop-by-hop name spelled with _"


RESPONSE_EXEMPT = frozenset(
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


# ---------------------------------------------------------------------- the injector, in memory


def _terminated() -> tuple[MemoryUpstreamPool, _Tunnel, StringTransport]:
    injector = MemoryUpstreamPool()
    verifyObject(IUpstreamPool, injector)
    tunnel, client = memoryTunnel(injector, Route(HOST, RULE, FixedToken(TOKEN)), (ADDRESS,))
    return injector, tunnel, client


def _awaitsItsAnswer(tunnel: _Tunnel) -> bool:
    """A request fully forwarded, its response not yet all read."""
    exchange = tunnel._exchange
    return exchange is not None and exchange.requestDone and not exchange.responseDone


@dataclass
class OursOnRequests:
    upstream: bytes  # everything the injector sent upstream, in order
    ends: list[int]  # per request it finished forwarding: the client stream offset just past it
    refused: str | None  # the first line of its error answer, when it refused


def oursOnRequests(pieces: list[bytes]) -> OursOnRequests:
    """Feed the client's bytes, in ``pieces``, to a terminated tunnel, answering
    each request it forwards with ``NEXT_PLEASE`` so it reads the next."""
    injector, tunnel, client = _terminated()
    refusals: list[str] = []
    refuse = tunnel._refuse

    def recordRefusal(status: int, text: str) -> None:
        refusals.append(f"{status} {text}")
        refuse(status, text)

    tunnel._refuse = recordRefusal  # type: ignore[method-assign]
    total = 0
    for piece in pieces:
        if client.disconnecting:
            break
        total += len(piece)
        tunnel.dataReceived(piece)
    ends: list[int] = []
    # A request fully forwarded and waiting for its answer: the injector reads
    # nothing past it until then, so what it holds starts the next request.
    while not client.disconnecting and _awaitsItsAnswer(tunnel):
        assert len(injector.upstreams) == 1
        ends.append(total - tunnel._requests.buffered)
        injector.upstreams[0].dataReceived(NEXT_PLEASE)
    assert len(injector.upstreams) <= 1, "one client connection holds one upstream connection"
    sent = injector.upstreams[0].transport.value() if injector.upstreams else b""  # type: ignore[union-attr]
    return OursOnRequests(sent, ends, refusals[0] if refusals else None)


@dataclass
class OursOnResponse:
    toClient: bytes
    clientClosed: bool  # the injector closed the client's connection (cleanly)
    clientCut: bool  # ... or aborted it
    started: bool  # a final response head from the upstream went to the client
    end: int | None  # the upstream stream offset just past the response, when it ended one


def oursOnResponse(method: bytes, pieces: list[bytes], eof: bool) -> OursOnResponse:
    """Send one request of ``method`` through a terminated tunnel, then feed the
    upstream's ``pieces`` (and its clean close when ``eof``)."""
    injector, tunnel, client = _terminated()
    length = b"content-length: 0\r\n" if method == b"POST" else b""
    tunnel.dataReceived(
        method + b" /r HTTP/1.1\r\nhost: " + HOST_BYTES + b"\r\n" + length + b"\r\n"
    )
    assert len(injector.upstreams) == 1, client.value()
    upstream = injector.upstreams[0]
    transport: StringTransport = upstream.transport  # type: ignore[assignment]
    fed = 0
    starts: list[bool] = []
    ends: list[int] = []
    original = tunnel.fromUpstream

    def fromUpstream(parts: list[Part]) -> None:
        if any(isinstance(p, Started) and not p.informational for p in parts):
            starts.append(True)
        if END in parts:
            ends.append(fed - upstream._responses.buffered)
        original(parts)

    tunnel.fromUpstream = fromUpstream  # type: ignore[method-assign]
    for piece in pieces:
        if transport.disconnecting:
            break
        fed += len(piece)
        upstream.dataReceived(piece)
    # What the reactor would do next: tell the protocol its connection ended.
    if transport.disconnected:
        upstream.connectionLost(Failure(ConnectionLost("aborted")))
    elif eof:
        upstream.connectionLost(Failure(ConnectionDone()))
    return OursOnResponse(
        client.value(),
        client.disconnecting and not client.disconnected,
        client.disconnected,
        bool(starts),
        ends[0] if ends else None,
    )


# ---------------------------------------------------------------------- h11's reading


@dataclass
class Message:
    head: Any  # h11.Request or h11.Response
    informational: list[Any] = field(default_factory=list)
    body: bytes = b""
    end: int | None = None  # offset just past the message, once h11 saw all of it


@dataclass
class H11Reading:
    messages: list[Message]
    error: str | None


def _events(conn: h11.Connection, data: bytes, eof: bool, onEnd: Callable[[], bool]) -> H11Reading:
    messages: list[Message] = []
    informational: list[Any] = []
    if data:
        conn.receive_data(data)  # (b"" would mean EOF)
    closed = False
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as e:
            if informational:
                messages.append(Message(None, informational))
            return H11Reading(messages, str(e))
        if event is h11.NEED_DATA:
            if eof and not closed:
                closed = True
                conn.receive_data(b"")
                continue
            break
        if event is h11.PAUSED or isinstance(event, h11.ConnectionClosed):
            break
        if isinstance(event, h11.InformationalResponse):
            informational.append(event)
        elif isinstance(event, (h11.Request, h11.Response)):
            messages.append(Message(event, informational))
            informational = []
        elif isinstance(event, h11.Data):
            messages[-1].body += bytes(event.data)
        elif isinstance(event, h11.EndOfMessage):
            messages[-1].end = len(data) - len(conn.trailing_data[0])
            if not onEnd():
                break
    if informational:
        messages.append(Message(None, informational))
    return H11Reading(messages, None)


def h11Requests(data: bytes) -> H11Reading:
    """h11 as the server reads ``data``, answering each request as the upstream does."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)

    def answer() -> bool:
        # Not a 2xx: that would accept a CONNECT's switch of protocols.
        conn.send(h11.Response(status_code=404, headers=[("content-length", "0")]))
        conn.send(h11.EndOfMessage())
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
            return True
        return False  # e.g. Connection: close; the injector reads no further either

    return _events(conn, data, False, answer)


def h11Response(method: bytes, data: bytes, eof: bool) -> H11Reading:
    """h11 as the client of a ``method`` request reads ``data`` (then EOF when ``eof``)."""
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
    headers = [("host", HOST)] + ([("content-length", "0")] if method == b"POST" else [])
    conn.send(h11.Request(method=method, target="/r", headers=headers))
    conn.send(h11.EndOfMessage())
    return _events(conn, data, eof, lambda: False)


def _connectionNamed(headers: list[tuple[bytes, bytes]]) -> set[bytes]:
    named = {t.strip().lower() for n, v in headers if n == b"connection" for t in v.split(b",")}
    # Framing is never hop-by-hop: a Content-Length must survive being named.
    return named - {b"content-length"}


def _kept(
    headers: list[tuple[bytes, bytes]], exempt: frozenset[bytes], named: set[bytes]
) -> list[tuple[bytes, bytes]]:
    return [
        (n, v)
        for n, v in headers
        if n not in exempt and n not in named and not n.startswith(b"proxy-")
    ]


def _headers(event: Any) -> list[tuple[bytes, bytes]]:
    return [(bytes(n), bytes(v)) for n, v in event.headers]


def originForm(target: bytes) -> bytes | None:
    """The target the tunnel's host should get, or None when it must be refused."""
    if target.startswith(b"/"):
        return target
    low = target.lower()
    for prefix in (b"https://" + HOST_BYTES + b":443", b"https://" + HOST_BYTES):
        rest = target[len(prefix) :]
        if low.startswith(prefix) and rest[:1] in (b"/", b""):
            return rest or b"/"
    return None


# ---------------------------------------------------------------------- generated streams
#
# Every choice has its usual form and odd ones (the near-valid cases).  Each
# generated stream draws how often its choices go odd: never, now and then, or
# often, so a run sees clean messages, messages with one oddity and garbage.

ODDNESS = st.sampled_from([0, 0, 40, 40, 12, 4])
ODD_EOLS = [b"\n", b"\r", b"\n\r", b""]
ODD_BYTES = [
    b"a",
    b"Z",
    b"0",
    b" ",
    b"\t",
    b"\x00",
    b"\x01",
    b"\x7f",
    b"\x80",
    b"\xff",
    b"\x0b",
    b"\x0c",
    b"\r",
    b"\n",
    b":",
    b",",
    b";",
    b'"',
]
oddBytes = st.lists(st.sampled_from(ODD_BYTES), max_size=6).map(b"".join)


def pick(draw: st.DrawFn, rate: int, usual: Any, odd: list[Any]) -> Any:
    """``usual`` (or one of a list of usual forms); with chance about 1/``rate``, one of ``odd``."""
    if rate and odd and draw(st.sampled_from(range(rate))) == rate - 1:
        return draw(st.sampled_from(odd))
    return draw(st.sampled_from(usual)) if isinstance(usual, list) else usual


def eol(draw: st.DrawFn, rate: int) -> bytes:
    return pick(draw, rate, b"\r\n", ODD_EOLS)  # type: ignore[no-any-return]


@st.composite
def chunkedBody(draw: st.DrawFn, rate: int) -> bytes:
    out = []
    for data in draw(st.lists(st.binary(min_size=1, max_size=20), max_size=3)):
        size = pick(
            draw,
            rate,
            [b"%x", b"%X", b"%04x"],
            [b"0x%x", b"+%x", b"-%x", b" %x", b"%x ", b"%x\t", b"%d", b"%025x", b"%x\x00"],
        )
        ext = pick(
            draw,
            rate,
            [b"", b"", b";a=b"],
            [
                b";a",
                b";",
                b" ;a=b",
                b"\t;x",
                b';a="q q"',
                b"; a",
                b";a\x01",
                b";a\rb",
                b";a ",
                b";a=b\t",
            ],
        )
        out.append(size % len(data) + ext + eol(draw, rate))
        out.append(data + pick(draw, rate, b"", [b"x"]))  # now and then a byte too long
        out.append(pick(draw, rate, b"\r\n", [b"\n", b"", b"XX", b"\r", b"\r\r\n"]))
    out.append(pick(draw, rate, b"0", [b"00", b"000", b"0 ", b"-0", b"0;x=y", b"0 ;x"]))
    out.append(eol(draw, rate))
    for _ in range(pick(draw, rate, 0, [1, 1, 2])):
        out.append(
            pick(
                draw,
                rate,
                b"X-Trailer: t",
                [
                    b"Bad Trailer: x",
                    b" folded",
                    b"X-Trailer:\x01",
                    b"X-T:a\rb",
                    b"Content-Length: 5",
                ],
            )
        )
        out.append(eol(draw, rate))
    out.append(eol(draw, rate))
    return b"".join(out)


@st.composite
def framedBody(draw: st.DrawFn, rate: int) -> tuple[list[bytes], bytes]:
    """(framing header lines, body): matching, near-matching or conflicting."""
    kind = pick(
        draw,
        rate,
        ["none", "length", "length", "chunked", "chunked"],
        ["both", "lengths", "codings"],
    )
    data = draw(st.binary(max_size=24))
    n = len(data)
    lengthValue = pick(
        draw,
        rate,
        b"%d",
        [
            b"0%d",
            b"+%d",
            b"-%d",
            b" %d ",
            b"%d, %d",
            b"%d,%d",
            b"0x%x",
            b"",
            b"%d.0",
            b"99999999999999999999",
            b"%d %d",
            b"1%d",
            b"%d\x00",
        ],
    )
    codingValue = pick(
        draw,
        rate,
        b"chunked",
        [
            b"Chunked",
            b"CHUNKED",
            b"gzip",
            b"gzip, chunked",
            b"chunked, chunked",
            b"identity",
            b" chunked\t",
            b"chunked;q=1",
            b"",
            b"chunked,",
        ],
    )
    lengthName = pick(
        draw,
        rate,
        [b"Content-Length", b"content-length"],
        [b"CONTENT-LENGTH", b"Content-Length ", b"Content_Length"],
    )
    codingName = pick(
        draw,
        rate,
        [b"Transfer-Encoding", b"transfer-encoding"],
        [b"TRANSFER-ENCODING", b"Transfer_Encoding"],
    )
    count = lengthValue.count(b"%")

    def length(v: int) -> bytes:
        return lengthName + b": " + (lengthValue % ((v,) * count) if count else lengthValue)  # type: ignore[no-any-return]

    if kind == "none":
        return [], b""
    if kind == "length":
        return [length(n)], data
    if kind == "lengths":
        return [length(n), length(draw(st.sampled_from([n, n + 1])))], data
    chunks = draw(chunkedBody(rate))
    coding = codingName + b": " + codingValue
    if kind == "chunked":
        return [coding], chunks
    if kind == "both":
        return [coding, length(len(chunks))], chunks
    return [coding, codingName + b": " + draw(st.sampled_from([b"chunked", b"gzip", b""]))], chunks


HEADER_NAMES = [
    b"X-Thing",
    b"X-Thing",
    b"Accept",
    b"User-Agent",
    b"Authorization",
    b"X-Api-Key",
    b"x-api-key",
    b"Proxy-Authorization",
    b"Proxy-Foo",
    b"Keep-Alive",
    b"TE",
    b"Trailer",
    b"Connection",
    b"Expect",
    b"Upgrade",
]
ODD_HEADER_NAMES = [b"X Bad", b"X\x01", b"", b"X-\xe9", b"X(y)", b"X-Thing "]
HEADER_VALUES = [
    b"v",
    b"a, b",
    b"close",
    b"keep-alive",
    b"x-thing",
    b"content-length",
    b"transfer-encoding",
    b"close, x-thing",
    b"Upgrade",
    b"websocket",
    b"100-continue",
    b"token zzz",
    b"host",
    b"x-api-key",
    b"",
]


@st.composite
def headerLine(draw: st.DrawFn, rate: int, names: list[bytes]) -> bytes:
    name = pick(draw, rate, names, ODD_HEADER_NAMES)
    sep = pick(draw, rate, b": ", [b":", b" :", b":\t", b":  ", b"\t:"])
    value = (
        draw(oddBytes) if pick(draw, rate, False, [True]) else draw(st.sampled_from(HEADER_VALUES))
    )
    line = name + sep + value + pick(draw, rate, b"", [b" ", b"\t"])
    if pick(draw, rate, False, [True]):
        line += eol(draw, rate) + draw(st.sampled_from([b" folded", b"\tfolded"]))
    return line  # type: ignore[no-any-return]


#: The terminated tunnel's targets: (usual, odd).
TUNNEL_TARGETS = (
    [b"/", b"/a/b?c=d", b"/%7e", b"https://api.example.com/x", b"https://API.example.com:443"],
    [
        b"*",
        b"https://api.example.com:8443/",
        b"https://api.example.com.example.net/",
        b"http://api.example.com/",
        b"/\xe9",
        b"/a b",
        b"//x",
        b"https://u@api.example.com/",
        b"",
        b"/a\x7f",
    ],
)


@st.composite
def request(
    draw: st.DrawFn, rate: int, targets: tuple[list[bytes], list[bytes]] = TUNNEL_TARGETS
) -> bytes:
    method = pick(
        draw,
        rate,
        [b"GET", b"GET", b"POST", b"PUT", b"HEAD", b"DELETE", b"OPTIONS", b"PATCH"],
        [b"TRACE", b"CONNECT", b"get", b"G@T", b"M-SEARCH", b""],
    )
    target = pick(draw, rate, *targets)
    sp = pick(draw, rate, b" ", [b"  ", b"\t"])
    version = pick(
        draw,
        rate,
        b"HTTP/1.1",
        [
            b"HTTP/1.0",
            b"HTTP/2.0",
            b"HTTP/1.2",
            b"http/1.1",
            b"HTTP/1.1 ",
            b"HTTP/11",
            b" HTTP/1.1",
        ],
    )
    framing, content = draw(framedBody(rate))
    hosts = [
        b"Host: " + pick(draw, rate, HOST_BYTES, [b"example.net", b"", b"a b"])
        for _ in range(pick(draw, rate, 1, [0, 2]))
    ]
    others = draw(st.lists(headerLine(rate, HEADER_NAMES), max_size=4))
    head = pick(draw, rate, b"", [b"\r\n", b"\n", b" "])
    for text in [
        method + sp + target + b" " + version,
        *draw(st.permutations(hosts + framing + others)),
    ]:
        head += text + eol(draw, rate)
    return head + eol(draw, rate) + content  # type: ignore[no-any-return]


def _pieces(draw: st.DrawFn, stream: bytes) -> list[bytes]:
    """``stream`` cut where hypothesis says (where a read ends must not matter)."""
    cuts = sorted(set(draw(st.lists(st.integers(0, max(len(stream), 1)), max_size=3))))
    pieces, last = [], 0
    for cut in [*cuts, len(stream)]:
        if cut > last:
            pieces.append(stream[last:cut])
            last = cut
    return pieces


def _truncated(draw: st.DrawFn, stream: bytes) -> bytes:
    if draw(st.sampled_from([False] * 4 + [True])):
        return stream[: draw(st.integers(0, len(stream)))]
    return stream


@st.composite
def requestStream(
    draw: st.DrawFn, targets: tuple[list[bytes], list[bytes]] = TUNNEL_TARGETS
) -> tuple[bytes, list[bytes]]:
    rate = draw(ODDNESS)
    stream = _truncated(
        draw, b"".join(draw(st.lists(request(rate, targets), min_size=1, max_size=3)))
    )
    return stream, _pieces(draw, stream)


RESPONSE_HEADERS = [
    b"Server",
    b"Set-Cookie",
    b"X-Thing",
    b"Connection",
    b"Keep-Alive",
    b"Proxy-Authenticate",
    b"Trailer",
    b"Upgrade",
]


@st.composite
def responseHead(draw: st.DrawFn, rate: int, statuses: list[bytes]) -> bytes:
    version = pick(
        draw, rate, b"HTTP/1.1", [b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.2", b"http/1.1", b"HTTP/1.1 "]
    )
    status = pick(draw, rate, statuses, [b"099", b"2000", b"20", b"abc", b"600", b"101"])
    reason = pick(
        draw,
        rate,
        [b" OK", b" Not Found", b""],
        [b" ", b" \x01", b" \xff", b"  two  spaces", b"\tOK"],
    )
    return version + b" " + status + reason  # type: ignore[no-any-return]


@st.composite
def responseStream(draw: st.DrawFn) -> tuple[bytes, bytes, bool, list[bytes]]:
    rate = draw(ODDNESS)
    method = draw(st.sampled_from([b"GET", b"GET", b"HEAD", b"POST"]))
    stream = b""
    for _ in range(pick(draw, rate, 0, [1, 1, 2])):
        lines = [
            draw(responseHead(rate, [b"100", b"103"])),
            *draw(st.lists(headerLine(rate, RESPONSE_HEADERS), max_size=2)),
        ]
        stream += b"".join(text + eol(draw, rate) for text in lines) + eol(draw, rate)
    line = draw(responseHead(rate, [b"200", b"200", b"200", b"204", b"304", b"404", b"500"]))
    framing, content = draw(framedBody(rate))
    others = draw(st.lists(headerLine(rate, RESPONSE_HEADERS), max_size=3))
    for text in [line, *draw(st.permutations(framing + others))]:
        stream += text + eol(draw, rate)
    stream += eol(draw, rate) + content + pick(draw, rate, b"", [b"X", b"\r\n", NEXT_PLEASE])
    stream = _truncated(draw, stream)
    return method, stream, draw(st.booleans()), _pieces(draw, stream)


# ---------------------------------------------------------------------- the properties


def _report(capsys: pytest.CaptureFixture[str], title: str, tally: Counter[str]) -> None:
    with capsys.disabled():
        print(f"\n{title}")
        for why, count in tally.most_common():
            print(f"  {count:6d}  {why}")


def checkRequests(stream: bytes, pieces: list[bytes], tally: Counter[str]) -> None:
    want = h11Requests(stream)
    ours = oursOnRequests(pieces)
    sent = h11Requests(ours.upstream)
    assert sent.error is None, (
        f"h11 cannot read what the injector sent upstream: {sent.error}\n{ours.upstream!r}"
    )
    finished = [m for m in sent.messages if m.end is not None]
    assert len(finished) == len(ours.ends)
    for k, got in enumerate(sent.messages):
        assert k < len(want.messages), (
            f"the injector forwarded request {k + 1}, which h11 refuses: {want.error}"
        )
        expected = want.messages[k]
        assert got.head.method == expected.head.method
        assert got.head.target == originForm(bytes(expected.head.target))
        headers = _headers(expected.head)
        assert not refusedOnPurpose(headers), "the injector forwarded a framing name spelled with _"
        named = _connectionNamed(headers)
        forwarded = _headers(got.head)
        assert _kept(forwarded, REQUEST_EXEMPT, named) == _kept(headers, REQUEST_EXEMPT, named)
        assert [v for n, v in forwarded if n == b"host"] == [HOST_BYTES]
        assert [v for n, v in forwarded if n == b"x-api-key"] == [TOKEN.encode()]
        assert not [n for n, _ in forwarded if n in (b"authorization", b"proxy-authorization")]
        assert expected.body.startswith(got.body), (
            "the injector forwarded body bytes h11 does not read"
        )
        if got.end is not None:
            assert expected.end is not None, "the injector ended a request where h11 reads on"
            assert got.body == expected.body
            assert ours.ends[k] == expected.end, "the next request starts at another byte"
    for k, expected in enumerate(want.messages):
        if expected.end is None:
            continue
        if k < len(finished):
            tally["both accept"] += 1
        elif ours.refused is not None:
            tally["h11 accepts, ours refuses: " + refusal(ours.refused, stream)] += 1
        else:
            raise AssertionError(
                f"h11 read request {k + 1} to its end; the injector neither forwarded nor refused it"
            )
    if want.error is not None and not want.messages[len(finished) :]:
        tally["streams both refuse (after the requests counted above)"] += 1


def checkResponse(
    method: bytes, stream: bytes, eof: bool, pieces: list[bytes], tally: Counter[str]
) -> None:
    want = h11Response(method, stream, eof)
    ours = oursOnResponse(method, pieces, eof)
    got = h11Response(method, ours.toClient, ours.clientClosed)
    assert got.error is None, (
        f"h11 cannot read what the injector sent the client: {got.error}\n{ours.toClient!r}"
    )
    wanted = want.messages[0] if want.messages else Message(None)
    received = got.messages[0] if got.messages else Message(None)
    forwarded = [e.status_code for e in received.informational]
    assert forwarded == [e.status_code for e in wanted.informational[: len(forwarded)]], (
        "the injector forwarded an informational response h11 refuses"
    )
    if not ours.started:
        if received.head is not None:
            assert received.head.status_code == 502, received.head
            # (the error's text, read raw: the client of a HEAD reads no body)
            why = (
                "502 "
                + ours.toClient.rsplit(b"\r\n", 1)[-1].decode().strip().partition(f"{HOST}: ")[2]
            )
        else:
            why = "cut" if ours.clientCut else "still waits for the end of the head"
        if wanted.head is not None:
            tally["h11 accepts, ours refuses: " + refusal(why, stream)] += 1
        else:
            tally["both refuse or wait"] += 1
        return
    assert wanted.head is not None, (
        f"the injector forwarded a response head h11 refuses: {want.error}"
    )
    assert not refusedOnPurpose(_headers(wanted.head)), (
        "the injector forwarded a response with a framing name spelled with _"
    )
    assert received.head is not None
    assert received.head.status_code == wanted.head.status_code
    assert received.head.reason == wanted.head.reason
    headers = _headers(wanted.head)
    named = _connectionNamed(headers)
    assert _kept(_headers(received.head), RESPONSE_EXEMPT, named) == _kept(
        headers, RESPONSE_EXEMPT, named
    )
    assert wanted.body.startswith(received.body), (
        "the injector forwarded body bytes h11 does not read"
    )
    if ours.end is not None and not ours.clientCut:
        assert wanted.end is not None, "the injector ended a response where h11 reads on"
        assert ours.end == wanted.end, "the response ends at another byte"
        assert received.end is not None and received.body == wanted.body
        tally["both accept"] += 1
    elif wanted.end is not None:
        assert ours.clientCut, (
            "h11 read the response to its end; the injector neither ended nor cut it"
        )
        tally["h11 accepts, ours cuts the client"] += 1
    else:
        tally["both refuse or wait (mid-body)"] += 1


@contextmanager
def _watchdog(seconds: int) -> Iterator[None]:
    """Fail, rather than hang the suite, if the parser loops forever on a case."""

    def expired(signum: int, frame: Any) -> None:
        raise AssertionError(f"the injector did not return from one example within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
