"""The proxy on a real loopback port: CONNECT, SOCKS5, forwarding, refusals, limits, timeouts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

from twisted.internet.protocol import Factory
from twisted.trial.unittest import TestCase

from agentsandbox.egress.testing import FixedResolver, MappedDialer
from tests.support.egress_fixtures import (
    Echo,
    Greeter,
    ProxyHarness,
    deferredTest,
    exchange,
    listen,
    reactor,
)


class ConnectTests(TestCase):
    spliceFast = True

    async def _proxy(
        self, domains: Sequence[str], table: Mapping[str, Sequence[str]] | None = None, **kw: Any
    ) -> ProxyHarness:
        echo = await listen(Factory.forProtocol(Echo))
        self.addCleanup(echo.stopListening)
        dialer = MappedDialer(reactor)
        dialer.route("192.0.2.10", 443, echo.getHost().port)
        h = ProxyHarness(domains, FixedResolver(table or {"echo.example.org": ["192.0.2.10"]}), dialer, **kw)
        await h.start()
        self.addCleanup(h.stop)
        return h

    @deferredTest
    async def test_connectEchoes(self) -> None:
        h = await self._proxy(["echo.example.org"])
        out = await exchange(h.port, b"CONNECT echo.example.org:443 HTTP/1.1\r\nHost: echo.example.org:443\r\n\r\nping")
        self.assertEqual(out, b"HTTP/1.1 200 Connection established\r\n\r\nping")
        self.assertEqual(h.dialer.dialled, [("192.0.2.10", 443)])
        recs = h.records()
        self.assertEqual(recs[-1]["event"], "tunnel")
        self.assertEqual((recs[-1]["up"], recs[-1]["down"]), (4, 4))

    @deferredTest
    async def test_refusedOffList(self) -> None:
        h = await self._proxy(["echo.example.org"])
        out = await exchange(h.port, b"CONNECT github.com.example.com:443 HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertIn(b"403 Forbidden", out)
        self.assertIn(b"github.com.example.com:443 is not on the sandbox's allow list", out)
        self.assertIn(b"sandbox.domains", out)
        self.assertEqual(h.dialer.dialled, [])
        rec = h.records()[-1]
        self.assertEqual((rec["event"], rec["host"], rec["allow"]), ("refused", "github.com.example.com", "github.com.example.com"))

    @deferredTest
    async def test_socksNoAuth(self) -> None:
        h = await self._proxy(["echo.example.org"])
        name = b"echo.example.org"
        out = await exchange(h.port, b"\x05\x01\x00" + b"\x05\x01\x00\x03" + bytes([len(name)]) + name + (443).to_bytes(2, "big") + b"data")
        self.assertEqual(out, b"\x05\x00" + b"\x05\x00\x00\x01" + b"\0" * 6 + b"data")


# ---------------------------------------------------------------- helpers

import ssl  # noqa: E402

from twisted.internet.defer import Deferred  # noqa: E402
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol  # noqa: E402
from twisted.internet.error import ConnectionDone  # noqa: E402
from twisted.internet.interfaces import IProtocol  # noqa: E402
from twisted.internet.protocol import Protocol  # noqa: E402
from twisted.internet.task import Clock  # noqa: E402
from zope.interface import implementer  # noqa: E402

from agentsandbox.allowlist import IPAddress  # noqa: E402
from agentsandbox.egress.http import errorReply  # noqa: E402
from agentsandbox.egress.interfaces import IPeerChecker, ITerminator  # noqa: E402
from tests.support.egress_fixtures import Collector  # noqa: E402


def socksConnect(host: bytes, port: int, atyp: int = 3, auth: bool = False) -> bytes:
    greeting = b"\x05\x01\x02" + b"\x01\x0bsrt-sandbox\x0bplaceholder" if auth else b"\x05\x01\x00"
    addr = bytes([3, len(host)]) + host if atyp == 3 else bytes([atyp]) + host
    return greeting + b"\x05\x01\x00" + addr + port.to_bytes(2, "big")


OK = b"\x05\x00\x00\x01" + b"\0" * 6


def clientHello() -> bytes:
    """The first flight of a real TLS client (what a client pointed at the proxy as an
    https:// proxy sends), from the standard library's OpenSSL."""
    context = ssl.create_default_context()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname="echo.example.org")
    try:
        tls.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return outgoing.read()


