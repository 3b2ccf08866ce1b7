"""Shared fixtures: a whole user (home, runtime dir, temp dir) in a temp directory."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agentsandbox.config import Config
from agentsandbox.loader import loads
from agentsandbox.paths import Paths
from agentsandbox.policy import Policy
from tests.support.claude_harness import ClaudeBinary, installedBinaries

REPO = Path(__file__).resolve().parent.parent

DEFAULT_TOML = """\
[sandbox]
read = ["~/projects"]
write = ["~/go/pkg/mod"]
domains = ["muster.example.com", "127.0.0.1:6443"]

[proxy]
port = 3190
"""


#: Where the session's own temp root goes, whatever ``$TMPDIR`` says: a Unix
#: socket's path holds at most 107 bytes, and the package build runs the tests
#: with a long ``TMPDIR`` (scripts/test-deb: ``/tmp/a-long-temporary-directory-name.XXXXXX``,
#: mode 0700, which nobody cannot enter either).
SHORT_BASE = "/tmp"


def shortBase() -> str:
    """``SHORT_BASE`` where it is a writable directory, else the usual temp dir."""
    if os.path.isdir(SHORT_BASE) and os.access(SHORT_BASE, os.W_OK | os.X_OK):
        return SHORT_BASE
    return tempfile.gettempdir()


@pytest.fixture(scope="session", autouse=True)
def privateTempRoot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Every tempfile.mkdtemp/mkstemp of the session lands here, and goes at its end.

    Many fixtures build homes, spools and repositories with tempfile; a failing
    or interrupted test must not leave them behind in /tmp.  The root is 0755
    because some tests run commands as nobody inside it, and it is made in
    ``SHORT_BASE``, not ``$TMPDIR``, so that nobody can reach it and the
    sockets made in it have short paths however long ``$TMPDIR`` is.
    """
    # pytest's own tmp_path root is fixed first, in the usual place: it cleans
    # that up itself, after this fixture is gone.
    tmp_path_factory.getbasetemp()
    root = tempfile.mkdtemp(prefix="as-tests-", dir=shortBase())
    os.chmod(root, 0o755)
    previous = tempfile.tempdir
    tempfile.tempdir = root
    try:
        yield root
    finally:
        tempfile.tempdir = previous
        shutil.rmtree(root, ignore_errors=True)


@dataclass
class User:
    """A fixture user: ``env`` is the environment the hook and the config see."""

    base: Path
    home: Path
    runtime: Path
    tmp: Path
    env: dict[str, str]

    @property
    def configFile(self) -> Path:
        return self.home / ".config" / "agentsandbox" / "config.toml"

    def writeConfig(self, text: str) -> Path:
        self.configFile.parent.mkdir(parents=True, exist_ok=True)
        self.configFile.write_text(text)
        return self.configFile

    def config(self, text: str | None = None) -> Config:
        raw = (DEFAULT_TOML if text is None else text).encode()
        return loads(raw, str(self.configFile), Paths.fromEnvironment(self.env))

    def policy(self, text: str | None = None, exe: str = "/usr/bin/agentsandbox",
               others: tuple[str, ...] = ()) -> Policy:
        """The policy of ``text`` (default ``DEFAULT_TOML``); ``others`` stand for other people's homes."""
        return Policy.fromConfig(self.config(text), self.env, exe=exe, others=others)

    def h(self, rel: str) -> str:
        return str(self.home / rel)


