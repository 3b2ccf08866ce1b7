"""The machine's config bounds a user's (issue 24): discovery, narrowing key by key, the policy helper."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentsandbox import claude, policyhelper
from agentsandbox.allowlist import Entry
from agentsandbox.config import BUILTIN, ConfigError
from agentsandbox.loader import load
from agentsandbox.policy import Policy, otherHomes
from tests.conftest import REPO, MachineConfig, User

MACHINE = """\
[sandbox]
read = ["~/docs", "~/projects"]
write = ["~/projects", "~/go/pkg/mod"]
deny = ["~/projects/secret"]
domains = ["*.example.com", "example.org", "10.0.0.0/8", "127.0.0.1:6443"]
keep_env = ["LC_*", "AWS_REGION"]
allow_tools = ["PowerShell"]

[proxy]
port = 3190
max_tunnels = 100

[run]
env = ["PATH", "HOME", "LC_*"]
"""


# --------------------------------------------------------------------------- discovery


def test_without_a_machine_config_the_users_file_is_the_policy(user: User, machineFile: MachineConfig) -> None:
    assert load(None, user.env).source == BUILTIN
    user.writeConfig('[sandbox]\nwrite = ["~/anywhere"]\n')
    config = load(None, user.env)
    assert config.source == str(user.configFile) and config.machine is None and not config.notices
    assert config.sandbox.write == (user.h("anywhere"),)
    assert config.served == str(user.configFile)


def test_with_only_the_machine_config_it_is_served(user: User, machineFile: MachineConfig) -> None:
    machineFile.write(MACHINE)
    config = load(None, user.env)
    assert config.source == config.machine == str(machineFile.path)
    assert config.served == f"{machineFile.path} (the machine's)"
    # ~ in the machine's file is each user's own home.
    assert config.sandbox.read == (user.h("docs"), user.h("projects"))


def test_the_machine_file_is_never_taken_from_the_environment(user: User, machineFile: MachineConfig) -> None:
    """$AGENTSANDBOX_CONFIG names the user's layer; it cannot replace the admin's bounds."""
    machineFile.write(MACHINE)
    own = user.base / "mine.toml"
    own.write_text('[sandbox]\nwrite = ["~/anywhere"]\n')
    config = load(None, {**user.env, "AGENTSANDBOX_CONFIG": str(own)})
    assert config.machine == str(machineFile.path) and config.sandbox.write == ()
    assert "sandbox.write[0]" in config.notices[0]
    # Naming the machine's own file is reading it alone.
    assert load(str(machineFile.path), user.env).source == str(machineFile.path)


def test_a_broken_machine_config_names_the_machine_file(user: User, machineFile: MachineConfig) -> None:
    machineFile.write("[sandbox]\nread = 1\n")
    user.writeConfig("")
    with pytest.raises(ConfigError) as e:
        load(None, user.env)
    assert e.value.source == str(machineFile.path) and e.value.key == "sandbox.read"


def test_a_broken_user_config_names_the_user_file(user: User, machineFile: MachineConfig) -> None:
    machineFile.write(MACHINE)
    user.writeConfig("[sandbox]\nwrite = 1\n")
    with pytest.raises(ConfigError) as e:
        load(None, user.env)
    assert e.value.source == str(user.configFile) and e.value.key == "sandbox.write"


# --------------------------------------------------------------------------- narrowing


def test_a_user_file_that_only_narrows_is_honoured_with_no_notice(user: User, machineFile: MachineConfig) -> None:
    machineFile.write(MACHINE)
    user.writeConfig(
        '[sandbox]\nread = ["~/docs/public"]\nwrite = ["~/projects/repo"]\ndeny = ["~/projects/repo/.env"]\n'
        'domains = ["api.example.com", "example.org", "10.1.0.0/16"]\nkeep_env = ["LC_ALL"]\n'
        'unset_env = ["MY_*"]\nallow_tools = []\n[run]\nenv = ["PATH"]\n'
    )
    config = load(None, user.env)
    assert config.notices == ()
    assert config.served == f"{machineFile.path} (the machine's), narrowed by {user.configFile}"
    sb = config.sandbox
    assert sb.read == (user.h("docs/public"),)
    assert sb.write == (user.h("projects/repo"),)
    assert sb.deny == (user.h("projects/secret"), user.h("projects/repo/.env"))
    assert sb.domains == ("api.example.com", "example.org", "10.1.0.0/16")
    assert sb.keep_env == ("LC_ALL",)
    assert sb.unset_env[-1] == "MY_*" and "GITHUB_TOKEN" in sb.unset_env
    assert sb.allow_tools == ()
    assert config.run.env == ("PATH",)


def test_each_wish_the_machine_does_not_grant_is_left_out_naming_both_files_and_the_key(
    user: User, machineFile: MachineConfig
) -> None:
    machineFile.write(MACHINE)
    user.writeConfig(
        '[sandbox]\nread = ["~/docs", "~/Documents"]\nwrite = ["~/projects/repo", "~/src/other"]\n'
        'domains = ["example.org", "*.example.net", "example.com", "10.0.0.0/7", "127.0.0.1:22"]\n'
        'keep_env = ["GITHUB_TOKEN"]\nallow_tools = ["Workflow"]\n'
        '[proxy]\nport = 4000\ndispatch_root = true\nmax_tunnels = 10\n[run]\nenv = ["PATH", "AWS_SECRET_ACCESS_KEY"]\n'
    )
    config = load(None, user.env)
    sb = config.sandbox
    assert sb.read == (user.h("docs"),)
    assert sb.write == (user.h("projects/repo"),)
    assert sb.domains == ("example.org",)
    assert sb.keep_env == () and sb.allow_tools == ()
    assert config.run.env == ("PATH",)
    # Where the sandboxes dial is the machine's; the proxy's own limits are the user's.
    assert config.proxy.port == 3190 and config.proxy.dispatch_root is False
    assert config.proxy.max_tunnels == 10
    keys = [n.split(": ", 1)[1].split(" = ", 1)[0] for n in config.notices]
    assert keys == [
        "sandbox.read[1]", "sandbox.write[1]", "sandbox.domains[1]", "sandbox.domains[2]",
        "sandbox.domains[3]", "sandbox.domains[4]", "sandbox.keep_env[0]", "sandbox.allow_tools[0]",
        "run.env[1]", "proxy.port", "proxy.dispatch_root",
    ]
    first = config.notices[0]
    assert first.startswith(f"{user.configFile}: sandbox.read[1] = '{user.h('Documents')}'")
    assert f"not granted by the machine's config {machineFile.path} (sandbox.read)" in first


def test_what_is_the_users_by_nature_is_theirs(user: User, machineFile: MachineConfig) -> None:
    machineFile.write(MACHINE + '\n[[inject]]\nhosts = ["api.example.com"]\ntoken_env = "MACHINE_TOKEN"\n')
    assert [r.hosts for r in load(None, user.env).inject] == [("api.example.com",)]
    user.writeConfig(
        'inject = []\n[broker.run.build]\nargv = ["/usr/bin/make"]\n[scope]\nmemory_max = "2G"\n'
        '[audit]\nkeep = 9\n[proxy]\nparent = "http://127.0.0.1:8080"\n'
    )
    config = load(None, user.env)
    assert config.inject == () and config.notices == ()
    assert config.broker.command("build") is not None
    assert config.scope.memory_max == "2G" and config.audit.keep == 9
    assert config.proxy.parent == "http://127.0.0.1:8080"


def test_require_session_is_the_machines_or_stricter(user: User, machineFile: MachineConfig) -> None:
    machineFile.write(MACHINE)
    user.writeConfig("[proxy]\nrequire_session = true\n")
    assert load(None, user.env).proxy.require_session is True  # a user may turn it on
    machineFile.write(MACHINE.replace("max_tunnels = 100\n", "max_tunnels = 100\nrequire_session = true\n"))
    user.writeConfig("[proxy]\nrequire_session = false\n")
    config = load(None, user.env)
    assert config.proxy.require_session is True  # ...never off
    assert [n.split(": ", 1)[1].split(" = ", 1)[0] for n in config.notices] == ["proxy.require_session"]


def test_a_users_github_table_is_their_inject_rule(user: User, machineFile: MachineConfig) -> None:
    """[github] shapes the built-in GitHub rule, which is the user's as [[inject]] is."""
    # The machine lets GitHub's API through: the built-in rule applies only where a host is allowed.
    machineFile.write(MACHINE.replace('domains = [', 'domains = ["api.github.com", ', 1)
                      + '\n[[inject]]\nhosts = ["api.example.com"]\ntoken_env = "MACHINE_TOKEN"\n')
    user.writeConfig('[github]\n[[github.requests]]\naction = "refuse"\nmethods = ["POST"]\npath = "/gists"\n')
    config = load(None, user.env)
    assert config.injectFor("github.com") is None, "not on the machine's allow list"
    api = config.injectFor("api.github.com")
    assert api is not None and [r.key for r in api.requests] == ["github.requests[0]"]
    assert config.injectFor("api.example.com") is None and config.notices == ()


