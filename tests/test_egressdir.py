"""The egress dir (ca.pem, bundle.pem, gh/hosts.yml) and the variables that point at it."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from agentsandbox import egressdir
from agentsandbox.egressdir import EgressDirError, egressVarNames, egressVars, writeEgressDir

REPO = Path(__file__).resolve().parent.parent
CA = b"-----BEGIN CERTIFICATE-----\nCA\n-----END CERTIFICATE-----\n"


def test_writeEgressDir(tmp_path: Path) -> None:
    roots = tmp_path / "roots.pem"
    roots.write_bytes(b"ROOTS\n\n")
    d = tmp_path / "run" / "agentsandbox" / "egress"
    writeEgressDir(str(d), CA, bundles=[str(tmp_path / "missing.pem"), str(roots)])
    assert (d / "ca.pem").read_bytes() == CA
    assert (d / "bundle.pem").read_bytes() == b"ROOTS\n" + CA
    hosts = (d / "gh" / "hosts.yml").read_text()
    assert "github.com:\n" in hosts and "oauth_token: agentsandbox-egress-proxy" in hosts
    assert "git_protocol: https" in hosts
    for p in (d, d / "gh"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o700
    for p in (d / "ca.pem", d / "bundle.pem", d / "gh" / "hosts.yml"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert not list(d.glob("*.new"))
    # Rewriting (a restart makes a new CA) replaces the files.
    writeEgressDir(str(d), CA.replace(b"CA", b"CB"), bundles=[str(roots)])
    assert b"CB" in (d / "bundle.pem").read_bytes()


def test_noSystemBundleIsAnError(tmp_path: Path) -> None:
    with pytest.raises(EgressDirError, match="no system root bundle"):
        writeEgressDir(str(tmp_path / "e"), CA, bundles=[str(tmp_path / "none.pem")])


def test_aPrivateKeyIsNeverWritten(tmp_path: Path) -> None:
    with pytest.raises(EgressDirError, match="private key"):
        writeEgressDir(str(tmp_path / "e"), b"-----BEGIN PRIVATE KEY-----\n", bundles=["/dev/null"])


def test_anUnwritableDirSaysWhich(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(EgressDirError, match=str(blocker)):
        writeEgressDir(str(blocker / "egress"), CA, bundles=["/dev/null"])


def test_realSystemBundleAndTheCAVerify(tmp_path: Path) -> None:
    from agentsandbox.egress.tls import InjectionCA

    ca = InjectionCA.create(["api.github.com"])
    d = tmp_path / "egress"
    writeEgressDir(str(d), ca.pem)
    _path, roots = egressdir.systemBundle()
    assert (d / "bundle.pem").read_bytes().startswith(roots.rstrip(b"\n"))
    assert (d / "bundle.pem").read_bytes().endswith(ca.pem)


def test_egressVars() -> None:
    env = egressVars("/run/user/1/agentsandbox/egress")
    b = "/run/user/1/agentsandbox/egress/bundle.pem"
    assert env["SSL_CERT_FILE"] == env["GIT_SSL_CAINFO"] == env["CURL_CA_BUNDLE"] == env["REQUESTS_CA_BUNDLE"] == b
    assert env["NODE_EXTRA_CA_CERTS"] == "/run/user/1/agentsandbox/egress/ca.pem"
    assert env["GH_CONFIG_DIR"] == "/run/user/1/agentsandbox/egress/gh"
    assert env["GIT_CONFIG_COUNT"] == "3"
    assert env["GIT_CONFIG_KEY_0"] == env["GIT_CONFIG_KEY_1"] == "url.https://github.com/.insteadOf"
    assert env["GIT_CONFIG_VALUE_0"] == "git@github.com:"
    assert env["GIT_CONFIG_VALUE_1"] == "ssh://git@github.com/"
    assert env["GIT_CONFIG_KEY_2"] == "credential.https://github.com.helper"
    assert env["GIT_CONFIG_VALUE_2"] == ""
    more = egressVars("/e", gitConfig=[("gpg.program", "/e/gpg")])
    assert more["GIT_CONFIG_COUNT"] == "4" and more["GIT_CONFIG_VALUE_3"] == "/e/gpg"
    assert set(more) <= set(egressVarNames())


def test_gitHonoursTheVariables(tmp_path: Path) -> None:
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), **egressVars(str(tmp_path))}
    r = subprocess.run(
        ["git", "ls-remote", "--get-url", "git@github.com:octo/repo.git"], env=env, capture_output=True, text=True
    )
    assert r.stdout.strip() == "https://github.com/octo/repo.git"
    r = subprocess.run(["git", "config", "--get-all", "credential.https://github.com.helper"], env=env,
                       capture_output=True, text=True)
    assert r.stdout == "\n"


def test_moduleImportsNoTwisted() -> None:
    code = "import sys, agentsandbox.egressdir; print(any(m.startswith('twisted') for m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.stdout.strip() == "False", r.stderr


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agentsandbox.cli", "env", *args], cwd=REPO,
                          capture_output=True, text=True, env={**env, "PYTHONPATH": str(REPO)})


def test_envCommandPrintsExportsThatAShellTakes(tmp_path: Path) -> None:
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    r = _cli(env=env)
    assert r.returncode == 0, r.stderr
    assert f"export SSL_CERT_FILE={tmp_path}/run/agentsandbox/egress/bundle.pem" in r.stdout
    shell = subprocess.run(["sh", "-c", r.stdout + 'printf "%s|%s" "$GIT_CONFIG_VALUE_2" "$GH_CONFIG_DIR"'],
                           capture_output=True, text=True)
    assert shell.stdout == f"|{tmp_path}/run/agentsandbox/egress/gh"


def test_envUnsetRemovesEveryOne(tmp_path: Path) -> None:
    r = _cli("--unset", env={"PATH": os.environ["PATH"]})
    assert r.returncode == 0
    exports = egressdir.exportLines(egressVars("/e", gitConfig=[("gpg.program", "/e/gpg")]))
    shell = subprocess.run(["sh", "-c", exports + r.stdout + "env"], capture_output=True, text=True,
                           env={"PATH": os.environ["PATH"]})
    names = {line.split("=", 1)[0] for line in shell.stdout.splitlines()}
    assert not names & set(egressVarNames())


def test_envWithoutARuntimeDirAndBadArguments(tmp_path: Path) -> None:
    r = _cli(env={"PATH": os.environ["PATH"], "HOME": str(tmp_path)})
    assert r.returncode == 1 and "XDG_RUNTIME_DIR" in r.stderr
    r = _cli("--bogus", env={"PATH": os.environ["PATH"]})
    assert r.returncode == 2 and "--bogus" in r.stderr


def test_signing_wrappers_run_our_command(tmp_path: Path) -> None:
    import subprocess

    from agentsandbox.egressdir import signingGitConfig, writeWrappers

    exe = tmp_path / "bin dir" / "fake agentsandbox"
    exe.parent.mkdir()
    exe.write_text('#!/bin/sh\necho "$@"\n')
    exe.chmod(0o755)
    egress = tmp_path / "egress"
    writeWrappers(str(egress), str(exe))
    for name, sub in (("gpg", "gpg"), ("ssh-sign", "ssh-sign")):
        wrapper = egress / name
        assert wrapper.stat().st_mode & 0o777 == 0o700
        out = subprocess.run([str(wrapper), "--status-fd=2", "-bsau", "KEY"], capture_output=True, text=True, check=True)
        assert out.stdout == f"{sub} --status-fd=2 -bsau KEY\n"
    assert dict(signingGitConfig(str(egress))) == {
        "gpg.program": str(egress / "gpg"),
        "gpg.ssh.program": str(egress / "ssh-sign"),
    }


def test_packaged_wrappers_are_shared_and_used_only_when_they_run_this_install(tmp_path: Path) -> None:
    from agentsandbox.egressdir import packagedWrappers, signingGitConfig, writeWrappers

    packaged = tmp_path / "libexec"
    writeWrappers(str(packaged), "/usr/bin/agentsandbox", shared=True)
    assert packaged.stat().st_mode & 0o777 == 0o755
    for name in ("gpg", "ssh-sign"):
        assert (packaged / name).stat().st_mode & 0o777 == 0o755
    egress = str(tmp_path / "egress")
    assert dict(signingGitConfig(egress, "/usr/bin/agentsandbox", str(packaged))) == {
        "gpg.program": str(packaged / "gpg"),
        "gpg.ssh.program": str(packaged / "ssh-sign"),
    }
    # Another install (a pip install in a home) signs through its own copies.
    assert packagedWrappers("/home/ann/.local/bin/agentsandbox", str(packaged)) is None
    assert dict(signingGitConfig(egress, "/home/ann/.local/bin/agentsandbox", str(packaged)))["gpg.program"] == (
        egress + "/gpg"
    )
    # Half a set, or none, is not a set.
    (packaged / "ssh-sign").unlink()
    assert packagedWrappers("/usr/bin/agentsandbox", str(packaged)) is None
    assert packagedWrappers("/usr/bin/agentsandbox", str(tmp_path / "absent")) is None
