"""What each file tool touches, read as Claude Code reads it (docs/hook.md).

The three hook reproductions of issue 10 come first: each decides through
``hook.pretooluse`` or the real command only, so it runs unchanged against an
older hook (which it fails).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import agentsandbox
from agentsandbox import hook
from tests.conftest import User, hookDecision

#: Where the imported package lives: the command under test is that one.
PACKAGE_ROOT = str(Path(agentsandbox.__file__).resolve().parent.parent)

#: JavaScript's trim set, spelled out; Python's str.strip() gets three wrong.
JS_SPACES = ["\t", "\n", "\v", "\f", "\r", " ", "\xa0", "\u1680", *map(chr, range(0x2000, 0x200B)),
             "\u2028", "\u2029", "\u202f", "\u205f", "\u3000", "\ufeff"]


@pytest.fixture
def home(user: User) -> User:
    """~/projects readable, ~/private closed and holding a marker, a link the session could make."""
    user.writeConfig('[sandbox]\nread = ["~/projects"]\nwrite = ["~/go/pkg/mod"]\n')
    (user.home / "private").mkdir()
    (user.home / "private/notes.txt").write_text("PRIVATE-MARKER\n")
    # In the project, where sandboxed Bash may write: link/.. is ~/projects
    # to the kernel, but the project itself to a lexical reading.
    (user.home / "projects/repo/link").symlink_to(user.home / "projects/other")
    return user


decision = hookDecision


def command(user: User, stdin: bytes) -> subprocess.CompletedProcess[bytes]:
    env = dict(user.env, PYTHONPATH=PACKAGE_ROOT)
    return subprocess.run([sys.executable, "-m", "agentsandbox", "hook", "pretooluse"],
                          input=stdin, capture_output=True, env=env, timeout=60)


# --------------------------------------------------------------------------- reproductions


@pytest.mark.parametrize("space", JS_SPACES, ids=[f"U+{ord(c):04X}" for c in JS_SPACES])
def test_repro_1_grep_and_glob_path_is_trimmed_as_javascript_does(home: User, space: str) -> None:
    private = home.h("private")
    for spelled in (space + private, private + space, f"{space}{space}{private}{space}"):
        assert decision(home, "Grep", pattern="x", path=spelled) is not None, repr(spelled)
        assert decision(home, "Glob", pattern="*", path=spelled) is not None, repr(spelled)
    assert decision(home, "Grep", pattern="x", path=f"{space}~/private") is not None


def test_repro_1_the_reason_shows_the_whitespace(home: User) -> None:
    text = decision(home, "Grep", pattern="x", path=" " + home.h("private"))
    assert text is not None
    assert text.startswith(f"agentsandbox refused to read ' {home.h('private')}' (read as {home.h('private')}):")


def test_repro_2_glob_through_proc_self_root_then_dotdot(home: User) -> None:
    pattern = f"/proc/self/root/../..{home.home}/private/*"
    assert decision(home, "Glob", pattern=pattern) is not None


def test_repro_2_glob_through_a_project_link_then_dotdot(home: User) -> None:
    # Lexically project/private (readable, under ~/projects); the kernel reads
    # link/.. as ~/projects, so ../private is ~/private.
    pattern = home.h("projects/repo/link/../../private/*")
    text = decision(home, "Glob", pattern=pattern)
    assert text is not None
    assert f"which the file system resolves, links before '..', to {home.h('private')}" in text
    assert decision(home, "Glob", pattern=home.h("projects/repo/link/../../private/notes.txt")) is not None


def test_repro_3_a_lone_surrogate_never_crashes_the_command(home: User) -> None:
    # json.dumps would escape the backslash: the surrogate escape is written by hand.
    raw = b'{"tool_name":"Read","cwd":"/","tool_input":{"file_path":"HOME/\\ud800"}}'
    raw = raw.replace(b"HOME", bytes(home.home))
    p = command(home, raw)
    assert (p.returncode, p.stderr) == (0, b"")
    assert json.loads(p.stdout)["hookSpecificOutput"]["permissionDecision"] == "deny"
    p.stdout.decode("ascii")
    grep = b'{"tool_name":"Grep","cwd":"/","tool_input":{"pattern":"x","path":"HOME/private/\\ud800/.."}}'
    grep = grep.replace(b"HOME", bytes(home.home))
    p = command(home, grep)
    assert (p.returncode, p.stderr) == (0, b"")
    spec = json.loads(p.stdout)["hookSpecificOutput"]
    assert spec["permissionDecision"] == "deny"
    assert "refused to read" in spec["permissionDecisionReason"], "decided on the path, not a crash"


@pytest.fixture
def startedInHome(home: User) -> User:
    """Claude Code started in home (its own cwd), the session's Bash moved into the project.

    ~/private/notes.txt is closed; the project holds links whose meaning depends
    on the process that reads them.
    """
    project = home.home / "projects/repo"
    (project / "private").mkdir()
    (project / "private/notes.txt").write_text("harmless\n")
    for name, target in (("l-cwd", "/proc/self/cwd"), ("l-thread", "/proc/thread-self/cwd"),
                         ("l-proc", "/proc"), ("l-fd", "/dev/fd"), ("l-rel", "l-cwd")):
        (project / name).symlink_to(target)
    return home


def test_repro_4_a_project_link_to_proc_self_cwd_is_refused(startedInHome: User) -> None:
    """Issue 23, 4: the hook resolved the link in its own process (cwd = the project).

    Claude Code opens P/l-cwd/private/notes.txt in its own process, whose cwd is
    where it started (home): ~/private/notes.txt.  Run as the real command too,
    in the project's directory, as Claude Code runs hooks.
    """
    user = startedInHome
    project = user.h("projects/repo")
    for link in ("l-cwd", "l-thread", "l-rel", "l-proc/self/cwd", "l-fd/3"):
        read = decision(user, "Read", cwd=project, file_path=f"{project}/{link}/private/notes.txt")
        assert read is not None and ("inside /proc" in read or "inside /dev/fd" in read), (link, read)
        assert decision(user, "Glob", cwd=project, pattern=f"{project}/{link}/private/*") is not None, link
        assert decision(user, "Grep", cwd=project, pattern="x", path=f"{project}/{link}/private") is not None, link
        assert decision(user, "Write", cwd=project, file_path=f"{project}/{link}/private/new.txt",
                        content="x") is not None, link
        assert decision(user, "Read", cwd=project, file_path=f"{link}/private/notes.txt") is not None, link
    event = {"tool_name": "Read", "cwd": project,
             "tool_input": {"file_path": f"{project}/l-cwd/private/notes.txt"}}
    p = subprocess.run([sys.executable, "-m", "agentsandbox", "hook", "pretooluse"], cwd=project,
                       input=json.dumps(event).encode(), capture_output=True, timeout=60,
                       env=dict(user.env, PYTHONPATH=PACKAGE_ROOT))
    assert (p.returncode, p.stderr) == (0, b"")
    reason = json.loads(p.stdout)["hookSpecificOutput"]["permissionDecisionReason"]
    assert "a link to /proc/self/cwd/private/notes.txt" in reason and "inside /proc" in reason
    # The project's own files stay open: only the process-relative link is refused.
    assert decision(user, "Read", cwd=project, file_path=f"{project}/private/notes.txt") is None
    assert decision(user, "Glob", cwd=project, pattern="private/*") is None


# --------------------------------------------------------------------------- each tool's expansion


def test_js_whitespace_is_what_node_trims() -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed (.ci/install-deps installs it)")
    script = ('let o=[];for(let c=0;c<=0xffff;c++){const s=String.fromCharCode(c);'
              'if(("a"+s).trim()==="a"&&(s+"a").trim()==="a")o.push(c)}console.log(JSON.stringify(o))')
    out = subprocess.run([node, "-e", script], capture_output=True, text=True, check=True, timeout=60)
    assert [chr(c) for c in json.loads(out.stdout)] == sorted(hook.JS_WHITESPACE)
    assert sorted(hook.JS_WHITESPACE) == sorted(JS_SPACES)


def _expandInNode(cases: list[tuple[str, str, str]]) -> list[str]:
    """Claude Code's expandPath (as measured: trim, ~, path.resolve) on node's own path module."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed (.ci/install-deps installs it)")
    script = (
        'const p=require("path");const cases=JSON.parse(require("fs").readFileSync(0,"utf8"));'
        'console.log(JSON.stringify(cases.map(([e,cwd,home])=>{const r=e.trim();'
        'if(!r)return p.normalize(cwd);if(r==="~")return home;'
        'if(r.startsWith("~/"))return p.join(home,r.slice(2));'
        'return p.isAbsolute(r)?p.normalize(r):p.resolve(cwd,r)})))'
    )
    out = subprocess.run([node, "-e", script], input=json.dumps(cases), capture_output=True,
                         text=True, check=True, timeout=60)
    results: list[str] = json.loads(out.stdout)
    return results


