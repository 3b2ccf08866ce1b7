"""The plain ``http://`` forward path's framing: the house's one grammar (``http11``).

The forward path and the terminated path read HTTP/1.1 with the same module,
so they refuse the same heads with the same texts.  These tests mirror
``tests/test_inject_framing.py`` and reuse its parts: the §5.1 refusal list of
``tests/test_inject.py`` goes through the proxy to an allowed loopback origin
(which must receive nothing, not even a connection) and each answer is held to
the terminated path's answer for the same head; then a scripted origin on
plain TCP splits, lies and trails, as the scripted TLS upstream does there.
"""

from __future__ import annotations

from typing import Any

from twisted.internet import defer
from twisted.internet.error import ConnectionDone
from twisted.trial import unittest

from agentsandbox.egress.http11 import MAX_HEAD
from tests.support.chunks import dechunk
from tests.support.differential import oursOnRequests
from tests.support.egress_fixtures import Collector, ProxyHarness, reactor
from tests.test_inject import SMUGGLING
from tests.test_inject_framing import Close, ScriptedFactory
from tests.test_proxy import foreignStarts


def _status(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1])


def _text(raw: bytes) -> str:
    """The plain-text reason of an error reply."""
    return raw.partition(b"\r\n\r\n")[2].decode("utf-8").strip()


