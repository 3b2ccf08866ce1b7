"""The front door's decisions as values: what a tunnel may do, or why it may not.

The gate (``gate.py``) ends every decision in one of two values: a ``Grant``
(the host, port and checked addresses a tunnel may reach) or a ``Refusal`` (what
was refused, why, and the config entry that would allow it); ``gate.Verdict``
is their union.  The protocol handlers (``http.py``, ``socks.py``), the dial
(``dial.py``), the dispatcher and ``check host`` all speak these, so they live
here, importing nothing of the proxy that uses them, and no Twisted: ``check
host`` and the gate run without a reactor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from agentsandbox.allowlist import IPAddress

if TYPE_CHECKING:
    from twisted.python.failure import Failure

#: The HTTP status each kind of refusal is answered with (SOCKS maps them in socks.py).
_STATUS = {"policy": 403, "inject": 403, "limit": 503, "resolve": 502, "dial": 502, "parent": 502}


@dataclass(frozen=True)
class Refusal:
    """Why a tunnel was not opened.  ``kind`` picks the HTTP status and SOCKS code."""

    kind: str  # policy | limit | resolve | dial | parent | inject
    reason: str
    allow: str | None = None
    address: str | None = None

    @property
    def status(self) -> int:
        return _STATUS[self.kind]


class RefusalError(Exception):
    """A ``Refusal`` carried down a Deferred's errback chain.

    Only where an errback really carries one: a dial or the parent proxy's
    handshake failing.  Decisions never raise it; the gate returns a Refusal.
    """

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.reason)
        self.refusal = refusal


def refusalOf(f: Failure) -> Refusal:
    """The Refusal a failure carries (it must wrap a RefusalError)."""
    error = f.value
    assert isinstance(error, RefusalError)
    return error.refusal


@dataclass(frozen=True, slots=True)
class Grant:
    """A tunnel the policy allows: where it may go."""

    host: str
    port: int
    addresses: tuple[IPAddress, ...]
    entry: str
    viaParent: bool
    #: The address as the audit shows it when there is only one.
    shown: str | None = None
