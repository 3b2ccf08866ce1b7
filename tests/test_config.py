"""The config loader: lookup order, defaults, and every bad input with its exact error."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest

from agentsandbox.config import (
    BUILTIN,
    DEFAULT_DOMAINS,
    CommandSource,
    Config,
    ConfigError,
    EnvSource,
    FileSource,
    githubRules,
    parse,
)
from agentsandbox.loader import load, loads
from agentsandbox.paths import Paths
from tests.conftest import User


def test_builtin_defaults(user: User) -> None:
    c = load(None, user.env)
    assert c.source == BUILTIN
    assert c.sandbox.domains == DEFAULT_DOMAINS
    assert c.proxy.port == 3190
    assert c.proxy.endpoint == "tcp:3190:interface=127.0.0.1"
    assert c.broker.spool == user.h(".local/state/agentsandbox/spool")
    assert c.inject == githubRules()
    assert c.injectFor("github.com") is not None
    assert c.injectFor("codeload.github.com") is None


def test_lookup_order(user: User, tmp_path: Path) -> None:
    userFile = user.writeConfig('[sandbox]\ndomains = ["user.example.com"]\n')
    envFile = tmp_path / "env.toml"
    envFile.write_text('[sandbox]\ndomains = ["env.example.com"]\n')
    explicit = tmp_path / "explicit.toml"
    explicit.write_text('[sandbox]\ndomains = ["explicit.example.com"]\n')
    assert load(None, user.env).source == str(userFile)
    env = dict(user.env, AGENTSANDBOX_CONFIG=str(envFile))
    assert load(None, env).sandbox.domains == ("env.example.com",)
    assert load(str(explicit), env).sandbox.domains == ("explicit.example.com",)


def test_tilde_paths_expand_and_values_are_frozen(user: User) -> None:
    c = user.config('[sandbox]\nread = ["~/a", "/srv/b"]\nwrite = ["~/c/"]\n')
    assert c.sandbox.read == (user.h("a"), "/srv/b")
    assert c.sandbox.write == (user.h("c"),)
    with pytest.raises(AttributeError):
        c.sandbox.read = ()  # type: ignore[misc]


def test_inject_rules_and_render(user: User) -> None:
    c = user.config(
        """
[[inject]]
hosts = ["models.example.com"]
header = "x-api-key"
format = "{token}"
token_env = "MODEL_KEY"

[[inject]]
hosts = ["registry.example.org"]
format = "Basic {basic}"
basic_user = "ci"
token_file = "~/.secrets/registry"
renew = 60
"""
    )
    model, registry = c.inject
    assert model.header == "x-api-key" and model.token == EnvSource(env="MODEL_KEY")
    assert model.render("T") == "T"
    assert registry.token == FileSource(file=user.h(".secrets/registry"), renew=60.0)
    assert registry.token.renew == 60.0
    assert registry.render("T") == "Basic Y2k6VA=="
    github = githubRules()
    assert github[0].render("T") == "Basic eC1hY2Nlc3MtdG9rZW46VA=="
    assert github[1].render("T") == "token T"
    assert user.config("inject = []\n").inject == ()


def test_run_commands(user: User) -> None:
    c = user.config(
        """
