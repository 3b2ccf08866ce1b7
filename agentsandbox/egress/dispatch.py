"""The system dispatcher: one proxy port, each connection handed to its owner's service.

The Claude Code drop-in names one proxy port for the whole machine.  On a machine
with several people, ``agentsandbox dispatch`` owns that port (127.0.0.1 and ::1)
and every user's agentsandbox service registers with it over a Unix socket
instead of binding the port.  For each accepted TCP connection the dispatcher

1. asks the kernel's socket table who owns the client's socket
   (``peer.SocketTable``: the same sock_diag code as the proxy's peer check);
2. passes the connected socket with ``SCM_RIGHTS`` to the service that uid
   registered, and closes its own copy, **before reading any byte**;
3. or, when that uid has no service, answers in the client's own protocol (the
   first byte, peeked: SOCKS5 gets a general-failure reply, anything else an
   HTTP 503 naming the uid and the fix) and logs one line.  For ``HOLD_AFTER_START``
   seconds after the dispatcher's own start a connection of a uid without a
   registration is held instead (at most ``MAX_HELD`` of them), and handed on
   when that uid's service registers: after a dispatcher restart every
   service registers again within about a second, and the connections systemd
   kept in the socket's backlog meanwhile must not get the 503.

The registration's uid comes from ``SO_PEERCRED`` alone, never from anything
the client sends.  One registration per uid: a new one replaces the old (which
is told so and closed); a registration ends when its socket closes.

The wire on the registration socket is JSON, one object per line, at most
``MAX_LINE`` bytes (``dispatchwire.py``, Twisted-free, with the sans-IO parser):

- client -> dispatcher: ``{"op": "register"}``, ``{"op": "status"}``;
- dispatcher -> client: ``{"op": "registered", "uid": U, "ports": [...]}``,
  ``{"op": "conn"}`` carrying one file descriptor, ``{"op": "replaced"}``,
  ``{"op": "status", ...}``, ``{"op": "error", "error": "..."}``.

Sockets here are raw, not Twisted transports, on purpose: a handed-off socket
must be closed, never shut down (a Twisted transport's close shuts the
connection down for its new owner too), and a descriptor queued for sending
must be closed exactly when the kernel has taken it, which Twisted's
``sendFileDescriptor`` does not report.  They are still driven by the reactor
(``IReadDescriptor``/``IWriteDescriptor``), under ``MultiService`` pieces.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import struct
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING, Any

from twisted.application.service import MultiService, Service
from twisted.internet.defer import Deferred, fail
from twisted.internet.interfaces import IReadDescriptor, IReadWriteDescriptor
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from agentsandbox.config import DEFAULT_PROXY_PORT
from agentsandbox.egress.dispatchwire import (
    CONN,
    FDS_PER_MESSAGE,
    MAX_LINE,
    DispatchQueryError,
    LineReader,
    WireError,
    askStatus,
    encode,
    peerCredentials,
)
from agentsandbox.egress.grant import Grant, Refusal, RefusalError
from agentsandbox.egress.interfaces import IFrontDoor
from agentsandbox.egress.peer import CLOSED, CLOSED_REFUSAL
from agentsandbox.paths import DISPATCH_SOCKET, SYSTEM_CONFIG

log = Logger(namespace="agentsandbox.dispatch")

#: Seconds a new registration-socket client has to say what it wants.
SPEAK_TIMEOUT = 10.0
#: Registration-socket clients of one uid that have not registered yet.
UNREGISTERED_PER_UID = 16
#: Bytes read from a registration-socket client at a time.  Nothing is read
#: while its answers wait for its socket, so this (plus one unfinished line)
#: is what a client that sends and never reads can make the dispatcher hold.
READ_SIZE = 4 * MAX_LINE
#: Connections queued for one registration while its socket is full.
MAX_QUEUED = 1024
#: Seconds an unserved client gets to send its first byte (and to read the refusal).
REFUSAL_TIMEOUT = 10.0
#: Unserved connections of one uid being answered at once; past it that uid's
#: next ones are closed unanswered, so one user's idle connections cannot take
#: the slots another user's 503 needs.
REFUSING_PER_UID = 32
#: Unserved connections being answered at once, all uids together (a
#: descriptor and about 1 KiB each); past it they are closed at once.
MAX_REFUSING = 1024
#: Bytes of an unserved client's request read (and dropped) so that closing
#: does not reset the connection before it read the refusal.
DRAIN_LIMIT = 64 * 1024
#: Seconds after the dispatcher's own start during which a connection of a uid
#: without a registration is held for it rather than refused: services register
#: again 0.5-1.1 s after a dispatcher restart and 1.5-1.7 s after a kill
#: (measured under systemd, with the socket unit keeping the port), so 5 s covers
#: them with room, and a uid that has no service waits at most this long for its 503.
HOLD_AFTER_START = 5.0
#: Connections held that way, all uids together; past it they get the 503 at once.
MAX_HELD = 1024
#: Connections accepted per readiness event of a listening socket.
ACCEPT_BATCH = 64

SERVICE_FIX = "`systemctl --user start agentsandbox`, or `agentsandbox serve`"
#: The machine's config key that lets root's service register.
ROOT_KEY = "proxy.dispatch_root"

#: Room for a few descriptors, so that a client sending some is seen doing it
#: (and they are closed) rather than the kernel truncating them silently.
_ANCILLARY = socket.CMSG_SPACE(16 * 4)


def _address(sockaddr: Any) -> tuple[str, int]:
    return (str(sockaddr[0]), int(sockaddr[1]))


def _showAddress(address: tuple[str, int]) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# --------------------------------------------------------------------------- refusing unserved clients


def refusalText(uid: int, serveRoot: bool = True) -> str:
    if uid == 0 and not serveRoot:
        return (
            "this dispatcher does not serve uid 0 (root): the machine's config does not set "
            f"{ROOT_KEY} = true, so no service of root's may register"
        )
    return (
        f"no agentsandbox service is registered with the dispatcher for uid {uid}: start yours "
        f"with {SERVICE_FIX}, then retry"
    )


def rootRefusal(source: str) -> str:
    """Why a registration of uid 0 is refused, naming the key and the config that lacks it."""
    return (
        f"registered as uid 0 (root), which this dispatcher does not serve: {ROOT_KEY} is not "
        f"true in {source} (set it and restart the dispatcher to serve root's sandboxes)"
    )


if TYPE_CHECKING:
    from agentsandbox.egress.gate import Verdict

#: The one answer a uid without a registered service gets.
_NO_SERVICE = Refusal("limit", "no service registered")


class _RawTransport:
    """Just enough of a transport for ``SocksHandler``: writes to the raw socket."""

    def __init__(self, refusal: _Refusal) -> None:
        self.refusal = refusal

    def write(self, data: bytes) -> None:
        self.refusal.send(data)

    def loseConnection(self) -> None:
        self.refusal.finish()

    def abortConnection(self) -> None:
        self.refusal.close()

    def pauseProducing(self) -> None:
        pass  # the refusal reads only to drop

    def resumeProducing(self) -> None:
        pass


@implementer(IFrontDoor)
class _RefusingDoor:
    """A front door that answers every request "general failure" (``SocksHandler``
    walks the client there); the host is never logged or kept: the dispatcher
    serves no one's traffic."""

    client = "?"
    gone = False

    def __init__(self, refusal: _Refusal) -> None:
        self.transport = _RawTransport(refusal)

    def armHeaderTimer(self) -> None:
        pass  # the refusal has its own deadline (REFUSAL_TIMEOUT)

    def cancelHeaderTimer(self) -> None:
        pass

    def parseError(self, kind: str, why: str, answer: bytes) -> None:
        if answer:
            self.transport.write(answer)
        self.transport.loseConnection()

    def buffered(self, data: bytes) -> None:
        pass

    def sessionRefusal(self, kind: str, password: bytes | None) -> str | None:
        return None  # every request is refused below anyway

    def openTunnel(
        self, kind: str, host: str, port: int, granted: Callable[[], None], refused: Callable[[Refusal], None]
    ) -> None:
        refused(_NO_SERVICE)

    def decide(
        self, host: str, port: int, reserve: bool, then: Callable[[Verdict], None], kind: str = "forward"
    ) -> None:
        then(_NO_SERVICE)

    def connect(self, grant: Grant, protocol: Protocol) -> Deferred[Any]:
        return fail(RefusalError(_NO_SERVICE))

    def record(self, event: str, **fields: Any) -> None:
        pass

    def logFailure(self, why: str, failure: Failure) -> None:
        log.failure("dispatch: refusal {why}", failure, why=why)


