"""The dispatcher for one user: its units, socket activation, lookup of its socket.

The many-users behaviour (real users from ``useradd``) is in test_dispatch_users.py; the
wire (``dispatchwire.py``) in test_dispatchwire.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from agentsandbox.config import ConfigError
from agentsandbox.loader import loads
from agentsandbox.paths import DISPATCH_SOCKET, Paths, locateDispatchSocket
from harness.service_process import REPO, HelloServer, ServiceProcess
from tests.support.broker_support import waitFor

DATA = REPO / "agentsandbox" / "data"


# --------------------------------------------------------------------------- where a service looks


def test_dispatch_socket_lookup_env_then_config_then_default() -> None:
    assert locateDispatchSocket(DISPATCH_SOCKET, {}) == "/run/agentsandbox/dispatch.sock"
    assert locateDispatchSocket("/srv/d.sock", {}) == "/srv/d.sock"
    assert locateDispatchSocket("/srv/d.sock", {"AGENTSANDBOX_DISPATCH_SOCKET": "/tmp/e.sock"}) == "/tmp/e.sock"
    assert locateDispatchSocket("", {}) is None


def test_config_key_dispatch_root(tmp_path: Path) -> None:
    paths = Paths.fromEnvironment({"HOME": str(tmp_path)})
    assert loads(b"", "c.toml", paths).proxy.dispatch_root is False
    assert loads(b"[proxy]\ndispatch_root = true\n", "c.toml", paths).proxy.dispatch_root is True
    assert loads(b"[proxy]\ndispatch_root = false\n", "c.toml", paths).proxy.dispatch_root is False
    for bad, kind in ((b'"yes"', "a string"), (b"1", "an integer")):
        with pytest.raises(ConfigError, match=rf"c\.toml: proxy\.dispatch_root: must be true or false, not {kind}"):
            loads(b"[proxy]\ndispatch_root = " + bad + b"\n", "c.toml", paths)
    with pytest.raises(ConfigError, match=r"proxy\.dispatch_roots: unknown key"):
        loads(b"[proxy]\ndispatch_roots = true\n", "c.toml", paths)


def test_config_key_dispatch_socket(tmp_path: Path) -> None:
    paths = Paths.fromEnvironment({"HOME": str(tmp_path)})
    assert loads(b"", "c.toml", paths).proxy.dispatch_socket == DISPATCH_SOCKET
    assert loads(b'[proxy]\ndispatch_socket = ""\n', "c.toml", paths).proxy.dispatch_socket == ""
    with pytest.raises(ConfigError, match=r"proxy\.dispatch_socket.*absolute path"):
        loads(b'[proxy]\ndispatch_socket = "run/d.sock"\n', "c.toml", paths)


# --------------------------------------------------------------------------- the units


def _verifiable(tmp: Path) -> Path:
    """The units with ExecStart pointing at a program that exists here (verify checks it)."""
    for name in ("agentsandbox-dispatch.socket", "agentsandbox-dispatch.service"):
        text = (DATA / name).read_text().replace("/usr/bin/agentsandbox dispatch", "/bin/true dispatch")
        (tmp / name).write_text(text)
    return tmp


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_units_verify_and_exposure(tmp_path: Path) -> None:
    d = _verifiable(tmp_path)
    out = subprocess.run(
        ["systemd-analyze", "verify", str(d / "agentsandbox-dispatch.socket"), str(d / "agentsandbox-dispatch.service")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0 and not out.stderr.strip(), out.stderr
    sec = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", str(DATA / "agentsandbox-dispatch.service")],
        capture_output=True, text=True,
    )  # fmt: skip
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", sec.stdout)
    assert m is not None, sec.stdout + sec.stderr
    print("systemd-analyze security --offline=yes:", m.group(1))
    assert float(m.group(1)) <= 2.0


def test_unit_contract() -> None:
    socketUnit = (DATA / "agentsandbox-dispatch.socket").read_text()
    for line in ("ListenStream=127.0.0.1:3190", "ListenStream=[::1]:3190", "ListenStream=/run/agentsandbox/dispatch.sock",
                 "SocketMode=0666", "DirectoryMode=0755"):  # fmt: skip
        assert line in socketUnit.splitlines()
    service = (DATA / "agentsandbox-dispatch.service").read_text().splitlines()
    for line in ("ExecStart=/usr/bin/agentsandbox dispatch", "DynamicUser=yes", "ProtectSystem=strict", "ProtectHome=yes",
                 "PrivateTmp=yes", "NoNewPrivileges=yes", "CapabilityBoundingSet=", "SystemCallFilter=@system-service",
                 "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK"):  # fmt: skip
        assert line in service
    # A user namespace would show every other user's uid as "nobody".
    assert "PrivateUsers=yes" not in service


# --------------------------------------------------------------------------- the command


def _agentsandbox(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agentsandbox", *args], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip


def test_status_without_a_dispatcher_says_so(tmp_path: Path) -> None:
    out = _agentsandbox("dispatch", "--status", "--socket", str(tmp_path / "none.sock"))
    assert out.returncode == 1 and "no dispatcher answers on" in out.stderr


def test_bad_port_and_taken_socket(tmp_path: Path) -> None:
    assert "not a port" in _agentsandbox("dispatch", "--port", "70000").stderr
    not_a_socket = tmp_path / "file"
    not_a_socket.write_text("")
    out = _agentsandbox("dispatch", "--port", "1", "--socket", str(not_a_socket))
    assert out.returncode == 1 and ("not a socket" in out.stderr or "cannot listen" in out.stderr), out.stderr


def test_the_dispatcher_reads_its_config_with_or_without_a_port(tmp_path: Path) -> None:
    """proxy.dispatch_root is the machine's decision: a config that cannot say it
    stops the dispatcher, whether the port comes from --port, the config or systemd."""
    bad = tmp_path / "config.toml"
    bad.write_text('[proxy]\ndispatch_root = "yes"\n')
    for args in (("--port", "1"), ()):
        out = _agentsandbox("dispatch", *args, "--socket", str(tmp_path / "d.sock"), "--config", str(bad))
        assert out.returncode == 2 and "proxy.dispatch_root: must be true or false, not a string" in out.stderr, out.stderr
        assert not (tmp_path / "d.sock").exists()


def _registerAndServeOne(path: str, answer: str) -> subprocess.Popen[str]:
    """A registration (this user) that answers the first connection it is handed."""
    code = (
        "import socket, sys\n"
        "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); s.sendall(b'{\"op\":\"register\"}\\n')\n"
        "print(s.recv(4096).decode().strip(), flush=True)\n"
        "msg, fds, _, _ = socket.recv_fds(s, 4096, 1)\n"
        "c = socket.socket(fileno=fds[0]); c.recv(65536); c.sendall(sys.argv[2].encode()); c.close()\n"
    )
    return subprocess.Popen([sys.executable, "-c", code, path, answer], stdout=subprocess.PIPE, text=True)


@pytest.mark.skipif(shutil.which("systemd-socket-activate") is None, reason="systemd-socket-activate is not installed")
def test_socket_activation_adopts_tcp_and_unix_descriptors() -> None:
    base = tempfile.mkdtemp(prefix="dispatch-activate-")
    path = os.path.join(base, "dispatch.sock")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # The machine's config, read under socket activation too: the registration
    # below is this process's, root's when the suite runs as root.
    config = os.path.join(base, "config.toml")
    with open(config, "w") as f:
        f.write("[proxy]\ndispatch_root = true\n")
    # The Unix socket first: the dispatcher sorts by family, not position.
    argv = ["systemd-socket-activate", "-E", f"PYTHONPATH={REPO}",
            "-l", path, "-l", f"127.0.0.1:{port}", "-l", f"[::1]:{port}",
            sys.executable, "-m", "agentsandbox", "dispatch", "--config", config]  # fmt: skip
    proc = ServiceProcess(argv, {**os.environ, "PYTHONPATH": str(REPO)}, base)
    hello = HelloServer()
    try:
        waitFor(lambda: os.path.exists(path), 20, "systemd-socket-activate to listen")
        status = json.loads(waitFor(lambda: _agentsandbox("dispatch", "--status", "--json", "--socket", path).stdout, 60, "status"))
        assert status["ports"] == [f"127.0.0.1:{port}", f"[::1]:{port}"]
        registered = _registerAndServeOne(path, "HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\nhi\n")
        assert registered.stdout is not None and json.loads(registered.stdout.readline())["uid"] == os.getuid()
        out = subprocess.run(
            ["curl", "-sS", "--noproxy", "", "-x", f"http://[::1]:{port}", f"http://127.0.0.1:{hello.port}/"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert out.stdout == "hi\n", out
        registered.wait(10)
        assert "dispatching" in proc.output() and "from systemd" in proc.output()
        assert "uid 0 may register" in proc.output()
    finally:
        hello.close()
        proc.kill()
        shutil.rmtree(base, ignore_errors=True)
