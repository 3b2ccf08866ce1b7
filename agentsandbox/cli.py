"""``agentsandbox`` subcommands, and the preamble they share.

Each subcommand lives in the module that owns its contract and exposes
``main(argv) -> int``; this file maps names to modules and imports the one
asked for, so ``agentsandbox hook pretooluse`` or ``agentsandbox gpg`` never pay
for Twisted or for the other subcommands.

It also owns the preamble of every subcommand that reads the config:
``parser`` (``agentsandbox NAME`` with ``--config``) and ``loadConfig``, which
prints ``agentsandbox NAME: FILE: KEY: WHY`` and exits ``EXIT_CONFIG`` when the
config cannot be used.  Both import what they need when called.
"""

from __future__ import annotations

import importlib
import sys

from agentsandbox import PURPOSE, __version__

# Importing typing costs a subcommand such as ``gpg`` more than its own work;
# mypy reads this name as true all the same.
TYPE_CHECKING = False

if TYPE_CHECKING:
    import argparse
    from collections.abc import Mapping

    from agentsandbox.config import Config

#: The exit status of every subcommand whose config cannot be used (and of a
#: usage error, as argparse gives): nothing was done, and the message names the
#: file and the key.  ``doctor`` gives it too, after reporting every check.
EXIT_CONFIG = 2

CONFIG_HELP = "config file (default: $AGENTSANDBOX_CONFIG, the user's, the system's, built-in)"
EXIT_NOTE = f"Exit status {EXIT_CONFIG} when the arguments or the config cannot be used (nothing was done)."

#: name -> (module, function, one line of help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "config": ("agentsandbox.commands", "configMain", "print the effective config and its file"),
    "render": ("agentsandbox.commands", "renderMain", "print a rendered file: claude | srt"),
    "install": ("agentsandbox.claude", "installMain", "install the Claude Code drop-in"),
    "check": ("agentsandbox.commands", "checkMain", "explain a decision: read|write PATH, host HOST[:PORT]"),
    "hook": ("agentsandbox.hook", "main", "Claude Code hooks: pretooluse | sessionstart"),
    "env": ("agentsandbox.egressdir", "main", "print the egress CA and gh variables; --unset: the line that removes them"),
    "serve": ("agentsandbox.serve", "main", "run the service in the foreground (--demo: on the built-in defaults)"),
    "dispatch": ("agentsandbox.egress.dispatch", "main", "the system dispatcher: one proxy port for every user [--port N] [--socket PATH] [--status]"),
    "broker": ("agentsandbox.broker.server", "main", "run only the host broker, in the foreground"),
    "ask": ("agentsandbox.broker.commands", "askMain", "ask the host broker: ping | status"),
    "gpg": ("agentsandbox.broker.commands", "gpgMain", "git's gpg.program: sign through the broker"),
    "ssh-sign": ("agentsandbox.broker.commands", "sshSignMain", "git's gpg.ssh.program: ssh-sign through the broker"),
    "host": ("agentsandbox.broker.commands", "hostMain", "run a named host command: NAME [ARGS...]"),
    "cap": ("agentsandbox.broker.commands", "capMain", "run CMD in a capped scope: [--memory SIZE] [--cpu PCT] -- CMD"),
    "kubeconfig": ("agentsandbox.broker.commands", "kubeconfigMain", "write a kubeconfig for CONTEXT, print its path"),
    "run": ("agentsandbox.run", "main", "run any command under srt with the policy: [--print] [--] CMD..."),
    "doctor": ("agentsandbox.doctor", "main", "check that everything the policy needs is in place"),
    "status": ("agentsandbox.doctor", "statusMain", "the service's figures: requests, proxy, tokens [--json]"),
    "setup": ("agentsandbox.setup", "setupMain", "set up for daily use: config, user service, drop-in, doctor"),
    "uninstall": ("agentsandbox.setup", "uninstallMain", "undo exactly what setup did"),
    "log": ("agentsandbox.audit", "logMain", "show egress decisions: [--denied] [--since 2h] [--json]"),
    "suggest": ("agentsandbox.audit", "suggestMain", "print sandbox.domains entries for recent refusals"),
    "approvals": ("agentsandbox.approvecli", "approvalsMain", "what waits for your answer (proxy.unlisted = \"ask\"), recent decisions"),
    "approve": ("agentsandbox.approvecli", "approveMain", "let a held request through: ID|HOST [--once|--for DURATION|--always]"),
    "deny": ("agentsandbox.approvecli", "denyMain", "refuse a held request: ID|HOST [--once|--for DURATION|--always]"),
    "watch": ("agentsandbox.watch", "main", "a live view of held requests, with one-key answers"),
}


def usage() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = [
        "usage: agentsandbox [--version] COMMAND [ARGS...]",
        "",
        PURPOSE,
        "",
        "commands:",
    ]
    lines += [f"  {name.ljust(width)}  {help}" for name, (_, _, help) in COMMANDS.items()]
    lines += [
        "",
        "'agentsandbox COMMAND --help' shows a command's options.",
        f"exit status: {EXIT_CONFIG} when the arguments or the config cannot be used (the message",
        "names the file and the key, and nothing was done); otherwise as COMMAND --help says.",
    ]
    return "\n".join(lines)


def parser(name: str, description: str, *, config: bool = True) -> argparse.ArgumentParser:
    """The parser of ``agentsandbox NAME``, with ``--config`` unless ``config`` is False."""
    import argparse

    p = argparse.ArgumentParser(
        prog=f"agentsandbox {name}", description=description, epilog=EXIT_NOTE if config else None
    )
    if config:
        p.add_argument("--config", help=CONFIG_HELP)
    return p


def loadConfig(name: str, path: str | None, environ: Mapping[str, str] | None = None) -> Config:
    """The config at ``path`` (None: the usual lookup) for ``agentsandbox NAME``.

    A config that cannot be used is said once, ``agentsandbox NAME: FILE: KEY:
    WHY``, and ends the command with ``EXIT_CONFIG``, as argparse ends it on a
    usage error.
    """
    from agentsandbox.config import ConfigError
    from agentsandbox.loader import load

    try:
        return load(path, environ)
    except ConfigError as e:
        print(f"agentsandbox {name}: {e}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        print(f"agentsandbox {__version__}")
        return 0
    name = args[0]
    if name not in COMMANDS:
        print(f"agentsandbox: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module, function, _ = COMMANDS[name]
    entry = getattr(importlib.import_module(module), function)
    result: int = entry(args[1:])
    return result


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
