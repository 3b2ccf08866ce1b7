"""proxy.parent: allowed traffic leaves through an organisation's CONNECT proxy.

What is checked where (docs/egress.md): the allow list and the address rules for
every answer our resolver gives run here, before the parent is asked; the
parent gets the *name*, resolves it itself and applies its own policy.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from twisted.internet.protocol import Factory
from twisted.trial.unittest import TestCase

from agentsandbox.egress.testing import FixedResolver, MappedDialer
from tests.support.egress_fixtures import (
    Echo,
    ProxyHarness,
    deferredTest,
    exchange,
    listen,
    reactor,
)
from tests.support.egress_parent import ParentProxy
from tests.support.egress_servers import webSite


class ParentTests(TestCase):
    async def setUpParent(self, table: Mapping[str, Sequence[str]]) -> None:
        import tempfile

        echo = await listen(Factory.forProtocol(Echo))
        self.addCleanup(echo.stopListening)
        root = tempfile.mkdtemp(prefix="egress-parent-")
        web = await listen(webSite(root))
        self.addCleanup(web.stopListening)
        self.parent = ParentProxy(
            reactor,
            {
                ("echo.example.org", 443): echo.getHost().port,
                ("inner.example.org", 443): echo.getHost().port,
                ("web.example.org", 80): web.getHost().port,
                ("blocked.example.org", 443): echo.getHost().port,
            },
            deny=("blocked.example.org",),
        )
        parentPort = await listen(self.parent)
        self.addCleanup(parentPort.stopListening)
        self.dialer = MappedDialer(reactor)
        self.loopEcho = echo.getHost().port
        domains = [
            "echo.example.org", "inner.example.org", "web.example.org", "private.example.org",
            "blocked.example.org", f"127.0.0.1:{self.loopEcho}",
        ]
        self.h = ProxyHarness(domains, FixedResolver(table), self.dialer, proxy={"parent": f"http://127.0.0.1:{parentPort.getHost().port}"})
        await self.h.start()
        self.addCleanup(self.h.stop)

    @deferredTest
    async def test_allowedNameLeavesThroughTheParentByName(self) -> None:
        await self.setUpParent({"echo.example.org": ["192.0.2.10"]})
        out = await exchange(self.h.port, b"CONNECT echo.example.org:443 HTTP/1.1\r\nHost: x\r\n\r\nvia parent")
        self.assertEqual(out, b"HTTP/1.1 200 Connection established\r\n\r\nvia parent")
        self.assertEqual(self.parent.seen, ["echo.example.org:443"])
        self.assertEqual(self.dialer.dialled, [])  # nothing dialled directly
        self.assertEqual(self.h.records()[-1]["via"], "parent")

    @deferredTest
    async def test_checksHereStillApply(self) -> None:
        await self.setUpParent({"private.example.org": ["10.0.0.7"]})
        out = await exchange(self.h.port, b"CONNECT example.net:443 HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertIn(b"403", out)
        out = await exchange(self.h.port, b"CONNECT private.example.org:443 HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertIn(b"resolves to 10.0.0.7", out)
        self.assertEqual(self.parent.seen, [])

    @deferredTest
    async def test_nameOnlyTheParentResolves(self) -> None:
        await self.setUpParent({})
        out = await exchange(self.h.port, b"CONNECT inner.example.org:443 HTTP/1.1\r\nHost: x\r\n\r\nhi")
        self.assertTrue(out.endswith(b"hi"), out)
        self.assertEqual(self.parent.seen, ["inner.example.org:443"])

    @deferredTest
    async def test_parentRefusalIs502NamingTheParent(self) -> None:
        await self.setUpParent({"blocked.example.org": ["192.0.2.11"]})
        out = await exchange(self.h.port, b"CONNECT blocked.example.org:443 HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertIn(b"502 Bad Gateway", out)
        self.assertIn(b"the parent proxy: answered 403 Forbidden to CONNECT blocked.example.org:443", out)

    @deferredTest
    async def test_forwardThroughTheParent(self) -> None:
        await self.setUpParent({"web.example.org": ["192.0.2.80"]})
        out = await exchange(self.h.port, b"GET http://web.example.org/headers HTTP/1.1\r\nHost: web.example.org\r\nProxy-Authorization: Basic eA==\r\nConnection: close\r\n\r\n")
        head, _, body = out.partition(b"\r\n\r\n")
        self.assertIn(b"200 OK", head)
        seen = json.loads(body)
        self.assertEqual(seen["uri"], "/headers")
        self.assertNotIn("proxy-authorization", {k.lower() for k, _ in seen["headers"]})
        self.assertEqual(self.parent.seen, ["web.example.org:80"])

    @deferredTest
    async def test_explicitLoopbackEntryIsDialledDirectly(self) -> None:
        await self.setUpParent({})
        out = await exchange(self.h.port, b"CONNECT 127.0.0.1:%d HTTP/1.1\r\nHost: x\r\n\r\nlocal" % self.loopEcho)
        self.assertTrue(out.endswith(b"local"), out)
        self.assertEqual(self.parent.seen, [])
