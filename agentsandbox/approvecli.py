"""``agentsandbox approvals``, ``approve`` and ``deny``: the person's answers on the command line.

They speak the control socket's wire (``approvals.py``) to the user's own
service and import no Twisted.  The service decides whether the answer is
taken (``egress/control.py``): from inside a sandbox or from under an agent,
it is refused, and these commands print the service's words.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import time
from typing import Any

from agentsandbox.approvals import (
    Answer,
    controlSocket,
    decode,
    describeAnswer,
    encode,
    formatSeconds,
)

#: How long a command waits for the service's answer (it answers at once).
TIMEOUT = 30.0


class NotServing(Exception):
    """The service's control socket cannot be reached; the message says what to do."""


def socketPath(environ: dict[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    runtime = env.get("XDG_RUNTIME_DIR")
    if not runtime:
        raise NotServing(
            "XDG_RUNTIME_DIR is not set, so the service's control socket cannot be found "
            "(run this in your own login session)"
        )
    return controlSocket(runtime)


def exchange(message: dict[str, Any], path: str | None = None) -> dict[str, Any]:
    """Send one request to the service and read its one reply."""
    path = path or socketPath()
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    except OSError as e:
        # Claude Code's sandbox (seccomp) forbids Unix sockets altogether.
        raise NotServing(
            f"this process may not open a Unix socket ({e.strerror or e}): it runs in a sandbox, "
            "and answers come only from your own terminal"
        ) from None
    sock.settimeout(TIMEOUT)
    try:
        try:
            sock.connect(path)
        except FileNotFoundError:
            raise NotServing(
                f"no control socket at {path}: the agentsandbox service is not running "
                "(start it: systemctl --user start agentsandbox, or agentsandbox serve)"
            ) from None
        except ConnectionRefusedError:
            raise NotServing(
                f"{path} is there but nothing answers: the agentsandbox service is not running "
                "(start it: systemctl --user start agentsandbox, or agentsandbox serve)"
            ) from None
        except PermissionError:
            raise NotServing(
                f"{path} may not be opened by this process: it is another user's, or this "
                "process runs in a sandbox (answers come only from your own terminal)"
            ) from None
        sock.sendall(encode(message))
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except (TimeoutError, OSError) as e:
        raise NotServing(f"the service did not answer on {path}: {e}") from None
    finally:
        sock.close()
    if not data:
        raise NotServing(f"the service closed {path} without answering")
    return decode(data.split(b"\n", 1)[0])


_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([smhdw]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parseFor(text: str) -> float:
    """``--for``'s ``90``, ``30s``, ``10m``, ``2h``, ``7d``, ``1w`` in seconds (as ``log --since``)."""
    m = _DURATION.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a duration such as 30s, 10m, 2h or 7d")
    seconds = float(m.group(1)) * _UNITS[m.group(2)]
    if seconds <= 0:
        raise ValueError(f"{text!r} is no time at all")
    return seconds


def _describeRequest(request: dict[str, Any], now: float) -> str:
    waited = formatSeconds(max(0.0, now - float(request.get("since", now))))
    process = request.get("process") or "process unknown"
    return (
        f"{request['id']:>4}  {request['host']}:{request['port']}  {request['kind']}  "
        f"from {request['client']} ({process})  waiting {waited}"
    )


def approvalsMain(argv: list[str]) -> int:
    from agentsandbox.cli import parser

    p = parser(
        "approvals",
        "What waits for your answer (proxy.unlisted = \"ask\"), and the latest decisions.",
        config=False,
    )
    p.add_argument("--json", action="store_true", help="print the service's reply as JSON")
    args = p.parse_args(argv)
    try:
        reply = exchange({"op": "list"})
    except NotServing as e:
        print(f"agentsandbox approvals: {e}", file=sys.stderr)
        return 1
    if not reply.get("ok"):
        print(f"agentsandbox approvals: {reply.get('error')}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(reply, indent=2, sort_keys=True))
        return 0
    now = time.time()
    mode = reply.get("mode", "?")
    held = reply.get("held", [])
    print(f"proxy.unlisted = {json.dumps(mode)}")
    if mode != "ask":
        print("  (unlisted hosts are not held for an answer; set proxy.unlisted = \"ask\" to be asked)")
    print(f"waiting ({len(held)}):" if held else "waiting: nothing")
    for request in held:
        print("  " + _describeRequest(request, now))
    if held:
        print("  answer: agentsandbox approve ID|HOST [--once|--for DURATION|--always], "
              "agentsandbox deny ID|HOST [--once|--always]")
    recent = reply.get("recent", [])
    if recent:
        print("recent:")
        for item in recent[-10:]:
            request, answer = item["request"], item.get("answer")
            how = item["outcome"]
            if answer is not None:
                how += f" ({describeAnswer(Answer.fromWire(answer))}, by {answer.get('by') or 'the person'})"
            ago = formatSeconds(max(0.0, now - float(item.get("at", now))))
            print(f"  {request['host']}:{request['port']} {request['kind']}: {how}, {ago} ago")
    return 0


def _answerMain(name: str, verdict: str, argv: list[str]) -> int:
    from agentsandbox.cli import parser

    allow = verdict == "allow"
    p = parser(
        name,
        ("Let" if allow else "Refuse")
        + " a request held for your answer (agentsandbox approvals lists them), by its ID, "
        "or every one held for HOST.",
        config=False,
    )
    p.add_argument("target", metavar="ID|HOST")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--once", action="store_true", help="this request only (the default)")
    how.add_argument("--for", dest="duration", metavar="DURATION",
                     help="this request and every one for HOST for DURATION (30s, 10m, 2h, 7d)")
    how.add_argument("--until-stop", action="store_true",
                     help="this request and every one for HOST until the service stops")
    how.add_argument("--always", action="store_true",
                     help="written into your own config: sandbox."
                     + ("domains" if allow else "refused_domains"))
    args = p.parse_args(argv)
    seconds: float | None = None
    if args.always:
        scope = "always"
    elif args.duration is not None or args.until_stop:
        scope = "for"
        if args.duration is not None:
            try:
                seconds = parseFor(args.duration)
            except ValueError as e:
                p.error(f"--for: {e}")
    else:
        scope = "once"
    answer = Answer(verdict, scope, seconds, by=f"agentsandbox {name}")  # type: ignore[arg-type]
    try:
        reply = exchange({"op": "answer", "target": args.target, "answer": answer.toWire()})
    except NotServing as e:
        print(f"agentsandbox {name}: {e}", file=sys.stderr)
        return 1
    if not reply.get("ok"):
        print(f"agentsandbox {name}: {reply.get('error')}", file=sys.stderr)
        return 1
    answered = reply.get("answered", [])
    said = describeAnswer(answer)
    if answered:
        print(f"{said}: answered request{'s' if len(answered) > 1 else ''} {', '.join(answered)}")
    else:
        print(f"{said}: {args.target} (nothing was waiting; it decides the requests that follow)")
    return 0


def approveMain(argv: list[str]) -> int:
    return _answerMain("approve", "allow", argv)


def denyMain(argv: list[str]) -> int:
    return _answerMain("deny", "deny", argv)
