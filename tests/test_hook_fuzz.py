"""The PreToolUse hook on arbitrary input: exit 0 and a valid allow or deny, every time.

Runs the real entry point, ``hook.main(["pretooluse"])``, in-process with
stdin, stdout and the environment replaced (the bulk), and a sample through
``python -m agentsandbox hook pretooluse``.  Besides "never crash", every call
whose path, read as Claude Code reads it, touches a closed directory must be
denied; the oracle for that is written here, apart from the hook's own code.
"""

from __future__ import annotations

import io
import json
import os
import posixpath
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentsandbox import hook
from agentsandbox.policy import Policy
from tests.conftest import User
from tests.test_hook_paths import JS_SPACES, PACKAGE_ROOT

FILE_TOOLS = {"Read": "file_path", "Edit": "file_path", "MultiEdit": "file_path", "Write": "file_path",
              "NotebookEdit": "notebook_path", "Grep": "path", "Glob": "pattern"}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[User]:
    """One fixture user for every example (hypothesis reuses it)."""
    base = tmp_path_factory.mktemp("fuzz").resolve()
    home = base / "home"
    for d in ("projects/repo", "private", ".ssh"):
        (home / d).mkdir(parents=True)
    (home / "private/notes.txt").write_text("PRIVATE-MARKER\n")
    (home / "projects/repo/link").symlink_to(home / "projects")
    runtime = base / "run/user/1000"
    runtime.mkdir(parents=True)
    (base / "tmp").mkdir()
    env = {"HOME": str(home), "TMPDIR": str(base / "tmp"), "XDG_RUNTIME_DIR": str(runtime),
           "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    user = User(base=base, home=home, runtime=runtime, tmp=base / "tmp", env=env)
    user.writeConfig('[sandbox]\nread = ["~/projects"]\n')
    yield user


def runMain(user: User, stdin: bytes) -> tuple[int, bytes]:
    """``hook.main(["pretooluse"])`` with this stdin and the user's environment."""
    out = io.BytesIO()
    stdout = io.TextIOWrapper(out, encoding="ascii", errors="strict")
    stdinWrapper = io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8")
    with (mock.patch.dict(os.environ, user.env, clear=True), mock.patch.object(sys, "stdin", stdinWrapper),
          mock.patch.object(sys, "stdout", stdout),
          mock.patch.object(hook, "_lastResort", side_effect=AssertionError("the last resort fired"))):
        status = hook.main(["pretooluse"])
        stdout.flush()
    return status, out.getvalue()


def checkOutput(stdout: bytes) -> str | None:
    """None for an allow (no output), else the deny's reason; fails on anything else."""
    if stdout == b"":
        return None
    text = stdout.decode("ascii")
    assert text.endswith("\n") and text.count("\n") == 1, text
    parsed = json.loads(text)
    assert set(parsed) == {"hookSpecificOutput"}
    spec = parsed["hookSpecificOutput"]
    assert spec["hookEventName"] == "PreToolUse" and spec["permissionDecision"] == "deny", spec
    reason = spec["permissionDecisionReason"]
    assert isinstance(reason, str) and reason.startswith("agentsandbox refused"), reason
    return reason


# --------------------------------------------------------------------------- strategies

SURROGATES = st.integers(0xD800, 0xDFFF).map(chr)
ODD = st.sampled_from([*JS_SPACES, "\0", "\u202e", "\u200f", "\u0301", "\u0085", "\u180e", "\u200b",
                       "\ufffd", "\u212a", "\uff0f", "\u2215", "/", ".", "~", "*", "?", "[", "{", "\\"])
CHARS = st.one_of(st.characters(), SURROGATES, ODD)
SEGMENT = st.one_of(
    st.text(CHARS, max_size=12),
    st.sampled_from(["", ".", "..", "~", "private", "notes.txt", "projects", "repo", "link", "*", "**",
                     "proc", "self", "root", "cwd", "fd", "dev", "0", "environ", "\u0440rivate"]),
)


@st.composite
def paths(draw: st.DrawFn, home: str) -> str:
    """Path spellings: ~ forms, home prefixes, /proc and /dev/fd, odd characters, long ones."""
    prefix = draw(st.sampled_from(["", "/", "~/", "~", home + "/", home + "/projects/repo/link/../",
                                   "/proc/self/root" + home + "/", "/proc/self/cwd/", "/dev/fd/", "//",
                                   "./", "../../", home + "/private/\ud800/../"]))
    parts = draw(st.lists(SEGMENT, max_size=6))
    path = prefix + "/".join(parts)
    if draw(st.integers(0, 40)) == 0:
        # 64 KiB: each component costs the hook an lstat, so these are rare.
        path += "a/" * draw(st.sampled_from([10, 32 * 1024]))
    pad = draw(st.sampled_from(["", *JS_SPACES[:3], "\ufeff", "\u3000", "\u2028"]))
    return pad + path + draw(st.sampled_from(["", pad, "/"]))


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(CHARS, max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(CHARS, max_size=10), inner, max_size=4),
    max_leaves=12,
)
#: What a field may hold: mostly a path, sometimes any JSON value or nothing.
MISSING = object()


