"""The built .deb on this machine, as root: install, two users behind one dispatcher, upgrade, purge.

``scripts/test-deb`` builds the package twice in a temp copy of the tree (the
second build with a bumped changelog version) and runs this module with
``AGENTSANDBOX_DEB`` and ``AGENTSANDBOX_DEB_UPGRADE`` naming the two .debs.
The tests run in file order and each stage builds on the one before:

1. ``apt-get install ./agentsandbox_*_all.deb``: the version, the twistd plugin
   (for root and for a user), the units (``systemd-analyze verify``), the
   drop-in the postinst rendered (the renderer's output, merged by the real
   Claude Code), the fixed-path signing wrappers;
2. two users made here (``useradd``), each with their own config; the
   dispatcher in the foreground on one port (no systemd PID 1 here), each
   user's service under ``agentsandbox-twistd``; for each user
   ``agentsandbox run -- curl`` allowed and refused per that user's policy,
   and one Claude Code session whose hook and sandbox hold;
3. an upgrade to the second build keeps the locally edited
   ``/etc/agentsandbox/config.toml`` and re-renders the drop-in from it;
4. ``dpkg -r`` then ``dpkg -P`` leave nothing of ours in /etc, /usr, /var.

Whatever a stage leaves is undone by the module's fixtures (the package is
purged, the users deleted, ``/etc/claude-code`` restored exactly), and
``scripts/test-deb`` purges again from a trap.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.claude_harness import (
    ClaudeBinary,
    ManagedSettingsGuard,
    asUser,
    freeLoopbackPort,
    getSettings,
    latestClaude,
    missingFrom,
    mockAPI,
    pinnedClaude,
    runClaude,
    tempLeftoversRemoved,
    withoutKeys,
)
from tests.support.mock_messages import ToolCall
from tests.support.service_harness import LocalSite

DEB = os.environ.get("AGENTSANDBOX_DEB", "")
DEB_UPGRADE = os.environ.get("AGENTSANDBOX_DEB_UPGRADE", "")
CONFIG = Path("/etc/agentsandbox/config.toml")
DROP_IN = Path("/etc/claude-code/managed-settings.d/50-agentsandbox.json")
WRAPPERS = Path("/usr/libexec/agentsandbox")
SYSTEM_UNITS = ("/lib/systemd/system/agentsandbox-dispatch.socket", "/lib/systemd/system/agentsandbox-dispatch.service")
USER_UNIT = "/usr/lib/systemd/user/agentsandbox.service"
SOCKET_ENABLED = Path("/etc/systemd/system/sockets.target.wants/agentsandbox-dispatch.socket")
PLAIN_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
#: Where "nothing of ours" is looked for after the purge.
CHECKED_ROOTS = ("/etc", "/usr", "/var")
USERS = ("asdeb-ann", "asdeb-bob")
CANARY = "AGENTSANDBOX-DEB-CANARY-KEY-5e1c"
#: Bounds on waiting for a process to be ready (waits, not timed assertions).
READY_WAIT = 60.0

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="installs a package and makes users: needs root (sudo scripts/test-deb)"),
    pytest.mark.skipif(shutil.which("dpkg-buildpackage") is None, reason="dpkg-buildpackage is absent (.ci/install-deps installs it)"),
    pytest.mark.skipif(
        not DEB, reason="run by scripts/test-deb (the end of scripts/test), which builds the .debs it names in AGENTSANDBOX_DEB"
    ),
]


def sh(argv: list[str], *, user: int | None = None, env: Mapping[str, str] | None = None,
       cwd: str = "/", check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, cwd=cwd, stdin=subprocess.DEVNULL,
        env=dict(env) if env is not None else {"PATH": PLAIN_PATH, "HOME": "/root", "LANG": "C.UTF-8"},
        **asUser(user),
    )
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited {out.returncode}\nstdout: {out.stdout}\nstderr: {out.stderr}")
    return out


def installed() -> bool:
    p = sh(["dpkg-query", "-W", "-f=${Status}", "agentsandbox"], check=False)
    return p.returncode == 0 and "installed" in p.stdout.split()


def ours() -> set[str]:
    """Every path under /etc, /usr and /var whose name says agentsandbox, and /etc/claude-code."""
    found: set[str] = set()
    for root in CHECKED_ROOTS:
        p = sh(["find", root, "-xdev", "-name", "*agentsandbox*"], check=False)
        found |= {line for line in p.stdout.splitlines() if line}
    if os.path.lexists("/etc/claude-code"):
        found.add("/etc/claude-code")
    return found


def rendered(user: int | None = None, env: Mapping[str, str] | None = None) -> str:
    return sh(["/usr/bin/agentsandbox", "render", "claude", "--config", str(CONFIG)], user=user, env=env).stdout


# --------------------------------------------------------------------------- the package


@dataclass
class Package:
    before: set[str]
    log: list[str] = field(default_factory=list)

    def apt(self, deb: str) -> None:
        p = sh(["apt-get", "install", "-y", "--no-install-recommends", deb],
               env={"PATH": PLAIN_PATH, "DEBIAN_FRONTEND": "noninteractive", "HOME": "/root"})
        self.log.append(p.stdout + p.stderr)

    def dpkg(self, *args: str) -> str:
        p = sh(["dpkg", *args])
        self.log.append(p.stdout + p.stderr)
        return p.stdout + p.stderr


@pytest.fixture(scope="module")
def managed() -> Iterator[None]:
    """/etc/claude-code as the test found it, put back exactly at the end."""
    with ManagedSettingsGuard():
        yield


@pytest.fixture(scope="module")
def package(managed: None) -> Iterator[Package]:
    assert not installed(), "agentsandbox is installed already: purge it before this test (dpkg -P agentsandbox)"
    pkg = Package(before=ours())
    pkg.apt(DEB)
    try:
        yield pkg
    finally:
        if installed():
            sh(["dpkg", "-P", "agentsandbox"], check=False)


def test_install_puts_the_commands_on_path(package: Package) -> None:
    assert sh(["agentsandbox", "--version"]).stdout.strip() == "agentsandbox 0.1.0"
    assert shutil.which("agentsandbox", path=PLAIN_PATH) == "/usr/bin/agentsandbox"
    assert "agentsandbox" in sh(["agentsandbox-twistd", "--help"]).stdout


def test_twistd3_lists_the_plugin_for_root_and_for_a_user(package: Package) -> None:
    for user in (None, pwd.getpwnam("nobody").pw_uid):
        p = sh(["twistd3", "--help"], user=user, env={"PATH": PLAIN_PATH, "HOME": "/nonexistent"})
        commands = p.stdout.split("Commands:")[1]
        assert any(line.split()[:1] == ["agentsandbox"] for line in commands.splitlines()), p.stdout
        assert "plugin cache" not in p.stderr, p.stderr


def test_units_verify_and_only_the_dispatcher_socket_is_enabled(package: Package) -> None:
    sh(["systemd-analyze", "verify", *SYSTEM_UNITS])
    runtime = tempfile.mkdtemp()
    try:
        sh(["systemd-analyze", "--user", "verify", USER_UNIT],
           env={"PATH": PLAIN_PATH, "HOME": "/root", "XDG_RUNTIME_DIR": runtime})
    finally:
        shutil.rmtree(runtime)
    # deb-systemd-helper enables the socket even where systemd does not run (nothing starts).
    assert SOCKET_ENABLED.is_symlink()
    assert not Path("/etc/systemd/user/default.target.wants/agentsandbox.service").exists(), (
        "the user unit must be enabled per user by `agentsandbox setup`, not for everyone"
    )


def test_the_installed_drop_in_is_the_renderers_output(package: Package) -> None:
    text = DROP_IN.read_text()
    assert DROP_IN.stat().st_mode & 0o777 == 0o644
    assert text == rendered(), "root's rendering differs from what the postinst installed"
    settings = json.loads(text)
    assert settings["sandbox"]["network"]["allowedDomains"] == ["github.com", "*.github.com", "*.githubusercontent.com"]
    pre = settings["hooks"]["PreToolUse"][0]["hooks"][0]
    assert [pre["command"], *pre["args"]] == [
        "/usr/bin/python3", "-I", "-S", "/usr/lib/python3/dist-packages/agentsandbox/hookstart.py",
        "/usr/bin/agentsandbox", "pretooluse",
    ]
    assert settings["hooks"]["SessionStart"][0]["hooks"][0]["command"] == "/usr/bin/agentsandbox"
    assert settings["policyHelper"] == {"path": "/usr/bin/agentsandbox-policy-helper"}
    assert os.access("/usr/bin/agentsandbox-policy-helper", os.X_OK)
    assert "//run/user/*/agentsandbox/egress" in settings["sandbox"]["filesystem"]["allowRead"]
    # Nothing of root's home went in, and nothing was left there.
    assert "/root" not in text


def test_the_signing_wrappers_are_at_a_fixed_path(package: Package) -> None:
    for name in ("gpg", "ssh-sign"):
        wrapper = WRAPPERS / name
        assert wrapper.stat().st_mode & 0o777 == 0o755
        assert wrapper.read_text() == f'#!/bin/sh\nexec /usr/bin/agentsandbox {name} "$@"\n'


# --------------------------------------------------------------------------- two users


@dataclass
class Person:
    name: str
    uid: int
    gid: int
    home: Path
    runtime: Path
    site: LocalSite
    service: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    def env(self, **extra: str) -> dict[str, str]:
        env = {
            "PATH": PLAIN_PATH, "HOME": str(self.home), "USER": self.name, "LOGNAME": self.name,
            "LANG": "C.UTF-8", "XDG_RUNTIME_DIR": str(self.runtime),
        }
        env.update(extra)
        return env

    def run(self, *argv: str, check: bool = True, **extra: str) -> subprocess.CompletedProcess[str]:
        return sh(list(argv), user=self.uid, env=self.env(**extra), cwd=str(self.home / "work"), check=check)

    @property
    def configFile(self) -> Path:
        return self.home / ".config" / "agentsandbox" / "config.toml"

    def writeConfig(self, allowedPort: int, write: tuple[str, ...] = ("~/work",)) -> None:
        """This user's own policy: one of the machine's two sites, and ``write`` (the machine grants ~/work)."""
        self.configFile.parent.mkdir(parents=True, exist_ok=True)
        self.configFile.write_text(
            f"[sandbox]\nwrite = {json.dumps(list(write))}\n"
            f'domains = ["127.0.0.1:{allowedPort}"]\n'
        )


@dataclass
class Machine:
    port: int
    socket: Path
    people: dict[str, Person]
    dispatcher: subprocess.Popen[bytes]
    logs: Path

    def other(self, person: Person) -> Person:
        return next(p for p in self.people.values() if p is not person)


def _makeUser(name: str) -> Person:
    sh(["userdel", "-r", name], check=False)
    sh(["useradd", "--create-home", "--shell", "/bin/sh", "--user-group", name])
    entry = pwd.getpwnam(name)
    home = Path(entry.pw_dir)
    runtime = Path(f"/run/user/{entry.pw_uid}")
    runtime.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chown(runtime, entry.pw_uid, entry.pw_gid)
    # A key where no credential deny rule of the drop-in reaches: only the hook
    # (file tools) and the sandbox (Bash) stand between it and the model.
    for d in ("work", "old-laptop"):
        (home / d).mkdir(mode=0o700)
    (home / "old-laptop" / "id_ed25519").write_text(f"-----BEGIN OPENSSH PRIVATE KEY-----\n{CANARY}\n")
    return Person(name, entry.pw_uid, entry.pw_gid, home, runtime, LocalSite())


def _chownTree(person: Person) -> None:
    sh(["chown", "-R", f"{person.uid}:{person.gid}", str(person.home)])


def _waitFor(what: str, ready: Any, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + READY_WAIT
    while not ready():
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not ready after {READY_WAIT}s:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def machine(package: Package) -> Iterator[Machine]:
    """The machine's config pointed at a free port, re-rendered; the dispatcher; both users' services."""
    logs = Path(tempfile.mkdtemp(prefix="agentsandbox-deb-logs-"))
    logs.chmod(0o755)  # the dispatcher (nobody) reaches its socket dir through it
    people: dict[str, Person] = {}
    dispatcher: subprocess.Popen[bytes] | None = None
    try:
        port = freeLoopbackPort()
        for name in USERS:
            people[name] = _makeUser(name)
        ann, bob = people[USERS[0]], people[USERS[1]]
        nobody = pwd.getpwnam("nobody")
        sockDir = logs / "dispatch"
        sockDir.mkdir(mode=0o755)
        os.chown(sockDir, nobody.pw_uid, nobody.pw_gid)
        sock = sockDir / "dispatch.sock"
        # An administrator's edit of the machine's policy: the port, the
        # dispatcher's socket (not at its default path here), ~/work writable
        # and both users' sites reachable.  The drop-in names the port, so
        # doctor reports drift until root's `agentsandbox install` re-renders it.
        machineText = CONFIG.read_text().replace("port = 3190", f'port = {port}\ndispatch_socket = "{sock}"')
        machineText = machineText.replace('write = []', 'write = ["~/work"]').replace(
            'domains = ["github.com",',
            f'domains = ["127.0.0.1:{ann.site.port}", "127.0.0.1:{bob.site.port}", "github.com",')
        assert f"127.0.0.1:{bob.site.port}" in machineText and '"~/work"' in machineText
        CONFIG.write_text(machineText)
        doctor = sh(["agentsandbox", "doctor", "--json"], check=False)
        assert "differs from what the machine's config renders" in doctor.stdout, doctor.stdout
        sh(["agentsandbox", "install"])
        assert json.loads(DROP_IN.read_text())["sandbox"]["network"]["httpProxyPort"] == port
        # Each user narrows the machine's: their own site only.  Ann also asks
        # for a directory the machine does not grant (left out, everywhere).
        ann.writeConfig(ann.site.port, write=("~/work", "~/src/other"))
        bob.writeConfig(bob.site.port)
        for person in people.values():
            _chownTree(person)
        dlog = logs / "dispatch.log"
        with open(dlog, "wb") as out:
            dispatcher = subprocess.Popen(
                ["/usr/bin/agentsandbox", "dispatch", "--port", str(port), "--socket", str(sock)],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd="/",
                env={"PATH": PLAIN_PATH, "HOME": "/nonexistent", "LANG": "C.UTF-8"}, **asUser(nobody.pw_uid),
            )
        _waitFor("the dispatcher", lambda: sock.exists() and _listening(port), dispatcher, dlog)

        for person in people.values():
            person.log = logs / f"{person.name}.log"
            with open(person.log, "wb") as out:
                person.service = subprocess.Popen(
                    ["/usr/bin/agentsandbox-twistd", "--nodaemon", "--pidfile=", "--logfile=-", "agentsandbox"],
                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=str(person.home),
                    env=person.env(), **asUser(person.uid),
                )
        for person in people.values():
            assert person.service is not None and person.log is not None
            url = f"http://127.0.0.1:{person.site.port}/ready"

            def registered(person: Person = person, url: str = url) -> bool:
                # Outside the sandbox, straight to the shared port: 200 once this
                # user's service has registered with the dispatcher.
                p = person.run("curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-x",
                               f"http://127.0.0.1:{port}", url, check=False)
                return p.stdout == "200" and person.run("agentsandbox", "ask", "ping", check=False).returncode == 0

            _waitFor(f"{person.name}'s service", registered, person.service, person.log)
        yield Machine(port, sock, people, dispatcher, logs)
    finally:
        for person in people.values():
            _stop(person.service)
            person.site.close()
        _stop(dispatcher)
        for name in USERS:
            sh(["userdel", "-r", name], check=False)
        for person in people.values():
            shutil.rmtree(person.runtime, ignore_errors=True)
        shutil.rmtree(logs, ignore_errors=True)


def _curlLine(port: int, path: str) -> str:
    # --noproxy '': the sandbox's NO_PROXY lists 127.0.0.1; the request must go through the proxy.
    return f"curl -s --noproxy '' -w ' HTTP=%{{http_code}}' http://127.0.0.1:{port}{path}"


@pytest.mark.parametrize("who", USERS)
def test_each_users_run_is_held_to_their_own_policy(machine: Machine, who: str) -> None:
    person = machine.people[who]
    other = machine.other(person)
    mine = person.run("agentsandbox", "run", "--", "sh", "-c", _curlLine(person.site.port, f"/run-{who}"), check=False)
    assert "HTTP=200" in mine.stdout and LocalSite.BODY in mine.stdout, f"{mine.stdout}\n{mine.stderr}"
    assert f"/run-{who}" in person.site.paths
    theirs = person.run("agentsandbox", "run", "--", "sh", "-c", _curlLine(other.site.port, f"/refused-{who}"), check=False)
    assert "HTTP=403" in theirs.stdout and "sandbox.domains" in theirs.stdout, f"{theirs.stdout}\n{theirs.stderr}"
    assert f"/refused-{who}" not in other.site.paths
    # Each decision is in the requester's own audit log and in no one else's.
    own = (person.home / ".local" / "state" / "agentsandbox" / "audit.jsonl").read_text()
    assert f"127.0.0.1:{other.site.port}" in own
    theirLog = other.home / ".local" / "state" / "agentsandbox" / "audit.jsonl"
    assert f"refused-{who}" not in (theirLog.read_text() if theirLog.exists() else "")


def test_the_session_start_hook_points_git_at_the_fixed_wrappers(machine: Machine) -> None:
    ann = machine.people[USERS[0]]
    envFile = ann.home / "session.env"
    ann.run("agentsandbox", "hook", "sessionstart", CLAUDE_ENV_FILE=str(envFile))
    text = envFile.read_text()
    assert f"={WRAPPERS}/gpg\n" in text and f"={WRAPPERS}/ssh-sign\n" in text, text
    envFile.unlink()


@pytest.fixture(params=["pinned", "latest"])
def claude(request: pytest.FixtureRequest) -> ClaudeBinary:
    return pinnedClaude() if request.param == "pinned" else latestClaude()


def _claudeEnv(person: Person, baseURL: str) -> dict[str, str]:
    tmp = person.home / "claude-tmp"
    tmp.mkdir(exist_ok=True)
    os.chown(tmp, person.uid, person.gid)
    path = os.pathsep.join([os.path.dirname(shutil.which("claude") or "/usr/bin/claude"), PLAIN_PATH])
    return person.env(
        PATH=path, ANTHROPIC_BASE_URL=baseURL, ANTHROPIC_API_KEY="sk-ant-deb-test-not-a-key",
        DISABLE_AUTOUPDATER="1", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", ENABLE_TOOL_SEARCH="false",
        CLAUDE_CODE_TMPDIR=str(tmp),
    )


def _helperOutput(person: Person, baseURL: str) -> dict[str, Any]:
    # As Claude Code runs it: a child of a process whose cwd is the session's
    # (the helper reads its parent's), not exec'd in its place.
    out = sh(["sh", "-c", "/usr/bin/agentsandbox-policy-helper; exit $?"], user=person.uid,
             env=_claudeEnv(person, baseURL), cwd=str(person.home / "work"))
    settings: dict[str, Any] = json.loads(out.stdout)["managedSettings"]
    return settings


def test_claude_code_gives_each_user_their_own_policy_through_the_helper(machine: Machine, claude: ClaudeBinary) -> None:
    """Each user's session settings are the policy helper's for that user: same drop-in, two policies."""
    binary = claude.require()
    seen: dict[str, list[str]] = {}
    for person in machine.people.values():
        with mockAPI() as api:
            settings = getSettings(binary, cwd=person.home / "work", env=_claudeEnv(person, api.baseURL),
                                   user=person.uid)
            expected = withoutKeys(_helperOutput(person, api.baseURL), claude.ignoredKeys)
        policy = [s for s in settings.get("sources", []) if s.get("source") == "policySettings"]
        assert policy, json.dumps(settings)[:2000]
        assert missingFrom(policy[0].get("settings"), expected) == []
        assert missingFrom(settings.get("effective"), expected) == []
        network = policy[0]["settings"]["sandbox"]["network"]
        seen[person.name] = network["allowedDomains"]
        assert network["httpProxyPort"] == machine.port
        other = machine.other(person)
        assert "/" + str(other.home) in policy[0]["settings"]["sandbox"]["filesystem"]["denyRead"]
    ann, bob = (machine.people[u] for u in USERS)
    assert seen == {ann.name: [f"127.0.0.1:{ann.site.port}"], bob.name: [f"127.0.0.1:{bob.site.port}"]}


def test_a_claude_code_session_is_held_by_the_hook_and_the_sandbox(machine: Machine) -> None:
    binary = pinnedClaude().require()
    ann = machine.people[USERS[0]]
    bob = machine.other(ann)
    key = str(ann.home / "old-laptop" / "id_ed25519")
    calls = [
        ToolCall("Bash", {"command": _curlLine(ann.site.port, "/claude-allowed")}),
        ToolCall("Bash", {"command": _curlLine(bob.site.port, "/claude-refused")}),
        ToolCall("Read", {"file_path": key}),
        ToolCall("Bash", {"command": f"cat {key}"}),
    ]
    with mockAPI() as api, tempLeftoversRemoved():
        run = runClaude(binary, calls, cwd=ann.home / "work", env=_claudeEnv(ann, api.baseURL), api=api, user=ann.uid)
    assert not run.timedOut and len(run.outcomes) == len(calls), run.describe()
    allowed, refused, read, cat = run.outcomes
    assert "HTTP=200" in allowed.text and "/claude-allowed" in ann.site.paths, run.describe()
    assert "HTTP=403" in refused.text and "/claude-refused" not in bob.site.paths, run.describe()
    assert read.isError and "agentsandbox" in read.text and key in read.text, run.describe()
    assert CANARY not in cat.text, run.describe()
    assert CANARY not in run.everything, run.describe()


# --------------------------------------------------------------------------- one machine, each user's own config


def _doctor(person: Person) -> dict[str, list[dict[str, Any]]]:
    """doctor's checks by name (a name may repeat: one warning per wish left out)."""
    checks: dict[str, list[dict[str, Any]]] = {}
    for check in json.loads(person.run("agentsandbox", "doctor", "--json", check=False).stdout):
        checks.setdefault(check["name"], []).append(check)
    return checks


