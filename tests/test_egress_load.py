"""Load and faults, bounded: 500 concurrent tunnels and the fd count, an upstream
reset mid-transfer, and generated garbage on live sockets."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from typing import Any

from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.error import ConnectionDone
from twisted.internet.protocol import Factory, Protocol
from twisted.trial.unittest import TestCase

from agentsandbox.egress.testing import FixedResolver, MappedDialer
from tests.support.egress_fixtures import (
    Collector,
    Echo,
    ProxyHarness,
    deferredTest,
    exchange,
    listen,
    reactor,
    sleep,
    waitFor,
)

CONNECT = b"CONNECT echo.example.org:443 HTTP/1.1\r\nHost: echo.example.org:443\r\n\r\n"


def openFds() -> int:
    return len(os.listdir("/proc/self/fd"))


class Source(Protocol):
    """Sends ``size`` bytes of a known pattern as fast as the proxy takes them, then closes."""

    #: A TCP transport: also the consumer this producer registers with (not in ITransport).
    transport: Any

    BLOCK = hashlib.sha256(b"source").digest() * 2048  # 64 KiB

    def __init__(self, size: int) -> None:
        self.left = size

    @classmethod
    def digest(cls, size: int) -> str:
        h = hashlib.sha256()
        for _ in range(size // len(cls.BLOCK)):
            h.update(cls.BLOCK)
        return h.hexdigest()

    def connectionMade(self) -> None:
        self.transport.registerProducer(self, True)
        self.resumeProducing()

    def resumeProducing(self) -> None:
        self.paused = False
        while self.left and not self.paused:
            self.transport.write(self.BLOCK)
            self.left -= len(self.BLOCK)
        if not self.left:
            self.transport.unregisterProducer()
            self.transport.loseConnection()

    def pauseProducing(self) -> None:
        self.paused = True

    def stopProducing(self) -> None:
        self.left = 0


class SmallWindowCollector(Collector):
    """A client with a fixed 1 MiB receive buffer (no autotuning up to tcp_rmem's max)."""

    def makeConnection(self, transport: Any) -> None:
        import socket

        transport.getHandle().setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        super().makeConnection(transport)


class Resetter(Protocol):
    """Sends 1 MiB, then resets the connection (RST) mid-transfer."""

    #: A TCP transport: abortConnection is not in ITransport.
    transport: Any

    def connectionMade(self) -> None:
        self.transport.write(b"r" * (1 << 20))
        reactor.callLater(0.05, self.transport.abortConnection)


class LoadTests(TestCase):
    """Run with the zero-copy splice; ``LoadTestsCopyLoop`` runs them on Twisted's copy loop."""

    spliceFast = True
    async def proxy(self, upstream: Callable[[], Protocol] = Echo, **kw: Any) -> ProxyHarness:
        server = await listen(Factory.forProtocol(upstream))
        self.addCleanup(server.stopListening)
        dialer = MappedDialer(reactor)
        dialer.route("192.0.2.10", 443, server.getHost().port)
        h = ProxyHarness(["echo.example.org"], FixedResolver({"echo.example.org": ["192.0.2.10"]}), dialer, **kw, spliceFast=self.spliceFast)
        await h.start()
        self.addCleanup(h.stop)
        return h

    @deferredTest
    async def test_fiveHundredTunnelsThenFdsBackToBaseline(self) -> None:
        # every tunnel goes to splice(2) at once here, so its pipes are counted too
        h = await self.proxy(zeroCopyAfter=0)
        # warm up once so lazily created fds (thread pools, log files) exist in the baseline
        await exchange(h.port, CONNECT + b"warm")
        await waitFor(lambda: not h.factory.tunnels, "the warm-up tunnel to close")
        baseline = openFds()
        clients: list[Collector] = []
        for _ in range(500):
            c = Collector(CONNECT)
            clients.append(c)
            await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", h.port), c)
        await waitFor(lambda: len(h.factory.tunnels) == 500, "500 open tunnels", 60)
        for i, c in enumerate(clients):
            c.transport.write(b"%d;" % i)
        await waitFor(lambda: all(c.received.endswith(b"%d;" % i) for i, c in enumerate(clients)), "every echo", 60)
        # each tunnel holds 4 fds here: client, proxy's client side, proxy's upstream side, echo
        self.assertGreaterEqual(openFds() - baseline, 2000)
        for c in clients:
            c.transport.loseConnection()
        for c in clients:
            await c.done
        await waitFor(lambda: not h.factory.tunnels and h.factory.reserved == 0, "the tunnels to close", 60)
        await waitFor(lambda: openFds() <= baseline, f"fds back to {baseline} (now {openFds()})", 60)
        self.assertEqual(len([r for r in h.records() if r["event"] == "tunnel"]), 501)
        # the warm-up half-closed before its tunnel opened, so it stayed on the copy loop
        self.assertEqual(h.factory.zeroCopied, 500 if self.spliceFast else 0)

    @deferredTest
    async def test_upstreamResetMidTransfer(self) -> None:
        h = await self.proxy(upstream=Resetter)
        c = Collector(CONNECT)
        await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", h.port), c)
        await c.done
        self.assertTrue(c.received.startswith(b"HTTP/1.1 200"))
        # the reset reaches the client as a reset, so a truncated transfer never looks complete
        self.assertIsNone(c.reason.check(ConnectionDone), c.reason)
        rec = [r for r in h.records() if r["event"] == "tunnel"][-1]
        self.assertIn("upstream connection ended", rec.get("reason", ""))
        # the same proxy serves the next client: a refusal, and a tunnel that carries data
        self.assertTrue((await exchange(h.port, b"CONNECT example.net:443 HTTP/1.1\r\nHost: x\r\n\r\n")).startswith(b"HTTP/1.1 403"))
        nxt = Collector(CONNECT)
        await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", h.port), nxt)
        await waitFor(lambda: len(nxt.received) > 100_000, "the next client's data")
        self.assertTrue(nxt.received.startswith(b"HTTP/1.1 200 Connection established\r\n\r\nrrrr"))
        await nxt.done


    @deferredTest
    async def test_halfCloseAfterTheTunnelOpened(self) -> None:
        h = await self.proxy()
        c = Collector(CONNECT)
        await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", h.port), c)
        await waitFor(lambda: c.received.endswith(b"\r\n\r\n"), "the 200")
        payload = bytes(range(256)) * 4096  # 1 MiB
        c.transport.write(payload)
        c.transport.loseWriteConnection()
        await c.done
        self.assertEqual(bytes(c.received).partition(b"\r\n\r\n")[2], payload)
        self.assertIsNotNone(c.reason.check(ConnectionDone), c.reason)
        rec = [r for r in h.records() if r["event"] == "tunnel"][-1]
        self.assertEqual((rec["up"], rec["down"], rec.get("reason")), (len(payload), len(payload), None))
        # 1 MiB each way passes the hand-over threshold mid-stream
        self.assertEqual(h.factory.zeroCopied, 1 if self.spliceFast else 0)

    @deferredTest
    async def test_backPressureFromASlowClient(self) -> None:
        size = 64 << 20
        h = await self.proxy(upstream=lambda: Source(size))
        c = SmallWindowCollector(CONNECT)
        await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", h.port), c)
        await waitFor(lambda: len(c.received) > 100, "the first bytes")
        c.transport.pauseProducing()  # the client stops reading
        await waitFor(lambda: h.factory.tunnels, "the tunnel")
        (tunnel,) = h.factory.tunnels
        seen = -1
        for _ in range(200):  # bounded: until the proxy's count stops moving
            await sleep(0.02)
            if tunnel.down == seen:
                break
            seen = tunnel.down
        # what the proxy moved is bounded by the client's 1 MiB window, the socket
        # buffers and one pipe, not the 64 MiB the upstream tried to send
        self.assertLess(tunnel.down, 16 << 20)
        c.transport.resumeProducing()
        await c.done
        body = bytes(c.received).partition(b"\r\n\r\n")[2]
        self.assertEqual(len(body), size)
        self.assertEqual(h.factory.zeroCopied, 1 if self.spliceFast else 0)
        self.assertEqual(hashlib.sha256(body).hexdigest(), Source.digest(size))


class LoadTestsCopyLoop(LoadTests):
    spliceFast = False


class LiveGarbageTests(TestCase):
    @deferredTest
    async def test_garbageOverLiveSocketsLeavesTheProxyServing(self) -> None:
        import random

        server = await listen(Factory.forProtocol(Echo))
        self.addCleanup(server.stopListening)
        dialer = MappedDialer(reactor)
        dialer.route("192.0.2.10", 443, server.getHost().port)
        h = ProxyHarness(["echo.example.org"], FixedResolver({"echo.example.org": ["192.0.2.10"]}), dialer, proxy={"header_timeout": 2})
        await h.start()
        self.addCleanup(h.stop)
        rng = random.Random(1928)
        samples = [
            b"\x05", b"\x05\x00", b"\x05\x01\x00\x05\x01\x00\x03\x00\x01\xbb", b"\x05\xff" + bytes(255),
            b"CONNECT :443 HTTP/1.1\r\n\r\n", b"GET http:// HTTP/1.1\r\nHost: \r\n\r\n", b"\r\n\r\n",
            b"POST http://echo.example.org/ HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"GET http://echo.example.org/ HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
            b"A" * 70000 + b"\r\n\r\n",
        ]
        for _ in range(300):
            base = rng.choice(samples)
            noise = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 64)))
            cut = rng.randrange(len(base) + 1)
            out = await exchange(h.port, base[:cut] + noise)
            self.assertTrue(out == b"" or out[:1] == b"\x05" or out.startswith(b"HTTP/1.1 4") or out.startswith(b"HTTP/1.1 5"), out[:80])
        out = await exchange(h.port, CONNECT + b"alive")
        self.assertTrue(out.endswith(b"alive"))
        self.assertEqual(self.flushLoggedErrors(), [])
