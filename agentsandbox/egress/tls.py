"""The in-memory CA of the terminating proxy, its leaves, and both TLS sides.

The CA is made at start and lives only in this process: its key is never
serialised, so nothing on disk can mint a certificate a sandboxed client
trusts.  It is name-constrained (critical) to exactly the injected hosts and
excludes every IP address, so even a stolen CA could vouch for nothing else.

Server side: one ``SSL.Context`` per injected host, holding that host's leaf,
whatever SNI the client sends (the tunnel decides the host, never the
ClientHello), TLS 1.2 at least, ALPN answered with ``http/1.1`` only.  The
context is built here rather than through ``CertificateOptions`` because
Twisted 26's ``CertificateOptions`` without ``acceptableProtocols`` fails every
ALPN-offering client (curl always offers it) with an internal_error, and 22.4
has no SNI hook to reuse.

Client side (upstream): Twisted's ``optionsForClientTLS``, which verifies the
chain against the trust root (the system's by default) and the host name with
service-identity.
"""

from __future__ import annotations

import datetime
import ipaddress
import secrets
import socket
from collections.abc import Iterable
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from OpenSSL import SSL
from twisted.internet import ssl as tssl
from twisted.internet._sslverify import IOpenSSLTrustRoot
from twisted.internet.interfaces import (
    IOpenSSLClientConnectionCreator,
    IOpenSSLServerConnectionCreator,
)
from twisted.protocols.tls import TLSMemoryBIOProtocol
from zope.interface import implementer

from agentsandbox.egress.compat import notValidAfter, notValidBefore, useKeyAndChain

ALPN_HTTP11 = b"http/1.1"

#: The CA and its leaves are valid from an hour ago (clock skew) for a year;
#: the CA is remade at every start, so this is an upper bound, not a lifetime.
BACKDATE = datetime.timedelta(hours=1)
LIFETIME = datetime.timedelta(days=365)


class NotInjectedError(ValueError):
    """A leaf was asked for a host the CA is not constrained to."""


def _name(common: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "agentsandbox"),
            x509.NameAttribute(NameOID.COMMON_NAME, common[:64]),
        ]
    )


def _serial() -> int:
    # Positive and below 2**159 (RFC 5280 caps serials at 20 octets).
    return secrets.randbits(126) | 1


class InjectionCA:
    """A P-256 CA constrained to ``hosts``, and the leaves it signs for them.

    Every leaf shares one P-256 key: a leaf is worth only as much as the CA
    that constrains it, and one key saves a key generation per host.
    """

    def __init__(
        self,
        hosts: tuple[str, ...],
        key: ec.EllipticCurvePrivateKey,
        certificate: x509.Certificate,
        leafKey: ec.EllipticCurvePrivateKey,
    ) -> None:
        self.hosts = hosts
        self._key = key
        self.certificate = certificate
        self.leafKey = leafKey
        self._leaves: dict[str, x509.Certificate] = {}
        self._contexts: dict[str, SSL.Context] = {}

    @classmethod
    def create(
        cls, hosts: Iterable[str], now: datetime.datetime | None = None, label: str | None = None
    ) -> InjectionCA:
        """A fresh CA for ``hosts`` (canonical host names; at least one)."""
        names = tuple(dict.fromkeys(hosts))
        if not names:
            raise ValueError("a CA needs at least one injected host")
        start = (now or datetime.datetime.now(datetime.UTC)) - BACKDATE
        key = ec.generate_private_key(ec.SECP256R1())
        subject = _name(f"agentsandbox egress CA {label or socket.gethostname()}".strip())
        constraints = x509.NameConstraints(
            permitted_subtrees=[x509.DNSName(h) for h in names],
            excluded_subtrees=[
                x509.IPAddress(ipaddress.ip_network("0.0.0.0/0")),
                x509.IPAddress(ipaddress.ip_network("::/0")),
            ],
        )
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(_serial())
            .not_valid_before(start)
            .not_valid_after(start + LIFETIME)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(constraints, critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        return cls(names, key, cert, ec.generate_private_key(ec.SECP256R1()))

    @property
    def pem(self) -> bytes:
        """The CA certificate (never the key) in PEM, for ``ca.pem`` and ``bundle.pem``."""
        return self.certificate.public_bytes(serialization.Encoding.PEM)

    def leaf(self, host: str) -> x509.Certificate:
        """The cached leaf for an injected host."""
        cert = self._leaves.get(host)
        if cert is None:
            if host not in self.hosts:
                raise NotInjectedError(f"{host} has no inject rule, so the proxy serves it no certificate")
            cert = self._leaves[host] = self.issue(host)
        return cert

    def issue(self, host: str) -> x509.Certificate:
        """Sign a leaf for ``host`` without the injected-host check (tests show the
        name constraints then refuse it)."""
        ca = self.certificate
        return (
            x509.CertificateBuilder()
            .subject_name(_name(host))
            .issuer_name(ca.subject)
            .public_key(self.leafKey.public_key())
            .serial_number(_serial())
            .not_valid_before(notValidBefore(ca))
            .not_valid_after(notValidAfter(ca))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                critical=False,
            )
            .sign(self._key, hashes.SHA256())
        )

    def serverContext(self, host: str) -> SSL.Context:
        """The cached server context that presents ``host``'s leaf to every client."""
        context = self._contexts.get(host)
        if context is None:
            context = self._contexts[host] = _serverContext(self.leafKey, self.leaf(host), self.certificate)
        return context

    def serverCreator(self, host: str) -> IOpenSSLServerConnectionCreator:
        return _HostServerCreator(self.serverContext(host))


def _selectALPN(connection: SSL.Connection, offered: list[bytes]) -> Any:
    # A client that offers only h2 gets no ALPN at all, which means HTTP/1.1.
    chosen: Any = ALPN_HTTP11 if ALPN_HTTP11 in offered else SSL.NO_OVERLAPPING_PROTOCOLS
    return chosen  # type: ignore[no-any-return,unused-ignore]


def _serverContext(
    key: ec.EllipticCurvePrivateKey, leaf: x509.Certificate, ca: x509.Certificate
) -> SSL.Context:
    context = SSL.Context(SSL.TLS_METHOD)
    context.set_min_proto_version(SSL.TLS1_2_VERSION)
    context.set_options(
        SSL.OP_NO_COMPRESSION | SSL.OP_CIPHER_SERVER_PREFERENCE | SSL.OP_SINGLE_ECDH_USE
    )
    useKeyAndChain(context, key, leaf, [ca])
    context.set_alpn_select_callback(_selectALPN)
    # No servername callback: OpenSSL then ignores SNI and every ClientHello
    # gets this context's leaf, the tunnel's host.
    return context


@implementer(IOpenSSLServerConnectionCreator)
class _HostServerCreator:
    def __init__(self, context: SSL.Context) -> None:
        self._context = context

    def serverConnectionForTLS(self, tlsProtocol: TLSMemoryBIOProtocol) -> SSL.Connection:
        return SSL.Connection(self._context, None)


def upstreamCreator(
    host: str, trustRoot: IOpenSSLTrustRoot | None = None
) -> IOpenSSLClientConnectionCreator:
    """TLS to the real ``host``: chain verified against ``trustRoot`` (the
    system's roots when None), name checked with service-identity, HTTP/1.1."""
    options: IOpenSSLClientConnectionCreator = tssl.optionsForClientTLS(
        host,
        trustRoot=trustRoot if trustRoot is not None else tssl.platformTrust(),  # type: ignore[no-untyped-call,unused-ignore]
        acceptableProtocols=[ALPN_HTTP11],
    )
    return options