#: What arrives at the proxy's port from clients that speak something else,
#: with the refusal each gets: (what, bytes, text).
def foreignStarts() -> list[tuple[str, bytes, str]]:
    socks4 = b"\x04\x01" + (443).to_bytes(2, "big") + bytes([192, 0, 2, 10]) + b"user\x00"
    socks4a = b"\x04\x01" + (443).to_bytes(2, "big") + b"\x00\x00\x00\x01user\x00echo.example.org\x00"
    starting = "refused: a request starting with byte 0x{:02x}, which no HTTP method starts with"
    return [
        ("SOCKS4", socks4, starting.format(4)),
        ("SOCKS4a", socks4a, starting.format(4)),
        ("TLS ClientHello", clientHello(), starting.format(0x16)),
        ("a NUL inside a method", b"GE\x00T http://echo.example.org/ HTTP/1.1", "refused: byte 0x00 in the request's method"),
    ]


def socksReply(code: int) -> bytes:
    return bytes([5, code, 0, 1]) + b"\0" * 6


class Recorder(Protocol):
    """A fake TLS terminator's protocol: records what it is fed and answers."""

    def __init__(self, log: list[tuple[str, Any]]) -> None:
        self.log = log

    def connectionMade(self) -> None:
        self.log.append(("made", self.transport is not None))

    def dataReceived(self, data: bytes) -> None:
        self.log.append(("data", data))
        assert self.transport is not None
        self.transport.write(b"terminated:" + data)
        self.transport.loseConnection()

    def connectionLost(self, reason: Any = None) -> None:
        self.log.append(("lost", None))


@implementer(ITerminator)
class FakeTerminator:
    """Terminates ``hosts`` on 443, whatever the proxy's config says (the proxy asks it alone)."""

    def __init__(self, hosts: Sequence[str] = ("api.github.com",)) -> None:
        self.hosts = set(hosts)
        self.asked: list[tuple[str, int]] = []
        self.calls: list[tuple[str, list[str]]] = []
        self.fed: list[tuple[str, Any]] = []

    def injects(self, host: str, port: int) -> bool:
        self.asked.append((host, port))
        return port == 443 and host in self.hosts

    def terminate(self, host: str, addresses: Sequence[IPAddress]) -> IProtocol:
        self.calls.append((host, [str(a) for a in addresses]))
        return Recorder(self.fed)


def injectGitHub(h: ProxyHarness) -> None:
    """Swap in a config with an inject rule for api.github.com (the proxy's own, not the terminator's)."""
    from tests.support.egress_fixtures import makeConfig

    h.factory.holder.swap(
        makeConfig(
            '[sandbox]\ndomains = ["api.github.com"]\n[[inject]]\nhosts = ["api.github.com"]\n'
            'format = "token {token}"\ntoken_env = "T"\n'
        )
    )


class BaseProxyTest(TestCase):
    spliceFast = True

    async def proxy(
        self,
        domains: Sequence[str],
        table: Mapping[str, Sequence[str]] | None = None,
        upstream: type[Protocol] = Echo,
        routes: Sequence[tuple[str, int]] = ((("192.0.2.10", 443)),),
        **kw: Any,
    ) -> ProxyHarness:
        server = await listen(Factory.forProtocol(upstream))
        self.addCleanup(server.stopListening)
        self.upstreamPort = server.getHost().port
        dialer = MappedDialer(reactor)
        for addr, port in routes:
            dialer.route(addr, port, self.upstreamPort)
        h = ProxyHarness(domains, FixedResolver(table if table is not None else {"echo.example.org": ["192.0.2.10"]}), dialer, **kw, spliceFast=self.spliceFast)
        await h.start()
        self.addCleanup(h.stop)
        return h


