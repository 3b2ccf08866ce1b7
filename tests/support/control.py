"""A stand-in for the service's side of issue 28: the registry's contract and its control socket.

``FakeRegistry`` keeps what the contract (/work/notes/approvals-contract.md,
docs/approvals.md) promises of ``egress/approvals.ApprovalRegistry``:
``subscribe``/``unsubscribe`` with wire-shaped event dicts, ``answer(target,
Answer)`` returning the ids answered or raising ValueError with words, and
``snapshot()``.  The test holds requests itself (``hold``), so what ``watch``
and the desktop notifier do with them can be shown without a proxy.

``FakeControlServer`` serves it on a Unix socket, one thread per connection,
speaking the control wire (``list``, ``answer``, ``follow``).  It imports no
Twisted: ``watch`` runs in a terminal (tmux) while the test drives this from
its own thread.  It checks no peer credentials; the real server's checks are
the registry branch's tests.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from agentsandbox.approvals import (
    Answer,
    HeldRequest,
    decidedEvent,
    decode,
    encode,
    heldEvent,
    observedEvent,
    timedoutEvent,
    withdrawnEvent,
)

Observer = Callable[[dict[str, Any]], None]


class FakeRegistry:
    """Held requests and answers in memory, thread-safe; observers called in the caller's thread."""

    def __init__(self, mode: str = "ask", clock: Callable[[], float] = time.time) -> None:
        self.mode = mode
        self._clock = clock
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self.held: dict[str, HeldRequest] = {}
        self.recent: list[dict[str, Any]] = []
        #: Every answer taken, in order: (target, answer).
        self.answers: list[tuple[str, Answer]] = []
        self._observers: list[Observer] = []

    # ------------------------------------------------------------- contract
    def subscribe(self, observer: Observer) -> None:
        with self._lock:
            self._observers.append(observer)

    def unsubscribe(self, observer: Observer) -> None:
        with self._lock, contextlib.suppress(ValueError):
            self._observers.remove(observer)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "ok": True,
                "mode": self.mode,
                "held": [h.toWire() for h in self.held.values()],
                "recent": list(self.recent),
            }

    def answer(self, target: str, answer: Answer) -> list[str]:
        with self._lock:
            if target in self.held:
                chosen = [self.held[target]]
            else:
                chosen = [h for h in self.held.values() if h.host == target]
            if not chosen:
                raise ValueError(f"nothing is held for {target!r}")
            self.answers.append((target, answer))
            for h in chosen:
                del self.held[h.id]
                outcome = "allowed" if answer.verdict == "allow" else "denied"
                self.recent.append(
                    {"request": h.toWire(), "answer": answer.toWire(), "outcome": outcome, "at": self._clock()}
                )
                self._publish(decidedEvent(h, answer))
            return [h.id for h in chosen]

    # ------------------------------------------------------------- the test's side
    def hold(
        self, host: str, port: int = 443, kind: str = "connect", process: str | None = "4242 curl"
    ) -> HeldRequest:
        with self._lock:
            h = HeldRequest(f"h{next(self._ids)}", host, port, kind, "127.0.0.1:40000", process, self._clock())
            self.held[h.id] = h
            self._publish(heldEvent(h))
            return h

    def timeOut(self, id: str) -> None:
        with self._lock:
            h = self.held.pop(id)
            self.recent.append({"request": h.toWire(), "answer": None, "outcome": "timedout", "at": self._clock()})
            self._publish(timedoutEvent(h))

    def withdraw(self, id: str) -> None:
        """The client went away before anyone answered."""
        with self._lock:
            h = self.held.pop(id)
            self._publish(withdrawnEvent(h))

    def observe(self, host: str, port: int = 443, kind: str = "connect") -> None:
        with self._lock:
            self._publish(observedEvent(host, port, kind))

    def _publish(self, event: dict[str, Any]) -> None:
        for observer in list(self._observers):
            observer(event)


class FakeControlServer:
    """The control socket over a ``FakeRegistry``: start(), stop(); ``path`` is the socket."""

    def __init__(self, registry: FakeRegistry, path: str) -> None:
        self.registry = registry
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._threads: list[threading.Thread] = []
        self._conns: list[socket.socket] = []
        self._stopping = threading.Event()
        #: How many ``follow`` connections are open now.
        self.following = 0

    def start(self) -> FakeControlServer:
        os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
        self._sock.bind(self.path)
        os.chmod(self.path, 0o600)
        self._sock.listen(16)
        t = threading.Thread(target=self._accept, name="fake-control", daemon=True)
        t.start()
        self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        for c in list(self._conns):
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        for t in self._threads:
            t.join(5)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self._conns.append(conn)
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            t.start()
            self._threads.append(t)

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            f = conn.makefile("rb")
            try:
                line = f.readline()
                if not line:
                    return
                request = decode(line)
                op = request.get("op")
                if op == "list":
                    conn.sendall(encode(self.registry.snapshot()))
                elif op == "answer":
                    conn.sendall(encode(self._answer(request)))
                elif op == "follow":
                    self._follow(conn, f)
                else:
                    conn.sendall(encode({"ok": False, "error": f"unknown op {op!r}"}))
            except (OSError, ValueError):
                return

    def _answer(self, request: dict[str, Any]) -> dict[str, Any]:
        try:
            answer = Answer.fromWire(request.get("answer") or {})
            return {"ok": True, "answered": self.registry.answer(str(request.get("target")), answer)}
        except ValueError as e:
            return {"ok": False, "error": str(e)}

    def _follow(self, conn: socket.socket, f: Any) -> None:
        events: queue.Queue[dict[str, Any] | None] = queue.Queue()

        def ended() -> None:
            f.read()  # until the client closes
            events.put(None)

        # The snapshot and the subscription under one lock: no event falls between.
        with self.registry._lock:
            conn.sendall(encode(self.registry.snapshot()))
            self.registry.subscribe(events.put)
        self.following += 1
        threading.Thread(target=ended, daemon=True).start()
        try:
            while not self._stopping.is_set():
                event = events.get()
                if event is None:
                    return
                conn.sendall(encode(event))
        finally:
            self.following -= 1
            self.registry.unsubscribe(events.put)
