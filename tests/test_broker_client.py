"""The wire format, the stdlib client and the client commands (no reactor here).

A broker, where one is needed, runs as a child process (``agentsandbox broker``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest

from agentsandbox.broker import client
from agentsandbox.broker import spool as wire
from agentsandbox.broker.spool import Reply, Request, WireError
from tests.support.broker_support import (
    REPO,
    BrokerProcess,
    agentsandboxArgv,
    launcher,
    pythonEnv,
    runningBroker,
)

# --------------------------------------------------------------------------- wire


def test_idsAndNames() -> None:
    rid = wire.newId()
    assert len(rid) == 24 and wire.isId(rid)
    assert wire.newId() != rid
    assert wire.splitName(rid + ".req") == (rid, ".req")
    assert wire.splitName(rid + ".reply.tmp") == (rid, ".reply.tmp")
    assert wire.splitName(rid + ".reply") == (rid, ".reply")
    for bad in ("x.req", rid.upper() + ".req", rid + ".exe", "../" + rid + ".req", rid + "0.req"):
        assert wire.splitName(bad) is None


def test_requestAndReplyRoundTrip() -> None:
    request = Request(
        op="run", args=("a", "b c"), input=b"\x00\xff", stream=True, memory="1G", cpu="50%", key="k"
    )
    assert wire.parseRequest(request.toJSON()) == request
    assert wire.parseRequest(Request(op="ping").toJSON()) == Request(op="ping")
    reply = Reply(error=None, out=b"\x00bin\xff", err=b"e", code=3)
    assert wire.parseReply(reply.toJSON()) == reply
    assert wire.parseReply(b"{}") == Reply()


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"x" * (wire.REQUEST_LIMIT + 1), "over 1048576 bytes"),
        (b"{", "malformed request"),
        (b'"ping"', "not a JSON object"),
        (b'{"op": ""}', "no 'op'"),
        (b'{"op": "ping", "extra": 1}', "unknown field 'extra'"),
        (b'{"op": "ping", "args": {}}', "'args' must be a list"),
        (b'{"op": "ping", "memory": 5}', "'memory' must be a str"),
        (b'{"op": "ping", "input": "@@"}', "not base64"),
        (b'{"op": "ping", "args": ["\\u0000"]}', "NUL"),
        (b"\xc3\x28", "not UTF-8"),
    ],
)
def test_badRequests(raw: bytes, why: str) -> None:
    with pytest.raises(WireError, match=why.replace("(", r"\(")):
        wire.parseRequest(raw)


@pytest.mark.parametrize(
    "raw",
    [b"nope", b"[]", b'{"error": 1}', b'{"code": "1"}', b'{"code": true}', b'{"out": 5}', b'{"out": "!"}'],
)
def test_badReplies(raw: bytes) -> None:
    with pytest.raises(WireError):
        wire.parseReply(raw)


def test_signShapes() -> None:
    assert wire.checkGpgArgs(["--status-fd=2", "-bsau", "Test <t@example.org>"]) == "Test <t@example.org>"
    for bad in (
        [],
        ["--status-fd=1", "-bsau", "K"],
        ["--status-fd=2", "-bsau"],
        ["--status-fd=2", "-bsau", "K", "x"],
        ["--status-fd=2", "--verify", "K"],
        ["--status-fd=2", "-bsau", ""],
        ["--status-fd=2", "-bsau", "--homedir=/x"],
        ["--status-fd=2", "-bsau", "K\x7f"],
    ):
        with pytest.raises(WireError):
            wire.checkGpgArgs(bad)
    assert wire.checkSshArgs(["-Y", "sign", "-n", "git", "-f", "/k"]) == "/k"
    assert wire.checkSshArgs(["-Y", "sign", "-n", "git", "-f", "/k", "-U"]) == "/k"
    for bad in (
        ["-Y", "sign", "-n", "file", "-f", "/k"],
        ["-Y", "verify", "-n", "git", "-f", "/k"],
        ["-Y", "sign", "-n", "git", "-f", ""],
        ["-Y", "sign", "-n", "git", "-f", "/k", "-O", "x"],
    ):
        with pytest.raises(WireError):
            wire.checkSshArgs(bad)
    assert wire.publicKeyOf("ssh-ed25519 AAAAC3Nz me@example.org\n") == "ssh-ed25519 AAAAC3Nz"
    assert wire.publicKeyOf("key::ssh-ed25519 AAAAC3Nz") == "ssh-ed25519 AAAAC3Nz"
    assert wire.publicKeyOf("-----BEGIN OPENSSH PRIVATE KEY-----") is None
    assert wire.publicKeyOf("") is None


# --------------------------------------------------------------------------- client alone


def test_noBrokerIsDistinctNamesTheSpoolAndCleansUp(tmp_path: os.PathLike[str]) -> None:
    spool = os.path.join(str(tmp_path), "spool")
    with pytest.raises(client.NoBroker) as caught:
        client.call(Request(op="ping"), spool, 0.05)
    assert spool in str(caught.value)
    assert isinstance(caught.value, client.BrokerError)
    assert os.listdir(spool) == []
    assert os.stat(spool).st_mode & 0o777 == 0o700
    # The backoff poll (no inotify) gives the same answer.
    with pytest.raises(client.NoBroker):
        client.call(Request(op="ping"), spool, 0.05, useInotify=False)
    assert os.listdir(spool) == []


def test_aSpoolOthersCanWriteIsRefused(tmp_path: os.PathLike[str]) -> None:
    spool = os.path.join(str(tmp_path), "spool")
    os.mkdir(spool)
    os.chmod(spool, 0o777)
    with pytest.raises(client.BrokerError, match="writable by others"):
        client.call(Request(op="ping"), spool, 0.05)


def test_aPlantedReplySymlinkIsRefused(tmp_path: os.PathLike[str]) -> None:
    spool = os.path.join(str(tmp_path), "spool")

    def plant(rid: str) -> None:
        os.symlink("/etc/hostname", os.path.join(spool, rid + wire.REPLY))

    with pytest.raises(client.BrokerError, match="symlink"):
        client.call(Request(op="ping"), spool, 5.0, onSent=plant)
    assert os.listdir(spool) == []


def test_theClientImportsNoTwisted() -> None:
    code = (
        "import sys\n"
        "import agentsandbox.broker.client, agentsandbox.broker.commands, agentsandbox.broker.spool\n"
        "import agentsandbox.cli\n"
        "assert not [m for m in sys.modules if m == 'twisted' or m.startswith('twisted.')], "
        "sorted(m for m in sys.modules if m.startswith('twisted'))\n"
        "print('clean')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=pythonEnv(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "clean\n"


# --------------------------------------------------------------------------- commands, no broker


@pytest.mark.parametrize(
    "argv",
    [
        ["ask", "ping"],
        ["ask", "status"],
        ["gpg", "--status-fd=2", "-bsau", "K"],
        ["ssh-sign", "-Y", "sign", "-n", "git", "-f", "KEYFILE", "BUFFER"],
        ["host", "cluster-up"],
        ["cap", "--", "true"],
        ["kubeconfig", "kind-lab"],
    ],
)
def test_everyCommandFailsTheSameWayWithoutABroker(argv: list[str], tmp_path: os.PathLike[str]) -> None:
    spool = os.path.join(str(tmp_path), "spool")
    buffer = os.path.join(str(tmp_path), "buffer")
    with open(buffer, "wb") as f:
        f.write(b"tree 0\n")
    argv = [buffer if a == "BUFFER" else a for a in argv]
    marker = os.path.join(str(tmp_path), "ran")
    if argv[0] == "cap":
        argv = ["cap", "--", "touch", marker]
    env = pythonEnv({"AGENTSANDBOX_SPOOL": spool, "SANDBOX_RUNTIME": "1"})
    result = subprocess.run(
        agentsandboxArgv(*argv), env=env, input=b"payload", capture_output=True, timeout=60
    )
    assert result.returncode == 69, result.stderr
    assert f"no agentsandbox broker answered within 5s in {spool}" in result.stderr.decode()
    assert "nothing was done inside the sandbox" in result.stderr.decode()
    assert not os.path.exists(marker)
    assert not os.path.exists(buffer + ".sig")
    assert os.listdir(spool) == []


def test_gpgInsideTheSandboxRefusesOtherShapes(tmp_path: os.PathLike[str]) -> None:
    env = pythonEnv({"AGENTSANDBOX_SPOOL": str(tmp_path), "SANDBOX_RUNTIME": "1"})
    for argv in (["--verify", "sig", "-"], ["--export-secret-keys"], ["--status-fd=2", "-bsau", "-K"]):
        result = subprocess.run(agentsandboxArgv("gpg", *argv), env=env, capture_output=True, timeout=60)
        assert result.returncode == 2
        assert b"signs only git's gpg call" in result.stderr or b"starts with '-'" in result.stderr


def test_gpgOutsideTheSandboxIsTheRealGpg(tmp_path: os.PathLike[str]) -> None:
    if shutil.which("gpg") is None:
        pytest.skip("gpg is not installed")
    base = str(tmp_path)
    # Even a git config that names agentsandbox as gpg.program must not loop.
    wrapper = launcher(base, "agentsandbox-gpg", "gpg")
    home = os.path.join(base, "home")
    os.makedirs(home)
    subprocess.run(["git", "config", "--file", os.path.join(home, ".gitconfig"), "gpg.program", wrapper], check=True)
    env = pythonEnv({"HOME": home, "GNUPGHOME": os.path.join(base, "gnupg")})
    result = subprocess.run([wrapper, "--version"], env=env, capture_output=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(b"gpg (GnuPG)")


def test_sshSignOutsideOrForVerifyIsTheRealSshKeygen(tmp_path: os.PathLike[str]) -> None:
    if shutil.which("ssh-keygen") is None:
        pytest.skip("ssh-keygen is not installed")
    key = os.path.join(str(tmp_path), "id")
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key], check=True)
    env = pythonEnv({"SANDBOX_RUNTIME": "1", "AGENTSANDBOX_SPOOL": str(tmp_path)})
    # -Y check-novalidate needs no secret, so it runs here even inside the sandbox.
    payload = os.path.join(str(tmp_path), "msg")
    with open(payload, "wb") as f:
        f.write(b"hello\n")
    subprocess.run(["ssh-keygen", "-q", "-Y", "sign", "-n", "git", "-f", key, payload], check=True, capture_output=True)
    with open(payload, "rb") as f:
        result = subprocess.run(
            agentsandboxArgv("ssh-sign", "-Y", "check-novalidate", "-n", "git", "-s", payload + ".sig"),
            env=env,
            stdin=f,
            capture_output=True,
            timeout=60,
        )
    assert result.returncode == 0, result.stderr


# --------------------------------------------------------------------------- with a broker process


@pytest.fixture
def brokerProcess() -> Iterator[BrokerProcess]:
    with runningBroker() as (broker, _base):
        yield broker


def test_askPingAndStatus(brokerProcess: BrokerProcess) -> None:
    env = pythonEnv({"AGENTSANDBOX_SPOOL": brokerProcess.spool})
    ping = subprocess.run(agentsandboxArgv("ask", "ping"), env=env, capture_output=True, timeout=60)
    assert ping.returncode == 0, ping.stderr
    assert brokerProcess.spool.encode() in ping.stdout
    status = subprocess.run(agentsandboxArgv("ask", "status"), env=env, capture_output=True, timeout=60)
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert report["requests"]["ping"]["ok"] >= 2
    assert report["spool"] == brokerProcess.spool
    assert report["uptime"] >= 0


def test_theBrokerRefusesToRunInsideTheSandbox() -> None:
    result = subprocess.run(
        agentsandboxArgv("broker"), env=pythonEnv({"SANDBOX_RUNTIME": "1"}), capture_output=True, timeout=60
    )
    assert result.returncode == 2
    assert b"runs on the host" in result.stderr


def test_cliListsTheBrokerCommands() -> None:
    from agentsandbox.cli import COMMANDS

    for name in ("ask", "gpg", "ssh-sign", "host", "cap", "kubeconfig", "broker"):
        assert name in COMMANDS
    assert REPO.is_dir()