def test_the_narrowed_layout_is_checked_again(user: User, machineFile: MachineConfig) -> None:
    """A user's read and write may each be granted yet nest in a way the sandbox cannot mount."""
    # ~/a is the machine's to write; the user reads all of it and writes only ~/a/w,
    # both granted, and the sandbox would mount ~/a read-only over ~/a/w.
    machineFile.write('[sandbox]\nwrite = ["~/a"]\n')
    user.writeConfig('[sandbox]\nread = ["~/a"]\nwrite = ["~/a/w"]\n')
    with pytest.raises(ConfigError) as e:
        load(None, user.env)
    assert e.value.key == "sandbox.write" and "lies inside the readable path" in str(e.value)


@pytest.mark.parametrize(
    ("inner", "outer", "within"),
    [
        ("api.example.com", "*.example.com", True),
        ("a.b.example.com", "*.example.com", True),
        ("*.a.example.com", "*.example.com", True),
        ("*.example.com", "*.example.com", True),
        ("example.com", "*.example.com", False),
        ("*.example.com", "example.com", False),
        ("*.example.com", "api.example.com", False),
        ("example.org:443", "example.org", True),
        ("example.org", "example.org:443", False),
        ("example.org:8443", "example.org:443", False),
        ("10.1.0.0/16", "10.0.0.0/8", True),
        ("10.0.0.0/7", "10.0.0.0/8", False),
        ("10.1.2.3", "10.0.0.0/8", True),
        ("10.1.2.3/32", "10.1.2.3", True),
        ("127.0.0.1:6443", "127.0.0.1:6443", True),
        ("127.0.0.1:22", "127.0.0.1:6443", False),
        ("::1:443", "example.org", False),
        ("2001:db8::/48", "2001:db8::/32", True),
        ("2001:db8::/48", "10.0.0.0/8", False),
    ],
)
def test_an_allow_list_entry_is_within_another_only_where_it_allows_less(inner: str, outer: str, within: bool) -> None:
    assert Entry.parse(inner).within(Entry.parse(outer)) is within


