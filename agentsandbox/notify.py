"""Desktop notifications with actions for held requests (issue 28).

A service inside the agentsandbox service: it subscribes to the registry of held
requests (``egress/approvals.py``) and, for each ``held`` event, shows a
freedesktop notification (org.freedesktop.Notifications on the user's session
bus) with three actions: allow once, allow always, deny (once).  The person's
click answers the registry with ``by="desktop notification"``; a request
decided elsewhere (``watch``, ``approve``) or timed out closes its notification.

How it talks to the bus: one ``notify-send --print-id --action ...`` (libnotify-bin
0.7.9 or later; Debian 12 ships 0.8.1) per held request, spawned with
``reactor.spawnProcess``.  It prints the notification's id, then the key of the
action clicked, and exits when the notification closes; SIGINT makes it close the
notification.  The alternative, ``gdbus call ...Notify`` plus one ``gdbus monitor``
for ActionInvoked/NotificationClosed, is not sound: the specification does not
say those signals are broadcast, and servers (KDE Plasma) send them to the
connection that called Notify only, which a monitor on another connection never
sees (measured: tests/support/notifications.py sends them that way, and
``gdbus monitor`` shows nothing).  notify-send hears them on its own connection.
No Python D-Bus binding is needed, so no new dependency.

Where there is no session bus (no ``DBUS_SESSION_BUS_ADDRESS``, no
``$XDG_RUNTIME_DIR/bus``) or no notify-send, there are no notifications, quietly:
one line in the service log.  Where the bus has no notification server,
notify-send fails at once; that is said once in the log, not per request.
``agentsandbox doctor`` says which of these holds (``channels``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from twisted.application.service import Service
from twisted.internet.error import ProcessDone, ProcessExitedAlready
from twisted.internet.protocol import ProcessProtocol
from twisted.logger import Logger
from twisted.python.failure import Failure

from agentsandbox.approvals import Answer, HeldRequest
from agentsandbox.desktop import notifySend, sessionBus, unavailable

#: action key -> (verdict, scope, the button's words)
ACTIONS: dict[str, tuple[str, str, str]] = {
    "allow-once": ("allow", "once", "Allow once"),
    "allow-always": ("allow", "always", "Allow always"),
    "deny": ("deny", "once", "Deny"),
}

BY = "desktop notification"

#: The variables notify-send needs (the bus, the user's locale); nothing else of the service's.
_CHILD_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "LC_MESSAGES", "XDG_RUNTIME_DIR", "DBUS_SESSION_BUS_ADDRESS")


class Registry(Protocol):
    """What the notifier needs of ``egress.approvals.ApprovalRegistry`` (the contract)."""

    def subscribe(self, observer: Callable[[dict[str, Any]], None]) -> None: ...

    def unsubscribe(self, observer: Callable[[dict[str, Any]], None]) -> None: ...

    def answer(self, target: str, answer: Answer) -> list[str]: ...


def _escape(text: str) -> str:
    # Servers may read the body as markup (the "body-markup" capability).
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def words(request: HeldRequest) -> tuple[str, str]:
    """The notification's summary and body."""
    target = f"{request.host}:{request.port}"
    who = request.process or "a sandboxed process"
    summary = f"agentsandbox: allow {target}?"
    body = (
        f"{who} asks for {target} ({request.kind}), which is not on sandbox.domains. "
        "Allow always writes it into your config."
    )
    return summary, _escape(body)


