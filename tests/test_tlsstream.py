"""TLSStream (stdlib ``ssl`` over a Twisted transport) against Twisted's own TLS.

The peer in every test is Twisted's ``TLSMemoryBIOProtocol`` on the other end
of a loopback socket: an independent implementation, so what passes here
speaks TLS, not merely TLSStream to itself.
"""

from __future__ import annotations

import os
import ssl
from typing import Any
from unittest import mock

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from service_identity import VerificationError
from twisted.internet import defer, endpoints, reactor
from twisted.internet import ssl as tssl
from twisted.internet.address import IPv4Address
from twisted.internet.error import ConnectionDone, ConnectionLost
from twisted.internet.interfaces import IHandshakeListener
from twisted.internet.protocol import Factory, Protocol, ServerFactory
from twisted.internet.testing import StringTransport
from twisted.protocols.tls import TLSMemoryBIOFactory, TLSMemoryBIOProtocol
from twisted.python.failure import Failure
from twisted.trial import unittest
from zope.interface import implementer

from agentsandbox.egress.testing import UpstreamPKI
from agentsandbox.egress.tls import InjectionCA, upstreamContext, verifyUpstream
from agentsandbox.egress.tlsstream import TLSHandshakeError, TLSStream
from tests.support.inject_harness import LogCapture

HOST = "api.github.com"


@implementer(IHandshakeListener)
class Recorder(Protocol):
    """Keeps what arrives and how the connection ended; writes ``greeting`` at once."""

    def __init__(self, greeting: bytes = b"", closeAfter: bytes | None = None) -> None:
        self.greeting = greeting
        self.closeAfter = closeAfter
        self.received = bytearray()
        self.events: list[str] = []
        self.reason: Failure | None = None
        self.lost: defer.Deferred[None] = defer.Deferred()
        self.got: defer.Deferred[None] = defer.Deferred()

    def connectionMade(self) -> None:
        self.events.append("connected")
        if self.greeting:
            self.transport.write(self.greeting)  # type: ignore[union-attr]

    def handshakeCompleted(self) -> None:
        self.events.append("handshake")

    def dataReceived(self, data: bytes) -> None:
        self.received += data
        if self.closeAfter is not None and self.received.endswith(self.closeAfter):
            self.transport.loseConnection()  # type: ignore[union-attr]
        if not self.got.called:
            self.got.callback(None)

    def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
        self.events.append("lost")
        self.reason = reason
        self.lost.callback(None)


