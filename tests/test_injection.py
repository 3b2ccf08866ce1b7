"""InjectionService follows the ConfigHolder on its own; the proxy and ``check host`` ask one question.

The service is never handed a new config by anyone: a ``swap`` of the holder it
was built with is all it gets.  ``check host`` and a running proxy are then
shown to agree, target by target, with ``ITerminator.injects`` of the injector
the service builds.
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile
from collections.abc import Sequence
from contextlib import redirect_stdout

from twisted.internet import reactor
from twisted.internet.interfaces import IProtocol
from twisted.internet.protocol import Factory, Protocol
from twisted.trial.unittest import TestCase
from zope.interface import implementer
from zope.interface.verify import verifyObject

from agentsandbox.allowlist import IPAddress
from agentsandbox.commands import _checkHost
from agentsandbox.config import Config
from agentsandbox.egress.inject import Injector
from agentsandbox.egress.injection import InjectionService, injectionFor
from agentsandbox.egress.interfaces import ITerminator
from agentsandbox.egress.testing import FixedResolver, MappedDialer
from agentsandbox.loader import loads
from agentsandbox.paths import Paths
from agentsandbox.reload import ConfigHolder
from tests.support.broker_support import until
from tests.support.egress_fixtures import (
    Echo,
    ProxyHarness,
    deferredTest,
    exchange,
    listen,
)

GITHUB = '[[inject]]\nhosts = ["api.github.com"]\nformat = "token {token}"\ntoken_env = "T"\n'
GITLAB = '[[inject]]\nhosts = ["gitlab.example.com"]\nformat = "Bearer {token}"\ntoken_env = "T"\n'


class Configs:
    """Configs for one home and runtime dir, so the egress dir is a real, private directory."""

    def __init__(self, case: TestCase) -> None:
        self.base = tempfile.mkdtemp(prefix="injection-")
        case.addCleanup(shutil.rmtree, self.base, True)
        runtime = os.path.join(self.base, "run")
        os.makedirs(runtime, mode=0o700)
        self.paths = Paths.fromEnvironment({"HOME": self.base, "XDG_RUNTIME_DIR": runtime})

    def make(self, body: str, domains: Sequence[str] = ("api.github.com", "gitlab.example.com")) -> Config:
        listed = ", ".join(f'"{d}"' for d in domains)
        toml = ("inject = []\n" if "[[inject]]" not in body else "") + f"[sandbox]\ndomains = [{listed}]\n" + body
        return loads(toml.encode(), "<test config>", self.paths)

    def caFile(self, config: Config) -> bytes:
        assert config.paths.egressDir is not None
        with open(os.path.join(config.paths.egressDir, "ca.pem"), "rb") as f:
            return f.read()


class InjectionServiceReloads(TestCase):
    def setUp(self) -> None:
        self.configs = Configs(self)

    def start(self, config: Config) -> tuple[ConfigHolder, InjectionService]:
        holder = ConfigHolder(config)
        service = InjectionService(holder, reactor, environ={"T": "tok-1"})
        service.startService()
        self.addCleanup(service.stopService)
        return holder, service

    def test_theInjectorIsATerminator(self) -> None:
        service = injectionFor(self.configs.make(GITHUB))
        self.assertTrue(verifyObject(ITerminator, service.injector))

    @deferredTest
    async def test_aSwapOfItsHolderReachesTheInjectorTokensAndEgressDir(self) -> None:
        holder, service = self.start(self.configs.make(""))
        injector = service.injector
        self.assertFalse(injector.injects("api.github.com", 443))
        self.assertEqual(self.configs.caFile(holder.current), b"")

        holder.swap(self.configs.make(GITHUB))
        # The same injector (the proxy's terminator for the service's life) now says yes.
        self.assertIs(service.injector, injector)
        self.assertTrue(injector.injects("api.github.com", 443))
        self.assertFalse(injector.injects("api.github.com", 8443))
        self.assertFalse(injector.injects("gitlab.example.com", 443))
        assert service.ca is not None
        self.assertEqual(service.ca.hosts, ("api.github.com",))
        self.assertEqual(self.configs.caFile(holder.current), service.ca.pem)
        self.assertTrue(service.tokens.running)
        self.assertIs(service.tokens.parent, service)
        tokens = service.tokens
        await until(lambda: tokens.statuses()[0].present, what="the new keeper's first fetch")

        # Another host set: a new CA, written out; the retired keepers stop.
        retired, firstCA = service.tokens, service.ca
        holder.swap(self.configs.make(GITLAB))
        self.assertFalse(injector.injects("api.github.com", 443))
        self.assertTrue(injector.injects("gitlab.example.com", 443))
        self.assertIsNot(service.ca, firstCA)
        self.assertEqual(self.configs.caFile(holder.current), service.ca.pem)
        self.assertFalse(retired.running)
        self.assertIsNone(retired.parent)

        # No rule left: no CA, every host dialled as usual.
        holder.swap(self.configs.make(""))
        self.assertIsNone(service.ca)
        self.assertFalse(injector.injects("gitlab.example.com", 443))

    def test_theSameHostsKeepTheirCA(self) -> None:
        holder, service = self.start(self.configs.make(GITHUB))
        ca = service.ca
        holder.swap(self.configs.make(GITHUB.replace("token {token}", "Bearer {token}")))
        self.assertIs(service.ca, ca)
        self.assertTrue(service.injector.injects("api.github.com", 443))

    def test_aStoppedServiceNoLongerFollows(self) -> None:
        holder, service = self.start(self.configs.make(""))
        self.assertTrue(service.injector.pooling)
        service.stopService()
        # A tunnel the stopping proxy closes after this must not refill the pool.
        self.assertFalse(service.injector.pooling)
        holder.swap(self.configs.make(GITHUB))
        self.assertFalse(service.injector.injects("api.github.com", 443))

    def test_aSwapBeforeStartIsTakenAtStart(self) -> None:
        holder = ConfigHolder(self.configs.make(""))
        service = InjectionService(holder, reactor, environ={"T": "tok-1"})
        holder.swap(self.configs.make(GITHUB))
        self.assertFalse(service.injector.injects("api.github.com", 443))
        service.startService()
        self.addCleanup(service.stopService)
        self.assertTrue(service.injector.injects("api.github.com", 443))
        assert service.ca is not None
        self.assertEqual(self.configs.caFile(holder.current), service.ca.pem)

    def test_checkHostBuildsNothingOnDisk(self) -> None:
        config = self.configs.make(GITHUB)
        injectionFor(config)
        assert config.paths.egressDir is not None
        self.assertFalse(os.path.exists(config.paths.egressDir))


def fakeGh(directory: str, body: str) -> dict[str, str]:
    """An environment whose PATH finds a ``gh`` that runs ``body`` (sh)."""
    bindir = os.path.join(directory, "bin")
    os.makedirs(bindir, exist_ok=True)
    gh = os.path.join(bindir, "gh")
    with open(gh, "w") as f:
        f.write("#!/bin/sh\n" + body + "\n")
    os.chmod(gh, 0o755)
    return {"PATH": f"{bindir}:/usr/bin:/bin", "HOME": directory}


class TheBuiltinGithubRule(TestCase):
    """The built-in rule terminates GitHub's hosts only while ``gh auth token`` gives a token."""

    def setUp(self) -> None:
        self.configs = Configs(self)

    def builtin(self, domains: Sequence[str] = ("github.com", "*.github.com")) -> Config:
        listed = ", ".join(f'"{d}"' for d in domains)
        return loads(f"[sandbox]\ndomains = [{listed}]\n".encode(), "<test config>", self.configs.paths)

    async def started(self, config: Config, environ: dict[str, str]) -> InjectionService:
        service = InjectionService(ConfigHolder(config), reactor, environ=environ)
        service.startService()
        self.addCleanup(service.stopService)
        status = service.tokens.statuses
        await until(lambda: status()[0].present or status()[0].failures > 0, what="the first gh auth token")
        return service

    @deferredTest
    async def test_withoutALoginGithubIsTunnelledUntouched(self) -> None:
        env = fakeGh(self.configs.base, 'echo "gh: To get started with GitHub CLI, please run:  gh auth login" >&2; exit 4')
        service = await self.started(self.builtin(), env)
        self.assertFalse(service.tokens.statuses()[0].present)
        for host in ("github.com", "api.github.com", "uploads.github.com"):
            self.assertFalse(service.injector.injects(host, 443), host)

    @deferredTest
    async def test_withALoginGithubIsTerminated(self) -> None:
        env = fakeGh(self.configs.base, 'echo "gho_fake0token0from0gh"')
        service = await self.started(self.builtin(), env)
        self.assertTrue(service.tokens.statuses()[0].present)
        for host in ("github.com", "api.github.com", "uploads.github.com"):
            self.assertTrue(service.injector.injects(host, 443), host)

    @deferredTest
    async def test_onlyTheAllowedGithubHostsAreCovered(self) -> None:
        env = fakeGh(self.configs.base, 'echo "gho_fake0token0from0gh"')
        service = await self.started(self.builtin(("github.com",)), env)
        self.assertTrue(service.injector.injects("github.com", 443))
        self.assertFalse(service.injector.injects("api.github.com", 443))

    def test_noGithubHostAllowedNoRuleNoKeeper(self) -> None:
        config = self.builtin(("example.org",))
        self.assertTrue(config.inject_builtin)
        self.assertEqual(config.inject, ())
        service = injectionFor(config)
        self.assertIsNone(service.ca)
        self.assertEqual(service.tokens.statuses(), [])

    @deferredTest
    async def test_anExplicitRuleWithoutItsTokenIsStillTerminated(self) -> None:
        # What [[inject]] names is the person's: it stays in force (and doctor fails) without a token.
        config = self.configs.make('[[inject]]\nhosts = ["api.github.com"]\nformat = "token {token}"\ntoken_env = "UNSET_T"\n')
        service = await self.started(config, {"PATH": "/usr/bin:/bin"})
        self.assertFalse(service.tokens.statuses()[0].present)
        self.assertTrue(service.injector.injects("api.github.com", 443))


