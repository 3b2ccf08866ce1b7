"""Held requests' cost: tunnels/s and bulk with and without 100 requests held for a person.

    .venv/bin/python bench/approvals.py [--held 100] [--concurrency 50] [--tunnels 3000] [--bulk-mib 512]

One run, one proxy (``proxy.unlisted = "ask"``, its real registry and control
socket, the real policy path and audit log), measured against itself:

  * new tunnels per second: --concurrency clients each doing CONNECT to a
    listed origin, a 1-byte echo and close, --tunnels in all (bench/egress.py's);
  * bulk: one tunnel carrying --bulk-mib MiB (MB/s);

each with nothing held, then with --held CONNECTs to unlisted hosts held open
(asked, nobody answering: ``proxy.ask_timeout`` is set past the run), in
interleaved rounds; the medians and their ratios are printed.  Memory: the
proxy's RSS before and after holding --held requests, and --memory-held (a
larger number, for a steadier per-request figure), divided by the count.
The held count is read from the control socket's ``list``, the one
``agentsandbox approvals`` reads.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)

from egress import bulk, cpuSeconds, freePort, serveOrigin, stopAll, tunnelsPerSecond, waitPort  # noqa: E402


def serveProxy(port: int, bulkPort: int, echoPort: int, state: str, control: str) -> None:
    """The proxy under ask, with the service's registry and control socket."""
    from twisted.internet import reactor
    from twisted.logger import globalLogBeginner, textFileLogObserver

    from agentsandbox.audit import AuditLog
    from agentsandbox.config import loads
    from agentsandbox.egress.approvals import ApprovalRegistry
    from agentsandbox.egress.control import ControlFactory, ControlService
    from agentsandbox.egress.proxy import EgressProxyFactory, ProxyService
    from agentsandbox.paths import Paths
    from agentsandbox.service import freezeStartupHeap

    devnull = open(os.devnull, "w")  # noqa: SIM115 (lives as long as the process)
    globalLogBeginner.beginLoggingTo([textFileLogObserver(devnull)], redirectStandardIO=False)
    toml = (
        f'inject = []\n[sandbox]\ndomains = ["127.0.0.1:{bulkPort}", "127.0.0.1:{echoPort}"]\n'
        f'[proxy]\nport = {port}\nmax_tunnels = 100000\nunlisted = "ask"\nask_timeout = 86400\nmax_held = 100000\n'
    )
    config = loads(toml.encode(), "<bench>", Paths.fromEnvironment({"HOME": state}))
    audit = AuditLog(os.path.join(state, "audit.jsonl"), maxBytes=64 << 20)
    factory = EgressProxyFactory(config, reactor, audit=audit)
    registry = ApprovalRegistry(lambda: config, reactor, factory.record)
    factory.approvals = registry
    ControlService(ControlFactory(registry, factory.record), control, reactor).startService()
    ProxyService(factory).startService()
    reactor.callWhenRunning(freezeStartupHeap)  # type: ignore[attr-defined,unused-ignore]
    reactor.run()  # type: ignore[attr-defined,unused-ignore]


