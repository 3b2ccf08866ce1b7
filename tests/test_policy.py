"""The read/write decisions shared by the hook and the broker (reference §1.8, §8)."""

from __future__ import annotations

import os

import pytest

from agentsandbox.policy import SANDBOX_NO_PROXY, Policy, resolve, under, underGlob
from tests.conftest import User


def test_under_is_component_wise() -> None:
    assert under("/a/b", "/a")
    assert under("/a", "/a")
    assert under("/a/b", "/a/")
    assert not under("/ab", "/a")
    assert under("/x", "/")
    assert not under("/home/user2", "/home/user")


def test_underGlob_matches_per_component() -> None:
    assert underGlob("/h/.claude/projects/p/memory/m.md", "/h/.claude/projects/*/memory")
    assert not underGlob("/h/.claude/projects/p/q/memory", "/h/.claude/projects/*/memory")
    assert not underGlob("/h/.claude/projects", "/h/.claude/projects/*/memory")


def test_readable(user: User) -> None:
    p = user.policy()
    cwd = user.h("projects/repo")
    for path in (
        "~/.kube/config",
        "~/.ssh/id_ed25519",
        "~/.ssh/missing_key",
        "~",
        "../../.kube/config",
        "~/.claude/.credentials.json",
        "~/.config/agentsandbox2/secret.toml",
        user.h(".local/state/agentsandbox/audit.jsonl"),
        str(user.runtime / "bus"),
    ):
        assert not p.readable(path, cwd), path
    for path in (
        "~/projects/repo/go.mod",
        "go.mod",
        "~/.claude/projects/p/x.jsonl",
        user.h(".local/state/agentsandbox/spool/x.req"),
        "~/go/pkg/mod/cache",
        "/etc/hosts",
        str(user.configFile),
        str(user.runtime / "agentsandbox/egress/ca.pem"),
    ):
        assert p.readable(path, cwd), path


def test_readable_follows_symlinks(user: User) -> None:
    p = user.policy()
    link = user.home / "projects/repo/kube"
    link.symlink_to(user.home / ".kube")
    cwd = user.h("projects/repo")
    assert not p.readable("kube/config", cwd)
    assert not p.writable("kube/new", cwd)


def test_a_dangling_link_is_decided_at_its_target(user: User) -> None:
    p = user.policy()
    (user.home / "projects/repo/profile").symlink_to(user.home / ".profile")
    assert not p.writable("profile", user.h("projects/repo"))


def test_writable(user: User) -> None:
    p = user.policy()
    cwd = user.h("projects/repo")
    for path in (
        "new/nested/file.go",
        "~/.claude/projects/p/memory/m.md",
        str(user.tmp / "probe"),
        user.h(".local/state/agentsandbox/spool/x.req"),
        "~/go/pkg/mod/x",
    ):
        assert p.writable(path, cwd), path
    for path in (
        "~/projects/other/x",
        "~/x.txt",
        "~/.claude/projects/p/x.jsonl",
        "~/.claude/settings.json",
        user.h(".local/state/agentsandbox/audit.jsonl"),
        user.h(".local/state/agentsandbox2/x"),
        "/etc/passwd",
    ):
        assert not p.writable(path, cwd), path


@pytest.mark.parametrize("rel", ["", ".."])
def test_home_or_an_ancestor_as_cwd_opens_nothing(user: User, rel: str) -> None:
    p = user.policy()
    cwd = os.path.normpath(os.path.join(str(user.home), rel))
    assert not p.writable("x.txt", cwd)
    assert not p.writable(user.h(".bashrc"), cwd)
    assert not p.readable(user.h(".ssh/id_ed25519"), cwd)
    assert not p.writable(str(user.runtime / "x"), cwd)


def test_root_as_cwd_opens_nothing(user: User) -> None:
    p = user.policy()
    assert not p.writable("/etc/x", "/")
    assert not p.writable(user.h("x"), "/")


def test_a_listed_cwd_outside_home_opens_its_tree(user: User) -> None:
    p = user.policy()
    work = user.base / "work"
    work.mkdir()
    assert p.writable("src/x.py", str(work))
    assert not p.writable(str(user.base / "elsewhere"), str(work))


def test_temp_dir_is_TMPDIR_not_gettempdir(user: User) -> None:
    p = user.policy()
    assert p.writable(str(user.tmp / "x"), "/")
    assert not p.writable("/tmp/agentsandbox-test-x", "/")
    env = {k: v for k, v in user.env.items() if k != "TMPDIR"}
    p2 = Policy.fromConfig(user.config(), env, exe="/usr/bin/agentsandbox")
    assert p2.writable("/tmp/agentsandbox-test-x", "/")


def test_a_denied_dir_inside_a_writable_one_is_closed_both_ways(user: User) -> None:
    p = user.policy(
        '[sandbox]\nwrite = ["~/work"]\ndeny = ["~/work/scan"]\n'
    )
    for path in ("~/work/scan", "~/work/scan/key", "~/work/scan/index.json"):
        assert not p.readable(path, "/"), path
        assert not p.writable(path, "/"), path
    assert p.readable("~/work/state.json", "/")
    assert p.writable("~/work/scanned.json", "/")
    assert p.deniedBy("~/work/scan/key", "/") == user.h("work/scan")


