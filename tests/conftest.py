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

from agentsandbox.config import Config, loads
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


@pytest.fixture(scope="session", autouse=True)
def privateTempRoot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Every tempfile.mkdtemp/mkstemp of the session lands here, and goes at its end.

    Many fixtures build homes, spools and repositories with tempfile; a failing
    or interrupted test must not leave them behind in /tmp.  The root is 0755
    because some tests run commands as nobody inside it.
    """
    # pytest's own tmp_path root is fixed first, in the usual place: it cleans
    # that up itself, after this fixture is gone.
    tmp_path_factory.getbasetemp()
    root = tempfile.mkdtemp(prefix="agentsandbox-tests-")
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

