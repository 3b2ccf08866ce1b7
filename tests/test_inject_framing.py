"""The injector's own framing over real loopback TLS: bodies by length and by chunk.

The injector does not run a per-event HTTP state machine on its hot path
(issue 4's benchmark goal); it checks heads against RFC 9112's grammar and
passes bodies through by Content-Length or chunk.  The parsers are tested on
their own in ``test_http11``; here a scripted upstream splits, lies and trails.
"""

from __future__ import annotations

from typing import Any

from twisted.internet import defer, reactor
from twisted.internet.abstract import FileDescriptor
from twisted.internet.error import ConnectionDone
from twisted.internet.protocol import Factory, Protocol
from twisted.python.failure import Failure
from twisted.trial import unittest

from tests.support.chunks import dechunk
from tests.support.inject_github import documentationAddress
from tests.support.inject_harness import TOKEN, AnySNI, InjectHarness, LogCapture

# ---------------------------------------------------------------------- a scripted upstream


#: How a script ends after its last piece: True closes TLS cleanly (close_notify
#: first), BARE_CLOSE closes only the TCP connection under it, False stays open.
BARE_CLOSE = "bare"
Close = bool | str


class Scripted(Protocol):
    """Answers each request head with the pieces its path is scripted to, each
    piece its own write a reactor turn or more apart (so its own TLS record and,
    as a rule, its own read at the injector)."""

    factory: ScriptedFactory

    def connectionMade(self) -> None:
        self.factory.connections += 1
        self.buffer = b""

    def dataReceived(self, data: bytes) -> None:
        self.factory.raw += data
        self.buffer += data
        while b"\r\n\r\n" in self.buffer:
            head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
            parts = head.split(b" ")
            if len(parts) < 3 or parts[1] not in self.factory.script:
                continue  # a body the test sent along; ``raw`` has it
            self.factory.heads.append(head)
            pieces, close = self.factory.script[parts[1]]
            self._play(list(pieces), close)

    def _play(self, pieces: list[bytes], close: Close) -> None:
        self.transport.write(pieces[0])  # type: ignore[union-attr]
        if len(pieces) > 1:
            later = reactor.callLater(0.002, self._play, pieces[1:], close)  # type: ignore[attr-defined,unused-ignore]
            self.factory.later.append(later)
        elif close == BARE_CLOSE:
            # Under the TLS layer: a TCP close with no close_notify before it.
            below: Any = self.transport
            while not isinstance(below, FileDescriptor):
                below = below.transport
            below.loseConnection()
        elif close:
            self.transport.loseConnection()  # type: ignore[union-attr]


class ScriptedFactory(Factory):
    # Twisted 26 wants Factory[Scripted] here; 22.4's Factory cannot be subscripted at run time.
    protocol = Scripted  # type: ignore[assignment,unused-ignore]

    def __init__(self, script: dict[bytes, tuple[list[bytes], Close]]) -> None:
        self.script = script
        self.heads: list[bytes] = []
        self.raw = b""
        self.connections = 0
        self.later: list[Any] = []

    def cancel(self) -> None:
        for call in self.later:
            if call.active():
                call.cancel()


