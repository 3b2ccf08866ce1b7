"""Splicing a granted tunnel: client <-> upstream, both directions, with back-pressure.

Each side's transport is registered as the streaming producer of the other, so
a slow reader on one side pauses reading on the other: memory stays bounded
by the transports' write buffers whatever the speeds.  An EOF in one
direction becomes a write half-close on the other (``loseWriteConnection``);
the tunnel ends when both directions have ended, or at once when either side
fails.  An upstream reset is passed to the client as a reset (abort), so a
truncated transfer never looks complete.

The per-chunk Python work is a length count for the audit and one write,
sent at once when nothing is queued before it (``privates.writeNow``).

Once a plain tunnel is established, ``ZeroCopy`` may take both sockets out of
Twisted's copy loop and move bytes with ``splice(2)`` through a pipe per
direction: the data never enters Python, and the pipe is the back-pressure
(a direction stops reading when its pipe is full and resumes when the other
socket has drained it).  Half-close and resets follow the same rules as
above.  The sockets stay registered with the reactor through small
descriptor objects, so the reactor (and its clock) still drive everything,
and at the end the Twisted transports are closed the ordinary way so every
protocol sees its ``connectionLost``.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import sys
from collections.abc import Callable
from typing import Any

from twisted.internet.error import ConnectionAborted, ConnectionDone
from twisted.internet.interfaces import IHalfCloseableProtocol, ITCPTransport
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from zope.interface import implementer

from agentsandbox.egress.nodelay import noDelay
from agentsandbox.egress.privates import ENABLED as PRIVATES
from agentsandbox.egress.privates import clearOutput, shutWrite, takeOutput, writeNow, writeOpen

#: Called once when a tunnel ends: (tunnel, why) where why is None for a clean end.
OnClose = Callable[["Tunnel", "str | None"], None]


@implementer(IHalfCloseableProtocol)
class UpstreamProtocol(Protocol):
    """The upstream side of a tunnel; everything it receives goes to the tunnel."""

    tunnel: Tunnel | None = None
    transport: Any
    #: Called with this protocol from ``connectionMade`` when the dial is not an
    #: endpoint's (``dial.TCPDialer.dial``), which would fire its own Deferred.
    onConnected: Callable[[UpstreamProtocol], None] | None = None

    def __init__(self) -> None:
        self._early: list[bytes] = []
        self._earlyEOF = False
        self._earlyLost: Failure | None = None

    def connectionMade(self) -> None:
        # Every dial's socket, whichever dialler made it (through a parent
        # proxy, ParentHandshake has set it already; a second call is harmless).
        noDelay(self.transport)
        connected, self.onConnected = self.onConnected, None
        if connected is not None:
            connected(self)

    def attach(self, tunnel: Tunnel) -> None:
        self.tunnel = tunnel
        for chunk in self._early:
            tunnel.fromUpstream(chunk)
        self._early = []
        if self._earlyEOF:
            tunnel.upstreamReadLost()
        if self._earlyLost is not None:
            tunnel.upstreamLost(self._earlyLost)

    def dataReceived(self, data: bytes) -> None:
        if self.tunnel is None:
            self._early.append(data)
        else:
            self.tunnel.fromUpstream(data)

    def readConnectionLost(self) -> None:
        if self.tunnel is None:
            self._earlyEOF = True
        else:
            self.tunnel.upstreamReadLost()

    def writeConnectionLost(self) -> None:
        if self.tunnel is not None:
            self.tunnel.upstreamWriteLost()

    def connectionLost(self, reason: Failure = Failure(ConnectionDone())) -> None:  # noqa: B008
        if self.tunnel is None:
            self._earlyLost = reason
        else:
            self.tunnel.upstreamLost(reason)


class Tunnel:
    """One spliced tunnel.  ``up`` counts client->upstream bytes, ``down`` the reverse."""

    def __init__(
        self,
        client: Any,
        upstream: UpstreamProtocol,
        onClose: OnClose,
        idleTimeout: float,
        startedAt: float,
    ) -> None:
        self.client = client
        self.upstreamProtocol = upstream
        self.upstream: Any = upstream.transport
        self.onClose = onClose
        self.idleTimeout = idleTimeout
        self.startedAt = startedAt
        self.up = 0
        self.down = 0
        self.idleMark = -1
        self.idleSince = startedAt
        self._clientEOF = False
        self._upstreamEOF = False
        self._closed = False
        self.engine: ZeroCopy | None = None
        self._volume: tuple[int, Callable[[Tunnel], None]] | None = None
        self._clock: Any = None
        self.client.registerProducer(self.upstream, True)
        self.upstream.registerProducer(self.client, True)
        upstream.attach(self)

    def onVolume(self, threshold: int, callback: Callable[[Tunnel], None], clock: Any) -> None:
        """Call ``callback(self)`` once, from a reactor turn, after ``threshold`` bytes moved."""
        self._volume = (threshold, callback)
        self._clock = clock
        if self.up + self.down >= threshold:
            self._volumeReached()

    def _volumeReached(self) -> None:
        assert self._volume is not None
        _, callback = self._volume
        self._volume = None
        # Not from inside dataReceived: the transports are mid-read there.
        self._clock.callLater(0, lambda: None if self._closed else callback(self))

    # client -> upstream
    def fromClient(self, data: bytes) -> None:
        self.up += len(data)
        writeNow(self.upstream, data)
        if self._volume is not None and self.up + self.down >= self._volume[0]:
            self._volumeReached()

    def clientReadLost(self) -> None:
        if self._clientEOF:
            return
        self._clientEOF = True
        # When the other direction has ended too, closing (after the buffered
        # bytes) says the same as a write shutdown, one step sooner.
        if not self._upstreamEOF and ITCPTransport.providedBy(self.upstream):
            shutWrite(self.upstream)
        self._maybeFinish()

    def clientLost(self, reason: Failure) -> None:
        if self._closed:
            return
        clean = reason.check(ConnectionDone) is not None and self._clientEOF
        if clean:
            self.upstream.loseConnection()
        else:
            self.upstream.abortConnection()
        self._finish(None if clean else _why(reason, "client"))

    # upstream -> client
    def fromUpstream(self, data: bytes) -> None:
        self.down += len(data)
        writeNow(self.client, data)
        if self._volume is not None and self.up + self.down >= self._volume[0]:
            self._volumeReached()

    def upstreamReadLost(self) -> None:
        if self._upstreamEOF:
            return
        self._upstreamEOF = True
        if not self._clientEOF:
            shutWrite(self.client)
        self._maybeFinish()

    def upstreamWriteLost(self) -> None:
        pass

    def upstreamLost(self, reason: Failure) -> None:
        if self._closed:
            return
        clean = reason.check(ConnectionDone) is not None
        if clean:
            self.client.loseConnection()
        else:
            self.client.abortConnection()
        self._finish(None if clean else _why(reason, "upstream"))

    # ending
    def _maybeFinish(self) -> None:
        if self._clientEOF and self._upstreamEOF:
            self.client.loseConnection()
            self.upstream.loseConnection()

    def close(self, why: str) -> None:
        """End the tunnel now (idle timeout, shutdown)."""
        if self._closed:
            return
        if self.engine is not None:
            self.engine.abort(why)
            return
        self.client.abortConnection()
        self.upstream.abortConnection()
        self._finish(why)

    def _finish(self, why: str | None) -> None:
        if self._closed:
            return
        self._closed = True
        for t in (self.client, self.upstream):
            try:
                t.unregisterProducer()
            except Exception:  # a transport already torn down has nothing to unregister
                pass
        self.onClose(self, why)

    @property
    def closed(self) -> bool:
        return self._closed


def _why(reason: Failure, side: str) -> str:
    return f"{side} connection ended: {reason.getErrorMessage()}"


#: Bytes per splice(2) call and the pipe size asked for (the kernel may give less).
SPLICE_CHUNK = 1 << 20
PIPE_SIZE = 1 << 20
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_SPLICE_FLAGS = getattr(os, "SPLICE_F_MOVE", 1) | getattr(os, "SPLICE_F_NONBLOCK", 2)
_RESET = (errno.ECONNRESET, errno.EPIPE, errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH)


def zeroCopyAvailable() -> bool:
    """Whether tunnels may move to splice(2): Linux, Python 3.10+, and the hand-over
    may take Twisted's buffers (``privates.ENABLED``)."""
    return PRIVATES and sys.platform.startswith("linux") and hasattr(os, "splice")


