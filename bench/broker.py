#!/usr/bin/env python3
"""Broker round trip: ping p50/p99 against the inotify broker and a 50 ms polling baseline.

    python bench/broker.py [--asks 500]

Starts two ``agentsandbox broker`` processes over two temp spools, one woken by
inotify, one that only looks every 50 ms (``--poll 0.05``, the baseline measured in
the same run), and times ``--asks`` sequential pings against each with the real
client.  A third series measures the client's own wait: the inotify watch against
its backoff poll, both against the inotify broker.  Goal: inotify p50 <= 0.2x the
polling baseline's p50.
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
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agentsandbox.broker import client  # noqa: E402
from agentsandbox.broker.spool import Request  # noqa: E402

GOAL = 0.2


def startBroker(base: str, name: str, poll: float | None) -> tuple[subprocess.Popen[bytes], str]:
    spool = os.path.join(base, name, "spool")
    config = os.path.join(base, name, "config.toml")
    os.makedirs(os.path.dirname(config))
    with open(config, "w") as f:
        f.write(f'[broker]\nspool = "{spool}"\n')
    argv = [sys.executable, "-m", "agentsandbox", "broker", "--config", config]
    if poll is not None:
        argv += ["--poll", str(poll)]
    env = dict(os.environ, PYTHONPATH=str(REPO), HOME=os.path.join(base, name))
    env.pop("SANDBOX_RUNTIME", None)
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            client.call(Request(op="ping"), spool, 0.5)
            return proc, spool
        except client.NoBroker:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise SystemExit(f"the {name} broker did not start") from None


def series(spool: str, asks: int, useInotify: bool = True) -> list[float]:
    times = []
    for _ in range(asks):
        start = time.perf_counter()
        client.call(Request(op="ping"), spool, 10.0, useInotify=useInotify)
        times.append(time.perf_counter() - start)
    return times


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def report(name: str, times: list[float]) -> float:
    p50 = statistics.median(times)
    print(f"{name:<38} p50 {p50 * 1000:8.2f} ms   p99 {percentile(times, 99) * 1000:8.2f} ms")
    return p50


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--asks", type=int, default=500)
    args = parser.parse_args()
    base = tempfile.mkdtemp(prefix="agentsandbox-bench-")
    procs = []
    try:
        fast, fastSpool = startBroker(base, "inotify", None)
        procs.append(fast)
        slow, slowSpool = startBroker(base, "polling", 0.05)
        procs.append(slow)
        print(f"{args.asks} sequential pings each (client waits with inotify unless said)\n")
        inotifyP50 = report("broker inotify", series(fastSpool, args.asks))
        pollP50 = report("broker polling every 50 ms (baseline)", series(slowSpool, args.asks))
        clientPoll = report("broker inotify, client backoff poll", series(fastSpool, args.asks, False))
        ratio = inotifyP50 / pollP50
        print(f"\np50 ratio inotify / polling baseline: {ratio:.3f} (goal <= {GOAL})")
        print(f"client wait, backoff poll / inotify p50: {clientPoll / inotifyP50:.2f}")
        print("goal met" if ratio <= GOAL else "GOAL MISSED")
        return 0 if ratio <= GOAL else 1
    finally:
        for proc in procs:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
