"""Egress proxy benchmark: one run, printed as ratios against baselines measured now.

    .venv/bin/python bench/egress.py [--bulk-mib 1024] [--tunnels 5000] [--concurrency 50] [--hold 500]
                                     [--compare CHECKOUT]

Measures, on this machine and in this run:
  * bulk: one tunnel carrying --bulk-mib MiB, client -> proxy -> origin, MB/s;
  * new tunnels per second: --concurrency clients each doing CONNECT, a 1-byte
    echo and close, --tunnels in all;
  * the proxy's RSS holding --hold open tunnels;
  * the plain http:// forward path: one GET of --forward-mib MiB (MB/s) and
    keep-alive forwarded requests/s driven by wrk (absolute-form GETs of a tiny
    resource over --connections connections; every forwarded request is a new
    connection to the origin, as the proxy does);
for a direct connection (no proxy), squid (apt; configured for CONNECT from a
temp dir on loopback), a bare Twisted CONNECT splice (~60 lines, no policy), and
agentsandbox twice: with its zero-copy splice(2) and with Twisted's copy loop.
agentsandbox runs with its real policy path: allow list, address check,
same-user peer check and the audit log (journal lines to /dev/null).
Every server runs in its own process; all share this machine's CPUs.

``--compare CHECKOUT`` adds another checkout's proxy (same policy, zero-copy
splice) as one more contender in the same interleaved rounds, and prints this
checkout's figures over its, round by round: before and after a change in one
run, so load that comes and goes on the machine hits both alike.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterable

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SQUID = shutil.which("squid") or "/usr/sbin/squid"

# --------------------------------------------------------------------------- servers (child processes)



def stopAll(procs: Iterable[subprocess.Popen[bytes]]) -> None:
    """SIGTERM every child, then wait up to 10 s each and kill the ones still running."""
    running = list(procs)
    for proc in running:
        proc.send_signal(signal.SIGTERM)
    for proc in running:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()

def serveOrigin(bulkPort: int, echoPort: int, bulkBytes: int, httpPort: int, forwardBytes: int) -> None:
    """Origin: the bulk port sends ``bulkBytes`` then closes; the echo port echoes 1 byte;
    the http port answers ``GET /bulk`` with ``forwardBytes`` and anything else with 2 bytes."""
    block = memoryview(os.urandom(1 << 20))

    def httpClient(conn: socket.socket) -> None:
        with conn:
            buf = b""
            try:
                while True:
                    while b"\r\n\r\n" not in buf:
                        data = conn.recv(65536)
                        if not data:
                            return
                        buf += data
                    head, _, buf = buf.partition(b"\r\n\r\n")
                    if head.split(b" ", 2)[1].endswith(b"/bulk"):
                        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % forwardBytes)
                        left = forwardBytes
                        while left:
                            n = min(left, len(block))
                            conn.sendall(block[:n])
                            left -= n
                    else:
                        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok")
            except OSError:
                pass

    def httpLoop() -> None:
        s = socket.create_server(("127.0.0.1", httpPort), backlog=1024)
        while True:
            conn, _ = s.accept()
            threading.Thread(target=httpClient, args=(conn,), daemon=True).start()

    threading.Thread(target=httpLoop, daemon=True).start()

    def bulkClient(conn: socket.socket) -> None:
        with conn:
            left = bulkBytes
            try:
                while left:
                    n = min(left, len(block))
                    conn.sendall(block[:n])
                    left -= n
                conn.shutdown(socket.SHUT_WR)
                conn.recv(1)
            except OSError:
                pass  # the warm-up reads only a part and hangs up

    def bulkLoop() -> None:
        s = socket.create_server(("127.0.0.1", bulkPort), backlog=128)
        while True:
            conn, _ = s.accept()
            threading.Thread(target=bulkClient, args=(conn,), daemon=True).start()

    threading.Thread(target=bulkLoop, daemon=True).start()

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            data = await reader.read(1)
            writer.write(data)
            await writer.drain()
            await reader.read(1)
        except OSError:
            pass
        writer.close()

    async def main() -> None:
        server = await asyncio.start_server(echo, "127.0.0.1", echoPort, backlog=4096)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


BARE = '''
from twisted.internet import reactor, protocol
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol


class Upstream(protocol.Protocol):
    def __init__(self, client):
        self.client = client

    def connectionMade(self):
        self.client.upstream = self
        self.client.transport.registerProducer(self.transport, True)
        self.transport.registerProducer(self.client.transport, True)
        self.client.transport.write(b"HTTP/1.1 200 Connection established\\r\\n\\r\\n")
        if self.client.pending:
            self.transport.write(self.client.pending)
        self.client.transport.resumeProducing()

    def dataReceived(self, data):
        self.client.transport.write(data)

    def connectionLost(self, reason):
        self.client.transport.loseConnection()


class Client(protocol.Protocol):
    upstream = None

    def connectionMade(self):
        self.buffer = b""

    def dataReceived(self, data):
        if self.upstream is not None:
            self.upstream.transport.write(data)
            return
        self.buffer += data
        head, sep, rest = self.buffer.partition(b"\\r\\n\\r\\n")
        if not sep:
            return
        method, target = head.split(b" ")[:2]
        host, _, port = target.rpartition(b":")
        self.pending = rest
        self.transport.pauseProducing()
        ep = TCP4ClientEndpoint(reactor, host.decode(), int(port))
        connectProtocol(ep, Upstream(self)).addErrback(lambda f: self.transport.loseConnection())

    def connectionLost(self, reason):
        if self.upstream is not None:
            self.upstream.transport.loseConnection()


f = protocol.Factory.forProtocol(Client)
reactor.listenTCP(PORT, f, interface="127.0.0.1", backlog=4096)
reactor.run()
'''


def serveBare(port: int) -> None:
    exec(compile(BARE.replace("PORT", str(port)), "bare-twisted-splice", "exec"), {})


def serveAgentsandbox(
    port: int, allowPorts: list[int], fast: bool, state: str, dispatchSocket: str | None = None, repo: str = REPO
) -> None:
    """The proxy with its real policy path; on ``port``, or registered with the
    dispatcher on ``dispatchSocket`` (bench/dispatch.py); ``repo``'s code (a
    ``--compare`` checkout's, or this one's)."""
    sys.path.insert(0, repo)
    from twisted.internet import reactor
    from twisted.logger import globalLogBeginner, textFileLogObserver

    from agentsandbox.audit import AuditLog
    from agentsandbox.config import loads
    from agentsandbox.egress.proxy import EgressProxyFactory, ProxyService
    from agentsandbox.paths import Paths
    from agentsandbox.service import freezeStartupHeap

    devnull = open(os.devnull, "w")  # noqa: SIM115 (lives as long as the process)
    globalLogBeginner.beginLoggingTo([textFileLogObserver(devnull)], redirectStandardIO=False)
    domains = ", ".join(f'"127.0.0.1:{p}"' for p in allowPorts)
    toml = f'inject = []\n[sandbox]\ndomains = [{domains}]\n[proxy]\nport = {port}\nmax_tunnels = 100000\n'
    config = loads(toml.encode(), "<bench>", Paths.fromEnvironment({"HOME": state}))
    audit = AuditLog(os.path.join(state, "audit.jsonl"), maxBytes=64 << 20)
    factory = EgressProxyFactory(config, reactor, audit=audit, spliceFast=fast)
    ProxyService(factory, dispatchSocket=dispatchSocket).startService()
    # As the service's entry points do: start-up's objects out of the collector's walks.
    reactor.callWhenRunning(freezeStartupHeap)  # type: ignore[attr-defined,unused-ignore]
    reactor.run()  # type: ignore[attr-defined,unused-ignore]


# --------------------------------------------------------------------------- clients


def waitPort(port: int, limit: float = 15.0) -> None:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"nothing listens on 127.0.0.1:{port}")


def connectVia(proxyPort: int | None, target: int) -> tuple[socket.socket, bytes]:
    if proxyPort is None:
        return socket.create_connection(("127.0.0.1", target)), b""
    s = socket.create_connection(("127.0.0.1", proxyPort))
    s.sendall(f"CONNECT 127.0.0.1:{target} HTTP/1.1\r\nHost: 127.0.0.1:{target}\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            raise SystemExit(f"proxy on {proxyPort} closed during CONNECT: {data!r}")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    if b" 200 " not in head.split(b"\r\n")[0] + b" ":
        raise SystemExit(f"proxy on {proxyPort} refused: {head!r}")
    return s, rest


def bulk(proxyPort: int | None, target: int, size: int) -> float:
    """MB/s for one tunnel carrying ``size`` bytes."""
    start = time.perf_counter()
    s, rest = connectVia(proxyPort, target)
    got = len(rest)
    buf = bytearray(1 << 20)
    with s:
        while got < size:
            n = s.recv_into(buf)
            if not n:
                raise SystemExit(f"bulk ended early at {got} of {size} bytes")
            got += n
    return size / (time.perf_counter() - start) / 1e6


async def oneTunnel(proxyPort: int | None, target: int) -> None:
    host = "127.0.0.1"
    reader, writer = await asyncio.open_connection(host, proxyPort or target)
    if proxyPort is not None:
        writer.write(f"CONNECT {host}:{target} HTTP/1.1\r\nHost: {host}:{target}\r\n\r\n".encode())
        head = await reader.readuntil(b"\r\n\r\n")
        if b" 200 " not in head:
            raise RuntimeError(head)
    writer.write(b"x")
    if await reader.readexactly(1) != b"x":
        raise RuntimeError("bad echo")
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass


def tunnelsPerSecond(proxyPort: int | None, target: int, total: int, concurrency: int) -> float:
    async def run() -> float:
        left = [total]

        async def worker() -> None:
            while left[0] > 0:
                left[0] -= 1
                await oneTunnel(proxyPort, target)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return total / (time.perf_counter() - start)

    return asyncio.run(run())


def forwardBulk(proxyPort: int | None, httpPort: int, size: int) -> float:
    """MB/s for one forwarded GET of ``size`` bytes (or direct, without a proxy)."""
    start = time.perf_counter()
    s = socket.create_connection(("127.0.0.1", proxyPort or httpPort))
    target = f"http://127.0.0.1:{httpPort}/bulk" if proxyPort else "/bulk"
    s.sendall(f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1:{httpPort}\r\n\r\n".encode())
    data = b""
    with s:
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                raise SystemExit(f"forward via {proxyPort} closed before the head: {data!r}")
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise SystemExit(f"forward via {proxyPort}: {head!r}")
        got = len(rest)
        buf = bytearray(1 << 20)
        while got < size:
            n = s.recv_into(buf)
            if not n:
                raise SystemExit(f"forward bulk ended early at {got} of {size} bytes")
            got += n
    return size / (time.perf_counter() - start) / 1e6


WRK_PROXY = """
wrk.path = "http://127.0.0.1:PORT/small"
wrk.headers["Host"] = "127.0.0.1:PORT"
"""


def forwardRate(proxyPort: int | None, httpPort: int, seconds: float, connections: int, pid: int | None) -> tuple[float, float]:
    """(keep-alive requests/s, requests per proxy CPU-second) through wrk; (nan, nan) without wrk."""
    if shutil.which("wrk") is None:
        return float("nan"), float("nan")
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s"]
    script = None
    if proxyPort:
        fd, script = tempfile.mkstemp(suffix=".lua")
        with os.fdopen(fd, "w") as f:
            f.write(WRK_PROXY.replace("PORT", str(httpPort)))
        argv += ["-s", script, f"http://127.0.0.1:{proxyPort}/"]
    else:
        argv.append(f"http://127.0.0.1:{httpPort}/small")
    before = cpuSeconds(pid)
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60).stdout
    finally:
        if script:
            os.unlink(script)
    cpu = cpuSeconds(pid) - before
    rate = re.search(r"Requests/sec:\s+([0-9.]+)", out)
    total = re.search(r"(\d+) requests in", out)
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if rate is None or total is None or bad is not None:
        raise SystemExit(f"wrk through {proxyPort}: {out[-400:]}")
    return float(rate.group(1)), (int(total.group(1)) / cpu if cpu > 0 else float("nan"))


def cpuSeconds(pid: int | None) -> float:
    """User + system CPU seconds the process has used (0 for no process)."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rssWithTunnels(pid: int, proxyPort: int, target: int, hold: int) -> tuple[float, float]:
    """(RSS MB idle, RSS MB holding ``hold`` open tunnels)."""

    def rss() -> float:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return 0.0

    idle = rss()
    socks = [connectVia(proxyPort, target)[0] for _ in range(hold)]
    for s in socks:
        s.sendall(b"x")
        s.recv(1)
    held = rss()
    for s in socks:
        s.close()
    return idle, held


