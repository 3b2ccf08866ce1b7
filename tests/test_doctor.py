"""``agentsandbox doctor`` and ``status``: every check driven to pass and to fail.

The checks take their inputs (a runner, a lookup, paths, probes), so each is fed
real programs (the installed bwrap, srt, claude; small scripts standing in for
broken ones), a real broker process and real loopback sockets.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from agentsandbox import claude, doctor, probes
from agentsandbox.probes import systemRunner
from tests.conftest import REPO, MachineConfig, User
from tests.support.standin import StandInProxy, freePort, startBroker, stopBroker

EXE = "/usr/bin/agentsandbox"


def script(directory: Path, name: str, body: str) -> str:
    """An executable shell script standing in for a program (a broken one, an old one)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


RUN = probes.systemRunner()


def which(name: str) -> str | None:
    return shutil.which(name)


def nowhere(name: str) -> str | None:
    return None


# --------------------------------------------------------------------------- the sandbox tools


@pytest.mark.parametrize("name", sorted(doctor.TOOLS))
def test_a_tool_on_the_path_that_answers_passes(name: str) -> None:
    program = doctor.TOOLS[name][0]
    if shutil.which(program) is None:
        pytest.skip(f"{program} is not installed (.ci/install-deps installs it)")
    c = doctor.checkTool(name, which, RUN)
    assert c.status == doctor.OK, c
    assert c.detail.startswith(shutil.which(program) or "")


@pytest.mark.parametrize("name", sorted(doctor.TOOLS))
def test_a_missing_tool_fails_with_its_install_command(name: str) -> None:
    c = doctor.checkTool(name, nowhere, RUN)
    assert c.status == doctor.FAIL
    assert f"{doctor.TOOLS[name][0]} is not on the PATH" in c.detail
    assert c.fix == doctor.TOOLS[name][2]


def test_a_tool_that_does_not_run_fails(tmp_path: Path) -> None:
    broken = script(tmp_path, "rg", 'echo "rg: error while loading shared libraries" >&2; exit 127')
    c = doctor.checkTool("ripgrep", lambda n: broken, RUN)
    assert c.status == doctor.FAIL
    assert "does not run (exit status 127: rg: error while loading shared libraries)" in c.detail
    assert c.fix is not None and "apt-get install ripgrep" in c.fix


def test_bubblewrap_works_here_and_a_failing_one_names_user_namespaces(tmp_path: Path) -> None:
    real = shutil.which("bwrap")
    if real is None:
        pytest.skip("bwrap is not installed (.ci/install-deps installs bubblewrap)")
    assert doctor.checkBwrapWorks(real, RUN).status == doctor.OK
    broken = script(tmp_path, "bwrap", 'echo "bwrap: setting up uid map: Permission denied" >&2; exit 1')
    c = doctor.checkBwrapWorks(broken, RUN)
    assert c.status == doctor.FAIL
    assert "setting up uid map: Permission denied" in c.detail
    assert c.fix == doctor.BWRAP_FIX
    assert doctor.checkBwrapWorks(None, RUN).status == doctor.FAIL


def test_srt_works_here_and_a_failing_one_fails(tmp_path: Path) -> None:
    real = shutil.which("srt")
    if real is None or shutil.which("node") is None:
        pytest.skip("srt is not installed (.ci/install-deps installs it)")
    assert doctor.checkSrtWorks(real, RUN).status == doctor.OK
    broken = script(tmp_path, "srt", 'echo "Error: bwrap not found" >&2; exit 1')
    c = doctor.checkSrtWorks(broken, RUN, scratch=str(tmp_path))
    assert c.status == doctor.FAIL and "Error: bwrap not found" in c.detail
    assert c.fix is not None and "srt --debug -c true" in c.fix
    assert list(tmp_path.glob("doctor-srt-*")) == []  # the settings file is gone
    assert doctor.checkSrtWorks(None, RUN).status == doctor.FAIL


def test_srt_gets_a_settings_file_it_accepts(tmp_path: Path) -> None:
    seen: list[dict[str, object]] = []

    def recording(argv: list[str]) -> subprocess.CompletedProcess[str]:
        seen.append(json.loads(Path(argv[2]).read_text()))
        return subprocess.CompletedProcess(argv, 0, "", "")

    assert doctor.checkSrtWorks("/x/srt", recording).status == doctor.OK  # type: ignore[arg-type]
    assert seen == [doctor.MINIMAL_SRT_SETTINGS]