@implementer(IReadDescriptor)
class _Refusal:
    """One connection of a uid without a service: answered in its protocol, then closed.

    The first byte is peeked, not consumed.  A SOCKS5 client is walked through
    its greeting to a general-failure reply (the proxy's own parser does it);
    an HTTP client gets the 503 at once.  What the client sends is read only
    to be dropped (at most ``DRAIN_LIMIT`` bytes): closing a socket with unread
    bytes resets the connection, and the client might never read the refusal.
    """

    def __init__(self, dispatcher: Dispatcher, sock: socket.socket, uid: int | None) -> None:
        self.dispatcher = dispatcher
        self.sock = sock
        self.uid = uid
        self.socks: Any = None
        self.drained = 0
        self.closed = False
        self.finished = False
        sock.setblocking(False)
        self.timer = dispatcher.clock.callLater(REFUSAL_TIMEOUT, self.close)
        dispatcher.refusing.add(self)
        dispatcher.refusingByUid[uid] += 1
        dispatcher.reactor.addReader(self)

    def fileno(self) -> int:
        return self.sock.fileno() if not self.closed else -1

    def logPrefix(self) -> str:
        return "dispatch-refusal"

    def doRead(self) -> None:
        if self.closed:
            return
        try:
            if self.socks is None and not self.finished:
                first = self.sock.recv(1, socket.MSG_PEEK)
                if not first:
                    self.close()
                    return
                if not self._answer(first[0]):
                    return
            data = self.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            self.close()
            return
        if not data:
            self.close()
            return
        self.drained += len(data)
        if self.drained > DRAIN_LIMIT:
            self.close()
        elif self.socks is not None and not self.finished:
            self.socks.dataReceived(data)

    def _answer(self, first: int) -> bool:
        """Answers by the first byte; False when the connection is closed already."""
        from agentsandbox.egress.http import errorReply
        from agentsandbox.egress.socks import VERSION, SocksHandler

        uid = "?" if self.uid is None else str(self.uid)
        if first == VERSION:
            log.info("uid {uid} has no registered service: SOCKS5 connection refused", uid=uid)
            self.socks = SocksHandler(_RefusingDoor(self))
            return True
        log.info("uid {uid} has no registered service: HTTP connection answered 503", uid=uid)
        if self.uid is None:
            text = "no agentsandbox service for this connection"
        else:
            text = refusalText(self.uid, self.dispatcher.serveRoot)
        self.send(errorReply(503, text))
        self.finish()
        return not self.closed

    def send(self, data: bytes) -> None:
        # A refusal is a few hundred bytes on a fresh socket: it fits, or the
        # client is gone.
        try:
            self.sock.send(data)
        except OSError:
            self.close()

    def finish(self) -> None:
        """The answer is out: no more to say; read what comes until EOF, then close."""
        self.finished = True
        if not self.closed:
            try:
                self.sock.shutdown(socket.SHUT_WR)
            except OSError:
                self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.timer.active():
            self.timer.cancel()
        self.dispatcher.reactor.removeReader(self)
        self.dispatcher.refusing.discard(self)
        self.dispatcher.refusalEnded(self.uid)
        self.sock.close()

    def connectionLost(self, reason: Failure) -> None:
        self.close()


