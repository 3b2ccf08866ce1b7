"""Where a check and its consumer read the same input (issue 10): the egress side.

Each test tries spellings that a check and its consumer could read differently
against the real consumer:

- the resolver: glibc's ``getaddrinfo`` in a private network namespace whose
  resolver has a search domain and a DNS server the test runs, so an allowed
  name that a search domain would extend is seen to be extended by libc and not
  by the proxy;
- the dialer: the proxy with the system resolver and the default TCP dialer,
  SOCKS5 and CONNECT spellings of an allowed loopback origin, asserting the
  address dialled is the one the decided name resolves to, and every other
  spelling is refused before any dial; curl's own spellings too;
- ``agentsandbox check host`` against the proxy's answer to the same target.

docs/egress.md ("Where a check and its consumer read the same input") lists
each pair and its verdict.
"""

from __future__ import annotations

import contextlib
import io
import ipaddress
import os
import struct

import pytest
from twisted.internet.protocol import Factory
from twisted.trial.unittest import SkipTest, TestCase
from twisted.web.resource import Resource
from twisted.web.server import Site
from twisted.web.static import Data

from agentsandbox.allowlist import (
    AllowList,
    Entry,
    EntryError,
    canonicalHost,
    decideHost,
    parseAuthority,
)
from agentsandbox.commands import _checkHost
from agentsandbox.egress.dial import tcpDialer
from agentsandbox.egress.resolve import SystemResolver, addressesFromGetaddrinfo, hostsFileAddresses
from agentsandbox.egress.testing import FixedResolver
from tests.support.dns_namespace import resolveInNamespace
from tests.support.egress_fixtures import (
    CURL,
    Echo,
    ProxyHarness,
    curl,
    deferredTest,
    domainsToml,
    exchange,
    listen,
    makeConfig,
    reactor,
)

# --------------------------------------------------------------------------- the name, as a string


@pytest.mark.parametrize(
    "host",
    [
        " example.org",
        "example.org ",
        "example.org\n",
        "example\n.org",
        "example.org\x0b",
        "\x0cexample.org",
        "example.org\x00",
        "example.org%00",
        "example%2eorg",
        "example.org..",
        "a..example.org",
        ".example.org",
        "fe80::1%eth0",
        "[fe80::1%25eth0]",
        "a" * 64 + ".example.org",
        ("a" * 60 + ".") * 5 + "org",
        "exa\ufffdmple.org",
    ],
)
def test_hostsWithASecondReadingAreNotHostNames(host: str) -> None:
    """Refused, not read as the name inside: a string a resolver or a client could
    read differently (``$`` before a final newline, a stripped space, a zone id)."""
    with pytest.raises(EntryError):
        canonicalHost(host)
    allow = AllowList.parse(["example.org", "*.example.org", "[fe80::/10]:443"])
    assert not decideHost(allow, host, 443).allowed


@pytest.mark.parametrize(
    "host,canonical",
    [
        ("EXAMPLE.org", "example.org"),
        ("example.org.", "example.org"),
        ("[example.org]", "example.org"),
        ("b\u00fccher.example.org", "xn--bcher-kva.example.org"),
        ("\uff45xample.org", "example.org"),  # fullwidth e: IDNA maps it, and that one name is resolved
        ("example\u3002org", "example.org"),  # ideographic full stop is a dot to IDNA
        ("[::FFFF:127.0.0.1]", str(ipaddress.ip_address("::ffff:127.0.0.1"))),
    ],
)
def test_oneCanonicalReadingIsTheNameResolved(host: str, canonical: str) -> None:
    decision = decideHost(AllowList.parse([canonical]), host, 443)
    assert decision.allowed and decision.host == canonical


@pytest.mark.parametrize(
    "target,expected",
    [
        ("example.org:443", ("example.org", 443)),
        ("[::1]:8443", ("::1", 8443)),
        ("example.org:0", None),
        ("example.org:+443", None),
        ("example.org:0443", None),
        ("example.org:65536", None),
        ("example.org:443\n", None),
        ("example.org:\uff14\uff14\uff13", None),
        ("example.org: 443", None),
        ("example.org", None),
        ("::1:443", None),
        ("[::1]", None),
        ("exa mple.org:443", None),
        ("user@example.org:443", None),
        ("example.org\x00:443", None),
    ],
)
def test_connectAuthority(target: str, expected: tuple[str, int] | None) -> None:
    assert parseAuthority(target) == expected


