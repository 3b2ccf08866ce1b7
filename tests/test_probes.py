"""The CLI's shared probes: socket-table rows, listeners, the proxy port, the broker, programs.

Real parts: the kernel's own ``/proc/net/tcp`` with a socket this test listens
on, loopback connections, a spool no broker serves, real programs.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from agentsandbox import probes
from agentsandbox.probes import SocketRow, parseProcAddress
from tests.conftest import REPO

LITTLE = sys.byteorder == "little"
HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"


@pytest.mark.skipif(not LITTLE, reason="the fixtures below are written in little-endian word order")
def test_parseProcAddressWordOrder() -> None:
    assert parseProcAddress("0100007F:1F90") == (ipaddress.ip_address("127.0.0.1"), 8080)
    # ::1 is stored as four host-order words: the last one holds 0x00000001
    assert parseProcAddress("00000000000000000000000001000000:0050") == (ipaddress.ip_address("::1"), 80)
    # 2001:db8::1 -> words 20010db8, 0, 0, 00000001 each stored little-endian
    assert parseProcAddress("B80D0120000000000000000001000000:01BB") == (ipaddress.ip_address("2001:db8::1"), 443)
    # an IPv4-mapped client of a dual-stack listener
    assert parseProcAddress("0000000000000000FFFF00000100007F:1F90")[0] == ipaddress.ip_address("::ffff:127.0.0.1")


def test_an_address_that_is_neither_ipv4_nor_ipv6_is_refused() -> None:
    for text in ("0100:0050", "zz00007F:0050", "0100007F:port"):
        with pytest.raises(ValueError):
            parseProcAddress(text)


@pytest.mark.skipif(not LITTLE, reason="little-endian fixture")
def test_a_row_parses_to_its_ends_state_owner_and_inode() -> None:
    row = SocketRow.parse("   0: 0100007F:0C76 00000000:0000 0A 00000000:00000000 00:00000000 00000000   999        0 1")
    assert row == SocketRow(
        (ipaddress.ip_address("127.0.0.1"), 0x0C76), (ipaddress.ip_address("0.0.0.0"), 0), "0A", 999, 1
    )
    assert row.listening
    assert SocketRow.parse(HEADER) is None
    assert SocketRow.parse("   2: short row") is None
    assert SocketRow.parse("   3: 0100007F:0C76 00000000:0000 0A 0:0 00:0 0 nobody 0 1") is None
    assert SocketRow.parse("   4: 01007F:0C76 00000000:0000 0A 0:0 00:0 0 1000 0 1") is None
    # The inode is the kernel's word for "a process holds this socket": a row without one is not read.
    assert SocketRow.parse("   5: 0100007F:0C76 00000000:0000 0A 0:0 00:0 0 1000 0") is None
    assert SocketRow.parse("   6: 0100007F:0C76 00000000:0000 0A 0:0 00:0 0 1000 0 x") is None


@pytest.mark.skipif(not LITTLE, reason="little-endian fixture")
def test_listeners_come_from_both_tables_and_only_listening_rows(tmp_path: Path) -> None:
    net = tmp_path / "net"
    net.mkdir()
    (net / "tcp").write_text(
        HEADER
        + "   0: 0100007F:0C76 00000000:0000 0A 00000000:00000000 00:00000000 00000000   999        0 1\n"
        + "   1: 0100007F:0C76 0100007F:9999 01 00000000:00000000 00:00000000 00000000  1000        0 2\n"
        + "   2: garbage\n"
    )
    (net / "tcp6").write_text(
        HEADER
        + "   0: 00000000000000000000000001000000:0C76 00000000000000000000000000000000:0000 0A "
        "00000000:00000000 00:00000000 00000000   998        0 3\n"
    )
    assert probes.listenerUids(0x0C76, str(tmp_path)) == {998, 999}
    assert probes.listenerUids(0x9999, str(tmp_path)) == set()
    assert probes.proxyOwner(0x0C76, str(tmp_path), uid=999) == (
        "port 3190 is held by uid 998, 999, not by this user (uid 999)"
    )
    assert probes.listenerUids(0x0C76, str(tmp_path / "nowhere")) == set()


def test_the_kernel_table_shows_our_own_listener() -> None:
    if not os.path.exists("/proc/net/tcp"):
        pytest.skip("no /proc/net/tcp: the socket tables are Linux's")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        assert probes.listenerUids(port) == {os.getuid()}
        assert probes.proxyOwner(port) is None
        assert probes.connectTCP(port) is None
    assert probes.listenerUids(port) == set()
    why = probes.connectTCP(port)
    assert why is not None and "refused" in why.lower()


def test_no_broker_in_a_spool(tmp_path: Path) -> None:
    why = probes.brokerAnswers(str(tmp_path / "spool"), timeout=0.3)
    assert why is not None and str(tmp_path / "spool") in why


def test_the_runner_never_raises_for_a_program(tmp_path: Path) -> None:
    run = probes.systemRunner({"PATH": "/usr/bin:/bin"}, timeout=5)
    assert run(["sh", "-c", "echo out; echo err >&2; exit 3"]).returncode == 3
    missing = run([str(tmp_path / "no-such-program")])
    assert missing.returncode == 127 and "not found" in missing.stderr
    (tmp_path / "plain").write_text("not a program\n")
    assert run([str(tmp_path / "plain")]).returncode == 126
    assert probes.firstLine("\n  \n  first \nsecond") == "first"
    assert probes.firstLine(" \n") == ""


def test_the_probes_import_no_twisted() -> None:
    code = (
        "import sys, agentsandbox.probes\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'twisted'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True, text=True, check=True, timeout=60,
    )
    assert out.stdout == "[]\n"
