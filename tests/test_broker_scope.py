"""The scope op: sizes, caps, the busctl command line, and a clear error without a user bus.

No user systemd runs on the build machine (no systemd as PID 1), so the real
StartTransientUnit path runs only where a user bus answers, else it is skipped
with the reason.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from agentsandbox.broker import scope
from agentsandbox.broker.scope import INFINITY, Caps, ScopeError
from agentsandbox.config import ConfigError, ScopeConfig
from tests.support.broker_support import (
    BrokerProcess,
    agentsandboxArgv,
    makeConfig,
    pythonEnv,
    runningBroker,
)


def test_sizes() -> None:
    assert scope.parseSize("0") == 0
    assert scope.parseSize("512") == 512
    assert scope.parseSize("1K") == 1024
    assert scope.parseSize("2m") == 2 << 20
    assert scope.parseSize("8G") == 8 << 30
    assert scope.parseSize("1T") == 1 << 40
    assert scope.parseSize("infinity") == INFINITY
    for bad in ("", "lots", "1.5G", "-1", "1GB", "1 G", "Infinity", "99999999999T"):
        with pytest.raises(ScopeError):
            scope.parseSize(bad)


def test_percent() -> None:
    assert scope.parsePercent("150%") == 150
    for bad in ("0%", "150", "-5%", "1.5%", "%"):
        with pytest.raises(ScopeError):
            scope.parsePercent(bad)


def test_capsFromConfigAndRequest() -> None:
    config = ScopeConfig(slice="lab.slice", memory_max="8G", memory_swap_max="0", cpu_quota="200%")
    assert scope.decideCaps(config, None, None) == Caps("lab.slice", 8 << 30, 0, 200)
    assert scope.decideCaps(config, "2G", "50%") == Caps("lab.slice", 2 << 30, 0, 50)
    with pytest.raises(ScopeError, match=r"above the cap scope.memory_max = 8G"):
        scope.decideCaps(config, "9G", None)
    with pytest.raises(ScopeError, match=r"above the cap scope.cpu_quota = 200%"):
        scope.decideCaps(config, None, "300%")
    with pytest.raises(ScopeError, match="not a size"):
        scope.decideCaps(config, "lots", None)
    # Without a CPU cap a requested quota only restricts, so it is allowed.
    free = ScopeConfig(memory_max="infinity")
    assert scope.decideCaps(free, "64G", "400%").cpuPercent == 400
    assert scope.decideCaps(free, None, None) == Caps("agentsandbox.slice", INFINITY, 0, None)


def test_busctlArgv() -> None:
    caps = Caps("agentsandbox.slice", 2 << 30, 0, 150)
    argv = scope.busctlArgv("/usr/bin/busctl", "agentsandbox-cap-42-abcdef.scope", 42, caps)
    assert argv == [
        "/usr/bin/busctl", "--user", "--timeout=10", "call",
        "org.freedesktop.systemd1", "/org/freedesktop/systemd1",
        "org.freedesktop.systemd1.Manager", "StartTransientUnit",
        "ssa(sv)a(sa(sv))", "agentsandbox-cap-42-abcdef.scope", "fail", "7",
        "Description", "s", "agentsandbox cap for pid 42",
        "PIDs", "au", "1", "42",
        "Slice", "s", "agentsandbox.slice",
        "MemoryMax", "t", str(2 << 30),
        "MemorySwapMax", "t", "0",
        "OOMPolicy", "s", "continue",
        "CPUQuotaPerSecUSec", "t", "1500000",
        "0",
    ]  # fmt: skip
    noCPU = scope.busctlArgv("busctl", "u.scope", 7, Caps("a.slice", INFINITY, 1024, None))
    assert "CPUQuotaPerSecUSec" not in noCPU
    assert noCPU[11] == "6"
    assert str(INFINITY) in noCPU


def test_unitNamesAndCgroupMatch() -> None:
    name = scope.unitName(42)
    assert name.startswith("agentsandbox-cap-42-") and name.endswith(".scope")
    assert scope.unitName(42) != name
    text = "0::/user.slice/user-1000.slice/user@1000.service/agentsandbox.slice/" + name + "\n"
    assert scope.inScope(text, name)
    assert not scope.inScope("0::/user.slice/other.scope\n", name)
    assert not scope.inScope("0::/x/" + name + "-evil\n", name)


def test_userBusProblem(tmp_path: os.PathLike[str]) -> None:
    assert "XDG_RUNTIME_DIR is not set" in (scope.userBusProblem({}) or "")
    missing = scope.userBusProblem({"XDG_RUNTIME_DIR": str(tmp_path)}) or ""
    assert f"no user bus at {tmp_path}/bus" in missing
    assert "loginctl enable-linger" in missing
    # An address systemd set with no bus behind it (no dbus-user-session) is no bus.
    absent = scope.userBusProblem({"DBUS_SESSION_BUS_ADDRESS": "unix:path=/x"}) or ""
    assert "no user bus at /x" in absent and "dbus-user-session" in absent
    bus = os.path.join(str(tmp_path), "bus")
    listening = socket.socket(socket.AF_UNIX)
    listening.bind(bus)
    listening.listen(1)
    try:
        assert scope.userBusProblem({"DBUS_SESSION_BUS_ADDRESS": f"unix:path={bus}"}) is None
        assert scope.userBusProblem({"XDG_RUNTIME_DIR": str(tmp_path)}) is None
    finally:
        listening.close()
    assert scope.userBusProblem({"DBUS_SESSION_BUS_ADDRESS": "unix:abstract=/x"}) is None
    assert "dbus-user-session" in scope.busHint("Failed to connect to bus: No such file or directory")
    assert scope.busHint("Unit exists") == "Unit exists"


_UNIT = "agentsandbox-cap-7-abc123.scope"
_CAPS = scope.Caps(slice="agentsandbox.slice", memoryMax=64 << 20, memorySwapMax=0, cpuPercent=None)


def _tree(root: str, files: dict[str, str]) -> str:
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    return root


def test_capProblem_v1_user_manager_is_not_enforced(tmp_path: os.PathLike[str]) -> None:
    """cgroup v1: systemd keeps a user scope's processes in the user's memory cgroup."""
    user = "/user.slice/user-1000.slice/user@1000.service"
    text = f"4:memory:/user.slice/user-1000.slice\n1:name=systemd:{user}/agentsandbox.slice/{_UNIT}\n0::{user}/agentsandbox.slice/{_UNIT}\n"
    root = _tree(str(tmp_path), {"memory/user.slice/user-1000.slice/memory.limit_in_bytes": "9223372036854771712\n"})
    problem = scope.capProblem(text, _UNIT, _CAPS, root) or ""
    assert "MemoryMax" in problem and "not in " + _UNIT in problem and "cgroup v1" in problem


def test_capProblem_v1_system_scope_is_enforced(tmp_path: os.PathLike[str]) -> None:
    text = f"4:memory:/agentsandbox.slice/{_UNIT}\n"
    root = _tree(str(tmp_path), {f"memory/agentsandbox.slice/{_UNIT}/memory.limit_in_bytes": f"{64 << 20}\n"})
    assert scope.capProblem(text, _UNIT, _CAPS, root) is None
    _tree(root, {f"memory/agentsandbox.slice/{_UNIT}/memory.limit_in_bytes": "9223372036854771712\n"})
    assert "not the cap" in (scope.capProblem(text, _UNIT, _CAPS, root) or "")


def test_capProblem_v2(tmp_path: os.PathLike[str]) -> None:
    path = f"/user.slice/user-1000.slice/user@1000.service/agentsandbox.slice/{_UNIT}"
    text = f"0::{path}\n"
    root = _tree(str(tmp_path), {"cgroup.controllers": "cpu memory pids\n"})
    # The user manager was not given the memory controller: the scope has no memory.max.
    assert "does not exist" in (scope.capProblem(text, _UNIT, _CAPS, root) or "")
    _tree(root, {path.lstrip("/") + "/memory.max": f"{64 << 20}\n"})
    assert scope.capProblem(text, _UNIT, _CAPS, root) is None
    cpu = scope.Caps(slice="s.slice", memoryMax=scope.INFINITY, memorySwapMax=0, cpuPercent=150)
    _tree(root, {path.lstrip("/") + "/cpu.max": "max 100000\n"})
    assert "CPUQuota" in (scope.capProblem(text, _UNIT, cpu, root) or "")
    _tree(root, {path.lstrip("/") + "/cpu.max": "150000 100000\n"})
    assert scope.capProblem(text, _UNIT, cpu, root) is None


def test_scopeConfigIsStrict(tmp_path: os.PathLike[str]) -> None:
    base = str(tmp_path)
    for table, why in (
        ({"slice": "../x.slice"}, "scope.slice"),
        ({"memory_max": "lots"}, "scope.memory_max"),
        ({"memory_swap_max": "1.5G"}, "scope.memory_swap_max"),
        ({"cpu_quota": "fast"}, "scope.cpu_quota"),
        ({"allow_uncapped": "yes"}, "scope.allow_uncapped"),
    ):
        with pytest.raises(ConfigError, match=why.replace(".", r"\.")):
            makeConfig(base, scope=table)


def _userBus() -> str | None:
    """Why the real scope path cannot run here, or None when it can."""
    if shutil.which("busctl") is None:
        return "busctl is not installed"
    problem = scope.userBusProblem(os.environ)
    if problem is not None:
        return problem
    result = subprocess.run(
        ["busctl", "--user", "status"], capture_output=True, timeout=10, check=False
    )
    if result.returncode != 0:
        return "the user bus does not answer: " + result.stderr.decode(errors="replace").strip()
    return None


@pytest.fixture
def scopeBroker() -> Iterator[tuple[BrokerProcess, str]]:
    with runningBroker('[scope]\nmemory_max = "1G"\ncpu_quota = "100%"\n') as running:
        yield running


def test_capWithoutAUserBusRefusesAndRunsNothing(scopeBroker: tuple[BrokerProcess, str]) -> None:
    if _userBus() is None:
        pytest.skip("a user bus answers here; the refusal is for machines without one")
    broker, base = scopeBroker
    marker = os.path.join(base, "ran")
    env = pythonEnv({"AGENTSANDBOX_SPOOL": broker.spool})
    result = subprocess.run(
        agentsandboxArgv("cap", "--memory", "512M", "--", "touch", marker),
        env=env, capture_output=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 1
    err = result.stderr.decode()
    assert "no user systemd to ask" in err
    assert "not running touch uncapped" in err
    assert not os.path.exists(marker)
    above = subprocess.run(
        agentsandboxArgv("cap", "--memory", "2G", "--", "true"), env=env, capture_output=True, timeout=60
    )
    assert above.returncode == 1
    assert b"above the cap scope.memory_max = 1G" in above.stderr


def test_capMovesTheCommandIntoAScope(scopeBroker: tuple[BrokerProcess, str]) -> None:
    why = _userBus()
    if why is not None:
        pytest.skip(f"no user systemd here, so no transient scope can start: {why}")
    broker, _base = scopeBroker
    env = pythonEnv({"AGENTSANDBOX_SPOOL": broker.spool})
    result = subprocess.run(
        agentsandboxArgv("cap", "--memory", "512M", "--", sys.executable, "-c",
                         "print(open('/proc/self/cgroup').read())"),
        env=env, capture_output=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert b"agentsandbox-cap-" in result.stdout
