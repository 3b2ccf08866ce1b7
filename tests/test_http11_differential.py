"""The house's HTTP/1.1 grammar (``egress/http11.py``) and the forward path, differentially against h11.

``tests/test_inject_differential.py`` holds the terminated path to h11; this
module holds the other two readers of HTTP/1.1 to it, with the same generated
streams (valid and near-valid), the same h11 readings and the same rule:
never more permissive than h11, never a message framed differently.

* ``http11`` directly: a request stream read with its ``RequestFramer`` (and
  ``oneHost``), a response stream with its ``ResponseFramer``, the framers the
  terminated path's protocols sit on, with none of either path's own policy
  (HTTP/1.0, TRACE, any target, any header pass here).  Whenever ``http11``
  reads a message, h11 read the same one: start line, every field as h11
  reports it, body bytes and the byte where it ends.
* the plain ``http://`` forward path (``egress/http.py``) through the real
  front door on in-memory transports, each forwarded request on an upstream
  connection of its own.  What it sends the origin is read back with h11 (it
  must be HTTP/1.1 h11 reads, one request per connection); every request it
  forwarded is the one h11 read from the client: method, target (origin
  form), fields (but for the hop-by-hop ones and Host, set on purpose), body,
  and the byte where the next pipelined request starts.  Responses: what the
  client receives is read back with h11, and agrees with h11's reading of the
  origin's bytes (status, reason, fields, body, ended or not).

What h11 accepts and ours refuses is counted by our reason and printed; the
class refused on purpose (a framing or hop-by-hop name spelled with ``_``,
``tests/test_inject_differential.py``'s ``SPELLED_WITH_UNDERSCORE``) is never
read or forwarded, given only to streams that hold it, and counted apart.
Each property runs a fixed 2,000 derandomized examples (as many as the
terminated path's), no example database.  The version notes of
``tests/test_inject_differential.py`` hold here too.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.error import ConnectionDone, ConnectionLost
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure

from agentsandbox.egress.http import HTTPHandler
from agentsandbox.egress.http11 import (
    CHUNKED,
    END,
    Head,
    Part,
    Refused,
    RequestFramer,
    ResponseFramer,
    Started,
    oneHost,
)
from agentsandbox.egress.proxy import EgressProxyFactory
from agentsandbox.egress.testing import AllowAllPeers, FixedResolver, MemoryDialer
from tests.support.differential import (
    EXAMPLES,
    HOST,
    HOST_BYTES,
    NEXT_PLEASE,
    RESPONSE_EXEMPT,
    Message,
    _connectionNamed,
    _headers,
    _kept,
    _report,
    _watchdog,
    checkRequests,
    checkResponse,
    h11Requests,
    h11Response,
    refusal,
    refusedOnPurpose,
    requestStream,
    responseStream,
)
from tests.support.egress_fixtures import domainsToml, makeConfig

# ---------------------------------------------------------------------- http11 on its own


@dataclass
class Read:
    head: Head
    body: bytes = b""
    end: int | None = None  # the stream offset just past the message, once it ended


@dataclass
class Reading:
    messages: list[Read]
    informational: list[Head] = field(default_factory=list)
    refused: str | None = None


def _payload(out: list[bytes], chunked: bool) -> bytes:
    """The body bytes of what a framer put out (a chunked body is re-framed: undo it)."""
    if not chunked:
        return b"".join(out)
    data = b""
    for piece in out:
        if piece == b"0\r\n\r\n":
            continue
        size, _, rest = piece.partition(b"\r\n")
        assert rest.endswith(b"\r\n") and len(rest) - 2 == int(size, 16), piece
        data += rest[:-2]
    return data


class _Taking:
    """Collects a framer's parts into ``Read`` messages, noting where each ends."""

    def __init__(self, reading: Reading) -> None:
        self.reading = reading
        self.current: Read | None = None
        self.chunked = False

    def take(self, parts: list[Part], offset: int) -> bool:
        """Take ``parts``, the stream read up to ``offset``; False once refused."""
        for part in parts:
            if isinstance(part, Refused):
                self.reading.refused = f"{part.status} {part.why}"
                return False
            if isinstance(part, Started):
                if part.informational:
                    self.reading.informational.append(part.head)
                    continue
                self.current = Read(part.head)
                self.reading.messages.append(self.current)
                self.chunked = part.framing is CHUNKED
            elif part is END:
                assert self.current is not None
                self.current.end = offset
            elif isinstance(part, bytes):
                assert self.current is not None
                self.current.body += _payload([part], self.chunked)
        return True


