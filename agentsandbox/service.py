"""The one reactor application, composed: watcher, injection, proxy, broker, audit log.

This module builds the children and adds them; it pushes nothing into them.
Each child is handed the one ``ConfigHolder`` (``reload.py``) and follows
reloads itself: the proxy reads ``holder.current`` per connection and
subscribes for what it keeps, ``InjectionService`` (``egress/injection.py``)
swaps the token keepers, CA and routes, and ``BrokerService`` rebuilds its
policy.  ``RestartNotice`` says which changed keys wait for a restart.

``makeService(config, reactor=...)`` returns the ``MultiService`` that twistd,
``agentsandbox serve`` and the tests run.  Every outside effect is injectable
(the reactor and clock, the resolver and dialer the proxy reaches the world
through, the upstream trust root, the peer check, ``/proc``), so the tests run
the whole application against loopback fakes without a config backdoor.
"""

from __future__ import annotations

import gc
import os
from collections import Counter
from typing import Any

from twisted.application.service import MultiService, Service
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.logger import Logger
from twisted.python.failure import Failure

from agentsandbox.approvals import controlSocket
from agentsandbox.audit import AuditLog
from agentsandbox.broker.server import BrokerService
from agentsandbox.config import Config
from agentsandbox.egress.approvals import ApprovalRegistry, configWriter
from agentsandbox.egress.control import ControlFactory, ControlService
from agentsandbox.egress.dial import tcpDialer
from agentsandbox.egress.injection import InjectionService
from agentsandbox.egress.interfaces import IDialer, IResolver
from agentsandbox.egress.proxy import EgressProxyFactory, ProxyService
from agentsandbox.egress.sessions import SessionRegistry
from agentsandbox.loader import load
from agentsandbox.notify import DesktopNotifier
from agentsandbox.oneshot import OneShotObserver
from agentsandbox.paths import Paths, locateConfig, locateDispatchSocket
from agentsandbox.policy import Policy
from agentsandbox.reload import ConfigHolder, ConfigWatcher

log = Logger(namespace="agentsandbox.service")


def freezeStartupHeap() -> None:
    """Take what start-up allocated out of the cyclic collector's sight (``gc.freeze``).

    Imports, the config and the service's objects are tens of thousands of
    objects that live as long as the process; every full collection walked
    them all, and one such collection, due every few thousand tunnels or
    exchanges, stopped the reactor for 20-26 ms here (issue 25: an exchange
    waiting on it counts above 10 ms).  Frozen, they are never walked again:
    a full collection then covers only what was allocated since, and garbage
    made later is collected as before.  The entry points that run the process
    (twistd, ``serve``) call this once the reactor runs; a collection first,
    so nothing already unreachable is kept for good.
    """
    gc.collect()
    gc.freeze()

#: Seconds a host command gets between SIGTERM and SIGKILL when the service stops.
STOP_GRACE = 2.0


class CountingAudit:
    """The audit log, counting every decision on its way through for ``status``."""

    def __init__(self, audit: AuditLog, sessions: SessionRegistry | None = None) -> None:
        self.audit = audit
        #: Which session each client address belongs to: every record of it says so.
        self.sessions = sessions if sessions is not None else SessionRegistry()
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
        session = self.sessions.of(fields.get("client"))
        if session is not None:
            fields["session"] = session
        return self.audit.record(event, **fields)

    def close(self) -> None:
        self.audit.close()


