"""``agentsandbox run [--print] [--] CMD...``: any agent under the same policy, through ``srt``.

Claude Code enforces the policy through its managed-settings drop-in; every other
agent (pi, codex, aider, a plain shell) gets it from Anthropic's sandbox runtime:
``srt --settings FILE -- CMD...`` with the settings rendered from the same
``Policy`` (``agentsandbox.srt.render``).  Network goes through our egress proxy
(``httpProxyPort``/``socksProxyPort`` = ``proxy.port``), so the allow list, the
address rules and the credential injection apply unchanged.

Three rules make it safe to use:

* **Never unenforced.**  Before anything starts, srt, bubblewrap, socat and
  ripgrep must be on the PATH and the service must answer (a broker ping *and*
  a TCP connection to the proxy port on 127.0.0.1, whose listening socket is
  not another user's: the probes of ``agentsandbox.probes``).  Otherwise
  nothing runs and the exit status is ``EX_UNENFORCED`` (125), with a message
  naming the fix.
* **Deny-by-default environment.**  Only variables matching ``[run] env`` pass,
  minus every credential-looking name (``sandbox.unset_env``; ``sandbox.keep_env``
  exempts names, as for Claude Code's sessions), plus the per-user session
  variables the SessionStart hook gives Claude Code's sandboxed Bash.
* **The command's exit status is ours.**  srt passes it through; a command
  killed by a signal gives 128 + the signal number, as a shell reports it.

The settings file is private (0600), holds only paths, host patterns and the
proxy port (the policy has no secrets), and is removed when the command ends.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from types import FrameType
from typing import Any

from agentsandbox import cli, srt
from agentsandbox.config import Config
from agentsandbox.policy import Policy, resolve, under
from agentsandbox.probes import brokerAnswers, connectTCP, proxyOwner

#: ``agentsandbox run`` refused to start the command: the policy could not be enforced.
EX_UNENFORCED = 125
#: A usage or config error: nothing was started (``agentsandbox.cli.EXIT_CONFIG``).
EX_USAGE = cli.EXIT_CONFIG

#: The programs srt needs on the PATH (srt itself, and what it drives on Linux).
REQUIRED_TOOLS: tuple[tuple[str, str], ...] = (
    ("srt", "npm install -g @anthropic-ai/sandbox-runtime"),
    ("bwrap", "apt-get install bubblewrap"),
    ("socat", "apt-get install socat"),
    ("rg", "apt-get install ripgrep"),
)

SERVICE_FIX = (
    "start the service: `systemctl --user start agentsandbox` (after `agentsandbox setup`), "
    "or `agentsandbox serve` in another terminal"
)


# --------------------------------------------------------------------------- the environment


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatchcase(name, p) for p in patterns)


def sandboxEnv(config: Config, policy: Policy, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment the sandboxed command gets: named variables only, never a credential.

    ``[run] env`` names what passes; ``sandbox.unset_env`` removes credential
    names even when a broad ``run.env`` pattern matched them (``sandbox.keep_env``
    exempts a name, as it does for Claude Code's sandboxed Bash).  The session
    variables (``AGENTSANDBOX``, the spool, the CA bundle...) are set last.
    """
    out: dict[str, str] = {}
    for name, value in environ.items():
        if not _matches(name, config.run.env):
            continue
        if _matches(name, config.sandbox.unset_env) and not _matches(name, config.sandbox.keep_env):
            continue
        out[name] = value
    out.update(sessionVars(policy))
    return out


def sessionVars(policy: Policy) -> dict[str, str]:
    """The per-user variables: the policy's, and the egress dir's (CA bundle, gh config,
    git's gpg programs), exactly what the SessionStart hook gives Claude Code's Bash."""
    from agentsandbox.egressdir import egressVars, signingGitConfig

    out = dict(policy.sessionVars())
    if policy.egress is not None:
        out.update(egressVars(policy.egress, signingGitConfig(policy.egress, policy.exe)))
    # srt sets its own over these with --setenv; srtArgv sets them again inside.
    out.update(policy.proxyVars())
    return out


# --------------------------------------------------------------------------- the settings


