"""The Debian package's own files, checked without building or installing anything.

These run during the package build too (debian/rules lists this module), so a
config, a man page or a maintainer script that went wrong fails the build.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from agentsandbox import cli
from agentsandbox.loader import loads
from agentsandbox.paths import Paths
from agentsandbox.policy import Policy

DEBIAN = Path(__file__).resolve().parents[2] / "debian"
GITHUB = ("github.com", "*.github.com", "*.githubusercontent.com")

pytestmark = pytest.mark.skipif(not DEBIAN.is_dir(), reason="no debian/ beside tests/")


def machinePolicy(home: Path) -> Policy:
    env = {"HOME": str(home), "XDG_RUNTIME_DIR": "/run/user/1000", "PATH": "/usr/bin:/bin"}
    config = loads((DEBIAN / "config.toml").read_bytes(), "/etc/agentsandbox/config.toml", Paths.fromEnvironment(env))
    return Policy.fromConfig(config, env, exe="/usr/bin/agentsandbox")


def test_the_machine_config_opens_nothing_under_home_and_allows_githubs_hosts() -> None:
    # Outside /tmp, which sessions may use: the home need not exist for a decision.
    home = Path("/home/agentsandbox-no-such-user")
    config = loads(
        (DEBIAN / "config.toml").read_bytes(), "/etc/agentsandbox/config.toml", Paths.fromEnvironment({"HOME": str(home)})
    )
    assert config.sandbox.read == () and config.sandbox.write == ()
    assert config.sandbox.domains == GITHUB
    assert config.proxy.port == 3190
    policy = machinePolicy(home)
    for d in ("src", ".ssh", "Documents"):
        assert not policy.readable(str(home / d / "x"), "/")
        assert not policy.writable(str(home / d / "x"), "/")


def test_the_man_page_documents_every_command() -> None:
    page = (DEBIAN / "agentsandbox.1").read_text()
    documented = set(re.findall(r"^\.B (\S+)", page, re.M))
    missing = [name for name in cli.COMMANDS if name.replace("-", "\\-") not in documented]
    assert not missing, f"agentsandbox.1 has no entry for {missing}"
    for binary in ("agentsandbox", "agentsandbox-twistd", "agentsandbox-policy-helper"):
        assert (DEBIAN / f"{binary}.1").exists()
        assert f"debian/{binary}.1" in (DEBIAN / "agentsandbox.manpages").read_text().split()


def test_the_postinst_renders_with_the_packages_renderer_only() -> None:
    postinst = (DEBIAN / "agentsandbox.postinst").read_text()
    assert "/usr/bin/agentsandbox install --config \"$CONFIG\"" in postinst
    # No second implementation: the script never names the drop-in's file or a
    # settings key, so it cannot write one itself.
    for word in ("50-agentsandbox.json", "allowRead", "hooks", "permissions"):
        assert word not in postinst, word


def test_the_trigger_keeps_twisteds_plugin_cache() -> None:
    assert (DEBIAN / "agentsandbox.triggers").read_text().split() == ["activate-noawait", "twisted-plugins-cache"]


def test_the_package_installs_the_shipped_units_unchanged() -> None:
    lines = (DEBIAN / "agentsandbox.install").read_text().split("\n")
    for unit, where in (
        ("agentsandbox-dispatch.socket", "lib/systemd/system/"),
        ("agentsandbox-dispatch.service", "lib/systemd/system/"),
        ("agentsandbox.service", "usr/lib/systemd/user/"),
    ):
        assert f"agentsandbox/data/{unit} {where}" in lines
        assert (DEBIAN.parent / "agentsandbox" / "data" / unit).exists()