class _Direction:
    """One direction src -> dst through a pipe.  ``pending`` holds bytes Twisted had buffered."""

    def __init__(self, src: int, dst: int, pending: bytes) -> None:
        self.src = src
        self.dst = dst
        self.pending = pending
        self.readPipe, self.writePipe = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            fcntl.fcntl(self.writePipe, _F_SETPIPE_SZ, PIPE_SIZE)
        except OSError:
            pass  # the default 64 KiB pipe still works, only slower
        self.inPipe = 0
        self.eof = False
        self.shut = False
        self.moved = 0

    def close(self) -> None:
        for fd in (self.readPipe, self.writePipe):
            try:
                os.close(fd)
            except OSError:
                pass

    def fill(self) -> None:
        """Move what ``src`` has into the pipe (stops at EAGAIN, EOF or a full pipe)."""
        while not self.eof:
            try:
                n = os.splice(self.src, self.writePipe, SPLICE_CHUNK, flags=_SPLICE_FLAGS)
            except BlockingIOError:
                return
            if n == 0:
                self.eof = True
                return
            self.inPipe += n

    def drain(self) -> bool:
        """Move the pipe (and pending bytes) into ``dst``; True when nothing is left."""
        while self.pending:
            try:
                n = os.write(self.dst, self.pending)
            except BlockingIOError:
                return False
            self.pending = self.pending[n:]
        while self.inPipe:
            try:
                n = os.splice(self.readPipe, self.dst, self.inPipe, flags=_SPLICE_FLAGS)
            except BlockingIOError:
                return False
            self.inPipe -= n
            self.moved += n
        return True