def test_a_wish_the_machine_does_not_grant_is_left_out_in_all_four_places(machine: Machine) -> None:
    """Ann's file asks for ~/src/other, which /etc/agentsandbox/config.toml does not grant."""
    ann = machine.people[USERS[0]]
    other = ann.home / "src" / "other"
    said = ann.run("agentsandbox", "config").stdout
    assert f"# effective config, from {CONFIG} (the machine's), narrowed by {ann.configFile}" in said, said
    assert "# not granted: " in said and "sandbox.write[1]" in said and f"machine's config {CONFIG}" in said, said
    # The hook's decision, the proxy service's view, run's sandbox:
    check = ann.run("agentsandbox", "check", "write", str(other / "x"), check=False)
    assert check.returncode == 1 and "sandbox.write" in check.stdout, check.stdout
    status = ann.run("agentsandbox", "status").stdout
    assert f"narrowed by {ann.configFile}" in status and "not granted:" in status, status
    # Home is an empty mount in the sandbox: a mkdir there may succeed, and nothing reaches the real home.
    made = ann.run("agentsandbox", "run", "--", "sh", "-c", f"mkdir -p {other} && echo made", check=False)
    assert not other.exists(), made.stdout + made.stderr
    # doctor warns about the wish and finds the machine's drop-in current.
    checks = _doctor(ann)
    wishes = checks.get("config: not granted", [])
    assert [c["status"] for c in wishes] == ["warn"] and "sandbox.write[1]" in wishes[0]["detail"], checks
    assert checks["Claude Code drop-in"][0]["status"] == "ok", checks["Claude Code drop-in"]
    # Claude Code's Bash (the helper's settings) and Write (the hook) agree.
    calls = [ToolCall("Bash", {"command": f"mkdir -p {other} && echo made"}),
             ToolCall("Write", {"file_path": str(other / "w.txt"), "content": "x\n"}),
             ToolCall("Bash", {"command": "mkdir -p ~/work/ok && echo made-ok"})]
    with mockAPI() as api, tempLeftoversRemoved():
        run = runClaude(pinnedClaude().require(), calls, cwd=ann.home / "work", env=_claudeEnv(ann, api.baseURL),
                        api=api, user=ann.uid)
    assert not run.timedOut and len(run.outcomes) == len(calls), run.describe()
    _bash, write, ok = run.outcomes
    assert write.isError and "agentsandbox" in write.text, run.describe()
    assert "made-ok" in ok.text and (ann.home / "work" / "ok").is_dir(), run.describe()
    assert not other.exists(), run.describe()


