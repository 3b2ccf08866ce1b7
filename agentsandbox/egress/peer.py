"""Same-user peer check: serve only sockets owned by our own Unix user.

TCP has no ``SO_PEERCRED``, so the owner of the client's socket is read from
the kernel's socket tables, ``/proc/net/tcp`` and ``/proc/net/tcp6``: the row
whose local address is the client's address and whose remote address is ours
carries the owning uid.  Addresses there are hex, stored in host byte order per
32-bit word (each 4-byte group reversed on little-endian machines); the one
parser of those rows is ``agentsandbox.probes.SocketRow``, which doctor and
``run`` read the listeners with.

Reading those tables costs the kernel a walk of its whole connection hash
(3.5 ms per read measured here, with four sockets open), which would cap the
proxy near 300 new connections a second.  So ``SocketTable`` first asks the
kernel for the one socket through ``sock_diag`` netlink (the same table,
looked up by its 4-tuple, ~5 us), and reads ``/proc/net/tcp{,6}`` only where
netlink is unavailable.  Both paths answer from the kernel's socket table; no
path trusts anything the client says.  The proxy's same-user check
(``SameUserPeers``) and the system dispatcher (``dispatch.py``, which hands each
connection to its owner's service) both ask ``SocketTable.ownerOf``.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from zope.interface import implementer

from agentsandbox.egress.interfaces import IPeerChecker
from agentsandbox.egress.rules import IPAddress, unwrapMapped
from agentsandbox.probes import readTable, socketRows


def _same(a: tuple[IPAddress, int], b: tuple[str, int]) -> bool:
    try:
        ip = ipaddress.ip_address(b[0].split("%", 1)[0])
    except ValueError:
        return False
    return a[1] == b[1] and unwrapMapped(a[0]) == unwrapMapped(ip)


def ownerOf(
    tables: list[str], client: tuple[str, int], server: tuple[str, int]
) -> int | None:
    """The uid owning the client's end of the connection client -> server, or None."""
    for table in tables:
        for row in socketRows(table):
            if _same(row.local, client) and _same(row.remote, server):
                return row.uid
    return None


_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLMSG_ERROR = 2
_NLM_F_REQUEST = 1
_NLMSG_HEADER = struct.Struct("=IHHII")
# inet_diag_msg: family, state, timer, retrans, sockid (48 bytes), expires,
# rqueue, wqueue, then the uid we want.
_UID_OFFSET = _NLMSG_HEADER.size + 4 + 48 + 12
# nlmsghdr, then inet_diag_req_v2: family, protocol, ext, pad, states, and the
# socket id: ports (network order), addresses (16 bytes each), interface, cookie.
# Ports go in network order: htons() them into a native-order field.
_REQUEST = struct.Struct("=IHHIIBBBxIHH16s16sIII")
_ERRNO = struct.Struct("=i")
_UID = struct.Struct("=I")


