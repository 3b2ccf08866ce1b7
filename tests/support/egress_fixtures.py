"""Parts for egress tests: a proxy on an ephemeral loopback port, small servers
and clients.  The doubles it is built with (a table resolver, a dialer that
maps documentation addresses to loopback listeners, a peer check that allows
everyone) live in ``agentsandbox.egress.testing``.  The address rules stay real:
the proxy classifies the documentation address (public), and only the last hop
is bent to loopback.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from twisted.internet import reactor as _reactor
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP4ServerEndpoint
from twisted.internet.interfaces import (
    IHalfCloseableProtocol,
    IProtocolFactory,
)
from twisted.internet.protocol import Protocol
from twisted.internet.utils import getProcessOutputAndValue
from zope.interface import implementer

from agentsandbox.audit import AuditLog
from agentsandbox.config import Config
from agentsandbox.egress.proxy import ZERO_COPY_AFTER, EgressProxyFactory, FrontDoor, ProxyService
from agentsandbox.egress.testing import AllowAllPeers, FixedResolver, MappedDialer
from agentsandbox.loader import loads
from agentsandbox.paths import Paths

reactor: Any = _reactor

CURL = "/usr/bin/curl"
GIT = "/usr/bin/git"


def makeConfig(toml: str = "", home: str | None = None) -> Config:
    home = home or tempfile.mkdtemp(prefix="egress-home-")
    paths = Paths.fromEnvironment({"HOME": home})
    return loads(toml.encode(), "<test config>", paths)


def domainsToml(domains: Sequence[str], **proxy: Any) -> str:
    lines = ["[sandbox]", "domains = [" + ", ".join(f'"{d}"' for d in domains) + "]"]
    if proxy:
        lines.append("[proxy]")
        for k, v in proxy.items():
            lines.append(f"{k} = {v!r}" if not isinstance(v, str) else f'{k} = "{v}"')
    lines.append("inject = []")
    # `inject = []` must be top level: move it before any table.
    body = [ln for ln in lines if ln != "inject = []"]
    return "inject = []\n" + "\n".join(body) + "\n"


@implementer(IHalfCloseableProtocol)
class Echo(Protocol):
    """Echoes; at the client's EOF it finishes writing, then closes."""

    def dataReceived(self, data: bytes) -> None:
        self.transport.write(data)  # type: ignore[union-attr]

    def readConnectionLost(self) -> None:
        self.transport.loseConnection()  # type: ignore[union-attr]

    def writeConnectionLost(self) -> None:
        pass


class Greeter(Protocol):
    """Sends a banner then echoes (shows data flows upstream -> client first)."""

    def connectionMade(self) -> None:
        self.transport.write(b"hello\n")  # type: ignore[union-attr]

    def dataReceived(self, data: bytes) -> None:
        self.transport.write(data)  # type: ignore[union-attr]


async def listen(factory: IProtocolFactory, reactor: Any = reactor) -> Any:
    port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(factory)
    return port


class ProxyHarness:
    """A running proxy on 127.0.0.1:ephemeral with injected parts; ``stop`` in cleanup."""

    def __init__(
        self,
        domains: Sequence[str] = (),
        resolver: FixedResolver | None = None,
        dialer: Any = None,
        peers: Any = None,
        terminator: Any = None,
        proxy: Mapping[str, Any] | None = None,
        audit: bool = True,
        config: Config | Any = None,
        spliceFast: bool = True,
        zeroCopyAfter: int | None = None,
        clock: Any = None,
    ) -> None:
        self.home = tempfile.mkdtemp(prefix="egress-home-")
        self.config = config or makeConfig(domainsToml(domains, **(proxy or {})), self.home)
        self.resolver = resolver or FixedResolver({})
        self.dialer = dialer or MappedDialer(reactor)
        self.auditPath = os.path.join(self.home, "audit.jsonl")
        self.audit = AuditLog(self.auditPath, journal=False) if audit else None
        self.factory = EgressProxyFactory(
            self.config,
            reactor,
            resolver=self.resolver,
            dialer=self.dialer,
            peers=peers or AllowAllPeers(),
            terminator=terminator,
            audit=self.audit,
            spliceFast=spliceFast,
            zeroCopyAfter=ZERO_COPY_AFTER if zeroCopyAfter is None else zeroCopyAfter,
            clock=clock,
        )
        self._doorWaiters: list[tuple[int, Deferred[FrontDoor]]] = []
        build = self.factory.buildProtocol
        self.factory.buildProtocol = lambda addr: self._watched(build(addr))  # type: ignore[method-assign]
        self.service = ProxyService(self.factory, "tcp:0:interface=127.0.0.1")
        self.port = 0

    def doorRead(self, size: int) -> Deferred[FrontDoor]:
        """Fires with the next front door once it has read ``size`` bytes of its client.

        A timeout test on a ``task.Clock`` advances the clock only after this,
        so the proxy has seen what the client sent, without polling.
        """
        d: Deferred[FrontDoor] = Deferred()
        self._doorWaiters.append((size, d))
        return d

    def _watched(self, door: FrontDoor) -> FrontDoor:
        if not self._doorWaiters:
            return door
        size, d = self._doorWaiters.pop(0)
        received = door.dataReceived
        seen = 0

        def dataReceived(data: bytes) -> None:
            nonlocal seen
            received(data)
            seen += len(data)
            if seen >= size and not d.called:
                d.callback(door)

        door.dataReceived = dataReceived  # type: ignore[method-assign]
        return door

    async def start(self) -> ProxyHarness:
        self.service.startService()
        assert self.service.listening is not None
        listening = await self.service.listening
        host = listening.getHost()
        assert isinstance(host, IPv4Address)  # the service listens on 127.0.0.1
        self.port = host.port
        return self

    def stop(self) -> Deferred[None]:
        """A Deferred, not a coroutine: trial 22.4's addCleanup waits only for Deferreds."""

        async def stopping() -> None:
            await self.service.stopService()
            if self.audit is not None:
                self.audit.close()

        return Deferred.fromCoroutine(stopping())

    def records(self) -> list[dict[str, Any]]:
        from agentsandbox.audit import readRecords

        return list(readRecords(self.auditPath))


