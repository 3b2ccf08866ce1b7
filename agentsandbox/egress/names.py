"""Names to addresses, synchronously (stdlib only).

The proxy asks ``addressesFromGetaddrinfo`` in the reactor's thread pool
(``resolve.SystemResolver``); ``agentsandbox check host --resolve`` and the
PreToolUse hook (WebFetch's URLs, fetched by Claude Code's own process, not
through the proxy) ask it directly and hand the answers to the same gate
(``gate.Gate.decideResolving``).  No Twisted here: the hook imports this module.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from typing import Any

from agentsandbox.allowlist import IPAddress


class ResolveError(Exception):
    """A name that resolved to nothing; the message names the host."""

    def __init__(self, host: str, why: str) -> None:
        super().__init__(f"{host} does not resolve ({why})")
        self.host = host
        self.why = why


#: ``socket.getaddrinfo`` or a stand-in with its signature.
GetAddrInfo = Callable[..., Any]


#: The hosts database ``getaddrinfo`` reads before DNS (``hosts: files dns``).
HOSTS_FILE = "/etc/hosts"


def addressesFromGetaddrinfo(
    host: str,
    port: int,
    getaddrinfo: GetAddrInfo = socket.getaddrinfo,
    hostsFile: str = HOSTS_FILE,
) -> list[IPAddress]:
    """Every distinct address of exactly ``host`` (canonical) for a TCP connection, in order.

    The name the allow list matched is the name resolved, in three readings
    that never apply the resolver's search list (``search corp.internal`` would
    turn an allowed ``a.example.com`` that has no record into
    ``a.example.com.corp.internal``, a name no entry allowed):

    1. a numeric spelling (``2130706433``, ``0x7f.1``, ``127.1``) is the address
       the C library reads it as (``AI_NUMERICHOST``, no lookup);
    2. a name in the hosts file gets that file's addresses, as ``getaddrinfo``
       would give them before asking DNS;
    3. anything else is asked as the absolute name ``host.``, which the
       resolver never extends with a search domain.

    Scope ids (``fe80::1%eth0``) are dropped: the address's class decides, and a
    link-local address is refused whatever its scope.
    """
    try:
        infos = getaddrinfo(host, port, 0, socket.SOCK_STREAM, 0, socket.AI_NUMERICHOST)
    except (OSError, UnicodeError):
        infos = None
    if infos is None:
        listed = hostsFileAddresses(host, hostsFile)
        if listed:
            return listed
        absolute = host if host.endswith(".") else host + "."
        try:
            infos = getaddrinfo(absolute, port, 0, socket.SOCK_STREAM)
        except (OSError, UnicodeError) as e:
            raise ResolveError(host, str(e) or type(e).__name__) from None
    seen: list[IPAddress] = []
    for family, _type, _proto, _canon, sockaddr in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        ip = _address(str(sockaddr[0]))
        if ip is not None and ip not in seen:
            seen.append(ip)
    if not seen:
        raise ResolveError(host, "no A or AAAA answer")
    return seen


def _address(text: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None


def hostsFileAddresses(host: str, hostsFile: str = HOSTS_FILE) -> list[IPAddress]:
    """The addresses ``hostsFile`` lists for ``host`` (any of a line's names, any case)."""
    want = host.lower().removesuffix(".")
    try:
        with open(hostsFile, encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return []
    found: list[IPAddress] = []
    for line in lines:
        fields = line.partition("#")[0].split()
        if len(fields) < 2:
            continue
        if want in (name.lower().removesuffix(".") for name in fields[1:]):
            ip = _address(fields[0])
            if ip is not None and ip not in found:
                found.append(ip)
    return found