class RestartNotice(Service):
    """Says which changed keys wait for a restart: what the composition builds once.

    The audit log and the broker's spool, ops and scope are made once, from the
    config in force at start; the keys the children follow live
    (``docs/service.md`` has the table) are theirs to follow.  The proxy's
    listening endpoint is made once too, but ``ProxyService`` says so itself:
    it knows whether it was handed an endpoint of its own (then the config's
    keys do not apply) and which endpoint it keeps.
    """

    def __init__(self, holder: ConfigHolder) -> None:
        self.holder = holder

    def startService(self) -> None:
        super().startService()
        self.holder.subscribe(self._configChanged)

    def stopService(self) -> None:
        self.holder.unsubscribe(self._configChanged)
        super().stopService()

    def _configChanged(self, old: Config, new: Config) -> None:
        pending = [
            name
            for name, changed in (
                ("[broker]", new.broker != old.broker),
                ("[scope]", new.scope != old.scope),
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


class AgentSandbox(MultiService):
    """The whole service, composed: it builds the children and adds them.

    Every child is handed the one ``ConfigHolder`` and follows reloads on its
    own subscription; nothing is pushed into a child from here.  Children
    start in order and stop in reverse: the broker stops first (its in-flight
    requests are answered "broker stopping", its host commands get
    ``STOP_GRACE``), then the proxy (listening stops, tunnels close), the
    injection service (token keepers, pooled upstreams) and the watcher.
    """

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
        #: Per-session proxy credentials (their digests), registered through the broker.
        self.sessions = SessionRegistry()
        self.audit = CountingAudit(AuditLog.fromConfig(config), self.sessions)
        dialer = dialer if dialer is not None else tcpDialer(reactor)
        #: Why the proxy could not listen (None while it listens or has not tried).
        self.startFailure: str | None = None
        #: The proxy's listening port, or why it cannot listen: once per start.
        self._listening: OneShotObserver[Any] = OneShotObserver()

        if watchConfig:
            # Reloads read the file with the service's environment (home, XDG
            # dirs), the one the first load used, not whatever the process has.
            # configPath is the explicit --config (None: the usual lookup); both
            # it and the machine's file are watched, present or not.
            from agentsandbox import paths as where

            userFile = configPath or locateConfig(None, self.environ) or Paths.fromEnvironment(self.environ).userConfig
            if configPath is None:
                # The user's own config dir, so a file written there later is seen.
                try:
                    os.makedirs(os.path.dirname(userFile), mode=0o755, exist_ok=True)
                except OSError:
                    pass  # the watcher says it is not watched, and why
            self.watcher: ConfigWatcher | None = ConfigWatcher(
                self.holder,
                (userFile, where.SYSTEM_CONFIG),
                reactor,
                loader=lambda: load(configPath, self.environ),
                handleSignal=handleSignals,
            )
            self.watcher.setServiceParent(self)
        else:
            self.watcher = None
        RestartNotice(self.holder).setServiceParent(self)

        self.injection = InjectionService(
            self.holder, reactor, clock=clock, environ=self.environ, dialer=dialer, upstreamTrust=upstreamTrust
        )
        self.injection.setServiceParent(self)
        # Refused requests and withheld responses of terminated tunnels are decisions too.
        self.injection.injector.audit = self.audit.record

        self.proxyFactory = EgressProxyFactory(
            self.holder,
            reactor,
            resolver=resolver,
            dialer=dialer,
            peers=peers,
            terminator=self.injection.injector,
            audit=self.audit,  # type: ignore[arg-type]
        )
        dispatchSocket = locateDispatchSocket(config.proxy.dispatch_socket, self.environ)
        self.proxyFactory.sessions = self.sessions
        # Requests for unlisted hosts held for the person (proxy.unlisted = "ask"),
        # answered only on the control socket, never through the broker's spool.
        self.approvals = ApprovalRegistry(
            lambda: self.holder.current, clock if clock is not None else reactor,
            self.proxyFactory.record, configWriter(lambda: self.holder.current),
        )
        self.proxyFactory.approvals = self.approvals
        runtimeDir = config.paths.runtimeDir
        self.control: ControlService | None = None
        if runtimeDir is not None:
            self.control = ControlService(
                ControlFactory(self.approvals, self.proxyFactory.record), controlSocket(runtimeDir), reactor
            )
            self.control.setServiceParent(self)
        # And a desktop notification per held request, where this user's session
        # has a bus and a notification server (quietly none elsewhere).
        self.notifier = DesktopNotifier(self.approvals, reactor, self.environ)
        self.notifier.setServiceParent(self)
        self.proxy = ProxyService(
            self.proxyFactory, dispatchSocket=dispatchSocket, awaitDispatcher=awaitDispatcher(dispatchSocket, config, self.environ)
        )
        self.proxy.setServiceParent(self)

        self.broker = BrokerService(
            self.holder,
            reactor=reactor,
            clock=clock,
            procDir=procDir,
            environ=self.environ,
            stopGrace=STOP_GRACE,
            statusSources={"proxy": self.proxyFigures, "tokens": self.injection.tokenFigures,
                           "config": self.configFigures},
            sessions=self.sessions,
        )
        self.broker.setServiceParent(self)

    def configFigures(self) -> dict[str, Any]:
        if self.watcher is not None:
            return self.watcher.figures()
        current = self.holder.current
        return {"served": current.served, "watching": [], "unwatched": {}, "notices": list(current.notices)}

    # ------------------------------------------------------------------ lifecycle

    def startService(self) -> None:
        # A layout the sandbox cannot mount refuses to start, before any child does.
        Policy.fromConfig(self.holder.current, self.environ).mountPoints()
        self.startFailure = None
        if self._listening.fired:
            # A restart listens again; callers waiting already keep waiting.
            self._listening = OneShotObserver()
        super().startService()
        if self.proxy.listening is not None:
            self.proxy.listening.addCallbacks(self._listened, self._notListening)

    def _listened(self, port: Any) -> None:
        self._listening.fire(port)

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
        self._listening.fire(failure)

    @inlineCallbacks
    def stopService(self) -> Any:
        try:
            yield super().stopService()
        finally:
            self.audit.close()

    @property
    def listening(self) -> Deferred[Any]:
        """A new Deferred per caller: the proxy's listening port, or why it cannot listen."""
        return self._listening.whenFired()

    # ------------------------------------------------------------------ status

    def proxyFigures(self) -> dict[str, Any]:
        events = self.audit.events
        # Closed tunnels are counted from their audit records; open ones live,
        # so a long clone shows its bytes while it runs.
        open_ = list(self.proxyFactory.tunnels)
        return {
            **self.proxy.figures(),
            # What an unlisted host meets (status says observe loudly).
            "unlisted": self.holder.current.proxy.unlisted,
            "openTunnels": len(open_),
            "tunnelsClosed": events["tunnel"],
            "forwarded": events["forward"],
            "refused": events["refused"] + events["peer"] + events["parse"],
            "failed": events["failed"],
            "withheld": events["withheld"],
            # Unlisted hosts let through under proxy.unlisted = "observe" ("would refuse").
            "observed": events["observed"],
            "sessions": self.sessions.sessions,
            "bytesUp": self.audit.bytesUp + sum(t.up for t in open_),
            "bytesDown": self.audit.bytesDown + sum(t.down for t in open_),
            "injectedRequests": self.injection.injectedRequests(),
        }


def awaitDispatcher(dispatchSocket: str | None, config: Config, environ: dict[str, str]) -> str | None:
    """On a package machine, why the service waits for the dispatcher instead of binding
    the shared port (and the admin's command that starts it); None elsewhere."""
    from agentsandbox.packaged import machine

    here = machine(environ)
    if dispatchSocket is None or config.proxy.listen is not None or not here.package:
        return None
    return (
        f"this machine's package installed a dispatcher ({here.evidence()}), which owns 127.0.0.1:"
        f"{config.proxy.port} for every user, so this service does not bind it; start the dispatcher "
        + here.startAdvice(dispatchSocket)
    )


def makeService(config: Config, reactor: Any = None, **kwargs: Any) -> AgentSandbox:
    """The MultiService of the whole application (see ``AgentSandbox`` for the knobs)."""
    if reactor is None:
        from twisted.internet import reactor as defaultReactor

        reactor = defaultReactor
    return AgentSandbox(config, reactor, **kwargs)
