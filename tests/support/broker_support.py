"""Helpers for the broker tests: a config around a temp spool, raw requests, bounded waits."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from agentsandbox.broker import spool as wire
from agentsandbox.config import Config, parse
from agentsandbox.paths import Paths

REPO = Path(__file__).resolve().parent.parent.parent


def makeConfig(base: str, broker: Mapping[str, Any] | None = None, **tables: Any) -> Config:
    """A config whose home, state and spool live under ``base``."""
    home = os.path.join(base, "home")
    os.makedirs(home, exist_ok=True)
    paths = Paths.fromEnvironment({"HOME": home})
    data: dict[str, Any] = {"broker": {"spool": os.path.join(base, "spool"), **(broker or {})}}
    data.update(tables)
    return parse(data, os.path.join(base, "config.toml"), paths)


def tempBase(prefix: str = "broker-") -> str:
    # Short and outside any home, so cwd and policy decisions are about /tmp.
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")


class Held:
    """A request file written and held open the way a client does, but with raw bytes."""

    def __init__(self, spool: str, raw: bytes, rid: str | None = None) -> None:
        os.makedirs(spool, mode=0o700, exist_ok=True)
        self.spool = spool
        self.rid = rid or wire.newId()
        self.base = os.path.join(spool, self.rid)
        tmp = self.base + wire.TMP
        self.fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        os.write(self.fd, raw)

    def send(self) -> Held:
        os.rename(self.base + wire.TMP, self.base + wire.REQ)
        return self

    def replyPath(self) -> str:
        return self.base + wire.REPLY

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def waitFor(predicate: Callable[[], Any], timeout: float = 20.0, what: str = "a condition") -> Any:
    """Poll ``predicate`` until it returns something true; fail after ``timeout`` (a bound)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what} after {timeout}s")
        time.sleep(0.01)


def readReply(path: str) -> wire.Reply | None:
    try:
        with open(path, "rb") as f:
            return wire.parseReply(f.read())
    except FileNotFoundError:
        return None


def readText(path: str) -> str:
    """The file's text, '' while it does not exist."""
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return ""


def spoolNames(spool: str) -> list[str]:
    return sorted(os.listdir(spool))


def launcher(directory: str, name: str, command: str | None = None) -> str:
    """A ``#!/bin/sh`` launcher for ``python -m agentsandbox [command]`` (the Debian stack has no script)."""
    path = os.path.join(directory, name)
    sub = f" {command}" if command else ""
    with open(path, "w") as f:
        f.write(
            "#!/bin/sh\n"
            f"PYTHONPATH={REPO}${{PYTHONPATH:+:$PYTHONPATH}} exec {sys.executable} -m agentsandbox{sub} \"$@\"\n"
        )
    os.chmod(path, 0o755)
    return path


def agentsandboxArgv(*args: str) -> list[str]:
    return [sys.executable, "-m", "agentsandbox", *args]


def pythonEnv(extra: Mapping[str, str] | None = None, base: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = str(REPO) + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("SANDBOX_RUNTIME", None)
    env.pop("AGENTSANDBOX_SPOOL", None)
    env.update(extra or {})
    return env


class BrokerProcess:
    """``agentsandbox broker`` as a child process, for tests that must not share its reactor."""

    def __init__(self, configFile: str, env: Mapping[str, str], spool: str) -> None:
        self.spool = spool
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            agentsandboxArgv("broker", "--config", configFile),
            env=dict(env),
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        waitFor(self._answers, 30.0, "the broker to answer a ping")

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"the broker exited {self.proc.returncode}: {self.output()}")
        from agentsandbox.broker import client

        try:
            client.call(wire.Request(op="ping"), self.spool, 0.5)
        except client.NoBroker:
            return False
        return True

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode("utf-8", "replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if not self.log.closed:
            self.log.close()


@contextlib.contextmanager
def runningBroker(extraToml: str = "") -> Iterator[tuple[BrokerProcess, str]]:
    """A broker process on a fresh temporary base (its spool there, ``extraToml``
    appended to its config), and that base; both gone afterwards."""
    base = tempBase()
    spool = os.path.join(base, "spool")
    config = os.path.join(base, "config.toml")
    with open(config, "w") as f:
        f.write(f'[broker]\nspool = "{spool}"\n{extraToml}')
    broker = BrokerProcess(config, pythonEnv({"HOME": os.path.join(base, "home")}), spool)
    try:
        yield broker, base
    finally:
        broker.stop()
        shutil.rmtree(base, ignore_errors=True)


def awaitExec(proc: subprocess.Popen[bytes], name: str = "sleep") -> None:
    """Wait for a ``sh -c '...; echo ready; exec CMD'`` child to say ready and
    finish its exec of ``name``.  Until the new image has its stack the kernel
    shows an empty environ (a read right after "ready" saw one 83 times in 300),
    and the shell's own environ, read before its exec starts, says nothing of
    when the exec ends; the new image's name (``comm``) is set after its memory
    is in place, so the wait is for that name and an environ."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line != b"ready\n":
        raise AssertionError(f"the child said {line!r}, not ready")

    def execed() -> bool:
        try:
            with open(f"/proc/{proc.pid}/comm") as f:
                if f.read().strip() != name:
                    return False
            with open(f"/proc/{proc.pid}/environ", "rb") as f:
                return bool(f.read())
        except OSError:
            return False

    waitFor(execed, timeout=10, what=f"pid {proc.pid} to finish its exec of {name}")


def killQuietly(proc: subprocess.Popen[Any]) -> None:
    with contextlib.suppress(OSError):
        proc.kill()
    with contextlib.suppress(Exception):
        proc.wait(5)


def asyncTest(f: Callable[..., Any]) -> Callable[..., Any]:
    """Let a trial test method be ``async def`` on every Twisted we support."""
    import functools

    from twisted.internet import defer

    @functools.wraps(f)
    def wrapper(self: Any) -> Any:
        return defer.ensureDeferred(f(self))

    return wrapper


async def until(
    predicate: Callable[[], Any], timeout: float = 20.0, what: str = "a condition"
) -> Any:
    """``waitFor`` for reactor tests: polls on the reactor, never blocks it."""
    from twisted.internet import reactor, task

    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what} after {timeout}s")
        await task.deferLater(reactor, 0.01, lambda: None)
