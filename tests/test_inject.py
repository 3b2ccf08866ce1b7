"""Termination and injection against the fake GitHub over real loopback sockets.

Each test hands a loopback connection to ``Injector.terminate`` the way the
proxy does after granting a tunnel, and talks to it with real curl or a raw
TLS client.  The fake GitHub records what reached it.
"""

from __future__ import annotations

import json
import os
import resource
from typing import Any

import pytest
from twisted.internet import defer, reactor
from twisted.trial import unittest

from agentsandbox.config import EnvSource, InjectRule, githubRules
from agentsandbox.egress.http11 import headAnomaly
from agentsandbox.egress.testing import FixedToken
from tests.support.inject_github import RawWebSocketish, documentationAddress
from tests.support.inject_harness import TOKEN, InjectHarness, LogCapture


def _status(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1])


class Base(unittest.TestCase):
    timeout = 120
    rules: tuple[InjectRule, ...] | None = None
    trustUpstream = True

    def setUp(self) -> None:
        self.holder = FixedToken(TOKEN)
        self.h = InjectHarness(reactor, rules=self.rules, token=self.holder, trustUpstream=self.trustUpstream)
        self.addCleanup(self.h.close)
        self.logs = LogCapture()
        self.logs.start()
        self.addCleanup(self.logs.stop)

    def curl(self, host: str, path: str, *args: str) -> defer.Deferred[tuple[bytes, bytes, int]]:
        return self.h.curl(*self.h.connectTo(host), *args, f"https://{host}{path}")

    def assertNoTokenIn(self, *blobs: bytes | str) -> None:
        for blob in blobs:
            text = blob.decode("latin-1") if isinstance(blob, bytes) else blob
            self.assertNotIn(TOKEN, text)


class TokenInHeadersOnly(Base):
    @defer.inlineCallbacks
    def test_apiGetsTokenScheme(self) -> Any:
        out, err, code = yield self.curl("api.github.com", "/user", "-H", "Authorization: token sandbox-placeholder")
        self.assertEqual(code, 0, err)
        self.assertEqual(json.loads(out)["login"], "octocat")
        self.assertEqual(self.h.fake.seen[-1].authorization, [f"token {TOKEN}"])
        self.assertNoTokenIn(out, err)

    @defer.inlineCallbacks
    def test_githubGetsBasicAndTheBodyIsUntouched(self) -> Any:
        for host in ("api.github.com", "github.com", "uploads.github.com"):
            body = f"{host} /markdown echo ghu_ placeholder Authorization: token x".encode()
            out, err, code = yield self.curl(
                host, "/echo", "--data-binary", body.decode(), "-H", "Authorization: token sandbox-placeholder"
            )
            self.assertEqual(code, 0, err)
            self.assertEqual(out, body)
            seen = self.h.fake.seen[-1]
            expected = self.h.fake.basic() if host == "github.com" else f"token {TOKEN}"
            self.assertEqual(seen.authorization, [expected])
            self.assertEqual(seen.host, host)
            self.assertNoTokenIn(out, err)

    @defer.inlineCallbacks
    def test_uploadsGetTokenToo(self) -> Any:
        out, err, code = yield self.curl("uploads.github.com", "/echo", "--data-binary", "x")
        self.assertEqual((code, out), (0, b"x"), err)
        self.assertEqual(self.h.fake.seen[-1].authorization, [f"token {TOKEN}"])

    @defer.inlineCallbacks
    def test_everyClientAuthorizationIsRemoved(self) -> Any:
        raw = (
            b"POST /echo HTTP/1.1\r\nHost: api.github.com\r\nAuthorization: token a\r\n"
            b"authorization: Basic Yjpj\r\nProxy-Authorization: Basic eDp5\r\nContent-Length: 2\r\n"
            b"Connection: close\r\n\r\nhi"
        )
        client = yield self.h.raw("api.github.com", raw)
        self.assertEqual(_status(client.received), 200)
        seen = self.h.fake.seen[-1]
        self.assertEqual(seen.authorization, [f"token {TOKEN}"])
        self.assertNotIn("proxy-authorization", seen.headers)

    @defer.inlineCallbacks
    def test_traceAndConnectAre405AndNothingIsForwarded(self) -> Any:
        for method in (b"TRACE", b"CONNECT"):
            target = b"api.github.com:443" if method == b"CONNECT" else b"/"
            client = yield self.h.raw("api.github.com", method + b" " + target + b" HTTP/1.1\r\nHost: api.github.com\r\n\r\n")
            self.assertEqual(_status(client.received), 405, client.received)
            self.assertIn(b"not forwarded", client.received)
        self.assertEqual(self.h.fake.seen, [])
        self.assertEqual(self.h.dialer.dialled, [])


