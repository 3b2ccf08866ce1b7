"""The one reactor application: proxy, broker, token keepers, config watcher, audit log.

``makeService(config, reactor=...)`` returns the ``MultiService`` that twistd,
``agentsandbox serve`` and the tests run.  Every outside effect is injectable
(the reactor and clock, the resolver and dialer the proxy reaches the world
through, the upstream trust root, the peer check, ``/proc``), so the tests run
the whole application against loopback fakes without a config backdoor.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import asdict
from typing import Any

from twisted.application.service import MultiService
from twisted.internet.defer import Deferred, fail, inlineCallbacks, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure

from agentsandbox.audit import AuditLog
from agentsandbox.broker.server import BrokerService
from agentsandbox.config import Config, load
from agentsandbox.egress.dial import tcpDialer
from agentsandbox.egress.interfaces import IDialer, IResolver
from agentsandbox.egress.proxy import EgressProxyFactory, ProxyService
from agentsandbox.paths import locateDispatchSocket
from agentsandbox.policy import Policy
from agentsandbox.reload import ConfigHolder, ConfigWatcher
from agentsandbox.tokens import TokenKeepers

log = Logger(namespace="agentsandbox.service")

#: Seconds a host command gets between SIGTERM and SIGKILL when the service stops.
STOP_GRACE = 2.0


class CountingAudit:
    """The audit log, counting every decision on its way through for ``status``."""

    def __init__(self, audit: AuditLog) -> None:
        self.audit = audit
        self.events: Counter[str] = Counter()
        self.bytesUp = 0
        self.bytesDown = 0

    def record(self, event: str, **fields: Any) -> dict[str, Any]:
        self.events[event] += 1
        up, down = fields.get("up"), fields.get("down")
        if isinstance(up, int):
            self.bytesUp += up
        if isinstance(down, int):
            self.bytesDown += down
        return self.audit.record(event, **fields)

    def close(self) -> None:
        self.audit.close()


class AgentSandbox(MultiService):
    """The whole service.  Children start in order and stop in reverse:
    the broker stops first (its in-flight requests are answered "broker
    stopping"), then the proxy (listening stops, tunnels close), the token
    keepers and the watcher."""

    def __init__(
        self,
        config: Config,
        reactor: Any,
        *,
        configPath: str | None = None,
        clock: Any = None,
        resolver: IResolver | None = None,
        dialer: IDialer | None = None,
        peers: Any = None,
        upstreamTrust: bytes | None = None,
        procDir: str = "/proc",
        environ: dict[str, str] | None = None,
        watchConfig: bool = True,
        handleSignals: bool = True,
    ) -> None:
        super().__init__()
        self.reactor = reactor
        self.environ = dict(os.environ if environ is None else environ)
        self.holder = ConfigHolder(config)
        self.audit = CountingAudit(AuditLog.fromConfig(config))
        self.dialer: IDialer = dialer if dialer is not None else tcpDialer(reactor)
        self.upstreamTrust = upstreamTrust
        self._clock = clock
        #: Why the proxy could not listen (None while it listens or has not tried).
        self.startFailure: str | None = None
        self._listeningPort: Any = None
        self._listeningFailure: Failure | None = None
        self._listeningWaiters: list[Deferred[Any]] = []

        if watchConfig:
            # Reloads read the file with the service's environment (home, XDG
            # dirs), the one the first load used, not whatever the process has.
            self.watcher: ConfigWatcher | None = ConfigWatcher(
                self.holder,
                configPath,
                reactor,
                loader=lambda: load(configPath, self.environ),
                handleSignal=handleSignals,
            )
            self.watcher.setServiceParent(self)
        else:
            self.watcher = None

        self.tokens = TokenKeepers(config.inject, reactor, clock, self.environ)
        self.tokens.setServiceParent(self)

        self.injection = _Injection(config, self.tokens, self.dialer, reactor, upstreamTrust)
        self.proxyFactory = EgressProxyFactory(
            self.holder,
            reactor,
            resolver=resolver,
            dialer=self.dialer,
            peers=peers,
            terminator=self.injection.injector,
            audit=self.audit,  # type: ignore[arg-type]
        )
        self.proxy = ProxyService(
            self.proxyFactory, dispatchSocket=locateDispatchSocket(config.proxy.dispatch_socket, self.environ)
        )
        self.proxy.setServiceParent(self)

        self.broker = BrokerService(config, reactor=reactor, clock=clock, procDir=procDir, environ=self.environ)
        self.broker.statusSources["proxy"] = self.proxyFigures
        self.broker.statusSources["tokens"] = self.tokenFigures
        self.broker.setServiceParent(self)

        self.holder.subscribe(self._configChanged)

    # ------------------------------------------------------------------ lifecycle

    def startService(self) -> None:
        config = self.holder.current
        Policy.fromConfig(config, self.environ).mountPoints()
        self.injection.writeEgressDir(config)
        self.startFailure = None
        self._listeningPort = None
        self._listeningFailure = None
        super().startService()
        if self.proxy.listening is not None:
            self.proxy.listening.addCallbacks(self._listened, self._notListening)

    def _listened(self, port: Any) -> None:
        self._listeningPort = port
        waiters, self._listeningWaiters = self._listeningWaiters, []
        for d in waiters:
            d.callback(port)

    def _notListening(self, failure: Failure) -> None:
        # Said here, once, whoever runs the service: under twistd nobody else
        # would (the Deferred's error would surface only at garbage collection,
        # leaving a service that answers the broker but proxies nothing).
        endpoint = self.proxy.endpoint or self.holder.current.proxy.endpoint
        self.startFailure = (
            f"the egress proxy cannot listen on {endpoint}: {failure.getErrorMessage()} "
            "(another agentsandbox running? change proxy.port or proxy.listen in "
            f"{self.holder.current.source})"
        )
        log.critical("{why}", why=self.startFailure)
        self._listeningFailure = failure
        waiters, self._listeningWaiters = self._listeningWaiters, []
        for d in waiters:
            d.errback(failure)

    @inlineCallbacks
    def stopService(self) -> Any:
        # A stopping broker waits for its host commands; one that ignores
        # SIGTERM (or gets it between fork and exec, where Twisted's handler
        # still eats it) would hold the stop for the whole killDelay.
        host = self.broker.host
        killDelay, host.killDelay = host.killDelay, min(host.killDelay, STOP_GRACE)
        try:
            yield super().stopService()
        finally:
            host.killDelay = killDelay
        if self.injection.injector is not None:
            yield self.injection.injector.closeIdle()
        self.audit.close()

    @property
    def listening(self) -> Deferred[Any]:
        """A new Deferred per caller: the proxy's listening port, or why it cannot listen."""
        if self._listeningPort is not None:
            return succeed(self._listeningPort)
        if self._listeningFailure is not None:
            return fail(self._listeningFailure)
        d: Deferred[Any] = Deferred()
        self._listeningWaiters.append(d)
        return d

    # ------------------------------------------------------------------ reload

    def _configChanged(self, old: Config, new: Config) -> None:
        if new.inject != old.inject:
            retired = self.tokens
            self.tokens = TokenKeepers(new.inject, self.reactor, self._clock, self.environ)
            self.tokens.setServiceParent(self)
            self.injection.rebuild(new, self.tokens)
            self.proxyFactory.terminator = self.injection.injector
            self.injection.writeEgressDir(new)
            retired.disownServiceParent()
            log.info("config: inject rules reloaded for {hosts}", hosts=", ".join(h for r in new.inject for h in r.hosts) or "no host")
        if new.sandbox != old.sandbox or new.paths != old.paths:
            # The broker's own check (a host command's cwd must be readable)
            # follows the file at once: a narrowed policy must not wait for a restart.
            self.broker.host.policy = Policy.fromConfig(new, self.environ)
        pending = [
            name
            for name, changed in (
                ("[broker]", new.broker != old.broker),
                ("[scope]", new.scope != old.scope),
                ("proxy.port/proxy.listen", new.proxy.endpoint != old.proxy.endpoint),
                ("[audit]", new.audit != old.audit),
            )
            if changed
        ]
        if pending:
            log.warn(
                "config: {what} changes take effect when the service restarts "
                "(systemctl --user restart agentsandbox)",
                what=", ".join(pending),
            )

    # ------------------------------------------------------------------ status

    def proxyFigures(self) -> dict[str, Any]:
        events = self.audit.events
        # Closed tunnels are counted from their audit records; open ones live,
        # so a long clone shows its bytes while it runs.
        open_ = list(self.proxyFactory.tunnels)
        return {
            **self.proxy.figures(),
            "openTunnels": len(open_),
            "tunnelsClosed": events["tunnel"],
            "forwarded": events["forward"],
            "refused": events["refused"] + events["peer"] + events["parse"],
            "failed": events["failed"],
            "bytesUp": self.audit.bytesUp + sum(t.up for t in open_),
            "bytesDown": self.audit.bytesDown + sum(t.down for t in open_),
            "injectedRequests": self.injection.requests(),
        }

    def tokenFigures(self) -> list[dict[str, Any]]:
        return [dict(asdict(s), describe=s.describe()) for s in self.tokens.statuses()]


class _Injection:
    """The CA and the injector, rebuilt together when the inject rules change.

    The CA is made in memory for exactly the injected hosts and never written
    anywhere but its certificate; a new host set means a new CA, so the
    egress dir is rewritten with it.
    """

    def __init__(self, config: Config, tokens: TokenKeepers, dialer: IDialer, reactor: Any, upstreamTrust: bytes | None) -> None:
        self.dialer = dialer
        self.reactor = reactor
        self.upstreamTrust = upstreamTrust
        self.injector: Any = None
        self.ca: Any = None
        self.rebuild(config, tokens)

    def rebuild(self, config: Config, tokens: TokenKeepers) -> None:
        from agentsandbox.egress.inject import Injector, routesFor
        from agentsandbox.egress.tls import InjectionCA

        hosts = tuple(h for rule in config.inject for h in rule.hosts)
        routes = routesFor(config.inject, lambda rule: tokens.keeperFor(rule.token))
        if hosts and (self.ca is None or set(self.ca.hosts) != set(hosts)):
            self.ca = InjectionCA.create(hosts)
        if not hosts:
            self.ca = None
            self.injector = None
        elif self.injector is None:
            self.injector = Injector(self.ca, routes, self.dialer, self.reactor, upstreamTrust=self.upstreamTrust)
        else:
            self.injector.swap(self.ca, routes)

    def writeEgressDir(self, config: Config) -> None:
        from agentsandbox.egressdir import writeEgressDir, writeWrappers
        from agentsandbox.policy import executable

        egress = config.paths.egressDir
        if egress is None:
            log.warn("no XDG_RUNTIME_DIR: the egress dir (CA bundle, gh config) is not written")
            return
        writeEgressDir(egress, self.ca.pem if self.ca is not None else b"")
        writeWrappers(egress, executable())

    def requests(self) -> int:
        return self.injector.injectedRequests if self.injector is not None else 0


def makeService(config: Config, reactor: Any = None, **kwargs: Any) -> AgentSandbox:
    """The MultiService of the whole application (see ``AgentSandbox`` for the knobs)."""
    if reactor is None:
        from twisted.internet import reactor as defaultReactor

        reactor = defaultReactor
    return AgentSandbox(config, reactor, **kwargs)
