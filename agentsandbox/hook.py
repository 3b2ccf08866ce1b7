"""Claude Code hooks: PreToolUse holds the file tools to the policy; SessionStart
gives sandboxed Bash the per-user environment and takes the credentials away.

The sandbox (bubblewrap) wraps only the Bash tool; Read, Grep, Glob, Edit, Write
and NotebookEdit run in Claude Code's own process, so this hook is what holds
them.  It fails closed: bad input, a config that cannot be loaded, or any
exception denies the call with a reason.  Claude Code 2.1.197 runs a tool whose
hook crashed, so a crash must never escape as a traceback.

Stdlib only, and kept small: it runs on every file-tool call.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from fnmatch import fnmatchcase

# Importing typing costs the hook more than its decision; mypy reads this name
# as true all the same.
TYPE_CHECKING = False

if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import IO, Any

    from agentsandbox.policy import Policy

MAX_INPUT = 1024 * 1024

READ_TOOLS = {"Read": "file_path", "Grep": "path", "Glob": "path"}
WRITE_TOOLS = {"Edit": "file_path", "MultiEdit": "file_path", "Write": "file_path", "NotebookEdit": "notebook_path"}
_GLOB_CHARS = re.compile(r"[*?\[{\\]")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class Refusal(Exception):
    """A file-tool call the hook denies; the message is the reason Claude sees."""


def deny(reason: str) -> str:
    return (
        json.dumps(
            {
                "hookSpecificOutput": {
                    "hookEventName": "PreToolUse",
                    "permissionDecision": "deny",
                    "permissionDecisionReason": reason,
                }
            },
            ensure_ascii=False,
        )
        + "\n"
    )


def globRoot(pattern: str, base: str) -> str:
    """The highest directory a Glob ``pattern`` searched from ``base`` can reach.

    The literal components before the first wildcard are the root.  After it a
    ``..`` can still climb (``*/../..``): each wildcard descends at least one
    level (``**`` at least none) and each ``..`` climbs one, so the root is
    raised to the lowest depth the pattern can reach.
    """
    parts = pattern.split("/")
    literal: list[str] = []
    rest: list[str] = []
    for i, part in enumerate(parts):
        if _GLOB_CHARS.search(part):
            rest = parts[i:]
            break
        literal.append(part)
    if pattern.startswith("/"):
        root = "/" + "/".join(p for p in literal if p)
    else:
        root = os.path.join(base, *[p for p in literal if p])
    root = os.path.normpath(root)
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


def _text(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise Refusal(f"agentsandbox refused this call: {field} is not a string")
    if "\0" in value:
        raise Refusal(f"agentsandbox refused this call: {field} contains a NUL byte")
    return value


def decide(event: Any, environ: Mapping[str, str]) -> str | None:
    """The deny reason for one PreToolUse event, or None to let it pass."""
    if not isinstance(event, dict):
        raise Refusal("agentsandbox refused this call: the hook's input is not a JSON object")
    tool = event.get("tool_name")
    if not isinstance(tool, str):
        raise Refusal("agentsandbox refused this call: the hook's input has no tool_name")
    if tool not in READ_TOOLS and tool not in WRITE_TOOLS:
        return None
    toolInput = event.get("tool_input")
    if not isinstance(toolInput, dict):
        raise Refusal(f"agentsandbox refused this {tool} call: tool_input is missing")
    cwd = _text(event.get("cwd"), "cwd")
    if not os.path.isabs(cwd):
        raise Refusal(f"agentsandbox refused this {tool} call: cwd {cwd!r} is not absolute")

    if tool in WRITE_TOOLS:
        field = WRITE_TOOLS[tool]
        path = _text(toolInput.get(field), f"tool_input.{field}")
        if not path:
            raise Refusal(f"agentsandbox refused this {tool} call: tool_input.{field} is empty")
        checks = [(path, path, "write")]
    elif tool == "Read":
        path = _text(toolInput.get("file_path"), "tool_input.file_path")
        if not path:
            raise Refusal("agentsandbox refused this Read call: tool_input.file_path is empty")
        checks = [(path, path, "read")]
    else:
        given = toolInput.get("path")
        base = cwd if given is None or given == "" else _text(given, "tool_input.path")
        checks = [(base, base, "read")]
        if tool == "Glob":
            pattern = _text(toolInput.get("pattern"), "tool_input.pattern")
            if pattern.startswith(("/", "~/")):
                checks = []
            absBase = base if os.path.isabs(base) else os.path.join(cwd, base)
            home = environ.get("HOME", "")
            if pattern.startswith("~/") and home:
                pattern = os.path.join(home, pattern[2:])
            if home and absBase.startswith("~/"):
                absBase = os.path.join(home, absBase[2:])
            root = globRoot(pattern, absBase)
            checks.append((root, pattern, "read"))

    policy, source = _policy(environ)
    for path, shown, mode in checks:
        if mode == "write" and policy.whyWritable(path, cwd) is None:
            return _refuse(policy, source, path, shown, cwd, "write")
        if mode == "read" and policy.whyReadable(path, cwd) is None:
            return _refuse(policy, source, path, shown, cwd, "read")
        if tool in ("Grep", "Glob"):
            closed = policy.closedBelow(path, cwd)
            if closed is not None:
                return (
                    f"agentsandbox refused to search {shown}: the search would descend into "
                    f"{closed}, which sessions may not read. Search a directory inside the "
                    f"paths in sandbox.read or sandbox.write instead."
                )
    return None


def _policy(environ: Mapping[str, str]) -> tuple[Policy, str]:
    from agentsandbox.policy import PolicyUnavailable, cachedPolicy

    try:
        return cachedPolicy(environ)
    except PolicyUnavailable as e:
        raise Refusal(
            f"agentsandbox refused this call because its config cannot be loaded, so no "
            f"file access is allowed until it is fixed: {e}"
        ) from None


def _linkNote(policy: Policy, path: str, cwd: str) -> str:
    """`` (a link to TARGET)`` when symlinks take ``path`` elsewhere: the target is what was refused."""
    from agentsandbox.policy import resolve

    literal = path
    if path == "~":
        literal = policy.home
    elif path.startswith("~/"):
        literal = os.path.join(policy.home, path[2:])
    plain = os.path.normpath(os.path.join(cwd, literal))
    if plain.startswith("//"):
        plain = "/" + plain.lstrip("/")
    real = resolve(path, cwd, policy.home)
    return "" if real == plain else f" (a link to {real})"


def _refuse(policy: Policy, source: str, path: str, shown: str, cwd: str, mode: str) -> str:
    denied = policy.deniedBy(path, cwd)
    where = f" in {source}" if source.startswith("/") else ""
    shown += _linkNote(policy, path, cwd)
    if denied is not None:
        return (
            f"agentsandbox refused to {mode} {shown}: it is inside {denied}, which sandbox.deny "
            f"closes both ways{where}. Remove it from sandbox.deny to open it."
        )
    if mode == "write":
        return (
            f"agentsandbox refused to write {shown}: sessions write their working directory, "
            f"the temp dir and the paths in sandbox.write. To allow it, add it or a parent "
            f"to sandbox.write{where}."
        )
    return (
        f"agentsandbox refused to read {shown}: the home and runtime directories are closed "
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
            event = json.loads(raw)
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
    return sorted(
        name
        for name in environ
        if _NAME.match(name)
        and any(fnmatchcase(name, p) for p in patterns)
        and not any(fnmatchcase(name, k) for k in keep)
    )


def sessionLines(environ: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """(lines for $CLAUDE_ENV_FILE, messages for the user)."""
    from agentsandbox.config import DEFAULT_UNSET_ENV, ConfigError, load
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
    lines = [f"export {k}={shlex.quote(v)}" for k, v in sorted(exports.items())]
    lines += [f"unset {n}" for n in names]
    from agentsandbox.claude import drift

    why = drift(policy)
    if why is not None:
        messages.append(
            f"agentsandbox: {why}. Run `agentsandbox install` (it prints the root commands if needed)."
        )
    return lines, messages


def _egressVars(egressDir: str | None, exe: str) -> dict[str, str]:
    if egressDir is None:
        return {}
    from agentsandbox.egressdir import egressVars, signingGitConfig

    exported: dict[str, str] = egressVars(egressDir, signingGitConfig(egressDir, exe))
    return exported


def sessionstart(environ: Mapping[str, str]) -> str:
    """Append the session's environment to $CLAUDE_ENV_FILE; stdout is the hook's JSON."""
    messages: list[str] = []
    try:
        lines, messages = sessionLines(environ)
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
    return json.dumps({"systemMessage": " ".join(messages)}, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    if argv == ["pretooluse"]:
        sys.stdout.write(pretooluse(sys.stdin.buffer, os.environ))
        return 0
    if argv == ["sessionstart"]:
        try:
            sys.stdin.buffer.read(MAX_INPUT)
        except Exception:
            pass
        sys.stdout.write(sessionstart(os.environ))
        return 0
    print("usage: agentsandbox hook pretooluse|sessionstart  (run by Claude Code; JSON on stdin)", file=sys.stderr)
    if argv and argv[0] == "pretooluse":
        sys.stdout.write(deny("agentsandbox refused this call: the hook was started with unknown arguments"))
        return 0
    return 2
