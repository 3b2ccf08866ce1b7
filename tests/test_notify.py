"""Desktop notifications for held requests, on a real session bus with a real notification server.

Each test starts its own ``dbus-daemon --session`` and
``tests/support/notifications.py`` (Debian's python3-gi) owning
org.freedesktop.Notifications on it; the notifier spawns the real notify-send.
The server reports each notification it is asked to show and takes the click
(``invoke ID KEY``) on its stdin, sending the signals only to the notification's
sender, as the strictest servers do.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
from twisted.internet import reactor, task
from twisted.internet.protocol import ProcessProtocol
from twisted.trial import unittest

from agentsandbox import doctor, probes
from agentsandbox.approvals import Answer
from agentsandbox.desktop import sessionBus, unavailable
from agentsandbox.notify import ACTIONS, BY, DesktopNotifier
from tests.conftest import User
from tests.support.control import FakeRegistry

#: Every test here needs a real session bus and the notification server (python3-gi).
pytestmark = pytest.mark.desktop

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Debian's interpreter: python3-gi is a Debian package, not on PyPI's stack.
SYSTEM_PYTHON = "/usr/bin/python3"


class ServerProcess(ProcessProtocol):
    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self._buf = b""
        self.err = b""

    def outReceived(self, data: bytes) -> None:
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        self.messages += [json.loads(line) for line in lines if line.strip()]

    def errReceived(self, data: bytes) -> None:
        self.err += data

    def of(self, kind: str) -> list[Any]:
        return [m[kind] for m in self.messages if kind in m]

    def send(self, line: str) -> None:
        assert self.transport is not None
        self.transport.write(line.encode() + b"\n")


async def until(predicate: Any, what: Any, bound: float = 15.0) -> None:
    """Poll ``predicate``; fail after ``bound`` seconds naming ``what`` (a callable: words made then)."""
    waited = 0.0
    while not predicate():
        if waited > bound:
            raise AssertionError(f"{what() if callable(what) else what} did not happen in {bound}s")
        await task.deferLater(reactor, 0.02, lambda: None)  # type: ignore[arg-type,unused-ignore]
        waited += 0.02


class NotifierOnARealBus(unittest.TestCase):
    def setUp(self) -> Any:  # type: ignore[override,unused-ignore]
        for program in ("dbus-daemon", "notify-send"):
            if shutil.which(program) is None:
                self.fail(f"{program} is not installed (.ci/install-deps installs it)")
        self.dir = tempfile.mkdtemp(prefix="notify-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.bus = subprocess.Popen(
            ["dbus-daemon", "--session", "--nofork", "--nopidfile", f"--address=unix:path={self.dir}/bus",
             "--print-address=1"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        self.addCleanup(self._stopBus)
        assert self.bus.stdout is not None
        self.address = self.bus.stdout.readline().strip()
        assert self.address.startswith("unix:"), self.address
        self.environ = {"PATH": os.environ["PATH"], "DBUS_SESSION_BUS_ADDRESS": self.address}
        self.registry = FakeRegistry()
        return None

    def _stopBus(self) -> None:
        self.bus.terminate()
        self.bus.wait(10)

    async def startServer(self) -> ServerProcess:
        server = ServerProcess()
        env = {**self.environ, "PYTHONPATH": REPO}
        reactor.spawnProcess(server, SYSTEM_PYTHON, [SYSTEM_PYTHON, "-m", "tests.support.notifications"], env=env)  # type: ignore[attr-defined,unused-ignore]

        def stop() -> None:
            if server.transport is not None and server.transport.pid is not None:  # type: ignore[attr-defined,unused-ignore]
                server.transport.signalProcess("KILL")

        self.addCleanup(stop)
        await until(lambda: server.of("ready"), f"the notification server owning the name ({server.err!r})")
        return server

    def startNotifier(self) -> DesktopNotifier:
        notifier = DesktopNotifier(self.registry, reactor, self.environ)
        notifier.startService()
        self.addCleanup(notifier.stopService)
        return notifier

    async def test_a_held_request_is_shown_with_its_actions_and_a_click_answers_it(self) -> None:
        server = await self.startServer()
        self.startNotifier()
        request = self.registry.hold("example.org", 443, process="4242 curl")
        await until(lambda: server.of("notify"), "the notification")
        shown = server.of("notify")[0]
        self.assertEqual(shown["summary"], "agentsandbox: allow example.org:443?")
        self.assertIn("4242 curl asks for example.org:443 (connect)", shown["body"])
        self.assertEqual(shown["actions"], [x for key, (_, _, label) in ACTIONS.items() for x in (key, label)])
        self.assertEqual(shown["expire"], 0)
        server.send(f"invoke {shown['id']} allow-once")
        await until(lambda: self.registry.answers, "the click reaching the registry")
        self.assertEqual(self.registry.answers, [(request.id, Answer("allow", "once", None, BY))])

    async def test_allow_always_and_deny_answer_as_their_buttons_say(self) -> None:
        server = await self.startServer()
        self.startNotifier()
        first = self.registry.hold("example.org")
        second = self.registry.hold("git.example.com")
        await until(lambda: len(server.of("notify")) == 2, "both notifications")
        ids = {n["summary"]: n["id"] for n in server.of("notify")}
        server.send(f"invoke {ids['agentsandbox: allow git.example.com:443?']} deny")
        server.send(f"invoke {ids['agentsandbox: allow example.org:443?']} allow-always")
        await until(
            lambda: len(self.registry.answers) == 2,
            lambda: f"both clicks (server: {server.messages}; answers: {self.registry.answers})",
        )
        self.assertEqual(
            sorted(self.registry.answers),
            sorted([(first.id, Answer("allow", "always", None, BY)), (second.id, Answer("deny", "once", None, BY))]),
        )

    async def test_decided_elsewhere_timed_out_or_withdrawn_the_notification_closes(self) -> None:
        server = await self.startServer()
        notifier = self.startNotifier()
        decided = self.registry.hold("example.org")
        timedOut = self.registry.hold("git.example.com")
        withdrawn = self.registry.hold("c.example.com")
        await until(lambda: len(server.of("notify")) == 3, "the notifications")
        self.registry.answer(decided.id, Answer("allow", "once", by="cli pid 1"))
        self.registry.timeOut(timedOut.id)
        self.registry.withdraw(withdrawn.id)
        await until(lambda: len(server.of("closed")) == 3, "every notification closing")
        # Closed by a call (reason 3), not by a person; nothing answered from the desktop.
        self.assertEqual({m["reason"] for m in server.messages if "closed" in m}, {3})
        self.assertEqual([a.by for _, a in self.registry.answers], ["cli pid 1"])
        await until(lambda: not notifier.shown, "every notify-send ending")

    async def test_a_person_dismissing_it_answers_nothing(self) -> None:
        server = await self.startServer()
        notifier = self.startNotifier()
        self.registry.hold("example.org")
        await until(lambda: server.of("notify"), "the notification")
        server.send(f"dismiss {server.of('notify')[0]['id']}")
        await until(lambda: not notifier.shown, "notify-send ending")
        self.assertEqual(self.registry.answers, [])
        self.assertEqual(len(self.registry.held), 1)

    async def test_a_bus_without_a_notification_server_shows_nothing_and_answers_nothing(self) -> None:
        notifier = self.startNotifier()
        self.registry.hold("example.org")
        await until(lambda: not notifier.shown, "notify-send failing")
        self.assertTrue(notifier._failing)
        self.assertEqual(self.registry.answers, [])

    def test_without_a_session_bus_there_are_no_notifications_and_no_subscription(self) -> None:
        environ = {"PATH": os.environ["PATH"], "XDG_RUNTIME_DIR": self.dir + "/nobus"}
        self.assertIsNone(sessionBus(environ))
        self.assertIn("no session bus", unavailable(environ) or "")
        notifier = DesktopNotifier(self.registry, reactor, environ)
        notifier.startService()
        self.addCleanup(notifier.stopService)
        self.assertFalse(notifier.subscribed)
        self.registry.hold("example.org")
        self.assertEqual(notifier.shown, {})

    def test_a_bus_without_notify_send_names_both_ways_to_install_it(self) -> None:
        environ = {"PATH": self.dir + "/empty", "XDG_RUNTIME_DIR": self.dir}
        self.assertIsNotNone(sessionBus(environ))
        why = unavailable(environ) or ""
        self.assertIn("notify-send is not on the service's PATH", why)
        self.assertIn("apt install libnotify-bin", why)
        self.assertIn("pkgs.libnotify to services.agentsandbox.path", why)

    def test_the_runtime_dirs_bus_is_found_without_the_variable(self) -> None:
        self.assertEqual(sessionBus({"XDG_RUNTIME_DIR": self.dir}), f"unix:path={self.dir}/bus")


def test_doctor_says_desktop_notifications_yes_on_a_bus_with_a_server_no_without(user: User, tmp_path: Path) -> None:
    """``doctor``'s channel check (agentsandbox/desktop.py), asking a real bus with gdbus."""
    from agentsandbox.loader import load
    from tests.support.sessionbus import SessionBus

    config = load(None, user.env)
    noBus = doctor.checkChannels(
        config, {"PATH": os.environ["PATH"], "XDG_RUNTIME_DIR": str(tmp_path)}, probes.systemRunner(), shutil.which
    )
    assert noBus[1].detail.startswith("no: no session bus")
    (tmp_path / "empty-bus").mkdir()
    empty = SessionBus(str(tmp_path / "empty-bus"))
    try:
        checks = doctor.checkChannels(config, empty.environ, probes.systemRunner(empty.environ), shutil.which)
        assert checks[1].detail.startswith("no: no notification server on the session bus")
    finally:
        empty.close()
    (tmp_path / "bus").mkdir()
    served = SessionBus(str(tmp_path / "bus"), server=True)
    try:
        checks = doctor.checkChannels(config, served.environ, probes.systemRunner(served.environ), shutil.which)
        assert (checks[1].status, checks[1].detail) == (
            "ok", "yes: a notification server owns org.freedesktop.Notifications on the session bus"
        )
    finally:
        served.close()
