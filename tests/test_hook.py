"""The PreToolUse and SessionStart hooks (DESIGN §4.3): decisions, bad input, fail-closed."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from agentsandbox import claude, hook
from agentsandbox.hook import cachedPolicy
from tests.conftest import REPO, MachineConfig, User


def run(user: User, event: Any, raw: bytes | None = None) -> dict[str, Any] | None:
    """Decide one event in-process; None means no output (the call passes)."""
    data = raw if raw is not None else json.dumps(event).encode()
    out = hook.pretooluse(io.BytesIO(data), user.env)
    if not out:
        return None
    assert out.endswith("\n") and out.count("\n") == 1
    parsed: dict[str, Any] = json.loads(out)
    return parsed


def reason(result: dict[str, Any] | None) -> str:
    assert result is not None, "expected a deny"
    spec = result["hookSpecificOutput"]
    assert spec["hookEventName"] == "PreToolUse"
    assert spec["permissionDecision"] == "deny"
    text: str = spec["permissionDecisionReason"]
    return text


@pytest.fixture
def configured(user: User) -> User:
    user.writeConfig('[sandbox]\nread = ["~/projects"]\nwrite = ["~/go/pkg/mod"]\n')
    return user


def ev(user: User, tool: str, cwd: str | None = None, **toolInput: Any) -> dict[str, Any]:
    return {
        "session_id": "s",
        "hook_event_name": "PreToolUse",
        "tool_name": tool,
        "tool_input": toolInput,
        "cwd": cwd or user.h("projects/repo"),
    }


# (tool, input, refused-as) — refused-as is "read", "write" or None for allowed.
TABLE: list[tuple[str, dict[str, Any], str | None]] = [
    ("Read", {"file_path": "~/.ssh/id_ed25519"}, "read"),
    ("Read", {"file_path": "{home}/.kube/config"}, "read"),
    ("Read", {"file_path": "../../.kube/config"}, "read"),
    ("Read", {"file_path": "go.mod"}, None),
    ("Read", {"file_path": "{home}/projects/repo/go.mod"}, None),
    ("Read", {"file_path": "/etc/hosts"}, None),
    ("Grep", {"pattern": "x", "path": "{home}/.ssh"}, "read"),
    ("Grep", {"pattern": "x"}, None),
    ("Grep", {"pattern": "x", "path": "."}, None),
    ("Glob", {"pattern": "{home}/.ssh/*"}, "read"),
    ("Glob", {"pattern": "{home}/**/id_*"}, "read"),
    ("Glob", {"pattern": "../../.ssh/*"}, "read"),
    ("Glob", {"pattern": "*/../../../.ssh/*"}, "read"),
    ("Glob", {"pattern": "~/.aws/*"}, "read"),
    ("Glob", {"pattern": "**/*.go"}, None),
    ("Glob", {"pattern": "/etc/*.conf"}, None),
    ("Glob", {"pattern": "*.go", "path": "{home}/.kube"}, "read"),
    ("Write", {"file_path": "~/.bashrc", "content": "x"}, "write"),
    ("Write", {"file_path": "new/file.go", "content": "x"}, None),
    ("Write", {"file_path": "~/projects/other/x", "content": "x"}, "write"),
    ("Edit", {"file_path": "~/.claude/settings.json", "old_string": "a", "new_string": "b"}, "write"),
    ("Edit", {"file_path": "~/.claude/projects/p/memory/m.md", "old_string": "a", "new_string": "b"}, None),
    ("MultiEdit", {"file_path": "~/.profile", "edits": []}, "write"),
    ("NotebookEdit", {"notebook_path": "~/nb.ipynb", "new_source": "x"}, "write"),
    ("NotebookEdit", {"notebook_path": "nb.ipynb", "new_source": "x"}, None),
    ("Bash", {"command": "cat ~/.ssh/id_ed25519"}, None),
]


@pytest.mark.parametrize(("tool", "toolInput", "refused"), TABLE)
def test_file_tools_are_held_to_the_policy(
    configured: User, tool: str, toolInput: dict[str, Any], refused: str | None
) -> None:
    given = {k: v.replace("{home}", str(configured.home)) if isinstance(v, str) else v for k, v in toolInput.items()}
    result = run(configured, ev(configured, tool, **given))
    if refused is None:
        assert result is None
        return
    text = reason(result)
    assert f"agentsandbox refused to {refused} " in text
    assert f"sandbox.{refused}" in text
    assert str(configured.configFile) in text


def test_the_reason_names_the_path_as_given(configured: User) -> None:
    text = reason(run(configured, ev(configured, "Read", file_path="~/.ssh/id_ed25519")))
    assert text.startswith("agentsandbox refused to read ~/.ssh/id_ed25519: ")


def test_grep_without_path_in_home_is_refused(configured: User) -> None:
    text = reason(run(configured, ev(configured, "Grep", cwd=str(configured.home), pattern="x")))
    assert f"refused to read {configured.home}:" in text


def test_a_relative_glob_names_its_pattern(configured: User) -> None:
    text = reason(run(configured, ev(configured, "Glob", pattern="../../.ssh/*")))
    assert "refused to read ../../.ssh/*:" in text


def test_a_denied_path_names_the_deny_entry(user: User) -> None:
    user.writeConfig('[sandbox]\nwrite = ["~/work"]\ndeny = ["~/work/scan"]\n')
    text = reason(run(user, ev(user, "Read", cwd=user.h("work"), file_path="scan/key")))
    assert f"inside {user.home}/work/scan, which sandbox.deny closes both ways" in text


@pytest.mark.parametrize(
    ("pattern", "base", "root"),
    [
        ("/home/u/.ssh/*", "/x", "/home/u/.ssh"),
        ("/home/u/**/id_*", "/x", "/home/u"),
        # No wildcard: ripgrep walks the dirname for the basename (measured).
        ("/etc/os-release", "/x", "/etc"),
        ("/*", "/x", "/"),
        ("../../.ssh/*", "/home/u/p/r", "/home/u/.ssh"),
        ("*.go", "/home/u/p", "/home/u/p"),
        ("src/**/x", "/home/u/p", "/home/u/p/src"),
        ("*/../../x/*", "/home/u/p", "/home/u"),
        ("**/../../../*", "/home/u/p", "/"),
        ("./*/../x", "/home/u/p", "/home/u/p"),
        ("a/{b,c}/*", "/w", "/w/a"),
        ("a/[xy]/*", "/w", "/w/a"),
    ],
)
def test_glob_root(pattern: str, base: str, root: str) -> None:
    assert hook.globRoot(pattern, base) == root


BAD_INPUT: list[tuple[bytes, str]] = [
    (b"", "agentsandbox refused this call: the hook's input is empty"),
    (b"   \n", "agentsandbox refused this call: the hook's input is empty"),
    (b"{not json", "agentsandbox refused this call: the hook's input is not JSON (Expecting property name"),
    (b"\xff\xfe", "agentsandbox refused this call: the hook's input is not JSON ("),
    (b"[]", "agentsandbox refused this call: the hook's input is not a JSON object"),
    (b'"Read"', "agentsandbox refused this call: the hook's input is not a JSON object"),
    (b"{}", "agentsandbox refused this call: the hook's input has no tool_name"),
    (b'{"tool_name": 3}', "agentsandbox refused this call: the hook's input has no tool_name"),
    (b'{"tool_name": "Read", "cwd": "/"}', "agentsandbox refused this Read call: tool_input is missing"),
    (b'{"tool_name": "Read", "tool_input": [], "cwd": "/"}', "agentsandbox refused this Read call: tool_input is missing"),
    (b'{"tool_name": "Read", "tool_input": {"file_path": "/etc/hosts"}}', "agentsandbox refused this call: cwd is not a string"),
    (b'{"tool_name": "Read", "tool_input": {"file_path": "/etc/hosts"}, "cwd": "rel"}', "agentsandbox refused this Read call: cwd 'rel' is not absolute"),
    (b'{"tool_name": "Read", "tool_input": {}, "cwd": "/"}', "agentsandbox refused this call: tool_input.file_path is not a string"),
    (b'{"tool_name": "Read", "tool_input": {"file_path": 7}, "cwd": "/"}', "agentsandbox refused this call: tool_input.file_path is not a string"),
    (b'{"tool_name": "Read", "tool_input": {"file_path": ""}, "cwd": "/"}', "agentsandbox refused this Read call: tool_input.file_path is empty"),
    (b'{"tool_name": "Read", "tool_input": {"file_path": "/etc/hosts\\u0000x"}, "cwd": "/"}', "agentsandbox refused this call: tool_input.file_path contains a NUL byte"),
    (b'{"tool_name": "Write", "tool_input": {"file_path": null}, "cwd": "/"}', "agentsandbox refused this call: tool_input.file_path is not a string"),
    (b'{"tool_name": "NotebookEdit", "tool_input": {"file_path": "/tmp/x"}, "cwd": "/"}', "agentsandbox refused this call: tool_input.notebook_path is not a string"),
    (b'{"tool_name": "Grep", "tool_input": {"path": ["/"]}, "cwd": "/"}', "agentsandbox refused this call: tool_input.path is not a string"),
    (b'{"tool_name": "Glob", "tool_input": {}, "cwd": "/"}', "agentsandbox refused this call: tool_input.pattern is not a string"),
    (b"{" + b'"a":' * 0 + b'"tool_name": "Read", "tool_input": {"file_path": "/x"}, "cwd": "/"' + b" " * (1024 * 1024) + b"}", "agentsandbox refused this call: the hook's input is over 1048576 bytes"),
]


@pytest.mark.parametrize(("raw", "expected"), BAD_INPUT)
def test_bad_input_is_refused_with_a_reason(configured: User, raw: bytes, expected: str) -> None:
    assert reason(run(configured, None, raw=raw)).startswith(expected)


def test_deep_nesting_does_not_escape(configured: User) -> None:
    raw = b"[" * 100000 + b"]" * 100000
    assert "agentsandbox refused this call" in reason(run(configured, None, raw=raw))


def test_an_unloadable_config_refuses_every_file_tool(user: User) -> None:
    user.writeConfig("[sandbox]\nreed = []\n")
    text = reason(run(user, ev(user, "Read", file_path="go.mod")))
    assert "config cannot be loaded" in text
    assert "sandbox.reed: unknown key" in text
    # Bash and other tools are left to the sandbox and the permission rules.
    assert run(user, ev(user, "Bash", command="ls")) is None


def test_a_missing_explicit_config_refuses(user: User) -> None:
    user.env["AGENTSANDBOX_CONFIG"] = str(user.base / "nope.toml")
    assert "cannot read the config" in reason(run(user, ev(user, "Read", file_path="go.mod")))


# --------------------------------------------------------------------------- the cache


def test_the_cache_follows_config_changes(configured: User) -> None:
    e = ev(configured, "Read", file_path="~/notes/a.txt")
    assert run(configured, e) is not None
    cache = configured.home / ".local/state/agentsandbox/policy-cache.json"
    assert cache.exists() and cache.stat().st_mode & 0o777 == 0o600
    time.sleep(0.01)
    configured.writeConfig('[sandbox]\nread = ["~/projects", "~/notes"]\n')
    assert run(configured, e) is None
    configured.writeConfig("[sandbox]\nbroken =\n")
    assert "config cannot be loaded" in reason(run(configured, e))


def test_a_forged_cache_is_ignored_when_sessions_could_write_it(user: User) -> None:
    user.writeConfig('[sandbox]\nwrite = ["~/.local/state"]\n')
    policy, _ = cachedPolicy(user.env)
    cache = user.home / ".local/state/agentsandbox/policy-cache.json"
    assert not cache.exists(), "a cache sessions could write is never written"
    from agentsandbox.hook import _cacheKey

    forged = dict(policy.toDict(), read=[str(user.home)])
    cache.write_text(json.dumps({"key": _cacheKey(user.env), "source": "x", "policy": forged}))
    cache.chmod(0o600)
    assert run(user, ev(user, "Read", file_path="~/.ssh/id_ed25519")) is not None


def test_a_group_writable_cache_is_ignored(configured: User) -> None:
    from agentsandbox.hook import _cacheKey

    policy, _ = cachedPolicy(configured.env)
    cache = configured.home / ".local/state/agentsandbox/policy-cache.json"
    forged = dict(policy.toDict(), read=[str(configured.home)])
    cache.write_text(json.dumps({"key": _cacheKey(configured.env), "source": "x", "policy": forged}))
    cache.chmod(0o620)
    assert run(configured, ev(configured, "Read", file_path="~/.ssh/id_ed25519")) is not None
    # The refused cache was replaced by the real policy; a private forgery is trusted,
    # which shows the mode check above is what refused it.
    cache.write_text(json.dumps({"key": _cacheKey(configured.env), "source": "x", "policy": forged}))
    cache.chmod(0o600)
    assert run(configured, ev(configured, "Read", file_path="~/.ssh/id_ed25519")) is None, "sanity: the forgery works when trusted"


def test_a_garbage_cache_falls_back_to_the_config(configured: User) -> None:
    cache = configured.home / ".local/state/agentsandbox/policy-cache.json"
    for junk in ("", "{", "[]", '{"key": 1}', '{"key": null, "policy": {}}'):
        cache.write_text(junk)
        assert run(configured, ev(configured, "Read", file_path="~/.ssh/x")) is not None
        assert run(configured, ev(configured, "Read", file_path="go.mod")) is None


# --------------------------------------------------------------------------- the real command


def command(user: User, args: list[str], stdin: bytes) -> subprocess.CompletedProcess[bytes]:
    env = dict(user.env, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "agentsandbox", "hook", *args],
        input=stdin,
        capture_output=True,
        env=env,
        timeout=30,
    )


@pytest.mark.parametrize("raw", [b"", b"{", b"\x00" * 10, json.dumps({"tool_name": "Read"}).encode()])
def test_the_command_always_exits_0_with_valid_json(configured: User, raw: bytes) -> None:
    p = command(configured, ["pretooluse"], raw)
    assert p.returncode == 0
    assert p.stderr == b""
    assert json.loads(p.stdout)["hookSpecificOutput"]["permissionDecision"] == "deny"


def test_the_command_allows_with_no_output(configured: User) -> None:
    p = command(configured, ["pretooluse"], json.dumps(ev(configured, "Read", file_path="go.mod")).encode())
    assert (p.returncode, p.stdout, p.stderr) == (0, b"", b"")


def test_the_command_imports_no_twisted(configured: User) -> None:
    code = (
        "import io,json,os,sys; from agentsandbox import hook;"
        "hook.pretooluse(io.BytesIO(sys.argv[1].encode()), os.environ);"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('twisted','dataclasses','tomllib','typing'))))"
    )
    e = json.dumps(ev(configured, "Read", file_path="go.mod"))
    env = dict(configured.env, PYTHONPATH=str(REPO))
    subprocess.run([sys.executable, "-c", code, e], env=env, check=True, capture_output=True)
    out = subprocess.run([sys.executable, "-c", code, e], env=env, check=True, capture_output=True, text=True)
    assert json.loads(out.stdout) == [], "the cached path must not import these"


# --------------------------------------------------------------------------- session start

CREDENTIALS = {
    "GH_TOKEN": "canary-gh",
    "ANTHROPIC_API_KEY": "canary-anthropic",
    "AWS_SECRET_ACCESS_KEY": "canary-aws",
    "MY_SERVICE_TOKEN": "canary-svc",
    "DB_PASSWORD": "canary-db",
    "SSH_AUTH_SOCK": "/run/ssh.sock",
}


def sessionStart(user: User, envFile: Path | None) -> tuple[str, list[str]]:
    env = dict(user.env, **CREDENTIALS, KEEP_ME_TOKEN="kept", EDITOR="vi")
    if envFile is not None:
        env["CLAUDE_ENV_FILE"] = str(envFile)
    out = hook.sessionstart(env)
    lines = envFile.read_text().splitlines() if envFile is not None and envFile.exists() else []
    return out, lines


def test_sessionstart_exports_and_unsets(user: User, tmp_path: Path) -> None:
    user.writeConfig('[sandbox]\nkeep_env = ["KEEP_ME_*"]\n')
    out, lines = sessionStart(user, tmp_path / "env.sh")
    assert f"export AGENTSANDBOX_SPOOL={user.home}/.local/state/agentsandbox/spool" in lines
    assert "export AGENTSANDBOX=1" in lines
    for name in CREDENTIALS:
        assert f"unset {name}" in lines, name
    assert "unset KEEP_ME_TOKEN" not in lines
    egress = user.runtime / "agentsandbox/egress"
    assert f"export SSL_CERT_FILE={egress}/bundle.pem" in lines
    assert f"export GH_CONFIG_DIR={egress}/gh" in lines
    exported = dict(line[len("export ") :].split("=", 1) for line in lines if line.startswith("export "))
    pairs = {
        exported[f"GIT_CONFIG_KEY_{i}"]: exported[f"GIT_CONFIG_VALUE_{i}"]
        for i in range(int(exported["GIT_CONFIG_COUNT"]))
    }
    assert pairs["gpg.program"] == f"{egress}/gpg"
    assert pairs["gpg.ssh.program"] == f"{egress}/ssh-sign"
    assert pairs["url.https://github.com/.insteadOf"] in ("git@github.com:", "ssh://git@github.com/")
    assert "unset EDITOR" not in lines
    text = "\n".join(lines)
    for value in CREDENTIALS.values():
        assert value not in text
    # Not installed in this fixture: the user is told what to run.
    assert "agentsandbox install" in json.loads(out)["systemMessage"]


def test_sessionstart_export_lines_run_in_a_shell(user: User, tmp_path: Path) -> None:
    user.writeConfig("")
    envFile = tmp_path / "env.sh"
    sessionStart(user, envFile)
    env = dict(CREDENTIALS, PATH="/usr/bin:/bin")
    out = subprocess.run(["sh", "-c", f". {envFile}; env"], env=env, capture_output=True, text=True, check=True)
    for name in CREDENTIALS:
        assert f"{name}=" not in out.stdout
    assert "AGENTSANDBOX=1" in out.stdout


def test_sessionstart_narrows_no_proxy_to_the_loopback_not_listed(user: User, tmp_path: Path) -> None:
    # The sandbox's own NO_PROXY (set before the file is sourced) sends a listed
    # 127.0.0.1:PORT direct into the sandbox's empty loopback; the file's export wins.
    user.writeConfig('[sandbox]\ndomains = ["127.0.0.1:6443", "10.0.0.0/8"]\n')
    envFile = tmp_path / "env.sh"
    sessionStart(user, envFile)
    sandboxOwn = "localhost,127.0.0.1,::1,169.254.0.0/16,10.0.0.0/8,172.16.0.0/12,192.168.0.0/16"
    env = {"PATH": "/usr/bin:/bin", "NO_PROXY": sandboxOwn, "no_proxy": sandboxOwn}
    out = subprocess.run(["sh", "-c", f". {envFile}; env"], env=env, capture_output=True, text=True, check=True)
    assert "NO_PROXY=localhost,::1" in out.stdout.splitlines()
    assert "no_proxy=localhost,::1" in out.stdout.splitlines()


def test_sessionstart_says_nothing_when_the_drop_in_is_current(user: User, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    user.writeConfig("")
    managed = tmp_path / "managed"
    claude.install(claude.machinePolicy(user.env), str(managed))
    monkeypatch.setattr("agentsandbox.claude.managedDir", lambda: str(managed))
    out, lines = sessionStart(user, tmp_path / "env.sh")
    assert out == ""
    assert lines


def test_sessionstart_says_loudly_that_the_machine_only_observes(user: User, machineFile: MachineConfig, tmp_path: Path) -> None:
    machineFile.write('[proxy]\nunlisted = "observe"\n')
    user.writeConfig("")
    out, _ = sessionStart(user, tmp_path / "env.sh")
    assert hook.OBSERVING in json.loads(out)["systemMessage"]
    assert "OBSERVING, NOT ENFORCING" in hook.OBSERVING


def test_sessionstart_with_a_broken_config_still_unsets(user: User, tmp_path: Path) -> None:
    user.writeConfig("[sandbox\n")
    out, lines = sessionStart(user, tmp_path / "env.sh")
    assert "unset GH_TOKEN" in lines
    assert "config cannot be loaded" in json.loads(out)["systemMessage"]


def test_sessionstart_without_an_env_file_warns(user: User) -> None:
    user.writeConfig("")
    out, _ = sessionStart(user, None)
    assert "CLAUDE_ENV_FILE is not set" in json.loads(out)["systemMessage"]


def test_sessionstart_refuses_a_symlinked_env_file(user: User, tmp_path: Path) -> None:
    user.writeConfig("")
    target = tmp_path / "elsewhere"
    link = tmp_path / "env.sh"
    link.symlink_to(target)
    out, _ = sessionStart(user, link)
    assert "failed" in json.loads(out)["systemMessage"]
    assert not target.exists()


def test_unknown_hook_arguments(user: User) -> None:
    p = command(user, ["bogus"], b"")
    assert p.returncode == 2 and b"usage" in p.stderr
    p = command(user, ["pretooluse", "extra"], b"{}")
    assert p.returncode == 0
    assert json.loads(p.stdout)["hookSpecificOutput"]["permissionDecision"] == "deny"
