"""The one place that bridges Debian 12's TLS stack and current releases.

Debian 12 ships Twisted 22.4, cryptography 38 and pyOpenSSL 23; PyPI has
Twisted 26, cryptography 50 and pyOpenSSL 26.  The gaps that matter to the
terminating proxy (``reference/packaging.md`` §1.8):

- pyOpenSSL 23 takes only its own ``X509`` wrapper where 26 deprecates it in
  favour of *cryptography* objects (the tests verify leaves with its
  ``X509Store``).
- cryptography 42 added the ``*_utc`` validity accessors and deprecated the
  naive ones.
- Neither Twisted writes to a socket before the next reactor iteration;
  ``WriteThrough`` does, using only the FileDescriptor attributes both
  versions share.

Everything else uses APIs both stacks have.
"""

from __future__ import annotations

import datetime
from typing import Any

from cryptography import x509
from OpenSSL import crypto
from twisted.internet.abstract import FileDescriptor
from zope.interface import directlyProvides, providedBy


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


# ---------------------------------------------------------------------- write-through

#: What a FileDescriptor transport must have for ``WriteThrough`` to send
#: directly; both Twisted 22.4 and 26 have all of them.
_FD_ATTRIBUTES = ("writeSomeData", "dataBuffer", "offset", "_tempDataBuffer", "connected", "disconnecting")


class WriteThrough:
    """A transport that sends a write at once when nothing is queued before it.

    Twisted's socket transports queue every write for the next reactor
    iteration: two ``epoll_ctl`` calls and one more dispatch per write, which
    is a third of the terminating path's cost per request.  Sending at once is
    safe only when the transport has nothing buffered (order) and is still
    open; otherwise, and for whatever the socket did not take, the transport's
    own ``write`` queues as usual, so back-pressure and close work unchanged.
    Everything but ``write``/``writeSequence`` is the wrapped transport's.
    """

    def __init__(self, transport: Any) -> None:
        self._transport = transport
        #: Bytes handed to the socket side so far, for the audit record.
        self.written = 0
        directlyProvides(self, *providedBy(transport))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def write(self, data: bytes) -> None:
        self.written += len(data)
        t = self._transport
        if (
            t._tempDataBuffer
            or len(t.dataBuffer) > t.offset
            or not t.connected
            or t.disconnecting
            or getattr(t, "_writeDisconnected", False)
        ):
            t.write(data)
            return
        sent = t.writeSomeData(data)
        if not isinstance(sent, int):
            # The connection is gone; the transport's own write finds out and
            # reports it through connectionLost as usual.
            t.write(data)
        elif sent < len(data):
            t.write(data[sent:])

    def writeSequence(self, data: Any) -> None:
        self.write(b"".join(data))


def writeThrough(transport: Any) -> Any:
    """``transport`` wrapped in ``WriteThrough`` when it is a socket transport that allows it."""
    if isinstance(transport, FileDescriptor) and all(hasattr(transport, a) for a in _FD_ATTRIBUTES):
        return WriteThrough(transport)
    return transport
