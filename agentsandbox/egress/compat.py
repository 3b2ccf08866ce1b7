"""The one place that bridges Debian 12's TLS stack and current releases.

Debian 12 ships Twisted 22.4, cryptography 38 and pyOpenSSL 23; PyPI has
Twisted 26, cryptography 50 and pyOpenSSL 26.  The gaps that matter to the
terminating proxy (``reference/packaging.md`` §1.8):

- pyOpenSSL 23 takes only its own ``X509`` wrapper where 26 deprecates it in
  favour of *cryptography* objects (the tests verify leaves with its
  ``X509Store``).
- cryptography 42 added the ``*_utc`` validity accessors and deprecated the
  naive ones.

Only such bridges live here; everything else uses APIs both stacks have
(``tlsstream.WriteThrough``, for one, uses only the FileDescriptor attributes
Twisted 22.4 and 26 share).
"""

from __future__ import annotations

import datetime

from cryptography import x509
from OpenSSL import crypto


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