class SocksTests(BaseProxyTest):
    @deferredTest
    async def test_userPassAcceptedAndIgnored(self) -> None:
        h = await self.proxy(["echo.example.org"])
        out = await exchange(h.port, socksConnect(b"echo.example.org", 443, auth=True) + b"abc")
        self.assertEqual(out, b"\x05\x02" + b"\x01\x00" + OK + b"abc")
        with open(h.auditPath) as f:
            self.assertNotIn("placeholder", f.read())

    @deferredTest
    async def test_ipv4AndIpv6Addresses(self) -> None:
        h = await self.proxy(["192.0.2.10:443", "[2001:db8::10]:443"], routes=[("192.0.2.10", 443), ("2001:db8::10", 443)])
        out = await exchange(h.port, socksConnect(bytes([192, 0, 2, 10]), 443, atyp=1) + b"v4")
        self.assertEqual(out, b"\x05\x00" + OK + b"v4")
        v6 = ipaddress_packed("2001:db8::10")
        out = await exchange(h.port, socksConnect(v6, 443, atyp=4) + b"v6")
        self.assertEqual(out, b"\x05\x00" + OK + b"v6")

    @deferredTest
    async def test_refusals(self) -> None:
        h = await self.proxy(["echo.example.org:443"])
        # the listed port + 1: refused by the rules (code 2)
        self.assertEqual(await exchange(h.port, socksConnect(b"echo.example.org", 444)), b"\x05\x00" + socksReply(2))
        self.assertEqual(await exchange(h.port, socksConnect(b"example.com", 443)), b"\x05\x00" + socksReply(2))
        # BIND (2) and UDP ASSOCIATE (3): command not supported (7)
        self.assertEqual(await exchange(h.port, b"\x05\x01\x00\x05\x02\x00\x01" + b"\0" * 6), b"\x05\x00" + socksReply(7))
        self.assertEqual(await exchange(h.port, b"\x05\x01\x00\x05\x03\x00\x01" + b"\0" * 6), b"\x05\x00" + socksReply(7))
        # unknown address type: 8
        self.assertEqual(await exchange(h.port, b"\x05\x01\x00\x05\x01\x00\x09" + b"\0" * 6), b"\x05\x00" + socksReply(8))
        # no acceptable method (GSSAPI only)
        self.assertEqual(await exchange(h.port, b"\x05\x01\x01"), b"\x05\xff")
        # bad sub-negotiation version
        self.assertEqual(await exchange(h.port, b"\x05\x01\x02\x05\x01a\x01b"), b"\x05\x02\x01\x01")
        # an unresolvable but allowed name: host unreachable (4)
        h2 = await self.proxy(["gone.example.org"], table={})
        self.assertEqual(await exchange(h2.port, socksConnect(b"gone.example.org", 443)), b"\x05\x00" + socksReply(4))
        events = [(r["event"], r.get("host")) for r in h.records()]
        self.assertIn(("refused", "echo.example.org"), events)
        self.assertIn(("refused", "example.com"), events)
        self.assertIn(("parse", None), events)

    @deferredTest
    async def test_portSpecificLoopbackEntry(self) -> None:
        echo = await listen(Factory.forProtocol(Echo))
        self.addCleanup(echo.stopListening)
        port = echo.getHost().port
        h = ProxyHarness([f"127.0.0.1:{port}"])
        await h.start()
        self.addCleanup(h.stop)
        out = await exchange(h.port, socksConnect(bytes([127, 0, 0, 1]), port, atyp=1) + b"lo")
        self.assertEqual(out, b"\x05\x00" + OK + b"lo")
        out = await exchange(h.port, socksConnect(bytes([127, 0, 0, 1]), port + 1, atyp=1))
        self.assertEqual(out, b"\x05\x00" + socksReply(2))


def ipaddress_packed(text: str) -> bytes:
    import ipaddress

    return ipaddress.ip_address(text).packed


