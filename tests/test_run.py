"""``agentsandbox run``: real commands under real srt/bubblewrap, a real broker process.

The egress proxy here is a small loopback stand-in on the configured port that
records the request lines it gets and refuses each one (403): it shows that the
command's traffic reaches that port and nothing else.  The end-to-end runs with
the whole service are in the service tests.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from agentsandbox import probes
from agentsandbox import run as runModule
from agentsandbox.loader import loads
from agentsandbox.paths import Paths
from agentsandbox.policy import Policy
from harness.service_process import HelloServer, ServiceProcess, serveArgv
from tests.conftest import REPO, suiteEnv
from tests.support.standin import StandInProxy, freePort, startBroker, stopBroker

SRT_TOOLS = ("srt", "bwrap", "socat", "rg", "node")
CANARY = "-----BEGIN OPENSSH PRIVATE KEY----- canary-7f3a\n"
#: Credentials planted in the environment of `agentsandbox run`: none may reach the command.
PLANTED = {
    "GH_TOKEN": "ghp_plantedtoken111",
    "GITHUB_TOKEN": "ghp_plantedtoken222",
    "AWS_SECRET_ACCESS_KEY": "planted-aws-secret-333",
    "ANTHROPIC_API_KEY": "sk-ant-planted-444",
    "MY_SERVICE_API_KEY": "planted-555",
    "DB_PASSWORD": "planted-666",
}


def _needSrt() -> None:
    missing = [t for t in SRT_TOOLS if shutil.which(t) is None]
    if missing:
        pytest.skip(f"srt runs need {', '.join(missing)} on the PATH (.ci/install-deps installs them)")


@dataclass
class Host:
    """A fixture user with a config, and the service (a real broker + the stand-in proxy)."""

    base: Path
    home: Path
    work: Path
    env: dict[str, str]
    port: int
    broker: subprocess.Popen[str] | None = None
    proxy: StandInProxy | None = None
    extra: list[str] = field(default_factory=list)

    @property
    def config(self) -> Path:
        return self.home / ".config" / "agentsandbox" / "config.toml"

    def writeConfig(self, extra: str = "") -> None:
        self.config.parent.mkdir(parents=True, exist_ok=True)
        self.config.write_text(
            f'[sandbox]\nread = ["~/projects"]\nwrite = ["{self.work}"]\n'
            f'domains = ["example.org"]\n\n[proxy]\nport = {self.port}\n' + extra
        )

    def startService(self) -> None:
        self.proxy = StandInProxy(self.port)
        self.broker = startBroker(self.env)

    def stopService(self) -> None:
        if self.broker is not None:
            stopBroker(self.broker)
            self.broker = None
        if self.proxy is not None:
            self.proxy.close()
            self.proxy = None

    def run(
        self, *args: str, cwd: Path | None = None, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "agentsandbox", "run", *args],
            env=dict(self.env, **PLANTED) if env is None else env,
            cwd=str(cwd or self.work),
            capture_output=True,
            text=True,
            timeout=120,
        )


def _makeHost(base: Path) -> Host:
    base = base.resolve()
    home = base / "home"
    for d in ("projects/repo", ".ssh", ".local/state/agentsandbox/spool"):
        (home / d).mkdir(parents=True, exist_ok=True)
    (home / ".ssh" / "id_ed25519").write_text(CANARY)
    work = base / "work"
    work.mkdir()
    runtime = base / "run" / "user" / "1000"
    runtime.mkdir(parents=True)
    env = {
        "HOME": str(home),
        "XDG_RUNTIME_DIR": str(runtime),
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": str(REPO),
        "LANG": "C.UTF-8",
        "FOO_UNLISTED": "dropped",
        **suiteEnv(),
    }
    host = Host(base=base, home=home, work=work, env=env, port=freePort())
    host.writeConfig()
    return host


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    """One host whose service answers, shared by the runs that need it."""
    _needSrt()
    host = _makeHost(tmp_path_factory.mktemp("run"))
    host.startService()
    yield host
    host.stopService()


@pytest.fixture
def idle(tmp_path: Path) -> Host:
    """A host with no service running."""
    return _makeHost(tmp_path)


# --------------------------------------------------------------------------- real runs


def test_exit_status_passes_through(served: Host) -> None:
    assert served.run("--", "sh", "-c", "exit 7").returncode == 7
    assert served.run("sh", "-c", "exit 0").returncode == 0
    ok = served.run("--", "sh", "-c", "echo out; echo err >&2; exit 3")
    assert (ok.returncode, ok.stdout) == (3, "out\n")
    assert "err\n" in ok.stderr


def test_a_planted_ssh_key_is_not_readable_inside(served: Host) -> None:
    key = served.home / ".ssh" / "id_ed25519"
    p = served.run("--", "cat", str(key))
    assert p.returncode != 0
    assert "canary" not in p.stdout
    # A shell that looks for it by name under $HOME finds nothing either.
    p = served.run("--", "sh", "-c", 'cat "$HOME/.ssh/id_ed25519"; ls -a "$HOME"; grep -rl canary "$HOME" 2>/dev/null; true')
    assert "canary" not in p.stdout
    assert ".ssh" not in p.stdout.split()


def test_writes_outside_the_write_list_are_refused(served: Host) -> None:
    outside = served.base / "outside.txt"
    inHome = served.home / "projects" / "written.txt"
    p = served.run("--", "sh", "-c", f"echo x > {outside}; echo x > {inHome}; echo x > {served.work}/inside.txt")
    assert "Read-only file system" in p.stderr
    assert not outside.exists()
    assert not inHome.exists()
    assert (served.work / "inside.txt").read_text() == "x\n"


def test_the_working_directory_is_writable_when_the_policy_says_so(served: Host) -> None:
    cwd = served.base / "elsewhere"
    cwd.mkdir(exist_ok=True)
    p = served.run("--", "sh", "-c", "echo y > here.txt", cwd=cwd)
    assert p.returncode == 0, p.stderr
    assert (cwd / "here.txt").read_text() == "y\n"


def test_a_working_directory_inside_a_readable_path_stays_read_only(served: Host) -> None:
    repo = served.home / "projects" / "repo"
    p = served.run("--", "sh", "-c", "ls >/dev/null; echo z > f.txt", cwd=repo)
    assert p.returncode != 0
    assert f"inside the readable path {served.home / 'projects'}" in p.stderr
    assert not (repo / "f.txt").exists()


def test_the_environment_is_deny_by_default_and_holds_no_credential(served: Host) -> None:
    p = served.run("--", "env")
    assert p.returncode == 0, p.stderr
    seen = dict(line.split("=", 1) for line in p.stdout.splitlines() if "=" in line)
    for name, value in PLANTED.items():
        assert name not in seen
        assert value not in p.stdout
    assert "FOO_UNLISTED" not in seen
    assert seen["LANG"] == "C.UTF-8"
    assert seen["HOME"] == str(served.home)
    assert seen["AGENTSANDBOX"] == "1"
    assert seen["AGENTSANDBOX_SPOOL"] == str(served.home / ".local/state/agentsandbox/spool")
    assert seen["SANDBOX_RUNTIME"] == "1"


def test_a_broad_run_env_pattern_still_passes_no_credential(served: Host, tmp_path: Path) -> None:
    config = tmp_path / "broad.toml"
    config.write_text(served.config.read_text() + '\n[run]\nenv = ["*"]\n')
    p = served.run("--config", str(config), "--", "env")
    assert p.returncode == 0, p.stderr
    assert "FOO_UNLISTED=dropped" in p.stdout
    for name, value in PLANTED.items():
        assert f"{name}=" not in p.stdout
        assert value not in p.stdout


def test_network_goes_only_through_the_proxy(served: Host) -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed (.ci/install-deps installs it)")
    assert served.proxy is not None
    # A host listener the command tries to reach directly, bypassing the proxy.
    direct = StandInProxy(freePort())
    try:
        directPort = direct.sock.getsockname()[1]
        script = (
            "curl -sS -o /dev/null -w 'proxied=%{http_code}\\n' http://example.org/probe; "
            f"curl -sS --noproxy '*' --max-time 5 http://127.0.0.1:{directPort}/direct; echo direct=$?; "
            f"curl -sS --noproxy '*' --max-time 5 http://127.0.0.1:{served.port}/direct; echo toproxyport=$?"
        )
        p = served.run("--", "sh", "-c", script)
    finally:
        direct.close()
    assert "proxied=403" in p.stdout, (p.stdout, p.stderr)
    assert "GET http://example.org/probe HTTP/1.1" in served.proxy.lines
    assert "direct=0" not in p.stdout and "toproxyport=0" not in p.stdout
    assert direct.lines == []
    assert not any("/direct" in line for line in served.proxy.lines)


@dataclass
class RealService:
    """A host whose service is the real one (``agentsandbox serve``: proxy and broker)."""

    host: Host
    service: ServiceProcess
    listed: HelloServer
    unlisted: HelloServer


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealService]:
    _needSrt()
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed (.ci/install-deps installs it)")
    host = _makeHost(tmp_path_factory.mktemp("real"))
    listed, unlisted = HelloServer(), HelloServer()
    config = host.config.read_text().replace('domains = ["example.org"]', f'domains = ["127.0.0.1:{listed.port}"]')
    host.config.write_text(config)
    service = ServiceProcess(serveArgv(), host.env, cwd=str(host.base), logPath=str(host.base / "service.log"))
    try:
        assert service.proxyPort() == host.port
        service.brokerServing()
        yield RealService(host, service, listed, unlisted)
    finally:
        service.kill()
        listed.close()
        unlisted.close()


def test_a_listed_loopback_literal_is_reached_through_the_proxy_and_an_unlisted_one_refused(real: RealService) -> None:
    # srt's NO_PROXY names 127.0.0.1: without run's narrowing a plain curl would
    # dial the sandbox's own loopback and fail with "Couldn't connect".
    script = (
        "echo NO_PROXY=$NO_PROXY no_proxy=$no_proxy; "
        f"curl -sS http://127.0.0.1:{real.listed.port}/listed; "
        f"curl -sS -i http://127.0.0.1:{real.unlisted.port}/unlisted"
    )
    p = real.host.run("--", "sh", "-c", script)
    assert p.returncode == 0, (p.stdout, p.stderr)
    assert "NO_PROXY=localhost,::1 no_proxy=localhost,::1" in p.stdout
    assert HelloServer.BODY.decode() in p.stdout, (p.stdout, p.stderr)
    assert "HTTP/1.1 403" in p.stdout, p.stdout
    assert f"127.0.0.1:{real.unlisted.port} is not on the sandbox's allow list" in p.stdout
    assert "sandbox.domains" in p.stdout


def test_proxy_variables_are_set_inside_the_sandbox() -> None:
    argv = runModule.srtArgv("srt", "/s.json", ["cmd", "a b"], {"NO_PROXY": "localhost,::1", "no_proxy": "localhost,::1"})
    assert argv[:6] == ["srt", "--settings", "/s.json", "--", "/bin/sh", "-c"]
    assert argv[6] == "NO_PROXY=localhost,::1; no_proxy=localhost,::1; export NO_PROXY no_proxy; " + runModule.BRIDGE_WAIT
    assert argv[7:] == ["agentsandbox-run", "cmd", "a b"]
    # An empty value proxies everything, loopback included; quoting keeps it a value.
    assert runModule.insideEnv({"NO_PROXY": "", "no_proxy": ""}) == "NO_PROXY=''; no_proxy=''; export NO_PROXY no_proxy; "
    assert runModule.srtArgv("srt", "/s.json", ["cmd"])[6] == runModule.BRIDGE_WAIT


def test_print_shows_settings_and_environment_and_runs_nothing(idle: Host) -> None:
    marker = idle.work / "ran"
    p = idle.run("--print", "--", "touch", str(marker))
    assert p.returncode == 0, p.stderr
    assert not marker.exists()
    assert f'"httpProxyPort": {idle.port}' in p.stdout
    assert f'"socksProxyPort": {idle.port}' in p.stdout
    assert str(idle.home / ".ssh") not in p.stdout.split('"allowRead"')[1].split("]")[0]
    assert "LANG=C.UTF-8" in p.stdout
    assert "AGENTSANDBOX=1" in p.stdout
    assert "NO_PROXY=localhost,127.0.0.1,::1" in p.stdout.splitlines()
    for name, value in PLANTED.items():
        assert name not in p.stdout and value not in p.stdout
    assert f"srt --settings SETTINGS -- touch {marker}" in p.stdout


# --------------------------------------------------------------------------- refusals


def _pathWithout(tmp_path: Path, left: str) -> str:
    """A PATH holding every tool srt runs with except ``left``."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for tool in (*SRT_TOOLS, "sh", "bash", "env", "cat", "true"):
        found = shutil.which(tool)
        if tool != left and found:
            (bin_ / tool).symlink_to(found)
    return str(bin_)


