"""The machine's config bounds a user's: which keys a user's file may set, and how.

On a machine with ``/etc/agentsandbox/config.toml`` (the .deb's, the NixOS
module's) that file is the admin's policy.  A user's own file is read on top of
it, key by key, and may only narrow it where the narrowing holds in all four
places (Claude Code's sandbox through the policy helper, the hook, the proxy,
``run``), all of which read the one effective config this module makes:

- lists of what the agent may do (``sandbox.read``, ``write``, ``domains``,
  ``keep_env``, ``allow_tools``, ``run.env``): the user's entries that the
  machine's already grant; any other is left out, with a notice naming both
  files and the key;
- lists of what the agent may not do (``sandbox.deny``, ``unset_env``,
  ``refused_domains``): the machine's plus the user's;
- ``proxy.unlisted``: the user's where it is not more permissive than the
  machine's (refuse < ask < observe);
- where the machine's ``proxy.unlisted`` is ask (or observe), it has handed
  hosts off its list to each person, so a user's ``sandbox.domains`` name
  entries (what the person approved ``--always``) are kept beyond the
  machine's list; entries that open addresses (IPs, CIDRs, loopback) are still
  held to it, because address rules are never asked;
- where the sandboxes dial and the dispatcher (``proxy.port``, ``listen``,
  ``dispatch_socket``, ``dispatch_root``): the machine's alone;
- what is the user's by nature (their tokens and ``inject`` rules with their
  request rules, ``[github]`` included, ``broker``,
  ``scope``, ``audit``, the proxy's limits and parent): the user's where given.

A notice is a wish the machine does not grant; ``doctor`` shows each as a
warning and the service logs them.  docs/config.md has the table.

Stdlib only: the hook loads the config through this on a cache miss.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields, replace
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # loader.load calls narrow: the values come in, nothing is imported back
    from agentsandbox.config import Config

#: ``proxy.unlisted`` from the least permissive to the most (config.UNLISTED).
UNLISTED = ("refuse", "ask", "observe")

#: ``proxy`` keys that are the machine's alone: the port every sandbox dials and the dispatcher.
MACHINE_PROXY_KEYS = ("port", "listen", "dispatch_socket", "dispatch_root")


def narrow(machine: Config, user: Config, given: Mapping[str, Any]) -> Config:
    """The effective config: ``machine`` narrowed by ``user`` (parsed from ``given``)."""
    notices: list[str] = []

    def refused(key: str, value: object, machineKey: str | None = None) -> None:
        notices.append(
            f"{user.source}: {key} = {value!r} is not granted by the machine's config "
            f"{machine.source} ({machineKey or key.split('[')[0]}); it is left out (ask the admin "
            "to grant it there, or remove it from your file)"
        )

    sandboxGiven = _table(given, "sandbox")
    proxyGiven = _table(given, "proxy")
    m, u = machine.sandbox, user.sandbox

    def keptList(
        key: str, wished: Sequence[str], grants: Callable[[str], bool], default: tuple[str, ...]
    ) -> tuple[str, ...]:
        if key.split(".")[-1] not in (_table(given, key.split(".")[0])):
            return default
        kept: list[str] = []
        for i, value in enumerate(wished):
            if grants(value):
                kept.append(value)
            else:
                refused(f"{key}[{i}]", value)
        return tuple(kept)

    from agentsandbox.policy import under

    read = keptList(
        "sandbox.read", u.read, lambda p: any(under(p, e) for e in (*m.read, *m.write)), m.read
    )
    write = keptList("sandbox.write", u.write, lambda p: any(under(p, e) for e in m.write), m.write)
    domainGrant = _domainGrant(m.domains)
    if machine.proxy.unlisted != "refuse":
        domainGrant = _delegatedGrant(domainGrant)
    domains = keptList("sandbox.domains", u.domains, domainGrant, m.domains)
    keep = keptList("sandbox.keep_env", u.keep_env, _patternGrant(m.keep_env), m.keep_env)
    tools = keptList("sandbox.allow_tools", u.allow_tools, lambda t: t in m.allow_tools, m.allow_tools)
    runEnv = keptList("run.env", user.run.env, _patternGrant(machine.run.env), machine.run.env)
    sandbox = replace(
        m,
        read=read,
        write=write,
        deny=_union(m.deny, u.deny if "deny" in sandboxGiven else ()),
        domains=domains,
        unset_env=_union(m.unset_env, u.unset_env if "unset_env" in sandboxGiven else ()),
        keep_env=keep,
        allow_tools=tools,
        refused_domains=_union(
            m.refused_domains, u.refused_domains if "refused_domains" in sandboxGiven else ()
        ),
    )

    # [scope] is the user's, but running a cap uncapped is the machine's to allow.
    scope = user.scope if "scope" in given else machine.scope
    if scope.allow_uncapped and not machine.scope.allow_uncapped:
        refused("scope.allow_uncapped", True)
        scope = replace(scope, allow_uncapped=False)

    proxyValues: dict[str, Any] = {}
    for field in fields(machine.proxy):
        name = field.name
        if name == "require_session":
            # The machine's, or stricter: a user may turn it on, never off.
            proxyValues[name] = machine.proxy.require_session or (name in proxyGiven and user.proxy.require_session)
            if name in proxyGiven and machine.proxy.require_session and not user.proxy.require_session:
                refused("proxy.require_session", False)
        elif name == "unlisted":
            # Where the machine refuses, a user may not ask or observe: at most the machine's.
            wished = user.proxy.unlisted if name in proxyGiven else machine.proxy.unlisted
            if UNLISTED.index(wished) > UNLISTED.index(machine.proxy.unlisted):
                refused("proxy.unlisted", wished)
                wished = machine.proxy.unlisted
            proxyValues[name] = wished
        elif name in MACHINE_PROXY_KEYS:
            if name in proxyGiven and getattr(user.proxy, name) != getattr(machine.proxy, name):
                refused(f"proxy.{name}", getattr(user.proxy, name))
            proxyValues[name] = getattr(machine.proxy, name)
        else:
            proxyValues[name] = getattr(user.proxy if name in proxyGiven else machine.proxy, name)

    return replace(
        machine,
        source=user.source,
        machine=machine.source,
        sandbox=sandbox,
        proxy=replace(machine.proxy, **proxyValues),
        # [github] shapes the built-in inject rule: it is the user's as [[inject]] is.
        inject=user.inject if "inject" in given or "github" in given else machine.inject,
        inject_builtin=user.inject_builtin if "inject" in given or "github" in given else machine.inject_builtin,
        broker=user.broker if "broker" in given else machine.broker,
        scope=scope,
        audit=user.audit if "audit" in given else machine.audit,
        run=replace(machine.run, env=runEnv),
        notices=tuple(notices),
    )


def _table(given: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = given.get(name, {})
    return value if isinstance(value, Mapping) else {}


def _union(first: tuple[str, ...], more: tuple[str, ...]) -> tuple[str, ...]:
    return first + tuple(v for v in dict.fromkeys(more) if v not in first)


def _domainGrant(machineDomains: tuple[str, ...]) -> Callable[[str], bool]:
    from agentsandbox.allowlist import Entry

    entries = [Entry.parse(text) for text in machineDomains]
    return lambda text: any(Entry.parse(text).within(e) for e in entries)


def _delegatedGrant(grants: Callable[[str], bool]) -> Callable[[str], bool]:
    """``grants``, and any name entry: the machine asks the person about unlisted names,
    so the names a person listed are theirs.  Address entries (an IP, a CIDR, a
    loopback name with its port) stay the machine's: address rules are never asked."""
    from agentsandbox.allowlist import Entry

    def delegated(text: str) -> bool:
        entry = Entry.parse(text)
        return grants(text) or not (entry.isAddressEntry or entry.opensLoopback())

    return delegated


def _patternGrant(machinePatterns: tuple[str, ...]) -> Callable[[str], bool]:
    """A variable pattern the machine's list covers: the same pattern, or a name it matches."""

    def grants(value: str) -> bool:
        if value in machinePatterns:
            return True
        literal = not any(c in value for c in "*?[")
        return literal and any(fnmatchcase(value, p) for p in machinePatterns)

    return grants
