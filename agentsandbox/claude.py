"""Claude Code's managed-settings drop-in: render it, install it, tell when it drifted.

The drop-in is user-independent, so one file serves every user of a machine:
home paths are written ``~/…``, other absolute paths ``//…``, and every user's
runtime dir (``//run/user``) is closed.  Per-user absolute paths reach sandboxed
Bash through the SessionStart hook instead (Claude Code expands nothing in
``env`` values).

Stdlib only: the SessionStart hook renders it to check for drift.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from agentsandbox.files import atomicWrite
from agentsandbox.paths import DROP_IN_NAME, managedDir
from agentsandbox.policy import ENV_MARKER, Policy, under
from agentsandbox.tools import removedTools

HOOK_TIMEOUT = 10
#: The script the PreToolUse hook runs, in this installation's package directory
#: (Debian: /usr/lib/python3/dist-packages; Nix: the store path's site-packages).
HOOK_START = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hookstart.py")
RUNTIME_ROOT = "/run/user"
#: Every user's egress dir, as ``_readSetting`` writes a runtime-dir path.  It is
#: re-allowed even when whoever renders has no runtime dir (root in a package's
#: postinst, or under sudo, which drops XDG_RUNTIME_DIR), so the machine's drop-in
#: is the one each user's session renders.
EVERY_EGRESS_DIR = "/" + RUNTIME_ROOT + "/*/agentsandbox/egress"

#: Credential locations under home that also get permission deny rules: a second
#: layer under the hook, which holds even if the hook cannot run.  A path the
#: config re-allows explicitly is left out, so the two layers never disagree.
CREDENTIAL_DIRS = (
    ".ssh",
    ".gnupg",
    ".aws",
    ".azure",
    ".config/gcloud",
    ".config/gh",
    ".config/hub",
    ".kube",
    ".password-store",
    ".local/share/keyrings",
)
CREDENTIAL_FILES = (
    ".docker/config.json",
    ".netrc",
    ".git-credentials",
    ".npmrc",
    ".pypirc",
    ".vault-token",
    ".claude/.credentials.json",
)
CREDENTIAL_PATHS = CREDENTIAL_DIRS + CREDENTIAL_FILES


def render(policy: Policy) -> dict[str, Any]:
    """The drop-in as a JSON-ready dict."""
    setting = policy.setting
    closed = ["~/", "/" + RUNTIME_ROOT]
    explicit = (*policy.read, *policy.write)
    credentialDeny: list[str] = []
    for rel in CREDENTIAL_PATHS:
        full = os.path.join(policy.home, rel)
        if any(under(e, full) or (under(full, e) and e != policy.home) for e in explicit):
            continue
        credentialDeny.append(full)
    denyRules: list[str] = []
    for p in (*policy.deny, *credentialDeny):
        s = _ruleSetting(policy, p)
        isFile = os.path.relpath(p, policy.home) in CREDENTIAL_FILES
        for tool in ("Read", "Edit"):
            denyRules += [f"{tool}({s})"] if isFile else [f"{tool}({s})", f"{tool}({s}/**)"]
    exe = policy.exe
    return {
        "env": {ENV_MARKER: "1"},
        "hooks": {
            "PreToolUse": [
                {
                    # Every tool, known or not: the hook decides each by tools.TOOLS.
                    "matcher": "*",
                    "hooks": [_hook(exe, "pretooluse")],
                }
            ],
            "SessionStart": [{"hooks": [_hook(exe, "sessionstart")]}],
        },
        # Run (no arguments) before each session: refuses one whose skill listing or
        # memory would carry a closed file (hook.policyHelper, docs/hook.md).
        "policyHelper": {"path": exe},
        "permissions": {
            "allow": _webFetchRules(policy.domains),
            "deny": _settings(denyRules) + removedTools(policy.allowTools),
        },
        "sandbox": {
            "enabled": True,
            "failIfUnavailable": True,
            "allowUnsandboxedCommands": False,
            "autoAllowBashIfSandboxed": True,
            "filesystem": {
                "allowManagedReadPathsOnly": True,
                "allowRead": _settings(
                    [_readSetting(policy, p) for p in policy.read if _isClosed(policy, p)]
                    + ([] if policy.runtime else [EVERY_EGRESS_DIR])
                ),
                "allowWrite": _settings(setting(p) for p in policy.write),
                "denyRead": closed + [s for s in _settings(setting(p) for p in policy.deny) if s not in closed],
                "denyWrite": _settings([*(setting(p) for p in policy.deny), setting(policy.harness)]),
            },
            "network": {
                "allowManagedDomainsOnly": True,
                "allowedDomains": list(policy.domains),
                "httpProxyPort": policy.proxyPort,
                "socksProxyPort": policy.proxyPort,
                "strictAllowlist": True,
            },
        },
    }


def _webFetchRules(domains: Iterable[str]) -> list[str]:
    """``WebFetch(domain:…)`` allow rules for the listed names, so WebFetch asks no question for them.

    They only spare a prompt: the hook decides every WebFetch URL (host, port
    and resolved addresses, as the proxy does), and refuses every host off the
    list.  Address and CIDR entries get no rule (a rule matches names).
    """
    from agentsandbox.egress.rules import AllowList, EntryError

    try:
        entries = AllowList.parse(list(domains)).entries
    except EntryError:
        return []
    names = set()
    for entry in entries:
        if entry.host is not None and not entry.isAddressEntry:
            names.add(entry.host)
        elif entry.suffix is not None:
            names.add("*." + entry.suffix)
    return sorted(f"WebFetch(domain:{n})" for n in names)


def _settings(items: Iterable[str]) -> list[str]:
    """Sorted and unique by the rendered text, not by the absolute paths behind it.

    The same config must render the same bytes for every user (the drift check
    compares them): sorting absolute paths would order ``~/…`` entries by where
    each user's home happens to lie.
    """
    return sorted(set(items))


def hookCommand(exe: str, event: str) -> list[str]:
    """The argv Claude Code runs for a hook ``event`` (``pretooluse``, ``sessionstart``).

    PreToolUse runs before every file-tool call, so it skips the console script
    (which imports the CLI, and on Debian ``re``) and ``site``: the interpreter
    running this code, isolated, on ``hookstart.py`` with ``exe`` (its
    docstring says why).  SessionStart runs once a session and needs the whole
    CLI: ``exe hook sessionstart``.
    """
    if event == "pretooluse" and sys.executable:
        return [sys.executable, "-I", "-S", HOOK_START, exe, event]
    return [exe, "hook", event]


def _hook(exe: str, event: str) -> dict[str, Any]:
    command, *args = hookCommand(exe, event)
    return {
        "type": "command",
        "command": command,
        "args": args,
        "timeout": HOOK_TIMEOUT,
        "onFailure": "block",
    }


def _isClosed(policy: Policy, path: str) -> bool:
    """Only paths inside a closed dir need re-allowing; the rest is readable anyway."""
    return under(path, policy.home) or under(path, RUNTIME_ROOT)


def _readSetting(policy: Policy, path: str) -> str:
    """Like ``setting``, but a path in this user's runtime dir names every user's.

    ``//run/user/*/…`` is expanded by the sandbox when it wraps a command, so
    the drop-in stays the same for every user.
    """
    if policy.runtime and under(path, policy.runtime) and under(policy.runtime, RUNTIME_ROOT):
        rest = path[len(policy.runtime) :].lstrip("/")
        return "/" + os.path.join(RUNTIME_ROOT, "*", rest)
    return policy.setting(path)


def _ruleSetting(policy: Policy, path: str) -> str:
    """Permission rules read ``/x`` relative to the session: absolute must be ``//x``."""
    return policy.setting(path).rstrip("/") if path != policy.home else "~"


