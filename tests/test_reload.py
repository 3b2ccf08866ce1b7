"""Live reload: inotify on the config file and SIGHUP; a broken file keeps the old config."""

from __future__ import annotations

import os
import signal
from typing import Any, cast

from twisted.internet.task import Clock
from twisted.logger import ILogObserver, globalLogPublisher
from twisted.trial.unittest import TestCase

from agentsandbox.config import Config, ConfigError, load
from agentsandbox.reload import ConfigHolder, ConfigWatcher
from tests.support.egress_fixtures import (
    FixedResolver,
    ProxyHarness,
    deferredTest,
    domainsToml,
    exchange,
    makeConfig,
    reactor,
    waitFor,
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
        watcher = ConfigWatcher(holder, None, clock, loader=broken, handleSignal=False)
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

        watcher = ConfigWatcher(holder, None, clock, loader=loader, settle=0.2, handleSignal=False)
        for _ in range(5):
            watcher.schedule()
            clock.advance(0.1)
        self.assertEqual(loads, [])
        clock.advance(0.2)
        self.assertEqual(loads, [1])


class LiveReloadTests(TestCase):
    def setUp(self) -> None:
        self.dir = self.mktemp()
        os.makedirs(self.dir)
        self.path = os.path.join(self.dir, "config.toml")
        self.env = {"HOME": self.dir}
        self.write(domainsToml(["a.example.org"]))
        self.holder = ConfigHolder(load(self.path, self.env))
        self.watcher = ConfigWatcher(self.holder, self.path, reactor, loader=lambda: load(self.path, self.env), settle=0.05)
        self.watcher.startService()
        self.addCleanup(self.watcher.stopService)

    def write(self, text: str, atomic: bool = False) -> None:
        target = self.path + ".tmp" if atomic else self.path
        with open(target, "w") as f:
            f.write(text)
        if atomic:
            os.replace(target, self.path)

    def domains(self) -> tuple[str, ...]:
        return self.holder.current.sandbox.domains

    @deferredTest
    async def test_inotifyWriteAndRename(self) -> None:
        self.write(domainsToml(["b.example.org"]))
        await waitFor(lambda: self.domains() == ("b.example.org",), "the in-place write to reload")
        self.write(domainsToml(["c.example.org"]), atomic=True)
        await waitFor(lambda: self.domains() == ("c.example.org",), "the rename to reload")

    @deferredTest
    async def test_brokenFileKeepsTheOldConfig(self) -> None:
        events = Events(self)
        self.write("[sandbox]\ndomains = [\"*\"]\n")
        await waitFor(lambda: self.watcher.failures >= 1, "the broken file to be read")
        self.assertEqual(self.domains(), ("a.example.org",))
        err = events.errors()[-1]
        self.assertEqual((err["file"], err["key"]), (self.path, "sandbox.domains[0]"))
        self.write("[sandbox\n")
        await waitFor(lambda: self.watcher.failures >= 2, "the unparsable file to be read")
        self.assertEqual(self.domains(), ("a.example.org",))
        self.assertIn("not valid TOML", events.errors()[-1]["error"])
        self.write(domainsToml(["d.example.org"]))
        await waitFor(lambda: self.domains() == ("d.example.org",), "the fixed file to reload")

    @deferredTest
    async def test_sighup(self) -> None:
        self.watcher.stopService()  # no inotify: only the signal can reload now
        self.watcher.path = None
        self.watcher.startService()
        with open(self.path, "w") as f:
            f.write(domainsToml(["e.example.org"]))
        before = self.watcher.reloads
        os.kill(os.getpid(), signal.SIGHUP)
        await waitFor(lambda: self.watcher.reloads > before, "SIGHUP to reload")
        self.assertEqual(self.domains(), ("e.example.org",))

    @deferredTest
    async def test_proxyFollowsTheFile(self) -> None:
        h = ProxyHarness(config=self.holder, resolver=FixedResolver({}))
        await h.start()
        self.addCleanup(h.stop)
        out = await exchange(h.port, b"CONNECT z.example.org:443 HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertIn(b"z.example.org:443 is not on the sandbox's allow list", out)
        self.write(domainsToml(["z.example.org"], max_tunnels=7))
        await waitFor(lambda: self.holder.current.proxy.max_tunnels == 7, "the reload")
        out = await exchange(h.port, b"CONNECT z.example.org:443 HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertIn(b"z.example.org does not resolve", out)  # allowed by name now; the test resolver knows no address