@pytest.mark.parametrize("left", ["srt", "bwrap", "socat", "rg"])
def test_refuses_without_a_sandbox_tool(served: Host, tmp_path: Path, left: str) -> None:
    marker = served.work / f"ran-without-{left}"
    env = dict(served.env, PATH=_pathWithout(tmp_path, left))
    p = served.run("--", "touch", str(marker), env=env)
    assert p.returncode == runModule.EX_UNENFORCED == 125
    assert f"{left} is not on the PATH" in p.stderr
    assert "refusing to run" in p.stderr
    fix = dict(runModule.REQUIRED_TOOLS)[left]
    assert fix in p.stderr
    assert "proxy" not in p.stderr and "broker" not in p.stderr
    assert not marker.exists()


def test_refuses_when_the_service_does_not_answer(idle: Host) -> None:
    marker = idle.work / "ran"
    p = idle.run("--", "touch", str(marker))
    assert p.returncode == 125
    assert f"the egress proxy does not answer on 127.0.0.1:{idle.port} (proxy.port)" in p.stderr
    assert "the broker does not answer" in p.stderr
    assert "agentsandbox serve" in p.stderr and "systemctl --user start agentsandbox" in p.stderr
    assert not marker.exists()


def test_refuses_when_only_the_proxy_answers(idle: Host) -> None:
    proxy = StandInProxy(idle.port)
    try:
        p = idle.run("--", "true")
    finally:
        proxy.close()
    assert p.returncode == 125
    assert "the broker does not answer" in p.stderr
    assert "egress proxy" not in p.stderr
    assert proxy.lines == []  # the probe sends no request


