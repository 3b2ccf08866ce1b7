"""Benchmark: the terminating path (proxy + injector) vs mitmproxy vs no proxy at all.

One run measures, on this machine, with the same client and the same upstream:

- keep-alive requests/s over 8 connections (CONNECT once, then GET after GET);
- new TLS handshakes/s (CONNECT, TLS, one GET, close; 8 at a time);

for: the client talking to the upstream directly; through agentsandbox's proxy
terminating and injecting; through mitmproxy (``mitmdump``) doing the same header
injection.  It prints each rate and the ratios.  The goal is >= 20x mitmproxy's
keep-alive requests/s.

mitmproxy comes from PyPI into a separate venv (``.venv-bench``); without it
that comparison is skipped with the reason printed.  Only loopback is used: the
upstream is a local TLS server with its own test CA, and both proxies are told
to dial it for api.github.com (ours through its injected resolver and dialer,
mitmproxy through an addon), never DNS.

    .venv/bin/python bench/inject.py [--seconds 5] [--connections 8]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

HOST = "api.github.com"
TOKEN = "ghu_bench" + "x" * 31
RESPONSE_BODY = b'{"login":"octocat"}'
REQUEST = f"GET /user HTTP/1.1\r\nHost: {HOST}\r\nUser-Agent: bench\r\n\r\n".encode()
CLOSE_REQUEST = f"GET /user HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode()


# ---------------------------------------------------------------------- upstream


def serveUpstream(workdir: str, ready: Any) -> None:
    """A lean keep-alive TLS server: a fixed response to every request head."""
    from twisted.internet import reactor
    from twisted.internet.protocol import Factory, Protocol

    from tests.support.inject_github import TestPKI

    pki = TestPKI.create("bench upstream CA")
    with open(os.path.join(workdir, "upstream-ca.pem"), "wb") as f:
        f.write(pki.pem)
    response = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(RESPONSE_BODY)).encode()
        + b"\r\n\r\n"
        + RESPONSE_BODY
    )
    closing = response.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1)

    class Fixed(Protocol):
        buf = b""

        def dataReceived(self, data: bytes) -> None:
            self.buf += data
            while b"\r\n\r\n" in self.buf:
                head, _, self.buf = self.buf.partition(b"\r\n\r\n")
                if b"\nauthorization: " not in head.lower() and b"Connection" not in head:
                    pass
                if b"connection: close" in head.lower():
                    self.transport.write(closing)  # type: ignore[union-attr]
                    self.transport.loseConnection()  # type: ignore[union-attr]
                    return
                self.transport.write(response)  # type: ignore[union-attr]

    port = reactor.listenSSL(  # type: ignore[attr-defined]
        0, Factory.forProtocol(Fixed), pki.serverOptions([HOST]), interface="127.0.0.1", backlog=512
    )
    ready.put(port.getHost().port)
    reactor.run()  # type: ignore[attr-defined]


# ---------------------------------------------------------------------- our proxy


def serveOurs(workdir: str, upstreamPort: int, ready: Any) -> None:
    from twisted.internet import reactor
    from twisted.internet import ssl as tssl

    from agentsandbox.config import githubRules
    from agentsandbox.egress.inject import Injector, routesFor
    from agentsandbox.egress.proxy import EgressProxyFactory
    from agentsandbox.egress.tls import InjectionCA
    from tests.support.egress_fixtures import FixedResolver, makeConfig
    from tests.support.inject_github import LoopbackDialer
    from tests.support.inject_harness import FixedToken

    with open(os.path.join(workdir, "upstream-ca.pem"), "rb") as f:
        trust = tssl.trustRootFromCertificates([tssl.Certificate.loadPEM(f.read())])
    rules = githubRules()
    ca = InjectionCA.create([h for r in rules for h in r.hosts], label="bench")
    with open(os.path.join(workdir, "ours-ca.pem"), "wb") as f:
        f.write(ca.pem)
    dialer = LoopbackDialer(reactor)
    dialer.map(__import__("ipaddress").ip_address("192.0.2.10"), upstreamPort)
    holder = FixedToken(TOKEN)
    injector = Injector(ca, routesFor(rules, lambda rule: holder), dialer, reactor, trustRoot=trust)
    config = makeConfig('[sandbox]\ndomains = ["api.github.com"]\n')
    factory = EgressProxyFactory(
        config, reactor, resolver=FixedResolver({HOST: ["192.0.2.10"]}), terminator=injector
    )
    port = reactor.listenTCP(0, factory, interface="127.0.0.1", backlog=512)  # type: ignore[attr-defined]
    ready.put(port.getHost().port)
    reactor.run()  # type: ignore[attr-defined]


MITM_ADDON = """
from mitmproxy import http

