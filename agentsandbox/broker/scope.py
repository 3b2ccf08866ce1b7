"""The ``scope`` op's systemd side: sizes, caps and the StartTransientUnit call.

Why ``busctl`` and not a D-Bus library
--------------------------------------
The broker moves a requester into a transient scope with one method call,
``org.freedesktop.systemd1.Manager.StartTransientUnit``, on the *user* bus.
``busctl`` ships with systemd itself, so it is present on every machine where there
is a user systemd to ask at all, it speaks the bus's authentication and marshalling
for us, and its ``call`` verb takes the exact D-Bus signature
(``ssa(sv)a(sa(sv))``), so what we send is what the systemd documentation describes,
with nothing hand-marshalled.  A library would be a new runtime dependency for one
call a session makes rarely: ``txdbus`` is unmaintained, ``jeepney`` and
``dbus-python`` are not among the project's dependencies (twisted, cryptography,
pyOpenSSL, service-identity, zope.interface) and dbus-python wants a GLib loop.
The cost of busctl is one short process per ``cap`` call, spawned with
``reactor.spawnProcess`` like every other host action, so the reactor never blocks.

Everything in this module is pure (stdlib, no I/O except ``userBusProblem``'s stat and connect),
so the argv and the properties are tested without a bus.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from agentsandbox.config import ScopeConfig

INFINITY = 2**64 - 1
_SIZE = re.compile(r"([0-9]+)([KMGTkmgt]?)")
_PERCENT = re.compile(r"([0-9]+)%")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
#: systemd's CPUQuotaPerSecUSec: microseconds of CPU time per second of wall time.
_USEC_PER_PERCENT = 10_000


class ScopeError(ValueError):
    """A scope request that cannot be honoured; the message says why and which key."""


def parseSize(text: str) -> int:
    """Bytes for ``infinity`` or a number with an optional K, M, G or T (powers of 1024)."""
    if text == "infinity":
        return INFINITY
    m = _SIZE.fullmatch(text)
    if m is None:
        raise ScopeError(
            f"{text!r} is not a size (bytes, or a number with K, M, G or T, or infinity)"
        )
    value = int(m.group(1)) * _UNITS[m.group(2).upper()]
    if value >= INFINITY:
        raise ScopeError(f"{text!r} is too large; write infinity")
    return value


def parsePercent(text: str) -> int:
    m = _PERCENT.fullmatch(text)
    if m is None or int(m.group(1)) == 0:
        raise ScopeError(f"{text!r} is not a CPU percentage such as 150%")
    return int(m.group(1))


@dataclass(frozen=True)
class Caps:
    """What the scope gets: the config's caps, lowered where the requester asked."""

    slice: str
    memoryMax: int
    memorySwapMax: int
    cpuPercent: int | None


def decideCaps(config: ScopeConfig, memory: str | None, cpu: str | None) -> Caps:
    """The caps for a request; asking above the config's cap is refused, naming the key."""
    capMemory = parseSize(config.memory_max)
    capCPU = parsePercent(config.cpu_quota) if config.cpu_quota else None
    memoryMax = capMemory
    if memory is not None:
        asked = parseSize(memory)
        if asked > capMemory:
            raise ScopeError(
                f"memory {memory} is above the cap scope.memory_max = {config.memory_max}"
            )
        memoryMax = asked
    cpuPercent = capCPU
    if cpu is not None:
        asked = parsePercent(cpu)
        if capCPU is not None and asked > capCPU:
            raise ScopeError(f"cpu {cpu} is above the cap scope.cpu_quota = {config.cpu_quota}")
        cpuPercent = asked
    return Caps(
        slice=config.slice,
        memoryMax=memoryMax,
        memorySwapMax=parseSize(config.memory_swap_max),
        cpuPercent=cpuPercent,
    )


def unitName(pid: int, suffix: str | None = None) -> str:
    return f"agentsandbox-cap-{pid}-{suffix or secrets.token_hex(3)}.scope"


def properties(pid: int, caps: Caps) -> list[tuple[str, str, str]]:
    """(name, D-Bus type, value) for StartTransientUnit."""
    props = [
        ("Description", "s", f"agentsandbox cap for pid {pid}"),
        ("PIDs", "au", str(pid)),
        ("Slice", "s", caps.slice),
        ("MemoryMax", "t", str(caps.memoryMax)),
        ("MemorySwapMax", "t", str(caps.memorySwapMax)),
        # The kernel kills inside the scope at the cap; the other processes of the
        # scope keep running rather than the whole scope being stopped.
        ("OOMPolicy", "s", "continue"),
    ]
    if caps.cpuPercent is not None:
        props.append(("CPUQuotaPerSecUSec", "t", str(caps.cpuPercent * _USEC_PER_PERCENT)))
    return props


def busctlArgv(busctl: str, unit: str, pid: int, caps: Caps) -> list[str]:
    """The full ``busctl --user call … StartTransientUnit`` command line."""
    props = properties(pid, caps)
    argv = [
        busctl,
        "--user",
        "--timeout=10",
        "call",
        "org.freedesktop.systemd1",
        "/org/freedesktop/systemd1",
        "org.freedesktop.systemd1.Manager",
        "StartTransientUnit",
        "ssa(sv)a(sa(sv))",
        unit,
        "fail",
        str(len(props)),
    ]
    for name, kind, value in props:
        argv += [name, kind]
        if kind == "au":
            argv += ["1", value]
        else:
            argv.append(value)
    argv.append("0")  # no auxiliary units
    return argv


