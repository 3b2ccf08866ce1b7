"""Real clients through the running proxy on loopback: curl (forward, CONNECT,
SOCKS5 with the proxy resolving), git clone over smart HTTP, and 1 GiB with a
matching sha256.  The origin is a Twisted web server on loopback that the
test dialer reaches for the documentation address web.example.org resolves to.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from typing import Any

import pytest
from twisted.internet.utils import getProcessOutputAndValue
from twisted.trial.unittest import SkipTest, TestCase

from agentsandbox.egress.testing import FixedResolver, MappedDialer
from tests.support.egress_fixtures import (
    CURL,
    GIT,
    ProxyHarness,
    curl,
    deferredTest,
    listen,
    reactor,
    waitFor,
)
from tests.support.egress_servers import GIT_HTTP_BACKEND, makeRepository, webSite

WEB = "web.example.org"
WEB_ADDRESS = "192.0.2.80"


class ClientTests(TestCase):
    spliceFast = True

    async def setUpWeb(self, bigFile: int = 0) -> None:
        for tool in (CURL, GIT, GIT_HTTP_BACKEND):
            if not os.path.exists(tool):
                raise SkipTest(f"{tool} is not installed (apt install curl git)")
        self.root = tempfile.mkdtemp(prefix="egress-web-")
        self.addCleanup(shutil.rmtree, self.root, True)
        self.head = makeRepository(self.root)
        web = await listen(webSite(self.root))
        self.addCleanup(web.stopListening)
        dialer = MappedDialer(reactor)
        dialer.route(WEB_ADDRESS, 80, web.getHost().port)
        dialer.route(WEB_ADDRESS, 443, web.getHost().port)  # CONNECT :443 lands on the same plain server
        self.proxy = ProxyHarness([WEB], FixedResolver({WEB: [WEB_ADDRESS]}), dialer, spliceFast=self.spliceFast)
        await self.proxy.start()
        self.addCleanup(self.proxy.stop)
        self.proxyURL = f"http://127.0.0.1:{self.proxy.port}"

    @deferredTest
    async def test_curlForward(self) -> None:
        await self.setUpWeb()
        out, err, code = await curl(
            "--proxy", self.proxyURL, "--proxy-user", "srt:placeholder",
            "-H", "Proxy-Connection: keep-alive", "-H", "X-Kept: 1",
            f"http://{WEB}/headers", f"http://{WEB}/headers",
        )
        self.assertEqual(code, 0, err)
        first, second = _twoJSON(out)
        for seen in (first, second):
            names = {k.lower(): v for k, v in seen["headers"]}
            self.assertEqual(names["host"], WEB)
            self.assertNotIn("proxy-authorization", names)
            self.assertNotIn("proxy-connection", names)
            self.assertNotIn("authorization", names)
            self.assertEqual(names["x-kept"], "1")
            self.assertEqual(seen["uri"], "/headers")
        # keep-alive: curl reused the connection for the second request
        self.assertIn(b"Re-using existing connection", (await curl("-v", "--proxy", self.proxyURL, f"http://{WEB}/headers", f"http://{WEB}/headers"))[1])
        forwards = [r for r in self.proxy.records() if r["event"] == "forward"]
        self.assertGreaterEqual(len(forwards), 4)
        self.assertTrue(all(r["status"] == 200 for r in forwards))

    @deferredTest
    async def test_curlForwardRefused(self) -> None:
        await self.setUpWeb()
        out, _, _ = await curl("--proxy", self.proxyURL, "-w", "%{http_code}", "http://example.com/")
        self.assertEqual(out.splitlines()[-1], b"403")
        self.assertIn(b"example.com:80 is not on the sandbox's allow list", out)

    @deferredTest
    async def test_curlConnect(self) -> None:
        await self.setUpWeb()
        out, err, code = await curl("-p", "--proxy", self.proxyURL, f"http://{WEB}:443/headers")
        self.assertEqual(code, 0, err)
        self.assertEqual(json.loads(out)["uri"], "/headers")
        out, err, code = await curl("-p", "--proxy", self.proxyURL, "https://example.com/")
        self.assertNotEqual(code, 0)
        self.assertIn(b"403", err)

    @deferredTest
    async def test_curlSocks5Hostname(self) -> None:
        await self.setUpWeb()
        out, err, code = await curl("--socks5-hostname", f"127.0.0.1:{self.proxy.port}", "--proxy-user", "srt:placeholder", f"http://{WEB}/headers")
        self.assertEqual(code, 0, err)
        self.assertEqual(json.loads(out)["method"], "GET")
        out, err, code = await curl("--socks5-hostname", f"127.0.0.1:{self.proxy.port}", "http://example.com/")
        self.assertNotEqual(code, 0)
        self.assertEqual(self.proxy.resolver.lookups, [WEB])

    @deferredTest
    async def test_gitClone(self) -> None:
        await self.setUpWeb()
        dest = os.path.join(self.root, "clone")
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": self.root,
            "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_TERMINAL_PROMPT": "0",
        }
        out, err, code = await getProcessOutputAndValue(
            GIT, ("-c", f"http.proxy={self.proxyURL}", "clone", "-q", f"http://{WEB}/git/repo.git", dest), env=env
        )
        self.assertEqual(code, 0, err)
        with open(os.path.join(dest, "README")) as f:
            self.assertEqual(f.read(), "through the egress proxy\n")
        out, err, code = await getProcessOutputAndValue(GIT, ("-C", dest, "rev-parse", "HEAD"), env=env)
        self.assertEqual(out.decode().strip(), self.head)
        # the same clone through SOCKS5 with the proxy resolving the name
        dest2 = os.path.join(self.root, "clone2")
        out, err, code = await getProcessOutputAndValue(
            GIT, ("-c", f"http.proxy=socks5h://127.0.0.1:{self.proxy.port}", "clone", "-q", f"http://{WEB}/git/repo.git", dest2), env=env
        )
        self.assertEqual(code, 0, err)

    @pytest.mark.slow
    @deferredTest
    async def test_oneGiBThroughATunnel(self) -> None:
        await self.setUpWeb()
        path = os.path.join(self.root, "files", "big")
        block = hashlib.sha256(b"seed").digest() * (1 << 15)  # 1 MiB, not all one byte
        digest = hashlib.sha256()
        with open(path, "wb") as f:
            for i in range(1024):
                chunk = i.to_bytes(4, "big") + block[4:]
                f.write(chunk)
                digest.update(chunk)
        self.addCleanup(os.unlink, path)
        script = f'{CURL} -sS --noproxy "" -p --proxy {self.proxyURL} http://{WEB}:443/files/big | sha256sum'
        out, err, code = await getProcessOutputAndValue("/bin/sh", ("-c", script), env={"PATH": "/usr/bin:/bin"})
        self.assertEqual(code, 0, err)
        self.assertEqual(out.split()[0].decode(), digest.hexdigest())
        tunnels = lambda: [r for r in self.proxy.records() if r["event"] == "tunnel"]  # noqa: E731
        await waitFor(tunnels, "the tunnel's audit record")
        tunnel = tunnels()[-1]
        self.assertGreater(tunnel["down"], 1 << 30)
        self.assertEqual(self.proxy.factory.zeroCopied, 1 if self.spliceFast else 0)


def _twoJSON(out: bytes) -> tuple[Any, Any]:
    text = out.decode()
    dec = json.JSONDecoder()
    first, end = dec.raw_decode(text)
    second, _ = dec.raw_decode(text[end:])
    return first, second


class ClientTestsCopyLoop(ClientTests):
    """curl, git and the 1 GiB transfer on Twisted's copy loop instead of splice(2)."""

    spliceFast = False