class _Socket:
    """The reactor's view of one tunnel socket: readable -> pump out, writable -> drain in."""

    def __init__(self, engine: ZeroCopy, fd: int, side: str) -> None:
        self.engine = engine
        self.fd = fd
        self.side = side

    def fileno(self) -> int:
        return self.fd

    def logPrefix(self) -> str:
        return f"ZeroCopy({self.side})"

    def doRead(self) -> None:
        self.engine.readable(self)

    def doWrite(self) -> None:
        self.engine.writable(self)

    def connectionLost(self, reason: Failure) -> None:
        self.engine.abort(f"{self.side} socket lost: {reason.getErrorMessage()}")


class ZeroCopy:
    """Moves an established tunnel's bytes with splice(2); see the module docstring."""

    def __init__(self, tunnel: Tunnel, reactor: Any, clientPending: bytes, upstreamPending: bytes) -> None:
        self.tunnel = tunnel
        self.reactor = reactor
        c = tunnel.client.fileno()
        u = tunnel.upstream.fileno()
        self.clientSock = _Socket(self, c, "client")
        self.upstreamSock = _Socket(self, u, "upstream")
        self.up = _Direction(c, u, upstreamPending)
        try:
            self.down = _Direction(u, c, clientPending)
        except OSError:
            self.up.close()
            raise
        self.finished = False
        self.upBase = tunnel.up
        self.downBase = tunnel.down

    def start(self) -> None:
        self.reactor.addReader(self.clientSock)
        self.reactor.addReader(self.upstreamSock)
        if self.up.pending:
            self.reactor.addWriter(self.upstreamSock)
        if self.down.pending:
            self.reactor.addWriter(self.clientSock)

    def _dirs(self, sock: _Socket) -> tuple[_Direction, _Direction, _Socket]:
        """(the direction this socket feeds, the one it drains, the other socket)."""
        if sock is self.clientSock:
            return self.up, self.down, self.upstreamSock
        return self.down, self.up, self.clientSock

    def _count(self) -> None:
        self.tunnel.up = self.upBase + self.up.moved
        self.tunnel.down = self.downBase + self.down.moved

    def readable(self, sock: _Socket) -> None:
        out, _, other = self._dirs(sock)
        try:
            out.fill()
        except OSError as e:
            self._failed(e, sock)
            return
        try:
            done = out.drain()
        except OSError as e:
            self._failed(e, other)
            return
        if not done:
            # The other socket is full: stop reading here until it drains the pipe.
            self.reactor.removeReader(sock)
            self.reactor.addWriter(other)
        elif out.eof:
            self.reactor.removeReader(sock)
            self._shut(out, other)
        self._count()

    def writable(self, sock: _Socket) -> None:
        _, inbound, other = self._dirs(sock)
        try:
            done = inbound.drain()
        except OSError as e:
            self._failed(e, sock)
            return
        if done:
            self.reactor.removeWriter(sock)
            if inbound.eof:
                self._shut(inbound, sock)
            elif not self.finished:
                self.reactor.addReader(other)
        self._count()

    def _shut(self, direction: _Direction, dst: _Socket) -> None:
        if direction.shut:
            return
        direction.shut = True
        transport = self.tunnel.client if dst is self.clientSock else self.tunnel.upstream
        try:
            transport.socket.shutdown(socket.SHUT_WR)
        except (OSError, AttributeError):
            pass
        if self.up.shut and self.down.shut:
            self._finish(None)

    def _failed(self, e: OSError, sock: _Socket) -> None:
        if e.errno in _RESET:
            why = f"{sock.side} connection ended: {e.strerror}"
        else:
            why = f"{sock.side} splice failed: {e.strerror or e}"
        self._finish(why)

    def abort(self, why: str) -> None:
        self._finish(why)

    def _finish(self, why: str | None) -> None:
        if self.finished:
            return
        self.finished = True
        self._count()
        for s in (self.clientSock, self.upstreamSock):
            self.reactor.removeReader(s)
            self.reactor.removeWriter(s)
        self.up.close()
        self.down.close()
        tunnel = self.tunnel
        tunnel._finish(why)
        # A clean end closes both sockets in order; a failure resets both
        # (ConnectionAborted makes Twisted close with SO_LINGER 0), so a
        # truncated transfer never looks complete, as in the copy loop.
        reason = Failure(ConnectionDone()) if why is None else Failure(ConnectionAborted())
        for t in (tunnel.client, tunnel.upstream):
            try:
                t.connectionLost(reason)
            except Exception:  # the audit is written; one protocol's teardown must not stop the other's
                pass


def zeroCopy(tunnel: Tunnel, reactor: Any) -> bool:
    """Hand an established tunnel to splice(2).  False keeps Twisted's copy loop.

    Only plain TCP transports on both sides qualify (no TLS, no half-closed
    direction yet), on Linux with ``os.splice`` (Python 3.10+).
    """
    if not zeroCopyAvailable() or tunnel.closed or tunnel._clientEOF or tunnel._upstreamEOF:
        return False
    client, upstream = tunnel.client, tunnel.upstream
    for t in (client, upstream):
        if type(t).__module__ != "twisted.internet.tcp" or getattr(t, "disconnecting", True):
            return False
        if not writeOpen(t):
            return False
    clientPending = takeOutput(client)
    upstreamPending = takeOutput(upstream)
    if clientPending is None or upstreamPending is None:
        return False
    try:
        engine = ZeroCopy(tunnel, reactor, clientPending, upstreamPending)
    except OSError:
        return False  # out of fds for pipes: the copy loop still works
    for t in (client, upstream):
        t.unregisterProducer()
        t.stopReading()
        t.stopWriting()
        clearOutput(t)
    tunnel.engine = engine
    engine.start()
    return True