# --------------------------------------------------------------------------- Claude Code


def test_the_drop_in_is_held_to_the_machines_config_not_the_users(user: User, machineFile: MachineConfig,
                                                                      tmp_path: Path) -> None:
    managed = str(tmp_path / "managed")
    env = user.env
    c = doctor.checkDropIn(env, managed)
    assert c.status == doctor.FAIL and "is not installed" in c.detail
    assert c.fix is not None and c.fix.endswith("agentsandbox install") and "sudo /" in c.fix
    assert "the built-in defaults" in c.fix
    os.makedirs(managed)
    claude.install(claude.machinePolicy(env), managed)
    assert doctor.checkDropIn(env, managed).status == doctor.OK
    # The user's own file never makes the drop-in differ: it reaches the
    # sessions through the policy helper.
    user.writeConfig('[sandbox]\nread = ["~/elsewhere"]\n')
    assert doctor.checkDropIn(env, managed).status == doctor.OK
    # The machine's does.
    machineFile.write('[sandbox]\nread = ["~/projects"]\n')
    c = doctor.checkDropIn(env, managed)
    assert c.status == doctor.FAIL and "differs from what the machine's config renders" in c.detail
    assert c.fix is not None and str(machineFile.path) in c.fix


def test_address_entries_say_which_clients_need_the_proxy_set_by_hand(user: User) -> None:
    c = doctor.checkAddressEntries(user.policy('[sandbox]\ndomains = ["example.org", "*.example.com"]\n'))
    assert c.status == doctor.OK and "no IP address" in c.detail
    c = doctor.checkAddressEntries(user.policy('[sandbox]\ndomains = ["example.org", "127.0.0.1:6443", "localhost:8080"]\n'))
    assert c.status == doctor.WARN and not c.failed
    assert "'127.0.0.1:6443', 'localhost:8080'" in c.detail and "reach them through the proxy" in c.detail
    assert "sessions get NO_PROXY=::1 over the sandbox's own" in c.detail
    assert c.fix is not None
    assert "ProxyCommand='socat - PROXY:localhost:%h:%p,proxyport=3128'" in c.fix
    assert "Go programs (kubectl, gh, terraform) never proxy a loopback address" in c.fix
    assert c.fix.count("clients that ignore the proxy variables") == 1


def test_server_managed_settings_replace_the_file_tier(user: User) -> None:
    claudeDir = str(user.home / ".claude")
    assert doctor.checkServerManaged(claudeDir).status == doctor.OK
    (user.home / ".claude" / "remote-settings.json").write_text("{}")
    c = doctor.checkServerManaged(claudeDir)
    assert c.status == doctor.FAIL
    assert "ignores /etc/claude-code" in c.detail
    assert c.fix is not None and "server-managed settings" in c.fix


@pytest.mark.parametrize(
    ("printed", "status"),
    [
        ("2.1.197 (Claude Code)", doctor.WARN),
        ("2.1.331 (Claude Code)", doctor.WARN),
        ("2.1.332 (Claude Code)", doctor.OK),
        ("2.2.0 (Claude Code)", doctor.OK),
        ("10.0.1 (Claude Code)", doctor.OK),
    ],
)
def test_claude_code_version_and_on_failure(tmp_path: Path, printed: str, status: str) -> None:
    fake = script(tmp_path, "claude", f'echo "{printed}"')
    c = doctor.checkClaude(fake, RUN)
    assert c.status == status, c
    assert c.detail.startswith(printed.split(" ")[0])
    if status == doctor.WARN:
        assert c.fix == "upgrade Claude Code to 2.1.332 or later"


def test_claude_code_missing_or_broken(tmp_path: Path) -> None:
    assert doctor.checkClaude(None, RUN).status == doctor.UNKNOWN
    broken = script(tmp_path, "claude", "echo 'segfault' >&2; exit 139")
    c = doctor.checkClaude(broken, RUN)
    assert c.status == doctor.FAIL and "exit status 139: segfault" in c.detail
    garbage = script(tmp_path, "claude2", "echo 'no version here'")
    assert doctor.checkClaude(garbage, RUN).status == doctor.FAIL


def test_the_installed_claude_code_is_recognised() -> None:
    real = shutil.which("claude")
    if real is None:
        pytest.skip("Claude Code is not installed (.ci/install-claude installs it)")
    c = doctor.checkClaude(real, RUN)
    assert c.status in (doctor.OK, doctor.WARN), c


