"""The injection service: the CA, the injector, the token keepers and the egress dir, as one.

``InjectionService`` owns everything the terminating path needs and follows
the ``ConfigHolder`` itself: it subscribes at start (taking any swap made
since it was built), reacts only to a change of ``[[inject]]``, and
unsubscribes at stop.  It holds:

- the **token keepers** (``agentsandbox/tokens.py``), one per token source of
  ``[[inject]]``, as its child service;
- the **CA** (``tls.InjectionCA``), made in memory for exactly the injected
  hosts; a new host set on reload makes a new CA;
- the **injector** (``inject.Injector``), one object for the service's life:
  it is the proxy factory's ``ITerminator``, and a reload swaps its routes and
  CA in place, so nobody has to hand the proxy a new one;
- the **egress dir** writes (``agentsandbox/egressdir.py``): the CA certificate,
  the bundle, gh's config and the signing wrappers, at start and whenever the
  CA changes.

The injector's ``injects(host, port)`` is the one answer to "is this host
terminated?": the proxy asks it when it grants a tunnel, and ``check host``
builds an ``InjectionService`` (never started: no token fetch, no file
written) and asks the same.

The token keepers stay in ``agentsandbox/tokens.py``, beside ``config.py``
whose token sources they fetch (``doctor`` reads those sources too); this
service is their only user in the egress room.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from twisted.application.service import MultiService
from twisted.internet.defer import inlineCallbacks
from twisted.logger import Logger

from agentsandbox.config import Config
from agentsandbox.egress.dial import tcpDialer
from agentsandbox.egress.inject import Injector, routesFor
from agentsandbox.egress.interfaces import IDialer
from agentsandbox.egress.tls import InjectionCA
from agentsandbox.reload import ConfigHolder, asHolder
from agentsandbox.tokens import TokenKeepers

log = Logger(namespace="agentsandbox.egress.injection")


def injectedHosts(config: Config) -> tuple[str, ...]:
    return tuple(h for rule in config.inject for h in rule.hosts)


class InjectionService(MultiService):
    """The terminating path's state, following ``config`` (a Config or a ConfigHolder).

    ``reactor`` spawns token commands; ``clock`` (the reactor unless given)
    times the keepers and the injector's tunnels and upstreams.  ``dialer`` reaches a checked
    address (the proxy's own); ``upstreamTrust`` is the upstream trust in PEM
    (the system's roots when None; tests pass theirs here, never through config).
    ``writeEgress=False`` leaves the egress dir alone (a service that is only
    asked ``injects``).
    """

    name = "injection"

    def __init__(
        self,
        config: Config | ConfigHolder,
        reactor: Any = None,
        *,
        clock: Any = None,
        environ: Mapping[str, str] | None = None,
        dialer: IDialer | None = None,
        upstreamTrust: bytes | None = None,
        writeEgress: bool = True,
    ) -> None:
        super().__init__()
        if reactor is None:
            from twisted.internet import reactor as defaultReactor

            reactor = defaultReactor
        if dialer is None:
            dialer = tcpDialer(reactor)
        self.holder = asHolder(config)
        self.reactor = reactor
        self.clock = clock
        self.environ = dict(os.environ if environ is None else environ)
        self.writeEgress = writeEgress
        current = self.holder.current
        #: The rules the keepers, CA and routes were made for.
        self._rules = current.inject
        self.tokens = self._keepers(current)
        self.tokens.setServiceParent(self)
        self.ca = self._caFor(current, None)
        self.injector = Injector(
            self.ca,
            routesFor(current.inject, lambda rule: self.tokens.keeperFor(rule.token)),
            dialer,
            reactor,
            upstreamTrust=upstreamTrust,
            clock=clock,
        )

    def _keepers(self, config: Config) -> TokenKeepers:
        return TokenKeepers(config.inject, self.reactor, self.clock, self.environ)

    @staticmethod
    def _caFor(config: Config, ca: InjectionCA | None) -> InjectionCA | None:
        """The CA for ``config``'s injected hosts: ``ca`` when it already is, else a new one."""
        hosts = injectedHosts(config)
        if not hosts:
            return None
        if ca is not None and set(ca.hosts) == set(hosts):
            return ca
        return InjectionCA.create(hosts)

    # ------------------------------------------------------------------ lifecycle

    def startService(self) -> None:
        # A swap between construction and start found nobody subscribed yet.
        self._adopt(self.holder.current)
        self.writeEgressDir()
        self.injector.pooling = True
        self.holder.subscribe(self._configChanged)
        super().startService()

    @inlineCallbacks
    def stopService(self) -> Any:
        self.holder.unsubscribe(self._configChanged)
        yield super().stopService()
        # Pooled upstream connections would keep the process's sockets (and
        # their idle timers) past the stop.
        yield self.injector.closeIdle()

    # ------------------------------------------------------------------ reload

    def _configChanged(self, old: Config, new: Config) -> None:
        if self._adopt(new):
            log.info(
                "config: inject rules reloaded for {hosts}",
                hosts=", ".join(injectedHosts(new)) or "no host",
            )

    def _adopt(self, new: Config) -> bool:
        """Take ``new``'s inject rules unless they are the ones in force; whether it did."""
        if new.inject == self._rules:
            return False
        self._rules = new.inject
        # The old keepers go first: the new ones take their child name, and
        # the swap below happens before the reactor runs again, so no request
        # meets a route without its keeper.
        self.tokens.disownServiceParent()
        tokens = self.tokens = self._keepers(new)
        tokens.setServiceParent(self)
        previous = self.ca
        self.ca = self._caFor(new, previous)
        self.injector.swap(self.ca, routesFor(new.inject, lambda rule: tokens.keeperFor(rule.token)))
        if self.running and self.ca is not previous:
            self.writeEgressDir()
        return True

    # ------------------------------------------------------------------ the egress dir

    def writeEgressDir(self) -> None:
        """The CA certificate, bundle, gh config and signing wrappers for the sandbox."""
        if not self.writeEgress:
            return
        from agentsandbox.egressdir import writeEgressDir, writeWrappers
        from agentsandbox.policy import executable

        egress = self.holder.current.paths.egressDir
        if egress is None:
            log.warn("no XDG_RUNTIME_DIR: the egress dir (CA bundle, gh config) is not written")
            return
        writeEgressDir(egress, self.ca.pem if self.ca is not None else b"")
        writeWrappers(egress, executable())

    # ------------------------------------------------------------------ status

    def injectedRequests(self) -> int:
        """Requests sent upstream with a credential set, since start."""
        return self.injector.injectedRequests

    def tokenFigures(self) -> list[dict[str, Any]]:
        """One entry per token source, for ``status`` (never the token)."""
        return [dict(asdict(s), describe=s.describe()) for s in self.tokens.statuses()]


def injectionFor(config: Config) -> InjectionService:
    """The injection service the running service would build for ``config``, not started.

    ``check host`` asks its injector the proxy's question; nothing is fetched,
    dialled or written.
    """
    return InjectionService(config, writeEgress=False)