class DesktopNotifier(Service):
    """Shows a notification per held request and answers the registry on a click."""

    log = Logger(namespace="agentsandbox.notify")

    def __init__(self, registry: Registry, reactor: Any, environ: Mapping[str, str]) -> None:
        self.registry = registry
        self.reactor = reactor
        self.environ = dict(environ)
        self.shown: dict[str, Shown] = {}
        self.subscribed = False
        #: Whether the last notify-send failed (said once until one works again).
        self._failing = False

    def startService(self) -> None:
        super().startService()
        why = unavailable(self.environ)
        if why is not None:
            self.log.info("desktop notifications: none: {why}", why=why)
            return
        self.registry.subscribe(self.event)
        self.subscribed = True

    def stopService(self) -> None:
        super().stopService()
        if self.subscribed:
            self.registry.unsubscribe(self.event)
            self.subscribed = False
        for shown in list(self.shown.values()):
            shown.close()

    def event(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "held":
            self.show(HeldRequest.fromWire(event["request"]))
        elif kind in ("decided", "timedout", "withdrawn"):
            shown = self.shown.pop(str(event["request"]["id"]), None)
            if shown is not None:
                shown.close()

    def childEnv(self) -> dict[str, str]:
        env = {k: self.environ[k] for k in _CHILD_ENV if k in self.environ}
        bus = sessionBus(self.environ)
        if bus is not None:
            env["DBUS_SESSION_BUS_ADDRESS"] = bus
        return env

    def show(self, request: HeldRequest) -> None:
        program = notifySend(self.environ)
        if program is None or sessionBus(self.environ) is None:
            return
        summary, body = words(request)
        argv = [
            program, "--print-id", "--app-name=agentsandbox", "--urgency=critical",
            # Never expires by itself: it closes when the request is decided or times out.
            "--expire-time=0", "--category=network",
            *(f"--action={key}={label}" for key, (_, _, label) in ACTIONS.items()),
            "--", summary, body,
        ]  # fmt: skip
        shown = Shown(self, request)
        self.shown[request.id] = shown
        # notify-send prints the id before it handles SIGINT, and SIGINT is how
        # it is told to close: started with SIGINT ignored (kept across exec), one
        # sent too early is lost, not fatal, and ``Shown`` sends it again.
        sh = "/bin/sh"
        self.reactor.spawnProcess(shown, sh, [sh, "-c", 'trap "" INT; exec "$@"', "notify-send", *argv],
                                  env=self.childEnv())  # fmt: skip

    def clicked(self, request: HeldRequest, key: str) -> None:
        verdict, scope, _ = ACTIONS[key]
        try:
            ids = self.registry.answer(request.id, Answer(verdict, scope, by=BY))  # type: ignore[arg-type]
        except ValueError as e:
            # Answered or timed out between the click and now: the person sees the outcome in watch/log.
            self.log.info("desktop notification: {key} for {id} not taken: {why}", key=key, id=request.id, why=e)
            return
        self.log.info("desktop notification: {key} answered {ids}", key=key, ids=ids)

    def ended(self, shown: Shown, failure: Failure, stderr: str) -> None:
        if self.shown.get(shown.request.id) is shown:
            del self.shown[shown.request.id]
        if shown.id is None and not shown.closing and not failure.check(ProcessDone):
            if not self._failing:
                self.log.info(
                    "desktop notifications: notify-send failed ({why}); said once until one is shown",
                    why=stderr.strip().splitlines()[-1] if stderr.strip() else failure.getErrorMessage(),
                )
            self._failing = True
        elif shown.id is not None:
            self._failing = False


class Shown(ProcessProtocol):
    """One notify-send: its id line, then the key of the action clicked.

    Its stdout is a pipe, so fully buffered: both lines come when it exits,
    which it does when the notification closes (a click closes it).  Nothing
    here waits for the id.
    """

    #: How often, and how many times, SIGINT is sent before SIGKILL.
    EVERY = 0.1
    RETRIES = 50

    def __init__(self, notifier: DesktopNotifier, request: HeldRequest) -> None:
        self.notifier = notifier
        self.request = request
        self.id: int | None = None
        self.closing = False
        self.running = True
        self._out = b""
        self._err = b""
        self._answered = False
        self._tries = 0
        self._retry: Any = None

    def outReceived(self, data: bytes) -> None:
        self._out += data
        *lines, self._out = self._out.split(b"\n")
        for raw in lines:
            line = raw.decode("utf-8", "replace").strip()
            # Without a server notify-send still prints 0 (and then fails): no id.
            if self.id is None and line.isdigit() and int(line) > 0:
                self.id = int(line)
            elif line in ACTIONS and not self._answered and not self.closing:
                self._answered = True
                self.notifier.clicked(self.request, line)

    def errReceived(self, data: bytes) -> None:
        self._err = (self._err + data)[-2048:]

    def close(self) -> None:
        """Take the notification off the screen (decided elsewhere, timed out, stopping)."""
        if not self.closing:
            self.closing = True
            self._interrupt()

    def _interrupt(self) -> None:
        self._retry = None
        if not self.running or self.transport is None:
            return
        self._tries += 1
        # notify-send closes its notification on SIGINT ("Wait cancelled"); until
        # its handler is in place SIGINT is ignored, so it is sent again until it
        # exits, and after RETRIES, it is killed (its notification may stay).
        with contextlib.suppress(ProcessExitedAlready):
            self.transport.signalProcess("INT" if self._tries <= self.RETRIES else "KILL")
        self._retry = self.notifier.reactor.callLater(self.EVERY, self._interrupt)

    def processEnded(self, reason: Failure) -> None:  # type: ignore[override,unused-ignore]
        self.running = False
        if self._retry is not None and self._retry.active():
            self._retry.cancel()
        self._retry = None
        self.notifier.ended(self, reason, self._err.decode("utf-8", "replace"))