# --------------------------------------------------------------------------- the service


@pytest.fixture
def broker(user: User) -> Iterator[str]:
    """A real broker for the fixture user; yields its spool."""
    env = dict(user.env, PYTHONPATH=str(REPO))
    process = startBroker(env)
    try:
        yield str(user.home / ".local/state/agentsandbox/spool")
    finally:
        stopBroker(process)


def test_a_broker_that_answers_passes_and_reports_its_figures(broker: str) -> None:
    c, report = doctor.checkBroker(broker)
    assert c.status == doctor.OK, c
    assert report is not None and isinstance(report["pid"], int)
    assert f"pid {report['pid']}" in c.detail


def test_no_broker_fails_with_the_fix(user: User) -> None:
    spool = str(user.home / ".local/state/agentsandbox/spool")
    c, report = doctor.checkBroker(spool, lambda s, op: probes.askBroker(s, op, timeout=0.3))
    assert c.status == doctor.FAIL and report is None
    assert "no agentsandbox broker answered" in c.detail
    assert c.fix == doctor.SERVICE_FIX


def test_the_proxy_port_accepting_or_not() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        assert doctor.checkProxy(port).status == doctor.OK
    c = doctor.checkProxy(port)
    assert c.status == doctor.FAIL
    assert f"127.0.0.1:{port} (proxy.port)" in c.detail and c.fix == doctor.SERVICE_FIX


def test_same_user_for_the_proxy_listener_and_the_broker() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        assert probes.listenerUids(port) == {os.getuid()}
        assert doctor.checkSameUser(port, os.getpid()).status == doctor.OK
        other = os.getuid() + 4242
        c = doctor.checkSameUser(port, os.getpid(), uid=other)
        assert c.status == doctor.FAIL
        assert f"port {port} is held by uid {os.getuid()}, not {other}" in c.detail
        assert f"runs as uid {os.getuid()}, not {other}" in c.detail
    c = doctor.checkSameUser(port, None)
    assert c.status == doctor.FAIL
    assert "no listening socket" in c.detail and "did not say its pid" in c.detail


def test_same_user_reads_a_socket_table(tmp_path: Path) -> None:
    net = tmp_path / "net"
    net.mkdir()
    (tmp_path / "77").mkdir()
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    (net / "tcp").write_text(
        header
        + "   0: 0100007F:0C76 00000000:0000 0A 00000000:00000000 00:00000000 00000000   999        0 1\n"
        + "   1: 0100007F:0C76 0100007F:9999 01 00000000:00000000 00:00000000 00000000  1000        0 2\n"
    )
    (net / "tcp6").write_text(header)
    assert probes.listenerUids(0x0C76, str(tmp_path)) == {999}
    c = doctor.checkSameUser(0x0C76, 77, uid=999, procDir=str(tmp_path))
    assert c.status == (doctor.OK if os.stat(tmp_path / "77").st_uid == 999 else doctor.FAIL)
    c = doctor.checkSameUser(0x0C76, 78, uid=1000, procDir=str(tmp_path))
    assert "held by uid 999, not 1000" in c.detail and "process 78 is not in" in c.detail


def test_tokens_from_the_service_report(user: User) -> None:
    rules = user.config(
        '[[inject]]\nhosts = ["github.com", "api.github.com"]\nformat = "token {token}"\n'
        'token_command = ["gh", "auth", "token"]\n\n'
        '[[inject]]\nhosts = ["api.example.org"]\nformat = "Bearer {token}"\ntoken_env = "EXAMPLE_TOKEN"\n\n'
        '[[inject]]\nhosts = ["files.example.net"]\nformat = "Bearer {token}"\ntoken_file = "~/.example-token"\n'
    ).inject
    unknown = doctor.checkTokens(rules, None)
    assert [c.status for c in unknown] == [doctor.UNKNOWN] * 3
    assert "not answering" in unknown[0].detail
    assert [c.status for c in doctor.checkTokens(rules, {"pid": 1})] == [doctor.UNKNOWN] * 3
    report = {
        "tokens": [
            {"source": "command gh auth token", "hosts": ["github.com", "api.github.com"], "present": True, "age": 3.0},
            {"source": "environment variable EXAMPLE_TOKEN", "hosts": ["api.example.org"], "present": False,
             "lastError": "EXAMPLE_TOKEN is not set", "failures": 2},
            {"source": "file", "hosts": ["files.example.net"], "present": False, "lastError": None},
        ]
    }
    checks = doctor.checkTokens(rules, report)
    assert [c.status for c in checks] == [doctor.OK, doctor.FAIL, doctor.FAIL]
    assert checks[0].name == "token for github.com, api.github.com"
    assert "EXAMPLE_TOKEN is not set" in checks[1].detail
    assert checks[1].fix is not None and "systemctl --user set-environment EXAMPLE_TOKEN" in checks[1].fix
    assert "not fetched yet" in checks[2].detail
    assert checks[2].fix == f"put the token in {user.home}/.example-token (mode 0600)"
    failing = {"tokens": [{"hosts": ["github.com"], "present": False, "lastError": "gh: not logged in"}]}
    gh = doctor.checkTokens(rules[:1], failing)[0]
    assert gh.status == doctor.FAIL and gh.fix is not None and "gh auth login" in gh.fix
    assert doctor.checkTokens(rules[:1], {"tokens": []})[0].status == doctor.UNKNOWN


