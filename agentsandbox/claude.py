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
from collections.abc import Iterable, Mapping
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


def render(policy: Policy, helper: str | None = None) -> dict[str, Any]:
    """The drop-in as a JSON-ready dict; with ``helper``, naming it as Claude Code's policy helper.

    The machine's drop-in names the helper (``helperPath``), which Claude Code
    runs as the session's user when it starts; the helper prints this same
    rendering of that user's own policy (``policyhelper``), which replaces the
    file's for that session.  ``policy.others`` (other people's homes) are
    closed here too: each session's rendering closes them, the machine's has none.
    """
    setting = policy.setting
    closed = ["~/", "/" + RUNTIME_ROOT, *_settings(setting(h) for h in policy.others)]
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
    settings: dict[str, Any] = {
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
    if helper is not None:
        settings["policyHelper"] = {"path": helper}
    return settings


#: The policy helper's executable, beside ``agentsandbox`` (a console script of the package).
HELPER_NAME = "agentsandbox-policy-helper"


def helperPath(exe: str) -> str:
    """The policy helper of the installation whose ``agentsandbox`` is ``exe``."""
    return os.path.join(os.path.dirname(exe), HELPER_NAME)


def machinePolicy(environ: Mapping[str, str] | None = None, config: str | None = None) -> Policy:
    """The policy the machine's drop-in is rendered from: the machine's config, never a user's.

    ``config`` names the machine's file (``render claude --config``, the Nix
    module's build); by default it is ``/etc/agentsandbox/config.toml``, or the
    built-in defaults where there is none.  Other people's homes are left out:
    the drop-in is the same for every user.
    """
    from agentsandbox.loader import loadMachine

    return Policy.fromConfig(loadMachine(environ, config), environ, others=())


def renderMachine(policy: Policy) -> dict[str, Any]:
    """The machine's drop-in: ``policy`` (``machinePolicy``'s) naming this installation's helper."""
    return render(policy, helperPath(policy.exe))


def _webFetchRules(domains: Iterable[str]) -> list[str]:
    """``WebFetch(domain:…)`` allow rules for the listed names, so WebFetch asks no question for them.

    They only spare a prompt: the hook decides every WebFetch URL (host, port
    and resolved addresses, as the proxy does), and refuses every host off the
    list.  Address and CIDR entries get no rule (a rule matches names).
    """
    from agentsandbox.allowlist import AllowList, EntryError

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
    #: The root command that would write it, when this process may not.
    steps: tuple[str, ...]
    #: What writing it changes: a unified diff of the installed drop-in and the new one.
    diff: str = ""


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def drift(policy: Policy, managed: str | None = None) -> str | None:
    """Why the installed drop-in is not what ``policy`` (``machinePolicy``'s) renders, or None."""
    path = dropInPath(managed)
    try:
        installed = _read(path)
    except OSError as e:
        return f"cannot read {path}: {e.strerror}"
    if installed is None:
        return f"{path} is not installed"
    if installed != dumps(renderMachine(policy)).encode():
        return f"{path} differs from what the machine's config renders"
    return None


def install(policy: Policy, managed: str | None = None) -> InstallResult:
    """Write the machine's drop-in (``renderMachine(policy)``) atomically.

    Without permission nothing is written and nothing is staged: the result
    names the root command (``agentsandbox install``, which renders from the
    machine's config itself) and the diff it would make.  No command ever
    copies a file a user can write into the managed directory.
    """
    managed = managed or managedDir()
    text = dumps(renderMachine(policy))
    data = text.encode()
    base = os.path.join(managed, "managed-settings.json")
    dropDir = os.path.join(managed, "managed-settings.d")
    target = os.path.join(dropDir, DROP_IN_NAME)
    needBase = not os.path.exists(base)
    current = _read(target) if os.path.isdir(dropDir) else None
    if not needBase and current == data:
        return InstallResult(False, target, ())
    import difflib

    old = (current or b"").decode("utf-8", "replace").splitlines(keepends=True)
    diff = "".join(difflib.unified_diff(old, text.splitlines(keepends=True), target, target + " (new)"))
    try:
        os.makedirs(dropDir, mode=0o755, exist_ok=True)
        if needBase:
            atomicWrite(base, b"{}\n", 0o644)
        atomicWrite(target, data, 0o644)
        return InstallResult(True, target, (), diff)
    except PermissionError:
        pass
    command = [policy.exe, "install"]
    if managed != managedDir():
        command += ["--managed-dir", managed]
    return InstallResult(True, target, ("sudo " + shlex.join(command),), diff)


class UntrustedConfig(Exception):
    """A config root may not render the machine's drop-in from; the text says why."""


def trustedForMachine(path: str) -> None:
    """Refuse a config file anyone but root could have written, or could still replace.

    The machine's drop-in holds every user's sessions, so it is rendered only
    from a file that root owns and no one else can write, in directories no
    one else can rename it out of (a sticky directory, such as /var/tmp, is
    safe: only its owner may rename an entry).  Raises ``UntrustedConfig``.
    """
    import stat

    path = os.path.abspath(path)
    if stat.S_ISLNK(os.lstat(path).st_mode):
        raise UntrustedConfig(f"{path} is a symbolic link; name the file itself")
    why = _othersCanChange(path)
    if why is not None:
        raise UntrustedConfig(f"{why}; the machine's drop-in is rendered only from a file root owns and no one else can write")


def _othersCanChange(path: str) -> str | None:
    """Why someone other than root could change what ``path`` is (it, a link on the way, a directory), or None."""
    import stat

    path = os.path.abspath(path)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        target = os.path.join(os.path.dirname(path), os.readlink(path))
        return _directoriesOf(path) or _othersCanChange(target)
    if st.st_uid != 0 or st.st_mode & 0o022:
        return f"{path} is owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):04o}"
    return _directoriesOf(path)


def _directoriesOf(path: str) -> str | None:
    import stat

    directory = os.path.dirname(path)
    while True:
        st = os.stat(directory)
        sticky = bool(st.st_mode & stat.S_ISVTX)
        if st.st_uid != 0 or (st.st_mode & 0o022 and not sticky):
            return (
                f"{directory} (holding {path}) is owned by uid {st.st_uid} with mode "
                f"{stat.S_IMODE(st.st_mode):04o}"
            )
        if directory == "/":
            return None
        directory = os.path.dirname(directory)


def programsOthersCanChange(settings: dict[str, Any]) -> list[str]:
    """Each program the drop-in makes every user's sessions run that someone other than root could change.

    The hooks' commands, their script, and the policy helper run as every
    user who starts Claude Code: one in a user's venv would let that user run
    code as everyone else.
    """
    programs: list[str] = []
    for entries in settings.get("hooks", {}).values():
        for entry in entries:
            for hook in entry.get("hooks", []):
                programs += [hook.get("command", ""), *(a for a in hook.get("args", []) if a.startswith("/"))]
    helper = settings.get("policyHelper", {}).get("path")
    if helper:
        programs.append(helper)
    found = []
    for program in dict.fromkeys(p for p in programs if p.startswith("/")):
        try:
            why = _othersCanChange(program)
        except FileNotFoundError:
            why = None  # Claude Code cannot run it: its session does not start (closed, not open)
        if why is not None:
            found.append(why)
    return found


def installMain(argv: list[str]) -> int:
    from agentsandbox.cli import parser
    from agentsandbox.config import ConfigError

    p = parser(
        "install",
        "Install Claude Code's managed-settings drop-in, rendered from the machine's config "
        "(/etc/agentsandbox/config.toml, or the built-in defaults where there is none) and naming "
        "the policy helper that gives each session its user's own policy.",
    )
    p.add_argument("--managed-dir", default=None, help=f"managed-settings root (default {managedDir()})")
    args = p.parse_args(argv)
    try:
        if args.config is not None:
            trustedForMachine(args.config)
        policy = machinePolicy(config=args.config)
    except (UntrustedConfig, OSError) as e:
        print(f"agentsandbox install: {e}", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"agentsandbox install: {e}", file=sys.stderr)
        return 2
    policy.mountPoints()
    unsafe = programsOthersCanChange(renderMachine(policy))
    if unsafe and os.geteuid() == 0:
        # Root writing it would hand every user's sessions to whoever can change these.
        print(
            "agentsandbox install: the drop-in would make every user's Claude Code sessions run "
            "programs someone other than root can change: " + "; ".join(unsafe)
            + ". Install agentsandbox where only root can write (the Debian package, or a venv "
            "root owns) and run that installation's `agentsandbox install`.",
            file=sys.stderr,
        )
        return 1
    result = install(policy, args.managed_dir)
    if not result.changed:
        print(f"the drop-in {result.path} is current")
        return 0
    if result.steps:
        print(f"no permission to write {result.path}; root renders it from the machine's config:")
        for step in result.steps:
            print(f"  {step}")
        if result.diff:
            print("it will change:")
            sys.stdout.write(result.diff)
        return 1
    print(f"installed {result.path}")
    return 0
