"""Every tool Claude Code offers, held (issue 23): the table, the hook's decision per kind, the drop-in.

Each reproduction decides through ``hook.pretooluse`` only, so it runs unchanged
against a hook that knew six file tools (which it fails).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from agentsandbox import claude, hook, tools
from agentsandbox.config import ConfigError
from tests.conftest import User, hookDecision


@pytest.fixture
def home(user: User) -> User:
    """~/projects readable, ~/projects/repo a git checkout, ~/Documents closed and holding a marker."""
    user.writeConfig('[sandbox]\nread = ["~/projects/other"]\nwrite = ["~/projects/repo"]\n'
                     'domains = ["github.com", "*.example.com", "127.0.0.1:8443"]\n')
    (user.home / "Documents").mkdir()
    (user.home / "Documents/notes.txt").write_text("private notes MARKER\n")
    (user.home / "projects/repo/.git").mkdir()
    return user


decision = hookDecision


# --------------------------------------------------------------------------- the table


def test_every_file_tool_of_the_table_has_its_paths() -> None:
    files = {n for n, t in tools.TOOLS.items() if t.kind in (tools.READS, tools.WRITES)}
    assert files == set(hook.FILE_PATHS)


def test_every_tool_has_a_known_kind_and_a_reason_where_it_is_not_plain() -> None:
    kinds = {tools.READS, tools.WRITES, tools.CWD, tools.SANDBOXED, tools.NETWORK, tools.SKILL,
             tools.HARMLESS, tools.REMOVED, tools.JUDGED}
    for name, tool in tools.TOOLS.items():
        assert tool.kind in kinds, name
        assert tool.name == name
        if tool.kind not in (tools.HARMLESS, tools.SANDBOXED, tools.JUDGED):
            assert tool.fields and tool.why, name


def test_docs_list_every_tool() -> None:
    text = (Path(__file__).parent.parent / "docs/hook.md").read_text()
    missing = [n for n in tools.TOOLS if f"`{n}`" not in text]
    assert not missing, f"docs/hook.md does not list {missing}"


# --------------------------------------------------------------------------- 1. Workflow


def test_repro_1_workflow_is_removed(home: User) -> None:
    text = decision(home, "Workflow", scriptPath=home.h("Documents/notes.txt"))
    assert text is not None
    assert "sandbox.allow_tools" in text and "before any hook runs" in text
    assert decision(home, "Workflow", scriptPath="wf.js") is not None


def test_the_drop_in_removes_workflow_unless_the_config_reopens_it(home: User) -> None:
    rendered = claude.render(home.policy(home.configFile.read_text()))
    assert "Workflow" in rendered["permissions"]["deny"]
    reopened = home.configFile.read_text().replace("[sandbox]\n", '[sandbox]\nallow_tools = ["Workflow"]\n')
    assert "Workflow" not in claude.render(home.policy(reopened))["permissions"]["deny"]
    home.writeConfig(reopened)
    # Re-opened, its scriptPath is still judged where the hook is asked.
    text = decision(home, "Workflow", scriptPath=home.h("Documents/notes.txt"))
    assert text is not None and "Documents/notes.txt" in text
    assert decision(home, "Workflow", scriptPath="wf.js") is None


@pytest.mark.parametrize("bad", ['["Read"]', '["workflow"]', '"Workflow"', "[1]"])
def test_allow_tools_names_only_removed_tools(user: User, bad: str) -> None:
    with pytest.raises(ConfigError, match=r"sandbox\.allow_tools"):
        user.config(f"[sandbox]\nallow_tools = {bad}\n")


# --------------------------------------------------------------------------- 2. EnterWorktree


def test_repro_2_enter_worktree_into_a_closed_directory_is_refused(home: User) -> None:
    text = decision(home, "EnterWorktree", path=home.h("Documents"))
    assert text is not None
    assert home.h("Documents") in text and "working directory" in text and "sandbox.write" in text
    assert decision(home, "EnterWorktree", path="~/Documents") is not None
    assert decision(home, "EnterWorktree", path="../../Documents") is not None
    # A directory holding a closed one opens it to the sandbox's writes: refused too.
    assert decision(home, "EnterWorktree", path=home.h("")) is not None
    assert decision(home, "EnterWorktree", path="/") is not None


def test_enter_worktree_inside_the_project_works(home: User) -> None:
    assert decision(home, "EnterWorktree", name="feature") is None
    assert decision(home, "EnterWorktree") is None
    assert decision(home, "EnterWorktree", path=home.h("projects/repo/.claude/worktrees/x")) is None
    # Readable is not enough: the sandbox would make it writable.
    assert decision(home, "EnterWorktree", path=home.h("projects/other")) is not None


def test_a_worktree_link_into_a_closed_directory_is_refused(home: User) -> None:
    (home.home / "projects/repo/docs").symlink_to(home.home / "Documents")
    text = decision(home, "EnterWorktree", path=home.h("projects/repo/docs"))
    assert text is not None and home.h("Documents") in text


# --------------------------------------------------------------------------- 3. Skill


def test_repro_3_a_skill_linked_to_a_closed_file_is_refused(home: User) -> None:
    skill = home.home / "projects/repo/.claude/skills/notes"
    skill.mkdir(parents=True)
    (skill / "SKILL.md").symlink_to(home.home / "Documents/notes.txt")
    text = decision(home, "Skill", skill="notes")
    assert text is not None and home.h("Documents/notes.txt") in text and "Skill" in text


def test_a_nested_skill_link_is_refused(home: User) -> None:
    """Planted by Bash in sub/.claude/skills (only the cwd's own .claude is protected)."""
    nested = home.home / "projects/repo/sub/deeper/.claude/skills/plan"
    nested.mkdir(parents=True)
    (nested / "SKILL.md").symlink_to(home.home / "Documents/notes.txt")
    assert decision(home, "Skill", skill="plan") is not None
    # A linked skill directory, and a command file.
    linked = home.home / "projects/repo/sub/.claude/skills"
    linked.mkdir(parents=True)
    (linked / "docs").symlink_to(home.home / "Documents")
    (home.home / "Documents/SKILL.md").write_text("---\nname: docs\n---\nMARKER\n")
    assert decision(home, "Skill", skill="docs") is not None
    commands = home.home / "projects/repo/a/.claude/commands"
    commands.mkdir(parents=True)
    (commands / "leak.md").symlink_to(home.home / "Documents/notes.txt")
    assert decision(home, "Skill", skill="leak") is not None
    assert decision(home, "Skill", skill="/leak") is not None


def test_skills_under_the_project_and_the_user_still_load(home: User) -> None:
    skill = home.home / "projects/repo/.claude/skills/build"
    skill.mkdir(parents=True)
    (skill / "SKILL.md").write_text("---\nname: build\ndescription: build it\n---\nmake\n")
    mine = home.home / ".claude/skills/review"
    mine.mkdir(parents=True)
    (mine / "SKILL.md").write_text("---\nname: review\n---\nlook\n")
    assert decision(home, "Skill", skill="build") is None
    assert decision(home, "Skill", skill="review") is None
    assert decision(home, "Skill", skill="nothing-by-that-name") is None
    assert decision(home, "Skill", skill="plugin:thing") is None


def test_an_agent_definition_linked_to_a_closed_file_is_refused(home: User) -> None:
    """A subagent type loads its definition (found by front matter, not by file name)."""
    assert decision(home, "Agent", prompt="p", description="d") is None
    assert decision(home, "Agent", prompt="p", description="d", subagent_type="general-purpose") is None
    agents = home.home / "projects/repo/sub/.claude/agents"
    agents.mkdir(parents=True)
    (agents / "innocent-name.md").symlink_to(home.home / "Documents/notes.txt")
    for tool, field, name in (("Agent", "subagent_type", "reviewer"), ("Skill", "skill", "anything")):
        text = decision(home, tool, prompt="p", description="d", **{field: name})
        assert text is not None and str(agents / "innocent-name.md") in text and "remove the link" in text, tool
    (agents / "innocent-name.md").unlink()
    assert decision(home, "Agent", prompt="p", description="d", subagent_type="reviewer") is None


def test_a_linked_claude_directory_is_refused(home: User) -> None:
    (home.home / "Documents/skills/x").mkdir(parents=True)
    (home.home / "Documents/skills/x/SKILL.md").write_text("---\nname: x\n---\nMARKER\n")
    nested = home.home / "projects/repo/sub/.claude"
    nested.mkdir(parents=True)
    (nested / "skills").symlink_to(home.home / "Documents/skills")
    assert decision(home, "Skill", skill="x") is not None


@pytest.mark.parametrize("name", ["../../Documents", "a/../b", "", " "])
def test_a_skill_name_that_is_a_path_is_refused(home: User, name: str) -> None:
    assert decision(home, "Skill", skill=name) is not None


# --------------------------------------------------------------------------- 5. WebFetch


def test_repro_5_webfetch_is_held_to_the_allow_list(home: User) -> None:
    text = decision(home, "WebFetch", url="https://unlisted.example.org/?q=MARKER", prompt="p")
    assert text is not None
    assert "unlisted.example.org:443 is not on the sandbox's allow list" in text and "sandbox.domains" in text
    assert decision(home, "WebFetch", url="http://unlisted.example.org/", prompt="p") is not None
    assert decision(home, "WebFetch", url="ftp://github.com/", prompt="p") is not None
    assert decision(home, "WebFetch", url="https://169.254.169.254/latest/", prompt="p") is not None
    # A listed name is decided by its resolved addresses too: offline here, it does not resolve.
    offline = decision(home, "WebFetch", url="https://github.com/", prompt="p")
    assert offline is None or "does not resolve" in offline
    # An explicit IP:port entry is reached on that port only.
    assert decision(home, "WebFetch", url="https://127.0.0.1:8443/x", prompt="p") is None
    assert decision(home, "WebFetch", url="https://127.0.0.1:8444/x", prompt="p") is not None


def test_the_drop_in_allows_webfetch_for_the_listed_names(home: User) -> None:
    rendered = claude.render(home.policy(home.configFile.read_text()))
    assert rendered["permissions"]["allow"] == ["WebFetch(domain:*.example.com)", "WebFetch(domain:github.com)"]
    assert rendered["hooks"]["PreToolUse"][0]["matcher"] == "*"


def test_websearch_and_the_harmless_tools_pass_without_a_policy(home: User) -> None:
    home.writeConfig("[sandbox\n")  # unloadable: file tools are refused, these are not asked about
    for name, tool in tools.TOOLS.items():
        if tool.kind in (tools.HARMLESS, tools.SANDBOXED):
            assert decision(home, name) is None, name
    assert decision(home, "Read", file_path="go.mod") is not None


# --------------------------------------------------------------------------- unknown tools


@pytest.mark.parametrize("toolInput", [
    {"path": "~/Documents/notes.txt"},
    {"path": "../../Documents"},
    {"file": "/proc/self/environ"},
    {"target": "{home}/Documents/notes.txt"},
    {"options": {"sources": ["src/a.py", "{home}/.ssh/id_ed25519"]}},
    {"uri": "file://{home}/Documents/notes.txt"},
    {"url": "https://unlisted.example.org/upload"},
    {"endpoint": "wss://unlisted.example.org:9000/"},
    {"dsn": "postgres://unlisted.example.org/db"},
    {"path": "/etc/hosts"},
    {"deep": [[[[[[[[[[[[[[[[[["x"]]]]]]]]]]]]]]]]]]},
])
def test_an_unknown_tool_is_judged_on_every_path_and_url(home: User, toolInput: dict[str, Any]) -> None:
    given = json.loads(json.dumps(toolInput).replace("{home}", str(home.home)))
    for tool in ("mcp__files__read", "SomeNewTool"):
        text = decision(home, tool, **given)
        assert text is not None, (tool, given)
        assert tool in text


def test_an_unknown_tool_works_inside_the_project(home: User) -> None:
    assert decision(home, "mcp__files__read", path="src/a.py", query="hello world") is None
    assert decision(home, "mcp__files__write", file_path=home.h("projects/repo/x"), content="/* c */\nx") is None
    assert decision(home, "SomeNewTool", url="https://127.0.0.1:8443/", notes="see ~ later") is None
    assert decision(home, "SomeNewTool") is None


# --------------------------------------------------------------------------- session start


def test_sessionstart_warns_of_a_definition_that_leads_to_a_closed_file(home: User, tmp_path: Path) -> None:
    """Claude Code lists skills (one line of each SKILL.md) before any tool call: the person is told."""
    import subprocess
    import sys

    from tests.conftest import REPO

    project = home.home / "projects/repo"
    event = json.dumps({"hook_event_name": "SessionStart", "cwd": str(project)}).encode()
    env = dict(home.env, CLAUDE_ENV_FILE=str(tmp_path / "env.sh"), PYTHONPATH=str(REPO))

    def start() -> str:
        p = subprocess.run([sys.executable, "-m", "agentsandbox", "hook", "sessionstart"], input=event,
                           capture_output=True, env=env, timeout=60, check=True)
        return p.stdout.decode()

    assert "WARNING" not in start()
    skill = project / "sub/.claude/skills/notes"
    skill.mkdir(parents=True)
    (skill / "SKILL.md").symlink_to("../../../../../../Documents/notes.txt")
    said = json.loads(start())["systemMessage"]
    assert "WARNING" in said and str(skill / "SKILL.md") in said and home.h("Documents/notes.txt") in said
    assert "MARKER" not in said


def helper(home: User, cwd: str | None = None) -> tuple[int, str]:
    """The policyHelper's answer for a session started in ``cwd`` (the repo by default)."""
    return hook.policyHelper(home.env, home.h("projects/repo") if cwd is None else cwd)


def test_policy_helper_refuses_a_session_whose_listing_would_carry_a_closed_file(home: User) -> None:
    """Claude Code lists every skill, command and agent of the user's, the cwd's and each parent's .claude."""
    project = home.home / "projects/repo"
    notes = home.h("Documents/notes.txt")
    assert helper(home) == (0, "{}")
    for at in (project / ".claude/skills/notes/SKILL.md", project / ".claude/commands/deep/notes.md",
               project / ".claude/agents/a.md", home.home / "projects/.claude/skills/up/SKILL.md",
               project / "CLAUDE.md", project / "CLAUDE.local.md", project / ".claude/CLAUDE.md",
               project / ".claude/rules/deep/r.md", home.home / "projects/CLAUDE.md"):
        at.parent.mkdir(parents=True, exist_ok=True)
        at.symlink_to(notes)
        code, text = helper(home)
        assert code == 1 and f"{at} leads to {notes}, which sessions may not read" in text, text
        assert text.startswith("agentsandbox refused to start this Claude Code session: ") and "MARKER" not in text
        # Below the project too (its .claude is a parent's there).
        assert helper(home, home.h("projects/repo/src"))[0] == 1
        at.unlink()
    assert helper(home) == (0, "{}")


def test_policy_helper_follows_memory_imports(home: User) -> None:
    """CLAUDE.md's ``@path`` imports are read whole at start; 2.1.197 follows a link there."""
    project = home.home / "projects/repo"
    (project / "docs").mkdir()
    (project / "docs/n.md").symlink_to(home.home / "Documents/notes.txt")
    (project / "shelf").symlink_to(home.home / "Documents")
    _write(project / "docs/plain.md", "see @n.md\n")
    for text in ("See @docs/n.md", "See @shelf/notes.txt", "See @docs/plain.md", "a\n@./docs/n.md\n"):
        (project / "CLAUDE.md").write_text(text + "\n")
        code, said = helper(home)
        assert code == 1 and str(home.home / "Documents/notes.txt") in said and "whole" in said, (text, said)
    # Claude Code does not import a file outside the project unless the user approved it there.
    for text in ("See @~/Documents/notes.txt", "mail me@example.org", "@docs/missing.md", "email@docs/n.md"):
        (project / "CLAUDE.md").write_text(text + "\n")
        assert helper(home) == (0, "{}"), text


def test_policy_helper_trusts_the_users_own_claude_directory_unless_sessions_write_it(home: User) -> None:
    mine = home.home / ".claude/skills/mine/SKILL.md"
    mine.parent.mkdir(parents=True)
    mine.symlink_to(home.home / "Documents/notes.txt")
    _write(home.home / "dotfiles/rules/r.md", "my rules\n")
    (home.home / ".claude/rules").symlink_to(home.home / "dotfiles/rules")
    assert helper(home) == (0, "{}")
    home.writeConfig('[sandbox]\nwrite = ["~/projects/repo", "~/.claude"]\n')
    code, said = helper(home)
    assert code == 1 and home.h("Documents/notes.txt") in said, said


def test_policy_helper_follows_links_of_directories(home: User) -> None:
    """A skill directory, a skills directory and a .claude that are links lead where they point."""
    project = home.home / "projects/repo"
    (home.home / "Documents/skills/x").mkdir(parents=True)
    (home.home / "Documents/skills/x/SKILL.md").write_text("---\nname: x\n---\nMARKER\n")
    for at, target in ((project / ".claude/skills/docs", home.home / "Documents/skills/x"),
                       (project / ".claude/skills", home.home / "Documents/skills"),
                       (project / ".claude", home.home / "Documents")):
        shutil.rmtree(project / ".claude", ignore_errors=True)
        at.parent.mkdir(parents=True, exist_ok=True)
        at.symlink_to(target)
        code, text = helper(home)
        assert code == 1 and str(home.home / "Documents") in text, (at, text)
        at.unlink()


def test_policy_helper_lets_the_own_and_the_readable_definitions_start(home: User) -> None:
    project = home.home / "projects/repo"
    _write(project / ".claude/skills/build/SKILL.md", "---\nname: build\ndescription: b\n---\nmake\n")
    _write(home.home / ".claude/commands/mine.md", "my own command\n")
    _write(home.home / ".claude/agents/reviewer.md", "---\nname: reviewer\n---\nreview\n")
    # A link inside its .claude, and one to a file sessions may read.
    (project / ".claude/skills/alias").mkdir()
    (project / ".claude/skills/alias/SKILL.md").symlink_to("../build/SKILL.md")
    _write(home.home / "projects/other/shared.md", "shared\n")
    (project / ".claude/commands").mkdir()
    (project / ".claude/commands/shared.md").symlink_to(home.home / "projects/other/shared.md")
    # The user's .claude may itself be a link (dotfiles): what lies in it is the user's own.
    (home.home / "dotfiles").mkdir()
    (home.home / ".claude").rename(home.home / "dotfiles/claude")
    (home.home / ".claude").symlink_to(home.home / "dotfiles/claude")
    assert helper(home) == (0, "{}")
    # Nested .claude directories are not listed at start: the file tools hold them.
    _write(project / "sub/.claude/skills/r/SKILL.md", "")
    (project / "sub/.claude/skills/r/SKILL.md").unlink()
    (project / "sub/.claude/skills/r/SKILL.md").symlink_to(home.home / "Documents/notes.txt")
    assert helper(home) == (0, "{}")
    assert helper(home, home.h("projects/repo/sub"))[0] == 1


def test_policy_helper_fails_closed(home: User, monkeypatch: pytest.MonkeyPatch) -> None:
    project = home.home / "projects/repo"
    code, text = hook.policyHelper(home.env, None)
    assert code == 1 and "working directory cannot be told" in text
    # A broken config: the session starts (every file tool is refused), unless a link leads out.
    home.writeConfig("[sandbox\n")
    assert helper(home) == (0, "{}")
    (project / ".claude/skills/x").mkdir(parents=True)
    (project / ".claude/skills/x/SKILL.md").symlink_to(home.home / "projects/other/readable.md")
    code, text = helper(home)
    assert code == 1 and "a link out of where it lies" in text and "config cannot be loaded" in text, text
    home.writeConfig('[sandbox]\nread = ["~/projects/other"]\nwrite = ["~/projects/repo"]\n')
    assert helper(home) == (0, "{}")
    monkeypatch.setattr(hook, "_SKILL_ENTRIES", 0)
    code, text = helper(home)
    assert code == 1 and "more than 0 entries" in text, text


def test_policy_helper_refuses_before_printing_settings(home: User) -> None:
    """Claude Code runs the drop-in's policyHelper.path with no arguments; it finds the session through its parent."""
    import subprocess
    import sys

    from tests.conftest import REPO

    project = home.home / "projects/repo"
    env = dict(home.env, PYTHONPATH=str(REPO))
    script = ("import os, subprocess, sys; os.chdir(sys.argv[1]); "
              "p = subprocess.run([sys.executable, '-m', 'agentsandbox.policyhelper'], cwd='/', capture_output=True, "
              "text=True); print(p.returncode); print(p.stdout.strip()[:40]); print(p.stderr.strip())")

    def run() -> list[str]:
        p = subprocess.run([sys.executable, "-c", script, str(project)], env=env, capture_output=True, text=True,
                           timeout=60, check=True)
        return p.stdout.split("\n")

    assert run()[:2] == ["0", '{"managedSettings": {"env": {"AGENTSANDB']
    (project / ".claude/skills/notes").mkdir(parents=True)
    (project / ".claude/skills/notes/SKILL.md").symlink_to(home.home / "Documents/notes.txt")
    code, out, said, *_ = run()
    assert code == "1" and out == "" and str(project / ".claude/skills/notes/SKILL.md") in said


def test_the_drop_in_names_the_helper_beside_the_command(home: User) -> None:
    policy = home.policy(exe="/usr/bin/agentsandbox")
    assert claude.renderMachine(policy)["policyHelper"] == {"path": "/usr/bin/agentsandbox-policy-helper"}
    assert "policyHelper" not in claude.render(policy)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_touching_a_directory_with_a_planted_skill_link_is_refused(home: User) -> None:
    """2.1.197 lists a nested skill, a line of its SKILL.md, once a file tool touched its directory."""
    project = home.home / "projects/repo"
    (project / "sub/deeper").mkdir(parents=True)
    (project / "sub/deeper/x.txt").write_text("x\n")
    (project / "other").mkdir()
    assert decision(home, "Read", file_path=str(project / "sub/deeper/x.txt")) is None
    skill = project / "sub/.claude/skills/roadmap"
    skill.mkdir(parents=True)
    (skill / "SKILL.md").symlink_to(home.home / "Documents/notes.txt")
    for tool, field in (("Read", "file_path"), ("Write", "file_path"), ("Edit", "file_path")):
        text = decision(home, tool, **{field: str(project / "sub/deeper/x.txt"), "content": "y"})
        assert text is not None and str(skill / "SKILL.md") in text and "discover" in text, tool
    assert decision(home, "Read", file_path="sub/x.txt") is not None
    # Elsewhere in the project, and the cwd's own files, are not the planted directory's.
    assert decision(home, "Read", file_path=str(project / "other/y")) is None
    assert decision(home, "Write", file_path="top.txt", content="x") is None


def test_a_tree_too_large_to_check_refuses_skill_and_agent(home: User, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the entry budget the hook refuses rather than guess what it did not read."""
    monkeypatch.setattr(hook, "_SKILL_ENTRIES", 10)
    for i in range(20):
        (home.home / f"projects/repo/f{i}").write_text("x")
    text = decision(home, "Skill", skill="build")
    assert text is not None and "more than 10 entries" in text and "smaller directory" in text
    assert decision(home, "Agent", prompt="p", description="d", subagent_type="reviewer") is not None
    assert decision(home, "Read", file_path="f1") is None, "a file tool walks nothing below the cwd"


def test_a_name_that_does_not_resolve_in_time_is_refused(home: User, monkeypatch: pytest.MonkeyPatch) -> None:
    """2.1.197 runs a tool whose hook timed out: the hook gives up on a slow resolver first."""
    import socket
    import threading

    release = threading.Event()

    def hangs(*args: object, **kw: object) -> object:
        release.wait(30)
        raise OSError("released")

    # A deadline of 0: the hanging lookup is given up at once, nothing waits on the wall clock.
    monkeypatch.setattr(hook, "_RESOLVE_SECONDS", 0)
    monkeypatch.setattr(socket, "getaddrinfo", hangs)
    try:
        text = decision(home, "WebFetch", url="https://github.com/", prompt="p")
    finally:
        release.set()
    assert text is not None and "no answer within 0 s" in text and "github.com" in text

    def public(*args: object, **kw: object) -> object:
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("192.0.2.10", 443))]

    monkeypatch.setattr(hook, "_RESOLVE_SECONDS", 30)
    monkeypatch.setattr(socket, "getaddrinfo", public)
    assert decision(home, "WebFetch", url="https://github.com/", prompt="p") is None