class _Answer(Protocol):
    def dataReceived(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(b"terminated:" + data)
        self.transport.loseConnection()


@implementer(ITerminator)
class Spy:
    """The service's injector's answer to ``injects``; ``terminate`` answers in plain text (no TLS here)."""

    def __init__(self, injector: Injector) -> None:
        self.injector = injector
        self.terminated: list[str] = []

    def injects(self, host: str, port: int) -> bool:
        return self.injector.injects(host, port)

    def terminate(self, host: str, addresses: Sequence[IPAddress]) -> IProtocol:
        self.terminated.append(host)
        return _Answer()


class CheckHostAndTheProxyAgree(TestCase):
    targets = ("api.github.com:443", "API.GitHub.com.:443", "api.github.com:8443", "echo.example.org:443")

    @deferredTest
    async def test_eachTargetIsTerminatedByBothOrByNeither(self) -> None:
        configs = Configs(self)
        config = configs.make(
            GITHUB, domains=("api.github.com:443", "api.github.com:8443", "echo.example.org:443")
        )
        injector = injectionFor(config).injector
        server = await listen(Factory.forProtocol(Echo))
        self.addCleanup(server.stopListening)
        dialer = MappedDialer(reactor)
        dialer.route("192.0.2.10", 443, server.getHost().port)
        dialer.route("192.0.2.10", 8443, server.getHost().port)
        resolver = FixedResolver({"api.github.com": ["192.0.2.10"], "echo.example.org": ["192.0.2.10"]})
        spy = Spy(injector)
        h = ProxyHarness(resolver=resolver, dialer=dialer, terminator=spy, config=config)
        await h.start()
        self.addCleanup(h.stop)

        seen: dict[str, tuple[bool, bool, bool]] = {}
        for target in self.targets:
            printed = io.StringIO()
            with redirect_stdout(printed):
                self.assertEqual(_checkHost(config, target, False), 0, printed.getvalue())
            said = "the proxy terminates TLS" in printed.getvalue()
            before = len(spy.terminated)
            out = await exchange(h.port, f"CONNECT {target} HTTP/1.1\r\nHost: x\r\n\r\nhello".encode())
            self.assertTrue(out.startswith(b"HTTP/1.1 200 "), (target, out))
            terminated = len(spy.terminated) > before
            self.assertEqual(out.endswith(b"terminated:hello"), terminated, (target, out))
            name, _, port = target.lower().rpartition(":")
            seen[target] = (said, terminated, injector.injects(name.rstrip("."), int(port)))
        self.assertEqual(
            seen,
            {
                "api.github.com:443": (True, True, True),
                "API.GitHub.com.:443": (True, True, True),
                "api.github.com:8443": (False, False, False),
                "echo.example.org:443": (False, False, False),
            },
        )

