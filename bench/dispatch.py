"""Dispatcher benchmark: the same proxy bound directly vs registered with the dispatcher, in one run.

    .venv/bin/python bench/dispatch.py [--rounds 7] [--tunnels 4000] [--concurrency 50] [--bulk-mib 1024]
                                       [--compare CHECKOUT]

Measures, on this machine and in this run, for the agentsandbox proxy (its real
policy path: allow list, address check, same-user peer check, audit log) once
bound to its port and once behind ``agentsandbox dispatch`` (which looks up the
client's uid and passes each connection with SCM_RIGHTS):
  * new tunnels per second: --concurrency clients each doing CONNECT, a 1-byte
    echo and close, --tunnels in all;
  * the CPU each process spent per new tunnel (client, echo origin, the
    user's proxy, the dispatcher): the cost itself, which a loaded machine
    shifts much less than it shifts a rate;
  * bulk: one tunnel carrying --bulk-mib MiB, MB/s (the bytes never pass the
    dispatcher, so this should match).
--compare CHECKOUT adds a third target: the dispatcher and the registered proxy
run from another checkout (say the commit before a change, from ``git archive``),
measured in the same rounds, so before and after share the machine's load.

Every round measures every target twice, there and back (A B B A, each
target's figure for the round the mean of its two), in an order that rotates
from round to round, so a slow spell of the machine falls on each in turn.
Ratios are taken round by round (the pair ran side by side) and their median
and range are reported.  Goals: tunnels/s >= 0.9x direct, bulk >= 0.98x direct.

The load is lean on purpose, so that on 2 cores the proxy is what is measured:
the tunnel client and the echo origin are plain epoll loops (asyncio streams
cost more CPU per tunnel than the proxy's whole hand-off), and the bulk client
discards what it receives in the kernel (``MSG_TRUNC``) rather than copying it.
"""

from __future__ import annotations

import argparse
import errno
import os
import select
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import egress  # noqa: E402  (bench/egress.py: the proxy, the bulk origin, stopAll)

GOAL_TUNNELS = 0.9
GOAL_BULK = 0.98


# --------------------------------------------------------------------------- the load


def serveEcho(port: int) -> None:
    """Echo origin: each connection's bytes are sent back; EOF closes it."""
    server = socket.create_server(("127.0.0.1", port), backlog=4096)
    server.setblocking(False)
    listening = server.fileno()
    poller = select.epoll()
    poller.register(listening, select.EPOLLIN)
    conns: dict[int, socket.socket] = {}
    while True:
        for fd, _ in poller.poll():
            if fd == listening:
                while True:
                    try:
                        conn, _ = server.accept()
                    except BlockingIOError:
                        break
                    conn.setblocking(False)
                    conns[conn.fileno()] = conn
                    poller.register(conn.fileno(), select.EPOLLIN)
                continue
            conn = conns[fd]
            try:
                data = conn.recv(64)
                if data:
                    conn.send(data)
                    continue
            except BlockingIOError:
                continue
            except OSError:
                pass
            del conns[fd]
            conn.close()


def tunnelsPerSecond(proxyPort: int, target: int, total: int, concurrency: int) -> float:
    """New tunnels/s: ``concurrency`` at a time, each CONNECT, wait for 200, 1-byte echo, close."""
    request = f"CONNECT 127.0.0.1:{target} HTTP/1.1\r\nHost: 127.0.0.1:{target}\r\n\r\n".encode()
    proxy = ("127.0.0.1", proxyPort)
    poller = select.epoll()
    #: fd -> [socket, phase (0 connecting, 1 reading the answer, 2 reading the echo), bytes read]
    tunnels: dict[int, list[object]] = {}
    started = done = 0

    def start() -> None:
        nonlocal started
        sock = socket.socket()
        sock.setblocking(False)
        failed = sock.connect_ex(proxy)
        if failed not in (0, errno.EINPROGRESS):
            raise SystemExit(f"cannot connect to the proxy on {proxyPort}: {os.strerror(failed)}")
        tunnels[sock.fileno()] = [sock, 0, b""]
        poller.register(sock.fileno(), select.EPOLLOUT)
        started += 1

    begin = time.perf_counter()
    for _ in range(min(concurrency, total)):
        start()
    while done < total:
        for fd, events in poller.poll():
            tunnel = tunnels[fd]
            sock, phase = tunnel[0], tunnel[1]
            assert isinstance(sock, socket.socket)
            if phase == 0:
                if events & (select.EPOLLERR | select.EPOLLHUP):
                    raise SystemExit(f"cannot connect to the proxy on {proxyPort}")
                sock.send(request)
                tunnel[1] = 1
                poller.modify(fd, select.EPOLLIN)
            elif phase == 1:
                chunk = sock.recv(4096)
                data = tunnel[2] + chunk  # type: ignore[operator]
                if b"\r\n\r\n" not in data:
                    if not chunk:
                        raise SystemExit(f"proxy on {proxyPort} closed during CONNECT: {data!r}")
                    tunnel[2] = data
                    continue
                if b" 200 " not in data.split(b"\r\n", 1)[0] + b" ":
                    raise SystemExit(f"proxy on {proxyPort} refused: {data!r}")
                sock.send(b"x")
                tunnel[1] = 2
            else:
                if sock.recv(16) != b"x":
                    raise SystemExit("bad echo")
                # Closing the socket takes it out of the epoll set too.
                del tunnels[fd]
                sock.close()
                done += 1
                if started < total:
                    start()
    elapsed = time.perf_counter() - begin
    poller.close()
    return total / elapsed