def test_a_user_whose_config_only_narrows_gets_a_clean_doctor_and_a_silent_banner(machine: Machine) -> None:
    bob = machine.people[USERS[1]]
    checks = _doctor(bob)
    assert "config: not granted" not in checks, checks
    assert checks["config"][0]["status"] == "ok" and f"narrowed by {bob.configFile}" in checks["config"][0]["detail"]
    assert checks["Claude Code drop-in"][0]["status"] == "ok", checks["Claude Code drop-in"]
    envFile = bob.home / "session.env"
    banner = bob.run("agentsandbox", "hook", "sessionstart", CLAUDE_ENV_FILE=str(envFile))
    assert banner.stdout == "", banner.stdout
    envFile.unlink()


def test_no_command_copies_a_users_file_into_etc(machine: Machine) -> None:
    """The first defect's attack has nothing to work with: no staged file, no root line that copies one."""
    ann = machine.people[USERS[0]]
    before = DROP_IN.read_bytes()
    p = ann.run("agentsandbox", "install", check=False)
    assert p.returncode == 0 and "is current" in p.stdout, p.stdout  # the machine's drop-in, already rendered
    ann.configFile.write_text(ann.configFile.read_text() + '\n[proxy]\nmax_tunnels = 7\n')
    elsewhere = "/etc/agentsandbox-test-managed"  # a managed dir ann cannot write
    p = ann.run("agentsandbox", "install", "--managed-dir", elsewhere, check=False)
    sudo = [line.strip() for line in p.stdout.splitlines() if "sudo" in line]
    assert p.returncode == 1 and sudo == [f"sudo /usr/bin/agentsandbox install --managed-dir {elsewhere}"], p.stdout
    assert not os.path.exists(elsewhere)
    assert not list(ann.home.rglob("staged")), "nothing is staged for root to copy"
    refused = ann.run("agentsandbox", "install", "--config", str(ann.configFile), check=False)
    assert refused.returncode == 2 and "root owns" in refused.stderr, refused.stderr
    # Root's render reads /etc/agentsandbox/config.toml alone, whatever a user's file says.
    sh(["agentsandbox", "install"])
    assert DROP_IN.read_bytes() == before
    assert str(ann.home) not in before.decode()