def _fakeGh(tmp_path: Path, body: str) -> dict[str, str]:
    bindir = tmp_path / "gh-bin"
    bindir.mkdir(exist_ok=True)
    gh = bindir / "gh"
    gh.write_text("#!/bin/sh\n" + body + "\n")
    gh.chmod(0o755)
    return {"PATH": f"{bindir}:/usr/bin:/bin", "HOME": str(tmp_path)}


def test_the_builtin_github_rule_warns_without_a_login_and_fails_nothing(user: User, tmp_path: Path) -> None:
    config = user.config('[sandbox]\ndomains = ["github.com", "*.github.com"]\n')
    assert config.inject_builtin and all(r.builtin for r in config.inject)
    builtin = doctor.checkBuiltinGithub(config)
    assert builtin is not None and builtin.status == doctor.OK
    assert "github.com, api.github.com, uploads.github.com" in builtin.detail
    # The service says gh gave nothing: a warning, and the fix names both ways out.
    failing = {"tokens": [{"hosts": ["github.com", "api.github.com", "uploads.github.com"], "present": False,
                           "lastError": "gh auth token: exit status 4"}]}  # fmt: skip
    checks = doctor.checkTokens(config.inject, failing, source=config.source)
    assert [c.status for c in checks] == [doctor.WARN, doctor.WARN]
    assert "inactive" in checks[0].detail and "exit status 4" in checks[0].detail
    fix = checks[0].fix or ""
    assert "`gh auth login`" in fix and f"`inject = []` in {config.source}" in fix
    # The service is not answering: doctor asks a fake gh on the PATH itself, as this user.
    notLoggedIn = systemRunner(_fakeGh(tmp_path, 'echo "not logged into any GitHub hosts" >&2; exit 1'))
    checks = doctor.checkTokens(config.inject, None, notLoggedIn, config.source)
    assert [c.status for c in checks] == [doctor.WARN, doctor.WARN]
    assert "not logged into any GitHub hosts" in checks[0].detail
    assert not any(c.failed for c in checks)
    empty = systemRunner(_fakeGh(tmp_path, "exit 0"))
    assert [c.status for c in doctor.checkTokens(config.inject, None, empty, config.source)] == [doctor.WARN] * 2
    loggedIn = systemRunner(_fakeGh(tmp_path, 'echo "gho_fake0token0for0doctor"'))
    checks = doctor.checkTokens(config.inject, None, loggedIn, config.source)
    assert [c.status for c in checks] == [doctor.OK, doctor.OK]
    assert "gives a token" in checks[0].detail and "gho_" not in checks[0].detail
    present = {"tokens": [{"hosts": ["github.com"], "present": True}]}
    assert doctor.checkTokens(config.inject[:1], present)[0].status == doctor.OK


def test_the_builtin_github_rule_without_a_github_host_is_inactive_with_a_warning(user: User) -> None:
    config = user.config('[sandbox]\ndomains = ["example.org"]\n')
    assert config.inject_builtin and config.inject == ()
    c = doctor.checkBuiltinGithub(config)
    assert c is not None and c.status == doctor.WARN and not c.failed
    assert "admits none of github.com, api.github.com, uploads.github.com" in c.detail
    assert c.fix is not None and "`gh auth login`" in c.fix and f"`inject = []` in {config.source}" in c.fix
    # Only the allowed GitHub hosts are covered.
    narrow = user.config('[sandbox]\ndomains = ["github.com"]\n')
    assert [r.hosts for r in narrow.inject] == [("github.com",)]
    # A config that names its inject has no built-in rule to speak of.
    assert doctor.checkBuiltinGithub(user.config('inject = []\n[sandbox]\ndomains = ["github.com"]\n')) is None


