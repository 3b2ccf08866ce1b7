"""A package machine without systemd: two real users reach a working state by following doctor.

The machine is made in a directory (``$AGENTSANDBOX_MACHINE_ROOT``): the
.deb's dispatcher unit in ``lib/systemd/system`` and a machine config in
``etc/agentsandbox/config.toml``, and no ``run/systemd/system`` (no systemd).
Users A and B are made with ``useradd`` (removed after); their services
(``agentsandbox serve``), their ``doctor`` and ``run`` and their clients run as
them (setpriv), on loopback, with the registration socket under a test
directory (``$AGENTSANDBOX_DISPATCH_SOCKET``).  The dispatcher is started only
with the command line doctor prints (``sudo`` dropped: the test is root; the
installed ``agentsandbox`` is this checkout's ``python -m agentsandbox``).

Shown, in file order on one machine:

1. both services started before any dispatcher wait for it (neither takes the
   shared port); doctor fails for each with the dispatcher's start command;
   ``run`` says the same, not "another user's program";
2. the command doctor printed starts the dispatcher; both services register by
   themselves; each user reaches their own origin and not the other's; doctor's
   dispatcher check passes;
3. the other order: the dispatcher is up first, then B, then A;
4. a user's service that is not registered: ``run`` gives doctor's diagnosis;
5. a user's own proxy.port, overridden by the dispatcher, is said once in the
   service log (also across a re-registration) and by ``status``;
6. a dispatcher started while a user's program holds the port names that
   user's uid, pid and command and the recovery order, and following it works.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from harness.service_process import REPO, HelloServer, ServiceProcess, UserDirs
from tests.support.broker_support import waitFor
from tests.support.dispatch_world import (
    REGISTERED,
    UnixUser,
    curl,
    freePort,
    systemUsers,
    usersAvailable,
)

why = usersAvailable()
pytestmark = pytest.mark.skipif(why is not None, reason=why or "")

WAITING = re.compile(r"no dispatcher on \S+ yet; this machine's package installed a dispatcher")
DISPATCH_COMMAND = re.compile(r"`(sudo agentsandbox dispatch[^`]*)`")


class HelloA(HelloServer):
    BODY = b"hello from A's origin\n"


class HelloB(HelloServer):
    BODY = b"hello from B's origin\n"


@dataclass
class Machine:
    base: str
    root: str
    port: int
    socket: str
    users: dict[str, UnixUser]
    origins: dict[str, HelloServer]
    dirs: dict[str, UserDirs] = field(default_factory=dict)
    configs: dict[str, str] = field(default_factory=dict)
    services: dict[str, ServiceProcess] = field(default_factory=dict)
    dispatcher: ServiceProcess | None = None

    def env(self, name: str) -> dict[str, str]:
        return self.dirs[name].env(
            extra={
                "AGENTSANDBOX_MACHINE_ROOT": self.root,
                "AGENTSANDBOX_DISPATCH_SOCKET": self.socket,
                "AGENTSANDBOX_CONFIG": self.configs[name],
            }
        )

    def writeConfig(self, name: str, port: int | None = None) -> None:
        with open(self.configs[name], "w") as f:
            f.write(f'inject = []\n\n[sandbox]\ndomains = ["127.0.0.1:{self.origins[name].port}"]\n\n')
            f.write(f"[proxy]\nport = {self.port if port is None else port}\n")
        os.chmod(self.configs[name], 0o644)

    def cli(self, name: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        user = self.users[name]
        return subprocess.run(
            user.argv(sys.executable, "-m", "agentsandbox", *args),
            env=self.env(name), cwd=self.dirs[name].home, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip

    def doctor(self, name: str) -> dict[str, dict[str, str]]:
        p = self.cli(name, "doctor", "--json", "--managed-dir", os.path.join(self.base, "managed"))
        checks: dict[str, dict[str, str]] = {c["name"]: c for c in json.loads(p.stdout)}
        return checks

    def startService(self, name: str) -> ServiceProcess:
        user = self.users[name]
        log = tempfile.mktemp(prefix=f"service-{name}-", suffix=".log", dir=self.base)
        argv = user.argv(sys.executable, "-m", "agentsandbox", "serve")
        service = ServiceProcess(argv, self.env(name), self.dirs[name].base, log)
        self.services[name] = service
        return service

    def follow(self, command: str) -> ServiceProcess:
        """Run the dispatcher command doctor printed, as root (the test is root)."""
        argv = shlex.split(command)
        assert argv[:3] == ["sudo", "agentsandbox", "dispatch"], argv
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO), "LANG": "C.UTF-8", "HOME": "/root"}
        log = tempfile.mktemp(prefix="dispatcher-", suffix=".log", dir=self.base)
        return ServiceProcess([sys.executable, "-m", "agentsandbox", *argv[2:]], env, self.base, log)

    def startDispatcherAsDoctorSays(self, name: str) -> ServiceProcess:
        check = self.doctor(name)["dispatcher"]
        m = DISPATCH_COMMAND.search(check["fix"] or "")
        assert m is not None, check
        self.dispatcher = self.follow(m.group(1))
        self.dispatcher.waitFor(re.compile(r"dispatching "), 60, "the dispatcher to listen")
        return self.dispatcher

    def reaches(self, name: str) -> None:
        """``name`` reaches their own origin through the shared port, and not the other's."""
        user = self.users[name]
        own = curl(user, f"http://127.0.0.1:{self.origins[name].port}/", port=self.port)
        assert own.status == 200 and own.body == self.origins[name].BODY.decode().strip(), own
        other = next(n for n in self.origins if n != name)
        theirs = curl(user, f"http://127.0.0.1:{self.origins[other].port}/", port=self.port)
        assert theirs.status == 403 and "sandbox.domains" in theirs.body, theirs

    def stopService(self, name: str) -> None:
        self.services.pop(name).kill()

    def stop(self) -> None:
        for service in self.services.values():
            service.kill()
        if self.dispatcher is not None:
            self.dispatcher.kill()