def test_neither_users_agent_can_read_the_others_home(machine: Machine) -> None:
    """A 0755 home (what many admins give) is closed to the other user's agent in all three places."""
    ann, bob = (machine.people[u] for u in USERS)
    secret = bob.home / "notes.txt"
    secret.write_text(f"bob's notes {CANARY}-BOB\n")
    os.chown(secret, bob.uid, bob.gid)
    secret.chmod(0o644)
    bob.home.chmod(0o755)
    try:
        assert CANARY in ann.run("cat", str(secret)).stdout, "Unix permissions alone let ann read it"
        check = ann.run("agentsandbox", "check", "read", str(secret), check=False)
        assert check.returncode == 1, check.stdout
        cat = ann.run("agentsandbox", "run", "--", "cat", str(secret), check=False)
        assert f"{CANARY}-BOB" not in cat.stdout, cat.stdout
        calls = [ToolCall("Read", {"file_path": str(secret)}), ToolCall("Bash", {"command": f"cat {secret}"})]
        with mockAPI() as api, tempLeftoversRemoved():
            run = runClaude(pinnedClaude().require(), calls, cwd=ann.home / "work",
                            env=_claudeEnv(ann, api.baseURL), api=api, user=ann.uid)
        assert not run.timedOut and len(run.outcomes) == len(calls), run.describe()
        read, bash = run.outcomes
        assert read.isError and f"{CANARY}-BOB" not in bash.text, run.describe()
        assert f"{CANARY}-BOB" not in run.everything, run.describe()
    finally:
        bob.home.chmod(0o700)


