"""Deciding unlisted hosts by a person (issue 28): the values and the control wire.

With ``proxy.unlisted = "ask"`` the proxy holds a request for a host that is
not on ``sandbox.domains`` and asks the person; this module is the contract
between the three parties, and imports no Twisted so the command line that
answers (``agentsandbox approve``, ``approvals``, ``watch``) stays light:

- the service's registry of held requests (``egress/approvals.py``), which
  holds, times out and remembers answers, and tells its subscribers;
- the control socket (one per user, ``controlSocket``), the only place an
  answer is taken: never the broker's spool, which the sandbox writes;
- the ways a person answers: the command line, ``watch``, a desktop
  notification.

The wire is one JSON object a line, each way.  A client sends one request and
reads answers until it closes; ``follow`` keeps the connection open and
streams events.  Every answer carries ``ok``; ``ok: false`` carries ``error``,
words meant for the person.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any, Literal

#: How a held request may be answered.
Verdict = Literal["allow", "deny"]

#: For how long an answer holds: this one request, ``seconds`` (or until the
#: service stops when None), or written into the user's config.
Scope = Literal["once", "for", "always"]

#: The operations the control socket takes.
OPS = ("list", "answer", "follow")


@dataclass(frozen=True, slots=True)
class HeldRequest:
    """A request waiting for a person's answer."""

    id: str
    host: str
    port: int
    #: connect | socks | forward
    kind: str
    #: The client's address on the proxy's port.
    client: str
    #: What is known of the process that asked (``pid comm`` or a session), else None.
    process: str | None
    #: When it was held (the service clock's seconds).
    since: float

    def toWire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def fromWire(cls, data: dict[str, Any]) -> HeldRequest:
        return cls(
            id=str(data["id"]),
            host=str(data["host"]),
            port=int(data["port"]),
            kind=str(data["kind"]),
            client=str(data["client"]),
            process=None if data.get("process") is None else str(data["process"]),
            since=float(data["since"]),
        )


@dataclass(frozen=True, slots=True)
class Answer:
    """A person's answer to a held request (or to every request for a host)."""

    verdict: Verdict
    scope: Scope
    #: With scope "for": how long; None means until the service stops.
    seconds: float | None = None
    #: Who answered, for the audit record: the channel and the answering process.
    by: str = ""

    def toWire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def fromWire(cls, data: dict[str, Any]) -> Answer:
        verdict, scope = data.get("verdict"), data.get("scope")
        if verdict not in ("allow", "deny"):
            raise ValueError(f"verdict must be allow or deny, not {verdict!r}")
        if scope not in ("once", "for", "always"):
            raise ValueError(f"scope must be once, for or always, not {scope!r}")
        seconds = data.get("seconds")
        if seconds is not None and (not isinstance(seconds, (int, float)) or seconds <= 0):
            raise ValueError(f"seconds must be a positive number, not {seconds!r}")
        return cls(verdict, scope, None if seconds is None else float(seconds), str(data.get("by", "")))


def controlSocket(runtimeDir: str) -> str:
    """The user's control socket (mode 0600 in the 0700 runtime directory)."""
    return os.path.join(runtimeDir, "agentsandbox", "control.sock")


def encode(message: dict[str, Any]) -> bytes:
    """One message on the wire: compact JSON and a newline."""
    return json.dumps(message, separators=(",", ":"), sort_keys=True).encode() + b"\n"


#: The longest line either side accepts (a list of many held requests fits).
MAX_LINE = 1 << 20


def decode(line: bytes) -> dict[str, Any]:
    """One line off the wire; ValueError with the reason when it is not a JSON object."""
    if len(line) > MAX_LINE:
        raise ValueError(f"a control message is longer than {MAX_LINE} bytes")
    try:
        value = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"a control message is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("a control message must be a JSON object")
    return value


# --------------------------------------------------------------------------- events
#
# What ``follow`` streams and what the registry's subscribers get: the same
# dicts, so the terminal view and the desktop notifier see one thing.


def heldEvent(request: HeldRequest) -> dict[str, Any]:
    return {"event": "held", "request": request.toWire()}


def decidedEvent(request: HeldRequest, answer: Answer) -> dict[str, Any]:
    return {"event": "decided", "request": request.toWire(), "answer": answer.toWire()}


def timedoutEvent(request: HeldRequest) -> dict[str, Any]:
    return {"event": "timedout", "request": request.toWire()}


def withdrawnEvent(request: HeldRequest) -> dict[str, Any]:
    """The client went away before anyone answered: the request is no longer held."""
    return {"event": "withdrawn", "request": request.toWire()}


def observedEvent(host: str, port: int, kind: str) -> dict[str, Any]:
    return {"event": "observed", "host": host, "port": port, "kind": kind}


def describeAnswer(answer: Answer) -> str:
    """``allow once``, ``allow for 10m``, ``deny always``: how the person answered."""
    if answer.scope != "for":
        return f"{answer.verdict} {answer.scope}"
    if answer.seconds is None:
        return f"{answer.verdict} until the service stops"
    return f"{answer.verdict} for {formatSeconds(answer.seconds)}"


def formatSeconds(seconds: float) -> str:
    """``45s``, ``10m``, ``2h``, ``1h30m``: a duration as ``--for`` takes it."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m" + (f"{s % 60}s" if s % 60 else "")
    return f"{s // 3600}h" + (f"{s % 3600 // 60}m" if s % 3600 // 60 else "")
