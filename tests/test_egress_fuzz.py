"""Generated request heads and SOCKS greetings: each gets an error reply or a close.

Driven through the real front door and decision path on an in-memory
transport with a ``Clock`` (so the header timeout is part of the run), 10,000
examples each; a smaller batch then goes over live loopback sockets.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import ILogObserver, LogEvent, globalLogPublisher
from twisted.python.failure import Failure
from zope.interface import provider

from agentsandbox.egress.proxy import EgressProxyFactory
from agentsandbox.egress.testing import AllowAllPeers, FixedResolver, RefusingDialer
from tests.support.egress_fixtures import domainsToml, makeConfig

CONFIG = makeConfig(domainsToml(["*.example.org", "example.net:443", "127.0.0.1:6443", "10.0.0.0/8:22"], header_timeout=5))
RESOLVER = FixedResolver({"a.example.org": ["192.0.2.1"], "b.example.org": ["10.0.0.1", "127.0.0.1"], "example.net": ["192.0.2.2"]})




class HalfCloseTransport(StringTransport):
    def loseWriteConnection(self) -> None:
        self.disconnecting = True


def drive(chunks: list[bytes]) -> tuple[bytes, bool]:
    """Feed ``chunks`` to a fresh front door; returns (bytes written, closed)."""
    clock = Clock()
    factory = EgressProxyFactory(CONFIG, clock, resolver=RESOLVER, dialer=RefusingDialer(), peers=AllowAllPeers())
    factory.doStart()
    door = factory.buildProtocol(None)
    transport = HalfCloseTransport()
    door.makeConnection(transport)
    for chunk in chunks:
        if transport.disconnecting:
            break
        door.dataReceived(chunk)
    if not transport.disconnecting:
        clock.advance(6)  # past the header timeout (the sweep runs every 1.25 s here)
    closed = transport.disconnecting
    door.connectionLost(Failure(ConnectionDone()))
    factory.doStop()
    clock.advance(60)
    return transport.value(), closed


def allowedAnswer(written: bytes) -> bool:
    if written == b"":
        return True
    if written.startswith(b"HTTP/1.1 4") or written.startswith(b"HTTP/1.1 5"):
        return b"\r\nConnection: close\r\n" in written
    # SOCKS: method selection, optional sub-negotiation answer, then a failure reply
    return written[:1] == b"\x05" and not written.endswith(b"\x05\x00\x00\x01\x00\x00\x00\x00\x00\x00")


@pytest.fixture
def loggedFailures() -> Iterator[list[LogEvent]]:
    errors: list[LogEvent] = []

    @provider(ILogObserver)
    def observe(event: LogEvent) -> None:
        if event.get("log_failure") is not None or (event.get("log_level") is not None and event["log_level"].name == "critical"):
            errors.append(event)

    globalLogPublisher.addObserver(observe)
    yield errors
    globalLogPublisher.removeObserver(observe)


TOKEN = st.sampled_from([b"GET", b"CONNECT", b"POST", b"HEAD", b"TRACE", b"connect", b"PUT", b"G\x00T", b""])
TARGETS = st.one_of(
    st.sampled_from(
        [
            b"a.example.org:443", b"b.example.org:22", b"example.net:443", b"example.net:80", b"[::1]:6443",
            b"127.0.0.1:6443", b"http://a.example.org/", b"http://a.example.org:8080/x?y", b"http://[fe80::1]/",
            b"http://user:pw@a.example.org/", b"https://a.example.org/", b"/", b"*", b"a.example.org:0",
            b"a.example.org:65536", b"2130706433:443", b"0x7f.1:6443", b"[a.example.org]:443", b"a.example.org.:443",
            b"http://a.example.org\r\nX: y/",
        ]
    ),
    st.binary(max_size=80),
)
HEADER = st.tuples(
    st.one_of(st.sampled_from([b"Host", b"Content-Length", b"Transfer-Encoding", b"Connection", b"Proxy-Authorization", b"Upgrade", b"Expect"]), st.binary(max_size=20)),
    st.one_of(st.sampled_from([b"0", b"5", b"-1", b"+5", b"chunked", b"close", b"keep-alive", b"100-continue", b"h2c", b"a.example.org"]), st.binary(max_size=40)),
)
HEADS = st.one_of(
    st.builds(
        lambda m, t, v, hs, body: m + b" " + t + b" " + v + b"\r\n" + b"".join(k + b": " + val + b"\r\n" for k, val in hs) + b"\r\n" + body,
        TOKEN,
        TARGETS,
        st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.1x", b""]),
        st.lists(HEADER, max_size=6),
        st.binary(max_size=64),
    ),
    st.binary(min_size=1, max_size=512).filter(lambda b: b[0] != 5),
)


def socksRequest(ver: int, cmd: int, atyp: int, addr: bytes, port: int) -> bytes:
    return bytes([ver, cmd, 0, atyp]) + addr + port.to_bytes(2, "big")


DOMAIN = st.one_of(st.sampled_from([b"a.example.org", b"b.example.org", b"example.net", b"", b"127.0.0.1", b"x" * 255]), st.binary(max_size=40))
GREETINGS = st.one_of(
    st.builds(
        lambda n, methods, auth, req: bytes([5, n]) + methods + auth + req,
        st.integers(0, 255),
        st.binary(max_size=8),
        st.one_of(st.just(b""), st.builds(lambda v, u, p: bytes([v, len(u)]) + u + bytes([len(p)]) + p, st.integers(0, 3), st.binary(max_size=20), st.binary(max_size=20))),
        st.one_of(
            st.builds(
                socksRequest,
                st.sampled_from([5, 4, 0]),
                st.integers(0, 4),
                st.sampled_from([1, 3, 4, 0, 9]),
                st.one_of(st.binary(min_size=4, max_size=4), st.binary(min_size=16, max_size=16), DOMAIN.map(lambda d: bytes([len(d)]) + d)),
                st.integers(0, 65535),
            ),
            st.binary(max_size=300),
        ),
    ),
    st.binary(max_size=400).map(lambda b: b"\x05" + b),
)


def splits(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    out, last = [], 0
    for p in [*points, len(data)]:
        out.append(data[last:p])
        last = p
    return [c for c in out if c] or [data]


FUZZ = settings(max_examples=10_000, deadline=None, database=None, suppress_health_check=list(HealthCheck))


@pytest.mark.slow
@FUZZ
@given(HEADS, st.lists(st.integers(0, 4096), max_size=4))
def test_requestHeads(loggedFailures: list[LogEvent], head: bytes, cuts: list[int]) -> None:
    written, closed = drive(splits(head, cuts))
    assert closed, head
    assert allowedAnswer(written), (head, written)
    assert not loggedFailures, loggedFailures


@pytest.mark.slow
@FUZZ
@given(GREETINGS, st.lists(st.integers(0, 4096), max_size=4))
def test_socksGreetings(loggedFailures: list[LogEvent], greeting: bytes, cuts: list[int]) -> None:
    written, closed = drive(splits(greeting, cuts))
    assert closed, greeting
    assert allowedAnswer(written), (greeting, written)
    assert not loggedFailures, loggedFailures