def test_an_explicit_rule_without_its_token_still_fails(user: User, tmp_path: Path) -> None:
    config = user.config(
        '[sandbox]\ndomains = ["github.com"]\n\n'
        '[[inject]]\nhosts = ["github.com"]\nformat = "token {token}"\ntoken_command = ["gh", "auth", "token"]\n'
    )
    assert not config.inject_builtin and not config.inject[0].builtin
    assert doctor.checkBuiltinGithub(config) is None
    failing = {"tokens": [{"hosts": ["github.com"], "present": False, "lastError": "gh: not logged in"}]}
    c = doctor.checkTokens(config.inject, failing, source=config.source)[0]
    assert c.status == doctor.FAIL and c.fix is not None and "gh auth login" in c.fix
    # Not probed here: an explicit rule's state is the service's to report.
    runner = systemRunner(_fakeGh(tmp_path, 'echo "gho_fake0token"'))
    assert doctor.checkTokens(config.inject, None, runner, config.source)[0].status == doctor.UNKNOWN


def _certificatePEM() -> bytes:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "doctor test CA")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM)


def test_the_ca_bundle(tmp_path: Path) -> None:
    assert doctor.checkBundle(None).status == doctor.FAIL
    egress = tmp_path / "egress"
    c = doctor.checkBundle(str(egress))
    assert c.status == doctor.FAIL and "No such file" in c.detail
    egress.mkdir()
    (egress / "bundle.pem").write_bytes(b"not a certificate\n")
    assert "holds no certificate" in doctor.checkBundle(str(egress)).detail
    (egress / "bundle.pem").write_bytes(_certificatePEM())
    assert doctor.checkBundle(str(egress)).status == doctor.OK
    if os.getuid() != 0:  # root reads a 0000 file anyway
        (egress / "bundle.pem").chmod(0)
        assert "Permission denied" in doctor.checkBundle(str(egress)).detail


# --------------------------------------------------------------------------- the command


def _doctorEnv(user: User) -> dict[str, str]:
    return dict(user.env, PYTHONPATH=str(REPO), AGENTSANDBOX_EXE=EXE)


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agentsandbox", *args], env=env, capture_output=True, text=True, timeout=120
    )


def _needSandboxTools() -> None:
    missing = [t for t in ("srt", "bwrap", "socat", "rg", "node") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"doctor's full run needs {', '.join(missing)} (.ci/install-deps installs them)")


def test_doctor_passes_when_everything_is_in_place(user: User, tmp_path: Path, shortDir: Path) -> None:
    _needSandboxTools()
    port = freePort()
    user.writeConfig(f'inject = []\n\n[sandbox]\ndomains = ["example.org"]\n\n[proxy]\nport = {port}\n')
    managed = tmp_path / "managed"
    managed.mkdir()
    # srt makes its bridge sockets in $TMPDIR: a long one (the package build's) overflows them.
    env = dict(_doctorEnv(user), TMPDIR=str(shortDir))
    installed = _cli(env, "install", "--managed-dir", str(managed))
    assert installed.returncode == 0, installed.stderr
    egress = user.runtime / "agentsandbox" / "egress"
    egress.mkdir(parents=True)
    (egress / "bundle.pem").write_bytes(_certificatePEM())
    proxy = StandInProxy(port)
    broker = startBroker(env)
    try:
        p = _cli(env, "doctor", "--managed-dir", str(managed))
        j = _cli(env, "doctor", "--managed-dir", str(managed), "--json")
    finally:
        stopBroker(broker)
        proxy.close()
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.endswith("all checks passed\n")
    assert proxy.lines == []  # doctor's probe is not a request
    checks = {c["name"]: c for c in json.loads(j.stdout)}
    assert j.returncode == 0
    for name in ("bubblewrap", "socat", "ripgrep", "srt", "bubblewrap works", "srt works", "config",
                 "Claude Code drop-in", "server-managed settings", "broker", "egress proxy", "same user",
                 "CA bundle"):
        assert checks[name]["status"] == "ok", checks[name]
    assert checks["Claude Code"]["status"] in ("ok", "warn", "unknown")