def http11Requests(pieces: list[bytes]) -> Reading:
    """``pieces`` read as a server reads requests, with http11's ``RequestFramer``
    only (and ``oneHost``, which both paths ask).  Like h11, it reads no further
    than a message after which the connection must close (``Connection: close``,
    HTTP/1.0)."""
    reading = Reading([])
    framer = RequestFramer()
    taking = _Taking(reading)
    fed = 0
    try:
        for piece in pieces:
            fed += len(piece)
            parts = framer.feed(piece)
            while True:
                for part in parts:
                    if isinstance(part, Started):
                        oneHost(part.head)
                if not taking.take(parts, fed - framer.buffered):
                    return reading
                if not framer.waiting or framer.closing:
                    break
                parts = framer.next()
    except Refused as e:
        reading.refused = f"{e.status} {e.why}"
    return reading


def http11Response(method: bytes, pieces: list[bytes], eof: bool) -> Reading:
    """``pieces`` (then EOF when ``eof``) read as the client of a ``method``
    request reads its response, with http11's ``ResponseFramer`` only.  Neither
    path asks to switch protocols here, so the framer refuses a 101."""
    reading = Reading([])
    framer = ResponseFramer()
    framer.expect(method)
    taking = _Taking(reading)
    fed = 0
    for piece in pieces:
        fed += len(piece)
        if not taking.take(framer.feed(piece), fed - framer.buffered):
            return reading
        if reading.messages and reading.messages[0].end is not None:
            return reading  # what follows is not asked for: neither reader reads it
    if eof:
        taking.take(framer.closed(True), fed)
    return reading


def checkGrammarRequests(stream: bytes, pieces: list[bytes], tally: Counter[str]) -> None:
    want = h11Requests(stream)
    ours = http11Requests(pieces)
    for k, got in enumerate(ours.messages):
        assert k < len(want.messages), f"http11 read request {k + 1}, which h11 refuses: {want.error}"
        expected = want.messages[k]
        assert got.head.start == (bytes(expected.head.method), bytes(expected.head.target))
        assert list(got.head.fields) == _headers(expected.head)
        assert not refusedOnPurpose(_headers(expected.head)), "http11 read a framing name spelled with _"
        assert expected.body.startswith(got.body), "http11 read body bytes h11 does not"
        if got.end is not None:
            assert expected.end is not None, "http11 ended a request where h11 reads on"
            assert got.body == expected.body
            assert got.end == expected.end, "the next request starts at another byte"
    finished = [m for m in ours.messages if m.end is not None]
    for k, expected in enumerate(want.messages):
        if expected.end is None:
            continue
        if k < len(finished):
            tally["both accept"] += 1
        elif ours.refused is not None:
            tally["h11 accepts, http11 refuses: " + refusal(ours.refused, stream)] += 1
        else:
            raise AssertionError(f"h11 read request {k + 1} to its end; http11 neither read nor refused it")


