"""Where a new tunnel's time goes, from accept to the first byte spliced (issue 25).

    .venv/bin/python bench/tunnelphases.py [--tunnels 1000] [--repo CHECKOUT]

Runs the proxy of ``--repo`` (default: this checkout) in this process with its
real policy path (the same-user peer check through sock_diag, the allow list,
the address rules, the audit log) and the default dialler, and a client in
another process opening tunnels one at a time to bench/latency.py's backend:
CONNECT, one 100+100 / 100+900-byte exchange, close.  Each step of the proxy's
path is timed with ``perf_counter`` by wrapping the method that starts or ends
it, and the median and 90th percentile of each step over all tunnels are
printed.  Wall-clock times on a shared machine: a step that wakes another
process (the dial wakes the backend's accept) includes the scheduler's share.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

CLIENT = """
import sys, time
sys.path.insert(0, {here!r})
import latency
head, _ = latency.request(b"/", b"x", close=True)
for _ in range({n}):
    with latency.viaConnect({proxy}, {backend}) as s:
        latency.exchange(s, head, b"q" * latency.BODY)
    time.sleep(0.002)
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tunnels", type=int, default=1000)
    p.add_argument("--repo", default=REPO, help="the checkout whose proxy is timed")
    opts = p.parse_args()
    repo = os.path.abspath(opts.repo)
    sys.path.insert(0, repo)
    sys.path.insert(0, HERE)
    import egress  # bench/egress.py: ports
    from twisted.internet import reactor
    from twisted.logger import globalLogBeginner, textFileLogObserver

    from agentsandbox.audit import AuditLog
    from agentsandbox.config import loads
    from agentsandbox.egress import dial, http, peer, proxy, splice
    from agentsandbox.paths import Paths

    devnull = open(os.devnull, "w")  # noqa: SIM115 (lives as long as the process)
    globalLogBeginner.beginLoggingTo([textFileLogObserver(devnull)], redirectStandardIO=False)
    backend = egress.freePort()
    env = dict(os.environ, PYTHONPATH=REPO)
    server = subprocess.Popen([sys.executable, os.path.join(HERE, "latency.py"), "--serve", "backend", str(backend)], env=env)
    egress.waitPort(backend)
    state = tempfile.mkdtemp(prefix="tunnelphases-")
    port = egress.freePort()
    toml = f'inject = []\n[sandbox]\ndomains = ["127.0.0.1:{backend}"]\n[proxy]\nport = {port}\n'
    config = loads(toml.encode(), "<bench>", Paths.fromEnvironment({"HOME": state}))
    factory = proxy.EgressProxyFactory(config, reactor, audit=AuditLog(os.path.join(state, "audit.jsonl")))
    proxy.ProxyService(factory).startService()

    now = time.perf_counter
    current: dict[str, float] = {}
    tunnels: list[dict[str, float]] = []

    def mark(owner: Any, name: str, label: str, after: bool = False) -> None:
        original: Callable[..., Any] = getattr(owner, name)

        def timed(*args: Any, **kw: Any) -> Any:
            if not after:
                current.setdefault(label, now())
            result = original(*args, **kw)
            if after:
                current.setdefault(label, now())
            return result

        setattr(owner, name, timed)

    mark(proxy.EgressProxyFactory, "buildProtocol", "accepted")
    mark(proxy.FrontDoor, "connectionMade", "connectionMade")
    mark(peer.SameUserPeers, "check", "peer check asked")
    mark(peer.SameUserPeers, "check", "peer check answered", after=True)
    mark(proxy.FrontDoor, "dataReceived", "first read of the request")
    mark(proxy.FrontDoor, "openTunnel", "request parsed")
    mark(dial.TCPDialer, "dial", "decided, dial started")
    mark(splice.UpstreamProtocol, "connectionMade", "upstream connected")
    mark(http.HTTPHandler, "_granted", "200 sent", after=True)
    mark(splice.Tunnel, "__init__", "tunnel spliced", after=True)
    mark(splice.Tunnel, "fromClient", "first client byte passed")
    mark(splice.Tunnel, "fromUpstream", "first answer byte passed")
    mark(proxy.EgressProxyFactory, "tunnelClosed", "closed, audit record written", after=True)
    closed = proxy.EgressProxyFactory.tunnelClosed

    def tunnelClosed(self: Any, *args: Any, **kw: Any) -> None:
        closed(self, *args, **kw)
        tunnels.append(dict(current))
        current.clear()

    proxy.EgressProxyFactory.tunnelClosed = tunnelClosed  # type: ignore[method-assign,unused-ignore]
    client = CLIENT.format(here=HERE, n=opts.tunnels, proxy=port, backend=backend)

    def run() -> None:
        driver = subprocess.Popen([sys.executable, "-c", client], env=env)

        def poll() -> None:
            if driver.poll() is None:
                reactor.callLater(0.1, poll)  # type: ignore[attr-defined,unused-ignore]
            else:
                reactor.stop()  # type: ignore[attr-defined,unused-ignore]

        poll()

    reactor.callWhenRunning(run)  # type: ignore[attr-defined,unused-ignore]
    reactor.run()  # type: ignore[attr-defined,unused-ignore]
    server.kill()
    order = sorted({k for t in tunnels for k in t}, key=lambda k: statistics.median(t[k] - t["accepted"] for t in tunnels if k in t))
    print(f"{len(tunnels)} tunnels through {repo}, one at a time; microseconds per step")
    print(f"  {'step':58s} {'median':>8s} {'p90':>8s}")
    for a, b in itertools.pairwise(order):
        gaps = sorted((t[b] - t[a]) * 1e6 for t in tunnels if a in t and b in t)
        print(f"  {a + ' -> ' + b:58s} {statistics.median(gaps):8.1f} {gaps[int(len(gaps) * 0.9)]:8.1f}")
    whole = sorted((t["first answer byte passed"] - t["accepted"]) * 1e6 for t in tunnels)
    print(f"  {'accepted -> first answer byte passed':58s} {statistics.median(whole):8.1f} {whole[int(len(whole) * 0.9)]:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
