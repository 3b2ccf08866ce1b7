"""The token keeper: sources, renewal, bounded commands, backoff, and silence about the token."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from typing import Any

from twisted.internet import defer, reactor
from twisted.internet.task import Clock
from twisted.trial import unittest

from agentsandbox.config import CommandSource, EnvSource, FileSource, TokenSource, githubRules
from agentsandbox.tokens import TokenError, TokenKeeper, TokenKeepers, checkToken
from tests.support.inject_harness import LogCapture

TOKEN = "ghu_" + "K33perT0ken" * 3 + "Q"


def script(body: str, directory: str | None = None) -> str:
    fd, path = tempfile.mkstemp(prefix="token-", suffix=".sh", dir=directory)
    with os.fdopen(fd, "w") as f:
        f.write("#!/bin/sh\n" + body + "\n")
    os.chmod(path, 0o700)
    return path


class KeeperTests(unittest.TestCase):
    timeout = 60

    def setUp(self) -> None:
        self.clock = Clock()
        self.logs = LogCapture()
        self.logs.start()
        self.addCleanup(self.logs.stop)
        self.state = tempfile.mkdtemp(prefix="token-state-")
        self.addCleanup(shutil.rmtree, self.state, True)

    def keeper(self, source: TokenSource, **kw: Any) -> TokenKeeper:
        k = TokenKeeper(source, reactor, clock=self.clock, hosts=("api.github.com",), **kw)
        self.addCleanup(k.stopService)
        return k

    def commandSource(self, body: str, **kw: Any) -> CommandSource:
        path = script(body, self.state)
        self.addCleanup(os.unlink, path)
        return CommandSource(command=(path,), **kw)

    def assertSilent(self) -> None:
        for line in self.logs.lines:
            self.assertNotIn(TOKEN, line)

    @defer.inlineCallbacks
    def test_commandTokenAndRenewal(self) -> Any:
        counter = os.path.join(self.state, "n")
        source = self.commandSource(f'echo x >> {counter}; echo "{TOKEN}"', renew=300)
        k = self.keeper(source)
        self.assertIsNone(k.token())
        k.startService()
        yield k.refresh()
        self.assertEqual(k.token(), TOKEN)
        status = k.status()
        self.assertTrue(status.present)
        self.assertEqual(status.age, 0)
        self.assertAlmostEqual(status.nextAttempt or 0, 300)
        self.assertNotIn(TOKEN, status.describe())
        self.clock.advance(300)
        yield k.refresh()
        with open(counter) as f:
            self.assertGreaterEqual(len(f.readlines()), 2)
        self.assertSilent()

    @defer.inlineCallbacks
    def test_failingCommandKeepsTheOldTokenAndBacksOff(self) -> Any:
        flag = os.path.join(self.state, "fail")
        source = self.commandSource(
            f'if [ -e {flag} ]; then echo "bad login {TOKEN}" >&2; exit 3; fi; echo {TOKEN}', renew=300
        )
        k = self.keeper(source)
        k.startService()
        yield k.refresh()
        self.assertEqual(k.token(), TOKEN)
        open(flag, "w").close()
        delays = []
        for _ in range(4):
            yield k.refresh()
            delays.append(round(k.status().nextAttempt or 0))
        self.assertEqual(k.token(), TOKEN)
        self.assertEqual(delays, [5, 10, 20, 40])
        status = k.status()
        self.assertEqual(status.failures, 4)
        self.assertIn("exited 3", status.lastError or "")
        self.assertIn("bad login [token]", status.lastError or "")
        self.assertIn("keeping the token", "\n".join(self.logs.lines))
        self.assertSilent()
        os.unlink(flag)
        yield k.refresh()
        self.assertEqual(k.status().failures, 0)
        self.assertIsNone(k.status().lastError)

    @defer.inlineCallbacks
    def test_backoffIsCappedAtTheRenewalPeriod(self) -> Any:
        k = self.keeper(self.commandSource("exit 1", renew=12))
        k.startService()
        for _ in range(5):
            yield k.refresh()
        self.assertEqual(round(k.status().nextAttempt or 0), 12)

    @defer.inlineCallbacks
    def test_aHangingCommandIsKilledAtItsBound(self) -> Any:
        k = self.keeper(self.commandSource(f"echo {TOKEN}; exec sleep 600", timeout=7))
        k.startService()
        d = k.refresh()
        self.clock.advance(7)
        yield d
        self.assertIsNone(k.token())
        self.assertIn("took longer than 7s", k.status().lastError or "")
        self.assertEqual(round(k.status().nextAttempt or 0), 5)
        self.assertSilent()

    @defer.inlineCallbacks
    def test_emptyOutputIsNoToken(self) -> Any:
        k = self.keeper(self.commandSource("echo"))
        k.startService()
        yield k.refresh()
        self.assertIsNone(k.token())
        self.assertIn("no token", k.status().lastError or "")
        self.assertIn("no token yet", k.status().describe())

    @defer.inlineCallbacks
    def test_outputWithSpacesOrNewlinesIsRefused(self) -> Any:
        k = self.keeper(self.commandSource(f'printf "{TOKEN}\\r\\nX-Evil: 1\\n"'))
        k.startService()
        yield k.refresh()
        self.assertIsNone(k.token())
        self.assertIn("control characters", k.status().lastError or "")
        self.assertSilent()
        self.assertNotIn(TOKEN, k.status().describe())

    @defer.inlineCallbacks
    def test_missingProgram(self) -> Any:
        k = self.keeper(CommandSource(command=("no-such-token-program-here",)), environ={"PATH": "/nonexistent"})
        k.startService()
        yield k.refresh()
        self.assertIn("not on the service's PATH", k.status().lastError or "")

    @defer.inlineCallbacks
    def test_fileSource(self) -> Any:
        path = os.path.join(self.state, "token")
        with open(path, "w") as f:
            f.write(TOKEN + "\n")
        k = self.keeper(FileSource(file=path))
        k.startService()
        yield k.refresh()
        self.assertEqual(k.token(), TOKEN)
        os.unlink(path)
        yield k.refresh()
        self.assertEqual(k.token(), TOKEN)
        self.assertIn("cannot read file", k.status().lastError or "")

    @defer.inlineCallbacks
    def test_environmentSource(self) -> Any:
        k = self.keeper(EnvSource(env="MY_TOKEN"), environ={"MY_TOKEN": TOKEN})
        k.startService()
        yield k.refresh()
        self.assertEqual(k.token(), TOKEN)
        k2 = self.keeper(EnvSource(env="MY_TOKEN"), environ={})
        k2.startService()
        yield k2.refresh()
        self.assertIn("MY_TOKEN is not set", k2.status().lastError or "")

    def test_startFetchesAtOnceAndStopCancels(self) -> None:
        k = self.keeper(EnvSource(env="T"), environ={"T": TOKEN})
        k.startService()
        self.clock.advance(0)
        self.assertEqual(k.token(), TOKEN)
        k.stopService()
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_checkToken(self) -> None:
        self.assertEqual(checkToken(b"  abc\n", "x"), "abc")
        for bad in (b"", b"\n", b"a b", b"a\x00", "é".encode()):
            self.assertRaises(TokenError, checkToken, bad, "x")

    def test_githubHostsShareOneKeeper(self) -> None:
        keepers = TokenKeepers(githubRules(), reactor, clock=self.clock)
        rules = githubRules()
        self.assertIs(keepers.keeperFor(rules[0].token), keepers.keeperFor(rules[1].token))
        self.assertEqual(len(keepers.statuses()), 1)
        self.assertEqual(keepers.statuses()[0].hosts, ("github.com", "api.github.com", "uploads.github.com"))

    @defer.inlineCallbacks
    def test_theCommandSeesNoTokenInItsArgvOrEnvironment(self) -> Any:
        out = os.path.join(self.state, "env")
        source = self.commandSource(f'cat /proc/$$/environ > {out}; echo "$@" >> {out}; echo {TOKEN}')
        k = self.keeper(source, environ={"PATH": os.environ.get("PATH", ""), "HOME": self.state})
        k.startService()
        yield k.refresh()
        yield k.refresh()
        with open(out, "rb") as f:
            self.assertNotIn(TOKEN.encode(), f.read())


_ = sys
