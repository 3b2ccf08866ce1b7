"""The whole application from ``makeService``, on the real reactor and real loopback sockets.

One ``AgentSandbox`` per test: the proxy on an ephemeral loopback port, the
broker on a temp spool (real inotify, real /proc), a token keeper reading its
token from the service's environment, and the audit log in a temp state dir.
The only outside parts bent for the test are the ones that would leave the
machine: a resolver that answers ``api.github.com`` with a documentation
address, and a dialer that takes that address to a local fake GitHub whose
test CA is the injector's upstream trust.  Loopback upstreams are reached
through the real address rules (explicit ``127.0.0.1:PORT`` entries).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import replace
from typing import Any, cast

from twisted.internet import defer, reactor, threads
from twisted.internet.address import IPv4Address
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.utils import getProcessOutputAndValue
from twisted.trial import unittest

from agentsandbox.broker import client
from agentsandbox.broker.server import STOPPING
from agentsandbox.broker.spool import Reply
from agentsandbox.config import Config
from agentsandbox.egress.testing import FixedResolver, MappedDialer, UpstreamPKI
from agentsandbox.egressdir import egressVars
from agentsandbox.loader import load
from agentsandbox.service import AgentSandbox, makeService
from tests.support.broker_support import asyncTest, until
from tests.support.egress_fixtures import Echo, exchange
from tests.support.inject_github import FakeGitHub, documentationAddress, listenTLS
from tests.support.inject_harness import TOKEN

TOKEN_VAR = "AGENTSANDBOX_TEST_GITHUB_TOKEN"

CONFIG = """\
[sandbox]
domains = ["127.0.0.1:{echo}", "127.0.0.1:{web}", "api.github.com"]

[proxy]
listen = "tcp:0:interface=127.0.0.1"

[[inject]]
hosts = ["api.github.com"]
format = "token {{token}}"
token_env = "{tokenVar}"

[broker]
spool = "{base}/spool"

[broker.run.slow]
argv = ["/bin/sh", "-c", 'i=0; while [ ! -e "$1" ] && [ $i -lt 2000 ]; do sleep 0.01; i=$((i+1)); done; echo done', "slow"]
args = ["/tmp/[A-Za-z0-9._/-]+"]
stream = false