class Raw(Protocol):
    """A plain TCP peer that says ``data`` and records the answer."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.received = bytearray()
        self.lost: defer.Deferred[None] = defer.Deferred()

    def connectionMade(self) -> None:
        if self.data:
            self.transport.write(self.data)  # type: ignore[union-attr]

    def dataReceived(self, data: bytes) -> None:
        self.received += data

    def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
        self.lost.callback(None)


class Base(unittest.TestCase):
    timeout = 30

    def setUp(self) -> None:
        self.ca = InjectionCA.create([HOST], label="tlsstream test")
        self.pki = UpstreamPKI.create()

    def listen(self, build: Any) -> int:
        class OneShot(ServerFactory):
            def buildProtocol(self, addr: Any) -> Any:
                return build()

        port = reactor.listenTCP(0, OneShot(), interface="127.0.0.1")  # type: ignore[attr-defined,unused-ignore]
        self.addCleanup(port.stopListening)
        host = port.getHost()
        assert isinstance(host, IPv4Address)
        return int(host.port)

    def listenOurs(self, inner: Protocol) -> int:
        """A listener whose one connection is ``inner`` behind our server TLS."""
        return self.listen(lambda: TLSStream(self.ca.serverContext(HOST), inner, serverSide=True))

    def connect(self, port: int, protocol: Any) -> defer.Deferred[Any]:
        endpoint = endpoints.TCP4ClientEndpoint(reactor, "127.0.0.1", port)
        d: defer.Deferred[Any] = endpoints.connectProtocol(endpoint, protocol)  # type: ignore[no-untyped-call,unused-ignore]
        return d

    def twistedClient(self, inner: Protocol, trustPEM: bytes, host: str = HOST) -> Any:
        options = tssl.optionsForClientTLS(host, trustRoot=tssl.Certificate.loadPEM(trustPEM))
        return TLSMemoryBIOProtocol(TLSMemoryBIOFactory(options, True, Factory()), inner)  # type: ignore[no-untyped-call,unused-ignore]

    def twistedServer(self, inner: Protocol, names: list[str]) -> Any:
        factory = TLSMemoryBIOFactory(self.pki.serverOptions(names), False, Factory())
        return TLSMemoryBIOProtocol(factory, inner)  # type: ignore[no-untyped-call,unused-ignore]


class ServerSide(Base):
    """TLSStream as the server the sandbox's clients see."""

    @defer.inlineCallbacks
    def test_roundTripAndCleanCloseBothWays(self) -> Any:
        server = Recorder(greeting=b"hello before the handshake ends", closeAfter=b"bye")
        stream = TLSStream(self.ca.serverContext(HOST), server, serverSide=True)
        port = self.listen(lambda: stream)
        client = Recorder(greeting=b"ping bye")
        yield self.connect(port, self.twistedClient(client, self.ca.pem))
        yield client.lost
        reason = client.reason
        assert reason is not None
        yield server.lost
        # The server's early write waited for the handshake, then went out.
        self.assertEqual(bytes(client.received), b"hello before the handshake ends")
        self.assertEqual(bytes(server.received), b"ping bye")
        self.assertEqual(server.events, ["connected", "handshake", "lost"])
        # close_notify reached the client: Twisted reports a clean close only then.
        reason.trap(ConnectionDone)
        self.assertEqual(stream.negotiatedProtocol, None)

    @defer.inlineCallbacks
    def test_thePeersCloseNotifyEndsWithConnectionDone(self) -> Any:
        server = Recorder()
        port = self.listenOurs(server)
        client = Recorder(greeting=b"one", closeAfter=None)
        clientTLS = self.twistedClient(client, self.ca.pem)
        yield self.connect(port, clientTLS)
        yield server.got
        client.transport.loseConnection()  # type: ignore[union-attr]
        yield server.lost
        reason = server.reason
        assert reason is not None
        reason.trap(ConnectionDone)
        yield client.lost

    @defer.inlineCallbacks
    def test_aTCPCloseWithoutCloseNotifyEndsWithConnectionLost(self) -> Any:
        server = Recorder()
        port = self.listenOurs(server)
        client = Recorder(greeting=b"one")
        clientTLS = self.twistedClient(client, self.ca.pem)
        yield self.connect(port, clientTLS)
        yield server.got
        clientTLS.transport.loseConnection()  # the TCP connection under the client's TLS
        yield server.lost
        reason = server.reason
        assert reason is not None
        reason.trap(ConnectionLost)
        self.assertIn("without TLS close_notify", reason.getErrorMessage())
        yield client.lost

    @defer.inlineCallbacks
    def test_aClientThatDistrustsUsEndsWithAnSSLError(self) -> Any:
        server = Recorder(greeting=b"never delivered")
        port = self.listenOurs(server)
        client = Recorder(greeting=b"never sent")
        yield self.connect(port, self.twistedClient(client, self.pki.pem))  # trusts another CA
        yield server.lost
        reason = server.reason
        assert reason is not None
        yield client.lost
        self.assertIsInstance(reason.value, ssl.SSLError)
        self.assertEqual(server.received, b"")
        self.assertEqual(client.received, b"")
        self.assertNotIn("handshake", server.events)

    @defer.inlineCallbacks
    def test_plaintextIsATLSErrorAndNothingPlainGoesBack(self) -> Any:
        server = Recorder()
        port = self.listenOurs(server)
        raw = Raw(b"GET / HTTP/1.1\r\nHost: api.github.com\r\n\r\n")
        yield self.connect(port, raw)
        yield server.lost
        reason = server.reason
        assert reason is not None
        yield raw.lost
        self.assertIsInstance(reason.value, ssl.SSLError)
        self.assertEqual(server.received, b"")
        # Nothing in plaintext went back: at most a TLS alert record (type 21).
        self.assertIn(bytes(raw.received[:1]), (b"", b"\x15"))

    @defer.inlineCallbacks
    def test_aCloseDuringTheHandshakeIsAHandshakeError(self) -> Any:
        server = Recorder()
        port = self.listenOurs(server)
        raw = Raw(b"\x16\x03\x01\x00\x10")  # a ClientHello record header, then nothing
        yield self.connect(port, raw)
        raw.transport.loseConnection()  # type: ignore[union-attr]
        yield server.lost
        reason = server.reason
        assert reason is not None
        self.assertIsInstance(reason.value, TLSHandshakeError)
        self.assertIn("during the TLS handshake", str(reason.value))

    @defer.inlineCallbacks
    def test_anAbortCutsAndLaterWritesAreDropped(self) -> Any:
        server = Recorder()
        stream = TLSStream(self.ca.serverContext(HOST), server, serverSide=True)
        port = self.listen(lambda: stream)
        client = Recorder(greeting=b"x")
        yield self.connect(port, self.twistedClient(client, self.ca.pem))
        yield server.got
        stream.abortConnection()
        stream.write(b"after the abort")
        stream.loseConnection()
        yield server.lost
        yield client.lost
        self.assertEqual(client.received, b"")
        # Cut, not closed: no close_notify reached the client.
        assert client.reason is not None
        self.assertNotIsInstance(client.reason.value, ConnectionDone)

    @defer.inlineCallbacks
    def test_aBigWriteArrivesWhole(self) -> Any:
        payload = os.urandom(3 * 1024 * 1024 + 17)  # many records, several socket writes
        server = Recorder()
        port = self.listenOurs(server)
        client = Recorder(greeting=payload)
        yield self.connect(port, self.twistedClient(client, self.ca.pem))
        while len(server.received) < len(payload):
            server.got = defer.Deferred()
            yield server.got
        self.assertEqual(bytes(server.received), payload)
        client.transport.loseConnection()  # type: ignore[union-attr]
        yield server.lost
        yield client.lost