async def curl(*args: str, env: Mapping[str, str] | None = None) -> tuple[bytes, bytes, int]:
    environ = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": tempfile.gettempdir()}
    environ.update(env or {})
    out, err, code = await getProcessOutputAndValue(
        CURL, ("--silent", "--show-error", "--noproxy", "", "--max-time", "60", *args), env=environ
    )
    return out, err, code


def sha256File(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def deferredTest(f: Any) -> Any:
    """Run an ``async def`` test method under trial on Twisted 22.4 and current Twisted alike."""
    import functools

    @functools.wraps(f)
    def wrapper(self: Any, *a: Any, **kw: Any) -> Deferred[Any]:
        return Deferred.fromCoroutine(f(self, *a, **kw))

    return wrapper


class Collector(Protocol):
    """A client that collects what it receives and fires ``done`` at close."""

    #: A TCP transport: tests also pause and half-close it, which ITransport does not declare.
    transport: Any

    def __init__(self, send: bytes = b"", halfClose: bool = False) -> None:
        self.send = send
        self.halfClose = halfClose
        self.received = bytearray()
        self.done: Deferred[bytes] = Deferred()
        self.reason: Any = None
        self._waiters: list[tuple[bytes, Deferred[bytes]]] = []

    def connectionMade(self) -> None:
        if self.send:
            self.transport.write(self.send)
        if self.halfClose:
            self.transport.loseWriteConnection()

    def dataReceived(self, data: bytes) -> None:
        self.received += data
        if self._waiters:
            arrived = [(m, d) for m, d in self._waiters if m in self.received]
            self._waiters = [(m, d) for m, d in self._waiters if m not in self.received]
            for _, d in arrived:
                d.callback(bytes(self.received))

    def connectionLost(self, reason: Any = None) -> None:
        self.reason = reason
        self.done.callback(bytes(self.received))
        waiters, self._waiters = self._waiters, []
        for marker, d in waiters:
            d.errback(AssertionError(f"the connection closed before {marker!r} arrived: {bytes(self.received)[:200]!r}"))

    def until(self, marker: bytes) -> Deferred[bytes]:
        """Fires with what was received once it holds ``marker`` (event-driven, no polling)."""
        d: Deferred[bytes] = Deferred()
        if marker in self.received:
            d.callback(bytes(self.received))
        else:
            self._waiters.append((marker, d))
        return d


async def exchange(port: int, send: bytes, halfClose: bool = True) -> bytes:
    """Connect to the proxy, send bytes (then half-close), return everything received."""
    from twisted.internet.endpoints import connectProtocol

    c = Collector(send, halfClose)
    await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", port), c)
    return await c.done


async def sleep(seconds: float) -> None:
    d: Deferred[None] = Deferred()
    reactor.callLater(seconds, d.callback, None)
    await d


async def waitFor(predicate: Any, what: str, limit: float = 30.0) -> None:
    """Poll ``predicate`` every 10 ms; fail with ``what`` after ``limit`` seconds (bounded)."""
    for _ in range(int(limit / 0.01)):
        if predicate():
            return
        await sleep(0.01)
    raise AssertionError(f"gave up waiting for {what}")
