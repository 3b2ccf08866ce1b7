"""Allow-list and address decisions: reference §8's tables and an SSRF table.

The SSRF table drives the proxy's gate (``egress/gate.py``) directly, with a
table for a resolver: each name is resolved once and each answer classified
exactly as a live connection's would be, without a socket.
``tests/test_gate.py`` shows the proxy and ``check host`` give every
row the same verdict in the same words.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence

import pytest

from agentsandbox.allowlist import AllowList, decideHost
from agentsandbox.egress.gate import Gate
from agentsandbox.egress.grant import Grant
from agentsandbox.egress.resolve import addressesFromGetaddrinfo
from agentsandbox.egress.rules import classifyAddress, decideAddress, embeddedIPv4
from agentsandbox.egress.testing import FixedResolver
from tests.support.egress_fixtures import domainsToml, makeConfig


def decide(
    domains: Sequence[str], host: str, port: int, table: Mapping[str, Sequence[str]] | None = None
) -> tuple[list[str] | None, str]:
    """(granted addresses or None, refusal text) from the proxy's own gate."""
    config = makeConfig(domainsToml(domains))
    verdict = Gate.ofConfig(config).decideResolving(host, port, FixedResolver(table or {}).addresses)
    if isinstance(verdict, Grant):
        return [str(a) for a in verdict.addresses], ""
    return None, verdict.reason


# ---------------------------------------------------------------- reference §3.5 / §8 tables

GITHUB = ["github.com", "*.github.com", "127.0.0.1:6443", "[::1]:7000"]


@pytest.mark.parametrize(
    "host,port,allowed",
    [
        ("GitHub.com.", 443, True),
        ("a.b.github.com", 22, True),
        ("evilgithub.com", 443, False),
        ("github.com.evil.io", 443, False),
        ("github.com.example.com", 443, False),
        ("127.0.0.1", 6443, True),
        ("127.0.0.1", 6444, False),
        ("[::1]", 7000, True),
        ("localhost", 6443, False),
        ("", 443, False),
        ("[github.com]", 443, True),
        ("GITHUB.COM", 443, True),
    ],
)
def test_allowedTable(host: str, port: int, allowed: bool) -> None:
    assert (AllowList.parse(GITHUB).byName(host, port) is not None) is allowed


@pytest.mark.parametrize("ip", ["140.82.121.4", "10.1.2.3"])
def test_byNameAllowsPublicAndListedPrivate(ip: str) -> None:
    # 10.1.2.3 reaches the proxy only through the CIDR entry; 140.82.121.4 is public.
    got, why = decide(["git.example.org", "10.0.0.0/8"], "git.example.org", 443, {"git.example.org": [ip]})
    assert got == [ip], why


@pytest.mark.parametrize("ip", ["127.0.0.1", "::1", "0.0.0.0", "169.254.169.254", "fe80::1", "224.0.0.1"])
def test_byNameRefuses(ip: str) -> None:
    got, why = decide(["git.example.org"], "git.example.org", 443, {"git.example.org": [ip]})
    assert got is None
    assert "git.example.org" in why and ip in why and "sandbox.domains" in why


# ---------------------------------------------------------------- SSRF table (security-tests §5)

NAME = "target.example.org"

