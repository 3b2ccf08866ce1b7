"""Benchmark: what one exchange (or new tunnel) costs each proxy path, in memory, against h11.

    .venv/bin/python bench/exchange.py [--rounds 5] [--exchanges 20000] [--callgrind]
                                       [--compare CHECKOUT]

The wall-clock benchmarks (``egress.py``, ``inject.py``) drive real sockets
with wrk; on two shared cores their figures swing by 15-30% from run to run,
which hides a change of a few percent in the proxy's own work.  This one
takes the sockets, TLS and the reactor away and feeds one keep-alive exchange
(``GET /x`` with three fields, a 5-byte ``Content-Length`` answer) straight
into the protocols, over and over:

``terminated``
    a terminated tunnel (``inject._Tunnel`` and its ``_Upstream``, from
    ``agentsandbox.egress.testing.memoryTunnel``): head policy, ``Host`` and
    header injection, the response head rewritten, both framers.
``forward``
    the plain ``http://`` path: a front door from ``EgressProxyFactory``
    (allow list, address rules, audit record) with a ``MemoryDialer``, one
    origin connection per request as on the real path.
``tunnel``
    one new tunnel: CONNECT to an allowed host, the default ``TCPDialer`` on
    Twisted's ``MemoryReactor`` (the tunnel's own upstream protocol, as in
    production), four bytes each way, both ends closing (the audit records
    built).
``h11``
    the baseline, measured in the same run: h11 (the grammar's test oracle)
    reading the same request and response and writing each back out, which is
    the least a proxy built on it would do per exchange.

Each target runs in a fresh process per round (the order rotating from round
to round) and reports the CPU it spent per exchange after a warm-up; the
median over rounds is printed with its range, and each path's ratio to the
baseline.  ``--callgrind`` counts instructions instead (valgrind, from apt):
the process is run with 0 and with ``--exchanges`` exchanges and the
difference divided, which gives the same count on every run on the same
machine and Python, whatever else the machine is doing.  ``--compare
CHECKOUT`` adds both paths as another checkout builds them (one that ships the
memory doubles), measured in the same rounds, for a before/after.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentsandbox.config import Config

HERE = Path(__file__).resolve().parent.parent
HOST = "api.example.com"
REQUEST = b"GET /x HTTP/1.1\r\nHost: " + HOST.encode() + b"\r\nUser-Agent: wrk\r\nAccept: */*\r\n\r\n"
FORWARD_REQUEST = (
    b"GET http://" + HOST.encode() + b"/x HTTP/1.1\r\nHost: " + HOST.encode() + b"\r\nUser-Agent: wrk\r\nAccept: */*\r\n\r\n"
)
RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Type: text/plain\r\n\r\nhello"
ADDRESS = "192.0.2.80"  # a documentation address: the memory doubles dial nothing


# ---------------------------------------------------------------------- the exchanges (worker side)


def _terminated() -> Callable[[], None]:
    import ipaddress

    from agentsandbox.config import EnvSource, InjectRule
    from agentsandbox.egress.inject import Route
    from agentsandbox.egress.testing import FixedToken, MemoryUpstreamPool, memoryTunnel

    pool = MemoryUpstreamPool()
    rule = InjectRule(hosts=(HOST,), header="Authorization", format="token {token}", token=EnvSource("UNUSED"))
    route = Route(HOST, rule, FixedToken("bench-t0k3n"))
    tunnel, client = memoryTunnel(pool, route, (ipaddress.ip_address(ADDRESS),))

    def exchange() -> None:
        tunnel.dataReceived(REQUEST)
        upstream = pool.upstreams[0]
        upstream.dataReceived(RESPONSE)
        client.clear()
        upstream.transport.clear()  # type: ignore[union-attr]

    exchange()
    if len(pool.upstreams) != 1 or pool.injectedRequests != 1:
        raise SystemExit("the terminated exchange did not reuse its upstream or inject its header")
    return exchange


def _forward() -> Callable[[], None]:
    from twisted.internet.task import Clock
    from twisted.internet.testing import StringTransport

    from agentsandbox.egress.proxy import EgressProxyFactory
    from agentsandbox.egress.testing import AllowAllPeers, FixedResolver, MemoryDialer

    dialer = MemoryDialer()
    factory = EgressProxyFactory(
        _config(), Clock(), resolver=FixedResolver({HOST: [ADDRESS]}), dialer=dialer, peers=AllowAllPeers()
    )
    door = factory.buildProtocol(None)
    client = StringTransport()
    door.makeConnection(client)

    def exchange() -> None:
        door.dataReceived(FORWARD_REQUEST)
        upstream = dialer.upstreams.pop()
        upstream.dataReceived(RESPONSE)
        client.clear()

    exchange()
    if client.disconnecting:
        raise SystemExit("the forward exchange was refused: " + client.value().decode(errors="replace"))
    return exchange


def _tunnel() -> Callable[[], None]:
    from twisted.internet.address import IPv4Address
    from twisted.internet.error import ConnectionDone
    from twisted.internet.task import Clock
    from twisted.internet.testing import MemoryReactor, StringTransport
    from twisted.python.failure import Failure

    from agentsandbox.egress.dial import TCPDialer
    from agentsandbox.egress.proxy import EgressProxyFactory
    from agentsandbox.egress.testing import AllowAllPeers, FixedResolver

    # The default dialer, as in production, on a reactor whose connectTCP is
    # answered here: the tunnel's own UpstreamProtocol on a StringTransport.
    reactor = MemoryReactor()
    factory = EgressProxyFactory(
        _config(), Clock(), resolver=FixedResolver({HOST: [ADDRESS]}), dialer=TCPDialer(reactor), peers=AllowAllPeers()
    )
    connect = b"CONNECT %b:443 HTTP/1.1\r\nHost: %b:443\r\n\r\n" % (HOST.encode(), HOST.encode())
    last: list[StringTransport] = []  # the last client's transport, to check the first tunnel by

    def exchange() -> None:
        door = factory.buildProtocol(None)
        client = StringTransport()
        door.makeConnection(client)
        door.dataReceived(connect)
        host, port, dialled, _, _ = reactor.tcpClients.pop()
        upstream = dialled.buildProtocol(IPv4Address("TCP", host, port))
        assert upstream is not None
        upstream.makeConnection(StringTransport())
        door.dataReceived(b"ping")
        upstream.dataReceived(b"pong")
        last[:] = [client]
        door.connectionLost(Failure(ConnectionDone()))
        upstream.connectionLost(Failure(ConnectionDone()))

    exchange()
    if not last[0].value().endswith(b"pong"):
        raise SystemExit("the tunnel did not carry its bytes: " + last[0].value().decode(errors="replace"))
    return exchange


def _config() -> Config:
    from agentsandbox.config import loads
    from agentsandbox.paths import Paths

    home = tempfile.mkdtemp(prefix="bench-exchange-")
    return loads(f'[sandbox]\ndomains = ["{HOST}"]\n'.encode(), "<bench>", Paths.fromEnvironment({"HOME": home}))


def _h11() -> Callable[[], None]:
    import h11

    server = h11.Connection(h11.SERVER)
    origin = h11.Connection(h11.CLIENT)

    def exchange() -> None:
        server.receive_data(REQUEST)
        request = server.next_event()
        end = server.next_event()
        assert isinstance(request, h11.Request) and isinstance(end, h11.EndOfMessage)
        origin.send(request)
        origin.send(end)
        origin.receive_data(RESPONSE)
        for _ in range(3):  # Response, Data, EndOfMessage
            event = origin.next_event()
            assert isinstance(event, h11.Response | h11.Data | h11.EndOfMessage)
            server.send(event)
        server.start_next_cycle()
        origin.start_next_cycle()

    exchange()
    return exchange


_MEASURED = ("terminated", "forward", "tunnel")
_PATHS = {"terminated": _terminated, "forward": _forward, "tunnel": _tunnel, "h11": _h11}


def worker(path: str, exchanges: int) -> None:
    """Build ``path``'s exchange, warm it up, run it ``exchanges`` times; print CPU s per exchange."""
    exchange = _PATHS[path]()
    for _ in range(min(exchanges, 500)):
        exchange()
    start = time.process_time()
    for _ in range(exchanges):
        exchange()
    spent = time.process_time() - start
    print(json.dumps({"perExchange": spent / exchanges if exchanges else 0.0}))