class ClientSide(Base):
    """TLSStream as the upstream client, verifying the real host."""

    def stream(self, inner: Protocol, context: ssl.SSLContext, host: str = HOST, verify: Any = "default") -> TLSStream:
        check = verifyUpstream(host) if verify == "default" else verify
        return TLSStream(context, inner, serverSide=False, serverHostname=host, verify=check)

    @defer.inlineCallbacks
    def test_verifiedRoundTripWithALPN(self) -> Any:
        server = Recorder(greeting=b"pong")
        port = self.listen(lambda: self.twistedServer(server, [HOST]))
        client = Recorder(greeting=b"ping")
        stream = self.stream(client, upstreamContext(self.pki.pem))
        yield self.connect(port, stream)
        yield client.got
        self.assertEqual(bytes(client.received), b"pong")
        self.assertEqual(client.events, ["connected", "handshake"])
        self.assertEqual(stream.negotiatedProtocol, b"http/1.1")
        yield server.got
        self.assertEqual(bytes(server.received), b"ping")
        stream.loseConnection()
        yield server.lost
        reason = server.reason
        assert reason is not None
        reason.trap(ConnectionDone)

    @defer.inlineCallbacks
    def test_anUntrustedChainIsRefusedBeforeAnythingIsSent(self) -> Any:
        server = Recorder()
        port = self.listen(lambda: self.twistedServer(server, [HOST]))
        client = Recorder(greeting=b"GET /user with a token")
        yield self.connect(port, self.stream(client, upstreamContext(None)))  # the system roots
        yield client.lost
        reason = client.reason
        assert reason is not None
        self.assertIsInstance(reason.value, ssl.SSLCertVerificationError)
        self.assertNotIn("handshake", client.events)
        yield server.lost
        self.assertEqual(server.received, b"")

    @defer.inlineCallbacks
    def test_openSSLRefusesAnotherName(self) -> Any:
        server = Recorder()
        port = self.listen(lambda: self.twistedServer(server, ["example.org"]))
        client = Recorder(greeting=b"secret")
        yield self.connect(port, self.stream(client, upstreamContext(self.pki.pem)))
        yield client.lost
        reason = client.reason
        assert reason is not None
        self.assertIsInstance(reason.value, ssl.SSLCertVerificationError)
        assert isinstance(reason.value, ssl.SSLCertVerificationError)
        self.assertIn("api.github.com", reason.value.verify_message)
        yield server.lost
        self.assertEqual(server.received, b"")

    @defer.inlineCallbacks
    def test_serviceIdentityRefusesAnotherNameToo(self) -> Any:
        # With OpenSSL's own name check off, the verifier alone must refuse,
        # and the held write must never leave.
        context = upstreamContext(self.pki.pem)
        context.check_hostname = False
        server = Recorder()
        port = self.listen(lambda: self.twistedServer(server, ["example.org"]))
        client = Recorder(greeting=b"secret")
        yield self.connect(port, self.stream(client, context))
        yield client.lost
        reason = client.reason
        assert reason is not None
        self.assertIsInstance(reason.value, VerificationError)
        self.assertEqual(client.events, ["connected", "lost"])
        yield server.lost
        self.assertEqual(server.received, b"")

    @defer.inlineCallbacks
    def test_loseConnectionBeforeTheHandshakeSendsWhatWasWrittenFirst(self) -> Any:
        server = Recorder()
        port = self.listen(lambda: self.twistedServer(server, [HOST]))
        client = Recorder(greeting=b"last words")
        stream = self.stream(client, upstreamContext(self.pki.pem))
        yield self.connect(port, stream)
        stream.loseConnection()
        yield server.lost
        reason = server.reason
        assert reason is not None
        self.assertEqual(bytes(server.received), b"last words")
        reason.trap(ConnectionDone)


