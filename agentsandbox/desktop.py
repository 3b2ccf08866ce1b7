"""Whether this user's session can show desktop notifications (no Twisted: ``doctor`` asks too).

The notifier (``agentsandbox/notify.py``) runs inside the service; ``doctor``
runs in the person's shell.  Both ask the same questions here: is there a
session bus, is notify-send installed, and (doctor only, with gdbus) does a
notification server own org.freedesktop.Notifications or start on demand.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Callable, Mapping

from agentsandbox.probes import Runner

NOTIFICATIONS = "org.freedesktop.Notifications"


def sessionBus(environ: Mapping[str, str]) -> str | None:
    """The user's session bus address: ``DBUS_SESSION_BUS_ADDRESS``, else ``$XDG_RUNTIME_DIR/bus``."""
    address = environ.get("DBUS_SESSION_BUS_ADDRESS")
    if address:
        return address
    runtime = environ.get("XDG_RUNTIME_DIR")
    if runtime:
        bus = os.path.join(runtime, "bus")
        try:
            if stat.S_ISSOCK(os.stat(bus).st_mode):
                return f"unix:path={bus}"
        except OSError:
            pass
    return None


def notifySend(environ: Mapping[str, str]) -> str | None:
    return shutil.which("notify-send", path=environ.get("PATH"))


def unavailable(environ: Mapping[str, str]) -> str | None:
    """Why this environment can show no notification, or None when it may."""
    if sessionBus(environ) is None:
        return "no session bus (neither DBUS_SESSION_BUS_ADDRESS nor $XDG_RUNTIME_DIR/bus)"
    if notifySend(environ) is None:
        return (
            "notify-send is not on the service's PATH (apt install libnotify-bin; with Nix, "
            "add pkgs.libnotify to services.agentsandbox.path)"
        )
    return None


def _busCall(gdbus: str, method: str, *args: str) -> list[str]:
    return [gdbus, "call", "--session", "--dest", "org.freedesktop.DBus", "--object-path", "/org/freedesktop/DBus",
            "--method", f"org.freedesktop.DBus.{method}", *args]  # fmt: skip


def desktopChannel(
    environ: Mapping[str, str], runner: Runner, which: Callable[[str], str | None]
) -> tuple[bool | None, str]:
    """(yes / no / unknown, why) for desktop notifications in this session.

    ``runner`` must run programs with ``environ`` (the session's bus address).
    """
    why = unavailable(environ)
    if why is not None:
        return False, why
    gdbus = which("gdbus")
    if gdbus is None:
        return None, "a session bus and notify-send, but whether a notification server runs is unknown " \
            "(gdbus, in libglib2.0-bin, answers that)"
    owned = runner(_busCall(gdbus, "NameHasOwner", NOTIFICATIONS))
    if owned.returncode != 0:
        return False, f"the session bus does not answer ({(owned.stderr or owned.stdout).strip()[:200]})"
    if "true" in owned.stdout:
        return True, f"a notification server owns {NOTIFICATIONS} on the session bus"
    activatable = runner(_busCall(gdbus, "ListActivatableNames"))
    if activatable.returncode == 0 and f"'{NOTIFICATIONS}'" in activatable.stdout:
        return True, f"the session bus starts a notification server on demand ({NOTIFICATIONS})"
    return False, f"no notification server on the session bus (nothing owns {NOTIFICATIONS})"
