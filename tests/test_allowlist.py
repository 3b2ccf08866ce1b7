"""The allow-list matcher: entries, canonical hosts, string matching without DNS."""

from __future__ import annotations

import ipaddress

import pytest

from agentsandbox.allowlist import AllowList, Entry, EntryError, canonicalHost, isLoopbackName

LIST = AllowList.parse(
    [
        "github.com",
        "*.github.com",
        "127.0.0.1:6443",
        "[::1]:7000",
        "10.0.0.0/8:443",
        "[fd00::/8]:22",
        "registry.example.org:5000",
    ]
)

ALLOWED = [
    ("GitHub.com.", 443),
    ("github.com", 22),
    ("a.b.github.com", 22),
    ("127.0.0.1", 6443),
    ("[::1]", 7000),
    ("0:0::1", 7000),
    ("10.1.2.3", 443),
    ("fd00::5", 22),
    ("registry.example.org", 5000),
]
REFUSED = [
    ("evilgithub.com", 443),
    ("github.com.evil.io", 443),
    ("github.com.example.com", 443),
    ("127.0.0.1", 6444),
    ("localhost", 6443),
    ("10.1.2.3", 80),
    ("registry.example.org", 443),
    ("", 443),
    ("2130706433", 6443),
    ("0x7f.1", 6443),
    ("fd00::5", 23),
    ("bad host", 443),
]


@pytest.mark.parametrize(("host", "port"), ALLOWED)
def test_allowed(host: str, port: int) -> None:
    assert LIST.byName(host, port) is not None


@pytest.mark.parametrize(("host", "port"), REFUSED)
def test_refused(host: str, port: int) -> None:
    assert LIST.byName(host, port) is None


def test_a_wildcard_never_matches_its_apex() -> None:
    only = AllowList.parse(["*.example.com"])
    assert only.byName("a.example.com", 443) is not None
    assert only.byName("example.com", 443) is None


def test_byAddress_uses_cidr_and_ip_entries_only() -> None:
    ip = ipaddress.ip_address
    assert LIST.byAddress(ip("10.9.9.9"), 443) is not None
    assert LIST.byAddress(ip("::ffff:10.9.9.9"), 443) is not None
    assert LIST.byAddress(ip("10.9.9.9"), 80) is None
    assert LIST.byAddress(ip("140.82.121.4"), 443) is None
    assert LIST.byAddress(ip("127.0.0.1"), 6443) is not None


@pytest.mark.parametrize(
    ("text", "canon"),
    [
        ("Example.ORG.", "example.org"),
        ("[::1]", "::1"),
        ("bücher.example", "xn--bcher-kva.example"),
        ("xn--bcher-kva.example", "xn--bcher-kva.example"),
    ],
)
def test_canonical(text: str, canon: str) -> None:
    assert canonicalHost(text) == canon


@pytest.mark.parametrize(
    "text", ["", "*", "*:443", "a.*.b", "*.*.b", "[::1", "[::1]x", "h:0", "h:x", "10.0.0.0/33", "-a.example.com"]
)
def test_bad_entries(text: str) -> None:
    with pytest.raises(EntryError):
        Entry.parse(text)


def test_loopback_names() -> None:
    for h in ("localhost", "LOCALHOST.", "a.localhost", "127.0.0.2", "::1", "[::1]", "::ffff:127.0.0.1"):
        assert isLoopbackName(h), h
    for h in ("example.org", "10.0.0.1", "localhost.example.org"):
        assert not isLoopbackName(h), h