def bulk(proxyPort: int, target: int, size: int) -> float:
    """MB/s for one tunnel carrying ``size`` bytes, discarded in the kernel as they arrive."""
    start = time.perf_counter()
    s, rest = egress.connectVia(proxyPort, target)
    got = len(rest)
    buf = bytearray(1 << 20)
    with s:
        while got < size:
            n = s.recv_into(buf, len(buf), socket.MSG_TRUNC)
            if not n:
                raise SystemExit(f"bulk ended early at {got} of {size} bytes")
            got += n
    return size / (time.perf_counter() - start) / 1e6


# --------------------------------------------------------------------------- the run


@dataclass
class Target:
    name: str
    port: int
    #: The processes serving this target's tunnels: "proxy", and "dispatcher" behind one.
    pids: dict[str, int]
    tunnels: list[float] = field(default_factory=list)
    bulk: list[float] = field(default_factory=list)
    #: CPU microseconds per tunnel, by process, one dict per round.
    cpu: list[dict[str, float]] = field(default_factory=list)


def cpuSeconds(pid: int) -> float:
    return egress.cpuSeconds(pid)


def child(repo: str, *args: str) -> subprocess.Popen[bytes]:
    """``bench/dispatch.py --serve ...`` of ``repo``, importing that checkout's agentsandbox."""
    script = os.path.join(repo, "bench", "dispatch.py")
    return subprocess.Popen([sys.executable, script, "--serve", *args], env=dict(os.environ, PYTHONPATH=repo), cwd=repo)