class ForwardFraming(unittest.TestCase):
    timeout = 30

    @defer.inlineCallbacks
    def serve(self, script: dict[bytes, tuple[list[bytes], Close]]) -> Any:
        """A scripted origin on 127.0.0.1 and a proxy whose allow list names exactly it."""
        self.origin = ScriptedFactory(script)
        self.addCleanup(self.origin.cancel)
        listening = reactor.listenTCP(0, self.origin, interface="127.0.0.1")
        self.addCleanup(listening.stopListening)
        self.authority = b"127.0.0.1:%d" % listening.getHost().port
        self.proxy = ProxyHarness([self.authority.decode()])
        yield defer.ensureDeferred(self.proxy.start())
        self.addCleanup(self.proxy.stop)

    def absolute(self, raw: bytes) -> bytes:
        """``raw`` (an origin-form request) with its target made absolute-form for the origin."""
        method, sp, rest = raw.partition(b" ")
        if not rest.startswith(b"/"):
            return raw
        return method + sp + b"http://" + self.authority + rest

    @defer.inlineCallbacks
    def send(self, data: bytes, halfClose: bool = True) -> Any:
        from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol

        client = Collector(data, halfClose)
        yield connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", self.proxy.port), client)
        yield client.done
        return client

    # ------------------------------------------------------------------ refusals

    @defer.inlineCallbacks
    def test_theSmuggledRequestOfIssue10Is400AndTheOriginGetsNothing(self) -> Any:
        yield self.serve({b"/x": ([b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"], False)})
        origin = self.authority
        raw = (
            b"POST http://" + origin + b"/x HTTP/1.1\r\nHost: " + origin + b"\r\n"
            b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"2a\r\nGET /smuggled HTTP/1.1\r\nHost: internal\r\n\r\n\r\n0\r\n\r\n"
        )
        client = yield self.send(raw)
        self.assertEqual(_status(client.received), 400, client.received)
        self.assertEqual(_text(client.received), "refused: Content-Length together with Transfer-Encoding")
        self.assertEqual((self.origin.connections, self.origin.raw), (0, b""))
        parses = [r for r in self.proxy.records() if r["event"] == "parse"]
        self.assertEqual([r["reason"] for r in parses], ["refused: Content-Length together with Transfer-Encoding"])

    @defer.inlineCallbacks
    def test_transferEncodingSpelledWithUnderscoreBesideContentLengthIs400AndTheOriginGetsNothing(self) -> Any:
        # Issue 23's gadget: an origin that reads Transfer_Encoding as
        # Transfer-Encoding frames by the chunks and reads "GET /smuggled" next.
        yield self.serve({b"/x": ([b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"], False)})
        origin = self.authority
        smuggled = b"0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: internal\r\n\r\n"
        for name in (b"Transfer_Encoding", b"transfer_encoding", b"TRANSFER_ENCODING"):
            raw = b"POST http://%b/x HTTP/1.1\r\nHost: %b\r\nContent-Length: %d\r\n%b: chunked\r\n\r\n%b" % (
                origin,
                origin,
                len(smuggled),
                name,
                smuggled,
            )
            client = yield self.send(raw)
            text = f"refused: a header named {name.decode()}, read as Transfer-Encoding where _ is taken for -"
            self.assertEqual(f"{_status(client.received)} {_text(client.received)}", f"400 {text}")
            self.assertEqual([r["reason"] for r in self.proxy.records() if r["event"] == "parse"][-1], text)
        self.assertEqual((self.origin.connections, self.origin.raw), (0, b""))

    @defer.inlineCallbacks
    def test_otherFramingAndHopByHopNamesSpelledWithUnderscoreAre400(self) -> Any:
        yield self.serve({b"/x": ([b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"], False)})
        for field, readAs in [
            (b"content_length: 5", "Content-Length"),
            (b"Content_Length: 5", "Content-Length"),
            (b"Keep_Alive: timeout=5", "Keep-Alive"),
            (b"PROXY_CONNECTION: keep-alive", "Proxy-Connection"),
            (b"Proxy_Connection: close", "Proxy-Connection"),
            (b"Proxy_Authorization: Basic eDp5", "Proxy-Authorization"),
        ]:
            raw = self.absolute(b"POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n%b\r\n\r\n0\r\n\r\n" % field)
            client = yield self.send(raw)
            name = field.partition(b":")[0].decode()
            self.assertEqual(
                f"{_status(client.received)} {_text(client.received)}",
                f"400 refused: a header named {name}, read as {readAs} where _ is taken for -",
            )
        self.assertEqual((self.origin.connections, self.origin.raw), (0, b""))

    @defer.inlineCallbacks
    def test_aResponseWithFramingSpelledWithUnderscoreIs502(self) -> Any:
        yield self.serve(
            {b"/te": ([b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer_Encoding: chunked\r\n\r\n0\r\n\r\n"], False)}
        )
        client = yield self.send(self.absolute(b"GET /te HTTP/1.1\r\nHost: x\r\n\r\n"))
        self.assertTrue(bytes(client.received).startswith(b"HTTP/1.1 502 "), client.received)
        self.assertIn(
            b"sent an invalid response: a header named Transfer_Encoding, read as Transfer-Encoding where _ is taken for -",
            client.received,
        )

    @defer.inlineCallbacks
    def test_everyHeadTheTerminatedPathRefusesIsRefusedHereWithItsText(self) -> Any:
        yield self.serve({b"/echo": ([b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"], False)})
        for name, raw in SMUGGLING.items():
            terminated = oursOnRequests([raw]).refused
            assert terminated is not None, name
            client = yield self.send(self.absolute(raw))
            got = bytes(client.received)
            self.assertEqual(f"{_status(got)} {_text(got)}", terminated, f"{name}: {got[:300]!r}")
            self.assertEqual((self.origin.connections, self.origin.raw), (0, b""), name)

    @defer.inlineCallbacks
    def test_aStartNoRequestCanHaveIsRefusedOnBothPathsWithoutWaitingForMore(self) -> Any:
        # Neither client closes its side: each answer comes from the bytes alone.
        yield self.serve({})
        for what, sent, text in foreignStarts():
            self.assertEqual(oursOnRequests([sent]).refused, f"400 {text}", what)
            client = yield self.send(sent, halfClose=False)
            got = bytes(client.received)
            self.assertEqual(f"{_status(got)} {_text(got)}", f"400 {text}", what)
        self.assertEqual(self.origin.connections, 0)

    @defer.inlineCallbacks
    def test_aSmuggledHeadPipelinedAfterAGoodRequestIsRefused(self) -> Any:
        yield self.serve({b"/echo": ([b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"], False)})
        good = self.absolute(b"GET /echo HTTP/1.1\r\nHost: a\r\n\r\n")
        client = yield self.send(good + self.absolute(SMUGGLING["CL+TE"]))
        responses = bytes(client.received).split(b"HTTP/1.1 ")[1:]
        self.assertEqual([int(r[:3]) for r in responses], [200, 400])
        self.assertEqual(len(self.origin.heads), 1)

    @defer.inlineCallbacks
    def test_refusalsOfTheForwardPathItself(self) -> Any:
        yield self.serve({})
        for raw, status, text in [
            (self.absolute(b"GET /x HTTP/1.0\r\nHost: a\r\n\r\n"), 505, "only HTTP/1.1 is forwarded through the sandbox's proxy"),
            (
                b"CONNECT a.example.org:443 HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello",
                400,
                "refused: a CONNECT request with a body",
            ),
            (
                b"CONNECT a.example.org:443 HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
                400,
                "refused: a CONNECT request with a body",
            ),
            (b"CONNECT a.example.org:443 HTTP/1.1\r\nHost: a\r\n X: y\r\n\r\n", 400, "refused: obsolete line folding in the header"),
            (b"GET / HTTP/1.1\r\nHost: a\r\n\r\n", 400, "this is the sandbox's egress proxy"),
            (b"GET http://[::1/ HTTP/1.1\r\nHost: a\r\n\r\n", 400, "is not an http:// URL with a host"),
        ]:
            client = yield self.send(raw)
            got = bytes(client.received)
            self.assertEqual(_status(got), status, got)
            self.assertIn(text, _text(got), raw)
        self.assertEqual(self.origin.connections, 0)

    @defer.inlineCallbacks
    def test_connectAsHttp10WithoutHostOpensTheTunnel(self) -> Any:
        # Python 3.11's http.client tunnels so: HTTP/1.0, no Host.
        yield self.serve({})
        client = yield self.send(b"CONNECT " + self.authority + b" HTTP/1.0\r\n\r\nthrough the tunnel")
        self.assertTrue(bytes(client.received).startswith(b"HTTP/1.1 200 Connection established\r\n\r\n"), client.received)
        self.assertEqual(self.origin.raw, b"through the tunnel")

    @defer.inlineCallbacks
    def test_aBadChunkInTheFirstSegmentReachesNoOrigin(self) -> Any:
        yield self.serve({b"/up": ([b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"], False)})
        raw = self.absolute(b"POST /up HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\nzz\r\n")
        client = yield self.send(raw)
        self.assertEqual(_text(bytes(client.received)), "refused: a malformed chunk size line")
        self.assertEqual(self.origin.connections, 0)

    @defer.inlineCallbacks
    def test_aRequestHeadOverTheLimitIs431(self) -> Any:
        yield self.serve({})
        client = yield self.send(self.absolute(b"GET /x HTTP/1.1\r\nHost: a\r\nX: " + b"a" * MAX_HEAD))
        self.assertEqual(_status(bytes(client.received)), 431)

    # ------------------------------------------------------------------ a scripted origin

    @defer.inlineCallbacks
    def test_aContentLengthBodySplitAcrossManyReadsArrivesWhole(self) -> Any:
        body = bytes(range(256)) * 40
        pieces = [b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n" % len(body), b"X-A: b\r\n\r\n"]
        pieces += [body[i : i + 97] for i in range(0, len(body), 97)]
        yield self.serve({b"/big": (pieces, False)})
        client = yield self.send(self.absolute(b"GET /big HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"))
        head, _, got = bytes(client.received).partition(b"\r\n\r\n")
        self.assertTrue(head.startswith(b"HTTP/1.1 200 OK\r\n"), head)
        self.assertIn(b"x-a: b", head)
        self.assertIn(b"connection: close", head)
        self.assertEqual(got, body)
        self.assertIsInstance(client.reason.value, ConnectionDone)
        self.assertIn(b"host: " + self.authority, self.origin.heads[0].lower())
        self.assertIn(b"connection: close", self.origin.heads[0].lower())

    @defer.inlineCallbacks
    def test_aChunkedResponseWithExtensionsAndTrailersIsReframed(self) -> Any:
        raw = b"5;name=value\r\nhello\r\n6;x\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n"
        pieces = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"]
        pieces += [raw[i : i + 3] for i in range(0, len(raw), 3)]
        yield self.serve(
            {
                b"/chunked": (pieces, False),
                b"/after": ([b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nafter"], False),
            }
        )
        client = yield self.send(
            self.absolute(b"GET /chunked HTTP/1.1\r\nHost: x\r\n\r\n")
            + self.absolute(b"GET /after HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        )
        first, _, rest = bytes(client.received).partition(b"\r\n\r\n")
        self.assertIn(b"transfer-encoding: chunked", first)
        body, rest = dechunk(rest)
        self.assertEqual(body, b"hello world")
        self.assertTrue(rest.startswith(b"\r\nHTTP/1.1 200 OK\r\n"), rest)
        self.assertTrue(rest.endswith(b"\r\n\r\nafter"), rest)
        self.assertNotIn(b"X-Trailer", client.received)
        self.assertNotIn(b"name=value", client.received)
        # Each forwarded request is a connection of its own (with Connection: close).
        self.assertEqual(self.origin.connections, 2)

    @defer.inlineCallbacks
    def test_aResponseShorterThanItsLengthCutsTheClient(self) -> Any:
        pieces = [b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n", b"only ten b"]
        yield self.serve({b"/short": (pieces, True)})
        client = yield self.send(self.absolute(b"GET /short HTTP/1.1\r\nHost: x\r\n\r\n"))
        # A reset, not a FIN: what was still in the proxy's send buffer may be
        # lost to it (plain TCP has no way to flush and then reset), never
        # anything but the response's own bytes.
        whole = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly ten b"
        self.assertTrue(whole.startswith(bytes(client.received)), client.received)
        self.assertNotIsInstance(client.reason.value, ConnectionDone)

    @defer.inlineCallbacks
    def test_bytesBeyondTheLengthNeverReachTheClient(self) -> Any:
        yield self.serve(
            {
                b"/long": ([b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhelloHTTP/1.1 200 OK\r\n\r\nsmuggled"], False),
                b"/next": ([b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nnext"], False),
            }
        )
        client = yield self.send(
            self.absolute(b"GET /long HTTP/1.1\r\nHost: x\r\n\r\n")
            + self.absolute(b"GET /next HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        )
        received = bytes(client.received)
        self.assertNotIn(b"smuggled", received)
        self.assertEqual(received.count(b"HTTP/1.1 200 OK"), 2, received)
        self.assertTrue(received.endswith(b"\r\n\r\nnext"), received)

    @defer.inlineCallbacks
    def test_headAnd204And304HaveNoBody(self) -> Any:
        yield self.serve(
            {
                b"/head": ([b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n"], False),
                b"/204": ([b"HTTP/1.1 204 No Content\r\n\r\n"], False),
                b"/304": ([b"HTTP/1.1 304 Not Modified\r\nContent-Length: 50\r\n\r\n"], False),
                b"/last": ([b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nlast"], False),
            }
        )
        client = yield self.send(
            b"".join(
                self.absolute(r)
                for r in (
                    b"HEAD /head HTTP/1.1\r\nHost: x\r\n\r\n",
                    b"GET /204 HTTP/1.1\r\nHost: x\r\n\r\n",
                    b"GET /304 HTTP/1.1\r\nHost: x\r\n\r\n",
                    b"GET /last HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                )
            )
        )
        self.assertEqual(
            bytes(client.received),
            b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n"
            b"HTTP/1.1 204 No Content\r\n\r\n"
            b"HTTP/1.1 304 Not Modified\r\ncontent-length: 50\r\n\r\n"
            b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\nconnection: close\r\n\r\nlast",
        )
        self.assertEqual(len(self.origin.heads), 4)

    @defer.inlineCallbacks
    def test_aMalformedResponseHeadIs502(self) -> Any:
        yield self.serve(
            {b"/bad": ([b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!"], False)}
        )
        client = yield self.send(self.absolute(b"GET /bad HTTP/1.1\r\nHost: x\r\n\r\n"))
        self.assertTrue(bytes(client.received).startswith(b"HTTP/1.1 502 "), client.received)
        self.assertIn(b"sent an invalid response: more than one Content-Length", client.received)

    @defer.inlineCallbacks
    def test_aBadChunkAfterTheHeadCutsTheClient(self) -> Any:
        pieces = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", b"5\r\nhello\r\n", b"zz\r\n"]
        yield self.serve({b"/bad": (pieces, False)})
        client = yield self.send(self.absolute(b"GET /bad HTTP/1.1\r\nHost: x\r\n\r\n"))
        self.assertNotIn(b"0\r\n\r\n", client.received)
        self.assertNotIsInstance(client.reason.value, ConnectionDone)

    @defer.inlineCallbacks
    def test_aResponseDelimitedByCloseClosesTheClientToo(self) -> Any:
        pieces = [b"HTTP/1.1 200 OK\r\n\r\n", b"until ", b"the end"]
        yield self.serve({b"/eof": (pieces, True)})
        client = yield self.send(self.absolute(b"GET /eof HTTP/1.1\r\nHost: x\r\n\r\n"))
        self.assertEqual(bytes(client.received), b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil the end")
        self.assertIsInstance(client.reason.value, ConnectionDone)

    @defer.inlineCallbacks
    def test_aChunkedRequestIsReframedUpstream(self) -> Any:
        yield self.serve({b"/up": ([b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"], False)})
        client = yield self.send(
            self.absolute(
                b"POST /up HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                b"3;ext=1\r\nabc\r\n0\r\nX-T: 1\r\n\r\n"
            )
        )
        self.assertTrue(bytes(client.received).endswith(b"\r\n\r\nok"), client.received)
        self.assertIn(b"transfer-encoding: chunked", self.origin.heads[0].lower())
        self.assertNotIn(b"content-length", self.origin.heads[0].lower())
        self.assertTrue(self.origin.raw.endswith(b"\r\n\r\n3\r\nabc\r\n0\r\n\r\n"), self.origin.raw)

    @defer.inlineCallbacks
    def test_informationalResponsesPassAndSwitchingProtocolsIs502(self) -> Any:
        yield self.serve(
            {
                b"/early": ([b"HTTP/1.1 103 Early Hints\r\nLink: </s.css>\r\n\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"], False),
                b"/switch": ([b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n"], False),
            }
        )
        client = yield self.send(self.absolute(b"GET /early HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"))
        got = bytes(client.received)
        self.assertTrue(got.startswith(b"HTTP/1.1 103 Early Hints\r\nlink: </s.css>\r\n\r\nHTTP/1.1 200 OK\r\n"), got)
        client = yield self.send(self.absolute(b"GET /switch HTTP/1.1\r\nHost: x\r\n\r\n"))
        self.assertEqual(_status(bytes(client.received)), 502)
        self.assertIn(b"switched protocols without being asked to", client.received)