SSRF = [
    # (case, answers the resolver gives, expected: list dialled or None for refused)
    ("public v4", ["93.184.216.34"], ["93.184.216.34"]),
    ("public v6", ["2606:2800:220:1::1"], ["2606:2800:220:1::1"]),
    ("loopback", ["127.0.0.1"], None),
    ("loopback top", ["127.255.255.255"], None),
    ("loopback v6", ["::1"], None),
    ("metadata", ["169.254.169.254"], None),
    ("link-local v4", ["169.254.0.1"], None),
    ("link-local v6", ["fe80::1"], None),
    ("unspecified", ["0.0.0.0"], None),
    ("this network", ["0.1.2.3"], None),
    ("unspecified v6", ["::"], None),
    ("broadcast", ["255.255.255.255"], None),
    ("multicast", ["224.0.0.1"], None),
    ("multicast v6", ["ff02::2"], None),
    ("reserved 240/4", ["240.0.0.1"], None),
    ("rfc1918 10", ["10.0.0.1"], None),
    ("rfc1918 172.16", ["172.16.0.1"], None),
    ("rfc1918 172.31 edge", ["172.31.255.255"], None),
    ("172.32 is public", ["172.32.0.1"], ["172.32.0.1"]),
    ("rfc1918 192.168", ["192.168.1.1"], None),
    ("cgnat low edge", ["100.64.0.0"], None),
    ("cgnat high edge", ["100.127.255.255"], None),
    ("below cgnat", ["100.63.255.254"], ["100.63.255.254"]),
    ("above cgnat", ["100.128.0.1"], ["100.128.0.1"]),
    ("ula", ["fc00::1"], None),
    ("ula fd", ["fd12:3456::1"], None),
    ("site-local v6", ["fec0::1"], None),
    ("v4-mapped loopback", ["::ffff:127.0.0.1"], None),
    ("v4-mapped metadata", ["::ffff:169.254.169.254"], None),
    ("v4-mapped private", ["::ffff:10.0.0.1"], None),
    ("v4-mapped public", ["::ffff:93.184.216.34"], ["::ffff:5db8:d822"]),
    ("v4-compatible loopback", ["::127.0.0.1"], None),
    ("nat64 loopback", ["64:ff9b::7f00:1"], None),
    ("nat64 metadata", ["64:ff9b::a9fe:a9fe"], None),
    ("nat64 private", ["64:ff9b::a00:1"], None),
    ("nat64 local-use prefix", ["64:ff9b:1::1"], None),
    ("64:ff9c is not nat64", ["64:ff9c::1"], ["64:ff9c::1"]),
    ("6to4 loopback", ["2002:7f00:1::1"], None),
    ("6to4 private", ["2002:c0a8:101::1"], None),
    ("teredo private server", ["2001:0:a00:1::1"], None),
    ("teredo loopback client", ["2001:0:5db8:d822:0:0:80ff:fffe"], None),
    ("documentation v4 (test stand-in) passes", ["192.0.2.1"], ["192.0.2.1"]),
    ("benchmarking", ["198.18.0.1"], None),
    ("ietf protocol assignments", ["192.0.0.8"], None),
    ("discard-only v6", ["100::1"], None),
    ("loopback then public: public dialled", ["127.0.0.1", "93.184.216.34"], ["93.184.216.34"]),
    ("metadata then public v6", ["169.254.169.254", "2606:2800:220:1::1"], ["2606:2800:220:1::1"]),
    ("only private answers", ["10.0.0.1", "192.168.0.1", "fd00::1"], None),
    ("duplicates kept in order", ["93.184.216.34", "93.184.216.35"], ["93.184.216.34", "93.184.216.35"]),
]


@pytest.mark.parametrize("case,answers,expected", SSRF, ids=[c[0] for c in SSRF])
def test_ssrfTable(case: str, answers: list[str], expected: list[str] | None) -> None:
    got, why = decide([NAME], NAME, 443, {NAME: answers})
    assert got == expected, (case, why)
    if expected is None:
        assert NAME in why and "sandbox.domains" in why
        assert any(str(ipaddress.ip_address(a)) in why for a in answers)


# Names that are IP spellings: Python's resolver accepts them, so the allow
# list sees a *name*, and the address it resolves to is what gets classified.
SPELLINGS = ["2130706433", "0177.0.0.1", "0x7f.1", "0x7f000001", "127.1", "017700000001"]


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_ipSpellingsAsNamesAreClassifiedByTheirAddress(spelling: str) -> None:
    answers = addressesFromGetaddrinfo(spelling, 443)  # the real system resolver
    assert ipaddress.ip_address("127.0.0.1") in answers
    got, why = decide([spelling], spelling, 443, {spelling: [str(a) for a in answers]})
    assert got is None and "loopback" in why


@pytest.mark.parametrize(
    "host,canonical",
    [
        ("Target.Example.ORG.", NAME),
        ("[target.example.org]", NAME),
        ("TARGET.example.org", NAME),
    ],
)
def test_normalisedNamesMatchAndAreStillChecked(host: str, canonical: str) -> None:
    got, _ = decide([NAME], host, 443, {canonical: ["93.184.216.34"]})
    assert got == ["93.184.216.34"]
    got, why = decide([NAME], host, 443, {canonical: ["10.0.0.1"]})
    assert got is None and canonical in why


def test_punycodeName() -> None:
    host = "bücher.example.org"
    puny = "xn--bcher-kva.example.org"
    got, _ = decide([puny], host, 443, {puny: ["93.184.216.34"]})
    assert got == ["93.184.216.34"]
    got, why = decide(["example.org"], host, 443, {puny: ["93.184.216.34"]})
    assert got is None and puny in why


