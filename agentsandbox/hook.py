"""Claude Code hooks: PreToolUse holds the file tools to the policy; SessionStart
gives sandboxed Bash the per-user environment and takes the credentials away.

The sandbox (bubblewrap) wraps only the Bash tool; Read, Grep, Glob, Edit, Write
and NotebookEdit run in Claude Code's own process, so this hook is what holds
them.  It fails closed: bad input, a config that cannot be loaded, or any
exception denies the call with a reason.  Claude Code 2.1.197 runs a tool whose
hook crashed, so a crash must never escape as a traceback.

Stdlib only, and kept small: it runs on every file-tool call, started by
``hookstart.py`` (``python -I -S``, which the drop-in names) with nothing but
this module, the policy, the paths and their JSON (``hookjson``).  The decision
imports neither ``json`` nor ``re`` nor ``fnmatch``: each would cost more than
the decision itself (bench/hook.py); the SessionStart hook, run once a session
through the CLI, imports what it needs.

The policy cache (``cachedPolicy``) lives here, the only place that loads the
config for a decision: ``policy`` must not import ``config``, which builds a
Policy to check its layout.
"""

from __future__ import annotations

import os
import sys

from agentsandbox.hookjson import asciiString, loads

# Importing typing costs the hook more than its decision; mypy reads this name
# as true all the same.
TYPE_CHECKING = False

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping
    from typing import IO, Any

    from agentsandbox.policy import Policy

MAX_INPUT = 1024 * 1024

_NAME = r"[A-Za-z_][A-Za-z0-9_]*"

#: What JavaScript's String.prototype.trim() removes: ECMAScript WhiteSpace and
#: LineTerminator (checked against node in the tests).  Python's str.strip()
#: differs: it keeps U+FEFF and removes U+001C-001F and U+0085.
JS_WHITESPACE = (
    "\t\n\v\f\r \xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
    "\u2028\u2029\u202f\u205f\u3000\ufeff"
)
#: The characters Claude Code's Glob takes as the start of a wildcard.
_GLOB_START = "*?[{"

#: The whole stdout when even building a deny fails: a static, valid deny.
LAST_RESORT = (
    b'{"hookSpecificOutput": {"hookEventName": "PreToolUse", "permissionDecision": "deny", '
    b'"permissionDecisionReason": "agentsandbox refused this call: the hook failed"}}\n'
)


class Refusal(Exception):
    """A file-tool call the hook denies; the message is the reason Claude sees."""


def deny(reason: str) -> str:
    """The deny line: ``json.dumps`` of the hook's answer, ``ensure_ascii=True``.

    ASCII only: a lone surrogate or any other code point is escaped, so the
    line can be written whatever stdout's encoding is.
    """
    return (
        '{"hookSpecificOutput": {"hookEventName": "PreToolUse", "permissionDecision": "deny", '
        f'"permissionDecisionReason": {asciiString(reason)}}}}}\n'
    )


# --------------------------------------------------------------------------- what each tool touches


class Reading:
    """One absolute path a tool call may touch, and how it was derived.

    ``physical`` readings apply ``..`` after following links, as the kernel
    does with a path handed to it unnormalised; the others apply ``..``
    first, as Node's ``path.resolve`` does.  ``search`` marks the root of a
    recursive walk (Grep, Glob), which must not hold a closed directory.
    """

    __slots__ = ("path", "physical", "search")

    def __init__(self, path: str, physical: bool = False, search: bool = False) -> None:
        self.path = path
        self.physical = physical
        self.search = search

    def __repr__(self) -> str:
        return f"Reading({self.path!r}, physical={self.physical}, search={self.search})"


def jsTrim(text: str) -> str:
    return text.strip(JS_WHITESPACE)


