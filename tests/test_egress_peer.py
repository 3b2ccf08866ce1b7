"""Same-user peer check: the socket tables, netlink and /proc, and a real other-uid client."""

from __future__ import annotations

import os
import pathlib
import shutil
import socket
import sys

import pytest
from twisted.internet.protocol import Factory
from twisted.internet.utils import getProcessOutputAndValue
from twisted.trial.unittest import SkipTest, TestCase
from zope.interface import implementer

from agentsandbox.egress.interfaces import IPeerChecker
from agentsandbox.egress.peer import ProcNetPeers, SameUserPeers, SockDiag, SocketTable, ownerOf
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
        echo = await listen(Factory.forProtocol(Echo))
        self.addCleanup(echo.stopListening)
        dialer = MappedDialer(reactor)
        dialer.route("192.0.2.10", 80, echo.getHost().port)
        h = ProxyHarness(["echo.example.org"], FixedResolver({"echo.example.org": ["192.0.2.10"]}), dialer, peers=SameUserPeers())
        await h.start()
        self.addCleanup(h.stop)
        args = ("--reuid=65534", "--regid=65534", "--clear-groups", CURL, "-sS", "--max-time", "10", "--noproxy", "", "--proxy", f"http://127.0.0.1:{h.port}", "http://echo.example.org/")
        out, _, code = await getProcessOutputAndValue("/usr/bin/setpriv", args, env={"PATH": "/usr/bin:/bin"})
        self.assertNotEqual(code, 0)
        await waitFor(lambda: any(r["event"] == "peer" for r in h.records()), "the peer refusal record")
        rec = [r for r in h.records() if r["event"] == "peer"][-1]
        self.assertEqual(rec["reason"], f"its socket belongs to uid 65534, not {os.getuid()}")
        # our own uid is served by the same proxy
        out, _, code = await getProcessOutputAndValue(CURL, ("-sS", "--noproxy", "", "-o", "/dev/null", "-w", "%{http_code}", "--proxy", f"http://127.0.0.1:{h.port}", "http://example.com/"), env={"PATH": "/usr/bin:/bin"})
        self.assertEqual(out, b"403")


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
