"""The Claude Code drop-in (DESIGN §4.2) and the srt settings rendered from one policy."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from agentsandbox import claude, srt
from tests.conftest import User


def test_settings_shape(user: User) -> None:
    s = claude.render(user.policy())
    assert s["env"] == {"AGENTSANDBOX": "1"}
    sb = s["sandbox"]
    assert sb["enabled"] and sb["failIfUnavailable"] and sb["autoAllowBashIfSandboxed"]
    assert sb["allowUnsandboxedCommands"] is False
    fs = sb["filesystem"]
    assert fs["denyRead"] == ["~/", "//run/user"]
    assert fs["denyWrite"] == ["~/.claude"]
    assert fs["allowManagedReadPathsOnly"] is True
    for entry in ("~/projects", "~/.config/agentsandbox", "~/.claude/projects", "~/.gitconfig"):
        assert entry in fs["allowRead"], entry
    for entry in ("~/.kube", "~/.claude", "~/.config/gh", "~/.ssh", "~/"):
        assert entry not in fs["allowRead"], entry
    assert "//usr/bin" not in fs["allowRead"], "paths outside closed dirs need no re-allowing"
    assert fs["allowWrite"] == ["~/.local/state/agentsandbox/spool", "~/go/pkg/mod"]
    net = sb["network"]
    assert net["allowManagedDomainsOnly"] and net["strictAllowlist"]
    assert net["httpProxyPort"] == net["socksProxyPort"] == 3190
    assert net["allowedDomains"] == ["muster.example.com", "127.0.0.1:6443"]
    assert "allowAllUnixSockets" not in net
    (pre,) = s["hooks"]["PreToolUse"]
    assert pre["matcher"] == "*", "every tool meets the hook (agentsandbox/tools.py decides each)"
    (hook,) = pre["hooks"]
    # The interpreter rendering it, isolated and without site, on this package's hookstart.py.
    assert hook == {
        "type": "command",
        "command": sys.executable,
        "args": ["-I", "-S", str(Path(claude.__file__).resolve().parent / "hookstart.py"),
                 "/usr/bin/agentsandbox", "pretooluse"],
        "timeout": 10,
        "onFailure": "block",
    }
    (start,) = s["hooks"]["SessionStart"]
    assert start["hooks"][0]["command"] == "/usr/bin/agentsandbox"
    assert start["hooks"][0]["args"] == ["hook", "sessionstart"]
    assert "credentials" not in json.dumps(s["sandbox"])
    assert "tlsTerminate" not in json.dumps(s)


def test_drop_in_is_user_independent(user: User) -> None:
    text = claude.dumps(claude.render(user.policy()))
    assert str(user.home) not in text
    assert str(user.runtime) not in text
    assert "1000" not in text


def test_the_egress_dir_is_re_allowed_for_every_user(user: User, tmp_path: Path) -> None:
    env = dict(user.env, XDG_RUNTIME_DIR="/run/user/1000")
    from agentsandbox.loader import loads
    from agentsandbox.paths import Paths
    from agentsandbox.policy import Policy

    config = loads(b"", "/etc/agentsandbox/config.toml", Paths.fromEnvironment(env))
    s = claude.render(Policy.fromConfig(config, env, exe="/usr/bin/agentsandbox"))
    assert "//run/user/*/agentsandbox/egress" in s["sandbox"]["filesystem"]["allowRead"]
    assert "//run/user" in s["sandbox"]["filesystem"]["denyRead"]


def test_the_same_config_renders_the_same_bytes_for_every_user() -> None:
    """Homes either side of /opt, /run and /srv in sort order, and root without a runtime
    dir (a package's postinst, sudo).  Nothing here needs the homes to exist."""
    from agentsandbox.loader import loads
    from agentsandbox.paths import Paths
    from agentsandbox.policy import Policy

    toml = (
        b'[sandbox]\nwrite = ["~/src", "/srv/data"]\nread = ["~/docs", "/opt/tools"]\n'
        b'deny = ["~/src/secrets", "/srv/data/keys"]\n'
    )
    rendered = set()
    for home, runtime in (("/aaa/ann", "/run/user/1000"), ("/zzz/bob", "/run/user/1001"), ("/root", None)):
        env = {"HOME": home, "PATH": "/usr/bin:/bin"}
        if runtime is not None:
            env["XDG_RUNTIME_DIR"] = runtime
        config = loads(toml, "/etc/agentsandbox/config.toml", Paths.fromEnvironment(env))
        rendered.add(claude.dumps(claude.render(Policy.fromConfig(config, env, exe="/usr/bin/agentsandbox"))))
    assert len(rendered) == 1, "\n---\n".join(sorted(rendered))
    (text,) = rendered
    assert "//run/user/*/agentsandbox/egress" in json.loads(text)["sandbox"]["filesystem"]["allowRead"]


def test_permission_rules_deny_the_deny_list_and_credentials(user: User) -> None:
    s = claude.render(user.policy('[sandbox]\nwrite = ["~/work"]\ndeny = ["~/work/scan", "/srv/vault"]\n'))
    deny = s["permissions"]["deny"]
    for rule in (
        "Read(~/work/scan)",
        "Read(~/work/scan/**)",
        "Edit(~/work/scan/**)",
        "Read(//srv/vault/**)",
        "Read(~/.ssh/**)",
        "Edit(~/.ssh/**)",
        "Read(~/.gnupg/**)",
        "Read(~/.aws/**)",
        "Read(~/.config/gh/**)",
        "Read(~/.kube/**)",
        "Read(~/.docker/config.json)",
        "Read(~/.netrc)",
    ):
        assert rule in deny, rule
    paths = [r for r in deny if "(" in r]
    assert all(r.startswith(("Read(~/", "Edit(~/", "Read(//", "Edit(//")) for r in paths)
    # The rest are whole tools the hook cannot hold (agentsandbox/tools.py).
    assert [r for r in deny if "(" not in r] == ["DesignSync", "PowerShell", "Workflow"]
    assert s["sandbox"]["filesystem"]["denyRead"] == ["~/", "//run/user", "//srv/vault", "~/work/scan"]
    assert "~/work/scan" in s["sandbox"]["filesystem"]["denyWrite"]


def test_an_explicitly_allowed_credential_dir_gets_no_rule(user: User) -> None:
    deny = claude.render(user.policy('[sandbox]\nread = ["~/.kube"]\n'))["permissions"]["deny"]
    assert not any(".kube" in r for r in deny)
    assert "Read(~/.ssh/**)" in deny


def test_output_is_byte_stable(user: User) -> None:
    a = claude.dumps(claude.render(user.policy()))
    b = claude.dumps(claude.render(user.policy()))
    assert a == b and a.endswith("}\n")
    assert json.loads(a) == claude.render(user.policy())
    keys = list(json.loads(a))
    assert keys == sorted(keys)


def test_install_writes_atomically_and_says_current(user: User, tmp_path: Path) -> None:
    managed = tmp_path / "claude-code"
    policy = user.policy()
    first = claude.install(policy, str(managed))
    assert first.changed and not first.steps
    drop = managed / "managed-settings.d" / "50-agentsandbox.json"
    assert drop.read_text() == claude.dumps(claude.renderMachine(policy))
    assert json.loads(drop.read_text())["policyHelper"] == {"path": "/usr/bin/agentsandbox-policy-helper"}
    assert stat.S_IMODE(drop.stat().st_mode) == 0o644
    assert (managed / "managed-settings.json").read_text() == "{}\n"
    assert claude.drift(policy, str(managed)) is None
    again = claude.install(policy, str(managed))
    assert not again.changed
    assert not [p for p in os.listdir(managed / "managed-settings.d") if p.startswith(".")]
    other = user.policy('[sandbox]\ndomains = ["other.example.com"]\n')
    assert "differs" in (claude.drift(other, str(managed)) or "")
    changed = claude.install(other, str(managed))
    assert changed.changed and '-        "muster.example.com",' in changed.diff


def test_the_machine_drop_in_closes_no_one_home_the_sessions_close_the_others(user: User) -> None:
    """The drop-in is the same for every user; each session's rendering (the helper's) closes the others."""
    session = claude.render(user.policy(others=("/home/ann", "/srv/homes/bob")))
    assert session["sandbox"]["filesystem"]["denyRead"][:4] == ["~/", "//run/user", "//home/ann", "//srv/homes/bob"]
    assert "policyHelper" not in session
    machine = claude.renderMachine(user.policy())
    assert machine["sandbox"]["filesystem"]["denyRead"][:2] == ["~/", "//run/user"]
    assert "//home/ann" not in machine["sandbox"]["filesystem"]["denyRead"]


def test_install_keeps_an_existing_base_file(user: User, tmp_path: Path) -> None:
    managed = tmp_path / "claude-code"
    managed.mkdir()
    (managed / "managed-settings.json").write_text('{"x": 1}\n')
    claude.install(user.policy(), str(managed))
    assert (managed / "managed-settings.json").read_text() == '{"x": 1}\n'


def test_install_without_permission_names_the_root_command_and_stages_nothing(
    user: User, request: pytest.FixtureRequest, readableSource: str
) -> None:
    """One root command that renders from the machine's config; no copy of anything is left behind."""
    import shutil
    import subprocess
    import tempfile

    from tests.conftest import REPO

    top = Path(tempfile.mkdtemp(prefix="install-"))
    request.addfinalizer(lambda: shutil.rmtree(top, ignore_errors=True))
    top.chmod(0o755)
    managed = top / "has space" / "claude-code"
    managed.parent.mkdir()
    asRoot = os.getuid() == 0
    if not asRoot:
        managed.parent.chmod(0o555)
    code = (
        "import json,sys; from agentsandbox import claude; from agentsandbox.policy import Policy;"
        "p = Policy.fromDict(json.loads(sys.argv[1]), {});"
        "r = claude.install(p, sys.argv[2]);"
        "print(json.dumps([r.changed, list(r.steps), r.diff]))"
    )
    out = subprocess.run(
        ["/usr/bin/python3", "-c", code, json.dumps(user.policy().toDict()), str(managed)],
        capture_output=True,
        text=True,
        user=65534 if asRoot else None,
        # As nobody, the checkout itself may not be readable (a 0700 build tree).
        env={"PYTHONPATH": readableSource if asRoot else str(REPO), "HOME": "/nonexistent"},
        check=True,
        cwd=str(top),
    )
    changed, steps, diff = json.loads(out.stdout)
    assert changed
    assert steps == [f"sudo /usr/bin/agentsandbox install --managed-dir '{managed}'"]
    assert '+  "policyHelper": {' in diff
    assert not managed.exists()
    assert sorted(os.listdir(top)) == ["has space"]


def test_install_renders_only_from_a_file_root_alone_could_have_written(tmp_path: Path) -> None:
    """``install --config`` refuses a config someone other than root owns, could write or could swap."""
    if os.getuid() != 0:
        pytest.skip("the ownership checks need files owned by root and by another uid: run as root")
    safe = tmp_path / "etc"
    safe.mkdir(mode=0o755)
    config = safe / "config.toml"
    config.write_text("")
    config.chmod(0o644)
    claude.trustedForMachine(str(config))
    config.chmod(0o664)
    with pytest.raises(claude.UntrustedConfig, match="owned by uid 0 with mode 0664"):
        claude.trustedForMachine(str(config))
    config.chmod(0o644)
    os.chown(config, 65534, 65534)
    with pytest.raises(claude.UntrustedConfig, match="owned by uid 65534"):
        claude.trustedForMachine(str(config))
    os.chown(config, 0, 0)
    os.chown(safe, 65534, 65534)
    with pytest.raises(claude.UntrustedConfig, match=r"etc \(holding .*\) is owned by uid 65534"):
        claude.trustedForMachine(str(config))
    os.chown(safe, 0, 0)
    link = tmp_path / "link.toml"
    link.symlink_to(config)
    with pytest.raises(claude.UntrustedConfig, match="symbolic link"):
        claude.trustedForMachine(str(link))


def test_srt_settings_hold_the_same_lists(user: User) -> None:
    policy = user.policy('[sandbox]\nread = ["~/projects"]\nwrite = ["~/work"]\ndeny = ["~/work/scan"]\n')
    s = srt.render(policy)
    fs = s["filesystem"]
    assert fs["denyRead"] == [str(user.home), str(user.runtime), user.h("work/scan")]
    assert user.h("projects") in fs["allowRead"]
    assert fs["allowWrite"] == [user.h(".local/state/agentsandbox/spool"), user.h("work")]
    assert fs["denyWrite"] == [user.h("work/scan"), user.h(".claude")]
    net = s["network"]
    assert net["httpProxyPort"] == net["socksProxyPort"] == 3190
    for required in ("allowedDomains", "deniedDomains"):
        assert isinstance(net[required], list)


def test_root_never_installs_a_drop_in_that_runs_a_program_a_user_can_change(user: User, tmp_path: Path) -> None:
    """A hook or helper in a user's venv would run that user's code as everyone who starts Claude Code."""
    if os.getuid() != 0:
        pytest.skip("the ownership checks need files owned by root and by another uid: run as root")
    bin = tmp_path / "venv" / "bin"
    bin.mkdir(parents=True)
    tmp_path.chmod(0o755)
    (tmp_path / "venv").chmod(0o755)
    for name in ("agentsandbox", claude.HELPER_NAME):
        (bin / name).write_text("#!/bin/sh\n")
        (bin / name).chmod(0o755)
    settings = claude.renderMachine(user.policy(exe=str(bin / "agentsandbox")))
    assert claude.programsOthersCanChange(settings) == []
    os.chown(bin / claude.HELPER_NAME, 1000, 1000)
    assert claude.programsOthersCanChange(settings) == [
        f"{bin / claude.HELPER_NAME} is owned by uid 1000 with mode 0755"]
    os.chown(bin / claude.HELPER_NAME, 0, 0)
    os.chown(bin, 1000, 1000)
    found = claude.programsOthersCanChange(settings)
    assert len(found) == 2 and all(f"{bin} (holding " in f for f in found), found
    os.chown(bin, 0, 0)
    link = bin / "linked"
    link.symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").write_text("")
    os.chown(tmp_path / "elsewhere", 1000, 1000)
    assert claude._othersCanChange(str(link)) == f"{tmp_path / 'elsewhere'} is owned by uid 1000 with mode 0644"
