"""Faults of the running service, as a real child process (``agentsandbox serve --config X``).

- SIGHUP reloads the config: open tunnels keep working, new connections get the
  new policy, a broken file keeps the old one and the service stays up;
- SIGTERM stops it with tunnels open and a broker request in flight, well
  inside 5 seconds (a bound on shutdown, not a speed goal: the measured time
  is printed);
- after ``kill -9`` of the service and of its clients, a restart on the same
  port removes every leftover spool file and answers new requests.
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
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from agentsandbox.broker import client
from agentsandbox.broker import spool as wire
from agentsandbox.broker.server import STOPPING
from harness.service_process import (
    REPO,
    EchoServer,
    ServiceProcess,
    UserDirs,
    connectTunnel,
    roundTrip,
    runnerArgv,
    serveArgv,
    writeConfig,
)
from tests.support.broker_support import waitFor

#: The shutdown bound the issue sets.
SIGTERM_BOUND = 5.0



def slowCommand(stream: bool) -> str:
    """A host command that runs until its gate file appears (bounded at 20 s)."""
    return (
        "[broker.run.slow]\n"
        """argv = ["/bin/sh", "-c", 'echo started; i=0; while [ ! -e "$1" ] && [ $i -lt 2000 ]; """
        """do sleep 0.01; i=$((i+1)); done; echo done', "slow"]\n"""
        'args = ["/tmp/[A-Za-z0-9._/-]+"]\n'
        f"stream = {'true' if stream else 'false'}\n"
    )


def freePort() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class World:
    base: str
    dirs: UserDirs
    echo: EchoServer
    gate: str

    def env(self) -> dict[str, str]:
        return self.dirs.env(pythonPath=str(REPO))

    def serve(self, config: str, log: str = "service.log", runner: bool = False) -> ServiceProcess:
        if runner:
            argv = [*runnerArgv(), "--nodaemon", "--pidfile=", "--logfile=-", "agentsandbox", "--config", config]
        else:
            argv = [*serveArgv(), "--config", config]
        return ServiceProcess(argv, self.env(), cwd=self.base, logPath=os.path.join(self.base, log))


@pytest.fixture
def world() -> Iterator[World]:
    base = tempfile.mkdtemp(prefix="faults-", dir="/tmp")
    echo = EchoServer()
    gate = os.path.join(base, "gate")
    try:
        yield World(base=base, dirs=UserDirs(base), echo=echo, gate=gate)
    finally:
        open(gate, "w").close()  # any host command still waiting ends
        echo.close()
        shutil.rmtree(base, ignore_errors=True)