[audit]
file = "{base}/state/audit.jsonl"
"""


class TunnelClient(Protocol):
    """A client that keeps its connection and lets the test wait for bytes."""

    def __init__(self) -> None:
        self.received = b""
        self.closed: defer.Deferred[None] = defer.Deferred()
        self._waiting: list[tuple[bytes, defer.Deferred[bytes]]] = []

    def dataReceived(self, data: bytes) -> None:
        self.received += data
        for item in list(self._waiting):
            marker, d = item
            if marker in self.received:
                self._waiting.remove(item)
                d.callback(self.received)

    def connectionLost(self, reason: Any = None) -> None:
        for _marker, d in self._waiting:
            d.errback(AssertionError(f"closed before the expected bytes; got {self.received!r}"))
        self._waiting = []
        self.closed.callback(None)

    def waitFor(self, marker: bytes) -> defer.Deferred[bytes]:
        if marker in self.received:
            return defer.succeed(self.received)
        d: defer.Deferred[bytes] = defer.Deferred()
        self._waiting.append((marker, d))
        return d

    def send(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)


class _Hello(Protocol):
    """A one-shot HTTP/1.1 server: answers any request with a fixed body and closes."""

    def dataReceived(self, data: bytes) -> None:
        if b"\r\n\r\n" in data:
            body = b"hello through the proxy\n"
            assert self.transport is not None
            self.transport.write(
                b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
            )
            self.transport.loseConnection()


class ServiceCase(unittest.TestCase):
    """Starts the whole application from a config file in a temp user."""

    timeout = 120

    # trial waits on the Deferred setUp returns; unittest's stub says None.
    @defer.inlineCallbacks
    def setUp(self) -> Any:  # type: ignore[override]
        self.base = tempfile.mkdtemp(prefix="svc-", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.base, True)
        self.env = {
            "HOME": os.path.join(self.base, "home"),
            "XDG_RUNTIME_DIR": os.path.join(self.base, "run"),
            "XDG_STATE_HOME": os.path.join(self.base, "state"),
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            # Not /tmp, which the policy opens as the temp dir and which holds base.
            "TMPDIR": os.path.join(self.base, "tmp"),
            TOKEN_VAR: TOKEN,
        }
        for d in ("home", "run", "tmp"):
            os.makedirs(os.path.join(self.base, d), mode=0o700)

        self.echoPort = yield self.listen(Factory.forProtocol(Echo))
        self.webPort = yield self.listen(Factory.forProtocol(_Hello))

        # The fake GitHub, reached only through the injector's dialer.
        self.pki = UpstreamPKI.create()
        gitRoot = os.path.join(self.base, "git")
        os.makedirs(gitRoot)
        self.fake = FakeGitHub(token=TOKEN, gitRoot=gitRoot)
        # On Twisted 22.4 the module reactor is a plain module to mypy, not an IReactorTCP.
        upstream = listenTLS(reactor, self.fake.site(), self.pki.serverOptions(["api.github.com"]))  # type: ignore[arg-type,unused-ignore]
        self.addCleanup(upstream.stopListening)
        address = documentationAddress(61)
        self.dialer = MappedDialer(reactor)
        upstreamHost = upstream.getHost()
        assert isinstance(upstreamHost, IPv4Address)
        self.dialer.route(str(address), 443, upstreamHost.port)
        self.resolver = FixedResolver({"api.github.com": [str(address)]})

        self.configPath = os.path.join(self.base, "config.toml")
        with open(self.configPath, "w") as f:
            f.write(
                CONFIG.format(
                    echo=self.echoPort, web=self.webPort, base=self.base, tokenVar=TOKEN_VAR
                )
            )
        self.config: Config = load(self.configPath, self.env)
        self.spool = self.config.broker.spool
        self.service = self.makeService()
        self.service.startService()
        self.addCleanup(self.stopService)
        port = yield self.service.listening
        self.proxyPort: int = port.getHost().port
        yield self.service.broker.ready

    def makeService(self) -> AgentSandbox:
        # The peer check stays the real one: these loopback clients are our own uid.
        return makeService(
            self.config,
            reactor,
            configPath=self.configPath,
            resolver=self.resolver,
            dialer=self.dialer,
            upstreamTrust=self.pki.pem,
            environ=self.env,
            handleSignals=False,
        )

    def stopService(self) -> Any:
        if self.service.running:
            return self.service.stopService()
        return None

    @defer.inlineCallbacks
    def listen(self, factory: Factory) -> Any:
        # Twisted 22.4's module reactor has no listenTCP for mypy; newer stubs want a ServerFactory.
        port = reactor.listenTCP(0, factory, interface="127.0.0.1")  # type: ignore[attr-defined,arg-type,unused-ignore]
        self.addCleanup(port.stopListening)
        yield None
        host = port.getHost()
        assert isinstance(host, IPv4Address)
        return host.port

    async def tunnel(self, port: int) -> TunnelClient:
        """An open CONNECT tunnel through the proxy to 127.0.0.1:port."""
        c = TunnelClient()
        await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", self.proxyPort), c)
        c.send(b"CONNECT 127.0.0.1:%d HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n" % (port, port))
        head = await c.waitFor(b"\r\n\r\n")
        self.assertTrue(head.startswith(b"HTTP/1.1 200"), head)
        c.received = b""
        return c

    def ask(self, op: str) -> defer.Deferred[Reply]:
        # Twisted 22.4's deferToThread is unannotated: name the type here.
        d: defer.Deferred[Reply] = threads.deferToThread(client.ask, op, self.spool, 20.0)
        return d

    async def status(self) -> dict[str, Any]:
        reply = await self.ask("status")
        report: dict[str, Any] = json.loads(reply.out)
        return report


class ProxyTests(ServiceCase):
    @asyncTest
    async def test_allowedTunnelEchoes(self) -> None:
        t = await self.tunnel(self.echoPort)
        t.send(b"ping through the tunnel\n")
        self.assertEqual(await t.waitFor(b"\n"), b"ping through the tunnel\n")
        assert t.transport is not None
        t.transport.loseConnection()
        await t.closed

    @asyncTest
    async def test_allowedAbsoluteFormRequest(self) -> None:
        answer = await exchange(
            self.proxyPort,
            b"GET http://127.0.0.1:%d/ HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nConnection: close\r\n\r\n" % (self.webPort, self.webPort),
            halfClose=False,
        )
        self.assertTrue(answer.startswith(b"HTTP/1.1 200"), answer)
        self.assertIn(b"hello through the proxy", answer)

    @asyncTest
    async def test_unlistedHostIsRefusedWithTheKeyThatWouldAllowIt(self) -> None:
        answer = await exchange(self.proxyPort, b"CONNECT example.org:443 HTTP/1.1\r\nHost: example.org:443\r\n\r\n")
        self.assertTrue(answer.startswith(b"HTTP/1.1 403"), answer)
        self.assertIn(b"example.org", answer)
        self.assertIn(b"sandbox.domains", answer)

    @asyncTest
    async def test_unlistedLoopbackPortIsRefused(self) -> None:
        # Another port on the same loopback address is not on the list.
        answer = await exchange(self.proxyPort, b"CONNECT 127.0.0.1:9 HTTP/1.1\r\nHost: 127.0.0.1:9\r\n\r\n")
        self.assertTrue(answer.startswith(b"HTTP/1.1 403"), answer)

    @asyncTest
    async def test_injectedRequestCarriesTheTokenTheClientNeverHad(self) -> None:
        await until(lambda: self.service.injection.tokens.statuses()[0].present, what="the token keeper's first fetch")
        egress = self.config.paths.egressDir
        assert egress is not None
        proxy = f"http://127.0.0.1:{self.proxyPort}"
        env = {"PATH": self.env["PATH"], "HOME": self.env["HOME"], "HTTPS_PROXY": proxy, **egressVars(egress)}
        out, err, code = await getProcessOutputAndValue(
            "/usr/bin/curl", ("-sS", "--max-time", "30", "https://api.github.com/user"), env=env
        )
        self.assertEqual(code, 0, err)
        self.assertIn(b"octocat", out)
        self.assertEqual(self.fake.seen[-1].authorization, [f"token {TOKEN}"])
        self.assertNotIn(TOKEN, json.dumps(env))


class BrokerTests(ServiceCase):
    @asyncTest
    async def test_ping(self) -> None:
        reply = await self.ask("ping")
        self.assertIsNone(reply.error)

    @asyncTest
    async def test_statusHasProxyFiguresAndTokenState(self) -> None:
        # One refusal, one closed tunnel with bytes both ways, one open tunnel,
        # one injected request: each shows in the broker's status.
        await exchange(self.proxyPort, b"CONNECT example.org:443 HTTP/1.1\r\nHost: example.org:443\r\n\r\n")
        closing = await self.tunnel(self.echoPort)
        closing.send(b"x" * 1000)
        await until(lambda: len(closing.received) >= 1000, what="the echo")
        assert closing.transport is not None
        closing.transport.loseConnection()
        await closing.closed
        held = await self.tunnel(self.echoPort)
        held.send(b"y" * 500)
        await until(lambda: len(held.received) >= 500, what="the held tunnel's echo")
        await until(lambda: self.service.proxyFigures()["tunnelsClosed"] == 1, what="the closed tunnel's record")
        await until(lambda: self.service.injection.tokens.statuses()[0].present, what="the token")
        egress = self.config.paths.egressDir
        assert egress is not None
        env = {"PATH": self.env["PATH"], "HTTPS_PROXY": f"http://127.0.0.1:{self.proxyPort}", **egressVars(egress)}
        _out, err, code = await getProcessOutputAndValue(
            "/usr/bin/curl", ("-sS", "--max-time", "30", "https://api.github.com/user"), env=env
        )
        self.assertEqual(code, 0, err)

        report = await self.status()
        proxy = report["proxy"]
        self.assertEqual(proxy["listening"], f"127.0.0.1:{self.proxyPort}")
        self.assertEqual(proxy["openTunnels"], 1)
        self.assertGreaterEqual(proxy["refused"], 1)
        # The closed tunnel's 1000 bytes and the open one's 500, both ways.
        self.assertGreaterEqual(proxy["bytesUp"], 1500)
        self.assertGreaterEqual(proxy["bytesDown"], 1500)
        self.assertEqual(proxy["injectedRequests"], 1)
        (token,) = report["tokens"]
        self.assertEqual(token["hosts"], ["api.github.com"])
        self.assertTrue(token["present"])
        self.assertIsNone(token["lastError"])
        self.assertIn(TOKEN_VAR, token["source"])
        self.assertIn("token present", token["describe"])
        self.assertNotIn(TOKEN, json.dumps(report), "status never shows the token")
        self.assertEqual(report["pid"], os.getpid())

        assert held.transport is not None
        held.transport.loseConnection()
        await held.closed

    @asyncTest
    async def test_statusShowsAMissingToken(self) -> None:
        await self.stopService()
        del self.env[TOKEN_VAR]
        self.service = self.makeService()
        self.service.startService()
        await self.service.listening
        await self.service.broker.ready
        await until(lambda: self.service.injection.tokens.statuses()[0].failures, what="the failed fetch")
        (token,) = (await self.status())["tokens"]
        self.assertFalse(token["present"])
        self.assertIn(TOKEN_VAR, token["lastError"])
        self.assertIsNotNone(token["nextAttempt"])


class StopTests(ServiceCase):
    @asyncTest
    async def test_stopClosesListeningTunnelsAndAnswersInFlightRequests(self) -> None:
        t = await self.tunnel(self.echoPort)
        t.send(b"before\n")
        await t.waitFor(b"before\n")
        gate = os.path.join(self.base, "gate")
        self.addCleanup(lambda: open(gate, "w").close())  # the host command ends either way
        slow = threads.deferToThread(client.ask, "run", self.spool, 20.0, args=("slow", gate))
        await until(lambda: self.service.broker.host.running, what="the host command to start")

        await self.service.stopService()

        # The in-flight request got the broker's "stopping" reply.
        with self.assertRaises(client.BrokerError) as caught:
            await slow
        self.assertEqual(str(caught.exception), STOPPING)
        # The open tunnel was closed by the proxy.
        await t.closed
        # Nothing listens any more.
        with self.assertRaises(ConnectionRefusedError):
            await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", self.proxyPort), Protocol())
        self.assertEqual(self.service.proxyFactory.tunnels, set())
        self.assertEqual(self.service.broker.host.running, set())
        # The audit log was closed and holds the tunnel's record.
        with open(self.config.audit.file) as f:
            records = [json.loads(line) for line in f]
        self.assertIn("tunnel", [r.get("event") for r in records])


class ReloadTests(ServiceCase):
    @asyncTest
    async def test_reloadKeepsOpenTunnelsAndRefusesNewOnes(self) -> None:
        t = await self.tunnel(self.echoPort)
        with open(self.configPath) as f:
            text = f.read()
        with open(self.configPath + ".new", "w") as f:
            f.write(text.replace(f'"127.0.0.1:{self.echoPort}", ', ""))
        os.rename(self.configPath + ".new", self.configPath)
        watcher = self.service.watcher
        assert watcher is not None
        await until(lambda: watcher.reloads >= 1, what="the watcher to reload the changed file")
        t.send(b"still here\n")
        self.assertEqual(await t.waitFor(b"\n"), b"still here\n")
        answer = await exchange(
            self.proxyPort, b"CONNECT 127.0.0.1:%d HTTP/1.1\r\nHost: x\r\n\r\n" % self.echoPort
        )
        self.assertTrue(answer.startswith(b"HTTP/1.1 403"), answer)
        assert t.transport is not None
        t.transport.loseConnection()
        await t.closed


class CompositionTests(ServiceCase):
    """service.py composes: every reload listener on the holder is a child's own."""

    def test_everyListenerOfTheHolderIsAChildsOwn(self) -> None:
        from agentsandbox.broker.server import BrokerService
        from agentsandbox.egress.injection import InjectionService
        from agentsandbox.egress.proxy import EgressProxyFactory, ProxyService
        from agentsandbox.service import RestartNotice

        owners = [getattr(listener, "__self__", None) for listener in self.service.holder._listeners]
        children = list(self.service)
        # The proxy's factory swaps its gate on every swap of the holder; it is the
        # proxy child's own, and lives and dies with it.
        proxies = [c for c in children if isinstance(c, ProxyService)]
        owned = children + [p.factory for p in proxies]
        for owner in owners:
            self.assertIn(owner, owned)
        self.assertEqual(
            sorted(type(owner).__name__ for owner in owners),
            sorted(
                c.__name__
                for c in (BrokerService, InjectionService, ProxyService, RestartNotice, EgressProxyFactory)
            ),
        )
        # The proxy's terminator is the injection service's injector, for the service's life.
        self.assertIs(self.service.proxyFactory.terminator, self.service.injection.injector)

    @asyncTest
    async def test_anInjectReloadKeepsTheTerminatorAndNeedsNoRestart(self) -> None:
        from twisted.logger import ILogObserver, globalLogPublisher

        events: list[dict[str, Any]] = []
        observer = cast(ILogObserver, events.append)
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        injector = self.service.injection.injector
        self.assertTrue(injector.injects("api.github.com", 443))
        config = self.service.holder.current
        self.service.holder.swap(replace(config, inject=()))
        self.assertIs(self.service.proxyFactory.terminator, injector)
        self.assertFalse(injector.injects("api.github.com", 443))
        self.service.holder.swap(config)
        self.assertTrue(injector.injects("api.github.com", 443))
        self.assertEqual([e for e in events if "restarts" in e.get("log_format", "")], [])