def events(home: str, cwd: str) -> st.SearchStrategy[dict[str, Any]]:
    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        tool = draw(st.sampled_from([*FILE_TOOLS, "Bash", "", "read"]))
        toolInput: dict[str, Any] = {}
        for field in ("file_path", "notebook_path", "path", "pattern", "content"):
            value = draw(st.one_of(paths(home), paths(home), JSON, st.just(MISSING)))
            if value is not MISSING:
                toolInput[field] = value
        event: dict[str, Any] = {"hook_event_name": "PreToolUse", "tool_name": tool,
                                 "cwd": draw(st.sampled_from([cwd, cwd, home, "/", "rel", 7, None]))}
        event["tool_input"] = draw(st.one_of(st.just(toolInput), st.just(toolInput), JSON))
        return event

    return build()


# --------------------------------------------------------------------------- the oracle


def claudeCodeReadings(raw: str, cwd: str, home: str) -> list[str]:
    """How Claude Code's expandPath reads ``raw``, then the kernel: a separate model."""
    text = raw.strip("".join(JS_SPACES))
    if not text:
        joined = cwd
    elif text == "~" or text.startswith("~/"):
        joined = home + text[1:]
    else:
        joined = posixpath.join(cwd, text)
    joined = "".join("\ufffd" if 0xD800 <= ord(c) <= 0xDFFF else c for c in joined)
    return [posixpath.normpath(joined), os.path.realpath(joined)]


def mustDeny(policy: Policy, event: dict[str, Any], home: str) -> bool:
    """Whether ``event`` is a file-tool call whose path Claude Code reads as closed."""
    tool, toolInput, cwd = event["tool_name"], event.get("tool_input"), event["cwd"]
    if tool not in FILE_TOOLS or not isinstance(toolInput, dict) or not isinstance(cwd, str):
        return tool in FILE_TOOLS
    if not cwd.startswith("/"):
        return True
    field = FILE_TOOLS[tool]
    raw = toolInput.get(field)
    if tool == "Grep" and raw in (None, ""):
        raw = cwd
    if tool == "Glob":
        return False  # roots are checked by test_glob_into_a_closed_dir_is_denied
    if not isinstance(raw, str) or "\0" in raw or raw == "":
        return True
    mode = "read" if tool == "Grep" or tool == "Read" else "write"
    for reading in claudeCodeReadings(raw, cwd, home):
        allowed = policy.whyReadable(reading, cwd) if mode == "read" else policy.whyWritable(reading, cwd)
        if allowed is None or (tool == "Grep" and policy.closedBelow(reading, cwd) is not None):
            return True
    return False


FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                         HealthCheck.data_too_large])


@given(data=st.data())
@FUZZ
def test_any_event_gets_exit_0_and_a_valid_answer(world: User, data: st.DataObject) -> None:
    home, cwd = str(world.home), str(world.home / "projects/repo")
    event = data.draw(events(home, cwd))
    encoded = json.dumps(event, ensure_ascii=data.draw(st.booleans())).encode("utf-8", "surrogatepass")
    status, stdout = runMain(world, encoded)
    assert status == 0
    reason = checkOutput(stdout)
    if reason is None:
        from agentsandbox.hook import cachedPolicy

        policy, _ = cachedPolicy(world.env)
        assert not mustDeny(policy, event, home), f"allowed {event!r}"


@given(value=JSON)
@FUZZ
def test_any_json_value_gets_a_valid_answer(world: User, value: Any) -> None:
    status, stdout = runMain(world, json.dumps(value).encode())
    assert status == 0
    checkOutput(stdout)


