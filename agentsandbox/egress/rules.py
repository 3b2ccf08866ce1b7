"""The egress allow list: parsing entries, canonical host names, and string matching.

Entries are ``host``, ``*.domain`` (strict subdomains, never the apex), ``host:port``,
``IP:port`` (IPv6 in brackets), and ``CIDR[:port]`` (IPv6 CIDR with a port in
brackets: ``[fd00::/8]:443``).  Matching a host name is a string comparison: no DNS
here.  IP literals compare as addresses, so ``[0:0::1]`` and ``::1`` are one host.

Stdlib only: the config loader and ``agentsandbox check`` use it outside the reactor.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_LABEL = re.compile(r"^(?!-)[a-z0-9_-]{1,63}(?<!-)$")


class EntryError(ValueError):
    """An allow-list entry that cannot be used; the message says why."""


def canonicalHost(host: str) -> str:
    """Lower case, brackets stripped, one trailing dot dropped, IDNA to ASCII.

    Raises EntryError for a host that no DNS name or IP literal can be.
    """
    h = host.strip()
    if h.startswith("[") and h.endswith("]"):
        h = h[1:-1]
    if h.endswith("."):
        h = h[:-1]
    if not h:
        raise EntryError("empty host")
    ip = parseIP(h)
    if ip is not None:
        return str(ip)
    try:
        h = h.encode("idna").decode("ascii") if not h.isascii() else h
    except UnicodeError as e:
        raise EntryError(f"{host!r} is not a valid host name ({e})") from None
    h = h.lower()
    if len(h) > 253 or not all(_LABEL.match(label) for label in h.split(".")):
        raise EntryError(f"{host!r} is not a valid host name")
    return h


def parseIP(text: str) -> IPAddress | None:
    """An IP literal in its strict form, or None.

    Only dotted-quad IPv4 and standard IPv6 count: ``2130706433`` or ``0x7f.1``
    are names here, so they must match a name entry and are then resolved and
    classified by address like any name.
    """
    t = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    if "%" in t:
        return None
    try:
        return ipaddress.ip_address(t)
    except ValueError:
        return None


def unwrapMapped(ip: IPAddress) -> IPAddress:
    """The IPv4 address inside an IPv4-mapped IPv6 address, else the address."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def isLoopbackName(host: str) -> bool:
    """``localhost``, ``*.localhost`` or a loopback IP literal (IPv4-mapped too)."""
    h = host.lower().strip("[]")
    if h.endswith("."):
        h = h[:-1]
    if h == "localhost" or h.endswith(".localhost"):
        return True
    ip = parseIP(h)
    return ip is not None and unwrapMapped(ip).is_loopback


def _parsePort(text: str, entry: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise EntryError(f"{entry!r}: port {text!r} is not a number from 1 to 65535")
    return int(text)


@dataclass(frozen=True)
class Entry:
    """One allow-list entry, parsed.  Exactly one of host, suffix and network is set."""

    text: str
    host: str | None = None
    suffix: str | None = None
    network: IPNetwork | None = None
    port: int | None = None

    @classmethod
    def parse(cls, text: str) -> Entry:
        raw = text.strip()
        if not raw:
            raise EntryError("an empty entry allows nothing; remove it")
        if raw == "*" or raw.startswith("*:"):
            raise EntryError(f"{raw!r} would allow every host; list the hosts instead")
        hostPart, port = _splitPort(raw)
        if "/" in hostPart:
            try:
                net = ipaddress.ip_network(hostPart.strip("[]"), strict=False)
            except ValueError as e:
                raise EntryError(f"{raw!r} is not a CIDR block ({e})") from None
            return cls(text=raw, network=net, port=port)
        if hostPart.startswith("*."):
            rest = hostPart[2:]
            if "*" in rest:
                raise EntryError(f"{raw!r}: only one leading '*.' is allowed")
            return cls(text=raw, suffix=canonicalHost(rest), port=port)
        if "*" in hostPart:
            raise EntryError(f"{raw!r}: a wildcard is allowed only as a leading '*.'")
        return cls(text=raw, host=canonicalHost(hostPart), port=port)

    @property
    def isAddressEntry(self) -> bool:
        return self.network is not None or (self.host is not None and parseIP(self.host) is not None)

    def matchesName(self, host: str, port: int) -> bool:
        """Does this entry allow ``host`` (canonical) on ``port``, by name alone?"""
        if self.port is not None and self.port != port:
            return False
        if self.suffix is not None:
            return host.endswith("." + self.suffix)
        if self.host is not None:
            return host == self.host
        ip = parseIP(host)
        return ip is not None and self.network is not None and _inNetwork(ip, self.network)

    def matchesAddress(self, ip: IPAddress, port: int) -> bool:
        """Does this entry allow a resolved address?  Only CIDR and IP entries do."""
        if self.port is not None and self.port != port:
            return False
        if self.network is not None:
            return _inNetwork(ip, self.network)
        if self.host is not None:
            own = parseIP(self.host)
            return own is not None and unwrapMapped(own) == unwrapMapped(ip)
        return False

    def opensLoopback(self) -> bool:
        """An entry that would reach loopback; those need an explicit port."""
        if self.host is not None:
            return isLoopbackName(self.host)
        if self.network is not None:
            net = self.network
            loop = (
                ipaddress.ip_network("127.0.0.0/8")
                if net.version == 4
                else ipaddress.ip_network("::1/128")
            )
            mapped = ipaddress.ip_network("::ffff:127.0.0.0/104")
            return net.overlaps(loop) or (net.version == 6 and net.overlaps(mapped))
        return self.suffix == "localhost"


def _inNetwork(ip: IPAddress, net: IPNetwork) -> bool:
    ip = unwrapMapped(ip)
    return ip.version == net.version and ip in net


def _splitPort(raw: str) -> tuple[str, int | None]:
    """Split ``host:port``; a bare IPv6 literal or CIDR has no port."""
    if raw.startswith("["):
        close = raw.find("]")
        if close < 0:
            raise EntryError(f"{raw!r}: '[' without ']'")
        rest = raw[close + 1 :]
        if not rest:
            return raw[1:close], None
        if not rest.startswith(":"):
            raise EntryError(f"{raw!r}: expected ':port' after ']'")
        return raw[1:close], _parsePort(rest[1:], raw)
    if raw.count(":") > 1:
        return raw, None
    if ":" in raw:
        host, _, port = raw.partition(":")
        return host, _parsePort(port, raw)
    return raw, None


@dataclass(frozen=True)
class AllowList:
    """The parsed allow list.  ``decide`` answers by name; no DNS."""

    entries: tuple[Entry, ...]

    @classmethod
    def parse(cls, texts: tuple[str, ...] | list[str]) -> AllowList:
        return cls(tuple(Entry.parse(t) for t in texts))

    def byName(self, host: str, port: int) -> Entry | None:
        """The first entry that allows ``host:port`` by name, or None."""
        try:
            h = canonicalHost(host)
        except EntryError:
            return None
        for entry in self.entries:
            if entry.matchesName(h, port):
                return entry
        return None

    def byAddress(self, ip: IPAddress, port: int) -> Entry | None:
        """The first CIDR or IP entry that allows a resolved address, or None."""
        for entry in self.entries:
            if entry.matchesAddress(ip, port):
                return entry
        return None
