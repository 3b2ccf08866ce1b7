"""Every tool a real Claude Code release offers the model, captured offline.

Claude Code sends its tool list with each Messages API request; the mock
records the bodies, so the list is read from what the binary really sends, not
from its documentation.  Two things hide tools from a plain run:

* **Deferred loading.**  With tool search on (2.1.335 by default; 2.1.197 only
  with ``ENABLE_TOOL_SEARCH=true``, since it turns tool search off for a
  non-Anthropic ``ANTHROPIC_BASE_URL``) the request carries a ``ToolSearch``
  tool and names the other tools only in a ``<system-reminder>`` of the first
  user message ("The following deferred tools are now available via
  ToolSearch…", one name a line); 2.1.335 also sends a schemaless
  ``DeferredToolPlaceholder`` with ``defer_loading: true``.  A tool's schema
  arrives once the model calls ``ToolSearch {"query": "select:A,B"}``: the
  tool result holds ``tool_reference`` blocks and the next request's ``tools``
  carries the full tools, flagged ``defer_loading: true``.
* **Optional tools.**  Some appear only under a setting, a variable or a
  feature flag: ``TodoWrite`` (``CLAUDE_CODE_ENABLE_TASKS=false`` replaces the
  Task* tools with it), ``PowerShell`` (``CLAUDE_CODE_USE_POWERSHELL_TOOL=1``),
  ``ListMcpResourcesTool``/``ReadMcpResourceTool``/``ReadMcpResourceDirTool``
  (an MCP server with resources is configured), ``Glob``/``Grep`` (only when
  named in ``--allowedTools`` in ``-p`` mode), and on 2.1.197 ``Monitor``,
  ``PushNotification`` and ``DesignSync`` (GrowthBook flags, read from the
  cache in ``~/.claude.json`` when non-essential traffic is not disabled).

So each binary is run three times (about 2 s each), in a throwaway home under /var/tmp:

1. **optional**: tool search off, the variables above, a probe MCP server, the
   flags in the cached GrowthBook features, and every outgoing proxy variable
   pointing at a closed loopback port (non-essential traffic is allowed here so
   the cached flags are read, and must not get anywhere).
2. **deferred**: tool search forced on, no call: which tools are deferred.
3. **selected**: the same, and the mock calls ``ToolSearch`` with ``select:``
   and every name runs 1 and 2 showed, so each deferred tool's schema is the
   one ToolSearch hands out.  A deferred name whose schema never arrives stays
   in the result with an empty schema.

The probe MCP server's own tools (``mcp__agentsandbox-probe__*``) are left out:
they are this module's, not Claude Code's.  Results are cached per binary for
the test session.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Container, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .claude_harness import ALLOWED_TOOLS, MODEL, ClaudeBinary, ManagedSettingsGuard
from .mock_messages import MockMessagesAPI, ToolCall, scriptPrompt

PROBE_SERVER = "agentsandbox-probe"
PROBE_PREFIX = f"mcp__{PROBE_SERVER}__"
RUN_TIMEOUT = 120.0
#: GrowthBook flags that gate a tool (code: the tool's ``isEnabled``); set
#: true in the cached features so the optional run sees those tools.
TOOL_FLAGS = (
    "tengu_amber_sentinel",  # Monitor (2.1.197)
    "tengu_kairos_push_notifications",  # PushNotification
    "tengu_kairos_cron",  # CronCreate/CronDelete/CronList (default on)
    "tengu_surreal_dali",  # RemoteTrigger (also needs a claude.ai login)
    "tengu_send_user_file",  # SendUserFile (also needs a remote session)
)
#: Variables that switch optional tools on.
OPTIONAL_ENV = {
    "CLAUDE_CODE_ENABLE_TASKS": "false",  # TodoWrite instead of TaskCreate/Get/List/Update
    "CLAUDE_CODE_USE_POWERSHELL_TOOL": "1",
    "ENABLE_LSP_TOOL": "1",
}
#: Every proxy variable Claude Code or Bun reads, at a port nothing listens on.
DEAD_PROXY = "http://127.0.0.1:9"
DEFERRED_HEADER = "deferred tools are now available via ToolSearch"

#: A stdio MCP server with one tool and one resource: enough for Claude Code to
#: offer its MCP resource tools.  Newline-delimited JSON-RPC, stdlib only.
PROBE_MCP_SERVER = r'''
import json, sys
def send(o):
    sys.stdout.write(json.dumps(o) + "\n"); sys.stdout.flush()
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    i, method = m.get("id"), m.get("method")
    if i is None:
        continue
    if method == "initialize":
        r = {"protocolVersion": m.get("params", {}).get("protocolVersion", "2024-11-05"),
             "capabilities": {"tools": {}, "resources": {}}, "serverInfo": {"name": "probe", "version": "1"}}
    elif method == "tools/list":
        r = {"tools": [{"name": "echo", "description": "echo",
                        "inputSchema": {"type": "object", "properties": {"x": {"type": "string"}}}}]}
    elif method == "resources/list":
        r = {"resources": [{"uri": "probe://r", "name": "r"}]}
    elif method == "resources/templates/list":
        r = {"resourceTemplates": []}
    else:
        r = {}
    send({"jsonrpc": "2.0", "id": i, "result": r})
'''


@dataclass(frozen=True)
class Capture:
    """What one binary offered: every tool's input schema, and which were deferred."""

    release: str
    tools: dict[str, dict[str, Any]]
    deferred: frozenset[str]
    requests: int


