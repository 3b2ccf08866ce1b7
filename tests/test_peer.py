"""Same-user peer check: the socket tables, netlink and /proc, and a real other-uid client."""

from __future__ import annotations

import errno
import os
import pathlib
import shutil
import socket
import struct
import sys
import time

import pytest
from twisted.internet.protocol import Factory
from twisted.internet.utils import getProcessOutputAndValue
from twisted.trial.unittest import SkipTest, TestCase
from zope.interface import implementer

from agentsandbox.egress.interfaces import IPeerChecker
from agentsandbox.egress.peer import (
    CLOSED,
    CLOSED_REFUSAL,
    ProcNetPeers,
    SameUserPeers,
    SockDiag,
    SocketTable,
    ownerOf,
)
from agentsandbox.egress.testing import FixedResolver, MappedDialer
from tests.support.egress_fixtures import (
    CURL,
    Echo,
    ProxyHarness,
    deferredTest,
    listen,
    reactor,
    waitFor,
)

LITTLE = sys.byteorder == "little"


TABLE = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:0C76 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 1 1 0000000000000000 100 0 0 10 0
   1: 0100007F:9C40 0100007F:0C76 01 00000000:00000000 00:00000000 00000000  4242        0 2 1 0000000000000000 20 4 30 10 -1
   2: short row
"""


@pytest.mark.skipif(not LITTLE, reason="little-endian fixture")
def test_ownerFromATable(tmp_path: pathlib.Path) -> None:
    assert ownerOf([TABLE], ("127.0.0.1", 0x9C40), ("127.0.0.1", 0x0C76)) == 4242
    assert ownerOf([TABLE], ("127.0.0.1", 0x9C41), ("127.0.0.1", 0x0C76)) is None
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "tcp").write_text(TABLE)
    peers = ProcNetPeers(str(tmp_path), 1000)
    assert peers.check(("127.0.0.1", 0x9C40), ("127.0.0.1", 0x0C76)) == "its socket belongs to uid 4242, not 1000"
    assert ProcNetPeers(str(tmp_path), 4242).check(("127.0.0.1", 0x9C40), ("127.0.0.1", 0x0C76)) is None
    assert peers.check(("127.0.0.1", 1), ("127.0.0.1", 0x0C76)) == "no socket of 127.0.0.1:1 in the socket table"
    # a procDir other than /proc never asks netlink
    assert not SameUserPeers(str(tmp_path), 1000).viaNetlink


#: A closed client's rows: its socket in TIME_WAIT (the kernel prints uid 0 and
#: inode 0 for it), an orphaned FIN_WAIT1 one (its uid kept, inode 0), a
#: half-closed one still held (FIN_WAIT2, inode 7) and a listener.
CLOSED_TABLE = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:9C40 0100007F:0C76 06 00000000:00000000 03:00001770 00000000     0        0 0 3 0000000000000000
   1: 0100007F:9C41 0100007F:0C76 04 00000001:00000000 01:00000014 00000000  4242        0 0 2 0000000000000000 20 4 30 10 -1
   2: 0100007F:9C42 0100007F:0C76 05 00000000:00000000 00:00000000 00000000  4242        0 7 1 0000000000000000 20 4 30 10 -1
   3: 0100007F:9C43 00000000:0000 0A 00000000:00000000 00:00000000 00000000  4242        0 8 1 0000000000000000 100 0 0 10 0
"""


@pytest.mark.skipif(not LITTLE, reason="little-endian fixture")
def test_aRowWithInodeZeroIsAClosedClientNotUidZero(tmp_path: pathlib.Path) -> None:
    """A socket no process holds (inode 0) has no owner: not root's, not its old uid's."""
    server = ("127.0.0.1", 0x0C76)
    assert ownerOf([CLOSED_TABLE], ("127.0.0.1", 0x9C40), server) is CLOSED
    assert ownerOf([CLOSED_TABLE], ("127.0.0.1", 0x9C41), server) is CLOSED
    assert ownerOf([CLOSED_TABLE], ("127.0.0.1", 0x9C42), server) == 4242
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "tcp").write_text(CLOSED_TABLE)
    for uid in (0, 4242):
        peers = ProcNetPeers(str(tmp_path), uid)
        assert peers.check(("127.0.0.1", 0x9C40), server) == CLOSED_REFUSAL
        assert peers.check(("127.0.0.1", 0x9C41), server) == CLOSED_REFUSAL
        assert SameUserPeers(str(tmp_path), uid).check(("127.0.0.1", 0x9C40), server) == CLOSED_REFUSAL
    assert ProcNetPeers(str(tmp_path), 4242).check(("127.0.0.1", 0x9C42), server) is None
    # A listener is nobody's client socket.
    assert ownerOf([CLOSED_TABLE.replace("00000000:0000 0A", "0100007F:0C76 0A")], ("127.0.0.1", 0x9C43), server) is None


