"""``agentsandbox setup`` and ``agentsandbox uninstall``: daily use for one user, and its undo.

``setup`` (run as the user):

1. writes a commented starter config when no config exists anywhere in the
   lookup (``$AGENTSANDBOX_CONFIG``, the user's, the system's), so a system-wide
   config is never shadowed;
2. installs the systemd user unit (and, with ``--socket``, the socket unit) in
   ``~/.config/systemd/user`` unless a package already ships it, then
   ``systemctl --user daemon-reload`` and ``enable --now``; where no user
   manager runs it says so and carries on;
3. installs the Claude Code drop-in, or prints the one root command that does;
4. runs ``doctor``, whose exit status becomes setup's.

Everything it writes or switches on is recorded in ``<state>/install.json``
(path and SHA-256 of each file, each directory it created, each unit it
enabled).  ``uninstall`` reverses exactly that: it removes a recorded file only
while it still holds what setup wrote, a directory only when it is empty, and
never touches anything setup did not write.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources

from agentsandbox import cli
from agentsandbox.config import Config, ConfigError
from agentsandbox.files import atomicWrite
from agentsandbox.loader import load
from agentsandbox.paths import DROP_IN_NAME, Paths, locateConfig, locateDispatchSocket, managedDir
from agentsandbox.policy import Policy, executable
from agentsandbox.probes import Runner, firstLine, systemRunner

SERVICE = "agentsandbox.service"
SOCKET = "agentsandbox.socket"
RECORD = "install.json"
RECORD_VERSION = 1
#: Where packages put user units; a unit found there is used as it is.
PACKAGED_UNIT_DIRS = (
    "/etc/systemd/user",
    "/usr/local/lib/systemd/user",
    "/usr/lib/systemd/user",
    "/lib/systemd/user",
)
#: The ExecStart line of the shipped unit; setup points it at this install.
_SHIPPED_EXEC = "ExecStart=/usr/bin/agentsandbox-twistd "
_SHIPPED_LISTEN = "ListenStream=127.0.0.1:3190"
SOCKET_LISTEN = "systemd:domain=INET:index=0"
#: Seconds the service must stay running after ``enable --now`` before setup says it
#: runs: a broken install (no CA bundle, say) starts, then exits about a second later.
SETTLE = 3.0
LINGER_DIR = "/var/lib/systemd/linger"


class SetupError(Exception):
    """Setup cannot go on; the message says why and what to do, ``status`` is the exit status."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


# --------------------------------------------------------------------------- files we ship


def shippedUnit(name: str) -> str:
    return resources.files("agentsandbox").joinpath("data", name).read_text(encoding="utf-8")


def renderService(bindir: str) -> str:
    """The user unit with ExecStart at ``bindir``/agentsandbox-twistd."""
    if not os.path.isabs(bindir) or any(c in bindir for c in " \t\n\"'\\$;"):
        raise SetupError(
            f"cannot write a unit for {bindir!r}: systemd needs an absolute path without "
            "blanks, quotes, backslashes or $ (install agentsandbox somewhere plainer)"
        )
    text = shippedUnit(SERVICE)
    if _SHIPPED_EXEC not in text:  # pragma: no cover - guards the shipped file
        raise SetupError("the shipped unit has no ExecStart line to point at this install")
    program = os.path.join(bindir, "agentsandbox-twistd").replace("%", "%%")
    return text.replace(_SHIPPED_EXEC, f"ExecStart={program} ", 1)


def renderSocket(port: int) -> str:
    return shippedUnit(SOCKET).replace(_SHIPPED_LISTEN, f"ListenStream=127.0.0.1:{port}", 1)