@given(raw=st.binary(max_size=200))
@FUZZ
def test_any_bytes_get_a_valid_answer(world: User, raw: bytes) -> None:
    status, stdout = runMain(world, raw)
    assert status == 0
    checkOutput(stdout)


@given(data=st.data())
@FUZZ
def test_glob_into_a_closed_dir_is_denied(world: User, data: st.DataObject) -> None:
    home = str(world.home)
    closed = data.draw(st.sampled_from([f"{home}/private", f"{home}/.ssh", home, str(world.runtime),
                                        f"{home}/projects/repo/link/../private",
                                        f"/proc/self/root{home}/private", f"/proc/self/root/../..{home}/private",
                                        "/proc/self", "~/private", "/"]))
    tail = data.draw(st.sampled_from(["*", "**/*", "notes.txt", "*.txt", "**", "[a-z]*", "{a,b}/*", "n?tes.txt"]))
    pad = data.draw(st.sampled_from(["", " ", "\ufeff", "\u3000"]))
    event = {"tool_name": "Glob", "cwd": f"{home}/projects/repo", "tool_input": {"pattern": pad + closed + "/" + tail}}
    status, stdout = runMain(world, json.dumps(event).encode())
    assert status == 0
    assert checkOutput(stdout) is not None, event


# --------------------------------------------------------------------------- the real command


def command(user: User, stdin: bytes, **kw: Any) -> subprocess.CompletedProcess[bytes]:
    env = dict(user.env, PYTHONPATH=PACKAGE_ROOT)
    return subprocess.run([sys.executable, "-m", "agentsandbox", "hook", "pretooluse"], input=stdin,
                          capture_output=True, env=env, timeout=60, **kw)


@given(data=st.data())
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_the_command_on_generated_events(world: User, data: st.DataObject) -> None:
    home, cwd = str(world.home), str(world.home / "projects/repo")
    event = data.draw(events(home, cwd))
    p = command(world, json.dumps(event).encode())
    assert (p.returncode, p.stderr) == (0, b""), p
    checkOutput(p.stdout)


@pytest.mark.parametrize(("raw", "denied"), [
    (b"", True),
    (b"\0", True),
    (b'{"tool_name":"Read","cwd":"/","tool_input":{"file_path":"/x\\ud800"}}', False),
    (b'{"tool_name":"Read","cwd":"/","tool_input":{"file_path":"~/private/\\ud800/../notes.txt"}}', True),
    (b'{"tool_name":"Grep","cwd":"/","tool_input":{"pattern":"x","path":"\\udfff\\ud800"}}', False),
    (b'{"tool_name":"Write","cwd":"\\ud800","tool_input":{"file_path":1e999}}', True),
    (b'{"tool_name":"Glob","cwd":"/","tool_input":{"pattern":"/' + b"a/" * 32768 + b'*"}}', False),
    (b'{"tool_name":"Glob","cwd":"/","tool_input":{"pattern":"~/' + b"a/../" * 13000 + b'*"}}', True),
])
def test_the_command_on_hostile_bytes(world: User, raw: bytes, denied: bool) -> None:
    p = command(world, raw)
    assert (p.returncode, p.stderr) == (0, b""), p
    assert (checkOutput(p.stdout) is not None) == denied


def test_the_last_resort_is_a_valid_deny(world: User, capfdbinary: pytest.CaptureFixture[bytes]) -> None:
    def broken(*args: object) -> str:
        raise MemoryError

    with mock.patch.object(hook, "pretooluse", broken):
        assert hook.main(["pretooluse"]) == 0
    out = capfdbinary.readouterr().out
    assert out == hook.LAST_RESORT
    assert checkOutput(out) is not None


def test_a_closed_stdout_still_exits_0(world: User, tmp_path: Path) -> None:
    event = json.dumps({"tool_name": "Read", "cwd": "/", "tool_input": {"file_path": "~/.ssh/id"}}).encode()
    env = dict(world.env, PYTHONPATH=PACKAGE_ROOT)
    p = subprocess.run([sys.executable, "-m", "agentsandbox", "hook", "pretooluse"], input=event,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, timeout=60,
                       preexec_fn=lambda: os.close(1))
    assert (p.returncode, p.stderr) == (0, b"")