# --------------------------------------------------------------------------- upgrade and removal


def test_an_upgrade_keeps_the_edited_config_and_re_renders_the_drop_in(package: Package) -> None:
    assert DEB_UPGRADE, "scripts/test-deb names the second build in AGENTSANDBOX_DEB_UPGRADE"
    edited = CONFIG.read_text().replace('domains = [', 'domains = ["upgrade.example.org", ', 1)
    assert "upgrade.example.org" in edited
    CONFIG.write_text(edited)
    package.apt(DEB_UPGRADE)
    assert sh(["dpkg-query", "-W", "-f=${Version}", "agentsandbox"]).stdout != "0.1.0"
    assert CONFIG.read_text() == edited, "dpkg replaced the locally edited conffile"
    drop = json.loads(DROP_IN.read_text())
    assert "upgrade.example.org" in drop["sandbox"]["network"]["allowedDomains"]
    assert DROP_IN.read_text() == rendered()


def test_remove_then_purge_leaves_nothing_of_ours(package: Package) -> None:
    package.dpkg("-r", "agentsandbox")
    assert not DROP_IN.exists(), "the drop-in must go with the program its hooks run"
    assert CONFIG.exists(), "dpkg -r keeps conffiles"
    assert not Path("/usr/bin/agentsandbox").exists()
    p = sh(["/usr/bin/python3", "-c",
            "from twisted.plugin import IPlugin, getPlugins; import twisted.plugins as t;"
            "list(getPlugins(IPlugin)); print(sorted(getattr(t, '__path__', [])))"])
    cache = Path("/usr/lib/python3/dist-packages/twisted/plugins/dropin.cache")
    assert not cache.exists() or b"agentsandbox_plugin" not in cache.read_bytes(), p.stdout
    package.dpkg("-P", "agentsandbox")
    left = sorted(ours() - package.before)
    print("checked for leftovers:", ", ".join(CHECKED_ROOTS), "(every name containing 'agentsandbox') and /etc/claude-code")
    print("present before the install and still there:", sorted(ours() & package.before) or "nothing")
    assert left == [], f"left after purge: {left}"
    assert not SOCKET_ENABLED.exists()
