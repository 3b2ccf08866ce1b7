"""The config file: TOML in, a frozen Config out.  Every error names the file and the key.

The user's file: ``--config`` > ``$AGENTSANDBOX_CONFIG`` > ``~/.config/agentsandbox/config.toml``.
On a machine with ``/etc/agentsandbox/config.toml`` that file is the policy and
the user's only narrows it (``machine.narrow``); without one, the user's file
(or the built-in defaults) is the policy.  Unknown keys are errors, because a
typo must never silently weaken a policy.

It owns the config's values, the token sources among them (``CommandSource``,
``FileSource``, ``EnvSource``: where a token comes from, how that is named and
what fixes it when it gives none); ``tokens.py`` fetches from them.

Stdlib only: the hook loads the config on every file-tool call.
"""

from __future__ import annotations

import functools
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeVar, cast

from agentsandbox.allowlist import (
    AllowList,
    Entry,
    EntryError,
    isLoopbackName,
    parseIP,
    unwrapMapped,
)
from agentsandbox.paths import DISPATCH_SOCKET, Paths, locateConfig
from agentsandbox.tools import reopenable

BUILTIN = "<built-in defaults>"

DEFAULT_PROXY_PORT = 3190

#: Credential-looking variables the SessionStart hook unsets in sandboxed Bash.
DEFAULT_UNSET_ENV = (
    "*_TOKEN",
    "*_TOKEN_*",
    "*_API_KEY",
    "*_APIKEY",
    "*_SECRET",
    "*_SECRET_*",
    "*SECRET_KEY*",
    "*_PASSWORD*",
    "*_PASSWD*",
    "*_CREDENTIALS",
    "*_PAT",
    "AWS_*",
    "AZURE_CLIENT_SECRET",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "GH_ENTERPRISE_TOKEN",
    "GITHUB_TOKEN",
    "GH_TOKEN",
    "ANTHROPIC_API_KEY",
    "ANTHROPIC_AUTH_TOKEN",
    "CLAUDE_CODE_OAUTH_TOKEN",
    "OPENAI_API_KEY",
    "NPM_TOKEN",
    "NODE_AUTH_TOKEN",
    "PYPI_TOKEN",
    "TWINE_PASSWORD",
    "DOCKER_AUTH_CONFIG",
    "KUBECONFIG",
    "VAULT_TOKEN",
    "SSH_AUTH_SOCK",
    "SSH_AGENT_PID",
    "GPG_AGENT_INFO",
    "DBUS_SESSION_BUS_ADDRESS",
)

#: Variables `agentsandbox run` passes to the command; everything else is dropped.
DEFAULT_RUN_ENV = (
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "SHELL",
    "TERM",
    "COLORTERM",
    "LANG",
    "LANGUAGE",
    "LC_*",
    "TZ",
    "EDITOR",
    "VISUAL",
    "PAGER",
)

GITHUB_HOSTS = ("github.com", "api.github.com", "uploads.github.com")

#: The allow list when the config names none: GitHub, whose token the built-in
#: inject rule sets.  A config's own ``domains`` replaces it.
#: ``proxy.unlisted``, from the least permissive to the most (``machine.narrow``
#: keeps a user's value only when it is not more permissive than the machine's).
UNLISTED = ("refuse", "ask", "observe")
Unlisted = Literal["refuse", "ask", "observe"]

#: 90 s: long enough to read a notification and answer, and shorter than Claude
#: Code's Bash tool timeout (2 minutes by default), so the agent reads the
#: proxy's words ("nobody answered ...") rather than a command killed for time.
DEFAULT_ASK_TIMEOUT = 90.0

DEFAULT_DOMAINS = ("github.com", "*.github.com", "*.githubusercontent.com")


class ConfigError(Exception):
    """A config that cannot be used.  ``str()`` is ``FILE: KEY: WHY``."""

    def __init__(self, source: str, key: str, why: str) -> None:
        super().__init__(f"{source}: {key}: {why}" if key else f"{source}: {why}")
        self.source = source
        self.key = key
        self.why = why


#: Seconds between fetches of a token (``renew``).
DEFAULT_RENEW = 300.0
#: Seconds a token command may run (``token_timeout``).
DEFAULT_TOKEN_TIMEOUT = 30.0


# A token source is one of three frozen values, each named after its config key
# (``token_command``, ``token_file``, ``token_env``).  ``describe()`` is how
# status, doctor and the keeper's log name it; ``fix()`` is what doctor tells a
# person to do when it gave no token.  Neither ever holds the token.


@dataclass(frozen=True)
class CommandSource:
    """The token is what ``command`` prints (``token_command``), run in the service's environment."""

    command: tuple[str, ...]
    renew: float = DEFAULT_RENEW
    timeout: float = DEFAULT_TOKEN_TIMEOUT

    def describe(self) -> str:
        return "command " + " ".join(self.command)

    def fix(self) -> str:
        hint = " (for gh: `gh auth login`)" if os.path.basename(self.command[0]) == "gh" else ""
        return f"make `{' '.join(self.command)}` print the token{hint}; the service retries"


@dataclass(frozen=True)
class FileSource:
    """The token is the content of ``file`` (``token_file``), read again at each renewal."""

    file: str
    renew: float = DEFAULT_RENEW

    def describe(self) -> str:
        return "file " + self.file

    def fix(self) -> str:
        return f"put the token in {self.file} (mode 0600)"


