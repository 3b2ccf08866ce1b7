"""Live reload: inotify on the config file and SIGHUP; a broken file keeps the old config."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any, cast

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.task import Clock
from twisted.logger import ILogObserver, globalLogPublisher
from twisted.trial.unittest import TestCase

from agentsandbox.config import Config, ConfigError
from agentsandbox.egress.testing import FixedResolver
from agentsandbox.loader import load
from agentsandbox.reload import ConfigHolder, ConfigWatcher
from tests.support.egress_fixtures import (
    ProxyHarness,
    deferredTest,
    domainsToml,
    exchange,
    makeConfig,
    reactor,
)


class Events:
    def __init__(self, test: TestCase) -> None:
        self.events: list[dict[str, Any]] = []
        # Any callable observes; the stubs ask for the interface.
        observer = cast(ILogObserver, self.events.append)
        globalLogPublisher.addObserver(observer)
        test.addCleanup(globalLogPublisher.removeObserver, observer)

    def errors(self) -> list[dict[str, Any]]:
        return [e for e in self.events if str(e.get("log_namespace", "")).startswith("agentsandbox.reload") and e["log_level"].name == "error"]


class HolderTests(TestCase):
    def test_swapTellsListeners(self) -> None:
        a, b = makeConfig(domainsToml(["a.example.org"])), makeConfig(domainsToml(["b.example.org"]))
        holder = ConfigHolder(a)
        seen: list[tuple[Config, Config]] = []
        holder.subscribe(lambda old, new: seen.append((old, new)))
        holder.swap(b)
        self.assertIs(holder.current, b)
        self.assertEqual(seen, [(a, b)])

    def test_brokenConfigKeepsTheOldOneAndNamesFileAndKey(self) -> None:
        clock = Clock()
        good = makeConfig(domainsToml(["a.example.org"]))
        holder = ConfigHolder(good)

        def broken() -> Config:
            raise ConfigError("/etc/agentsandbox/config.toml", "sandbox.domains[0]", "'*' would allow every host")

        events = Events(self)
        watcher = ConfigWatcher(holder, None, reactor, loader=broken, handleSignal=False, clock=clock)
        self.assertFalse(watcher.reload("test"))
        self.assertIs(holder.current, good)
        (err,) = events.errors()
        self.assertEqual((err["file"], err["key"]), ("/etc/agentsandbox/config.toml", "sandbox.domains[0]"))
        self.assertIn("keeping the previous config", err["log_format"])
        self.assertIn("sandbox.domains[0]", err["error"])

    def test_eventsCoalesce(self) -> None:
        clock = Clock()
        holder = ConfigHolder(makeConfig(""))
        loads: list[int] = []

        def loader() -> Config:
            loads.append(1)
            return makeConfig("")

        watcher = ConfigWatcher(holder, None, reactor, loader=loader, settle=0.2, handleSignal=False, clock=clock)
        for _ in range(5):
            watcher.schedule()
            clock.advance(0.1)
        self.assertEqual(loads, [])
        clock.advance(0.2)
        self.assertEqual(loads, [1])


class WatchedClock(Clock):
    """A ``Clock`` that says when something schedules a call on it.

    The watcher schedules its reload when inotify reports the write, which
    arrives through the real reactor; ``nextCall`` fires then, so the test
    advances the clock past ``settle`` without polling or sleeping.
    """

    def __init__(self) -> None:
        super().__init__()
        self._waiters: list[Deferred[None]] = []

    def nextCall(self) -> Deferred[None]:
        d: Deferred[None] = Deferred()
        self._waiters.append(d)
        return d

    def callLater(self, delay: float, callable: Callable[..., Any], *args: object, **kw: object) -> IDelayedCall:
        call = super().callLater(delay, callable, *args, **kw)
        waiters, self._waiters = self._waiters, []
        for d in waiters:
            # From the next reactor turn: the scheduler has not kept its call yet.
            reactor.callLater(0, d.callback, None)
        return call


class LiveReloadTests(TestCase):
    SETTLE = 0.2

    def setUp(self) -> None:
        self.dir = self.mktemp()
        os.makedirs(self.dir)
        self.path = os.path.join(self.dir, "config.toml")
        self.env = {"HOME": self.dir}
        self.write(domainsToml(["a.example.org"]))
        self.holder = ConfigHolder(load(self.path, self.env))
        self.clock = WatchedClock()
        self.watcher = ConfigWatcher(
            self.holder, self.path, reactor, loader=lambda: load(self.path, self.env), settle=self.SETTLE, clock=self.clock
        )
        self.watcher.startService()
        self.addCleanup(self.watcher.stopService)

    def write(self, text: str, atomic: bool = False) -> None:
        target = self.path + ".tmp" if atomic else self.path
        with open(target, "w") as f:
            f.write(text)
        if atomic:
            os.replace(target, self.path)

    async def writeAndSettle(self, text: str, atomic: bool = False) -> None:
        """Write the file, wait for inotify to schedule the reload, then let ``settle`` pass."""
        scheduled = self.clock.nextCall()
        self.write(text, atomic)
        await scheduled
        self.clock.advance(self.SETTLE / 2)
        self.assertTrue(self.watcher._pending is not None and self.watcher._pending.active(), "reloaded before settle")
        self.clock.advance(self.SETTLE)  # past it: halves of a float need not add up to it

    def domains(self) -> tuple[str, ...]:
        return self.holder.current.sandbox.domains

    @deferredTest
    async def test_inotifyWriteAndRename(self) -> None:
        await self.writeAndSettle(domainsToml(["b.example.org"]))
        self.assertEqual(self.domains(), ("b.example.org",), "the in-place write to reload")
        await self.writeAndSettle(domainsToml(["c.example.org"]), atomic=True)
        self.assertEqual(self.domains(), ("c.example.org",), "the rename to reload")

    @deferredTest
    async def test_brokenFileKeepsTheOldConfig(self) -> None:
        events = Events(self)
        await self.writeAndSettle("[sandbox]\ndomains = [\"*\"]\n")
        self.assertGreaterEqual(self.watcher.failures, 1, "the broken file to be read")
        self.assertEqual(self.domains(), ("a.example.org",))
        err = events.errors()[-1]
        self.assertEqual((err["file"], err["key"]), (self.path, "sandbox.domains[0]"))
        await self.writeAndSettle("[sandbox\n")
        self.assertGreaterEqual(self.watcher.failures, 2, "the unparsable file to be read")
        self.assertEqual(self.domains(), ("a.example.org",))
        self.assertIn("not valid TOML", events.errors()[-1]["error"])
        await self.writeAndSettle(domainsToml(["d.example.org"]))
        self.assertEqual(self.domains(), ("d.example.org",), "the fixed file to reload")

    @deferredTest
    async def test_sighup(self) -> None:
        self.watcher.stopService()  # no inotify: only the signal can reload now
        self.watcher.paths = ()
        self.watcher.startService()
        with open(self.path, "w") as f:
            f.write(domainsToml(["e.example.org"]))
        before = self.watcher.reloads
        swapped: Deferred[None] = Deferred()
        self.holder.subscribe(lambda old, new: None if swapped.called else swapped.callback(None))
        os.kill(os.getpid(), signal.SIGHUP)
        await swapped  # the handler reloads from the reactor's thread, not on the clock
        self.assertGreater(self.watcher.reloads, before, "SIGHUP to reload")
        self.assertEqual(self.domains(), ("e.example.org",))

    @deferredTest
    async def test_proxyFollowsTheFile(self) -> None:
        h = ProxyHarness(config=self.holder, resolver=FixedResolver({}))
        await h.start()
        self.addCleanup(h.stop)
        out = await exchange(h.port, b"CONNECT z.example.org:443 HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertIn(b"z.example.org:443 is not on the sandbox's allow list", out)
        await self.writeAndSettle(domainsToml(["z.example.org"], max_tunnels=7))
        self.assertEqual(self.holder.current.proxy.max_tunnels, 7, "the reload")
        out = await exchange(h.port, b"CONNECT z.example.org:443 HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertIn(b"z.example.org does not resolve", out)  # allowed by name now; the test resolver knows no address


class DiscoveryReloadTests(TestCase):
    """Issue 24: the user's file appearing or going, and the machine's changing, are each followed."""

    SETTLE = 0.2

    def setUp(self) -> None:
        from agentsandbox import paths

        base = os.path.abspath(self.mktemp())
        self.home = os.path.join(base, "home")
        os.makedirs(os.path.join(self.home, ".config", "agentsandbox"))
        self.user = os.path.join(self.home, ".config", "agentsandbox", "config.toml")
        self.machine = os.path.join(base, "etc", "config.toml")
        os.makedirs(os.path.dirname(self.machine))
        with open(self.machine, "w") as f:
            f.write(domainsToml(["a.example.org", "b.example.org"]))
        self.patch(paths, "SYSTEM_CONFIG", self.machine)
        self.env = {"HOME": self.home}
        self.holder = ConfigHolder(load(None, self.env))
        self.clock = WatchedClock()
        self.watcher = ConfigWatcher(self.holder, (self.user, self.machine), reactor,
                                     loader=lambda: load(None, self.env), settle=self.SETTLE,
                                     handleSignal=False, clock=self.clock)
        self.watcher.startService()
        self.addCleanup(self.watcher.stopService)

    async def changeAndSettle(self, change: Callable[[], None]) -> None:
        scheduled = self.clock.nextCall()
        change()
        await scheduled
        self.clock.advance(self.SETTLE * 2)

    def write(self, path: str, text: str) -> Callable[[], None]:
        def go() -> None:
            with open(path, "w") as f:
                f.write(text)
        return go

    @deferredTest
    async def test_aUserFileThatAppearsIsServedAndOneThatGoesIsNot(self) -> None:
        self.assertEqual(self.holder.current.sandbox.domains, ("a.example.org", "b.example.org"))
        self.assertEqual(self.watcher.figures()["served"], f"{self.machine} (the machine's)")
        await self.changeAndSettle(self.write(self.user, domainsToml(["a.example.org", "c.example.org"])))
        self.assertEqual(self.holder.current.sandbox.domains, ("a.example.org",), "the new file, narrowed")
        figures = self.watcher.figures()
        self.assertEqual(figures["served"], f"{self.machine} (the machine's), narrowed by {self.user}")
        self.assertEqual(len(figures["notices"]), 1)
        self.assertIn("sandbox.domains[1] = 'c.example.org' is not granted", figures["notices"][0])
        await self.changeAndSettle(self.write(self.machine, domainsToml(["a.example.org", "c.example.org"])))
        self.assertEqual(self.holder.current.sandbox.domains, ("a.example.org", "c.example.org"), "the machine's edit")
        await self.changeAndSettle(lambda: os.remove(self.user))
        self.assertEqual(self.holder.current.served, f"{self.machine} (the machine's)", "the file gone")

    def test_whatIsNotWatchedIsSaidWithWhy(self) -> None:
        missing = os.path.join(self.home, "nowhere", "config.toml")
        watcher = ConfigWatcher(self.holder, (missing, self.machine), reactor, handleSignal=False, clock=Clock())
        watcher.startService()
        self.addCleanup(watcher.stopService)
        unwatched = watcher.figures()["unwatched"]
        self.assertEqual(list(unwatched), [missing])
        self.assertIn("SIGHUP reloads", unwatched[missing])
        self.assertEqual(watcher.figures()["watching"], [self.machine])
