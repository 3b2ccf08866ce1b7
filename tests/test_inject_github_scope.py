"""GitHub scopes (``github.repos``, ``github.mutations``) with real git and gh through the proxy.

The proxy and the fake GitHub are wired as in ``test_inject_proxy.py``; the
built-in GitHub rule carries ``repos = ["o/repo"]``, one listed mutation and
an allow rule for ``POST /markdown``.  Each command's requests, as the fake
and the audit log saw them, are printed: docs/injection.md's table of how
GitHub's endpoints are classified was taken from this output.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from typing import Any

from twisted.internet import defer, reactor
from twisted.internet.utils import getProcessOutputAndValue
from twisted.trial import unittest

from agentsandbox.config import RequestRule, githubRules
from agentsandbox.egress.testing import FixedResolver, MappedDialer
from agentsandbox.egressdir import egressVars, writeEgressDir
from tests.support.egress_fixtures import ProxyHarness, makeConfig
from tests.support.inject_github import gitHttpBackend
from tests.support.inject_harness import TOKEN, InjectHarness

GH = shutil.which("gh")
GIT = shutil.which("git")

CONFIG = """\
[sandbox]
domains = ["github.com", "api.github.com", "uploads.github.com"]
"""

RULES = githubRules(
    requests=(RequestRule(key="github.requests[0]", action="allow", path="/markdown", methods=("POST",)),),
    repos=("o/repo",),
    mutations=("addStar",),
)


class Scoped(unittest.TestCase):
    timeout = 180

    @defer.inlineCallbacks
    def setUp(self) -> Any:  # type: ignore[override]
        self.h = InjectHarness(reactor, rules=RULES)
        self.addCleanup(self.h.close)
        address = str(self.h.address)
        self.proxy = ProxyHarness(
            config=makeConfig(CONFIG),
            resolver=FixedResolver({h: [address] for h in ("github.com", "api.github.com", "uploads.github.com")}),
            dialer=MappedDialer(reactor),
            terminator=self.h.injector,
        )
        yield defer.Deferred.fromCoroutine(self.proxy.start())
        self.addCleanup(self.proxy.stop)
        self.audit: list[dict[str, Any]] = []
        self.h.injector.audit = lambda event, **fields: self.audit.append(dict(fields, event=event))
        runtime = tempfile.mkdtemp(prefix="scope-runtime-")
        self.egress = os.path.join(runtime, "agentsandbox", "egress")
        writeEgressDir(self.egress, self.h.ca.pem)
        self.home = tempfile.mkdtemp(prefix="scope-home-")

    def env(self) -> dict[str, str]:
        proxy = f"http://127.0.0.1:{self.proxy.port}"
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": self.home,
            "HTTPS_PROXY": proxy, "https_proxy": proxy,
            "GIT_TERMINAL_PROMPT": "0", "GH_NO_UPDATE_NOTIFIER": "1", "GH_PROMPT_DISABLED": "1", "NO_COLOR": "1",
            "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.org",
            "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.org",
            **egressVars(self.egress),
        }

    @defer.inlineCallbacks
    def command(self, program: str, *args: str) -> Any:
        seen, audited = len(self.h.fake.seen), len(self.audit)
        out, err, code = yield getProcessOutputAndValue(program, args, env=self.env(), reactor=reactor)
        print(f"\n$ {os.path.basename(program)} {' '.join(args)}  -> exit {code}")
        if code:
            print("    stderr: " + err.decode(errors="replace").strip().replace("\n", "\n    stderr: "))
        for s in self.h.fake.seen[seen:]:
            print(f"    reached the fake: {s.method} {s.path}")
        for a in self.audit[audited:]:
            print(f"    {a['event']} {a['method']} {a['path']}: {a['rule']}")
        self.assertNotIn(TOKEN.encode(), out + err)
        return out.decode(errors="replace"), err.decode(errors="replace"), code

    def bare(self, owner: str, name: str) -> str:
        root = os.path.join(self.h.gitRoot, owner) if owner != "o" else self.h.gitRoot
        bare = os.path.join(root, f"{name}.git")
        env = self.env()
        subprocess.run(["git", "init", "-q", "--bare", "-b", "main", bare], check=True, env=env)
        seed = tempfile.mkdtemp(prefix="seed-")
        subprocess.run(["git", "init", "-q", "-b", "main", seed], check=True, env=env)
        with open(os.path.join(seed, "README"), "w") as f:
            f.write("seed\n")
        subprocess.run(["git", "-C", seed, "add", "README"], check=True, env=env)
        subprocess.run(["git", "-C", seed, "commit", "-qm", "seed"], check=True, env=env)
        subprocess.run(["git", "-C", seed, "push", "-q", bare, "main"], check=True, env=env)
        return bare

    def refusedBy(self, key: str) -> dict[str, Any]:
        refused = [a for a in self.audit if a["event"] == "refused"]
        self.assertTrue(refused, "nothing was refused")
        self.assertEqual(refused[-1]["rule"], key, refused[-1])
        return refused[-1]

    # ------------------------------------------------------------------ git

    @defer.inlineCallbacks
    def test_gitCloneAndPushToAListedRepository(self) -> Any:
        if GIT is None or gitHttpBackend() is None:
            raise unittest.SkipTest("git or git-http-backend is not installed")
        bare = self.bare("o", "repo")
        clone = os.path.join(tempfile.mkdtemp(prefix="clone-"), "repo")
        _out, err, code = yield self.command(GIT, "clone", "-q", "https://github.com/o/repo.git", clone)
        self.assertEqual(code, 0, err)
        with open(os.path.join(clone, "NEW"), "w") as f:
            f.write("pushed\n")
        for args in (("add", "NEW"), ("commit", "-qm", "new")):
            _out, err, code = yield self.command(GIT, "-C", clone, *args)
            self.assertEqual(code, 0, err)
        _out, err, code = yield self.command(GIT, "-C", clone, "push", "-q", "origin", "main")
        self.assertEqual(code, 0, err)
        log = subprocess.run(["git", "-C", bare, "log", "--format=%s", "-1"], capture_output=True, text=True)
        self.assertEqual(log.stdout.strip(), "new")
        self.assertEqual([a for a in self.audit if a["event"] == "refused"], [])

    @defer.inlineCallbacks
    def test_gitPushToAnUnlistedRepositoryIsRefused(self) -> Any:
        if GIT is None or gitHttpBackend() is None:
            raise unittest.SkipTest("git or git-http-backend is not installed")
        bare = self.bare("other", "x")
        clone = tempfile.mkdtemp(prefix="local-")
        subprocess.run(["git", "clone", "-q", bare, clone], check=True, env=self.env())
        _out, err, code = yield self.command(GIT, "-C", clone, "push", "-q", "https://github.com/other/x.git", "HEAD:side")
        self.assertNotEqual(code, 0)
        self.assertIn("403", err)
        self.assertIn("which github.repos does not list; list the repository in github.repos", err)  # git shows the body
        refused = self.refusedBy("github.repos")
        self.assertIn("names the repository other/x, which github.repos does not list", refused["reason"])
        self.assertEqual([s.path for s in self.h.fake.seen if s.path.startswith("/other/")], [])
        refs = subprocess.run(["git", "-C", bare, "branch", "--list", "side"], capture_output=True, text=True)
        self.assertEqual(refs.stdout, "")

    # ------------------------------------------------------------------ gh

    def needGh(self) -> str:
        if GH is None:
            raise unittest.SkipTest("gh is not installed (Debian: apt-get install gh)")
        return GH

    @defer.inlineCallbacks
    def test_ghAllowedGetWorks(self) -> Any:
        gh = self.needGh()
        out, err, code = yield self.command(gh, "api", "repos/o/repo")
        self.assertEqual(code, 0, err)
        self.assertEqual(json.loads(out)["path"], "/repos/o/repo")
        out, err, code = yield self.command(gh, "api", "user")
        self.assertEqual(code, 0, err)
        out, err, code = yield self.command(gh, "api", "graphql", "-f", 'query=query { repository(owner: "o", name: "repo") { id } }')
        self.assertEqual(code, 0, err)
        out, err, code = yield self.command(gh, "api", "markdown", "-f", "text=hi")  # allowed by github.requests[0]
        self.assertEqual(code, 0, err)
        self.assertEqual([a for a in self.audit if a["event"] == "refused"], [])

    @defer.inlineCallbacks
    def test_ghOnAnUnlistedRepositoryIsRefused(self) -> Any:
        gh = self.needGh()
        out, err, code = yield self.command(gh, "api", "repos/other/x")
        self.assertNotEqual(code, 0)
        self.assertIn("403", err)
        self.assertIn("which github.repos does not list", out)  # gh api prints the JSON body
        self.refusedBy("github.repos")
        _out, err, code = yield self.command(
            gh, "api", "graphql", "-F", "owner=other", "-F", "name=x",
            "-f", "query=query($owner: String!, $name: String!) { repository(owner: $owner, name: $name) { id } }",
        )
        self.assertNotEqual(code, 0)
        self.assertIn("names the repository other/x", self.refusedBy("github.repos")["reason"])

    @defer.inlineCallbacks
    def test_ghGistCreateIsRefused(self) -> Any:
        gh = self.needGh()
        secret = os.path.join(self.home, "notes.txt")
        with open(secret, "w") as f:
            f.write("something an agent read\n")
        _out, err, code = yield self.command(gh, "gist", "create", secret)
        self.assertNotEqual(code, 0)
        self.assertIn("HTTP 403: refused: POST /gists to api.github.com is refused: it creates", err)
        self.assertIn("add an allow rule for it to github.requests", err)
        refused = self.refusedBy("github.requests")
        self.assertEqual((refused["method"], refused["path"]), ("POST", "/gists"))
        self.assertIn("it creates, changes or deletes a gist", refused["reason"])
        self.assertEqual([s for s in self.h.fake.seen if s.path.startswith("/gists")], [])

    @defer.inlineCallbacks
    def test_ghGraphqlMutationsAreRefusedUnlessListed(self) -> Any:
        gh = self.needGh()
        out, err, code = yield self.command(
            gh, "api", "graphql", "-f", 'query=mutation { createIssue(input: {repositoryId: "R", title: "t"}) { clientMutationId } }'
        )
        self.assertNotEqual(code, 0)
        self.assertIn("403", err)
        self.assertIn("list the mutation in github.mutations", out)
        refused = self.refusedBy("github.mutations")
        self.assertIn("the GraphQL mutation createIssue is not listed in github.mutations", refused["reason"])
        self.assertEqual([s for s in self.h.fake.seen if s.path == "/graphql"], [])
        _out, err, code = yield self.command(
            gh, "api", "graphql", "-f", 'query=mutation { addStar(input: {starrableId: "R"}) { clientMutationId } }'
        )
        self.assertEqual(code, 0, err)
        self.assertEqual([s.method for s in self.h.fake.seen if s.path == "/graphql"], ["POST"])

    @defer.inlineCallbacks
    def test_ghUserLevelWritesAreRefused(self) -> Any:
        gh = self.needGh()
        for args in (("api", "-X", "POST", "user/repos", "-f", "name=new"), ("api", "-X", "PATCH", "user", "-f", "bio=x"),
                     ("api", "-X", "PUT", "user/starred/other/x")):
            _out, _err, code = yield self.command(gh, *args)
            self.assertNotEqual(code, 0)
            self.assertIn("a user-level write", self.refusedBy("github.requests")["reason"])
        self.assertEqual([s for s in self.h.fake.seen if s.path.startswith("/user")], [])