@dataclass(frozen=True)
class EnvSource:
    """The token is the service's own environment variable ``env`` (``token_env``)."""

    env: str
    renew: float = DEFAULT_RENEW

    def describe(self) -> str:
        return f"environment variable {self.env}"

    def fix(self) -> str:
        return (
            f"give the service ${self.env}: `systemctl --user set-environment {self.env}=…` "
            "then restart it, or set it where `agentsandbox serve` runs"
        )


#: Where a token comes from: exactly one of a command, a file and a variable.
TokenSource = CommandSource | FileSource | EnvSource


#: What a request rule does with a request it matches (``action``), and what
#: a rule's ``unmatched`` does with one no rule matches.
ALLOW, REFUSE = "allow", "refuse"
ACTIONS = (ALLOW, REFUSE)


@dataclass(frozen=True)
class RequestRule:
    """One ``[[inject.requests]]`` (or ``[[github.requests]]``) entry: requests of
    ``methods`` (any when empty) to a path ``path`` matches, on ``host`` (any of
    the rule's hosts when None), are let through (``allow``) or answered 403
    (``refuse``).  ``key`` is where it is written, for the refusal's text.

    ``path`` is a pattern of ``/``-separated segments: ``*`` inside a segment
    matches any run of characters but ``/``, a segment ``**`` any number of
    segments (none included).  ``egress/reqrules.py`` matches it.
    """

    key: str
    action: str
    path: str
    methods: tuple[str, ...] = ()
    host: str | None = None

    def describe(self) -> str:
        methods = ",".join(self.methods) if self.methods else "any method"
        on = f" on {self.host}" if self.host else ""
        return f"{self.action} {methods} {self.path}{on}"


@dataclass(frozen=True)
class InjectRule:
    """Set ``header`` to ``format`` on requests to ``hosts`` (TLS terminated on 443).

    ``format`` may hold ``{token}`` and ``{basic}``; ``{basic}`` is
    ``base64(basic_user + ":" + token)``.  ``requests`` are the ordered
    request rules (the first that matches decides); a request none matches is
    let through when ``unmatched`` is ``allow``.  ``key`` names the rule in
    refusals: ``inject[N]``, or ``github`` for the built-in rule.
    """

    hosts: tuple[str, ...]
    header: str
    format: str
    token: TokenSource
    basic_user: str | None = None
    #: One of the built-in GitHub rules (``githubRules``), not a ``[[inject]]`` of the
    #: config: it applies only where it can work (``builtinRules``).
    builtin: bool = False
    requests: tuple[RequestRule, ...] = ()
    unmatched: str = ALLOW
    key: str = ""
    #: ``github.repos``: the repositories the built-in GitHub rule's token may
    #: reach (``owner/name``, ``owner/*``); None: no scope (``egress/github.py``).
    repos: tuple[str, ...] | None = None
    #: ``github.mutations``: the GraphQL mutations allowed while ``repos`` is set.
    mutations: tuple[str, ...] = ()

    @property
    def decides(self) -> bool:
        """Whether requests are matched at all (a rule, ``unmatched = "refuse"``, a scope)."""
        return bool(self.requests) or self.unmatched != ALLOW or self.repos is not None

    def render(self, token: str) -> str:
        import base64

        basic = ""
        if self.basic_user is not None:
            basic = base64.b64encode(f"{self.basic_user}:{token}".encode()).decode("ascii")
        return self.format.replace("{token}", token).replace("{basic}", basic)


@dataclass(frozen=True)
class ProxyConfig:
    """The egress proxy.  ``port`` is the loopback port the sandbox's bridges dial."""

    port: int = DEFAULT_PROXY_PORT
    listen: str | None = None
    parent: str | None = None
    max_tunnels: int = 1024
    header_timeout: float = 60.0
    idle_timeout: float = 600.0
    #: The system dispatcher's registration socket; "" never registers (always binds).
    dispatch_socket: str = DISPATCH_SOCKET
    #: Whether the dispatcher takes a registration of uid 0 (root's service).  Read
    #: by the dispatcher from the config it loads (the machine's); off, since a
    #: service of root's would be handed whatever the kernel reports as uid 0.
    dispatch_root: bool = False
    #: Refuse requests that carry no registered session credential (egress/sessions.py).
    require_session: bool = False
    #: What a host off ``sandbox.domains`` gets: refused, held while the person is
    #: asked (docs/approvals.md), or let through and recorded ("would refuse").
    unlisted: Unlisted = "refuse"
    #: How long a held request waits for the person's answer.
    ask_timeout: float = DEFAULT_ASK_TIMEOUT
    #: How many requests this user's service holds at once; past it, refused at once.
    max_held: int = 32

    @property
    def endpoint(self) -> str:
        """The Twisted server endpoint string the proxy listens on."""
        return self.listen or f"tcp:{self.port}:interface=127.0.0.1"


@dataclass(frozen=True)
class RunCommand:
    """A named host command a sandboxed session may ask the broker to run."""

    name: str
    argv: tuple[str, ...]
    args: tuple[str, ...] = ()
    timeout: float = 600.0
    stream: bool = True
    env: tuple[str, ...] = ()
    #: Variables taken from the requester's own environment (it is untrusted input).
    caller_env: tuple[str, ...] = ()


@dataclass(frozen=True)
class BrokerConfig:
    spool: str
    sign_program: str | None = None
    ssh_key: str | None = None
    kubeconfig: str | None = None
    run: tuple[RunCommand, ...] = ()

    def command(self, name: str) -> RunCommand | None:
        for c in self.run:
            if c.name == name:
                return c
        return None