def hostCommandsOf(pid: int) -> list[int]:
    """The children of ``pid`` (from /proc), i.e. the host commands the broker runs."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/stat") as f:
                # The name in parentheses may hold spaces; the ppid follows the last ')'.
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
    return found


def refusedHead(proxyPort: int, host: str, port: int) -> str:
    try:
        s = connectTunnel(proxyPort, host, port)
    except ConnectionRefusedError as e:
        return str(e)
    s.close()
    raise AssertionError(f"{host}:{port} was not refused")


# --------------------------------------------------------------------------- SIGHUP


@pytest.mark.parametrize("runner", [False, True], ids=["serve", "agentsandbox-twistd"])
def test_sighupReloadKeepsOpenTunnelsAndRefusesNewOnes(world: World, runner: bool) -> None:
    # The config is a symlink into another directory, as home-manager, a Nix
    # store path or /etc alternatives make it: the watcher sees nothing when
    # the target changes, so only SIGHUP can cause the reload seen below.
    real = os.path.join(world.base, "real")
    linked = os.path.join(world.base, "etc")
    os.makedirs(real)
    os.makedirs(linked)
    target = writeConfig(os.path.join(real, "config.toml"), [f"127.0.0.1:{world.echo.port}"])
    config = os.path.join(linked, "config.toml")
    os.symlink(target, config)

    service = world.serve(config, runner=runner)
    try:
        port = service.proxyPort()
        service.brokerServing()
        tunnel = connectTunnel(port, "127.0.0.1", world.echo.port)
        assert roundTrip(tunnel, b"before the reload\n") == b"before the reload\n"

        # The new policy no longer lists the echo host.
        writeConfig(target + ".new", ["127.0.0.1:9"])
        os.rename(target + ".new", target)
        time.sleep(0.5)  # what the watcher would need to notice a change, had it seen one
        assert "config reloaded" not in service.output()
        mark = len(service.output())
        service.signal(signal.SIGHUP)
        service.waitFor(re.compile(r"config reloaded after SIGHUP"), 30.0, "the SIGHUP reload", mark)

        assert roundTrip(tunnel, b"after the reload\n") == b"after the reload\n", "the open tunnel was kept"
        head = refusedHead(port, "127.0.0.1", world.echo.port)
        assert head.startswith("HTTP/1.1 403") and "sandbox.domains" in head, head

        # A broken file: the old config stays, the service stays up.
        with open(target + ".new", "w") as f:
            f.write("[sandbox]\ndomains = [\"*\"]\n")
        os.rename(target + ".new", target)
        mark = len(service.output())
        service.signal(signal.SIGHUP)
        service.waitFor(re.compile(r"keeping the previous config"), 30.0, "the refused reload", mark)
        assert service.proc.poll() is None
        assert roundTrip(tunnel, b"still open\n") == b"still open\n"
        assert refusedHead(port, "127.0.0.1", world.echo.port).startswith("HTTP/1.1 403")
        client.ask("ping", world.dirs.spool, 20.0)
        tunnel.close()
        service.terminate()
    finally:
        service.kill()


# --------------------------------------------------------------------------- SIGTERM


@pytest.mark.parametrize("runner", [False, True], ids=["serve", "agentsandbox-twistd"])
def test_sigtermStopsWithinFiveSecondsWithTunnelsAndARequestInFlight(world: World, runner: bool) -> None:
    config = writeConfig(os.path.join(world.base, "config.toml"), [f"127.0.0.1:{world.echo.port}"], extra=slowCommand(stream=False))
    service = world.serve(config, runner=runner)
    tunnels: list[socket.socket] = []
    try:
        port = service.proxyPort()
        service.brokerServing()
        for i in range(20):
            t = connectTunnel(port, "127.0.0.1", world.echo.port)
            assert roundTrip(t, b"tunnel %d\n" % i) == b"tunnel %d\n" % i
            tunnels.append(t)
        answers: list[BaseException | object] = []

        def inFlight() -> None:
            try:
                answers.append(client.ask("run", world.dirs.spool, 30.0, args=("slow", world.gate)))
            except BaseException as e:  # the reply is what the test looks at
                answers.append(e)

        asker = threading.Thread(target=inFlight, daemon=True)
        asker.start()
        waitFor(lambda: any(n.endswith(wire.REQ) for n in os.listdir(world.dirs.spool)), 20.0, "the request in the spool")
        waitFor(lambda: hostCommandsOf(service.pid), 20.0, "the broker to start the host command")
        seconds = service.terminate(bound=SIGTERM_BOUND)
        name = "agentsandbox-twistd" if runner else "serve"
        print(f"{name} stopped {seconds:.3f}s after SIGTERM with {len(tunnels)} tunnels and a broker request open")
        # twistd re-raises the SIGTERM it handled once it has stopped (a clean stop to systemd).
        assert service.proc.returncode == (-signal.SIGTERM if runner else 0), service.output()

        asker.join(30.0)
        (answer,) = answers
        assert isinstance(answer, client.BrokerError) and str(answer) == STOPPING, answer
        for t in tunnels:
            t.settimeout(10.0)
            with contextlib.suppress(ConnectionResetError):
                assert t.recv(1) == b"", "the proxy closed every tunnel"
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        for t in tunnels:
            t.close()
        service.kill()


STUBBORN = """\
[broker.run.stubborn]
argv = ["/bin/sh", "-c", 'trap "" TERM; echo started; i=0; while [ ! -e "$1" ] && [ $i -lt 2000 ]; do sleep 0.01; i=$((i+1)); done', "stubborn"]
args = ["/tmp/[A-Za-z0-9._/-]+"]
stream = false
"""


def test_sigtermStopsWithinFiveSecondsWhenAHostCommandIgnoresIt(world: World) -> None:
    config = writeConfig(os.path.join(world.base, "config.toml"), [f"127.0.0.1:{world.echo.port}"], extra=STUBBORN)
    service = world.serve(config)
    try:
        service.proxyPort()
        service.brokerServing()
        answers: list[BaseException | object] = []

        def inFlight() -> None:
            try:
                answers.append(client.ask("run", world.dirs.spool, 30.0, args=("stubborn", world.gate)))
            except BaseException as e:
                answers.append(e)

        asker = threading.Thread(target=inFlight, daemon=True)
        asker.start()
        commands = waitFor(lambda: hostCommandsOf(service.pid), 20.0, "the host command to start")
        # Past fork and exec: the shell has set its trap and runs its loop.
        waitFor(lambda: any(hostCommandsOf(c) for c in commands), 20.0, "the shell's loop to run")
        seconds = service.terminate(bound=SIGTERM_BOUND)
        print(f"serve stopped {seconds:.3f}s after SIGTERM with a host command that ignores SIGTERM")
        assert service.proc.returncode == 0, service.output()
        asker.join(30.0)
        (answer,) = answers
        assert isinstance(answer, client.BrokerError) and str(answer) == STOPPING, answer
        for pid in commands:
            assert not os.path.exists(f"/proc/{pid}"), "the host command was killed and reaped"
    finally:
        service.kill()


# --------------------------------------------------------------------------- kill -9


_CLIENT_HOLDS_TMP = """\
import os, sys, time
fd = os.open(os.path.join(sys.argv[1], sys.argv[2] + '.tmp'), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
os.write(fd, b'{"op": "pi')
print('written', flush=True)
time.sleep(120)
"""

# Sends a ping and holds the request without ever collecting the reply.
_CLIENT_NEVER_COLLECTS = """\
import os, sys, time
base = os.path.join(sys.argv[1], sys.argv[2])
fd = os.open(base + '.tmp', os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
os.write(fd, b'{"op": "ping"}')
os.rename(base + '.tmp', base + '.req')
print('sent', flush=True)
time.sleep(120)
"""

_CLIENT_STREAMS = """\
import sys
from agentsandbox.broker import client
from agentsandbox.broker.spool import Request
client.stream(Request(op='run', args=('slow', sys.argv[2])), sys.stdout.buffer, sys.argv[1], timeout=120)
"""


def _child(world: World, code: str, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        env=world.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _kill9(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)
    if proc.stdout is not None:
        proc.stdout.close()


def test_kill9ThenRestartCleansTheSpoolAndAnswers(world: World) -> None:
    fixed = freePort()
    config = writeConfig(
        os.path.join(world.base, "config.toml"),
        [f"127.0.0.1:{world.echo.port}"],
        extra=slowCommand(stream=True),
        listen=f"tcp:{fixed}:interface=127.0.0.1",
    )
    spool = world.dirs.spool
    first = world.serve(config, "first.log")
    children: list[subprocess.Popen[bytes]] = []
    second = None
    try:
        assert first.proxyPort() == fixed
        first.brokerServing()
        tunnel = connectTunnel(fixed, "127.0.0.1", world.echo.port)
        assert roundTrip(tunnel, b"open at the kill\n") == b"open at the kill\n"

        # A streamed host command in flight (leaves .req and .out) ...
        streaming = _child(world, _CLIENT_STREAMS, spool, world.gate)
        children.append(streaming)
        waitFor(lambda: any(n.endswith(wire.OUT) for n in os.listdir(spool)), 30.0, "the streamed call to start")
        # ... a client killed while writing its request (leaves .tmp) ...
        writing = _child(world, _CLIENT_HOLDS_TMP, spool, wire.newId())
        children.append(writing)
        assert writing.stdout is not None and writing.stdout.readline() == b"written\n"
        # ... and one answered but never collected (leaves .req and .reply).
        rid = wire.newId()
        lazy = _child(world, _CLIENT_NEVER_COLLECTS, spool, rid)
        children.append(lazy)
        waitFor(lambda: os.path.exists(os.path.join(spool, rid + wire.REPLY)), 30.0, "the uncollected reply")

        os.kill(first.pid, signal.SIGKILL)
        first.proc.wait(10)
        for child in children:
            _kill9(child)
        tunnel.close()
        leftovers = sorted(os.listdir(spool))
        suffixes = {wire.splitName(n)[1] for n in leftovers if wire.splitName(n) is not None}  # type: ignore[index]
        assert {wire.REQ, wire.OUT, wire.TMP, wire.REPLY} <= suffixes, leftovers

        second = world.serve(config, "second.log")
        assert second.proxyPort() == fixed, "the restart listens on the same port"
        second.brokerServing()
        assert [n for n in os.listdir(spool) if wire.splitName(n) is not None] == [], os.listdir(spool)
        assert re.search(f"removed {len(leftovers)} leftover spool files", second.output()), second.output()

        assert client.ask("ping", spool, 20.0).error is None
        fresh = connectTunnel(fixed, "127.0.0.1", world.echo.port)
        assert roundTrip(fresh, b"after the restart\n") == b"after the restart\n"
        fresh.close()
        second.terminate()
    finally:
        for child in children:
            if child.poll() is None:
                _kill9(child)
        first.kill()
        if second is not None:
            second.kill()
