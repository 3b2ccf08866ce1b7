"""Request rules on terminated hosts, and responses that never carry the token back.

The matcher and the scanner are sans-IO and tested on their own; then the
injector against the fake GitHub over real loopback sockets with real curl:
a refused request is a 403 naming the rule and its key, and never reaches the
origin; a response echoing the token (in a header, split across chunks and
TLS records, base64-encoded) never reaches the client, and the audit record
says so.
"""

from __future__ import annotations

import base64
from typing import Any

import pytest
from twisted.internet import defer, reactor
from twisted.trial import unittest

from agentsandbox.config import ConfigError, RequestRule, githubRules, parse
from agentsandbox.egress.inject import Route, _unchunk
from agentsandbox.egress.leakscan import LeakScanner, tokenForms
from agentsandbox.egress.reqrules import RequestPolicy, ambiguity
from agentsandbox.egress.testing import FixedToken, MemoryUpstreamPool, memoryTunnel
from agentsandbox.paths import Paths
from tests.support.inject_github import documentationAddress
from tests.support.inject_harness import TOKEN, InjectHarness

# ---------------------------------------------------------------------- the matcher


def _rule(*requests: tuple[str, str, tuple[str, ...]], unmatched: str = "allow") -> Any:
    rules = tuple(
        RequestRule(key=f"github.requests[{i}]", action=a, path=p, methods=m) for i, (a, p, m) in enumerate(requests)
    )
    return githubRules(requests=rules, unmatched=unmatched)[1]


@pytest.mark.parametrize(
    "target",
    [
        b"/repos/./o/r", b"/repos/../gists", b"/a/..", b"/a/.", b"/gist%73", b"/%2e%2e/gists", b"/a%2Fb",
        b"/a%5cb", b"/a\\b", b"//gists", b"/a//b", b"/gists#x", b"/gists;x=1", b"/a%2", b"/a%zz", b"/%67ists",
    ],
)
def test_ambiguousTargetsAreRefusedNotNormalised(target: bytes) -> None:
    assert ambiguity(target) is not None
    decision = RequestPolicy(_rule(("allow", "/**", ())), "api.github.com").decide(b"GET", target)
    assert not decision.allowed
    assert "github.requests" in decision.text


@pytest.mark.parametrize("target", [b"/", b"/repos/o/r", b"/a%20b", b"/a.b/c..d/.e", b"/search?q=a/../b"])
def test_plainTargetsAreNotAmbiguous(target: bytes) -> None:
    assert ambiguity(target.split(b"?")[0]) is None


def test_firstMatchingRuleDecides() -> None:
    rule = _rule(
        ("allow", "/gists/*/star", ("PUT",)),
        ("refuse", "/gists/**", ("POST", "PUT", "PATCH", "DELETE")),
        ("refuse", "/gists", ("POST",)),
    )
    policy = RequestPolicy(rule, "api.github.com")
    assert policy.decide(b"PUT", b"/gists/abc/star").allowed
    refused = policy.decide(b"PATCH", b"/gists/abc")
    assert not refused.allowed and refused.rule is not None and refused.rule.key == "github.requests[1]"
    assert "github.requests[1] (refuse POST,PUT,PATCH,DELETE /gists/**)" in refused.text
    # case, a trailing slash and the query do not dodge a rule ("/gists/**" matches "/gists" too)
    for target in (b"/GISTS", b"/gists/", b"/Gists?public=true"):
        decision = policy.decide(b"POST", target)
        assert not decision.allowed and decision.rule is not None and decision.rule.key == "github.requests[1]"
    assert policy.decide(b"GET", b"/gists").allowed  # no rule matches: unmatched = allow
    assert not policy.decide(b"GET", b"/gists", overridden=True).allowed


def test_unmatchedRefuseNamesTheKey() -> None:
    policy = RequestPolicy(_rule(("allow", "/user", ("GET",)), unmatched="refuse"), "api.github.com")
    assert policy.decide(b"GET", b"/user").allowed
    refused = policy.decide(b"DELETE", b"/user")
    assert not refused.allowed and refused.rule is None
    assert "github.unmatched is \"refuse\"; add an allow rule for it to github.requests" in refused.text