# --- reading request bodies ----------------------------------------------------------


def toolSchemas(body: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Name -> ``input_schema`` of each tool in one request (deferred placeholders too)."""
    out: dict[str, dict[str, Any]] = {}
    tools = body.get("tools")
    if not isinstance(tools, list):
        return out
    for tool in tools:
        if isinstance(tool, Mapping) and isinstance(tool.get("name"), str):
            schema = tool.get("input_schema")
            out[tool["name"]] = dict(schema) if isinstance(schema, Mapping) else {}
    return out


def flaggedDeferred(body: Mapping[str, Any]) -> set[str]:
    """Tools the request marks ``defer_loading: true``."""
    tools = body.get("tools")
    if not isinstance(tools, list):
        return set()
    return {t["name"] for t in tools
            if isinstance(t, Mapping) and isinstance(t.get("name"), str) and t.get("defer_loading") is True}


def _texts(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for item in value:
            yield from _texts(item)
    elif isinstance(value, Mapping):
        for key in ("text", "content"):
            if key in value:
                yield from _texts(value[key])


def listedDeferred(body: Mapping[str, Any]) -> set[str]:
    """Tool names announced as deferred in the system prompt or a message's reminder.

    The block is a header line followed by one bare tool name a line, up to
    ``</system-reminder>``; the names are the lines that look like tool names.
    """
    names: set[str] = set()
    for text in [*_texts(body.get("system")), *_texts(body.get("messages"))]:
        at = text.find(DEFERRED_HEADER)
        if at < 0:
            continue
        block = text[at:].split("</system-reminder>", 1)[0]
        for line in block.splitlines()[1:]:
            line = line.strip()
            if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", line):
                names.add(line)
    return names


# --- running a binary ---------------------------------------------------------------------


@contextmanager
def _throwawayHome() -> Iterator[Path]:
    # Not under /tmp: Claude Code's sandbox treats the temp dir specially, and
    # the other Claude Code fixtures keep their homes in /var/tmp too.
    base = Path(tempfile.mkdtemp(prefix="agentsandbox-tools-", dir="/var/tmp"))
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _env(home: Path, api: MockMessagesAPI, *, optional: bool) -> dict[str, str]:
    env = {
        "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "DISABLE_AUTOUPDATER": "1",
        "ANTHROPIC_API_KEY": "sk-ant-agentsandbox-tools-dummy",
        "ANTHROPIC_BASE_URL": api.baseURL,
        "IS_SANDBOX": "1",  # root may use bypassPermissions only when it says so
        "CLAUDE_CODE_TMPDIR": str(home / "claude-tmp"),
    }
    if optional:
        env.update(OPTIONAL_ENV)
        env["ENABLE_TOOL_SEARCH"] = "false"
        for name in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy", "all_proxy"):
            env[name] = DEAD_PROXY
        env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    else:
        env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] = "1"
        env["ENABLE_TOOL_SEARCH"] = "true"
    return env


def _run(binary: str, calls: list[ToolCall], *, home: Path, optional: bool) -> list[dict[str, Any]]:
    """One ``claude -p`` run; the request bodies the mock recorded."""
    project = home / "project"
    project.mkdir(parents=True, exist_ok=True)
    (home / "claude-tmp").mkdir(exist_ok=True)
    argv = [binary, "-p", scriptPrompt(calls, "List the tools."),
            "--output-format", "stream-json", "--verbose", "--model", MODEL,
            "--permission-mode", "bypassPermissions", "--allowedTools", ",".join(ALLOWED_TOOLS)]
    if optional:
        server = home / "probe_mcp.py"
        server.write_text(PROBE_MCP_SERVER)
        config = home / "mcp.json"
        config.write_text(json.dumps({"mcpServers": {PROBE_SERVER: {
            "type": "stdio", "command": sys.executable, "args": [str(server)]}}}))
        argv += ["--mcp-config", str(config)]
        (home / ".claude.json").write_text(json.dumps({
            "hasCompletedOnboarding": True,
            "cachedGrowthBookFeatures": {flag: True for flag in TOOL_FLAGS},
        }))
    with MockMessagesAPI() as api:
        proc = subprocess.Popen(
            argv, cwd=str(project), env=_env(home, api, optional=optional), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )
        try:
            stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            stdout, stderr = "", "timed out"
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        requests = [r for r in api.requests if isinstance(r.get("tools"), list) and r["tools"]]
    if not requests:
        raise AssertionError(f"{binary} sent no request with tools (rc={proc.returncode})\n"
                             f"stdout: {stdout[-1500:]}\nstderr: {stderr[-1500:]}")
    return requests


def captureTools(binary: str, release: str) -> Capture:
    """Run ``binary`` three times (see the module doc) and merge what it offered."""
    with _throwawayHome() as home:
        optionalRequests = _run(binary, [], home=home / "optional", optional=True)
    offered: dict[str, dict[str, Any]] = {}
    for body in optionalRequests:
        offered.update(toolSchemas(body))
    with _throwawayHome() as home:
        first = _run(binary, [], home=home / "deferred", optional=False)
        deferredRequests = first
        if "ToolSearch" in toolSchemas(first[0]):
            names = set(offered) | listedDeferred(first[0]) | flaggedDeferred(first[0])
            select = ToolCall("ToolSearch", {"query": "select:" + ",".join(sorted(names)),
                                             "max_results": len(names)})
            deferredRequests = _run(binary, [select], home=home / "selected", optional=False)
    deferred: set[str] = set()
    for body in deferredRequests:
        deferred |= listedDeferred(body) | flaggedDeferred(body)
        for name, schema in toolSchemas(body).items():
            # A loaded deferred tool's schema is the one the model really gets.
            if schema or name not in offered:
                offered[name] = schema
    for name in deferred:
        offered.setdefault(name, {})
    tools = {n: s for n, s in sorted(offered.items()) if not n.startswith(PROBE_PREFIX)}
    return Capture(release, tools, frozenset(deferred), len(optionalRequests) + len(deferredRequests))


@functools.cache
def capture(binary: ClaudeBinary) -> Capture:
    """``captureTools`` for a fixture binary, once per test session.

    ``/etc/claude-code`` is emptied for the runs (under the shared e2e
    lock), so a drop-in another test installed cannot hide a tool.
    """
    path = binary.require()
    with ManagedSettingsGuard():
        return captureTools(path, binary.version or binary.label)


def capturedTools(binary: ClaudeBinary) -> dict[str, dict[str, Any]]:
    """Name -> input schema (``{}`` for a deferred tool whose schema never arrived)."""
    return dict(capture(binary).tools)


# --- the tripwire's check ---------------------------------------------------------------------


def unknownTools(captured: Mapping[str, Iterable[str]], known: Container[str]) -> dict[str, list[str]]:
    """Release -> the captured tool names ``known`` lacks, sorted."""
    out: dict[str, list[str]] = {}
    for release, names in captured.items():
        missing = sorted(n for n in set(names) if n not in known)
        if missing:
            out[release] = missing
    return out


def checkAllKnown(captured: Mapping[str, Iterable[str]], known: Container[str]) -> None:
    """Fail naming every captured tool the table lacks, and the release that offers it."""
    unknown = unknownTools(captured, known)
    if unknown:
        lines = [f"  {name} (Claude Code {release})"
                 for release, names in sorted(unknown.items()) for name in names]
        raise AssertionError(
            "Claude Code offers tools agentsandbox.tools.TOOLS does not classify; classify each "
            "(what it reads, writes, runs or reaches) before this release is supported:\n"
            + "\n".join(lines))