def child(*args: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", *args], env=env, cwd=REPO)


def heldCount(control: str) -> int:
    from agentsandbox.watch import ask

    return len(ask(control, {"op": "list"})["held"])


def hold(proxyPort: int, control: str, n: int, start: int) -> list[socket.socket]:
    """``n`` CONNECTs to unlisted hosts, left waiting; returns once the registry holds them all."""
    before = heldCount(control)
    socks = []
    for i in range(start, start + n):
        s = socket.create_connection(("127.0.0.1", proxyPort))
        host = f"held-{i}.example.com"
        s.sendall(f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\n\r\n".encode())
        socks.append(s)
    deadline = time.monotonic() + 30
    while heldCount(control) < before + n:
        if time.monotonic() > deadline:
            raise SystemExit(f"the proxy holds {heldCount(control) - before} of {n} requests after 30 s")
        time.sleep(0.01)
    return socks


def release(socks: list[socket.socket], control: str) -> None:
    """The clients go away (a reset: a FIN alone is a half-close, after which a
    client may still wait for its answer, so the proxy keeps it held); their
    requests are withdrawn."""
    for s in socks:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
    deadline = time.monotonic() + 30
    while heldCount(control):
        if time.monotonic() > deadline:
            raise SystemExit("held requests were not withdrawn after their clients closed")
        time.sleep(0.01)


def rss(pid: int) -> float:
    """Resident set size, kB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return float(line.split()[1])
    return 0.0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "--serve":
        kind, rest = args[1], args[2:]
        if kind == "origin":
            serveOrigin(int(rest[0]), int(rest[1]), int(rest[2]), int(rest[3]), int(rest[4]))
        elif kind == "proxy":
            serveProxy(int(rest[0]), int(rest[1]), int(rest[2]), rest[3], rest[4])
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--held", type=int, default=100)
    p.add_argument("--memory-held", type=int, default=1000, help="held requests for the steadier memory figure")
    p.add_argument("--concurrency", type=int, default=50)
    p.add_argument("--tunnels", type=int, default=3000)
    p.add_argument("--bulk-mib", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; medians are reported")
    opts = p.parse_args(args)
    size = opts.bulk_mib << 20
    work = tempfile.mkdtemp(prefix="approvals-bench-")
    bulkPort, echoPort, httpPort, proxyPort = freePort(), freePort(), freePort(), freePort()
    control = os.path.join(work, "control.sock")
    state = os.path.join(work, "state")
    os.makedirs(state)
    procs = {
        "origin": child("origin", str(bulkPort), str(echoPort), str(size), str(httpPort), "2"),
        "proxy": child("proxy", str(proxyPort), str(bulkPort), str(echoPort), state, control),
    }
    serial = 0
    try:
        for port in (bulkPort, echoPort, proxyPort):
            waitPort(port)
        deadline = time.monotonic() + 15
        while not os.path.exists(control):
            if time.monotonic() > deadline:
                raise SystemExit("the control socket did not appear")
            time.sleep(0.05)
        # Memory first, on a heap no earlier held request has left free room in:
        # --held, then --memory-held more on top, each an RSS delta over its count.
        pid = procs["proxy"].pid
        memory = []
        allHeld: list[socket.socket] = []
        for n in (opts.held, opts.memory_held):
            before = rss(pid)
            allHeld += hold(proxyPort, control, n, serial)
            serial += n
            memory.append((n, before, rss(pid)))
        release(allHeld, control)
        bulk(proxyPort, bulkPort, min(size, 64 << 20))  # warm up
        tunnelsPerSecond(proxyPort, echoPort, 500, opts.concurrency)
        samples: dict[str, list[tuple[float, float, float]]] = {"nothing held": [], f"{opts.held} held": []}
        for r in range(opts.rounds):
            # Each pair back to back, the order flipped every round: drift cancels.
            for label in list(samples)[:: 1 if r % 2 == 0 else -1]:
                socks: list[socket.socket] = []
                if label != "nothing held":
                    socks = hold(proxyPort, control, opts.held, serial)
                    serial += opts.held
                cpu = cpuSeconds(pid)
                tps = tunnelsPerSecond(proxyPort, echoPort, opts.tunnels, opts.concurrency)
                perCPU = opts.tunnels / max(cpuSeconds(pid) - cpu, 1e-9)
                mbs = bulk(proxyPort, bulkPort, size)
                if socks:
                    if heldCount(control) != opts.held:
                        raise SystemExit("a held request was let go during the measurement")
                    release(socks, control)
                samples[label].append((tps, mbs, perCPU))
                print(
                    f"  round {r + 1} {label:14s} {tps:8.0f} tunnels/s {perCPU:8.0f} tunnels/proxy CPU-s"
                    f"   bulk {mbs:8.0f} MB/s",
                    flush=True,
                )
    finally:
        stopAll(procs.values())
        shutil.rmtree(work, ignore_errors=True)

    base, held = (samples[k] for k in samples)
    med = {k: tuple(statistics.median(x[i] for x in v) for i in range(3)) for k, v in samples.items()}
    print()
    print(
        f"medians of {opts.rounds} rounds: {opts.tunnels} new tunnels at concurrency {opts.concurrency}; "
        f"bulk {opts.bulk_mib} MiB through one tunnel"
    )
    for label, (tps, mbs, perCPU) in med.items():
        print(f"  {label:14s} {tps:8.0f} tunnels/s {perCPU:8.0f} tunnels/proxy CPU-s   bulk {mbs:8.0f} MB/s")
    (t0, b0, c0), (t1, b1, c1) = med.values()
    print(
        f"  with {opts.held} held vs nothing held: tunnels/s {t1 / t0:.2f}x, tunnels per proxy CPU-second "
        f"{c1 / c0:.2f}x, bulk {b1 / b0:.2f}x"
    )
    for i, what in ((0, "tunnels/s"), (2, "tunnels per proxy CPU-second"), (1, "bulk")):
        pairs = [h[i] / b[i] for b, h in zip(base, held, strict=True)]
        shown = " ".join(f"{x:.2f}" for x in pairs)
        print(f"  {what}, per-round pairs (back to back): {shown} (median {statistics.median(pairs):.2f}x)")
    for n, before, after in memory:
        print(f"  RSS {before / 1024:.1f} MB -> {after / 1024:.1f} MB holding {n} more: {(after - before) / n:.1f} kB per held request")
    return 0


if __name__ == "__main__":
    sys.exit(main())