def test_refuses_inside_a_sandbox(idle: Host) -> None:
    p = idle.run("--", "true", env=dict(idle.env, SANDBOX_RUNTIME="1"))
    assert p.returncode == 125
    assert "already inside a sandbox" in p.stderr


def test_usage_and_config_errors(idle: Host) -> None:
    p = idle.run()
    assert p.returncode == 2 and "give the command to run" in p.stderr
    p = idle.run("--")
    assert p.returncode == 2
    idle.config.write_text("[run]\nenv = [1]\n")
    p = idle.run("--", "true")
    assert p.returncode == 2
    assert f"{idle.config}: run.env[0]: must be a string" in p.stderr


def test_enforcement_problems_reports_every_missing_part(idle: Host) -> None:
    config = loads(idle.config.read_bytes(), str(idle.config), Paths.fromEnvironment(idle.env))
    found = runModule.enforcementProblems(
        config,
        "/nowhere",
        which=lambda name, path=None: None,
        proxyCheck=lambda port: "Connection refused",
        brokerCheck=lambda spool: "no agentsandbox broker answered",
    )
    text = [str(p) for p in found]
    assert [t.split(" ")[0] for t in text[:4]] == ["srt", "bwrap", "socat", "rg"]
    assert "Connection refused" in text[4] and "no agentsandbox broker answered" in text[5]
    assert runModule.enforcementProblems(
        config, "/x", which=lambda n, path=None: "/x/" + n, proxyCheck=lambda p: None, brokerCheck=lambda s: None
    ) == []