def _diagAnswer(state: int, uid: int, inode: int) -> bytes:
    """One sock_diag answer as the kernel writes it: nlmsghdr, then inet_diag_msg."""
    body = struct.pack("=BBBB48sIIIII", socket.AF_INET, state, 0, 0, b"\0" * 48, 0, 0, 0, uid, inode)
    return struct.pack("=IHHII", 16 + len(body), 20, 0, 1, 0) + body


@pytest.mark.parametrize(
    ("state", "uid", "inode", "owner"),
    [
        (1, 1000, 41470, 1000),  # ESTABLISHED, held
        (5, 1000, 41470, 1000),  # FIN_WAIT2 after shutdown(SHUT_WR): still held
        (8, 1000, 41470, 1000),  # CLOSE_WAIT
        (6, 0, 0, CLOSED),  # TIME_WAIT: the kernel says uid 0
        (5, 0, 0, CLOSED),  # an orphaned FIN_WAIT2 (a timewait minisock)
        (4, 1000, 0, CLOSED),  # an orphaned FIN_WAIT1 keeps its uid, not its inode
        (10, 1000, 41470, None),  # a listener on the client's port: not the client
        (2, 1000, 41470, None),  # SYN_SENT
    ],
)
def test_aSockDiagAnswerIsReadByStateAndInode(state: int, uid: int, inode: int, owner: object) -> None:
    answer = _diagAnswer(state, uid, inode)
    assert SockDiag._answer(answer, 0, len(answer), 20) == owner


def _tableState(port: int) -> tuple[str, str] | None:
    """(state, inode) of the row whose local port is ``port`` in /proc/net/tcp, read raw."""
    with open("/proc/net/tcp") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 9 and fields[1].endswith(f":{port:04X}") and fields[0] != "sl":
                return fields[3], fields[9]
    return None


