"""Every tool the Claude Code releases we test offer the model, and what holds each one.

The drop-in's PreToolUse hook matches every tool (``*``) and decides by this
table (docs/hook.md has it as prose).  ``tests/test_claude_tools.py`` captures
the tools both installed releases offer (the request's ``tools`` and the ones
loaded on demand) and fails, naming it, on any tool this table does not know:
the tripwire for the next release.  A tool unknown here (a newer release's, an
MCP server's) is not let through unread: the hook judges every path-like and
URL-like value of its input, and refuses the call if any is closed.

Stdlib only and no ``typing`` at import: the hook reads this on every call.
"""

from __future__ import annotations

#: The kinds, each with what holds it.
READS = "reads files"
WRITES = "writes files"
CWD = "changes the session's working directory"
SANDBOXED = "runs commands in the sandbox"
NETWORK = "reaches the network from Claude Code's own process"
SKILL = "loads a skill's, command's or agent's file into the conversation"
HARMLESS = "touches no file or host of its own"
REMOVED = "removed by the drop-in's permissions.deny"
#: Judged as a tool the table does not know is: every path and URL in its input.
JUDGED = "judged on every path and URL it carries"

#: The config key that re-opens a tool the drop-in removes.
REOPEN_KEY = "sandbox.allow_tools"


class Tool:
    """One tool: its kind, the input fields that carry a path or URL, and why it is held so."""

    __slots__ = ("fields", "kind", "name", "why")

    def __init__(self, name: str, kind: str, fields: tuple[str, ...] = (), why: str = "") -> None:
        self.name = name
        self.kind = kind
        self.fields = fields
        self.why = why

    def __repr__(self) -> str:
        return f"Tool({self.name!r}, {self.kind!r}, {self.fields!r})"


_SUBAGENT = "its prompt runs later or elsewhere as tool calls that meet the same hook and sandbox"

_TABLE = (
    # Claude Code's own file tools run in its own process: the hook holds them.
    Tool("Read", READS, ("file_path",), "the hook: both readings of file_path"),
    Tool("Grep", READS, ("path",), "the hook: the search root (the cwd without path), no closed directory below it"),
    Tool("Glob", READS, ("pattern", "path"), "the hook: the walk's root, as ripgrep gets it"),
    Tool("Edit", WRITES, ("file_path",), "the hook: both readings of file_path, for writing"),
    Tool("MultiEdit", WRITES, ("file_path",), "the hook, as Edit (older releases)"),
    Tool("Write", WRITES, ("file_path",), "the hook, as Edit"),
    Tool("NotebookEdit", WRITES, ("notebook_path",), "the hook: notebook_path, for writing"),
    # Commands: bubblewrap through the drop-in holds them, not the hook.
    Tool("Bash", SANDBOXED, (), "the sandbox (bubblewrap and the egress proxy), from the drop-in"),
    # The working directory: the sandbox makes it writable, so it may move only
    # where the session could already write.
    Tool("EnterWorktree", CWD, ("path", "name"), "the hook: only into a directory the session may already write"),
    Tool("ExitWorktree", HARMLESS, (), "returns to the directory the session entered from"),
    # Claude Code's own process reaches the network for these, outside the sandbox and the proxy.
    Tool("WebFetch", NETWORK, ("url",), "the hook: the URL's host by sandbox.domains, its addresses by the address rules"),
    Tool(
        "Monitor",
        NETWORK,
        ("ws.url",),
        "its command runs in the sandbox as Bash's does; its ws.url is opened by Claude Code's own "
        "process, so the hook decides it as WebFetch's URL",
    ),
    Tool(
        "Skill",
        SKILL,
        ("skill",),
        "the hook: every skill, command and agent file of every .claude the session loads from, read physically",
    ),
    # Removed by the drop-in's permissions.deny: the hook cannot hold them.
    Tool(
        "Workflow",
        REMOVED,
        ("scriptPath",),
        "Claude Code reads its scriptPath while checking the input, before any hook runs, and "
        "quotes the file in its error",
    ),
    Tool(
        "DesignSync",
        REMOVED,
        ("localDir", "files.localPath"),
        "it reads local files (files[].localPath under a localDir that defaults to the working "
        "directory) in Claude Code's own process and uploads them to a remote API",
    ),
    Tool(
        "PowerShell",
        REMOVED,
        ("command",),
        "it runs a pwsh command, which is not shown to be held by the sandbox on Linux",
    ),
    Tool(
        "WebSearch",
        HARMLESS,
        (),
        "the search runs at the model provider, which already receives the whole conversation; "
        "no URL is fetched from this machine (allowed_domains and blocked_domains only filter results)",
    ),
    # Subagents, schedules and tasks: whatever they do later is a tool call of its own.
    Tool(
        "Agent",
        SKILL,
        ("subagent_type",),
        "the hook, as Skill: a subagent type loads its definition file; what the subagent does "
        "then meets the same hook and sandbox",
    ),
    Tool("Task", HARMLESS, (), _SUBAGENT + " (Agent's older name)"),
    Tool("SendMessage", HARMLESS, (), "messages another session of this user, held by the same policy"),
    Tool("ListAgents", HARMLESS, (), "lists this user's other sessions"),
    Tool("CronCreate", HARMLESS, (), _SUBAGENT),
    Tool("CronDelete", HARMLESS),
    Tool("CronList", HARMLESS),
    Tool("ScheduleWakeup", HARMLESS, (), _SUBAGENT),
    Tool("TaskCreate", HARMLESS),
    Tool("TaskGet", HARMLESS),
    Tool("TaskList", HARMLESS),
    Tool("TaskUpdate", HARMLESS),
    Tool("TaskOutput", HARMLESS, (), "reads what a command or subagent already held wrote"),
    Tool("TaskStop", HARMLESS, (), "stops a command or subagent"),
    Tool("BashOutput", HARMLESS, (), "reads what a sandboxed command wrote (TaskOutput's older name)"),
    Tool("KillShell", HARMLESS, (), "stops a sandboxed command (TaskStop's older name)"),
    Tool("TodoWrite", HARMLESS),
    Tool("ReportFindings", HARMLESS),
    Tool("PushNotification", HARMLESS, (), "sends the person a notification through the model provider"),
    Tool("ExitPlanMode", HARMLESS),
    Tool("EnterPlanMode", HARMLESS),
    Tool("AskUserQuestion", HARMLESS),
    Tool("ToolSearch", HARMLESS, (), "loads another tool's schema; that tool is decided when it is called"),
    Tool("DeferredToolPlaceholder", HARMLESS, (), "stands for the deferred tools; it is never called"),
    # MCP servers are the admin's or the person's, outside the sandbox (README); what
    # the model hands them is judged as an unknown tool's input is.
    Tool("ListMcpResourcesTool", JUDGED, ("server",), "lists what a configured MCP server offers"),
    Tool("ReadMcpResourceTool", JUDGED, ("uri",), "a file: URI is decided as a path, a network URI by sandbox.domains"),
    Tool("ReadMcpResourceDirTool", JUDGED, ("uri",), "as ReadMcpResourceTool"),
)

TOOLS: dict[str, Tool] = {t.name: t for t in _TABLE}


def removedTools(reopened: tuple[str, ...] | list[str] = ()) -> list[str]:
    """The tools the drop-in's ``permissions.deny`` removes, less those the config re-opens."""
    return sorted(t.name for t in _TABLE if t.kind == REMOVED and t.name not in reopened)


def reopenable() -> list[str]:
    """What ``sandbox.allow_tools`` may name."""
    return removedTools()
