"""Benchmark: the terminating path vs mitmproxy vs no proxy at all, driven by wrk.

One run measures, on this machine, with the same client, request and upstream:

- keep-alive requests/s over 8 connections (TLS once, then GET after GET);
- new TLS handshakes/s (TLS, one GET with ``Connection: close``, 8 at a time);

for three targets:

``direct``
    wrk talking TLS to the upstream itself, sending the real header.
``agentsandbox``
    a loopback listener whose every connection goes to
    ``Injector.terminate("api.github.com", [address])``, exactly what the
    egress proxy does once it has answered a CONNECT or SOCKS request for an
    injected host (the tests' harness does the same).  Its TLS, request
    parsing, header injection and verified upstream TLS are the production
    code; only the tunnel set-up before it is skipped.
``agentsandbox+rules``
    the same, with what issue 29 adds on: eight request rules on the host
    (``unmatched = "refuse"``, ``GET /user`` allowed by the last one, so every
    request is matched against all of them) and every response head and body
    searched for the token's forms.  ``agentsandbox`` itself runs with both
    off, so the ratio of the two, measured in the same run, is their cost
    (goal: at least 0.85).
``mitmproxy``
    ``mitmdump`` in reverse-proxy mode to ``https://api.github.com`` (an addon
    points the connection at the local upstream, as our dialer does, and sets
    the same header after removing the client's): the same work, TLS in, parse,
    inject, verified TLS out, also without a CONNECT in front.

Both proxies get the same request, ``GET /user`` with ``Host`` and a fake
``Authorization`` that must be replaced.  The upstream answers 200 only when
the request carries exactly one ``Authorization: token <the bench token>``
and 401 otherwise; wrk counts non-2xx answers, printed as errors, so a proxy
that skipped the injection could not look fast.

Why wrk and not a CONNECT-speaking client: the first version of this bench
drove the proxies from 8 Python processes, which took most of the two CPUs
the proxies needed and so measured the client.  wrk (C, one thread) cannot
send CONNECT, hence the direct hand-off above, used for both proxies alike.
For handshakes, agentsandbox keeps its upstream connections in its pool
across client connections (a design feature), mitmproxy opens one per client
connection.  Our server contexts leave OpenSSL's session tickets on (TLS 1.2
and 1.3 resumption checked with ``openssl s_client -reconnect`` and
``-sess_in``); whether wrk resumes is the same for all three targets.

The upstream is a small stdlib-``ssl`` server (one process, no Twisted) so it
takes as little CPU as possible from the proxies.  Everything is loopback.

    .venv/bin/python bench/inject.py [--seconds 5] [--connections 8]

mitmproxy comes from PyPI into ``.venv-bench``; wrk from apt.  Without either,
what needs it is skipped with the reason printed.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import multiprocessing
import os
import re
import selectors
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
UPSTREAM_ADDRESS = ipaddress.ip_address("192.0.2.10")


# ---------------------------------------------------------------------- upstream


def _upstreamTLS(workdir: str) -> ssl.SSLContext:
    """The bench upstream's certificate for HOST from a throwaway test CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    from agentsandbox.egress.testing import UpstreamPKI

    pki = UpstreamPKI.create("bench upstream CA")
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)  # noqa: UP017 (Debian's Python has it too, this reads plainer)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, HOST)]))
        .issuer_name(pki.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(HOST)]), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(pki.key, hashes.SHA256())
    )
    with open(os.path.join(workdir, "upstream-ca.pem"), "wb") as f:
        f.write(pki.pem)
    # The stdlib loads keys only from files: this throwaway test key lives in
    # the bench's temporary directory, removed at the end.
    pair = os.path.join(workdir, "upstream-pair.pem")
    with open(pair, "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
            + cert.public_bytes(serialization.Encoding.PEM)
        )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pair)
    context.set_alpn_protocols(["http/1.1"])
    return context


