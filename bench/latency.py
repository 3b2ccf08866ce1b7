"""Latency a person feels through the proxy: small exchanges and new connections (issue 25).

    .venv/bin/python bench/latency.py [--exchanges 1000] [--connections 300] [--compare CHECKOUT]

One run measures, on loopback, with the client and every backend setting
``TCP_NODELAY`` (so whatever stalls is the proxy's):

* **kept exchanges**: on one connection, ``--exchanges`` times, the client
  writes a 100-byte request head and a 100-byte body in two writes and the
  backend answers a 100-byte head and a 900-byte body in two writes; the time
  from the first write to the last byte read.  p50, p99 and how many took
  more than 10 ms (a Nagle stall meeting a delayed ACK costs ~40 ms).
* **new connections**, one at a time, ``--connections`` times: connect, the
  proxy's handshake (CONNECT and its 200, the SOCKS5 greeting and reply, a TLS
  handshake), one such exchange, close.  p50 and p99.

for each path:

* ``connect``: an opaque CONNECT tunnel;
* ``socks5``: a SOCKS5 tunnel (squid has none: its CONNECT figures are the anchor);
* ``forward``: a plain ``http://`` request forwarded (absolute form);
* ``terminated``: TLS terminated and the credential injected, keep-alive
  exchanges and new connections with their handshake, as ``bench/inject.py``
  runs it: the connection handed straight to ``Injector.terminate`` (no
  CONNECT), and mitmproxy in reverse-proxy mode doing the same work;

against ``direct`` (no proxy) and the anchors the other benchmarks use:
squid (started as ``bench/egress.py`` starts it) for tunnels and forwarding,
mitmproxy (started as ``bench/inject.py`` starts it: ``mitmdump`` from
``.venv-bench`` or ``PATH``; without it its rows say why) for the terminated path.
agentsandbox runs ``bench/egress.py``'s proxy (real policy path: allow list,
address rules, same-user peer check, audit log) and ``bench/inject.py``'s
injector.  With ``--compare CHECKOUT``, that checkout's proxy and injector run
in the same rounds (``agentsandbox@NAME`` rows): before and after in one run.

Contenders are interleaved exchange by exchange (one exchange on each, then
the next, starting from the next contender each round), so load from elsewhere
on the machine hits all of them alike.
Every server is its own process; all share this machine's CPUs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import ssl
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import egress  # noqa: E402  (bench/egress.py: squid, the proxy, ports, stopAll)
import inject  # noqa: E402  (bench/inject.py: the terminated path's origin certificate, mitmproxy)

HEAD = 100
BODY = 100
ANSWER_HEAD = 100
ANSWER_BODY = 900
SLOW = 0.010
TERMINATED_HOST = "api.github.com"  # the host bench/inject.py's injector and mitmproxy serve
TOKEN_HEADER = b"\nauthorization: token "


# --------------------------------------------------------------------------- backends (child processes)


def padHead(first: bytes, fields: bytes, size: int) -> bytes:
    """``first`` + ``fields`` + a padding field: ``size`` bytes with the blank line
    (a few more when the fields alone pass it: a ``connection: close`` head)."""
    head = first + fields
    pad = size - len(head) - len(b"x-pad: \r\n\r\n")
    if pad < 0:
        return head + b"\r\n"
    return head + b"x-pad: " + b"p" * pad + b"\r\n\r\n"


ANSWER = padHead(b"HTTP/1.1 200 OK\r\n", b"content-length: %d\r\n" % ANSWER_BODY, ANSWER_HEAD)
DENIED = b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 0\r\n\r\n"
ANSWER_BYTES = b"b" * ANSWER_BODY


def answerRequests(conn: socket.socket | ssl.SSLSocket, checkToken: bool) -> None:
    """Read requests (head, counted body) and answer each in two writes: head, then body."""
    buf = b""
    with conn:
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buf += chunk
                head, _, buf = buf.partition(b"\r\n\r\n")
                lower = head.lower() + b"\r\n"
                length = 0
                at = lower.find(b"\ncontent-length:")
                if at >= 0:
                    length = int(lower[at + 16 : lower.index(b"\r\n", at)])
                while len(buf) < length:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buf += chunk
                buf = buf[length:]
                if checkToken and lower.count(TOKEN_HEADER) != 1:
                    conn.sendall(DENIED)
                else:
                    conn.sendall(ANSWER)
                    conn.sendall(ANSWER_BYTES)
                if b"\nconnection: close\r\n" in lower:
                    return
        except OSError:
            pass


def serveBackend(port: int) -> None:
    """The plain backend: a thread per connection (a tunnel's end, or an http:// origin)."""
    listener = socket.create_server(("127.0.0.1", port), backlog=1024)
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=answerRequests, args=(conn, False), daemon=True).start()


