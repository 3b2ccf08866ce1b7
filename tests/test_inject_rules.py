"""The injector applies request rules and never carries the token back.

The matcher (``test_reqrules``) and the scanner (``test_leakscan``) are tested
on their own; here the injector in memory, then against the fake GitHub over
real loopback sockets with real curl:
a refused request is a 403 naming the rule and its key, and never reaches the
origin; a response echoing the token (in a header, split across chunks and
TLS records, base64-encoded) never reaches the client, and the audit record
says so.
"""

from __future__ import annotations

from typing import Any

from twisted.internet import defer, reactor
from twisted.trial import unittest

from agentsandbox.config import RequestRule, githubRules
from agentsandbox.egress.inject import Route, _unchunk
from agentsandbox.egress.leakscan import tokenForms
from agentsandbox.egress.testing import FixedToken, MemoryUpstreamPool, memoryTunnel
from tests.support.inject_github import documentationAddress
from tests.support.inject_harness import TOKEN, InjectHarness
from tests.test_reqrules import githubRule

# ---------------------------------------------------------------------- in memory


def test_aRefusedRequestIsAuditedAndNeverDialled() -> None:
    pool = MemoryUpstreamPool()
    rule = githubRule(("refuse", "/gists", ("POST",)))
    tunnel, client = memoryTunnel(pool, Route("api.github.com", rule, FixedToken(TOKEN)), (documentationAddress(1),))
    tunnel.dataReceived(b"POST /gists?secret=1 HTTP/1.1\r\nHost: api.github.com\r\nContent-Length: 2\r\n\r\nhi")
    answer = client.value()
    assert answer.startswith(b"HTTP/1.1 403 Forbidden\r\n")
    assert b"POST /gists to api.github.com is refused by github.requests[0] (refuse POST /gists)" in answer
    assert b"secret" not in answer
    assert pool.upstreams == []
    assert [(e, m, t, r) for e, _, m, t, _, r in pool.records] == [
        ("refused", b"POST", b"/gists?secret=1", "github.requests[0]")
    ]


def test_aMethodOverrideHeaderIsRefusedWhereRulesApply() -> None:
    pool = MemoryUpstreamPool()
    rule = githubRule(("refuse", "/gists", ("POST",)))
    tunnel, client = memoryTunnel(pool, Route("api.github.com", rule, FixedToken(TOKEN)), (documentationAddress(1),))
    tunnel.dataReceived(b"GET /gists HTTP/1.1\r\nHost: api.github.com\r\nX-HTTP-Method-Override: POST\r\n\r\n")
    assert client.value().startswith(b"HTTP/1.1 403 ")
    assert pool.upstreams == []


# ---------------------------------------------------------------------- real curl, real TLS


class _Base(unittest.TestCase):
    timeout = 120
    requests: tuple[RequestRule, ...] = ()

    def setUp(self) -> None:
        self.h = InjectHarness(reactor, rules=githubRules(requests=self.requests), token=FixedToken(TOKEN))
        self.audit: list[dict[str, Any]] = []
        self.h.injector.audit = lambda event, **fields: self.audit.append(dict(fields, event=event))
        self.addCleanup(self.h.close)

    def curl(self, host: str, path: str, *args: str) -> defer.Deferred[tuple[bytes, bytes, int]]:
        return self.h.curl(*self.h.connectTo(host), "-i", *args, f"https://{host}{path}")


class RulesThroughTLS(_Base):
    requests = (
        RequestRule(key="github.requests[0]", action="refuse", path="/gists", methods=("POST",)),
        RequestRule(key="github.requests[1]", action="refuse", path="/o/*.git/**", methods=(), host="github.com"),
    )

    @defer.inlineCallbacks
    def test_aRefusalIs403NamingTheRuleAndNothingReachesTheOrigin(self) -> Any:
        out, err, code = yield self.curl("api.github.com", "/gists", "--data-binary", "{}")
        self.assertEqual(code, 0, err)
        self.assertTrue(out.startswith(b"HTTP/1.1 403 Forbidden"), out)
        self.assertIn(b"refused by github.requests[0] (refuse POST /gists)", out)
        out, err, code = yield self.curl("github.com", "/o/x.git/info/refs?service=git-receive-pack")
        self.assertIn(b"refused by github.requests[1] (refuse any method /o/*.git/** on github.com)", out)
        self.assertEqual(self.h.fake.seen, [])
        self.assertEqual(
            [(a["event"], a["method"], a["path"], a["rule"]) for a in self.audit],
            [
                ("refused", "POST", "/gists", "github.requests[0]"),
                ("refused", "GET", "/o/x.git/info/refs?service=git-receive-pack", "github.requests[1]"),
            ],
        )

    @defer.inlineCallbacks
    def test_anAllowedRequestPasses(self) -> Any:
        out, err, code = yield self.curl("api.github.com", "/user")
        self.assertEqual(code, 0, err)
        self.assertIn(b'"login": "octocat"', out)
        out, err, code = yield self.curl("api.github.com", "/echo", "--data-binary", "hi")
        self.assertTrue(out.endswith(b"\r\n\r\nhi"), out)

    @defer.inlineCallbacks
    def test_anAmbiguousTargetIsRefused(self) -> Any:
        client = yield self.h.raw("api.github.com", b"POST /gist%73 HTTP/1.1\r\nHost: api.github.com\r\nContent-Length: 0\r\n\r\n")
        self.assertIn(b"403 Forbidden", client.received)
        self.assertIn(b"a percent-encoded 's' (73)", client.received)
        self.assertEqual(self.h.fake.seen, [])