@pytest.mark.parametrize("bad", ["[[x]]", "a b.example.org", "x" * 300, "exa_mple..org", "-lead.example.org"])
def test_invalidHostsRefused(bad: str) -> None:
    got, why = decide(["example.org"], bad, 443)
    assert got is None and why


def test_cidrEntryOpensAPrivateRangeForNamesOnItsPortOnly() -> None:
    table = {"db.example.org": ["10.1.2.3"]}
    assert decide(["db.example.org", "10.0.0.0/8:5432"], "db.example.org", 5432, table)[0] == ["10.1.2.3"]
    got, why = decide(["db.example.org", "10.0.0.0/8:5432"], "db.example.org", 5433, table)
    assert got is None and "10.1.2.3" in why


def test_loopbackOnlyThroughAnExplicitIPPortEntry() -> None:
    assert decide(["127.0.0.1:6443"], "127.0.0.1", 6443)[0] == ["127.0.0.1"]
    assert decide(["127.0.0.1:6443"], "127.0.0.1", 6444)[0] is None
    # a name resolving to loopback is refused even with a loopback entry for another port
    got, why = decide(["k8s.example.org", "127.0.0.1:6443"], "k8s.example.org", 443, {"k8s.example.org": ["127.0.0.1"]})
    assert got is None and "explicit IP:port" in why
    # the same name on the listed port reaches it through the IP:port entry
    assert decide(["k8s.example.org", "127.0.0.1:6443"], "k8s.example.org", 6443, {"k8s.example.org": ["127.0.0.1"]})[0] == ["127.0.0.1"]
    assert decide(["localhost:6443"], "localhost", 6443, {"localhost": ["127.0.0.1", "::1"]})[0] == ["127.0.0.1", "::1"]


def test_ipLiteralTargetsAreClassifiedToo() -> None:
    got, _ = decide(["10.1.2.3"], "10.1.2.3", 443)
    assert got == ["10.1.2.3"]  # an IP entry covers its own address
    got, _ = decide(["93.184.216.34"], "93.184.216.34", 443)
    assert got == ["93.184.216.34"]
    # a v4-mapped spelling of a listed loopback literal is another host string: refused by name
    got, _ = decide(["127.0.0.1:6443"], "[::ffff:127.0.0.1]", 6443)
    assert got is None


def test_unresolvableNameRefused() -> None:
    got, why = decide(["gone.example.org"], "gone.example.org", 443, {})
    assert got is None and "gone.example.org does not resolve" in why


def test_embeddings() -> None:
    assert embeddedIPv4(ipaddress.ip_address("93.184.216.34")) == []
    assert [str(v) for _, v in embeddedIPv4(ipaddress.ip_address("2002:7f00:1::"))] == ["127.0.0.1"]
    cls = classifyAddress(ipaddress.ip_address("64:ff9b::7f00:1"))
    assert cls is not None and cls.isLoopback and "NAT64" in cls.describe()


def test_decideAddressNamesHostAddressAndRule() -> None:
    d = decideAddress(AllowList.parse([NAME]), NAME, 443, ipaddress.ip_address("10.9.8.7"), None)
    assert not d.allowed
    assert NAME in d.reason and "10.9.8.7" in d.reason and "10.0.0.0/8" in d.reason and "'10.9.8.7/32:443'" in d.reason


def test_decideHostRefusalNamesTheKey() -> None:
    d = decideHost(AllowList.parse([]), "example.net", 8080)
    assert not d.allowed and "example.net:8080" in d.reason and "'example.net:8080'" in d.reason and "sandbox.domains" in d.reason


def test_checkHostResolvingWordsEachAddress(capsys: pytest.CaptureFixture[str]) -> None:
    from agentsandbox.commands import _checkHost

    config = makeConfig(domainsToml(["localhost:6443", "127.0.0.1:6443", "2130706433"]))
    table = FixedResolver({"localhost": ["127.0.0.1"], "2130706433": ["127.0.0.1"]})
    assert _checkHost(config, "localhost:6443", True, table.addresses) == 0
    out = capsys.readouterr().out
    assert out.startswith("allowed by name:") and "dial    127.0.0.1" in out
    assert _checkHost(config, "2130706433", True, table.addresses) == 1
    assert "loopback" in capsys.readouterr().out
    assert _checkHost(config, "example.net", True, table.addresses) == 1
    assert "sandbox.domains" in capsys.readouterr().out
    assert _checkHost(config, "127.0.0.1:6443", True, table.addresses) == 0
