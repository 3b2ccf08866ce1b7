"""The default dialer's direct path: tunnels dialled with ``reactor.connectTCP``, no endpoint.

``TCPDialer.dial`` connects a tunnel's upstream without an endpoint's wrapper
protocol; these tests run it against real loopback listeners: a tunnel that
works (bytes both ways, half-close, the audit record), a refused dial, the next
address tried after a failed one, an IPv6 literal, and a reload that takes a
literal's cached grant away.
"""

from __future__ import annotations

import socket

from twisted.internet.endpoints import TCP6ServerEndpoint
from twisted.internet.protocol import Factory
from twisted.trial.unittest import TestCase

from agentsandbox.egress.dial import TCPDialer, tcpDialer
from agentsandbox.egress.testing import FixedResolver
from agentsandbox.reload import ConfigHolder
from tests.support.egress_fixtures import (
    Echo,
    ProxyHarness,
    deferredTest,
    domainsToml,
    exchange,
    listen,
    makeConfig,
    reactor,
)


def connectHead(target: str) -> bytes:
    return f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode()


async def closedPort() -> int:
    """A loopback port nothing listens on (it was just released)."""
    port = await listen(Factory.forProtocol(Echo))
    number = int(port.getHost().port)
    await port.stopListening()
    return number


class DirectDialTests(TestCase):
    async def harness(self, domains: list[str], resolver: FixedResolver | None = None) -> ProxyHarness:
        h = ProxyHarness(domains, resolver or FixedResolver({}), tcpDialer(reactor))
        self.assertIsInstance(h.dialer, TCPDialer)
        await h.start()
        self.addCleanup(h.stop)
        return h

    async def echoPort(self) -> int:
        port = await listen(Factory.forProtocol(Echo))
        self.addCleanup(port.stopListening)
        return int(port.getHost().port)

    @deferredTest
    async def test_tunnelThroughTheDirectDial(self) -> None:
        echo = await self.echoPort()
        h = await self.harness([f"127.0.0.1:{echo}"])
        out = await exchange(h.port, connectHead(f"127.0.0.1:{echo}") + b"ping", halfClose=True)
        self.assertEqual(out, b"HTTP/1.1 200 Connection established\r\n\r\nping")
        [rec] = [r for r in h.records() if r["event"] == "tunnel"]
        self.assertEqual((rec["host"], rec["port"], rec["address"]), ("127.0.0.1", echo, "127.0.0.1"))
        self.assertEqual((rec["up"], rec["down"]), (4, 4))
        self.assertNotIn("reason", rec)

    @deferredTest
    async def test_refusedDialIsA502AndAFailedRecord(self) -> None:
        port = await closedPort()
        h = await self.harness([f"127.0.0.1:{port}"])
        out = await exchange(h.port, connectHead(f"127.0.0.1:{port}"), halfClose=False)
        self.assertTrue(out.startswith(b"HTTP/1.1 502 "), out)
        self.assertIn(f"could not connect to 127.0.0.1:{port} (127.0.0.1: ".encode(), out)
        # The socket's own error (the reset reached epoll as an error, not a writable socket).
        self.assertIn(b"Connection refused", out)
        [rec] = [r for r in h.records() if r["event"] == "failed"]
        self.assertEqual((rec["host"], rec["port"]), ("127.0.0.1", port))
        self.assertEqual(h.factory.reserved, 0)

    @deferredTest
    async def test_nextAddressAfterAFailedDial(self) -> None:
        echo = await self.echoPort()
        # 127.0.0.2 is loopback too, and nothing listens there on this port.
        resolver = FixedResolver({"echo.example.org": ["127.0.0.2", "127.0.0.1"]})
        h = await self.harness(
            ["echo.example.org", f"127.0.0.2:{echo}", f"127.0.0.1:{echo}"], resolver
        )
        out = await exchange(h.port, connectHead(f"echo.example.org:{echo}") + b"two", halfClose=True)
        self.assertEqual(out, b"HTTP/1.1 200 Connection established\r\n\r\ntwo")
        [rec] = [r for r in h.records() if r["event"] == "tunnel"]
        self.assertEqual((rec["host"], rec["address"]), ("echo.example.org", "127.0.0.1"))

    @deferredTest
    async def test_ipv6Literal(self) -> None:
        try:
            with socket.socket(socket.AF_INET6) as s:
                s.bind(("::1", 0))
        except OSError as e:
            self.skipTest(f"no IPv6 loopback here ({e})")
        port = await TCP6ServerEndpoint(reactor, 0, interface="::1").listen(Factory.forProtocol(Echo))
        self.addCleanup(port.stopListening)
        echo = port.getHost().port
        h = await self.harness([f"[::1]:{echo}"])
        out = await exchange(h.port, connectHead(f"[::1]:{echo}") + b"six", halfClose=True)
        self.assertEqual(out, b"HTTP/1.1 200 Connection established\r\n\r\nsix")
        [rec] = [r for r in h.records() if r["event"] == "tunnel"]
        self.assertEqual(rec["address"], "::1")

    @deferredTest
    async def test_reloadDropsALiteralsCachedGrant(self) -> None:
        echo = await self.echoPort()
        allowed = makeConfig(domainsToml([f"127.0.0.1:{echo}"]))
        holder = ConfigHolder(allowed)
        h = ProxyHarness(config=holder, dialer=tcpDialer(reactor))
        await h.start()
        self.addCleanup(h.stop)
        first = await exchange(h.port, connectHead(f"127.0.0.1:{echo}") + b"a", halfClose=True)
        self.assertEqual(first, b"HTTP/1.1 200 Connection established\r\n\r\na")
        holder.swap(makeConfig(domainsToml(["example.org"])))
        second = await exchange(h.port, connectHead(f"127.0.0.1:{echo}"), halfClose=False)
        self.assertTrue(second.startswith(b"HTTP/1.1 403 "), second)
        holder.swap(allowed)
        third = await exchange(h.port, connectHead(f"127.0.0.1:{echo}") + b"c", halfClose=True)
        self.assertEqual(third, b"HTTP/1.1 200 Connection established\r\n\r\nc")