def writableCwd(policy: Policy, cwd: str) -> str | None:
    """The working directory to add to ``allowWrite``, or None.

    Claude Code's sandbox lets a session write its working directory when the
    policy does (``Policy.whyWritable``); srt writes only what it is told, so the
    directory is listed explicitly.  A directory already covered by
    ``sandbox.write`` needs nothing.
    """
    real = resolve(cwd, "/", policy.home)
    if policy.whyWritable(real, real) is None:
        return None
    if any(under(real, resolve(w, "/", policy.home)) for w in policy.write):
        return None
    return real


def nestedIn(policy: Policy, path: str) -> str | None:
    """The readable path that ``path`` lies strictly inside, if the sandbox mounts one.

    bubblewrap mounts a re-allowed readable directory read-only over anything
    below it, so a writable directory there would make srt refuse to start.
    """
    for r in policy.read:
        if not any(under(r, c) for c in policy.closed()):
            continue
        if r != path and under(path, r):
            return r
    return None


def settingsFor(policy: Policy, cwd: str) -> tuple[dict[str, Any], list[str]]:
    """The srt settings for a run from ``cwd``, and notes for the person."""
    settings = srt.render(policy)
    notes: list[str] = []
    extra = writableCwd(policy, cwd)
    if extra is not None:
        inside = nestedIn(policy, extra)
        if inside is None:
            settings["filesystem"]["allowWrite"].append(extra)
        else:
            notes.append(
                f"the working directory {extra} lies inside the readable path {inside}, which "
                "the sandbox mounts read-only; it stays read-only for this run (list a parent "
                f"in sandbox.write instead of {inside} in sandbox.read to write here)"
            )
    return settings, notes


@contextlib.contextmanager
def settingsFile(settings: Mapping[str, Any], directory: str | None) -> Any:
    """A private (0600) temp file holding ``settings``; removed on the way out."""
    if directory is not None:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix="srt-settings-", suffix=".json", dir=directory)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(srt.dumps(dict(settings)))
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def settingsDir(policy: Policy) -> str | None:
    """Where the settings file goes: the runtime dir (closed to sessions), else $TMPDIR."""
    if policy.runtime is not None and os.path.isdir(policy.runtime):
        return os.path.join(policy.runtime, "agentsandbox", "run")
    return None


# --------------------------------------------------------------------------- enforcement


@dataclass(frozen=True)
class Problem:
    """One reason the policy cannot be enforced, and what fixes it."""

    what: str
    fix: str

    def __str__(self) -> str:
        return f"{self.what}; fix: {self.fix}"


def missingTools(
    searchPath: str | None, which: Callable[..., str | None] = shutil.which
) -> list[Problem]:
    """The required programs that are not on ``searchPath``."""
    if not searchPath:
        return [
            Problem(
                "the command gets no PATH, so srt finds neither node nor bubblewrap",
                'list "PATH" in [run] env',
            )
        ]
    problems = []
    for tool, fix in REQUIRED_TOOLS:
        if which(tool, path=searchPath) is None:
            problems.append(Problem(f"{tool} is not on the PATH ({searchPath})", fix))
    return problems


def dispatcherDiagnosis(config: Config, environ: Mapping[str, str] | None = None) -> tuple[bool, Problem | None]:
    """Whether a dispatcher is involved in this user's proxy port, and what is wrong with it.

    ``doctor``'s dispatcher check decides it (``doctor.checkDispatcher``: the
    dispatcher runs or this package machine expects one; it serves proxy.port;
    the port's listener is the dispatcher's uid by SO_PEERCRED; this uid is
    registered), so ``run`` and ``doctor`` never disagree about a shared port.
    (False, None): no dispatcher here, the port is the user's own to hold;
    (True, None): the dispatcher serves this user; (True, problem): it does not,
    and the problem says why with doctor's fix.
    """
    from agentsandbox.doctor import OK, checkDispatcher
    from agentsandbox.packaged import machine
    from agentsandbox.paths import locateDispatchSocket

    env = os.environ if environ is None else environ
    path = locateDispatchSocket(config.proxy.dispatch_socket, env)
    if path is None or config.proxy.listen is not None:
        return False, None
    if not os.path.lexists(path) and not machine(env).package:
        return False, None
    check = checkDispatcher(config, env, None)
    if check.status == OK:
        return True, None
    return True, Problem(f"the dispatcher: {check.detail}", check.fix or SERVICE_FIX)


