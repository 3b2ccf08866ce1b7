"""``agentsandbox watch``: the held requests live, with one-key answers.

A terminal view over the control socket's ``follow`` stream (agentsandbox/approvals.py):
what is waiting on top (host, port, kind, the process that asked, for how long,
ticking), the latest decisions below.  A key answers the selected request:
``o`` allow once, ``f`` allow for a while (asks how long; Enter takes
``DEFAULT_FOR``), ``a`` allow always (written into the config), ``d`` deny once,
``D`` deny always, ``q`` quits.  Arrows, ``j``/``k`` or a digit select.

Imports no Twisted and nothing outside the standard library: it is a client of
the service, run by the person in their own terminal.  The view itself is sans-IO
(``WatchState``: events in, lines out, keys in, answers out), so it is tested
without a terminal; ``Terminal`` is the only part that touches the tty: cbreak
mode (Ctrl-C still interrupts), the alternate screen, and everything put back on
the way out however the program ends.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TextIO

from agentsandbox.approvals import MAX_LINE, Answer, HeldRequest, controlSocket, decode, encode

#: ``f`` with no duration typed: an hour.  docs/approvals.md names it.
DEFAULT_FOR = 3600.0
#: How many decisions the view keeps below the held requests.
RECENT = 50
#: How long an ``answer`` may take before the view says so.
ANSWER_TIMEOUT = 10.0

NOT_RUNNING = (
    "the agentsandbox service is not running for this user (no control socket at {path}): "
    "start it with `systemctl --user start agentsandbox` or `agentsandbox serve`"
)


class NotRunning(Exception):
    """The control socket is not there or nobody listens on it; str() says so to the person."""


def socketPath(environ: dict[str, str] | None = None) -> str:
    """The user's control socket, from ``$XDG_RUNTIME_DIR`` (``/run/user/UID`` without it)."""
    env = os.environ if environ is None else environ
    runtime = env.get("XDG_RUNTIME_DIR") or f"/run/user/{os.getuid()}"
    return controlSocket(runtime)


def connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
    except (FileNotFoundError, ConnectionRefusedError) as e:
        s.close()
        raise NotRunning(NOT_RUNNING.format(path=path)) from e
    except OSError:
        s.close()
        raise
    return s


def ask(path: str, message: dict[str, Any], timeout: float = ANSWER_TIMEOUT) -> dict[str, Any]:
    """One request on its own connection, its one reply."""
    with connect(path) as s:
        s.settimeout(timeout)
        s.sendall(encode(message))
        lines = Lines()
        while True:
            data = s.recv(65536)
            if not data:
                raise OSError("the service closed the control connection without an answer")
            for reply in lines.feed(data):
                return reply