class SockDiag:
    """Looks TCP sockets up by their 4-tuple through ``NETLINK_SOCK_DIAG``.

    A dump filtered by port (one request for many sockets) was measured and
    rejected: the kernel walks its whole established hash for it (262144
    buckets here, 1.5 ms a dump, against 6 us for one lookup by 4-tuple).
    Several lookups in one message (``uidsOf``) save the sends instead.
    """

    #: Lookups per netlink message: their answers (under 1 KiB each in the
    #: socket's receive buffer) fit the default 208 KiB many times over.
    BATCH = 32

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG)
        self._seq = 0
        # One buffer for every reply (an answer is ~100 bytes; errors echo the request).
        self._reply = bytearray(8192)
        #: Packed addresses by text: the proxy's own address repeats on every
        #: connection, clients on loopback come from a handful of addresses.
        self._packed: dict[str, tuple[int, bytes] | None] = {}

    def close(self) -> None:
        self._sock.close()

    def _pack(self, host: str) -> tuple[int, bytes] | None:
        """(family, 16-byte address) for an IP literal; None for anything else."""
        found = self._packed.get(host, False)
        if found is not False:
            return found  # type: ignore[return-value]
        text = host.split("%", 1)[0]
        family = socket.AF_INET6 if ":" in text else socket.AF_INET
        try:
            packed: tuple[int, bytes] | None = (family, socket.inet_pton(family, text).ljust(16, b"\0"))
        except OSError:
            packed = None
        if len(self._packed) >= 1024:
            self._packed.clear()
        self._packed[host] = packed
        return packed

    def _request(self, local: tuple[str, int], remote: tuple[str, int]) -> tuple[int, bytes] | None:
        """(sequence number, request) for the socket bound to ``local`` connected to
        ``remote``; None when either is not an IP literal of one family."""
        lpacked, rpacked = self._pack(local[0]), self._pack(remote[0])
        if lpacked is None or rpacked is None or lpacked[0] != rpacked[0]:
            return None
        self._seq = seq = (self._seq + 1) & 0xFFFFFFFF
        return seq, _REQUEST.pack(
            _REQUEST.size, _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, seq, 0,
            lpacked[0], socket.IPPROTO_TCP, 0, 0xFFFFFFFF,
            socket.htons(local[1]), socket.htons(remote[1]), lpacked[1], rpacked[1], 0, 0xFFFFFFFF, 0xFFFFFFFF,
        )  # fmt: skip

    @staticmethod
    def _answer(reply: bytearray, offset: int, length: int, kind: int) -> int | None:
        """The uid in one answer message at ``offset``; None for "no such socket"."""
        if kind == _NLMSG_ERROR:
            (code,) = _ERRNO.unpack_from(reply, offset + _NLMSG_HEADER.size)
            if -code == errno.ENOENT:
                return None
            raise OSError(-code, os.strerror(-code))
        if length < _UID_OFFSET + _UID.size:
            raise OSError(errno.EPROTO, f"a sock_diag answer of {length} bytes has no uid")
        (uid,) = _UID.unpack_from(reply, offset + _UID_OFFSET)
        return int(uid)

    def uidOf(self, local: tuple[str, int], remote: tuple[str, int]) -> int | None:
        """The uid owning the socket bound to ``local`` connected to ``remote``."""
        request = self._request(local, remote)
        if request is None:
            return None
        seq, message = request
        self._sock.send(message)
        reply = self._reply
        while True:
            got = self._sock.recv_into(reply)
            length, kind, _flags, answered, _pid = _NLMSG_HEADER.unpack_from(reply)
            if answered == seq:
                return self._answer(reply, 0, min(got, length), kind)

    def uidsOf(self, pairs: Sequence[tuple[tuple[str, int], tuple[str, int]]]) -> list[int | None]:
        """``uidOf`` for each (local, remote) pair, asked in one netlink message per
        ``BATCH`` pairs: the kernel answers each request in turn, matched here by
        sequence number, so one send serves a readiness event's worth of accepts."""
        answers: list[int | None] = [None] * len(pairs)
        reply = self._reply
        for start in range(0, len(pairs), self.BATCH):
            waiting: dict[int, int] = {}
            requests: list[bytes] = []
            for i in range(start, min(start + self.BATCH, len(pairs))):
                request = self._request(*pairs[i])
                if request is not None:
                    waiting[request[0]] = i
                    requests.append(request[1])
            if not requests:
                continue
            self._sock.send(b"".join(requests))
            while waiting:
                got = self._sock.recv_into(reply)
                offset = 0
                # One answer per datagram in practice; walk them all regardless.
                while offset + _NLMSG_HEADER.size <= got:
                    length, kind, _flags, answered, _pid = _NLMSG_HEADER.unpack_from(reply, offset)
                    if length < _NLMSG_HEADER.size:
                        raise OSError(errno.EPROTO, f"a sock_diag message of {length} bytes")
                    i = waiting.pop(answered, -1)
                    if i >= 0:
                        answers[i] = self._answer(reply, offset, min(length, got - offset), kind)
                    offset += (length + 3) & ~3
        return answers


class NoSocketTable(Exception):
    """Neither sock_diag nor ``/proc/net/tcp{,6}`` answers here; says which was tried."""


