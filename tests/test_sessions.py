"""Per-session proxy credentials: attribution on every audit record, and proxy.require_session.

The registry and the broker op are tested on their own; then a running proxy
with real curl: a credential in the proxy URL's userinfo (as the SessionStart
hook's env lines put it there) names the session on the CONNECT, forward and
SOCKS records and on a terminated tunnel's request refusal; a request without
one is served unattributed, or refused 407 when ``proxy.require_session`` is
true.  The credential itself is never in a record, a log line or an argv.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
from typing import Any

import pytest
from twisted.internet import defer, reactor, task
from twisted.internet.utils import getProcessOutputAndValue
from twisted.trial import unittest

from agentsandbox.audit import AuditLog
from agentsandbox.broker.ops import Call, OpError, Session
from agentsandbox.broker.procfs import Origin
from agentsandbox.broker.spool import Request
from agentsandbox.egress.sessions import SessionRegistry, digest, newCredential, passwordOf
from agentsandbox.hook import sessionCredentialLines
from agentsandbox.service import CountingAudit
from tests.support.egress_fixtures import ProxyHarness, makeConfig
from tests.support.service_harness import LocalSite

# ---------------------------------------------------------------------- the registry


def test_aRegisteredCredentialNamesItsSessionByClient() -> None:
    registry = SessionRegistry()
    credential = newCredential()
    assert registry.register("sess-1", digest(credential)) is None
    assert registry.attribute("127.0.0.1:5000", credential.encode()) == "sess-1"
    assert registry.of("127.0.0.1:5000") == "sess-1"
    assert registry.attribute("127.0.0.1:5001", b"placeholder") is None
    registry.connected("127.0.0.1:5000")  # a new connection from that address
    assert registry.of("127.0.0.1:5000") is None


def test_aSessionCannotBeTakenOver() -> None:
    registry = SessionRegistry()
    assert registry.register("sess-1", digest(newCredential())) is None
    assert registry.register("sess-1", digest(newCredential())) == "the session sess-1 has a credential already"
    assert registry.register("../x", digest("c")) is not None
    assert registry.register("sess-2", "not-hex") is not None


@pytest.mark.parametrize(
    ("value", "password"),
    [
        (b"Basic " + base64.b64encode(b"agentsandbox:s1.abc"), b"s1.abc"),
        (b"basic " + base64.b64encode(b"srt:placeholder"), b"placeholder"),
        (b"Bearer x", None),
        (b"Basic !!!", None),
        (b"Basic " + base64.b64encode(b"nocolon"), None),
    ],
)
def test_proxyAuthorizationPasswords(value: bytes, password: bytes | None) -> None:
    assert passwordOf(value) == password


def test_theBrokerOpRegistersOnlyFromTheHost() -> None:
    op = Session()
    registry = SessionRegistry()
    host: Any = type("H", (), {"sessions": registry})()
    plan = op.validate(Request(op="session", args=("sess-1", digest("c"))), None)  # type: ignore[arg-type]
    with pytest.raises(OpError, match="a sandboxed process cannot register a session"):
        op.perform(plan, Call(Request(op="session"), Origin(pid=1, cwd="/", env={}, sandboxed=True)), host)
    op.perform(plan, Call(Request(op="session"), Origin(pid=1, cwd="/", env={}, sandboxed=False)), host)
    assert registry.attribute("c:1", b"c") == "sess-1"
    with pytest.raises(OpError, match="two arguments"):
        op.validate(Request(op="session", args=("only",)), None)  # type: ignore[arg-type]


def test_terminatedRequestRecordsNameTheSessionToo(tmp_path: Any) -> None:
    registry = SessionRegistry()
    registry.register("sess-1", digest("c"))
    registry.attribute("127.0.0.1:7", b"c")
    audit = CountingAudit(AuditLog(str(tmp_path / "a.jsonl"), journal=False), registry)
    rec = audit.record("refused", kind="inject", client="127.0.0.1:7", method="POST", path="/gists")
    assert rec["session"] == "sess-1"
    assert "session" not in audit.record("refused", kind="inject", client="127.0.0.1:8")


def test_theEnvLinesHoldTheCredentialOnlyAsShellText(tmp_path: Any) -> None:
    """The lines run in dash and bash without a child process that could show it in an argv."""
    credential = newCredential()
    script = tmp_path / "env.sh"
    script.write_text("\n".join(sessionCredentialLines("sess-1", credential)) + "\n")
    for shell in ("/bin/sh", "/bin/bash"):
        out = subprocess.run(
            [shell, "-c", f". {script}; echo $HTTPS_PROXY; echo $ALL_PROXY; echo ${{no_such-unset}}; echo ${{__agentsandbox_c-gone}}${{__agentsandbox_v-gone}}"],
            env={"HTTPS_PROXY": "http://srt:placeholder@localhost:3128", "ALL_PROXY": "socks5h://localhost:1080"},
            capture_output=True, text=True, check=True,
        ).stdout.split("\n")
        assert out[0] == f"http://agentsandbox:{credential}@localhost:3128"
        assert out[1] == f"socks5h://agentsandbox:{credential}@localhost:1080"
        assert out[3] == "gonegone"  # no helper variable is left behind


# ---------------------------------------------------------------------- a running proxy, real curl


class Attributed(unittest.TestCase):
    timeout = 60
    requireSession = False

    @defer.inlineCallbacks
    def setUp(self) -> Any:  # type: ignore[override]
        self.site = LocalSite()
        self.addCleanup(self.site.close)
        toml = f'[sandbox]\ndomains = ["127.0.0.1:{self.site.port}"]\n'
        if self.requireSession:
            toml += "[proxy]\nrequire_session = true\n"
        self.proxy = ProxyHarness(config=makeConfig(toml))
        yield defer.Deferred.fromCoroutine(self.proxy.start())
        self.addCleanup(self.proxy.stop)
        self.credential = newCredential()
        self.proxy.factory.sessions.register("sess-1", digest(self.credential))

    @defer.inlineCallbacks
    def curl(self, *args: str) -> Any:
        out, err, code = yield getProcessOutputAndValue(
            "/usr/bin/curl", ("-sS", "--noproxy", "", *args), env={"PATH": "/usr/bin:/bin"}, reactor=reactor
        )
        return out, err, code

    @defer.inlineCallbacks
    def records(self, count: int) -> Any:
        for _ in range(200):  # written when the proxy sees the close (bounded, not timed)
            if os.path.exists(self.proxy.auditPath):
                with open(self.proxy.auditPath) as f:
                    found = [json.loads(line) for line in f if line.strip()]
                if len(found) >= count:
                    return found
            yield task.deferLater(reactor, 0.05, lambda: None)
        return []

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.site.port}{path}"

    @defer.inlineCallbacks
    def test_everyRecordNamesTheSession(self) -> Any:
        proxy = f"127.0.0.1:{self.proxy.port}"
        runs = [
            ("--proxy", f"http://agentsandbox:{self.credential}@{proxy}", self.url("/forward")),
            ("--proxytunnel", "--proxy", f"http://agentsandbox:{self.credential}@{proxy}", self.url("/tunnel")),
            ("--proxy", f"socks5h://agentsandbox:{self.credential}@{proxy}", self.url("/socks")),
            ("--proxy", f"http://srt:placeholder@{proxy}", self.url("/nobody")),
        ]
        for args in runs:
            _out, err, code = yield self.curl(*args)
            self.assertEqual(code, 0, err)
        records = yield self.records(4)
        self.assertEqual(
            [(r["event"], r.get("kind"), r.get("session")) for r in records],
            [("forward", "http", "sess-1"), ("tunnel", "connect", "sess-1"), ("tunnel", "socks", "sess-1"),
             ("forward", "http", None)],
        )
        with open(self.proxy.auditPath) as f:
            self.assertNotIn(self.credential, f.read())


class Required(Attributed):
    requireSession = True

    @defer.inlineCallbacks
    def test_everyRecordNamesTheSession(self) -> Any:
        proxy = f"127.0.0.1:{self.proxy.port}"
        out, err, code = yield self.curl("--proxy", f"http://agentsandbox:{self.credential}@{proxy}", self.url("/ok"))
        self.assertEqual(code, 0, err)
        out, _err, _code = yield self.curl("-i", "--proxy", f"http://srt:placeholder@{proxy}", self.url("/no"))
        self.assertIn(b"407 Proxy Authentication Required", out)
        self.assertIn(b"proxy.require_session is true", out)
        _out, _err, code = yield self.curl("--proxy", f"socks5h://{proxy}", self.url("/no-socks"))
        self.assertNotEqual(code, 0)
        _out, _err, code = yield self.curl("--proxy", f"socks5h://u:wrong@{proxy}", self.url("/wrong-socks"))
        self.assertNotEqual(code, 0)
        records = yield self.records(4)
        self.assertEqual(next((r["event"], r.get("session")) for r in records), ("forward", "sess-1"))
        self.assertEqual([r["event"] for r in records[1:]], ["refused"] * 3)
        self.assertEqual(self.site.paths, ["/ok"])