@pytest.fixture(scope="module")
def machine() -> Iterator[Machine]:
    base = tempfile.mkdtemp(prefix="nosystemd-")
    os.chmod(base, 0o755)
    root = os.path.join(base, "machine")
    port = freePort()
    sock = os.path.join(base, "dispatch", "dispatch.sock")
    # What the .deb lays down, on a machine where systemd does not run.
    os.makedirs(os.path.join(root, "lib", "systemd", "system"))
    shutil.copy(REPO / "agentsandbox" / "data" / "agentsandbox-dispatch.socket", os.path.join(root, "lib", "systemd", "system"))
    os.makedirs(os.path.join(root, "etc", "agentsandbox"))
    with open(os.path.join(root, "etc", "agentsandbox", "config.toml"), "w") as f:
        f.write(f'inject = []\n\n[proxy]\nport = {port}\ndispatch_socket = "{sock}"\n')
    origins: dict[str, HelloServer] = {"a": HelloA(), "b": HelloB()}
    with systemUsers(2) as made:
        m = Machine(base, root, port, sock, {"a": made[0], "b": made[1]}, origins)
        for name, user in m.users.items():
            m.dirs[name] = UserDirs(os.path.join(base, name), uid=user.uid)
            os.chown(m.dirs[name].base, user.uid, user.gid)
            m.configs[name] = os.path.join(m.dirs[name].base, "config.toml")
            m.writeConfig(name)
        try:
            yield m
        finally:
            m.stop()
            for origin in origins.values():
                origin.close()
            shutil.rmtree(base, ignore_errors=True)


def test_services_started_first_wait_and_doctor_starts_the_dispatcher(machine: Machine) -> None:
    m = machine
    a = m.startService("a")
    a.waitFor(WAITING, 60, "A's service to wait for the dispatcher")
    b = m.startService("b")
    b.waitFor(WAITING, 60, "B's service to wait for the dispatcher")
    # Neither took the shared port.
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", m.port))
    for name in ("a", "b"):
        check = m.doctor(name)["dispatcher"]
        assert check["status"] == "FAIL", check
        assert "not running on this package machine" in check["detail"] and "your service waits for it" in check["detail"]
        assert f"--socket {m.socket}" in check["fix"] and "Order:" in check["fix"], check
        refused = m.cli(name, "run", "--", "true")
        assert refused.returncode == 125
        assert "the dispatcher: not running on this package machine" in refused.stderr, refused.stderr
        assert "another user's program" not in refused.stderr, refused.stderr
    print("doctor said:", m.doctor("a")["dispatcher"]["fix"])

    m.startDispatcherAsDoctorSays("a")
    a.waitFor(REGISTERED, 30, "A's waiting service to register")
    b.waitFor(REGISTERED, 30, "B's waiting service to register")
    for name in ("a", "b"):
        m.reaches(name)
        check = m.doctor(name)["dispatcher"]
        assert check["status"] == "ok" and "registered with the dispatcher" in check["detail"], check