def test_a_dispatcher_problem_speaks_for_the_port(idle: Host) -> None:
    """Where a dispatcher is involved, run gives its diagnosis (doctor's) instead of the port probes'."""
    config = loads(idle.config.read_bytes(), str(idle.config), Paths.fromEnvironment(idle.env))
    said = runModule.Problem("the dispatcher: the dispatcher on /run/d.sock serves 127.0.0.1:3190 but no service "
                             "of uid 1000 is registered", "start the service")  # fmt: skip
    found = runModule.enforcementProblems(
        config, "/x", which=lambda n, path=None: "/x/" + n,
        proxyCheck=lambda port: pytest.fail("the port is the dispatcher's to diagnose"),
        brokerCheck=lambda s: None, dispatcher=lambda c: (True, said),
    )  # fmt: skip
    assert found == [said]
    # Served by the dispatcher: another uid's listener (the dispatcher's) is no squatter.
    assert runModule.enforcementProblems(
        config, "/x", which=lambda n, path=None: "/x/" + n, proxyCheck=lambda p: None,
        brokerCheck=lambda s: None, dispatcher=lambda c: (True, None),
    ) == []  # fmt: skip


# --------------------------------------------------------------------------- the settings file


def test_the_settings_file_is_private_and_holds_no_secret(idle: Host) -> None:
    token = "ghp_injectedtoken999"
    idle.config.write_text(
        idle.config.read_text()
        + '\n[[inject]]\nhosts = ["api.example.org"]\nformat = "Bearer {token}"\ntoken_env = "GH_TOKEN"\n'
    )
    env = {**idle.env, **PLANTED, "GH_TOKEN": token}
    config = loads(idle.config.read_bytes(), str(idle.config), Paths.fromEnvironment(env))
    policy = Policy.fromConfig(config, env, exe="/usr/bin/agentsandbox")
    settings, _ = runModule.settingsFor(policy, str(idle.work))
    directory = runModule.settingsDir(policy)
    assert directory is not None and directory.startswith(str(idle.base / "run"))
    with runModule.settingsFile(settings, directory) as path:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        text = Path(path).read_text()
    assert not os.path.exists(path)
    for value in (token, *PLANTED.values()):
        assert value not in text
    assert "GH_TOKEN" not in text
    assert settings["network"]["httpProxyPort"] == settings["network"]["socksProxyPort"] == idle.port
    assert str(idle.home) in settings["filesystem"]["denyRead"]


