"""The dispatcher's wire, Twisted-free: what both ends of the registration socket say.

The dispatcher (``dispatch.py``), a user's service registering with it
(``register.py``), and ``doctor``/``run`` asking it for its status all speak
this: JSON, one object per line, at most ``MAX_LINE`` bytes.  ``run`` and
``doctor`` ask the status before a sandbox starts, so this module imports no
Twisted (``tests/test_dispatchwire.py`` shows it): a status query costs a
socket, not the reactor's import.

- client -> dispatcher: ``{"op": "register"}``, ``{"op": "status"}``;
- dispatcher -> client: ``{"op": "registered", "uid": U, "ports": [...]}``,
  ``{"op": "conn"}`` carrying one file descriptor, ``{"op": "replaced"}``,
  ``{"op": "status", ...}``, ``{"op": "error", "error": "..."}``.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

#: Longest line on the registration socket; a longer one is refused.
MAX_LINE = 4096
#: Descriptors sent in one ``SCM_RIGHTS`` message (the kernel allows 253): the
#: connections of one readiness event travel together, so the service reads
#: them with one ``recvmsg`` (the kernel ends a read at the first message
#: carrying descriptors).
FDS_PER_MESSAGE = 64

_PEERCRED = struct.Struct("3i")


class WireError(Exception):
    """A registration-socket message that is not one: says what was wrong."""


class LineReader:
    """Splits bytes into JSON objects, one per line, each at most ``MAX_LINE`` bytes.

    ``feed`` parses every line at once; ``push`` and ``next`` let a reader take
    one message at a time and stop, leaving the rest as bytes (a parsed message
    costs several times its line).
    """

    def __init__(self, limit: int = MAX_LINE) -> None:
        self.limit = limit
        self._buffer = b""
        #: Where the lines not taken yet start in ``_buffer``.
        self._start = 0

    def push(self, data: bytes) -> None:
        """Takes ``data``; an unfinished line already longer than the limit is refused here."""
        buffer = self._buffer[self._start :] + data if self._start else self._buffer + data
        self._start = 0
        if len(buffer) - buffer.rfind(b"\n") - 1 > self.limit:
            self._buffer = b""
            raise WireError(f"a message longer than {self.limit} bytes")
        self._buffer = buffer

    def next(self) -> dict[str, Any] | None:
        """The next whole message, or None until more bytes come."""
        end = self._buffer.find(b"\n", self._start)
        if end < 0:
            return None
        line = self._buffer[self._start : end]
        self._start = end + 1
        if line == _CONN_LINE:
            # The line every hand-off carries: no JSON parser for it.
            return {"op": "conn"}
        if len(line) > self.limit:
            raise WireError(f"a message longer than {self.limit} bytes")
        try:
            message = json.loads(line)
        except (UnicodeDecodeError, ValueError):
            raise WireError("a message that is not JSON") from None
        if not isinstance(message, dict) or not isinstance(message.get("op"), str):
            raise WireError('a message that is not a JSON object with an "op"')
        return message

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self.push(data)
        messages = []
        while (message := self.next()) is not None:
            messages.append(message)
        return messages

    @property
    def pending(self) -> int:
        """Bytes taken and not yet returned as a message."""
        return len(self._buffer) - self._start


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":"), sort_keys=True).encode() + b"\n"


#: The line each handed-off descriptor travels with.
CONN = encode({"op": "conn"})
_CONN_LINE = CONN[:-1]


def peerCredentials(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket, from the kernel."""
    pid, uid, _gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return pid, uid


# --------------------------------------------------------------------------- asking a dispatcher


class DispatchQueryError(Exception):
    """No dispatcher answered the status query, or not with a status: says which and where."""


def askStatus(path: str, timeout: float = 3.0) -> dict[str, Any]:
    """The dispatcher's status reply, asked over its registration socket, with
    ``answeredBy``: the uid that listens on it (the kernel's SO_PEERCRED)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
            _, answeredBy = peerCredentials(sock)
            sock.sendall(encode({"op": "status"}))
            data = b""
            while not data.endswith(b"\n"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
        except OSError as e:
            raise DispatchQueryError(f"no dispatcher answers on {path}: {e.strerror or e}") from None
    try:
        reply = json.loads(data)
    except ValueError:
        raise DispatchQueryError(f"the dispatcher on {path} answered something that is not JSON") from None
    if not isinstance(reply, dict) or reply.get("op") != "status":
        raise DispatchQueryError(f"the dispatcher on {path} answered {str(reply)[:200]}")
    reply["answeredBy"] = answeredBy
    return reply
