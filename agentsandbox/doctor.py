"""``agentsandbox doctor`` and ``agentsandbox status``.

``doctor`` checks everything the policy needs to be enforced, one small function
per check, each taking what it looks at (paths, a command runner, a probe) so the
tests can drive it both ways; the probes themselves (connect, listeners, broker
ask, program runner) are ``agentsandbox.probes``'.  Every failure says what fixes
it.  Exit status 0 when no check failed, ``cli.EXIT_CONFIG`` (2) when the config
cannot be loaded, 1 when another check failed; a *warning* (Claude Code too old
for ``onFailure``) or an *unknown* (token state the service did not report) does
not fail the run.

``status`` shows the running service's figures from the broker's ``status`` op:
requests per op and outcome, uptime, and whatever the service adds (proxy
figures, token state), as a table or ``--json``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agentsandbox import cli
from agentsandbox.config import CommandSource, Config, ConfigError, InjectRule
from agentsandbox.loader import load
from agentsandbox.paths import Paths
from agentsandbox.policy import Policy
from agentsandbox.probes import Runner, askBroker, connectTCP, firstLine, listenerUids, systemRunner

OK = "ok"
FAIL = "FAIL"
WARN = "warn"
UNKNOWN = "unknown"

#: The first Claude Code release known to honour a hook's ``onFailure: "block"``.
ON_FAILURE_VERSION = (2, 1, 332)

SERVICE_FIX = (
    "start the service: `systemctl --user enable --now agentsandbox` (after `agentsandbox "
    "setup`), or `agentsandbox serve` in a terminal"
)


@dataclass(frozen=True)
class Check:
    """One finding: ``status`` is ok, FAIL, warn or unknown; ``fix`` says what to do."""

    name: str
    status: str
    detail: str
    fix: str | None = None

    @property
    def failed(self) -> bool:
        return self.status == FAIL

    def asDict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "detail": self.detail, "fix": self.fix}


def _why(p: subprocess.CompletedProcess[str]) -> str:
    said = firstLine(p.stderr) or firstLine(p.stdout)
    return f"exit status {p.returncode}" + (f": {said}" if said else "")


# --------------------------------------------------------------------------- the sandbox tools

#: name -> (program, version argv, what installs it)
TOOLS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "bubblewrap": ("bwrap", ("--version",), "apt-get install bubblewrap"),
    "socat": ("socat", ("-V",), "apt-get install socat"),
    "ripgrep": ("rg", ("--version",), "apt-get install ripgrep"),
    "srt": ("srt", ("--version",), "npm install -g @anthropic-ai/sandbox-runtime"),
}


def checkTool(name: str, which: Callable[[str], str | None], runner: Runner) -> Check:
    """``name`` (a TOOLS key) is on the PATH and answers its version flag."""
    program, versionArgs, fix = TOOLS[name]
    found = which(program)
    if found is None:
        return Check(name, FAIL, f"{program} is not on the PATH", fix)
    p = runner([found, *versionArgs])
    if p.returncode != 0:
        return Check(name, FAIL, f"{found} does not run ({_why(p)})", f"reinstall it: {fix}")
    version = firstLine(p.stdout) or firstLine(p.stderr)
    return Check(name, OK, f"{found}: {version}")


BWRAP_FIX = (
    "bubblewrap needs unprivileged user namespaces: check `sysctl kernel.unprivileged_userns_clone` "
    "and, on Ubuntu 24.04, `kernel.apparmor_restrict_unprivileged_userns`; inside a container, "
    "its seccomp/AppArmor profile must allow them"
)


def checkBwrapWorks(bwrap: str | None, runner: Runner) -> Check:
    """bubblewrap can build a sandbox like srt's (new namespaces, read-only root)."""
    if bwrap is None:
        return Check("bubblewrap works", FAIL, "bwrap is not on the PATH", TOOLS["bubblewrap"][2])
    p = runner([bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--unshare-all", "--die-with-parent", "true"])
    if p.returncode != 0:
        return Check("bubblewrap works", FAIL, f"a test sandbox failed ({_why(p)})", BWRAP_FIX)
    return Check("bubblewrap works", OK, "a test sandbox ran `true`")


#: The smallest settings srt accepts: every list it requires, nothing allowed.
MINIMAL_SRT_SETTINGS: dict[str, dict[str, list[str]]] = {
    "network": {"allowedDomains": [], "deniedDomains": []},
    "filesystem": {"denyRead": [], "allowWrite": [], "denyWrite": []},
}


def checkSrtWorks(srt: str | None, runner: Runner, scratch: str | None = None) -> Check:
    """``srt -c true`` runs under a minimal settings file."""
    if srt is None:
        return Check("srt works", FAIL, "srt is not on the PATH", TOOLS["srt"][2])
    fd, path = tempfile.mkstemp(prefix="doctor-srt-", suffix=".json", dir=scratch)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(MINIMAL_SRT_SETTINGS, f)
        p = runner([srt, "--settings", path, "-c", "true"])
    finally:
        os.unlink(path)
    if p.returncode != 0:
        return Check(
            "srt works",
            FAIL,
            f"`srt -c true` failed ({_why(p)})",
            "run `srt --debug -c true` to see why; it needs bwrap, socat and rg on the PATH, "
            "and node to run",
        )
    return Check("srt works", OK, "`srt -c true` ran in a sandbox")


# --------------------------------------------------------------------------- Claude Code

CONFIG_CHECK = "config"


def checkConfig(configPath: str | None, environ: Mapping[str, str]) -> tuple[Check, Config | None]:
    try:
        config = load(configPath, environ)
    except ConfigError as e:
        return Check(CONFIG_CHECK, FAIL, str(e), f"fix {e.source} (key {e.key or '-'})"), None
    return Check(CONFIG_CHECK, OK, config.served), config


def checkWishes(config: Config) -> list[Check]:
    """A warning for each thing the user's file asks for that the machine's does not grant."""
    return [
        Check("config: not granted", WARN, notice, f"ask the admin to grant it in {config.machine}, or drop it")
        for notice in config.notices
    ]


def checkDropIn(environ: Mapping[str, str], managed: str | None = None) -> Check:
    """The Claude Code drop-in is installed and is what the machine's config renders now.

    Compared with the machine's config alone (or the built-in defaults where
    the machine has none), never a user's: the drop-in serves every user, and
    each session's own policy comes from the policy helper it names.
    """
    from agentsandbox.claude import drift, dropInPath, machinePolicy

    name = "Claude Code drop-in"
    try:
        policy = machinePolicy(environ)
    except ConfigError as e:
        return Check(name, FAIL, f"the machine's config does not load: {e}", f"the admin fixes {e.source}")
    why = drift(policy, managed)
    if why is not None:
        return Check(
            name,
            FAIL,
            why,
            f"root renders it from {policy.configFile or 'the built-in defaults'}: "
            f"sudo {policy.exe} install",
        )
    return Check(name, OK, f"{dropInPath(managed)} is current")


def checkServerManaged(claudeDir: str) -> Check:
    """No server-managed settings that would replace the managed file tier."""
    remote = os.path.join(claudeDir, "remote-settings.json")
    if os.path.lexists(remote):
        return Check(
            "server-managed settings",
            FAIL,
            f"{remote} exists: Claude Code then ignores /etc/claude-code (drop-in included), "
            "so neither the sandbox settings nor the hooks apply",
            "ask your organisation's admin to carry the agentsandbox settings in the server-managed "
            'settings (or, from Claude Code 2.1.332, set managedSourcesBehavior "merge" there); '
            "until then use `agentsandbox run` for other agents only",
        )
    return Check("server-managed settings", OK, f"none ({remote} does not exist)")


_VERSION = re.compile(r"(\d+)\.(\d+)\.(\d+)")


def parseVersion(text: str) -> tuple[int, int, int] | None:
    m = _VERSION.search(text)
    if m is None:
        return None
    return (int(m.group(1)), int(m.group(2)), int(m.group(3)))


def checkClaude(claude: str | None, runner: Runner) -> Check:
    """Claude Code's version, and whether it honours the hooks' ``onFailure: "block"``."""
    name = "Claude Code"
    if claude is None:
        return Check(name, UNKNOWN, "claude is not on the PATH; only `agentsandbox run` applies")
    p = runner([claude, "--version"])
    version = parseVersion(p.stdout) if p.returncode == 0 else None
    if version is None:
        return Check(name, FAIL, f"`claude --version` gave no version ({_why(p)})", "reinstall Claude Code")
    shown = ".".join(map(str, version))
    if version >= ON_FAILURE_VERSION:
        return Check(name, OK, f"{shown}: honours onFailure \"block\" (a failing hook blocks the tool)")
    need = ".".join(map(str, ON_FAILURE_VERSION))
    return Check(
        name,
        WARN,
        f"{shown} ignores onFailure: a hook that crashes or times out lets the tool run "
        "(agentsandbox's hook denies on its own errors, so only a killed or hung hook is exposed)",
        f"upgrade Claude Code to {need} or later",
    )


# --------------------------------------------------------------------------- the service


def checkBroker(
    spool: str, ask: Callable[[str, str], bytes] = askBroker
) -> tuple[Check, dict[str, Any] | None]:
    """The broker answers a ping; its ``status`` reply (if it parses) comes back too."""
    from agentsandbox.broker.client import BrokerError

    try:
        ask(spool, "ping")
    except (BrokerError, OSError) as e:
        return Check("broker", FAIL, str(e), SERVICE_FIX), None
    try:
        report = json.loads(ask(spool, "status"))
    except (BrokerError, OSError, ValueError) as e:
        return Check("broker", OK, f"answers a ping in {spool} (status: {e})"), None
    if not isinstance(report, dict):
        return Check("broker", OK, f"answers a ping in {spool}"), None
    return Check("broker", OK, f"answers in {spool} (pid {report.get('pid', '?')})"), report


def checkService(runner: Runner) -> Check | None:
    """Whether the user unit runs, when a user systemd answers (None when none does).

    A service that crash-loops (no CA bundle on a minimal Debian) makes the broker and
    proxy checks fail with no word of why; this one names the unit's state and its log."""
    name = "user service"
    p = runner(["systemctl", "--user", "show", "-p", "LoadState,ActiveState,SubState,NRestarts,Result",
                "agentsandbox.service"])  # fmt: skip
    if p.returncode != 0:
        return None
    props = dict(line.partition("=")[::2] for line in p.stdout.splitlines())
    load, active, sub = props.get("LoadState", ""), props.get("ActiveState", ""), props.get("SubState", "")
    restarts = props.get("NRestarts", "0")
    if load != "loaded" or (active == "inactive" and props.get("Result") == "success"):
        return Check(name, OK, f"agentsandbox.service is {load or '?'}/{active or '?'} (not run by systemd)")
    if active == "active" and sub == "running":
        return Check(name, OK, f"agentsandbox.service is running ({restarts} restarts)")
    return Check(
        name, FAIL,
        f"agentsandbox.service is {active}/{sub} after {restarts} restarts (result {props.get('Result', '?')})",
        "its log says why: `journalctl --user -u agentsandbox -n 50`; after fixing it: "
        "`systemctl --user reset-failed agentsandbox; systemctl --user restart agentsandbox`",
    )  # fmt: skip


def checkUserBus(environ: Mapping[str, str]) -> Check:
    """The user bus `agentsandbox cap` asks systemd through (dbus-user-session on Debian)."""
    from agentsandbox.broker import scope

    problem = scope.userBusProblem(environ)
    if problem is not None:
        return Check(
            "user bus", WARN, f"{problem}; `agentsandbox cap` is refused until there is one",
            f"install {scope.USER_BUS_PACKAGE} (`sudo apt install {scope.USER_BUS_PACKAGE}`), then log in again",
        )  # fmt: skip
    return Check("user bus", OK, "a user bus is there for `agentsandbox cap`")


def checkProxy(port: int, connect: Callable[[int], str | None] = connectTCP) -> Check:
    why = connect(port)
    if why is not None:
        return Check(
            "egress proxy", FAIL, f"nothing accepts on 127.0.0.1:{port} (proxy.port): {why}", SERVICE_FIX
        )
    return Check("egress proxy", OK, f"accepts on 127.0.0.1:{port}")


def checkSameUser(
    port: int, brokerPid: int | None, uid: int | None = None, procDir: str = "/proc", viaDispatcher: bool = False
) -> Check:
    """The proxy's listening socket and the broker process belong to this user.

    With a dispatcher the port is the dispatcher's (``checkDispatcher`` looks at it)."""
    me = os.getuid() if uid is None else uid
    name = "same user"
    owners = set() if viaDispatcher else listenerUids(port, procDir)
    problems = []
    if viaDispatcher:
        pass
    elif not owners:
        problems.append(f"no listening socket on port {port} in {procDir}/net/tcp*")
    elif owners != {me}:
        from agentsandbox.packaged import machine

        problems.append(
            f"port {port} is held by uid {', '.join(map(str, sorted(owners)))}, not {me} (on a machine "
            f"with several users, the system dispatcher shares the port: `{machine().startCommand()}`, "
            "see docs/dispatch.md)"
        )
    if brokerPid is None:
        problems.append("the broker did not say its pid")
    else:
        try:
            owner = os.stat(os.path.join(procDir, str(brokerPid))).st_uid
        except OSError:
            problems.append(f"the broker's process {brokerPid} is not in {procDir}")
        else:
            if owner != me:
                problems.append(f"the broker (pid {brokerPid}) runs as uid {owner}, not {me}")
    if problems:
        return Check(
            name,
            FAIL,
            "; ".join(problems),
            "run the service as the user whose sessions it serves (a user unit: "
            "`agentsandbox setup`); another user's proxy refuses this user's connections",
        )
    return Check(name, OK, f"the proxy and the broker run as uid {me}")


def askDispatcher(path: str) -> dict[str, Any]:
    """The dispatcher's status, plus ``answeredBy``: the uid of the socket's owner (SO_PEERCRED)."""
    from agentsandbox.egress.dispatchwire import askStatus

    return askStatus(path)


def checkDispatcher(
    config: Config,
    environ: Mapping[str, str],
    report: Mapping[str, Any] | None,
    ask: Callable[[str], dict[str, Any]] = askDispatcher,
    uid: int | None = None,
    procDir: str = "/proc",
) -> Check:
    """Whether the service is bound directly or registered with a dispatcher, and
    whether that dispatcher is absent, unreachable, or serving the port for someone else."""
    from agentsandbox.egress.dispatchwire import DispatchQueryError
    from agentsandbox.packaged import machine
    from agentsandbox.paths import locateDispatchSocket

    name = "dispatcher"
    me = os.getuid() if uid is None else uid
    port = config.proxy.port
    proxy = report.get("proxy") if report is not None else None
    mode = proxy.get("mode") if isinstance(proxy, Mapping) else None
    path = locateDispatchSocket(config.proxy.dispatch_socket, environ)
    if path is None:
        return Check(name, OK, "none configured (proxy.dispatch_socket = \"\"): the service binds the port itself")
    if config.proxy.listen is not None:
        return Check(name, OK, f"not used: proxy.listen = {config.proxy.listen!r} binds as told")
    here = machine(environ)
    if not os.path.lexists(path):
        if not here.package:
            return Check(name, OK, f"absent ({path} does not exist): the service binds 127.0.0.1:{port} itself")
        if mode == "direct":
            yours = (
                f"your service bound 127.0.0.1:{port} itself, so the dispatcher cannot start and other "
                "users' services cannot serve; stop your service (`systemctl --user stop agentsandbox`, or "
                "end `agentsandbox serve`), then the dispatcher starts, then start your service again"
            )
        else:
            yours = "your service waits for it and registers when it starts, serving nothing meanwhile"
        return Check(
            name, FAIL,
            f"not running on this package machine ({here.evidence()}): {path} does not exist; {yours}",
            "start the dispatcher " + here.startAdvice(path),
        )  # fmt: skip
    try:
        status = ask(path)
    except DispatchQueryError as e:
        stale = "" if here.package else f" (or remove the stale {path} on a single-user machine)"
        return Check(
            name, FAIL,
            f"unreachable: {e}; your service keeps trying to register and serves nothing meanwhile",
            "start the dispatcher " + here.startAdvice(path) + stale,
        )  # fmt: skip
    ports = [str(p) for p in status.get("ports") or ()]
    if f"127.0.0.1:{port}" not in ports:
        return Check(
            name, FAIL,
            f"the dispatcher on {path} serves {', '.join(ports) or 'no port'}, not proxy.port {port}: "
            "your sandbox dials a port it does not serve",
            f"set proxy.port to the dispatcher's port (the socket unit's ListenStream=) in {config.source}",
        )  # fmt: skip
    answeredBy = status.get("answeredBy")
    owners = listenerUids(port, procDir)
    if isinstance(answeredBy, int) and owners and answeredBy not in owners:
        return Check(
            name, FAIL,
            f"port {port} is held by uid {', '.join(map(str, sorted(owners)))}, not by the dispatcher (uid "
            f"{answeredBy}): your sandbox's connections reach someone else's process",
            f"stop what holds port {port} (`ss -ltnp 'sport = :{port}'`), then restart the dispatcher",
        )  # fmt: skip
    registered = {r.get("uid") for r in status.get("registered") or () if isinstance(r, Mapping)}
    if me == 0 and me not in registered and status.get("servesRoot") is False:
        return Check(
            name, FAIL,
            f"the dispatcher on {path} serves 127.0.0.1:{port} but does not let uid 0 (root) register: "
            "proxy.dispatch_root is not true in the machine's config, so root's sandboxes get 503",
            "set proxy.dispatch_root = true in /etc/agentsandbox/config.toml and restart the dispatcher "
            "(`systemctl restart agentsandbox-dispatch`), or run agents as another user",
        )  # fmt: skip
    if me not in registered:
        fix = SERVICE_FIX
        if mode == "direct":
            fix = "restart your service so it registers: `systemctl --user restart agentsandbox`"
        return Check(
            name, FAIL,
            f"the dispatcher on {path} serves 127.0.0.1:{port} but no service of uid {me} is registered: "
            "your sandbox's connections get 503",
            fix,
        )  # fmt: skip
    if mode is not None and mode != "dispatcher":
        return Check(name, FAIL, f"uid {me} is registered, but not by the service that answers the broker", SERVICE_FIX)
    return Check(name, OK, f"registered with the dispatcher on {path} (pid {status.get('pid', '?')}, {', '.join(ports)})")


def builtinFix(source: str) -> str:
    """What turns the built-in GitHub rule on, or off for good."""
    return (
        "`gh auth login` on the host (the service fetches `gh auth token` again within its renewal "
        "period; `systemctl --user restart agentsandbox` fetches it at once), or `inject = []` in "
        f"{source} if the proxy should set no GitHub credential"
    )


def checkBuiltinGithub(config: Config) -> Check | None:
    """The built-in GitHub rule, where the config names no ``inject``: which hosts it covers.

    None when the config names its own ``inject`` (then only its rules count)."""
    from agentsandbox.config import GITHUB_HOSTS

    if not config.inject_builtin:
        return None
    name = "built-in GitHub rule"
    covered = [h for rule in config.inject if rule.builtin for h in rule.hosts]
    if not covered:
        return Check(
            name, WARN,
            f"inactive: sandbox.domains in {config.source} admits none of {', '.join(GITHUB_HOSTS)}, "
            "so the proxy sets no GitHub credential",
            f"add github.com (and *.github.com) to sandbox.domains and run `gh auth login`, or set "
            f"`inject = []` in {config.source} to say the built-in rule is not wanted",
        )  # fmt: skip
    return Check(name, OK, f"covers {', '.join(covered)} (the config names no inject)")


def checkTokens(
    rules: Sequence[InjectRule], report: Mapping[str, Any] | None, runner: Runner | None = None, source: str = "the config"
) -> list[Check]:
    """A token is present for every inject rule, by the service's own account.

    A missing token of a ``[[inject]]`` rule fails; of the built-in GitHub rule it
    is a warning (the rule is inactive until ``gh auth token`` answers: the proxy
    tunnels GitHub untouched meanwhile).  When the service does not answer, the
    built-in rule's ``gh auth token`` is asked here with ``runner``, as this user.
    """
    checks: list[Check] = []
    tokens = report.get("tokens") if report is not None else None
    for rule in rules:
        name = "token for " + ", ".join(rule.hosts)
        if not isinstance(tokens, list):
            if rule.builtin and runner is not None and isinstance(rule.token, CommandSource):
                checks.append(_probeBuiltin(name, rule, runner, source))
                continue
            checks.append(
                Check(name, UNKNOWN, "the service did not report token state "
                      + ("(it is not answering)" if report is None else "(its status carries none)"))
            )
            continue
        entry = next(
            (
                t
                for t in tokens
                if isinstance(t, dict) and set(t.get("hosts") or ()) & set(rule.hosts)
            ),
            None,
        )
        if entry is None:
            checks.append(Check(name, UNKNOWN, "the service reports no keeper for these hosts"))
        elif entry.get("present"):
            checks.append(Check(name, OK, f"present ({rule.token.describe()})"))
        elif rule.builtin:
            error = entry.get("lastError") or "not fetched yet"
            why = (
                f"the built-in GitHub rule is inactive: no token from {rule.token.describe()} ({error}); "
                "the proxy tunnels these hosts untouched, without a credential"
            )
            checks.append(Check(name, WARN, why, builtinFix(source)))
        else:
            error = entry.get("lastError") or "not fetched yet"
            checks.append(
                Check(name, FAIL, f"no token from {rule.token.describe()}: {error}", rule.token.fix())
            )
    return checks


def _probeBuiltin(name: str, rule: InjectRule, runner: Runner, source: str) -> Check:
    """The built-in rule's token command, run here (the service is not answering)."""
    from agentsandbox.tokens import TokenError, checkToken

    assert isinstance(rule.token, CommandSource)
    p = runner(list(rule.token.command))
    what = rule.token.describe()
    if p.returncode == 0:
        try:
            checkToken(p.stdout.encode("utf-8", "replace"), what)
        except TokenError as e:
            why = str(e)
        else:
            return Check(name, OK, f"{what} gives a token (asked here: the service is not answering)")
    else:
        why = _why(p)
    return Check(
        name, WARN,
        f"the built-in GitHub rule is inactive: {what} gives no token ({why}); "
        "the proxy tunnels these hosts untouched, without a credential",
        builtinFix(source),
    )  # fmt: skip


def checkAddressEntries(policy: Policy) -> Check:
    """Allow-list entries that are addresses: who inside the sandbox reaches them.

    A warning, never a failure: clients that use the proxy variables reach them
    (``Policy.noProxy``); the fix says what the others need.
    """
    from agentsandbox.policy import PROXY_AWARE, literalFixes, noProxyNote

    name = "address entries"
    fixes: list[str] = []
    listed: list[str] = []
    for text in policy.domains:
        found = literalFixes(text)
        if found is None:
            continue
        listed.append(repr(text))
        fixes += [f for f in found if f not in fixes]
    if not listed:
        return Check(name, OK, "sandbox.domains lists no IP address, CIDR block or loopback name")
    return Check(
        name,
        WARN,
        f"{', '.join(listed)}: inside the sandbox, {PROXY_AWARE} reach "
        f"{'it' if len(listed) == 1 else 'them'} through the proxy; {noProxyNote(policy.noProxy())}",
        "; ".join(fixes),
    )


def checkBundle(egressDir: str | None) -> Check:
    """The CA bundle sandboxed programs trust (system roots + the injection CA) is readable."""
    name = "CA bundle"
    if egressDir is None:
        return Check(
            name,
            FAIL,
            "no runtime dir ($XDG_RUNTIME_DIR is not set), so there is no egress dir",
            "log in through a session that sets XDG_RUNTIME_DIR (systemd-logind), or set it",
        )
    bundle = os.path.join(egressDir, "bundle.pem")
    try:
        with open(bundle, "rb") as f:
            head = f.read(1 << 20)
    except OSError as e:
        return Check(
            name,
            FAIL,
            f"cannot read {bundle}: {e.strerror or e}",
            "the service writes it when it starts: " + SERVICE_FIX,
        )
    if b"-----BEGIN CERTIFICATE-----" not in head:
        return Check(name, FAIL, f"{bundle} holds no certificate", "restart the service; it rewrites the bundle")
    return Check(name, OK, f"{bundle} is readable")


# --------------------------------------------------------------------------- answering (issue 28)


def controlAnswers(path: str) -> str | None:
    """None when the service's control socket answers ``list``; else why not."""
    from agentsandbox.watch import NotRunning, ask

    try:
        reply = ask(path, {"op": "list"}, timeout=5)
    except NotRunning:
        return f"nothing listens on {path}"
    except (OSError, ValueError) as e:
        return f"{path} does not answer: {e}"
    return None if reply.get("ok") else f"{path} refused to list: {reply.get('error', '?')}"


def checkUnlisted(config: Config) -> Check | None:
    """Observe mode is said loudly: unlisted hosts go through, nothing is enforced by name."""
    if config.proxy.unlisted != "observe":
        return None
    return Check(
        "unlisted hosts", WARN,
        "OBSERVING, NOT ENFORCING: proxy.unlisted = \"observe\" lets every unlisted host through "
        "(address rules still refuse) and only records it as \"would refuse\"",
        "when the list is complete: `agentsandbox suggest` prints the entries for sandbox.domains; "
        "then set proxy.unlisted = \"refuse\" (or \"ask\")",
    )  # fmt: skip


def checkChannels(
    config: Config,
    environ: Mapping[str, str],
    runner: Runner,
    which: Callable[[str], str | None],
    control: Callable[[str], str | None] = controlAnswers,
) -> list[Check]:
    """Where this user can answer a held request: the command line and watch (the control
    socket), and desktop notifications (a session bus with a notification server)."""
    from agentsandbox.approvals import controlSocket
    from agentsandbox.desktop import desktopChannel

    mode = config.proxy.unlisted
    checks = []
    name = "answering: approve, watch"
    runtimeDir = config.paths.runtimeDir
    why = "no runtime directory ($XDG_RUNTIME_DIR), so no control socket" if runtimeDir is None else control(
        controlSocket(runtimeDir)
    )
    if why is None:
        checks.append(Check(name, OK, f"`agentsandbox approvals`, `approve`, `deny` and `watch` answer here "
                                      f"({controlSocket(str(runtimeDir))})"))  # fmt: skip
    elif mode == "ask":
        checks.append(Check(name, FAIL, f"proxy.unlisted = \"ask\" but nobody can answer: {why}", SERVICE_FIX))
    else:
        checks.append(Check(name, OK, f"not needed while proxy.unlisted = \"{mode}\" ({why})"))
    yes, detail = desktopChannel(environ, runner, which)
    desktop = "answering: desktop"
    if yes is None:
        checks.append(Check(desktop, UNKNOWN, detail, "apt install libglib2.0-bin to know"))
    elif yes:
        checks.append(Check(desktop, OK, f"yes: {detail}"))
    else:
        checks.append(Check(desktop, OK, f"no: {detail}; the command line and watch answer instead"))
    return checks


# --------------------------------------------------------------------------- the whole run


@dataclass
class Inputs:
    """Everything doctor looks at; the defaults are this machine."""

    environ: Mapping[str, str]
    runner: Runner
    which: Callable[[str], str | None]
    managedDir: str | None = None
    procDir: str = "/proc"
    ask: Callable[[str, str], bytes] = askBroker
    connect: Callable[[int], str | None] = connectTCP
    askDispatcher: Callable[[str], dict[str, Any]] = askDispatcher
    control: Callable[[str], str | None] = controlAnswers

    @classmethod
    def system(cls, environ: Mapping[str, str] | None = None) -> Inputs:
        env = dict(os.environ if environ is None else environ)
        path = env.get("PATH")
        return cls(
            environ=env,
            runner=systemRunner(env),
            which=lambda name: shutil.which(name, path=path),
        )


def diagnose(configPath: str | None, inputs: Inputs) -> list[Check]:
    checks: list[Check] = []
    for name in TOOLS:
        checks.append(checkTool(name, inputs.which, inputs.runner))
    checks.append(checkBwrapWorks(inputs.which("bwrap"), inputs.runner))
    checks.append(checkSrtWorks(inputs.which("srt"), inputs.runner))
    configCheck, config = checkConfig(configPath, inputs.environ)
    checks.append(configCheck)
    paths = Paths.fromEnvironment(inputs.environ)
    if config is not None:
        checks.extend(checkWishes(config))
        policy = Policy.fromConfig(config, inputs.environ)
        checks.append(checkDropIn(inputs.environ, inputs.managedDir))
        checks.append(checkAddressEntries(policy))
    checks.append(checkServerManaged(paths.claudeDir))
    if config is not None:
        serviceCheck = checkService(inputs.runner)
        if serviceCheck is not None:
            checks.append(serviceCheck)
            checks.append(checkUserBus(inputs.environ))
        brokerCheck, report = checkBroker(config.broker.spool, inputs.ask)
        checks.append(brokerCheck)
        proxyCheck = checkProxy(config.proxy.port, inputs.connect)
        checks.append(proxyCheck)
        unlisted = checkUnlisted(config)
        if unlisted is not None:
            checks.append(unlisted)
        checks.extend(checkChannels(config, inputs.environ, inputs.runner, inputs.which, inputs.control))
        dispatcherCheck = checkDispatcher(config, inputs.environ, report, inputs.askDispatcher, procDir=inputs.procDir)
        checks.append(dispatcherCheck)
        proxy = report.get("proxy") if report is not None else None
        viaDispatcher = isinstance(proxy, dict) and proxy.get("mode") == "dispatcher"
        if not brokerCheck.failed and not proxyCheck.failed:
            pid = report.get("pid") if report is not None else None
            checks.append(
                checkSameUser(
                    config.proxy.port, pid if isinstance(pid, int) else None, procDir=inputs.procDir, viaDispatcher=viaDispatcher
                )
            )
        builtin = checkBuiltinGithub(config)
        if builtin is not None:
            checks.append(builtin)
        checks.extend(checkTokens(config.inject, report, inputs.runner, config.source))
        checks.append(checkBundle(paths.egressDir))
    checks.append(checkClaude(inputs.which("claude"), inputs.runner))
    return checks


def report(checks: Sequence[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"{c.status:<7} {c.name.ljust(width)}  {c.detail}")
        if c.fix and c.status != OK:
            lines.append(f"{'':<7} {''.ljust(width)}  fix: {c.fix}")
    failed = sum(c.failed for c in checks)
    lines.append("")
    lines.append(
        "all checks passed" if not failed else f"{failed} check{'s' if failed > 1 else ''} failed"
    )
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    parser = cli.parser(
        "doctor",
        "Check that everything the policy needs is in place: the sandbox tools, "
        "the Claude Code drop-in, the service, the tokens, the CA bundle, Claude Code's "
        f"version.  Exit status 0 when no check failed, {cli.EXIT_CONFIG} when the config "
        "cannot be used (after every other check), 1 when another check failed.",
    )
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")
    parser.add_argument("--managed-dir", help="Claude Code's managed-settings root (default: the system one)")
    args = parser.parse_args(argv)
    inputs = Inputs.system()
    inputs.managedDir = args.managed_dir
    checks = diagnose(args.config, inputs)
    if args.json:
        print(json.dumps([c.asDict() for c in checks], indent=2))
    else:
        sys.stdout.write(report(checks))
    return exitStatus(checks)


def exitStatus(checks: Sequence[Check]) -> int:
    """0 when nothing failed; the config error's status when the config failed; else 1."""
    if any(c.name == CONFIG_CHECK and c.failed for c in checks):
        return cli.EXIT_CONFIG
    return 1 if any(c.failed for c in checks) else 0


# --------------------------------------------------------------------------- status


def _duration(seconds: float) -> str:
    s = int(seconds)
    if s < 120:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def _scalar(value: Any) -> str:
    """A figure as a person reads it: no JSON punctuation (``--json`` has that)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return ", ".join(f"{k} {_scalar(v)}" for k, v in sorted(value.items())) or "none"
    if isinstance(value, list | tuple):
        return ", ".join(_scalar(v) for v in value) or "none"
    return str(value)


def statusTable(data: Mapping[str, Any]) -> str:
    """The broker's ``status`` reply as a readable table."""
    lines: list[str] = []
    proxy = data.get("proxy")
    if isinstance(proxy, dict) and proxy.get("unlisted") == "observe":
        lines += [
            "OBSERVING, NOT ENFORCING: proxy.unlisted = \"observe\" lets every unlisted host through,",
            "recorded as \"would refuse\" (address rules still refuse); `agentsandbox suggest` lists them.",
            "",
        ]
    uptime = data.get("uptime")
    head = [f"pid {data.get('pid', '?')}"]
    if isinstance(uptime, int | float):
        head.append(f"up {_duration(uptime)}")
    if "inFlight" in data:
        head.append(f"{data['inFlight']} in flight")
    lines.append("service   " + ", ".join(head))
    if "spool" in data:
        lines.append(f"spool     {data['spool']}")
    config = data.get("config")
    if isinstance(config, dict):
        lines.append(f"config    {config.get('served', '?')}")
        for path, why in sorted((config.get("unwatched") or {}).items()):
            lines.append(f"          not watched: {path}: {why}")
        for notice in config.get("notices") or []:
            lines.append(f"          not granted: {notice}")
    requests = data.get("requests")
    if isinstance(requests, dict):
        outcomes = sorted({o for per in requests.values() if isinstance(per, dict) for o in per})
        lines.append("")
        if not requests:
            lines.append("requests  none yet")
        else:
            width = max(len("op"), *(len(op) for op in requests))
            lines.append("requests  " + "op".ljust(width) + "".join(f"  {o:>8}" for o in outcomes))
            for op in sorted(requests):
                per = requests[op] if isinstance(requests[op], dict) else {}
                lines.append(
                    "          " + op.ljust(width) + "".join(f"  {per.get(o, 0):>8}" for o in outcomes)
                )
    if isinstance(proxy, dict):
        lines.append("")
        width = max((len(k) for k in proxy), default=0)
        for i, key in enumerate(sorted(proxy)):
            lines.append(("proxy     " if i == 0 else "          ") + f"{key.ljust(width)}  {_scalar(proxy[key])}")
        dispatcher = proxy.get("dispatcher")
        if isinstance(dispatcher, dict) and dispatcher.get("portOverridden"):
            lines.append(f"          note: {dispatcher['portOverridden']}")
    tokens = data.get("tokens")
    if isinstance(tokens, list):
        lines.append("")
        if not tokens:
            lines.append("tokens    no inject rules")
        for i, t in enumerate(tokens):
            lines.append(("tokens    " if i == 0 else "          ") + _describeToken(t))
    known = {"pid", "uptime", "inFlight", "spool", "requests", "proxy", "tokens", "config"}
    rest = {k: v for k, v in data.items() if k not in known}
    if rest:
        lines.append("")
        width = max(len(k) for k in rest)
        for key in sorted(rest):
            lines.append(f"{key.ljust(width)}  {_scalar(rest[key])}")
    return "\n".join(lines) + "\n"


def _describeToken(t: Any) -> str:
    if not isinstance(t, dict):
        return _scalar(t)
    hosts = ", ".join(t.get("hosts") or ()) or "no host"
    state = "present" if t.get("present") else "MISSING"
    age = t.get("age")
    if t.get("present") and isinstance(age, int | float):
        state += f", fetched {_duration(age)} ago"
    parts = [f"{hosts}: {state}"]
    if t.get("source"):
        parts.append(f"from {t['source']}")
    if t.get("lastError"):
        parts.append(f"last error: {t['lastError']}")
    return "; ".join(parts)


def statusMain(argv: list[str]) -> int:
    parser = cli.parser(
        "status",
        "Show the running service's figures (the broker's status op): requests "
        "per op, uptime, proxy figures and token state.",
    )
    parser.add_argument("--json", action="store_true", help="print the raw figures as JSON")
    args = parser.parse_args(argv)
    from agentsandbox.broker.client import BrokerError

    config = cli.loadConfig("status", args.config)
    try:
        raw = askBroker(config.broker.spool, "status")
        data = json.loads(raw)
    except (BrokerError, OSError) as e:
        print(f"agentsandbox status: {e}", file=sys.stderr)
        print(f"agentsandbox status: fix: {SERVICE_FIX}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"agentsandbox status: the broker's status reply is not JSON: {e}", file=sys.stderr)
        return 1
    if not isinstance(data, dict):
        print("agentsandbox status: the broker's status reply is not a JSON object", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        sys.stdout.write(statusTable(data))
    return 0