# --------------------------------------------------------------------------- other people's homes


def test_other_homes_are_roots_and_login_accounts_but_not_services_nor_ones_own(tmp_path: Path) -> None:
    homes = tmp_path / "home"
    for name in ("ann", "bob", "me"):
        (homes / name).mkdir(parents=True)
    (tmp_path / "root").mkdir()
    passwd = tmp_path / "passwd"
    passwd.write_text(
        f"root:x:0:0:root:{tmp_path}/root:/bin/bash\n"
        "bin:x:2:2:bin:/bin:/usr/sbin/nologin\n"
        f"ann:x:1000:1000::{homes}/ann:/bin/bash\n"
        f"bob:x:1001:1001::{homes}/bob/:/bin/bash\n"
        f"me:x:1002:1002::{homes}/me:/bin/bash\n"
        f"gone:x:1003:1003::{homes}/gone:/bin/bash\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
        "broken line\n"
    )
    defs = tmp_path / "login.defs"
    defs.write_text("UID_MIN 1000\nUID_MAX 60000\n")
    found = otherHomes(1002, str(homes / "me"), str(passwd), str(defs))
    assert found == (str(homes / "ann"), str(homes / "bob"), str(tmp_path / "root"))
    # A session whose HOME lies inside another account's home does not close its own.
    assert str(homes / "ann") not in otherHomes(1002, str(homes / "ann" / "sub"), str(passwd), str(defs))
    defs.write_text("UID_MIN 1001\n")
    assert str(homes / "ann") not in otherHomes(1002, str(homes / "me"), str(passwd), str(defs))


def test_other_homes_are_closed_to_the_hook_and_run(user: User, tmp_path: Path) -> None:
    from tests.conftest import hookDecision

    other = tmp_path / "home" / "bob"
    other.mkdir(parents=True)
    (other / "notes.txt").write_text("bob's\n")
    policy = user.policy(others=(str(other),))
    assert not policy.readable(str(other / "notes.txt"), "/")
    assert str(other) in policy.closed()
    from agentsandbox import srt

    assert str(other) in srt.render(policy)["filesystem"]["denyRead"]
    # The hook builds its policy from the machine's accounts: a home listed in
    # /etc/passwd (here, if any) is closed; the fixture's own home never is.
    live = Policy.fromConfig(user.config(), user.env)
    assert user.home.as_posix() not in live.others
    for home in live.others:
        reason = hookDecision(user, "Read", file_path=os.path.join(home, ".bashrc"))
        assert reason is not None and home in reason


