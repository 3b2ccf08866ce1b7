"""Resolving a name once, in the reactor's thread pool.

The proxy resolves a granted name exactly once, classifies every A and AAAA
answer (the gate, ``gate.py``) and dials only the checked addresses, so a
second lookup can never hand it a different, unchecked address (DNS
rebinding).  The lookup itself lives in ``names`` (stdlib only: the hook and
``check host`` resolve with it).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorThreads
from twisted.internet.threads import deferToThreadPool
from zope.interface import implementer

from agentsandbox.allowlist import IPAddress
from agentsandbox.egress.interfaces import IResolver
from agentsandbox.egress.names import (
    GetAddrInfo,
    ResolveError,
    addressesFromGetaddrinfo,
    hostsFileAddresses,
)

__all__ = [
    "ResolveError",
    "SystemResolver",
    "addressesFromGetaddrinfo",
    "hostsFileAddresses",
]


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