SPELLINGS = [
    "a", "./a", "a/./b", "a//b", "a/../b", "../../x", "/abs", "//abs", "///abs//x/", "/a/b/../..",
    "/..", "~", "~/", "~/x", "~/../x", "~x", "~/x/../../y", " ~/x", "~ /x", "x/", ".", "..",
    "\u3000/abs\ufeff", "\t\n~/k\u2028", "\xa0", "", "   ", "a\u0085", "\u180e/abs", "/a/\u200b/..",
    "e\u0301", "\u00e9", "/a/./b/./", "a\\b", "/a/b/c/../../../../..",
]


def test_expand_path_agrees_with_node() -> None:
    cases = [(s, cwd, home) for s in SPELLINGS for cwd, home in (("/w/p", "/h/u"), ("/", "/h/u/"))]
    expected = _expandInNode(cases)
    for (raw, cwd, home), node in zip(cases, expected, strict=True):
        # Node's normalize keeps a trailing slash; the decision does not depend on it.
        want = node.rstrip("/") or "/"
        assert hook.expandPath(raw, cwd, home) == os.path.normpath(want), (raw, cwd, home)


def test_each_file_tool_reads_its_field_through_expand_path(home: User) -> None:
    cwd = home.h("projects/repo")
    for tool, field in (("Read", "file_path"), ("Edit", "file_path"), ("MultiEdit", "file_path"),
                        ("Write", "file_path"), ("NotebookEdit", "notebook_path")):
        for spelled in (" ~/private/notes.txt", "\ufeff../../private/notes.txt\u3000",
                        "~/projects/../private/notes.txt", f"{home.home}//private/./notes.txt"):
            assert decision(home, tool, cwd=cwd, **{field: spelled, "content": "x"}) is not None, (tool, spelled)
        assert decision(home, tool, cwd=cwd, **{field: " go.mod ", "content": "x"}) is None, tool