def test_doubleStarMatchesAnyDepthAndStarOneSegment() -> None:
    policy = RequestPolicy(
        _rule(("allow", "/repos/me/*/**", ()), ("allow", "/x/a*b", ()), unmatched="refuse"), "api.github.com"
    )
    for ok in (b"/repos/me/r", b"/repos/me/r/pulls/1", b"/x/ab", b"/x/aZZb"):
        assert policy.decide(b"GET", ok).allowed, ok
    for no in (b"/repos/me", b"/repos/you/r", b"/x/a/b", b"/repos/me2/r"):
        assert not policy.decide(b"GET", no).allowed, no


# ---------------------------------------------------------------------- config


def _load(text: str) -> Any:
    import tomllib

    return parse(tomllib.loads(text), "/c.toml", Paths.fromEnvironment({"HOME": "/home/u"}))


def test_rulesParseInOrderWithTheirKeys() -> None:
    config = _load(
        '[[inject]]\nhosts = ["llm.example.com"]\ntoken_env = "K"\nunmatched = "refuse"\n'
        '[[inject.requests]]\naction = "allow"\nmethods = ["POST"]\npath = "/v1/messages"\n'
        '[[inject.requests]]\naction = "allow"\npath = "/v1/models/**"\n'
    )
    rule = config.inject[0]
    assert rule.unmatched == "refuse" and rule.key == "inject[0]"
    assert [(r.key, r.action, r.methods, r.path) for r in rule.requests] == [
        ("inject[0].requests[0]", "allow", ("POST",), "/v1/messages"),
        ("inject[0].requests[1]", "allow", (), "/v1/models/**"),
    ]


def test_githubTableShapesTheBuiltInRule() -> None:
    config = _load('[github]\n[[github.requests]]\naction = "refuse"\nmethods = ["POST"]\npath = "/gists"\nhost = "api.github.com"\n')
    api = config.injectFor("api.github.com")
    web = config.injectFor("github.com")
    assert api is not None and web is not None
    assert [r.key for r in api.requests] == ["github.requests[0]"] and web.requests == ()


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('[[inject]]\nhosts = ["a.example.com"]\ntoken_env = "T"\n[[inject.requests]]\naction = "deny"\npath = "/"\n',
         "inject[0].requests[0].action: 'deny' is not \"allow\" or \"refuse\""),
        ('[[inject]]\nhosts = ["a.example.com"]\ntoken_env = "T"\n[[inject.requests]]\naction = "allow"\npath = "v1"\n',
         "inject[0].requests[0].path: 'v1' is not a path pattern"),
        ('[[inject]]\nhosts = ["a.example.com"]\ntoken_env = "T"\n[[inject.requests]]\naction = "allow"\npath = "/a/../b"\n',
         "inject[0].requests[0].path: '/a/../b': a segment is '**' alone, and never '.' or '..'"),
        ('[[inject]]\nhosts = ["a.example.com"]\ntoken_env = "T"\n[[inject.requests]]\naction = "allow"\npath = "/a**"\n',
         "inject[0].requests[0].path: '/a**': a segment is '**' alone"),
        ('[[inject]]\nhosts = ["a.example.com"]\ntoken_env = "T"\n[[inject.requests]]\naction = "allow"\npath = "/a?b"\n',
         "inject[0].requests[0].path: '/a?b' is not a path pattern"),
        ('[[inject]]\nhosts = ["a.example.com"]\ntoken_env = "T"\n[[inject.requests]]\naction = "allow"\npath = "/"\nmethods = ["get"]\n',
         "inject[0].requests[0].methods[0]: 'get' is not an HTTP method in capitals"),
        ('[[inject]]\nhosts = ["a.example.com"]\ntoken_env = "T"\n[[inject.requests]]\naction = "allow"\npath = "/"\nhost = "b.example.com"\n',
         "inject[0].requests[0].host: 'b.example.com' is not one of this rule's hosts (a.example.com)"),
        ('[[inject]]\nhosts = ["a.example.com"]\ntoken_env = "T"\n[[inject.requests]]\naction = "allow"\npath = "/"\nmetod = "GET"\n',
         "inject[0].requests[0].metod: unknown key"),
        ('[[inject]]\nhosts = ["a.example.com"]\ntoken_env = "T"\nunmatched = "deny"\n',
         "inject[0].unmatched: 'deny' is not \"allow\" or \"refuse\""),
        ('[[inject]]\nhosts = ["a.example.com"]\ntoken_env = "T"\n[github]\nunmatched = "refuse"\n',
         "github.requests: [github] shapes the built-in GitHub rule, which [[inject]] tables replace"),
        ('[github]\nrepos = 1\n', "github.repos: must be a list of strings, not an integer"),
        ('[github]\nrepos = ["octocat"]\n', "github.repos[0]: 'octocat' is not OWNER/NAME or OWNER/*"),
        ('[github]\nrepos = ["o/*/x"]\n', "github.repos[0]: 'o/*/x' is not OWNER/NAME or OWNER/*"),
        ('[github]\nrepos = ["o/r"]\nmutations = ["add-star"]\n', "github.mutations[0]: 'add-star' is not a GraphQL mutation name"),
        ('[github]\nmutations = ["addStar"]\n', "github.mutations: mutations are allowed by name only while github.repos is set"),
    ],
)
def test_badRulesNameFileAndKey(text: str, error: str) -> None:
    with pytest.raises(ConfigError) as e:
        _load(text)
    assert str(e.value).startswith("/c.toml: " + error), str(e.value)


