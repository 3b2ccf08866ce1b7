"""The real agentsandbox service, in a child process, for end-to-end tests.

Claude Code and ``agentsandbox run`` are blocking subprocesses of the test, so
a reactor in the test process would not turn while they run.  The service runs
instead as ``python -m tests.support.service_harness``: that child builds
``makeService`` from a real config file and runs the reactor until SIGTERM.

What the child adds around the service is only the outside world the test
cannot use here, injected through ``makeService``'s own arguments (no config
backdoor):

* a fake GitHub (``inject_github.FakeGitHub``: TLS with its own test CA, git's
  smart HTTP through ``git http-backend``) on a loopback port;
* a resolver that answers GitHub's names with a documentation address, and a
  dialer that sends that address to the fake and loopback addresses straight
  through, so the proxy's address rules still see a public address;
* the fake's test CA as the injector's upstream trust root.

The fake's view of each request (method, path, and whether the Authorization
header was exactly the injected credential) goes to a JSON-lines report.  The
header itself is never written anywhere: the tests show the token exists
nowhere on disk.

The parent side is ``ServiceProcess``: start, wait for the ready line (bounded),
read the report, stop (SIGTERM, then SIGKILL to the child's process group).
Also here: small pieces the end-to-end tests share (a local allowed web host,
a gpg signing key, a bare repository for the fake, a scan for secrets).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import IO, Any

from tests.support import gpg

REPO = Path(__file__).resolve().parents[2]
#: The documentation address the resolver gives GitHub's names; only the dialer maps it.
FAKE_GITHUB_ADDRESS = "203.0.113.10"
READY = "agentsandbox-service-ready "
START_TIMEOUT = 60.0
STOP_TIMEOUT = 10.0


# --------------------------------------------------------------------------- parent side


@dataclass
class ServiceProcess:
    """``makeService`` on a config file, run by a child process until ``stop``."""

    configPath: Path
    env: Mapping[str, str]
    workDir: Path
    gitRoot: Path
    proc: subprocess.Popen[bytes] | None = None
    ready: dict[str, Any] = field(default_factory=dict)
    rest: bytes = b""
    #: More names the service's resolver answers (each a documentation address its
    #: dialer sends to the local port): unlisted hosts a test reaches once allowed.
    routes: dict[str, int] = field(default_factory=dict)

    @property
    def reportPath(self) -> Path:
        return self.workDir / "fake-github.jsonl"

    @property
    def logPath(self) -> Path:
        return self.workDir / "service.log"

    def start(self, timeout: float = START_TIMEOUT) -> ServiceProcess:
        self.workDir.mkdir(parents=True, exist_ok=True)
        env = dict(self.env)
        env["PYTHONPATH"] = str(REPO) + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.service_harness", "--config", str(self.configPath),
             "--git-root", str(self.gitRoot), "--report", str(self.reportPath), "--log", str(self.logPath),
             *(f"--route={name}={port}" for name, port in self.routes.items())],
            env=env, cwd=str(REPO), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            self.ready = self._waitReady(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _waitReady(self, timeout: float) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        seen = b""
        while b"\n" not in seen:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"the service did not say it was ready within {timeout}s: "
                                     f"{seen.decode(errors='replace')}\n{self.log()}")
            readable, _, _ = select.select([self.proc.stdout], [], [], remaining)
            if not readable:
                continue
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                self.proc.wait(STOP_TIMEOUT)
                raise AssertionError(f"the service exited {self.proc.returncode} before it was ready: "
                                     f"{seen.decode(errors='replace')}\n{self.log()}")
            seen += chunk
        line = seen.split(b"\n", 1)[0].decode()
        if not line.startswith(READY):
            raise AssertionError(f"unexpected first line from the service: {line!r}\n{self.log()}")
        ready: dict[str, Any] = json.loads(line[len(READY):])
        return ready

    @property
    def proxyPort(self) -> int:
        return int(self.ready["proxy"])

    def log(self) -> str:
        try:
            return self.logPath.read_text(errors="replace")
        except OSError:
            return ""

    def fakeSeen(self) -> list[dict[str, Any]]:
        """What reached the fake GitHub, oldest first."""
        try:
            text = self.reportPath.read_text()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL to the whole process group; returns the exit status."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                pass
        # Anything the service started (gpg-agent is not: it leaves the group) goes too.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(STOP_TIMEOUT)
        if proc.stdout is not None:
            with contextlib.suppress(OSError):
                self.rest = proc.stdout.read() or b""
            proc.stdout.close()
        return proc.returncode


# --------------------------------------------------------------------------- shared pieces


class LocalSite:
    """A plain HTTP server on 127.0.0.1: the allowed local host.  Records each path."""

    BODY = "hello from the allowed local host"

    def __init__(self) -> None:
        self.paths: list[str] = []
        site = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                site.paths.append(self.path)
                body = f"{site.BODY}: {self.path}\n".encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="local-site", daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


SIGNER = "Sandbox Signer <signer@example.org>"


def makeSigningKey(gnupgHome: Path) -> str:
    """The signer's key in ``gnupgHome``; its fingerprint."""
    return gpg.makeSigningKey(gnupgHome, SIGNER)