def checkGrammarResponse(method: bytes, stream: bytes, eof: bool, pieces: list[bytes], tally: Counter[str]) -> None:
    want = h11Response(method, stream, eof)
    ours = http11Response(method, pieces, eof)
    wanted = want.messages[0] if want.messages else Message(None)
    statuses = [int(h.start[0]) for h in ours.informational]
    assert statuses == [e.status_code for e in wanted.informational[: len(statuses)]], (
        "http11 read an informational response h11 refuses"
    )
    if not ours.messages:
        if wanted.head is not None:
            tally[f"h11 accepts, http11 refuses: {refusal(ours.refused or 'waits', stream)}"] += 1
        else:
            tally["both refuse or wait"] += 1
        return
    got = ours.messages[0]
    assert wanted.head is not None, f"http11 read a response head h11 refuses: {want.error}"
    assert not refusedOnPurpose(_headers(wanted.head)), "http11 read a framing name spelled with _"
    assert int(got.head.start[0]) == wanted.head.status_code
    assert got.head.start[1] == bytes(wanted.head.reason)
    assert list(got.head.fields) == _headers(wanted.head)
    assert wanted.body.startswith(got.body), "http11 read body bytes h11 does not"
    if got.end is not None:
        assert wanted.end is not None, "http11 ended a response where h11 reads on"
        assert (got.body, got.end) == (wanted.body, wanted.end), "the response ends at another byte"
        tally["both accept"] += 1
    elif wanted.end is not None:
        assert ours.refused is not None, "h11 read the response to its end; http11 neither ended nor refused it"
        tally["h11 accepts, http11 refuses: " + refusal(ours.refused, stream)] += 1
    else:
        tally["both refuse or wait (mid-body)"] += 1


# ---------------------------------------------------------------------- the forward path, in memory

FORWARD_CONFIG = makeConfig(domainsToml([HOST]))
FORWARD_RESOLVER = FixedResolver({HOST: ["192.0.2.80"]})
#: Absolute-form targets, (usual, odd).
FORWARD_TARGETS = (
    [
        b"http://api.example.com/",
        b"http://api.example.com/a/b?c=d",
        b"http://API.example.com:80/%7e",
        b"http://api.example.com",
    ],
    [
        b"/",
        b"*",
        b"https://api.example.com/",
        b"http://api.example.com:8080/",
        b"http://u@api.example.com/x",
        b"http://api.example.com/a#f",
        b"http://api.example.com?q",
        b"http://[::1/",
        b"http:///x",
        b"HTTP://api.example.com/",
        b"",
    ],
)
#: Request fields the forward path removes or sets on purpose.
FORWARD_EXEMPT = RESPONSE_EXEMPT | {b"host", b"proxy-authorization"}


class _HalfCloseTransport(StringTransport):
    def loseWriteConnection(self) -> None:
        self.disconnecting = True


def _door() -> tuple[Any, StringTransport, list[Any]]:
    upstreams: list[Any] = []
    factory = EgressProxyFactory(
        FORWARD_CONFIG,
        Clock(),
        resolver=FORWARD_RESOLVER,
        dialer=MemoryDialer(upstreams),
        peers=AllowAllPeers(),
    )
    door = factory.buildProtocol(None)
    client = _HalfCloseTransport()
    door.makeConnection(client)
    return door, client, upstreams


@dataclass
class Forwarded:
    upstreams: list[bytes]  # what each upstream connection received
    ends: list[int]  # per request fully forwarded: the client stream offset just past it
    refused: str | None  # the error the client got, when it got one


def oursForwardRequests(pieces: list[bytes]) -> Forwarded:
    """Feed the client's bytes to a front door, answering each forwarded
    request with ``NEXT_PLEASE`` so it reads the next."""
    door, client, upstreams = _door()
    total = 0
    for piece in pieces:
        if client.disconnecting:
            break
        total += len(piece)
        door.dataReceived(piece)
    ends: list[int] = []
    handler = door.handler
    while not client.disconnecting and isinstance(handler, HTTPHandler):
        exchange = handler.exchange
        if exchange is None or not exchange.requestDone or exchange.upstream is None:
            break
        ends.append(total - handler.requests.buffered)
        exchange.upstream.dataReceived(NEXT_PLEASE)
    out = client.value()
    refused = None
    if out.startswith((b"HTTP/1.1 4", b"HTTP/1.1 5")) or b"\r\n\r\nHTTP/1.1 4" in out or b"\r\n\r\nHTTP/1.1 5" in out:
        last = out[out.rfind(b"HTTP/1.1 ") :]
        refused = last[9:12].decode() + " " + last.partition(b"\r\n\r\n")[2].decode("utf-8", "replace").strip()
    return Forwarded([u.transport.value() for u in upstreams], ends, refused)


