"""``egress/http11.py`` on its own: the head parsers and their refusals, the chunked
decoder at the worst split, the hop-by-hop rule, the Host rule, the body framers'
decisions and payload counts, a request refused at the first byte no request can
hold, and framing or hop-by-hop fields spelled with ``_``.  (The injector's framing
over real TLS is ``test_inject_framing``; h11's agreement, ``test_http11_differential``.)"""

from __future__ import annotations

from twisted.trial import unittest

from agentsandbox.egress.http11 import (
    END,
    ChunkedBody,
    LengthBody,
    Refused,
    RequestFramer,
    ResponseFramer,
    UntilClose,
    forwardedLines,
    oneHost,
    parseRequestHead,
    parseResponseHead,
    requestBody,
    responseBody,
    takeRequestHead,
)
from tests.support.chunks import dechunk

#: RFC 9110 §5.6.2's tchar, written out here rather than taken from the module under test.
TCHAR = frozenset(b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")


def _chunked(body: bytes) -> tuple[list[bytes], bool]:
    """Feed ``body`` to a ChunkedBody one byte at a time (the worst split)."""
    decoder = ChunkedBody(400)
    buf = bytearray()
    out: list[bytes] = []
    for i in range(len(body)):
        buf += body[i : i + 1]
        decoder.feed(buf, out)
    return out, decoder.done


class Parsers(unittest.TestCase):
    def test_aRequestHeadIsSplitIntoLowerCaseFields(self) -> None:
        head = parseRequestHead(b"POST /x?y HTTP/1.1\r\nHost: a\r\nX-Thing:  v  w \r\nContent-Length: 12\r\n\r\n")
        self.assertEqual(head.start, (b"POST", b"/x?y"))
        self.assertEqual(list(head.fields), [(b"host", b"a"), (b"x-thing", b"v  w"), (b"content-length", b"12")])
        self.assertEqual((head.length, head.chunked, head.minor), (12, False, 1))

    def test_requestRefusals(self) -> None:
        for raw, why in [
            (b"GET / HTTP/1.1\r\nHost: a\r\nX: \x7f\r\n\r\n", "a malformed header line"),
            (b"GET / HTTP/2.0\r\nHost: a\r\n\r\n", "a malformed request line"),
            (b"GET  / HTTP/1.1\r\nHost: a\r\n\r\n", "a malformed request line"),
            (b"GET / HTTP/1.1\r\nHost : a\r\n\r\n", "whitespace before a header's colon"),
            (b"GET / HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\n", "a malformed Content-Length"),
            (b"GET / HTTP/1.1\r\nContent-Length:\r\n\r\n", "a malformed Content-Length"),
        ]:
            with self.assertRaises(Refused, msg=raw) as caught:
                parseRequestHead(raw)
            self.assertEqual(caught.exception.why, why, raw)

    def test_aResponseHeadKeepsItsReason(self) -> None:
        head = parseResponseHead(b"HTTP/1.1 404 Not Found Here\r\nContent-Length: 0\r\n\r\n")
        self.assertEqual(head.start, (b"404", b"Not Found Here"))
        self.assertEqual(parseResponseHead(b"HTTP/1.1 204\r\n\r\n").start, (b"204", b""))

    def test_responseRefusalsAre502(self) -> None:
        for raw in [
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
            b"HTTP/1.1 20 OK\r\n\r\n",
            b"HTTP/1.1 200 OK\nX: y\r\n\r\n",
            b"ICY 200 OK\r\n\r\n",
        ]:
            with self.assertRaises(Refused, msg=raw) as caught:
                parseResponseHead(raw)
            self.assertEqual(caught.exception.status, 502)

    def test_chunkedBodiesAreReframedWithoutExtensionsOrTrailers(self) -> None:
        out, done = _chunked(b"5;name=value\r\nhello\r\n6; x \r\n world\r\n0\r\nX-Trailer: t\r\n\r\n")
        self.assertTrue(done)
        body, rest = dechunk(b"".join(out))
        self.assertEqual((body, rest), (b"hello world", b"\r\n"))
        self.assertNotIn(b"name", b"".join(out))
        self.assertNotIn(b"X-Trailer", b"".join(out))

    def test_chunkedBodyRefusals(self) -> None:
        for raw in [
            b"0x5\r\nhello\r\n0\r\n\r\n",
            b"-5\r\nhello\r\n0\r\n\r\n",
            b"5 ;x\r\nhello\r\n0\r\n\r\n",  # h11 refuses whitespace before an extension
            b"5;a\nb\r\nhello\r\n0\r\n\r\n",
            b"5\r\nhelloXX0\r\n\r\n",
            b"5\nhello\r\n0\r\n\r\n",
            b"11111111111111111\r\n",
            b"0\r\nBad Trailer: x\r\n\r\n",
            b"5\r\n" + b"hello\r\n" + b"1" * 5000,
        ]:
            with self.assertRaises(Refused, msg=raw):
                _chunked(raw)

    def test_aChunkedBodyStopsAtItsEnd(self) -> None:
        decoder = ChunkedBody(400)
        buf = bytearray(b"3\r\nabc\r\n0\r\n\r\nGET /next HTTP/1.1\r\n")
        out: list[bytes] = []
        decoder.feed(buf, out)
        self.assertTrue(decoder.done)
        self.assertEqual(bytes(buf), b"GET /next HTTP/1.1\r\n")


def _refusal(raw: bytes) -> str | None:
    """What ``takeRequestHead`` refuses ``raw`` (all that has arrived) with, None while it waits."""
    try:
        takeRequestHead(bytearray(raw))
    except Refused as e:
        return f"{e.status} {e.why}"
    return None


class HopByHop(unittest.TestCase):
    def test_theTableProxyFieldsAndWhatConnectionNamesAreDroppedButNeverTheFraming(self) -> None:
        head = parseRequestHead(
            b"POST /x HTTP/1.1\r\nHost: a\r\nConnection: x-hop, content-length, close\r\nX-Hop: 1\r\n"
            b"Keep-Alive: 5\r\nTE: trailers\r\nUpgrade: h2c\r\nProxy-Authorization: Basic eA==\r\n"
            b"Proxy-Anything: y\r\nX-Kept: yes\r\nContent-Length: 3\r\n\r\n"
        )
        self.assertEqual(forwardedLines(head, frozenset({b"host"})), b"x-kept: yes\r\ncontent-length: 3\r\n")

    def test_exactlyOneHost(self) -> None:
        self.assertEqual(oneHost(parseRequestHead(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")), b"a")
        for raw in (b"GET / HTTP/1.1\r\n\r\n", b"GET / HTTP/1.1\r\nHost: a\r\nhost: b\r\n\r\n"):
            with self.assertRaises(Refused) as caught:
                oneHost(parseRequestHead(raw))
            self.assertEqual(caught.exception.text, "refused: a request needs exactly one Host header")


class Bodies(unittest.TestCase):
    def test_whichFramerARequestGets(self) -> None:
        self.assertIsNone(requestBody(parseRequestHead(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")))
        self.assertIsNone(requestBody(parseRequestHead(b"POST / HTTP/1.1\r\nContent-Length: 0\r\n\r\n")))
        self.assertIsInstance(requestBody(parseRequestHead(b"POST / HTTP/1.1\r\nContent-Length: 3\r\n\r\n")), LengthBody)
        chunked = parseRequestHead(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n")
        self.assertIsInstance(requestBody(chunked), ChunkedBody)

    def test_whichFramerAResponseGets(self) -> None:
        length = parseResponseHead(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n")
        self.assertIsInstance(responseBody(length, b"GET"), LengthBody)
        self.assertIsNone(responseBody(length, b"HEAD"))
        for status in (b"204", b"304"):
            self.assertIsNone(responseBody(parseResponseHead(b"HTTP/1.1 " + status + b" X\r\nContent-Length: 5\r\n\r\n"), b"GET"))
        self.assertIsInstance(responseBody(parseResponseHead(b"HTTP/1.1 200 OK\r\n\r\n"), b"GET"), UntilClose)
        chunked = parseResponseHead(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        self.assertIsInstance(responseBody(chunked, b"GET"), ChunkedBody)

    def test_aLengthBodySplitsAReadWithoutCopyingWhatIsAllBody(self) -> None:
        body = LengthBody(10)
        data = b"0123456"
        part, rest = body.split(data)
        self.assertIs(part, data)
        self.assertEqual((rest, body.left, body.payload), (b"", 3, 7))
        self.assertEqual(body.split(b"789GET /"), (b"789", b"GET /"))
        self.assertTrue(body.done)

    def test_payloadCountsChunkDataNotFraming(self) -> None:
        body = ChunkedBody(400)
        out: list[bytes] = []
        body.feed(bytearray(b"3;x=y\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"), out)
        self.assertEqual((body.payload, body.done), (5, True))
        self.assertEqual(b"".join(out), b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")


class FramerPayload(unittest.TestCase):
    """``payload``: the body bytes of the message a framer began last, past its END (the audit's up/down)."""

    def test_aRequestFramerCountsTheCurrentRequestsBodyUntilTheNextBegins(self) -> None:
        framer = RequestFramer()
        self.assertEqual(framer.payload, 0)
        framer.feed(b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nab")
        self.assertEqual(framer.payload, 2)
        data = b"cde"
        parts = framer.feed(data + b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
        self.assertEqual((parts[0], parts[-1], framer.payload), (data, END, 5))
        framer.next()  # a request with no body begins
        self.assertEqual(framer.payload, 0)
        framer.next()
        framer.feed(b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3;x\r\nabc\r\n0\r\n\r\n")
        self.assertEqual((framer.payload, framer.waiting), (3, True))

    def test_aResponseFramerCountsTheFinalResponsesBodyNotA1xx(self) -> None:
        framer = ResponseFramer()
        framer.expect(b"GET")
        framer.feed(b"HTTP/1.1 100 Continue\r\n\r\n")
        self.assertEqual(framer.payload, 0)
        framer.feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nabcd\r\n0\r\n\r\n")
        self.assertEqual((framer.payload, framer.idle), (4, True))
        framer.expect(b"GET")
        framer.feed(b"HTTP/1.1 200 OK\r\n\r\nuntil")
        self.assertEqual(framer.feed(b" close"), [b" close"])
        self.assertEqual(framer.closed(True), [END])
        self.assertEqual(framer.payload, 11)
        framer.expect(b"HEAD")
        framer.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n")
        self.assertEqual(framer.payload, 0)


class ImpossibleStarts(unittest.TestCase):
    """A request is refused at the first byte no request line can hold, not when its head
    ends: a TLS ClientHello or a SOCKS4 request never ends one, and used to wait for the
    header timeout."""

    def test_everyFirstByteThatNoMethodStartsWithIsRefusedAlone(self) -> None:
        for byte in range(256):
            parts = RequestFramer().feed(bytes([byte]))
            if byte in TCHAR:
                self.assertEqual(parts, [], byte)
                continue
            self.assertEqual(len(parts), 1, byte)
            (refused,) = parts
            assert isinstance(refused, Refused), (byte, refused)
            if byte in b"\r\n":
                self.assertEqual(refused.why, "a blank line before the request line")
            else:
                self.assertEqual(refused.status, 400)
                self.assertEqual(refused.text, f"refused: a request starting with byte 0x{byte:02x}, which no HTTP method starts with")

    def test_aMethodIsRefusedAtItsFirstImpossibleByteWhereverTheReadsEnd(self) -> None:
        for raw, at, why in [
            (b"GE\x00T / HTTP/1.1\r\nHost: a\r\n\r\n", 2, "400 byte 0x00 in the request's method"),
            (b"G@T / HTTP/1.1\r\nHost: a\r\n\r\n", 1, "400 byte 0x40 in the request's method"),
            (b"POST\x7f/ HTTP/1.1\r\n", 4, "400 byte 0x7f in the request's method"),
            (b"GET\x0b/\nHost: a\n\n", 3, "400 byte 0x0b in the request's method"),
            (b" GET / HTTP/1.1\r\nHost: a\r\n\r\n", 0, "400 a request starting with byte 0x20, which no HTTP method starts with"),
            (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\r\n\r\n" * 2, 0, "400 a request starting with byte 0x16, which no HTTP method starts with"),
            (b"\x16" + b"a" * 70000 + b"\r\n\r\n", 0, "400 a request starting with byte 0x16, which no HTTP method starts with"),
        ]:
            for cut in range(at):
                self.assertIsNone(_refusal(raw[:cut]), (raw, cut))
            # However much arrived with the byte, complete head or not, the same refusal.
            for cut in {at + 1, at + 2, len(raw) // 2, len(raw) - 1, len(raw)} - set(range(at + 1)):
                self.assertEqual(_refusal(raw[:cut]), why, (raw[:40], cut))
            framer = RequestFramer()
            for k in range(at):
                self.assertEqual(framer.feed(raw[k : k + 1]), [], (raw, k))
            (refused,) = framer.feed(raw[at : at + 1])
            assert isinstance(refused, Refused)
            self.assertEqual(f"{refused.status} {refused.why}", why)

    def test_everyBeginningOfAGoodRequestWaits(self) -> None:
        for raw in (
            b"M-SEARCH * HTTP/1.1\r\nHost: a\r\n\r\n",
            b"CONNECT example.org:443 HTTP/1.1\r\n\r\n",
            b"GET http://a.example.com/x_y HTTP/1.1\r\nHost: a\r\n\r\n",
        ):
            for cut in range(len(raw)):
                self.assertIsNone(_refusal(raw[:cut]), raw[:cut])
            self.assertIsNotNone(takeRequestHead(bytearray(raw)))

    def test_whatEndsTheMethodKeepsItsOwnRefusal(self) -> None:
        # CR and LF after a method are the request line's (or the line end's) to refuse.
        self.assertEqual(_refusal(b"GET\r\n\r\n"), "400 a malformed request line")
        self.assertEqual(_refusal(b"GET\nHost"), "400 a header line ends in a bare LF")


class FramingSpelledWithUnderscore(unittest.TestCase):
    """A field whose name reads as a framing or hop-by-hop field's once ``_`` is taken for
    ``-`` is refused: an origin that maps one to the other (CGI/WSGI's
    ``HTTP_TRANSFER_ENCODING``) would frame by a field the proxy passed on as ordinary."""

    SPELLINGS = (
        (b"Transfer_Encoding", "Transfer-Encoding"),
        (b"transfer_encoding", "Transfer-Encoding"),
        (b"Content_Length", "Content-Length"),
        (b"content_length", "Content-Length"),
        (b"CONTENT_LENGTH", "Content-Length"),
        (b"Keep_Alive", "Keep-Alive"),
        (b"PROXY_CONNECTION", "Proxy-Connection"),
        (b"Proxy_Connection", "Proxy-Connection"),
        (b"Proxy_Authorization", "Proxy-Authorization"),
        (b"proxy_authenticate", "Proxy-Authenticate"),
    )

    def test_eachSpellingIsRefusedInARequestNamingItAsSent(self) -> None:
        for sent, readAs in self.SPELLINGS:
            for head in (
                b"POST /a_b HTTP/1.1\r\nHost: a\r\n" + sent + b": 5\r\nContent-Length: 5\r\n\r\n",
                b"GET / HTTP/1.1\r\nHost: a\r\n" + sent + b": chunked\r\n\r\n",
            ):
                with self.assertRaises(Refused, msg=head) as caught:
                    parseRequestHead(head)
                self.assertEqual(caught.exception.status, 400)
                self.assertEqual(
                    caught.exception.text, f"refused: a header named {sent.decode()}, read as {readAs} where _ is taken for -"
                )

    def test_andInAResponse502(self) -> None:
        for sent, readAs in self.SPELLINGS:
            with self.assertRaises(Refused) as caught:
                parseResponseHead(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n" + sent + b": chunked\r\n\r\n")
            self.assertEqual(caught.exception.status, 502)
            self.assertEqual(caught.exception.why, f"a header named {sent.decode()}, read as {readAs} where _ is taken for -")

    def test_otherUnderscoresAreOrdinary(self) -> None:
        head = parseRequestHead(
            b"GET /x_y?a_b=c_d HTTP/1.1\r\nHost: a_b.example.org\r\nX_Thing: t_1\r\nConnection_: x\r\n"
            b"_TE: trailers\r\nTransfer_Encoding_X: y\r\nContent-Length: 0\r\n\r\n"
        )
        self.assertEqual(
            [n for n, _ in head.fields], [b"host", b"x_thing", b"connection_", b"_te", b"transfer_encoding_x", b"content-length"]
        )
        self.assertEqual(head.length, 0)
        self.assertEqual(parseResponseHead(b"HTTP/1.1 200 OK\r\nX_Powered_By: y\r\n\r\n").fields, ((b"x_powered_by", b"y"),))