class HostConfusion(Base):
    @defer.inlineCallbacks
    def test_innerHostIsRewrittenToTheTunnelHost(self) -> Any:
        raw = b"GET /user HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n"
        client = yield self.h.raw("api.github.com", raw)
        self.assertEqual(_status(client.received), 200, client.received)
        self.assertEqual(self.h.fake.seen[-1].host, "api.github.com")
        self.assertEqual(self.h.dialer.dialled, [(str(self.h.address), 443)])

    @defer.inlineCallbacks
    def test_anotherSNIIsServedTheTunnelHostsCertificate(self) -> Any:
        raw = b"GET /user HTTP/1.1\r\nHost: api.github.com\r\nConnection: close\r\n\r\n"
        client = yield self.h.raw("api.github.com", raw, sni="evil.example")
        self.assertEqual(_status(client.received), 200)
        self.assertEqual(client.peer.get_subject().CN, "api.github.com")

    @defer.inlineCallbacks
    def test_absoluteFormHttpNeverGetsAToken(self) -> Any:
        for target in (b"http://api.github.com/user", b"https://evil.example/user", b"*"):
            raw = b"GET " + target + b" HTTP/1.1\r\nHost: api.github.com\r\n\r\n"
            client = yield self.h.raw("api.github.com", raw)
            self.assertEqual(_status(client.received), 400, client.received)
        self.assertEqual(self.h.fake.seen, [])

    @defer.inlineCallbacks
    def test_absoluteFormToTheTunnelHostIsOriginForm(self) -> Any:
        raw = b"GET https://api.github.com/user HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        client = yield self.h.raw("api.github.com", raw)
        self.assertEqual(_status(client.received), 200)
        self.assertEqual(self.h.fake.seen[-1].path, "/user")


#: OpenMoat's framing list (security-tests.md §5.1) plus h11's own refusals.
SMUGGLING = {
    "CL+TE": b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "TE+CL": b"POST /echo HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n",
    "repeated CL": b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello",
    "conflicting CL": b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",
    "CL list": b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 5, 5\r\n\r\nhello",
    "CL signed": b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: +5\r\n\r\nhello",
    "CL negative": b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: -5\r\n\r\nhello",
    "CL hex": b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 0x5\r\n\r\nhello",
    "CL space-embedded": b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 5 5\r\n\r\nhello",
    "CL space before colon": b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length : 5\r\n\r\nhello",
    "TE.TE": b"POST /echo HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "TE gzip, chunked": b"POST /echo HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
    "TE Chunked": b"POST /echo HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: Chunked\r\n\r\n0\r\n\r\n",
    "TE identity": b"POST /echo HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: identity\r\n\r\n",
    "TE space before colon": b"POST /echo HTTP/1.1\r\nHost: a\r\nTransfer-Encoding : chunked\r\n\r\n0\r\n\r\n",
    "bare LF": b"POST /echo HTTP/1.1\nHost: a\nContent-Length: 5\n\nhello",
    "obs-fold": b"POST /echo HTTP/1.1\r\nHost: a\r\nX: a\r\n Content-Length: 5\r\n\r\nhello",
    "CR in target": b"GET /a\rb HTTP/1.1\r\nHost: a\r\n\r\n",
    "two Host": b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
    "no Host": b"GET / HTTP/1.1\r\n\r\n",
    "NUL in header": b"GET / HTTP/1.1\r\nHost: a\r\nX: a\x00b\r\n\r\n",
    "chunk size 0x": b"POST /echo HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0x5\r\nhello\r\n0\r\n\r\n",
    "chunk size negative": b"POST /echo HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n-5\r\nhello\r\n0\r\n\r\n",
    "LF in chunk extension": b"POST /echo HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5;a\nb\r\nhello\r\n0\r\n\r\n",
    "chunk without CRLF": b"POST /echo HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhelloXX0\r\n\r\n",
    "garbage request line": b"GET\r\n\r\n",
    # issue 23: framing under another spelling, which an origin mapping _ to - reads as framing
    "TE spelled with _ beside CL": b"POST /echo HTTP/1.1\r\nHost: a\r\nTransfer_Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n",
    "CL spelled with _ beside TE": b"POST /echo HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\ncontent_length: 5\r\n\r\n0\r\n\r\n",
    "Keep_Alive": b"GET / HTTP/1.1\r\nHost: a\r\nKEEP_ALIVE: timeout=5\r\n\r\n",
    "Proxy_Connection": b"GET / HTTP/1.1\r\nHost: a\r\nPROXY_CONNECTION: keep-alive\r\n\r\n",
    "oversized head": b"GET / HTTP/1.1\r\nHost: a\r\nX: " + b"a" * 70000 + b"\r\n\r\n",
}


