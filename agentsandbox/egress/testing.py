"""Test doubles for the egress seams, shipped beside the real parts.

The proxy and the injector take every outside dependency as a parameter
(``agentsandbox.egress.interfaces``); these are the doubles this package's own
tests and benchmarks use, kept here so that users' tests can build a proxy or
an injector on loopback without reaching into ``tests/`` (treq's
``treq.testing`` is the model):

- ``FixedResolver``: an ``IResolver`` answering from a table, counting lookups.
- ``MappedDialer``: an ``IDialer`` that bends the last hop of a checked
  (documentation) address to a loopback port, so the address rules stay real.
- ``RefusingDialer``: an ``IDialer`` whose every dial fails, for decision-only tests.
- ``AllowAllPeers``: an ``IPeerChecker`` that lets every client in (the real one
  reads the kernel's socket table, which a test's client passes anyway).
- ``FixedToken``: an ``ITokenHolder`` whose token the test sets directly.
- ``FixedAskers``: an ``IAskers`` naming the asking process the test sets, at once.
- ``UpstreamPKI``: a throwaway root CA and server certificates for a fake origin.
- ``MemoryDialer``: an ``IDialer`` whose every dial connects at once to a
  ``StringTransport``, keeping the connected protocols in ``upstreams``.
- ``MemoryUpstreamPool`` and ``memoryTunnel``: a terminated tunnel past its TLS,
  its upstream connections on ``StringTransport``, to drive ``inject.py``'s
  protocols byte by byte (the differential tests and ``bench/exchange.py`` do).

Time is a seam too: ``EgressProxyFactory``, ``Injector`` and
``reload.ConfigWatcher`` take a ``clock``; pass ``twisted.internet.task.Clock``
and advance it past a timeout instead of waiting for one.

Nothing here sends a packet off the machine: an address a ``MappedDialer`` has
no route for is dialled at a closed loopback port (the dial is refused), and
the memory doubles open no socket at all.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from twisted.internet import error, ssl
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.interfaces import IProtocol, IProtocolFactory, IStreamClientEndpoint
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from zope.interface import implementer

from agentsandbox.allowlist import IPAddress
from agentsandbox.egress.inject import IUpstreamPool, Route, _Tunnel, _Upstream
from agentsandbox.egress.interfaces import IAskers, IDialer, IPeerChecker, IResolver, ITokenHolder
from agentsandbox.egress.resolve import ResolveError

#: Where a dial with no route goes: a closed loopback port, so it is refused here.
_NOWHERE = ("127.0.0.1", 1)


@implementer(IResolver)
class FixedResolver:
    """Answers from a table; counts lookups so tests can show a name resolves once."""

    def __init__(self, table: Mapping[str, Sequence[str]]) -> None:
        self.table = {k: [ipaddress.ip_address(a) for a in v] for k, v in table.items()}
        self.lookups: list[str] = []

    def resolve(self, host: str, port: int) -> Deferred[Sequence[IPAddress]]:
        try:
            return succeed(self.addresses(host, port))
        except ResolveError as e:
            return fail(e)

    def addresses(self, host: str, port: int) -> list[IPAddress]:
        """The same answer, synchronously (raises ResolveError): what ``check host``
        and ``gate.Gate.decideResolving`` take, so both sides read one table."""
        self.lookups.append(host)
        if host not in self.table or not self.table[host]:
            raise ResolveError(host, "not in the test's table")
        return list(self.table[host])


@implementer(IDialer)
class MappedDialer:
    """Dials checked addresses at loopback ports; records every dial in ``dialled``.

    ``route(address, port, localPort)`` bends one address and port,
    ``map(address, localPort)`` every port of an address.  An unrouted
    loopback IPv4 address is dialled as it is; anything else goes to a closed
    loopback port, standing in for an unreachable host.
    """

    def __init__(self, reactor: Any, routes: Mapping[tuple[str, int], int] | None = None, timeout: float = 5) -> None:
        self.reactor = reactor
        self.timeout = timeout
        self.routes: dict[tuple[str, int], int] = dict(routes or {})
        self.hosts: dict[str, int] = {}
        self.dialled: list[tuple[str, int]] = []

    def route(self, address: str, port: int, localPort: int) -> None:
        self.routes[(str(ipaddress.ip_address(address)), port)] = localPort

    def map(self, address: str | IPAddress, localPort: int) -> None:
        self.hosts[str(ipaddress.ip_address(address))] = localPort

    def __call__(self, ip: IPAddress, port: int) -> IStreamClientEndpoint:
        key = (str(ip), port)
        self.dialled.append(key)
        if key in self.routes:
            return TCP4ClientEndpoint(self.reactor, "127.0.0.1", self.routes[key], timeout=self.timeout)
        if key[0] in self.hosts:
            return TCP4ClientEndpoint(self.reactor, "127.0.0.1", self.hosts[key[0]], timeout=self.timeout)
        if ip.version == 4 and ip.is_loopback:
            return TCP4ClientEndpoint(self.reactor, str(ip), port, timeout=self.timeout)
        return TCP4ClientEndpoint(self.reactor, *_NOWHERE, timeout=self.timeout)


@implementer(IStreamClientEndpoint)
class _Refused:
    def connect(self, protocolFactory: Any) -> Deferred[Any]:
        return fail(error.ConnectionRefusedError("the test's dialer refuses every dial"))


@implementer(IDialer)
class RefusingDialer:
    """Every dial fails with "connection refused", without a socket: for tests of decisions."""

    def __init__(self) -> None:
        self.dialled: list[tuple[str, int]] = []

    def __call__(self, ip: IPAddress, port: int) -> IStreamClientEndpoint:
        self.dialled.append((str(ip), port))
        return _Refused()


@implementer(IPeerChecker)
class AllowAllPeers:
    """Every client may use the proxy (the same-user check has its own tests)."""

    def check(self, client: tuple[str, int], server: tuple[str, int]) -> str | None:
        return None


@implementer(IAskers)
@dataclass
class FixedAskers:
    """The asking process is what the test says, found at once (the /proc walk has its own tests)."""

    text: str | None = None

    def find(self, client: tuple[str, int], server: tuple[str, int]) -> Deferred[str | None]:
        return succeed(self.text)


@implementer(ITokenHolder)
@dataclass
class FixedToken:
    """A token holder the test sets directly (the keeper has its own tests)."""

    value: str | None

    def token(self) -> str | None:
        return self.value


@dataclass
class UpstreamPKI:
    """A throwaway root and the server certificates it signs, for a fake upstream.

    Pass ``pem`` as the injector's ``upstreamTrust`` and serve the fake with
    ``serverOptions(names)``: the injector then verifies the fake exactly as it
    verifies a real origin, against a root that exists only in the test.
    """

    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @classmethod
    def create(cls, name: str = "agentsandbox test upstream CA") -> UpstreamPKI:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        return cls(key, cert)

    @property
    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def serverOptions(self, names: Iterable[str]) -> ssl.CertificateOptions:
        """Server TLS for ``names`` (ALPN http/1.1, which ALPN clients need on Twisted 26)."""
        key = ec.generate_private_key(ec.SECP256R1())
        names = list(names)
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        keyPEM = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        certPEM = cert.public_bytes(serialization.Encoding.PEM)
        pair = ssl.PrivateCertificate.loadPEM(keyPEM + certPEM)
        # On Twisted 22.4 an untyped decorator on __init__ makes this call Any.
        options: ssl.CertificateOptions = ssl.CertificateOptions(
            privateKey=pair.privateKey.original,
            certificate=pair.original,
            acceptableProtocols=[b"http/1.1"],
        )
        return options


@implementer(IStreamClientEndpoint)
class _MemoryEndpoint:
    def __init__(self, upstreams: list[IProtocol], address: IPv4Address) -> None:
        self._upstreams = upstreams
        self._address = address

    def connect(self, protocolFactory: IProtocolFactory) -> Deferred[IProtocol]:
        protocol = protocolFactory.buildProtocol(self._address)
        assert protocol is not None
        protocol.makeConnection(StringTransport())
        self._upstreams.append(protocol)
        return succeed(protocol)


@implementer(IDialer)
class MemoryDialer:
    """Every dial connects at once, to a ``StringTransport``: what the protocol
    sends is its ``transport.value()``, what the origin answers is fed to its
    ``dataReceived``.  The connected protocols are in ``upstreams``, in order."""

    def __init__(self, upstreams: list[IProtocol] | None = None) -> None:
        self.upstreams: list[IProtocol] = [] if upstreams is None else upstreams

    def __call__(self, ip: IPAddress, port: int) -> IStreamClientEndpoint:
        return _MemoryEndpoint(self.upstreams, IPv4Address("TCP", str(ip), port))


@implementer(IUpstreamPool)
class MemoryUpstreamPool:
    """What a terminated tunnel asks of its ``Injector``, with each upstream
    connection on a ``StringTransport`` instead of verified TLS (its handshake
    taken as done).  Every ``acquire`` opens a new one, kept in ``upstreams``;
    ``release`` closes it rather than keeping it idle; ``injectedRequests``
    counts the requests a header was set on."""

    idleTimeout = 300.0
    upstreamIdleTimeout = 60.0
    handshakeTimeout = 30.0

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock = Clock() if clock is None else clock
        self.injectedRequests = 0
        self.upstreams: list[_Upstream] = []
        #: (event, host, method, target, reason, rule) of every ``record``.
        self.records: list[tuple[str, str, bytes, bytes, str, str | None]] = []

    def injected(self) -> None:
        self.injectedRequests += 1

    def record(
        self, event: str, host: str, method: bytes, target: bytes, reason: str, rule: str | None, client: str | None = None
    ) -> None:
        self.records.append((event, host, method, target, reason, rule))

    def acquire(self, host: str, addresses: tuple[IPAddress, ...]) -> Deferred[_Upstream]:
        upstream = _Upstream(self, host, addresses[0], self.clock)
        upstream.makeConnection(StringTransport())
        upstream.handshakeCompleted()
        self.upstreams.append(upstream)
        return succeed(upstream)

    def release(self, upstream: _Upstream) -> None:
        upstream.close()

    def forget(self, upstream: _Upstream) -> None:
        pass


def memoryTunnel(pool: MemoryUpstreamPool, route: Route, addresses: Sequence[IPAddress]) -> tuple[_Tunnel, StringTransport]:
    """A terminated tunnel for ``route`` past its TLS: the client's decrypted
    bytes go to its ``dataReceived``, what the client gets is the returned
    transport's ``value()``; its upstreams come from ``pool``."""
    tunnel = _Tunnel(pool, route, tuple(addresses), pool.clock)
    client = StringTransport()
    tunnel.makeConnection(client)
    return tunnel, client
