"""The proxy on a real loopback port: CONNECT, SOCKS5, forwarding, refusals, limits, timeouts."""

from __future__ import annotations

import json

from twisted.internet.protocol import Factory
from twisted.trial.unittest import TestCase

from tests.support.egress_fixtures import (
    Echo,
    FixedResolver,
    Greeter,
    MappedDialer,
    ProxyHarness,
    deferredTest,
    exchange,
    listen,
    reactor,
)


class ConnectTests(TestCase):
    async def _proxy(self, domains, table=None, **kw):
        echo = await listen(Factory.forProtocol(Echo))
        self.addCleanup(echo.stopListening)
        dialer = MappedDialer(reactor)
        dialer.route("192.0.2.10", 443, echo.getHost().port)
        h = ProxyHarness(domains, FixedResolver(table or {"echo.example.org": ["192.0.2.10"]}), dialer, **kw)
        await h.start()
        self.addCleanup(h.stop)
        return h

    @deferredTest
    async def test_connectEchoes(self):
        h = await self._proxy(["echo.example.org"])
        out = await exchange(h.port, b"CONNECT echo.example.org:443 HTTP/1.1\r\nHost: echo.example.org:443\r\n\r\nping")
        self.assertEqual(out, b"HTTP/1.1 200 Connection established\r\n\r\nping")
        self.assertEqual(h.dialer.dialled, [("192.0.2.10", 443)])
        recs = h.records()
        self.assertEqual(recs[-1]["event"], "tunnel")
        self.assertEqual((recs[-1]["up"], recs[-1]["down"]), (4, 4))

    @deferredTest
    async def test_refusedOffList(self):
        h = await self._proxy(["echo.example.org"])
        out = await exchange(h.port, b"CONNECT github.com.example.com:443 HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertIn(b"403 Forbidden", out)
        self.assertIn(b"github.com.example.com:443 is not on the sandbox's allow list", out)
        self.assertIn(b"sandbox.domains", out)
        self.assertEqual(h.dialer.dialled, [])
        rec = h.records()[-1]
        self.assertEqual((rec["event"], rec["host"], rec["allow"]), ("refused", "github.com.example.com", "github.com.example.com"))

    @deferredTest
    async def test_socksNoAuth(self):
        h = await self._proxy(["echo.example.org"])
        name = b"echo.example.org"
        out = await exchange(h.port, b"\x05\x01\x00" + b"\x05\x01\x00\x03" + bytes([len(name)]) + name + (443).to_bytes(2, "big") + b"data")
        self.assertEqual(out, b"\x05\x00" + b"\x05\x00\x00\x01" + b"\0" * 6 + b"data")
