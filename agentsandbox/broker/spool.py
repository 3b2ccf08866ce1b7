"""The broker's wire format, shared by the client (in the sandbox) and the server (on the host).

A sandboxed process cannot open a Unix socket, so it asks the host through files in
one directory, the spool (0700).  For a request id (24 lower-case hex characters from
12 random bytes):

``<id>.tmp``
    the requester creates it O_EXCL, mode 0600, and writes the request JSON;
``<id>.req``
    the same file renamed into place; the requester keeps it open until it has the
    answer, because the open file is how the broker knows who asks;
``<id>.out``
    a streamed call's output while it runs (created by the broker, 0600);
``<id>.reply.tmp`` then ``<id>.reply``
    the broker's answer, written aside and renamed, so a reply that exists is whole.

Request JSON (``op`` required, every other field optional, unknown fields refused)::

    {"op": "run", "args": ["NAME", "ARG"], "input": "<base64>", "stream": true,
     "memory": "2G", "cpu": "150%", "key": "ssh-ed25519 AAAA..."}

Reply JSON (every field optional; no ``error`` means the op was carried out)::

    {"error": "why not", "out": "<base64>", "err": "<base64>", "code": 0}

``out`` and ``err`` are base64 so a host command's bytes survive JSON unchanged.

Stdlib only: the client imports this inside the sandbox.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

#: The broker reads at most this many bytes of a request; more is refused.
REQUEST_LIMIT = 1 << 20
#: A signing payload (a commit or tag object) may be at most this long.
SIGN_PAYLOAD_LIMIT = 512 * 1024

FILE_MODE = 0o600
DIR_MODE = 0o700

TMP = ".tmp"
REQ = ".req"
OUT = ".out"
REPLY = ".reply"
REPLY_TMP = ".reply.tmp"
#: Every suffix the spool may hold; anything else in the directory is not ours.
SUFFIXES = (REPLY_TMP, REPLY, REQ, TMP, OUT)

_ID = re.compile(r"[0-9a-f]{24}")
_GPG_KEY_FORBIDDEN = re.compile(r"[\x00-\x1f\x7f]")
_SSH_PUBLIC = re.compile(r"[a-z0-9@.-]+ [A-Za-z0-9+/]+=*(?: .*)?")

#: The only gpg call the broker makes for a sandbox: git's detached, armoured signature.
GPG_SHAPE = "--status-fd=2 -bsau KEY"
#: The only ssh-keygen call: git's signature in the git namespace (the buffer file
#: stays in the sandbox; its bytes travel as the request's input).
SSH_SHAPE = "-Y sign -n git -f KEYFILE [-U]"

#: Fields a request may carry, with their JSON types.
_FIELDS: dict[str, type] = {
    "op": str,
    "args": list,
    "input": str,
    "stream": bool,
    "memory": str,
    "cpu": str,
    "key": str,
}


class WireError(ValueError):
    """A request or reply that does not follow the wire format; the message says how."""


def newId() -> str:
    return secrets.token_hex(12)


def isId(text: str) -> bool:
    return bool(_ID.fullmatch(text))


def splitName(name: str) -> tuple[str, str] | None:
    """``(id, suffix)`` for a spool file name, or None when the name is not ours."""
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            rid = name[: -len(suffix)]
            return (rid, suffix) if isId(rid) else None
    return None


@dataclass(frozen=True)
class Request:
    op: str
    args: tuple[str, ...] = ()
    input: bytes | None = None
    stream: bool = False
    memory: str | None = None
    cpu: str | None = None
    key: str | None = None

    def toJSON(self) -> bytes:
        obj: dict[str, Any] = {"op": self.op}
        if self.args:
            obj["args"] = list(self.args)
        if self.input is not None:
            obj["input"] = base64.b64encode(self.input).decode("ascii")
        if self.stream:
            obj["stream"] = True
        for name in ("memory", "cpu", "key"):
            value = getattr(self, name)
            if value is not None:
                obj[name] = value
        return (json.dumps(obj, sort_keys=True) + "\n").encode("utf-8")


def parseRequest(raw: bytes) -> Request:
    """Strictly decode a request.  Raises WireError naming what is wrong."""
    if len(raw) > REQUEST_LIMIT:
        raise WireError(f"request over {REQUEST_LIMIT} bytes")
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise WireError(f"malformed request: not UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise WireError(f"malformed request: {e}") from None
    if not isinstance(obj, dict):
        raise WireError("malformed request: not a JSON object")
    for name, value in obj.items():
        kind = _FIELDS.get(name)
        if kind is None:
            raise WireError(f"malformed request: unknown field {name!r}")
        if not isinstance(value, kind):
            raise WireError(f"malformed request: {name!r} must be a {kind.__name__}")
    op = obj.get("op")
    if not isinstance(op, str) or not op:
        raise WireError("malformed request: no 'op'")
    args = obj.get("args", [])
    for i, a in enumerate(args):
        if not isinstance(a, str):
            raise WireError(f"malformed request: args[{i}] must be a string")
        if "\0" in a:
            raise WireError(f"malformed request: args[{i}] holds a NUL byte")
        try:
            a.encode("utf-8")
        except UnicodeEncodeError:
            # A lone surrogate (valid in JSON) has no bytes the program could
            # get; '\udcff' would reach exec as the byte 0xff through
            # surrogateescape, a second reading of what the pattern matched.
            raise WireError(f"malformed request: args[{i}] is not valid Unicode text") from None
    data: bytes | None = None
    if "input" in obj:
        try:
            data = base64.b64decode(obj["input"], validate=True)
        except (binascii.Error, ValueError):
            raise WireError("malformed request: 'input' is not base64") from None
    return Request(
        op=op,
        args=tuple(args),
        input=data,
        stream=bool(obj.get("stream", False)),
        memory=obj.get("memory"),
        cpu=obj.get("cpu"),
        key=obj.get("key"),
    )


@dataclass(frozen=True)
class Reply:
    error: str | None = None
    out: bytes = b""
    err: bytes = b""
    code: int | None = None

    def toJSON(self) -> bytes:
        obj: dict[str, Any] = {}
        if self.error is not None:
            obj["error"] = self.error
        if self.out:
            obj["out"] = base64.b64encode(self.out).decode("ascii")
        if self.err:
            obj["err"] = base64.b64encode(self.err).decode("ascii")
        if self.code is not None:
            obj["code"] = self.code
        return (json.dumps(obj, sort_keys=True) + "\n").encode("utf-8")


def parseReply(raw: bytes) -> Reply:
    """Decode the broker's answer.  Raises WireError."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"the broker's answer is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise WireError("the broker's answer is not a JSON object")
    error = obj.get("error")
    code = obj.get("code")
    if error is not None and not isinstance(error, str):
        raise WireError("the broker's answer has a non-string 'error'")
    if code is not None and (not isinstance(code, int) or isinstance(code, bool)):
        raise WireError("the broker's answer has a non-integer 'code'")
    blobs: dict[str, bytes] = {}
    for name in ("out", "err"):
        value = obj.get(name, "")
        if not isinstance(value, str):
            raise WireError(f"the broker's answer has a non-string {name!r}")
        try:
            blobs[name] = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise WireError(f"the broker's answer has a non-base64 {name!r}") from None
    return Reply(error=error, out=blobs["out"], err=blobs["err"], code=code)


