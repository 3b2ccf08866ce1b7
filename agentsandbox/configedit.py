"""Adding one entry to a list in the person's own config, keeping what they wrote.

``agentsandbox approve HOST --always`` and ``deny HOST --always`` (issue 28)
end here: the host goes into ``sandbox.domains`` or ``sandbox.refused_domains``
of the user's file, which the person reads and edits by hand.  ``tomlkit`` is
used (a dependency for exactly this) because it round-trips a TOML document
with its comments, blank lines and key order intact; ``tomllib`` only reads,
and writing a dict back would drop every comment the person and ``setup`` put
there.  The service's watcher (``reload.py``) then follows the change like any
edit.

Never a file under ``/etc``: the machine's config is the admin's.  The write
is atomic (a temporary file in the same directory, then ``rename``) and keeps
the file's mode.  Twisted-free.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import tomlkit
from tomlkit.items import Array, Table

#: The comment a file this module creates starts with.
HEADER = (
    "agentsandbox: your own config (docs/config.md).  Created by agentsandbox approve/deny\n"
    "--always; edit it freely: comments and layout are kept when an answer adds a line."
)


class ConfigEditError(Exception):
    """The entry could not be written; the message says why, for the person."""


def userFileFor(source: str, machine: str | None, userConfig: str) -> str:
    """The file an always-answer writes: the config's own user file, else the default.

    ``source`` is the loaded config's (``Config.source``), which is the machine's
    file or the built-in defaults when the user has none; then ``userConfig``
    (``~/.config/agentsandbox/config.toml``) is created.
    """
    if os.path.isabs(source) and source != machine and not _underEtc(source):
        return source
    return userConfig


def _underEtc(path: str) -> bool:
    real = os.path.realpath(path)
    return real == "/etc" or real.startswith("/etc/")


def addEntry(
    path: str,
    table: str,
    key: str,
    entry: str,
    seed: tuple[str, ...] = (),
    check: Callable[[str], object] | None = None,
) -> bool:
    """Append ``entry`` to ``[table] key`` of ``path``; False when it is there already.

    Where the file has no such key, the list starts as ``seed``: the values in
    force now, because a list written in the file replaces them (a fresh
    ``sandbox.domains = ["example.org"]`` would drop GitHub's hosts).  Creates
    the file (and its directory, 0700) with a header comment when missing.
    ``check`` gets the new text before it replaces the file and raises (with
    words) when that text must not be written: a file the config loader would
    refuse would stop every session.  Raises ConfigEditError with words for the person.
    """
    if _underEtc(path):
        raise ConfigEditError(f"{path} is under /etc, the machine's: an answer never writes there")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        mode: int | None = os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        text, mode = "", None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigEditError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    try:
        doc = tomlkit.parse(text) if text else _newDocument()
    except Exception as e:  # tomlkit's errors share no public base across 0.11 and later
        raise ConfigEditError(f"{path} is not TOML, so it was left alone: {e}") from None
    section = doc.get(table)
    if section is None:
        section = tomlkit.table()
        doc.add(table, section)
    elif not isinstance(section, Table):
        raise ConfigEditError(f"{path}: {table} is not a table, so it was left alone")
    values: Any = section.get(key)
    if values is None:
        values = tomlkit.array()
        values.extend(seed)
        section.add(key, values)
    elif not isinstance(values, Array):
        raise ConfigEditError(f"{path}: {table}.{key} is not a list, so it was left alone")
    if entry in [str(v) for v in values]:
        return False
    if len(values) and "\n" in values.as_string():
        # A list written one entry a line stays one entry a line.
        values.add_line(entry)
    else:
        values.append(entry)
    text = tomlkit.dumps(doc)
    if check is not None:
        try:
            check(text)
        except Exception as e:
            raise ConfigEditError(f"{path} was left as it was: with {entry!r} it would not load ({e})") from None
    _replace(path, text, mode)
    return True


def _newDocument() -> tomlkit.TOMLDocument:
    doc = tomlkit.document()
    for line in HEADER.splitlines():
        doc.add(tomlkit.comment(line))
    doc.add(tomlkit.nl())
    return doc


def _replace(path: str, text: str, mode: int | None) -> None:
    directory = os.path.dirname(path) or "."
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        fd, temp = tempfile.mkstemp(prefix=".config.", suffix=".toml.tmp", dir=directory)
    except OSError as e:
        raise ConfigEditError(f"cannot write beside {path}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(temp, 0o644 if mode is None else mode)
        os.replace(temp, path)
    except OSError as e:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise ConfigEditError(f"cannot write {path}: {e.strerror or e}") from None
