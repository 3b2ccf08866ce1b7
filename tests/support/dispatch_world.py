"""Real Unix users behind one dispatcher: users made with ``useradd``, processes run as them.

``SystemUsers`` creates users for a test (and removes them), holding the
lock ``/tmp/agentsandbox-users.lock`` meanwhile, since useradd writes /etc
(a lock of its own: a run held under a wider lock must not wait on itself).  ``DispatchWorld`` runs a dispatcher as ``nobody`` on a free port and a
registration socket under a test directory, plus one ``agentsandbox serve`` per
user that has a config, each as that user, registering through
``$AGENTSANDBOX_DISPATCH_SOCKET``.  Clients run as the user too (setpriv), so
the kernel's socket table names them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import re
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from harness.service_process import NOBODY, REPO, ServiceProcess, UserDirs
from tests.support.broker_support import waitFor

USERS_LOCK = "/tmp/agentsandbox-users.lock"
REGISTERED = re.compile(r"egress proxy (re-)?registered with the dispatcher")


@dataclass(frozen=True)
class UnixUser:
    name: str
    uid: int
    gid: int

    def argv(self, *command: str) -> list[str]:
        """``command`` run as this user, with no supplementary groups."""
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups", *command]


#: The superuser, as a ``UnixUser`` for a world where root runs a service too.
ROOT = UnixUser("root", 0, 0)


def usersAvailable() -> str | None:
    """Why real users cannot be made here, or None."""
    if os.geteuid() != 0:
        return "making Unix users needs root (useradd)"
    for tool in ("useradd", "userdel", "setpriv"):
        if subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True).returncode != 0:
            return f"{tool} is not installed"
    return None


@contextlib.contextmanager
def systemUsers(count: int) -> Iterator[list[UnixUser]]:
    """``count`` new users (no home, no login shell), removed afterwards, under the users lock."""
    with open(USERS_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        made: list[UnixUser] = []
        try:
            for i in range(count):
                name = f"asbxd{os.getpid() % 100000}{chr(ord('a') + i)}"
                subprocess.run(["userdel", name], capture_output=True)
                subprocess.run(["useradd", "-M", "-U", "-s", "/usr/sbin/nologin", name], check=True, capture_output=True)
                entry = pwd.getpwnam(name)
                made.append(UnixUser(name, entry.pw_uid, entry.pw_gid))
            yield made
        finally:
            for user in made:
                subprocess.run(["userdel", user.name], capture_output=True)
            fcntl.flock(lock, fcntl.LOCK_UN)


def freePort() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class DispatchWorld:
    """A dispatcher (as nobody) and per-user services, all under ``base``."""

    def __init__(self, base: str, speakTimeout: float = 1.0, serveRoot: bool = False, holdAfterStart: float = 0.0) -> None:
        self.base = base
        #: The dispatcher's ``proxy.dispatch_root``: whether root's service may register.
        self.serveRoot = serveRoot
        self.port = freePort()
        self.socketDir = os.path.join(base, "dispatch")
        os.makedirs(self.socketDir)
        os.chown(self.socketDir, 65534, 65534)
        self.socket = os.path.join(self.socketDir, "dispatch.sock")
        self.speakTimeout = speakTimeout
        #: 0 by default: these tests start the dispatcher and want a user without a
        #: service refused at once; the hold after a restart has its own tests.
        self.holdAfterStart = holdAfterStart
        self.dispatcher: ServiceProcess | None = None
        self.services: dict[str, ServiceProcess] = {}
        self.dirs: dict[str, UserDirs] = {}
        self.configs: dict[str, str] = {}

    # ------------------------------------------------------------------ the dispatcher

    def dispatcherConfig(self) -> str:
        """The dispatcher's own config (the machine's, on a real one), readable by nobody."""
        path = os.path.join(self.base, "dispatcher.toml")
        with open(path, "w") as f:
            f.write(f"[proxy]\nport = {self.port}\n" + ("dispatch_root = true\n" if self.serveRoot else ""))
        os.chmod(path, 0o644)
        return path

    def startDispatcher(self) -> ServiceProcess:
        argv = [
            *NOBODY, sys.executable, "-m", "agentsandbox", "dispatch", "--config", self.dispatcherConfig(),
            "--port", str(self.port), "--socket", self.socket, "--speak-timeout", str(self.speakTimeout),
            "--hold-after-start", str(self.holdAfterStart),
        ]  # fmt: skip
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO), "LANG": "C.UTF-8", "HOME": "/"}
        self.dispatcher = ServiceProcess(argv, env, self.base, os.path.join(self.base, f"dispatcher-{freePort()}.log"))
        self.dispatcher.waitFor(re.compile(r"dispatching "), 60, "the dispatcher to listen")
        return self.dispatcher

    def status(self) -> dict[str, Any]:
        out = subprocess.run(
            [sys.executable, "-m", "agentsandbox", "dispatch", "--status", "--json", "--socket", self.socket],
            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=30,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        status: dict[str, Any] = json.loads(out.stdout)
        return status

    def registeredUids(self) -> set[int]:
        return {int(r["uid"]) for r in self.status()["registered"]}

    # ------------------------------------------------------------------ user services

    def configure(self, user: UnixUser, domains: Sequence[str]) -> None:
        dirs = UserDirs(os.path.join(self.base, user.name), uid=user.uid)
        self.dirs[user.name] = dirs
        path = os.path.join(dirs.base, "config.toml")
        with open(path, "w") as f:
            f.write("inject = []\n\n[sandbox]\ndomains = [" + ", ".join(f'"{d}"' for d in domains) + "]\n\n")
            f.write(f"[proxy]\nport = {self.port}\n")
        os.chmod(path, 0o644)
        os.chown(dirs.base, user.uid, user.gid)
        self.configs[user.name] = path

    def startService(self, user: UnixUser, registers: bool = True) -> ServiceProcess:
        dirs = self.dirs[user.name]
        env = dirs.env(extra={"AGENTSANDBOX_DISPATCH_SOCKET": self.socket})
        argv = user.argv(sys.executable, "-m", "agentsandbox", "serve", "--config", self.configs[user.name])
        service = ServiceProcess(argv, env, dirs.base, tempfile.mktemp(prefix="service-", suffix=".log", dir=self.base))
        self.services[user.name] = service
        if registers:
            service.waitFor(REGISTERED, 60, f"{user.name}'s service to register")
        return service

    def audit(self, user: UnixUser) -> list[dict[str, object]]:
        try:
            with open(self.dirs[user.name].audit) as f:
                return [json.loads(line) for line in f if line.strip()]
        except FileNotFoundError:
            return []

    def stop(self) -> None:
        for service in self.services.values():
            service.kill()
        if self.dispatcher is not None:
            self.dispatcher.kill()


@dataclass(frozen=True)
class Curl:
    returncode: int
    status: int | None
    body: str
    stderr: str


def curl(user: UnixUser, url: str, *, port: int, socks: bool = False, proxyHost: str = "127.0.0.1", timeout: float = 20) -> Curl:
    """curl as ``user`` through the proxy on ``port`` (HTTP proxy, or SOCKS5 with remote names)."""
    proxy = ["--socks5-hostname", f"{proxyHost}:{port}"] if socks else ["-x", f"http://{proxyHost}:{port}"]
    out = subprocess.run(
        user.argv("curl", "-sS", "--noproxy", "", "-o", "-", "-w", "\n%{http_code}", *proxy, url),
        capture_output=True, text=True, timeout=timeout, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
    )  # fmt: skip
    body, _, code = out.stdout.rpartition("\n")
    return Curl(out.returncode, int(code) if code.isdigit() and code != "000" else None, body.strip(), out.stderr)


def waitRegistered(world: DispatchWorld, uids: set[int], timeout: float, what: str) -> None:
    waitFor(lambda: uids <= world.registeredUids(), timeout, what)