# --------------------------------------------------------------------------- sign shapes


def checkGpgArgs(args: tuple[str, ...] | list[str]) -> str:
    """The key of git's ``--status-fd=2 -bsau KEY``; WireError for any other shape."""
    if len(args) != 3 or args[0] != "--status-fd=2" or args[1] != "-bsau":
        raise WireError(f"the broker signs only git's gpg call: {GPG_SHAPE}")
    key = args[2]
    if not key or key.startswith("-") or _GPG_KEY_FORBIDDEN.search(key):
        raise WireError(
            f"the signing key {key!r} is empty, starts with '-' or holds a control character"
        )
    return key


def checkSshArgs(args: tuple[str, ...] | list[str]) -> str:
    """The key file of git's ``-Y sign -n git -f KEYFILE [-U]``; WireError otherwise."""
    rest = list(args)
    if rest and rest[-1] == "-U":
        rest = rest[:-1]
    if len(rest) != 6 or rest[:5] != ["-Y", "sign", "-n", "git", "-f"] or not rest[5]:
        raise WireError(f"the broker signs only git's ssh call: {SSH_SHAPE}")
    return rest[5]


def publicKeyOf(text: str) -> str | None:
    """``TYPE BASE64`` of an OpenSSH public key line (or git's ``key::`` literal), else None."""
    stripped = text.strip()
    line = stripped.splitlines()[0] if stripped else ""
    if line.startswith("key::"):
        line = line[5:]
    if not _SSH_PUBLIC.fullmatch(line):
        return None
    kind, blob = line.split()[:2]
    return f"{kind} {blob}"
