"""Real signing end to end: git inside srt (bubblewrap) signs through the broker on the host.

The policy hides the GNUPGHOME and the ssh key directory from the sandbox (srt's
``denyRead`` mounts an empty tmpfs over them); git's ``gpg.program`` /
``gpg.ssh.program`` are launchers of ``agentsandbox gpg`` / ``agentsandbox ssh-sign``;
the broker runs as ``agentsandbox broker`` on the host with the key.  The commit made
inside must verify on the host, and the sandbox must not be able to read the key.

srt's own rules apply on top of ours: its mandatory write denies (``.git/hooks``,
``.git/config``, shell rc files, …) are why the repo is configured on the host first,
and it sets ``SANDBOX_RUNTIME=1`` and ``TMPDIR=/tmp/claude`` (which it does not create
here, so the commands point TMPDIR at a writable directory of the test).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.support.broker_support import BrokerProcess, launcher, pythonEnv, tempBase
from tests.support.gpg import stopGpgAgent
from tests.test_broker_ops import GPG_KEY_NAME, KUBECONFIG, makeGpgHome

pytestmark = pytest.mark.srt


def _missing() -> str | None:
    for tool in ("srt", "bwrap", "socat", "git", "gpg", "gpgconf", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    return None


@dataclass
class World:
    base: str
    spool: str
    gnupg: str
    fingerprint: str
    sshDir: str
    sshKey: str
    repo: str
    tmp: str
    bin: str
    broker: BrokerProcess
    kubeconfig: str

    def srt(self, command: str, extraEnv: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        settings = os.path.join(self.base, "srt-settings.json")
        with open(settings, "w") as f:
            json.dump(
                {
                    "network": {"allowedDomains": [], "deniedDomains": []},
                    "filesystem": {
                        "denyRead": [self.gnupg, self.sshDir],
                        "allowWrite": [self.spool, self.repo, self.tmp],
                        "denyWrite": [],
                    },
                },
                f,
            )
        env = pythonEnv({"AGENTSANDBOX_SPOOL": self.spool, "GNUPGHOME": self.gnupg, **(extraEnv or {})})
        return subprocess.run(
            ["srt", "--settings", settings, "-c", f"export TMPDIR={self.tmp}; {command}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )

    def git(self, *args: str) -> subprocess.CompletedProcess[str]:
        env = pythonEnv({"GNUPGHOME": self.gnupg, "HOME": os.path.join(self.base, "home")})
        return subprocess.run(
            ["git", "-C", self.repo, *args], env=env, capture_output=True, text=True, timeout=120
        )


@pytest.fixture
def world() -> Iterator[World]:
    why = _missing()
    if why is not None:
        pytest.skip(why)
    base = tempBase("broker-e2e-")
    home = os.path.join(base, "home")
    os.makedirs(home)
    gnupg, fingerprint = makeGpgHome(base)
    sshDir = os.path.join(base, "ssh")
    os.makedirs(sshDir, mode=0o700)
    sshKey = os.path.join(sshDir, "id_ed25519")
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "e2e@example.org", "-f", sshKey], check=True
    )
    spool = os.path.join(base, "spool")
    kubeconfig = os.path.join(base, "kubeconfig.json")
    with open(kubeconfig, "w") as f:
        json.dump(KUBECONFIG, f)
    config = os.path.join(base, "config.toml")
    with open(config, "w") as f:
        f.write(
            f'[broker]\nspool = "{spool}"\nkubeconfig = "{kubeconfig}"\n'
            f'[broker.sign]\nssh_key = "{sshKey}"\n'
        )
    binDir = os.path.join(base, "bin")
    os.makedirs(binDir)
    launcher(binDir, "agentsandbox")
    launcher(binDir, "agentsandbox-gpg", "gpg")
    launcher(binDir, "agentsandbox-ssh-sign", "ssh-sign")
    repo = os.path.join(base, "repo")
    tmp = os.path.join(base, "tmp")
    os.makedirs(tmp)
    subprocess.run(["git", "init", "-q", repo], check=True)
    for key, value in (
        ("user.name", "Broker Test"),
        ("user.email", "broker-test@example.org"),
        ("commit.gpgsign", "false"),
    ):
        subprocess.run(["git", "-C", repo, "config", key, value], check=True)
    brokerEnv = pythonEnv({"HOME": home, "GNUPGHOME": gnupg})
    broker = BrokerProcess(config, brokerEnv, spool)
    w = World(base, spool, gnupg, fingerprint, sshDir, sshKey, repo, tmp, binDir, broker, kubeconfig)
    yield w
    broker.stop()
    stopGpgAgent(gnupg)
    shutil.rmtree(base, ignore_errors=True)


def test_gpgSigningInsideSrtVerifiesOnTheHost(world: World) -> None:
    for key, value in (
        ("user.signingkey", world.fingerprint),
        ("gpg.program", os.path.join(world.bin, "agentsandbox-gpg")),
    ):
        assert world.git("config", key, value).returncode == 0
    inside = world.srt(
        f"cd {world.repo} && echo one > file && git add file && "
        "git commit -S -q -m 'signed inside the sandbox' && echo COMMITTED; "
        f"echo SR=$SANDBOX_RUNTIME; ls -A {world.gnupg} | wc -l; "
        f"cat {world.gnupg}/private-keys-v1.d/* && echo READ-THE-KEY"
    )
    assert "COMMITTED" in inside.stdout, inside.stderr
    assert "SR=1" in inside.stdout
    assert "READ-THE-KEY" not in inside.stdout
    assert "No such file or directory" in inside.stderr
    # The hidden GNUPGHOME is an empty directory inside.
    assert "\n0\n" in inside.stdout
    # On the host the signature verifies (gpg.program is still our launcher: outside the
    # sandbox it hands over to the real gpg).
    verify = world.git("verify-commit", "-v", "HEAD")
    assert verify.returncode == 0, verify.stderr
    assert GPG_KEY_NAME.split(" <")[0] in verify.stderr
    status = json.loads(
        subprocess.run(
            [os.path.join(world.bin, "agentsandbox"), "ask", "status"],
            env=pythonEnv({"AGENTSANDBOX_SPOOL": world.spool}),
            capture_output=True,
            timeout=60,
            check=True,
        ).stdout
    )
    assert status["requests"]["sign"] == {"ok": 1}
    assert status["requesters"]["sandboxed"] >= 2  # the ping and the sign came from inside


def test_sshSigningInsideSrtVerifiesWithAllowedSigners(world: World) -> None:
    with open(world.sshKey + ".pub") as f:
        public = f.read().strip()
    signers = os.path.join(world.base, "allowed_signers")
    with open(signers, "w") as f:
        f.write(f"broker-test@example.org {public}\n")
    for key, value in (
        ("gpg.format", "ssh"),
        ("user.signingkey", f"key::{public}"),
        ("gpg.ssh.program", os.path.join(world.bin, "agentsandbox-ssh-sign")),
        ("gpg.ssh.allowedSignersFile", signers),
    ):
        assert world.git("config", key, value).returncode == 0
    inside = world.srt(
        f"cd {world.repo} && echo two > file && git add file && "
        "git commit -S -q -m 'ssh-signed inside the sandbox' && echo COMMITTED; "
        f"cat {world.sshKey} && echo READ-THE-KEY"
    )
    assert "COMMITTED" in inside.stdout, inside.stderr
    assert "READ-THE-KEY" not in inside.stdout
    assert "No such file or directory" in inside.stderr
    verify = world.git("verify-commit", "HEAD")
    assert verify.returncode == 0, verify.stderr
    assert 'Good "git" signature for broker-test@example.org' in verify.stderr


def test_aSandboxedKubeconfigGetsTheSandboxProxy(world: World) -> None:
    out = os.path.join(world.tmp, "kc.json")
    inside = world.srt(
        f"{world.bin}/agentsandbox kubeconfig kind-lab -o {out} && echo WROTE",
        {"ALL_PROXY": "socks5h://localhost:1080"},
    )
    assert "WROTE" in inside.stdout, inside.stderr
    with open(out) as f:
        doc = json.load(f)
    proxy = doc["clusters"][0]["cluster"]["proxy-url"]
    assert proxy.startswith("socks5://")
    assert os.stat(out).st_mode & 0o777 == 0o600


def test_hostCommandsInsideSrtFailClosedWithoutABroker(world: World) -> None:
    world.broker.stop()
    inside = world.srt(f"{world.bin}/agentsandbox host anything; echo rc=$?")
    assert "rc=69" in inside.stdout
    assert "no agentsandbox broker answered" in inside.stderr
