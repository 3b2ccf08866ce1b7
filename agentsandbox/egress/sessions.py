"""Per-session proxy credentials: which session a proxy connection belongs to.

Stdlib only.  The SessionStart hook (and ``agentsandbox run``) makes a random
credential for its session, keeps it in that session's environment only (the
proxy variables' userinfo, ``agentsandbox:CREDENTIAL@``), and registers its
SHA-256 with the running service through the broker's ``session`` op: the
service never holds the credential itself, and nothing of it is written
anywhere but the session's env file.  The proxy reads it from a CONNECT's or a
forwarded request's ``Proxy-Authorization: Basic`` and from SOCKS5's RFC 1929
password, and ``SessionRegistry`` maps the connection's client address to the
session, which every audit record of that connection then carries.

Attribution, not a boundary: a request without a known credential is served
as before unless ``proxy.require_session`` is true.  A sandboxed process of
the same user can read its own session's credential (it is in its
environment) and could register one of its own under a session name nobody
registered yet; it cannot take over a name already registered.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import secrets

#: The user name of the proxy credential (the password is the credential).
USER = "agentsandbox"
#: A session's name: Claude Code's session id, or ``run-…`` for ``agentsandbox run``.
SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: Registered sessions kept, the oldest forgotten first.
MAX_SESSIONS = 4096
#: Client addresses remembered with their session (a live connection's, or one
#: whose records are still being written); the oldest forgotten first.
MAX_CLIENTS = 65536


def newCredential() -> str:
    """A fresh session credential (URL-safe, so it can stand in a proxy URL as it is)."""
    return "s1." + secrets.token_urlsafe(32)


def digest(credential: str | bytes) -> str:
    raw = credential.encode("ascii") if isinstance(credential, str) else credential
    return hashlib.sha256(raw).hexdigest()


def passwordOf(proxyAuthorization: bytes) -> bytes | None:
    """The password of a ``Basic`` Proxy-Authorization value, or None."""
    scheme, _, encoded = proxyAuthorization.strip().partition(b" ")
    if scheme.lower() != b"basic":
        return None
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    _user, colon, password = decoded.partition(b":")
    return password if colon else None


class SessionRegistry:
    """Digests of registered credentials, and the session of each client address."""

    def __init__(self) -> None:
        self._byDigest: dict[str, str] = {}
        self._byClient: dict[str, str] = {}

    def register(self, session: str, credentialDigest: str) -> str | None:
        """Register ``session``'s credential digest; None, or why it is refused."""
        if not SESSION_ID.fullmatch(session):
            return f"{session!r} is not a session name"
        if not re.fullmatch(r"[0-9a-f]{64}", credentialDigest):
            return "the credential digest is not 64 hex digits"
        if session in self._byDigest.values():
            return f"the session {session} has a credential already"
        self._byDigest[credentialDigest] = session
        while len(self._byDigest) > MAX_SESSIONS:
            del self._byDigest[next(iter(self._byDigest))]
        return None

    @property
    def sessions(self) -> int:
        return len(self._byDigest)

    def connected(self, client: str) -> None:
        """A new connection from ``client``: whatever that address was before is forgotten."""
        self._byClient.pop(client, None)

    def attribute(self, client: str, password: bytes | None) -> str | None:
        """The session whose credential ``password`` is, now remembered for ``client``; None if unknown."""
        if not password:
            return None
        session = self._byDigest.get(digest(password))
        if session is not None:
            self._byClient[client] = session
            while len(self._byClient) > MAX_CLIENTS:
                del self._byClient[next(iter(self._byClient))]
        return session

    def of(self, client: object) -> str | None:
        """The session of the connection from ``client`` (an audit record's ``client``)."""
        return self._byClient.get(client) if isinstance(client, str) else None