# ---------------------------------------------------------------------- the scanner


def test_everyFormOfTheTokenIsFound() -> None:
    forms = tokenForms(TOKEN)
    for prefix in (b"", b"a", b"ab", b"x-access-token:"):
        for encode in (base64.b64encode, base64.urlsafe_b64encode):
            assert any(f in encode(prefix + TOKEN.encode() + b"!") for f in forms)
    weird = "tok/en+with%sp@ce"
    assert b"tok%2Fen%2Bwith%25sp%40ce" in tokenForms(weird)


@pytest.mark.parametrize("form", tokenForms(TOKEN))
def test_aFormSplitAnywhereIsNeverPassedOnInPart(form: bytes) -> None:
    body = b"0123456789" * 3 + form + b"abcdefghij" * 3
    start = body.index(form)
    for cut in range(1, len(body)):
        for second in (cut + 1, cut + 7, len(body)):
            scanner = LeakScanner(tokenForms(TOKEN))
            passed = b""
            found = False
            for piece in (body[:cut], body[cut:second], body[second:]):
                out = scanner.feed(piece)
                if out is None:
                    found = True
                    break
                passed += out
            assert found, (cut, second)
            assert passed == body[: len(passed)] and len(passed) <= start


def test_aBodyWithoutTheTokenPassesWhole() -> None:
    forms = tokenForms(TOKEN)
    body = (TOKEN[:-1] + "|" + TOKEN[1:] + "|" + base64.b64encode(TOKEN[:-2].encode()).decode()).encode() * 50
    for size in (1, 3, 17, 64, 1000):
        scanner = LeakScanner(forms)
        out = b""
        for i in range(0, len(body), size):
            passed = scanner.feed(body[i : i + size])
            assert passed is not None
            out += passed
        out += scanner.end()
        assert out == body


# ---------------------------------------------------------------------- in memory


def test_aRefusedRequestIsAuditedAndNeverDialled() -> None:
    pool = MemoryUpstreamPool()
    rule = _rule(("refuse", "/gists", ("POST",)))
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
    rule = _rule(("refuse", "/gists", ("POST",)))
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


# ---------------------------------------------------------------------- GitHub scopes, sans-IO


def _scope(host: str) -> RequestPolicy:
    rule = githubRules(repos=("o/repo", "team/*"), mutations=("addStar",))
    return RequestPolicy(rule[0] if host == "github.com" else rule[1], host)


