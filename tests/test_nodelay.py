"""TCP_NODELAY on every TCP leg the proxy owns (issue 25), read from the real sockets.

Each test opens a connection through a proxy on loopback, holds it open, and
reads ``TCP_NODELAY`` with ``getsockopt`` on the proxy's own sockets: found
among the reactor's descriptors by their addresses (the client's leg is the
socket whose peer is the test client, an upstream leg the one whose peer is
the origin's or the parent's listening address).  The test client and the
origins never set the option, and a control assertion reads it off on their
sockets, so a value of 1 on the proxy's is the proxy's doing.  Figures (what
the option saves) are ``bench/latency.py``'s; nothing here is timed.
"""

from __future__ import annotations

import os
import socket
import ssl
import struct
import threading
from collections.abc import Callable
from typing import Any

from twisted.internet import threads
from twisted.internet.defer import Deferred
from twisted.internet.protocol import Factory, Protocol
from twisted.trial.unittest import TestCase

from agentsandbox.egress.dial import tcpDialer
from agentsandbox.egress.dispatch import bindTCP
from agentsandbox.egress.register import _serveAdopted
from agentsandbox.egress.testing import FixedResolver, MappedDialer
from tests.support.egress_fixtures import (
    Echo,
    ProxyHarness,
    deferredTest,
    listen,
    makeConfig,
    reactor,
    waitFor,
)
from tests.support.egress_parent import ParentProxy
from tests.support.inject_harness import InjectHarness, Tracked

Address = tuple[str, int]


def _noDelay(sock: socket.socket) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def processSockets() -> list[tuple[Address, Address, int]]:
    """(local address, peer address, TCP_NODELAY) of every connected TCP socket of
    this process: the proxy's, the in-process origins' and the test's clients'.

    Read from ``/proc/self/fd`` rather than the reactor's readers: a leg the proxy
    has paused (a terminated client between a response and its next read) is not
    among them, and is exactly as much the proxy's.
    """
    found = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
        except OSError:
            continue  # closed since the listing
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue  # closed since the listing
        try:
            if sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6):
                found.append((sock.getsockname()[:2], sock.getpeername()[:2], _noDelay(sock)))
        except OSError:
            pass  # a listening socket has no peer
        finally:
            sock.close()
    return found


class Held:
    """A blocking client in a thread: ``script`` runs on its connected socket,
    then the connection stays open until ``release``.

    A script that wraps the socket (TLS) returns the wrapper: ``wrap_socket``
    detaches the plain socket, so the wrapper alone owns the descriptor and is
    held here, or the connection would close when the script returns.
    """

    def __init__(self, port: int, script: Callable[[socket.socket], Any]) -> None:
        self.ready: Deferred[Any] = Deferred()
        self.go = threading.Event()
        self.address: Address = ("", 0)
        self.clientNoDelay = -1

        def run() -> None:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                    self.address = sock.getsockname()[:2]
                    self.clientNoDelay = _noDelay(sock)
                    kept = script(sock)
                    try:
                        reactor.callFromThread(self.ready.callback, None)
                        self.go.wait(30)
                    finally:
                        if isinstance(kept, socket.socket):
                            kept.close()
            except BaseException as e:
                if not self.ready.called:
                    reactor.callFromThread(self.ready.errback, e)

        self.done: Deferred[None] = threads.deferToThread(run)

    def release(self) -> Deferred[None]:
        self.go.set()
        return self.done


def readUntil(sock: socket.socket, marker: bytes) -> bytes:
    data = b""
    while marker not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"closed before {marker!r}: {data!r}")
        data += chunk
    return data


class HoldingOrigin(Protocol):
    """An http:// origin that answers the head and part of the body, then holds."""

    def dataReceived(self, data: bytes) -> None:
        if b"\r\n\r\n" in data:
            self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhello")  # type: ignore[union-attr]