def test_doctor_fails_with_each_fix_when_nothing_is_set_up(user: User, tmp_path: Path) -> None:
    port = freePort()
    user.writeConfig(f"[proxy]\nport = {port}\n")
    (user.home / ".claude" / "remote-settings.json").write_text("{}")
    env = _doctorEnv(user)
    env["PATH"] = str(tmp_path / "empty-bin")  # doctor itself starts by its absolute path
    p = _cli(env, "doctor", "--managed-dir", str(tmp_path / "managed"))
    assert p.returncode == 1
    out = p.stdout
    for line in (
        "FAIL    bubblewrap", "FAIL    srt ", "FAIL    Claude Code drop-in", "FAIL    server-managed settings",
        "FAIL    broker", "FAIL    egress proxy", "FAIL    CA bundle",
        "warn    token for github.com", "unknown Claude Code",
    ):
        assert line in out, (line, out)
    # No gh on the PATH: the built-in GitHub rule is inactive, a warning whose fix offers both ways.
    assert "`gh auth login`" in out and "`inject = []`" in out
    assert "same user" not in out  # nothing to compare without a service
    assert out.count("fix: ") >= 7
    assert out.rstrip().endswith("checks failed")


def test_doctor_reports_a_broken_config(user: User) -> None:
    user.writeConfig("[proxy]\nprot = 1\n")
    env = dict(user.env, PYTHONPATH=str(REPO))
    p = _cli(env, "doctor", "--json")
    assert p.returncode == 2  # the config error's status (agentsandbox.cli.EXIT_CONFIG)
    checks = {c["name"]: c for c in json.loads(p.stdout)}
    assert checks["config"]["status"] == "FAIL"
    assert "proxy.prot: unknown key" in checks["config"]["detail"]
    assert "broker" not in checks  # nothing that needs the config is checked


# --------------------------------------------------------------------------- status


SAMPLE = {
    "pid": 4321,
    "uptime": 3725.5,
    "inFlight": 1,
    "spool": "/home/u/.local/state/agentsandbox/spool",
    "requests": {"ping": {"ok": 3}, "sign": {"ok": 2, "error": 1}, "run": {"dropped": 1}},
    "proxy": {"openTunnels": 2, "refused": 5, "bytesUp": 100, "injectedRequests": 7, "listening": "127.0.0.1:3190"},
    "tokens": [
        {"source": "command gh auth token", "hosts": ["github.com", "api.github.com"], "present": True, "age": 61},
        {"source": "environment variable X", "hosts": ["api.example.org"], "present": False, "lastError": "X is not set"},
    ],
    "extraFigure": {"a": 1, "b": None, "c": ["x", "y"]},
    "requesters": {"sandboxed": 5, "host": 2},
}


def test_the_status_table() -> None:
    text = doctor.statusTable(SAMPLE)
    lines = text.splitlines()
    assert lines[0] == "service   pid 4321, up 1h02m, 1 in flight"
    assert "spool     /home/u/.local/state/agentsandbox/spool" in lines
    header = next(line for line in lines if line.startswith("requests"))
    assert header.split() == ["requests", "op", "dropped", "error", "ok"]
    sign = next(line for line in lines if line.split()[:1] == ["sign"])
    assert sign.split() == ["sign", "0", "1", "2"]
    assert any(line.split() == ["proxy", "bytesUp", "100"] for line in lines)
    assert any(line.split() == ["injectedRequests", "7"] for line in lines)
    assert "tokens    github.com, api.github.com: present, fetched 61s ago; from command gh auth token" in lines
    assert any("api.example.org: MISSING; from environment variable X; last error: X is not set" in line for line in lines)
    # No JSON and no Twisted reprs in the table: nested figures read as words.
    assert "extraFigure  a 1, b none, c x, y" in lines
    assert any(line.split() == ["listening", "127.0.0.1:3190"] for line in lines)
    assert "requesters   host 2, sandboxed 5" in lines
    assert not any(ch in text for ch in '{}"'), text
    assert doctor.statusTable({"pid": 1, "requests": {}}).splitlines()[-1] == "requests  none yet"


