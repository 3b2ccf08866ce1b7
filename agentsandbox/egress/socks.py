"""SOCKS5 (RFC 1928) CONNECT, with RFC 1929 user/password accepted and ignored.

The sandbox's bridges send placeholder credentials; the proxy's answer never
depends on them, and they are never logged.  Only CONNECT with IPv4, IPv6 or
domain addresses is served; everything else gets the RFC's reply code and a
close.  Replies carry 0.0.0.0:0 as the bound address.
"""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING

from twisted.python.failure import Failure
from zope.interface import implementer

from agentsandbox.egress.interfaces import IDoorHandler, IFrontDoor
from agentsandbox.egress.privates import writeNow

if TYPE_CHECKING:
    from agentsandbox.egress.grant import Refusal

VERSION = 5
NO_AUTH = 0
USER_PASS = 2
NO_ACCEPTABLE = 0xFF
CONNECT = 1

SUCCEEDED = 0
GENERAL_FAILURE = 1
NOT_ALLOWED = 2
NETWORK_UNREACHABLE = 3
HOST_UNREACHABLE = 4
CONNECTION_REFUSED = 5
COMMAND_NOT_SUPPORTED = 7
ADDRESS_TYPE_NOT_SUPPORTED = 8

ATYP_IPV4 = 1
ATYP_DOMAIN = 3
ATYP_IPV6 = 4

#: Refusal kinds (proxy.Refusal.kind) -> SOCKS reply codes.
CODES = {
    "policy": NOT_ALLOWED,
    "inject": NOT_ALLOWED,
    "limit": GENERAL_FAILURE,
    "resolve": HOST_UNREACHABLE,
    "dial": CONNECTION_REFUSED,
    "parent": GENERAL_FAILURE,
}


def reply(code: int) -> bytes:
    return bytes([VERSION, code, 0, ATYP_IPV4, 0, 0, 0, 0, 0, 0])


@implementer(IDoorHandler)
class SocksHandler:
    """Parses the greeting, the optional sub-negotiation and the request, then asks the door."""

    kind = "socks"

    def __init__(self, door: IFrontDoor) -> None:
        self.door = door
        self.buffer = b""
        self.state = "greeting"

    def _bad(self, why: str, answer: bytes = b"") -> None:
        self.state = "closed"
        self.door.parseError("socks", why, answer)

    def dataReceived(self, data: bytes) -> None:
        if self.state == "closed":
            return
        if self.state == "waiting":
            self.door.buffered(data)
            return
        self.buffer += data
        while self.state in ("greeting", "auth", "request"):
            step = getattr(self, "_" + self.state)
            if not step():
                break
        if len(self.buffer) > 1024 and self.state != "waiting":
            self._bad("more than 1024 bytes before a complete SOCKS request")

    def _greeting(self) -> bool:
        b = self.buffer
        if len(b) < 2:
            return False
        if b[0] != VERSION:
            self._bad(f"SOCKS version {b[0]} (only 5 is served)")
            return False
        n = b[1]
        if len(b) < 2 + n:
            return False
        methods, self.buffer = b[2 : 2 + n], b[2 + n :]
        # user/password first: its password may be the session's credential.
        if USER_PASS in methods:
            writeNow(self.door.transport, bytes([VERSION, USER_PASS]))
            self.state = "auth"
        elif NO_AUTH in methods:
            if self.door.sessionRefusal("socks", None) is not None:
                self.state = "closed"
                self.door.transport.write(bytes([VERSION, NO_ACCEPTABLE]))
                self.door.transport.loseConnection()
                return False
            writeNow(self.door.transport, bytes([VERSION, NO_AUTH]))
            self.state = "request"
        else:
            self._bad(
                "no acceptable SOCKS method offered (no-auth or user/password)",
                bytes([VERSION, NO_ACCEPTABLE]),
            )
            return False
        return True

    def _auth(self) -> bool:
        b = self.buffer
        if len(b) < 2:
            return False
        if b[0] != 1:
            self._bad(f"SOCKS user/password sub-negotiation version {b[0]} (RFC 1929 is 1)", bytes([1, 1]))
            return False
        ulen = b[1]
        if len(b) < 3 + ulen:
            return False
        plen = b[2 + ulen]
        end = 3 + ulen + plen
        if len(b) < end:
            return False
        # The password is the session's credential (egress/sessions.py) or a
        # placeholder the sandbox's bridge sends: never kept, checked only by digest.
        password = bytes(b[3 + ulen : end])
        self.buffer = b[end:]
        if self.door.sessionRefusal("socks", password) is not None:
            self.state = "closed"
            self.door.transport.write(bytes([1, 1]))
            self.door.transport.loseConnection()
            return False
        writeNow(self.door.transport, bytes([1, 0]))
        self.state = "request"
        return True

    def _request(self) -> bool:
        b = self.buffer
        if len(b) < 4:
            return False
        if b[0] != VERSION:
            self._bad(f"SOCKS request version {b[0]}", reply(GENERAL_FAILURE))
            return False
        if b[1] != CONNECT:
            self._bad(f"SOCKS command {b[1]} (only CONNECT is served)", reply(COMMAND_NOT_SUPPORTED))
            return False
        atyp = b[3]
        if atyp == ATYP_IPV4:
            end = 4 + 4
            if len(b) < end + 2:
                return False
            host = str(ipaddress.IPv4Address(b[4:end]))
        elif atyp == ATYP_IPV6:
            end = 4 + 16
            if len(b) < end + 2:
                return False
            host = str(ipaddress.IPv6Address(b[4:end]))
        elif atyp == ATYP_DOMAIN:
            if len(b) < 5:
                return False
            end = 5 + b[4]
            if len(b) < end + 2:
                return False
            raw = b[5:end]
            # The domain is read once, here, and that string is what the proxy
            # decides on and resolves (rules.decideHost): bytes that are not
            # UTF-8 are refused rather than replaced, so no second reading of
            # them exists.  Everything else about the name (IDNA, case, a
            # trailing dot, an IP literal sent as a domain) is canonicalHost's.
            try:
                host = raw.decode("utf-8")
            except UnicodeDecodeError:
                host = ""
            if not host or any(c in host for c in "\x00\r\n\t /\\@%"):
                self._bad(f"SOCKS domain {raw!r} is not a host name", reply(NOT_ALLOWED))
                return False
        else:
            self._bad(f"SOCKS address type {atyp}", reply(ADDRESS_TYPE_NOT_SUPPORTED))
            return False
        port = int.from_bytes(b[end : end + 2], "big")
        leftover = b[end + 2 :]
        self.buffer = b""
        self.state = "waiting"
        self.door.buffered(leftover)
        self.door.openTunnel("socks", host, port, self._granted, self._refused)
        return False

    def _granted(self) -> None:
        self.state = "tunnel"
        writeNow(self.door.transport, reply(SUCCEEDED))

    def _refused(self, refusal: Refusal) -> None:
        self.state = "closed"
        self.door.transport.write(reply(CODES.get(refusal.kind, GENERAL_FAILURE)))
        self.door.transport.loseConnection()

    def readConnectionLost(self) -> None:
        self.door.transport.loseConnection()

    def connectionLost(self, reason: Failure) -> None:
        self.state = "closed"