@pytest.fixture
def shortDir() -> Iterator[Path]:
    """A fresh directory with a short path (under the session's root, not ``$TMPDIR``):
    for Unix sockets, and for a ``TMPDIR`` or runtime dir given to programs that make them."""
    path = Path(tempfile.mkdtemp(prefix="s-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def readableSource(privateTempRoot: str) -> str:
    """A copy of the ``agentsandbox`` package that another user (nobody) can import.

    The checkout may be private (a 0700 build tree: dpkg-buildpackage's, or a
    home), so a child run as nobody with ``PYTHONPATH`` at the checkout would
    fail to import.  Give it this directory instead.
    """
    target = os.path.join(privateTempRoot, "readable-source")
    shutil.copytree(REPO / "agentsandbox", os.path.join(target, "agentsandbox"),
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    for root, _dirs, files in os.walk(target):
        os.chmod(root, 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)
    return target


@pytest.fixture
def user(tmp_path: Path) -> User:
    base = tmp_path.resolve()
    home = base / "home"
    for d in (
        "projects/repo",
        "projects/other",
        ".kube",
        ".ssh",
        ".claude/projects/p/memory",
        ".local/state/agentsandbox/spool",
        "go/pkg/mod",
    ):
        (home / d).mkdir(parents=True, exist_ok=True)
    (home / "projects/repo/go.mod").write_text("module x\n")
    (home / ".kube/config").write_text("kube secret\n")
    (home / ".ssh/id_ed25519").write_text("-----BEGIN OPENSSH PRIVATE KEY----- canary\n")
    runtime = base / "run" / "user" / "1000"
    runtime.mkdir(parents=True)
    tmp = base / "tmp"
    tmp.mkdir()
    env = {
        "HOME": str(home),
        "TMPDIR": str(tmp),
        "XDG_RUNTIME_DIR": str(runtime),
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        **suiteEnv(),
    }
    return User(base=base, home=home, runtime=runtime, tmp=tmp, env=env)


class MachineConfig:
    """The machine's config file (``/etc/agentsandbox/config.toml``), moved into a test's temp dir."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, text: str) -> Path:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(text)
        return self.path


@pytest.fixture
def machineFile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> MachineConfig:
    """This process reads the machine's config from a temp file (absent until ``write``)."""
    from agentsandbox import paths

    path = tmp_path / "etc" / "agentsandbox" / "config.toml"
    monkeypatch.setattr(paths, "SYSTEM_CONFIG", str(path))
    return MachineConfig(path)


@pytest.fixture(params=["pinned", "latest"])
def claude(request: pytest.FixtureRequest) -> ClaudeBinary:
    """The Claude Code binary under test (pinned, then the newest); skips with the reason when unusable."""
    binary = installedBinaries()[request.param]
    binary.require()
    return binary


def hookDecision(user: User, tool: str, cwd: str | None = None, **toolInput: Any) -> str | None:
    """The PreToolUse hook's deny reason for one call (in-process), or None when it passes."""
    import io
    import json

    from agentsandbox import hook

    event = {"hook_event_name": "PreToolUse", "tool_name": tool, "tool_input": toolInput,
             "cwd": cwd or user.h("projects/repo")}
    out = hook.pretooluse(io.BytesIO(json.dumps(event).encode()), user.env)
    if not out:
        return None
    spec = json.loads(out)["hookSpecificOutput"]
    assert spec["permissionDecision"] == "deny"
    reason: str = spec["permissionDecisionReason"]
    return reason



def suiteEnv() -> dict[str, str]:
    """What an environment built from scratch for a child must carry: the suite's
    machine root (``notAPackageMachine``)."""
    from agentsandbox.packaged import ROOT_ENV

    return {ROOT_ENV: os.environ[ROOT_ENV]} if os.environ.get(ROOT_ENV) else {}


@pytest.fixture(scope="session", autouse=True)
def notAPackageMachine(privateTempRoot: str) -> Iterator[str]:
    """The suite's services and checks see no package machine (``machine.ROOT_ENV``).

    A .deb installed meanwhile by another run (scripts/test-deb) lays down the
    dispatcher's unit and /etc/agentsandbox/config.toml, which would make a
    service started here wait for a dispatcher instead of binding its port.
    Tests of a package machine make one in a directory and name it themselves.
    """
    from agentsandbox.packaged import ROOT_ENV

    root = os.path.join(privateTempRoot, "no-package-machine")
    os.makedirs(root)
    previous = os.environ.get(ROOT_ENV)
    os.environ[ROOT_ENV] = root
    try:
        yield root
    finally:
        if previous is None:
            os.environ.pop(ROOT_ENV, None)
        else:
            os.environ[ROOT_ENV] = previous