def test_a_path_through_a_link_is_decided_physically_as_well(home: User) -> None:
    # link/.. is ~/projects to the kernel: ../private from there is ~/private.
    spelled = home.h("projects/repo/link/../../private/notes.txt")
    assert decision(home, "Read", file_path=spelled) is not None
    assert decision(home, "Grep", pattern="x", path=home.h("projects/repo/link/../../private")) is not None
    # Both readings open: passes.
    assert decision(home, "Read", file_path=home.h("projects/repo/link/../go.mod")) is None


@pytest.mark.parametrize("spelled", [
    "/proc/self/environ", "/proc/self/root{home}/private/notes.txt", "/proc/self/cwd/../../private/notes.txt",
    "/proc/thread-self/environ", "/proc/1/environ", "/dev/fd/0", "/dev/stdin", "/proc/self/mem",
])
def test_process_paths_are_closed(home: User, spelled: str) -> None:
    spelled = spelled.replace("{home}", str(home.home))
    for tool, field in (("Read", "file_path"), ("Write", "file_path")):
        text = decision(home, tool, **{field: spelled})
        assert text is not None, (tool, spelled)
        assert "names the reading process's own objects" in text or "sandbox." in text
    assert decision(home, "Grep", pattern="x", path="/proc") is not None
    assert decision(home, "Glob", pattern="/proc/*/environ") is not None


@pytest.mark.parametrize(("pattern", "path", "refused"), [
    ("{home}/private/*", None, True),
    ("{home}/private/notes.txt", None, True),
    ("{home}/notes.txt", None, True),
    ("/home/notes.txt", None, None),  # dirname /home: refused when its tree holds the fixture home or anyone's
    ("{home}/projects/repo/link/../../private/*", None, True),
    ("{home}/projects/repo/*/../../../private/*", None, True),
    ("~/private/*", None, True),
    (" {home}/private/*", None, True),
    ("*", " {home}/private", True),
    ("*", "{home}/private", True),
    ("*", "~/private", True),
    ("*.go", None, False),
    ("**/*.go", None, False),
    ("{home}/projects/repo/*", None, False),
    ("/etc/*.conf", None, False),
])
def test_glob_roots(home: User, pattern: str, path: str | None, refused: bool | None) -> None:
    toolInput: dict[str, Any] = {"pattern": pattern.replace("{home}", str(home.home))}
    if path is not None:
        toolInput["path"] = path.replace("{home}", str(home.home))
    if refused is None:
        from agentsandbox.policy import otherHomes

        refused = any(h.startswith("/home/") for h in (str(home.home), *otherHomes(os.getuid(), str(home.home))))
    assert (decision(home, "Glob", **toolInput) is not None) == refused, toolInput


def test_glob_split_is_claude_codes() -> None:
    assert hook.globSplit("/a/b/*.go") == ("/a/b", "*.go")
    assert hook.globSplit("/a/b*/c") == ("/a", "b*/c")
    assert hook.globSplit("/*") == ("/", "*")
    assert hook.globSplit("/a/b/c.txt") == ("/a/b", "c.txt")
    assert hook.globSplit("/a/b/") == ("/a", "b")
    assert hook.globSplit("/a/link/../x/*") == ("/a/link/../x", "*")
    assert hook.globSplit("src/*.go") == ("src", "*.go")
    assert hook.globSplit("*.go") == ("", "*.go")


def test_a_lone_surrogate_is_the_replacement_character_to_the_kernel(home: User) -> None:
    # Node writes a lone surrogate as U+FFFD: a directory of that name is what
    # the kernel walks through.
    (home.home / "projects/repo/\ufffd").symlink_to(home.home / "projects/other")
    assert decision(home, "Glob", pattern=home.h("projects/repo/\ud800/../../private/*")) is not None
    assert decision(home, "Read", file_path=home.h("projects/repo/\udc80")) is None
