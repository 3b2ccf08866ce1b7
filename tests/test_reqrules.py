"""``egress/reqrules.py``, sans IO: the request-rule matcher (first matching rule decides,
``*`` one segment, ``**`` any depth, ambiguous targets refused rather than normalised, every
refusal naming its key) and the built-in GitHub rule's repository and GraphQL scopes.

The injector applying these rules over real TLS is ``test_inject_rules``."""

from __future__ import annotations

from typing import Any

import pytest

from agentsandbox.config import RequestRule, githubRules
from agentsandbox.egress.reqrules import RequestPolicy, ambiguity


def githubRule(*requests: tuple[str, str, tuple[str, ...]], unmatched: str = "allow") -> Any:
    """The built-in rule for api.github.com with ``requests`` (action, path, methods) in order."""
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
    decision = RequestPolicy(githubRule(("allow", "/**", ())), "api.github.com").decide(b"GET", target)
    assert not decision.allowed
    assert "github.requests" in decision.text


@pytest.mark.parametrize("target", [b"/", b"/repos/o/r", b"/a%20b", b"/a.b/c..d/.e", b"/search?q=a/../b"])
def test_plainTargetsAreNotAmbiguous(target: bytes) -> None:
    assert ambiguity(target.split(b"?")[0]) is None


def test_firstMatchingRuleDecides() -> None:
    rule = githubRule(
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
    policy = RequestPolicy(githubRule(("allow", "/user", ("GET",)), unmatched="refuse"), "api.github.com")
    assert policy.decide(b"GET", b"/user").allowed
    refused = policy.decide(b"DELETE", b"/user")
    assert not refused.allowed and refused.rule is None
    assert "github.unmatched is \"refuse\"; add an allow rule for it to github.requests" in refused.text


def test_doubleStarMatchesAnyDepthAndStarOneSegment() -> None:
    policy = RequestPolicy(
        githubRule(("allow", "/repos/me/*/**", ()), ("allow", "/x/a*b", ()), unmatched="refuse"), "api.github.com"
    )
    for ok in (b"/repos/me/r", b"/repos/me/r/pulls/1", b"/x/ab", b"/x/aZZb"):
        assert policy.decide(b"GET", ok).allowed, ok
    for no in (b"/repos/me", b"/repos/you/r", b"/x/a/b", b"/repos/me2/r"):
        assert not policy.decide(b"GET", no).allowed, no


# ---------------------------------------------------------------------- the built-in GitHub rule's scopes


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