@pytest.mark.parametrize(
    "target,expected",
    [
        ("example.org", ("example.org", 443)),
        ("::1", ("::1", 443)),
        ("[::1]", ("::1", 443)),
        ("example.org:80", ("example.org", 80)),
        ("fe80::1:nope", None),
        ("example.org:+80", None),
    ],
)
def test_checkAuthorityDefaultsThePort(target: str, expected: tuple[str, int] | None) -> None:
    assert parseAuthority(target, 443) == expected


@pytest.mark.parametrize("entry", ["example.org:+443", "example.org:0443", "example.org:\uff14\uff14\uff13", "[::1]:08443"])
def test_entryPortsArePlainDigits(entry: str) -> None:
    with pytest.raises(EntryError, match="is not a number from 1 to 65535"):
        Entry.parse(entry)


# --------------------------------------------------------------------------- the resolver


def test_hostsFileIsReadAsGetaddrinfoReadsIt(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "hosts")
    with open(path, "w") as f:
        f.write("# comment\n192.0.2.1 one.example.org One # trailing\n192.0.2.2\tone.example.org\n::1 six\n")
    assert hostsFileAddresses("one.example.org", path) == [ipaddress.ip_address("192.0.2.1"), ipaddress.ip_address("192.0.2.2")]
    assert hostsFileAddresses("one", path) == [ipaddress.ip_address("192.0.2.1")]
    assert hostsFileAddresses("comment", path) == []
    assert hostsFileAddresses("six", os.path.join(str(tmp_path), "absent")) == []


def test_numericSpellingsAreReadAsTheCLibraryReadsThem() -> None:
    for spelling in ("2130706433", "0x7f.1", "127.1", "0177.0.0.1"):
        assert addressesFromGetaddrinfo(spelling, 443) == [ipaddress.ip_address("127.0.0.1")]


def test_theResolverIsAskedExactlyTheNameTheAllowListMatched() -> None:
    """glibc with ``search corp.test`` and a real DNS server on loopback.

    ``a.example.com`` has no record; ``a.example.com.corp.test`` has one.  The
    allow list's ``*.example.com`` matched ``a.example.com``: libc's plain
    lookup answers for the search-extended name (the hole the old resolver had,
    shown here so the test proves something), the proxy's answers nothing.
    """
    table = {
        "a.example.com.corp.test": "203.0.113.7",
        "b.example.com": "203.0.113.8",
        "intranet.corp.test": "203.0.113.9",
    }
    try:
        got = resolveInNamespace(table, ["a.example.com", "b.example.com", "intranet", "localhost", "2130706433"])
    except RuntimeError as e:
        pytest.skip(f"no private network namespace here: {e}")
    results = got["results"]
    assert results["a.example.com"]["libc"] == ["203.0.113.7"], "the search list must be live for this test to mean anything"
    assert results["a.example.com"]["proxy"][0].startswith("error: a.example.com does not resolve")
    assert results["intranet"]["libc"] == ["203.0.113.9"]
    assert results["intranet"]["proxy"][0].startswith("error: intranet does not resolve")
    assert results["b.example.com"]["proxy"] == ["203.0.113.8"]
    assert results["localhost"]["proxy"] == ["127.0.0.1"]  # the hosts file still answers
    assert results["2130706433"]["proxy"] == ["127.0.0.1"]  # numeric, no lookup at all
    assert "intranet" in got["asked"] and "a.example.com" in got["asked"]


# --------------------------------------------------------------------------- the dialer


def socksRequest(name: bytes, port: int) -> bytes:
    return b"\x05\x01\x00" + b"\x05\x01\x00\x03" + bytes([len(name)]) + name + struct.pack("!H", port)


SOCKS_GRANTED = b"\x05\x00\x05\x00\x00\x01\x00\x00\x00\x00\x00\x00"