def originForm(target: bytes) -> bytes:
    """The target the origin should get for an absolute-form ``target`` (no fragment)."""
    rest = target[len(b"http://") :]
    cut = min((i for i in (rest.find(b"/"), rest.find(b"?")) if i >= 0), default=len(rest))
    path = rest[cut:].partition(b"#")[0]
    return path if path.startswith(b"/") else b"/" + path


def checkForwardRequests(stream: bytes, pieces: list[bytes], tally: Counter[str]) -> None:
    want = h11Requests(stream)
    ours = oursForwardRequests(pieces)
    assert len(ours.ends) <= len(ours.upstreams)
    for k, sentBytes in enumerate(ours.upstreams):
        sent = h11Requests(sentBytes)
        assert sent.error is None, f"h11 cannot read what the proxy sent the origin: {sent.error}\n{sentBytes!r}"
        assert len(sent.messages) <= 1, "one request per origin connection"
        if not sent.messages:
            continue  # dialled, nothing sent yet (the head waits for the body's first bytes)
        got = sent.messages[0]
        assert k < len(want.messages), f"the proxy forwarded request {k + 1}, which h11 refuses: {want.error}"
        expected = want.messages[k]
        assert got.head.method == expected.head.method
        target = bytes(expected.head.target)
        assert bytes(got.head.target) == originForm(target)
        headers = _headers(expected.head)
        assert not refusedOnPurpose(headers), "the proxy forwarded a framing name spelled with _"
        named = _connectionNamed(headers)
        forwarded = _headers(got.head)
        assert _kept(forwarded, FORWARD_EXEMPT, named) == _kept(headers, FORWARD_EXEMPT, named)
        authority = target[len(b"http://") :].split(b"/")[0].split(b"?")[0].rpartition(b"@")[2]
        assert [v for n, v in forwarded if n == b"host"] == [authority]
        assert [v for n, v in forwarded if n == b"connection"] == [b"close"]
        assert not [n for n, _ in forwarded if n.startswith(b"proxy-")]
        assert expected.body.startswith(got.body), "the proxy forwarded body bytes h11 does not read"
        if got.end is not None:
            assert expected.end is not None, "the proxy ended a request where h11 reads on"
            assert got.body == expected.body
            if k < len(ours.ends):
                assert ours.ends[k] == expected.end, "the next request starts at another byte"
    finished = [m for m in (h11Requests(b).messages for b in ours.upstreams) if m and m[0].end is not None]
    for k, expected in enumerate(want.messages):
        if expected.end is None:
            continue
        if k < len(finished):
            tally["both accept"] += 1
        elif ours.refused is not None:
            tally["h11 accepts, ours refuses: " + refusal(ours.refused, stream)[:90]] += 1
        else:
            raise AssertionError(f"h11 read request {k + 1} to its end; the proxy neither forwarded nor refused it")


@dataclass
class ForwardedResponse:
    toClient: bytes
    clientClosed: bool
    clientCut: bool
    started: bool


