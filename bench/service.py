#!/usr/bin/env python3
"""The whole service's footprint: RSS idle and with open tunnels, CPU per 1,000 requests.

    python bench/service.py [--tunnels 200] [--requests 1000] [--settle 1.0]

Runs, in the same run and under the same twistd machinery:

- **agentsandbox**: ``agentsandbox-twistd --nodaemon --pidfile= --logfile=- agentsandbox``
  (what the user unit runs), once with ``inject = []`` and once with the
  built-in GitHub inject rules (the CA made in memory, the TLS stack loaded);
- **bare echo**: ``twistd -n -y echo.tac``, a Twisted echo server and nothing else
  (the baseline); the same echo as a plain reactor script without twistd is
  printed too, as a floor for reference.

For each it prints the resident set size (``VmRSS``) after start-up, again with
``--tunnels`` connections held open (through the proxy: CONNECT tunnels to a
loopback echo server; to the bare service: direct connections), and the CPU
time (user + system, from ``/proc/PID/stat``) the process spent on
``--requests`` sequential requests (proxy: open a CONNECT tunnel, one 1 KiB
round trip, close; bare: connect, the same round trip, close), per 1,000.

Goal: idle RSS <= 1.5x the bare service.  No assertions: the figures and the
ratios are printed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from harness.service_process import (  # noqa: E402
    EchoServer,
    ServiceProcess,
    UserDirs,
    connectTunnel,
    roundTrip,
    runnerArgv,
    twistdArgv,
    writeConfig,
)

GOAL = 1.5

# The same echo without twistd: a floor, printed for reference only.
ECHO_SCRIPT = """\
import sys
from twisted.internet import reactor
from twisted.internet.protocol import Factory, Protocol


class Echo(Protocol):
    def dataReceived(self, data):
        self.transport.write(data)


port = reactor.listenTCP(0, Factory.forProtocol(Echo), interface="127.0.0.1")
print("listening on", port.getHost().port, flush=True)
reactor.run()
"""
PAYLOAD = b"x" * 1024

ECHO_TAC = """\
from twisted.application import service, strports
from twisted.internet.protocol import Factory, Protocol


class Echo(Protocol):
    def dataReceived(self, data):
        self.transport.write(data)