[broker.run.cluster-up]
argv = ["/usr/bin/kind", "create", "cluster"]
args = ["^--name=[a-z]+$"]
timeout = 120
stream = false
env = ["KUBECONFIG"]
"""
    )
    cmd = c.broker.command("cluster-up")
    assert cmd is not None
    assert cmd.argv == ("/usr/bin/kind", "create", "cluster")
    assert cmd.timeout == 120.0 and not cmd.stream and cmd.env == ("KUBECONFIG",)


BAD = [
    ("[sandbox]\nreed = []\n", "sandbox.reed: unknown key (a typo here must not weaken the policy)"),
    ("bogus = 1\n", "bogus: unknown key (a typo here must not weaken the policy)"),
    ("[sandbox]\nread = \"~/x\"\n", "sandbox.read: must be a list of strings, not a string"),
    ("[sandbox]\nread = [1]\n", "sandbox.read[0]: must be a string, not an integer"),
    ("[sandbox]\nwrite = [\"relative/dir\"]\n", "sandbox.write[0]: 'relative/dir' is not absolute (write it as ~/… or /…)"),
    ("[sandbox]\ndomains = [\"*\"]\n", "sandbox.domains[0]: '*' would allow every host; list the hosts instead"),
    ("[sandbox]\ndomains = [\"\"]\n", "sandbox.domains[0]: an empty entry allows nothing; remove it"),
    ("[sandbox]\ndomains = [\"localhost\"]\n", "sandbox.domains[0]: 'localhost' would open every loopback port; loopback is reachable only through an explicit IP:port entry such as 127.0.0.1:6443"),
    ("[sandbox]\ndomains = [\"127.0.0.1\"]\n", "sandbox.domains[0]: '127.0.0.1' would open every loopback port; loopback is reachable only through an explicit IP:port entry such as 127.0.0.1:6443"),
    ("[sandbox]\ndomains = [\"::1\"]\n", "sandbox.domains[0]: '::1' would open every loopback port; loopback is reachable only through an explicit IP:port entry such as 127.0.0.1:6443"),
    ("[sandbox]\ndomains = [\"*.localhost\"]\n", "sandbox.domains[0]: '*.localhost' would open every loopback port; loopback is reachable only through an explicit IP:port entry such as 127.0.0.1:6443"),
    ("[sandbox]\ndomains = [\"127.0.0.0/8:80\"]\n", "sandbox.domains[0]: '127.0.0.0/8:80': loopback is reachable only through an explicit IP:port entry"),
    ("[sandbox]\ndomains = [\"127.0.0.1:3190\"]\n", "sandbox.domains[0]: '127.0.0.1:3190' is the egress proxy itself (proxy.port = 3190)"),
    ("[sandbox]\ndomains = [\"localhost:4000\"]\n[proxy]\nport = 4000\n", "sandbox.domains[0]: 'localhost:4000' is the egress proxy itself (proxy.port = 4000)"),
    ("[sandbox]\ndomains = [\"a.*.example.com\"]\n", "sandbox.domains[0]: 'a.*.example.com': a wildcard is allowed only as a leading '*.'"),
    ("[sandbox]\ndomains = [\"example.com:99999\"]\n", "sandbox.domains[0]: 'example.com:99999': port '99999' is not a number from 1 to 65535"),
    ("[sandbox]\ndomains = [\"exa mple.com\"]\n", "sandbox.domains[0]: 'exa mple.com' is not a valid host name"),
    ("[proxy]\nport = \"3190\"\n", "proxy.port: must be an integer, not a string"),
    ("[proxy]\nport = 70000\n", "proxy.port: 70000 is not a port from 1 to 65535"),
    ("[proxy]\nport = true\n", "proxy.port: must be an integer, not a boolean"),
    ("[proxy]\nmax_tunnels = 0\n", "proxy.max_tunnels: must be greater than zero"),
    ("[proxy]\nparent = \"socks5://x:1\"\n", "proxy.parent: 'socks5://x:1' must be http://HOST:PORT (an HTTP CONNECT proxy)"),
    ("[proxy]\nunlisted = \"allow\"\n", "proxy.unlisted: 'allow' is not one of 'refuse', 'ask', 'observe'"),
    ("[proxy]\nask_timeout = 0\n", "proxy.ask_timeout: must be greater than zero"),
    ("[proxy]\nmax_held = -1\n", "proxy.max_held: must be greater than zero"),
    ("[sandbox]\nrefused_domains = [\"*\"]\n", "sandbox.refused_domains[0]: '*' would allow every host; list the hosts instead"),
    ("sandbox = 3\n", "sandbox: must be a table, not an integer"),
    ("[[inject]]\nhosts = []\ntoken_env = \"T\"\n", "inject[0].hosts: list at least one host"),
    ("[[inject]]\nhosts = [\"*.example.com\"]\ntoken_env = \"T\"\n", "inject[0].hosts[0]: '*.example.com' must be a plain host name (no port, wildcard or IP)"),
    ("[[inject]]\nhosts = [\"a.example.com\"]\n", "inject[0].token_command: give exactly one of token_command, token_file and token_env"),
    ("[[inject]]\nhosts = [\"a.example.com\"]\ntoken_env = \"T\"\ntoken_file = \"/t\"\n", "inject[0].token_command: give exactly one of token_command, token_file and token_env (found token_file, token_env)"),
    ("[[inject]]\nhosts = [\"a.example.com\"]\ntoken_env = \"T\"\nformat = \"Bearer\"\n", "inject[0].format: must contain {token} or {basic}"),
    ("[[inject]]\nhosts = [\"a.example.com\"]\ntoken_env = \"T\"\nformat = \"Basic {basic}\"\n", "inject[0].basic_user: {basic} in format needs basic_user"),
    ("[[inject]]\nhosts = [\"a.example.com\"]\ntoken_env = \"T\"\nheader = \"Bad Header\"\n", "inject[0].header: 'Bad Header' is not an HTTP header name"),
    ("[[inject]]\nhosts = [\"a.example.com\"]\ntoken_env = \"T\"\n[[inject]]\nhosts = [\"A.example.com\"]\ntoken_env = \"U\"\n", "inject[1].hosts[0]: a.example.com already has a rule (inject[0])"),
    ("[[inject]]\nhosts = [\"a.example.com\"]\ntoken_env = \"T\"\nextra = 1\n", "inject[0].extra: unknown key (a typo here must not weaken the policy)"),
    ("[broker.run.up]\nargv = [\"kind\"]\n", "broker.run.up.argv[0]: 'kind' must be an absolute path to the program"),
    ("[broker.run.Up]\nargv = [\"/bin/true\"]\n", "broker.run.Up: a command name is lower case letters, digits, '.', '_', '-'"),
    ("[broker.run.up]\nargv = [\"/bin/true\"]\nargs = [\"(\"]\n", "broker.run.up.args[0]: not a regular expression: missing ), unterminated subpattern at position 0"),
    ("[scope]\nmemory_max = \"lots\"\n", "scope.memory_max: 'lots' is not a size (bytes, or a number with K, M, G or T, or infinity)"),
    ("[scope]\nslice = \"../x.slice\"\n", "scope.slice: '../x.slice' is not a systemd slice name (NAME.slice)"),
    ("[scope]\ncpu_quota = \"2 cores\"\n", "scope.cpu_quota: '2 cores' is not a percentage such as 200%"),
    ("[sandbox]\nread = [\"~/p\"]\nwrite = [\"~/p/r\"]\n", "sandbox.write: the writable path {home}/p/r lies inside the readable path {home}/p"),
]


@pytest.mark.parametrize(("text", "error"), BAD)
def test_bad_config_names_file_key_and_why(user: User, text: str, error: str) -> None:
    with pytest.raises(ConfigError) as e:
        loads(text.encode(), "/etc/agentsandbox/test.toml", Paths.fromEnvironment(user.env))
    assert str(e.value).startswith("/etc/agentsandbox/test.toml: " + error.replace("{home}", str(user.home)))


def _proxy(user: User, body: str) -> tuple[int, str]:
    c = loads(f"[proxy]\n{body}".encode(), "/etc/agentsandbox/test.toml", Paths.fromEnvironment(user.env))
    return c.proxy.port, c.proxy.endpoint


@pytest.mark.parametrize(
    ("body", "port", "endpoint"),
    [
        ('listen = "tcp:3190:interface=127.0.0.1"\n', 3190, "tcp:3190:interface=127.0.0.1"),
        ('listen = "tcp:port=3191:interface=127.0.0.1:backlog=64"\n', 3191, "tcp:port=3191:interface=127.0.0.1:backlog=64"),
        ('listen = "systemd:domain=INET:index=0"\n', 3190, "systemd:domain=INET:index=0"),
        ('port = 4000\nlisten = "systemd:domain=INET6:index=1"\n', 4000, "systemd:domain=INET6:index=1"),
        # HOST:PORT with a loopback HOST is shorthand; its port is the one the sandboxes dial.
        ('listen = "127.0.0.1:3191"\n', 3191, "tcp:3191:interface=127.0.0.1"),
        ('listen = "localhost:3190"\n', 3190, "tcp:3190:interface=127.0.0.1"),
        ('listen = "[::1]:3192"\n', 3192, "tcp:3192:interface=\\:\\:1"),
        ('port = 3193\nlisten = "127.0.0.1:3193"\n', 3193, "tcp:3193:interface=127.0.0.1"),
        # Port 0 (a free port, for tests) leaves proxy.port alone.
        ('listen = "tcp:0:interface=127.0.0.1"\n', 3190, "tcp:0:interface=127.0.0.1"),
    ],
)
def test_proxy_listen_forms(user: User, body: str, port: int, endpoint: str) -> None:
    assert _proxy(user, body) == (port, endpoint)


@pytest.mark.parametrize(
    ("listen", "why"),
    [
        ("0.0.0.0:3190", "the proxy would listen on '0.0.0.0', where other machines could reach it"),
        ("tcp:3190", "the proxy would listen on every interface, where other machines could reach it"),
        ("tcp:3190:interface=192.168.1.5", "the proxy would listen on '192.168.1.5'"),
        ("example.org:3190", "the proxy would listen on 'example.org'"),
        ("unix:/run/user/1000/proxy.sock", "'unix' is not an endpoint the proxy listens on (it serves TCP on loopback"),
        ("ssl:3190", "'ssl' is not an endpoint the proxy listens on"),
        ("systemd:domain=UNIX:index=0", "systemd: domain=UNIX is not INET or INET6 (the proxy serves TCP only)"),
        ("systemd:domain=INET", "systemd: index missing"),
        ("systemd:domain=INET:index=x", "systemd: index 'x' is not a number"),
        ("tcp:3190:interface=127.0.0.1:mode=600", "tcp: unknown option 'mode' (it takes port, interface, backlog)"),
        ("tcp:99999:interface=127.0.0.1", "port '99999' is not a number from 0 to 65535"),
        ("3190", "'3190' is neither an endpoint (tcp:..., systemd:...) nor HOST:PORT"),
        ("127.0.0.1", "'127.0.0.1' is neither an endpoint (tcp:..., systemd:...) nor HOST:PORT"),
    ],
)
def test_proxy_listen_refused_at_load_naming_the_forms_and_proxy_port(user: User, listen: str, why: str) -> None:
    with pytest.raises(ConfigError) as e:
        _proxy(user, f'listen = "{listen}"\n')
    text = str(e.value)
    assert text.startswith(f"/etc/agentsandbox/test.toml: proxy.listen: {why}"), text
    assert "Accepted: tcp:PORT:interface=ADDR" in text
    assert "systemd:domain=INET:index=N" in text and "systemd:domain=INET:index=0" in text
    assert "HOST:PORT with HOST a loopback address" in text
    assert "set proxy.port alone" in text


def test_proxy_listen_and_port_must_agree(user: User) -> None:
    with pytest.raises(ConfigError) as e:
        _proxy(user, 'port = 3190\nlisten = "127.0.0.1:3191"\n')
    assert str(e.value) == (
        "/etc/agentsandbox/test.toml: proxy.listen: listens on port 3191, but proxy.port (the port "
        "every sandbox dials) is 3190; set one port, in proxy.port"
    )


def test_not_toml_and_not_utf8(user: User) -> None:
    paths = Paths.fromEnvironment(user.env)
    with pytest.raises(ConfigError, match=r"^f.toml: not valid TOML: "):
        loads(b"[sandbox\n", "f.toml", paths)
    with pytest.raises(ConfigError, match=r"^f.toml: not UTF-8 "):
        loads(b"a = '\xff'\n", "f.toml", paths)


def test_unreadable_config(user: User, tmp_path: Path) -> None:
    missing = tmp_path / "missing.toml"
    with pytest.raises(ConfigError, match=r"missing.toml: cannot read the config: No such file"):
        load(str(missing), user.env)
    if os.getuid() != 0:
        secret = tmp_path / "secret.toml"
        secret.write_text("")
        secret.chmod(0)
        with pytest.raises(ConfigError, match="Permission denied"):
            load(str(secret), user.env)


def test_a_token_source_is_one_of_three_values_each_describing_itself(user: User) -> None:
    c = user.config(
        '[[inject]]\nhosts = ["a.example.org"]\ntoken_command = ["gh", "auth", "token"]\ntoken_timeout = 5\n\n'
        '[[inject]]\nhosts = ["b.example.org"]\ntoken_file = "~/.secrets/b"\nrenew = 60\n\n'
        '[[inject]]\nhosts = ["c.example.org"]\ntoken_env = "C_TOKEN"\ntoken_timeout = 9\n'
    )
    command, file, env = (rule.token for rule in c.inject)
    assert command == CommandSource(command=("gh", "auth", "token"), timeout=5.0)
    assert file == FileSource(file=user.h(".secrets/b"), renew=60.0)
    assert env == EnvSource(env="C_TOKEN")  # token_timeout bounds a command only
    assert [s.describe() for s in (command, file, env)] == [
        "command gh auth token",
        f"file {user.h('.secrets/b')}",
        "environment variable C_TOKEN",
    ]
    assert command.fix() == "make `gh auth token` print the token (for gh: `gh auth login`); the service retries"
    assert CommandSource(command=("/opt/vault", "read")).fix() == "make `/opt/vault read` print the token; the service retries"
    assert file.fix() == f"put the token in {user.h('.secrets/b')} (mode 0600)"
    assert env.fix().startswith("give the service $C_TOKEN: `systemctl --user set-environment C_TOKEN=…`")
    # The built-in rules share one value, so one keeper runs one command for GitHub.
    assert len({rule.token for rule in githubRules()}) == 1
    with pytest.raises(ConfigError, match=r"inject\[0\]\.token_timeout"):
        user.config('[[inject]]\nhosts = ["a.example.org"]\ntoken_env = "A"\ntoken_timeout = 0\n')


# ---------------------------------------------------------------------- request rules ([[inject.requests]], [github])


def _parsed(text: str) -> Config:
    return parse(tomllib.loads(text), "/c.toml", Paths.fromEnvironment({"HOME": "/home/u"}))


def test_rulesParseInOrderWithTheirKeys() -> None:
    config = _parsed(
        '[[inject]]\nhosts = ["llm.example.com"]\ntoken_env = "K"\nunmatched = "refuse"\n'
        '[[inject.requests]]\naction = "allow"\nmethods = ["POST"]\npath = "/v1/messages"\n'
        '[[inject.requests]]\naction = "allow"\npath = "/v1/models/**"\n'
    )
    rule = config.inject[0]
    assert rule.unmatched == "refuse" and rule.key == "inject[0]"
    assert [(r.key, r.action, r.methods, r.path) for r in rule.requests] == [
        ("inject[0].requests[0]", "allow", ("POST",), "/v1/messages"),
        ("inject[0].requests[1]", "allow", (), "/v1/models/**"),
    ]


def test_githubTableShapesTheBuiltInRule() -> None:
    config = _parsed('[github]\n[[github.requests]]\naction = "refuse"\nmethods = ["POST"]\npath = "/gists"\nhost = "api.github.com"\n')
    api = config.injectFor("api.github.com")
    web = config.injectFor("github.com")
    assert api is not None and web is not None
    assert [r.key for r in api.requests] == ["github.requests[0]"] and web.requests == ()


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('[[inject]]\nhosts = ["a.example.com"]\ntoken_env = "T"\n[[inject.requests]]\naction = "deny"\npath = "/"\n',
         "inject[0].requests[0].action: 'deny' is not \"allow\" or \"refuse\""),
        ('[[inject]]\nhosts = ["a.example.com"]\ntoken_env = "T"\n[[inject.requests]]\naction = "allow"\npath = "v1"\n',
         "inject[0].requests[0].path: 'v1' is not a path pattern"),
        ('[[inject]]\nhosts = ["a.example.com"]\ntoken_env = "T"\n[[inject.requests]]\naction = "allow"\npath = "/a/../b"\n',
         "inject[0].requests[0].path: '/a/../b': a segment is '**' alone, and never '.' or '..'"),
        ('[[inject]]\nhosts = ["a.example.com"]\ntoken_env = "T"\n[[inject.requests]]\naction = "allow"\npath = "/a**"\n',
         "inject[0].requests[0].path: '/a**': a segment is '**' alone"),
        ('[[inject]]\nhosts = ["a.example.com"]\ntoken_env = "T"\n[[inject.requests]]\naction = "allow"\npath = "/a?b"\n',
         "inject[0].requests[0].path: '/a?b' is not a path pattern"),
        ('[[inject]]\nhosts = ["a.example.com"]\ntoken_env = "T"\n[[inject.requests]]\naction = "allow"\npath = "/"\nmethods = ["get"]\n',
         "inject[0].requests[0].methods[0]: 'get' is not an HTTP method in capitals"),
        ('[[inject]]\nhosts = ["a.example.com"]\ntoken_env = "T"\n[[inject.requests]]\naction = "allow"\npath = "/"\nhost = "b.example.com"\n',
         "inject[0].requests[0].host: 'b.example.com' is not one of this rule's hosts (a.example.com)"),
        ('[[inject]]\nhosts = ["a.example.com"]\ntoken_env = "T"\n[[inject.requests]]\naction = "allow"\npath = "/"\nmetod = "GET"\n',
         "inject[0].requests[0].metod: unknown key"),
        ('[[inject]]\nhosts = ["a.example.com"]\ntoken_env = "T"\nunmatched = "deny"\n',
         "inject[0].unmatched: 'deny' is not \"allow\" or \"refuse\""),
        ('[[inject]]\nhosts = ["a.example.com"]\ntoken_env = "T"\n[github]\nunmatched = "refuse"\n',
         "github.requests: [github] shapes the built-in GitHub rule, which [[inject]] tables replace"),
        ('[github]\nrepos = 1\n', "github.repos: must be a list of strings, not an integer"),
        ('[github]\nrepos = ["octocat"]\n', "github.repos[0]: 'octocat' is not OWNER/NAME or OWNER/*"),
        ('[github]\nrepos = ["o/*/x"]\n', "github.repos[0]: 'o/*/x' is not OWNER/NAME or OWNER/*"),
        ('[github]\nrepos = ["o/r"]\nmutations = ["add-star"]\n', "github.mutations[0]: 'add-star' is not a GraphQL mutation name"),
        ('[github]\nmutations = ["addStar"]\n', "github.mutations: mutations are allowed by name only while github.repos is set"),
    ],
)
def test_badRulesNameFileAndKey(text: str, error: str) -> None:
    with pytest.raises(ConfigError) as e:
        _parsed(text)
    assert str(e.value).startswith("/c.toml: " + error), str(e.value)