def serveTLSBackend(port: int, workdir: str) -> None:
    """The terminated path's origin: bench/inject.py's certificate for its host (and
    its CA in ``workdir``, which the injector and mitmproxy trust); it answers 401
    unless the request carries exactly one injected ``Authorization: token``."""
    context = inject._upstreamTLS(workdir)
    listener = socket.create_server(("127.0.0.1", port), backlog=1024)

    def serve(raw: socket.socket) -> None:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            conn = context.wrap_socket(raw, server_side=True)
        except OSError:
            raw.close()
            return
        answerRequests(conn, True)

    while True:
        raw, _ = listener.accept()
        threading.Thread(target=serve, args=(raw,), daemon=True).start()


#: A child that runs a checkout's bench/inject.py injector and prints its port.
TERMINATOR = """
import sys
sys.path.insert(0, sys.argv[1] + "/bench")
import inject
class Ready:
    def put(self, port):
        print(port, flush=True)
inject.serveOurs(sys.argv[2], int(sys.argv[3]), Ready())
"""


# --------------------------------------------------------------------------- the client


@dataclass
class Contender:
    name: str
    #: Opens a connection ready for exchanges (the proxy's handshake done).
    open: Callable[[], socket.socket | ssl.SSLSocket]
    #: The request head (absolute-form for the forward path).
    target: bytes
    #: The same request saying ``connection: close`` (a new connection's one exchange).
    closeTarget: bytes
    kept: list[float] = field(default_factory=list)
    new: list[float] = field(default_factory=list)
    error: str | None = None


def readExactly(sock: socket.socket | ssl.SSLSocket, n: int, buf: bytes) -> bytes:
    while len(buf) < n:
        chunk = sock.recv(65536)
        if not chunk:
            raise OSError(f"closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def exchange(sock: socket.socket | ssl.SSLSocket, head: bytes, body: bytes) -> float:
    """One request in two writes, its answer read whole: seconds taken."""
    start = time.perf_counter()
    sock.sendall(head)
    sock.sendall(body)
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise OSError(f"closed before the answer's head: {buf[:200]!r}")
        buf += chunk
    answer, _, rest = buf.partition(b"\r\n\r\n")
    if not answer.startswith(b"HTTP/1.1 200"):
        raise OSError(f"answered {answer[:200]!r}")
    lower = answer.lower() + b"\r\n"
    at = lower.find(b"\ncontent-length:")
    length = int(lower[at + 16 : lower.index(b"\r\n", at)]) if at >= 0 else 0
    readExactly(sock, length, rest)
    return time.perf_counter() - start


def request(target: bytes, host: bytes, close: bool = False, token: bytes = b"") -> tuple[bytes, bytes]:
    fields = b"host: %b\r\ncontent-length: %d\r\n" % (host, BODY)
    if token:  # (direct to the terminated path's origin: what the proxies inject)
        fields += b"authorization: token %b\r\n" % token
    if close:
        fields += b"connection: close\r\n"
    return padHead(b"POST %b HTTP/1.1\r\n" % target, fields, HEAD), b"q" * BODY


def tcp(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def viaConnect(proxy: int, target: int) -> socket.socket:
    sock = tcp(proxy)
    sock.sendall(b"CONNECT 127.0.0.1:%d HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n" % (target, target))
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(4096)
        if not chunk:
            raise OSError(f"the proxy closed during CONNECT: {buf!r}")
        buf += chunk
    if not buf.startswith(b"HTTP/1.1 200") and not buf.startswith(b"HTTP/1.0 200"):
        raise OSError(f"CONNECT refused: {buf[:200]!r}")
    return sock


def viaSocks(proxy: int, target: int) -> socket.socket:
    sock = tcp(proxy)
    sock.sendall(b"\x05\x01\x00")
    if readExactly(sock, 2, b"") != b"\x05\x00":
        raise OSError("SOCKS5 greeting refused")
    sock.sendall(b"\x05\x01\x00\x01" + socket.inet_aton("127.0.0.1") + struct.pack("!H", target))
    got = readExactly(sock, 10, b"")
    if got[1] != 0:
        raise OSError(f"SOCKS5 reply {got[1]}")
    return sock


def tlsClient() -> ssl.SSLContext:
    # Every contender's certificate is a throwaway one (the injector's CA, mitmproxy's,
    # the bench origin's): not verified by the client, the same work for each.
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["http/1.1"])
    return context


def viaTLS(port: int) -> ssl.SSLSocket:
    return tlsClient().wrap_socket(tcp(port), server_hostname=TERMINATED_HOST)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def rotated(contenders: list[Contender], i: int) -> list[Contender]:
    """The contenders in turn, starting from a different one each round: one that
    runs right after a busy one (mitmproxy still finishing its last connection)
    would otherwise always share the CPUs with that one's tail."""
    k = i % len(contenders) if contenders else 0
    return contenders[k:] + contenders[:k]


def measure(contenders: list[Contender], exchanges: int, connections: int) -> None:
    """Kept exchanges, then new connections, interleaved across the contenders."""
    live = [c for c in contenders if c.error is None]
    socks: dict[str, socket.socket | ssl.SSLSocket] = {}
    for c in live:
        try:
            socks[c.name] = c.open()
            head, body = c.target, b"q" * BODY
            for _ in range(20):  # warm up: caches, the injector's pool, the first handshake
                exchange(socks[c.name], head, body)
        except OSError as e:
            c.error = f"{e}"
    live = [c for c in live if c.error is None]
    for i in range(exchanges):
        for c in rotated(live, i):
            if c.error is not None:
                continue
            try:
                c.kept.append(exchange(socks[c.name], c.target, b"q" * BODY))
            except OSError as e:
                c.error = f"kept exchange: {e}"
    for s in socks.values():
        s.close()
    for i in range(connections):
        for c in rotated(live, i):
            if c.error is not None:
                continue
            try:
                start = time.perf_counter()
                with c.open() as sock:
                    exchange(sock, c.closeTarget, b"q" * BODY)
                c.new.append(time.perf_counter() - start)
            except OSError as e:
                c.error = f"new connection: {e}"


# --------------------------------------------------------------------------- orchestration


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:7.2f}"