application = service.Application("bare-echo")
strports.service("tcp:0:interface=127.0.0.1", Factory.forProtocol(Echo)).setServiceParent(application)
"""


def rss(pid: int) -> int:
    """Resident set size in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def cpu(pid: int) -> float:
    """User + system CPU seconds so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return ticks / os.sysconf("SC_CLK_TCK")


class Measured:
    def __init__(self, name: str) -> None:
        self.name = name
        self.idle = 0
        self.loaded = 0
        self.cpuPer1000 = 0.0
        self.wallPer1000 = 0.0


def connectDirect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def measure(
    name: str,
    service: ServiceProcess,
    port: int,
    opener: Callable[[int], socket.socket],
    tunnels: int,
    requests: int,
    settle: float,
) -> Measured:
    m = Measured(name)
    time.sleep(settle)
    m.idle = rss(service.pid)

    held = []
    try:
        for _ in range(tunnels):
            s = opener(port)
            if roundTrip(s, PAYLOAD) != PAYLOAD:
                raise SystemExit(f"{name}: a held connection did not echo")
            held.append(s)
        time.sleep(settle)
        m.loaded = rss(service.pid)
    finally:
        for s in held:
            s.close()
    time.sleep(settle)

    before, started = cpu(service.pid), time.monotonic()
    for _ in range(requests):
        s = opener(port)
        if roundTrip(s, PAYLOAD) != PAYLOAD:
            raise SystemExit(f"{name}: a request did not echo")
        s.close()
    wall = time.monotonic() - started
    time.sleep(0.2)  # let the last closes be handled before reading the counter
    spent = cpu(service.pid) - before
    m.cpuPer1000 = spent * 1000 / requests
    m.wallPer1000 = wall * 1000 / requests
    return m


def mib(n: int) -> str:
    return f"{n / 1048576:8.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tunnels", type=int, default=200)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--settle", type=float, default=1.0, help="seconds to wait before each RSS reading")
    args = parser.parse_args()

    base = tempfile.mkdtemp(prefix="bench-service-", dir="/tmp")
    upstream = EchoServer()
    started: list[ServiceProcess] = []
    try:
        tac = os.path.join(base, "echo.tac")
        with open(tac, "w") as f:
            f.write(ECHO_TAC)

        results = []
        # The bare service first, then ours; each alone, so neither competes.
        dirs = UserDirs(os.path.join(base, "bare"))
        bare = ServiceProcess(
            [*twistdArgv(), "--nodaemon", "--pidfile=", "--logfile=-", "-y", tac],
            dirs.env(),
            cwd=dirs.base,
        )
        started.append(bare)
        port = int(bare.waitFor(re.compile(r"starting on (\d+)"), 60.0, "the echo service").group(1))
        results.append(measure("bare Twisted echo", bare, port, connectDirect, args.tunnels, args.requests, args.settle))
        bare.terminate()

        dirs = UserDirs(os.path.join(base, "script"))
        script = ServiceProcess([sys.executable, "-c", ECHO_SCRIPT], dirs.env(), cwd=dirs.base)
        started.append(script)
        port = int(script.waitFor(re.compile(r"listening on (\d+)"), 60.0, "the echo script").group(1))
        floor = measure("echo script, no twistd", script, port, connectDirect, args.tunnels, args.requests, args.settle)
        script.terminate()

        def throughProxy(proxyPort: int) -> socket.socket:
            return connectTunnel(proxyPort, "127.0.0.1", upstream.port)

        for label, name, withInject in (
            ("agentsandbox, inject = []", "plain", False),
            ("agentsandbox, GitHub inject", "github", True),
        ):
            dirs = UserDirs(os.path.join(base, name))
            config = writeConfig(os.path.join(dirs.base, "config.toml"), [f"127.0.0.1:{upstream.port}"])
            if withInject:
                # No inject key: the built-in GitHub rules (their token command may fail here; that is fine).
                with open(config) as f:
                    text = f.read()
                with open(config, "w") as f:
                    f.write(text.replace("inject = []\n", "", 1))
            service = ServiceProcess(
                [*runnerArgv(), "--nodaemon", "--pidfile=", "--logfile=-", "agentsandbox", "--config", config],
                dirs.env(),
                cwd=dirs.base,
            )
            started.append(service)
            proxyPort = service.proxyPort()
            service.brokerServing()
            results.append(measure(label, service, proxyPort, throughProxy, args.tunnels, args.requests, args.settle))
            service.terminate()

        import twisted

        print(f"python {sys.version.split()[0]} ({sys.executable}), Twisted {twisted.__version__}")
        print(f"{args.tunnels} held connections, {args.requests} sequential requests of one 1 KiB round trip\n")
        print(f"{'':30} {'idle RSS MiB':>12} {'RSS ' + str(args.tunnels) + ' open':>12} {'CPU s/1000':>11} {'wall s/1000':>12}")
        for r in results:
            print(f"{r.name:30} {mib(r.idle):>12} {mib(r.loaded):>12} {r.cpuPer1000:11.3f} {r.wallPer1000:12.3f}")
        print(f"{floor.name:30} {mib(floor.idle):>12} {mib(floor.loaded):>12} {floor.cpuPer1000:11.3f} {floor.wallPer1000:12.3f}  (reference)")
        b = results[0]
        print()
        for r in results[1:]:
            ratio = r.idle / b.idle
            print(
                f"{r.name}: idle RSS {ratio:.2f}x bare (goal <= {GOAL}: {'met' if ratio <= GOAL else 'MISSED'}), "
                f"with {args.tunnels} open {r.loaded / b.loaded:.2f}x, "
                f"per-connection {(r.loaded - r.idle) / max(args.tunnels, 1) / 1024:.1f} KiB vs "
                f"{(b.loaded - b.idle) / max(args.tunnels, 1) / 1024:.1f} KiB, "
                f"CPU per 1,000 requests {r.cpuPer1000 / b.cpuPer1000 if b.cpuPer1000 else float('inf'):.1f}x"
            )
            print(f"  (against the echo script without twistd: idle RSS {r.idle / floor.idle:.2f}x)")
        return 0
    finally:
        for s in started:
            s.kill()
        upstream.close()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
