"""``agentsandbox serve``: the whole service in the foreground, with readable logs.

``agentsandbox serve --demo`` runs it on the embedded default config in a
throwaway state and runtime dir, on a free loopback port, next to a tiny local
web server that the demo's allow list names; it then shows an allowed and a
refused request through the proxy and a broker ping, and serves until Ctrl-C.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from agentsandbox import cli
from agentsandbox.config import Config, parse
from agentsandbox.loader import checkLayout
from agentsandbox.paths import DISPATCH_SOCKET_ENV, Paths


def _freePort() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class _Hello(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"hello from the demo's allowed host\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _demoConfig(base: str) -> tuple[Config, dict[str, str], ThreadingHTTPServer]:
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    env = dict(os.environ)
    env.pop(DISPATCH_SOCKET_ENV, None)
    env.update(
        XDG_STATE_HOME=os.path.join(base, "state"),
        XDG_RUNTIME_DIR=os.path.join(base, "run"),
        XDG_CONFIG_HOME=os.path.join(base, "config"),
    )
    os.makedirs(env["XDG_RUNTIME_DIR"], mode=0o700)
    data = {
        "sandbox": {"domains": [f"127.0.0.1:{upstream.server_address[1]}", "github.com", "*.github.com"]},
        # The demo binds its own free port, whatever dispatcher this machine runs.
        "proxy": {"port": _freePort(), "dispatch_socket": ""},
        "inject": [],
    }
    config = checkLayout(parse(data, "<demo: the built-in defaults, on a free port>", Paths.fromEnvironment(env)))
    return config, env, upstream


def _proxyRequest(port: int, request: bytes) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        chunks = []
        while True:
            data = s.recv(65536)
            if not data:
                break
            chunks.append(data)
            if b"\r\n\r\n" in b"".join(chunks) and request.startswith(b"CONNECT"):
                break
    return b"".join(chunks).decode("latin-1")


def _showDemo(config: Config, upstreamPort: int, reactor: Any) -> None:
    from agentsandbox.broker.client import ask

    port = config.proxy.port
    lines = ["", "== agentsandbox demo: the service answers", f"proxy on 127.0.0.1:{port}, spool {config.broker.spool}"]
    allowed = _proxyRequest(
        port, f"GET http://127.0.0.1:{upstreamPort}/ HTTP/1.1\r\nHost: 127.0.0.1:{upstreamPort}\r\nConnection: close\r\n\r\n".encode()
    )
    lines.append(f"allowed  GET http://127.0.0.1:{upstreamPort}/ -> {allowed.splitlines()[0]} | {allowed.rsplit(chr(10), 2)[-2].strip()}")
    refused = _proxyRequest(port, b"CONNECT example.org:443 HTTP/1.1\r\nHost: example.org:443\r\n\r\n")
    body = refused.split("\r\n\r\n", 1)[-1].strip()
    lines.append(f"refused  CONNECT example.org:443 -> {refused.splitlines()[0]} | {body}")
    try:
        ask("ping", config.broker.spool, timeout=5)
        lines.append("broker   ping -> answered")
    except Exception as e:
        lines.append(f"broker   ping -> {e}")
    lines += ["serving until Ctrl-C; the audit log is " + config.audit.file, ""]
    reactor.callFromThread(print, "\n".join(lines), flush=True)


def main(argv: list[str]) -> int:
    parser = cli.parser("serve", __doc__.splitlines()[0])
    parser.add_argument("--demo", action="store_true", help="run on the built-in defaults in a throwaway state dir and show it working")
    args = parser.parse_args(argv)

    base = tempfile.mkdtemp(prefix="agentsandbox-demo-") if args.demo else None
    upstream = None
    try:
        env: dict[str, str] | None = None
        if base is not None:
            config, env, upstream = _demoConfig(base)
            configPath = None
        else:
            config = cli.loadConfig("serve", args.config)
            # The explicit --config, or None for the usual lookup, which each reload runs again.
            configPath = args.config
        return _run(config, configPath, env, upstream)
    finally:
        if upstream is not None:
            upstream.shutdown()
        if base is not None:
            shutil.rmtree(base, ignore_errors=True)


def _run(config: Config, configPath: str | None, env: dict[str, str] | None, upstream: ThreadingHTTPServer | None) -> int:
    from twisted.internet import reactor as installed
    from twisted.logger import globalLogBeginner, textFileLogObserver
    from twisted.python.failure import Failure

    from agentsandbox.service import freezeStartupHeap, makeService

    reactor: Any = installed
    globalLogBeginner.beginLoggingTo([textFileLogObserver(sys.stdout, timeFormat="%H:%M:%S")], redirectStandardIO=False)
    # The demo's config lives only in memory: a reload would swap it for the files'.
    service = makeService(config, reactor, configPath=configPath, environ=env, watchConfig=upstream is None)
    failed: list[str] = []

    def notListening(f: Failure) -> None:
        failed.append(f.getErrorMessage())
        reactor.stop()

    def showDemo(_: object) -> None:
        if upstream is not None:
            reactor.callInThread(_showDemo, config, upstream.server_address[1], reactor)

    def start() -> None:
        try:
            service.startService()
        except Exception as e:
            failed.append(str(e))
            reactor.stop()
            return
        d = service.listening
        if d is not None:
            d.addCallbacks(showDemo, notListening)

    def stop() -> object:
        return service.stopService() if service.running else None

    reactor.callWhenRunning(start)
    reactor.callWhenRunning(freezeStartupHeap)
    reactor.addSystemEventTrigger("before", "shutdown", stop)
    reactor.run()
    if failed:
        print(f"agentsandbox: the service did not start: {failed[0]}", file=sys.stderr)
        return 1
    return 0