class Lines:
    """Bytes in, decoded JSON lines out."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self._buf += data
        *complete, self._buf = self._buf.split(b"\n")
        if len(self._buf) > MAX_LINE:
            raise ValueError(f"a control message is longer than {MAX_LINE} bytes")
        return [decode(line) for line in complete if line.strip()]


_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([smhdw]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parseDuration(text: str) -> float:
    """``90``, ``30s``, ``10m``, ``2h``, ``7d`` -> seconds (audit.parseDuration's syntax, without Twisted)."""
    m = _DURATION.match(text)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a duration such as 30s, 10m, 2h or 7d")
    return float(m.group(1)) * _UNITS[m.group(2)]


def since(seconds: float) -> str:
    """A short age: 7s, 3m05s, 2h10m."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def describeAnswer(answer: Answer | None, outcome: str) -> str:
    """``allowed once``, ``allowed for 1h``, ``denied always``, ``nobody answered``."""
    if answer is None:
        return {"timedout": "nobody answered", "withdrawn": "the client went away"}.get(outcome, outcome)
    verb = "allowed" if answer.verdict == "allow" else "denied"
    if answer.scope == "for":
        return f"{verb} for {since(answer.seconds)}" if answer.seconds else f"{verb} until the service stops"
    return f"{verb} {answer.scope}"


@dataclass(frozen=True, slots=True)
class Decision:
    request: HeldRequest
    outcome: str
    answer: Answer | None
    at: float


@dataclass(frozen=True, slots=True)
class Send:
    """What a key asks of the service: answer ``target`` with ``answer``."""

    target: str
    answer: Answer
    #: The words for the status line once it is done.
    said: str


QUIT = object()

#: key -> (verdict, scope, target is the host rather than the one request)
KEYS: dict[str, tuple[str, str, bool]] = {
    "o": ("allow", "once", False),
    "f": ("allow", "for", True),
    "a": ("allow", "always", True),
    "d": ("deny", "once", False),
    "D": ("deny", "always", True),
}

HELP = "o once  f for a while  a always  d deny  D deny always  ↑↓/1-9 select  q quit"


class WatchState:
    """The view, sans-IO: ``load``/``apply`` take the wire, ``key`` takes a key, ``lines`` draws."""

    def __init__(self, by: str = "") -> None:
        self.mode: str | None = None
        self.held: list[HeldRequest] = []
        self.recent: deque[Decision] = deque(maxlen=RECENT)
        self.observed: deque[tuple[str, int, str, float]] = deque(maxlen=RECENT)
        self.selected = 0
        self.status = ""
        self.connected = False
        #: The ``f`` prompt's typed text while it is open, and the request it is for.
        self.prompt: str | None = None
        self._promptFor: HeldRequest | None = None
        self._by = by

    # ------------------------------------------------------------- the wire
    def load(self, snapshot: dict[str, Any]) -> None:
        """The ``list`` body: everything known when the stream starts."""
        self.connected = True
        self.mode = str(snapshot.get("mode") or "?")
        self.held = sorted((HeldRequest.fromWire(h) for h in snapshot.get("held") or ()), key=lambda h: h.since)
        self.recent.clear()
        for r in snapshot.get("recent") or ():
            a = r.get("answer")
            self.recent.appendleft(
                Decision(HeldRequest.fromWire(r["request"]), str(r.get("outcome", "")),
                         None if a is None else Answer.fromWire(a), float(r.get("at", 0)))
            )  # fmt: skip
        self._clamp()

    def apply(self, event: dict[str, Any], now: float) -> None:
        kind = event.get("event")
        if kind == "held":
            request = HeldRequest.fromWire(event["request"])
            if all(h.id != request.id for h in self.held):
                self.held.append(request)
        elif kind in ("decided", "timedout", "withdrawn"):
            request = HeldRequest.fromWire(event["request"])
            selected = self.current()
            self.held = [h for h in self.held if h.id != request.id]
            a = event.get("answer")
            answer = None if a is None else Answer.fromWire(a)
            if kind == "decided":
                outcome = "allowed" if answer and answer.verdict == "allow" else "denied"
            else:
                outcome = str(kind)
            self.recent.appendleft(Decision(request, outcome, answer, now))
            if self._promptFor is not None and self._promptFor.id == request.id:
                self.prompt = self._promptFor = None
            # The selection stays on the request it was on, when that one is still held.
            if selected is not None and selected.id != request.id:
                self.selected = next((i for i, h in enumerate(self.held) if h.id == selected.id), self.selected)
        elif kind == "observed":
            self.observed.appendleft((str(event.get("host")), int(event.get("port", 0)), str(event.get("kind")), now))
        self._clamp()

    def answered(self, ids: list[str]) -> None:
        """The service took an answer for ``ids``: they leave the list now, before their
        ``decided`` events arrive, so the next key never lands on one of them."""
        selected = self.current()
        self.held = [h for h in self.held if h.id not in ids]
        if selected is not None and selected.id not in ids:
            self.selected = next(i for i, h in enumerate(self.held) if h.id == selected.id)
        self._clamp()

    def _clamp(self) -> None:
        self.selected = max(0, min(self.selected, len(self.held) - 1))

    def current(self) -> HeldRequest | None:
        return self.held[self.selected] if self.held else None

    # ------------------------------------------------------------- keys
    def key(self, key: str) -> Send | object | None:
        """One key (a character, or ``up``/``down``/``enter``/``esc``/``backspace``): what to do."""
        if self.prompt is not None:
            return self._promptKey(key)
        if key == "q":
            return QUIT
        if key in ("up", "k"):
            self.selected -= 1
        elif key in ("down", "j"):
            self.selected += 1
        elif key.isdigit() and key != "0":
            if int(key) <= len(self.held):
                self.selected = int(key) - 1
        elif key in KEYS:
            request = self.current()
            if request is None:
                self.status = "nothing is waiting"
                return None
            if key == "f":
                self.prompt, self._promptFor = "", request
                return None
            return self._send(request, key, None)
        self._clamp()
        return None

    def _promptKey(self, key: str) -> Send | None:
        request = self._promptFor
        assert request is not None and self.prompt is not None
        if key == "esc":
            self.prompt = self._promptFor = None
            return None
        if key == "backspace":
            self.prompt = self.prompt[:-1]
            return None
        if key == "enter":
            text = self.prompt.strip()
            try:
                seconds = parseDuration(text) if text else DEFAULT_FOR
            except ValueError as e:
                self.status = str(e)
                return None
            self.prompt = self._promptFor = None
            return self._send(request, "f", seconds)
        if len(key) == 1 and key.isprintable() and len(self.prompt) < 12:
            self.prompt += key
        return None

    def _send(self, request: HeldRequest, key: str, seconds: float | None) -> Send:
        verdict, scope, byHost = KEYS[key]
        answer = Answer(verdict, scope, seconds, by=self._by)  # type: ignore[arg-type]
        target = request.host if byHost else request.id
        shown = f"{request.host}:{request.port}" if not byHost else request.host
        return Send(target, answer, f"{shown}: {describeAnswer(answer, '')}")

    # ------------------------------------------------------------- drawing
    def lines(self, width: int, height: int, now: float) -> list[str]:
        """The screen, ``height`` lines at most, none wider than ``width``."""
        width = max(width, 20)
        narrow = width < 64
        out: list[str] = []
        clock = time.strftime("%H:%M:%S", time.localtime(now))
        if not self.connected:
            head = "agentsandbox watch: the service is not running; waiting for it"
        elif self.mode == "ask":
            head = "agentsandbox watch: asking for unlisted hosts"
        elif self.mode == "observe":
            head = "agentsandbox watch: OBSERVING, NOT ENFORCING (proxy.unlisted = observe)"
        else:
            head = f"agentsandbox watch: proxy.unlisted = {self.mode}: unlisted hosts are refused, nothing is held"
        out += _wrap(f"{head}  {clock}", width)
        out.append("")
        out.append(f"WAITING ({len(self.held)})" if self.held else "WAITING: nothing")
        for i, h in enumerate(self.held):
            mark = ">" if i == self.selected else " "
            number = str(i + 1) if i < 9 else " "
            target = f"{h.host}:{h.port}"
            waited = since(now - h.since)
            who = h.process or "process unknown"
            if narrow:
                out.append(_fit(f"{mark}{number} {target}  {waited}", width))
                out.append(_fit(f"    {h.kind}, {who}", width))
            else:
                out.append(_fit(f"{mark}{number} {target:<32} {h.kind:<8} {waited:>7}  {who}", width))
        if self.prompt is not None and self._promptFor is not None:
            out += _wrap(
                f"allow {self._promptFor.host} for how long? (30m, 2h, 1d; Enter: {since(DEFAULT_FOR)}; Esc: cancel) "
                f"{self.prompt}_",
                width,
            )
        elif self.held:
            out += _wrap(HELP, width)
        else:
            out += _wrap("q quit", width)
        if self.status:
            out += _wrap(self.status, width)
        out.append("")
        out.append("LATEST")
        rows: list[tuple[float, str]] = []
        for d in self.recent:
            stamp = time.strftime("%H:%M:%S", time.localtime(d.at))
            by = f" by {d.answer.by}" if d.answer is not None and d.answer.by and not narrow else ""
            rows.append((d.at, f"  {stamp} {d.request.host}:{d.request.port} {describeAnswer(d.answer, d.outcome)}{by}"))
        for host, port, kind, at in self.observed:
            stamp = time.strftime("%H:%M:%S", time.localtime(at))
            rows.append((at, f"  {stamp} {host}:{port} would be refused (observed, {kind})"))
        rows.sort(key=lambda r: -r[0])
        if not rows:
            out.append("  nothing decided yet")
        out += [_fit(text, width) for _, text in rows]
        return out[:height]


def _fit(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _wrap(text: str, width: int) -> list[str]:
    """Words onto lines of ``width`` (a narrow terminal still shows every key)."""
    lines: list[str] = []
    line = ""
    for word in text.split(" "):
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    lines.append(_fit(line, width))
    return lines


# --------------------------------------------------------------------------- the terminal

#: Escape sequences of the keys the view takes.
_SEQUENCES = {"\x1b[A": "up", "\x1bOA": "up", "\x1b[B": "down", "\x1bOB": "down"}


def splitKeys(text: str) -> Iterator[str]:
    """Characters read from the tty -> keys (arrows as ``up``/``down``)."""
    i = 0
    while i < len(text):
        for seq, name in _SEQUENCES.items():
            if text.startswith(seq, i):
                yield name
                i += len(seq)
                break
        else:
            c = text[i]
            i += 1
            if c == "\x1b":
                # Another sequence (a function key) is skipped whole; a lone Esc is Esc.
                if i < len(text) and text[i] in "[O":
                    i += 1
                    while i < len(text) and not ("@" <= text[i] <= "~"):
                        i += 1
                    i += 1
                    continue
                yield "esc"
            elif c in "\r\n":
                yield "enter"
            elif c in "\x7f\x08":
                yield "backspace"
            else:
                yield c


class Terminal:
    """The tty in cbreak mode on the alternate screen, put back on exit (a context manager)."""

    def __init__(self, stdin: TextIO, stdout: TextIO) -> None:
        self.fd = stdin.fileno()
        self.out = stdout
        self._saved: list[Any] | None = None

    def __enter__(self) -> Terminal:
        import termios
        import tty

        self._saved = termios.tcgetattr(self.fd)
        # cbreak, not raw: ISIG stays, so Ctrl-C is SIGINT and ends the program
        # through the same ``finally`` as ``q``.
        tty.setcbreak(self.fd)
        self.out.write("\x1b[?1049h\x1b[?25l")
        self.out.flush()
        return self

    def __exit__(self, *exc: object) -> None:
        import termios

        self.out.write("\x1b[?25h\x1b[?1049l")
        self.out.flush()
        if self._saved is not None:
            termios.tcsetattr(self.fd, termios.TCSADRAIN, self._saved)

    def size(self) -> tuple[int, int]:
        try:
            cols, rows = os.get_terminal_size(self.out.fileno())
        except OSError:
            cols, rows = 80, 24
        return cols, rows

    def draw(self, lines: list[str]) -> None:
        self.out.write("\x1b[H" + "".join(f"{line}\x1b[K\r\n" for line in lines[:-1]))
        if lines:
            self.out.write(lines[-1] + "\x1b[K")
        self.out.write("\x1b[J")
        self.out.flush()

    def read(self) -> str:
        return os.read(self.fd, 1024).decode("utf-8", "replace")


# --------------------------------------------------------------------------- the loop


class Watcher:
    """The follow stream, the keys and the clock, turned into frames: ``run`` until ``q``."""

    def __init__(
        self,
        path: str,
        terminal: Terminal,
        state: WatchState,
        clock: Callable[[], float] = time.time,
        send: Callable[[str, dict[str, Any]], dict[str, Any]] = ask,
    ) -> None:
        self.path = path
        self.terminal = terminal
        self.state = state
        self._clock = clock
        self._send = send
        self._stream: socket.socket | None = None
        self._lines = Lines()
        #: Whether the next message is the stream's first (the ``list`` body).
        self._first = True

    def _connect(self) -> None:
        try:
            s = connect(self.path)
            s.sendall(encode({"op": "follow"}))
        except (NotRunning, OSError):
            self.state.connected = False
            return
        self._stream, self._lines = s, Lines()
        self._first = True

    def _drop(self) -> None:
        if self._stream is not None:
            self._stream.close()
        self._stream = None
        self.state.connected = False
        # A stopping service refuses what it held: nothing waits any more.
        self.state.held = []
        self.state.prompt = None

    def _read(self) -> None:
        assert self._stream is not None
        try:
            data = self._stream.recv(65536)
            messages = self._lines.feed(data) if data else None
        except (OSError, ValueError):
            messages = None
        if messages is None:
            self._drop()
            return
        for m in messages:
            if self._first:
                self._first = False
                if not m.get("ok", False):
                    self.state.status = f"the service refused to show what is held: {m.get('error', '?')}"
                    self._drop()
                    return
                self.state.load(m)
            else:
                self.state.apply(m, self._clock())

    def answer(self, send: Send) -> None:
        try:
            reply = self._send(self.path, {"op": "answer", "target": send.target, "answer": send.answer.toWire()})
        except (NotRunning, OSError, ValueError) as e:
            self.state.status = f"not answered: {e}"
            return
        if reply.get("ok"):
            self.state.status = f"answered: {send.said}"
            self.state.answered([str(i) for i in reply.get("answered") or ()])
        else:
            self.state.status = f"not answered: {reply.get('error', 'the service gave no reason')}"

    def run(self) -> None:
        lastTry = 0.0
        while True:
            now = self._clock()
            if self._stream is None and now - lastTry >= 1:
                lastTry = now
                self._connect()
            cols, rows = self.terminal.size()
            self.terminal.draw(self.state.lines(cols, rows, now))
            watched = [self.terminal.fd] + ([self._stream.fileno()] if self._stream is not None else [])
            # Wake on the next whole second: the waiting times tick.
            ready, _, _ = select.select(watched, [], [], 1 - (now % 1))
            if self._stream is not None and self._stream.fileno() in ready:
                self._read()
            if self.terminal.fd in ready:
                for key in splitKeys(self.terminal.read()):
                    action = self.state.key(key)
                    if action is QUIT:
                        return
                    if isinstance(action, Send):
                        self.answer(action)

    def close(self) -> None:
        self._drop()


def main(argv: list[str]) -> int:
    from agentsandbox.cli import parser

    p = parser(
        "watch",
        "A live view of the requests held for a person's answer (proxy.unlisted = ask), "
        "with one-key answers: o allow once, f allow for a while, a allow always, d deny once, "
        "D deny always, q quit.  Exit status 1 when the service is not running.",
        config=False,
    )
    p.add_argument("--socket", help="the control socket (default: $XDG_RUNTIME_DIR/agentsandbox/control.sock)")
    args = p.parse_args(argv)
    path = args.socket or socketPath()
    try:
        connect(path).close()
    except NotRunning as e:
        print(f"agentsandbox watch: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"agentsandbox watch: cannot reach the service at {path}: {e.strerror or e}", file=sys.stderr)
        return 1
    if not sys.stdin.isatty() or not sys.stdout.isatty():
        print("agentsandbox watch: needs a terminal; `agentsandbox approvals` lists what is held", file=sys.stderr)
        return 1

    def terminated(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminated)
    signal.signal(signal.SIGHUP, terminated)
    watcher = Watcher(path, Terminal(sys.stdin, sys.stdout), WatchState(by=f"watch pid {os.getpid()}"))
    try:
        with watcher.terminal:
            watcher.run()
    except KeyboardInterrupt:
        pass
    finally:
        watcher.close()
    return 0


if __name__ == "__main__":  # pragma: no cover
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main(sys.argv[1:]))