def serveUpstream(workdir: str, ready: Any) -> None:
    """A lean keep-alive TLS server: 200 with a small JSON body when the request
    carries exactly the injected header, 401 otherwise."""
    context = _upstreamTLS(workdir)
    ok = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b" % (
        len(RESPONSE_BODY),
        RESPONSE_BODY,
    )
    denied = b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\n\r\n"
    wanted = b"\nauthorization: token " + TOKEN.encode() + b"\r\n"
    selector = selectors.DefaultSelector()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(512)
    listener.setblocking(False)
    selector.register(listener, selectors.EVENT_READ, None)
    ready.put(listener.getsockname()[1])
    buffers: dict[Any, bytes] = {}

    def drop(conn: Any) -> None:
        selector.unregister(conn)
        buffers.pop(conn, None)
        conn.close()

    while True:
        for key, _ in selector.select():
            if key.data is None:
                try:
                    raw, _addr = listener.accept()
                except BlockingIOError:
                    continue
                raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn = context.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
                conn.setblocking(False)
                buffers[conn] = b""
                selector.register(conn, selectors.EVENT_READ, conn)
                continue
            conn = key.data
            try:
                data = conn.recv(65536)
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                continue
            except OSError:
                data = b""
            if not data:
                drop(conn)
                continue
            buf = buffers[conn] + data
            answers = []
            close = False
            while not close:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    break
                head = buf[: end + 2].lower()
                buf = buf[end + 4 :]
                answers.append(ok if wanted in head and head.count(b"\nauthorization:") == 1 else denied)
                close = b"\nconnection: close\r\n" in head
            buffers[conn] = buf
            try:
                if answers:
                    conn.setblocking(True)  # a few hundred bytes: never blocks for long
                    conn.sendall(b"".join(answers))
                    conn.setblocking(False)
            except OSError:
                close = True
            if close:
                drop(conn)


# ---------------------------------------------------------------------- our injector


#: The rules ``agentsandbox+rules`` matches every request against (the last allows it).
BENCH_RULES = (
    ("refuse", "/gists/**", ("POST", "PATCH", "DELETE")),
    ("refuse", "/user/repos", ("POST",)),
    ("refuse", "/repos/*/*/git/refs/**", ("DELETE",)),
    ("allow", "/repos/me/*/**", ()),
    ("refuse", "/orgs/**", ("POST", "PUT", "PATCH", "DELETE")),
    ("refuse", "/user/keys/**", ()),
    ("allow", "/graphql", ("POST",)),
    ("allow", "/user", ("GET",)),
)


def serveOurs(workdir: str, upstreamPort: int, ready: Any, guarded: bool = False) -> None:
    from twisted.internet import reactor
    from twisted.internet.address import IPv4Address
    from twisted.internet.protocol import ServerFactory

    from agentsandbox.config import githubRules
    from agentsandbox.egress.inject import Injector, routesFor
    from agentsandbox.egress.testing import FixedToken, MappedDialer
    from agentsandbox.egress.tls import InjectionCA

    with open(os.path.join(workdir, "upstream-ca.pem"), "rb") as f:
        trust = f.read()
    from agentsandbox.config import RequestRule

    requests = tuple(
        RequestRule(key=f"github.requests[{i}]", action=a, path=p, methods=m) for i, (a, p, m) in enumerate(BENCH_RULES)
    )
    rules = githubRules(requests=requests, unmatched="refuse") if guarded else githubRules()
    ca = InjectionCA.create([h for r in rules for h in r.hosts], label="bench")
    dialer = MappedDialer(reactor)
    dialer.map(UPSTREAM_ADDRESS, upstreamPort)
    holder = FixedToken(TOKEN)
    injector = Injector(
        ca, routesFor(rules, lambda rule: holder, scan=guarded), dialer, reactor, upstreamTrust=trust  # type: ignore[arg-type,unused-ignore]
    )

    class Tunnels(ServerFactory):
        def buildProtocol(self, addr: Any) -> Any:
            return injector.terminate(HOST, [UPSTREAM_ADDRESS])

    port = reactor.listenTCP(0, Tunnels(), interface="127.0.0.1", backlog=512)  # type: ignore[attr-defined,unused-ignore]
    host = port.getHost()
    assert isinstance(host, IPv4Address)
    ready.put(host.port)
    reactor.run()  # type: ignore[attr-defined,unused-ignore]


