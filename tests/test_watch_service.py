"""``watch`` and the desktop notification against the real thing: a real curl held by the proxy.

A real proxy (``ProxyHarness``, documentation addresses bent to a loopback web
server, the address rules real) under ``proxy.unlisted = "ask"``, the service's
registry and its control socket (peer checks on), and real curl as the agent's
command.  The person answers:

- in ``agentsandbox watch``, run in a real terminal (tmux), with one key;
- on a desktop notification, shown by the real notify-send on a real
  ``dbus-daemon --session`` to a notification server (tests/support/notifications.py),
  and clicked there.

tmux and the notification server are polled from threads so the reactor,
which serves the proxy and the control socket, keeps turning.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from typing import Any

import pytest
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.internet.threads import deferToThread
from twisted.internet.utils import getProcessOutputAndValue
from twisted.trial.unittest import TestCase
from twisted.web.resource import Resource
from twisted.web.server import Site
from twisted.web.static import Data

from agentsandbox.approvals import controlSocket
from agentsandbox.controlpeer import namespacesOf
from agentsandbox.egress.approvals import ApprovalRegistry, configWriter
from agentsandbox.egress.control import ControlFactory, ControlService
from agentsandbox.egress.testing import FixedResolver, MappedDialer
from agentsandbox.loader import load
from agentsandbox.notify import BY, DesktopNotifier
from agentsandbox.reload import ConfigHolder
from tests.support.egress_fixtures import CURL, ProxyHarness, deferredTest, listen, reactor, waitFor
from tests.support.sessionbus import SessionBus
from tests.support.tmux import Tmux

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONFIG = """\
inject = []

[sandbox]
domains = ["github.com"]