class StartFailureTests(ServiceCase):
    @asyncTest
    async def test_aProxyThatCannotListenSaysWhyAndWhichKey(self) -> None:
        from twisted.internet.error import CannotListenError

        await self.stopService()
        # The port the first service listened on is free again; squat it.
        squatter = reactor.listenTCP(self.proxyPort, Factory.forProtocol(Protocol), interface="127.0.0.1")  # type: ignore[attr-defined,arg-type,unused-ignore]
        self.addCleanup(squatter.stopListening)
        with open(self.configPath) as f:
            text = f.read()
        with open(self.configPath, "w") as f:
            f.write(text.replace('"tcp:0:interface=127.0.0.1"', f'"tcp:{self.proxyPort}:interface=127.0.0.1"'))
        self.config = load(self.configPath, self.env)
        self.service = self.makeService()
        self.service.startService()
        with self.assertRaises(CannotListenError):
            await self.service.listening
        failure = self.service.startFailure
        assert failure is not None
        self.assertIn(f"tcp:{self.proxyPort}:interface=127.0.0.1", failure)
        self.assertIn(f"proxy.listen in {self.configPath}", failure)
        # Asked again later, it says the same at once.
        with self.assertRaises(CannotListenError):
            await self.service.listening
        await self.service.broker.ready
        await self.service.stopService()


