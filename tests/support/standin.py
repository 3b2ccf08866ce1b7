"""Loopback stand-ins for the service in tests of its clients: a real broker process, a fake proxy port.

``StandInProxy`` accepts on the configured proxy port, records the first line
of each connection and answers 403: enough to show where a command's traffic
went.  ``startBroker`` runs the real ``agentsandbox broker`` as a subprocess.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Mapping


def freePort() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class StandInProxy:
    """Accepts on 127.0.0.1:port, records each connection's first line, answers 403."""

    def __init__(self, port: int) -> None:
        self.lines: list[str] = []
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            with conn:
                conn.settimeout(5)
                data = b""
                try:
                    while b"\n" not in data and len(data) < 8192:
                        chunk = conn.recv(4096)
                        if not chunk:
                            break
                        data += chunk
                    if data:
                        self.lines.append(data.split(b"\r\n", 1)[0].decode("latin-1"))
                        conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                except OSError:
                    pass

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(5)
        self.sock.close()


def startBroker(env: Mapping[str, str], *args: str) -> subprocess.Popen[str]:
    """The real broker for ``env``'s user, answering once this returns."""
    broker = subprocess.Popen(
        [sys.executable, "-m", "agentsandbox", "broker", *args],
        env=dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert broker.stdout is not None
    line = broker.stdout.readline()
    if not line.startswith("serving"):
        broker.kill()
        broker.wait(10)
        raise AssertionError(f"the broker did not start: {line!r}")
    return broker


def stopBroker(broker: subprocess.Popen[str]) -> None:
    broker.terminate()
    try:
        broker.wait(10)
    except subprocess.TimeoutExpired:
        broker.kill()
        broker.wait(10)
    if broker.stdout is not None:
        broker.stdout.close()
