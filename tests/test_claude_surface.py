"""Issue 23 through the real Claude Code: the tools past the six file tools, under the drop-in.

Each test installs the rendered drop-in (as test_claude_e2e does), points the
pinned 2.1.197 and the newest release at the mock Messages API and has the
mock make the issue's calls.  The home has a closed ``~/Documents`` (a git
checkout) whose ``notes.txt`` holds a marker; every request body the mock
recorded, and Claude Code's own output, is searched for it and for the
world's other markers, not only the final answer.

What each test shows, per release, is in its docstring; the controls (a
worktree inside the project, a skill under the project, Monitor, a subagent,
a listed WebFetch) show the holds did not take the tools away.  Where Claude
Code reaches a closed file outside any tool call (the skill listing, at
session start), the drop-in's policyHelper refuses the session before any
request; what the drop-in cannot hold (Bash planting a nested skill link)
stays asserted and is marked xfail with what was tried.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.support.claude_harness import (
    CANARY_DOCUMENTS,
    MANAGED_ROOT,
    PROJECT_TEXT,
    ClaudeBinary,
    ClaudeRun,
    ManagedSettingsGuard,
    ToolOutcome,
    World,
    freeLoopbackPort,
    gitCheckout,
    mockAPI,
    requireSomeBinary,
    runClaude,
    tempLeftoversRemoved,
)
from tests.support.mock_messages import (
    MOCK_ERROR,
    MockMessagesAPI,
    ToolCall,
    offeredTools,
    scriptPrompt,
)

DROP_IN = MANAGED_ROOT / "managed-settings.d" / "50-agentsandbox.json"
NOTES_TEXT = f"private notes {CANARY_DOCUMENTS}"
SKILL_BODY = "agentsandbox e2e skill body: build-7d21"
#: The GrowthBook flag that offers Monitor on 2.1.197 (tests/support/claude_tools.py).
MONITOR_FLAG = "tengu_amber_sentinel"




class Listener:
    """A loopback TCP port listed in sandbox.domains: counts who connects, answers nothing."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = int(self.sock.getsockname()[1])
        self.connections = 0
        threading.Thread(target=self._serve, name="surface-listener", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def listener() -> Iterator[Listener]:
    server = Listener()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def world(listener: Listener) -> Iterator[World]:
    # Not under /tmp: the temp dir is writable by policy (test_claude_e2e says why).
    base = Path(tempfile.mkdtemp(prefix="agentsandbox-surface-", dir="/var/tmp"))
    try:
        w = World(base=base, proxyPort=freeLoopbackPort(),
                  domains=("example.org", f"127.0.0.1:{listener.port}")).build()
        # ~/Documents is a git checkout of its own (issue 23, 2).
        gitCheckout(w.documents)
        # ~/.claude as someone who uses Claude Code has it.  2.1.197's sandbox
        # binds over the cwd's .claude/{commands,agents,skills} and settings
        # files and cannot create the mount points in a read-only home, so a
        # session started in home has no Bash without them (reported).
        for name in ("commands", "agents", "skills", "hooks"):
            (w.home / ".claude" / name).mkdir(parents=True, exist_ok=True)
        (w.home / ".claude" / "settings.local.json").write_text("{}\n")
        # WebFetch asks claude.ai whether a domain is safe before fetching;
        # offline that fails every fetch, listed or not, before it is tried.
        (w.home / ".claude" / "settings.json").write_text(json.dumps({"skipWebFetchPreflight": True}) + "\n")
        yield w
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def api() -> Iterator[MockMessagesAPI]:
    with mockAPI() as server:
        yield server


@pytest.fixture(scope="module")
def managed(world: World) -> Iterator[dict[str, Any]]:
    """The rendered drop-in, installed in an otherwise empty /etc/claude-code."""
    requireSomeBinary()
    with ManagedSettingsGuard(), tempLeftoversRemoved():
        installed = _install(world, world.config)
        yield installed


def _install(world: World, config: Path) -> dict[str, Any]:
    world.agentsandbox("install", "--managed-dir", str(MANAGED_ROOT), "--config", str(config))
    rendered = json.loads(world.agentsandbox("render", "claude", "--config", str(config)).stdout)
    installed: dict[str, Any] = json.loads(DROP_IN.read_text())
    assert installed == rendered, "install wrote something other than render prints"
    return installed


@contextmanager
def _installedFrom(world: World, config: Path, managed: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The drop-in ``config`` renders, installed for the block; the world's own afterwards."""
    try:
        yield _install(world, config)
    finally:
        assert _install(world, world.config) == managed


# --- running and checking ------------------------------------------------------------------


def _project(world: World, claude: ClaudeBinary, name: str, *, git: bool = False) -> Path:
    """A fresh project for one test on one release, under ~/work (which sessions may write)."""
    path = world.home / "work" / f"{name}-{claude.version}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    (path / "README.md").write_text(PROJECT_TEXT + "\n")
    if git:
        gitCheckout(path)
    return path


def _flaggedEnv(world: World, api: MockMessagesAPI) -> dict[str, str]:
    """Claude Code's env with Monitor offered on 2.1.197 too, and no way off this machine.

    2.1.197 offers Monitor only under a GrowthBook flag, read from ~/.claude.json's
    cache when non-essential traffic is not disabled; every proxy variable then
    points at a closed loopback port, as tests/support/claude_tools.py does.
    """
    state = world.home / ".claude.json"
    try:
        data = json.loads(state.read_text())
    except (OSError, ValueError):
        data = {}
    features = dict(data.get("cachedGrowthBookFeatures") or {})
    features[MONITOR_FLAG] = True
    data.update(hasCompletedOnboarding=True, cachedGrowthBookFeatures=features)
    state.write_text(json.dumps(data))
    env = world.claudeEnv(api)
    del env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"]
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy", "all_proxy"):
        env[name] = "http://127.0.0.1:9"
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    return env


def play(claude: ClaudeBinary, world: World, api: MockMessagesAPI, calls: list[ToolCall], *, cwd: Path,
         env: dict[str, str] | None = None, mockError: bool = False) -> ClaudeRun:
    """Run the calls; every run must end, and leave every protected file as it was."""
    before = world.secretFiles()
    run = runClaude(claude.require(), calls, cwd=cwd, env=env or world.claudeEnv(api), api=api)
    assert not run.timedOut, run.describe()
    result = run.result
    assert result is not None, f"no result event\n{run.describe()}"
    if not mockError:
        assert MOCK_ERROR not in str(result.get("result")), run.describe()
    assert world.secretFiles() == before, f"a protected file changed\n{run.describe()}"
    return run


def leaks(run: ClaudeRun, world: World, excused: Iterable[str] = ()) -> list[str]:
    """Where a marker left Claude Code: each request body the mock recorded, stdout, stderr.

    ``excused`` texts are cut out first (an xfail'd path checked on its own).
    """
    excused = list(excused)
    places = [(f"request {i}", json.dumps(body, ensure_ascii=False)) for i, body in enumerate(run.requests)]
    places += [("stdout", run.stdout), ("stderr", run.stderr)]
    found = []
    for where, text in places:
        for cut in excused:
            text = text.replace(cut, "")
        for canary in world.canaries():
            at = text.find(canary)
            if at >= 0:
                found.append(f"{where}: {canary!r} in ...{text[max(0, at - 240):at + 80]!r}...")
    return found


def assertNoLeak(run: ClaudeRun, world: World, excused: Iterable[str] = ()) -> None:
    found = leaks(run, world, excused)
    assert not found, "a marker reached the mock API or the output:\n" + "\n".join(found) + "\n" + run.describe()


def assertOurHook(outcome: ToolOutcome, run: ClaudeRun, *named: str) -> None:
    """Refused by the agentsandbox hook, whose reason names each of ``named``."""
    assert outcome.isError, f"{outcome.name} was not refused\n{run.describe()}"
    assert "agentsandbox refused" in outcome.text, f"not our hook's reason\n{run.describe()}"
    for text in named:
        assert text in outcome.text, f"the reason does not name {text}\n{run.describe()}"


def assertWorked(outcome: ToolOutcome, run: ClaudeRun, *holds: str) -> None:
    assert not outcome.isError, f"{outcome.name} failed\n{run.describe()}"
    for text in holds:
        assert text in outcome.text, f"{outcome.name}'s result lacks {text!r}\n{run.describe()}"


def offered(run: ClaudeRun) -> set[str]:
    names: set[str] = set()
    for body in run.requests:
        names |= offeredTools(body)
    return names


# --- 1. Workflow ---------------------------------------------------------------------------


@pytest.mark.claude
def test_workflow_is_removed_unless_the_config_reopens_it(claude: ClaudeBinary, world: World,
                                                          api: MockMessagesAPI,
                                                          managed: dict[str, Any]) -> None:
    """Issue 23, 1: Workflow reads its scriptPath before any hook runs, so it is not offered at all.

    Both releases: with the drop-in, no request offers Workflow, the scripted
    call never happens, and ~/Documents/notes.txt reaches nothing.  With
    ``sandbox.allow_tools = ["Workflow"]`` the rendered drop-in offers it again.
    """
    notes = str(world.documents / "notes.txt")
    run = play(claude, world, api, [ToolCall("Workflow", {"scriptPath": notes})], cwd=world.project,
               mockError=True)
    assert "Workflow" not in offered(run), run.describe()
    assert f"{MOCK_ERROR}: tool Workflow not offered" in str((run.result or {}).get("result")), run.describe()
    assert run.outcomes == [], run.describe()
    assertNoLeak(run, world)
    assert "Workflow" in managed["permissions"]["deny"]

    reopened = world.base / "etc" / "workflow.toml"
    reopened.write_text(world.config.read_text().replace("[sandbox]\n", '[sandbox]\nallow_tools = ["Workflow"]\n'))
    with _installedFrom(world, reopened, managed) as dropIn:
        assert "Workflow" not in dropIn["permissions"]["deny"]
        # Only a project path: re-opened, 2.1.197 reads scriptPath before the hook (docs/hook.md).
        run = play(claude, world, api, [ToolCall("Workflow", {"scriptPath": "wf.js"})], cwd=world.project,
                   env=world.claudeEnv(api, reopened))
    assert "Workflow" in offered(run), run.describe()
    assert [o.name for o in run.outcomes] == ["Workflow"], run.describe()
    assertNoLeak(run, world)


# --- 2. EnterWorktree ----------------------------------------------------------------------


@pytest.mark.claude
def test_enter_worktree_cannot_move_the_session_into_a_closed_checkout(claude: ClaudeBinary, world: World,
                                                                      api: MockMessagesAPI,
                                                                      managed: dict[str, Any]) -> None:
    """Issue 23, 2: a worktree entry written into the project's .git names ~/Documents.

    Both releases: the Writes into .git succeed (inside the project), our hook
    refuses ``EnterWorktree {"path": ~/Documents}``, Bash's ``pwd`` is still the
    project and its ``cat ~/Documents/notes.txt`` reads nothing.  Control:
    ``EnterWorktree {"name": "feature"}`` still moves the session into
    ``.claude/worktrees/feature``.
    """
    project = _project(world, claude, "worktree", git=True)
    entry = project / ".git" / "worktrees" / "docs"
    documents = str(world.documents)
    calls = [
        ToolCall("Write", {"file_path": str(entry / "gitdir"), "content": f"{documents}/.git\n"}),
        ToolCall("Write", {"file_path": str(entry / "HEAD"), "content": "ref: refs/heads/main\n"}),
        ToolCall("Write", {"file_path": str(entry / "commondir"), "content": "../..\n"}),
        ToolCall("EnterWorktree", {"path": documents}),
        ToolCall("Bash", {"command": "pwd; cat ~/Documents/notes.txt"}),
        ToolCall("EnterWorktree", {"name": "feature"}),
        ToolCall("Bash", {"command": "pwd"}),
    ]
    run = play(claude, world, api, calls, cwd=project)
    *writes, enter, probe, feature, where = run.outcomes
    for write in writes:
        assertWorked(write, run)
    assertOurHook(enter, run, documents, "working directory")
    # The cat fails ("Exit code 1" heads the text): pwd's line is the project.
    assert str(project) in probe.text.splitlines(), run.describe()
    assertWorked(feature, run)
    assertWorked(where, run)
    assert where.text.strip() == str(project / ".claude" / "worktrees" / "feature"), run.describe()
    assertNoLeak(run, world)


# --- 3. Skill ------------------------------------------------------------------------------


class SkillListingLeak(AssertionError):
    """The marker reached the API in Claude Code's skill listing, with no tool call."""


class NestedSkillPlanted(AssertionError):
    """Sandboxed Bash could plant a skill link in a nested .claude/skills."""


#: Why the plant assertion is xfail (measured on 2.1.197 and 2.1.335).
PLANT_REASON = (
    "issue 23's Build asks the drop-in's sandbox to deny Bash writes to nested "
    ".claude/{skills,commands,agents} and settings*.json, at any depth. Neither release can be told "
    "so: a glob write rule (**/.claude/skills) is skipped on Linux ('Skipping glob write pattern on "
    "Linux'), so Bash still plants sub/.claude/skills/r/SKILL.md; sandbox.mandatoryDenySearchDepth "
    "is not passed from the settings to the sandbox runtime, whose own dangerous names hold "
    ".claude/commands and .claude/agents but not .claude/skills, and an existing "
    "a/.claude/commands and a/.claude/skills were both written; a literal deny path holds even "
    "before it exists (a denied <project>/b/.claude/skills could not be created), but the "
    "directories a session may create cannot be listed in a machine-wide drop-in. Claude Code "
    "itself protects the cwd's own .claude, and 2.1.335 every parent's too (2.1.197 let Bash "
    "plant in a writable parent's .claude/skills). What holds the link's consequences instead: "
    "the drop-in's policyHelper refuses any later session whose start would list it, the file "
    "tools refuse the directory that would make 2.1.197 list it mid-session, and Skill and Agent "
    "are refused while it exists"
)
REFUSED_AT_START = "agentsandbox refused to start this Claude Code session"


def _link(at: Path, target: Path, relative: bool = False) -> None:
    at.parent.mkdir(parents=True, exist_ok=True)
    at.symlink_to(os.path.relpath(target, at.parent) if relative else target)


def _buildSkill(project: Path) -> None:
    skill = project / ".claude" / "skills" / "build" / "SKILL.md"
    skill.parent.mkdir(parents=True, exist_ok=True)
    skill.write_text(f"---\nname: build\ndescription: build the project\n---\n{SKILL_BODY}\n")


def refusedAtStart(claude: ClaudeBinary, world: World, api: MockMessagesAPI, cwd: Path, *named: str) -> ClaudeRun:
    """A session started in ``cwd`` that the drop-in's policyHelper refuses.

    Claude Code exits non-zero before it sends any request, saying
    ``policyHelper failed: …`` with our reason, which names each of ``named``.
    """
    before = world.secretFiles()
    run = runClaude(claude.require(), [ToolCall("Bash", {"command": "true"})], cwd=cwd, env=world.claudeEnv(api),
                    api=api)
    assert not run.timedOut, run.describe()
    assert run.returncode not in (0, None), f"the session started\n{run.describe()}"
    assert run.requests == [], f"Claude Code sent {len(run.requests)} requests\n{run.describe()}"
    assert "policyHelper failed" in run.stderr and REFUSED_AT_START in run.stderr, run.describe()
    for text in named:
        assert text in run.stderr, f"the refusal does not name {text}\n{run.describe()}"
    assertNoLeak(run, world)
    assert world.secretFiles() == before, f"a protected file changed\n{run.describe()}"
    return run


@pytest.mark.claude
def test_skill_linked_to_a_closed_file_is_refused(claude: ClaudeBinary, world: World, api: MockMessagesAPI,
                                                  managed: dict[str, Any]) -> None:
    """Issue 23, 3: SKILL.md links to ~/Documents/notes.txt, in the project's and a nested .claude.

    Both releases: with the project's own link, the session does not start
    (the policyHelper names the link and its target; Claude Code sends
    nothing).  With only the nested ``sub/.claude`` link: our hook refuses the
    Read that would make 2.1.197 discover it (naming that link), ``Skill
    roadmap`` is refused (by our hook, or as unknown where the refused Read
    kept Claude Code from discovering it), and while a link to a closed file
    is there every skill is refused, the project's own ``build`` too.  Bash's
    attempt to plant a link in the parent's ``.claude/skills`` works on 2.1.197
    (the next session there is then refused at start, naming it) and is
    refused by 2.1.335's sandbox.  The notes reach the API nowhere.  Control:
    once the links are removed, ``build`` loads and its body reaches the model.
    """
    parent = _project(world, claude, "skill")
    project = parent / "repo"
    project.mkdir()
    (project / "README.md").write_text(PROJECT_TEXT + "\n")
    notes = world.documents / "notes.txt"
    top = project / ".claude" / "skills" / "notes" / "SKILL.md"
    nestedLink = project / "sub" / ".claude" / "skills" / "roadmap" / "SKILL.md"
    planted = parent / ".claude" / "skills" / "pnotes" / "SKILL.md"
    _link(top, notes)
    _link(nestedLink, notes)
    (project / "sub" / "x.txt").write_text("x\n")
    _buildSkill(project)
    refusedAtStart(claude, world, api, project, str(top), str(notes))

    shutil.rmtree(top.parent)
    calls = [
        ToolCall("Read", {"file_path": str(project / "sub" / "x.txt")}),
        ToolCall("Bash", {"command": f"mkdir -p {planted.parent} && ln -s {notes} {planted} && echo planted"}),
        ToolCall("Bash", {"command": "true"}),
        ToolCall("Skill", {"skill": "roadmap"}),
        ToolCall("Skill", {"skill": "build"}),
    ]
    try:
        run = play(claude, world, api, calls, cwd=project)
        touch, plant, _, nested, build = run.outcomes
        assertOurHook(touch, run, str(nestedLink), str(notes))
        # 2.1.197 lets Bash write the parent's .claude (it lies in ~/work); 2.1.335 protects it.
        assert (plant.text == "planted") == os.path.islink(planted), run.describe()
        assert os.path.islink(planted) or "Read-only file system" in plant.text, run.describe()
        assert nested.isError, run.describe()
        assert "agentsandbox refused" in nested.text or "Unknown skill: roadmap" in nested.text, run.describe()
        assertOurHook(build, run, str(notes), "remove the link")
        assertNoLeak(run, world)
        if os.path.islink(planted):
            refusedAtStart(claude, world, api, project, str(planted), str(notes))
    finally:
        shutil.rmtree(parent / ".claude", ignore_errors=True)
    shutil.rmtree(nestedLink.parent)
    again = play(claude, world, api, [ToolCall("Skill", {"skill": "build"})], cwd=project)
    assertWorked(again.outcomes[0], again)
    assert again.requestsHolding(SKILL_BODY), f"the build skill's body never reached the model\n{again.describe()}"
    assertNoLeak(again, world)


@pytest.mark.claude
def test_skill_listing_at_session_start_never_carries_a_closed_file(claude: ClaudeBinary, world: World,
                                                                    api: MockMessagesAPI,
                                                                    managed: dict[str, Any]) -> None:
    """A repository that carries ``.claude/skills/notes/SKILL.md -> ../../../../Documents/notes.txt``.

    A relative link, as a cloned repository can hold one.  Without the
    drop-in's policyHelper, both releases sent the notes in the first
    request's skill listing, before any hook ran.  Both releases: a session
    started there, or in a directory below it, is refused before any request,
    and so is one whose ``.claude/commands/notes.md`` links to the notes;
    the refusal names the link and the notes.  Control: without the links the
    session starts and its first request lists the project's own ``build``
    and the user's ``mine`` skill (so ~/.claude/skills is still read).
    """
    project = _project(world, claude, "listing")
    (project / "sub").mkdir()
    notes = world.documents / "notes.txt"
    skill = project / ".claude" / "skills" / "notes" / "SKILL.md"
    command = project / ".claude" / "commands" / "notes.md"
    mine = world.home / ".claude" / "skills" / "mine" / "SKILL.md"
    _buildSkill(project)
    _link(skill, notes, relative=True)
    refusedAtStart(claude, world, api, project, str(skill), str(notes))
    refusedAtStart(claude, world, api, project / "sub", str(skill), str(notes))
    shutil.rmtree(skill.parent)
    _link(command, notes, relative=True)
    refusedAtStart(claude, world, api, project, str(command), str(notes))
    command.unlink()

    mine.parent.mkdir(parents=True, exist_ok=True)
    mine.write_text("---\nname: mine\ndescription: the user's own skill\n---\nmine\n")
    try:
        run = play(claude, world, api, [ToolCall("Bash", {"command": "true"})], cwd=project)
    finally:
        shutil.rmtree(mine.parent)
    assertWorked(run.outcomes[0], run)
    for description in ("build the project", "the user's own skill"):
        assert run.requestsHolding(description)[:1] == [0], f"{description!r} is not listed\n{run.describe()}"
    assertNoLeak(run, world)
    if run.requestsHolding(CANARY_DOCUMENTS):
        raise SkillListingLeak(run.describe())


@pytest.mark.claude
def test_memory_at_session_start_never_carries_a_closed_file(claude: ClaudeBinary, world: World,
                                                             api: MockMessagesAPI,
                                                             managed: dict[str, Any]) -> None:
    """A repository whose ``CLAUDE.md`` (or a rule, or a file it imports) links to the notes.

    Claude Code sends memory files whole in the first request.  Measured
    without the policyHelper: ``CLAUDE.md``, ``CLAUDE.local.md`` and
    ``.claude/CLAUDE.md`` linked to the notes sent them on both releases, a
    linked ``.claude/rules/r.md`` and an ``@docs/n.md`` import of a linked
    file on 2.1.197.  Both releases: each of these sessions is refused before
    any request, naming the link.  Control: a plain ``CLAUDE.md`` importing a
    plain file reaches the model.
    """
    project = _project(world, claude, "memory")
    notes = world.documents / "notes.txt"
    cases = [project / "CLAUDE.md", project / ".claude" / "CLAUDE.md", project / ".claude" / "rules" / "r.md"]
    for at in cases:
        _link(at, notes, relative=True)
        refusedAtStart(claude, world, api, project, str(at), str(notes))
        at.unlink()
    (project / "CLAUDE.md").write_text("# the project\nSee @docs/n.md\n")
    _link(project / "docs" / "n.md", notes, relative=True)
    refusedAtStart(claude, world, api, project, str(project / "docs" / "n.md"), str(notes))
    (project / "docs" / "n.md").unlink()
    (project / "docs" / "n.md").write_text("agentsandbox e2e imported memory: mem-5e2a\n")
    run = play(claude, world, api, [ToolCall("Bash", {"command": "true"})], cwd=project)
    assert run.requestsHolding("mem-5e2a")[:1] == [0], f"the imported memory is not sent\n{run.describe()}"
    assertNoLeak(run, world)


@pytest.mark.claude
def test_a_nested_skill_planted_by_bash_never_reaches_the_api(claude: ClaudeBinary, world: World,
                                                              api: MockMessagesAPI, managed: dict[str, Any],
                                                              request: pytest.FixtureRequest) -> None:
    """The issue's own path: sandboxed Bash plants the link in ``sub/.claude/skills/roadmap``.

    Both releases: the plant succeeds (xfail: the issue asks the sandbox to
    deny it, which neither release can be told: PLANT_REASON), our hook
    refuses the Read of ``sub/x.txt`` that would make 2.1.197 discover the
    nested skill and list it with the notes as its description at the next
    turn, and ``Skill roadmap`` is refused.  2.1.335 does not list it
    mid-session.  A later session started in ``sub`` is refused before any
    request, naming the planted link.
    """
    request.applymarker(pytest.mark.xfail(raises=NestedSkillPlanted, strict=True, reason=PLANT_REASON))
    project = _project(world, claude, "plant")
    (project / "sub").mkdir()
    (project / "sub" / "x.txt").write_text("x\n")
    plant = (f"mkdir -p sub/.claude/skills/roadmap && "
             f"ln -s {world.documents}/notes.txt sub/.claude/skills/roadmap/SKILL.md && echo planted")
    calls = [
        ToolCall("Bash", {"command": plant}),
        ToolCall("Read", {"file_path": str(project / "sub" / "x.txt")}),
        ToolCall("Bash", {"command": "true"}),
        ToolCall("Skill", {"skill": "roadmap"}),
    ]
    run = play(claude, world, api, calls, cwd=project)
    planted = os.path.islink(project / "sub/.claude/skills/roadmap/SKILL.md")
    touch, skill = run.outcomes[1], run.outcomes[-1]
    assert skill.isError, run.describe()
    if planted:
        # The Read that would make 2.1.197 discover sub/.claude is refused, so
        # Claude Code may not know the skill at all: refused either way.
        assertOurHook(touch, run, str(world.documents / "notes.txt"))
        assert "agentsandbox refused" in skill.text or "Unknown skill: roadmap" in skill.text, run.describe()
    assertNoLeak(run, world)
    listed = run.requestsHolding(CANARY_DOCUMENTS)
    if listed:
        raise SkillListingLeak(f"the skill listing of requests {listed} holds {NOTES_TEXT!r}\n{run.describe()}")
    if planted:
        refusedAtStart(claude, world, api, project / "sub", str(project / "sub/.claude/skills/roadmap/SKILL.md"),
                       str(world.documents / "notes.txt"))
        raise NestedSkillPlanted(f"{run.outcomes[0].text!r}: sub/.claude/skills/roadmap/SKILL.md was planted")


# --- 4. process-relative links -------------------------------------------------------------


@pytest.mark.claude
def test_a_project_link_to_proc_self_cwd_is_refused(claude: ClaudeBinary, world: World, api: MockMessagesAPI,
                                                    managed: dict[str, Any]) -> None:
    """Issue 23, 4: Claude Code started in home, its Bash moved into the project.

    Claude Code's own cwd stays home, where ``private/notes.txt`` is closed;
    hooks run in the session's (the project).  Both releases: Read and Glob
    through ``P/l-cwd`` (-> /proc/self/cwd) and Write through ``P/l-tcwd``
    (-> /proc/thread-self/cwd) are refused by our hook as /proc paths, no
    marker reaches the API, and nothing appears in ~/private.  Control: the
    project's README reads.
    """
    project = _project(world, claude, "proc")
    (project / "l-cwd").symlink_to("/proc/self/cwd")
    (project / "l-tcwd").symlink_to("/proc/thread-self/cwd")
    p = str(project)
    calls = [
        ToolCall("Bash", {"command": f"cd {p} && pwd"}),
        ToolCall("Read", {"file_path": f"{p}/l-cwd/private/notes.txt"}),
        ToolCall("Glob", {"pattern": f"{p}/l-cwd/private/*"}),
        ToolCall("Write", {"file_path": f"{p}/l-tcwd/private/new.txt", "content": "planted\n"}),
        ToolCall("Read", {"file_path": f"{p}/README.md"}),
    ]
    run = play(claude, world, api, calls, cwd=world.home)
    moved, read, glob, write, readme = run.outcomes
    assertWorked(moved, run, p)
    assertOurHook(read, run, "/proc/self/cwd", "inside /proc")
    assertOurHook(glob, run, "/proc/self/cwd", "inside /proc")
    assertOurHook(write, run, "/proc/thread-self/cwd", "inside /proc")
    assertWorked(readme, run, PROJECT_TEXT)
    assertNoLeak(run, world)


# --- 5. WebFetch and Monitor's WebSocket ---------------------------------------------------


@pytest.mark.claude
def test_webfetch_and_websockets_are_held_to_sandbox_domains(claude: ClaudeBinary, world: World,
                                                             api: MockMessagesAPI, listener: Listener,
                                                             managed: dict[str, Any]) -> None:
    """Issue 23, 5: WebFetch (and Monitor's ``ws``) connect from Claude Code's own process.

    Both releases: our hook refuses WebFetch of an unlisted host, naming
    sandbox.domains, and Monitor's WebSocket to it.  Control: WebFetch of the
    listed ``127.0.0.1:PORT`` is not refused by us and Claude Code connects to
    it (the listener speaks no TLS, so the fetch itself then fails).
    """
    project = _project(world, claude, "fetch")
    unlisted = f"https://unlisted.example.org/?q={PROJECT_TEXT.replace(' ', '+')}"
    before = listener.connections
    calls = [
        ToolCall("WebFetch", {"url": unlisted, "prompt": "summarise"}),
        ToolCall("Monitor", {"description": "feed", "ws": {"url": "wss://unlisted.example.org/feed"}}),
        ToolCall("WebFetch", {"url": f"http://127.0.0.1:{listener.port}/page", "prompt": "summarise"}),
    ]
    run = play(claude, world, api, calls, cwd=project, env=_flaggedEnv(world, api))
    fetch, socketWatch, listed = run.outcomes
    assertOurHook(fetch, run, "unlisted.example.org:443 is not on the sandbox's allow list", "sandbox.domains")
    assertOurHook(socketWatch, run, "unlisted.example.org", "sandbox.domains")
    assert "agentsandbox" not in listed.text, f"our hook refused a listed address\n{run.describe()}"
    assert listener.connections > before, f"Claude Code never connected to the listed address\n{run.describe()}"
    assertNoLeak(run, world)


# --- 6. what must keep working -------------------------------------------------------------


@pytest.mark.claude
def test_monitor_and_subagents_still_work(claude: ClaudeBinary, world: World, api: MockMessagesAPI,
                                          managed: dict[str, Any]) -> None:
    """The hook now runs for every tool: Monitor's command and a subagent's calls must still work.

    Both releases: Monitor's command runs in the sandbox (its event line shows
    SANDBOX_RUNTIME=1 and its ``cat`` of the notes reads nothing); a subagent's
    Read of the notes is refused by our hook and its Read of the README works,
    and that result comes back through Agent.
    """
    project = _project(world, claude, "monitor")
    notes = str(world.documents / "notes.txt")
    sub = scriptPrompt([ToolCall("Read", {"file_path": notes}),
                        ToolCall("Read", {"file_path": str(project / "README.md")})])
    calls = [
        ToolCall("Monitor", {"description": "probe",
                             "command": f"echo monitor-event-sandboxed=$SANDBOX_RUNTIME; cat {notes}"}),
        # Gives the event time to arrive before the next request is sent.
        ToolCall("Bash", {"command": "sleep 2"}),
        ToolCall("Agent", {"description": "read the readme", "prompt": sub, "subagent_type": "general-purpose",
                           "run_in_background": False}),
    ]
    run = play(claude, world, api, calls, cwd=project, env=_flaggedEnv(world, api))
    byName: dict[str, list[ToolOutcome]] = {}
    for o in run.outcomes:
        byName.setdefault(o.name, []).append(o)
    assertWorked(byName["Monitor"][0], run)
    assert run.requestsHolding("monitor-event-sandboxed=1"), f"no sandboxed Monitor event\n{run.describe()}"
    closed, readme = byName["Read"]
    assertOurHook(closed, run, notes)
    assertWorked(readme, run, PROJECT_TEXT)
    assertWorked(byName["Agent"][0], run, PROJECT_TEXT)
    assertNoLeak(run, world)