class DialedSpellingTests(TestCase):
    """The system resolver and the default dialer against a loopback echo origin."""

    async def setUpProxy(self) -> None:
        if not hostsFileAddresses("localhost") or ipaddress.ip_address("127.0.0.1") not in hostsFileAddresses("localhost"):
            raise SkipTest("/etc/hosts does not map localhost to 127.0.0.1")
        echo = await listen(Factory.forProtocol(Echo))
        self.addCleanup(echo.stopListening)
        self.echo = int(echo.getHost().port)
        self.proxy = ProxyHarness([f"localhost:{self.echo}"], SystemResolver(reactor), tcpDialer(reactor))  # type: ignore[arg-type]
        await self.proxy.start()
        self.addCleanup(self.proxy.stop)

    def dialled(self) -> list[tuple[str, str]]:
        return [(r["host"], r["address"]) for r in self.proxy.records() if r["event"] == "tunnel"]

    @deferredTest
    async def test_socksDomainSpellings(self) -> None:
        await self.setUpProxy()
        granted = [b"localhost", b"LOCALHOST", b"localhost.", "\uff4cocalhost".encode()]
        refused = [
            b"localhost..", b" localhost", b"localhost\x0b", b"localhost\x00", b"local\nhost",
            b"localhost%00", b"localhost\xff", b"127.0.0.1", b"[::1]", b"::ffff:127.0.0.1",
            b"2130706433", b"0x7f.1", b"127.1", b"fe80::1%lo", b"[fe80::1%25lo]", b"a" * 255,
        ]
        for name in granted:
            out = await exchange(self.proxy.port, socksRequest(name, self.echo) + b"ping", halfClose=True)
            self.assertEqual(out, SOCKS_GRANTED + b"ping", name)
        for name in refused:
            out = await exchange(self.proxy.port, socksRequest(name, self.echo) + b"ping", halfClose=False)
            self.assertTrue(out.startswith(b"\x05\x00\x05") and out[3] != 0 and b"ping" not in out, (name, out))
        out = await exchange(self.proxy.port, socksRequest(b"localhost", 0), halfClose=False)
        self.assertEqual(out[:4], b"\x05\x00\x05\x02", "port 0 is not a port")
        # Every grant dialled the one address the canonical name resolves to.
        self.assertEqual(self.dialled(), [("localhost", "127.0.0.1")] * len(granted))

    @deferredTest
    async def test_connectSpellings(self) -> None:
        await self.setUpProxy()
        p = self.echo
        granted = [f"localhost:{p}", f"LOCALHOST.:{p}", f"[localhost]:{p}"]
        refused = [
            f"localhost:0{p}", f"localhost:+{p}", f"localhost:{p + 65536}", "localhost:0",
            f"localhost..:{p}", f"127.0.0.1:{p}", f"[::1]:{p}", f"2130706433:{p}", f"0x7f.1:{p}",
            f"[fe80::1%25lo]:{p}", f"localhost%00:{p}", f"user@localhost:{p}",
        ]
        for target in granted:
            head = f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode()
            out = await exchange(self.proxy.port, head + b"ping", halfClose=True)
            self.assertEqual(out, b"HTTP/1.1 200 Connection established\r\n\r\nping", target)
        for target in refused:
            head = f"CONNECT {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
            out = await exchange(self.proxy.port, head + b"ping", halfClose=False)
            self.assertRegex(out, rb"^HTTP/1\.1 (400|403) ", target)
        self.assertEqual(self.dialled(), [("localhost", "127.0.0.1")] * len(granted))

    @deferredTest
    async def test_forwardSpellings(self) -> None:
        """The absolute-form URL's authority is read as CONNECT's is (port 80 when absent)."""
        root = Resource()
        root.putChild(b"x", Data(b"origin\n", "text/plain"))
        web = await listen(Site(root))
        self.addCleanup(web.stopListening)
        p = int(web.getHost().port)
        self.proxy = ProxyHarness([f"localhost:{p}", "localhost:80"], SystemResolver(reactor), tcpDialer(reactor))  # type: ignore[arg-type]
        await self.proxy.start()
        self.addCleanup(self.proxy.stop)
        for authority in (f"localhost:{p}", f"LOCALHOST.:{p}", f"u@localhost:{p}"):
            host = authority.rpartition("@")[2]
            head = f"GET http://{authority}/x HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
            out = await exchange(self.proxy.port, head, halfClose=False)
            self.assertTrue(out.startswith(b"HTTP/1.1 200 ") and out.endswith(b"origin\n"), (authority, out))
        # ':0' was read by urlsplit as no port (so 80, which is allowed here), ':0080' as 80.
        for authority in ("localhost:0", "localhost:0080", f"localhost:0{p}", "localhost:+80", "::1:80", "localhost%00:80"):
            head = f"GET http://{authority}/x HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode()
            out = await exchange(self.proxy.port, head, halfClose=False)
            self.assertRegex(out, rb"^HTTP/1\.1 (400|403) ", authority)
        self.assertTrue(all(a == "127.0.0.1" for _, a in self.dialled()))

    @deferredTest
    async def test_curlSpellingsThroughSocksAndConnect(self) -> None:
        """curl's own readings of the URL's host, through both front doors."""
        if not os.path.exists(CURL):
            raise SkipTest(f"{CURL} is not installed (apt install curl)")
        root = Resource()
        root.putChild(b"x", Data(b"origin\n", "text/plain"))
        web = await listen(Site(root))
        self.addCleanup(web.stopListening)
        port = int(web.getHost().port)
        self.proxy = ProxyHarness([f"localhost:{port}"], SystemResolver(reactor), tcpDialer(reactor))  # type: ignore[arg-type]
        await self.proxy.start()
        self.addCleanup(self.proxy.stop)
        proxies = [
            ["--socks5-hostname", f"127.0.0.1:{self.proxy.port}"],
            ["--proxytunnel", "--proxy", f"http://127.0.0.1:{self.proxy.port}"],
            ["--proxy", f"http://127.0.0.1:{self.proxy.port}"],  # the forward path
        ]
        for via in proxies:
            for host in ("localhost", "LOCALHOST", "localhost."):
                out, err, code = await curl(*via, f"http://{host}:{port}/x")
                self.assertEqual((code, out), (0, b"origin\n"), (via, host, err))
            for host in ("127.0.0.1", "[::1]", "2130706433", "localhost..", "[fe80::1%25lo]"):
                out, err, code = await curl("--fail", *via, f"http://{host}:{port}/x")
                self.assertNotEqual(code, 0, (via, host))
                self.assertNotIn(b"origin", out)
        self.assertTrue(all(a == "127.0.0.1" for _, a in self.dialled()))