stopGpgAgent = gpg.stopGpgAgent


def seedBareRepo(bare: Path, scratch: Path, readme: str) -> None:
    """A bare repository with one commit on ``main``, as the fake serves it."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(scratch),
           "GIT_AUTHOR_NAME": "Seed", "GIT_AUTHOR_EMAIL": "seed@example.org",
           "GIT_COMMITTER_NAME": "Seed", "GIT_COMMITTER_EMAIL": "seed@example.org",
           "GIT_CONFIG_NOSYSTEM": "1"}  # fmt: skip
    work = scratch / "seed"

    def git(*args: str) -> None:
        subprocess.run(["git", *args], env=env, check=True, capture_output=True, timeout=60)

    git("init", "-q", "--bare", "-b", "main", str(bare))
    git("init", "-q", "-b", "main", str(work))
    (work / "README.md").write_text(readme)
    git("-C", str(work), "add", "README.md")
    git("-C", str(work), "commit", "-q", "-m", "seed")
    git("-C", str(work), "push", "-q", str(bare), "main")


def runBounded(argv: list[str], *, env: Mapping[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in its own process group; on timeout (and after it ends) end the whole group."""
    proc = subprocess.Popen(argv, env=dict(env), cwd=str(cwd), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"{argv[:3]} did not finish within {timeout}s\n{stdout}\n{stderr}") from None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def secretForms(token: str, basicUser: str = "x-access-token") -> list[bytes]:
    """The token as it could appear anywhere: raw, and inside a Basic credential."""
    basic = base64.b64encode(f"{basicUser}:{token}".encode())
    return [token.encode(), basic]


def filesHolding(roots: Iterable[Path], needles: Iterable[bytes]) -> list[str]:
    """Every regular file under ``roots`` that contains one of ``needles`` (symlinks not followed)."""
    needles = list(needles)
    found = []
    for root in roots:
        if not root.exists():
            continue
        for dirpath, _dirs, files in os.walk(root):
            for name in files:
                path = os.path.join(dirpath, name)
                if os.path.islink(path):
                    continue
                try:
                    with open(path, "rb") as f:
                        data = f.read()
                except OSError:
                    continue
                if any(n in data for n in needles):
                    found.append(path)
    return found


def sections(text: str, marker: str = "=== ") -> dict[str, str]:
    """Split a script's output at ``=== NAME ===`` lines."""
    out: dict[str, str] = {}
    name = ""
    for line in text.splitlines():
        if line.startswith(marker) and line.endswith(" ==="):
            name = line[len(marker):-4].strip()
            out[name] = ""
            continue
        out[name] = out.get(name, "") + line + "\n"
    return out


@contextlib.contextmanager
def exclusiveLock(path: str, timeout: float, what: str) -> Iterator[None]:
    """An flock on ``path``, waited for at most ``timeout`` seconds."""
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"gave up waiting {timeout}s for {what} ({path})") from None
                time.sleep(0.2)
        yield
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- child side