class Client(Protocol):
    """Sends bytes, keeps everything until the connection ends, and how it ended."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.received = bytearray()
        self.reason: Failure | None = None
        self.done: defer.Deferred[Client] = defer.Deferred()

    def connectionMade(self) -> None:
        self.transport.write(self.data)  # type: ignore[union-attr]

    def dataReceived(self, data: bytes) -> None:
        self.received += data

    def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
        self.reason = reason
        self.done.callback(self)


class ScriptedUpstream(unittest.TestCase):
    timeout = 15

    def setUp(self) -> None:
        self.h = InjectHarness(reactor)
        self.addCleanup(self.h.close)
        self.logs = LogCapture()
        self.logs.start()
        self.addCleanup(self.logs.stop)

    def serve(self, script: dict[bytes, tuple[list[bytes], Close]]) -> tuple[ScriptedFactory, int]:
        factory = ScriptedFactory(script)
        self.addCleanup(factory.cancel)
        port = reactor.listenSSL(  # type: ignore[attr-defined]
            0, self.h.track(factory), self.h.pki.serverOptions(["api.github.com"]), interface="127.0.0.1"
        )
        self.h.ports.append(port)
        address = documentationAddress(30)
        self.h.dialer.map(address, port.getHost().port)
        return factory, self.h.tunnelTo("api.github.com", [address])

    def send(self, port: int, data: bytes) -> defer.Deferred[Client]:
        from twisted.internet import endpoints

        client = Client(data)
        endpoint = endpoints.wrapClientTLS(
            AnySNI(self.h.ca.pem, "api.github.com"), endpoints.TCP4ClientEndpoint(reactor, "127.0.0.1", port)
        )
        d: defer.Deferred[Client] = endpoints.connectProtocol(endpoint, client)
        d.addCallback(lambda _: client.done)
        return d

    @defer.inlineCallbacks
    def test_aContentLengthBodySplitAcrossManyReadsArrivesWhole(self) -> Any:
        body = bytes(range(256)) * 40
        pieces = [b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n" % len(body), b"X-A: b\r\n\r\n"]
        pieces += [body[i : i + 97] for i in range(0, len(body), 97)]
        factory, port = self.serve({b"/big": (pieces, False)})
        client = yield self.send(port, b"GET /big HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        head, _, got = bytes(client.received).partition(b"\r\n\r\n")
        self.assertTrue(head.startswith(b"HTTP/1.1 200 OK\r\n"), head)
        self.assertIn(b"x-a: b", head)
        self.assertIn(b"connection: close", head)
        self.assertEqual(got, body)
        self.assertIsInstance(client.reason.value, ConnectionDone)
        self.assertIn(b"authorization: token " + TOKEN.encode().lower(), factory.heads[0].lower())

    @defer.inlineCallbacks
    def test_aChunkedResponseWithExtensionsAndTrailersIsReframed(self) -> Any:
        raw = b"5;name=value\r\nhello\r\n6;x\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n"
        pieces = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"]
        pieces += [raw[i : i + 3] for i in range(0, len(raw), 3)]
        factory, port = self.serve(
            {
                b"/chunked": (pieces, False),
                b"/after": ([b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nafter"], False),
            }
        )
        client = yield self.send(
            port,
            b"GET /chunked HTTP/1.1\r\nHost: x\r\n\r\nGET /after HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
        first, _, rest = bytes(client.received).partition(b"\r\n\r\n")
        self.assertIn(b"transfer-encoding: chunked", first)
        body, rest = dechunk(rest)
        self.assertEqual(body, b"hello world")
        self.assertTrue(rest.startswith(b"\r\nHTTP/1.1 200 OK\r\n"), rest)
        self.assertTrue(rest.endswith(b"\r\n\r\nafter"), rest)
        self.assertNotIn(b"X-Trailer", client.received)
        self.assertNotIn(b"name=value", client.received)
        self.assertEqual(factory.connections, 1, "keep-alive after a chunked response")

    @defer.inlineCallbacks
    def test_aResponseShorterThanItsLengthCutsTheClient(self) -> Any:
        pieces = [b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n", b"only ten b"]
        _factory, port = self.serve({b"/short": (pieces, True)})
        client = yield self.send(port, b"GET /short HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertTrue(bytes(client.received).endswith(b"\r\n\r\nonly ten b"), client.received)
        self.assertNotIsInstance(client.reason.value, ConnectionDone)

    @defer.inlineCallbacks
    def test_bytesBeyondTheLengthEndTheUpstreamConnectionNotTheClients(self) -> Any:
        factory, port = self.serve(
            {
                b"/long": ([b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhelloHTTP/1.1 200 OK\r\n\r\nsmuggled"], False),
                b"/next": ([b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nnext"], False),
            }
        )
        client = yield self.send(
            port, b"GET /long HTTP/1.1\r\nHost: x\r\n\r\nGET /next HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        received = bytes(client.received)
        self.assertNotIn(b"smuggled", received)
        self.assertEqual(received.count(b"HTTP/1.1 200 OK"), 2, received)
        self.assertIn(b"\r\n\r\nhelloHTTP/1.1 200 OK\r\n", received)
        self.assertTrue(received.endswith(b"\r\n\r\nnext"), received)
        self.assertEqual(factory.connections, 2, "the desynchronised connection is not reused")

    @defer.inlineCallbacks
    def test_headAnd204And304HaveNoBody(self) -> Any:
        factory, port = self.serve(
            {
                b"/head": ([b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n"], False),
                b"/204": ([b"HTTP/1.1 204 No Content\r\n\r\n"], False),
                b"/304": ([b"HTTP/1.1 304 Not Modified\r\nContent-Length: 50\r\n\r\n"], False),
                b"/last": ([b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nlast"], False),
            }
        )
        client = yield self.send(
            port,
            b"HEAD /head HTTP/1.1\r\nHost: x\r\n\r\nGET /204 HTTP/1.1\r\nHost: x\r\n\r\n"
            b"GET /304 HTTP/1.1\r\nHost: x\r\n\r\nGET /last HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
        received = bytes(client.received)
        self.assertEqual(
            received,
            b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n"
            b"HTTP/1.1 204 No Content\r\n\r\n"
            b"HTTP/1.1 304 Not Modified\r\ncontent-length: 50\r\n\r\n"
            b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\nconnection: close\r\n\r\nlast",
        )
        self.assertEqual(factory.connections, 1)
        self.assertEqual(len(factory.heads), 4)

    @defer.inlineCallbacks
    def test_aMalformedResponseHeadIs502(self) -> Any:
        _factory, port = self.serve(
            {b"/bad": ([b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!"], False)}
        )
        client = yield self.send(port, b"GET /bad HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertTrue(bytes(client.received).startswith(b"HTTP/1.1 502 "), client.received)
        self.assertIn(b"reached no api.github.com: more than one Content-Length", client.received)

    @defer.inlineCallbacks
    def test_aBadChunkAfterTheHeadCutsTheClient(self) -> Any:
        pieces = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", b"5\r\nhello\r\n", b"zz\r\n"]
        _factory, port = self.serve({b"/bad": (pieces, False)})
        client = yield self.send(port, b"GET /bad HTTP/1.1\r\nHost: x\r\n\r\n")
        # What reached the client before the cut may be lost to the reset; a
        # finished body never reaches it.
        self.assertNotIn(b"0\r\n\r\n", client.received)
        self.assertNotIsInstance(client.reason.value, ConnectionDone)

    @defer.inlineCallbacks
    def test_aResponseDelimitedByCloseClosesTheClientToo(self) -> Any:
        pieces = [b"HTTP/1.1 200 OK\r\n\r\n", b"until ", b"the end"]
        _factory, port = self.serve({b"/eof": (pieces, True)})
        client = yield self.send(port, b"GET /eof HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertEqual(bytes(client.received), b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil the end")
        self.assertIsInstance(client.reason.value, ConnectionDone)

    @defer.inlineCallbacks
    def test_aCloseDelimitedBodyEndedWithoutCloseNotifyCutsTheClient(self) -> Any:
        # A bare TCP close may be a truncation: the client must not get a
        # clean end (close_notify) for a body that may be cut short.
        pieces = [b"HTTP/1.1 200 OK\r\n\r\n", b"until ", b"the cut"]
        _factory, port = self.serve({b"/cut": (pieces, BARE_CLOSE)})
        client = yield self.send(port, b"GET /cut HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertNotIsInstance(client.reason.value, ConnectionDone)
        self.assertTrue(any("without TLS close_notify" in line for line in self.logs.lines), self.logs.lines)

    @defer.inlineCallbacks
    def test_aChunkedRequestIsReframedUpstream(self) -> Any:
        factory, port = self.serve({b"/up": ([b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"], False)})
        client = yield self.send(
            port,
            b"POST /up HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
            b"3;ext=1\r\nabc\r\n0\r\nX-T: 1\r\n\r\n",
        )
        self.assertTrue(bytes(client.received).endswith(b"\r\n\r\nok"), client.received)
        self.assertIn(b"transfer-encoding: chunked", factory.heads[0].lower())
        self.assertTrue(factory.raw.endswith(b"\r\n\r\n3\r\nabc\r\n0\r\n\r\n"), factory.raw)

    @defer.inlineCallbacks
    def test_transferEncodingSpelledWithUnderscoreNeverReachesThePooledUpstream(self) -> Any:
        # Issue 23's gadget: beside Content-Length, an upstream that reads
        # Transfer_Encoding as Transfer-Encoding frames by the chunks, and the
        # kept-alive connection's next request would be the body's "GET /smuggled".
        factory, port = self.serve({b"/first": ([b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"], False)})
        first = b"GET /first HTTP/1.1\r\nHost: x\r\n\r\n"
        for name in (b"Transfer_Encoding", b"transfer_encoding"):
            smuggled = b"0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"
            gadget = b"POST /first HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%b: chunked\r\n\r\n%b" % (
                len(smuggled),
                name,
                smuggled,
            )
            client = yield self.send(port, first + gadget)
            received = bytes(client.received)
            self.assertEqual([int(r[:3]) for r in received.split(b"HTTP/1.1 ")[1:]], [200, 400], received)
            self.assertTrue(
                received.endswith(b"refused: a header named %b, read as Transfer-Encoding where _ is taken for -\n" % name),
                received,
            )
        # The upstream saw the two good requests, on the one pooled connection, and nothing else.
        self.assertEqual(factory.raw.count(b"GET /first HTTP/1.1\r\n"), 2, factory.raw)
        self.assertNotIn(b"POST", factory.raw)
        self.assertNotIn(b"smuggled", factory.raw)
        self.assertEqual(factory.connections, 1)

    @defer.inlineCallbacks
    def test_aResponseWithFramingSpelledWithUnderscoreIs502(self) -> Any:
        _factory, port = self.serve(
            {b"/te": ([b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer_Encoding: chunked\r\n\r\n0\r\n\r\n"], False)}
        )
        client = yield self.send(port, b"GET /te HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertTrue(bytes(client.received).startswith(b"HTTP/1.1 502 "), client.received)
        self.assertIn(
            b"reached no api.github.com: a header named Transfer_Encoding, read as Transfer-Encoding where _ is taken for -",
            client.received,
        )

    @defer.inlineCallbacks
    def test_http10IsRefused(self) -> Any:
        factory, port = self.serve({})
        client = yield self.send(port, b"GET / HTTP/1.0\r\nHost: x\r\n\r\n")
        self.assertTrue(bytes(client.received).startswith(b"HTTP/1.1 505 "), client.received)
        self.assertEqual(factory.connections, 0)
