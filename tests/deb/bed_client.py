"""A proxy client that runs inside the systemd bed as a user (stdlib only, Debian's python3).

    bed_client.py get URL [PROXY_HOST]      one GET through the proxy on PROXY_HOST:3190;
                                            prints the status line, or what went wrong
    bed_client.py traffic URL STOPFILE      opens a CONNECT tunnel to URL's host, then GETs URL
                                            through new connections every 50 ms until STOPFILE
                                            exists; prints JSON: outcome -> count, and what a
                                            GET through the tunnel opened first answered
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections import Counter

PORT = 3190


def _readHead(sock: socket.socket, end: bytes = b"\r\n") -> str:
    data = b""
    while end not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    if not data:
        return "closed"
    return data.split(b"\r\n", 1)[0].decode("latin-1")


def get(url: str, proxyHost: str = "127.0.0.1", timeout: float = 30.0) -> str:
    host = url.split("/")[2]
    try:
        with socket.create_connection((proxyHost, PORT), timeout=timeout) as sock:
            sock.sendall(f"GET {url} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            return _readHead(sock)
    except ConnectionRefusedError:
        return "refused"
    except ConnectionResetError:
        return "reset"
    except TimeoutError:
        return "timeout"
    except OSError as e:
        return f"error {e}"


def traffic(url: str, stop: str, limit: float = 300.0) -> dict[str, object]:
    host = url.split("/")[2]
    tunnel = socket.create_connection(("127.0.0.1", PORT), timeout=30)
    tunnel.sendall(f"CONNECT {host} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    # The whole CONNECT answer (the proxy sends nothing after it until the origin does).
    opened = _readHead(tunnel, b"\r\n\r\n")
    outcomes: Counter[str] = Counter()
    end = time.monotonic() + limit
    while not os.path.exists(stop) and time.monotonic() < end:
        status = get(url)
        outcomes[" ".join(status.split()[:2]) if status.startswith("HTTP/") else status] += 1
        time.sleep(0.05)
    path = "/" + url.split("/", 3)[3] if url.count("/") >= 3 else "/"
    try:
        tunnel.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        through = _readHead(tunnel)
    except OSError as e:
        through = f"error {e}"
    return {"outcomes": dict(outcomes), "tunnelOpened": opened, "throughTunnel": through}


def main(argv: list[str]) -> int:
    if argv[:1] == ["get"]:
        print(get(argv[1], argv[2] if len(argv) > 2 else "127.0.0.1"))
        return 0
    if argv[:1] == ["traffic"]:
        print(json.dumps(traffic(argv[1], argv[2])))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