# --------------------------------------------------------------------------- the policy helper


def test_the_helper_prints_this_users_policy_merged_with_the_other_managed_files(
    user: User, machineFile: MachineConfig, tmp_path: Path
) -> None:
    machineFile.write(MACHINE)
    user.writeConfig('[sandbox]\ndomains = ["api.example.com"]\ndeny = ["~/projects/private"]\n')
    managed = tmp_path / "claude-code"
    (managed / "managed-settings.d").mkdir(parents=True)
    (managed / "managed-settings.json").write_text('{"permissions": {"deny": ["Read(//srv/vault/**)"]}, "x": 1}\n')
    (managed / "managed-settings.d" / "10-vendor.json").write_text(
        '{"sandbox": {"network": {"allowedDomains": ["vendor.example.com"]}}, "x": 2}\n')
    (managed / "managed-settings.d" / "90-late.json").write_text('{"x": 3, "sandbox": {"enabled": false}}\n')
    (managed / "managed-settings.d" / "20-broken.json").write_text("{not json\n")
    claude.install(claude.machinePolicy(user.env), str(managed))
    settings, notes = policyhelper.sessionSettings(user.env, str(managed))
    assert "policyHelper" not in settings
    assert settings["x"] == 3 and settings["sandbox"]["enabled"] is False  # a later file's scalar wins, as in Claude Code
    assert settings["permissions"]["deny"][0] == "Read(//srv/vault/**)"
    assert "Read(~/projects/private)" in settings["permissions"]["deny"]
    assert settings["sandbox"]["network"]["allowedDomains"] == ["vendor.example.com", "api.example.com"]
    assert notes == [f"{managed}/managed-settings.d/20-broken.json is left out: "
                     "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"]
    assert (user.home / "projects" / "private").is_dir(), "the user's deny paths exist before the sandbox mounts them"


def test_the_helper_as_claude_code_runs_it(user: User, machineFile: MachineConfig, tmp_path: Path) -> None:
    """The console script's contract: JSON on stdout and 0, or our reason on stderr and 1 (no session)."""
    env = {**user.env, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-c", f"import sys, agentsandbox.paths as p; p.SYSTEM_CONFIG = {str(machineFile.path)!r}; "
               "from agentsandbox.policyhelper import main; sys.exit(main())"]
    user.writeConfig('[sandbox]\ndomains = ["example.org"]\n')
    ok = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    managed = json.loads(ok.stdout)["managedSettings"]
    assert managed["sandbox"]["network"]["allowedDomains"] == ["example.org"]
    assert "twisted" not in subprocess.run(
        [sys.executable, "-c", "import sys, agentsandbox.policyhelper as h; h.sessionSettings(dict(__import__('os').environ)); "
         "print(sorted(m for m in sys.modules if m.startswith('twisted')))"],
        env=env, capture_output=True, text=True, timeout=60).stdout.replace("[]", "")
    user.writeConfig("[sandbox]\nwrite = 1\n")
    bad = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and bad.stdout == ""
    assert bad.stderr.startswith(f"agentsandbox: {user.configFile}: sandbox.write: ")
    assert "Claude Code starts once the config loads" in bad.stderr


def test_merge_follows_claude_codes_rule() -> None:
    merged = policyhelper.mergeSettings(
        {"a": [1, "x", {"k": 1}], "o": {"p": 1, "q": [1]}, "s": 1},
        {"a": ["x", 2, {"k": 1}], "o": {"q": [1, 2]}, "s": {"now": "object"}},
    )
    assert merged == {"a": [1, "x", {"k": 1}, 2, {"k": 1}], "o": {"p": 1, "q": [1, 2]}, "s": {"now": "object"}}


def test_the_helper_names_the_agentsandbox_beside_it(tmp_path: Path) -> None:
    """Claude Code runs the helper by the drop-in's absolute path: its hooks name the command beside it."""
    helper = tmp_path / "bin" / claude.HELPER_NAME
    helper.parent.mkdir()
    helper.write_text("")
    assert policyhelper.installationExe(str(helper)) is None  # no agentsandbox beside it
    (tmp_path / "bin" / "agentsandbox").write_text("")
    assert policyhelper.installationExe(str(helper)) == str(tmp_path / "bin" / "agentsandbox")
    assert policyhelper.installationExe(claude.HELPER_NAME) is None
    assert policyhelper.installationExe(str(tmp_path / "bin" / "other")) is None


