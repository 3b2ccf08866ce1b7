"""``agentsandbox setup`` / ``uninstall`` against a fixture HOME, and the unit files.

``systemctl`` is a small script on the PATH that records its argv (one line per
call, arguments separated by tabs) and plays a user manager that is missing,
running, or already has the unit enabled.  ``uninstall`` must leave the fixture
HOME exactly as it found it, file for file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from agentsandbox import setup as setupModule
from agentsandbox.loader import loads
from agentsandbox.paths import Paths
from agentsandbox.probes import systemRunner
from tests.conftest import REPO, User

FAKE_SYSTEMCTL = """\
#!/bin/sh
printf '%s\\t' "$@" >> "$FAKE_SYSTEMCTL_LOG"; echo >> "$FAKE_SYSTEMCTL_LOG"
mode="${FAKE_SYSTEMCTL_MODE:-running}"
if [ "$mode" = none ]; then echo "Failed to connect to bus: No medium found" >&2; exit 1; fi
if [ "$2" = is-enabled ]; then
  if [ "$mode" = enabled ]; then echo enabled; exit 0; fi
  echo disabled; exit 1
fi
if [ "$2" = show ]; then
  if [ "$mode" = crashing ]; then
    printf 'ActiveState=activating\nSubState=auto-restart\nNRestarts=3\nResult=exit-code\nActiveEnterTimestampMonotonic=0\n'
  else
    printf 'ActiveState=active\nSubState=running\nNRestarts=0\nResult=success\nActiveEnterTimestampMonotonic=1\n'
  fi
  exit 0
