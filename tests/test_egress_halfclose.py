"""A client that half-closes right after its request still gets the answer."""

import tempfile

from twisted.trial.unittest import TestCase

from agentsandbox.egress.proxy import tcpDialer
from tests.support.egress_fixtures import (
    FixedResolver,
    ProxyHarness,
    deferredTest,
    exchange,
    listen,
    reactor,
)
from tests.support.egress_servers import webSite


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