#: What gives a Debian user manager its bus (``/run/user/UID/bus``).
USER_BUS_PACKAGE = "dbus-user-session"
_NO_BUS_FIX = (
    f"the user bus comes with {USER_BUS_PACKAGE} (Debian: `sudo apt install {USER_BUS_PACKAGE}`, "
    "then log in again or `systemctl --user restart dbus.socket`)"
)


def _isSocket(path: str) -> bool:
    """Whether something accepts on the Unix socket at ``path`` (a socket file left by a
    manager that ran with dbus-user-session, since removed, answers nothing)."""
    try:
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            return False
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2)
            s.connect(path)
        return True
    except OSError:
        return False


def userBusProblem(environ: Mapping[str, str]) -> str | None:
    """Why no user bus can answer here, or None when one may."""
    address = environ.get("DBUS_SESSION_BUS_ADDRESS")
    if address:
        # systemd sets unix:path=$XDG_RUNTIME_DIR/bus for its services whether or not
        # a bus listens there; a path that is no socket is no bus.
        paths = re.findall(r"(?:^|;)unix:path=([^,;]+)", address)
        if paths and not any(_isSocket(p) for p in paths):
            return f"no user bus at {paths[0]} (DBUS_SESSION_BUS_ADDRESS): {_NO_BUS_FIX}"
        return None
    runtime = environ.get("XDG_RUNTIME_DIR")
    if not runtime:
        return (
            "no user systemd to ask: XDG_RUNTIME_DIR is not set in the broker's environment, "
            "so there is no user bus (run the broker in a login session or as a systemd "
            "user service; on a server, `loginctl enable-linger USER`)"
        )
    bus = os.path.join(runtime, "bus")
    if _isSocket(bus):
        return None
    return (
        f"no user systemd to ask: no user bus at {bus} (no `systemd --user` runs for this "
        f"user, or it has no bus: {_NO_BUS_FIX}; start one with a login session, or "
        "`loginctl enable-linger USER`)"
    )


def busHint(busctlError: str) -> str:
    """busctl's own error, with what to install when it is the missing user bus."""
    if "Failed to connect to bus" in busctlError:
        return f"{busctlError} ({_NO_BUS_FIX})"
    return busctlError


def _cgroupLines(text: str) -> list[tuple[str, list[str], str]]:
    lines = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            lines.append((parts[0], parts[1].split(","), parts[2]))
    return lines


def _readValue(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def capProblem(cgroupText: str, unit: str, caps: Caps, root: str = "/sys/fs/cgroup") -> str | None:
    """Why the scope's caps do not reach the kernel for this process, or None when they do.

    ``cgroupText`` is ``/proc/PID/cgroup`` once the process is in ``unit``.  The memory
    cap is in the kernel when the memory controller's cgroup of the process is the
    scope's and its limit file holds the cap: ``memory.max`` (cgroup v2, the unified
    hierarchy at ``root``) or ``memory.limit_in_bytes`` (v1, ``root/memory``).  On a
    cgroup v1 host systemd never delegates v1 controllers to a user manager, so a user
    scope has ``MemoryMax=`` in systemd's view while its processes stay in the user
    slice's memory cgroup, uncapped; where v2 is mounted at ``root`` but the user
    manager was not given the memory controller, the scope has no ``memory.max``.
    A CPU quota is checked the same way (``cpu.max`` / ``cpu.cfs_quota_us``)."""
    lines = _cgroupLines(cgroupText)
    unified = os.path.exists(os.path.join(root, "cgroup.controllers"))
    checks: list[tuple[str, str, str, str, Callable[[str], bool]]] = []
    if caps.memoryMax != INFINITY:
        want = caps.memoryMax
        checks.append(("memory", "MemoryMax", "memory.max", "memory.limit_in_bytes",
                       lambda v: v.isdigit() and 0 < int(v) <= want))  # fmt: skip
    if caps.cpuPercent is not None:
        quota = caps.cpuPercent * 1000  # µs per 100 ms period, as systemd writes it

        def cpuOK(v: str) -> bool:
            first = v.split()[0] if v.split() else ""
            return first.isdigit() and 0 < int(first) <= quota

        checks.append(("cpu", "CPUQuota", "cpu.max", "cpu.cfs_quota_us", cpuOK))
    problems = []
    for controller, prop, v2file, v1file, ok in checks:
        if unified:
            path = next((p for h, _, p in lines if h == "0"), None)
            file = os.path.join(root, (path or "/").lstrip("/"), v2file)
        else:
            path = next((p for _, names, p in lines if controller in names), None)
            file = os.path.join(root, controller, (path or "/").lstrip("/"), v1file)
        if path is None:
            problems.append(f"{prop}: no {controller} controller for this process (cgroup v{'2' if unified else '1'})")
            continue
        if not (path.endswith("/" + unit) or f"/{unit}/" in path):
            problems.append(
                f"{prop}: the {controller} controller keeps this process in {path}, not in {unit} "
                "(systemd did not delegate the controller to the user manager; on a cgroup v1 "
                "host it never does)"
            )
            continue
        value = _readValue(file)
        if value is None:
            problems.append(f"{prop}: {file} does not exist (the {controller} controller is not enabled for the user manager)")
        elif not ok(value):
            problems.append(f"{prop}: {file} holds {value}, not the cap")
    return "; ".join(problems) or None


def inScope(cgroupText: str, unit: str) -> bool:
    return any(line.endswith("/" + unit) or f"/{unit}/" in line for line in cgroupText.splitlines())
