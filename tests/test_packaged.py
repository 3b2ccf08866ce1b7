"""A package machine, its dispatcher's start command, and who holds the port (no root, no users).

The real two-user runs without systemd are ``tests/test_dispatch_nosystemd.py``;
here each answer is checked against machines and ``/proc`` trees made in a
directory.
"""

from __future__ import annotations

import os
from pathlib import Path

from agentsandbox import doctor
from agentsandbox.egress.dispatch import portTaken
from agentsandbox.loader import loads
from agentsandbox.packaged import ROOT_ENV, machine
from agentsandbox.paths import Paths
from agentsandbox.probes import PortHolder, portHolders

UNIT = "agentsandbox-dispatch.socket"


def _machine(root: Path, unit: str | None = None, config: bool = False, systemd: bool = False) -> dict[str, str]:
    if unit is not None:
        (root / unit).mkdir(parents=True, exist_ok=True)
        (root / unit / UNIT).write_text("[Socket]\n")
    if config:
        (root / "etc" / "agentsandbox").mkdir(parents=True, exist_ok=True)
        (root / "etc" / "agentsandbox" / "config.toml").write_text("")
    if systemd:
        (root / "run" / "systemd" / "system").mkdir(parents=True, exist_ok=True)
    return {ROOT_ENV: str(root)}


def test_a_machine_without_the_package_expects_no_dispatcher(tmp_path: Path) -> None:
    here = machine(_machine(tmp_path))
    assert not here.package and here.unit is None and here.config is None and not here.systemd


def test_the_debs_unit_with_systemd_starts_by_systemctl(tmp_path: Path) -> None:
    here = machine(_machine(tmp_path, "lib/systemd/system", config=True, systemd=True))
    assert here.package and here.systemd
    assert here.unit == str(tmp_path / "lib/systemd/system" / UNIT)
    assert here.startCommand() == "sudo systemctl enable --now agentsandbox-dispatch.socket"
    assert "`sudo systemctl enable --now agentsandbox-dispatch.socket`" in here.startAdvice()


def test_without_systemd_the_dispatcher_runs_in_the_foreground_with_the_machines_config(tmp_path: Path) -> None:
    here = machine(_machine(tmp_path, "etc/systemd/system", config=True))
    config = str(tmp_path / "etc/agentsandbox/config.toml")
    assert here.package and not here.systemd
    assert here.startCommand() == f"sudo agentsandbox dispatch --config {config}"
    assert here.startCommand("/run/x/d.sock") == f"sudo agentsandbox dispatch --config {config} --socket /run/x/d.sock"
    advice = here.startAdvice()
    assert "as root, kept running" in advice and "Order: the dispatcher first takes the port" in advice
    assert "must be stopped before the dispatcher starts and started again after it" in advice
    # A machine config alone (a hand-made one) is a package machine too.
    only = machine(_machine(tmp_path / "only", config=True))
    assert only.package and only.unit is None


def test_doctor_on_a_package_machine_without_a_dispatcher(tmp_path: Path) -> None:
    env = dict(_machine(tmp_path / "m", "lib/systemd/system", config=True), HOME=str(tmp_path))
    env["AGENTSANDBOX_DISPATCH_SOCKET"] = str(tmp_path / "absent.sock")
    config = loads(b"inject = []\n", "c.toml", Paths.fromEnvironment(env))
    waiting = doctor.checkDispatcher(config, env, {"proxy": {"mode": "dispatcher"}})
    assert waiting.status == doctor.FAIL
    assert "not running on this package machine" in waiting.detail and "your service waits for it" in waiting.detail
    assert waiting.fix is not None and f"--socket {tmp_path / 'absent.sock'}`" in waiting.fix
    bound = doctor.checkDispatcher(config, env, {"proxy": {"mode": "direct"}})
    assert "your service bound 127.0.0.1:3190 itself" in bound.detail and "stop your service" in bound.detail
    # Not a package machine: the service binds the port, as before.
    env[ROOT_ENV] = str(tmp_path / "empty")
    assert doctor.checkDispatcher(config, env, None).status == doctor.OK
    # proxy.dispatch_socket = "": no dispatcher, even on a package machine.
    env[ROOT_ENV] = str(tmp_path / "m")
    del env["AGENTSANDBOX_DISPATCH_SOCKET"]
    off = loads(b'inject = []\n[proxy]\ndispatch_socket = ""\n', "c.toml", Paths.fromEnvironment(env))
    assert doctor.checkDispatcher(off, env, None).status == doctor.OK


def _proc(tmp_path: Path, uid: int, inode: int, pid: int, cmdline: bytes) -> str:
    proc = tmp_path / "proc"
    (proc / "net").mkdir(parents=True)
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    (proc / "net" / "tcp").write_text(
        header + f"   0: 0100007F:0C76 00000000:0000 0A 00000000:00000000 00:00000000 00000000 {uid:5d}        0 {inode} 1\n"
    )
    (proc / "net" / "tcp6").write_text(header)
    fd = proc / str(pid) / "fd"
    fd.mkdir(parents=True)
    os.symlink(f"socket:[{inode}]", fd / "7")
    os.symlink("/dev/null", fd / "0")
    (proc / str(pid) / "cmdline").write_bytes(cmdline)
    (proc / "12" / "fd").mkdir(parents=True)  # another process, holding nothing of it
    return str(proc)


def test_who_holds_the_port(tmp_path: Path) -> None:
    proc = _proc(tmp_path, 54321, 8877, 4242, b"/usr/bin/python3\0-m\0agentsandbox\0\n serve\n\0")
    holders = portHolders(0x0C76, proc)
    assert holders == [PortHolder(54321, (4242,), ("/usr/bin/python3 -m agentsandbox serve",))]
    assert holders[0].describe() == "uid 54321, pid 4242: /usr/bin/python3 -m agentsandbox serve"
    assert portHolders(0x0C77, proc) == []
    said = portTaken(0x0C76, proc)
    assert said.startswith("the port is held by uid 54321, pid 4242: /usr/bin/python3 -m agentsandbox serve. ")
    assert "Recovery, in this order: stop it" in said and "as root: `kill 4242`" in said
    assert "start the dispatcher again; then start that user's service again" in said
    # Another user's process is not visible to a non-root dispatcher: the uid is still named.
    assert PortHolder(54321).describe() == "uid 54321 (its process is not visible in /proc to this user)"


def test_status_says_the_overridden_port() -> None:
    note = "proxy.port 4000 in /home/b/.config/agentsandbox/config.toml is not used: the dispatcher hands ..."
    table = doctor.statusTable({"pid": 1, "proxy": {"mode": "dispatcher", "dispatcher": {"portOverridden": note}}})
    assert f"          note: {note}" in table.splitlines()
