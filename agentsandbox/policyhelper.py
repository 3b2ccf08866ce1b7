"""Claude Code's policy helper: each session's managed settings, from its own user's policy.

The machine's drop-in names this program (``policyHelper.path``, rendered by
``claude.renderMachine``).  Claude Code runs it as the session's user, in the
session's environment, when it starts; measured on 2.1.197 and the newest:

- what it prints as ``managedSettings`` replaces the managed files' settings
  for that session (the files are the whole policy tier, not merged with it);
- a non-zero exit stops Claude Code from starting, and it shows our stderr;
- it is honoured only from an admin source (the managed files), never from a
  user's or a project's settings.

So the session's sandbox, permission rules and hooks follow the same
effective config as the hook, the proxy and ``run`` (the machine's, narrowed
by the user's: ``machine.narrow``), other people's homes are closed, and the
user's deny paths exist before the sandbox mounts over them.  The managed
files are merged here exactly as Claude Code merges them, with agentsandbox's
own drop-in replaced by this user's rendering, so another vendor's drop-in
keeps its place and its rules.

No Twisted: it runs once per session start, before the first prompt.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from typing import Any

from agentsandbox.paths import DROP_IN_NAME, managedDir


def sessionSettings(
    environ: Mapping[str, str], managed: str | None = None, exe: str | None = None
) -> tuple[dict[str, Any], list[str]]:
    """(The session's managed settings, notes for stderr).  Raises ConfigError.

    ``exe`` is the ``agentsandbox`` the hooks run: the one beside this helper
    (``installationExe``), so the session's hooks are the drop-in's.
    """
    from agentsandbox.claude import render
    from agentsandbox.loader import load
    from agentsandbox.policy import Policy

    config = load(None, environ)
    policy = Policy.fromConfig(config, environ, exe=exe)
    policy.mountPoints()
    own = render(policy)
    notes = list(config.notices)
    merged: dict[str, Any] = {}
    placed = False
    for path in managedFiles(managed or managedDir()):
        if os.path.basename(path) == DROP_IN_NAME and os.path.dirname(path).endswith("managed-settings.d"):
            merged, placed = mergeSettings(merged, own), True
            continue
        try:
            with open(path, "rb") as f:
                data = json.loads(f.read())
        except (OSError, ValueError) as e:
            # Claude Code skips such a file too, and says so.
            notes.append(f"{path} is left out: {e}")
            continue
        if isinstance(data, dict):
            merged = mergeSettings(merged, data)
    if not placed:
        merged = mergeSettings(merged, own)
    merged.pop("policyHelper", None)
    return merged, notes


def managedFiles(managed: str) -> list[str]:
    """The managed files in Claude Code's order: the base file, then each drop-in by name."""
    files = [os.path.join(managed, "managed-settings.json")]
    dropDir = os.path.join(managed, "managed-settings.d")
    try:
        names = sorted(n for n in os.listdir(dropDir) if n.endswith(".json") and not n.startswith("."))
    except OSError:
        names = []
    files += [os.path.join(dropDir, n) for n in names]
    return [f for f in files if os.path.isfile(f)]


def mergeSettings(into: dict[str, Any], more: Mapping[str, Any]) -> dict[str, Any]:
    """Claude Code's merge of settings sources (docs/claude-code.md: lodash ``mergeWith``).

    Objects merge key by key, arrays concatenate keeping the first of equal
    strings and numbers, any other value of ``more`` replaces.
    """
    out = dict(into)
    for key, value in more.items():
        old = out.get(key)
        if isinstance(old, dict) and isinstance(value, dict):
            out[key] = mergeSettings(old, value)
        elif isinstance(old, list) and isinstance(value, list):
            seen: set[object] = set()
            combined: list[Any] = []
            for item in (*old, *value):
                if isinstance(item, (str, int, float, bool)) or item is None:
                    marker = (type(item).__name__, item)
                    if marker in seen:
                        continue
                    seen.add(marker)
                combined.append(item)
            out[key] = combined
        else:
            out[key] = value
    return out


def installationExe(argv0: str) -> str | None:
    """The ``agentsandbox`` beside this helper, as Claude Code ran it (by the drop-in's absolute path)."""
    from agentsandbox.claude import HELPER_NAME

    if os.path.isabs(argv0) and os.path.basename(argv0) == HELPER_NAME:
        beside = os.path.join(os.path.dirname(argv0), "agentsandbox")
        if os.path.exists(beside):
            return beside
    return None


def main() -> int:
    """Print ``{"managedSettings": …}``; on any failure say why and exit 1, so Claude Code does not start."""
    from agentsandbox.config import ConfigError
    from agentsandbox.hook import policyHelper, sessionDir

    # First: a session whose skill listing or memory (CLAUDE.md, rules, imports)
    # would carry a closed file does not start (hook.policyHelper, docs/hook.md).
    code, why = policyHelper(os.environ, sessionDir())
    if code != 0:
        sys.stderr.write(why + "\n")
        return 1
    try:
        settings, notes = sessionSettings(os.environ, exe=installationExe(sys.argv[0] if sys.argv else ""))
    except ConfigError as e:
        sys.stderr.write(
            f"agentsandbox: {e}. Claude Code starts once the config loads (`agentsandbox doctor` checks it).\n"
        )
        return 1
    except Exception as e:  # fail closed: no session without its policy
        sys.stderr.write(f"agentsandbox: the policy helper failed ({type(e).__name__}: {e}).\n")
        return 1
    for note in notes:
        sys.stderr.write(f"agentsandbox: {note}\n")
    sys.stdout.write(json.dumps({"managedSettings": settings}, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
