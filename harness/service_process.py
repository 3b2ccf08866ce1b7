"""The service as a real child process: start it, find its proxy port in its log, stop it.

Used by the twistd, fault and benchmark runs.  Every wait is bounded and every
process is started in its own session, so cleanup can end exactly the group
the test started (the service and the host commands it ran), never anything else.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

_LISTENING = re.compile(r"egress proxy listening on \S*:(\d+)$", re.MULTILINE)
_BROKER = re.compile(r"broker serving (\S+)")

#: setpriv's arguments to become ``nobody`` with no supplementary groups.
NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")


def venvScript(name: str) -> str | None:
    """``name`` next to this interpreter (a venv's console script), if it is there."""
    path = os.path.join(os.path.dirname(sys.executable), name)
    return path if os.access(path, os.X_OK) else None


def twistdArgv() -> list[str]:
    """This stack's twistd: the venv's ``twistd``, Debian's ``twistd3``, or the module."""
    script = venvScript("twistd")
    if script is not None:
        return [script]
    if os.path.realpath(sys.executable).startswith("/usr/bin/") and os.access("/usr/bin/twistd3", os.X_OK):
        return ["/usr/bin/twistd3"]
    return [sys.executable, "-c", "from twisted.scripts.twistd import run; run()"]


def runnerArgv() -> list[str]:
    """``agentsandbox-twistd``: the console script where installed (the venv), else the same call."""
    script = venvScript("agentsandbox-twistd")
    if script is not None:
        return [script]
    return [sys.executable, "-c", "from agentsandbox.tap import runTwistd; runTwistd()"]


def serveArgv() -> list[str]:
    return [sys.executable, "-m", "agentsandbox", "serve"]


def installCopy(target: str) -> str:
    """Lay the package out as an install does (package + plugin file, byte-compiled)."""
    site = os.path.join(target, "site")
    shutil.copytree(REPO / "agentsandbox", os.path.join(site, "agentsandbox"), ignore=shutil.ignore_patterns("__pycache__"))
    plugins = os.path.join(site, "twisted", "plugins")
    os.makedirs(plugins)
    shutil.copy2(REPO / "twisted" / "plugins" / "agentsandbox_plugin.py", plugins)
    subprocess.run([sys.executable, "-m", "compileall", "-q", site], check=True, stdout=subprocess.DEVNULL)
    return site


def makeReadOnly(path: str) -> None:
    """``chmod -R a-w``: what a package manager's or the Nix store's files look like to a user."""
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            p = os.path.join(root, name)
            os.chmod(p, os.stat(p).st_mode & ~0o222)
    os.chmod(path, os.stat(path).st_mode & ~0o222)


def makeWritable(path: str) -> None:
    for root, dirs, _files in os.walk(path):
        os.chmod(root, os.stat(root).st_mode | 0o200)
        for name in dirs:
            p = os.path.join(root, name)
            os.chmod(p, os.stat(p).st_mode | 0o200)


class UserDirs:
    """A home, runtime dir and state dir for one service user, under ``base``."""

    def __init__(self, base: str, uid: int | None = None) -> None:
        self.base = base
        self.home = os.path.join(base, "home")
        self.runtime = os.path.join(base, "run")
        self.state = os.path.join(base, "state")
        for d in (self.home, self.runtime, self.state):
            os.makedirs(d, mode=0o700, exist_ok=True)
            if uid is not None:
                os.chown(d, uid, uid)
        self.spool = os.path.join(self.state, "agentsandbox", "spool")
        self.audit = os.path.join(self.state, "agentsandbox", "audit.jsonl")

    def env(self, pythonPath: str | None = None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": self.home,
            "XDG_RUNTIME_DIR": self.runtime,
            "XDG_STATE_HOME": self.state,
            "XDG_CONFIG_HOME": os.path.join(self.home, ".config"),
            "LANG": "C.UTF-8",
            "PYTHONPATH": pythonPath if pythonPath is not None else str(REPO),
        }
        # The suite's choice of machine root (tests/conftest.py: no package machine).
        if os.environ.get("AGENTSANDBOX_MACHINE_ROOT"):
            env["AGENTSANDBOX_MACHINE_ROOT"] = os.environ["AGENTSANDBOX_MACHINE_ROOT"]
        env.update(extra or {})
        return env


def writeConfig(path: str, domains: Sequence[str], extra: str = "", listen: str = "tcp:0:interface=127.0.0.1") -> str:
    with open(path, "w") as f:
        f.write("inject = []\n\n[sandbox]\ndomains = [" + ", ".join(f'"{d}"' for d in domains) + "]\n\n")
        f.write(f'[proxy]\nlisten = "{listen}"\n\n')
        f.write(extra)
    os.chmod(path, 0o644)
    return path


class ServiceProcess:
    """One service command as a child; its stdout and stderr go to a log file."""

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        cwd: str,
        logPath: str | None = None,
    ) -> None:
        self.argv = list(argv)
        self.logPath = logPath or tempfile.mktemp(prefix="service-", suffix=".log", dir=cwd)
        self._log = open(self.logPath, "wb")  # noqa: SIM115 - closed in stop()/kill()
        self.proc = subprocess.Popen(
            self.argv,
            env=dict(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.pid = self.proc.pid

    def output(self) -> str:
        with open(self.logPath, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def waitFor(self, pattern: re.Pattern[str], timeout: float, what: str, after: int = 0) -> re.Match[str]:
        """The first match of ``pattern`` in the log past offset ``after``; fail if it exits first."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.output()
            m = pattern.search(text, after)
            if m is not None:
                return m
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.argv[0]} exited {self.proc.returncode} before {what}:\n{text}")
            if time.monotonic() > deadline:
                raise AssertionError(f"gave up waiting {timeout}s for {what}:\n{text}")
            time.sleep(0.02)

    def proxyPort(self, timeout: float = 60.0, after: int = 0) -> int:
        return int(self.waitFor(_LISTENING, timeout, "the proxy to listen", after).group(1))

    def brokerServing(self, timeout: float = 60.0, after: int = 0) -> str:
        return self.waitFor(_BROKER, timeout, "the broker to serve", after).group(1)

    def signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def terminate(self, bound: float = 30.0) -> float:
        """SIGTERM; the seconds until it exited (AssertionError past ``bound``)."""
        started = time.monotonic()
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(bound)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"still running {bound}s after SIGTERM:\n{self.output()}") from None
        self._close()
        return time.monotonic() - started

    def kill(self) -> None:
        """SIGKILL to the process group this test started, then reap."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.proc.wait(10)
        self._close()

    def _close(self) -> None:
        if not self._log.closed:
            self._log.close()


class HelloServer:
    """A loopback HTTP server (stdlib, in a thread) the proxy's allow list names."""

    BODY = b"hello from the allowed host\n"

    def __init__(self) -> None:
        body = self.BODY

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port: int = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class EchoServer:
    """A loopback echo server (stdlib, threads) for tunnels that stay open."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(512)
        self.port: int = self.sock.getsockname()[1]
        self._stop = False
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                conn.sendall(data)

    def close(self) -> None:
        self._stop = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def connectTunnel(proxyPort: int, host: str, port: int, timeout: float = 10.0) -> socket.socket:
    """An open CONNECT tunnel (the 200 head read); the caller closes it."""
    s = socket.create_connection(("127.0.0.1", proxyPort), timeout=timeout)
    s.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(4096)
        if not chunk:
            break
        head += chunk
    if not head.startswith(b"HTTP/1.1 200"):
        s.close()
        raise ConnectionRefusedError(head.decode("latin-1"))
    return s


def roundTrip(s: socket.socket, data: bytes) -> bytes:
    s.sendall(data)
    got = b""
    while len(got) < len(data):
        chunk = s.recv(65536)
        if not chunk:
            break
        got += chunk
    return got