class SocketTable:
    """Who owns the client's end of a TCP connection, from the kernel's socket table.

    Through sock_diag netlink when it can (one lookup by 4-tuple), else by reading
    ``procDir/net/tcp{,6}``.  ``procDir`` other than ``/proc`` (tests) always reads
    the files, since a netlink answer describes this machine, not the given
    directory.  Both the proxy's same-user check and the dispatcher ask this.
    """

    def __init__(self, procDir: str = "/proc", useNetlink: bool = True) -> None:
        self.procDir = procDir
        self._diag: SockDiag | None = None
        if useNetlink and procDir == "/proc" and sys.platform.startswith("linux"):
            try:
                self._diag = SockDiag()
            except OSError:
                self._diag = None

    @property
    def viaNetlink(self) -> bool:
        return self._diag is not None

    def close(self) -> None:
        if self._diag is not None:
            self._diag.close()
            self._diag = None

    def ownerOf(self, client: tuple[str, int], server: tuple[str, int]) -> int | None:
        """The uid owning the socket at ``client`` connected to ``server``; None when
        the table has no such socket.  Raises ``NoSocketTable`` when it cannot tell."""
        if self._diag is not None:
            try:
                return self._diag.uidOf(client, server)
            except (OSError, ValueError):
                # A netlink socket that failed once is not trusted again.
                self.close()
        return self._fromFiles(client, server)

    def ownersOf(self, pairs: Sequence[tuple[tuple[str, int], tuple[str, int]]]) -> list[int | None]:
        """``ownerOf`` for each (client, server) pair, in one netlink exchange where it can."""
        if self._diag is not None:
            try:
                return self._diag.uidsOf(pairs)
            except (OSError, ValueError):
                self.close()
        return [self._fromFiles(client, server) for client, server in pairs]

    def _fromFiles(self, client: tuple[str, int], server: tuple[str, int]) -> int | None:
        # A client on an IPv4 address is in tcp; tcp6 holds IPv6 and the
        # IPv4-mapped sockets of dual-stack listeners, so read it only if needed.
        names = ("tcp", "tcp6") if ":" not in client[0] else ("tcp6",)
        found = False
        for name in names:
            table = readTable(name, self.procDir)
            if table is None:
                continue
            found = True
            uid = ownerOf([table], client, server)
            if uid is not None:
                return uid
        if not found:
            raise NoSocketTable(f"no socket table under {self.procDir}/net (the peer check runs on Linux only)")
        return None


def _verdict(owner: int | None, uid: int, client: tuple[str, int]) -> str | None:
    if owner is None:
        return f"no socket of {client[0]}:{client[1]} in the socket table"
    if owner != uid:
        return f"its socket belongs to uid {owner}, not {uid}"
    return None


@implementer(IPeerChecker)
@dataclass(frozen=True)
class ProcNetPeers:
    """The peer check from ``/proc/net/tcp`` and ``tcp6`` alone.

    Allows only clients whose socket belongs to ``uid`` (default: ours)."""

    procDir: str = "/proc"
    uid: int = -1

    def _uid(self) -> int:
        return os.getuid() if self.uid < 0 else self.uid

    def check(self, client: tuple[str, int], server: tuple[str, int]) -> str | None:
        try:
            owner = SocketTable(self.procDir, useNetlink=False).ownerOf(client, server)
        except NoSocketTable as e:
            return str(e)
        return _verdict(owner, self._uid(), client)


@implementer(IPeerChecker)
class SameUserPeers:
    """The default peer check: the client's socket must belong to ``uid`` (default: ours)."""

    def __init__(self, procDir: str = "/proc", uid: int = -1, useNetlink: bool = True) -> None:
        self.procDir = procDir
        self.uid = os.getuid() if uid < 0 else uid
        self.table = SocketTable(procDir, useNetlink)

    @property
    def viaNetlink(self) -> bool:
        return self.table.viaNetlink

    def close(self) -> None:
        self.table.close()

    def check(self, client: tuple[str, int], server: tuple[str, int]) -> str | None:
        try:
            owner = self.table.ownerOf(client, server)
        except NoSocketTable as e:
            return str(e)
        return _verdict(owner, self.uid, client)
