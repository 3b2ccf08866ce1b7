"""Dispatcher benchmark: the same proxy bound directly vs registered with the dispatcher, in one run.

    .venv/bin/python bench/dispatch.py [--bulk-mib 1024] [--tunnels 3000] [--concurrency 50] [--rounds 5]

Measures, on this machine and in this run, for the agentsandbox proxy (its real
policy path: allow list, address check, same-user peer check, audit log) once
bound to its port and once behind ``agentsandbox dispatch`` (which looks up the
client's uid and passes each connection with SCM_RIGHTS):
  * new tunnels per second: --concurrency clients each doing CONNECT, a 1-byte
    echo and close, --tunnels in all;
  * bulk: one tunnel carrying --bulk-mib MiB, MB/s (the bytes never pass the
    dispatcher, so this should match).
The clients, origin and helpers are bench/egress.py's.  Goals: tunnels/s >=
0.9x direct, bulk >= 0.98x direct.  Rounds interleave the two; medians are reported.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import egress  # noqa: E402  (bench/egress.py: the house's clients and origin)


def child(*args: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", *args], env=env, cwd=REPO)


def waitFile(path: str, limit: float = 15.0) -> None:
    end = time.monotonic() + limit
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise SystemExit(f"{path} did not appear")
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "--serve":
        kind, rest = args[1], args[2:]
        if kind == "origin":
            # The http port (bench/egress.py's forward-path figures) is served but not measured here.
            egress.serveOrigin(int(rest[0]), int(rest[1]), int(rest[2]), int(rest[3]), 0)
        elif kind == "direct":
            egress.serveAgentsandbox(int(rest[0]), [int(rest[1]), int(rest[2])], True, rest[3])
        elif kind == "registered":
            egress.serveAgentsandbox(int(rest[0]), [int(rest[1]), int(rest[2])], True, rest[3], dispatchSocket=rest[4])
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bulk-mib", type=int, default=1024)
    p.add_argument("--tunnels", type=int, default=3000)
    p.add_argument("--concurrency", type=int, default=50)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; medians are reported")
    opts = p.parse_args(args)
    size = opts.bulk_mib << 20
    work = tempfile.mkdtemp(prefix="dispatch-bench-")
    bulkPort, echoPort = egress.freePort(), egress.freePort()
    directPort, dispatchPort = egress.freePort(), egress.freePort()
    sock = os.path.join(work, "dispatch.sock")
    for name in ("direct", "registered"):
        os.makedirs(os.path.join(work, name))
    devnull = open(os.devnull, "wb")  # noqa: SIM115 (lives as long as the run)
    procs: dict[str, subprocess.Popen[bytes]] = {
        "origin": child("origin", str(bulkPort), str(echoPort), str(size), str(egress.freePort())),
        "direct": child("direct", str(directPort), str(bulkPort), str(echoPort), os.path.join(work, "direct")),
        "dispatcher": subprocess.Popen(
            [sys.executable, "-m", "agentsandbox", "dispatch", "--port", str(dispatchPort), "--socket", sock],
            env=dict(os.environ, PYTHONPATH=REPO), cwd=REPO, stdout=devnull, stderr=subprocess.STDOUT,
        ),
    }  # fmt: skip
    ports = {"bound directly": directPort, "through the dispatcher": dispatchPort}
    try:
        waitFile(sock)
        procs["registered"] = child(
            "registered", str(dispatchPort), str(bulkPort), str(echoPort), os.path.join(work, "registered"), sock
        )
        for port in (bulkPort, echoPort, directPort, dispatchPort):
            egress.waitPort(port)
        # Registered once a connection is served (not a 503).
        end = time.monotonic() + 15
        while True:
            try:
                egress.connectVia(dispatchPort, echoPort)[0].close()
                break
            except SystemExit:
                if time.monotonic() > end:
                    raise
                time.sleep(0.05)
        for port in ports.values():
            egress.bulk(port, bulkPort, 64 << 20)  # warm up
            egress.tunnelsPerSecond(port, echoPort, min(500, opts.tunnels), opts.concurrency)
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in ports}
        for r in range(opts.rounds):
            for name, port in ports.items():
                mbs = egress.bulk(port, bulkPort, size)
                tps = egress.tunnelsPerSecond(port, echoPort, opts.tunnels, opts.concurrency)
                samples[name].append((mbs, tps))
                print(f"  round {r + 1} {name:24s} bulk {mbs:8.0f} MB/s   {tps:8.0f} tunnels/s", flush=True)
    finally:
        egress.stopAll(procs.values())
        devnull.close()
        shutil.rmtree(work, ignore_errors=True)

    results = {name: tuple(statistics.median(x[i] for x in got) for i in range(2)) for name, got in samples.items()}
    direct, dispatched = results["bound directly"], results["through the dispatcher"]
    print()
    print(
        f"medians of {opts.rounds} rounds: bulk {opts.bulk_mib} MiB through one tunnel; "
        f"{opts.tunnels} new tunnels at concurrency {opts.concurrency}"
    )
    for name, (mbs, tps) in results.items():
        print(f"  {name:24s} {mbs:8.0f} MB/s {tps:8.0f} tunnels/s")
    # Round by round: each pair ran back to back, so load from elsewhere cancels.
    perRound = [
        (d[0] / b[0], d[1] / b[1]) for b, d in zip(samples["bound directly"], samples["through the dispatcher"], strict=True)
    ]
    print()
    print("goals: tunnels/s >= 0.9x direct, bulk >= 0.98x direct")
    print(f"  tunnels/s through the dispatcher vs direct: {dispatched[1] / direct[1]:.2f}x "
          f"(median of per-round ratios {statistics.median(r[1] for r in perRound):.2f}x)")  # fmt: skip
    print(f"  bulk through the dispatcher vs direct:      {dispatched[0] / direct[0]:.2f}x "
          f"(median of per-round ratios {statistics.median(r[0] for r in perRound):.2f}x)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
