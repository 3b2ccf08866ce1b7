"""Run the real Claude Code offline against the mock Messages API.

The pieces a Claude Code end-to-end test needs, none of which know about a
particular scenario:

* ``ClaudeBinary``: which binaries exist (the pinned npm install and the newest
  release's platform binary) and why one cannot be used.
* ``ManagedSettingsGuard``: moves whatever is in ``/etc/claude-code`` aside,
  lets a test install the drop-in there, and puts the original back exactly as
  it was (the tree is compared before and after).
* ``World``: a fixture home outside the temp dir with a canary SSH key, a
  project, a read-only docs dir, a config file, and credential variables with
  canary values for Claude Code's own environment.
* ``runClaude``: one bounded ``claude -p`` run in stream-json mode, parsed into
  tool calls and their results.
* ``getSettings``: the effective settings through the SDK control protocol.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import queue
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, NoReturn

import pytest

from agentsandbox.claude import HELPER_NAME

from .mock_messages import MockMessagesAPI, ToolCall, scriptPrompt

REPO_ROOT = Path(__file__).resolve().parents[2]
PINNED_VERSION = "2.1.197"
LATEST_PREFIX_ENV = "AGENTSANDBOX_CLAUDE_LATEST"
DEFAULT_LATEST_PREFIX = "/opt/agentsandbox-ci/claude-latest"
#: Set by CI: a missing pinned binary or a non-root run is then a failure, not
#: a skip.  The newest release still only skips: the issue allows that.
REQUIRE_ENV = "AGENTSANDBOX_REQUIRE_CLAUDE"
MANAGED_ROOT = Path("/etc/claude-code")
MODEL = "claude-sonnet-4-5"
RUN_TIMEOUT = 120.0
#: Tools the mock may call.  Glob and Grep are offered in -p mode only when
#: named here; the others are listed so the set does not depend on defaults.
ALLOWED_TOOLS = ("Bash", "Read", "Grep", "Glob", "Edit", "Write", "NotebookEdit")

CANARY_KEY = "AGENTSANDBOX-CANARY-PRIVATE-KEY-7f3a9c1e"
CANARY_BASHRC = "# AGENTSANDBOX-CANARY-BASHRC-original"
PROJECT_TEXT = "agentsandbox e2e project file: readable-1c5d"
#: In ~/private, which no list opens: a line of text, and a file whose name is
#: itself the marker (a Glob that lists the directory shows it).
CANARY_PRIVATE = "AGENTSANDBOX-CANARY-PRIVATE-NOTES-4b7e"
CANARY_PRIVATE_NAME = "agentsandbox-canary-private-name-e81d.txt"
#: In ~/Documents/notes.txt, closed too: the file issue 23's reproductions reach.
CANARY_DOCUMENTS = "AGENTSANDBOX-CANARY-DOCUMENTS-NOTES-c3a1"
#: Credential variables planted in Claude Code's own environment.  Each value
#: is unique so its absence from any output is meaningful.
CANARY_ENV = {
    "ANTHROPIC_API_KEY": "sk-ant-canary-anthropic-5b21",
    "GH_TOKEN": "canary-gh-token-8e04",
    "GITHUB_TOKEN": "canary-github-token-2d77",
    "OPENAI_API_KEY": "canary-openai-key-91af",
    "NPM_TOKEN": "canary-npm-token-0c3e",
    "AWS_ACCESS_KEY_ID": "canary-aws-access-key-4410",
    "AWS_SECRET_ACCESS_KEY": "canary-aws-secret-6f19",
    "DATABASE_PASSWORD": "canary-db-password-3a58",
    "MY_SERVICE_SECRET_VALUE": "canary-service-secret-d2c0",
}


def requireOrSkip(reason: str, mandatory: bool = True) -> NoReturn:
    """Skip with ``reason``, or fail with it when CI said Claude Code must run."""
    if mandatory and os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason} (and {REQUIRE_ENV}=1 says these tests must run)")
    pytest.skip(reason)


# --- binaries -------------------------------------------------------------------


@dataclass(frozen=True)
class ClaudeBinary:
    label: str
    path: str | None
    version: str | None
    problem: str | None
    mandatory: bool

    def require(self) -> str:
        """The binary's path, or skip (fail under CI) with why it cannot be used."""
        if os.geteuid() != 0:
            requireOrSkip("the Claude Code tests install /etc/claude-code/managed-settings.d and need root")
        if self.problem is not None or self.path is None:
            requireOrSkip(f"{self.label}: {self.problem}", self.mandatory)
        return self.path

    @property
    def checksBeforeHooks(self) -> bool:
        """Whether this version refuses some calls before PreToolUse hooks run.

        2.1.197 applies Read/Edit deny rules and its read-before-write check
        first, so our hook never sees those calls; newer releases run hooks
        first (reference §9).
        """
        return self.version == PINNED_VERSION

    @property
    def ignoredKeys(self) -> frozenset[str]:
        """Drop-in keys this version's schema drops (2.1.197 knows neither)."""
        if self.version == PINNED_VERSION:
            return frozenset({"onFailure", "strictAllowlist"})
        return frozenset()


