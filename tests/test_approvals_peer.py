"""Who may answer for the person (issue 28): real processes, real namespaces, read from /proc."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from agentsandbox.controlpeer import agentOf, namespacesOf, readProcess, whyNotThePerson

SESSION = namespacesOf(os.getpid())
Start = Callable[..., int]


def _children(pid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            info = readProcess(int(name))
            if info is not None and info.ppid == pid:
                out.append(info.pid)
    return out


def _sleeper(proc: subprocess.Popen[bytes], depth: int) -> int:
    """The pid ``depth`` generations below ``proc`` (a sandbox's inner process), once it
    runs ``sleep`` (before its exec it is still the test's fork, with the test's environment)."""
    deadline = time.monotonic() + 30
    while True:
        pids = [proc.pid]
        for _ in range(depth):
            pids = [c for p in pids for c in _children(p)]
        found = [p for p in pids if _isSleep(p)]
        if found:
            return found[0]
        assert time.monotonic() < deadline and proc.poll() is None, f"no sleep under {proc.args!r}"
        time.sleep(0.02)


def _isSleep(pid: int) -> bool:
    info = readProcess(pid)
    return info is not None and info.name == "sleep"


@pytest.fixture
def run() -> Iterator[Start]:
    started: list[subprocess.Popen[bytes]] = []

    def start(argv: Sequence[str], env: dict[str, str] | None = None, depth: int = 0) -> int:
        proc = subprocess.Popen(list(argv), env=env, stdin=subprocess.DEVNULL)
        started.append(proc)
        return _sleeper(proc, depth)

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def test_a_plain_process_of_the_session_is_the_person(run: Start) -> None:
    pid = run(["sleep", "30"])
    assert whyNotThePerson(pid, SESSION) is None
    assert whyNotThePerson(os.getpid(), SESSION) is None


def test_a_process_under_unshare_is_refused_naming_the_namespaces(run: Start) -> None:
    if os.geteuid() != 0:
        pytest.skip("unshare -n needs root here")
    pid = run(["unshare", "-n", "sleep", "30"])
    why = whyNotThePerson(pid, SESSION)
    assert why is not None and "runs in other net namespaces than your session" in why


def test_a_process_under_bwrap_is_refused(run: Start) -> None:
    pid = run(
        ["bwrap", "--dev-bind", "/", "/", "--unshare-pid", "--unshare-net", "--", "sleep", "30"], depth=2
    )
    why = whyNotThePerson(pid, SESSION)
    assert why is not None and "runs in other net/mnt/pid namespaces than your session" in why


def test_an_agent_ancestor_is_refused(run: Start, tmp_path: Path) -> None:
    claude = run(["bash", "-c", "exec -a claude bash -c 'sleep 30; true'"], depth=1)
    why = whyNotThePerson(claude, SESSION)
    assert why is not None and why.startswith("its ancestor pid") and "is Claude Code" in why
    script = tmp_path / "agentsandbox"
    script.write_text("#!/bin/sh\nsleep 30\n")
    script.chmod(0o755)
    inRun = run([str(script), "run", "--", "x"], depth=1)
    why = whyNotThePerson(inRun, SESSION)
    assert why is not None and "is agentsandbox run (a sandbox)" in why


def test_a_command_claude_code_started_is_refused_by_its_environment(run: Start) -> None:
    pid = run(["sleep", "30"], env={"PATH": os.environ["PATH"], "CLAUDECODE": "1"})
    why = whyNotThePerson(pid, SESSION)
    assert why is not None and why.startswith("the asking process is a command Claude Code started")


def test_what_names_an_agent() -> None:
    me = readProcess(os.getpid())
    assert me is not None and agentOf(me) is None
    for argv, exe, agent in (
        (("/usr/bin/node", "/usr/lib/node_modules/@anthropic-ai/claude-code/cli.js"), "/usr/bin/node", "Claude Code"),
        (("claude", "-p"), "/usr/lib/node_modules/@anthropic-ai/claude-code/bin/claude.exe", "Claude Code"),
        (("node", "/x/node_modules/@anthropic-ai/sandbox-runtime/dist/cli.js"), "/usr/bin/node", "srt (the sandbox runtime)"),
        ((sys.executable, "-m", "agentsandbox", "run"), sys.executable, "agentsandbox run (a sandbox)"),
        (("bwrap", "--ro-bind"), "/usr/bin/bwrap", "bwrap (a sandbox)"),
    ):
        info = me.__class__(1, 0, "x", argv, exe, False)
        assert agentOf(info) == agent, argv


def test_a_gone_process_cannot_vouch() -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    why = whyNotThePerson(proc.pid, SESSION)
    assert why is not None and "could not be read" in why