def _expectedToken(config: Any) -> str:
    """The token the service will inject, read the way its keeper reads it."""
    from agentsandbox.config import EnvSource, FileSource

    for rule in config.inject:
        source = rule.token
        if isinstance(source, EnvSource):
            return os.environ[source.env]
        if isinstance(source, FileSource):
            with open(source.file) as f:
                return f.read().strip()
    raise SystemExit("the config has no inject rule with a token_env or token_file")


def _childMain(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="service_harness")
    parser.add_argument("--config", required=True)
    parser.add_argument("--git-root", required=True)
    parser.add_argument("--report", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--route", action="append", default=[], help="NAME=LOCALPORT")
    args = parser.parse_args(argv)

    from twisted.internet import reactor as installed
    from twisted.logger import globalLogBeginner, textFileLogObserver

    from agentsandbox.config import GITHUB_HOSTS
    from agentsandbox.egress.testing import FixedResolver, MappedDialer, UpstreamPKI
    from agentsandbox.loader import load
    from agentsandbox.service import makeService
    from tests.support.inject_github import FakeGitHub, listenTLS

    reactor: Any = installed
    logFile: IO[str] = open(args.log, "a", encoding="utf-8")  # noqa: SIM115 - open for the process's life
    globalLogBeginner.beginLoggingTo([textFileLogObserver(logFile, timeFormat="%H:%M:%S")],
                                     redirectStandardIO=False)

    config = load(args.config)
    report: IO[str] = open(args.report, "a", encoding="utf-8")  # noqa: SIM115

    class ReportingFake(FakeGitHub):
        def record(self, request: Any, body: bytes | None = None, length: int = 0, digest: str = "") -> Any:
            seen = super().record(request, body, length, digest)
            auth = seen.authorization
            verdict = ("basic" if auth == [self.basic()] else "token" if auth == [f"token {self.token}"]
                       else "none" if not auth else "other")
            report.write(json.dumps({"method": seen.method, "path": seen.path, "host": seen.host,
                                     "authorization": verdict}) + "\n")
            report.flush()
            return seen

    fake = ReportingFake(token=_expectedToken(config), gitRoot=args.git_root)
    pki = UpstreamPKI.create()
    site: Any = fake.site()
    upstream = listenTLS(reactor, site, pki.serverOptions([*GITHUB_HOSTS, "codeload.github.com"]))
    fakePort = int(getattr(upstream.getHost(), "port"))  # noqa: B009 - IAddress has no port attribute
    table = {h: [FAKE_GITHUB_ADDRESS] for h in (*GITHUB_HOSTS, "codeload.github.com")}
    dialer = MappedDialer(reactor)
    dialer.route(FAKE_GITHUB_ADDRESS, 443, fakePort)
    for i, route in enumerate(args.route):
        name, port = route.rsplit("=", 1)
        address = f"198.51.100.{10 + i}"
        table[name] = [address]
        dialer.map(address, int(port))
    resolver = FixedResolver(table)

    service = makeService(config, reactor, configPath=args.config, resolver=resolver, dialer=dialer,
                          upstreamTrust=pki.pem)
    failed: list[str] = []

    def ready(port: Any) -> None:
        line = READY + json.dumps({"proxy": port.getHost().port, "fake": fakePort, "pid": os.getpid()})
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    def notListening(f: Any) -> None:
        failed.append(f.getErrorMessage())
        reactor.stop()

    def start() -> None:
        try:
            service.startService()
        except Exception as e:
            failed.append(f"{type(e).__name__}: {e}")
            reactor.stop()
            return
        d = service.listening
        assert d is not None, "the proxy started without a listening Deferred"
        d.addCallbacks(ready, notListening)

    def stop() -> Any:
        upstream.stopListening()
        return service.stopService() if service.running else None

    reactor.callWhenRunning(start)
    reactor.addSystemEventTrigger("before", "shutdown", stop)
    reactor.run()
    report.close()
    if failed:
        sys.stdout.write(f"service failed: {failed[0]}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_childMain(sys.argv[1:]))