def report(path: str, contenders: list[Contender], anchor: str) -> None:
    print(f"\n{path}  (ratios against {anchor})")
    print(
        f"  {'':26s} {'kept p50':>9s} {'kept p99':>9s} {'> 10 ms':>9s} {'new p50':>9s} {'new p99':>9s}"
        f"   {'p99 x':>6s} {'new p50 x':>9s} {'new p99 x':>9s}"
    )
    base = next((c for c in contenders if c.name == anchor and c.kept and c.new), None)
    for c in contenders:
        if c.error is not None and not c.kept:
            print(f"  {c.name:26s} skipped: {c.error}")
            continue
        k50, k99 = statistics.median(c.kept), percentile(c.kept, 0.99)
        slow = sum(1 for x in c.kept if x > SLOW)
        line = f"  {c.name:26s} {ms(k50):>9s} {ms(k99):>9s} {f'{slow}/{len(c.kept)}':>9s}"
        if c.new:
            n50, n99 = statistics.median(c.new), percentile(c.new, 0.99)
            line += f" {ms(n50):>9s} {ms(n99):>9s}"
            if base is not None:
                b99, b50n, b99n = percentile(base.kept, 0.99), statistics.median(base.new), percentile(base.new, 0.99)
                line += f"   {k99 / b99:5.2f}x {n50 / b50n:8.2f}x {n99 / b99n:8.2f}x"
        if c.error is not None:
            line += f"  (stopped: {c.error})"
        print(line)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "--serve":
        if args[1] == "backend":
            serveBackend(int(args[2]))
        elif args[1] == "tls-backend":
            serveTLSBackend(int(args[2]), args[3])
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--exchanges", type=int, default=1000, help="kept exchanges on one connection, per contender")
    p.add_argument("--connections", type=int, default=300, help="new connections, one at a time, per contender")
    p.add_argument("--compare", metavar="CHECKOUT", help="another checkout whose proxy and injector run too")
    p.add_argument("--paths", default="connect,socks5,forward,terminated")
    opts = p.parse_args(args)
    paths = opts.paths.split(",")
    work = tempfile.mkdtemp(prefix="latency-bench-")
    os.chmod(work, 0o755)
    env = dict(os.environ, PYTHONPATH=REPO)
    me = os.path.abspath(__file__)
    backend, tlsBackend = egress.freePort(), egress.freePort()
    procs: dict[str, subprocess.Popen[bytes]] = {
        "backend": subprocess.Popen([sys.executable, me, "--serve", "backend", str(backend)], env=env),
        "tls-backend": subprocess.Popen([sys.executable, me, "--serve", "tls-backend", str(tlsBackend), work], env=env),
    }
    trees = {"agentsandbox": REPO}
    if opts.compare:
        trees[f"agentsandbox@{os.path.basename(os.path.abspath(opts.compare))}"] = os.path.abspath(opts.compare)
    proxies: dict[str, int] = {}
    terminators: dict[str, int] = {}
    try:
        squidDir = os.path.join(work, "squid")
        os.makedirs(squidDir)
        squidPort = egress.freePort()
        squid = egress.startSquid(squidDir, squidPort)
        if squid is not None:
            procs["squid"] = squid
            proxies["squid"] = squidPort
        egress.waitPort(backend)
        egress.waitPort(tlsBackend)  # (its certificate, and so the CA file, exist once it listens)
        for name, tree in trees.items():
            port = egress.freePort()
            state = os.path.join(work, name.replace("@", "-"))
            os.makedirs(state)
            procs[name] = subprocess.Popen(
                [sys.executable, os.path.join(tree, "bench", "egress.py"), "--serve", "agentsandbox",
                 str(port), str(backend), str(backend), str(backend), state],
                env=dict(os.environ, PYTHONPATH=tree), cwd=tree,
            )  # fmt: skip
            proxies[name] = port
            if "terminated" in paths:
                child = subprocess.Popen(
                    [sys.executable, "-c", TERMINATOR, tree, work, str(tlsBackend)],
                    env=dict(os.environ, PYTHONPATH=tree), cwd=tree, stdout=subprocess.PIPE,
                )  # fmt: skip
                procs[name + " injector"] = child
                assert child.stdout is not None
                terminators[name] = int(child.stdout.readline())
        mitm: str | int = "not asked for"
        if "terminated" in paths:
            started = inject.startMitm(work, tlsBackend)
            if isinstance(started, str):
                mitm = started
            else:
                procs["mitmproxy"] = started[0]
                mitm = started[1]
        for port in proxies.values():
            egress.waitPort(port)

        host = b"127.0.0.1:%d" % backend
        plain, _ = request(b"/", host)
        plainClose, _ = request(b"/", host, close=True)
        forward, _ = request(b"http://%b/" % host, host)
        forwardClose, _ = request(b"http://%b/" % host, host, close=True)
        tlsHost = TERMINATED_HOST.encode()
        tlsHead, _ = request(b"/user", tlsHost)
        tlsClose, _ = request(b"/user", tlsHost, close=True)
        token = inject.TOKEN.encode()
        directHead, _ = request(b"/user", tlsHost, token=token)
        directClose, _ = request(b"/user", tlsHost, close=True, token=token)

        def contender(name: str, opener: Callable[[], socket.socket | ssl.SSLSocket], head: bytes, closing: bytes) -> Contender:
            return Contender(name, opener, head, closing)

        tunnelled = [name for name in proxies]
        results: dict[str, list[Contender]] = {}
        if "connect" in paths:
            cs = [contender("direct", lambda: tcp(backend), plain, plainClose)]
            cs += [contender(n, partial(viaConnect, proxies[n], backend), plain, plainClose) for n in tunnelled]
            results["opaque CONNECT tunnel"] = cs
        if "socks5" in paths:
            cs = [contender("direct", lambda: tcp(backend), plain, plainClose)]
            if "squid" in proxies:
                cs.append(contender("squid (CONNECT)", lambda: viaConnect(proxies["squid"], backend), plain, plainClose))
            cs += [contender(n, partial(viaSocks, proxies[n], backend), plain, plainClose) for n in tunnelled if n != "squid"]
            results["SOCKS5 tunnel"] = cs
        if "forward" in paths:
            cs = [contender("direct", lambda: tcp(backend), plain, plainClose)]
            cs += [contender(n, partial(tcp, proxies[n]), forward, forwardClose) for n in tunnelled]
            results["plain http:// forward"] = cs
        if "terminated" in paths:
            cs = [contender("direct", lambda: viaTLS(tlsBackend), directHead, directClose)]
            if isinstance(mitm, int):
                cs.append(contender("mitmproxy", partial(viaTLS, mitm), tlsHead, tlsClose))
            else:
                skipped = contender("mitmproxy", lambda: viaTLS(0), tlsHead, tlsClose)
                skipped.error = mitm
                cs.append(skipped)
            cs += [contender(n, partial(viaTLS, terminators[n]), tlsHead, tlsClose) for n in terminators]
            results["terminated TLS (keep-alive exchange; new = TLS handshake + exchange)"] = cs

        import twisted

        print(
            f"bench/latency.py: {opts.exchanges} kept exchanges on one connection and {opts.connections} new "
            f"connections per contender, interleaved; {os.cpu_count()} CPUs shared by client, proxies and "
            f"backends; Python {sys.version.split()[0]}, Twisted {twisted.__version__}",
            flush=True,
        )
        for path, cs in results.items():
            measure(cs, opts.exchanges, opts.connections)
            anchor = "mitmproxy" if path.startswith("terminated") else ("squid (CONNECT)" if path.startswith("SOCKS5") else "squid")
            report(path, cs, anchor)
    finally:
        egress.stopAll(procs.values())
        shutil.rmtree(work, ignore_errors=True)
    print(
        "\ngoals (issue 25): connect, socks5, forward: 0 kept exchanges > 10 ms, kept p99 <= 2x squid; "
        "new tunnel p50 <= 1.5x squid, p99 <= 2x squid; terminated new connection p50 <= mitmproxy's"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
