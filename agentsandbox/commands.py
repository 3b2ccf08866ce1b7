"""The small explain-and-print commands: ``config``, ``render``, ``check``.

Their preamble (``--config``, loading, exit 2 on a config error) is ``agentsandbox.cli``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from typing import Any

from agentsandbox.cli import loadConfig, parser
from agentsandbox.config import Config
from agentsandbox.policy import Policy


def configMain(argv: list[str]) -> int:
    p = parser("config", "Print the effective config and the file it came from.")
    p.add_argument("--json", action="store_true", help="print JSON")
    args = p.parse_args(argv)
    config = loadConfig("config", args.config)
    data: dict[str, Any] = asdict(config)
    data.pop("paths")
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
        return 0
    print(f"# effective config, from {config.served}")
    for notice in config.notices:
        print(f"# not granted: {notice}")
    for section in ("sandbox", "proxy", "broker", "scope", "audit", "run"):
        print(f"\n[{section}]")
        for key, value in data[section].items():
            if isinstance(value, list) and value and isinstance(value[0], dict):
                for item in value:
                    print(f"# {section}.{key}: {json.dumps(item, sort_keys=True)}")
                continue
            print(f"{key} = {json.dumps(value)}")
    for rule in data["inject"]:
        print("\n[[inject]]")
        token = rule.pop("token")
        print(f"# written as {rule.pop('key') or 'the built-in rule'}")
        requests = rule.pop("requests")
        if rule["repos"] is None:
            del rule["repos"], rule["mutations"]  # no GitHub scope
        for key, value in rule.items():
            print(f"{key} = {json.dumps(value)}")
        for i, request in enumerate(requests):
            print(f"# requests[{i}]: {json.dumps(request, sort_keys=True)}")
        for key, value in token.items():
            print(f"# token {key} = {json.dumps(value)}")
    return 0


def renderMain(argv: list[str]) -> int:
    p = parser("render", "Print a file rendered from the policy.")
    p.add_argument(
        "what",
        choices=["claude", "srt"],
        help="claude: the machine's managed-settings drop-in (--config names the machine's file); "
        "srt: this user's srt settings",
    )
    args = p.parse_args(argv)
    if args.what == "claude":
        # The machine's drop-in, as `install` writes it: from --config taken as
        # the machine's file, else the machine's, else the built-in defaults.
        from agentsandbox import claude
        from agentsandbox.config import ConfigError

        try:
            machine = claude.machinePolicy(config=args.config)
        except ConfigError as e:
            print(f"agentsandbox render: {e}", file=sys.stderr)
            return 2
        sys.stdout.write(claude.dumps(claude.renderMachine(machine)))
        return 0
    config = loadConfig("render", args.config)
    policy = Policy.fromConfig(config)
    from agentsandbox import srt

    sys.stdout.write(srt.dumps(srt.render(policy)))
    return 0


def checkMain(argv: list[str]) -> int:
    p = parser("check", "Explain a decision: may a session read or write a path, or reach a host?")
    sub = p.add_subparsers(dest="kind", required=True)
    # --config is also accepted after the subcommand, where people type it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    for kind in ("read", "write"):
        s = sub.add_parser(kind, help=f"may a session {kind} PATH", parents=[common])
        s.add_argument("path")
        s.add_argument("--cwd", default=os.getcwd(), help="the session's working directory")
    h = sub.add_parser("host", help="may a session reach HOST[:PORT] (port defaults to 443)", parents=[common])
    h.add_argument("target")
    h.add_argument("--resolve", action="store_true", help="resolve the name and decide each address too")
    args = p.parse_args(argv)
    config = loadConfig("check", args.config)
    if args.kind in ("read", "write"):
        return _checkPath(Policy.fromConfig(config), args.kind, args.path, os.path.abspath(args.cwd))
    return _checkHost(config, args.target, args.resolve)


def _checkPath(policy: Policy, kind: str, path: str, cwd: str) -> int:
    """Decide ``path`` on the readings the hook decides a Read or Write on (docs/hook.md)."""
    from agentsandbox import hook

    paths = hook.readPaths if kind == "read" else hook.editPaths
    try:
        readings = paths({"file_path": path}, cwd, policy.home)
    except hook.Refusal:
        print(f"refused: {path!r} is not a path a file tool accepts (empty, or holds a NUL)")
        return 1
    decideOn = policy.whyReadable if kind == "read" else policy.whyWritable
    whys = [(r, decideOn(r.path, cwd)) for r in readings]
    refused = next((r for r, why in whys if why is None), None)
    if refused is None:
        print(f"allowed: a session may {kind} {path} ({whys[0][1]})")
        return 0
    shown = path
    if refused.physical:
        shown += f" (which the file system resolves, links before '..', to {refused.path})"
    elif refused.path != path and hook.jsTrim(path) != path:
        shown += f" (read as {refused.path})"
    process = policy.processPath(refused.path, cwd)
    denied = policy.deniedBy(refused.path, cwd)
    if process is not None:
        print(f"refused: {shown} is inside {process}, which names the reading process's own objects")
    elif denied is not None:
        print(f"refused: {shown} is inside {denied} (sandbox.deny)")
    else:
        key = "sandbox.read" if kind == "read" else "sandbox.write"
        print(f"refused: no rule lets a session {kind} {shown}; add it or a parent to {key}")
    return 1


def _checkHost(config: Config, target: str, resolve: bool, addressesOf: Any = None) -> int:
    """``check host``: the proxy's own gate (``egress/gate.py``) on ``config``, so the
    verdict and its words are the proxy's.  ``addressesOf(host, port)`` resolves
    (default: the stdlib resolver the hook uses, ``names.addressesFromGetaddrinfo``)."""
    # The proxy's own readings: the authority parser of CONNECT (a bare host or
    # IPv6 literal takes port 443), then the gate every front door asks.
    from agentsandbox.allowlist import parseAuthority
    from agentsandbox.egress.gate import Ask, Gate, Resolve
    from agentsandbox.egress.grant import Grant, Refusal
    from agentsandbox.egress.names import ResolveError, addressesFromGetaddrinfo

    authority = parseAuthority(target, 443)
    if authority is None:
        print(
            f"refused: {target!r} is not HOST[:PORT] (the port is 1 to 65535 in plain digits; "
            "IPv6 as [v6]:PORT)"
        )
        return 1
    gate = Gate.ofConfig(config)
    step = gate.decide(*authority)
    name = gate.name(*authority)
    entry = name.entry
    if isinstance(step, Ask):
        print(
            f"asked: {step.host}:{step.port} is not on sandbox.domains; with proxy.unlisted = \"ask\" "
            f"the proxy holds it for your answer (agentsandbox approve {step.host}) before "
            "resolving it, and the address rules still apply after an allow"
        )
        return 1
    if entry is None:
        assert isinstance(step, Refusal)
        print(f"refused: {step.reason}")
        return 1
    host, port = name.host, name.port
    print(f"allowed by name: {host}:{port} matches sandbox.domains entry {entry.text!r}")
    # The proxy's own question, asked of the terminator the service would
    # build from this config (never started: nothing fetched or written).
    from agentsandbox.egress.injection import injectionFor

    injector = injectionFor(config).injector
    route = injector.routes.get(host)
    if injector.injects(host, port):
        print(f"  the proxy terminates TLS for {host} and sets its credential header")
    elif route is not None and route.rule.builtin and port == 443:
        # Never started, this injector holds no token; the running service's does.
        print(
            f"  the proxy terminates TLS for {host} and sets its credential header while "
            f"{route.rule.token.describe()} gives it a token (the built-in GitHub rule); "
            "until then the tunnel goes through untouched"
        )
    from agentsandbox.policy import PROXY_AWARE, literalFixes, noProxyNote

    fixes = literalFixes(entry.text)
    if fixes is not None:
        print(f"  inside the sandbox, {PROXY_AWARE} reach it through the proxy;")
        print(f"  {noProxyNote(Policy.fromConfig(config).noProxy())}")
        for fix in fixes:
            print(f"  fix: {fix}")
    if isinstance(step, Resolve):
        if not resolve:
            return 0
        try:
            addresses = (addressesOf or addressesFromGetaddrinfo)(host, port)
        except ResolveError as e:
            verdict = gate.unresolved(step, str(e))
        else:
            verdict = gate.resolved(step, addresses)
    else:
        verdict = step
        addresses = [name.literal] if name.literal is not None else []
    if resolve or isinstance(verdict, Refusal):
        for d in gate.addresses(name, addresses if isinstance(verdict, Grant) or verdict.kind == "policy" else []):
            print(("  dial    " if d.allowed else "  refuse  ") + f"{d.address}: {d.reason}")
    return _printVerdict(verdict)


def _printVerdict(verdict: Any) -> int:
    """The gate's last word, as the proxy would answer it: ``refused: REASON`` is its
    403/502 body, word for word."""
    from agentsandbox.egress.grant import Refusal

    if isinstance(verdict, Refusal):
        print(f"refused: {verdict.reason}")
        return 1
    if verdict.viaParent and not verdict.addresses:
        print(f"allowed: {verdict.host} does not resolve here; the proxy hands it to proxy.parent, which resolves it")
    else:
        via = " through proxy.parent" if verdict.viaParent else ""
        print(f"allowed: {verdict.host}:{verdict.port} is dialled{via} at {', '.join(map(str, verdict.addresses))}")
    return 0