# --------------------------------------------------------------------------- check vs the proxy


CHECKED = ["example.org", "*.example.com", "[::1]:8443"]


def checkSays(target: str) -> bool:
    config = makeConfig(domainsToml(CHECKED))
    with contextlib.redirect_stdout(io.StringIO()):
        return _checkHost(config, target, resolve=False) == 0


class CheckAgreesWithTheProxy(TestCase):
    @deferredTest
    async def test_checkHostAndTheProxyDecideAlike(self) -> None:
        """For each target, ``check host`` allows it exactly when the proxy's CONNECT
        gets past the name decision (the test resolver knows no name, so an allowed
        name fails later, with 502, and a literal is dialled at a closed port)."""
        proxy = ProxyHarness(CHECKED, FixedResolver({}))
        await proxy.start()
        self.addCleanup(proxy.stop)
        targets = [
            "example.org:443", "EXAMPLE.org.:443", "example.org:+443", "example.org:0443",
            "example.org:0", "example.org:65536", "example.org..:443", "a.example.com:443",
            "example.com:443", "x.a.example.com:8443", "[::1]:8443", "[::1]:8444",
            "[0:0::1]:8443", "::1:8443", "xn--bcher-kva.example.com:443", "example.org%00:443",
            "-a.example.com:443", "a_b.example.com:443",
        ]
        for target in targets:
            head = f"CONNECT {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
            out = await exchange(proxy.port, head, halfClose=False)
            proxyAllows = not out.startswith((b"HTTP/1.1 400 ", b"HTTP/1.1 403 "))
            self.assertEqual(checkSays(target), proxyAllows, (target, out[:120]))
