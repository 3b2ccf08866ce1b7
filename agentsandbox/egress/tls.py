"""The in-memory CA of the terminating proxy, its leaves, and both TLS sides.

The CA is made at start and lives only in this process: its key is never
serialised, so nothing on disk can mint a certificate a sandboxed client
trusts.  It is name-constrained (critical) to exactly the injected hosts and
excludes every IP address, so even a stolen CA could vouch for nothing else.

Both TLS sides are the standard library's ``ssl`` (spoken through
``tlsstream.TLSStream``; why there):

Server side: one ``ssl.SSLContext`` per injected host, holding that host's
leaf whatever SNI the client sends (the tunnel decides the host, never the
ClientHello), TLS 1.2 at least, no renegotiation, ALPN answered with
``http/1.1`` only (a client offering only h2 gets no ALPN, which means
HTTP/1.1).

Client side (upstream): the chain verified against the system's roots (or a
test's CA, injected, never from config), the host name checked by OpenSSL
during the handshake and again with service-identity before any request is
sent.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
import socket
import ssl
from collections.abc import Callable, Iterable, Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from service_identity.cryptography import verify_certificate_hostname
from twisted.logger import Logger

from agentsandbox.egress.compat import notValidAfter, notValidBefore
from agentsandbox.egressdir import SYSTEM_BUNDLES, EgressDirError, systemBundle

log = Logger(namespace="agentsandbox.egress.tls")

ALPN_HTTP11 = "http/1.1"

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


#: Every flag ``x509.KeyUsage`` takes, all of which it wants spelt out.
_KEY_USAGES = (
    "digital_signature", "content_commitment", "key_encipherment", "data_encipherment",
    "key_agreement", "key_cert_sign", "crl_sign", "encipher_only", "decipher_only",
)


def _keyUsage(*allowed: str) -> x509.KeyUsage:
    """A KeyUsage with exactly ``allowed`` set."""
    unknown = set(allowed) - set(_KEY_USAGES)
    if unknown:
        raise ValueError(f"not a key usage: {sorted(unknown)}")
    return x509.KeyUsage(**{usage: usage in allowed for usage in _KEY_USAGES})


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
        self._contexts: dict[str, ssl.SSLContext] = {}

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
                _keyUsage("key_cert_sign", "crl_sign"),
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
                _keyUsage("digital_signature"),
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

    def serverContext(self, host: str) -> ssl.SSLContext:
        """The cached server context that presents ``host``'s leaf to every client."""
        context = self._contexts.get(host)
        if context is None:
            context = self._contexts[host] = _serverContext(self.leafKey, self.leaf(host), self.certificate)
        return context


def _serverContext(
    key: ec.EllipticCurvePrivateKey, leaf: x509.Certificate, ca: x509.Certificate
) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.options |= (
        ssl.OP_NO_COMPRESSION
        | ssl.OP_CIPHER_SERVER_PREFERENCE
        | ssl.OP_SINGLE_ECDH_USE
        | ssl.OP_NO_RENEGOTIATION
    )
    # A client that offers only h2 gets no ALPN at all, which means HTTP/1.1.
    context.set_alpn_protocols([ALPN_HTTP11])
    # No sni_callback: OpenSSL then ignores SNI and every ClientHello gets
    # this context's leaf, the tunnel's host.
    _loadKeyAndChain(context, key, [leaf, ca])
    return context


def _loadKeyAndChain(
    context: ssl.SSLContext, key: ec.EllipticCurvePrivateKey, chain: list[x509.Certificate]
) -> None:
    """Load ``key`` and ``chain`` (leaf first) without them touching a file system.

    The standard library loads keys only from a path.  The path given is an
    anonymous memory file (``memfd_create``, never on disk, closed at once),
    and the key in it is encrypted under a random password that exists only
    in this process, so even a reader of ``/proc/<pid>/fd`` in that instant
    learns nothing.
    """
    password = secrets.token_bytes(32)
    pem = b"".join(c.public_bytes(serialization.Encoding.PEM) for c in chain) + key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(password),
    )
    fd = os.memfd_create("agentsandbox-leaf", os.MFD_CLOEXEC)
    try:
        view = memoryview(pem)
        while view:
            view = view[os.write(fd, view) :]
        context.load_cert_chain(f"/proc/self/fd/{fd}", password=password)
    finally:
        os.close(fd)


def upstreamContext(
    trust: bytes | None = None,
    defaults: ssl.DefaultVerifyPaths | None = None,
    bundles: Sequence[str] = SYSTEM_BUNDLES,
) -> ssl.SSLContext:
    """TLS to the real hosts: chains verified against ``trust`` (PEM; the
    system's roots when None), host names by OpenSSL, HTTP/1.1 only.

    The system's roots are OpenSSL's default paths (``SSL_CERT_FILE`` and
    ``SSL_CERT_DIR`` included).  Where this Python's OpenSSL was built with
    paths that do not exist on this system, neither a file nor a directory,
    the first readable bundle of the usual list (the one ``bundle.pem`` is
    made from) is loaded instead, as Twisted's ``platformTrust`` does.
    ``defaults`` and ``bundles`` are for tests.

    ``verifyUpstream`` checks the name again with service-identity after the
    handshake, before a request goes out.
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED, check_hostname
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if trust is not None:
        context.load_verify_locations(cadata=trust.decode("ascii"))
    else:
        context.load_default_certs()
        paths = defaults if defaults is not None else ssl.get_default_verify_paths()
        if not paths.cafile and not paths.capath:  # None (typeshed says str) when missing
            try:
                path, _ = systemBundle(bundles)
            except EgressDirError:
                log.warn(
                    "egress: no system root certificates found ({paths}), so TLS to injected hosts "
                    "will fail verification; set SSL_CERT_FILE for the service",
                    paths=", ".join(bundles),
                )
            else:
                context.load_verify_locations(cafile=path)
    context.set_alpn_protocols([ALPN_HTTP11])
    return context


def verifyUpstream(host: str) -> Callable[[bytes], None]:
    """A ``TLSStream`` verifier: the certificate (DER) must name ``host``
    (service-identity; raises its ``VerificationError`` otherwise)."""

    def verify(der: bytes) -> None:
        verify_certificate_hostname(x509.load_der_x509_certificate(der), host)

    return verify
