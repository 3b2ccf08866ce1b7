"""The real system resolver against a DNS server the test controls, with a search list.

``resolveInNamespace`` runs this file as a script inside a fresh network and
mount namespace (``unshare --net --mount``, root only): loopback is brought
up, ``/etc/resolv.conf`` is bind-mounted to one naming ``nameserver 127.0.0.1``
and ``search corp.test``, and a stdlib UDP DNS server on 127.0.0.1:53 answers
A queries from a table (NXDOMAIN for every other name).  Then glibc's
``getaddrinfo`` does what it does on a machine whose resolver has a search
domain: nothing here is a stand-in for the resolver itself.  The script prints
one JSON object: for each name, what ``socket.getaddrinfo`` gives for the bare
name and what the proxy's ``addressesFromGetaddrinfo`` gives, and every name
the server was asked.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from typing import Any

SEARCH = "corp.test"


def resolveInNamespace(table: Mapping[str, str], names: Sequence[str]) -> dict[str, Any]:
    """Run the script in a new namespace; ``table`` maps absolute names (no dot) to IPv4."""
    unshare = shutil.which("unshare")
    ip = shutil.which("ip")
    if os.geteuid() != 0 or unshare is None or ip is None:
        raise RuntimeError("needs root, unshare and ip (a private network namespace)")
    work = tempfile.mkdtemp(prefix="dns-ns-")
    try:
        resolv = os.path.join(work, "resolv.conf")
        with open(resolv, "w") as f:
            f.write(f"nameserver 127.0.0.1\nsearch {SEARCH}\noptions timeout:1 attempts:1\n")
        here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        script = (
            f"{ip} link set lo up && mount --bind {resolv} /etc/resolv.conf && "
            f'exec "$0" -m tests.support.dns_namespace "$1"'
        )
        payload = json.dumps({"table": dict(table), "names": list(names)})
        done = subprocess.run(
            [unshare, "--net", "--mount", "sh", "-c", script, sys.executable, payload],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=here,
            env={**os.environ, "PYTHONPATH": here},
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"the namespace run failed ({done.returncode}): {done.stderr}")
        result: dict[str, Any] = json.loads(done.stdout)
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


# --------------------------------------------------------------------------- inside the namespace


def _name(packet: bytes, offset: int) -> tuple[str, int]:
    labels: list[str] = []
    while True:
        n = packet[offset]
        offset += 1
        if n == 0:
            return ".".join(labels), offset
        labels.append(packet[offset : offset + n].decode("ascii", "replace"))
        offset += n


def _answer(query: bytes, table: Mapping[str, str], asked: list[str]) -> bytes:
    ident, _flags, _count = struct.unpack("!HHH", query[:6])
    name, end = _name(query, 12)
    qtype = struct.unpack("!H", query[end : end + 2])[0]
    question = query[12 : end + 4]
    asked.append(name)
    address = table.get(name.lower())
    if address is None:
        return struct.pack("!HHHHHH", ident, 0x8183, 1, 0, 0, 0) + question  # NXDOMAIN
    if qtype != 1:
        return struct.pack("!HHHHHH", ident, 0x8180, 1, 0, 0, 0) + question  # no AAAA
    record = b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 60, 4) + socket.inet_aton(address)
    return struct.pack("!HHHHHH", ident, 0x8180, 1, 1, 0, 0) + question + record


def _serve(sock: socket.socket, table: Mapping[str, str], asked: list[str]) -> None:
    while True:
        query, peer = sock.recvfrom(4096)
        try:
            sock.sendto(_answer(query, table, asked), peer)
        except (IndexError, struct.error):
            continue


def _main(payload: str) -> None:
    from agentsandbox.egress.resolve import ResolveError, addressesFromGetaddrinfo

    spec = json.loads(payload)
    table = {k.lower(): v for k, v in spec["table"].items()}
    asked: list[str] = []
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 53))
    threading.Thread(target=_serve, args=(sock, table, asked), daemon=True).start()
    out: dict[str, Any] = {}
    for name in spec["names"]:
        try:
            libc = sorted({i[4][0] for i in socket.getaddrinfo(name, 443, 0, socket.SOCK_STREAM)})
        except OSError as e:
            libc = [f"error: {e}"]
        try:
            proxy = [str(a) for a in addressesFromGetaddrinfo(name, 443)]
        except ResolveError as e:
            proxy = [f"error: {e}"]
        out[name] = {"libc": libc, "proxy": proxy}
    print(json.dumps({"results": out, "asked": asked}))


if __name__ == "__main__":
    _main(sys.argv[1])