class HttpTests(BaseProxyTest):
    @deferredTest
    async def test_connectErrorsAre400(self) -> None:
        h = await self.proxy(["echo.example.org"])
        for head in (
            b"CONNECT echo.example.org HTTP/1.1\r\nHost: x\r\n\r\n",
            b"CONNECT echo.example.org:0 HTTP/1.1\r\nHost: x\r\n\r\n",
            b"CONNECT echo.example.org:99999 HTTP/1.1\r\nHost: x\r\n\r\n",
            b"CONNECT user@echo.example.org:443 HTTP/1.1\r\nHost: x\r\n\r\n",
        ):
            out = await exchange(h.port, head)
            self.assertTrue(out.startswith(b"HTTP/1.1 400 Bad Request\r\n"), out)
            self.assertIn(b"CONNECT wants host:port", out)
        out = await exchange(h.port, b"GET / HTTP/1.1\r\nHost: echo.example.org\r\n\r\n")
        self.assertIn(b"400 Bad Request", out)
        self.assertIn(b"forwards http:// URLs", out)
        out = await exchange(h.port, b"GET https://echo.example.org/ HTTP/1.1\r\nHost: echo.example.org\r\n\r\n")
        self.assertIn(b"400 Bad Request", out)
        out = await exchange(h.port, b"\x16\x03\x01garbage\r\n\r\n")
        self.assertIn(b"400", out)
        # the error reply format of reference §3.2
        out = await exchange(h.port, b"CONNECT nope.example.net:443 HTTP/1.1\r\nHost: x\r\n\r\n")
        head, _, body = out.partition(b"\r\n\r\n")
        self.assertEqual(
            head.split(b"\r\n"),
            [b"HTTP/1.1 403 Forbidden", b"Content-Type: text/plain; charset=utf-8", b"Content-Length: %d" % len(body), b"Connection: close"],
        )
        self.assertTrue(body.endswith(b"\n"))

    @deferredTest
    async def test_connectTriesTheNextAddress(self) -> None:
        # the first (public) address refuses connections, the second answers
        h = await self.proxy(["echo.example.org"], table={"echo.example.org": ["127.0.0.1", "198.51.100.7", "192.0.2.10"]})
        out = await exchange(h.port, b"CONNECT echo.example.org:443 HTTP/1.1\r\nHost: x\r\n\r\nok")
        self.assertEqual(out, b"HTTP/1.1 200 Connection established\r\n\r\nok")
        # 127.0.0.1 is refused by the rules and never dialled
        self.assertEqual(h.dialer.dialled, [("198.51.100.7", 443), ("192.0.2.10", 443)])
        self.assertEqual(h.resolver.lookups, ["echo.example.org"])

    @deferredTest
    async def test_dialFailureIs502NamingTheAddresses(self) -> None:
        h = await self.proxy(["echo.example.org"], table={"echo.example.org": ["198.51.100.7"]})
        out = await exchange(h.port, b"CONNECT echo.example.org:443 HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertIn(b"502 Bad Gateway", out)
        self.assertIn(b"could not connect to echo.example.org:443 (198.51.100.7:", out)
        self.assertEqual(h.records()[-1]["event"], "failed")

    @deferredTest
    async def test_privateAnswerRefusedWithTheRule(self) -> None:
        h = await self.proxy(["echo.example.org"], table={"echo.example.org": ["10.0.0.5"]})
        out = await exchange(h.port, b"CONNECT echo.example.org:443 HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertIn(b"403 Forbidden", out)
        self.assertIn(b"echo.example.org resolves to 10.0.0.5, which is private (RFC 1918) 10.0.0.0/8", out)
        rec = h.records()[-1]
        self.assertEqual((rec["address"], rec["allow"]), ("10.0.0.5", "10.0.0.5:443"))

    @deferredTest
    async def test_tunnelCapIs503AndReleased(self) -> None:
        h = await self.proxy(["echo.example.org"], proxy={"max_tunnels": 1})
        first = Collector(b"CONNECT echo.example.org:443 HTTP/1.1\r\nHost: x\r\n\r\n")
        await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", h.port), first)
        await first.until(b"200")
        out = await exchange(h.port, b"CONNECT echo.example.org:443 HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertIn(b"503 Service Unavailable", out)
        self.assertIn(b"proxy.max_tunnels", out)
        out = await exchange(h.port, socksConnect(b"echo.example.org", 443))
        self.assertEqual(out, b"\x05\x00" + socksReply(1))
        first.transport.loseConnection()
        await first.done
        while h.factory.reserved:
            await sleep(0.01)
        out = await exchange(h.port, b"CONNECT echo.example.org:443 HTTP/1.1\r\nHost: x\r\n\r\nagain")
        self.assertTrue(out.endswith(b"again"))

    @deferredTest
    async def test_headerTimeout(self) -> None:
        clock = Clock()
        h = await self.proxy(["echo.example.org"], proxy={"header_timeout": 0.2}, clock=clock)
        partial = b"CONNECT echo.example.org:443 HTTP/1.1\r\n"
        c = Collector(partial)
        read = h.doorRead(len(partial))
        await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", h.port), c)
        door = await read
        clock.pump([0.025] * 4)  # 0.1 s (the sweep runs every 0.05 s here): the head may still come
        self.assertFalse(door.gone)
        clock.pump([0.025] * 6)  # 0.25 s
        await c.done
        self.assertIn("proxy.header_timeout", h.records()[-1]["reason"])

    @deferredTest
    async def test_aFirstByteNoRequestStartsWithIs400AndClosedAtOnce(self) -> None:
        # These used to wait, unanswered, for proxy.header_timeout (60 s).  The
        # clock is never moved: the refusal must need no timer.
        clock = Clock()
        h = await self.proxy(["echo.example.org"], clock=clock)
        for what, sent, text in foreignStarts():
            c = Collector(sent)  # no half-close: such a client waits for an answer
            read = h.doorRead(1)
            await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", h.port), c)
            door = await read
            self.assertTrue(door.gone, f"{what}: not refused in the turn that read it")
            self.assertEqual(await c.done, errorReply(400, text), what)
            self.assertIsInstance(c.reason.value, ConnectionDone, what)
            record = h.records()[-1]
            self.assertEqual((record["event"], record["kind"], record["reason"]), ("parse", "http", text), what)
        self.assertEqual(clock.seconds(), 0)
        self.assertEqual(h.dialer.dialled, [])

    @deferredTest
    async def test_idleTimeoutClosesTunnel(self) -> None:
        clock = Clock()
        h = await self.proxy(["echo.example.org"], proxy={"idle_timeout": 0.3}, clock=clock)
        c = Collector(b"CONNECT echo.example.org:443 HTTP/1.1\r\nHost: x\r\n\r\n")
        await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", h.port), c)
        await c.until(b"\r\n\r\n")
        # The sweep (every 0.075 s here) starts the idle count at its first pass.
        clock.pump([0.025] * 8)  # 0.2 s: idle, but not for long enough
        self.assertEqual(len(h.factory.tunnels), 1)
        clock.pump([0.025] * 12)  # 0.5 s
        await c.done
        rec = h.records()[-1]
        self.assertEqual(rec["event"], "tunnel")
        self.assertIn("proxy.idle_timeout", rec["reason"])

    @deferredTest
    async def test_halfCloseBothWays(self) -> None:
        # the upstream greets, the client half-closes after sending; the echo
        # finishes and closes; the client gets everything and a clean end
        h = await self.proxy(["echo.example.org"], upstream=Greeter)
        out = await exchange(h.port, b"CONNECT echo.example.org:443 HTTP/1.1\r\nHost: x\r\n\r\n" + b"x" * 100000)
        self.assertTrue(out.startswith(b"HTTP/1.1 200 Connection established\r\n\r\nhello\n"))

    @deferredTest
    async def test_injectedHostGoesToTheTerminator(self) -> None:
        term = FakeTerminator()
        h = await self.proxy(
            ["api.github.com"],
            table={"api.github.com": ["10.0.0.1", "192.0.2.10"]},
            terminator=term,
            config=None,
        )
        injectGitHub(h)
        out = await exchange(h.port, b"CONNECT api.github.com:443 HTTP/1.1\r\nHost: x\r\n\r\nhello")
        self.assertEqual(out, b"HTTP/1.1 200 Connection established\r\n\r\nterminated:hello")
        self.assertEqual(term.calls, [("api.github.com", ["192.0.2.10"])])
        self.assertEqual(h.dialer.dialled, [])
        self.assertEqual(term.fed[0], ("made", True))
        self.assertIn(("data", b"hello"), term.fed)
        out = await exchange(h.port, socksConnect(b"api.github.com", 443) + b"hi")
        self.assertEqual(out, b"\x05\x00" + OK + b"terminated:hi")

    @deferredTest
    async def test_injectedHostWithoutTerminatorRefused(self) -> None:
        h = await self.proxy(["api.github.com"], table={"api.github.com": ["192.0.2.10"]})
        injectGitHub(h)
        out = await exchange(h.port, b"CONNECT api.github.com:443 HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertIn(b"403 Forbidden", out)
        self.assertIn(b"without the TLS terminator", out)
        self.assertEqual(h.dialer.dialled, [])

    @deferredTest
    async def test_theTerminatorAloneSaysWhichTunnelIsTerminated(self) -> None:
        # The connection's config has an inject rule for api.github.com, but
        # the terminator (the routes in force now) says no: the proxy asks it
        # alone, once per tunnel, and splices the tunnel as for any listed host.
        term = FakeTerminator(hosts=())
        h = await self.proxy(["api.github.com"], table={"api.github.com": ["192.0.2.10"]}, terminator=term)
        injectGitHub(h)
        out = await exchange(h.port, b"CONNECT api.github.com:443 HTTP/1.1\r\nHost: x\r\n\r\nhello")
        self.assertEqual(out, b"HTTP/1.1 200 Connection established\r\n\r\nhello")
        self.assertEqual(term.asked, [("api.github.com", 443)])
        self.assertEqual(term.calls, [])
        self.assertEqual(len(h.dialer.dialled), 1)

    @deferredTest
    async def test_aHostTheTerminatorInjectsIsHandedOverOnItsPortOnly(self) -> None:
        # No inject rule in the connection's config: the terminator's yes is
        # what hands the tunnel over, and its no on another port is dialled.
        term = FakeTerminator(hosts=("echo.example.org",))
        h = await self.proxy(
            ["echo.example.org:443", "echo.example.org:8443"],
            routes=[("192.0.2.10", 443), ("192.0.2.10", 8443)],
            terminator=term,
        )
        out = await exchange(h.port, b"CONNECT echo.example.org:443 HTTP/1.1\r\nHost: x\r\n\r\nhello")
        self.assertEqual(out, b"HTTP/1.1 200 Connection established\r\n\r\nterminated:hello")
        out = await exchange(h.port, b"CONNECT echo.example.org:8443 HTTP/1.1\r\nHost: x\r\n\r\nplain")
        self.assertEqual(out, b"HTTP/1.1 200 Connection established\r\n\r\nplain")
        self.assertEqual(term.asked, [("echo.example.org", 443), ("echo.example.org", 8443)])
        self.assertEqual(term.calls, [("echo.example.org", ["192.0.2.10"])])
        self.assertEqual(len(h.dialer.dialled), 1)

    @deferredTest
    async def test_peerRefused(self) -> None:
        @implementer(IPeerChecker)
        class NotYou:
            def check(self, client: tuple[str, int], server: tuple[str, int]) -> str:
                return "its socket belongs to uid 4242, not 0"

        h = await self.proxy(["echo.example.org"], peers=NotYou())
        out = await exchange(h.port, b"CONNECT echo.example.org:443 HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertEqual(out, b"")
        rec = h.records()[-1]
        self.assertEqual((rec["event"], rec["reason"]), ("peer", "its socket belongs to uid 4242, not 0"))

    @deferredTest
    async def test_reloadAppliesToNewConnectionsOnly(self) -> None:
        h = await self.proxy(["echo.example.org"])
        first = Collector(b"CONNECT echo.example.org:443 HTTP/1.1\r\nHost: x\r\n\r\n")
        await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", h.port), first)
        await first.until(b"200")
        from tests.support.egress_fixtures import domainsToml, makeConfig

        h.factory.holder.swap(makeConfig(domainsToml(["other.example.org"])))
        out = await exchange(h.port, b"CONNECT echo.example.org:443 HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertIn(b"403", out)
        first.transport.write(b"still open")
        await first.until(b"still open")
        first.transport.loseConnection()
        await first.done


async def sleep(seconds: float) -> None:
    d: Deferred[None] = Deferred()
    reactor.callLater(seconds, d.callback, None)
    await d


class HttpTestsCopyLoop(HttpTests):
    """The same tunnels on Twisted's copy loop instead of splice(2)."""

    spliceFast = False


class SocksTestsCopyLoop(SocksTests):
    spliceFast = False


class ForwardTests(TestCase):
    """Absolute-form forwarding on raw sockets: keep-alive, Host, hop-by-hop headers, bodies, framing."""

    async def web(self) -> ProxyHarness:
        import tempfile

        from tests.support.egress_servers import webSite

        site = await listen(webSite(tempfile.mkdtemp(prefix="egress-fwd-")))
        self.addCleanup(site.stopListening)
        dialer = MappedDialer(reactor)
        dialer.route("192.0.2.80", 80, site.getHost().port)
        h = ProxyHarness(["web.example.org"], FixedResolver({"web.example.org": ["192.0.2.80"]}), dialer)
        await h.start()
        self.addCleanup(h.stop)
        return h

    @staticmethod
    def responses(out: bytes) -> list[tuple[bytes, Any]]:
        import json as _json

        found: list[tuple[bytes, Any]] = []
        while out:
            head, _, rest = out.partition(b"\r\n\r\n")
            length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
            body, out = rest[:length], rest[length:]
            found.append((head.split(b"\r\n")[0], _json.loads(body) if body.startswith(b"{") else body))
        return found

    @deferredTest
    async def test_keepAliveHostAndHopByHop(self) -> None:
        h = await self.web()
        first = (
            b"GET http://web.example.org/headers?a=1 HTTP/1.1\r\nHost: evil.example.net\r\n"
            b"Proxy-Authorization: Basic c3J0OnBsYWNlaG9sZGVy\r\nProxy-Connection: keep-alive\r\n"
            b"Connection: keep-alive, X-Hop\r\nX-Hop: 1\r\nUpgrade: h2c\r\nTE: trailers\r\nX-Kept: yes\r\n"
            b"Proxy-Anything: x\r\n\r\n"
        )
        second = b"POST http://web.example.org/headers HTTP/1.1\r\nHost: web.example.org\r\nContent-Length: 5\r\n\r\nhello"
        third = (
            b"PUT http://web.example.org/headers HTTP/1.1\r\nHost: web.example.org\r\nTransfer-Encoding: chunked\r\n"
            b"Connection: close\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
        )
        out = await exchange(h.port, first + second + third)
        (s1, b1), (s2, b2), (s3, b3) = self.responses(out)
        self.assertEqual((s1, s2, s3), (b"HTTP/1.1 200 OK",) * 3)
        names = {k.lower(): v for k, v in b1["headers"]}
        self.assertEqual(names["host"], "web.example.org")
        self.assertEqual(b1["uri"], "/headers?a=1")
        for dropped in ("proxy-authorization", "proxy-connection", "proxy-anything", "x-hop", "upgrade", "te", "authorization"):
            self.assertNotIn(dropped, names)
        self.assertEqual(names["x-kept"], "yes")
        self.assertEqual((b2["method"], b2["body"]), ("POST", "hello"))
        self.assertEqual((b3["method"], b3["body"]), ("PUT", "abcde"))
        forwards = [r for r in h.records() if r["event"] == "forward"]
        self.assertEqual([r["up"] for r in forwards], [0, 5, 5])

    @deferredTest
    async def test_ambiguousFramingRefused(self) -> None:
        h = await self.web()
        for head in (
            b"POST http://web.example.org/headers HTTP/1.1\r\nHost: web.example.org\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            b"POST http://web.example.org/headers HTTP/1.1\r\nHost: web.example.org\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
            b"POST http://web.example.org/headers HTTP/1.1\r\nHost: web.example.org\r\nContent-Length: +3\r\n\r\nabc",
            b"POST http://web.example.org/headers HTTP/1.1\r\nHost: web.example.org\r\nTransfer-Encoding: chunked\r\n\r\n0x3\r\nabc\r\n0\r\n\r\n",
        ):
            out = await exchange(h.port, head)
            self.assertTrue(out.startswith(b"HTTP/1.1 400 Bad Request"), (head, out[:200]))

    @deferredTest
    async def test_forwardRefusedAndUnreachable(self) -> None:
        h = await self.web()
        out = await exchange(h.port, b"GET http://example.net/ HTTP/1.1\r\nHost: example.net\r\n\r\n")
        self.assertIn(b"403 Forbidden", out)
        self.assertIn(b"example.net:80 is not on the sandbox's allow list", out)
        h.resolver.table["web.example.org"] = [__import__("ipaddress").ip_address("198.51.100.9")]
        out = await exchange(h.port, b"GET http://web.example.org:8080/ HTTP/1.1\r\nHost: web.example.org\r\n\r\n")
        self.assertIn(b"502 Bad Gateway", out)


class ServiceTests(TestCase):
    @deferredTest
    async def test_listenChangeNeedsARestartAndSaysSo(self) -> None:
        from twisted.logger import ILogObserver, LogEvent, globalLogPublisher

        from tests.support.egress_fixtures import domainsToml, makeConfig

        h = ProxyHarness(["a.example.org"])
        await h.start()
        self.addCleanup(h.stop)
        seen: list[LogEvent] = []
        # Any callable observes; the stubs ask for the interface.
        observer = cast(ILogObserver, seen.append)
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        h.factory.holder.swap(makeConfig(domainsToml(["a.example.org"], port=4321)))
        self.assertEqual(h.service.endpoint, "tcp:0:interface=127.0.0.1")
        h.service.endpoint = None  # as the service runs it: from the config
        h.factory.holder.swap(makeConfig(domainsToml(["a.example.org"], port=4322)))
        warnings = [e for e in seen if "until agentsandbox restarts" in e.get("log_format", "")]
        self.assertEqual(len(warnings), 1)
        self.assertEqual(warnings[0]["new"], "tcp:4322:interface=127.0.0.1")
        # the port it listens on is unchanged and still serves
        out = await exchange(h.port, b"CONNECT b.example.org:443 HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertIn(b"403", out)

    @deferredTest
    async def test_socksInjectRefusalIsRuleset(self) -> None:
        h = ProxyHarness(["api.github.com"], FixedResolver({"api.github.com": ["192.0.2.10"]}))
        await h.start()
        self.addCleanup(h.stop)
        injectGitHub(h)
        out = await exchange(h.port, socksConnect(b"api.github.com", 443))
        self.assertEqual(out, b"\x05\x00" + socksReply(2))


# --------------------------------------------------------------------------- the door's phases
# The front door's phases (``proxy.Phase``): named, switched in one place, and the
# spliced hot path one bound call.


from agentsandbox.egress.proxy import FrontDoor, Phase  # noqa: E402
from tests.support.egress_fixtures import deferredTest, waitFor  # noqa: E402


class Phases(TestCase):
    async def proxy(self) -> ProxyHarness:
        server = await listen(Factory.forProtocol(Echo))
        self.addCleanup(server.stopListening)
        dialer = MappedDialer(reactor)
        dialer.route("192.0.2.10", 443, server.getHost().port)
        h = ProxyHarness(["echo.example.org"], FixedResolver({"echo.example.org": ["192.0.2.10"]}), dialer)
        await h.start()
        self.addCleanup(h.stop)
        return h

    async def door(self, h: ProxyHarness, send: bytes, until: bytes) -> tuple[FrontDoor, Collector]:
        from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol

        read = h.doorRead(len(send))
        c = Collector(send)
        await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", h.port), c)
        door = await read
        await c.until(until)
        return door, c

    @deferredTest
    async def test_a_spliced_door_reads_through_the_tunnel_itself(self) -> None:
        h = await self.proxy()
        door, client = await self.door(h, b"CONNECT echo.example.org:443 HTTP/1.1\r\nHost: x\r\n\r\nping", b"ping")
        self.assertIs(door.phase, Phase.SPLICED)
        assert door.tunnel is not None
        # The hot path: the transport's one lookup finds the tunnel's bound reader.
        self.assertEqual(vars(door)["dataReceived"], door.tunnel.fromClient)
        client.transport.loseConnection()
        await waitFor(lambda: door.phase is Phase.CLOSED and door.gone, "the door to close")

    @deferredTest
    async def test_a_refused_tunnel_goes_back_to_reading_then_closes(self) -> None:
        h = await self.proxy()
        door, _client = await self.door(h, b"CONNECT example.net:443 HTTP/1.1\r\nHost: x\r\n\r\n", b"allow list")
        await waitFor(lambda: door.phase is Phase.CLOSED, "the refused door to close")
        self.assertIsNone(door.tunnel)
        self.assertIsNone(door.terminated)

    def test_closed_is_the_last_phase(self) -> None:
        from agentsandbox.egress.proxy import EgressProxyFactory
        from agentsandbox.egress.testing import AllowAllPeers
        from tests.support.egress_fixtures import makeConfig

        door = FrontDoor(EgressProxyFactory(makeConfig(), reactor, peers=AllowAllPeers()))
        self.assertIs(door.phase, Phase.READING)
        door._become(Phase.CLOSED)
        door._become(Phase.DECIDING)
        self.assertIs(door.phase, Phase.CLOSED)
        self.assertTrue(door.gone)
