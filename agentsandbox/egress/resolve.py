"""Resolving a name once, and deciding every address it resolves to.

The proxy resolves a granted name exactly once, classifies every A and AAAA
answer (``rules.decideAddress``) and dials only the checked addresses, so a
second lookup can never hand it a different, unchecked address (DNS
rebinding).  ``describeResolved`` is the same decision, synchronously, for
``agentsandbox check host --resolve``.
"""

from __future__ import annotations

import functools
import ipaddress
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorThreads
from twisted.internet.threads import deferToThreadPool
from zope.interface import implementer

from agentsandbox.egress.interfaces import IResolver
from agentsandbox.egress.rules import (
    DOMAINS_KEY,
    AddressDecision,
    AllowList,
    Entry,
    EntryError,
    IPAddress,
    canonicalHost,
    decideAddress,
    parseIP,
    refusedByName,
)


class ResolveError(Exception):
    """A name that resolved to nothing; the message names the host."""

    def __init__(self, host: str, why: str) -> None:
        super().__init__(f"{host} does not resolve ({why})")
        self.host = host
        self.why = why


#: ``socket.getaddrinfo`` or a stand-in with its signature.
GetAddrInfo = Callable[..., Any]


def addressesFromGetaddrinfo(
    host: str, port: int, getaddrinfo: GetAddrInfo = socket.getaddrinfo
) -> list[IPAddress]:
    """Every distinct address ``getaddrinfo`` gives for a TCP connection, in its order.

    Scope ids (``fe80::1%eth0``) are dropped: the address's class decides, and a
    link-local address is refused whatever its scope.
    """
    try:
        infos = getaddrinfo(host, port, 0, socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        raise ResolveError(host, str(e) or type(e).__name__) from None
    seen: list[IPAddress] = []
    for family, _type, _proto, _canon, sockaddr in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        text = str(sockaddr[0]).split("%", 1)[0]
        try:
            ip = ipaddress.ip_address(text)
        except ValueError:
            continue
        if ip not in seen:
            seen.append(ip)
    if not seen:
        raise ResolveError(host, "no A or AAAA answer")
    return seen


@implementer(IResolver)
class SystemResolver:
    """The system's resolver (``getaddrinfo``) in the reactor's thread pool."""

    def __init__(self, reactor: IReactorThreads, getaddrinfo: GetAddrInfo = socket.getaddrinfo) -> None:
        self._reactor = reactor
        self._getaddrinfo = getaddrinfo

    def resolve(self, host: str, port: int) -> Deferred[Sequence[IPAddress]]:
        return deferToThreadPool(
            self._reactor,
            self._reactor.getThreadPool(),
            addressesFromGetaddrinfo,
            host,
            port,
            self._getaddrinfo,
        )


@dataclass(frozen=True)
class HostDecision:
    """The name half of a decision: the canonical host and the entry that allows it."""

    host: str
    port: int
    entry: Entry | None
    reason: str

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
    """Is ``host:port`` on the allow list by name?  No DNS here."""
    try:
        canon = canonicalHost(host)
    except EntryError as e:
        return HostDecision(host, port, None, f"{host!r} is not a host name the sandbox reaches ({e})")
    if not 0 < port < 65536:
        return HostDecision(canon, port, None, f"port {port} of {canon} is not a TCP port")
    entry = allow.byName(canon, port)
    if entry is None:
        return HostDecision(canon, port, None, refusedByName(canon, port))
    return HostDecision(canon, port, entry, f"{canon}:{port} is allowed by {entry.text!r} in {DOMAINS_KEY}")


def decideAddresses(
    allow: AllowList, name: HostDecision, addresses: Sequence[IPAddress]
) -> list[AddressDecision]:
    return [decideAddress(allow, name.host, name.port, ip, name.entry) for ip in addresses]


def describeResolved(config: object, host: str, port: int) -> tuple[bool, list[str]]:
    """The full decision for ``host:port`` as the proxy would take it, resolving synchronously.

    ``config`` is an ``agentsandbox.config.Config``.  Returns whether the proxy
    would dial at least one address, and one line per step: the name decision,
    then one line per resolved address saying whether it would be dialled and
    why.  Used by ``agentsandbox check host HOST[:PORT] --resolve``.
    """
    allow: AllowList = config.sandbox.allowList  # type: ignore[attr-defined]
    name = decideHost(allow, host, port)
    lines = [("allowed: " if name.allowed else "refused: ") + name.reason]
    if not name.allowed:
        return False, lines
    literal = name.literal
    if literal is not None:
        addresses: list[IPAddress] = [literal]
    else:
        try:
            addresses = addressesFromGetaddrinfo(name.host, port)
        except ResolveError as e:
            lines.append(f"refused: {e}")
            return False, lines
    ok = False
    for d in decideAddresses(allow, name, addresses):
        ok = ok or d.allowed
        lines.append(("  dial    " if d.allowed else "  refuse  ") + f"{d.address}: {d.reason}")
    if not ok:
        lines.append(f"refused: no address of {name.host} may be dialled")
    return ok, lines