def inMemory(rounds: int = 5, exchanges: int = 20000) -> tuple[float, float]:
    """CPU µs per keep-alive exchange of the terminated path past its TLS (a
    request in, the same small response out, ``memoryTunnel`` over
    ``StringTransport``s), without and with rules and scanning: the best of
    ``rounds`` alternated rounds, by this process's CPU time, so other load on
    the machine barely moves it."""
    import ipaddress as ip

    from agentsandbox.config import RequestRule, githubRules
    from agentsandbox.egress.inject import Route
    from agentsandbox.egress.testing import FixedToken, MemoryUpstreamPool, memoryTunnel

    class Keeping(MemoryUpstreamPool):
        def release(self, upstream: Any) -> None:
            pass  # one upstream for the tunnel's life, as the injector's pool gives

    requests = tuple(
        RequestRule(key=f"github.requests[{i}]", action=a, path=p, methods=m) for i, (a, p, m) in enumerate(BENCH_RULES)
    )
    request = b"GET /user HTTP/1.1\r\nHost: api.github.com\r\nAuthorization: token x\r\nUser-Agent: wrk\r\n\r\n"
    response = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b" % (
        len(RESPONSE_BODY), RESPONSE_BODY
    )

    def once(guarded: bool) -> float:
        rules = githubRules(requests=requests, unmatched="refuse") if guarded else githubRules()
        pool = Keeping()
        tunnel, client = memoryTunnel(pool, Route(HOST, rules[1], FixedToken(TOKEN), guarded), (ip.ip_address("192.0.2.1"),))
        tunnel.dataReceived(request)
        upstream = pool.upstreams[0]
        sent: Any = upstream.transport
        upstream.dataReceived(response)
        assert client.value().endswith(RESPONSE_BODY)
        start = time.process_time()
        for _ in range(exchanges):
            tunnel.dataReceived(request)
            upstream.dataReceived(response)
            client.clear()
            sent.clear()
        return (time.process_time() - start) / exchanges * 1e6

    plain, guarded = [], []
    for _ in range(rounds):
        plain.append(once(False))
        guarded.append(once(True))
    return min(plain), min(guarded)


# ---------------------------------------------------------------------- mitmproxy

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


def startMitm(workdir: str, upstreamPort: int) -> tuple[subprocess.Popen[bytes], int] | str:
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
            "--mode", f"reverse:https://{HOST}:443",
            "--set", f"confdir={confdir}",
            "--set", f"ssl_verify_upstream_trusted_ca={os.path.join(workdir, 'upstream-ca.pem')}",
            "--set", "http2=false", "--set", "flow_detail=0", "--set", "stream_large_bodies=1m",
            "-s", addon,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return "mitmdump exited: " + (proc.stderr.read().decode(errors="replace")[-300:] if proc.stderr else "")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return proc, port
        except OSError:
            time.sleep(0.2)
    proc.kill()
    return "mitmdump did not start within 30s"


# ---------------------------------------------------------------------- the client


