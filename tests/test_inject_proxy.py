"""Injection through the real egress proxy: CONNECT and SOCKS, curl, git, gh, and the canary.

The proxy (issue 3) runs on a loopback port with an injected resolver that
answers GitHub's names with a documentation address; the injector's dialer
maps that address to the fake GitHub, whose test CA is the injector's
upstream trust.  No config key points anything at the fake.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from typing import Any, ClassVar

from twisted.internet import defer, reactor, task
from twisted.internet.address import IPv4Address
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.utils import getProcessOutputAndValue
from twisted.trial import unittest

from agentsandbox.config import FileSource, githubRules
from agentsandbox.egress.inject import routesFor
from agentsandbox.egress.testing import FixedResolver, MappedDialer
from agentsandbox.egressdir import egressVars, writeEgressDir
from agentsandbox.tokens import TokenKeepers
from tests.support.egress_fixtures import ProxyHarness, makeConfig
from tests.support.inject_github import gitHttpBackend
from tests.support.inject_harness import TOKEN, InjectHarness, LogCapture

GH = shutil.which("gh")
GIT = shutil.which("git")

CONFIG = """\
[sandbox]
domains = ["github.com", "api.github.com", "uploads.github.com", "codeload.github.com"]
"""


class ThroughTheProxy(unittest.TestCase):
    timeout = 180

    # trial waits for the Deferred setUp returns; unittest's signature says None.
    @defer.inlineCallbacks
    def setUp(self) -> Any:  # type: ignore[override]
        self.logs = LogCapture()
        self.logs.start()
        self.addCleanup(self.logs.stop)
        self.h = InjectHarness(reactor)
        self.addCleanup(self.h.close)
        address = str(self.h.address)
        table = {host: [address] for host in ("github.com", "api.github.com", "uploads.github.com")}
        table["codeload.github.com"] = ["192.0.2.44"]
        self.resolver = FixedResolver(table)
        self.proxyDialer = MappedDialer(reactor)
        # codeload.github.com is allowed but not injected: an opaque tunnel to the
        # fake, whose own certificate the client then sees.
        upstreamHost = self.h.upstream.getHost()
        assert isinstance(upstreamHost, IPv4Address)
        self.proxyDialer.route("192.0.2.44", 443, upstreamHost.port)
        self.proxy = ProxyHarness(
            config=makeConfig(CONFIG),
            resolver=self.resolver,
            dialer=self.proxyDialer,
            terminator=self.h.injector,
        )
        yield defer.Deferred.fromCoroutine(self.proxy.start())
        self.addCleanup(self.proxy.stop)
        self.runtime = tempfile.mkdtemp(prefix="inject-runtime-")
        self.egress = os.path.join(self.runtime, "agentsandbox", "egress")
        writeEgressDir(self.egress, self.h.ca.pem)
        self.home = tempfile.mkdtemp(prefix="inject-home-")
        self.outputs: list[bytes] = []

    def env(self) -> dict[str, str]:
        proxy = f"http://srt:placeholder@127.0.0.1:{self.proxy.port}"
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": self.home,
            "HTTPS_PROXY": proxy,
            "https_proxy": proxy,
            "HTTP_PROXY": proxy,
            "http_proxy": proxy,
            "GIT_TERMINAL_PROMPT": "0",
            "GH_NO_UPDATE_NOTIFIER": "1",
            "GH_PROMPT_DISABLED": "1",
            "NO_COLOR": "1",
            **egressVars(self.egress),
        }

    @defer.inlineCallbacks
    def client(self, program: str, *args: str | bytes, cwd: str | None = None) -> Any:
        out, err, code = yield getProcessOutputAndValue(program, args, env=self.env(), path=cwd, reactor=reactor)
        self.outputs += [out, err]
        return out, err, code

    # ------------------------------------------------------------------ curl

    @defer.inlineCallbacks
    def test_curlConnect(self) -> Any:
        out, err, code = yield self.client("/usr/bin/curl", "-sS", "https://api.github.com/user")
        self.assertEqual(code, 0, err)
        self.assertIn(b"octocat", out)
        self.assertEqual(self.h.fake.seen[-1].authorization, [f"token {TOKEN}"])

    @defer.inlineCallbacks
    def test_curlSocks(self) -> Any:
        out, err, code = yield self.client(
            "/usr/bin/curl", "-sS", "--proxy", f"socks5h://u:p@127.0.0.1:{self.proxy.port}", "https://api.github.com/user"
        )
        self.assertEqual(code, 0, err)
        self.assertIn(b"octocat", out)
        self.assertEqual(self.h.fake.seen[-1].authorization, [f"token {TOKEN}"])

    @defer.inlineCallbacks
    def test_theTerminatedTunnelsRecordCountsBothWays(self) -> Any:
        out, err, code = yield self.client("/usr/bin/curl", "-sS", "https://api.github.com/user")
        self.assertEqual(code, 0, err)
        self.assertIn(b"octocat", out)
        records: list[dict[str, Any]] = []
        for _ in range(200):  # the record is written when the proxy sees the close (bounded, not timed)
            if os.path.exists(self.proxy.auditPath):
                with open(self.proxy.auditPath, "rb") as f:
                    records = [json.loads(line) for line in f if line.strip()]
            if any(r.get("via") == "inject" for r in records):
                break
            yield task.deferLater(reactor, 0.05, lambda: None)
        [tunnel] = [r for r in records if r.get("event") == "tunnel" and r.get("via") == "inject"]
        self.assertEqual((tunnel["host"], tunnel["port"]), ("api.github.com", 443))
        # TLS both ways: a ClientHello and a request up, a certificate and a response down.
        self.assertGreater(tunnel["up"], len(b"GET /user HTTP/1.1\r\n"))
        self.assertGreater(tunnel["down"], len(out))

    @defer.inlineCallbacks
    def test_aHostWithoutARuleStaysAnOpaqueTunnel(self) -> Any:
        # Our bundle does not know the fake's CA: an opaque tunnel fails to verify...
        _out, _err, code = yield self.client("/usr/bin/curl", "-sS", "https://codeload.github.com/user")
        self.assertNotEqual(code, 0)
        # ...and with the fake's own CA it verifies: the client spoke to the fake directly.
        caFile = os.path.join(self.h.dir, "upstream-ca.pem")
        with open(caFile, "wb") as f:
            f.write(self.h.pki.pem)
        _out, err, code = yield self.client(
            "/usr/bin/curl", "-sS", "--cacert", caFile, "-H", "Authorization: token mine", "https://codeload.github.com/user"
        )
        self.assertEqual(code, 0, err)
        self.assertEqual(self.h.fake.seen[-1].authorization, ["token mine"])

    @defer.inlineCallbacks
    def test_absoluteFormHttpNeverGetsAToken(self) -> Any:
        # Twisted 26 wants a ServerFactory here and forProtocol is typed to return a Factory.
        plain = yield reactor.listenTCP(0, Factory.forProtocol(_Recorder), interface="127.0.0.1")  # type: ignore[arg-type,attr-defined,unused-ignore]
        self.addCleanup(plain.stopListening)
        _Recorder.heads = []
        self.proxyDialer.route(str(self.h.address), 80, plain.getHost().port)
        _out, err, _code = yield self.client("/usr/bin/curl", "-sS", "--max-time", "20", "http://api.github.com/user")
        self.assertTrue(_Recorder.heads, err)
        self.assertNotIn(TOKEN.encode(), b"".join(_Recorder.heads))
        self.assertNotIn(b"authorization", b"".join(_Recorder.heads).lower())

    # ------------------------------------------------------------------ git and gh

    @defer.inlineCallbacks
    def test_gitCloneAndPush(self) -> Any:
        if GIT is None or gitHttpBackend() is None:
            raise unittest.SkipTest("git or git-http-backend is not installed")
        yield self.gitCloneAndPush()

    @defer.inlineCallbacks
    def gitCloneAndPush(self) -> Any:
        bare = os.path.join(self.h.gitRoot, "repo.git")
        subprocess.run(["git", "init", "-q", "--bare", "-b", "main", bare], check=True)
        seed = tempfile.mkdtemp(prefix="seed-")
        env = {"PATH": os.environ["PATH"], "HOME": self.home, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.org",
               "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.org"}
        subprocess.run(["git", "init", "-q", "-b", "main", seed], check=True, env=env)
        with open(os.path.join(seed, "README"), "w") as f:
            f.write("seed\n")
        subprocess.run(["git", "-C", seed, "add", "README"], check=True, env=env)
        subprocess.run(["git", "-C", seed, "commit", "-qm", "seed"], check=True, env=env)
        subprocess.run(["git", "-C", seed, "push", "-q", bare, "main"], check=True, env=env)
        clone = os.path.join(tempfile.mkdtemp(prefix="clone-"), "repo")
        # The ssh form goes over https through insteadOf, where the proxy injects.
        _out, err, code = yield self.client(GIT or "git", "clone", "-q", "git@github.com:o/repo.git", clone)
        self.assertEqual(code, 0, err)
        self.assertTrue(os.path.exists(os.path.join(clone, "README")))
        gitSeen = [s for s in self.h.fake.seen if s.path.startswith("/o/")]
        self.assertTrue(gitSeen)
        self.assertTrue(all(s.authorization == [self.h.fake.basic()] for s in gitSeen))
        with open(os.path.join(clone, "NEW"), "w") as f:
            f.write("pushed through the proxy\n")
        for args in (("add", "NEW"), ("-c", "user.name=t", "-c", "user.email=t@example.org", "commit", "-qm", "new")):
            _out, err, code = yield self.client(GIT or "git", "-C", clone, *args)
            self.assertEqual(code, 0, err)
        _out, err, code = yield self.client(GIT or "git", "-C", clone, "push", "-q", "origin", "main")
        self.assertEqual(code, 0, err)
        pushed = subprocess.run(["git", "-C", bare, "log", "--format=%s", "-1"], capture_output=True, text=True)
        self.assertEqual(pushed.stdout.strip(), "new")
        self.assertIn("git-receive-pack", " ".join(s.path for s in self.h.fake.seen))

    @defer.inlineCallbacks
    def test_ghApiUser(self) -> Any:
        if GH is None:
            raise unittest.SkipTest("gh is not installed (Debian: apt-get install gh)")
        yield self.ghApiUser()

    @defer.inlineCallbacks
    def ghApiUser(self) -> Any:
        out, err, code = yield self.client(GH or "gh", "api", "user")
        self.assertEqual(code, 0, err)
        self.assertIn(b"octocat", out)
        ghSeen = [s for s in self.h.fake.seen if s.path == "/user"]
        self.assertEqual(ghSeen[-1].authorization, [f"token {TOKEN}"])

    # ------------------------------------------------------------------ the canary

    @defer.inlineCallbacks
    def test_canary(self) -> Any:
        """After a whole session the token is nowhere but in the upstream's headers."""
        secrets = tempfile.mkdtemp(prefix="inject-secrets-")
        tokenFile = os.path.join(secrets, "token")
        with open(tokenFile, "w") as f:
            f.write(TOKEN + "\n")
        rules = githubRules(FileSource(file=tokenFile))
        keepers = TokenKeepers(rules, reactor)  # type: ignore[arg-type,unused-ignore]
        keepers.startService()
        self.addCleanup(keepers.stopService)
        yield keepers.keeperFor(rules[0].token).refresh()
        self.h.injector.swap(self.h.ca, routesFor(rules, lambda rule: keepers.keeperFor(rule.token)))
        self.h.holder.value = None  # only the real keeper has the token now

        sleeper = subprocess.Popen(["sleep", "60"], env=self.env())
        self.addCleanup(sleeper.kill)
        if GIT is not None and gitHttpBackend() is not None:
            yield self.gitCloneAndPush()
        if GH is not None:
            yield self.ghApiUser()
        body = b"echo body ghu_ placeholder"
        out, _err, _code = yield self.client("/usr/bin/curl", "-sS", "--data-binary", body, "https://api.github.com/echo")
        self.assertEqual(out, body)
        yield self.client("/usr/bin/curl", "-sS", "-X", "TRACE", "https://api.github.com/")
        yield self.client("/usr/bin/curl", "-sS", "--proxy", f"socks5h://127.0.0.1:{self.proxy.port}",
                       "https://github.com/echo", "--data-binary", "x")

        self.assertTrue(any(TOKEN in " ".join(s.authorization) or self.h.fake.basic() in s.authorization
                            for s in self.h.fake.seen), "the token did reach the upstream's headers")
        needle = TOKEN.encode()
        for blob in self.outputs:
            self.assertNotIn(needle, blob)
        for line in self.logs.lines:
            self.assertNotIn(TOKEN, line)
        for root in (self.runtime, self.egress, self.proxy.home, self.home):
            for dirpath, _dirs, files in os.walk(root):
                for name in files:
                    path = os.path.join(dirpath, name)
                    if os.path.islink(path):
                        continue
                    with open(path, "rb") as f:
                        self.assertNotIn(needle, f.read(), path)
        if os.path.exists(self.proxy.auditPath):
            with open(self.proxy.auditPath, "rb") as f:
                self.assertNotIn(needle, f.read())
        for pid in _children():
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    self.assertNotIn(needle, f.read(), f"pid {pid}")
            except OSError:
                continue
        self.assertIn(sleeper.pid, _children())
        for status in keepers.statuses():
            self.assertNotIn(TOKEN, status.describe())


def _children() -> list[int]:
    me = str(os.getpid())
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me:
            found.append(int(entry))
    return found


class _Recorder(Protocol):
    heads: ClassVar[list[bytes]] = []

    def dataReceived(self, data: bytes) -> None:
        _Recorder.heads.append(data)
        if b"\r\n\r\n" in data:
            assert self.transport is not None
            self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
            self.transport.loseConnection()
