"""Address classes: which resolved addresses the egress proxy reaches, and why not.

A name allowed by ``sandbox.domains`` (``agentsandbox.allowlist``) is resolved
once, and every address is classified here: public addresses pass; loopback,
private, link-local (cloud metadata), CGNAT and the other refused ranges pass
only through a CIDR or IP entry; IPv6 addresses that embed an IPv4 address
(mapped, NAT64, 6to4, Teredo) are classified by what they embed.

Stdlib only: ``check host``, the hook and the proxy's gate all decide with it.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from agentsandbox.allowlist import (
    DOMAINS_KEY,
    AllowList,
    Entry,
    IPAddress,
    IPNetwork,
    isLoopbackName,
    unwrapMapped,
)

# --------------------------------------------------------------------------- address classes
#
# Explicit range lists, not ``ipaddress.is_private``: the stdlib's notion of
# "private" changes between Python releases and counts the documentation ranges
# (192.0.2.0/24, 198.51.100.0/24, 203.0.113.0/24, 2001:db8::/32) as private,
# which would make the tests' stand-in upstream addresses unusable.  What the
# proxy refuses by name is exactly this table, and docs/egress.md repeats it.


@dataclass(frozen=True)
class AddressRange:
    """A range the proxy never reaches by name.  ``kind`` is what the refusal says."""

    network: IPNetwork
    kind: str

    @property
    def isLoopback(self) -> bool:
        return self.kind == "loopback"


def _ranges(*pairs: tuple[str, str]) -> tuple[AddressRange, ...]:
    return tuple(AddressRange(ipaddress.ip_network(net), kind) for net, kind in pairs)


#: Checked in order; the first match names the refusal, so the broadcast address
#: is reported as broadcast rather than as part of 240.0.0.0/4.
REFUSED_IPV4 = _ranges(
    ("255.255.255.255/32", "broadcast"),
    ("0.0.0.0/8", "unspecified"),
    ("127.0.0.0/8", "loopback"),
    ("169.254.0.0/16", "link-local (cloud metadata lives at 169.254.169.254)"),
    ("10.0.0.0/8", "private (RFC 1918)"),
    ("172.16.0.0/12", "private (RFC 1918)"),
    ("192.168.0.0/16", "private (RFC 1918)"),
    ("100.64.0.0/10", "shared address space (CGNAT, RFC 6598)"),
    ("192.0.0.0/24", "IETF protocol assignments (RFC 6890)"),
    ("198.18.0.0/15", "benchmarking (RFC 2544)"),
    ("224.0.0.0/4", "multicast"),
    ("240.0.0.0/4", "reserved (RFC 1112)"),
)

REFUSED_IPV6 = _ranges(
    ("::/128", "unspecified"),
    ("::1/128", "loopback"),
    ("fe80::/10", "link-local"),
    ("fec0::/10", "site-local (deprecated)"),
    ("fc00::/7", "unique local (ULA)"),
    ("ff00::/8", "multicast"),
    ("100::/64", "discard-only (RFC 6666)"),
    ("64:ff9b:1::/48", "local-use NAT64 (RFC 8215)"),
)

NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
SIX_TO_FOUR = ipaddress.IPv6Network("2002::/16")
TEREDO = ipaddress.IPv6Network("2001::/32")
IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")


def embeddedIPv4(ip: IPAddress) -> list[tuple[str, ipaddress.IPv4Address]]:
    """The IPv4 addresses an IPv6 address carries, with the mechanism's name.

    IPv4-mapped (``::ffff:a.b.c.d``), IPv4-compatible (``::a.b.c.d``), NAT64
    (``64:ff9b::a.b.c.d``), 6to4 (``2002:AABB:CCDD::``) and Teredo (server in
    bits 32-63, client inverted in the last 32 bits).  Each of these reaches the
    IPv4 address it embeds, so each embedded address is classified too.
    """
    if not isinstance(ip, ipaddress.IPv6Address):
        return []
    value = int(ip)
    low32 = ipaddress.IPv4Address(value & 0xFFFFFFFF)
    if ip.ipv4_mapped is not None:
        return [("IPv4-mapped", ip.ipv4_mapped)]
    if ip in NAT64:
        return [("NAT64", low32)]
    if ip.sixtofour is not None:
        return [("6to4", ip.sixtofour)]
    if ip.teredo is not None:
        server, client = ip.teredo
        return [("Teredo server", server), ("Teredo client", client)]
    if ip in IPV4_COMPATIBLE and value > 1:
        return [("IPv4-compatible", low32)]
    return []


@dataclass(frozen=True)
class AddressClass:
    """Why an address is refused by name: the range, its kind, and through what embedding."""

    address: IPAddress
    range: AddressRange
    via: str | None = None
    inner: IPAddress | None = None

    @property
    def isLoopback(self) -> bool:
        return self.range.isLoopback

    def describe(self) -> str:
        what = f"{self.range.kind} {self.range.network}"
        if self.via is not None:
            return f"{self.via} embedding of {self.inner}, which is {what}"
        return what


def _rangeOf(ip: IPAddress) -> AddressRange | None:
    table = REFUSED_IPV4 if ip.version == 4 else REFUSED_IPV6
    for r in table:
        if ip in r.network:
            return r
    return None


def classifyAddress(ip: IPAddress) -> AddressClass | None:
    """The refused range ``ip`` is in (after unwrapping embeddings), or None when public."""
    own = _rangeOf(ip)
    if own is not None:
        return AddressClass(ip, own)
    for via, inner in embeddedIPv4(ip):
        r = _rangeOf(inner)
        if r is not None:
            return AddressClass(ip, r, via, inner)
    return None


@dataclass(frozen=True)
class AddressDecision:
    """The verdict on one resolved address of an allowed name."""

    address: IPAddress
    allowed: bool
    reason: str
    entry: Entry | None = None
    refusedAs: AddressClass | None = None


def _explicitLoopbackEntry(entry: Entry | None) -> bool:
    return (
        entry is not None
        and entry.port is not None
        and entry.host is not None
        and isLoopbackName(entry.host)
    )


def decideAddress(
    allow: AllowList, host: str, port: int, ip: IPAddress, nameEntry: Entry | None
) -> AddressDecision:
    """May a connection for ``host:port`` (already allowed by ``nameEntry``) go to ``ip``?

    Public addresses pass.  Refused ranges pass only when a CIDR or IP entry
    covers the address on this port; loopback only through an explicit
    ``IP:port`` entry (or an explicit loopback ``name:port`` entry that the host
    itself matched, such as ``localhost:6443``).
    """
    cls = classifyAddress(ip)
    if cls is None:
        return AddressDecision(ip, True, f"{ip} is a public address", nameEntry)
    byAddr = allow.byAddress(ip, port)
    if cls.isLoopback:
        if byAddr is not None and byAddr.port is not None and byAddr.network is None:
            return AddressDecision(ip, True, f"{ip} is loopback, allowed by {byAddr.text!r}", byAddr, cls)
        if _explicitLoopbackEntry(nameEntry):
            assert nameEntry is not None
            return AddressDecision(
                ip, True, f"{ip} is loopback, allowed by {nameEntry.text!r}", nameEntry, cls
            )
        example = f"{unwrapMapped(ip)}:{port}" if ip.version == 4 or unwrapMapped(ip).version == 4 else f"[{ip}]:{port}"
        return AddressDecision(
            ip,
            False,
            f"{host} resolves to {ip}, which is {cls.describe()}; the sandbox reaches loopback "
            f"only through an explicit IP:port entry in {DOMAINS_KEY} (such as {example!r})",
            None,
            cls,
        )
    if byAddr is not None:
        return AddressDecision(
            ip, True, f"{ip} is {cls.describe()}, allowed by {byAddr.text!r}", byAddr, cls
        )
    shown = unwrapMapped(ip)
    example = f"{shown}/32:{port}" if shown.version == 4 else f"[{shown}/128]:{port}"
    return AddressDecision(
        ip,
        False,
        f"{host} resolves to {ip}, which is {cls.describe()}; the sandbox never reaches it by "
        f"name unless a CIDR entry in {DOMAINS_KEY} covers it (such as {example!r})",
        None,
        cls,
    )