fi
if [ "$mode" = faildisable ] && [ "$2" = disable ]; then echo "Failed to disable unit: Access denied" >&2; exit 1; fi
exit 0
"""


class Machine:
    """The fixture user plus a fake systemctl and a managed-settings dir."""

    def __init__(self, user: User, tmp: Path, mode: str) -> None:
        self.user = user
        self.bin = tmp / "fakebin"
        self.bin.mkdir()
        systemctl = self.bin / "systemctl"
        systemctl.write_text(FAKE_SYSTEMCTL)
        systemctl.chmod(0o755)
        self.log = tmp / "systemctl.log"
        self.managed = tmp / "managed"
        self.managed.mkdir()
        self.bindir = str(Path(sys.executable).parent)
        self.env = dict(
            user.env,
            PATH=f"{self.bin}:{user.env['PATH']}",
            PYTHONPATH=str(REPO),
            AGENTSANDBOX_EXE=os.path.join(self.bindir, "agentsandbox"),
            FAKE_SYSTEMCTL_LOG=str(self.log),
            FAKE_SYSTEMCTL_MODE=mode,
            USER="tester",
        )

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "agentsandbox", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    def setup(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.cli("setup", "--managed-dir", str(self.managed), "--no-doctor", *args)

    def calls(self) -> list[list[str]]:
        if not self.log.exists():
            return []
        # `show` is setup's look at the started service (test_setup_says_when_the_service_does_not_run).
        calls = [line.rstrip("\t").split("\t") for line in self.log.read_text().splitlines()]
        return [c for c in calls if c[1:2] != ["show"]]

    @property
    def paths(self) -> Paths:
        return Paths.fromEnvironment(self.env)

    @property
    def record(self) -> dict[str, object]:
        data: dict[str, object] = json.loads((Path(self.paths.stateDir) / "install.json").read_text())
        return data

    @property
    def unit(self) -> Path:
        return self.user.home / ".config/systemd/user/agentsandbox.service"

    @property
    def dropIn(self) -> Path:
        return self.managed / "managed-settings.d" / "50-agentsandbox.json"

    def snapshot(self) -> dict[str, str]:
        """Every path under the fixture base and the managed dir, with a digest of each file."""
        out: dict[str, str] = {}
        for root in (self.user.base,):
            for dirpath, dirnames, filenames in os.walk(root):
                if Path(dirpath) == self.bin or dirpath.startswith(str(self.bin)):
                    continue
                for d in dirnames:
                    out[os.path.join(dirpath, d)] = "dir"
                for f in filenames:
                    p = os.path.join(dirpath, f)
                    if p == str(self.log):
                        continue
                    out[p] = hashlib.sha256(Path(p).read_bytes()).hexdigest()
        return out


@pytest.fixture
def machine(user: User, tmp_path: Path, request: pytest.FixtureRequest) -> Machine:
    base = tmp_path / "m"
    base.mkdir()
    return Machine(user, base, getattr(request, "param", "running"))


# --------------------------------------------------------------------------- the unit files


def test_the_shipped_user_unit_says_what_the_issue_asks() -> None:
    text = setupModule.shippedUnit(setupModule.SERVICE)
    lines = text.splitlines()
    assert "ExecStart=/usr/bin/agentsandbox-twistd --nodaemon --pidfile= --logfile=- agentsandbox" in lines
    for line in ("Restart=on-failure", "MemoryMax=1G", "NoNewPrivileges=yes", "UMask=0077",
                 "Type=exec", "WantedBy=default.target", "ExecReload=/bin/kill -HUP $MAINPID"):
        assert line in lines
    for unfit in ("ProtectHome=", "PrivateTmp=", "User=", "ProtectSystem="):
        assert not any(line.startswith(unfit) for line in lines)
    socket = setupModule.shippedUnit(setupModule.SOCKET).splitlines()
    assert "ListenStream=127.0.0.1:3190" in socket and "FileDescriptorName=proxy" in socket


def test_rendered_units_point_at_this_install() -> None:
    text = setupModule.renderService("/opt/as/bin")
    assert "ExecStart=/opt/as/bin/agentsandbox-twistd --nodaemon --pidfile= --logfile=- agentsandbox\n" in text
    assert "/usr/bin/agentsandbox-twistd" not in text
    assert "ExecStart=/opt/50%%/bin/agentsandbox-twistd " in setupModule.renderService("/opt/50%/bin")
    for bad in ("relative/bin", "/opt/my bin", "/opt/$x", '/opt/"q"'):
        with pytest.raises(setupModule.SetupError, match="absolute path without blanks"):
            setupModule.renderService(bad)
    assert "ListenStream=127.0.0.1:4555\n" in setupModule.renderSocket(4555)


def _verify(tmp_path: Path, *units: Path) -> subprocess.CompletedProcess[str]:
    # Short, whatever $TMPDIR is: systemd refuses the user units' socket paths
    # under a long runtime dir ("File name too long").
    runtime = Path(tempfile.mkdtemp(prefix="xdg-"))
    runtime.chmod(0o700)
    return subprocess.run(
        ["systemd-analyze", "--user", "verify", *map(str, units)],
        env=dict(os.environ, XDG_RUNTIME_DIR=str(runtime)),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (apt package systemd; .ci/install-deps installs it)")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    runner = bindir / "agentsandbox-twistd"
    runner.write_text("#!/bin/sh\nexit 0\n")  # verify checks that ExecStart's program exists
    runner.chmod(0o755)
    units = tmp_path / "units"
    units.mkdir()
    (units / "agentsandbox.service").write_text(setupModule.renderService(str(bindir)))
    (units / "agentsandbox.socket").write_text(setupModule.renderSocket(3190))
    p = _verify(tmp_path, units / "agentsandbox.service", units / "agentsandbox.socket")
    if p.returncode != 0 and "Failed to initialize manager" in p.stderr:
        pytest.skip(f"systemd-analyze --user cannot run here: {p.stderr.strip()}")
    assert p.returncode == 0, p.stderr
    assert p.stderr.strip() == "", p.stderr
    # The check is not vacuous: a wrong value is reported.
    (units / "agentsandbox.service").write_text(
        setupModule.renderService(str(bindir)).replace("Restart=on-failure", "Restart=sometimes")
    )
    bad = _verify(tmp_path, units / "agentsandbox.service")
    assert "Failed to parse service restart specifier" in bad.stderr


# --------------------------------------------------------------------------- setup


@pytest.mark.parametrize("machine", ["none"], indirect=True)
def test_setup_without_a_user_manager_says_so_and_carries_on(machine: Machine) -> None:
    before = machine.snapshot()
    p = machine.setup()
    assert p.returncode == 0, p.stderr
    out = p.stdout
    config = Path(machine.paths.userConfig)
    assert f"config: wrote a starter config to {config}" in out
    assert f"unit: {machine.unit}" in out
    assert "no user service manager answers here (Failed to connect to bus: No medium found)" in out
    assert "systemctl --user enable --now agentsandbox.service" in out
    assert "agentsandbox serve" in out
    assert f"drop-in: {machine.dropIn} is installed" in out
    assert machine.calls() == [["--user", "daemon-reload"]]
    # The starter config is commented, valid, and opens nothing for writing.
    text = config.read_text()
    assert "write = []" in text and "Hint:" in text
    parsed = loads(text.encode(), str(config), machine.paths)
    assert parsed.sandbox.write == () and parsed.sandbox.read == ()
    unit = machine.unit.read_text()
    assert f"ExecStart={machine.bindir}/agentsandbox-twistd --nodaemon --pidfile= --logfile=- agentsandbox" in unit
    record = machine.record
    assert sorted(record["files"]) == sorted(  # type: ignore[call-overload]
        [str(config), str(machine.unit), str(machine.dropIn), str(machine.managed / "managed-settings.json")]
    )
    assert record["enabled"] == []
    assert json.loads(machine.dropIn.read_text())["sandbox"]["enabled"] is True

    p = machine.cli("uninstall")
    assert p.returncode == 0, p.stdout + p.stderr
    assert machine.snapshot() == before
    assert machine.calls()[-1] == ["--user", "daemon-reload"]  # tried, and said why it was skipped
    assert "daemon-reload skipped" in p.stdout


def test_setup_socket_refuses_where_the_dispatcher_holds_the_port(machine: Machine, tmp_path: Path) -> None:
    """Issue 26: the user socket unit and the system dispatcher both want proxy.port."""
    sock = tmp_path / "dispatch.sock"
    sock.write_text("")
    machine.env["AGENTSANDBOX_DISPATCH_SOCKET"] = str(sock)
    p = machine.setup("--socket")
    assert p.returncode != 0
    assert f"this machine's dispatcher ({sock}) holds proxy.port 3190" in p.stderr
    assert "run setup without --socket" in p.stderr
    assert not (machine.user.home / ".config/systemd/user/agentsandbox.socket").exists()


@pytest.mark.parametrize("machine", ["crashing"], indirect=True)
def test_setup_says_when_the_service_does_not_run(machine: Machine) -> None:
    """Issue 26: a service that crash-loops after `enable --now` (no CA bundle on a minimal
    Debian) is not reported as started; setup says where to look and exits non-zero."""
    p = machine.setup()
    assert p.returncode == 1, p.stdout + p.stderr
    assert "agentsandbox.service is NOT running 3 s after it started (activating/auto-restart, 3 restarts" in p.stdout
    assert "journalctl --user -u agentsandbox.service" in p.stdout
    assert "does not run" in p.stderr


def test_setup_enables_the_unit_and_uninstall_reverses_exactly(machine: Machine) -> None:
    before = machine.snapshot()
    p = machine.setup()
    assert p.returncode == 0, p.stderr
    assert "systemd: enabled and started agentsandbox.service" in p.stdout
    assert machine.calls() == [
        ["--user", "daemon-reload"],
        ["--user", "is-enabled", "agentsandbox.service"],
        ["--user", "enable", "--now", "agentsandbox.service"],
    ]
    assert machine.record["enabled"] == ["agentsandbox.service"]
    p = machine.cli("uninstall")
    assert p.returncode == 0, p.stdout + p.stderr
    assert machine.calls()[3:] == [
        ["--user", "disable", "--now", "agentsandbox.service"],
        ["--user", "daemon-reload"],
    ]
    assert machine.snapshot() == before
    again = machine.cli("uninstall")
    assert again.returncode == 0 and "nothing to undo" in again.stdout


@pytest.mark.parametrize("machine", ["enabled"], indirect=True)
def test_a_unit_enabled_before_setup_stays_enabled_after_uninstall(machine: Machine) -> None:
    assert machine.setup().returncode == 0
    assert machine.record["enabled"] == []
    machine.cli("uninstall")
    assert not any(call[1:2] == ["disable"] for call in machine.calls())


def test_setup_twice_changes_nothing_the_second_time(machine: Machine) -> None:
    assert machine.setup().returncode == 0
    first, snap = machine.record, machine.snapshot()
    p = machine.setup()
    assert p.returncode == 0
    assert f"config: using {machine.paths.userConfig}" in p.stdout
    assert "is current" in p.stdout
    assert machine.record == first
    assert machine.snapshot() == snap


def test_uninstall_never_removes_what_setup_did_not_write(machine: Machine) -> None:
    home = machine.user.home
    own = machine.user.writeConfig('[sandbox]\nwrite = ["~/go/pkg/mod"]\n')
    (home / ".config/systemd/user").mkdir(parents=True)
    machine.unit.write_text("[Service]\nExecStart=/bin/true\n")
    (machine.managed / "managed-settings.json").write_text('{"model": "x"}\n')
    p = machine.setup()
    assert p.returncode == 0, p.stderr
    assert f"config: using {own}" in p.stdout
    assert f"left {machine.unit} as it is: setup did not write it" in p.stdout
    assert machine.unit.read_text() == "[Service]\nExecStart=/bin/true\n"
    assert sorted(machine.record["files"]) == [str(machine.dropIn)]  # type: ignore[call-overload]
    (home / ".config/agentsandbox/notes.txt").write_text("mine\n")
    p = machine.cli("uninstall")
    assert p.returncode == 0, p.stdout
    assert own.exists() and machine.unit.exists()
    assert (machine.managed / "managed-settings.json").read_text() == '{"model": "x"}\n'
    assert not machine.dropIn.exists()


def test_a_file_edited_after_setup_is_kept(machine: Machine) -> None:
    assert machine.setup().returncode == 0
    config = Path(machine.paths.userConfig)
    config.write_text(config.read_text().replace("write = []", 'write = ["~/go/pkg/mod"]'))
    p = machine.cli("uninstall")
    assert p.returncode == 0
    assert f"kept {config}: it changed after setup wrote it" in p.stdout
    assert "write = [\"~/go/pkg/mod\"]" in config.read_text()
    assert not machine.unit.exists()
    assert f"kept {config.parent}: not empty" in p.stdout


def test_a_config_named_by_the_environment_is_not_shadowed(machine: Machine, tmp_path: Path) -> None:
    named = tmp_path / "elsewhere.toml"
    named.write_text("[proxy]\nport = 4000\n")
    machine.env["AGENTSANDBOX_CONFIG"] = str(named)
    p = machine.setup()
    assert p.returncode == 0
    assert f"config: using {named}" in p.stdout
    assert not Path(machine.paths.userConfig).exists()


def test_a_broken_config_stops_setup_with_the_key(machine: Machine) -> None:
    machine.user.writeConfig("[proxy]\nprot = 1\n")
    p = machine.setup()
    assert p.returncode == 2  # the config error's status (agentsandbox.cli.EXIT_CONFIG)
    assert "proxy.prot: unknown key" in p.stderr
    assert not machine.unit.exists()


def test_a_packaged_unit_is_enabled_not_copied(machine: Machine, tmp_path: Path) -> None:
    packaged = tmp_path / "usr-lib-systemd-user"
    packaged.mkdir()
    (packaged / "agentsandbox.service").write_text(setupModule.shippedUnit(setupModule.SERVICE))
    said: list[str] = []
    s = setupModule.Setup(
        machine.env, systemRunner(machine.env), managed=str(machine.managed),
        packagedUnitDirs=[str(packaged)], say=said.append,
    )
    s.run()
    assert f"unit: using the packaged {packaged / 'agentsandbox.service'}" in said
    assert not machine.unit.exists()
    assert ["--user", "enable", "--now", "agentsandbox.service"] in machine.calls()
    assert str(machine.unit) not in s.record.files


def _unwritableManagedDir(tmp_path: Path) -> Path:
    if os.getuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o555)
        return locked / "managed"
    probe = Path("/sys/agentsandbox-test-managed")
    try:
        probe.mkdir()
    except PermissionError:
        return probe
    except OSError as e:
        pytest.skip(f"no directory root cannot write here to test the no-permission path: {e}")
    probe.rmdir()
    pytest.skip("no directory root cannot write here to test the no-permission path")


def test_without_permission_setup_prints_the_one_root_command(machine: Machine, tmp_path: Path) -> None:
    """The root command renders from the machine's config itself: nothing of the user's is staged."""
    before = machine.snapshot()
    managed = _unwritableManagedDir(tmp_path)
    p = machine.cli("setup", "--managed-dir", str(managed), "--no-doctor")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith("drop-in: no permission to write"))
    assert "never from your file" in lines[i]
    command = lines[i + 1].strip()
    assert command.startswith("sudo /") and command.endswith(f"agentsandbox install --managed-dir {managed}")
    assert lines[i + 2].strip() == "it will change:"
    assert f"+++ {managed}/managed-settings.d/50-agentsandbox.json (new)" in p.stdout
    assert not (Path(machine.paths.stateDir) / "staged").exists()
    assert not [f for f in machine.record["files"] if "staged" in f]  # type: ignore[attr-defined]
    p = machine.cli("uninstall")
    assert p.returncode == 0, p.stdout
    assert machine.snapshot() == before


def test_socket_activation(machine: Machine) -> None:
    p = machine.setup("--socket")
    assert p.returncode == 0, p.stderr
    config = Path(machine.paths.userConfig).read_text()
    assert f'listen = "{setupModule.SOCKET_LISTEN}"' in config
    socket = machine.unit.with_name("agentsandbox.socket")
    assert "ListenStream=127.0.0.1:3190\n" in socket.read_text()
    assert ["--user", "enable", "--now", "agentsandbox.service", "agentsandbox.socket"] in machine.calls()
    assert machine.cli("uninstall").returncode == 0
    assert not socket.exists()


def test_socket_activation_needs_the_listen_key(machine: Machine) -> None:
    machine.user.writeConfig("[proxy]\nport = 3190\n")
    p = machine.setup("--socket")
    assert p.returncode == 1
    assert 'proxy.listen = "systemd:domain=INET:index=0"' in p.stderr


@pytest.mark.parametrize("machine", ["faildisable"], indirect=True)
def test_what_uninstall_cannot_undo_stays_recorded(machine: Machine) -> None:
    assert machine.setup().returncode == 0
    p = machine.cli("uninstall")
    assert p.returncode == 1
    assert "could not disable agentsandbox.service: Failed to disable unit: Access denied" in p.stdout
    assert machine.record == {"version": 1, "files": {}, "dirs": [], "enabled": ["agentsandbox.service"]}
    assert not machine.unit.exists()


def test_a_damaged_record_is_refused(machine: Machine) -> None:
    state = Path(machine.paths.stateDir)
    state.mkdir(parents=True, exist_ok=True)
    (state / "install.json").write_text('{"version": 1, "files": {"/etc/passwd": 3}}')
    p = machine.cli("uninstall")
    assert p.returncode == 1 and "is malformed; fix or remove it by hand" in p.stderr
    (state / "install.json").write_text("not json")
    assert machine.setup().returncode == 1
    assert Path("/etc/passwd").exists()


def test_setup_runs_doctor(machine: Machine) -> None:
    p = machine.cli("setup", "--managed-dir", str(machine.managed))
    assert "\ndoctor:\n" in p.stdout
    assert "Claude Code drop-in" in p.stdout and "is current" in p.stdout
    assert "FAIL    broker" in p.stdout  # no service runs in this test
    assert p.returncode == 1


def test_setup_under_sudo_is_refused(machine: Machine) -> None:
    if os.geteuid() != 0:
        pytest.skip("the sudo case is about root")
    machine.env["SUDO_USER"] = "alice"
    p = machine.setup()
    assert p.returncode == 2 and "run it as alice, without sudo" in p.stderr
    assert not Path(machine.paths.userConfig).exists() and machine.calls() == []


def test_setup_on_a_package_machine_without_a_dispatcher_says_how_to_start_it(machine: Machine, tmp_path: Path) -> None:
    from agentsandbox.packaged import ROOT_ENV

    root = tmp_path / "package-machine"
    (root / "lib" / "systemd" / "system").mkdir(parents=True)
    (root / "lib" / "systemd" / "system" / "agentsandbox-dispatch.socket").write_text(
        setupModule.shippedUnit("agentsandbox-dispatch.socket")
    )
    absent = tmp_path / "no-dispatcher" / "dispatch.sock"
    env = dict(machine.env, **{ROOT_ENV: str(root), "AGENTSANDBOX_DISPATCH_SOCKET": str(absent)})
    said: list[str] = []
    setupModule.Setup(env, systemRunner(env), managed=str(machine.managed), say=said.append).run()
    lines = [s for s in said if s.startswith("dispatcher: ")]
    assert len(lines) == 1, said
    assert "not running on this package machine" in lines[0]
    assert f"`sudo agentsandbox dispatch --socket {absent}`" in lines[0] and "Order:" in lines[0]
    # Not a package machine: nothing to say.
    said.clear()
    env[ROOT_ENV] = str(tmp_path / "empty")
    setupModule.Setup(env, systemRunner(env), managed=str(machine.managed), say=said.append).run()
    assert not [s for s in said if s.startswith("dispatcher: ")], said