def dispatcher(repo: str, port: int, sock: str) -> subprocess.Popen[bytes]:
    # The registered proxy runs as this user, root's when the benchmark runs as
    # root, and a dispatcher takes root's registration only when its config says so.
    config = sock + ".toml"
    with open(config, "w") as f:
        f.write("[proxy]\ndispatch_root = true\n")
    return subprocess.Popen(
        [sys.executable, "-m", "agentsandbox", "dispatch", "--port", str(port), "--socket", sock, "--config", config],
        env=dict(os.environ, PYTHONPATH=repo), cwd=repo, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip


def waitFile(path: str, limit: float = 15.0) -> None:
    end = time.monotonic() + limit
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise SystemExit(f"{path} did not appear")
        time.sleep(0.05)


def waitServed(port: int, target: int, limit: float = 15.0) -> None:
    """Until a tunnel through ``port`` is served (a registered service, not the 503)."""
    end = time.monotonic() + limit
    while True:
        try:
            egress.connectVia(port, target)[0].close()
            return
        except SystemExit:
            if time.monotonic() > end:
                raise
            time.sleep(0.05)


def spread(values: list[float], digits: int = 2) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def serve(kind: str, rest: list[str]) -> None:
    if kind == "origin":
        # Only the bulk port is measured here; the echo and http ports idle.
        egress.serveOrigin(int(rest[0]), egress.freePort(), int(rest[1]), egress.freePort(), 0)
    elif kind == "echo":
        serveEcho(int(rest[0]))
    elif kind == "direct":
        egress.serveAgentsandbox(int(rest[0]), [int(rest[1]), int(rest[2])], True, rest[3])
    elif kind == "registered":
        egress.serveAgentsandbox(int(rest[0]), [int(rest[1]), int(rest[2])], True, rest[3], dispatchSocket=rest[4])


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "--serve":
        serve(args[1], args[2:])
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bulk-mib", type=int, default=1024)
    p.add_argument("--tunnels", type=int, default=4000)
    p.add_argument("--concurrency", type=int, default=50)
    p.add_argument("--rounds", type=int, default=7, help="rounds, each measuring every target; medians are reported")
    p.add_argument("--compare", metavar="CHECKOUT", help="also measure the dispatcher and registered proxy of this checkout")
    opts = p.parse_args(args)
    size = opts.bulk_mib << 20
    work = tempfile.mkdtemp(prefix="dispatch-bench-")
    bulkPort, echoPort, directPort = egress.freePort(), egress.freePort(), egress.freePort()
    procs: dict[str, subprocess.Popen[bytes]] = {
        "origin": child(REPO, "origin", str(bulkPort), str(size)),
        "echo": child(REPO, "echo", str(echoPort)),
    }
    targets: list[Target] = []
    try:
        os.makedirs(os.path.join(work, "direct"))
        procs["direct"] = child(REPO, "direct", str(directPort), str(bulkPort), str(echoPort), os.path.join(work, "direct"))
        targets.append(Target("bound directly", directPort, {"proxy": procs["direct"].pid}))
        behind = [("through the dispatcher", REPO)]
        if opts.compare:
            behind.append((f"dispatcher of {os.path.basename(os.path.normpath(opts.compare))}", os.path.abspath(opts.compare)))
        for i, (name, repo) in enumerate(behind):
            port, sock, state = egress.freePort(), os.path.join(work, f"dispatch{i}.sock"), os.path.join(work, f"registered{i}")
            os.makedirs(state)
            procs[f"dispatcher{i}"] = dispatcher(repo, port, sock)
            waitFile(sock)
            procs[f"registered{i}"] = child(repo, "registered", str(port), str(bulkPort), str(echoPort), state, sock)
            targets.append(Target(name, port, {"proxy": procs[f"registered{i}"].pid, "dispatcher": procs[f"dispatcher{i}"].pid}))
        for port in (bulkPort, echoPort, directPort):
            egress.waitPort(port)
        for target in targets:
            waitServed(target.port, echoPort)
            bulk(target.port, bulkPort, min(size, 64 << 20))  # warm up: the origin sends size, then hangs up
            tunnelsPerSecond(target.port, echoPort, min(500, opts.tunnels), opts.concurrency)
        echoPid = procs["echo"].pid
        for r in range(opts.rounds):
            order = targets[r % len(targets):] + targets[: r % len(targets)]
            # There and back (A B B A): a load that rises or falls through the
            # round weighs the same on every target.
            there = order + order[::-1]
            got: dict[str, list[float]] = {t.name: [] for t in targets}
            for target in there:
                got[target.name].append(bulk(target.port, bulkPort, size))
            for target in targets:
                target.bulk.append(statistics.fmean(got[target.name]))
            got = {t.name: [] for t in targets}
            costs: dict[str, list[dict[str, float]]] = {t.name: [] for t in targets}
            for target in there:
                pids = dict(target.pids, origin=echoPid)
                before = {k: cpuSeconds(pid) for k, pid in pids.items()}
                mine = time.process_time()
                got[target.name].append(tunnelsPerSecond(target.port, echoPort, opts.tunnels, opts.concurrency))
                cpu = {"client": time.process_time() - mine}
                cpu.update((k, cpuSeconds(pid) - before[k]) for k, pid in pids.items())
                costs[target.name].append({k: v / opts.tunnels * 1e6 for k, v in cpu.items()})
            for target in targets:
                target.tunnels.append(statistics.fmean(got[target.name]))
                target.cpu.append({k: statistics.fmean(c[k] for c in costs[target.name]) for k in costs[target.name][0]})
            print(f"  round {r + 1}: " + "   ".join(
                f"{t.name} {t.tunnels[-1]:.0f} tunnels/s {t.bulk[-1]:.0f} MB/s" for t in targets), flush=True)  # fmt: skip
    finally:
        egress.stopAll(procs.values())
        shutil.rmtree(work, ignore_errors=True)

    direct = targets[0]
    print()
    print(f"{opts.rounds} rounds: {opts.tunnels} new tunnels at concurrency {opts.concurrency}; "
          f"bulk {opts.bulk_mib} MiB through one tunnel; median (min-max)")  # fmt: skip
    for t in targets:
        print(f"  {t.name:28s} {spread(t.tunnels, 0):>18s} tunnels/s   {spread(t.bulk, 0):>18s} MB/s")
    print()
    print("CPU per new tunnel, microseconds (median of rounds)")
    for t in targets:
        kinds = ("client", "origin", "proxy", "dispatcher")
        cost = {k: statistics.median(c[k] for c in t.cpu) for k in kinds if k in t.cpu[0]}
        print(f"  {t.name:28s} " + "  ".join(f"{k} {v:4.0f}" for k, v in cost.items())
              + f"  = {sum(cost.values()):.0f}")  # fmt: skip
    print()
    print(f"through the dispatcher vs bound directly, round by round: median (min-max); "
          f"goals tunnels/s >= {GOAL_TUNNELS}x, bulk >= {GOAL_BULK}x")  # fmt: skip
    for t in targets[1:]:
        tunnels = [d / b for d, b in zip(t.tunnels, direct.tunnels, strict=True)]
        bulks = [d / b for d, b in zip(t.bulk, direct.bulk, strict=True)]
        print(f"  {t.name:28s} tunnels/s {spread(tunnels)}x {_verdict(tunnels, GOAL_TUNNELS)}   "
              f"bulk {spread(bulks)}x {_verdict(bulks, GOAL_BULK)}")  # fmt: skip
    return 0


def _verdict(ratios: list[float], goal: float) -> str:
    return "met" if statistics.median(ratios) >= goal else "NOT met"


if __name__ == "__main__":
    sys.exit(main())