def oursForwardResponse(method: bytes, pieces: list[bytes], eof: bool) -> ForwardedResponse:
    door, client, upstreams = _door()
    length = b"content-length: 0\r\n" if method == b"POST" else b""
    door.dataReceived(method + b" http://" + HOST_BYTES + b"/r HTTP/1.1\r\nhost: " + HOST_BYTES + b"\r\n" + length + b"\r\n")
    assert len(upstreams) == 1, client.value()
    upstream = upstreams[0]
    exchange = door.handler.exchange
    for piece in pieces:
        if upstream.transport.disconnecting:
            break
        upstream.dataReceived(piece)
    if upstream.transport.disconnected:
        upstream.connectionLost(Failure(ConnectionLost("aborted")))
    elif eof or upstream.transport.disconnecting:
        upstream.connectionLost(Failure(ConnectionDone()))
    return ForwardedResponse(
        client.value(), client.disconnecting and not client.disconnected, client.disconnected, exchange.responseStarted
    )


def checkForwardResponse(method: bytes, stream: bytes, eof: bool, pieces: list[bytes], tally: Counter[str]) -> None:
    want = h11Response(method, stream, eof)
    ours = oursForwardResponse(method, pieces, eof)
    got = h11Response(method, ours.toClient, ours.clientClosed)
    assert got.error is None, f"h11 cannot read what the proxy sent the client: {got.error}\n{ours.toClient!r}"
    wanted = want.messages[0] if want.messages else Message(None)
    received = got.messages[0] if got.messages else Message(None)
    forwarded = [e.status_code for e in received.informational]
    assert forwarded == [e.status_code for e in wanted.informational[: len(forwarded)]], (
        "the proxy forwarded an informational response h11 refuses"
    )
    if not ours.started:
        if received.head is not None:
            assert received.head.status_code == 502, received.head
            why = refusal("502 " + ours.toClient.rsplit(b"\r\n", 1)[-1].decode().strip().partition(f"{HOST}")[2], stream)[:60]
        else:
            why = "cut" if ours.clientCut else "still waits for the end of the head"
        tally[("h11 accepts, ours refuses: " + why) if wanted.head is not None else "both refuse or wait"] += 1
        return
    assert wanted.head is not None, f"the proxy forwarded a response head h11 refuses: {want.error}"
    assert not refusedOnPurpose(_headers(wanted.head)), "the proxy forwarded a response with a framing name spelled with _"
    assert received.head is not None
    assert received.head.status_code == wanted.head.status_code
    assert received.head.reason == wanted.head.reason
    headers = _headers(wanted.head)
    named = _connectionNamed(headers)
    assert _kept(_headers(received.head), RESPONSE_EXEMPT, named) == _kept(headers, RESPONSE_EXEMPT, named)
    assert wanted.body.startswith(received.body), "the proxy forwarded body bytes h11 does not read"
    if received.end is not None and not ours.clientCut:
        assert wanted.end is not None, "the proxy ended a response where h11 reads on"
        assert received.body == wanted.body
        tally["both accept"] += 1
    elif wanted.end is not None:
        assert ours.clientCut, "h11 read the response to its end; the proxy neither ended nor cut it"
        tally["h11 accepts, ours cuts the client"] += 1
    else:
        tally["both refuse or wait (mid-body)"] += 1


# ---------------------------------------------------------------------- the properties


@pytest.mark.slow
def test_requestsHttp11ReadsAreH11s(capsys: pytest.CaptureFixture[str]) -> None:
    tally: Counter[str] = Counter()

    @EXAMPLES
    @given(st.one_of(requestStream(), requestStream(FORWARD_TARGETS)))
    def check(case: tuple[bytes, list[bytes]]) -> None:
        with _watchdog(10):
            checkGrammarRequests(*case, tally)

    check()
    _report(capsys, "requests (messages h11 reads to their end, by what http11 did):", tally)
    assert tally["both accept"] > 500, "the generator should make mostly acceptable requests"