class Smuggling(Base):
    @defer.inlineCallbacks
    def test_eachHeadIsRefusedWithNothingForwarded(self) -> Any:
        for name, raw in SMUGGLING.items():
            client = yield self.h.raw("api.github.com", raw)
            self.assertIn(_status(client.received), (400, 431, 501), f"{name}: {client.received[:200]!r}")
            self.assertEqual(self.h.fake.seen, [], name)
            self.assertEqual(self.h.dialer.dialled, [], name)
        self.assertNoTokenIn(*self.logs.lines)

    @defer.inlineCallbacks
    def test_aSmugglingHeadPipelinedAfterAGoodRequestIsRefused(self) -> Any:
        good = b"GET /user HTTP/1.1\r\nHost: api.github.com\r\n\r\n"
        client = yield self.h.raw("api.github.com", good + SMUGGLING["repeated CL"])
        responses = client.received.split(b"HTTP/1.1 ")[1:]
        self.assertEqual([int(r[:3]) for r in responses], [200, 400])
        self.assertEqual(len(self.h.fake.seen), 1)

    def test_headAnomalyAcceptsOrdinaryHeads(self) -> None:
        self.assertIsNone(headAnomaly(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"))
        self.assertIsNone(headAnomaly(b"POST / HTTP/1.1\r\nHost: a\r\ncontent-length: 12\r\n\r\n"))
        self.assertIsNone(headAnomaly(b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"))
        self.assertIsNone(headAnomaly(b"GET / HTTP/1.1\r\nX-Content-Length-Hint: 5, 6\r\n\r\n"))


class Headers(Base):
    @defer.inlineCallbacks
    def test_hopByHopHeadersAndH2cUpgradeAreDropped(self) -> Any:
        raw = (
            b"GET /user HTTP/1.1\r\nHost: api.github.com\r\nConnection: x-secret, upgrade\r\n"
            b"X-Secret: 1\r\nUpgrade: h2c\r\nKeep-Alive: 5\r\nTE: trailers\r\nX-Kept: yes\r\n"
            b"Proxy-Connection: keep-alive\r\n\r\n"
        )
        client = yield self.h.raw("api.github.com", raw, until=b"octocat")
        self.assertEqual(_status(client.received), 200)
        headers = self.h.fake.seen[-1].headers
        for gone in ("x-secret", "upgrade", "keep-alive", "te", "proxy-connection"):
            self.assertNotIn(gone, headers)
        self.assertEqual(headers["x-kept"], ["yes"])

    @defer.inlineCallbacks
    def test_keepAliveOnBothSides(self) -> Any:
        urls = [f"https://api.github.com/user?{i}" for i in range(5)]
        out, err, code = yield self.h.curl(*self.h.connectTo("api.github.com"), *urls)
        self.assertEqual(code, 0, err)
        self.assertEqual(out.count(b"octocat"), 5)
        self.assertEqual(len(self.h.dialer.dialled), 1, "one upstream connection for five requests")

    @defer.inlineCallbacks
    def test_anUpstreamConnectionIsReusedByTheNextTunnel(self) -> Any:
        for _ in range(3):
            _out, err, code = yield self.curl("api.github.com", "/user")
            self.assertEqual(code, 0, err)
        self.assertEqual(len(self.h.dialer.dialled), 1)

    @defer.inlineCallbacks
    def test_chunkedUploadAndExpectContinue(self) -> Any:
        out, err, code = yield self.curl(
            "api.github.com", "/echo", "-H", "Transfer-Encoding: chunked", "-H", "Expect: 100-continue",
            "--data-binary", "chunked body",
        )
        self.assertEqual((code, out), (0, b"chunked body"), err)

    @defer.inlineCallbacks
    def test_websocketUpgradePasses(self) -> Any:
        from twisted.internet.protocol import Factory

        factory = Factory.forProtocol(RawWebSocketish)
        factory.heads = []  # type: ignore[attr-defined]
        ws = reactor.listenSSL(  # type: ignore[attr-defined]
            0, self.h.track(factory), self.h.pki.serverOptions(["api.github.com"]), interface="127.0.0.1"
        )
        self.h.ports.append(ws)
        address = documentationAddress(20)
        self.h.dialer.map(address, ws.getHost().port)
        port = self.h.tunnelTo("api.github.com", [address])
        raw = (
            b"GET /socket HTTP/1.1\r\nHost: api.github.com\r\nConnection: Upgrade\r\n"
            b"Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
            b"ping-after-upgrade"
        )
        client = yield self.h.raw("api.github.com", raw, port=port, until=b"ping-after-upgrade")
        self.assertEqual(_status(client.received), 101)
        self.assertTrue(client.received.endswith(b"ping-after-upgrade"), client.received)
        head = factory.heads[0].lower()  # type: ignore[attr-defined]
        self.assertIn(b"upgrade: websocket", head)
        self.assertIn(TOKEN.encode().lower(), head)


class Streaming(Base):
    @pytest.mark.slow
    @defer.inlineCallbacks
    def test_a200MBPushStreams(self) -> Any:
        path = os.path.join(self.h.dir, "push.bin")
        size = 200 * 1024 * 1024
        with open(path, "wb") as f:
            f.truncate(size)
        self.addCleanup(os.unlink, path)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out, err, code = yield self.curl("uploads.github.com", "/upload", "-T", path)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        self.assertEqual(code, 0, err)
        self.assertEqual(json.loads(out)["length"], size)
        # ru_maxrss is in KiB; the body never sat whole in this process.
        self.assertLess((after - before) * 1024, size // 2)

    @defer.inlineCallbacks
    def test_aLargeDownloadStreams(self) -> Any:
        size = 64 * 1024 * 1024
        out, err, code = yield self.curl(
            "api.github.com", f"/download?n={size}", "-o", "/dev/null", "-w", "%{size_download} %{http_code}"
        )
        self.assertEqual(code, 0, err)
        self.assertEqual(out, f"{size} 200".encode())


class NoTokenYet(Base):
    @defer.inlineCallbacks
    def test_requestsGoWithoutAuthorizationAndOneWarningSaysWhy(self) -> Any:
        self.holder.value = None
        for _ in range(2):
            _out, err, code = yield self.curl("api.github.com", "/user", "-H", "Authorization: token placeholder")
            self.assertEqual(code, 0, err)
        self.assertEqual([s.authorization for s in self.h.fake.seen], [[], []])
        warnings = [line for line in self.logs.lines if "no token yet" in line]
        self.assertEqual(len(warnings), 1, self.logs.lines)
        self.assertIn("api.github.com", warnings[0])
        self.assertIn("gh auth token", warnings[0])
        self.holder.value = TOKEN
        _out, err, code = yield self.curl("api.github.com", "/user")
        self.assertEqual(self.h.fake.seen[-1].authorization, [f"token {TOKEN}"])


class UpstreamTLSFailure(Base):
    trustUpstream = False  # the system roots do not know the fake's test CA

    @defer.inlineCallbacks
    def test_502NamesTheHost(self) -> Any:
        out, _err, _code = yield self.curl("api.github.com", "/user", "-w", "%{http_code}")
        self.assertTrue(out.endswith(b"502"), out)
        self.assertIn(b"the sandbox's proxy reached no api.github.com", out)
        self.assertIn(b"TLS", out)
        self.assertEqual(self.h.fake.seen, [])
        # The service is still there for the next request.
        out, _err, _code = yield self.curl("api.github.com", "/user", "-w", "%{http_code}")
        self.assertTrue(out.endswith(b"502"), out)


class UpstreamUnreachable(Base):
    @defer.inlineCallbacks
    def test_502WhenNoAddressAnswers(self) -> Any:
        port = self.h.tunnelTo("api.github.com", [documentationAddress(99)])
        client = yield self.h.raw("api.github.com", b"GET /user HTTP/1.1\r\nHost: x\r\n\r\n", port=port)
        self.assertEqual(_status(client.received), 502)
        self.assertIn(b"reached no api.github.com", client.received)

    @defer.inlineCallbacks
    def test_theFailedDialSaysWhatATunnelsDialSays(self) -> Any:
        # One dial (egress/dial.py) for tunnels and the injector: one "could not connect" text.
        port = self.h.tunnelTo("api.github.com", [documentationAddress(99)])
        client = yield self.h.raw("api.github.com", b"GET /user HTTP/1.1\r\nHost: x\r\n\r\n", port=port)
        self.assertIn(b"could not connect to api.github.com:443 (" + str(documentationAddress(99)).encode() + b": ", client.received)

    @defer.inlineCallbacks
    def test_theNextAddressIsTriedWhenOneFails(self) -> Any:
        port = self.h.tunnelTo("api.github.com", [documentationAddress(99), self.h.address])
        client = yield self.h.raw("api.github.com", b"GET /user HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", port=port)
        self.assertEqual(_status(client.received), 200)


class GenericRule(Base):
    rules = (
        *githubRules(),
        InjectRule(
            hosts=("llm.example.com",),
            header="X-Api-Key",
            format="{token}",
            token=EnvSource(env="LLM_KEY"),
        ),
    )

    @defer.inlineCallbacks
    def test_aModelKeyIsInjectedTheSameWay(self) -> Any:
        out, err, code = yield self.curl("llm.example.com", "/echo", "--data-binary", "q", "-H", "x-api-key: fake")
        self.assertEqual((code, out), (0, b"q"), err)
        seen = self.h.fake.seen[-1]
        self.assertEqual(seen.headers["x-api-key"], [TOKEN])
        self.assertEqual(seen.authorization, [])