def test_the_other_order_dispatcher_first_then_b_then_a(machine: Machine) -> None:
    m = machine
    for name in ("a", "b"):
        m.stopService(name)
    assert m.dispatcher is not None
    m.dispatcher.kill()
    m.startDispatcherAsDoctorSays("b")
    b = m.startService("b")
    b.waitFor(REGISTERED, 60, "B's service to register")
    m.reaches("b")
    a = m.startService("a")
    a.waitFor(REGISTERED, 60, "A's service to register")
    for name in ("a", "b"):
        m.reaches(name)
        assert m.doctor(name)["dispatcher"]["status"] == "ok"


def test_run_with_an_unregistered_service_gives_doctors_diagnosis(machine: Machine) -> None:
    m = machine
    m.stopService("a")
    check = m.doctor("a")["dispatcher"]
    assert check["status"] == "FAIL" and f"no service of uid {m.users['a'].uid} is registered" in check["detail"], check
    refused = m.cli("a", "run", "--", "true")
    assert refused.returncode == 125
    assert f"the dispatcher: {check['detail']}; fix: {check['fix']}" in refused.stderr, refused.stderr
    assert "another user's program" not in refused.stderr and "move agentsandbox" not in refused.stderr
    # Following the fix: start the service; it registers.
    m.startService("a").waitFor(REGISTERED, 60, "A's service to register")
    m.reaches("a")


def test_a_users_own_port_overridden_by_the_dispatcher_is_said_once_and_by_status(machine: Machine) -> None:
    m = machine
    m.stopService("b")
    own = freePort()
    m.writeConfig("b", port=own)
    try:
        b = m.startService("b")
        b.waitFor(REGISTERED, 60, "B's service to register")
        note = f"proxy.port {own} in {m.configs['b']} is not used"
        waitFor(lambda: note in b.output(), 30, "the note in B's log")
        status = m.cli("b", "status")
        assert status.returncode == 0, status.stderr
        assert f"note: {note}" in status.stdout, status.stdout
        # A re-registration (the dispatcher restarted) does not say it again.
        assert m.dispatcher is not None
        m.dispatcher.kill()
        registered = len(REGISTERED.findall(b.output()))
        m.dispatcher = m.follow(DISPATCH_COMMAND.search(m.doctor("a")["dispatcher"]["fix"]).group(1))  # type: ignore[union-attr]
        m.dispatcher.waitFor(re.compile(r"dispatching "), 60, "the dispatcher to listen")
        waitFor(lambda: len(REGISTERED.findall(b.output())) > registered, 30, "B to register again")
        assert b.output().count(note) == 1, b.output()
    finally:
        m.stopService("b")
        m.writeConfig("b")
    m.startService("b").waitFor(REGISTERED, 60, "B's service to register")
    m.reaches("b")


def test_a_dispatcher_that_finds_the_port_taken_names_the_holder_and_the_order(machine: Machine) -> None:
    m = machine
    for name in list(m.services):
        m.stopService(name)
    assert m.dispatcher is not None
    m.dispatcher.kill()
    # A's program holds the shared port (say, a service started with dispatch_socket = "").
    hold = (
        "import socket, time; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
        f"s.bind(('127.0.0.1', {m.port})); s.listen(); print('held', flush=True); time.sleep(600)"
    )
    log = tempfile.mktemp(prefix="squatter-", suffix=".log", dir=m.base)
    squatter = ServiceProcess(m.users["a"].argv(sys.executable, "-c", hold), {"PATH": "/usr/bin:/bin"}, m.base, log)
    try:
        squatter.waitFor(re.compile("held"), 30, "A's program to hold the port")
        fix = m.doctor("b")["dispatcher"]["fix"]
        command = DISPATCH_COMMAND.search(fix)
        assert command is not None, fix
        failed = m.follow(command.group(1))
        waitFor(lambda: failed.proc.poll() is not None, 60, "the dispatcher to give up")
        said = failed.output()
        assert failed.proc.returncode == 1, said
        a = m.users["a"]
        assert f"held by uid {a.uid} ({a.name}), pid {squatter.pid}: " in said, said
        assert "Recovery, in this order:" in said and f"`kill {squatter.pid}`" in said, said
        # Following it: stop the holder, start the dispatcher again, start the services.
        squatter.kill()
        m.dispatcher = m.follow(command.group(1))
        m.dispatcher.waitFor(re.compile(r"dispatching "), 60, "the dispatcher to listen")
    finally:
        squatter.kill()
    for name in ("a", "b"):
        m.startService(name).waitFor(REGISTERED, 60, f"{name}'s service to register")
    for name in ("a", "b"):
        m.reaches(name)
