"""Is this a package machine, and how is its dispatcher started?

A machine where the .deb or the NixOS module installed agentsandbox shares one
proxy port among every user through the system dispatcher (docs/dispatch.md).
This module owns the one answer to "does this machine expect a dispatcher?"
and to "what starts it here?", which the service (wait for the dispatcher
rather than take the shared port), ``doctor``, ``setup`` and ``run`` all ask:

* a **package machine** has the dispatcher's socket unit in a system unit
  directory (the .deb: ``/lib/systemd/system``; NixOS: ``/etc/systemd/system``)
  or a machine config at ``/etc/agentsandbox/config.toml``;
* **systemd runs** when ``/run/systemd/system`` is a directory (sd_booted's test);
* the **start command** is ``systemctl enable --now agentsandbox-dispatch.socket``
  where systemd runs and the unit is installed, else ``agentsandbox dispatch``
  in the foreground, as root, with the machine's config.

``$AGENTSANDBOX_MACHINE_ROOT`` moves the root these paths are looked for
under (tests make a package machine in a directory, and the test suite
points it at an empty one so that a package installed meanwhile by another
run does not change what its services do).  It decides only whether a
service waits for a dispatcher or binds the port, and what doctor says; a
user can choose the same with ``proxy.dispatch_socket`` anyway.

Stdlib only: ``run`` and ``doctor`` import it before any Twisted.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass

from agentsandbox.paths import DISPATCH_SOCKET, SYSTEM_CONFIG

ROOT_ENV = "AGENTSANDBOX_MACHINE_ROOT"
#: The dispatcher's socket unit, as the packages install it.
DISPATCH_UNIT = "agentsandbox-dispatch.socket"
#: Where system units live (an admin's, the runtime's, the distribution's), root-relative.
UNIT_DIRS = ("etc/systemd/system", "run/systemd/system", "usr/lib/systemd/system", "lib/systemd/system")
#: What exists when systemd is the init system (sd_booted(3)), root-relative.
SYSTEMD_MARK = "run/systemd/system"


@dataclass(frozen=True)
class Machine:
    """What this machine's packages laid down for the dispatcher."""

    #: The dispatcher's socket unit file, when a package installed it.
    unit: str | None
    #: The machine's config, when it exists.
    config: str | None
    #: Whether systemd runs (and would start the unit).
    systemd: bool

    @property
    def package(self) -> bool:
        """Whether this machine expects the system dispatcher to own the proxy port."""
        return self.unit is not None or self.config is not None

    def evidence(self) -> str:
        found = [f"the dispatcher's unit {self.unit}"] if self.unit else []
        if self.config:
            found.append(f"the machine config {self.config}")
        return " and ".join(found) or "nothing of the package"

    def startCommand(self, socketPath: str | None = None) -> str:
        """The one root command that starts the dispatcher here."""
        if self.systemd and self.unit is not None:
            return f"sudo systemctl enable --now {DISPATCH_UNIT}"
        argv = ["sudo", "agentsandbox", "dispatch"]
        if self.config is not None:
            argv += ["--config", self.config]
        if socketPath is not None and socketPath != DISPATCH_SOCKET:
            argv += ["--socket", socketPath]
        return shlex.join(argv)

    def startAdvice(self, socketPath: str | None = None) -> str:
        """How to start the dispatcher, and its order relative to users' services."""
        command = self.startCommand(socketPath)
        if self.systemd and self.unit is not None:
            return (
                f"as root: `{command}` (users' services waiting for it register within a second; "
                "one that bound the port itself must be restarted after it)"
            )
        return (
            f"as root, kept running (a terminal, tmux, or the init system's own service): `{command}`. "
            "Order: the dispatcher first takes the port; users' services started before it wait and "
            "register within a second of its start, in any order. A service that holds the port "
            "itself (proxy.dispatch_socket = \"\", or started before the package) must be stopped "
            "before the dispatcher starts and started again after it"
        )


def machine(environ: Mapping[str, str] | None = None) -> Machine:
    """This machine, as the packages left it (under ``$AGENTSANDBOX_MACHINE_ROOT``, default /)."""
    env = os.environ if environ is None else environ
    root = env.get(ROOT_ENV) or os.environ.get(ROOT_ENV) or "/"
    unit = next(
        (p for p in (os.path.join(root, d, DISPATCH_UNIT) for d in UNIT_DIRS) if os.path.exists(p)),
        None,
    )
    config = os.path.join(root, SYSTEM_CONFIG.lstrip("/"))
    return Machine(
        unit=unit,
        config=config if os.path.exists(config) else None,
        systemd=os.path.isdir(os.path.join(root, SYSTEMD_MARK)),
    )