# --------------------------------------------------------------------------- orchestration


def freePort() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child(*args: str, repo: str = REPO) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=repo)
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", *args], env=env, cwd=repo)


def startSquid(workdir: str, port: int) -> subprocess.Popen[bytes] | None:
    if not os.path.exists(SQUID):
        print(f"squid not installed ({SQUID}): apt install squid; squid columns skipped")
        return None
    os.chmod(workdir, 0o777)
    conf = os.path.join(workdir, "squid.conf")
    with open(conf, "w") as f:
        f.write(
            textwrap.dedent(
                f"""\
                http_port 127.0.0.1:{port}
                http_access allow all
                cache deny all
                cache_mem 8 MB
                access_log none
                cache_log {workdir}/cache.log
                pid_filename {workdir}/squid.pid
                coredump_dir {workdir}
                max_filedescriptors 8192
                shutdown_lifetime 0 seconds
                workers 1
                """
            )
        )
    return subprocess.Popen([SQUID, "-N", "-f", conf], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "--serve":
        kind, rest = args[1], args[2:]
        if kind == "origin":
            serveOrigin(int(rest[0]), int(rest[1]), int(rest[2]), int(rest[3]), int(rest[4]))
        elif kind == "bare":
            serveBare(int(rest[0]))
        elif kind in ("agentsandbox", "agentsandbox-copy"):
            serveAgentsandbox(int(rest[0]), [int(p) for p in rest[1:4]], kind == "agentsandbox", rest[4])
        elif kind == "agentsandbox-compare":
            serveAgentsandbox(int(rest[0]), [int(p) for p in rest[1:4]], True, rest[4], repo=rest[5])
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bulk-mib", type=int, default=1024)
    p.add_argument("--tunnels", type=int, default=5000)
    p.add_argument("--concurrency", type=int, default=50)
    p.add_argument("--hold", type=int, default=500)
    p.add_argument("--forward-mib", type=int, default=256)
    p.add_argument("--forward-seconds", type=int, default=3, help="wrk -d: whole seconds")
    p.add_argument("--connections", type=int, default=8, help="wrk's connections for the forward rate")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; medians are reported")
    p.add_argument("--compare", metavar="CHECKOUT", help="also run another checkout's proxy in the same rounds")
    opts = p.parse_args(args)
    compared = "agentsandbox --compare"
    if opts.compare is not None:
        opts.compare = os.path.abspath(opts.compare)
        if not os.path.isfile(os.path.join(opts.compare, "agentsandbox", "egress", "proxy.py")):
            p.error(f"--compare {opts.compare}: not a checkout of agentsandbox (no agentsandbox/egress/proxy.py)")
    size = opts.bulk_mib << 20
    work = tempfile.mkdtemp(prefix="egress-bench-")
    bulkPort, echoPort, httpPort = freePort(), freePort(), freePort()
    forwardSize = opts.forward_mib << 20
    procs: dict[str, subprocess.Popen[bytes]] = {
        "origin": child("origin", str(bulkPort), str(echoPort), str(size), str(httpPort), str(forwardSize))
    }
    ports: dict[str, int | None] = {"direct": None}
    squidPort = freePort()
    squid = startSquid(work, squidPort)
    if squid is not None:
        procs["squid"] = squid
        ports["squid"] = squidPort
    ports["bare twisted"] = freePort()
    procs["bare twisted"] = child("bare", str(ports["bare twisted"]))
    for name, kind in (("agentsandbox", "agentsandbox"), ("agentsandbox copy loop", "agentsandbox-copy")):
        proxyPort = freePort()
        state = os.path.join(work, kind)
        os.makedirs(state)
        ports[name] = proxyPort
        procs[name] = child(kind, str(proxyPort), str(bulkPort), str(echoPort), str(httpPort), state)
    if opts.compare is not None:
        state = os.path.join(work, "compare")
        os.makedirs(state)
        ports[compared] = freePort()
        procs[compared] = child(
            "agentsandbox-compare",
            str(ports[compared]),
            str(bulkPort),
            str(echoPort),
            str(httpPort),
            state,
            opts.compare,
            repo=opts.compare,
        )
    try:
        waitPort(bulkPort)
        waitPort(echoPort)
        waitPort(httpPort)
        for port in ports.values():
            if port is not None:
                waitPort(port)
        for port in ports.values():
            bulk(port, bulkPort, min(size, 64 << 20))  # warm up: the origin sends size, then hangs up
            tunnelsPerSecond(port, echoPort, min(500, opts.tunnels), opts.concurrency)
        # Rounds interleave the contenders, so a burst of load from elsewhere on
        # the machine hits all of them; the median of each is reported.
        samples: dict[str, list[tuple[float, float, float]]] = {name: [] for name in ports}
        order = list(ports.items())
        for r in range(opts.rounds):
            # Each round starts one contender later, so no one always runs first.
            for name, port in order[r % len(order) :] + order[: r % len(order)]:
                pid = procs[name].pid if name in procs else None
                mbs = bulk(port, bulkPort, size)
                before = cpuSeconds(pid)
                tps = tunnelsPerSecond(port, echoPort, opts.tunnels, opts.concurrency)
                cpu = cpuSeconds(pid) - before
                perCPU = opts.tunnels / cpu if cpu > 0 else float("nan")
                samples[name].append((mbs, tps, perCPU))
                print(
                    f"  round {r + 1} {name:24s} bulk {mbs:8.0f} MB/s   {tps:8.0f} tunnels/s"
                    f"   {perCPU:8.0f} tunnels per proxy CPU-second",
                    flush=True,
                )
        results = {
            name: tuple(statistics.median(x[i] for x in got) for i in range(3))
            for name, got in samples.items()
        }
        # The forward path: only proxies that forward http:// (not the bare splice).
        forwarders = [n for n in ports if n in ("direct", "squid", "agentsandbox", compared)]
        for name in forwarders:
            forwardBulk(ports[name], httpPort, min(forwardSize, 16 << 20))  # warm up
        fsamples: dict[str, list[tuple[float, float, float]]] = {name: [] for name in forwarders}
        for r in range(opts.rounds):
            for name in forwarders[r % len(forwarders) :] + forwarders[: r % len(forwarders)]:
                pid = procs[name].pid if name in procs else None
                mbs = forwardBulk(ports[name], httpPort, forwardSize)
                rps, perCPU = forwardRate(ports[name], httpPort, opts.forward_seconds, opts.connections, pid)
                fsamples[name].append((mbs, rps, perCPU))
                print(
                    f"  round {r + 1} forward {name:16s} bulk {mbs:8.0f} MB/s   {rps:8.0f} requests/s"
                    f"   {perCPU:8.0f} requests per proxy CPU-second",
                    flush=True,
                )
        fresults = {
            name: tuple(statistics.median(x[i] for x in got) for i in range(3))
            for name, got in fsamples.items()
        }
        idle, held = rssWithTunnels(procs["agentsandbox"].pid, ports["agentsandbox"] or 0, echoPort, opts.hold)
        if opts.compare is not None:
            comparedRSS = rssWithTunnels(procs[compared].pid, ports[compared] or 0, echoPort, opts.hold)
    finally:
        stopAll(procs.values())
        shutil.rmtree(work, ignore_errors=True)

    direct = results["direct"]
    bare = results["bare twisted"]
    ours = results["agentsandbox"]
    print()
    print(
        f"medians of {opts.rounds} rounds: bulk {opts.bulk_mib} MiB through one tunnel; "
        f"{opts.tunnels} new tunnels at concurrency {opts.concurrency}"
    )
    for name, (mbs, tps, perCPU) in results.items():
        print(f"  {name:24s} {mbs:8.0f} MB/s {tps:8.0f} tunnels/s {perCPU:8.0f} tunnels/CPU-s")
    print(
        f"{'':24s} {'bulk vs direct':>15s} {'bulk vs squid':>14s} {'tun/s vs bare':>14s} "
        f"{'tun/s vs squid':>15s} {'tun/CPU-s vs bare':>18s}"
    )
    for name, (mbs, tps, perCPU) in results.items():
        vsSquid = f"{mbs / results['squid'][0]:13.2f}x" if "squid" in results else f"{'-':>14s}"
        tpsSquid = f"{tps / results['squid'][1]:14.2f}x" if "squid" in results else f"{'-':>15s}"
        cpuBare = f"{perCPU / bare[2]:17.2f}x" if name != "direct" else f"{'-':>18s}"
        print(f"{name:24s} {mbs / direct[0]:14.2f}x {vsSquid} {tps / bare[1]:13.2f}x {tpsSquid} {cpuBare}")
    print()
    print("goals: agentsandbox bulk >= 1.0x squid, tunnels/s >= 0.9x bare twisted, RSS <= 100 MB")
    if "squid" in results:
        print(f"  bulk vs squid:        {ours[0] / results['squid'][0]:.2f}x")
    print(f"  tunnels/s vs bare:    {ours[1] / bare[1]:.2f}x (wall clock; shares the CPUs with the client)")
    print(f"  tunnels per proxy CPU-second vs bare: {ours[2] / bare[2]:.2f}x (the policy's own cost)")
    # The same comparison round by round: each pair ran back to back, so load
    # from elsewhere on the machine that comes and goes between rounds cancels.
    for i, label in ((1, "tunnels/s"), (2, "tunnels per CPU-second")):
        pairs = [o[i] / b[i] for o, b in zip(samples["agentsandbox"], samples["bare twisted"], strict=True)]
        shown = " ".join(f"{x:.2f}" for x in pairs)
        print(f"  {label} vs bare, median of per-round pairs: {statistics.median(pairs):.2f}x ({shown})")
    print(f"  RSS: {idle:.0f} MB idle, {held:.0f} MB holding {opts.hold} tunnels")
    print()
    print(
        f"forward path (http://), medians of {opts.rounds} rounds: one GET of {opts.forward_mib} MiB; "
        f"wrk keep-alive GETs over {opts.connections} connections for {opts.forward_seconds:g}s"
    )
    for name, (mbs, rps, perCPU) in fresults.items():
        cpuText = f"{perCPU:8.0f} requests/proxy CPU-s" if name != "direct" else ""
        print(f"  {name:24s} {mbs:8.0f} MB/s {rps:8.0f} requests/s {cpuText}")
    fours = fresults["agentsandbox"]
    print(f"  forward bulk vs direct: {fours[0] / fresults['direct'][0]:.2f}x")
    if "squid" in fresults:
        fsquid = fresults["squid"]
        print(f"  forward bulk vs squid: {fours[0] / fsquid[0]:.2f}x; requests/s vs squid: {fours[1] / fsquid[1]:.2f}x")
    if opts.compare is not None:
        print()
        print(f"this checkout over --compare {opts.compare}, median of per-round pairs (1.00 = no change):")
        rows = (
            ("bulk MB/s", samples, 0),
            ("new tunnels/s", samples, 1),
            ("new tunnels per proxy CPU-second", samples, 2),
            ("forward bulk MB/s", fsamples, 0),
            ("forward requests/s", fsamples, 1),
            ("forward requests per proxy CPU-second", fsamples, 2),
        )
        for label, table, i in rows:
            pairs = [o[i] / c[i] for o, c in zip(table["agentsandbox"], table[compared], strict=True)]
            shown = " ".join(f"{x:.2f}" for x in pairs)
            print(f"  {label:38s} {statistics.median(pairs):.3f} ({shown})")
        print(
            f"  RSS: {idle:.0f} / {comparedRSS[0]:.0f} MB idle, "
            f"{held:.0f} / {comparedRSS[1]:.0f} MB holding {opts.hold} tunnels"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