@pytest.mark.slow
def test_responsesHttp11ReadsAreH11s(capsys: pytest.CaptureFixture[str]) -> None:
    tally: Counter[str] = Counter()

    @EXAMPLES
    @given(responseStream())
    def check(case: tuple[bytes, bytes, bool, list[bytes]]) -> None:
        with _watchdog(10):
            checkGrammarResponse(*case, tally)

    check()
    _report(capsys, "responses (by what h11 and http11 did):", tally)
    assert tally["both accept"] > 300, "the generator should make mostly acceptable responses"


@pytest.mark.slow
def test_requestsTheForwardPathForwardsAreH11s(capsys: pytest.CaptureFixture[str]) -> None:
    tally: Counter[str] = Counter()

    @EXAMPLES
    @given(requestStream(FORWARD_TARGETS))
    def check(case: tuple[bytes, list[bytes]]) -> None:
        with _watchdog(10):
            checkForwardRequests(*case, tally)

    check()
    _report(capsys, "forwarded requests (messages h11 reads to their end, by what the proxy did):", tally)
    assert tally["both accept"] > 400, "the generator should make mostly acceptable requests"


@pytest.mark.slow
def test_responsesTheForwardPathRelaysAreH11s(capsys: pytest.CaptureFixture[str]) -> None:
    tally: Counter[str] = Counter()

    @EXAMPLES
    @given(responseStream())
    def check(case: tuple[bytes, bytes, bool, list[bytes]]) -> None:
        with _watchdog(10):
            checkForwardResponse(*case, tally)

    check()
    _report(capsys, "forwarded responses (by what h11 and the proxy did):", tally)
    assert tally["both accept"] > 300, "the generator should make mostly acceptable responses"


#: Issue 23's gadget and its kin: h11 reads each as an ordinary field (what an
#: origin mapping _ to - reads as framing), and every reader here refuses it.
SPELLED_REQUESTS = [
    b"POST http://api.example.com/x HTTP/1.1\r\nHost: api.example.com\r\nContent-Length: 5\r\n"
    b"Transfer_Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"POST http://api.example.com/x HTTP/1.1\r\nHost: api.example.com\r\nTransfer-Encoding: chunked\r\n"
    b"content_length: 5\r\n\r\n0\r\n\r\n",
    b"GET http://api.example.com/ HTTP/1.1\r\nHost: api.example.com\r\nPROXY_CONNECTION: keep-alive\r\n\r\n",
    b"GET /a HTTP/1.1\r\nHost: api.example.com\r\nKeep_Alive: 5\r\n\r\n",
]
#: (stream, whether the origin closes after it)
SPELLED_RESPONSES = [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer_Encoding: chunked\r\n\r\n0\r\n\r\n", False),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nKeep_Alive: timeout=5\r\n\r\nok", False),
    (b"HTTP/1.1 200 OK\r\nCONTENT_LENGTH: 2\r\n\r\nok", True),  # h11: a body until the close
]


def test_framingNamesSpelledWithUnderscoreAreRefusedOnPurposeByEveryReader() -> None:
    tally: Counter[str] = Counter()
    checked = 0
    with _watchdog(30):
        for stream in SPELLED_REQUESTS:
            assert h11Requests(stream).messages[0].end is not None, "h11 reads it"
            checkGrammarRequests(stream, [stream], tally)
            checkRequests(stream, [stream], tally)  # the terminated path
            checked += 2
            if stream.startswith((b"GET http", b"POST http")):  # absolute form: the forward path
                checkForwardRequests(stream, [stream], tally)
                checked += 1
        for stream, eof in SPELLED_RESPONSES:
            assert h11Response(b"GET", stream, eof).messages[0].end is not None, "h11 reads it"
            checkGrammarResponse(b"GET", stream, eof, [stream], tally)
            checkForwardResponse(b"GET", stream, eof, [stream], tally)
            checkResponse(b"GET", stream, eof, [stream], tally)
            checked += 3
    onPurpose = sum(n for why, n in tally.items() if why.endswith("on purpose, a framing or hop-by-hop name spelled with _"))
    assert onPurpose == sum(tally.values()) == checked, tally
