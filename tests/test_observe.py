"""Observe mode (``proxy.unlisted = "observe"``, issue 28): unlisted hosts go through, recorded as "would refuse".

A real proxy on loopback (``ProxyHarness``: documentation addresses bent to a
loopback web server, the address rules real) with the service's registry, real
curl through each front door, then ``agentsandbox suggest`` on the audit log
the proxy wrote and ``check host`` on the same config.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import tomllib
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.internet.utils import getProcessOutputAndValue
from twisted.trial.unittest import TestCase
from twisted.web.resource import Resource
from twisted.web.server import Site
from twisted.web.static import Data

from agentsandbox.egress.approvals import ApprovalRegistry
from agentsandbox.egress.gate import Ask, Gate, Observe, Resolve
from agentsandbox.egress.grant import Refusal
from agentsandbox.egress.testing import FixedResolver, MappedDialer
from agentsandbox.loader import load
from agentsandbox.reload import ConfigHolder
from tests.support.egress_fixtures import CURL, ProxyHarness, deferredTest, listen, reactor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONFIG = """\
inject = []

[sandbox]
domains = ["github.com"]
refused_domains = ["never.example.org"]

[proxy]
listen = "127.0.0.1:0"
unlisted = "observe"
"""

TABLE = {
    "app.example.org": ["192.0.2.20"],
    "cdn.example.org": ["192.0.2.21"],
    "inside.example.org": ["10.0.0.5"],
    "never.example.org": ["192.0.2.22"],
}


def _hello() -> Resource:
    root = Resource()
    root.putChild(b"", Data(b"hello\n", "text/plain"))
    return root


def _env(base: str) -> dict[str, str]:
    home = os.path.join(base, "home")
    return {
        "HOME": home, "XDG_RUNTIME_DIR": os.path.join(base, "run"), "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": REPO, "XDG_CONFIG_HOME": os.path.join(home, ".config"),
    }  # fmt: skip


class TheGate(TestCase):
    def gate(self, unlisted: str) -> Gate:
        base = tempfile.mkdtemp(prefix="observe-")
        self.addCleanup(shutil.rmtree, base, True)
        env = _env(base)
        os.makedirs(os.path.join(env["XDG_CONFIG_HOME"], "agentsandbox"))
        with open(os.path.join(env["XDG_CONFIG_HOME"], "agentsandbox", "config.toml"), "w") as f:
            f.write(CONFIG.replace('"observe"', f'"{unlisted}"'))
        return Gate.ofConfig(load(None, env))

    def test_an_unlisted_name_is_observed_then_decided_as_a_listed_one_would_be(self) -> None:
        gate = self.gate("observe")
        step = gate.decide("app.example.org", 443)
        assert isinstance(step, Observe)
        self.assertIn("not on the sandbox's allow list", step.name.reason)
        self.assertEqual(step.name.allow, "app.example.org")
        self.assertIsInstance(gate.observed(step), Resolve)

    def test_what_refuse_and_ask_refuse_by_rule_is_not_observed(self) -> None:
        gate = self.gate("observe")
        self.assertIsInstance(gate.decide("never.example.org", 443), Refusal)  # sandbox.refused_domains
        self.assertIsInstance(gate.decide("10.0.0.5", 443), Refusal)  # a literal the address rules refuse
        self.assertIsInstance(gate.decide("github.com", 443), Resolve)  # listed: as ever
        self.assertIsInstance(self.gate("ask").decide("app.example.org", 443), Ask)
        self.assertIsInstance(self.gate("refuse").decide("app.example.org", 443), Refusal)


class ObservingProxy(TestCase):
    async def _world(self) -> None:
        self.base = tempfile.mkdtemp(prefix="observe-")
        self.addCleanup(shutil.rmtree, self.base, True)
        self.env = _env(self.base)
        os.makedirs(os.path.join(self.env["XDG_CONFIG_HOME"], "agentsandbox"))
        os.makedirs(self.env["XDG_RUNTIME_DIR"], mode=0o700)
        self.configFile = os.path.join(self.env["XDG_CONFIG_HOME"], "agentsandbox", "config.toml")
        with open(self.configFile, "w") as f:
            f.write(CONFIG)
        from agentsandbox import paths

        assert not os.path.exists(paths.SYSTEM_CONFIG), "these tests assume no machine config"
        self.holder = ConfigHolder(load(None, self.env))
        site = await listen(Site(_hello()))
        self.addCleanup(site.stopListening)
        self.dialer = MappedDialer(reactor)
        for addresses in TABLE.values():
            self.dialer.map(addresses[0], site.getHost().port)
        self.harness = ProxyHarness(resolver=FixedResolver(TABLE), dialer=self.dialer, config=self.holder)
        self.registry = ApprovalRegistry(lambda: self.holder.current, Clock(), self.harness.factory.record)
        self.harness.factory.approvals = self.registry
        self.events: list[dict[str, Any]] = []
        self.registry.subscribe(self.events.append)
        await self.harness.start()
        self.addCleanup(self.harness.stop)

    def curl(self, *args: str) -> Deferred[tuple[bytes, bytes, int]]:
        d: Deferred[tuple[bytes, bytes, int]] = getProcessOutputAndValue(
            CURL, ("--silent", "--show-error", "--noproxy", "", "--max-time", "30", *args), env=self.env
        )
        return d

    def cli(self, *args: str) -> Deferred[tuple[bytes, bytes, int]]:
        d: Deferred[tuple[bytes, bytes, int]] = getProcessOutputAndValue(
            sys.executable, ("-m", "agentsandbox", *args), env=self.env
        )
        return d

    def records(self, event: str) -> list[dict[str, Any]]:
        return [r for r in self.harness.records() if r["event"] == event]

    @deferredTest
    async def test_unlisted_hosts_go_through_each_door_recorded_as_would_refuse(self) -> None:
        await self._world()
        proxy = f"127.0.0.1:{self.harness.port}"
        for args in (("-p", "-x", f"http://{proxy}"), ("-x", f"http://{proxy}"), ("--socks5-hostname", proxy)):
            body, err, code = await self.curl(*args, "http://app.example.org/")
            self.assertEqual((body, code), (b"hello\n", 0), err)
        observed = self.records("observed")
        self.assertEqual([r["kind"] for r in observed], ["connect", "forward", "socks"])
        for r in observed:
            self.assertEqual((r["host"], r["port"], r["allow"]), ("app.example.org", 80, "app.example.org"))
            self.assertIn("not on the sandbox's allow list", r["reason"])
        self.assertEqual(
            [(e["event"], e["host"], e["kind"]) for e in self.events],
            [("observed", "app.example.org", k) for k in ("connect", "forward", "socks")],
        )
        self.assertEqual(self.registry.held, [])  # observing never holds anything

    @deferredTest
    async def test_address_rules_and_refused_domains_still_refuse(self) -> None:
        await self._world()
        proxy = f"http://127.0.0.1:{self.harness.port}"
        body, _, _ = await self.curl("-x", proxy, "http://inside.example.org/")
        self.assertIn(b"inside.example.org resolves to 10.0.0.5", body)
        body, _, _ = await self.curl("-x", proxy, "http://never.example.org/")
        self.assertIn(b"in sandbox.refused_domains", body)
        body, _, _ = await self.curl("-x", proxy, "http://10.0.0.5/")
        self.assertIn(b"10.0.0.5:80 is not on the sandbox's allow list", body)
        self.assertEqual([r["host"] for r in self.records("observed")], ["inside.example.org"])
        self.assertEqual(self.dialer.dialled, [])

    @deferredTest
    async def test_suggest_turns_what_was_observed_into_lines_to_paste(self) -> None:
        await self._world()
        proxy = f"127.0.0.1:{self.harness.port}"
        for host, times in (("app.example.org", 3), ("cdn.example.org", 1)):
            for _ in range(times):
                body, err, code = await self.curl("-p", "-x", f"http://{proxy}", f"http://{host}/")
                self.assertEqual((body, code), (b"hello\n", 0), err)
        out, err, code = await self.cli("suggest", "--file", self.harness.auditPath)
        self.assertEqual(code, 0, err)
        lines = out.decode().splitlines()
        self.assertEqual(lines[1], "  # example.org")
        self.assertTrue(lines[2].startswith('  "app.example.org",') and "would refuse 3x (observed)" in lines[2], lines)
        self.assertTrue(lines[3].startswith('  "cdn.example.org",') and "would refuse 1x (observed)" in lines[3], lines)
        pasted = "\n".join(line.split("#")[0] for line in lines[1:])
        self.assertEqual(tomllib.loads(f"domains = [\n{pasted}\n]")["domains"], ["app.example.org", "cdn.example.org"])

    @deferredTest
    async def test_check_host_says_it_would_be_observed(self) -> None:
        await self._world()
        out, err, code = await self.cli("check", "host", "app.example.org")
        self.assertEqual(code, 0, err)
        self.assertIn(b'observed: app.example.org:443 is not on sandbox.domains; with proxy.unlisted = "observe"', out)