def test_exit_status_of_a_signalled_child() -> None:
    assert runModule.exitStatus(-9) == 137
    assert runModule.exitStatus(3) == 3


def test_refuses_a_proxy_port_held_by_another_user(idle: Host) -> None:
    setpriv = shutil.which("setpriv")
    if os.getuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv to listen on the port as another user")
    squatter = subprocess.Popen(
        [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
         "import socket,sys\ns=socket.socket()\ns.bind(('127.0.0.1', int(sys.argv[1])))\n"
         "s.listen(4)\nprint('up', flush=True)\nsys.stdin.read()",
         str(idle.port)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert squatter.stdout is not None and squatter.stdout.readline() == "up\n"
        assert "uid 65534" in (probes.proxyOwner(idle.port) or "")
        p = idle.run("--", "true")
    finally:
        squatter.kill()
        squatter.wait(10)
    assert p.returncode == 125
    assert "another user's program listens on the proxy port" in p.stderr
    assert f"port {idle.port} is held by uid 65534, not by this user (uid 0)" in p.stderr


def test_the_owner_check_reads_the_socket_table(tmp_path: Path) -> None:
    net = tmp_path / "net"
    net.mkdir()
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    row = "   0: 0100007F:0C76 00000000:0000 0A 00000000:00000000 00:00000000 00000000 {uid:>5}        0 1\n"
    (net / "tcp").write_text(header + row.format(uid=os.getuid()))
    assert probes.proxyOwner(0x0C76, str(tmp_path)) is None
    (net / "tcp").write_text(header + row.format(uid=os.getuid() + 7))
    assert f"held by uid {os.getuid() + 7}" in (probes.proxyOwner(0x0C76, str(tmp_path)) or "")
    # The system dispatcher's port (doctor's dispatcher check passed) is not a squatter.
    assert probes.proxyOwner(0x0C76, str(tmp_path), dispatched=lambda: True) is None
    assert probes.proxyOwner(0x0C77, str(tmp_path)) is None  # nobody listens: the connect check says so


def test_refuses_when_run_env_drops_path(served: Host, tmp_path: Path) -> None:
    config = tmp_path / "nopath.toml"
    config.write_text(served.config.read_text() + '\n[run]\nenv = ["HOME", "LANG"]\n')
    p = served.run("--config", str(config), "--", "true")
    assert p.returncode == 125
    assert "the command gets no PATH" in p.stderr and 'list "PATH" in [run] env' in p.stderr
