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

Everything in this module is pure (stdlib, no I/O except ``userBusProblem``'s stat),
so the argv and the properties are tested without a bus.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from collections.abc import Mapping
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


def userBusProblem(environ: Mapping[str, str]) -> str | None:
    """Why no user bus can answer here, or None when one may."""
    if environ.get("DBUS_SESSION_BUS_ADDRESS"):
        return None
    runtime = environ.get("XDG_RUNTIME_DIR")
    if not runtime:
        return (
            "no user systemd to ask: XDG_RUNTIME_DIR is not set in the broker's environment, "
            "so there is no user bus (run the broker in a login session or as a systemd "
            "user service; on a server, `loginctl enable-linger USER`)"
        )
    bus = os.path.join(runtime, "bus")
    try:
        if stat.S_ISSOCK(os.stat(bus).st_mode):
            return None
    except OSError:
        pass
    return (
        f"no user systemd to ask: no user bus at {bus} (no `systemd --user` runs for this "
        "user; start one with a login session, or `loginctl enable-linger USER`)"
    )


def inScope(cgroupText: str, unit: str) -> bool:
    return any(line.endswith("/" + unit) or f"/{unit}/" in line for line in cgroupText.splitlines())
