"""The one place that bridges Debian 12's TLS stack and current releases.

Debian 12 ships Twisted 22.4, cryptography 38 and pyOpenSSL 23; PyPI has
Twisted 26, cryptography 50 and pyOpenSSL 26.  The gaps that matter to the
terminating proxy (``reference/packaging.md`` §1.8):

- pyOpenSSL 23 takes only its own ``PKey``/``X509`` wrappers; 26 deprecates
  them and takes *cryptography* objects.
- cryptography 42 added the ``*_utc`` validity accessors and deprecated the
  naive ones.
- Twisted 26 lets ``TLSMemoryBIOFactory`` take the clock it batches small
  writes with; 22.4 has no such argument.

Everything else uses APIs both stacks have.
"""

from __future__ import annotations

import datetime
import inspect
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from OpenSSL import SSL, crypto
from twisted.internet.interfaces import IProtocolFactory, IReactorTime
from twisted.protocols.tls import TLSMemoryBIOFactory

_FACTORY_TAKES_CLOCK = "clock" in inspect.signature(TLSMemoryBIOFactory.__init__).parameters


def tlsFactory(
    creator: Any, isClient: bool, wrapped: IProtocolFactory, clock: IReactorTime
) -> TLSMemoryBIOFactory:
    """A ``TLSMemoryBIOFactory`` that uses the injected clock where Twisted lets it."""
    if _FACTORY_TAKES_CLOCK:
        return TLSMemoryBIOFactory(creator, isClient, wrapped, clock=clock)
    return TLSMemoryBIOFactory(creator, isClient, wrapped)


def useKeyAndChain(
    context: SSL.Context,
    key: ec.EllipticCurvePrivateKey,
    leaf: x509.Certificate,
    chain: list[x509.Certificate],
) -> None:
    """Load a private key, its certificate and the chain above it into ``context``."""
    try:
        context.use_privatekey(key)
    except TypeError:  # pyOpenSSL < 24.3
        context.use_privatekey(crypto.PKey.from_cryptography_key(key))
    try:
        context.use_certificate(leaf)
    except TypeError:
        context.use_certificate(crypto.X509.from_cryptography(leaf))
    for cert in chain:
        try:
            context.add_extra_chain_cert(cert)
        except TypeError:
            context.add_extra_chain_cert(crypto.X509.from_cryptography(cert))
    context.check_privatekey()


def toX509(cert: x509.Certificate) -> crypto.X509:
    """pyOpenSSL's wrapper of a certificate (for X509Store, which both stacks have)."""
    return crypto.X509.from_cryptography(cert)


def notValidAfter(cert: x509.Certificate) -> datetime.datetime:
    """The end of the validity period, timezone-aware on every cryptography."""
    aware = getattr(cert, "not_valid_after_utc", None)
    if isinstance(aware, datetime.datetime):
        return aware
    return cert.not_valid_after.replace(tzinfo=datetime.UTC)


def notValidBefore(cert: x509.Certificate) -> datetime.datetime:
    """The start of the validity period, timezone-aware on every cryptography."""
    aware = getattr(cert, "not_valid_before_utc", None)
    if isinstance(aware, datetime.datetime):
        return aware
    return cert.not_valid_before.replace(tzinfo=datetime.UTC)