def _fsText(path: str) -> str:
    """The path Node hands the kernel: a lone surrogate becomes U+FFFD in its UTF-8."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in path)
    return path


def _joined(text: str, cwd: str, home: str) -> str:
    """``text`` made absolute with ``~`` and ``cwd`` (Claude Code's order), not normalised."""
    if text == "~":
        return home
    if text.startswith("~/"):
        return home + "/" + text[2:]
    if text.startswith("/"):
        return text
    return cwd + "/" + text


def _normal(path: str) -> str:
    """Node's path.normalize on an absolute POSIX path, less any trailing slash."""
    path = os.path.normpath(path)
    return "/" + path.lstrip("/") if path.startswith("//") else path


def expandPath(raw: str, cwd: str, home: str) -> str:
    """Claude Code's ``expandPath``: JS trim, then ``~`` or ``~/``, then ``path.resolve`` on cwd.

    Empty after trimming means the cwd.  Measured on 2.1.197 and the newest
    release (docs/hook.md).
    """
    text = jsTrim(raw)
    return _normal(_joined(text, cwd, home) if text else cwd)


def _both(raw: str, cwd: str, home: str, search: bool = False) -> list[Reading]:
    """The lexical reading Claude Code resolves ``raw`` to, and the physical one."""
    from agentsandbox.policy import physical

    text = jsTrim(raw)
    joined = _fsText(_joined(text, cwd, home) if text else cwd)
    # Node applies ".." to the string, the kernel after following links.
    return [
        Reading(_normal(joined), search=search),
        Reading(physical(joined), physical=True, search=search),
    ]


class _Empty(Refusal):
    """A path field that is the empty string; ``decide`` names the tool."""


def _filePath(toolInput: Mapping[str, Any], field: str, cwd: str, home: str) -> list[Reading]:
    raw = _text(toolInput.get(field), f"tool_input.{field}")
    if not raw:
        raise _Empty(f"tool_input.{field}")
    return _both(raw, cwd, home)


def readPaths(toolInput: Mapping[str, Any], cwd: str, home: str) -> list[Reading]:
    """Read opens ``expandPath(file_path)``.

    2.1.197 hands the hook the expanded path; newer releases call the hook
    with the raw one as well, so it is expanded here either way.
    """
    return _filePath(toolInput, "file_path", cwd, home)


def editPaths(toolInput: Mapping[str, Any], cwd: str, home: str) -> list[Reading]:
    """Edit, MultiEdit and Write write ``expandPath(file_path)``."""
    return _filePath(toolInput, "file_path", cwd, home)


def notebookPaths(toolInput: Mapping[str, Any], cwd: str, home: str) -> list[Reading]:
    """NotebookEdit writes ``expandPath(notebook_path)``."""
    return _filePath(toolInput, "notebook_path", cwd, home)


def _searchBase(toolInput: Mapping[str, Any], cwd: str, home: str) -> str:
    """Grep's and Glob's ``path``: the cwd when absent or empty (JS falsy), else expanded."""
    given = toolInput.get("path")
    if given is None or given == "":
        return cwd
    return _text(given, "tool_input.path")


def grepPaths(toolInput: Mapping[str, Any], cwd: str, home: str) -> list[Reading]:
    """Grep runs ripgrep on ``expandPath(path)`` (the cwd without one).

    The hook is handed ``path`` raw: the JS trim and ``~`` are applied here.
    ``glob`` and ``type`` only filter below that root.
    """
    return _both(_searchBase(toolInput, cwd, home), cwd, home, search=True)


def _climbed(root: str, rest: list[str]) -> str:
    """``root`` raised by each ``..`` of ``rest`` a wildcard cannot absorb.

    ripgrep matches the rest of a pattern below the root and never climbs, so
    this only widens the decision: each wildcard descends at least one level
    (``**`` at least none) and each ``..`` climbs one.
    """
    depth = lowest = 0
    for part in rest:
        if part == "..":
            depth -= 1
        elif part not in ("", ".", "**"):
            depth += 1
        lowest = min(lowest, depth)
    for _ in range(-lowest):
        root = os.path.dirname(root)
    return root


def globSplit(pattern: str) -> tuple[str, str]:
    """Claude Code's split of an absolute Glob pattern: (the walk's root as written, the rest).

    The root is everything before the last ``/`` that precedes the first
    wildcard, or the pattern's dirname when it has none; it is handed to
    ripgrep unnormalised.  A relative pattern is all rest ('' root).
    """
    first = min((i for i in map(pattern.find, _GLOB_START) if i >= 0), default=-1)
    literal = pattern if first < 0 else pattern[:first]
    if first < 0:
        stripped = pattern.rstrip("/") or "/"
        cut = stripped.rfind("/")
        return (stripped[:cut] or "/", stripped[cut + 1 :]) if cut >= 0 else ("", pattern)
    cut = literal.rfind("/")
    if cut < 0:
        return "", pattern
    return literal[:cut] or "/", pattern[cut + 1 :]


def globRoot(pattern: str, base: str) -> str:
    """The highest directory a relative or absolute Glob ``pattern`` from ``base`` can reach, lexically."""
    return _globReadings(pattern, base)[0].path


def _globReadings(pattern: str, base: str) -> list[Reading]:
    """Both readings of the walk's root for ``pattern`` (absolute, or relative to ``base``)."""
    root, rest = globSplit(pattern)
    if not pattern.startswith("/"):
        root = base + "/" + root if root else base
    from agentsandbox.policy import physical

    parts = rest.split("/")
    joined = _fsText(root)
    return [
        Reading(_climbed(_normal(joined), parts), search=True),
        Reading(_climbed(physical(joined), parts), physical=True, search=True),
    ]


def globPaths(toolInput: Mapping[str, Any], cwd: str, home: str) -> list[Reading]:
    """Glob runs ``ripgrep --files --glob REST ROOT``.

    An absolute pattern is split by ``globSplit`` and its root is handed to
    ripgrep unnormalised, so the kernel resolves links before ``..`` (2.1.197;
    measured).  Otherwise the root is ``expandPath(path)`` (the cwd without
    one) and the whole pattern filters below it.  Both readings of every root
    are decided, the relative pattern's literal prefix too, and the pattern
    trimmed as JavaScript would, in case a release trims it.
    """
    pattern = _text(toolInput.get("pattern"), "tool_input.pattern")
    readings: list[Reading] = []
    base = _both(_searchBase(toolInput, cwd, home), cwd, home, search=True)
    for candidate in dict.fromkeys((pattern, jsTrim(pattern))):
        if candidate.startswith("~/"):
            # Claude Code takes this as relative (ripgrep then matches nothing);
            # it is read as the home-relative path a release may expand it to.
            candidate = home + candidate[1:]
        if candidate.startswith("/"):
            readings += _globReadings(candidate, cwd)
        else:
            readings += base
            for b in base:
                readings += _globReadings(candidate, b.path)
    return readings


#: The path each file tool of ``tools.TOOLS`` (kinds READS and WRITES) acts on.
FILE_PATHS = {
    "Read": readPaths,
    "Grep": grepPaths,
    "Glob": globPaths,
    "Edit": editPaths,
    "MultiEdit": editPaths,
    "Write": editPaths,
    "NotebookEdit": notebookPaths,
}


def _text(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise Refusal(f"agentsandbox refused this call: {field} is not a string")
    if "\0" in value:
        raise Refusal(f"agentsandbox refused this call: {field} contains a NUL byte")
    return value


def decide(event: Any, environ: Mapping[str, str]) -> str | None:
    """The deny reason for one PreToolUse event, or None to let it pass.

    Every tool is decided by its kind in ``tools.TOOLS``; a tool the table does
    not know is judged on every path and URL its input carries (``_unknown``).
    """
    from agentsandbox import tools

    if not isinstance(event, dict):
        raise Refusal("agentsandbox refused this call: the hook's input is not a JSON object")
    tool = event.get("tool_name")
    if not isinstance(tool, str):
        raise Refusal("agentsandbox refused this call: the hook's input has no tool_name")
    known = tools.TOOLS.get(tool)
    if known is not None and known.kind in (tools.SANDBOXED, tools.HARMLESS):
        return None
    toolInput = event.get("tool_input")
    if not isinstance(toolInput, dict):
        raise Refusal(f"agentsandbox refused this {tool} call: tool_input is missing")
    cwd = _text(event.get("cwd"), "cwd")
    if not cwd.startswith("/"):
        raise Refusal(f"agentsandbox refused this {tool} call: cwd {cwd!r} is not absolute")
    policy, source = _policy(environ)
    if known is None or known.kind == tools.JUDGED:
        return _unknown(policy, source, tool, toolInput, cwd)
    kind = known.kind
    if kind == tools.REMOVED:
        if tool not in policy.allowTools:
            return (
                f"agentsandbox refused {tool}: the drop-in removes it because {known.why}. Add "
                f"{_quoted(tool)} to {tools.REOPEN_KEY}{_inSource(source)} to re-open it (docs/hook.md "
                f"says what that costs)."
            )
        return _unknown(policy, source, tool, toolInput, cwd)
    if kind == tools.NETWORK:
        return _fetch(policy, source, tool, known.fields, toolInput)
    if kind == tools.CWD:
        return _worktree(policy, source, tool, toolInput, cwd)
    if kind == tools.SKILL:
        return _skill(policy, source, tool, toolInput, cwd)
    paths = FILE_PATHS[tool]
    try:
        readings = paths(toolInput, cwd, policy.home)
    except _Empty as e:
        raise Refusal(f"agentsandbox refused this {tool} call: {e} is empty") from None
    shown = _shown(tool, toolInput, cwd)
    why = decideReadings(policy, source, readings, shown, cwd, "read" if kind == tools.READS else "write")
    if why is None:
        why = _touchedDefinitions(policy, source, tool, readings, cwd)
    return why


def _touchedDefinitions(policy: Policy, source: str, tool: str, readings: list[Reading], cwd: str) -> str | None:
    """A nested ``.claude`` on the way from the cwd to a path, holding a definition that leads to a closed file.

    Claude Code 2.1.197 discovers ``sub/.claude/skills`` once a file tool
    touched ``sub/``, and lists each skill with a line of its SKILL.md at the
    next turn, before any hook can refuse (docs/hook.md): so the call that
    would make it discover one is refused, naming the link.  Only directories
    strictly below the cwd are looked at (one ``lstat`` each); the cwd's own
    ``.claude`` is Claude Code's to protect.
    """
    prefix = cwd.rstrip("/") + "/"
    budget = [_SKILL_ENTRIES]
    for reading in readings:
        if reading.physical or not reading.path.startswith(prefix):
            continue
        here = os.path.dirname(reading.path)
        while here.startswith(prefix) and len(here) > len(cwd):
            base = here + "/.claude"
            if os.path.lexists(base):
                try:
                    files = _definitionFiles(base, budget)
                except Refusal:
                    return f"agentsandbox refused {tool}: {base} holds too many files to check."
                for candidate in files:
                    why = decideReadings(policy, source, _both(candidate, cwd, policy.home), candidate, cwd, "read")
                    if why is not None:
                        return (
                            f"{why} ({tool} would make Claude Code discover {base}, whose skills it lists "
                            f"to the model with a line of each; remove the link.)"
                        )
            here = os.path.dirname(here)
    return None


def _inSource(source: str) -> str:
    return f" in {source}" if source.startswith("/") else ""


# --------------------------------------------------------------------------- the other kinds

#: How deep, and how many values, of an unknown tool's input are read before it is refused.
_UNKNOWN_DEPTH = 16
_UNKNOWN_VALUES = 4096
#: Input keys whose value is a path even when it is written relative (``src/x.py``).
_PATH_KEYS = ("path", "paths", "file", "files", "filename", "dir", "dirs", "directory", "cwd", "root", "folder")
#: The port a URL of each scheme reaches when it names none.
_DEFAULT_PORTS = {
    "http": 80, "https": 443, "ws": 80, "wss": 443, "ftp": 21, "ftps": 990, "sftp": 22, "ssh": 22,
    "git": 9418, "smtp": 25, "imap": 143, "ldap": 389, "postgres": 5432, "postgresql": 5432,
    "mysql": 3306, "redis": 6379, "mongodb": 27017, "amqp": 5672,
}


def _strings(value: Any, key: str, depth: int, into: list[tuple[str, str]]) -> None:
    """Every string of a JSON value, with the key it stands under (a list's items take its key)."""
    if depth > _UNKNOWN_DEPTH or len(into) > _UNKNOWN_VALUES:
        raise Refusal("its input is nested too deeply or holds too many values to check")
    if isinstance(value, str):
        into.append((key, value))
    elif isinstance(value, dict):
        for k, v in value.items():
            _strings(v, str(k), depth + 1, into)
    elif isinstance(value, list):
        for v in value:
            _strings(v, key, depth + 1, into)


def _urlScheme(text: str) -> str | None:
    """The scheme of ``text`` when it reads as ``scheme://...``, lower case; else None."""
    cut = text.find("://")
    if cut <= 0:
        return None
    scheme = text[:cut]
    if not scheme[0].isascii() or not scheme[0].isalpha():
        return None
    for c in scheme:
        if not (c.isascii() and (c.isalnum() or c in "+-.")):
            return None
    return scheme.lower()


def _pathLike(key: str, text: str) -> bool:
    if not text or "\n" in text or len(text) > 4096:
        return False
    if text[0] == "/" or text == "~" or text.startswith(("~/", "./", "../")) or text in (".", ".."):
        return True
    lowered = key.lower()
    return lowered.endswith(_PATH_KEYS)


def _unknown(policy: Policy, source: str, tool: str, toolInput: Mapping[str, Any], cwd: str) -> str | None:
    """A tool the table does not know: every path it names must be readable and writable, every URL allowed.

    So such a tool (a newer release's, an MCP server's) works inside the
    project and never reaches a closed path or an unlisted host.
    """
    found: list[tuple[str, str]] = []
    try:
        _strings(toolInput, "", 0, found)
    except Refusal as r:
        return f"agentsandbox refused {tool}, a tool it does not know: {r}."
    for key, text in found:
        scheme = _urlScheme(text)
        if scheme is not None:
            if scheme == "file":
                text = text[len("file://") :]
                if not text.startswith("/"):
                    return (
                        f"agentsandbox refused {tool}, a tool it does not know: {key} {_quoted(text)} "
                        f"is a file URL with a host; only file:///path is read."
                    )
            else:
                why = _urlRefusal(policy, source, text, scheme)
                if why is not None:
                    return f"agentsandbox refused {tool}, a tool it does not know, whose {key or 'input'} {why}"
                continue
        elif not _pathLike(key, text):
            continue
        if "\0" in text:
            return f"agentsandbox refused {tool}: its {key or 'input'} contains a NUL byte."
        readings = _both(text, cwd, policy.home)
        for mode in ("read", "write"):
            why = decideReadings(policy, source, readings, text, cwd, mode)
            if why is not None:
                return (
                    f"{why} ({tool} is a tool agentsandbox does not know, so every path in its input "
                    f"must be one sessions may both read and write; this one is its {key or 'input'}.)"
                )
    return None


#: How long the hook waits for a name to resolve: Claude Code 2.1.197 runs a tool whose
#: hook timed out (its limit is the drop-in's 10 s), so a slow resolver must not outlast it.
_RESOLVE_SECONDS = 4.0


def _boundedGetaddrinfo(*args: Any) -> Any:
    """``socket.getaddrinfo`` that gives up after ``_RESOLVE_SECONDS`` (an OSError: the name is refused)."""
    import socket
    import threading

    answer: list[Any] = []
    failure: list[BaseException] = []

    def ask() -> None:
        try:
            answer.append(socket.getaddrinfo(*args))
        except BaseException as e:
            failure.append(e)

    asker = threading.Thread(target=ask, daemon=True)
    asker.start()
    asker.join(_RESOLVE_SECONDS)
    if answer:
        return answer[0]
    if failure:
        raise failure[0]
    raise OSError(f"no answer within {_RESOLVE_SECONDS:g} s")


def _boundedAddresses(host: str, port: int) -> Any:
    """Every address of ``host`` as the proxy resolves it, asked of ``_boundedGetaddrinfo``."""
    from agentsandbox.egress.names import addressesFromGetaddrinfo

    return addressesFromGetaddrinfo(host, port, _boundedGetaddrinfo)


def _urlRefusal(policy: Policy, source: str, url: str, scheme: str) -> str | None:
    """Why ``url`` may not be reached, decided as the proxy decides a connection; None when it may."""
    from urllib.parse import urlsplit

    from agentsandbox.allowlist import AllowList, EntryError
    from agentsandbox.egress.gate import Gate
    from agentsandbox.egress.grant import Refusal as GateRefusal

    try:
        parts = urlsplit(url)
        host = parts.hostname
        port = parts.port
    except ValueError as e:
        return f"URL {_quoted(url)} cannot be read ({e})."
    if not host:
        return f"URL {_quoted(url)} names no host."
    if port is None:
        port = _DEFAULT_PORTS.get(scheme)
        if port is None:
            # Not a network address this machine would dial on its own (an MCP
            # server's resource name, say): the server it is handed to is not held.
            return None
    try:
        allow = AllowList.parse(policy.domains)
    except EntryError as e:
        return f"URL {_quoted(url)} cannot be decided: {e}."
    # The proxy's gate, with no parent (Claude Code fetches it itself) and no
    # tunnel to count: the same verdict in the same words as a CONNECT.
    verdict = Gate(allow, maxTunnels=0).decideResolving(host, port, _boundedAddresses)
    if not isinstance(verdict, GateRefusal):
        return None
    return f"URL {_quoted(url)} is refused{_inSource(source)}: {verdict.reason}"


#: The schemes each network tool's URL may have; ``http:`` is also decided as the ``https:``
#: Claude Code upgrades it to.
_NETWORK_SCHEMES = {"WebFetch": ("http", "https"), "Monitor": ("ws", "wss")}


def _fetch(policy: Policy, source: str, tool: str, fields: tuple[str, ...],
           toolInput: Mapping[str, Any]) -> str | None:
    """WebFetch and Monitor's WebSocket run in Claude Code's own process, outside the sandbox and the proxy.

    Each URL is decided as the proxy decides a connection: the host by
    ``sandbox.domains``, every address it resolves to by the address rules.
    """
    schemes = _NETWORK_SCHEMES.get(tool, ("https",))
    for field in fields:
        value: Any = toolInput
        for step in field.split("."):
            value = value.get(step) if isinstance(value, dict) else None
        if value is None and field != "url":
            continue
        url = _text(value, f"tool_input.{field}")
        scheme = _urlScheme(url) or ""
        if scheme not in schemes:
            return (
                f"agentsandbox refused {tool} of {_quoted(url)}: its {field} must be a "
                f"{' or '.join(schemes)} URL."
            )
        upgraded = ("https" + url[len(scheme) :], "https") if scheme == "http" else (url, scheme)
        for candidate, candidateScheme in dict.fromkeys(((url, scheme), upgraded)):
            why = _urlRefusal(policy, source, candidate, candidateScheme)
            if why is not None:
                return f"agentsandbox refused {tool}: its {field} {why}"
    return None


def _gitTop(cwd: str) -> str | None:
    """The nearest directory at or above ``cwd`` holding ``.git`` (a directory or a file)."""
    here = cwd
    while True:
        if os.path.lexists(os.path.join(here, ".git")):
            return here
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent


def _worktree(policy: Policy, source: str, tool: str, toolInput: Mapping[str, Any], cwd: str) -> str | None:
    """EnterWorktree moves the session's working directory, which the sandbox makes writable.

    So it may go only where the session may already write (inside the project,
    ``sandbox.write``, the temp dir), and never to a directory holding a closed
    one: moving there must open nothing new.  With ``path`` it enters that
    worktree; with a ``name`` (or neither) Claude Code makes one under the
    repository's ``.claude/worktrees``.
    """
    given = toolInput.get("path")
    if given is not None and given != "":
        raw = _text(given, "tool_input.path")
    else:
        name = toolInput.get("name")
        top = _gitTop(cwd) or cwd
        raw = os.path.join(top, ".claude", "worktrees")
        if isinstance(name, str) and name:
            raw = os.path.join(raw, name)
    readings = _both(raw, cwd, policy.home, search=True)
    why = decideReadings(policy, source, readings, raw, cwd, "write")
    if why is None:
        return None
    return (
        f"{why} ({tool} makes it the session's working directory, which the sandbox lets commands "
        f"write, so it may only be a directory the session may already write.)"
    )


#: How much of the tree below the cwd ``_skill`` walks for nested ``.claude`` directories.
_SKILL_DEPTH = 8
_SKILL_ENTRIES = 50000


def _walk(root: str, budget: list[int], prune: tuple[str, ...]) -> Iterator[tuple[str, str, bool]]:
    """(path, name, is a directory) of each entry below ``root``, links not followed.

    Directories named in ``prune`` are not entered, nor any deeper than
    ``_SKILL_DEPTH``; past ``budget[0]`` entries (shared by one decision's
    walks) the decision is refused rather than guessed.
    """
    todo = [(root, 0)]
    while todo:
        here, depth = todo.pop()
        try:
            entries = list(os.scandir(here))
        except OSError:
            continue
        for entry in entries:
            budget[0] -= 1
            if budget[0] < 0:
                raise Refusal(f"there are more than {_SKILL_ENTRIES} entries below {root} to check")
            try:
                isDir = entry.is_dir(follow_symlinks=False)
            except OSError:
                isDir = False
            yield entry.path, entry.name, isDir
            if isDir and depth < _SKILL_DEPTH and entry.name not in prune:
                todo.append((entry.path, depth + 1))


def _nestedClaudeDirs(cwd: str, budget: list[int]) -> list[str]:
    """Every ``.claude`` directory below ``cwd`` (.git and node_modules skipped).

    Claude Code discovers a nested ``sub/.claude/skills`` once a file tool
    touched ``sub/``, and any later session started in ``sub`` loads it.
    """
    prune = (".git", "node_modules", ".claude")
    return [path for path, name, _ in _walk(cwd, budget, prune) if name == ".claude"]


#: What a ``.claude`` directory holds that Claude Code loads into the conversation by name:
#: skills (``skills/NAME/SKILL.md``), commands (``commands/**/NAME.md``), subagents
#: (``agents/*.md``, named by their front matter).
_DEFINITIONS = ("skills", "commands", "agents")


def _definitionFiles(base: str, budget: list[int], kinds: tuple[str, ...] = _DEFINITIONS) -> list[str]:
    """Every file below ``base``'s skills, commands and agents, links included (not followed)."""
    return [
        path
        for kind in kinds
        for path, _, isDir in _walk(os.path.join(base, kind), budget, ())
        if not isDir
    ]


def _skill(policy: Policy, source: str, tool: str, toolInput: Mapping[str, Any], cwd: str) -> str | None:
    """Skill (and Agent with a subagent type) load a definition file into the conversation.

    The file a name loads is found by Claude Code's own search (a skill's
    directory, a command's path, an agent's front matter), so the hook does
    not guess which one it is: every skill, command and agent file of every
    ``.claude`` the session can load from (the user's, the cwd's and each
    parent's, every nested one below the cwd) is decided, physically, and one
    that leads through any link to a closed file refuses the call, naming the
    link to remove.  A built-in name that loads no file still meets that check.
    """
    field = "subagent_type" if tool == "Agent" else "skill"
    given = toolInput.get(field)
    if tool == "Agent" and (given is None or given == ""):
        return None
    name = _text(given, f"tool_input.{field}").strip().lstrip("/")
    if not name:
        raise Refusal(f"agentsandbox refused this {tool} call: tool_input.{field} is empty")
    parts = name.replace(":", "/").split("/")
    if any(p in ("", ".", "..") for p in parts) or "\0" in name:
        return f"agentsandbox refused {tool} {_quoted(name)}: it is named by plain words, not a path."
    try:
        closed = closedDefinition(policy, source, cwd)
    except Refusal as r:
        return f"agentsandbox refused {tool} {_quoted(name)}: {r}; start the session in a smaller directory."
    if closed is None:
        return None
    return (
        f"{closed} ({tool} {_quoted(name)} may load it into the conversation: Claude Code finds "
        f"skills, commands and agents by name in every .claude directory; remove the link.)"
    )


def closedDefinition(policy: Policy, source: str, cwd: str) -> str | None:
    """Why the first skill, command or agent file Claude Code may load from ``cwd`` is closed, if one is.

    Every such file of every ``.claude`` the session loads from (the user's,
    the cwd's and each parent's, every nested one below the cwd) is read
    physically.  Raises ``Refusal`` when there are too many entries to check.
    """
    bases = [policy.harness]
    here = cwd
    while True:
        bases.append(os.path.join(here, ".claude"))
        parent = os.path.dirname(here)
        if parent == here:
            break
        here = parent
    budget = [_SKILL_ENTRIES]
    bases += _nestedClaudeDirs(cwd, budget)
    for base in dict.fromkeys(bases):
        for candidate in _definitionFiles(base, budget):
            why = decideReadings(policy, source, _both(candidate, cwd, policy.home), candidate, cwd, "read")
            if why is not None:
                return why
    return None


def _shown(tool: str, toolInput: Mapping[str, Any], cwd: str) -> str:
    """The path as the model wrote it, for the reason."""
    field = {"Glob": "pattern", "Grep": "path", "NotebookEdit": "notebook_path"}.get(tool, "file_path")
    given = toolInput.get(field)
    return given if isinstance(given, str) and given else cwd


def decideReadings(
    policy: Policy, source: str, readings: list[Reading], shown: str, cwd: str, mode: str
) -> str | None:
    """The reason the first closed reading is refused, or None when every reading is open."""
    seen: set[tuple[str, bool]] = set()
    for r in readings:
        if (r.path, r.search) in seen:
            continue
        seen.add((r.path, r.search))
        if mode == "write" and policy.whyWritable(r.path, cwd) is None:
            return _refuse(policy, source, r, shown, cwd, "write")
        if mode == "read" and policy.whyReadable(r.path, cwd) is None:
            return _refuse(policy, source, r, shown, cwd, "read")
        if r.search:
            closed = policy.closedBelow(r.path, cwd)
            if closed is not None:
                return (
                    f"agentsandbox refused to search {_quoted(shown)}{_readAs(policy, r, shown, cwd)}: "
                    f"the search would descend into {closed}, which sessions may not read. Search "
                    f"a directory inside the paths in sandbox.read or sandbox.write instead."
                )
    return None


def _policy(environ: Mapping[str, str]) -> tuple[Policy, str]:
    try:
        return cachedPolicy(environ)
    except PolicyUnavailable as e:
        raise Refusal(
            f"agentsandbox refused this call because its config cannot be loaded, so no "
            f"file access is allowed until it is fixed: {e}"
        ) from None


# --------------------------------------------------------------------------- the policy cache

_CACHE_NAME = "policy-cache.json"

#: The variables the policy depends on besides the config file.
_CACHE_ENV = (
    "HOME",
    "XDG_CONFIG_HOME",
    "XDG_STATE_HOME",
    "XDG_RUNTIME_DIR",
    "CLAUDE_CONFIG_DIR",
    "AGENTSANDBOX_EXE",
)


class PolicyUnavailable(Exception):
    """No policy can be built: the config cannot be loaded.  The text says why."""


def _cacheKey(environ: Mapping[str, str]) -> list[object]:
    """What the cached policy was built from: the user's and the machine's config, the accounts."""
    from agentsandbox import __version__, paths

    fileKeys: list[object] = []
    for source in (paths.locateConfig(None, environ), paths.SYSTEM_CONFIG, "/etc/passwd", "/etc/login.defs"):
        if source is None:
            fileKeys.append(None)
            continue
        try:
            st = os.stat(source)
        except FileNotFoundError:
            fileKeys.append([source])
            continue
        fileKeys.append([source, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns])
    return [__version__, fileKeys, [environ.get(n) for n in _CACHE_ENV]]


def cachedPolicy(environ: Mapping[str, str]) -> tuple[Policy, str]:
    """The policy and its config's source, parsing the config only when it changed.

    The hook runs on every file-tool call; parsing and validating TOML costs
    more than its whole budget.  The cache sits in the state dir, which sessions
    cannot write; it is ignored when the policy it holds would let a session
    write it, or when it is not a private file of this user.  Raises
    ``PolicyUnavailable`` (carrying the ConfigError's text) when the config
    cannot be loaded.  Only a miss imports the config loader (and TOML).

    The policy is for one decision: it resolves each path once
    (``Policy.remembering``), the cache's own check included.
    """
    from agentsandbox.paths import Paths
    from agentsandbox.policy import Policy

    path = os.path.join(Paths.fromEnvironment(environ).stateDir, _CACHE_NAME)
    try:
        key = _cacheKey(environ)
    except OSError:
        key = None
    if key is not None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_uid == os.getuid() and not st.st_mode & 0o022:
                    data = loads(f.read())
                    if data.get("key") == key:
                        policy = Policy.fromDict(data["policy"], environ).remembering()
                        if not policy.writable(path, "/"):
                            return policy, str(data["source"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
    from agentsandbox.config import ConfigError
    from agentsandbox.loader import load

    try:
        config = load(None, environ)
    except ConfigError as e:
        raise PolicyUnavailable(str(e)) from None
    policy = Policy.fromConfig(config, environ).remembering()
    if key is not None and not policy.writable(path, "/"):
        _writeCache(path, {"key": key, "source": config.source, "policy": policy.toDict()})
    return policy, config.source


def _writeCache(path: str, data: dict[str, object]) -> None:
    import json

    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def _quoted(shown: str) -> str:
    """The path as given; quoted when it holds what the text would hide, cut when very long."""
    if len(shown) > 512:
        shown = f"{shown[:512]}...({len(shown)} characters)"
    return repr(shown) if jsTrim(shown) != shown or not shown.isprintable() else shown


def _readAs(policy: Policy, reading: Reading, shown: str, cwd: str) -> str:
    """How ``shown`` was read, where the reason would not make that plain."""
    real = policy._resolve(reading.path, cwd)
    if reading.physical:
        return f" (which the file system resolves, links before '..', to {real})"
    if jsTrim(shown) != shown:
        trimmed = f" (read as {reading.path}"
        return trimmed + (")" if real == reading.path else f", a link to {real})")
    return "" if real == reading.path else f" (a link to {real})"


def _refuse(policy: Policy, source: str, reading: Reading, shown: str, cwd: str, mode: str) -> str:
    path = reading.path
    where = f" in {source}" if source.startswith("/") else ""
    what = _quoted(shown) + _readAs(policy, reading, shown, cwd)
    process = policy.processPath(path, cwd)
    if process is not None:
        return (
            f"agentsandbox refused to {mode} {what}: it is inside {process}, which names the "
            f"reading process's own objects (Claude Code's environment, memory and open files), "
            f"so the file tools may not use it; no config key opens it."
        )
    denied = policy.deniedBy(path, cwd)
    if denied is not None:
        return (
            f"agentsandbox refused to {mode} {what}: it is inside {denied}, which sandbox.deny "
            f"closes both ways{where}. Remove it from sandbox.deny to open it."
        )
    if mode == "write":
        return (
            f"agentsandbox refused to write {what}: sessions write their working directory, "
            f"the temp dir and the paths in sandbox.write. To allow it, add it or a parent "
            f"to sandbox.write{where}."
        )
    return (
        f"agentsandbox refused to read {what}: the home and runtime directories are closed "
        f"except the paths in sandbox.read and sandbox.write, and credentials stay unreadable "
        f"by design. To allow it, add it or a parent to sandbox.read{where}."
    )


def pretooluse(stdin: IO[bytes], environ: Mapping[str, str]) -> str:
    """The hook's whole stdout for one call: a deny line, or nothing."""
    try:
        raw = stdin.read(MAX_INPUT + 1)
        if len(raw) > MAX_INPUT:
            return deny(f"agentsandbox refused this call: the hook's input is over {MAX_INPUT} bytes")
        if not raw.strip():
            return deny("agentsandbox refused this call: the hook's input is empty")
        try:
            event = loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            return deny(f"agentsandbox refused this call: the hook's input is not JSON ({e})")
        reason = decide(event, environ)
        return "" if reason is None else deny(reason)
    except Refusal as r:
        return deny(str(r))
    except Exception as e:  # fail closed on anything
        return deny(f"agentsandbox refused this call: the hook failed ({type(e).__name__}: {e})")


# --------------------------------------------------------------------------- session start


def credentialNames(
    environ: Mapping[str, str], patterns: tuple[str, ...], keep: tuple[str, ...]
) -> list[str]:
    """Variables of Claude Code's environment that look like credentials, sorted."""
    import re
    from fnmatch import fnmatchcase

    return sorted(
        name
        for name in environ
        if re.fullmatch(_NAME, name)
        and any(fnmatchcase(name, p) for p in patterns)
        and not any(fnmatchcase(name, k) for k in keep)
    )


def sessionLines(
    environ: Mapping[str, str], cwd: str | None = None, session: str | None = None
) -> tuple[list[str], list[str]]:
    """(lines for $CLAUDE_ENV_FILE, messages for the user); ``cwd`` is the session's, when known;
    ``session`` is Claude Code's session id, which the proxy's records then carry."""
    from agentsandbox.config import DEFAULT_UNSET_ENV, ConfigError
    from agentsandbox.loader import load
    from agentsandbox.policy import Policy

    messages: list[str] = []
    try:
        config = load(None, environ)
    except ConfigError as e:
        names = credentialNames(environ, DEFAULT_UNSET_ENV, ())
        messages.append(f"agentsandbox: the config cannot be loaded ({e}); file tools are refused until it is fixed.")
        return ([f"unset {n}" for n in names], messages)
    policy = Policy.fromConfig(config, environ)
    exports = dict(policy.sessionVars())
    exports.update(_egressVars(policy.egress, policy.exe))
    # Claude Code sources this file inside the sandbox, after its own --setenv:
    # the narrowed NO_PROXY wins there (measured on 2.1.197 and the newest).
    exports.update(policy.proxyVars())
    names = [
        n
        for n in credentialNames(environ, config.sandbox.unset_env, config.sandbox.keep_env)
        if n not in exports
    ]
    import shlex

    lines = [f"export {k}={shlex.quote(v)}" for k, v in sorted(exports.items())]
    lines += [f"unset {n}" for n in names]
    if session is not None:
        credential, unregistered = registerSession(session, policy.spool)
        if credential is not None:
            lines += sessionCredentialLines(session, credential)
        elif config.proxy.require_session:
            messages.append(f"agentsandbox: this session has no proxy credential ({unregistered}); with "
                            "proxy.require_session its commands cannot reach the network.")
    from agentsandbox.claude import drift, machinePolicy

    try:
        why = drift(machinePolicy(environ))
    except ConfigError as e:
        why = f"the machine's config does not load ({e})"
    if why is not None:
        messages.append(f"agentsandbox: {why}. The admin renders it: `sudo agentsandbox install`.")
    for notice in config.notices:
        messages.append(f"agentsandbox: {notice}.")
    if config.proxy.unlisted == "observe":
        messages.append(OBSERVING)
    if cwd is not None and cwd.startswith("/"):
        messages += _definitionWarnings(policy, config.source, cwd)
    return lines, messages


#: Said at every session start while the machine only observes (issue 28).
OBSERVING = (
    "agentsandbox: OBSERVING, NOT ENFORCING: proxy.unlisted = \"observe\" lets this session's commands "
    "reach hosts off sandbox.domains (each recorded as \"would refuse\"; address rules still refuse). "
    "`agentsandbox suggest` turns them into an allow list."
)

#: The proxy variables whose URL gets the session's credential as its userinfo.
PROXY_URL_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy")


def registerSession(session: str, spool: str, timeout: float = 2.0) -> tuple[str | None, str]:
    """A fresh credential for ``session``, registered (its SHA-256 only) with the
    running service through the broker's ``session`` op; (None, why) when that fails."""
    from agentsandbox.broker.client import BrokerError, ask
    from agentsandbox.egress.sessions import SESSION_ID, digest, newCredential

    if not SESSION_ID.fullmatch(session):
        return None, f"{session[:80]!r} is not a session name the proxy takes"
    credential = newCredential()
    try:
        ask("session", spool, timeout, args=(session, digest(credential)))
    except BrokerError as e:
        return None, str(e)
    except OSError as e:
        return None, f"the broker's spool {spool}: {e.strerror or e}"
    return credential, ""


def sessionCredentialLines(session: str, credential: str) -> list[str]:
    """Shell lines that put ``credential`` into the userinfo of each proxy URL the
    sandbox set (replacing its placeholder), in the shell's own expansions: the
    credential never reaches an argv.  Sourced inside the sandbox, after the
    sandbox's own variables (egress/sessions.py, docs/injection.md)."""
    import shlex

    return [f"export AGENTSANDBOX_SESSION={shlex.quote(session)}", *proxyUserinfoLines(credential)]


def proxyUserinfoLines(credential: str) -> list[str]:
    """The shell that sets ``agentsandbox:CREDENTIAL@`` as every proxy URL's userinfo;
    ``credential`` is a shell word (the credential itself, which is URL- and
    shell-safe, or ``"$VARIABLE"``)."""
    from agentsandbox.egress.sessions import USER

    v, u, r = "__agentsandbox_v", "__agentsandbox_u", "__agentsandbox_r"
    return [
        f"__agentsandbox_c={USER}:{credential}@",
        f"for {v} in {' '.join(PROXY_URL_VARS)}; do "
        rf'eval "{u}=\${{${v}-}}"; '
        f'case "${u}" in *://*) {r}="${{{u}#*://}}"; '
        f'case "${{{r}%%/*}}" in *@*) {r}="${{{r}#*@}}";; esac; '
        f'export "${v}=${{{u}%%://*}}://$__agentsandbox_c${r}";; esac; done',
        f"unset {v} {u} {r} __agentsandbox_c",
    ]


def _definitionWarnings(policy: Policy, source: str, cwd: str) -> list[str]:
    """A warning for a skill, command or agent file that leads to a closed file.

    Claude Code reads every SKILL.md when a session starts and sends the first
    line of one without front matter to the model as its description, before
    any tool call: no hook can refuse that (docs/hook.md).  The person is told
    which link to remove; the Skill and Agent calls that would load it are
    refused.
    """
    try:
        closed = closedDefinition(policy.remembering(), source, cwd)
    except Refusal:
        return []
    if closed is None:
        return []
    return [
        "agentsandbox: WARNING: a skill, command or agent file of this session leads to a closed "
        f"file, and Claude Code sends a line of it to the model when it lists skills: {closed}"
    ]


# --------------------------------------------------------------------------- before the session


#: What Claude Code reads into the first request from a ``.claude`` directory besides the
#: definitions: its memory (``CLAUDE.md``) and rules (``rules/**/*.md``), whole.
_MEMORY_KINDS = ("rules",)
#: Memory files beside a ``.claude`` directory, read whole at start (the cwd's and each parent's).
_MEMORY_FILES = ("CLAUDE.md", "CLAUDE.local.md")
#: How deep Claude Code follows ``@path`` imports from a memory file.
_IMPORT_DEPTH = 5
_IMPORT_BYTES = 1024 * 1024


def _imports(path: str, home: str) -> list[str]:
    """The existing files a memory file names as ``@path`` imports (relative to it, ``~/``, absolute)."""
    import re

    try:
        with open(path, "rb") as f:
            text = f.read(_IMPORT_BYTES).decode("utf-8", "replace")
    except OSError:
        return []
    found = []
    for m in re.finditer(r"(?:^|\s)@((?:[^\s\\]|\\ )+)", text):
        name = m.group(1).replace("\\ ", " ")
        if name.startswith("~/"):
            name = os.path.join(home, name[2:])
        target = os.path.normpath(os.path.join(os.path.dirname(path), name))
        if os.path.lexists(target):
            found.append(target)
    return found


def listedAtStart(policy: Policy | None, cwd: str, harness: str, home: str | None = None) -> str | None:
    """Why Claude Code must not start a session in ``cwd``: what it sends at start leads to a closed file.

    When a session starts, before any hook runs, Claude Code reads, following
    links, and sends to the model: a line of every skill, command and agent
    file (of a file without front matter, its first line, as the
    description), and whole every memory file (``CLAUDE.md``,
    ``CLAUDE.local.md``, ``.claude/CLAUDE.md``, ``.claude/rules/**``) and the
    files they import (``@path``), of the user's ``.claude`` (``harness``) and
    of the cwd and each parent (measured on 2.1.197 and 2.1.335).

    A file there that leads, through a link, out of where it was found to a
    file sessions may not read is that file on its way to the model: a cloned
    repository carrying such a link, or one sandboxed Bash planted in a
    writable parent's ``.claude`` for the next session.  Where it was found:
    for a ``.claude``'s files, that ``.claude`` (the user's wherever it
    resolves to; a project's in the physical directory holding it); for a
    memory file beside a ``.claude``, itself; for an import, the path it
    names, read from the importing file's own directory.  What lies where it
    was found is the checkout's or the user's own and is not judged (the user
    started Claude Code there), and the user's ``.claude`` is judged only
    where a session may write (a dotfiles link there is the user's own).
    Without a ``policy`` (the config cannot be loaded) every such link
    counts.  Nested ``.claude`` directories below the cwd are not read at
    start (the file tools refuse the directories that would make 2.1.197 list
    one).  Raises ``Refusal`` when there are too many entries to check.
    """
    from agentsandbox.policy import under

    home = home or (policy.home if policy is not None else os.path.dirname(harness))

    def physical(path: str) -> str:
        return os.path.realpath(path) if policy is None else policy._resolve(path, "/")

    def closed(path: str) -> bool:
        return policy is None or policy.whyReadable(path, cwd) is None

    def own(path: str) -> bool:
        """A link in the user's .claude where no session may write is the user's own (dotfiles)."""
        return (policy is not None and under(path, harness)
                and policy.whyWritable(os.path.dirname(path), cwd) is None)

    bases = {harness: physical(harness)}
    memory: list[tuple[str, str]] = []
    here = cwd
    while True:
        real = physical(here)
        bases.setdefault(os.path.join(here, ".claude"), os.path.join(real, ".claude"))
        memory += [(os.path.join(here, name), os.path.join(real, name)) for name in _MEMORY_FILES]
        parent = os.path.dirname(here)
        if parent == here:
            break
        here = parent
    budget = [_SKILL_ENTRIES]
    found: list[tuple[str, str, bool]] = []
    for base, inside in bases.items():
        found += [(f, inside, False) for f in _definitionFiles(base, budget)]
        found += [(f, inside, True) for f in _definitionFiles(base, budget, _MEMORY_KINDS)]
        found.append((os.path.join(base, "CLAUDE.md"), inside, True))
    found += [(f, where, True) for f, where in memory]
    seen: set[str] = set()
    depth = 0
    while found:
        imported: list[tuple[str, str, bool]] = []
        for candidate, where, whole in found:
            if candidate in seen or not os.path.lexists(candidate):
                continue
            seen.add(candidate)
            real = physical(candidate)
            if own(candidate):
                continue
            if not under(real, where) and closed(candidate):
                what = "whole" if whole else "a line of it (a skill, command or agent's description)"
                return (
                    f"{candidate} leads to {real}, "
                    f"{'which sessions may not read' if policy is not None else 'a link out of where it lies'}, "
                    f"and Claude Code sends {what} to the model when a session starts, before any hook "
                    f"can refuse it. Remove the link (or open its target in sandbox.read) and start "
                    f"the session again."
                )
            if whole and depth < _IMPORT_DEPTH:
                # An import lies where its name says, read from the importing file's own directory.
                at = os.path.dirname(candidate)
                for target in _imports(candidate, home):
                    imported.append((target, os.path.normpath(os.path.join(physical(at), os.path.relpath(target, at))),
                                     True))
        found = imported
        depth += 1
    return None


def sessionDir() -> str | None:
    """The directory of the Claude Code process that started this one (its session's cwd).

    Claude Code never changes its own working directory.  2.1.197 starts its
    policy helper there; 2.1.335 starts it in ``/``: the parent's ``cwd``
    link is what both agree on.
    """
    try:
        return os.readlink(f"/proc/{os.getppid()}/cwd")
    except OSError:
        return None


def policyHelper(environ: Mapping[str, str], cwd: str | None) -> tuple[int, str]:
    """The policy helper's first check: (0, ``{}``) lets the session start, (1, why) refuses it.

    ``policyhelper.main`` asks it before it prints the session's settings:
    Claude Code runs the helper before a session starts (and before any
    request), in ``-p`` and interactive mode alike, and refuses the session
    when it exits non-zero, printing what it wrote to stderr.  Fails closed:
    a session directory that cannot be told, too many entries to check, or
    any error refuses; with a config that cannot be loaded, any definition
    that links out of its ``.claude`` refuses, naming it (the config's own
    error then stops the session in ``policyhelper.main``).
    """
    prefix = "agentsandbox refused to start this Claude Code session: "
    try:
        if cwd is None or not cwd.startswith("/"):
            return 1, prefix + "the session's working directory cannot be told (/proc/PPID/cwd)."
        from agentsandbox.paths import Paths

        policy: Policy | None
        try:
            policy, _ = cachedPolicy(environ)
            harness = policy.harness
        except PolicyUnavailable:
            # The file tools refuse everything until the config is fixed (and
            # SessionStart says why): the session may start unless a link counts.
            policy, harness = None, Paths.fromEnvironment(environ).claudeDir
        why = listedAtStart(policy, cwd, harness, environ.get("HOME"))
        if why is not None and policy is None:
            why += " (The config cannot be loaded, so every such link counts.)"
    except Refusal as r:
        return 1, prefix + f"{r}; start the session in a smaller directory."
    except Exception as e:
        return 1, prefix + f"the check failed ({type(e).__name__}: {e})."
    return (0, "{}") if why is None else (1, prefix + why)


def _egressVars(egressDir: str | None, exe: str) -> dict[str, str]:
    if egressDir is None:
        return {}
    from agentsandbox.egressdir import egressVars, signingGitConfig

    exported: dict[str, str] = egressVars(egressDir, signingGitConfig(egressDir, exe))
    return exported


def sessionstart(environ: Mapping[str, str], cwd: str | None = None, session: str | None = None) -> str:
    """Append the session's environment to $CLAUDE_ENV_FILE; stdout is the hook's JSON."""
    messages: list[str] = []
    try:
        lines, messages = sessionLines(environ, cwd, session)
        target = environ.get("CLAUDE_ENV_FILE")
        if not target:
            messages.append("agentsandbox: CLAUDE_ENV_FILE is not set; sandboxed Bash keeps Claude Code's environment.")
        else:
            fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "a") as f:
                f.write("".join(line + "\n" for line in lines))
    except Exception as e:
        messages.append(f"agentsandbox: the SessionStart hook failed ({type(e).__name__}: {e}).")
    if not messages:
        return ""
    import json

    return json.dumps({"systemMessage": " ".join(messages)}, ensure_ascii=True) + "\n"


def _emit(text: str) -> None:
    """Write the hook's stdout as bytes; a write that fails leaves the static deny."""
    out = sys.stdout.buffer
    try:
        out.write(text.encode("ascii"))
        out.flush()
    except Exception:
        _lastResort()


def _lastResort() -> None:
    try:
        os.write(1, LAST_RESORT)
    except BaseException:
        pass


def main(argv: list[str]) -> int:
    if argv == ["pretooluse"]:
        # Claude Code 2.1.197 runs a tool whose hook exited non-zero or printed
        # something it cannot parse: whatever happens here, exit 0 with a deny.
        try:
            _emit(pretooluse(sys.stdin.buffer, os.environ))
        except BaseException:
            _lastResort()
        return 0
    if argv == ["sessionstart"]:
        cwd: str | None = None
        session: str | None = None
        try:
            event = loads(sys.stdin.buffer.read(MAX_INPUT))
            given = event.get("cwd") if isinstance(event, dict) else None
            cwd = given if isinstance(given, str) else None
            named = event.get("session_id") if isinstance(event, dict) else None
            session = named if isinstance(named, str) else None
        except Exception:
            pass
        sys.stdout.write(sessionstart(os.environ, cwd, session))
        return 0
    print("usage: agentsandbox hook pretooluse|sessionstart  (run by Claude Code; JSON on stdin)", file=sys.stderr)
    if argv and argv[0] == "pretooluse":
        sys.stdout.write(deny("agentsandbox refused this call: the hook was started with unknown arguments"))
        return 0
    return 2
