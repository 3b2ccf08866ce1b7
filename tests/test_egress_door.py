"""The front door's phases (``proxy.Phase``): named, switched in one place, and
the spliced hot path one bound call."""

from __future__ import annotations

from twisted.internet import reactor
from twisted.internet.protocol import Factory
from twisted.trial.unittest import TestCase

from agentsandbox.egress.proxy import FrontDoor, Phase
from agentsandbox.egress.testing import FixedResolver, MappedDialer
from tests.support.egress_fixtures import (
    Collector,
    Echo,
    ProxyHarness,
    deferredTest,
    listen,
    waitFor,
)


class Phases(TestCase):
    async def proxy(self) -> ProxyHarness:
        server = await listen(Factory.forProtocol(Echo))
        self.addCleanup(server.stopListening)
        dialer = MappedDialer(reactor)
        dialer.route("192.0.2.10", 443, server.getHost().port)
        h = ProxyHarness(["echo.example.org"], FixedResolver({"echo.example.org": ["192.0.2.10"]}), dialer)
        await h.start()
        self.addCleanup(h.stop)
        return h

    async def door(self, h: ProxyHarness, send: bytes, until: bytes) -> tuple[FrontDoor, Collector]:
        from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol

        read = h.doorRead(len(send))
        c = Collector(send)
        await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", h.port), c)
        door = await read
        await c.until(until)
        return door, c

    @deferredTest
    async def test_a_spliced_door_reads_through_the_tunnel_itself(self) -> None:
        h = await self.proxy()
        door, client = await self.door(h, b"CONNECT echo.example.org:443 HTTP/1.1\r\nHost: x\r\n\r\nping", b"ping")
        self.assertIs(door.phase, Phase.SPLICED)
        assert door.tunnel is not None
        # The hot path: the transport's one lookup finds the tunnel's bound reader.
        self.assertEqual(vars(door)["dataReceived"], door.tunnel.fromClient)
        client.transport.loseConnection()
        await waitFor(lambda: door.phase is Phase.CLOSED and door.gone, "the door to close")

    @deferredTest
    async def test_a_refused_tunnel_goes_back_to_reading_then_closes(self) -> None:
        h = await self.proxy()
        door, _client = await self.door(h, b"CONNECT example.net:443 HTTP/1.1\r\nHost: x\r\n\r\n", b"allow list")
        await waitFor(lambda: door.phase is Phase.CLOSED, "the refused door to close")
        self.assertIsNone(door.tunnel)
        self.assertIsNone(door.terminated)

    def test_closed_is_the_last_phase(self) -> None:
        from agentsandbox.egress.proxy import EgressProxyFactory
        from agentsandbox.egress.testing import AllowAllPeers
        from tests.support.egress_fixtures import makeConfig

        door = FrontDoor(EgressProxyFactory(makeConfig(), reactor, peers=AllowAllPeers()))
        self.assertIs(door.phase, Phase.READING)
        door._become(Phase.CLOSED)
        door._become(Phase.DECIDING)
        self.assertIs(door.phase, Phase.CLOSED)
        self.assertTrue(door.gone)