def _cpuSeconds(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wrk(port: int, authorization: str, seconds: float, connections: int, close: bool,
        pid: int | None) -> tuple[float, str, float | None]:
    """(requests/s, problems, proxy CPU µs per request) for one wrk run."""
    argv = [
        "wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s",
        "-H", f"Host: {HOST}", "-H", f"Authorization: {authorization}",
    ]
    if close:
        argv += ["-H", "Connection: close"]
    argv.append(f"https://127.0.0.1:{port}/user")
    before = _cpuSeconds(pid)
    out = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60).stdout
    after = _cpuSeconds(pid)
    rate = re.search(r"Requests/sec:\s+([0-9.]+)", out)
    total = re.search(r"(\d+) requests in", out)
    problems = []
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if non2xx:
        problems.append(f"{non2xx.group(1)} non-2xx answers")
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if errors:
        connect, read, write, timeout = (int(g) for g in errors.groups())
        # In close mode every connection ends in a read of the server's close.
        if connect or write or timeout or (read and not close):
            problems.append(f"socket errors: connect {connect}, read {read}, write {write}, timeout {timeout}")
    if rate is None or total is None:
        return 0.0, "wrk printed no rate: " + out[-200:], None
    cpu = None
    if before is not None and after is not None and int(total.group(1)):
        cpu = (after - before) / int(total.group(1)) * 1e6
    return float(rate.group(1)), "; ".join(problems), cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument(
        "--rounds", type=int, default=3,
        help="keep-alive runs of agentsandbox and agentsandbox+rules, alternated, for their ratio",
    )
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        print("bench/inject.py: skipped: wrk is not installed (apt-get install wrk)")
        return 0
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
        guarded = ctx.Process(target=serveOurs, args=(workdir, upstreamPort, ready, True), daemon=True)
        guarded.start()
        children.append(guarded)
        guardedPort = ready.get(timeout=30)
        fake = "token agent-has-no-token"
        targets: dict[str, tuple[int, str, int | None] | str] = {
            "direct": (upstreamPort, f"token {TOKEN}", upstream.pid),
            "agentsandbox": (oursPort, fake, ours.pid),
            "agentsandbox+rules": (guardedPort, fake, guarded.pid),
        }
        mitm = startMitm(workdir, upstreamPort)
        if isinstance(mitm, str):
            targets["mitmproxy"] = mitm
        else:
            children.append(mitm[0])
            targets["mitmproxy"] = (mitm[1], fake, mitm[0].pid)

        import OpenSSL

        import twisted

        print(
            f"bench/inject.py: wrk, 1 thread, {args.connections} connections, {args.seconds:g}s a phase; "
            f"{os.cpu_count()} CPUs shared by wrk, proxy and upstream; "
            f"Python {sys.version.split()[0]}, Twisted {twisted.__version__}, pyOpenSSL {OpenSSL.__version__}, "
            f"the injector's TLS: {ssl.OPENSSL_VERSION}"
        )
        rates: dict[tuple[str, bool], float] = {}
        for close in (False, True):
            label = "new TLS handshakes/s (TLS + 1 GET + close)" if close else "keep-alive requests/s"
            print(f"\n{label}:")
            for name, target in targets.items():
                if isinstance(target, str):
                    print(f"  {name:18} skipped: {target}")
                    continue
                port, authorization, pid = target
                rate, problems, cpu = wrk(port, authorization, args.seconds, args.connections, close, pid)
                rates[(name, close)] = rate
                where = "upstream" if name == "direct" else "proxy"
                cpuNote = f"  ({where} CPU {cpu:6.0f} µs/request)" if cpu is not None else ""
                print(f"  {name:18} {rate:10.0f}{cpuNote}{'  ERRORS: ' + problems if problems else ''}")
        # The cost of rules and scanning: the two alternated, so that load from
        # elsewhere on a shared machine falls on both alike.
        pairs: list[tuple[float, float]] = []
        plain, withRules = targets["agentsandbox"], targets["agentsandbox+rules"]
        assert not isinstance(plain, str) and not isinstance(withRules, str)
        print(f"\nkeep-alive requests/s, without / with rules and scanning, {args.rounds} rounds alternated:")
        for _ in range(args.rounds):
            without = wrk(plain[0], plain[1], args.seconds, args.connections, False, plain[2])
            with_ = wrk(withRules[0], withRules[1], args.seconds, args.connections, False, withRules[2])
            pairs.append((without[0], with_[0]))
            cpus = f"  (proxy CPU {without[2] or 0:4.0f} / {with_[2] or 0:4.0f} µs/request)"
            problems = "; ".join(p for p in (without[1], with_[1]) if p)
            print(f"  {without[0]:10.0f} / {with_[0]:10.0f}  = {with_[0] / max(without[0], 1):5.2f}{cpus}"
                  f"{'  ERRORS: ' + problems if problems else ''}")
        plainCPU, guardedCPU = inMemory()
        print(
            f"\nin memory, past TLS (no sockets), CPU per keep-alive exchange: without {plainCPU:.1f} µs, "
            f"with rules and scanning {guardedCPU:.1f} µs (+{guardedCPU - plainCPU:.1f} µs)"
        )
        print("\nratios:")
        if pairs:
            total = sum(w for _, w in pairs) / max(sum(p for p, _ in pairs), 1)
            print(f"  keep-alive, {args.rounds} rounds: +rules+scanning / without = {total:6.2f}  (goal >= 0.85)")
        for close, label in ((False, "keep-alive"), (True, "handshakes")):
            ours_ = rates.get(("agentsandbox", close))
            if not ours_:
                continue
            guardedRate = rates.get(("agentsandbox+rules", close))
            if guardedRate:
                print(f"  {label}, one run: +rules+scanning / without = {guardedRate / ours_:6.2f}")
            direct = rates.get(("direct", close))
            if direct:
                print(f"  {label}: agentsandbox / direct    = {ours_ / direct:6.2f}")
            mitmRate = rates.get(("mitmproxy", close))
            if mitmRate:
                goal = "  (goal >= 20x)" if not close else ""
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
