"""The sandbox's allow list (``sandbox.domains``): its grammar, canonical host names, and the name decision.

Entries are ``host``, ``*.domain`` (strict subdomains, never the apex), ``host:port``,
``IP:port`` (IPv6 in brackets), and ``CIDR[:port]`` (IPv6 CIDR with a port in
brackets: ``[fd00::/8]:443``).  Matching a host name is a string comparison: no DNS
here.  IP literals compare as addresses, so ``[0:0::1]`` and ``::1`` are one host.

This is the config's grammar, so it sits on the config's floor: ``config.py``
parses ``sandbox.domains`` with it once per config (``SandboxConfig.allowList``),
and the egress proxy's gate (``egress/gate.py``), ``check host``, the hook and
the renderers read that parse.  What an *address* is (loopback, private, the
metadata range) is the egress layer's: ``egress/rules.py``.

Stdlib only: the config loader, the hook and ``agentsandbox check`` use it outside the reactor.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from dataclasses import dataclass

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

#: One DNS label, matched with ``fullmatch``: ``re.match`` with ``$`` would
#: accept a label ending in a newline (``$`` matches before a final ``\n``).
_LABEL = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)")
_PORT = re.compile(r"[1-9][0-9]{0,4}")


class EntryError(ValueError):
    """An allow-list entry that cannot be used; the message says why."""


def canonicalHost(host: str) -> str:
    """Lower case, brackets stripped, one trailing dot dropped, IDNA to ASCII.

    Raises EntryError for a host that no DNS name or IP literal can be.  Nothing
    is stripped: a host with whitespace or control characters around it is not
    a host name, and reading it as the name inside would decide on a string the
    client never sent (config entries are stripped by ``Entry.parse``).
    """
    h = host
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
    if len(h) > 253 or not all(_LABEL.fullmatch(label) for label in h.split(".")):
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
    if not _PORT.fullmatch(text) or int(text) > 65535:
        # Plain digits only (no sign, no leading zero, no fullwidth digits); the
        # text is the one the Nix module's assertion repeats.
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

    def within(self, other: Entry) -> bool:
        """Does ``other`` allow everything this entry allows?

        How a user's entry is held to the machine's list (``machine.narrow``):
        ``api.example.com`` is within ``*.example.com``, ``*.a.example.com``
        within ``*.example.com``, ``10.0.0.0/24`` within ``10.0.0.0/8``, and a
        portless entry only within a portless one.  ``*.example.com`` is not
        within ``example.com`` (nor the other way round): a suffix entry never
        matches its own apex.
        """
        if other.port is not None and other.port != self.port:
            return False
        if self.host is not None:
            return other.matchesName(self.host, self.port or 0)
        if self.suffix is not None:
            return other.suffix is not None and (
                self.suffix == other.suffix or self.suffix.endswith("." + other.suffix)
            )
        assert self.network is not None
        if other.network is not None:
            return self.network.version == other.network.version and self.network.subnet_of(
                other.network  # type: ignore[arg-type]
            )
        if other.host is not None and self.network.num_addresses == 1:
            return other.matchesName(str(self.network.network_address), self.port or 0)
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


#: The config key every refusal by name points at.
DOMAINS_KEY = "sandbox.domains"


def parseAuthority(target: str, defaultPort: int | None = None) -> tuple[str, int] | None:
    """``host:port`` or ``[v6]:port`` (CONNECT's authority form), else None.

    With ``defaultPort``, a bare ``host``, ``[v6]`` or IPv6 literal takes it
    (``agentsandbox check host``).  The port is plain digits, 1 to 65535: ``+443``,
    ``0443``, ``443\n`` and fullwidth digits are refused, not read as 443.
    """
    if target.startswith("["):
        close = target.find("]")
        if close < 0:
            return None
        host, rest = target[1:close], target[close + 1 :]
        if not rest and defaultPort is not None:
            port = str(defaultPort)
        elif rest.startswith(":"):
            port = rest[1:]
        else:
            return None
    else:
        host, sep, port = target.rpartition(":")
        if sep and ":" in host:
            if defaultPort is None or parseIP(target) is None:
                return None
            host, port = target, str(defaultPort)
        elif not sep:
            if defaultPort is None:
                return None
            host, port = port, str(defaultPort)
    if not host or not _PORT.fullmatch(port) or int(port) > 65535:
        return None
    if _NOT_IN_HOST.search(host):
        return None
    return host, int(port)


_NOT_IN_HOST = re.compile(r"[/@?#\\\s\x00-\x1f\x7f]")


@dataclass(frozen=True)
class HostDecision:
    """The name half of a decision: the canonical host and the entry that allows it."""

    host: str
    port: int
    entry: Entry | None
    reason: str
    #: The entry that would allow the name, when what is missing is only an entry
    #: (not when the host is no host name or the port no TCP port).
    allow: str | None = None

    @property
    def allowed(self) -> bool:
        return self.entry is not None

    @property
    def literal(self) -> IPAddress | None:
        return _literal(self.host)


@functools.lru_cache(maxsize=1024)
def _literal(host: str) -> IPAddress | None:
    return parseIP(host)


def decideHost(allow: AllowList, host: str, port: int) -> HostDecision:
    """Is ``host:port`` on the allow list by name?  No DNS here.

    The one name decision: the proxy (every front door) and ``agentsandbox check
    host`` both call it, and the canonical ``host`` it returns is the name the
    resolver is then asked, so the name judged is the name resolved.
    """
    try:
        canon = canonicalHost(host)
    except EntryError as e:
        return HostDecision(host, port, None, f"{host!r} is not a host name the sandbox reaches ({e})")
    if not 0 < port < 65536:
        return HostDecision(canon, port, None, f"port {port} of {canon} is not a TCP port")
    entry = allow.byName(canon, port)
    if entry is None:
        return HostDecision(canon, port, None, refusedByName(canon, port), suggestEntry(canon, port))
    return HostDecision(canon, port, entry, f"{canon}:{port} is allowed by {entry.text!r} in {DOMAINS_KEY}")


def refusedByName(host: str, port: int) -> str:
    """The refusal text for a host no entry allows."""
    return (
        f"{host}:{port} is not on the sandbox's allow list "
        f"(add {suggestEntry(host, port)!r} to {DOMAINS_KEY} to allow it, "
        'or set proxy.unlisted = "ask" to be asked while a request waits)'
    )


def suggestEntry(host: str, port: int) -> str:
    """The narrowest allow-list entry that would let ``host:port`` through by name."""
    ip = parseIP(host)
    if ip is not None and ip.version == 6:
        return f"[{ip}]:{port}"
    if port in (80, 443) and ip is None and not isLoopbackName(host):
        return host
    return f"{host}:{port}"
