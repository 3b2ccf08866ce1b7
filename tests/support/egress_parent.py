"""A stand-in organisation proxy: CONNECT only, its own name table, a deny list, a log."""

from __future__ import annotations

from typing import Any

from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.interfaces import IHalfCloseableProtocol
from twisted.internet.protocol import Factory, Protocol
from zope.interface import implementer


@implementer(IHalfCloseableProtocol)
class _Up(Protocol):
    def __init__(self, down: ParentConnection) -> None:
        self.down = down

    def connectionMade(self) -> None:
        self.down.up = self
        self.down.transport.write(b"HTTP/1.1 200 OK\r\n\r\n")  # type: ignore[union-attr]
        if self.down.rest:
            self.transport.write(self.down.rest)  # type: ignore[union-attr]
        if self.down.eof:
            self.transport.loseWriteConnection()  # type: ignore[union-attr]

    def dataReceived(self, data: bytes) -> None:
        self.down.transport.write(data)  # type: ignore[union-attr]

    def readConnectionLost(self) -> None:
        self.down.transport.loseWriteConnection()  # type: ignore[union-attr]

    def writeConnectionLost(self) -> None:
        pass

    def connectionLost(self, reason: Any = None) -> None:
        self.down.transport.loseConnection()  # type: ignore[union-attr]


@implementer(IHalfCloseableProtocol)
class ParentConnection(Protocol):
    up: _Up | None = None
    eof = False

    def __init__(self, parent: ParentProxy) -> None:
        self.parent = parent
        self.buffer = b""
        self.rest = b""

    def dataReceived(self, data: bytes) -> None:
        if self.up is not None:
            self.up.transport.write(data)  # type: ignore[union-attr]
            return
        self.buffer += data
        head, sep, self.rest = self.buffer.partition(b"\r\n\r\n")
        if not sep:
            return
        line = head.split(b"\r\n")[0].decode()
        method, target, _ = line.split(" ", 2)
        self.parent.seen.append(target)
        host, _, port = target.rpartition(":")
        if method != "CONNECT" or host in self.parent.deny or (host, int(port)) not in self.parent.routes:
            self.transport.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")  # type: ignore[union-attr]
            self.transport.loseConnection()  # type: ignore[union-attr]
            return
        local = self.parent.routes[(host, int(port))]
        connectProtocol(TCP4ClientEndpoint(self.parent.reactor, "127.0.0.1", local), _Up(self))

    def readConnectionLost(self) -> None:
        if self.up is not None:
            self.up.transport.loseWriteConnection()  # type: ignore[union-attr]
        else:
            self.eof = True

    def writeConnectionLost(self) -> None:
        pass

    def connectionLost(self, reason: Any = None) -> None:
        if self.up is not None:
            self.up.transport.loseConnection()  # type: ignore[union-attr]


class ParentProxy(Factory):
    """``routes`` maps (host, port) as the parent sees it to a loopback port."""

    noisy = False

    def __init__(self, reactor: Any, routes: dict[tuple[str, int], int], deny: tuple[str, ...] = ()) -> None:
        self.reactor = reactor
        self.routes = routes
        self.deny = deny
        self.seen: list[str] = []

    def buildProtocol(self, addr: Any) -> ParentConnection:
        return ParentConnection(self)
