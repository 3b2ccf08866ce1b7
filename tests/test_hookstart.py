"""The PreToolUse hook as the drop-in starts it: ``PYTHON -I -S hookstart.py EXE pretooluse``."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from agentsandbox import claude
from tests.conftest import User
from tests.test_hook import ev

EXE = "/opt/agentsandbox-test/bin/agentsandbox"

#: What the warm path must not import: each costs more than the decision
#: (bench/hook.py), or belongs to another room.
NOT_ON_THE_FAST_PATH = {
    "site", "re", "json", "fnmatch", "typing", "pathlib", "argparse", "tomllib", "dataclasses",
    "shlex", "shutil", "importlib.util", "agentsandbox.cli", "agentsandbox.config", "agentsandbox.claude",
}


@pytest.fixture
def configured(user: User) -> User:
    user.writeConfig('[sandbox]\nread = ["~/projects"]\nwrite = ["~/go/pkg/mod"]\n')
    return user


def dropInCommand(user: User) -> list[str]:
    """The PreToolUse hook's argv, as the rendered drop-in names it."""
    (pre,) = claude.render(user.policy(exe=EXE))["hooks"]["PreToolUse"]
    (entry,) = pre["hooks"]
    return [entry["command"], *entry["args"]]


def run(argv: list[str], user: User, event: object, **env: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(argv, input=json.dumps(event).encode(), capture_output=True,
                          env={**user.env, **env}, timeout=30)


def decision(p: subprocess.CompletedProcess[bytes]) -> str | None:
    assert (p.returncode, p.stderr) == (0, b""), p
    if p.stdout == b"":
        return None
    spec = json.loads(p.stdout)["hookSpecificOutput"]
    assert spec["permissionDecision"] == "deny", spec
    reason: str = spec["permissionDecisionReason"]
    return reason


def test_the_drop_in_command_denies_and_allows(configured: User) -> None:
    argv = dropInCommand(configured)
    assert argv[1:3] == ["-I", "-S"] and argv[3].endswith("/agentsandbox/hookstart.py") and argv[4:] == [EXE, "pretooluse"]
    denied = decision(run(argv, configured, ev(configured, "Read", file_path="~/.ssh/id_ed25519")))
    assert denied is not None and "sandbox.read" in denied and str(configured.configFile) in denied
    assert decision(run(argv, configured, ev(configured, "Read", file_path="go.mod"))) is None
    # The cache the hook wrote names the drop-in's command, as SessionStart's policy does.
    cache = json.loads((configured.home / ".local/state/agentsandbox/policy-cache.json").read_text())
    assert cache["policy"]["exe"] == EXE


def test_claude_codes_python_variables_do_not_reach_the_hook(configured: User, tmp_path: Path) -> None:
    """-I: a PYTHONPATH or PYTHONSTARTUP in Claude Code's environment cannot replace the hook."""
    poison = tmp_path / "poison"
    (poison / "agentsandbox").mkdir(parents=True)
    (poison / "agentsandbox/__init__.py").write_text("import os\nos.write(1, b'POISON')\nraise SystemExit(0)\n")
    (poison / "startup.py").write_text("import os\nos.write(1, b'POISON')\n")
    argv = dropInCommand(configured)
    p = run(argv, configured, ev(configured, "Read", file_path="~/.ssh/id_ed25519"),
            PYTHONPATH=str(poison), PYTHONSTARTUP=str(poison / "startup.py"), PYTHONINSPECT="1")
    assert b"POISON" not in p.stdout
    assert decision(p) is not None


def test_the_warm_path_imports_only_the_hooks_room(configured: User) -> None:
    argv = dropInCommand(configured)
    event = ev(configured, "Read", file_path="~/.ssh/id_ed25519")
    decision(run(argv, configured, event))  # writes the policy cache
    # The same command with -X importtime, which lists every module imported.
    p = subprocess.run([argv[0], "-X", "importtime", *argv[1:]], input=json.dumps(event).encode(),
                       capture_output=True, env=configured.env, timeout=30)
    assert p.returncode == 0 and b'"deny"' in p.stdout, p
    imported = {line.rsplit("|", 1)[1].strip() for line in p.stderr.decode().splitlines() if line.startswith("import time:")}
    assert "agentsandbox.hook" in imported
    assert imported & NOT_ON_THE_FAST_PATH == set()
    assert not any(m.split(".")[0] == "twisted" for m in imported)
    assert {m for m in imported if m.startswith("agentsandbox")} == {
        "agentsandbox", "agentsandbox.hook", "agentsandbox.hookjson", "agentsandbox.policy", "agentsandbox.paths",
        "agentsandbox.tools",
    }


#: A config with every section the loader validates: without site, a third-party
#: import anywhere in the loader would fail the first call after a change.
EVERY_SECTION = """\
[sandbox]
read = ["~/projects"]
write = ["~/go/pkg/mod"]
deny = ["~/projects/secret"]
domains = ["muster.example.com", "127.0.0.1:6443", "10.0.0.0/8"]

[proxy]
port = 3190

[[inject]]
hosts = ["models.example.com"]
header = "x-api-key"
format = "{token}"
token_env = "MODEL_KEY"

[[inject]]
hosts = ["registry.example.org"]
format = "Basic {basic}"
basic_user = "ci"
token_file = "~/.secrets/registry"
renew = 60

[broker.run.cluster-up]
argv = ["/usr/bin/kind", "create", "cluster"]
args = ["^--name=[a-z]+$"]
timeout = 120
"""


def test_a_cache_miss_loads_the_config_under_the_same_command(configured: User) -> None:
    """Without site, the config loader (tomllib and all) still imports: only stdlib and the package."""
    configured.config(EVERY_SECTION)  # the loader in this process accepts it
    configured.writeConfig(EVERY_SECTION)
    argv = dropInCommand(configured)
    cache = configured.home / ".local/state/agentsandbox/policy-cache.json"
    for _ in range(2):
        cache.unlink(missing_ok=True)
        assert decision(run(argv, configured, ev(configured, "Read", file_path="~/.ssh/id_ed25519"))) is not None
        assert cache.exists()
    configured.writeConfig("[sandbox\n")
    reason = decision(run(argv, configured, ev(configured, "Read", file_path="go.mod")))
    assert reason is not None and "config cannot be loaded" in reason


def test_a_hook_that_cannot_start_still_denies(configured: User, tmp_path: Path) -> None:
    """hookstart.py beside no package: the import fails, and the call is denied, exit 0."""
    lone = tmp_path / "lib/agentsandbox/hookstart.py"
    lone.parent.mkdir(parents=True)
    shutil.copy(claude.HOOK_START, lone)
    argv = dropInCommand(configured)
    argv[3] = str(lone)
    reason = decision(run(argv, configured, ev(configured, "Read", file_path="go.mod")))
    assert reason == "agentsandbox refused this call: the hook could not start"
