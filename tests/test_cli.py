"""The ``agentsandbox`` command as a person runs it: a real subprocess each time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agentsandbox import __version__
from agentsandbox.cli import EXIT_CONFIG
from tests.conftest import REPO, User


def cli(user: User, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(user.env, PYTHONPATH=str(REPO), AGENTSANDBOX_EXE="/usr/bin/agentsandbox")
    return subprocess.run(
        [sys.executable, "-m", "agentsandbox", *args], capture_output=True, text=True, env=env, timeout=60
    )


def test_help_and_version(user: User) -> None:
    p = cli(user, "--help")
    assert p.returncode == 0
    for name in ("config", "render", "install", "check", "hook"):
        assert f"  {name}" in p.stdout
    assert cli(user, "--version").stdout == f"agentsandbox {__version__}\n"
    bad = cli(user, "frobnicate")
    assert bad.returncode == 2 and "unknown command 'frobnicate'" in bad.stderr
    assert cli(user).returncode == 2


def test_config_prints_the_effective_config_and_its_file(user: User) -> None:
    user.writeConfig('[sandbox]\ndomains = ["example.org"]\n')
    p = cli(user, "config")
    assert p.returncode == 0
    assert p.stdout.startswith(f"# effective config, from {user.configFile}\n")
    assert 'domains = ["example.org"]' in p.stdout
    data = json.loads(cli(user, "config", "--json").stdout)
    assert data["sandbox"]["domains"] == ["example.org"]
    assert data["source"] == str(user.configFile)


def test_config_errors_exit_2_with_the_key(user: User) -> None:
    user.writeConfig("[proxy]\nprot = 1\n")
    p = cli(user, "config")
    assert p.returncode == EXIT_CONFIG == 2
    assert p.stderr == (
        f"agentsandbox config: {user.configFile}: proxy.prot: unknown key (a typo here must not weaken the policy)\n"
    )
    assert cli(user, "check", "read", "/etc/hosts").returncode != 0


def test_the_machine_drop_in_commands_never_read_the_users_file(user: User, tmp_path: Path) -> None:
    """``render claude`` and ``install`` render the machine's drop-in: a user's file is not theirs to read.

    A broken user file does not stop them; a broken machine file (``--config``) does, naming its key.
    """
    user.writeConfig("[proxy]\nprot = 1\n")
    assert json.loads(cli(user, "render", "claude").stdout)["policyHelper"]["path"].endswith(
        "agentsandbox-policy-helper")
    managed = tmp_path / "claude-code"
    assert cli(user, "install", "--managed-dir", str(managed)).returncode == 0
    broken = tmp_path / "machine.toml"
    broken.write_text("[sandbox]\nread = 1\n")
    for args in (("render", "claude"), ("install", "--managed-dir", str(managed))):
        p = cli(user, args[0], "--config", str(broken), *args[1:])
        assert p.returncode == EXIT_CONFIG, (p.stdout, p.stderr)
        assert f"{broken}: sandbox.read" in p.stderr


#: Every subcommand that loads the config, with arguments that get it as far as the load.
LOADS_THE_CONFIG: list[tuple[str, ...]] = [
    ("config",),
    ("render", "srt"),
    ("check", "read", "/etc/hosts"),
    ("check", "host", "example.org"),
    ("serve",),
    ("broker",),
    ("dispatch",),
    ("log",),
    ("suggest",),
    ("run", "--", "true"),
    ("run", "--print"),
    ("status",),
    ("doctor", "--json"),
    ("setup", "--no-doctor"),
]


@pytest.mark.parametrize("args", LOADS_THE_CONFIG, ids=" ".join)
def test_every_command_that_loads_the_config_exits_2_naming_the_key(user: User, args: tuple[str, ...]) -> None:
    user.writeConfig("[proxy]\nprot = 1\n")
    p = cli(user, *args)
    assert p.returncode == EXIT_CONFIG, (p.stdout, p.stderr)
    said = p.stdout if args[0] == "doctor" else p.stderr
    assert f"{user.configFile}: proxy.prot: unknown key" in said
    if args[0] != "doctor":
        assert p.stderr.startswith(f"agentsandbox {args[0]}: "), p.stderr
    # --config names the file the same way
    other = user.home / "other.toml"
    other.write_text("[sandbox]\nread = 1\n")
    if args[0] != "setup":  # setup has no --config: it sets up the usual lookup
        p = cli(user, args[0], "--config", str(other), *args[1:])
        assert p.returncode == EXIT_CONFIG, (p.stdout, p.stderr)
        assert f"{other}: sandbox.read" in (p.stdout if args[0] == "doctor" else p.stderr)


def test_the_exit_status_of_a_config_error_is_in_the_help(user: User) -> None:
    assert "exit status: 2 when the arguments or the config cannot be used" in cli(user, "--help").stdout
    for name in sorted({args[0] for args in LOADS_THE_CONFIG} - {"setup", "doctor"}):
        shown = " ".join(cli(user, name, "--help").stdout.split())
        assert "Exit status 2 when the arguments or the config cannot be used" in shown, name
    assert "2 when the config cannot be used" in " ".join(cli(user, "doctor", "--help").stdout.split())
    assert "2 when the config cannot be used" in " ".join(cli(user, "setup", "--help").stdout.split())


def test_render_claude_and_srt(user: User) -> None:
    user.writeConfig('[sandbox]\nread = ["~/projects"]\n')
    claude = json.loads(cli(user, "render", "claude", "--config", str(user.configFile)).stdout)
    # PreToolUse runs the interpreter on hookstart.py, handing it the command; SessionStart runs it.
    assert claude["hooks"]["PreToolUse"][0]["hooks"][0]["args"][-2:] == ["/usr/bin/agentsandbox", "pretooluse"]
    assert claude["hooks"]["SessionStart"][0]["hooks"][0]["command"] == "/usr/bin/agentsandbox"
    assert "~/projects" in claude["sandbox"]["filesystem"]["allowRead"]
    srt = json.loads(cli(user, "render", "srt").stdout)
    assert str(user.home / "projects") in srt["filesystem"]["allowRead"]


def test_check_read_write_host(user: User) -> None:
    user.writeConfig('[sandbox]\nread = ["~/projects"]\ndomains = ["example.org", "*.example.com", "127.0.0.1:6443"]\n')
    repo = str(user.home / "projects/repo")
    ok = cli(user, "check", "read", "go.mod", "--cwd", repo)
    assert ok.returncode == 0 and ok.stdout.startswith("allowed: a session may read go.mod (sandbox.read ")
    no = cli(user, "check", "read", "~/.ssh/id_ed25519", "--cwd", repo)
    assert no.returncode == 1
    assert no.stdout == "refused: no rule lets a session read ~/.ssh/id_ed25519; add it or a parent to sandbox.read\n"
    assert cli(user, "check", "write", "x.go", "--cwd", repo).returncode == 0
    w = cli(user, "check", "write", "~/x.go", "--cwd", repo)
    assert w.returncode == 1 and "sandbox.write" in w.stdout
    assert cli(user, "check", "host", "example.org").returncode == 0
    assert cli(user, "check", "host", "a.example.com:8443").returncode == 0
    refused = cli(user, "check", "host", "example.com")
    assert refused.returncode == 1
    assert refused.stdout == (
        "refused: example.com:443 is not on the sandbox's allow list "
        "(add 'example.com' to sandbox.domains to allow it, "
        'or set proxy.unlisted = "ask" to be asked while a request waits)\n'
    )
    assert cli(user, "check", "host", "127.0.0.1:6443").returncode == 0
    assert cli(user, "check", "host", "127.0.0.1:6444").returncode == 1
    assert cli(user, "check", "host", "[::1]:x").returncode == 1


def test_check_host_names_the_injection(user: User) -> None:
    p = cli(user, "check", "host", "api.github.com")
    assert p.returncode == 0
    assert "terminates TLS for api.github.com" in p.stdout


def test_check_host_says_which_sandboxed_clients_reach_an_address_entry(user: User) -> None:
    user.writeConfig('[sandbox]\ndomains = ["example.org", "127.0.0.1:6443", "10.0.0.0/8"]\n')
    loop = cli(user, "check", "host", "127.0.0.1:6443")
    assert loop.returncode == 0
    assert "curl, wget, git, pip, Python) reach it through the proxy" in loop.stdout
    assert "sessions get NO_PROXY=localhost,::1 over the sandbox's own" in loop.stdout
    assert "fix: clients that ignore the proxy variables" in loop.stdout and "PROXY:localhost:%h:%p" in loop.stdout
    assert "fix: Go programs (kubectl, gh, terraform) never proxy a loopback address" in loop.stdout
    private = cli(user, "check", "host", "10.1.2.3:80")
    assert private.returncode == 0 and "fix: clients that ignore the proxy variables" in private.stdout
    assert "Go programs" not in private.stdout  # Go proxies private addresses as NO_PROXY says
    name = cli(user, "check", "host", "example.org")
    assert "NO_PROXY" not in name.stdout and "fix:" not in name.stdout


def test_install_into_a_managed_dir(user: User, tmp_path: Path) -> None:
    user.writeConfig('[sandbox]\nwrite = ["~/work"]\ndeny = ["~/work/scan"]\n')
    managed = tmp_path / "claude-code"
    machine = ("--config", str(user.configFile))  # root's file, in a root-only temp dir
    p = cli(user, "install", "--managed-dir", str(managed), *machine)
    assert p.returncode == 0, p.stderr
    drop = managed / "managed-settings.d/50-agentsandbox.json"
    assert p.stdout == f"installed {drop}\n"
    assert drop.read_text() == cli(user, "render", "claude", *machine).stdout
    assert (user.home / "work/scan").is_dir(), "install creates the deny mount points"
    again = cli(user, "install", "--managed-dir", str(managed), *machine)
    assert again.stdout == f"the drop-in {drop} is current\n"


@pytest.mark.parametrize("args", [["check"], ["render"], ["render", "nope"], ["check", "read"]])
def test_usage_errors(user: User, args: list[str]) -> None:
    p = cli(user, *args)
    assert p.returncode == 2 and "usage:" in p.stderr


def test_check_host_resolve_shows_the_address_decision(user: User) -> None:
    user.writeConfig('[sandbox]\ndomains = ["127.0.0.1:6443", "localhost:7000", "10.0.0.0/8:443"]\n')
    literal = cli(user, "check", "host", "127.0.0.1:6443", "--resolve")
    assert literal.returncode == 0, literal.stdout
    assert "127.0.0.1 is loopback, allowed by '127.0.0.1:6443'" in literal.stdout
    byName = cli(user, "check", "host", "localhost:7000", "--resolve")
    assert "allowed by name: localhost:7000" in byName.stdout
    assert "127.0.0.1" in byName.stdout
    elsewhere = user.base / "other.toml"
    elsewhere.write_text('[sandbox]\ndomains = ["example.org"]\n')
    assert cli(user, "check", "host", "example.org", "--config", str(elsewhere)).returncode == 0
    assert cli(user, "check", "--config", str(elsewhere), "host", "example.org").returncode == 0
    private = cli(user, "check", "host", "10.1.2.3", "--resolve")
    assert private.returncode == 0 and "10.1.2.3" in private.stdout


def test_check_decides_on_the_hooks_readings(user: User) -> None:
    """``check read|write`` and the hook agree, for every spelling the hook reads specially."""
    import io

    from agentsandbox import hook

    user.writeConfig('[sandbox]\nread = ["~/projects"]\n')
    repo = user.home / "projects/repo"
    (user.home / "private").mkdir()
    (repo / "link").symlink_to(user.home / "projects/other")
    (repo / "l-cwd").symlink_to("/proc/self/cwd")
    spellings = [" ~/private/x", "\ufeff../../private/x\u3000", "link/../../private/x", "/proc/self/environ",
                 "l-cwd/go.mod", "l-cwd/../../private/x",
                 "/dev/stdin", "go.mod", " go.mod", "link/../repo/go.mod", "/etc/hosts", "~/projects/x\t"]
    for kind, tool in (("read", "Read"), ("write", "Write")):
        for spelled in spellings:
            event = {"tool_name": tool, "cwd": str(repo), "tool_input": {"file_path": spelled}}
            hookAllows = hook.pretooluse(io.BytesIO(json.dumps(event).encode()), user.env) == ""
            p = cli(user, "check", kind, spelled, "--cwd", str(repo))
            assert (p.returncode == 0) == hookAllows, (kind, spelled, p.stdout)
    linked = cli(user, "check", "read", "link/../../private/x", "--cwd", str(repo))
    assert f"links before '..', to {user.home}/private/x" in linked.stdout
    proc = cli(user, "check", "read", "/proc/self/environ", "--cwd", str(repo))
    assert proc.stdout == "refused: /proc/self/environ is inside /proc, which names the reading process's own objects\n"
