"""Splicing a granted tunnel: client <-> upstream, both directions, with back-pressure.

Each side's transport is registered as the streaming producer of the other, so
a slow reader on one side pauses reading on the other: memory stays bounded
by the transports' write buffers whatever the speeds.  An EOF in one
direction becomes a write half-close on the other (``loseWriteConnection``);
the tunnel ends when both directions have ended, or at once when either side
fails.  An upstream reset is passed to the client as a reset (abort), so a
truncated transfer never looks complete.

The per-chunk Python work is a length count for the audit and one ``write``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IHalfCloseableProtocol, ITCPTransport
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from zope.interface import implementer

#: Called once when a tunnel ends: (tunnel, why) where why is None for a clean end.
OnClose = Callable[["Tunnel", "str | None"], None]


@implementer(IHalfCloseableProtocol)
class UpstreamProtocol(Protocol):
    """The upstream side of a tunnel; everything it receives goes to the tunnel."""

    tunnel: Tunnel | None = None

    def __init__(self) -> None:
        self._early: list[bytes] = []
        self._earlyEOF = False
        self._earlyLost: Failure | None = None

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
        self.client.registerProducer(self.upstream, True)
        self.upstream.registerProducer(self.client, True)
        upstream.attach(self)

    # client -> upstream
    def fromClient(self, data: bytes) -> None:
        self.up += len(data)
        self.upstream.write(data)

    def clientReadLost(self) -> None:
        self._clientEOF = True
        if ITCPTransport.providedBy(self.upstream):
            self.upstream.loseWriteConnection()
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
        self.client.write(data)

    def upstreamReadLost(self) -> None:
        self._upstreamEOF = True
        self.client.loseWriteConnection()
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


def zeroCopy(tunnel: Tunnel, reactor: Any) -> bool:
    """Hand an established tunnel to the kernel's splice(2); False keeps Twisted's copy loop."""
    return False
