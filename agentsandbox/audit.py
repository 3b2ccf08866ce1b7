"""The decision log: one JSON line per egress decision, size-rotated, plus a journal line.

Records carry only what a decision is made of: the event, the protocol, the
client address, host, port, checked address, the reason, byte counts and
duration; a terminated request's record (a refusal by a request rule, a
response withheld because it carried the token) also its method, its path
(the query string only when ``audit.queries`` says so) and the rule that
decided.  Never a header, a body or a token: the proxy passes nothing else
in, and ``record`` keeps only the fields named in ``FIELDS`` so a later
caller cannot widen it by accident.

``agentsandbox log`` and ``agentsandbox suggest`` read the file back.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from twisted.logger import Logger

#: Event names.  ``tunnel``/``forward``: allowed, written at close;
#: ``withheld``: a terminated response that carried the token, cut.
#: ``held``/``decided``/``timedout``: a request for an unlisted host held for the
#: person's answer, answered (``by`` whom, ``verdict``, ``scope``, ``seconds``),
#: or not answered in time; ``withdrawn``: its client went away first; ``control``: a refused approvals control request;
#: ``observed``: under ``proxy.unlisted = "observe"``, an unlisted host let through
#: that would have been refused (``reason`` says why, ``allow`` the entry that lists it).
EVENTS = (
    "tunnel", "forward", "refused", "peer", "parse", "failed", "withheld", "held", "decided", "timedout", "control",
    "observed", "withdrawn",
)  # fmt: skip
#: The only fields a record may hold.
FIELDS = (
    "kind",
    "client",
    "host",
    "port",
    "address",
    "via",
    "reason",
    "allow",
    "status",
    "up",
    "down",
    "duration",
    "method",
    "path",
    "rule",
    "session",
    "id",
    "by",
    "verdict",
    "scope",
    "seconds",
)


_SCALARS = (int, float, bool, str)

#: One encoder for every record (json.dumps with options builds a new one per call).
_ENCODER = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"))


def _cEncoder() -> Callable[[dict[str, Any]], str]:
    """``_ENCODER.encode`` for flat records, without rebuilding the C encoder per call.

    ``JSONEncoder.encode`` makes a new C encoder for every call; records are
    flat dicts of scalars (no cycles to look for), so one is built here and
    reused.  Where the C accelerator is missing, ``_ENCODER.encode`` it is.
    """
    from json import encoder as jsonEncoder

    make = getattr(jsonEncoder, "c_make_encoder", None)
    if make is None:
        return _ENCODER.encode
    try:
        iterencode = make(
            None, _ENCODER.default, jsonEncoder.encode_basestring_ascii, None, ":", ",", False, False, True
        )
        if "".join(iterencode({"a": 1, "b": "\u00e9"}, 0)) != _ENCODER.encode({"a": 1, "b": "\u00e9"}):
            return _ENCODER.encode
    except (TypeError, ValueError):
        return _ENCODER.encode
    return lambda rec: "".join(iterencode(rec, 0))


_encode = _cEncoder()


class AuditLog:
    """Appends JSON lines to ``path``, rotating at ``maxBytes`` and keeping ``keep`` old files."""

    log = Logger(namespace="agentsandbox.egress")

    def __init__(
        self,
        path: str,
        maxBytes: int = 10 * 1024 * 1024,
        keep: int = 3,
        wallClock: Callable[[], float] = time.time,
        journal: bool = True,
        queries: bool = False,
    ) -> None:
        self.path = path
        self.maxBytes = maxBytes
        self.keep = keep
        self._now = wallClock
        self._journal = journal
        #: Whether a ``path`` keeps its query string (``audit.queries``); it may hold secrets.
        self._queries = queries
        self._fd: int | None = None
        self._size = 0

    @classmethod
    def fromConfig(cls, config: Any, **kw: Any) -> AuditLog:
        a = config.audit
        return cls(a.file, a.max_bytes, a.keep, queries=a.queries, **kw)

    def _open(self) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", mode=0o700, exist_ok=True)
        # One unbuffered O_APPEND write per record: a line is on disk (or in the
        # page cache) when record() returns, and lines never interleave.
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._size = os.fstat(self._fd).st_size

    def _rotate(self) -> None:
        self.close()
        for i in range(self.keep, 0, -1):
            older = f"{self.path}.{i}"
            newer = self.path if i == 1 else f"{self.path}.{i - 1}"
            if os.path.exists(newer):
                os.replace(newer, older)

    def record(self, event: str, **fields: Any) -> dict[str, Any]:
        """Write one decision.  Unknown fields are dropped; returns the record written."""
        if event not in EVENTS:
            raise ValueError(f"unknown audit event {event!r}")
        rec: dict[str, Any] = {"ts": round(self._now(), 3), "event": event}
        given = fields.get
        for name in FIELDS:
            value = given(name)
            if value is not None:
                rec[name] = value if type(value) in _SCALARS else str(value)
        path = rec.get("path")
        if path is not None and not self._queries:
            rec["path"] = str(path).split("?", 1)[0]
        line = (_encode(rec) + "\n").encode("ascii")
        try:
            if self._fd is None:
                self._open()
            if self._size and self._size + len(line) > self.maxBytes:
                self._rotate()
                self._open()
            assert self._fd is not None
            os.write(self._fd, line)
            self._size += len(line)
        except OSError as e:
            # The proxy must keep deciding even when the disk is full; the
            # journal line below still carries the decision.
            self.log.error("audit log {path} not written: {why}", path=self.path, why=e.strerror or str(e))
            self.close()
        if self._journal and event not in ("tunnel", "forward"):
            # The journal gets what an operator must see (refusals and failures);
            # allowed traffic is in the file, for `agentsandbox log`.
            self.log.info("{line}", line=journalLine(rec))
        return rec

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


def journalLine(rec: dict[str, Any]) -> str:
    """The short human line for one record (journal and ``agentsandbox log``)."""
    line = _journalLine(rec)
    session = rec.get("session")
    return f"{line} [session {session}]" if session else line


def _journalLine(rec: dict[str, Any]) -> str:
    ev = rec.get("event", "?")
    target = f"{rec.get('host', '')}:{rec.get('port', '')}" if "host" in rec else ""
    kind = rec.get("kind", "")
    client = rec.get("client", "")
    if ev in ("tunnel", "forward"):
        extra = f" via {rec['address']}" if "address" in rec else ""
        status = f" status {rec['status']}" if "status" in rec else ""
        return (
            f"egress: {kind} {target}{extra}{status} from {client}: "
            f"{rec.get('up', 0)} bytes up, {rec.get('down', 0)} down, {rec.get('duration', 0)}s"
        )
    if ev == "refused" and "method" in rec:
        return f"egress: refused {rec['method']} {rec.get('path', '')} to {target} ({rec.get('rule', '')}): {rec.get('reason', '')}"
    if ev == "withheld":
        return f"egress: withheld a response to {rec.get('method', '')} {rec.get('path', '')} from {target}: {rec.get('reason', '')}"
    if ev == "refused":
        return f"egress: refused {kind} {target} from {client}: {rec.get('reason', '')}"
    if ev == "held":
        return f"approvals: holding {kind} {target} from {client} (request {rec.get('id', '')}): {rec.get('reason', '')}"
    if ev == "decided":
        scope = rec.get("scope", "")
        if scope == "for":
            scope = f"for {rec['seconds']:g}s" if "seconds" in rec else "until the service stops"
        return f"approvals: {rec.get('verdict', '')} {scope} {target} (request {rec.get('id', '')}) by {rec.get('by', '')}"
    if ev == "timedout":
        return f"approvals: nobody answered for {target} (request {rec.get('id', '')}): {rec.get('reason', '')}"
    if ev == "withdrawn":
        return f"approvals: {kind} {target} from {client} went away before an answer (request {rec.get('id', '')})"
    if ev == "observed":
        return f"egress: OBSERVED {kind} {target} from {client}: would refuse: {rec.get('reason', '')}"
    if ev == "control":
        return f"approvals: refused a control request from {client}: {rec.get('reason', '')}"
    if ev == "peer":
        return f"egress: refused a connection from {client}: {rec.get('reason', '')}"
    if ev == "parse":
        return f"egress: bad {kind} request from {client}: {rec.get('reason', '')}"
    return f"egress: {kind} {target} failed: {rec.get('reason', '')}"


# --------------------------------------------------------------------------- reading


def readRecords(path: str, keep: int = 9) -> Iterator[dict[str, Any]]:
    """Every record, oldest first, across the rotated files.  Bad lines are skipped."""
    files = [f"{path}.{i}" for i in range(keep, 0, -1)] + [path]
    for name in files:
        try:
            f = open(name, encoding="utf-8", errors="replace")  # noqa: SIM115 (closed below)
        except OSError:
            continue
        with f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict) and isinstance(rec.get("ts"), int | float):
                    yield rec


_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([smhdw]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parseDuration(text: str) -> float:
    """``90``, ``30s``, ``10m``, ``2h``, ``7d``, ``1w`` -> seconds."""
    m = _DURATION.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a duration such as 30s, 10m, 2h or 7d")
    return float(m.group(1)) * _UNITS[m.group(2)]


def _isoTime(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def _auditPath(name: str, args: argparse.Namespace) -> str:
    if args.file:
        return str(args.file)
    from agentsandbox.cli import loadConfig

    return loadConfig(name, args.config).audit.file


def _parser(name: str, description: str) -> argparse.ArgumentParser:
    from agentsandbox.cli import parser

    p = parser(name, description)
    p.add_argument("--file", help="read this audit file instead of the config's audit.file")
    return p


def _isDenial(rec: dict[str, Any]) -> bool:
    """A refusal of any kind: the proxy's, a person's deny, nobody answering, a control request refused."""
    event = rec.get("event")
    return event in ("refused", "peer", "parse", "withheld", "timedout", "control") or (
        event == "decided" and rec.get("verdict") == "deny"
    )


def logMain(argv: list[str], now: Callable[[], float] = time.time) -> int:
    parser = _parser("log", "Show the egress decision log.")
    parser.add_argument("--denied", action="store_true", help="only refusals")
    parser.add_argument("--since", help="only records newer than DURATION (30s, 10m, 2h, 7d)")
    parser.add_argument("--json", action="store_true", help="print the JSON records")
    parser.add_argument("--session", help="only records of this session (Claude Code's session id, or run-…)")
    args = parser.parse_args(argv)
    try:
        since = now() - parseDuration(args.since) if args.since else None
    except ValueError as e:
        parser.error(str(e))
    for rec in readRecords(_auditPath("log", args)):
        if since is not None and rec["ts"] < since:
            continue
        if args.denied and not _isDenial(rec):
            continue
        if args.session is not None and rec.get("session") != args.session:
            continue
        if args.json:
            print(json.dumps(rec, sort_keys=True))
        else:
            print(f"{_isoTime(rec['ts'])} {journalLine(rec)}")
    return 0


@dataclass
class _Seen:
    #: Refused, and let through only because the machine was observing ("would refuse").
    count: int
    last: float
    hosts: set[str]
    observed: int = 0


def suggestions(records: Iterator[dict[str, Any]], since: float | None) -> dict[str, _Seen]:
    """allow-list entry -> how often and when it would have allowed a refusal
    (``refused``) or a host observe mode let through (``observed``)."""
    out: dict[str, _Seen] = {}
    for rec in records:
        event = rec.get("event")
        if event not in ("refused", "observed") or not rec.get("allow"):
            continue
        if since is not None and rec["ts"] < since:
            continue
        entry = str(rec["allow"])
        seen = out.setdefault(entry, _Seen(0, 0.0, set()))
        if event == "observed":
            seen.observed += 1
        else:
            seen.count += 1
        seen.last = max(seen.last, float(rec["ts"]))
        seen.hosts.add(str(rec.get("host", "")))
    return out


def group(entry: str) -> str:
    """The heading an entry is listed under: its registrable-looking domain (the last
    two labels), or the address itself for an IP entry."""
    host = entry.rsplit(":", 1)[0] if entry.count(":") == 1 else entry
    if host.startswith("[") or host.replace(".", "").isdigit():
        return host.strip("[]").split("]")[0]
    labels = host.split(".")
    return ".".join(labels[-2:])


def _said(seen: _Seen) -> str:
    parts = []
    if seen.count:
        parts.append(f"refused {seen.count}x")
    if seen.observed:
        parts.append(f"would refuse {seen.observed}x (observed)")
    return ", ".join(parts) + f", last {_isoTime(seen.last)}"


def suggestMain(argv: list[str], now: Callable[[], float] = time.time) -> int:
    parser = _parser(
        "suggest",
        "Print the sandbox.domains entries that would allow recently refused hosts, and the hosts "
        "observe mode (proxy.unlisted = \"observe\") let through: grouped by domain, counted, "
        "ready to paste.",
    )
    parser.add_argument("--since", default="1d", help="look back this far (default 1d)")
    args = parser.parse_args(argv)
    try:
        since = now() - parseDuration(args.since)
    except ValueError as e:
        parser.error(str(e))
    found = suggestions(readRecords(_auditPath("suggest", args)), since)
    if not found:
        print(f"# no refusals or observed hosts in the last {args.since}", file=sys.stderr)
        return 0
    print("# add to [sandbox] domains = [...] in your config, then the proxy reloads by itself")
    width = max(len(json.dumps(e)) for e in found) + 1
    groups: dict[str, list[tuple[str, _Seen]]] = {}
    for entry, seen in found.items():
        groups.setdefault(group(entry), []).append((entry, seen))

    def total(items: list[tuple[str, _Seen]]) -> int:
        return sum(s.count + s.observed for _, s in items)

    for name, items in sorted(groups.items(), key=lambda kv: (-total(kv[1]), kv[0])):
        print(f"  # {name}")
        for entry, seen in sorted(items, key=lambda kv: (-(kv[1].count + kv[1].observed), kv[0])):
            text = json.dumps(entry) + ","
            print(f"  {text.ljust(width)}  # {_said(seen)}")
    return 0
