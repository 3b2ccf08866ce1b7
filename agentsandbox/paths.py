"""Where things live: the XDG directories, the managed-settings directory, the spool.

Every function takes the environment it reads as an argument (defaulting to
``os.environ``) so tests can describe a whole user without touching the
process's own environment.

Stdlib only, and no ``dataclasses`` or ``typing`` at run time: the hook imports
this on every file-tool call, and those imports alone would cost more than the
hook's whole time budget.  ``Paths`` is therefore a small slotted value class.
"""

from __future__ import annotations

import os
import sys

# Importing typing costs the hook more than its decision; mypy reads this name
# as true all the same.
TYPE_CHECKING = False

if TYPE_CHECKING:
    from collections.abc import Mapping

APP = "agentsandbox"
DROP_IN_NAME = "50-agentsandbox.json"
CONFIG_ENV = "AGENTSANDBOX_CONFIG"
SYSTEM_CONFIG = "/etc/agentsandbox/config.toml"
#: The system dispatcher's registration socket (``agentsandbox-dispatch.socket``).
DISPATCH_SOCKET = "/run/agentsandbox/dispatch.sock"
DISPATCH_SOCKET_ENV = "AGENTSANDBOX_DISPATCH_SOCKET"


def managedDir() -> str:
    """Claude Code's managed-settings root on this platform."""
    if sys.platform == "darwin":
        return "/Library/Application Support/ClaudeCode"
    return "/etc/claude-code"


class Paths:
    """The per-user locations agentsandbox reads and writes (immutable)."""

    __slots__ = ("claudeDir", "configHome", "home", "runtimeDir", "stateDir")

    home: str
    configHome: str
    stateDir: str
    runtimeDir: str | None
    claudeDir: str

    def __init__(
        self, home: str, configHome: str, stateDir: str, runtimeDir: str | None, claudeDir: str
    ) -> None:
        for name, value in (
            ("home", home),
            ("configHome", configHome),
            ("stateDir", stateDir),
            ("runtimeDir", runtimeDir),
            ("claudeDir", claudeDir),
        ):
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Paths is immutable; cannot set {name}")

    def _key(self) -> tuple[str | None, ...]:
        return (self.home, self.configHome, self.stateDir, self.runtimeDir, self.claudeDir)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Paths) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __reduce__(self) -> tuple[type[Paths], tuple[str | None, ...]]:
        return (Paths, self._key())

    def __repr__(self) -> str:
        return "Paths(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in self.__slots__) + ")"

    @classmethod
    def fromEnvironment(cls, environ: Mapping[str, str] | None = None) -> Paths:
        env = os.environ if environ is None else environ
        home = env.get("HOME") or os.path.expanduser("~")
        home = os.path.normpath(home)
        configHome = env.get("XDG_CONFIG_HOME") or os.path.join(home, ".config")
        stateHome = env.get("XDG_STATE_HOME") or os.path.join(home, ".local", "state")
        runtime = env.get("XDG_RUNTIME_DIR") or None
        claude = env.get("CLAUDE_CONFIG_DIR") or os.path.join(home, ".claude")
        return cls(
            home=home,
            configHome=os.path.normpath(configHome),
            stateDir=os.path.normpath(os.path.join(stateHome, APP)),
            runtimeDir=os.path.normpath(runtime) if runtime else None,
            claudeDir=os.path.normpath(claude),
        )

    @property
    def userConfig(self) -> str:
        return os.path.join(self.configHome, APP, "config.toml")

    @property
    def configDir(self) -> str:
        return os.path.join(self.configHome, APP)

    @property
    def defaultSpool(self) -> str:
        return os.path.join(self.stateDir, "spool")

    @property
    def auditLog(self) -> str:
        return os.path.join(self.stateDir, "audit.jsonl")

    @property
    def egressDir(self) -> str | None:
        """The CA bundle and gh config the sandbox reads; None without a runtime dir."""
        if self.runtimeDir is None:
            return None
        return os.path.join(self.runtimeDir, APP, "egress")

    def expandUser(self, path: str) -> str:
        """Expand a leading ``~`` or ``~/`` against this user's home."""
        if path == "~":
            return self.home
        if path.startswith("~/"):
            # ``~//x`` is the home's ``x`` to a shell and to Node's path.join;
            # os.path.join would read the second slash as a new root (``/x``).
            return os.path.join(self.home, path[2:].lstrip("/"))
        return path


def locateConfig(explicit: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The user's config file, or None: ``--config`` > ``$AGENTSANDBOX_CONFIG`` > the user's file.

    The machine's file (``SYSTEM_CONFIG``) is not a fallback here: it is the
    bound every user's file is held to (``loader.load``, ``machine.narrow``).
    """
    env = os.environ if environ is None else environ
    if explicit:
        return explicit
    if env.get(CONFIG_ENV):
        return env[CONFIG_ENV]
    user = Paths.fromEnvironment(env).userConfig
    if os.path.exists(user):
        return user
    return None


def locateDispatchSocket(configured: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The dispatcher's registration socket a user's service tries, or None for none.

    ``$AGENTSANDBOX_DISPATCH_SOCKET`` > ``proxy.dispatch_socket`` (``configured``;
    an empty string turns the dispatcher off) > ``/run/agentsandbox/dispatch.sock``.
    """
    env = os.environ if environ is None else environ
    if env.get(DISPATCH_SOCKET_ENV):
        return env[DISPATCH_SOCKET_ENV]
    return configured or None