def _version(path: str) -> tuple[str | None, str | None]:
    try:
        out = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=60,
            stdin=subprocess.DEVNULL, env=_baseEnv(os.environ.get("HOME", "/root")),
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{path} --version failed: {e}"
    if out.returncode != 0:
        return None, f"{path} --version exited {out.returncode}: {out.stderr.strip()[:300]}"
    words = out.stdout.split()
    return (words[0] if words else None), None


def pinnedClaude() -> ClaudeBinary:
    """``claude`` on PATH, which .ci/install-claude pins to PINNED_VERSION."""
    label = f"claude {PINNED_VERSION}"
    path = shutil.which("claude")
    if path is None:
        return ClaudeBinary(label, None, None, "claude is not on PATH (run .ci/install-claude as root)",
                            mandatory=True)
    version, problem = _version(path)
    if problem is None and version != PINNED_VERSION:
        problem = f"{path} is version {version}, not {PINNED_VERSION} (run .ci/install-claude)"
    return ClaudeBinary(label, path, version, problem, mandatory=True)


def latestClaude() -> ClaudeBinary:
    """The newest release's native binary under the CI prefix, run directly."""
    prefix = os.environ.get(LATEST_PREFIX_ENV, DEFAULT_LATEST_PREFIX)
    path = os.path.join(prefix, "bin", "claude")
    label = "claude latest"
    if not os.access(path, os.X_OK):
        return ClaudeBinary(label, None, None,
                            f"no newest-release binary at {path} (.ci/install-claude puts it there)",
                            mandatory=False)
    version, problem = _version(path)
    return ClaudeBinary(f"claude {version or 'latest'}", path, version, problem, mandatory=False)


# --- /etc/claude-code -------------------------------------------------------------


@functools.cache
def installedBinaries() -> dict[str, ClaudeBinary]:
    """The pinned and the newest Claude Code (``.ci/install-claude``), each looked up once a run."""
    return {"pinned": pinnedClaude(), "latest": latestClaude()}


def requireSomeBinary() -> None:
    """Skip, with the reason, before /etc/claude-code is touched when no installed binary can run."""
    usable = [b for b in installedBinaries().values() if b.problem is None]
    (usable[0] if usable else installedBinaries()["pinned"]).require()


def treeSnapshot(root: Path) -> list[tuple[str, str, int, int, int, str]]:
    """Every entry under ``root``: path, kind, mode, uid, gid, content digest or link target."""
    if not os.path.lexists(root):
        return []
    entries = []
    paths = [root]
    for dirpath, dirnames, filenames in os.walk(root):  # does not follow symlinks
        paths += [Path(dirpath, n) for n in sorted(dirnames + filenames)]
    for p in sorted(paths):
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode):
            kind, data = "link", os.readlink(p)
        elif stat.S_ISREG(st.st_mode):
            kind, data = "file", hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            kind, data = ("dir" if stat.S_ISDIR(st.st_mode) else "other"), ""
        entries.append((str(p.relative_to(root)), kind, st.st_mode, st.st_uid, st.st_gid, data))
    return entries