class NoDelayTests(TestCase):
    timeout = 60

    async def hold(self, port: int, script: Callable[[socket.socket], Any]) -> Held:
        held = Held(port, script)
        self.addCleanup(held.release)
        await held.ready
        self.assertEqual(held.clientNoDelay, 0)  # the client leaves Nagle on: the proxy's side is the proxy's
        return held

    async def assertNoDelayTowards(self, peer: Address, what: str) -> None:
        """Every reactor socket whose peer is ``peer`` has TCP_NODELAY (and there is one).

        A leg the proxy has paused (a terminated client between a response and
        its next read) is not among the reactor's readers for a turn or two:
        it is waited for, up to a bound, rather than missed.
        """
        from twisted.internet.task import deferLater

        for _ in range(500):
            legs = [(local, nodelay) for local, remote, nodelay in processSockets() if remote == peer]
            if legs:
                break
            await deferLater(reactor, 0.01)
        self.assertTrue(legs, f"no socket of the proxy towards {what} ({peer})")
        for local, nodelay in legs:
            self.assertEqual(nodelay, 1, f"the proxy's {what} leg {local} -> {peer}")

    def assertOriginLeavesItOff(self, originPort: int) -> None:
        """The control: the in-process origin's accepted sockets read 0."""
        origin = [nodelay for local, _, nodelay in processSockets() if local[1] == originPort]
        self.assertTrue(origin)
        self.assertEqual(set(origin), {0})

    async def echoProxy(self, **kw: Any) -> tuple[ProxyHarness, int]:
        echo = await listen(Factory.forProtocol(Echo))
        self.addCleanup(echo.stopListening)
        port = echo.getHost().port
        # The default dialer (its own connect) on the loopback address the entry allows.
        h = ProxyHarness([f"127.0.0.1:{port}"], dialer=tcpDialer(reactor), **kw)
        await h.start()
        self.addCleanup(h.stop)
        return h, port

    @staticmethod
    def connectScript(port: int, payload: bytes = b"ping") -> Callable[[socket.socket], Any]:
        def script(sock: socket.socket) -> None:
            sock.sendall(b"CONNECT 127.0.0.1:%d HTTP/1.1\r\nHost: x\r\n\r\n%b" % (port, payload))
            readUntil(sock, b"\r\n\r\n" + payload)

        return script

    # ------------------------------------------------------------------ tunnels

    @deferredTest
    async def test_connectTunnelBothLegs(self) -> None:
        h, port = await self.echoProxy()
        held = await self.hold(h.port, self.connectScript(port))
        await self.assertNoDelayTowards(held.address, "client")
        await self.assertNoDelayTowards(("127.0.0.1", port), "upstream")
        self.assertOriginLeavesItOff(port)

    @deferredTest
    async def test_zeroCopySpliceKeepsIt(self) -> None:
        h, port = await self.echoProxy(zeroCopyAfter=1)
        held = await self.hold(h.port, self.connectScript(port, b"x" * 4096))
        await waitFor(lambda: h.factory.zeroCopied == 1, "the splice(2) hand-over")
        # The sockets are watched through the splice engine's descriptors now.
        await self.assertNoDelayTowards(held.address, "client")
        await self.assertNoDelayTowards(("127.0.0.1", port), "upstream")

    @deferredTest
    async def test_socks5BothLegs(self) -> None:
        h, port = await self.echoProxy()

        def script(sock: socket.socket) -> None:
            sock.sendall(b"\x05\x01\x00" + b"\x05\x01\x00\x01" + socket.inet_aton("127.0.0.1") + struct.pack("!H", port))
            got = b""
            while len(got) < 12:
                got += sock.recv(64)
            assert got[:4] == b"\x05\x00\x05\x00", got
            sock.sendall(b"ping")
            readUntil(sock, b"ping")

        held = await self.hold(h.port, script)
        await self.assertNoDelayTowards(held.address, "client")
        await self.assertNoDelayTowards(("127.0.0.1", port), "upstream")

    @deferredTest
    async def test_forwardBothLegs(self) -> None:
        origin = await listen(Factory.forProtocol(HoldingOrigin))
        self.addCleanup(origin.stopListening)
        port = origin.getHost().port
        h = ProxyHarness([f"127.0.0.1:{port}"])
        await h.start()
        self.addCleanup(h.stop)

        def script(sock: socket.socket) -> None:
            sock.sendall(b"GET http://127.0.0.1:%d/ HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n" % (port, port))
            readUntil(sock, b"hello")

        held = await self.hold(h.port, script)  # the response is not over: both legs are open
        await self.assertNoDelayTowards(held.address, "client")
        await self.assertNoDelayTowards(("127.0.0.1", port), "origin")
        self.assertOriginLeavesItOff(port)

    @deferredTest
    async def test_throughAParentProxy(self) -> None:
        echo = await listen(Factory.forProtocol(Echo))
        self.addCleanup(echo.stopListening)
        tracked = Tracked(ParentProxy(reactor, {("echo.example.org", 443): echo.getHost().port}))
        parent = await listen(tracked)
        self.addCleanup(parent.stopListening)
        self.addCleanup(tracked.closeAll)  # (after the proxy stopped: its legs end first)
        parentPort = parent.getHost().port
        h = ProxyHarness(
            ["echo.example.org"],
            FixedResolver({"echo.example.org": ["192.0.2.10"]}),
            MappedDialer(reactor),
            proxy={"parent": f"http://127.0.0.1:{parentPort}"},
        )
        await h.start()
        self.addCleanup(h.stop)

        def script(sock: socket.socket) -> None:
            sock.sendall(b"CONNECT echo.example.org:443 HTTP/1.1\r\nHost: x\r\n\r\nping")
            readUntil(sock, b"\r\n\r\nping")

        held = await self.hold(h.port, script)
        await self.assertNoDelayTowards(held.address, "client")
        await self.assertNoDelayTowards(("127.0.0.1", parentPort), "parent proxy")

    @deferredTest
    async def test_terminatedClientAndPooledUpstream(self) -> None:
        inject = InjectHarness(reactor)
        self.addCleanup(inject.close)
        h = ProxyHarness(
            config=makeConfig('[sandbox]\ndomains = ["api.github.com"]\n'),
            resolver=FixedResolver({"api.github.com": [str(inject.address)]}),
            terminator=inject.injector,
        )
        await h.start()
        self.addCleanup(h.stop)
        context = ssl.create_default_context(cadata=inject.ca.pem.decode())

        def script(sock: socket.socket) -> ssl.SSLSocket:
            sock.sendall(b"CONNECT api.github.com:443 HTTP/1.1\r\nHost: api.github.com:443\r\n\r\n")
            readUntil(sock, b"\r\n\r\n")
            tls = context.wrap_socket(sock, server_hostname="api.github.com")
            tls.sendall(b"GET /user HTTP/1.1\r\nHost: api.github.com\r\n\r\n")
            readUntil(tls, b"octocat")
            return tls  # the descriptor is the wrapper's now: Held keeps it open

        held = await self.hold(h.port, script)
        await self.assertNoDelayTowards(held.address, "client")
        upstreamPort = inject.upstream.getHost().port  # type: ignore[attr-defined]
        await self.assertNoDelayTowards(("127.0.0.1", upstreamPort), "pooled upstream")

    # ------------------------------------------------------------------ how the client's socket arrived

    @deferredTest
    async def test_socketActivatedListener(self) -> None:
        # What Twisted's systemd: endpoint does with the descriptor systemd passed:
        # adoptStreamPort, on a listener made without NoDelay=yes.
        h, port = await self.echoProxy()
        listener = socket.create_server(("127.0.0.1", 0))
        self.assertEqual(_noDelay(listener), 0)
        listener.setblocking(False)  # as systemd passes it, and as adoptStreamPort wants it
        activated = reactor.adoptStreamPort(listener.fileno(), socket.AF_INET, h.factory)
        listener.close()  # (adopted: Twisted holds its own copy)
        self.addCleanup(activated.stopListening)
        held = await self.hold(activated.getHost().port, self.connectScript(port))
        await self.assertNoDelayTowards(held.address, "client")

    @deferredTest
    async def test_handedOverByTheDispatcher(self) -> None:
        h, port = await self.echoProxy()
        listener = socket.create_server(("127.0.0.1", 0))
        self.addCleanup(listener.close)
        client = socket.create_connection(listener.getsockname())
        self.addCleanup(client.close)
        accepted, _ = listener.accept()
        self.assertEqual(_noDelay(accepted), 0)  # as from a dispatcher that did not set it
        # The same socket, seen through a descriptor of its own: with Twisted's
        # privates switched off, the adoption closes ``accepted`` (it serves a dup).
        probe = accepted.dup()
        self.addCleanup(probe.close)
        _serveAdopted(accepted, h.factory, reactor)
        self.assertEqual(_noDelay(probe), 1)
        client.sendall(b"CONNECT 127.0.0.1:%d HTTP/1.1\r\nHost: x\r\n\r\nping" % port)
        client.settimeout(30)
        self.assertIn(b"ping", await threads.deferToThread(readUntil, client, b"\r\n\r\nping"))
        await self.assertNoDelayTowards(("127.0.0.1", port), "upstream")

    def test_dispatcherListenersSetIt(self) -> None:
        # Accepted connections inherit the listener's option (Linux), so what the
        # dispatcher hands over has it before the user's proxy sets it again.
        sockets = bindTCP(0)
        for sock in sockets:
            self.addCleanup(sock.close)
        self.assertTrue(sockets)
        for sock in sockets:
            self.assertEqual(_noDelay(sock), 1)
            peer = socket.create_connection(sock.getsockname()[:2])
            accepted, _ = sock.accept()
            self.assertEqual(_noDelay(accepted), 1)
            accepted.close()
            peer.close()