@pytest.mark.parametrize(
    ("host", "method", "target", "allowed", "key"),
    [
        ("github.com", b"GET", b"/o/repo.git/info/refs?service=git-upload-pack", True, ""),
        ("github.com", b"POST", b"/O/Repo/git-receive-pack", True, ""),
        ("github.com", b"POST", b"/team/anything.git/git-receive-pack", True, ""),
        ("github.com", b"GET", b"/other/x.git/info/refs", False, "github.repos"),
        ("github.com", b"POST", b"/o/repo2.git/git-upload-pack", False, "github.repos"),
        ("github.com", b"GET", b"/login", True, ""),
        ("github.com", b"POST", b"/session", False, "github.requests"),
        ("api.github.com", b"GET", b"/repos/o/repo/pulls", True, ""),
        ("api.github.com", b"DELETE", b"/repos/o/repo/git/refs/heads/x", True, ""),
        ("api.github.com", b"GET", b"/repos/other/x", False, "github.repos"),
        ("api.github.com", b"GET", b"/repositories/123", False, "github.requests"),
        ("api.github.com", b"POST", b"/gists", False, "github.requests"),
        ("api.github.com", b"GET", b"/gists/1", True, ""),
        ("api.github.com", b"PUT", b"/gists/1/star", False, "github.requests"),
        ("api.github.com", b"POST", b"/user/repos", False, "github.requests"),
        ("api.github.com", b"POST", b"/orgs/team/repos", False, "github.requests"),
        ("api.github.com", b"GET", b"/search/code?q=x", True, ""),
        ("uploads.github.com", b"POST", b"/repos/o/repo/releases/1/assets?name=a", True, ""),
        ("uploads.github.com", b"POST", b"/repos/other/x/releases/1/assets", False, "github.repos"),
    ],
)
def test_githubEndpointsAreClassified(host: str, method: bytes, target: bytes, allowed: bool, key: str) -> None:
    decision = _scope(host).decide(method, target)
    assert (decision.allowed, decision.key) == (allowed, key), decision.text


@pytest.mark.parametrize(
    ("body", "allowed", "why"),
    [
        (b'{"query": "query { viewer { login } }"}', True, ""),
        (b'{"query": "{ repository(owner: \\"o\\", name: \\"repo\\") { id } }"}', True, ""),
        (b'{"query": "query($o: String!, $n: String!) { repository(owner: $o, name: $n) { id } }",'
         b' "variables": {"o": "team", "n": "x"}}', True, ""),
        (b'{"query": "query($o: String!) { repository(owner: $o, name: \\"x\\") { id } }", "variables": {"o": "other"}}',
         False, "names the repository other/x"),
        (b'{"query": "query($o: String!) { repository(owner: $o, name: \\"x\\") { id } }"}', False, "cannot be read"),
        (b'{"query": "mutation { addStar(input: {starrableId: \\"R\\"}) { clientMutationId } }"}', True, ""),
        (b'{"query": "mutation { s: addStar(input: {}) { x } d: deleteRepository(input: {}) { x } }"}',
         False, "the GraphQL mutation deleteRepository is not listed"),
        (b'{"query": "mutation { ...F } fragment F on Mutation { deleteRepository(input: {}) { x } }"}',
         False, "a fragment at an operation's root"),
        (b'{"query": "# mutation\\nmutation M { createGist(input: {}) { x } }"}', False, "createGist is not listed"),
        (b'{"query": "subscription { x }"}', False, "subscription"),
        (b'[{"query": "query { viewer { login } }"}]', False, "a batch is refused"),
        (b'not json', False, "not JSON"),
    ],
)
def test_graphqlBodiesAreDecided(body: bytes, allowed: bool, why: str) -> None:
    policy = _scope("api.github.com")
    assert policy.decide(b"POST", b"/graphql").needsBody
    decision = policy.decideBody(b"POST", b"/graphql", body)
    assert decision.allowed == allowed, decision.text
    assert why in decision.text


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