def dumps(settings: dict[str, Any]) -> str:
    """Byte-stable JSON: sorted keys, two-space indent, trailing newline."""
    return json.dumps(settings, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def dropInPath(managed: str | None = None) -> str:
    return os.path.join(managed or managedDir(), "managed-settings.d", DROP_IN_NAME)


# --------------------------------------------------------------------------- install


@dataclass(frozen=True)
class InstallResult:
    changed: bool
    path: str
    steps: tuple[str, ...]


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def drift(policy: Policy, managed: str | None = None) -> str | None:
    """Why the installed drop-in is not what the config renders, or None when current."""
    path = dropInPath(managed)
    try:
        installed = _read(path)
    except OSError as e:
        return f"cannot read {path}: {e.strerror}"
    if installed is None:
        return f"{path} is not installed"
    if installed != dumps(render(policy)).encode():
        return f"{path} differs from what the current config renders"
    return None


def install(policy: Policy, managed: str | None = None, stage: str | None = None) -> InstallResult:
    """Write the drop-in atomically; without permission, return the root commands.

    ``stage`` is where a copy is left for those commands (the state dir).
    """
    managed = managed or managedDir()
    data = dumps(render(policy)).encode()
    base = os.path.join(managed, "managed-settings.json")
    dropDir = os.path.join(managed, "managed-settings.d")
    target = os.path.join(dropDir, DROP_IN_NAME)
    needBase = not os.path.exists(base)
    needDir = not os.path.isdir(dropDir)
    current = _read(target) if not needDir else None
    if not needBase and current == data:
        return InstallResult(False, target, ())
    try:
        os.makedirs(dropDir, mode=0o755, exist_ok=True)
        if needBase:
            atomicWrite(base, b"{}\n", 0o644)
        atomicWrite(target, data, 0o644)
        return InstallResult(True, target, ())
    except PermissionError:
        pass
    staged = stage or tempfile.mkdtemp(prefix="agentsandbox-stage-")
    os.makedirs(staged, mode=0o700, exist_ok=True)
    stagedBase = os.path.join(staged, "managed-settings.json")
    stagedDrop = os.path.join(staged, DROP_IN_NAME)
    with open(stagedBase, "wb") as f:
        f.write(b"{}\n")
    with open(stagedDrop, "wb") as f:
        f.write(data)
    q = shlex.quote
    steps: list[str] = []
    if needBase:
        steps.append(f"sudo install -d -m 0755 {q(managed)}")
        steps.append(f"sudo install -m 0644 -o root {q(stagedBase)} {q(base)}")
    if needDir:
        steps.append(f"sudo install -d -m 0755 {q(dropDir)}")
    if current != data:
        steps.append(f"sudo install -m 0644 -o root {q(stagedDrop)} {q(target)}")
    return InstallResult(True, target, tuple(steps))


def installMain(argv: list[str]) -> int:
    from agentsandbox.cli import loadConfig, parser

    p = parser("install", "Install the Claude Code managed-settings drop-in rendered from the config.")
    p.add_argument("--managed-dir", default=None, help=f"managed-settings root (default {managedDir()})")
    args = p.parse_args(argv)
    config = loadConfig("install", args.config)
    policy = Policy.fromConfig(config)
    policy.mountPoints()
    result = install(policy, args.managed_dir, stage=os.path.join(config.paths.stateDir, "staged"))
    if not result.changed:
        print(f"the drop-in {result.path} is current")
        return 0
    if result.steps:
        print(f"no permission to write {result.path}; install it as root:")
        for step in result.steps:
            print(f"  {step}")
        return 1
    print(f"installed {result.path}")
    return 0
