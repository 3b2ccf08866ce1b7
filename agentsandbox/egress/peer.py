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
path trusts anything the client says.

A client that closed before the lookup leaves a socket no process holds: a
TIME_WAIT (or FIN_WAIT2) minisock, which the kernel reports with uid 0, or an
orphaned socket that keeps its uid.  Either has inode 0, and that is how both
paths tell it: such a socket is ``CLOSED``, never an owner, so a closed client
is refused as that and never read as root's.  The proxy's same-user check
(``SameUserPeers``) and the system dispatcher (``dispatch.py``, which hands each
connection to its owner's service) both ask ``SocketTable.ownerOf``.
"""

from __future__ import annotations

import enum
import errno
import ipaddress
import os
import socket
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from zope.interface import implementer

from agentsandbox.allowlist import IPAddress, unwrapMapped
from agentsandbox.egress.interfaces import IPeerChecker
from agentsandbox.probes import readTable, socketRows


class Closed(enum.Enum):
    """The client's socket is in the table, but no process holds it any more."""

    CLOSED = "closed"


#: A client that closed before its socket was looked up.
CLOSED: Final = Closed.CLOSED

#: What the socket table says of a client's socket: the uid that holds it,
#: ``CLOSED``, or None when there is no such socket.
Owner = int | Closed | None

#: The refusal of a client that closed before the check, for logs and the audit.
CLOSED_REFUSAL = "the client closed before the check (its socket is held by no process any more)"

# TCP states, as the kernel numbers them (include/net/tcp_states.h).
_ESTABLISHED, _FIN_WAIT1, _FIN_WAIT2, _TIME_WAIT, _CLOSE_WAIT, _LAST_ACK, _CLOSING = 1, 4, 5, 6, 8, 9, 11

#: The states the client's end of an accepted connection can be in while its
#: process holds it.  The kernel queues a connection for accept() only once the
#: client's ACK ended the handshake, so the client is past SYN_SENT: it is
#: ESTABLISHED; FIN_WAIT1 then FIN_WAIT2 once it shut its sending side down (a
#: half-close, after which it still reads the answer); CLOSE_WAIT once our end
#: sent FIN, then LAST_ACK once it shut down too; CLOSING when both ends sent FIN
#: at once.  SYN_SENT and SYN_RECV are handshakes not finished (a SYN_RECV entry
#: is a listener's, never a client's), LISTEN is a listener, and TIME_WAIT (like
#: an orphaned FIN_WAIT2) is a socket closed: a minisock that has no owner.
LIVE_STATES: Final = frozenset({_ESTABLISHED, _FIN_WAIT1, _FIN_WAIT2, _CLOSE_WAIT, _LAST_ACK, _CLOSING})

#: The same states as ``/proc/net/tcp`` prints them (two hex digits).
_LIVE_STATE_TEXT: Final = frozenset(f"{state:02X}" for state in LIVE_STATES)
_TIME_WAIT_TEXT = f"{_TIME_WAIT:02X}"


def _owner(state: int, uid: int, inode: int) -> Owner:
    """The owner of a socket found for a client's 4-tuple, by its state and inode.

    A socket in another state is not the client's: for a lookup by 4-tuple the
    kernel answers with a *listener* on the client's address and port when the
    client's own socket is gone (measured on Linux 6.18), and with the owner of
    that listener.  A client's socket with inode 0 is held by no process: the
    client closed it (TIME_WAIT and orphaned FIN_WAIT2 minisocks report uid 0;
    an orphaned FIN_WAIT1, CLOSING or LAST_ACK socket keeps its uid), so its uid
    says nothing of who is asking.
    """
    if state not in LIVE_STATES and state != _TIME_WAIT:
        return None
    if inode == 0:
        return CLOSED
    return uid


def _same(a: tuple[IPAddress, int], b: tuple[str, int]) -> bool:
    try:
        ip = ipaddress.ip_address(b[0].split("%", 1)[0])
    except ValueError:
        return False
    return a[1] == b[1] and unwrapMapped(a[0]) == unwrapMapped(ip)


def ownerOf(
    tables: list[str], client: tuple[str, int], server: tuple[str, int]
) -> Owner:
    """The uid owning the client's end of the connection client -> server,
    ``CLOSED`` when no process holds it any more, or None when there is none."""
    closed = False
    for table in tables:
        for row in socketRows(table):
            if not (_same(row.local, client) and _same(row.remote, server)):
                continue
            if row.state not in _LIVE_STATE_TEXT and row.state != _TIME_WAIT_TEXT:
                continue
            if row.inode == 0:
                # A live row for the same 4-tuple (a reused port) would be the client's.
                closed = True
                continue
            return row.uid
    return CLOSED if closed else None


def socketInode(procDir: str, client: tuple[str, int], server: tuple[str, int]) -> int | None:
    """The inode of the live socket at ``client`` connected to ``server``, from
    ``procDir/net/tcp{,6}``; None when there is none or no process holds it."""
    # An IPv4 client of a dual-stack listener is in tcp6, mapped.
    names = ("tcp", "tcp6") if ":" not in client[0] else ("tcp6",)
    for name in names:
        table = readTable(name, procDir)
        if table is None:
            continue
        for row in socketRows(table):
            if row.inode and row.state in _LIVE_STATE_TEXT and _same(row.local, client) and _same(row.remote, server):
                return row.inode
    return None


_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLMSG_ERROR = 2
_NLM_F_REQUEST = 1
_NLMSG_HEADER = struct.Struct("=IHHII")
# inet_diag_msg: family, state, timer, retrans, sockid (48 bytes), expires,
# rqueue, wqueue, then the uid and the inode we want.
_STATE_OFFSET = _NLMSG_HEADER.size + 1
_UID_OFFSET = _NLMSG_HEADER.size + 4 + 48 + 12
# nlmsghdr, then inet_diag_req_v2: family, protocol, ext, pad, states, and the
# socket id: ports (network order), addresses (16 bytes each), interface, cookie.
# Ports go in network order: htons() them into a native-order field.
_REQUEST = struct.Struct("=IHHIIBBBxIHH16s16sIII")
_ERRNO = struct.Struct("=i")
_UID_INODE = struct.Struct("=II")
#: The states asked for.  The kernel ignores them for a lookup by 4-tuple
#: (measured on Linux 6.18: a TIME_WAIT socket is answered to a request for
#: ESTABLISHED alone), so each answer's state and inode are checked too.
_STATES = sum(1 << state for state in LIVE_STATES)


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
            lpacked[0], socket.IPPROTO_TCP, 0, _STATES,
            socket.htons(local[1]), socket.htons(remote[1]), lpacked[1], rpacked[1], 0, 0xFFFFFFFF, 0xFFFFFFFF,
        )  # fmt: skip

    @staticmethod
    def _answer(reply: bytes | bytearray, offset: int, length: int, kind: int) -> Owner:
        """The owner in one answer message at ``offset``: its uid, ``CLOSED``, or
        None for "no such socket"."""
        if kind == _NLMSG_ERROR:
            (code,) = _ERRNO.unpack_from(reply, offset + _NLMSG_HEADER.size)
            if -code == errno.ENOENT:
                return None
            raise OSError(-code, os.strerror(-code))
        if length < _UID_OFFSET + _UID_INODE.size:
            raise OSError(errno.EPROTO, f"a sock_diag answer of {length} bytes has no uid")
        uid, inode = _UID_INODE.unpack_from(reply, offset + _UID_OFFSET)
        return _owner(reply[offset + _STATE_OFFSET], int(uid), int(inode))

    def uidOf(self, local: tuple[str, int], remote: tuple[str, int]) -> Owner:
        """The uid owning the socket bound to ``local`` connected to ``remote``
        (``CLOSED`` when no process holds it any more)."""
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

    def uidsOf(self, pairs: Sequence[tuple[tuple[str, int], tuple[str, int]]]) -> list[Owner]:
        """``uidOf`` for each (local, remote) pair, asked in one netlink message per
        ``BATCH`` pairs: the kernel answers each request in turn, matched here by
        sequence number, so one send serves a readiness event's worth of accepts."""
        answers: list[Owner] = [None] * len(pairs)
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

    def ownerOf(self, client: tuple[str, int], server: tuple[str, int]) -> Owner:
        """The uid owning the socket at ``client`` connected to ``server``; ``CLOSED``
        when the client closed it (no process holds it); None when the table has
        no such socket.  Raises ``NoSocketTable`` when it cannot tell."""
        if self._diag is not None:
            try:
                return self._diag.uidOf(client, server)
            except (OSError, ValueError):
                # A netlink socket that failed once is not trusted again.
                self.close()
        return self._fromFiles(client, server)

    def ownersOf(self, pairs: Sequence[tuple[tuple[str, int], tuple[str, int]]]) -> list[Owner]:
        """``ownerOf`` for each (client, server) pair, in one netlink exchange where it can."""
        if self._diag is not None:
            try:
                return self._diag.uidsOf(pairs)
            except (OSError, ValueError):
                self.close()
        return [self._fromFiles(client, server) for client, server in pairs]

    def _fromFiles(self, client: tuple[str, int], server: tuple[str, int]) -> Owner:
        # A client on an IPv4 address is in tcp; tcp6 holds IPv6 and the
        # IPv4-mapped sockets of dual-stack listeners, so read it only if needed.
        names = ("tcp", "tcp6") if ":" not in client[0] else ("tcp6",)
        found = False
        closed = False
        for name in names:
            table = readTable(name, self.procDir)
            if table is None:
                continue
            found = True
            owner = ownerOf([table], client, server)
            if owner is CLOSED:
                closed = True
            elif owner is not None:
                return owner
        if not found:
            raise NoSocketTable(f"no socket table under {self.procDir}/net (the peer check runs on Linux only)")
        return CLOSED if closed else None


def _verdict(owner: Owner, uid: int, client: tuple[str, int]) -> str | None:
    if owner is None:
        return f"no socket of {client[0]}:{client[1]} in the socket table"
    if owner is CLOSED:
        return CLOSED_REFUSAL
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