[proxy]
listen = "127.0.0.1:0"
unlisted = "ask"
ask_timeout = 45
"""

TABLE = {"app.example.org": ["192.0.2.20"], "git.example.org": ["192.0.2.21"]}


def _hello() -> Resource:
    root = Resource()
    root.putChild(b"", Data(b"hello\n", "text/plain"))
    return root


class World(TestCase):
    """The proxy, registry and control socket; the tests are the two classes below."""

    async def _world(self) -> None:
        self.base = tempfile.mkdtemp(prefix="watch-e2e-")
        self.addCleanup(shutil.rmtree, self.base, True)
        home = os.path.join(self.base, "home")
        self.runtime = os.path.join(self.base, "run")
        os.makedirs(os.path.join(home, ".config", "agentsandbox"))
        os.makedirs(self.runtime, mode=0o700)
        self.env = {
            "HOME": home, "XDG_RUNTIME_DIR": self.runtime, "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "PYTHONPATH": REPO, "XDG_CONFIG_HOME": os.path.join(home, ".config"),
        }  # fmt: skip
        with open(os.path.join(home, ".config", "agentsandbox", "config.toml"), "w") as f:
            f.write(CONFIG)
        from agentsandbox import paths

        assert not os.path.exists(paths.SYSTEM_CONFIG), "these tests assume no machine config"
        self.holder = ConfigHolder(load(None, self.env))
        site = await listen(Site(_hello()))
        self.addCleanup(site.stopListening)
        dialer = MappedDialer(reactor)
        for address in ("192.0.2.20", "192.0.2.21"):
            dialer.map(address, site.getHost().port)
        self.harness = ProxyHarness(resolver=FixedResolver(TABLE), dialer=dialer, config=self.holder)
        self.registry = ApprovalRegistry(
            lambda: self.holder.current, Clock(), self.harness.factory.record, configWriter(lambda: self.holder.current)
        )
        self.harness.factory.approvals = self.registry
        await self.harness.start()
        self.addCleanup(self.harness.stop)
        self.socket = controlSocket(self.runtime)
        control = ControlService(
            ControlFactory(self.registry, self.harness.factory.record, reference=namespacesOf(os.getpid())),
            self.socket, reactor,
        )  # fmt: skip
        control.startService()
        self.addCleanup(control.stopService)
        await waitFor(lambda: os.path.exists(self.socket), "the control socket")
        #: When each request was held (monotonic), by host.
        self.heldAt: dict[str, float] = {}

        def held(event: dict[str, Any]) -> None:
            if event["event"] == "held":
                self.heldAt.setdefault(event["request"]["host"], time.monotonic())

        self.registry.subscribe(held)

    def curl(self, host: str, tunnel: bool = True) -> Deferred[tuple[bytes, bytes, int]]:
        """curl through the proxy: CONNECT (``tunnel``), or a forwarded GET whose 403 body is printed."""
        d: Deferred[tuple[bytes, bytes, int]] = getProcessOutputAndValue(
            CURL,
            ("--silent", "--show-error", "--noproxy", "", "--max-time", "60", *(("-p",) if tunnel else ()), "-x",
             f"http://127.0.0.1:{self.harness.port}", f"http://{host}/"),
            env=self.env,
        )  # fmt: skip
        return d

    def decided(self) -> list[dict[str, Any]]:
        return [r for r in self.harness.records() if r["event"] == "decided"]

    async def screenShows(self, term: Tmux, *words: str) -> str:
        screen: str = await deferToThread(term.waitFor, lambda s: all(w in s for w in words))
        return screen



class AnswersInWatch(World):
    @deferredTest
    async def test_watch_in_a_terminal_shows_a_held_curl_at_once_and_a_key_lets_it_through(self) -> None:
        await self._world()
        term = Tmux(self.base)
        self.addCleanup(term.close)
        # The person's terminal: nothing of the test's environment but what watch needs.
        term.start(
            ["sh", "-c", f"{sys.executable} -m agentsandbox watch; sleep 600"],
            env={**self.env, "TERM": "xterm-256color"},
        )
        await self.screenShows(term, "asking for unlisted hosts", "WAITING: nothing")

        waiting = self.curl("app.example.org")
        await waitFor(lambda: len(self.registry.held) == 1, "the held request")
        await self.screenShows(term, "app.example.org:80", "connect")
        shownAfter = time.monotonic() - self.heldAt["app.example.org"]
        self.assertLess(shownAfter, 1.0, f"the held request took {shownAfter:.2f}s to show")

        term.keys("o")
        body, err, code = await waiting
        self.assertEqual((body, code), (b"hello\n", 0), err)
        await self.screenShows(term, "WAITING: nothing", "app.example.org:80 allowed once")
        (record,) = self.decided()
        self.assertEqual((record["verdict"], record["scope"]), ("allow", "once"))
        # The control socket names the answering process itself: watch, in the person's terminal.
        self.assertIn("watch", record["by"])

        # Once was that request only: the next is asked again; D refuses the host for good.
        again = self.curl("app.example.org", tunnel=False)
        await self.screenShows(term, "app.example.org:80", "WAITING (1)")
        term.keys("d")
        body, _, _ = await again
        self.assertIn(b"the person refused it (deny once", body)



@pytest.mark.desktop
class AnswersOnTheDesktop(World):
    @deferredTest
    async def test_a_desktop_notification_shows_a_held_curl_and_its_click_lets_it_through(self) -> None:
        await self._world()
        busDir = os.path.join(self.base, "bus")
        os.makedirs(busDir)
        bus = await deferToThread(SessionBus, busDir, True)
        self.addCleanup(bus.close)
        notifier = DesktopNotifier(self.registry, reactor, bus.environ)
        notifier.startService()
        self.addCleanup(notifier.stopService)

        waiting = self.curl("git.example.org")
        shown = await deferToThread(bus.until, lambda m: "notify" in m)
        self.assertEqual(shown["notify"]["summary"], "agentsandbox: allow git.example.org:80?")
        self.assertEqual(shown["notify"]["actions"][::2], ["allow-once", "allow-always", "deny"])
        bus.send(f"invoke {shown['notify']['id']} allow-once")
        body, err, code = await waiting
        self.assertEqual((body, code), (b"hello\n", 0), err)
        (record,) = self.decided()
        self.assertEqual((record["verdict"], record["scope"], record["by"]), ("allow", "once", BY))

        # Decided elsewhere (here, by the registry's own answer): the notification closes.
        again = self.curl("git.example.org", tunnel=False)
        second = await deferToThread(bus.until, lambda m: "notify" in m)
        self.registry.answer("git.example.org", self._denyOnce())
        body, _, _ = await again
        self.assertIn(b"the person refused it", body)
        closed = await deferToThread(bus.until, lambda m: m.get("closed") == second["notify"]["id"])
        self.assertEqual(closed["reason"], 3)

    @staticmethod
    def _denyOnce() -> Any:
        from agentsandbox.approvals import Answer

        return Answer("deny", "once", by="test")
