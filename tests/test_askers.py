"""``egress/askers.py``: the process a held request's client end belongs to, from ``/proc``.

First the pieces on crafted ``/proc`` trees (the fd links, a name a process set
to paint a terminal), then real sockets of this machine: this process, a child,
a child in a bubblewrap sandbox (its own user and pid namespaces), a socket
shared by more processes than are named, one the peer check's user does not
hold, and the lookup in the reactor's thread pool.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from twisted.internet import reactor as _reactor
from twisted.trial.unittest import TestCase

from agentsandbox.broker.procfs import commandName, socketHolders
from agentsandbox.egress.askers import MAX_NAMED, ProcAskers, holderText
from agentsandbox.egress.peer import socketInode
from tests.support.egress_fixtures import deferredTest

reactor: Any = _reactor

# ---------------------------------------------------------------------- crafted /proc


def _process(proc: Path, pid: int, comm: bytes, links: dict[str, str]) -> None:
    fd = proc / str(pid) / "fd"
    fd.mkdir(parents=True)
    (proc / str(pid) / "comm").write_bytes(comm + b"\n")
    for name, target in links.items():
        os.symlink(target, fd / name)


def test_the_holders_are_the_pids_whose_fd_links_name_the_socket(tmp_path: Path) -> None:
    _process(tmp_path, 30, b"git", {"0": "/dev/null", "5": "socket:[777]"})
    _process(tmp_path, 12, b"curl", {"3": "socket:[777]", "4": "socket:[778]"})
    _process(tmp_path, 40, b"sh", {"3": "socket:[7770]"})
    (tmp_path / "self").mkdir()
    assert socketHolders(str(tmp_path), [777, 778, 779], os.getuid()) == {777: [12, 30], 778: [12], 779: []}
    assert socketHolders(str(tmp_path), [777]) == {777: [12, 30]}
    # Only the asked user's processes are looked at.
    assert socketHolders(str(tmp_path), [777], os.getuid() + 1) == {777: []}


@pytest.mark.parametrize(
    ("comm", "shown"),
    [
        (b"curl", "curl"),
        (b"git-remote-http", "git-remote-http"),
        (b"Web Content", "Web Content"),
        (b"\x1b[2Jowned", "??2Jowned"),
        (b"<b>x</b>&amp;", "?b?x?/b??amp?"),
        (b"\xff\xfe", "??"),
        (b"", "?"),
    ],
)
def test_a_process_name_shows_only_plain_characters(tmp_path: Path, comm: bytes, shown: str) -> None:
    # A process names itself (prctl PR_SET_NAME); the name reaches a terminal and a notification.
    _process(tmp_path, 7, comm, {})
    assert commandName(str(tmp_path), 7) == shown


def test_a_gone_process_has_no_name(tmp_path: Path) -> None:
    assert commandName(str(tmp_path), 99) is None


def test_without_a_socket_table_nothing_is_found(tmp_path: Path) -> None:
    assert socketInode(str(tmp_path), ("127.0.0.1", 1), ("127.0.0.1", 2)) is None
    assert holderText(str(tmp_path), os.getuid(), ("127.0.0.1", 1), ("127.0.0.1", 2)) is None


# ---------------------------------------------------------------------- real sockets


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    yield s
    s.close()


def _ends(client: socket.socket) -> tuple[tuple[str, int], tuple[str, int]]:
    return client.getsockname()[:2], client.getpeername()[:2]


def _myName() -> str:
    return Path(f"/proc/{os.getpid()}/comm").read_text().strip()


def test_this_process_is_found_by_its_pid_and_name(listener: socket.socket) -> None:
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    with client, accepted:
        assert holderText("/proc", os.getuid(), *_ends(client)) == f"{os.getpid()} {_myName()}"
        # The 4-tuple's direction picks the end: each is its own socket.
        assert socketInode("/proc", *_ends(client)) == os.fstat(client.fileno()).st_ino
        assert socketInode("/proc", *_ends(accepted)) == os.fstat(accepted.fileno()).st_ino


def _child(argv: list[str], port: int) -> subprocess.Popen[str]:
    code = (
        "import socket, sys\n"
        f"s = socket.create_connection(('127.0.0.1', {port}))\n"
        "print('%s:%d' % s.getsockname()[:2], flush=True)\n"
        "sys.stdin.read()\n"
    )
    return subprocess.Popen([*argv, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _clientOf(child: subprocess.Popen[str], listener: socket.socket) -> tuple[tuple[str, int], tuple[str, int]]:
    assert child.stdout is not None
    host, _, port = child.stdout.readline().strip().rpartition(":")
    return (host, int(port)), listener.getsockname()[:2]


def test_a_child_holding_the_client_end_is_named_not_this_process(listener: socket.socket) -> None:
    child = _child([sys.executable], listener.getsockname()[1])
    try:
        ends = _clientOf(child, listener)
        accepted, _ = listener.accept()
        with accepted:
            text = holderText("/proc", os.getuid(), *ends)
            assert text is not None and text.startswith(f"{child.pid} python"), text
    finally:
        child.kill()
        child.wait()


def test_a_process_in_a_bubblewrap_sandbox_is_named_by_its_host_pid(listener: socket.socket) -> None:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        pytest.skip("bwrap is not installed (.ci/install-deps installs bubblewrap)")
    argv = [bwrap, "--unshare-user", "--unshare-pid", "--unshare-ipc", "--dev-bind", "/", "/", "--", sys.executable]
    child = _child(argv, listener.getsockname()[1])
    try:
        ends = _clientOf(child, listener)
        accepted, _ = listener.accept()
        with accepted:
            text = holderText("/proc", os.getuid(), *ends)
            assert text is not None, "the sandboxed client was not found"
            pid = int(text.split()[0])
            # The host's pid (bwrap's child), not the 1 or 2 it has inside its pid namespace.
            assert pid not in (1, 2) and Path(f"/proc/{pid}/ns/pid").exists()
            assert os.readlink(f"/proc/{pid}/ns/pid") != os.readlink("/proc/self/ns/pid")
            assert re.fullmatch(r"\d+ python[0-9.]*", text), text
    finally:
        child.kill()
        child.wait()


def test_a_socket_shared_wider_than_the_names_says_how_many_more(listener: socket.socket) -> None:
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    sharers = [
        subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE, pass_fds=[client.fileno()])
        for _ in range(MAX_NAMED + 1)
    ]
    try:
        with client, accepted:
            text = holderText("/proc", os.getuid(), *_ends(client)) or ""
            holders = MAX_NAMED + 2  # this process and its sharers
            assert text.count(", ") == MAX_NAMED, text
            assert text.endswith(f", {holders - MAX_NAMED} more"), text
    finally:
        for p in sharers:
            p.kill()
            p.wait()


def test_another_users_process_is_not_named(listener: socket.socket) -> None:
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    with client, accepted:
        assert holderText("/proc", os.getuid() + 12345, *_ends(client)) is None


def test_a_closed_client_is_found_nowhere(listener: socket.socket) -> None:
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    ends = _ends(client)
    client.close()
    with accepted:
        assert holderText("/proc", os.getuid(), *ends) is None


class ThreadPoolTests(TestCase):
    @deferredTest
    async def test_the_lookup_runs_in_the_reactors_thread_pool(self) -> None:
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        with server, client, accepted:
            found = await ProcAskers(reactor).find(*_ends(client))
            self.assertEqual(found, f"{os.getpid()} {_myName()}")