# ---------------------------------------------------------------------- the runs (driver side)


def _run(tree: Path, path: str, exchanges: int, callgrind: bool) -> float:
    """One measurement: CPU seconds, or instructions, per exchange of ``path`` as ``tree`` builds it."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    command = [sys.executable, str(HERE / "bench" / "exchange.py"), "--worker", path]
    if not callgrind:
        return float(json.loads(_worker(tree, path, [*command, "--exchanges", str(exchanges)], env))["perExchange"])
    counts = []
    with tempfile.TemporaryDirectory() as scratch:
        for n in (0, exchanges):
            report = Path(scratch) / f"callgrind.{n}"
            valgrind = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={report}"]
            _worker(tree, path, [*valgrind, *command, "--exchanges", str(n)], env)
            counts.append(_totalInstructions(report))
    return (counts[1] - counts[0]) / exchanges


def _worker(tree: Path, path: str, command: list[str], env: dict[str, str]) -> str:
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(
            f"bench/exchange.py: the {path} exchange from {tree} failed: {last}\n"
            "(a --compare checkout must ship agentsandbox.egress.testing's memory doubles)"
        )
    return done.stdout


def _totalInstructions(report: Path) -> int:
    for line in report.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise SystemExit(f"no instruction total in {report}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--exchanges", type=int, default=20000)
    parser.add_argument("--callgrind", action="store_true", help="count instructions under valgrind (repeatable)")
    parser.add_argument("--compare", type=Path, metavar="CHECKOUT", help="also measure another checkout's paths")
    parser.add_argument("--worker", choices=sorted(_PATHS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.exchanges)
        return
    if args.callgrind and shutil.which("valgrind") is None:
        raise SystemExit("--callgrind needs valgrind (apt install valgrind)")
    targets = [("h11", HERE, "h11")] + [(path, HERE, path) for path in _MEASURED]
    if args.compare is not None:
        other = args.compare.resolve()
        targets += [(f"{path} (compare)", other, path) for path in _MEASURED]
    rounds = 1 if args.callgrind else args.rounds  # (an instruction count is the same every time)
    exchanges = min(args.exchanges, 5000) if args.callgrind else args.exchanges
    results: dict[str, list[float]] = {name: [] for name, _, _ in targets}
    for r in range(rounds):
        turn = targets[r % len(targets) :] + targets[: r % len(targets)]
        for name, tree, path in turn:
            results[name].append(_run(tree, path, exchanges, args.callgrind))
    unit = "instructions" if args.callgrind else "µs CPU"
    scale = 1.0 if args.callgrind else 1e6
    print(
        f"bench/exchange.py: one keep-alive exchange in memory, {exchanges} a run, "
        f"{rounds} round(s); Python {sys.version.split()[0]}; {unit} per exchange (median, range)"
    )
    baseline = statistics.median(results["h11"])
    for name, _, _ in targets:
        values = results[name]
        median = statistics.median(values)
        print(
            f"  {name:22} {median * scale:12.1f}  ({min(values) * scale:.1f}-{max(values) * scale:.1f})"
            f"   vs h11 {median / baseline:5.2f}x"
        )
    if args.compare is not None:
        for path in _MEASURED:
            ours, theirs = statistics.median(results[path]), statistics.median(results[f"{path} (compare)"])
            print(f"  {path}: this checkout / {args.compare} = {ours / theirs:.3f}")


if __name__ == "__main__":
    main()