def starterConfig(socket: bool, now: datetime.datetime | None = None) -> str:
    when = (now or datetime.datetime.now()).strftime("%Y-%m-%d")
    listen = (
        f'# The proxy port comes from agentsandbox.socket (setup --socket).\nlisten = "{SOCKET_LISTEN}"\n'
        if socket
        else '# listen = "tcp:3190:interface=127.0.0.1"\n'
    )
    return f"""\
# agentsandbox config, written by `agentsandbox setup` on {when}.
#
# Every key is optional: one left out keeps its built-in default, and
# `agentsandbox config` prints the effective values.  Unknown keys are errors,
# so a typo never weakens the policy.  Paths may start with ~/.
# The service reloads this file when it changes; run `agentsandbox install`
# afterwards so Claude Code's drop-in follows (doctor tells when it differs).

[sandbox]
# What sessions may read besides the system: your home and your runtime dir
# are closed, apart from what is listed here.
read = []
# What sessions may write, besides the working directory of a session.
# Hint: list where your projects live, e.g. write = ["~/src"].  A path listed
# here must not lie inside a path listed in read.
write = []
# Closed even where a list above opens it.
# deny = ["~/src/secrets"]
# Hosts sessions may reach through the egress proxy: host, *.domain,
# host:port, IP:port, CIDR.  The default is GitHub's hosts.
# domains = ["github.com", "*.github.com", "*.githubusercontent.com", "example.org"]
# Hosts refused even where domains allows them, and never asked about
# (agentsandbox deny HOST --always writes here).
# refused_domains = []

[proxy]
# The loopback port sandboxed programs reach the proxy on.
# port = 3190
# A host off sandbox.domains is refused ("refuse"), or held while you are
# asked ("ask"): answer with agentsandbox approvals / approve HOST / deny HOST,
# or agentsandbox watch; approve --always adds the host to domains above.
# Nobody answering within ask_timeout seconds refuses it.  "observe" lets
# unlisted hosts through and records them, to learn a first list (suggest).
# unlisted = "refuse"
# ask_timeout = 90
{listen}"""


# --------------------------------------------------------------------------- the record


