"""The real Claude Code against a service that asks (issue 28), offline on the mock Messages API.

One session of the pinned Claude Code (the newest too, where it runs) makes its
Bash tool calls while the person, this test, answers through the real
``agentsandbox approve`` / ``deny`` from outside any sandbox:

1. ``curl`` to an unlisted host waits; the person approves it ``--once``; it succeeds;
2. the same ``curl`` again is asked again; the person denies it: the tool result
   carries the proxy's words;
3. ``agentsandbox approve`` from inside Claude Code's Bash is refused;
4. ``agentsandbox approve`` from a process Claude Code starts outside its sandbox
   (a PreToolUse hook of the user's own settings) is refused and recorded;
5. ``approve --always`` for a held command writes the user's file (its comments
   kept), and a new session reaches the host without being asked; a command
   nobody answers for gets the timeout's words.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from agentsandbox.audit import readRecords
from tests.support.claude_harness import (
    MANAGED_ROOT,
    ManagedSettingsGuard,
    World,
    freeLoopbackPort,
    installedBinaries,
    mockAPI,
    requireOrSkip,
    requireSomeBinary,
    runClaude,
    tempLeftoversRemoved,
)
from tests.support.mock_messages import MockMessagesAPI, ToolCall
from tests.support.service_harness import LocalSite, ServiceProcess
from tests.test_service_e2e import BRIDGES_UP, TOKEN, TOKEN_ENV

HOST = "app.example.org"
#: A host the person answers --always for.
ALWAYS = "docs.example.org"
#: Hosts a Claude Code session's person answers --always for, one a release.
WIKI = {label: f"wiki-{label}.example.org" for label in ("pinned", "latest")}
#: A host nobody answers for.
SILENT = "silent.example.org"
SESSION_TIMEOUT = 150.0
#: A bound on how long the person waits for Claude Code's command to be held.
HOLD_WAIT = 90.0


@dataclass
class Stack:
    world: World
    runtime: Path
    site: LocalSite
    service: ServiceProcess

    def userEnv(self) -> dict[str, str]:
        env = self.world.agentsandboxEnv()
        env["XDG_RUNTIME_DIR"] = str(self.runtime)
        return env

    def agentsandbox(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.world.launcher), *args], env=self.userEnv(), capture_output=True,
                              text=True, timeout=60, stdin=subprocess.DEVNULL)

    def audit(self) -> list[dict[str, Any]]:
        return list(readRecords(str(self.world.home / ".local" / "state" / "agentsandbox" / "audit.jsonl")))


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    for tool in ("bwrap", "socat", "rg", "curl"):
        if shutil.which(tool) is None:
            requireOrSkip(f"{tool} is not installed (.ci/install-deps installs it)")
    base = Path(tempfile.mkdtemp(prefix="agentsandbox-ask-e2e-", dir="/var/tmp"))
    site = LocalSite()
    world = World(base=base, proxyPort=freeLoopbackPort()).build()
    service: ServiceProcess | None = None
    try:
        world.config.write_text(
            "# The person's notes: an --always answer keeps them.\n"
            "[sandbox]\n"
            'read = ["~/docs"]\n'
            'write = ["~/work"]\n'
            'domains = ["github.com"]  # what the agent reaches\n'
            "\n[proxy]\n"
            f"port = {world.proxyPort}\n"
            'unlisted = "ask"\n'
            "ask_timeout = 60\n"
            "\n[[inject]]\n"
            'hosts = ["github.com"]\n'
            f'token_env = "{TOKEN_ENV}"\n'
        )
        runtime = base / "run"
        runtime.mkdir(mode=0o700)
        (base / "fake-git").mkdir()
        serviceEnv = world.agentsandboxEnv()
        serviceEnv.update(XDG_RUNTIME_DIR=str(runtime), **{TOKEN_ENV: TOKEN})
        service = ServiceProcess(world.config, serviceEnv, base / "service", base / "fake-git",
                                 routes={HOST: site.port, ALWAYS: site.port, **{w: site.port for w in WIKI.values()}}).start()
        yield Stack(world, runtime, site, service)
    finally:
        if service is not None:
            service.stop()
        site.close()
        shutil.rmtree(base, ignore_errors=True)


@dataclass(eq=False)
class Person(threading.Thread):
    """Answers each request Claude Code's commands get held for, in turn, from the test's own process tree."""

    stack: Stack
    answers: list[tuple[str, ...]]
    done: list[subprocess.CompletedProcess[str]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    #: Each held request as ``approvals --json`` listed it.
    seen: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        threading.Thread.__init__(self, name="the person", daemon=True)

    def run(self) -> None:
        for answer in self.answers:
            deadline = time.monotonic() + HOLD_WAIT
            while True:
                listed = self.stack.agentsandbox("approvals", "--json")
                held = json.loads(listed.stdout)["held"] if listed.returncode == 0 else []
                if held:
                    break
                if time.monotonic() > deadline:
                    self.problems.append(f"nothing was held within {HOLD_WAIT}s for {answer}: {listed.stderr}")
                    return
                time.sleep(0.1)
            self.seen.append(held[0])
            self.done.append(self.stack.agentsandbox(answer[0], held[0]["id"], *answer[1:]))


@pytest.mark.claude
@pytest.mark.parametrize("label", ["pinned", "latest"])
def test_claude_codes_curl_waits_for_the_person_and_claude_code_cannot_answer(stack: Stack, label: str) -> None:
    path = installedBinaries()[label].require()
    requireSomeBinary()
    world = stack.world
    hookLog = world.home / "work" / f"hook-approve-{label}.log"
    settings = world.home / ".claude" / "settings.json"
    settings.parent.mkdir(parents=True, exist_ok=True)
    # A process Claude Code starts outside its sandbox: a hook of the user's own settings.
    # The second drops CLAUDECODE: Claude Code itself, its ancestor, is still seen.
    withoutEnv = world.home / "work" / f"hook-approve-unset-{label}.log"
    settings.write_text(json.dumps({"hooks": {"PreToolUse": [{"matcher": "Bash", "hooks": [{
        "type": "command",
        "command": f"{world.launcher} approve {HOST} --for 10m >> {hookLog} 2>&1; "
                   f"env -u CLAUDECODE {world.launcher} approve {HOST} --for 10m >> {withoutEnv} 2>&1; true",
    }]}]}}))
    inside = f"{world.launcher} approve {HOST} --for 10m; echo rc=$?"
    calls = [
        ToolCall("Bash", {"command": f"{BRIDGES_UP}curl -sS -i http://{HOST}/first-{label}"}),
        ToolCall("Bash", {"command": f"curl -sS -i http://{HOST}/second-{label}"}),
        ToolCall("Bash", {"command": inside}),
    ]
    person = Person(stack, [("approve", "--once"), ("deny",)])
    auditBefore = len(stack.audit())
    with ManagedSettingsGuard(), tempLeftoversRemoved(), mockAPI() as api:
        installed = subprocess.run([str(world.launcher), "install", "--managed-dir", str(MANAGED_ROOT)],
                                   env=stack.userEnv(), capture_output=True, text=True, timeout=60,
                                   stdin=subprocess.DEVNULL)
        assert installed.returncode == 0, installed.stderr
        env = _claudeEnv(stack, api)
        person.start()
        run = runClaude(path, calls, cwd=world.project, env=env, api=api, timeout=SESSION_TIMEOUT)
        person.join(HOLD_WAIT)
    assert not person.problems, f"{person.problems}\n{run.describe()}"
    assert not run.timedOut and len(run.outcomes) == len(calls), run.describe()
    first, second, fromBash = (o.text for o in run.outcomes)
    # 1. held, approved once by the person, through.
    assert [d.returncode for d in person.done] == [0, 0], person.done
    # The person saw what asked (egress/askers.py): the process holding the client end, the
    # host side of the sandbox's network bridge, and the Claude Code session behind it.
    for request in person.seen:
        assert re.fullmatch(r"\d+ [^,]+, session [0-9a-f-]{36}", request["process"] or ""), person.seen
    assert f"{LocalSite.BODY}: /first-{label}" in first, run.describe()
    # 2. asked again, and the person's no in the proxy's words.
    assert "403 Forbidden" in second, run.describe()
    assert f"{HOST}:80 is not on sandbox.domains and the person refused it (deny once, by agentsandbox deny" in second
    assert f"`agentsandbox approve {HOST}`" in second
    # 3. from inside Claude Code's Bash: refused (by the service, or the sandbox hides its socket).
    assert "rc=1" in fromBash, run.describe()
    assert ("the answer was not taken" in fromBash or "may not be opened by this process" in fromBash
            or "may not open a Unix socket" in fromBash or "no control socket" in fromBash), fromBash
    # 4. from a process Claude Code started outside the sandbox: refused and recorded.
    said = hookLog.read_text()
    unset = withoutEnv.read_text()
    for text in (said, unset):
        # Claude Code itself, by its binary, up the chain (its CLAUDECODE is the fallback).
        assert "agentsandbox approve: the answer was not taken: its ancestor pid " in text, text
        assert "is Claude Code: an agent or a sandbox may not answer for the person" in text, text
    records = stack.audit()[auditBefore:]
    refusals = [r for r in records if r["event"] == "control"]
    assert refusals and all("the answer was not taken" in r["reason"] for r in refusals), records
    decided = [(r["verdict"], r["scope"]) for r in records if r["event"] == "decided"]
    assert decided == [("allow", "once"), ("deny", "once")], records


def _claudeEnv(stack: Stack, api: MockMessagesAPI) -> dict[str, str]:
    env = stack.world.claudeEnv(api)
    env["XDG_RUNTIME_DIR"] = str(stack.runtime)
    return env


@pytest.mark.srt
def test_agentsandbox_run_cannot_answer(stack: Stack) -> None:
    if shutil.which("srt") is None:
        requireOrSkip("srt is not installed (npm install -g @anthropic-ai/sandbox-runtime)")
    launcher = str(stack.world.launcher)
    auditBefore = len(stack.audit())
    # run passes no XDG_RUNTIME_DIR: name the socket's directory as an agent that knows it would.
    done = subprocess.run([launcher, "run", "--", "env", f"XDG_RUNTIME_DIR={stack.runtime}",
                           launcher, "approve", HOST, "--for", "10m"],
                          env=stack.userEnv(), cwd=stack.world.project, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "agentsandbox approve: " in done.stderr and (
        "may not open a Unix socket" in done.stderr or "the answer was not taken" in done.stderr
        or "may not be opened by this process" in done.stderr or "no control socket" in done.stderr
    ), done.stderr
    # Nothing was decided by it: the person's `approvals` shows no standing answer.
    assert not [r for r in stack.audit()[auditBefore:] if r["event"] == "decided"]


def test_always_is_written_followed_by_the_watcher_and_outlives_a_restart(stack: Stack) -> None:
    before = stack.world.config.read_text()
    log = stack.service.logPath
    reloads = log.read_text().count("config reloaded")
    done = stack.agentsandbox("approve", ALWAYS, "--always")
    assert done.returncode == 0, done.stderr
    after = stack.world.config.read_text()
    assert after == before.replace('domains = ["github.com"]', f'domains = ["github.com", "{ALWAYS}"]'), after
    deadline = time.monotonic() + 30
    while log.read_text().count("config reloaded") == reloads:  # the watcher follows the file
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    # A new service remembers nothing: only the file can let the host through now.
    stack.service.stop()
    stack.service.start()
    got = subprocess.run(
        ["curl", "-sS", "--noproxy", "", "-x", f"http://127.0.0.1:{stack.world.proxyPort}", f"http://{ALWAYS}/always"],
        capture_output=True, text=True, timeout=90,
    )
    assert got.stdout == f"{LocalSite.BODY}: /always\n", got
    assert not [r for r in stack.audit() if r["event"] == "held" and r["host"] == ALWAYS]


def _waitForReload(stack: Stack, before: int) -> None:
    log = stack.service.logPath
    deadline = time.monotonic() + 30
    while log.read_text().count("config reloaded") == before:  # the watcher follows the file
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)


@pytest.mark.claude
@pytest.mark.parametrize("label", ["pinned", "latest"])
def test_always_reaches_a_new_session_without_asking_and_silence_times_out(stack: Stack, label: str) -> None:
    path = installedBinaries()[label].require()
    requireSomeBinary()
    world, host = stack.world, WIKI[label]
    reloads = stack.service.logPath.read_text().count("config reloaded")
    person = Person(stack, [("approve", "--always")])
    with ManagedSettingsGuard(), tempLeftoversRemoved():
        installed = subprocess.run([str(world.launcher), "install", "--managed-dir", str(MANAGED_ROOT)],
                                   env=stack.userEnv(), capture_output=True, text=True, timeout=60,
                                   stdin=subprocess.DEVNULL)
        assert installed.returncode == 0, installed.stderr
        # 1. a session's command is held; the person answers --always.
        with mockAPI() as api:
            person.start()
            first = runClaude(path, [ToolCall("Bash", {"command": f"{BRIDGES_UP}curl -sS http://{host}/first"})],
                              cwd=world.project, env=_claudeEnv(stack, api), api=api, timeout=SESSION_TIMEOUT)
            person.join(HOLD_WAIT)
        assert not person.problems and [d.returncode for d in person.done] == [0], (person.problems, person.done)
        assert f"{LocalSite.BODY}: /first" in first.outcomes[0].text, first.describe()
        written = world.config.read_text()
        assert f'"{host}"' in written and "# The person's notes: an --always answer keeps them." in written, written
        assert "# what the agent reaches" in written, written
        _waitForReload(stack, reloads)
        # 2. a new session reaches it, and nobody is asked.
        heldBefore = [r for r in stack.audit() if r["event"] == "held" and r["host"] == host]
        with mockAPI() as api:
            second = runClaude(path, [ToolCall("Bash", {"command": f"{BRIDGES_UP}curl -sS http://{host}/second"})],
                               cwd=world.project, env=_claudeEnv(stack, api), api=api, timeout=SESSION_TIMEOUT)
        assert f"{LocalSite.BODY}: /second" in second.outcomes[0].text, second.describe()
        assert [r for r in stack.audit() if r["event"] == "held" and r["host"] == host] == heldBefore
        # 3. nobody answers: the tool result carries the timeout's words.
        original = world.config.read_text()
        reloads = stack.service.logPath.read_text().count("config reloaded")
        world.config.write_text(original.replace("ask_timeout = 60", "ask_timeout = 2"))
        try:
            _waitForReload(stack, reloads)
            with mockAPI() as api:
                silent = runClaude(path, [ToolCall("Bash", {"command": f"{BRIDGES_UP}curl -sS -i http://{SILENT}/"})],
                                   cwd=world.project, env=_claudeEnv(stack, api), api=api, timeout=SESSION_TIMEOUT)
            text = silent.outcomes[0].text
            assert "403 Forbidden" in text, silent.describe()
            assert f"{SILENT}:80" in text and "nobody answered within proxy.ask_timeout (2s)" in text, text
        finally:
            reloads = stack.service.logPath.read_text().count("config reloaded")
            world.config.write_text(original)
            _waitForReload(stack, reloads)