class ReloadScopeTests(ServiceCase):
    """What a reload changes at once, and what it says needs a restart."""

    async def rewrite(self, old: str, new: str) -> None:
        with open(self.configPath) as f:
            text = f.read()
        assert old in text, old
        with open(self.configPath + ".new", "w") as f:
            f.write(text.replace(old, new))
        watcher = self.service.watcher
        assert watcher is not None
        before = watcher.reloads
        os.rename(self.configPath + ".new", self.configPath)
        await until(lambda: watcher.reloads > before, what="the reload")

    @asyncTest
    async def test_aNarrowedReadListReachesTheBrokerAtOnce(self) -> None:
        project = os.path.join(self.env["HOME"], "project")
        os.makedirs(project)
        await self.rewrite("[sandbox]\n", '[sandbox]\nread = ["~/project"]\n')
        policy = self.service.broker.host.policy
        self.assertTrue(policy.readable(project, project))
        # The reload read the file with the service's environment: ~ is its HOME.
        self.assertEqual(self.service.holder.current.paths, self.config.paths)
        await self.rewrite('read = ["~/project"]\n', "")
        self.assertFalse(self.service.broker.host.policy.readable(project, project))

    @asyncTest
    async def test_whatNeedsARestartIsSaid(self) -> None:
        from twisted.logger import ILogObserver, globalLogPublisher

        events: list[dict[str, Any]] = []
        # Any callable observes; the stubs ask for the interface.
        observer = cast(ILogObserver, events.append)
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        await self.rewrite('listen = "tcp:0:interface=127.0.0.1"', 'listen = "tcp:0:interface=127.0.0.2"')
        restarts = [e for e in events if "restarts" in e.get("log_format", "")]
        # Said once, by the proxy, which names the endpoint it keeps.
        (warning,) = restarts
        self.assertEqual(warning["log_namespace"], "agentsandbox.egress.proxy.ProxyService")
        self.assertEqual(warning["old"], "tcp:0:interface=127.0.0.1")
        self.assertEqual(warning["new"], "tcp:0:interface=127.0.0.2")
        # The proxy keeps its port until then.
        answer = await exchange(self.proxyPort, b"CONNECT example.org:443 HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertTrue(answer.startswith(b"HTTP/1.1 403"), answer)