def sha256(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


@dataclass
class Record:
    """What setup did: files written (path -> sha256), directories made, units enabled."""

    files: dict[str, str] = field(default_factory=dict)
    dirs: list[str] = field(default_factory=list)
    enabled: list[str] = field(default_factory=list)

    def toJSON(self) -> str:
        return json.dumps(
            {"version": RECORD_VERSION, "files": self.files, "dirs": self.dirs, "enabled": self.enabled},
            indent=2,
            sort_keys=True,
        ) + "\n"

    @classmethod
    def load(cls, path: str) -> Record | None:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise SetupError(f"cannot read {path}: {e}; fix or remove it by hand") from None
        if not isinstance(data, dict) or data.get("version") != RECORD_VERSION:
            raise SetupError(f"{path} is not a record this version of agentsandbox wrote")
        files = data.get("files", {})
        dirs = data.get("dirs", [])
        enabled = data.get("enabled", [])
        if not (
            isinstance(files, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in files.items())
            and isinstance(dirs, list)
            and all(isinstance(d, str) for d in dirs)
            and isinstance(enabled, list)
            and all(isinstance(u, str) for u in enabled)
        ):
            raise SetupError(f"{path} is malformed; fix or remove it by hand")
        return cls(files=dict(files), dirs=list(dirs), enabled=list(enabled))

    def save(self, path: str) -> None:
        atomicWrite(path, self.toJSON().encode(), 0o600)

    @property
    def empty(self) -> bool:
        return not (self.files or self.dirs or self.enabled)


def _makeDirs(path: str, record: Record, mode: int = 0o755) -> None:
    """Create ``path`` and its missing parents, recording each one made."""
    missing: list[str] = []
    p = os.path.abspath(path)
    while not os.path.exists(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    for d in reversed(missing):
        os.mkdir(d, mode)
        if d not in record.dirs:
            record.dirs.append(d)


def systemctl(runner: Runner, *args: str) -> tuple[bool, str]:
    """``systemctl --user ARGS``: whether it succeeded, and the first thing it said."""
    p = runner(["systemctl", "--user", *args])
    return p.returncode == 0, firstLine(p.stderr) or firstLine(p.stdout) or f"exit status {p.returncode}"


# --------------------------------------------------------------------------- setup


@dataclass
class Setup:
    """One run of setup: its inputs, what it says, what it records."""

    environ: Mapping[str, str]
    runner: Runner
    socket: bool = False
    managed: str | None = None
    bindir: str | None = None
    packagedUnitDirs: Sequence[str] = PACKAGED_UNIT_DIRS
    say: Callable[[str], None] = print
    sleep: Callable[[float], None] = time.sleep
    monotonic: Callable[[], float] = time.monotonic
    lingerDir: str = LINGER_DIR
    #: False once the service was started but is not running (setup then exits non-zero).
    running: bool = True

    def __post_init__(self) -> None:
        self.paths = Paths.fromEnvironment(self.environ)
        self.recordPath = os.path.join(self.paths.stateDir, RECORD)
        self.record = Record()

    @property
    def unitDir(self) -> str:
        return os.path.join(self.paths.configHome, "systemd", "user")

    def writeFile(self, path: str, text: str, mode: int) -> bool:
        """Write ``path`` unless someone else's file is there; True when written or current."""
        data = text.encode()
        want = hashlib.sha256(data).hexdigest()
        current = sha256(path)
        if current == want:
            if path not in self.record.files and os.path.lexists(path):
                # Same bytes, but not ours: leave it unrecorded.
                return True
            self.record.files[path] = want
            return True
        if current is not None or os.path.lexists(path):
            mine = self.record.files.get(path)
            if mine is None:
                self.say(f"  left {path} as it is: setup did not write it (move it away to let setup manage it)")
                return False
            if mine != current:
                self.say(f"  left {path} as it is: it was edited after setup wrote it")
                return False
        _makeDirs(os.path.dirname(path), self.record)
        atomicWrite(path, data, mode)
        self.record.files[path] = want
        return True

    # ------------------------------------------------------------------ steps

    def config(self) -> Config:
        located = locateConfig(None, self.environ)
        if located is None:
            path = self.paths.userConfig
            self.writeFile(path, starterConfig(self.socket), 0o644)
            self.say(f"config: wrote a starter config to {path} (edit sandbox.write and sandbox.domains)")
        try:
            config = load(None, self.environ)
        except ConfigError as e:
            raise SetupError(f"the config cannot be used: {e}", cli.EXIT_CONFIG) from None
        if located is not None:
            self.say(f"config: using {config.served}")
        for notice in config.notices:
            self.say(f"config: not granted: {notice}")
        dispatcher = locateDispatchSocket(config.proxy.dispatch_socket, self.environ)
        if self.socket and dispatcher is not None and os.path.exists(dispatcher):
            # Both would own proxy.port: the user socket fails with "Address already in use".
            raise SetupError(
                f"--socket: this machine's dispatcher ({dispatcher}) holds proxy.port "
                f"{config.proxy.port} for every user, so agentsandbox.socket could not bind it; "
                "run setup without --socket: the service registers with the dispatcher"
            )
        if self.socket and not (config.proxy.listen or "").startswith("systemd:"):
            raise SetupError(
                f'--socket needs proxy.listen = "{SOCKET_LISTEN}" in {config.source}, so the '
                "service takes the port from agentsandbox.socket"
            )
        return config

    def packagedUnit(self, name: str) -> str | None:
        for d in self.packagedUnitDirs:
            path = os.path.join(d, name)
            if os.path.exists(path):
                return path
        return None

    def units(self, config: Config) -> list[str]:
        """Install the unit files; the units to enable."""
        wanted = [SERVICE, SOCKET] if self.socket else [SERVICE]
        for name in wanted:
            packaged = self.packagedUnit(name)
            if packaged is not None:
                self.say(f"unit: using the packaged {packaged}")
                continue
            path = os.path.join(self.unitDir, name)
            text = (
                renderService(self.bindir or os.path.dirname(executable()))
                if name == SERVICE
                else renderSocket(config.proxy.port)
            )
            if self.writeFile(path, text, 0o644):
                self.say(f"unit: {path}")
        return wanted

    def systemctl(self, *args: str) -> tuple[bool, str]:
        return systemctl(self.runner, *args)

    def enable(self, units: list[str]) -> None:
        ok, why = self.systemctl("daemon-reload")
        if not ok:
            self.say(
                f"systemd: no user service manager answers here ({why}).\n"
                f"  The unit is installed; where a user manager runs (a login session, or after "
                f"`loginctl enable-linger {self.environ.get('USER', '$USER')}`) start it with\n"
                f"    systemctl --user enable --now {' '.join(units)}\n"
                "  Until then run the service in a terminal: agentsandbox serve"
            )
            return
        before = {u: self.systemctl("is-enabled", u)[0] for u in units}
        ok, why = self.systemctl("enable", "--now", *units)
        if not ok:
            self.say(f"systemd: `systemctl --user enable --now {' '.join(units)}` failed: {why}")
            self.running = self.verifyRunning(SERVICE)
            return
        for u in units:
            if not before[u] and u not in self.record.enabled:
                self.record.enabled.append(u)
        self.say(f"systemd: enabled and started {', '.join(units)}")
        self.running = self.verifyRunning(SERVICE)
        if self.running:
            self.sayLinger()

    def verifyRunning(self, unit: str) -> bool:
        """Whether ``unit`` is still running ``SETTLE`` seconds after it started; says why not."""
        deadline = self.monotonic() + SETTLE
        while True:
            p = self.runner(["systemctl", "--user", "show", "-p",
                             "ActiveState,SubState,NRestarts,Result,ActiveEnterTimestampMonotonic", unit])  # fmt: skip
            props = dict(line.partition("=")[::2] for line in p.stdout.splitlines())
            active, sub = props.get("ActiveState", "?"), props.get("SubState", "?")
            restarts = int(props["NRestarts"]) if props.get("NRestarts", "").isdigit() else 0
            since = props.get("ActiveEnterTimestampMonotonic", "")
            broken = restarts > 0 or active in ("failed", "inactive", "deactivating") or sub == "auto-restart"
            if not broken and active == "active" and sub == "running":
                if since.isdigit() and int(since) > 0 and self.monotonic() - int(since) / 1e6 >= SETTLE:
                    return True
                if self.monotonic() >= deadline:
                    return True
            elif broken or self.monotonic() >= deadline:
                break
            self.sleep(0.25)
        log = self.runner(["journalctl", "--user", "-u", unit, "-n", "5", "--no-pager", "-o", "cat"])
        lines = [ln for ln in log.stdout.splitlines() if ln.strip()][-5:]
        self.say(
            f"systemd: {unit} is NOT running {SETTLE:g} s after it started ({active}/{sub}, "
            f"{restarts} restarts, result {props.get('Result', '?')}).\n"
            + "".join(f"    | {ln}\n" for ln in lines)
            + f"  Its log says why: journalctl --user -u {unit} -n 50\n"
            f"  Then: systemctl --user status {unit}; after fixing it: systemctl --user restart {unit}"
        )
        return False

    def sayLinger(self) -> None:
        user = self.environ.get("USER") or self.environ.get("LOGNAME")
        if not user or os.path.exists(os.path.join(self.lingerDir, user)):
            return
        self.say(
            "systemd: linger is off for this user, so the service stops about 10 s after your last "
            "session ends (sessions started later start it again). To keep it running, for agents "
            f"that run without a login: loginctl enable-linger {user}"
        )

    def dispatcher(self, config: Config) -> None:
        """On a package machine whose dispatcher does not run, say how the admin starts it
        (doctor's dispatcher check, which the run ends with, says the same)."""
        from agentsandbox.doctor import checkDispatcher
        from agentsandbox.packaged import machine
        from agentsandbox.paths import locateDispatchSocket

        path = locateDispatchSocket(config.proxy.dispatch_socket, self.environ)
        if path is None or config.proxy.listen is not None or os.path.lexists(path):
            return
        if not machine(self.environ).package:
            return
        check = checkDispatcher(config, self.environ, None)
        self.say(f"dispatcher: {check.detail}\n  fix: {check.fix}")

    def dropIn(self, config: Config) -> None:
        """Install the machine's drop-in when this user may; else say the root command and its diff.

        The drop-in is rendered from the machine's config (or the built-in
        defaults), never from this user's file: this user's policy reaches
        their sessions through the policy helper the drop-in names.
        """
        from agentsandbox import claude

        Policy.fromConfig(config, self.environ).mountPoints()
        try:
            policy = claude.machinePolicy(self.environ)
        except ConfigError as e:
            self.say(f"drop-in: the machine's config does not load ({e}); the admin fixes {e.source}")
            return
        managed = self.managed or managedDir()
        base = os.path.join(managed, "managed-settings.json")
        dropDir = os.path.join(managed, "managed-settings.d")
        target = os.path.join(dropDir, DROP_IN_NAME)
        existed = {p: os.path.exists(p) for p in (managed, dropDir, base, target)}
        try:
            result = claude.install(policy, managed)
        except OSError as e:
            self.say(f"drop-in: cannot install {target}: {e.strerror or e}")
            return
        if result.steps:
            source = config.machine or "the built-in defaults"
            self.say(
                f"drop-in: no permission to write {target}. Root renders it from {source} "
                "(never from your file; your own config reaches your sessions through the "
                "policy helper it names):\n"
                + "".join(f"    {step}\n" for step in result.steps)
                + ("  it will change:\n" + result.diff if result.diff else "")
            )
            return
        for d in (managed, dropDir):
            if not existed[d] and d not in self.record.dirs:
                self.record.dirs.append(d)
        for f in (base, target):
            if not existed[f] or f in self.record.files:
                digest = sha256(f)
                if digest is not None:
                    self.record.files[f] = digest
        self.say(f"drop-in: {target} is {'installed' if result.changed else 'current'}")

    def run(self) -> None:
        previous = Record.load(self.recordPath)
        if previous is not None:
            self.record = previous
        _makeDirs(self.paths.stateDir, self.record, 0o700)
        try:
            config = self.config()
            units = self.units(config)
            if shutil.which("systemctl", path=self.environ.get("PATH")) is None:
                self.say(
                    "systemd: systemctl is not on the PATH; run the service in a terminal: "
                    "agentsandbox serve"
                )
            else:
                self.enable(units)
            self.dispatcher(config)
            self.dropIn(config)
        finally:
            self.save()

    def save(self) -> None:
        self.record.save(self.recordPath)


def setupMain(argv: list[str]) -> int:
    parser = cli.parser(
        "setup",
        "Set up agentsandbox for daily use as this user: a starter config when none "
        "exists, the systemd user service, the Claude Code drop-in, then doctor.  Everything "
        "done is recorded so `agentsandbox uninstall` can undo exactly that.  Exit status "
        f"{cli.EXIT_CONFIG} when the config cannot be used, else doctor's.",
        config=False,
    )
    parser.add_argument(
        "--socket", action="store_true", help="also install agentsandbox.socket (socket activation)"
    )
    parser.add_argument("--managed-dir", help="Claude Code's managed-settings root (default: the system one)")
    parser.add_argument("--no-doctor", action="store_true", help="skip the doctor run at the end")
    args = parser.parse_args(argv)
    from agentsandbox.broker.client import inSandbox

    if inSandbox():
        print("agentsandbox setup: run it on the host, not inside the sandbox", file=sys.stderr)
        return 2
    if os.geteuid() == 0 and os.environ.get("SUDO_USER"):
        print(
            f"agentsandbox setup: run it as {os.environ['SUDO_USER']}, without sudo: it sets up "
            "the user who runs it, and prints the one root command it needs",
            file=sys.stderr,
        )
        return 2
    environ = dict(os.environ)
    setup = Setup(environ, systemRunner(environ), socket=args.socket, managed=args.managed_dir)
    try:
        setup.run()
    except SetupError as e:
        print(f"agentsandbox setup: {e}", file=sys.stderr)
        return e.status
    print(f"recorded in {setup.recordPath} (`agentsandbox uninstall` undoes it)")
    if not setup.running:
        print(f"agentsandbox setup: {SERVICE} does not run (above: why, and where to look)", file=sys.stderr)
    if args.no_doctor:
        return 0 if setup.running else 1
    print("\ndoctor:")
    from agentsandbox import doctor

    inputs = doctor.Inputs.system(environ)
    inputs.managedDir = args.managed_dir
    checks = doctor.diagnose(None, inputs)
    sys.stdout.write(doctor.report(checks))
    return doctor.exitStatus(checks) or (0 if setup.running else 1)


# --------------------------------------------------------------------------- uninstall


@dataclass
class Uninstall:
    environ: Mapping[str, str]
    runner: Runner
    say: Callable[[str], None] = print

    def __post_init__(self) -> None:
        self.paths = Paths.fromEnvironment(self.environ)
        self.recordPath = os.path.join(self.paths.stateDir, RECORD)

    def systemctl(self, *args: str) -> tuple[bool, str]:
        if shutil.which("systemctl", path=self.environ.get("PATH")) is None:
            return False, "systemctl is not on the PATH"
        return systemctl(self.runner, *args)

    def run(self) -> bool:
        """Undo the record; True when nothing of it is left."""
        record = Record.load(self.recordPath)
        if record is None:
            self.say(f"nothing to undo: setup has not run for this user (no {self.recordPath})")
            return True
        left = Record()
        if record.enabled:
            ok, why = self.systemctl("disable", "--now", *record.enabled)
            if ok:
                self.say(f"systemd: stopped and disabled {', '.join(record.enabled)}")
            else:
                self.say(f"systemd: could not disable {', '.join(record.enabled)}: {why}")
                left.enabled = list(record.enabled)
        unitsRemoved = False
        for path in sorted(record.files, reverse=True):
            digest = record.files[path]
            current = sha256(path)
            if current is None and not os.path.lexists(path):
                self.say(f"already gone: {path}")
                continue
            if current != digest:
                self.say(f"kept {path}: it changed after setup wrote it")
                continue
            try:
                os.unlink(path)
            except PermissionError:
                self.say(f"no permission to remove {path}; as root: sudo rm {shlex.quote(path)}")
                left.files[path] = digest
                continue
            except OSError as e:
                self.say(f"cannot remove {path}: {e.strerror or e}")
                left.files[path] = digest
                continue
            self.say(f"removed {path}")
            unitsRemoved |= path.endswith((".service", ".socket"))
        if unitsRemoved:
            ok, why = self.systemctl("daemon-reload")
            if not ok:
                self.say(f"systemd: daemon-reload skipped ({why})")
        if left.empty:
            # The record goes first: the state dir that holds it may be one to remove.
            os.unlink(self.recordPath)
        for d in sorted(record.dirs, key=len, reverse=True):
            try:
                os.rmdir(d)
            except FileNotFoundError:
                continue
            except OSError as e:
                if os.path.isdir(d) and os.listdir(d):
                    self.say(f"kept {d}: not empty (it holds what setup did not write)")
                else:
                    left.dirs.append(d)
                    self.say(f"cannot remove {d}: {e.strerror or e}")
                continue
            self.say(f"removed {d}/")
        if left.empty:
            return True
        _makeDirs(self.paths.stateDir, Record(), 0o700)
        left.save(self.recordPath)
        self.say(f"what could not be undone stays recorded in {self.recordPath}")
        return False


def uninstallMain(argv: list[str]) -> int:
    parser = cli.parser(
        "uninstall",
        "Undo exactly what `agentsandbox setup` recorded: disable the units it "
        "enabled, remove the files it wrote (only while unchanged) and the directories it "
        "created (only when empty).",
        config=False,
    )
    parser.parse_args(argv)
    environ = dict(os.environ)
    try:
        done = Uninstall(environ, systemRunner(environ)).run()
    except SetupError as e:
        print(f"agentsandbox uninstall: {e}", file=sys.stderr)
        return 1
    return 0 if done else 1