class SystemRoots(Base):
    """Where this Python's OpenSSL points at paths the system lacks, the usual
    bundle list is the system's roots."""

    missing = ssl.DefaultVerifyPaths(None, None, "SSL_CERT_FILE", "/nowhere/cert.pem", "SSL_CERT_DIR", "/nowhere/certs")  # type: ignore[arg-type]

    @defer.inlineCallbacks
    def test_theFirstReadableBundleIsLoaded(self) -> Any:
        bundle = self.mktemp()
        with open(bundle, "wb") as f:
            f.write(self.pki.pem)  # stands in for the distribution's bundle
        context = upstreamContext(None, defaults=self.missing, bundles=["/nowhere/ca-bundle.crt", bundle])
        server = Recorder(greeting=b"pong")
        port = self.listen(lambda: self.twistedServer(server, [HOST]))
        client = Recorder()
        stream = TLSStream(context, client, serverSide=False, serverHostname=HOST, verify=verifyUpstream(HOST))
        yield self.connect(port, stream)
        yield client.got
        self.assertEqual(bytes(client.received), b"pong")
        stream.loseConnection()
        yield server.lost

    def test_noBundleAnywhereIsAWarningNamingTheFix(self) -> None:
        logs = LogCapture()
        logs.start()
        self.addCleanup(logs.stop)
        upstreamContext(None, defaults=self.missing, bundles=["/nowhere/ca-bundle.crt"])
        [line] = [line for line in logs.lines if "root certificates" in line]
        self.assertIn("/nowhere/ca-bundle.crt", line)
        self.assertIn("SSL_CERT_FILE", line)