class ManagedSettingsGuard:
    """Give a test an empty ``/etc/claude-code``; put the original back afterwards.

    The original directory is renamed aside (same file system, so nothing is
    copied and nothing about it changes) and renamed back at the end.  A backup
    left by an interrupted run is never overwritten: the guard refuses to start
    and says what to do.
    """

    #: Test runs in other processes (another module, another checkout) take
    #: /etc/claude-code one at a time: each waits for this lock first.
    LOCK = Path("/tmp/agentsandbox-claude-e2e.lock")
    LOCK_WAIT = 900.0

    def __init__(self, root: Path = MANAGED_ROOT) -> None:
        self.root = root
        self.backup = root.with_name(root.name + ".agentsandbox-e2e-saved")
        self.before: list[tuple[str, str, int, int, int, str]] = []
        self.existed = False
        self._lock = -1

    def _acquire(self) -> None:
        import fcntl

        self._lock = os.open(self.LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        deadline = time.monotonic() + self.LOCK_WAIT
        while True:
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(self._lock)
                    self._lock = -1
                    pytest.fail(f"another test run held {self.LOCK} (and {self.root}) for {self.LOCK_WAIT}s")
                time.sleep(0.2)

    def _release(self) -> None:
        if self._lock >= 0:
            os.close(self._lock)
            self._lock = -1

    def __enter__(self) -> ManagedSettingsGuard:
        self._acquire()
        try:
            return self._enter()
        except BaseException:
            self._release()
            raise

    def _enter(self) -> ManagedSettingsGuard:
        if os.path.lexists(self.backup):
            pytest.fail(
                f"{self.backup} exists: an earlier test run did not restore {self.root}. "
                f"Inspect both, move the backup back to {self.root}, then rerun."
            )
        self.before = treeSnapshot(self.root)
        self.existed = os.path.lexists(self.root)
        if self.existed:
            os.rename(self.root, self.backup)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if os.path.lexists(self.root):
                if self.root.is_dir() and not self.root.is_symlink():
                    shutil.rmtree(self.root)
                else:
                    os.unlink(self.root)
            if self.existed:
                os.rename(self.backup, self.root)
            after = treeSnapshot(self.root)
            assert after == self.before, f"{self.root} was not restored exactly"
        finally:
            self._release()


@contextmanager
def tempLeftoversRemoved(tmp: Path = Path("/tmp")) -> Iterator[None]:
    """Remove the ``claude-*`` entries Claude Code leaves in /tmp during the block.

    Its sandbox makes an empty ``claude-empty-XXXXXX`` directory per denied
    path per command under the system temp dir and does not remove them in
    ``-p`` mode.  Only names that were not there before are touched.
    """
    def names() -> set[str]:
        try:
            return {n for n in os.listdir(tmp) if n.startswith("claude-")}
        except OSError:
            return set()

    before = names()
    try:
        yield
    finally:
        for name in sorted(names() - before):
            p = tmp / name
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                with suppress(OSError):
                    p.unlink()


# --- the fixture world -------------------------------------------------------------


def _baseEnv(home: str) -> dict[str, str]:
    """A clean environment: nothing of the developer's shell leaks into a run."""
    return {
        "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
        "HOME": home,
        "LANG": "C.UTF-8",
        "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }


def writeLauncher(path: Path) -> Path:
    """An ``agentsandbox`` executable for a checkout without console scripts, and its policy helper beside it.

    The drop-in names ``agentsandbox-policy-helper`` in the same directory as
    ``agentsandbox`` (``claude.helperPath``), as a package's console scripts lie.
    """
    for target, module, exe in ((path, "agentsandbox", ""),
                                (path.with_name(HELPER_NAME), "agentsandbox.policyhelper",
                                 # its hooks name this launcher, as a console script's name the one beside it
                                 f"AGENTSANDBOX_EXE=${{AGENTSANDBOX_EXE:-{_shQuote(str(path))}}}\nexport AGENTSANDBOX_EXE\n")):
        target.write_text(
            "#!/bin/sh\n"
            f"PYTHONPATH={_shQuote(str(REPO_ROOT))}${{PYTHONPATH:+:$PYTHONPATH}}\n"
            "export PYTHONPATH\n"
            + exe
            + f'exec {_shQuote(sys.executable)} -m {module} "$@"\n'
        )
        target.chmod(0o755)
    return path


def _shQuote(s: str) -> str:
    return "'" + s.replace("'", "'\"'\"'") + "'"


@dataclass
class World:
    """A fixture user: home, project, config, and the agentsandbox launcher."""

    base: Path
    proxyPort: int
    #: sandbox.domains of the world's config.
    domains: tuple[str, ...] = ("example.org",)
    home: Path = field(init=False)
    project: Path = field(init=False)
    docs: Path = field(init=False)
    outside: Path = field(init=False)
    config: Path = field(init=False)
    brokenConfig: Path = field(init=False)
    launcher: Path = field(init=False)
    strayKey: Path = field(init=False)
    private: Path = field(init=False)
    documents: Path = field(init=False)
    claudeTmp: Path = field(init=False)

    def __post_init__(self) -> None:
        b = self.base
        self.home = b / "home"
        self.project = self.home / "work" / "repo"
        self.docs = self.home / "docs"
        self.outside = b / "outside"
        self.config = b / "etc" / "config.toml"
        self.brokenConfig = b / "etc" / "broken.toml"
        self.launcher = b / "bin" / "agentsandbox"
        self.strayKey = self.home / "old-laptop" / "id_ed25519"
        self.private = self.home / "private"
        self.documents = self.home / "Documents"
        self.claudeTmp = b / "claude-tmp"

    def build(self) -> World:
        for d in (self.home / ".ssh", self.strayKey.parent, self.claudeTmp, self.project, self.docs, self.outside,
                  self.private, self.documents, self.config.parent, self.launcher.parent):
            d.mkdir(parents=True, exist_ok=True)
        (self.home / ".ssh").chmod(0o700)
        for key in (self.home / ".ssh" / "id_ed25519", self.strayKey):
            key.write_text(
                f"-----BEGIN OPENSSH PRIVATE KEY-----\n{CANARY_KEY}\n-----END OPENSSH PRIVATE KEY-----\n")
            key.chmod(0o600)
        (self.home / ".bashrc").write_text(CANARY_BASHRC + "\n")
        (self.project / "README.md").write_text(PROJECT_TEXT + "\n")
        (self.docs / "notes.txt").write_text("read-only notes\n")
        notebook = {"cells": [{"cell_type": "code", "id": "c1", "metadata": {}, "source": ["print(1)"],
                               "outputs": [], "execution_count": None}],
                    "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
        for d in (self.docs, self.outside, self.private):
            (d / "book.ipynb").write_text(json.dumps(notebook))
        (self.private / "notes.txt").write_text(CANARY_PRIVATE + "\n")
        (self.private / CANARY_PRIVATE_NAME).write_text("named\n")
        (self.documents / "notes.txt").write_text(f"private notes {CANARY_DOCUMENTS}\n")
        # Write paths are kept out of read paths: 2.1.197 cannot start its
        # sandbox otherwise, and the config loader refuses that layout.
        self.config.write_text(
            "[sandbox]\n"
            'read = ["~/docs"]\n'
            'write = ["~/work"]\n'
            'deny = []\n'
            f"domains = {json.dumps(list(self.domains))}\n"
            "\n[proxy]\n"
            f"port = {self.proxyPort}\n"
        )
        self.brokenConfig.write_text("[sandbox\nread = [this is not TOML\n")
        writeLauncher(self.launcher)
        return self

    def secretFiles(self) -> dict[Path, bytes]:
        """Every protected file's bytes, and the closed ~/private's listing (nothing may appear there)."""
        files = (self.home / ".ssh" / "id_ed25519", self.strayKey, self.home / ".bashrc",
                 self.private / "notes.txt", self.private / "book.ipynb", self.documents / "notes.txt")
        listing = "\n".join(sorted(os.listdir(self.private))).encode()
        return {**{p: p.read_bytes() for p in files}, self.private: listing}

    def agentsandboxEnv(self, config: Path | None = None) -> dict[str, str]:
        env = _baseEnv(str(self.home))
        env["AGENTSANDBOX_EXE"] = str(self.launcher)
        env["AGENTSANDBOX_CONFIG"] = str(config or self.config)
        return env

    def agentsandbox(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(
            [str(self.launcher), *args], capture_output=True, text=True, timeout=60,
            env=self.agentsandboxEnv(), stdin=subprocess.DEVNULL, cwd=str(self.base),
        )
        if check and out.returncode != 0:
            raise AssertionError(
                f"agentsandbox {' '.join(args)} exited {out.returncode}\n"
                f"stdout: {out.stdout}\nstderr: {out.stderr}"
            )
        return out

    def claudeEnv(self, api: MockMessagesAPI, config: Path | None = None) -> dict[str, str]:
        env = self.agentsandboxEnv(config)
        del env["AGENTSANDBOX_EXE"]
        env.update(CANARY_ENV)
        env.update({
            "ANTHROPIC_BASE_URL": api.baseURL,
            # root may use bypassPermissions only when it says it is sandboxed
            "IS_SANDBOX": "1",
            # 2.1.332 defers NotebookEdit behind ToolSearch unless this is off
            "ENABLE_TOOL_SEARCH": "false",
            # Claude Code's scratch files (/tmp/claude-<uid> by default) go
            # with the fixture, so a run leaves nothing in the real /tmp
            "CLAUDE_CODE_TMPDIR": str(self.claudeTmp),
        })
        return env

    def canaries(self) -> list[str]:
        return [CANARY_KEY, CANARY_BASHRC, CANARY_PRIVATE, CANARY_PRIVATE_NAME, CANARY_DOCUMENTS,
                *CANARY_ENV.values()]


def gitCheckout(path: Path) -> Path:
    """Make ``path`` a git repository with one commit of what it holds (no user or system config)."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(path), "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_CONFIG_GLOBAL": os.devnull, "GIT_AUTHOR_NAME": "e2e", "GIT_AUTHOR_EMAIL": "e2e@example.org",
           "GIT_COMMITTER_NAME": "e2e", "GIT_COMMITTER_EMAIL": "e2e@example.org"}
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "--allow-empty", "-m", "fixture"]):
        subprocess.run(["git", *args], cwd=str(path), env=env, check=True, capture_output=True, timeout=60)
    return path


# --- running claude ----------------------------------------------------------------


@dataclass(frozen=True)
class ToolOutcome:
    """One tool call as Claude Code reported it back to the model."""

    name: str
    input: Mapping[str, Any]
    text: str
    isError: bool


@dataclass
class ClaudeRun:
    argv: list[str]
    returncode: int | None
    stdout: str
    stderr: str
    events: list[dict[str, Any]]
    requests: list[dict[str, Any]]
    timedOut: bool = False

    @property
    def result(self) -> dict[str, Any] | None:
        return next((e for e in reversed(self.events) if e.get("type") == "result"), None)

    @property
    def outcomes(self) -> list[ToolOutcome]:
        """Every tool call in order, joined with the result Claude Code sent back."""
        calls: list[tuple[str, str, Mapping[str, Any]]] = []
        results: dict[str, tuple[str, bool]] = {}
        for e in self.events:
            message = e.get("message")
            if not isinstance(message, Mapping) or not isinstance(message.get("content"), list):
                continue
            for block in message["content"]:
                if not isinstance(block, Mapping):
                    continue
                if e.get("type") == "assistant" and block.get("type") == "tool_use":
                    calls.append((str(block.get("id")), str(block.get("name")), block.get("input") or {}))
                elif e.get("type") == "user" and block.get("type") == "tool_result":
                    results[str(block.get("tool_use_id"))] = (
                        _resultText(block.get("content")), bool(block.get("is_error")))
        out = []
        for callId, name, input in calls:
            text, isError = results.get(callId, ("<no tool_result>", True))
            out.append(ToolOutcome(name, input, text, isError))
        return out

    @property
    def permissionDenials(self) -> list[dict[str, Any]]:
        result = self.result or {}
        denials = result.get("permission_denials")
        return list(denials) if isinstance(denials, list) else []

    @property
    def everything(self) -> str:
        """All text that left Claude Code: its output and what it sent the model."""
        return "\n".join([self.stdout, self.stderr, json.dumps(self.requests)])

    def requestsHolding(self, text: str) -> list[int]:
        """The index of every request body sent to the mock that holds ``text`` anywhere."""
        return [i for i, body in enumerate(self.requests) if text in json.dumps(body, ensure_ascii=False)]

    def describe(self) -> str:
        lines = [f"$ {' '.join(self.argv[:2])} … (rc={self.returncode}, timed out={self.timedOut})"]
        for i, o in enumerate(self.outcomes):
            lines.append(f"  call {i}: {o.name} {json.dumps(dict(o.input))[:200]}")
            lines.append(f"    -> error={o.isError}: {o.text[:600]}")
        result = self.result
        if result is not None:
            lines.append(f"  result: {str(result.get('result'))[:600]}")
            lines.append(f"  denials: {json.dumps(self.permissionDenials)[:600]}")
        lines.append(f"  stderr: {self.stderr[-1500:]}")
        return "\n".join(lines)


def _resultText(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(b.get("text", "")) for b in content if isinstance(b, Mapping))
    return ""


def _parseLines(stdout: str) -> list[dict[str, Any]]:
    events = []
    # Lines end at "\n" only: str.splitlines() would also cut at U+0085 and
    # U+2028, which Claude Code writes unescaped inside its JSON lines.
    for line in stdout.split("\n"):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


def _killGroup(proc: subprocess.Popen[Any]) -> None:
    """End the run and anything it started (bwrap, socat, hooks): its own group."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def runClaude(
    binary: str,
    calls: Sequence[ToolCall],
    *,
    cwd: Path,
    env: Mapping[str, str],
    api: MockMessagesAPI,
    timeout: float = RUN_TIMEOUT,
    user: int | None = None,
) -> ClaudeRun:
    """One ``claude -p`` run that plays ``calls`` through the mock, bounded by ``timeout``.

    ``user``: the uid to run it as (its primary group, no others), for tests that
    made real users.
    """
    argv = [
        binary, "-p", scriptPrompt(calls),
        "--output-format", "stream-json", "--verbose",
        "--model", MODEL,
        "--permission-mode", "bypassPermissions",
        "--allowedTools", ",".join(ALLOWED_TOOLS),
    ]
    firstRequest = len(api.requests)
    proc = subprocess.Popen(
        argv, cwd=str(cwd), env=dict(env), stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        **asUser(user),
    )
    timedOut = False
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timedOut = True
        _killGroup(proc)
        stdout, stderr = proc.communicate()
    finally:
        _killGroup(proc)  # leftovers of a finished run, if any
    return ClaudeRun(argv, proc.returncode, stdout, stderr, _parseLines(stdout),
                     list(api.requests[firstRequest:]), timedOut)


# --- get_settings over the control protocol ----------------------------------------


def _lines(stream: IO[str], into: queue.Queue[str | None]) -> None:
    for line in stream:
        into.put(line)
    into.put(None)


def asUser(uid: int | None) -> dict[str, Any]:
    """``subprocess`` arguments that run a child as ``uid`` with only its primary group."""
    if uid is None:
        return {}
    import pwd

    return {"user": uid, "group": pwd.getpwuid(uid).pw_gid, "extra_groups": []}


def getSettings(binary: str, *, cwd: Path, env: Mapping[str, str],
                timeout: float = 60.0, user: int | None = None) -> dict[str, Any]:
    """The ``get_settings`` control response: ``effective`` and per-source ``sources``.

    Asks for nothing that needs the API: ``initialize``, then ``get_settings``,
    each sent after the previous answer arrived, under one deadline.
    """
    argv = [binary, "-p", "--input-format", "stream-json", "--output-format", "stream-json",
            "--verbose", "--model", MODEL]
    proc = subprocess.Popen(
        argv, cwd=str(cwd), env=dict(env), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True, **asUser(user),
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    lines: queue.Queue[str | None] = queue.Queue()
    errors: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True).start()
    threading.Thread(target=_lines, args=(proc.stderr, errors), daemon=True).start()
    deadline = time.monotonic() + timeout
    seen: list[str] = []

    def ask(requestId: str, request: dict[str, Any]) -> dict[str, Any]:
        assert proc.stdin is not None
        proc.stdin.write(json.dumps({"type": "control_request", "request_id": requestId,
                                     "request": request}) + "\n")
        proc.stdin.flush()
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no answer to {request['subtype']} within {timeout}s; saw: {seen[-5:]}")
            try:
                line = lines.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"claude exited before answering {request['subtype']}; "
                                     f"saw: {seen[-5:]}; stderr: {_drain(errors)[-1500:]}")
            seen.append(line.strip()[:500])
            try:
                event = json.loads(line)
            except ValueError:
                continue
            response = event.get("response") if isinstance(event, dict) else None
            if (event.get("type") == "control_response" and isinstance(response, dict)
                    and response.get("request_id") == requestId):
                if response.get("subtype") != "success":
                    raise AssertionError(f"{request['subtype']} failed: {line.strip()[:1500]}")
                payload = response.get("response")
                return payload if isinstance(payload, dict) else {}

    try:
        ask("init", {"subtype": "initialize"})
        return ask("settings", {"subtype": "get_settings"})
    finally:
        try:
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        _killGroup(proc)
        proc.wait()


def _drain(q: queue.Queue[str | None]) -> str:
    parts = []
    while True:
        try:
            item = q.get_nowait()
        except queue.Empty:
            break
        if item is not None:
            parts.append(item)
    return "".join(parts)


def withoutKeys(value: Any, keys: frozenset[str]) -> Any:
    """``value`` without the object keys in ``keys``, at any depth."""
    if isinstance(value, dict):
        return {k: withoutKeys(v, keys) for k, v in value.items() if k not in keys}
    if isinstance(value, list):
        return [withoutKeys(v, keys) for v in value]
    return value


def missingFrom(effective: Any, wanted: Any, where: str = "") -> list[str]:
    """Where ``wanted`` is not part of ``effective`` (arrays may have grown by merging)."""
    if isinstance(wanted, dict):
        if not isinstance(effective, dict):
            return [f"{where or '/'}: not an object"]
        missing = []
        for k, v in wanted.items():
            if k not in effective:
                missing.append(f"{where}/{k}: missing")
            else:
                missing += missingFrom(effective[k], v, f"{where}/{k}")
        return missing
    if isinstance(wanted, list):
        if not isinstance(effective, list):
            return [f"{where}: not an array"]
        return [f"{where}: lacks {w!r}" for w in wanted if w not in effective]
    return [] if effective == wanted else [f"{where}: {effective!r} != {wanted!r}"]


@contextmanager
def mockAPI() -> Iterator[MockMessagesAPI]:
    api = MockMessagesAPI().start()
    try:
        yield api
    finally:
        api.stop()


def freeLoopbackPort() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