class TokenNeverComesBack(_Base):
    def assertWithheld(self, out: bytes, where: str) -> None:
        for form in tokenForms(TOKEN):
            self.assertNotIn(form, out)
        self.assertEqual([(a["event"], a["path"]) for a in self.audit][-1:], [("withheld", self.path)])
        self.assertIn(where, self.audit[-1]["reason"])
        for blob in map(str, self.audit):
            self.assertNotIn(TOKEN, blob)

    @defer.inlineCallbacks
    def fetch(self, what: str) -> Any:
        self.path = f"/leak/{what}"
        out, _, code = yield self.curl("api.github.com", self.path)
        return out, code

    @defer.inlineCallbacks
    def test_inAHeader(self) -> Any:
        out, _ = yield self.fetch("header")
        self.assertIn(b"HTTP/1.1 502 Bad Gateway", out)
        self.assertIn(b"withheld a response of api.github.com: the response head carried the token", out)
        self.assertWithheld(out, "the response head carried the token")

    @defer.inlineCallbacks
    def test_splitAcrossChunksAndRecords(self) -> Any:
        out, code = yield self.fetch("chunked")
        self.assertNotEqual(code, 0)  # the connection was cut mid-body
        self.assertIn(b'{"debug": "auth was token ', out)
        self.assertWithheld(out, "the response body carried the token")

    @defer.inlineCallbacks
    def test_splitAcrossRecordsWithALength(self) -> Any:
        out, code = yield self.fetch("length")
        self.assertNotEqual(code, 0)
        self.assertWithheld(out, "the response body carried the token")

    @defer.inlineCallbacks
    def test_base64Encoded(self) -> Any:
        out, code = yield self.fetch("base64")
        self.assertNotEqual(code, 0)
        self.assertWithheld(out, "the response body carried an encoding of the token")

    @defer.inlineCallbacks
    def test_theSameShapesWithoutTheTokenPass(self) -> Any:
        out, code = yield self.fetch("none")
        self.assertEqual(code, 0)
        self.assertTrue(out.endswith(b'{"debug": "auth was token ", "x": 1}\n'), out)
        self.assertEqual(self.audit, [])
        self.assertEqual(self.h.fake.seen[-1].headers.get("accept-encoding"), ["identity"])


# ---------------------------------------------------------------------- GitHub scopes


def test_aChunkedGraphqlBodyIsHeldReadAndThenForwarded() -> None:
    rule = githubRules(repos=("o/repo",), mutations=("addStar",))[1]
    body = b'{"query": "mutation { addStar(input: {}) { x } }"}'
    chunked = b"%x\r\n%b\r\n%x\r\n%b\r\n0\r\n\r\n" % (10, body[:10], len(body) - 10, body[10:])
    head = b"POST /graphql HTTP/1.1\r\nHost: api.github.com\r\nTransfer-Encoding: chunked\r\n\r\n"
    pool = MemoryUpstreamPool()
    tunnel, _client = memoryTunnel(pool, Route("api.github.com", rule, FixedToken(TOKEN)), (documentationAddress(1),))
    tunnel.dataReceived(head + chunked[:20])
    assert pool.upstreams == []  # held until the body is whole
    tunnel.dataReceived(chunked[20:])
    [upstream] = pool.upstreams
    sent: bytes = upstream.transport.value()  # type: ignore[union-attr]
    assert sent.startswith(b"POST /graphql HTTP/1.1\r\n")
    assert _unchunk(sent.split(b"\r\n\r\n", 1)[1]) == body

    pool = MemoryUpstreamPool()
    tunnel, client = memoryTunnel(pool, Route("api.github.com", rule, FixedToken(TOKEN)), (documentationAddress(1),))
    refused = chunked.replace(b"addStar", b"delStar")
    tunnel.dataReceived(head.replace(b"\r\n\r\n", b"\r\nAccept: application/json\r\n\r\n") + refused)
    assert pool.upstreams == []
    answer = client.value()
    assert answer.startswith(b"HTTP/1.1 403 ") and b"content-type: application/json" in answer
    assert b'"message": "POST /graphql to api.github.com is refused: the GraphQL mutation delStar' in answer
    assert [r[5] for r in pool.records] == ["github.mutations"]