def enforcementProblems(
    config: Config,
    searchPath: str | None,
    which: Callable[..., str | None] = shutil.which,
    proxyCheck: Callable[[int], str | None] = connectTCP,
    brokerCheck: Callable[[str], str | None] = brokerAnswers,
    ownerCheck: Callable[[int], str | None] | None = None,
    dispatcher: Callable[[Config], tuple[bool, Problem | None]] = dispatcherDiagnosis,
) -> list[Problem]:
    """Every reason the run would not be enforced; empty when it would be.

    Where a dispatcher is involved (it runs, or this package machine expects
    one), its diagnosis speaks for the port: doctor's words and fix, never
    "another user's program" for the dispatcher itself or a user's own
    unregistered service.
    """
    problems = missingTools(searchPath, which)
    port = config.proxy.port
    involved, problem = dispatcher(config)
    if problem is not None:
        problems.append(problem)
    else:
        why = proxyCheck(port)
        if why is not None:
            problems.append(
                Problem(
                    f"the egress proxy does not answer on 127.0.0.1:{port} (proxy.port): {why}",
                    SERVICE_FIX,
                )
            )
        else:
            if ownerCheck is None:
                why = proxyOwner(port, dispatched=lambda: involved)
            else:
                why = ownerCheck(port)
            if why is not None:
                problems.append(
                    Problem(
                        f"another user's program listens on the proxy port: {why}",
                        "stop it, or move agentsandbox to a free port (proxy.port), then "
                        + SERVICE_FIX,
                    )
                )
    why = brokerCheck(config.broker.spool)
    if why is not None:
        problems.append(Problem(f"the broker does not answer: {why}", SERVICE_FIX))
    return problems


# --------------------------------------------------------------------------- running


#: srt starts its in-sandbox bridges to the proxy (socat listening on localhost:3128
#: and :1080) in the background and runs the command at once, so a command's first
#: connection can find nothing listening ("Couldn't connect to server"); seen under
#: load.  The command starts once both listen in the sandbox's own network namespace
#: (its /proc/net/tcp), or after about two seconds whatever the state.
BRIDGE_WAIT = (
    "i=0; until { grep -q ':0C38 00000000:0000 0A' /proc/net/tcp && "
    "grep -q ':0438 00000000:0000 0A' /proc/net/tcp; } 2>/dev/null; do "
    'i=$((i+1)); [ "$i" -ge 100 ] && break; sleep 0.02; done; exec "$@"'
)


def insideEnv(env: Mapping[str, str]) -> str:
    """Shell that sets the proxy variables of ``env`` inside the sandbox.

    srt gives every command its own ``NO_PROXY`` (loopback and the private
    ranges) through bubblewrap's ``--setenv``, over the caller's environment, so
    the narrowed value (``Policy.noProxy``) takes effect only when set in there.
    """
    names = [n for n in ("NO_PROXY", "no_proxy") if n in env]
    if not names:
        return ""
    return "".join(f"{n}={shlex.quote(env[n])}; " for n in names) + "export " + " ".join(names) + "; "


#: The variable that carries the session credential into the sandbox, where the
#: wrapper moves it into the proxy URLs and unsets it (never in an argv).
CREDENTIAL_VAR = "AGENTSANDBOX_SESSION_CREDENTIAL"


def insideCredential(env: Mapping[str, str]) -> str:
    """Shell (no secret in it) that moves ``$AGENTSANDBOX_SESSION_CREDENTIAL`` into
    the userinfo of the proxy URLs srt set, when ``env`` carries one."""
    if CREDENTIAL_VAR not in env:
        return ""
    from agentsandbox.hook import proxyUserinfoLines

    return "; ".join(proxyUserinfoLines(f'"${CREDENTIAL_VAR}"')) + f"; unset {CREDENTIAL_VAR}; "


def srtArgv(
    srtProgram: str, settingsPath: str, command: Sequence[str], env: Mapping[str, str] | None = None
) -> list[str]:
    """srt running ``command`` exactly (through ``exec "$@"``) once its bridges listen,
    with ``env``'s proxy variables set over srt's own."""
    script = insideEnv(env or {}) + insideCredential(env or {}) + BRIDGE_WAIT
    return [srtProgram, "--settings", settingsPath, "--", "/bin/sh", "-c", script, "agentsandbox-run", *command]