# --------------------------------------------------------------------------- registration-socket clients


@implementer(IReadWriteDescriptor)
class Client:
    """One connection on the registration socket: a registration, or a status question.

    Its uid is the kernel's (``SO_PEERCRED``) and fixed at accept.  Outgoing
    lines (and the descriptors they carry) are queued and sent in order when
    the socket can take them; a descriptor is closed here the moment the
    kernel has taken it.  Hand-offs queued next to each other leave in one
    message (up to ``FDS_PER_MESSAGE``): their lines and their descriptors.

    While anything waits to be sent, the client is not read (and what was read
    is not acted on): a client that asks and never reads the answers would
    otherwise make the dispatcher queue answers without bound, each many times
    the size of its question.  It is read again once the queue is sent; its
    close is seen meanwhile as its socket's error on the write side.
    """

    def __init__(self, dispatcher: Dispatcher, sock: socket.socket) -> None:
        self.dispatcher = dispatcher
        self.sock = sock
        self.pid, self.uid = peerCredentials(sock)
        self.reader = LineReader()
        #: (bytes, the socket they carry or None), oldest first.  Only hand-offs
        #: (``CONN``) carry a socket.
        self.outgoing: deque[tuple[bytes, socket.socket | None]] = deque()
        #: Sockets in ``outgoing`` (kept, not counted, on every hand-off).
        self.queued = 0
        #: Hand-offs were queued in this readiness event and are not sent yet.
        self.flushDue = False
        self.registered = False
        self.closed = False
        self.closeWhenFlushed = False
        self.writing = False
        #: Not read until ``outgoing`` is sent.
        self.paused = False
        self.handedOff = 0
        self.since = time.time()
        self.timer: Any = dispatcher.clock.callLater(dispatcher.speakTimeout, self._silent)
        dispatcher.reactor.addReader(self)

    def fileno(self) -> int:
        return self.sock.fileno() if not self.closed else -1

    def logPrefix(self) -> str:
        return "dispatch-registration"

    def _silent(self) -> None:
        self.timer = None
        log.warn(
            "registration socket: uid {uid} (pid {pid}) connected and said nothing for {s:g}s; closed",
            uid=self.uid, pid=self.pid, s=self.dispatcher.speakTimeout,
        )  # fmt: skip
        self.close()

    # ------------------------------------------------------------------ reading

    def doRead(self) -> None:
        if self.closed or self.paused:
            return
        try:
            data, ancillary, flags, _ = self.sock.recvmsg(READ_SIZE, _ANCILLARY)
        except BlockingIOError:
            return
        except OSError as e:
            self.close(f"read failed: {e.strerror or e}")
            return
        descriptors = _descriptorsIn(ancillary)
        if descriptors or flags & socket.MSG_CTRUNC:
            for fd in descriptors:
                os.close(fd)
            self.refuse("sent file descriptors to the dispatcher (it takes none); they were closed")
            return
        if not data:
            self.close()
            return
        try:
            self.reader.push(data)
        except WireError as e:
            self.refuse(f"sent {e}")
            return
        self._process()

    def _process(self) -> None:
        """Acts on the messages read, in order, until one's answer has to wait for the socket."""
        while not (self.closed or self.closeWhenFlushed):
            if self.outgoing:
                self._pause()
                return
            try:
                message = self.reader.next()
            except WireError as e:
                self.refuse(f"sent {e}")
                return
            if message is None:
                return
            self._handle(message)

    def _pause(self) -> None:
        if not self.paused:
            self.paused = True
            self.dispatcher.reactor.removeReader(self)
        # Draining the queue is what resumes reading; a dead peer shows up there too.
        self._wantWrite(True)

    def _resume(self) -> None:
        self.paused = False
        self.dispatcher.reactor.addReader(self)
        self._process()

    def _handle(self, message: dict[str, Any]) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        op = message["op"]
        if op == "register":
            if self.registered:
                self.refuse("registered twice on one connection")
                return
            # Whatever else the message says (a "uid", say) is ignored: the
            # registration is for the uid the kernel reports.
            self.dispatcher.register(self)
        elif op == "status":
            self.send(encode(dict(self.dispatcher.status(), op="status")))
            if not self.registered:
                self.closeWhenFlushed = True
                self._flush()
        else:
            self.refuse(f"sent an unknown op {op[:40]!r} (register or status)")

    def refuse(self, why: str) -> None:
        """Bad input: one log line, an error line back, and this connection closed."""
        log.warn("registration socket: uid {uid} (pid {pid}) {why}; closed", uid=self.uid, pid=self.pid, why=why)
        queued = self.takeQueued()
        self.outgoing.clear()
        # A registration that misbehaves ends now: nothing more is handed to it,
        # and what was queued for it is refused like any unserved connection.
        self.dispatcher.clientClosed(self, queued, why)
        self.send(encode({"op": "error", "error": why}))
        self.closeWhenFlushed = True
        self._flush()

    # ------------------------------------------------------------------ writing

    def send(self, data: bytes) -> None:
        self.outgoing.append((data, None))
        if not self.writing:
            self._flush()

    def takeQueued(self) -> list[socket.socket]:
        """Removes the connections queued for this client (its lines stay) and returns them."""
        if not self.queued:
            return []
        taken = [s for _, s in self.outgoing if s is not None]
        self.outgoing = deque(item for item in self.outgoing if item[1] is None)
        self.queued = 0
        return taken

    def flush(self) -> None:
        """Sends what was queued in this readiness event (unless waiting to be writable)."""
        self.flushDue = False
        if not self.writing:
            self._flush()

    def _flush(self) -> None:
        outgoing = self.outgoing
        while outgoing and not self.closed:
            data, carrying = outgoing[0]
            if carrying is None:
                try:
                    sent = self.sock.send(data)
                except BlockingIOError:
                    self._wantWrite(True)
                    return
                except OSError as e:
                    self.close(f"send failed: {e.strerror or e}")
                    return
                outgoing.popleft()
                if sent < len(data):
                    outgoing.appendleft((data[sent:], None))
                continue
            # The hand-offs at the head of the queue, in one message.
            run = [carrying]
            for _, more in islice(outgoing, 1, FDS_PER_MESSAGE):
                if more is None:
                    break
                run.append(more)
            data = CONN * len(run)
            try:
                sent = socket.send_fds(self.sock, [data], [s.fileno() for s in run])
            except BlockingIOError:
                self._wantWrite(True)
                return
            except OSError as e:
                # A dead service (EPIPE): what is queued, these too, gets the 503.
                self.close(f"send failed: {e.strerror or e}")
                return
            # The kernel holds the descriptors now (all of them ride with the
            # first byte sent): our copies go.
            for s in run:
                outgoing.popleft()
                s.close()
            self.queued -= len(run)
            self.handedOff += len(run)
            if sent < len(data):
                outgoing.appendleft((data[sent:], None))
        self._wantWrite(False)
        if self.closeWhenFlushed and not outgoing:
            self.close()
        elif self.paused and not self.closed:
            self._resume()

    def _wantWrite(self, want: bool) -> None:
        if want and not self.writing and not self.closed:
            self.writing = True
            self.dispatcher.reactor.addWriter(self)
        elif not want and self.writing:
            self.writing = False
            self.dispatcher.reactor.removeWriter(self)

    def doWrite(self) -> None:
        self.writing = True
        self._flush()

    def handOff(self, conn: socket.socket, now: bool = True) -> bool:
        """Queue one accepted connection for this registration; False when it is full.

        With ``now`` false it waits for ``flush``, so that the connections of
        one readiness event leave together."""
        if self.closed or self.closeWhenFlushed or self.queued >= MAX_QUEUED:
            return False
        self.outgoing.append((CONN, conn))
        self.queued += 1
        if now:
            self.flush()
        return True

    # ------------------------------------------------------------------ closing

    def close(self, why: str | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        reactor = self.dispatcher.reactor
        reactor.removeReader(self)
        if self.writing:
            reactor.removeWriter(self)
            self.writing = False
        unsent = self.takeQueued()
        self.outgoing.clear()
        self.sock.close()
        self.dispatcher.clientClosed(self, unsent, why)

    def connectionLost(self, reason: Failure) -> None:
        self.close()


def _descriptorsIn(ancillary: Iterable[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % 4
            fds.extend(struct.unpack(f"{usable // 4}i", data[:usable]))
    return fds


# --------------------------------------------------------------------------- the dispatcher


@dataclass(frozen=True)
class RegistrationFigures:
    uid: int
    handedOff: int
    queued: int
    registeredFor: float


class Dispatcher:
    """The registry (uid -> registration) and the decision for each accepted connection."""

    def __init__(
        self,
        reactor: Any,
        owners: Any = None,
        clock: Any = None,
        speakTimeout: float = SPEAK_TIMEOUT,
        serveRoot: bool = False,
        configSource: str = "the dispatcher's config",
        holdAfterStart: float = HOLD_AFTER_START,
    ) -> None:
        from agentsandbox.egress.peer import SocketTable

        self.reactor = reactor
        self.clock = clock if clock is not None else reactor
        self.speakTimeout = speakTimeout
        #: ``proxy.dispatch_root`` of the config at ``configSource``: whether uid 0 may register.
        self.serveRoot = serveRoot
        self.configSource = configSource
        #: Who owns client sockets: ``SocketTable.ownersOf([(client, server), ...])``.
        self.owners = owners if owners is not None else SocketTable()
        self.registrations: dict[int, Client] = {}
        self.clients: set[Client] = set()
        self.refusing: set[_Refusal] = set()
        #: ``refusing`` counted by uid, for ``REFUSING_PER_UID``.
        self.refusingByUid: Counter[int | None] = Counter()
        #: Unserved connections closed unanswered (their uid had no slot left), by uid.
        self.unanswered: Counter[int | None] = Counter()
        #: Uids at ``REFUSING_PER_UID``, and whether ``MAX_REFUSING`` is reached (said once each).
        self.uidsAtBound: set[int | None] = set()
        self.allAtBound = False
        self.ports: list[str] = []
        self.started = time.time()
        #: Connections of uids without a registration, held until ``HOLD_AFTER_START``
        #: seconds after this start (``holdUntil`` on ``clock``), by uid.
        self.held: dict[int, list[socket.socket]] = {}
        self.heldTotal = 0
        self.heldThenHanded = 0
        self.holdAfterStart = holdAfterStart
        self.holdUntil = self.clock.seconds() + holdAfterStart
        self.holdTimer: Any = None
        self.handedOff = 0
        self.unserved: Counter[int] = Counter()
        self.unknownPeers = 0
        #: Clients that closed before their socket was looked up (no owner to read).
        self.closedPeers = 0
        self.badClients = 0

    # ------------------------------------------------------------------ registrations

    def clientConnected(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        try:
            pid, uid = peerCredentials(sock)
        except OSError as e:
            log.warn("registration socket: a client without credentials ({e}); closed", e=e)
            sock.close()
            return
        waiting = sum(1 for c in self.clients if c.uid == uid and not c.registered)
        if waiting >= UNREGISTERED_PER_UID:
            log.warn(
                "registration socket: uid {uid} (pid {pid}) has {n} connections that have not "
                "registered; this one is closed",
                uid=uid, pid=pid, n=waiting,
            )  # fmt: skip
            self.badClients += 1
            sock.close()
            return
        self.clients.add(Client(self, sock))

    def register(self, client: Client) -> None:
        if client.uid == 0 and not self.serveRoot:
            # Off unless the admin says so: root's service would be handed every
            # connection the kernel reports as uid 0, and its policy is the machine's widest.
            client.refuse(rootRefusal(self.configSource))
            return
        old = self.registrations.get(client.uid)
        client.registered = True
        self.registrations[client.uid] = client
        client.send(encode({"op": "registered", "uid": client.uid, "ports": self.ports}))
        if old is not None and not old.closed:
            # The newer registration gets every connection from now on, and the
            # ones still queued for the old one.
            moved = old.takeQueued()
            old.registered = False
            old.send(encode({"op": "replaced"}))
            old.closeWhenFlushed = True
            old._flush()
            for conn in moved:
                if not client.handOff(conn):
                    self.refuse(conn, client.uid)
            log.info(
                "uid {uid}: a new registration (pid {pid}) replaces the one of pid {old}",
                uid=client.uid, pid=client.pid, old=old.pid,
            )  # fmt: skip
        else:
            log.info("uid {uid} registered (pid {pid})", uid=client.uid, pid=client.pid)
        held = self.held.pop(client.uid, [])
        if held:
            self.heldTotal -= len(held)
            log.info("uid {uid}: {n} connections held since the dispatcher started handed on", uid=client.uid, n=len(held))
            for conn in held:
                if client.handOff(conn, now=False):
                    self.handedOff += 1
                    self.heldThenHanded += 1
                else:
                    self.refuse(conn, client.uid)
            client.flush()

    def clientClosed(self, client: Client, unsent: list[socket.socket], why: str | None) -> None:
        """``client`` is closed (or refused and closing): drop its registration, re-route ``unsent``."""
        self.clients.discard(client)
        if self.registrations.get(client.uid) is client:
            del self.registrations[client.uid]
            log.info(
                "uid {uid}: registration of pid {pid} ended{why}; its connections get the 503 until it registers again",
                uid=client.uid, pid=client.pid, why=f" ({why})" if why else "",
            )  # fmt: skip
        for conn in unsent:
            successor = self.registrations.get(client.uid)
            if successor is None or not successor.handOff(conn):
                self.refuse(conn, client.uid)

    # ------------------------------------------------------------------ connections

    def connectionAccepted(self, conn: socket.socket, client: tuple[str, int], server: tuple[str, int]) -> None:
        """Hand ``conn`` to its owner's service, or refuse it; no byte of it is read here."""
        self.connectionsAccepted([(conn, client, server)])

    def connectionsAccepted(self, accepted: Sequence[tuple[socket.socket, tuple[str, int], tuple[str, int]]]) -> None:
        """``connectionAccepted`` for one readiness event's connections, (conn, client, server) each.

        Their owners are asked of the kernel together, and each service's
        share leaves in one message once all are sorted."""
        try:
            uids = self.owners.ownersOf([(client, server) for _, client, server in accepted])
        except Exception as e:
            for _, client, _ in accepted:
                log.warn("cannot tell who owns {client}: {e}; closed", client=_showAddress(client), e=e)
            uids = [None] * len(accepted)
        due: list[Client] = []
        for (conn, client, _), uid in zip(accepted, uids, strict=True):
            if uid is None:
                self.unknownPeers += 1
                log.warn("no socket of {client} in the kernel's socket table; closed", client=_showAddress(client))
                conn.close()
                continue
            if uid is CLOSED:
                # Its socket has no owner any more (the kernel says uid 0 for
                # it): handed to anyone, it would be served as that one's.
                self.closedPeers += 1
                log.info("{client}: {why}; closed, not handed on", client=_showAddress(client), why=CLOSED_REFUSAL)
                conn.close()
                continue
            registration = self.registrations.get(uid)
            if registration is not None and registration.handOff(conn, now=False):
                self.handedOff += 1
                if not registration.flushDue:
                    registration.flushDue = True
                    due.append(registration)
                continue
            if registration is not None:
                log.warn("uid {uid}'s service is not taking connections ({n} queued)", uid=uid, n=registration.queued)
            elif self.hold(conn, uid):
                continue
            self.refuse(conn, uid)
        for registration in due:
            registration.flush()

    def hold(self, conn: socket.socket, uid: int) -> bool:
        """Keep ``conn`` for ``uid``'s service while the dispatcher has just started; False past it."""
        now = self.clock.seconds()
        if now >= self.holdUntil or self.heldTotal >= MAX_HELD:
            return False
        self.held.setdefault(uid, []).append(conn)
        self.heldTotal += 1
        if self.holdTimer is None:
            self.holdTimer = self.clock.callLater(self.holdUntil - now, self.holdOver)
        return True

    def holdOver(self) -> None:
        """The hold after start is over: whatever is still held gets the 503."""
        self.holdTimer = None
        held, self.held, self.heldTotal = self.held, {}, 0
        for uid, conns in sorted(held.items()):
            log.info(
                "uid {uid} did not register within {s:g} s of the dispatcher's start; "
                "{n} held connections get the 503",
                uid=uid, s=self.holdAfterStart, n=len(conns),
            )  # fmt: skip
            for conn in conns:
                self.refuse(conn, uid)

    def refuse(self, conn: socket.socket, uid: int | None) -> None:
        if uid is not None:
            self.unserved[uid] += 1
        # One log line when a flood reaches a bound, not one per connection.
        if self.refusingByUid[uid] >= REFUSING_PER_UID:
            if uid not in self.uidsAtBound:
                self.uidsAtBound.add(uid)
                log.warn(
                    "uid {uid} has {n} connections being refused already; its next ones are closed "
                    "unanswered until one of those ends",
                    uid="?" if uid is None else uid, n=REFUSING_PER_UID,
                )  # fmt: skip
        elif len(self.refusing) >= MAX_REFUSING:
            if not self.allAtBound:
                self.allAtBound = True
                log.warn("{n} connections are being refused already; more are closed unanswered until one ends", n=MAX_REFUSING)
        else:
            _Refusal(self, conn, uid)
            return
        self.unanswered[uid] += 1
        conn.close()

    def refusalEnded(self, uid: int | None) -> None:
        """One of ``uid``'s refusals is over (``refusing`` no longer holds it)."""
        held = self.refusingByUid[uid] - 1
        if held > 0:
            self.refusingByUid[uid] = held
        else:
            del self.refusingByUid[uid]
        if held < REFUSING_PER_UID:
            self.uidsAtBound.discard(uid)
        if len(self.refusing) < MAX_REFUSING:
            self.allAtBound = False

    # ------------------------------------------------------------------ status

    def status(self) -> dict[str, Any]:
        """Registered uids and counts; never a path or a byte of payload."""
        now = time.time()
        registered = [
            RegistrationFigures(uid, c.handedOff, c.queued, round(now - c.since, 1))
            for uid, c in sorted(self.registrations.items())
        ]
        return {
            "pid": os.getpid(),
            "uptime": round(now - self.started, 1),
            "ports": list(self.ports),
            "registered": [r.__dict__ for r in registered],
            "handedOff": self.handedOff,
            "unserved": {str(uid): n for uid, n in sorted(self.unserved.items())},
            "unanswered": {str(uid): n for uid, n in sorted(self.unanswered.items(), key=lambda item: str(item[0]))},
            "unknownPeers": self.unknownPeers,
            "closedPeers": self.closedPeers,
            "refusedClients": self.badClients,
            "servesRoot": self.serveRoot,
            "held": self.heldTotal,
            "heldThenHanded": self.heldThenHanded,
        }

    def closeAll(self) -> None:
        if self.holdTimer is not None and self.holdTimer.active():
            self.holdTimer.cancel()
        self.holdTimer = None
        for conns in self.held.values():
            for conn in conns:
                conn.close()
        self.held, self.heldTotal = {}, 0
        for client in list(self.clients):
            client.close("the dispatcher is stopping")
        for refusal in list(self.refusing):
            refusal.close()


# --------------------------------------------------------------------------- listening sockets


#: What a listener does with one readiness event's accepted (socket, address) pairs.
Accepted = Callable[[list[tuple[socket.socket, Any]]], None]


@implementer(IReadDescriptor)
class _Acceptor:
    """A listening socket in the reactor; what each readiness event accepts goes to ``accepted``."""

    def __init__(self, sock: socket.socket, accepted: Accepted) -> None:
        self.sock = sock
        self.accepted = accepted
        sock.setblocking(False)

    def fileno(self) -> int:
        return self.sock.fileno()

    def logPrefix(self) -> str:
        return "dispatch-listener"

    def doRead(self) -> None:
        batch: list[tuple[socket.socket, Any]] = []
        accept = self.sock.accept
        for _ in range(ACCEPT_BATCH):
            try:
                batch.append(accept())
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno in (errno.ECONNABORTED, errno.EPROTO):
                    continue
                # Out of descriptors or memory: say so, and try at the next event.
                log.error("accept on {where} failed: {e}", where=self.sock.getsockname(), e=e.strerror or e)
                break
        if batch:
            self.accepted(batch)

    def connectionLost(self, reason: Failure) -> None:
        pass


class ListeningService(Service):
    """One listening socket, read by the reactor while the service runs."""

    def __init__(self, reactor: Any, sock: socket.socket, accepted: Accepted, cleanup: str | None = None) -> None:
        self.reactor = reactor
        self.acceptor = _Acceptor(sock, accepted)
        #: A socket file this service created and removes when it stops.
        self.cleanup = cleanup

    def startService(self) -> None:
        super().startService()
        self.reactor.addReader(self.acceptor)

    def stopService(self) -> None:
        super().stopService()
        self.reactor.removeReader(self.acceptor)
        self.acceptor.sock.close()
        if self.cleanup is not None:
            try:
                os.unlink(self.cleanup)
            except OSError:
                pass


class DispatchService(MultiService):
    """The dispatcher: its listening sockets (children) and the ``Dispatcher`` they feed."""

    def __init__(
        self,
        reactor: Any,
        tcp: list[socket.socket],
        registration: list[socket.socket],
        *,
        owners: Any = None,
        clock: Any = None,
        speakTimeout: float = SPEAK_TIMEOUT,
        createdSocket: str | None = None,
        serveRoot: bool = False,
        configSource: str = "the dispatcher's config",
        holdAfterStart: float = HOLD_AFTER_START,
    ) -> None:
        super().__init__()
        self.reactor = reactor
        self.dispatcher = Dispatcher(reactor, owners, clock, speakTimeout, serveRoot, configSource, holdAfterStart)
        for sock in tcp:
            local = _address(sock.getsockname())
            self.dispatcher.ports.append(_showAddress(local))
            ListeningService(reactor, sock, self._tcpAccepted(local)).setServiceParent(self)
        for sock in registration:
            ListeningService(reactor, sock, self._clientsAccepted, createdSocket).setServiceParent(self)

    def _clientsAccepted(self, batch: list[tuple[socket.socket, Any]]) -> None:
        for conn, _ in batch:
            self.dispatcher.clientConnected(conn)

    def _tcpAccepted(self, local: tuple[str, int]) -> Accepted:
        # A listener bound to one address gives every connection that address;
        # a wildcard one (a socket unit's choice) needs getsockname per connection.
        wildcard = local[0] in ("0.0.0.0", "::")

        def accepted(batch: list[tuple[socket.socket, Any]]) -> None:
            self.dispatcher.connectionsAccepted(
                [(conn, _address(address), _address(conn.getsockname()) if wildcard else local) for conn, address in batch]
            )

        return accepted

    def stopService(self) -> Any:
        self.dispatcher.closeAll()
        return super().stopService()


def inheritedSockets(environ: dict[str, str] | None = None) -> tuple[list[socket.socket], list[socket.socket]] | None:
    """(TCP, Unix) listening sockets systemd passed this process, or None without socket activation.

    Each descriptor is sorted by its family, not its position, so the socket
    unit's order of ``ListenStream=`` lines does not matter (Twisted 22.4 has no
    lookup by ``FileDescriptorName=``, and none is needed here).
    """
    env = os.environ if environ is None else environ
    if env.get("LISTEN_PID") != str(os.getpid()) or not env.get("LISTEN_FDS", "").isdigit():
        return None
    tcp: list[socket.socket] = []
    unix: list[socket.socket] = []
    for fd in range(3, 3 + int(env["LISTEN_FDS"])):
        os.set_inheritable(fd, False)
        sock = socket.socket(fileno=fd)
        if sock.family == socket.AF_UNIX:
            unix.append(sock)
        elif sock.family in (socket.AF_INET, socket.AF_INET6):
            # As bindTCP does, whatever the socket unit says (NoDelay=).
            _noDelay(sock)
            tcp.append(sock)
        else:
            log.warn("an inherited descriptor {fd} of family {family} is not used", fd=fd, family=sock.family)
            sock.close()
    for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(name, None)
    return tcp, unix


def _noDelay(listener: socket.socket) -> None:
    """``TCP_NODELAY`` on a listening socket: every connection accepted from it
    inherits it (Linux), so the socket handed over already has it; the user's
    proxy sets it again on what it adopts (``egress/nodelay.py`` says why)."""
    try:
        listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass


class DispatchStartError(Exception):
    """The dispatcher cannot listen: says where and why."""


def bindTCP(port: int) -> list[socket.socket]:
    """Listening sockets on 127.0.0.1:port and [::1]:port (the second only where IPv6 is)."""
    sockets: list[socket.socket] = []
    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as e:
            log.warn("no {host} listener: {e}", host=host, e=e.strerror or e)
            continue
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            _noDelay(sock)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((host, port))
            sock.listen(1024)
        except OSError as e:
            sock.close()
            if family == socket.AF_INET6 and e.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                log.warn("no [::1]:{port} listener: {e}", port=port, e=e.strerror or e)
                continue
            for s in sockets:
                s.close()
            why = portTaken(port) if e.errno == errno.EADDRINUSE else "(another agentsandbox on the port?)"
            raise DispatchStartError(f"cannot listen on {_showAddress((host, port))}: {e.strerror or e}: {why}") from None
        sockets.append(sock)
    return sockets


def portTaken(port: int, procDir: str = "/proc") -> str:
    """Who holds ``port`` (uid, and pid and command where /proc shows them), and the recovery order."""
    from agentsandbox.probes import portHolders

    holders = portHolders(port, procDir)
    held = "; ".join(h.describe() for h in holders) if holders else "by a socket this process cannot see"
    pids = [str(p) for h in holders for p in h.pids]
    stop = "stop it (if it is a user's agentsandbox service, that user runs `systemctl --user stop agentsandbox` or ends `agentsandbox serve`"
    stop += f"; as root: `kill {' '.join(pids)}`)" if pids else ")"
    return (
        f"the port is held by {held}. Recovery, in this order: {stop}; start the dispatcher again; "
        "then start that user's service again: on a machine with the dispatcher's unit or "
        f"{SYSTEM_CONFIG} it waits for the dispatcher and registers instead of binding the port"
    )


def bindRegistration(path: str) -> socket.socket:
    """The registration socket at ``path``, mode 0666, in a directory made 0755 if missing.

    A stale socket file (nobody accepts on it) is replaced; a live one means
    another dispatcher runs, and this one does not start.
    """
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, mode=0o755, exist_ok=True)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise DispatchStartError(f"{path} exists and is not a socket; remove it or pass --socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)
        else:
            raise DispatchStartError(f"another dispatcher accepts on {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        # Every user registers here; who they are comes from SO_PEERCRED, not the mode.
        os.chmod(path, 0o666)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise DispatchStartError(f"cannot listen on {path}: {e.strerror or e}") from None
    return sock


def makeService(
    reactor: Any, port: int, socketPath: str, environ: dict[str, str] | None = None, **kwargs: Any
) -> DispatchService:
    """The dispatcher on inherited sockets (socket activation), else on ``port`` and ``socketPath``."""
    inherited = inheritedSockets(environ)
    if inherited is not None:
        tcp, unix = inherited
        if not tcp or not unix:
            raise DispatchStartError(
                "socket activation passed no TCP socket or no Unix socket (agentsandbox-dispatch.socket "
                "needs ListenStream= lines for both)"
            )
        return DispatchService(reactor, tcp, unix, **kwargs)
    bound = bindTCP(port)
    try:
        registration = bindRegistration(socketPath)
    except DispatchStartError:
        for s in bound:
            s.close()
        raise
    return DispatchService(reactor, bound, [registration], createdSocket=socketPath, **kwargs)


# --------------------------------------------------------------------------- a dispatcher's status, in words


def statusText(status: dict[str, Any]) -> str:
    lines = [
        f"dispatcher  pid {status.get('pid', '?')}, up {status.get('uptime', '?')}s, "
        f"ports {', '.join(status.get('ports') or ()) or 'none'}",
        f"handed off  {status.get('handedOff', 0)} connections",
    ]
    registered = status.get("registered") or []
    if not registered:
        lines.append("registered  no service")
    for i, r in enumerate(registered):
        lines.append(
            ("registered  " if i == 0 else "            ")
            + f"uid {r.get('uid')}: {r.get('handedOff', 0)} handed off, {r.get('queued', 0)} queued, "
            f"for {r.get('registeredFor', 0)}s"
        )
    unserved = status.get("unserved") or {}
    unanswered = status.get("unanswered") or {}
    if unserved:
        lines.append(
            "unserved    "
            + ", ".join(f"uid {u}: {n}" + (f" ({unanswered[u]} closed unanswered)" if unanswered.get(u) else "") for u, n in unserved.items())
        )
    lines.append(f"unknown     {status.get('unknownPeers', 0)} peers not in the socket table, "
                 f"{status.get('closedPeers', 0)} closed before the check, "
                 f"{status.get('refusedClients', 0)} registration clients refused")  # fmt: skip
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- the command


def main(argv: list[str]) -> int:
    from agentsandbox import cli

    parser = cli.parser(
        "dispatch",
        "The system dispatcher: owns the proxy port for every user of this machine and "
        "hands each connection to its owner's agentsandbox service.  Runs in the foreground "
        "(systemd: agentsandbox-dispatch.socket).  Of the config (--config, else the usual lookup: "
        "the machine's /etc/agentsandbox/config.toml) it reads proxy.port and proxy.dispatch_root.",
    )
    parser.add_argument("--port", type=int, help=f"the proxy port (default: the config's proxy.port, {DEFAULT_PROXY_PORT})")
    parser.add_argument("--socket", help=f"the registration socket (default: {DISPATCH_SOCKET})")
    parser.add_argument(
        "--speak-timeout", type=float, default=SPEAK_TIMEOUT, metavar="SECONDS",
        help=f"how long a registration-socket client may stay silent before it is closed (default {SPEAK_TIMEOUT:g})",
    )  # fmt: skip
    parser.add_argument(
        "--hold-after-start", type=float, default=HOLD_AFTER_START, metavar="SECONDS",
        help="how long after its start a connection of a user without a registered service is held "
        f"for that service to register (after a restart) before its 503 (default {HOLD_AFTER_START:g}; 0: never)",
    )  # fmt: skip
    parser.add_argument("--status", action="store_true", help="ask the running dispatcher for its status, then exit")
    parser.add_argument("--json", action="store_true", help="with --status: print it as JSON")
    args = parser.parse_args(argv)
    path = args.socket or DISPATCH_SOCKET

    if args.status:
        try:
            status = askStatus(path)
        except DispatchQueryError as e:
            print(f"agentsandbox dispatch: {e}", file=sys.stderr)
            return 1
        status.pop("op", None)
        sys.stdout.write(json.dumps(status, indent=2, sort_keys=True) + "\n" if args.json else statusText(status))
        return 0

    port = args.port
    activated = os.environ.get("LISTEN_PID") == str(os.getpid())
    if port is not None and not 0 < port < 65536:
        print(f"agentsandbox dispatch: --port {port} is not a port from 1 to 65535", file=sys.stderr)
        return 2
    if not args.speak_timeout > 0:
        print("agentsandbox dispatch: --speak-timeout must be positive", file=sys.stderr)
        return 2
    if not 0 <= args.hold_after_start <= 60:
        print("agentsandbox dispatch: --hold-after-start must be from 0 to 60 seconds", file=sys.stderr)
        return 2
    # Read under socket activation too: whether root may register is the
    # machine's decision, and the sockets systemd passes do not say it.
    from agentsandbox.config import BUILTIN

    config = cli.loadConfig("dispatch", args.config)
    if port is None and not activated:
        port = config.proxy.port
    source = config.source
    if source == BUILTIN:
        source = f"the built-in defaults (no config file was found; the machine's is {SYSTEM_CONFIG})"
    return _run(
        port or DEFAULT_PROXY_PORT, path, activated, args.speak_timeout,
        serveRoot=config.proxy.dispatch_root, configSource=source, holdAfterStart=args.hold_after_start,
    )  # fmt: skip


def _run(
    port: int, path: str, activated: bool, speakTimeout: float, serveRoot: bool, configSource: str,
    holdAfterStart: float = HOLD_AFTER_START,
) -> int:
    from twisted.internet import reactor as installed
    from twisted.logger import globalLogBeginner, textFileLogObserver

    reactor: Any = installed
    globalLogBeginner.beginLoggingTo([textFileLogObserver(sys.stdout, timeFormat="%H:%M:%S")], redirectStandardIO=False)
    _raiseDescriptorLimit()
    try:
        service = makeService(
            reactor, port, path, speakTimeout=speakTimeout, serveRoot=serveRoot, configSource=configSource,
            holdAfterStart=holdAfterStart,
        )
    except DispatchStartError as e:
        print(f"agentsandbox dispatch: {e}", file=sys.stderr)
        return 1

    def start() -> None:
        service.startService()
        log.info(
            "dispatching {ports} to registered services (registration socket {path}; uid 0 {root})",
            ports=", ".join(service.dispatcher.ports), path="from systemd" if activated else path,
            root="may register" if serveRoot else f"may not register: {ROOT_KEY} is not true in {configSource}",
        )  # fmt: skip

    reactor.callWhenRunning(start)
    reactor.addSystemEventTrigger("before", "shutdown", lambda: service.stopService() if service.running else None)
    reactor.run()
    return 0


def _raiseDescriptorLimit() -> None:
    # Descriptors in flight to a service count against this process's limit
    # until that service reads them.
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