class LeafKeyLoading(unittest.TestCase):
    def test_theKeyGoesToOpenSSLEncryptedThroughAnAnonymousMemoryFile(self) -> None:
        seen: list[bytes] = []
        # tls.py's contexts are this ssl module's SSLContext: patching the class reaches them.
        real = ssl.SSLContext.load_cert_chain

        def spy(context: ssl.SSLContext, certfile: Any, keyfile: Any = None, password: Any = None) -> None:
            self.assertTrue(str(certfile).startswith("/proc/self/fd/"), certfile)
            self.assertEqual(os.readlink(certfile)[: len("/memfd:")], "/memfd:")
            with open(certfile, "rb") as f:
                seen.append(f.read())
            real(context, certfile, keyfile, password)

        ca = InjectionCA.create([HOST], label="memfd test")
        before = set(os.listdir("/proc/self/fd"))
        with mock.patch.object(ssl.SSLContext, "load_cert_chain", spy):
            ca.serverContext(HOST)
        [pem] = seen
        self.assertIn(b"-----BEGIN ENCRYPTED PRIVATE KEY-----", pem)
        self.assertNotIn(b"-----BEGIN PRIVATE KEY-----", pem)
        self.assertNotIn(b"-----BEGIN EC PRIVATE KEY-----", pem)
        self.assertEqual(pem.count(b"-----BEGIN CERTIFICATE-----"), 2)  # leaf, then the CA
        # The memory file is closed again.
        self.assertEqual(set(os.listdir("/proc/self/fd")) - before, set())


# ---------------------------------------------------------------------- bad input

_FUZZ = settings(max_examples=1_000, deadline=None, database=None, suppress_health_check=list(HealthCheck))
_SERVER_CA = InjectionCA.create([HOST], label="tlsstream fuzz")


def _server() -> tuple[TLSStream, Recorder, StringTransport]:
    inner = Recorder()
    stream = TLSStream(_SERVER_CA.serverContext(HOST), inner, serverSide=True)
    transport = StringTransport()
    stream.makeConnection(transport)
    return stream, inner, transport


def _endIfClosed(stream: TLSStream, inner: Recorder, transport: StringTransport) -> None:
    """What the reactor would do once a closing transport is gone."""
    if transport.disconnecting:
        stream.connectionLost(Failure(ConnectionDone()))
        assert inner.reason is not None
        assert isinstance(inner.reason.value, (ssl.SSLError, TLSHandshakeError)), inner.reason


@_FUZZ
@given(st.lists(st.binary(max_size=700), max_size=6))
def test_garbageBeforeTheHandshakeDeliversNothingAndRaisesNothing(chunks: list[bytes]) -> None:
    stream, inner, transport = _server()
    for chunk in chunks:
        stream.dataReceived(chunk)
    assert inner.received == b""
    assert "handshake" not in inner.events
    _endIfClosed(stream, inner, transport)


@_FUZZ
@given(st.binary(min_size=1, max_size=2000), st.integers(0, 64))
def test_garbageAfterTheHandshakeIsATLSErrorAndNothingIsDelivered(garbage: bytes, keep: int) -> None:
    stream, inner, transport = _server()
    # A real client in memory: the standard library's, trusting our CA.
    context = ssl.create_default_context(cadata=_SERVER_CA.pem.decode("ascii"))
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = context.wrap_bio(incoming, outgoing, server_hostname=HOST)
    for _ in range(4):
        try:
            client.do_handshake()
            break
        except ssl.SSLWantReadError:
            stream.dataReceived(outgoing.read())
            incoming.write(transport.value())
            transport.clear()
    stream.dataReceived(outgoing.read())  # the client's Finished
    assert inner.events == ["connected", "handshake"]
    client.write(b"real bytes")
    record = outgoing.read()
    # A valid record, then a cut or altered copy of one, then garbage.
    stream.dataReceived(record + record[:keep] + garbage)
    assert bytes(inner.received) == b"real bytes"  # a replayed record never decrypts
    _endIfClosed(stream, inner, transport)