UPSTREAM = ("127.0.0.1", {port})


class Inject:
    def server_connect(self, data):
        data.server.address = UPSTREAM

    def request(self, flow: http.HTTPFlow) -> None:
        flow.request.headers.pop("authorization", None)
        flow.request.headers["Authorization"] = "token {token}"


addons = [Inject()]
"""


def startMitm(workdir: str, upstreamPort: int) -> tuple[subprocess.Popen[bytes], int, str] | str:
    mitmdump = os.path.join(REPO, ".venv-bench", "bin", "mitmdump")
    if not os.access(mitmdump, os.X_OK):
        found = shutil.which("mitmdump")
        if found is None:
            return "mitmproxy is not installed (python3 -m venv .venv-bench && .venv-bench/bin/pip install mitmproxy)"
        mitmdump = found
    addon = os.path.join(workdir, "inject_addon.py")
    with open(addon, "w") as f:
        f.write(MITM_ADDON.format(port=upstreamPort, token=TOKEN))
    confdir = os.path.join(workdir, "mitm")
    os.makedirs(confdir, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            mitmdump, "--quiet", "--listen-host", "127.0.0.1", "--listen-port", str(port),
            "--set", f"confdir={confdir}",
            "--set", f"ssl_verify_upstream_trusted_ca={os.path.join(workdir, 'upstream-ca.pem')}",
            "--set", "http2=false", "--set", "flow_detail=0", "--set", "stream_large_bodies=1m",
            "-s", addon,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    caFile = os.path.join(confdir, "mitmproxy-ca-cert.pem")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return "mitmdump exited: " + (proc.stderr.read().decode(errors="replace")[-300:] if proc.stderr else "")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                if os.path.exists(caFile):
                    return proc, port, caFile
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    return "mitmdump did not start within 30s"


# ---------------------------------------------------------------------- the client


def _readResponse(sock: ssl.SSLSocket, buf: bytearray) -> bytes:
    while True:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            head = bytes(buf[:end])
            low = head.lower()
            i = low.find(b"content-length:")
            length = int(low[i + 15 : low.find(b"\r\n", i) if low.find(b"\r\n", i) >= 0 else None]) if i >= 0 else 0
            total = end + 4 + length
            while len(buf) < total:
                chunk = sock.recv(65536)
                if not chunk:
                    raise ConnectionError("closed mid-response")
                buf += chunk
            response = bytes(buf[:total])
            del buf[:total]
            return response
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed before a response")
        buf += chunk


def _open(target: tuple[str, int, str | None], caFile: str) -> ssl.SSLSocket:
    host, port, mode = target
    raw = socket.create_connection((host, port))
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if mode == "connect":
        raw.sendall(f"CONNECT {HOST}:443 HTTP/1.1\r\nHost: {HOST}:443\r\n\r\n".encode())
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = raw.recv(4096)
            if not chunk:
                raise ConnectionError("proxy closed")
            reply += chunk
        if b" 200" not in reply.split(b"\r\n", 1)[0]:
            raise ConnectionError(reply.split(b"\r\n", 1)[0].decode(errors="replace"))
    ctx = ssl.create_default_context(cafile=caFile)
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx.wrap_socket(raw, server_hostname=HOST)


def _worker(target: Any, caFile: str, seconds: float, keepAlive: bool, out: Any) -> None:
    count = errors = 0
    deadline = time.monotonic() + seconds
    try:
        if keepAlive:
            sock = _open(target, caFile)
            buf = bytearray()
            while time.monotonic() < deadline:
                for _ in range(20):
                    sock.sendall(REQUEST)
                    response = _readResponse(sock, buf)
                    if not response.startswith(b"HTTP/1.1 200"):
                        errors += 1
                    count += 1
            sock.close()
        else:
            while time.monotonic() < deadline:
                sock = _open(target, caFile)
                sock.sendall(CLOSE_REQUEST)
                response = _readResponse(sock, bytearray())
                if not response.startswith(b"HTTP/1.1 200"):
                    errors += 1
                count += 1
                sock.close()
    except Exception as e:
        out.put((count, errors + 1, f"{type(e).__name__}: {e}"))
        return
    out.put((count, errors, ""))


def measure(target: Any, caFile: str, seconds: float, connections: int, keepAlive: bool) -> tuple[float, str]:
    out: Any = multiprocessing.Queue()
    procs = [
        multiprocessing.Process(target=_worker, args=(target, caFile, seconds, keepAlive, out))
        for _ in range(connections)
    ]
    start = time.monotonic()
    for p in procs:
        p.start()
    results = [out.get(timeout=seconds + 60) for _ in procs]
    elapsed = time.monotonic() - start
    for p in procs:
        p.join(timeout=10)
    total = sum(r[0] for r in results)
    problems = sorted({r[2] for r in results if r[2]})
    errors = sum(r[1] for r in results)
    note = f" ({errors} errors: {'; '.join(problems)[:200]})" if errors else ""
    return total / max(elapsed, seconds), note


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--connections", type=int, default=8)
    args = parser.parse_args()
    ctx = multiprocessing.get_context("fork")
    workdir = tempfile.mkdtemp(prefix="bench-inject-")
    ready: Any = ctx.Queue()
    children: list[Any] = []
    try:
        upstream = ctx.Process(target=serveUpstream, args=(workdir, ready), daemon=True)
        upstream.start()
        children.append(upstream)
        upstreamPort = ready.get(timeout=30)
        ours = ctx.Process(target=serveOurs, args=(workdir, upstreamPort, ready), daemon=True)
        ours.start()
        children.append(ours)
        oursPort = ready.get(timeout=30)
        targets: dict[str, tuple[Any, str] | str] = {
            "direct": (("127.0.0.1", upstreamPort, None), os.path.join(workdir, "upstream-ca.pem")),
            "agentsandbox": (("127.0.0.1", oursPort, "connect"), os.path.join(workdir, "ours-ca.pem")),
        }
        mitm = startMitm(workdir, upstreamPort)
        if isinstance(mitm, str):
            targets["mitmproxy"] = mitm
        else:
            children.append(mitm[0])
            targets["mitmproxy"] = (("127.0.0.1", mitm[1], "connect"), mitm[2])

        print(f"bench/inject.py: {args.connections} client processes, {args.seconds:g}s a phase, "
              f"{os.cpu_count()} CPUs shared by client, proxy and upstream")
        rates: dict[tuple[str, bool], float] = {}
        for keepAlive in (True, False):
            label = "keep-alive requests/s" if keepAlive else "new TLS handshakes/s (CONNECT + TLS + 1 GET)"
            print(f"\n{label}:")
            for name, target in targets.items():
                if isinstance(target, str):
                    print(f"  {name:13} skipped: {target}")
                    continue
                rate, note = measure(target[0], target[1], args.seconds, args.connections, keepAlive)
                rates[(name, keepAlive)] = rate
                print(f"  {name:13} {rate:10.0f}{note}")
        print("\nratios:")
        for keepAlive, label in ((True, "keep-alive"), (False, "handshakes")):
            ours_ = rates.get(("agentsandbox", keepAlive))
            if ours_ is None:
                continue
            direct = rates.get(("direct", keepAlive))
            if direct:
                print(f"  {label}: agentsandbox / direct    = {ours_ / direct:6.2f}")
            mitmRate = rates.get(("mitmproxy", keepAlive))
            if mitmRate:
                goal = "  (goal >= 20x)" if keepAlive else ""
                print(f"  {label}: agentsandbox / mitmproxy = {ours_ / mitmRate:6.2f}{goal}")
            else:
                print(f"  {label}: agentsandbox / mitmproxy: no mitmproxy figure (see above)")
    finally:
        for child in children:
            if isinstance(child, subprocess.Popen):
                child.terminate()
                child.wait(timeout=10)
            else:
                child.terminate()
                child.join(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
