"""Half-close: a client that half-closes right after its request still gets the answer; privates.shutWrite."""

import tempfile
from typing import Any

from twisted.internet.interfaces import IHalfCloseableProtocol
from twisted.internet.protocol import Protocol
from twisted.trial.unittest import TestCase
from zope.interface import implementer

from agentsandbox.egress.dial import tcpDialer
from agentsandbox.egress.privates import shutWrite
from agentsandbox.egress.testing import FixedResolver
from tests.support.egress_fixtures import (
    Collector,
    ProxyHarness,
    deferredTest,
    exchange,
    listen,
    reactor,
    waitFor,
)
from tests.support.egress_servers import webSite


@implementer(IHalfCloseableProtocol)
class HalfCloser(Protocol):
    writeLost = False

    def readConnectionLost(self) -> None:
        pass

    def writeConnectionLost(self) -> None:
        self.writeLost = True


class HalfCloseTests(TestCase):
    @deferredTest
    async def test_halfCloseAfterOneAbsoluteFormRequest(self) -> None:
        site = await listen(webSite(tempfile.mkdtemp()))
        self.addCleanup(site.stopListening)
        port = site.getHost().port
        h = ProxyHarness([f"127.0.0.1:{port}"], FixedResolver({}), tcpDialer(reactor))
        await h.start()
        self.addCleanup(h.stop)
        for close in (b"Connection: close\r\n", b""):
            request = b"GET http://127.0.0.1:%d/headers HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n%s\r\n" % (port, port, close)
            out = await exchange(h.port, request, halfClose=True)
            self.assertTrue(out.startswith(b"HTTP/1.1 200 OK"), (close, out[:300]))


class ShutWriteTests(TestCase):
    """privates.shutWrite: a half-close at once when nothing is buffered, Twisted's own otherwise."""

    async def pair(self) -> tuple[Any, Any]:
        """(our transport's protocol, the peer's Collector) over a real loopback connection."""
        from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
        from twisted.internet.protocol import Factory

        peer = Collector()
        port = await listen(Factory.forProtocol(lambda: peer))
        self.addCleanup(port.stopListening)
        ours = HalfCloser()
        await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port), ours)
        return ours, peer

    @deferredTest
    async def test_emptyBufferShutsAtOnce(self) -> None:
        ours, peer = await self.pair()
        await waitFor(lambda: peer.transport is not None, "the peer's connection")
        shutWrite(ours.transport)
        # No reactor turn needed: the write side is shut and the protocol told.
        self.assertTrue(ours.writeLost)
        self.assertTrue(ours.transport._writeDisconnected)
        ours.transport.loseConnection()
        self.assertEqual(await peer.done, b"")

    @deferredTest
    async def test_bufferedBytesGoFirst(self) -> None:
        ours, peer = await self.pair()
        ours.transport.write(b"x" * 100_000)
        shutWrite(ours.transport)
        self.assertFalse(ours.writeLost)  # Twisted half-closes after the buffer drains
        await waitFor(lambda: ours.writeLost, "the half-close after the buffered bytes")
        ours.transport.loseConnection()
        self.assertEqual(await peer.done, b"x" * 100_000)