def test_the_built_in_github_rule_follows_the_narrowed_allow_list(user: User, machineFile: MachineConfig) -> None:
    machineFile.write('[sandbox]\ndomains = ["github.com", "api.github.com", "example.org"]\n')
    assert [r.hosts for r in load(None, user.env).inject] == [("github.com",), ("api.github.com",)]
    user.writeConfig('[sandbox]\ndomains = ["example.org"]\n')
    narrowed = load(None, user.env)
    assert narrowed.inject_builtin and narrowed.inject == ()
    user.writeConfig('inject = []\n')
    assert not load(None, user.env).inject_builtin


def test_running_a_cap_uncapped_is_the_machines_to_allow(user: User, machineFile: MachineConfig) -> None:
    machineFile.write(MACHINE)
    user.writeConfig('[scope]\nmemory_max = "2G"\nallow_uncapped = true\n')
    config = load(None, user.env)
    assert config.scope.memory_max == "2G" and config.scope.allow_uncapped is False
    assert "scope.allow_uncapped = True is not granted" in config.notices[0]
    machineFile.write(MACHINE + '\n[scope]\nallow_uncapped = true\n')
    assert load(None, user.env).scope.allow_uncapped is True


# --------------------------------------------------------------------------- unlisted hosts (issue 28)


def _leftOut(notices: tuple[str, ...]) -> list[str]:
    return [n.split(": ", 1)[1].split(" = ", 1)[0] for n in notices]


def test_unlisted_is_at_most_the_machines(user: User, machineFile: MachineConfig) -> None:
    """refuse < ask < observe: a user may choose the machine's or a stricter one."""
    machineFile.write(MACHINE)  # no proxy.unlisted: the built-in refuse
    user.writeConfig('[proxy]\nunlisted = "ask"\n')
    config = load(None, user.env)
    assert config.proxy.unlisted == "refuse" and _leftOut(config.notices) == ["proxy.unlisted"]
    machineFile.write(MACHINE.replace("max_tunnels = 100\n", 'max_tunnels = 100\nunlisted = "ask"\n'))
    for wished, got, notices in (("refuse", "refuse", []), ("ask", "ask", []), ("observe", "ask", ["proxy.unlisted"])):
        user.writeConfig(f'[proxy]\nunlisted = "{wished}"\nask_timeout = 30\nmax_held = 4\n')
        config = load(None, user.env)
        assert (config.proxy.unlisted, _leftOut(config.notices)) == (got, notices)
        assert (config.proxy.ask_timeout, config.proxy.max_held) == (30.0, 4)  # the user's limits
    user.writeConfig("[proxy]\nmax_held = 4\n")
    assert load(None, user.env).proxy.unlisted == "ask"  # not given: the machine's


def test_one_order_of_permissiveness() -> None:
    from agentsandbox import config, machine

    assert machine.UNLISTED == config.UNLISTED == ("refuse", "ask", "observe")


def test_without_a_machine_config_unlisted_is_the_users_choice(user: User, machineFile: MachineConfig) -> None:
    assert load(None, user.env).proxy.unlisted == "refuse"
    user.writeConfig('[proxy]\nunlisted = "observe"\n')
    assert load(None, user.env).proxy.unlisted == "observe"


def test_a_machine_that_asks_keeps_the_persons_name_entries_but_not_their_addresses(
    user: User, machineFile: MachineConfig
) -> None:
    """The machine handed unlisted names to each person; addresses are never asked."""
    wished = ["api.example.com", "example.net", "*.example.edu", "example.net:8443",
              "192.0.2.10:443", "172.16.0.0/12", "localhost:8080", "10.1.0.0/16"]
    user.writeConfig(f"[sandbox]\ndomains = {json.dumps(wished)}\nrefused_domains = [\"evil.example.com\"]\n")
    machineFile.write(MACHINE)
    refusing = load(None, user.env)
    assert refusing.sandbox.domains == ("api.example.com", "10.1.0.0/16")
    machineFile.write(
        MACHINE.replace("max_tunnels = 100\n", 'max_tunnels = 100\nunlisted = "ask"\n')
        .replace("keep_env", 'refused_domains = ["bad.example.org"]\nkeep_env')
    )
    asking = load(None, user.env)
    assert asking.sandbox.domains == (
        "api.example.com", "example.net", "*.example.edu", "example.net:8443", "10.1.0.0/16"
    )
    assert _leftOut(asking.notices) == ["sandbox.domains[4]", "sandbox.domains[5]", "sandbox.domains[6]"]
    # Refusals are the machine's plus the person's.
    assert asking.sandbox.refused_domains == ("bad.example.org", "evil.example.com")