def runSession(config: Any, policy: Policy) -> dict[str, str]:
    """A session of its own for this run (``run-`` and a random name): its credential
    registered with the service, and the variables that carry it into the sandbox.
    Without a broker the command runs unattributed (or, with
    ``proxy.require_session``, without the network), and is told so."""
    import secrets

    from agentsandbox.hook import registerSession

    session = "run-" + secrets.token_hex(6)
    credential, why = registerSession(session, policy.spool)
    if credential is None:
        suffix = " its requests are refused (proxy.require_session)" if config.proxy.require_session else ""
        _say(f"this run has no proxy session ({why});{suffix or ' its requests are not attributed'}")
        return {}
    _say(f"session {session} (agentsandbox log --session {session})")
    return {"AGENTSANDBOX_SESSION": session, CREDENTIAL_VAR: credential}


def exitStatus(returncode: int) -> int:
    """A shell's view of a child's end: the code, or 128 + signal."""
    return 128 - returncode if returncode < 0 else returncode


def runUnder(argv: Sequence[str], env: Mapping[str, str], cwd: str) -> int:
    """Run srt in the foreground, forwarding termination signals; its exit status is ours."""
    child = subprocess.Popen(list(argv), env=dict(env), cwd=cwd)
    forwarded = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def forward(signum: int, frame: FrameType | None) -> None:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in forwarded}
    try:
        while True:
            try:
                return exitStatus(child.wait())
            except InterruptedError:  # pragma: no cover - PEP 475 retries for us
                continue
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def printPlan(settings: Mapping[str, Any], env: Mapping[str, str], command: Sequence[str], notes: Sequence[str]) -> None:
    out = sys.stdout
    out.write("# srt settings (written to a private temp file for the run)\n")
    out.write(srt.dumps(dict(settings)))
    out.write("# environment of the command (everything else is dropped)\n")
    for name in sorted(env):
        out.write(f"{name}={shlex.quote(env[name])}\n")
    for note in notes:
        out.write(f"# note: {note}\n")
    if command:
        out.write("# command\n")
        out.write("srt --settings SETTINGS -- " + shlex.join(command) + "\n")


def _say(message: str) -> None:
    print(f"agentsandbox run: {message}", file=sys.stderr)


def main(argv: list[str]) -> int:
    parser = cli.parser(
        "run",
        "Run any command (an agent, a shell) under srt with the policy's filesystem "
        "lists, the network through the agentsandbox proxy, and a deny-by-default "
        "environment.  The command's exit status is passed through; 125 means agentsandbox "
        "refused to start it because the policy could not be enforced.",
    )
    parser.add_argument(
        "--print",
        dest="printOnly",
        action="store_true",
        help="show the srt settings and the environment, run nothing",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command and its arguments")
    args = parser.parse_args(argv)
    command: list[str] = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command and not args.printOnly:
        parser.print_usage(sys.stderr)
        _say("give the command to run, e.g. agentsandbox run -- bash")
        return EX_USAGE
    configPath = os.path.abspath(args.config) if args.config else None
    return run(command, configPath, args.printOnly, os.environ, os.getcwd())


def run(
    command: Sequence[str],
    configPath: str | None,
    printOnly: bool,
    environ: Mapping[str, str],
    cwd: str,
) -> int:
    from agentsandbox.broker.client import inSandbox

    if inSandbox(environ):
        _say("already inside a sandbox (SANDBOX_RUNTIME=1); run it on the host")
        return EX_UNENFORCED
    config = cli.loadConfig("run", configPath, environ)
    policy = Policy.fromConfig(config, environ)
    settings, notes = settingsFor(policy, cwd)
    env = sandboxEnv(config, policy, environ)
    if printOnly:
        printPlan(settings, env, command, notes)
        return 0
    problems = enforcementProblems(config, env.get("PATH", ""))
    if problems:
        _say(f"refusing to run {shlex.join(command)} unenforced:")
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
        print("  (`agentsandbox doctor` checks everything; `--print` shows the plan)", file=sys.stderr)
        return EX_UNENFORCED
    for note in notes:
        _say(note)
    srtProgram = shutil.which("srt", path=env.get("PATH")) or "srt"
    policy.mountPoints()
    env = {**env, **runSession(config, policy)}
    with settingsFile(settings, settingsDir(policy)) as path:
        try:
            return runUnder(srtArgv(srtProgram, path, command, env), env, cwd)
        except OSError as e:
            _say(f"cannot start srt: {e.strerror or e}")
            return EX_UNENFORCED