@dataclass(frozen=True)
class ScopeConfig:
    slice: str = "agentsandbox.slice"
    memory_max: str = "8G"
    memory_swap_max: str = "0"
    cpu_quota: str | None = None
    #: Run a capped command even when its caps do not reach the kernel (with a warning).
    allow_uncapped: bool = False


@dataclass(frozen=True)
class AuditConfig:
    file: str
    max_bytes: int = 10 * 1024 * 1024
    keep: int = 3
    #: Whether a terminated request's record keeps its query string (it may hold secrets).
    queries: bool = False


@dataclass(frozen=True)
class SandboxConfig:
    read: tuple[str, ...] = ()
    write: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()
    domains: tuple[str, ...] = DEFAULT_DOMAINS
    unset_env: tuple[str, ...] = DEFAULT_UNSET_ENV
    keep_env: tuple[str, ...] = ()
    #: Tools the drop-in removes by default (``tools.removedTools``) that this config re-opens.
    allow_tools: tuple[str, ...] = ()
    #: Hosts refused even where ``domains`` allows them, and never asked about
    #: (``agentsandbox deny --always`` writes here); the allow-list grammar.
    refused_domains: tuple[str, ...] = ()

    @functools.cached_property
    def allowList(self) -> AllowList:
        """``domains`` parsed, once per config: the proxy's gate, ``check host`` and the
        built-in rules read this one parse (a reload builds a new config, so a new one)."""
        return AllowList.parse(self.domains)

    @functools.cached_property
    def refusedList(self) -> AllowList:
        """``refused_domains`` parsed, once per config, in the allow list's grammar."""
        return AllowList.parse(self.refused_domains)


@dataclass(frozen=True)
class RunConfig:
    env: tuple[str, ...] = DEFAULT_RUN_ENV


@dataclass(frozen=True)
class Config:
    source: str
    paths: Paths
    sandbox: SandboxConfig
    proxy: ProxyConfig
    inject: tuple[InjectRule, ...]
    broker: BrokerConfig
    scope: ScopeConfig
    audit: AuditConfig
    run: RunConfig = field(default_factory=RunConfig)
    #: The machine's config file this one is held to (``machine.narrow``); None without one.
    machine: str | None = None
    #: What the user's file asked for that the machine's does not grant, one sentence each.
    notices: tuple[str, ...] = ()

    @property
    def served(self) -> str:
        """Which files make this config, for the service's log, ``status`` and ``doctor``."""
        if self.machine is None:
            return self.source
        if self.source == self.machine:
            return f"{self.machine} (the machine's)"
        return f"{self.machine} (the machine's), narrowed by {self.source}"
    #: The config names no ``inject``: the built-in GitHub rule is offered, and
    #: ``inject`` holds it for the GitHub hosts ``sandbox.domains`` admits (none: empty).
    inject_builtin: bool = False

    def injectFor(self, host: str) -> InjectRule | None:
        for rule in self.inject:
            if host in rule.hosts:
                return rule
        return None


def githubRules(
    token: TokenSource | None = None,
    requests: tuple[RequestRule, ...] = (),
    unmatched: str = ALLOW,
    repos: tuple[str, ...] | None = None,
    mutations: tuple[str, ...] = (),
) -> tuple[InjectRule, ...]:
    """The built-in rule: one ``gh auth token`` for GitHub's three hosts, with
    ``[github]``'s request rules (``requests``, ``unmatched``) and scope
    (``repos``, ``mutations``)."""
    source = token or CommandSource(command=("gh", "auth", "token"))
    return (
        InjectRule(
            hosts=("github.com",),
            header="Authorization",
            format="Basic {basic}",
            basic_user="x-access-token",
            token=source,
            builtin=True,
            requests=tuple(r for r in requests if r.host in (None, "github.com")),
            unmatched=unmatched,
            key="github",
            repos=repos,
            mutations=mutations,
        ),
        InjectRule(
            hosts=("api.github.com", "uploads.github.com"),
            header="Authorization",
            format="token {token}",
            token=source,
            builtin=True,
            requests=tuple(r for r in requests if r.host != "github.com"),
            unmatched=unmatched,
            key="github",
            repos=repos,
            mutations=mutations,
        ),
    )


def builtinRules(allow: AllowList, rules: tuple[InjectRule, ...] | None = None) -> tuple[InjectRule, ...]:
    """The built-in GitHub rules (``rules``, default ``githubRules()``) narrowed to the hosts the allow list admits on 443.

    A rule for a host the proxy refuses anyway would only start ``gh auth
    token`` every renewal and put the host in the injection CA; with no GitHub
    host allowed there is no rule at all (``doctor`` says so, as a warning).
    Whether the token source answers is the running service's to see: the
    injector terminates a built-in host only while its keeper holds a token
    (``egress.inject.Route.active``).
    """
    narrowed = []
    for rule in githubRules() if rules is None else rules:
        hosts = tuple(h for h in rule.hosts if allow.byName(h, 443) is not None)
        if hosts:
            narrowed.append(replace(rule, hosts=hosts))
    return tuple(narrowed)


# --------------------------------------------------------------------------- lookup