def test_deny_wins_over_tmp_and_cwd(user: User) -> None:
    p = user.policy(f'[sandbox]\ndeny = ["{user.tmp}/secret"]\n')
    assert not p.writable(str(user.tmp / "secret/x"), str(user.tmp))
    assert not p.readable(str(user.tmp / "secret/x"), str(user.tmp))
    assert p.writable(str(user.tmp / "other"), str(user.tmp))


def test_mount_points_are_created_0700_and_idempotent(user: User) -> None:
    p = user.policy('[sandbox]\nwrite = ["~/work"]\ndeny = ["~/work/scan"]\n')
    p.mountPoints()
    p.mountPoints()
    st = os.stat(user.h("work/scan"))
    assert st.st_mode & 0o777 == 0o700


def test_nested_refuses_a_writable_child_of_a_readable_parent(user: User) -> None:
    from agentsandbox.config import ConfigError

    with pytest.raises(ConfigError) as e:
        user.config('[sandbox]\nread = ["~/projects"]\nwrite = ["~/projects/repo"]\n')
    assert user.h("projects/repo") in str(e.value)
    assert user.h("projects") in str(e.value)
    assert "sandbox.write" in str(e.value)


def test_equal_read_and_write_is_not_nested(user: User) -> None:
    # The same path in both lists is one writable mount, not a read-only parent over a child.
    text = '[sandbox]\nread = ["~/work"]\nwrite = ["~/work"]\n'
    config = user.config(text)
    assert user.h("work") in config.sandbox.read
    assert user.h("work") in config.sandbox.write
    p = user.policy(text)
    assert p.nestedError() is None
    assert p.readable(user.h("work/file"), "/")
    assert p.writable(user.h("work/file"), "/")


def test_symlinked_list_entries_are_listed_at_their_target(user: User) -> None:
    target = user.base / "data"
    target.mkdir()
    (target / "file").write_text("x")
    (user.base / "neighbour").mkdir()
    (user.home / "data").symlink_to(target)
    p = user.policy('[sandbox]\nread = ["~/data"]\n')
    assert user.h("data") in p.read
    assert str(target) in p.read
    assert p.readable(str(target / "file"), "/")
    assert p.readable("~/data/file", "/")


def test_symlinked_config_home_is_named_by_its_target(user: User) -> None:
    real = user.base / "dotconfig"
    (real / "git").mkdir(parents=True)
    (real / "gh").mkdir()
    (real / "gh/hosts.yml").write_text("oauth_token: secret\n")
    (user.home / ".config").symlink_to(real)
    p = user.policy()
    assert p.sessionVars()["XDG_CONFIG_HOME"] == str(real)
    assert "GIT_CONFIG_GLOBAL" not in p.sessionVars()
    assert p.readable(str(real / "git/config"), "/")


@pytest.mark.parametrize(
    ("domains", "kept"),
    [
        # Nothing loopback listed: the sandbox's loopback entries stay, the private
        # ranges go (a direct dial there could only fail; the proxy refuses by name).
        (["example.org", "10.0.0.5:443", "10.0.0.0/8", "192.168.1.7:80"], "localhost,127.0.0.1,::1"),
        (["127.0.0.1:6443"], "localhost,::1"),
        (["localhost:8080"], "127.0.0.1,::1"),
        (["*.localhost:80"], "127.0.0.1,::1"),
        (["[::1]:80", "[::ffff:127.0.0.1]:81"], "localhost"),
        (["127.0.0.2:80"], "localhost,127.0.0.1,::1"),  # NO_PROXY's 127.0.0.1 does not cover 127.0.0.2
        (["127.0.0.1:1", "localhost:2", "[::1]:3"], ""),
    ],
)
def test_no_proxy_keeps_the_loopback_the_allow_list_does_not_claim(user: User, domains: list[str], kept: str) -> None:
    listed = ", ".join(f'"{d}"' for d in domains)
    p = user.policy(f"[sandbox]\ndomains = [{listed}]\n")
    assert p.noProxy() == kept
    assert p.proxyVars() == {"NO_PROXY": kept, "no_proxy": kept}
    assert set(kept.split(",") if kept else ()) <= set(SANDBOX_NO_PROXY)


def test_setting_prefixes(user: User) -> None:
    p = user.policy()
    h = str(user.home)
    assert p.setting(h) == "~/"
    assert p.setting(h + "/projects") == "~/projects"
    assert p.setting("/var/tmp/x") == "//var/tmp/x"
    assert p.setting(h + "2") == "/" + h + "2"


def test_resolve_expands_home_cwd_and_dotdot(user: User) -> None:
    h = str(user.home)
    assert resolve("~/a/../b", "/", h) == h + "/b"
    assert resolve("x", h + "/projects", h) == h + "/projects/x"
    assert resolve("//etc//hosts", "/", h) == "/etc/hosts"


def test_policy_is_immutable(user: User) -> None:
    p = user.policy()
    with pytest.raises(AttributeError):
        p.home = "/"
    assert Policy.fromDict(p.toDict(), user.env) == p