def _loopbackPair() -> tuple[socket.socket, socket.socket, socket.socket]:
    """(listener, client, accepted): one connected pair on 127.0.0.1."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    return server, client, accepted


@pytest.mark.parametrize("netlink", [True, False])
def test_aClientThatClosedIsRefusedAsClosedNotAsUidZero(netlink: bool) -> None:
    """A real client closes before the lookup: its socket (TIME_WAIT or an orphaned
    FIN_WAIT2, uid 0 in the kernel's answer) belongs to no one, also not to root."""
    server, client, accepted = _loopbackPair()
    mine, theirs = client.getsockname(), server.getsockname()
    try:
        table = SocketTable(useNetlink=netlink)
        assert table.ownerOf(mine, theirs) == os.getuid()
        # Half-closed, it still reads the answer: a live client, still its owner's.
        client.shutdown(socket.SHUT_WR)
        assert table.ownerOf(mine, theirs) == os.getuid()
        client.close()
        # Orphaned: FIN_WAIT1 (its uid kept) until the delayed ACK of its FIN,
        # then a timewait minisock, FIN_WAIT2 (05) or TIME_WAIT (06), uid 0.
        state = _tableState(mine[1])
        assert state is not None and state[1] == "0", state
        assert table.ownerOf(mine, theirs) is CLOSED
        for _ in range(500):
            state = _tableState(mine[1])
            if state is not None and state[0] in ("05", "06"):
                break
            time.sleep(0.01)
        assert state is not None and state[0] in ("05", "06") and state[1] == "0", state
        assert table.ownerOf(mine, theirs) is CLOSED
        assert table.ownersOf([(mine, theirs)]) == [CLOSED]
        assert table.viaNetlink is netlink
        for uid in (0, os.getuid()):
            assert SameUserPeers(uid=uid, useNetlink=netlink).check(mine, theirs) == CLOSED_REFUSAL
        table.close()
    finally:
        for s in (client, accepted, server):
            s.close()


def _squatGoneClientsPort() -> tuple[socket.socket, tuple[str, int], tuple[str, int], list[socket.socket]]:
    """A listener bound to the address and port of a client that was just reset.

    Another process may take the freed ephemeral port first (the suite runs
    beside other tests): then a new client is made, a few times at most.
    """
    for _ in range(20):
        server, client, accepted = _loopbackPair()
        mine, theirs = client.getsockname(), server.getsockname()
        # A reset leaves no TIME_WAIT behind: the port is free at once.
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()
        squatter = socket.socket()
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            squatter.bind(mine)
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            for s in (squatter, accepted, server):
                s.close()
            continue
        squatter.listen()
        return squatter, mine, theirs, [accepted, server]
    raise AssertionError("the gone client's port was taken every time")


def test_aListenerOnAGoneClientsPortIsNotItsOwner() -> None:
    """Asked for a 4-tuple whose client socket is gone, the kernel answers with a
    listener on the client's address and port: whoever listens there is not the client."""
    squatter, mine, theirs, others = _squatGoneClientsPort()
    try:
        table = SocketTable()
        assert table.viaNetlink
        assert table.ownerOf(mine, theirs) is None
        table.close()
    finally:
        for s in (squatter, *others):
            s.close()


def test_noSocketTable(tmp_path: pathlib.Path) -> None:
    why = SameUserPeers(str(tmp_path)).check(("127.0.0.1", 1), ("127.0.0.1", 2))
    assert why is not None and "no socket table" in why


@pytest.mark.parametrize("family,host", [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")])
@pytest.mark.parametrize("netlink", [True, False])
def test_realLoopbackPair(family: socket.AddressFamily, host: str, netlink: bool) -> None:
    server = socket.socket(family)
    try:
        server.bind((host, 0))
    except OSError:
        pytest.skip(f"no {host} on this machine")
    server.listen()
    client = socket.create_connection(server.getsockname()[:2])
    accepted, _ = server.accept()
    try:
        peers = SameUserPeers(useNetlink=netlink)
        assert peers.viaNetlink is netlink
        assert peers.check(accepted.getpeername()[:2], accepted.getsockname()[:2]) is None
        other = SameUserPeers(uid=os.getuid() + 4242, useNetlink=netlink)
        assert other.check(accepted.getpeername()[:2], accepted.getsockname()[:2]) == f"its socket belongs to uid {os.getuid()}, not {os.getuid() + 4242}"
        why = peers.check((host, 1), accepted.getsockname()[:2])
        assert why is not None and "no socket of" in why
        peers.close()
    finally:
        for s in (client, accepted, server):
            s.close()


@pytest.mark.parametrize("netlink", [True, False])
def test_ownersOfManyAtOnce(netlink: bool) -> None:
    """The batched lookup (one netlink message for many sockets) answers each pair as one lookup would."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(128)
    count = SockDiag.BATCH * 2 + 5  # crosses the batch boundary twice
    clients = [socket.create_connection(server.getsockname()) for _ in range(count)]
    accepted = [server.accept()[0] for _ in range(count)]
    try:
        table = SocketTable(useNetlink=netlink)
        assert table.viaNetlink is netlink
        pairs = [(a.getpeername()[:2], a.getsockname()[:2]) for a in accepted]
        # No such socket, between real ones and at the end: answered None, the rest still answered.
        missing = (("127.0.0.1", 1), accepted[0].getsockname()[:2])
        pairs.insert(SockDiag.BATCH - 1, missing)
        pairs.append(missing)
        owners = table.ownersOf(pairs)
        assert owners == [table.ownerOf(c, s) for c, s in pairs]
        assert owners.count(None) == 2 and owners.count(os.getuid()) == count
        assert owners[SockDiag.BATCH - 1] is None and owners[-1] is None
        assert table.viaNetlink is netlink  # nothing failed on the way
        assert table.ownersOf([]) == []
        table.close()
    finally:
        for s in [*clients, *accepted, server]:
            s.close()


class OtherUserTests(TestCase):
    @deferredTest
    async def test_aClientOfAnotherUidIsRefused(self) -> None:
        if os.getuid() != 0 or not shutil.which("setpriv"):
            raise SkipTest("needs root and setpriv to run curl as another uid")
        h, _ = await _echoProxy(self)
        args = ("--reuid=65534", "--regid=65534", "--clear-groups", CURL, "-sS", "--max-time", "10", "--noproxy", "", "--proxy", f"http://127.0.0.1:{h.port}", "http://echo.example.org/")
        out, _, code = await getProcessOutputAndValue("/usr/bin/setpriv", args, env={"PATH": "/usr/bin:/bin"})
        self.assertNotEqual(code, 0)
        await waitFor(lambda: any(r["event"] == "peer" for r in h.records()), "the peer refusal record")
        rec = [r for r in h.records() if r["event"] == "peer"][-1]
        self.assertEqual(rec["reason"], f"its socket belongs to uid 65534, not {os.getuid()}")
        # our own uid is served by the same proxy
        out, _, code = await getProcessOutputAndValue(CURL, ("-sS", "--noproxy", "", "-o", "/dev/null", "-w", "%{http_code}", "--proxy", f"http://127.0.0.1:{h.port}", "http://example.com/"), env={"PATH": "/usr/bin:/bin"})
        self.assertEqual(out, b"403")


async def _echoProxy(test: TestCase) -> tuple[ProxyHarness, MappedDialer]:
    """A proxy allowing echo.example.org (an echo server on loopback) with the real same-user check, and its dialer."""
    echo = await listen(Factory.forProtocol(Echo))
    test.addCleanup(echo.stopListening)
    dialer = MappedDialer(reactor)
    dialer.route("192.0.2.10", 80, echo.getHost().port)
    h = ProxyHarness(["echo.example.org"], FixedResolver({"echo.example.org": ["192.0.2.10"]}), dialer, peers=SameUserPeers())
    await h.start()
    test.addCleanup(h.stop)
    return h, dialer


class ClosedClientTests(TestCase):
    @deferredTest
    async def test_aClientThatClosedBeforeTheCheckIsNotServed(self) -> None:
        """The proxy's own same-user check: a request whose client closed before the
        check is refused as that, never served as uid 0's (the suite's own uid as root)."""
        h, dialer = await _echoProxy(self)
        # The reactor does not run between these lines: the proxy accepts the
        # connection only after the client has closed it.
        client = socket.create_connection(("127.0.0.1", h.port))
        client.sendall(b"GET http://echo.example.org/x HTTP/1.1\r\nHost: echo.example.org\r\n\r\n")
        port = client.getsockname()[1]
        client.close()
        state = _tableState(port)
        self.assertTrue(state is not None and state[1] == "0", state)
        await waitFor(lambda: any(r["event"] == "peer" for r in h.records()), "the peer refusal record")
        (rec,) = [r for r in h.records() if r["event"] == "peer"]
        self.assertEqual(rec["reason"], CLOSED_REFUSAL)
        self.assertEqual(rec["client"], f"127.0.0.1:{port}")
        self.assertEqual(dialer.dialled, [])
        self.assertEqual([r["event"] for r in h.records()], ["peer"])


@implementer(IPeerChecker)
class RecordingPeers:
    """Allows everyone; remembers the (client, server) pairs it was asked about."""

    def __init__(self) -> None:
        self.asked: list[tuple[tuple[str, int], tuple[str, int]]] = []

    def check(self, client: tuple[str, int], server: tuple[str, int]) -> str | None:
        self.asked.append((client, server))
        return None


class _WildcardPort:
    def getHost(self) -> object:
        from twisted.internet.address import IPv4Address

        return IPv4Address("TCP", "0.0.0.0", 3128)


class PeerAddressTests(TestCase):
    """The addresses the peer check gets are the connection's own, read without system calls."""

    @deferredTest
    async def test_theCheckGetsBothEndsOfTheConnection(self) -> None:
        peers = RecordingPeers()
        h = ProxyHarness(["echo.example.org"], FixedResolver({}), MappedDialer(reactor), peers=peers)
        await h.start()
        self.addCleanup(h.stop)
        client = socket.create_connection(("127.0.0.1", h.port))
        try:
            mine = client.getsockname()[:2]
            await waitFor(lambda: peers.asked, "the peer check")
        finally:
            client.close()
        self.assertEqual(peers.asked, [(mine, ("127.0.0.1", h.port))])
        # ... which is exactly what the real check needs to find our socket.
        listening = h.service.port
        self.assertEqual(h.factory.localAddressOf(listening), ("127.0.0.1", h.port))

    def test_wildcardListenersAskTheSocket(self) -> None:
        from agentsandbox.egress.proxy import EgressProxyFactory
        from tests.support.egress_fixtures import makeConfig

        factory = EgressProxyFactory(makeConfig(), reactor, peers=RecordingPeers())
        self.assertIsNone(factory.localAddressOf(_WildcardPort()))
        self.assertIsNone(factory.localAddressOf(None))
        self.assertIsNone(factory.localAddressOf(object()))