def locate(explicit: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The user's config file that applies (held to the machine's), or None."""
    return locateConfig(explicit, environ)


def machineConfig() -> str | None:
    """The machine's config file, if this machine has one."""
    from agentsandbox import paths

    return paths.SYSTEM_CONFIG if os.path.exists(paths.SYSTEM_CONFIG) else None


def sameFile(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def readConfig(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(path, "", f"cannot read the config: {e.strerror or e}") from None


def loads(raw: bytes, source: str, paths: Paths) -> Config:
    return parse(toml(raw, source), source, paths)


def toml(raw: bytes, source: str) -> dict[str, Any]:
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(source, "", f"not UTF-8 ({e.reason} at byte {e.start})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(source, "", f"not valid TOML: {e}") from None


# --------------------------------------------------------------------------- parsing

T = TypeVar("T")


class _Table:
    """A TOML table being read: tracks which keys were used, so the rest are errors."""

    def __init__(self, source: str, prefix: str, data: Any) -> None:
        if not isinstance(data, dict):
            raise ConfigError(source, prefix, f"must be a table, not {_typeName(data)}")
        self.source = source
        self.prefix = prefix
        self.data: dict[str, Any] = data
        self.seen: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    def error(self, name: str, why: str) -> ConfigError:
        return ConfigError(self.source, self.key(name), why)

    def get(self, name: str, kind: type[T], default: T) -> T:
        self.seen.add(name)
        if name not in self.data:
            return default
        value = self.data[name]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise self.error(name, f"must be {_kindName(kind)}, not {_typeName(value)}")
        return value

    def strings(self, name: str, default: tuple[str, ...]) -> tuple[str, ...]:
        self.seen.add(name)
        if name not in self.data:
            return default
        value = self.data[name]
        if not isinstance(value, list):
            raise self.error(name, f"must be a list of strings, not {_typeName(value)}")
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise self.error(f"{name}[{i}]", f"must be a string, not {_typeName(item)}")
        return tuple(value)

    def table(self, name: str) -> _Table:
        self.seen.add(name)
        return _Table(self.source, self.key(name), self.data.get(name, {}))

    def finish(self) -> None:
        unknown = sorted(set(self.data) - self.seen)
        if unknown:
            raise self.error(unknown[0], "unknown key (a typo here must not weaken the policy)")


def _typeName(v: Any) -> str:
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "a table",
    }.get(type(v), type(v).__name__)


def _kindName(kind: type) -> str:
    return {
        bool: "true or false",
        int: "an integer",
        float: "a number",
        str: "a string",
    }.get(kind, kind.__name__)


def _absPath(t: _Table, name: str, value: str, paths: Paths) -> str:
    if "\0" in value:
        raise t.error(name, "a path cannot contain a NUL byte")
    expanded = paths.expandUser(value)
    if not os.path.isabs(expanded):
        raise t.error(name, f"{value!r} is not absolute (write it as ~/… or /…)")
    return os.path.normpath(expanded)


def _paths(t: _Table, name: str, paths: Paths) -> tuple[str, ...]:
    values = t.strings(name, ())
    return tuple(_absPath(t, f"{name}[{i}]", v, paths) for i, v in enumerate(values))


def _positive(t: _Table, name: str, kind: type[T], default: T) -> T:
    v = t.get(name, kind, default)
    if v <= 0:  # type: ignore[operator]
        raise t.error(name, "must be greater than zero")
    return v


_SIZE = re.compile(r"(infinity|[0-9]+[KMGTkmgt]?)")
_PERCENT = re.compile(r"[0-9]+%")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ENV_PATTERN = re.compile(r"[A-Za-z0-9_*?\[\]]+")
_HEADER = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_RUN_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")
#: Variables a host command never takes from the sandbox: they choose what runs or loads.
_CALLER_ENV_REFUSED = frozenset(
    {"PATH", "IFS", "ENV", "BASH_ENV", "PYTHONPATH", "PYTHONSTARTUP", "PERL5LIB", "PERL5OPT",
     "RUBYOPT", "NODE_OPTIONS", "GIT_SSH_COMMAND", "GIT_EXEC_PATH", "GIT_CONFIG_GLOBAL",
     "HOME", "XDG_CONFIG_HOME", "KUBECONFIG", "SHELLOPTS"}
)


def parse(data: Mapping[str, Any], source: str, paths: Paths) -> Config:
    root = _Table(source, "", dict(data))
    sandbox = _parseSandbox(root.table("sandbox"), paths)
    proxy = _parseProxy(root.table("proxy"))
    _checkDomains(root.table("sandbox"), sandbox.domains, proxy.port)
    github = _parseGithub(root)
    named = _parseInject(root, paths)
    inject = builtinRules(sandbox.allowList, github) if named is None else named
    broker = _parseBroker(root.table("broker"), paths)
    scope = _parseScope(root.table("scope"))
    audit = _parseAudit(root.table("audit"), paths)
    run = _parseRun(root.table("run"))
    root.finish()
    config = Config(
        source=source,
        paths=paths,
        sandbox=sandbox,
        proxy=proxy,
        inject=inject,
        broker=broker,
        scope=scope,
        audit=audit,
        run=run,
        inject_builtin=named is None,
    )
    return config


def _parseSandbox(t: _Table, paths: Paths) -> SandboxConfig:
    read = _paths(t, "read", paths)
    write = _paths(t, "write", paths)
    deny = _paths(t, "deny", paths)
    domains = t.strings("domains", DEFAULT_DOMAINS)
    unset = t.strings("unset_env", DEFAULT_UNSET_ENV)
    keep = t.strings("keep_env", ())
    for key, values in (("unset_env", unset), ("keep_env", keep)):
        for i, v in enumerate(values):
            if not _ENV_PATTERN.fullmatch(v):
                raise t.error(f"{key}[{i}]", f"{v!r} is not a variable name or a */? pattern")
    refusedDomains = t.strings("refused_domains", ())
    for i, text in enumerate(refusedDomains):
        try:
            Entry.parse(text)
        except EntryError as e:
            raise t.error(f"refused_domains[{i}]", str(e)) from None
    allowTools = t.strings("allow_tools", ())
    for i, name in enumerate(allowTools):
        if name not in reopenable():
            raise t.error(
                f"allow_tools[{i}]",
                f"{name!r} is not a tool the drop-in removes; it may name only {', '.join(reopenable())}",
            )
    t.finish()
    return SandboxConfig(
        read=read, write=write, deny=deny, domains=domains, unset_env=unset, keep_env=keep,
        allow_tools=allowTools, refused_domains=refusedDomains,
    )


def _checkDomains(t: _Table, domains: tuple[str, ...], proxyPort: int) -> None:
    for i, text in enumerate(domains):
        key = f"domains[{i}]"
        try:
            entry = Entry.parse(text)
        except EntryError as e:
            raise t.error(key, str(e)) from None
        if entry.opensLoopback():
            if entry.port is None:
                raise t.error(
                    key,
                    f"{text!r} would open every loopback port; loopback is reachable only "
                    "through an explicit IP:port entry such as 127.0.0.1:6443",
                )
            if entry.network is not None:
                raise t.error(
                    key, f"{text!r}: loopback is reachable only through an explicit IP:port entry"
                )
            if entry.port == proxyPort and entry.host is not None and isLoopbackName(entry.host):
                raise t.error(
                    key, f"{text!r} is the egress proxy itself (proxy.port = {proxyPort})"
                )


#: The forms ``proxy.listen`` takes, as the errors list them.
LISTEN_FORMS = (
    "tcp:PORT:interface=ADDR (ADDR a loopback address, such as 127.0.0.1)",
    "systemd:domain=INET:index=N (socket activation: `agentsandbox setup --socket` writes "
    "systemd:domain=INET:index=0; INET6 works too)",
    "HOST:PORT with HOST a loopback address, short for tcp:PORT:interface=HOST",
)


#: ``HOST:PORT``, ``[V6]:PORT``: the shorthand (a bare IPv6 literal has no port).
_HOST_PORT = re.compile(r"(\[[^\]]*\]|[^:\[\]]+):[0-9]+")


class ListenError(ValueError):
    """``proxy.listen`` is not one of ``LISTEN_FORMS``; the message says why."""


def _endpointFields(text: str) -> list[str]:
    """Split a Twisted endpoint description on ``:``; ``\\:`` is a literal colon."""
    fields, current, chars = [], [], iter(text)
    for c in chars:
        if c == "\\":
            current.append(next(chars, ""))
        elif c == ":":
            fields.append("".join(current))
            current = []
        else:
            current.append(c)
    fields.append("".join(current))
    return fields


def _endpointArgs(
    kind: str, fields: list[str], names: tuple[str, ...], optional: tuple[str, ...] = ()
) -> dict[str, str]:
    """Positional and ``key=value`` fields of an endpoint, by parameter name."""
    args: dict[str, str] = {}
    for i, part in enumerate(fields):
        key, eq, value = part.partition("=")
        if not eq:
            if args.keys() - set(names[:i]) or i >= len(names):
                raise ListenError(f"{kind}: the field {part!r} has no name (write it as name=value)")
            key, value = names[i], part
        if key not in names:
            raise ListenError(f"{kind}: unknown option {key!r} (it takes {', '.join(names)})")
        if key in args:
            raise ListenError(f"{kind}: {key} is given twice")
        args[key] = value
    missing = [n for n in names if n not in args and n not in optional]
    if missing:
        raise ListenError(f"{kind}: {' and '.join(missing)} missing")
    return args


def _loopbackInterface(text: str) -> str:
    ip = parseIP(text)
    if ip is None or not unwrapMapped(ip).is_loopback:
        shown = f"{text!r}" if text else "every interface"
        raise ListenError(
            f"the proxy would listen on {shown}, where other machines could reach it; "
            "it listens on loopback only (interface=127.0.0.1)"
        )
    return str(ip)


def parseListen(text: str) -> tuple[str, int | None]:
    """``proxy.listen`` as (Twisted endpoint string, its TCP port or None), or ListenError.

    Only what the proxy works on passes: TCP on a loopback address (the peer
    check reads the kernel's TCP tables; a proxy other machines could reach
    would offer them the injected credentials' hosts) and systemd's inherited
    INET sockets.  ``HOST:PORT`` with a loopback HOST is shorthand for
    ``tcp:PORT:interface=HOST``: it says the same thing and cannot mean anything else.
    """
    fields = _endpointFields(text)
    kind, rest = fields[0], fields[1:]
    if kind == "tcp":
        args = _endpointArgs("tcp", rest, ("port", "interface", "backlog"), ("interface", "backlog"))
        port = _listenPort(args["port"])
        _loopbackInterface(args.get("interface", ""))
        if "backlog" in args and not args["backlog"].isdigit():
            raise ListenError(f"tcp: backlog {args['backlog']!r} is not a number")
        return text, port
    if kind == "systemd":
        args = _endpointArgs("systemd", rest, ("domain", "index"))
        if args["domain"] not in ("INET", "INET6"):
            raise ListenError(
                f"systemd: domain={args['domain']} is not INET or INET6 (the proxy serves TCP only)"
            )
        if not args["index"].isdigit():
            raise ListenError(f"systemd: index {args['index']!r} is not a number")
        return text, None
    shorthand = _HOST_PORT.fullmatch(text)
    host = shorthand.group(1).strip("[]") if shorthand is not None else ""
    if shorthand is None or not (parseIP(host) or "." in host or host.lower() == "localhost"):
        if len(fields) == 1 or parseIP(text) is not None:
            raise ListenError(f"{text!r} is neither an endpoint (tcp:..., systemd:...) nor HOST:PORT")
        raise ListenError(
            f"{kind!r} is not an endpoint the proxy listens on (it serves TCP on loopback: "
            "its same-user check reads the kernel's TCP tables)"
        )
    port = _listenPort(text.rpartition(":")[2])
    interface = _loopbackInterface("127.0.0.1" if host.lower() == "localhost" else host)
    return f"tcp:{port}:interface={interface.replace(':', chr(92) + ':')}", port


def _listenPort(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise ListenError(f"port {text!r} is not a number from 0 to 65535")
    return int(text)


def _parseProxy(t: _Table) -> ProxyConfig:
    port = t.get("port", int, DEFAULT_PROXY_PORT)
    if not 0 < port < 65536:
        raise t.error("port", f"{port} is not a port from 1 to 65535")
    listen = t.get("listen", str, "") or None
    if listen is not None:
        try:
            listen, listenPort = parseListen(listen.strip())
        except ListenError as e:
            raise t.error(
                "listen",
                f"{e}.  Accepted: {'; '.join(LISTEN_FORMS)}.  To move the proxy to another "
                "port, set proxy.port alone (the sandboxes dial 127.0.0.1:proxy.port)",
            ) from None
        if listenPort:
            if "port" not in t.data:
                # The one port the proxy is on is the one the sandboxes must dial.
                port = listenPort
            elif listenPort != port:
                raise t.error(
                    "listen",
                    f"listens on port {listenPort}, but proxy.port (the port every sandbox "
                    f"dials) is {port}; set one port, in proxy.port",
                )
    parent = t.get("parent", str, "") or None
    if parent is not None and not re.match(r"^http://[^/@\s]+:[0-9]+/?$", parent):
        raise t.error("parent", f"{parent!r} must be http://HOST:PORT (an HTTP CONNECT proxy)")
    dispatch = t.get("dispatch_socket", str, DISPATCH_SOCKET)
    if dispatch and not os.path.isabs(dispatch):
        raise t.error("dispatch_socket", f"{dispatch!r} must be an absolute path (or \"\" for no dispatcher)")
    proxy = ProxyConfig(
        port=port,
        listen=listen,
        parent=parent,
        max_tunnels=_positive(t, "max_tunnels", int, 1024),
        header_timeout=_positive(t, "header_timeout", float, 60.0),
        idle_timeout=_positive(t, "idle_timeout", float, 600.0),
        dispatch_socket=dispatch,
        dispatch_root=t.get("dispatch_root", bool, False),
        require_session=t.get("require_session", bool, False),
        unlisted=_unlisted(t),
        ask_timeout=_positive(t, "ask_timeout", float, DEFAULT_ASK_TIMEOUT),
        max_held=_positive(t, "max_held", int, 32),
    )
    t.finish()
    return proxy


def _unlisted(t: _Table) -> Unlisted:
    value = t.get("unlisted", str, "refuse")
    if value not in UNLISTED:
        raise t.error(
            "unlisted",
            f"{value!r} is not one of {', '.join(repr(v) for v in UNLISTED)} (what a host off "
            "sandbox.domains gets: refused, asked of the person, or let through and recorded)",
        )
    return cast(Unlisted, value)


def _parseToken(t: _Table, paths: Paths) -> TokenSource:
    command = t.strings("token_command", ())
    file = t.get("token_file", str, "")
    env = t.get("token_env", str, "")
    given = [k for k, v in (("token_command", command), ("token_file", file), ("token_env", env)) if v]
    if len(given) != 1:
        raise t.error(
            "token_command",
            "give exactly one of token_command, token_file and token_env"
            + (f" (found {', '.join(given)})" if given else ""),
        )
    if env and not _ENV_NAME.fullmatch(env):
        raise t.error("token_env", f"{env!r} is not a variable name")
    renew = _positive(t, "renew", float, DEFAULT_RENEW)
    # Read for every source, so a bad value is refused wherever it stands; only
    # a command can take too long.
    timeout = _positive(t, "token_timeout", float, DEFAULT_TOKEN_TIMEOUT)
    if command:
        return CommandSource(command, renew, timeout)
    if file:
        return FileSource(_absPath(t, "token_file", file, paths), renew)
    return EnvSource(env, renew)


_METHOD = re.compile(r"[A-Z][A-Z0-9_-]*")
#: A path pattern: an absolute path of visible ASCII, without what a request's
#: target may not hold on a path with rules (egress/reqrules.py refuses those).
_PATH_PATTERN = re.compile(r"/[!$&'()*+,\-.0-9:;=@A-Z_a-z~/%]*")


def _parseRequests(t: _Table, hosts: tuple[str, ...]) -> tuple[tuple[RequestRule, ...], str]:
    """``requests`` (an array of tables) and ``unmatched`` of an inject rule or of ``[github]``."""
    t.seen.add("requests")
    value = t.data.get("requests", [])
    if not isinstance(value, list):
        raise t.error("requests", f"must be an array of tables ([[{t.prefix.split('[')[0]}.requests]])")
    rules: list[RequestRule] = []
    for i, item in enumerate(value):
        r = _Table(t.source, t.key(f"requests[{i}]"), item)
        action = r.get("action", str, "")
        if action not in ACTIONS:
            raise r.error("action", f"{action!r} is not \"allow\" or \"refuse\"")
        path = r.get("path", str, "")
        if not _PATH_PATTERN.fullmatch(path):
            raise r.error(
                "path",
                f"{path!r} is not a path pattern (/…: '*' within a segment, '**' for any segments; "
                "no query, fragment, backslash or space)",
            )
        segments = path.split("/")[1:]
        for segment in segments:
            if segment in (".", "..") or ("**" in segment and segment != "**"):
                raise r.error(
                    "path", f"{path!r}: a segment is '**' alone, and never '.' or '..' (they are refused in requests)"
                )
        if "//" in path:
            raise r.error("path", f"{path!r}: an empty segment ('//') matches nothing (such requests are refused)")
        methods = r.strings("methods", ())
        for j, m in enumerate(methods):
            if not _METHOD.fullmatch(m):
                raise r.error(f"methods[{j}]", f"{m!r} is not an HTTP method in capitals (GET, POST, …)")
        host = r.get("host", str, "") or None
        if host is not None and host.lower() not in hosts:
            raise r.error("host", f"{host!r} is not one of this rule's hosts ({', '.join(hosts)})")
        r.finish()
        rules.append(
            RequestRule(key=r.prefix, action=action, path=path, methods=methods, host=host.lower() if host else None)
        )
    unmatched = t.get("unmatched", str, ALLOW)
    if unmatched not in ACTIONS:
        raise t.error("unmatched", f"{unmatched!r} is not \"allow\" or \"refuse\"")
    return tuple(rules), unmatched


_REPO = re.compile(r"[A-Za-z0-9-]+/(\*|[A-Za-z0-9._-]+)")
_GRAPHQL_NAME = re.compile(r"[_A-Za-z][_0-9A-Za-z]*")


def _parseGithub(root: _Table) -> tuple[InjectRule, ...] | None:
    """``[github]``: request rules and scope for the built-in GitHub rule; None when absent."""
    root.seen.add("github")
    if "github" not in root.data:
        return None
    t = _Table(root.source, "github", root.data["github"])
    if "inject" in root.data:
        raise t.error(
            "requests",
            "[github] shapes the built-in GitHub rule, which [[inject]] tables replace; "
            "put these requests in the [[inject]] rule for GitHub's hosts",
        )
    requests, unmatched = _parseRequests(t, GITHUB_HOSTS)
    repos: tuple[str, ...] | None = t.strings("repos", ()) if "repos" in t.data else None
    for i, repo in enumerate(repos or ()):
        if not _REPO.fullmatch(repo) or repo.split("/")[1] in (".", ".."):
            raise t.error(f"repos[{i}]", f"{repo!r} is not OWNER/NAME or OWNER/*")
    mutations = t.strings("mutations", ())
    for i, name in enumerate(mutations):
        if not _GRAPHQL_NAME.fullmatch(name):
            raise t.error(f"mutations[{i}]", f"{name!r} is not a GraphQL mutation name (createPullRequest, addComment, …)")
    if mutations and repos is None:
        raise t.error("mutations", "mutations are allowed by name only while github.repos is set (without it, all are)")
    t.finish()
    return githubRules(requests=requests, unmatched=unmatched, repos=repos, mutations=mutations)


def _parseInject(root: _Table, paths: Paths) -> tuple[InjectRule, ...] | None:
    """The config's ``[[inject]]`` rules; None when it names no ``inject`` (the built-in applies)."""
    root.seen.add("inject")
    if "inject" not in root.data:
        return None
    value = root.data["inject"]
    if not isinstance(value, list):
        raise root.error("inject", "must be an array of tables ([[inject]])")
    rules: list[InjectRule] = []
    claimed: dict[str, int] = {}
    for i, item in enumerate(value):
        t = _Table(root.source, f"inject[{i}]", item)
        hosts = t.strings("hosts", ())
        if not hosts:
            raise t.error("hosts", "list at least one host")
        canon: list[str] = []
        for j, h in enumerate(hosts):
            try:
                entry = Entry.parse(h)
            except EntryError as e:
                raise t.error(f"hosts[{j}]", str(e)) from None
            if entry.host is None or entry.port is not None or entry.isAddressEntry:
                raise t.error(f"hosts[{j}]", f"{h!r} must be a plain host name (no port, wildcard or IP)")
            if entry.host in claimed:
                raise t.error(
                    f"hosts[{j}]", f"{entry.host} already has a rule (inject[{claimed[entry.host]}])"
                )
            claimed[entry.host] = i
            canon.append(entry.host)
        header = t.get("header", str, "Authorization")
        if not _HEADER.fullmatch(header):
            raise t.error("header", f"{header!r} is not an HTTP header name")
        fmt = t.get("format", str, "Bearer {token}")
        basicUser = t.get("basic_user", str, "") or None
        if "{token}" not in fmt and "{basic}" not in fmt:
            raise t.error("format", "must contain {token} or {basic}")
        if "{basic}" in fmt and basicUser is None:
            raise t.error("basic_user", "{basic} in format needs basic_user")
        if any(c in fmt for c in "\r\n\0"):
            raise t.error("format", "cannot contain CR, LF or NUL")
        token = _parseToken(t, paths)
        requests, unmatched = _parseRequests(t, tuple(canon))
        t.finish()
        rules.append(
            InjectRule(
                hosts=tuple(canon), header=header, format=fmt, basic_user=basicUser, token=token,
                requests=requests, unmatched=unmatched, key=t.prefix,
            )
        )
    return tuple(rules)


def _parseBroker(t: _Table, paths: Paths) -> BrokerConfig:
    spool = t.get("spool", str, "")
    spoolPath = _absPath(t, "spool", spool, paths) if spool else paths.defaultSpool
    sign = t.table("sign")
    program = sign.get("program", str, "") or None
    sshKey = sign.get("ssh_key", str, "")
    sign.finish()
    kube = t.get("kubeconfig", str, "")
    runTable = t.table("run")
    commands: list[RunCommand] = []
    for name in sorted(runTable.data):
        runTable.seen.add(name)
        if not _RUN_NAME.fullmatch(name):
            raise runTable.error(name, "a command name is lower case letters, digits, '.', '_', '-'")
        c = _Table(t.source, runTable.key(name), runTable.data[name])
        argv = c.strings("argv", ())
        if not argv:
            raise c.error("argv", "list the program and its fixed arguments")
        if not os.path.isabs(paths.expandUser(argv[0])):
            raise c.error("argv[0]", f"{argv[0]!r} must be an absolute path to the program")
        patterns = c.strings("args", ())
        for i, p in enumerate(patterns):
            try:
                re.compile(p, re.ASCII)  # as ops.Run matches it
            except (re.error, ValueError) as e:  # ValueError: a (?u) flag against re.ASCII
                raise c.error(f"args[{i}]", f"not a regular expression: {e}") from None
        envNames = c.strings("env", ())
        for i, n in enumerate(envNames):
            if not _ENV_NAME.fullmatch(n):
                raise c.error(f"env[{i}]", f"{n!r} is not a variable name")
        callerEnv = c.strings("caller_env", ())
        for i, n in enumerate(callerEnv):
            if not _ENV_NAME.fullmatch(n):
                raise c.error(f"caller_env[{i}]", f"{n!r} is not a variable name")
            if n in _CALLER_ENV_REFUSED or n.startswith(("LD_", "DYLD_")):
                raise c.error(
                    f"caller_env[{i}]",
                    f"{n} from the sandbox would steer the host program (take it from the host with env)",
                )
        commands.append(
            RunCommand(
                name=name,
                argv=(paths.expandUser(argv[0]), *argv[1:]),
                args=patterns,
                timeout=_positive(c, "timeout", float, 600.0),
                stream=c.get("stream", bool, True),
                env=envNames,
                caller_env=callerEnv,
            )
        )
        c.finish()
    t.finish()
    return BrokerConfig(
        spool=spoolPath,
        sign_program=program,
        ssh_key=_absPath(sign, "ssh_key", sshKey, paths) if sshKey else None,
        kubeconfig=_absPath(t, "kubeconfig", kube, paths) if kube else None,
        run=tuple(commands),
    )


def _parseScope(t: _Table) -> ScopeConfig:
    sliceName = t.get("slice", str, "agentsandbox.slice")
    if not re.match(r"^[A-Za-z0-9_.-]+\.slice$", sliceName) or ".." in sliceName:
        raise t.error("slice", f"{sliceName!r} is not a systemd slice name (NAME.slice)")
    memMax = t.get("memory_max", str, "8G")
    swapMax = t.get("memory_swap_max", str, "0")
    for key, v in (("memory_max", memMax), ("memory_swap_max", swapMax)):
        if not _SIZE.fullmatch(v):
            raise t.error(key, f"{v!r} is not a size (bytes, or a number with K, M, G or T, or infinity)")
    cpu = t.get("cpu_quota", str, "") or None
    if cpu is not None and not _PERCENT.fullmatch(cpu):
        raise t.error("cpu_quota", f"{cpu!r} is not a percentage such as 200%")
    allowUncapped = t.get("allow_uncapped", bool, False)
    t.finish()
    return ScopeConfig(
        slice=sliceName, memory_max=memMax, memory_swap_max=swapMax, cpu_quota=cpu,
        allow_uncapped=allowUncapped,
    )  # fmt: skip


def _parseAudit(t: _Table, paths: Paths) -> AuditConfig:
    file = t.get("file", str, "")
    audit = AuditConfig(
        file=_absPath(t, "file", file, paths) if file else paths.auditLog,
        max_bytes=_positive(t, "max_bytes", int, 10 * 1024 * 1024),
        keep=_positive(t, "keep", int, 3),
        queries=t.get("queries", bool, False),
    )
    t.finish()
    return audit


def _parseRun(t: _Table) -> RunConfig:
    env = t.strings("env", DEFAULT_RUN_ENV)
    for i, v in enumerate(env):
        if not _ENV_PATTERN.fullmatch(v):
            raise t.error(f"env[{i}]", f"{v!r} is not a variable name or a */? pattern")
    t.finish()
    return RunConfig(env=env)