def test_the_status_table_says_first_that_the_machine_only_observes() -> None:
    observing = {**SAMPLE, "proxy": {**SAMPLE["proxy"], "unlisted": "observe"}}  # type: ignore[dict-item]
    assert doctor.statusTable(observing).startswith("OBSERVING, NOT ENFORCING")
    assert "OBSERVING" not in doctor.statusTable({**SAMPLE, "proxy": {**SAMPLE["proxy"], "unlisted": "ask"}})  # type: ignore[dict-item]


def test_status_from_a_running_broker(user: User, broker: str) -> None:
    env = dict(user.env, PYTHONPATH=str(REPO))
    assert _cli(env, "ask", "ping").returncode == 0
    p = _cli(env, "status")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("service   pid ")
    assert any(line.split()[:2] == ["ping", "1"] or (line.split()[-1:] == ["1"] and "ping" in line)
               for line in p.stdout.splitlines())
    j = _cli(env, "status", "--json")
    data = json.loads(j.stdout)
    assert data["requests"]["ping"]["ok"] >= 1
    assert data["spool"] == broker


def test_status_without_a_service(user: User) -> None:
    env = dict(user.env, PYTHONPATH=str(REPO))
    p = _cli(env, "status")
    assert p.returncode == 1
    assert "no agentsandbox broker answered" in p.stderr
    assert "fix: start the service" in p.stderr
    user.writeConfig("[broker]\nspool = 3\n")
    assert _cli(env, "status").returncode == 2



def _shows(stdout: str, code: int = 0) -> probes.Runner:
    def run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(list(argv), code, stdout, "")

    return run


def test_the_user_service_check_names_a_crash_loop_and_its_journal() -> None:
    """Issue 26: a crash-looping service made doctor blame the broker with no word of why."""
    looping = doctor.checkService(_shows("LoadState=loaded\nActiveState=activating\nSubState=auto-restart\nNRestarts=7\nResult=exit-code\n"))
    assert looping is not None and looping.failed
    assert "activating/auto-restart after 7 restarts" in looping.detail
    assert looping.fix is not None and "journalctl --user -u agentsandbox" in looping.fix
    running = doctor.checkService(_shows("LoadState=loaded\nActiveState=active\nSubState=running\nNRestarts=0\nResult=success\n"))
    assert running is not None and running.status == doctor.OK
    assert doctor.checkService(_shows("", code=1)) is None  # no user manager answers: no check


def test_the_user_bus_check_names_dbus_user_session(tmp_path: Path) -> None:
    check = doctor.checkUserBus({"XDG_RUNTIME_DIR": str(tmp_path)})
    assert check.status == doctor.WARN and not check.failed
    assert check.fix is not None and "dbus-user-session" in check.fix
    bus = socket.socket(socket.AF_UNIX)
    bus.bind(str(tmp_path / "bus"))
    bus.listen(1)
    try:
        assert doctor.checkUserBus({"XDG_RUNTIME_DIR": str(tmp_path)}).status == doctor.OK
    finally:
        bus.close()


# --------------------------------------------------------------------------- answering (issue 28)


def test_observe_mode_is_a_loud_warning(user: User) -> None:
    from agentsandbox.loader import load

    user.writeConfig('[proxy]\nunlisted = "refuse"\n')
    assert doctor.checkUnlisted(load(None, user.env)) is None
    user.writeConfig('[proxy]\nunlisted = "observe"\n')
    check = doctor.checkUnlisted(load(None, user.env))
    assert check is not None and check.status == "warn"
    assert "OBSERVING, NOT ENFORCING" in check.detail and "agentsandbox suggest" in (check.fix or "")


@pytest.mark.parametrize(
    ("mode", "answers", "status", "words"),
    [
        ("ask", None, "ok", "`watch` answer here"),
        ("ask", "nothing listens on X", "FAIL", "nobody can answer: nothing listens on X"),
        ("refuse", "nothing listens on X", "ok", 'not needed while proxy.unlisted = "refuse"'),
    ],
)
def test_the_command_line_channel_is_the_control_socket(
    user: User, mode: str, answers: str | None, status: str, words: str
) -> None:
    from agentsandbox.loader import load

    user.writeConfig(f'[proxy]\nunlisted = "{mode}"\n')
    config = load(None, user.env)
    checks = doctor.checkChannels(config, {"PATH": os.environ["PATH"]}, RUN, which, lambda path: answers)
    cli = checks[0]
    assert (cli.name, cli.status) == ("answering: approve, watch", status) and words in cli.detail
