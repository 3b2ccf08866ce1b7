"""The policy: which paths a session may read and write, decided the same way everywhere.

The lists come from the config plus what every session needs (the harness's own
project and plan files, git's config, the spool).  ``readable`` and ``writable``
are the decisions the PreToolUse hook and the broker make; the Claude Code
drop-in and the srt settings render the same lists for bubblewrap.

Stdlib only: the hook builds a Policy on every file-tool call.
"""

from __future__ import annotations

import fnmatch
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from agentsandbox.paths import APP, Paths

if TYPE_CHECKING:
    from agentsandbox.config import Config

ENV_MARKER = "AGENTSANDBOX"


def _clean(path: str) -> str:
    return os.path.normpath(path) if path else path


def under(path: str, directory: str) -> bool:
    """``path`` is ``directory`` or inside it, compared component by component."""
    if directory == "/":
        return path.startswith("/")
    d = directory.rstrip("/")
    return path == d or path.startswith(d + "/")


def underGlob(path: str, pattern: str) -> bool:
    """``path`` is at or below a path matching ``pattern``; ``*`` never crosses ``/``."""
    parts = path.split("/")
    pats = pattern.split("/")
    if len(parts) < len(pats):
        return False
    return all(fnmatch.fnmatchcase(p, q) for p, q in zip(parts, pats, strict=False))


def tempDir(environ: Mapping[str, str]) -> str:
    """``$TMPDIR`` or ``/tmp`` (not Python's gettempdir, which probes and falls back)."""
    return environ.get("TMPDIR") or "/tmp"


def resolve(path: str, cwd: str, home: str) -> str:
    """Absolute, clean, and with symlinks resolved through the nearest existing parent."""
    if path == "~":
        path = home
    elif path.startswith("~/"):
        path = os.path.join(home, path[2:])
    if not os.path.isabs(path):
        path = os.path.join(cwd or "/", path)
    path = os.path.normpath(path)
    if path.startswith("//"):
        path = "/" + path.lstrip("/")
    # Non-strict realpath follows every link it can read, dangling ones included, and
    # keeps missing components as they are: a Write through a dangling link creates
    # the link's target, so the target is what must be decided.
    return os.path.realpath(path)


def _withTargets(paths: Iterable[str]) -> tuple[str, ...]:
    """Each path and, where it differs, its symlink-resolved target; sorted, unique.

    bubblewrap mounts a link's target, not the link, so both must be listed.
    """
    out: set[str] = set()
    for p in paths:
        if not p:
            continue
        p = _clean(p)
        out.add(p)
        real = resolve(p, "/", "/")
        if real != p:
            out.add(real)
    return tuple(sorted(out))


@dataclass(frozen=True)
class Policy:
    """The lists, absolute and clean.  Build it with ``fromConfig``."""

    home: str
    runtime: str | None
    read: tuple[str, ...]
    write: tuple[str, ...]
    deny: tuple[str, ...]
    harness: str
    toolWrite: tuple[str, ...]
    domains: tuple[str, ...]
    proxyPort: int
    spool: str
    egress: str | None
    exe: str
    configFile: str | None
    environ: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def fromConfig(
        cls,
        config: Config,
        environ: Mapping[str, str] | None = None,
        exe: str | None = None,
    ) -> Policy:
        env = dict(os.environ if environ is None else environ)
        paths: Paths = config.paths
        claude = paths.claudeDir
        xdgGit = os.path.join(paths.configHome, "git")
        exe = exe or executable()
        configFile = config.source if os.path.isabs(config.source) else None
        read = [
            os.path.dirname(exe),
            os.path.join(claude, "projects"),
            os.path.join(claude, "plans"),
            os.path.join(claude, "skills"),
            os.path.join(claude, "plugins"),
            os.path.join(claude, "CLAUDE.md"),
            os.path.join(paths.home, ".gitconfig"),
            xdgGit,
            paths.configDir,
            *config.sandbox.read,
        ]
        if configFile is not None:
            read.append(configFile)
        egress = paths.egressDir
        if egress is not None:
            read.append(egress)
        write = [config.broker.spool, *config.sandbox.write]
        return cls(
            home=paths.home,
            runtime=paths.runtimeDir,
            read=_withTargets(read),
            write=_withTargets(write),
            deny=_withTargets(config.sandbox.deny),
            harness=_clean(claude),
            toolWrite=_withTargets(
                [os.path.join(claude, "projects", "*", "memory"), os.path.join(claude, "plans")]
            ),
            domains=config.sandbox.domains,
            proxyPort=config.proxy.port,
            spool=config.broker.spool,
            egress=egress,
            exe=exe,
            configFile=configFile,
            environ=env,
        )

    # ------------------------------------------------------------------ decisions

    def closed(self) -> tuple[str, ...]:
        """The directories denied for reading apart from what the lists re-allow."""
        return (self.home,) if self.runtime is None else (self.home, self.runtime)

    def _resolve(self, path: str, cwd: str) -> str:
        return resolve(path, cwd, self.home)

    def _denied(self, p: str) -> str | None:
        for d in self.deny:
            if under(p, self._resolve(d, "/")):
                return d
        return None

    def _listed(self, p: str) -> bool:
        if not any(under(p, c) for c in self.closed()):
            return True
        return any(under(p, self._resolve(r, "/")) for r in (*self.read, *self.write))

    def _cwdOpens(self, cwd: str) -> str | None:
        """The resolved cwd when it opens its tree for writing, else None.

        A cwd opens nothing when it is ``/`` or holds a closed directory (home, the
        runtime dir), or when it is itself closed and not listed.
        """
        if not cwd:
            return None
        c = self._resolve(cwd, "/")
        if c == "/" or any(under(closed, c) for closed in self.closed()):
            return None
        return c if self._listed(c) else None

    def writable(self, path: str, cwd: str) -> bool:
        return self.whyWritable(path, cwd) is not None

    def readable(self, path: str, cwd: str) -> bool:
        return self.whyReadable(path, cwd) is not None

    def whyWritable(self, path: str, cwd: str) -> str | None:
        """The rule that lets a session write ``path``, or None when nothing does."""
        p = self._resolve(path, cwd)
        if self._denied(p) is not None:
            return None
        tmp = self._resolve(tempDir(self.environ), "/")
        if under(p, tmp):
            return f"the temp dir {tmp}"
        for w in self.write:
            if under(p, self._resolve(w, "/")):
                return f"sandbox.write {w}"
        c = self._cwdOpens(cwd)
        if c is not None and under(p, c):
            return f"the session's working directory {c}"
        for g in self.toolWrite:
            if underGlob(p, g):
                return f"the harness's own files {g}"
        return None

    def whyReadable(self, path: str, cwd: str) -> str | None:
        """The rule that lets a session read ``path``, or None when nothing does."""
        p = self._resolve(path, cwd)
        if self._denied(p) is not None:
            return None
        if not any(under(p, c) for c in self.closed()):
            return "outside the closed directories (home, the runtime dir)"
        for r in self.read:
            if under(p, self._resolve(r, "/")):
                return f"sandbox.read {r}"
        return self.whyWritable(path, cwd)

    def deniedBy(self, path: str, cwd: str) -> str | None:
        """The ``sandbox.deny`` entry that closes ``path``, if one does."""
        return self._denied(self._resolve(path, cwd))

    # ------------------------------------------------------------------ checks

    def nestedError(self) -> str | None:
        """bubblewrap mounts a readable parent read-only over a writable child."""
        for w in self.write:
            for r in self.read:
                # Only re-allowed paths inside a closed dir become read-only mounts.
                if not any(under(r, c) for c in self.closed()):
                    continue
                if w != r and under(w, r):
                    return (
                        f"the writable path {w} lies inside the readable path {r}: the sandbox "
                        f"would mount {r} read-only over it. List {w}'s parent in sandbox.write "
                        f"instead, or drop {r} from sandbox.read"
                    )
        return None

    def mountPoints(self) -> None:
        """Create every deny path (0700): the sandbox mounts over it and cannot create it."""
        for d in self.deny:
            os.makedirs(d, mode=0o700, exist_ok=True)

    # ------------------------------------------------------------------ settings syntax

    def setting(self, path: str) -> str:
        """Claude Code's prefix syntax: ``~/`` for home, ``//abs`` for other absolute paths."""
        if path == self.home:
            return "~/"
        if under(path, self.home):
            return "~/" + path[len(self.home) :].lstrip("/")
        return "/" + path

    def sessionVars(self) -> dict[str, str]:
        """Per-user variables the SessionStart hook exports into sandboxed Bash."""
        out = {ENV_MARKER: "1", "AGENTSANDBOX_SPOOL": self.spool}
        for name, path in (
            ("AGENTSANDBOX_CONFIG", self.configFile),
            ("GIT_CONFIG_GLOBAL", os.path.join(self.home, ".gitconfig")),
            ("XDG_CONFIG_HOME", self.environ.get("XDG_CONFIG_HOME") or os.path.join(self.home, ".config")),
        ):
            if not path:
                continue
            real = resolve(path, "/", self.home)
            if real != path:
                out[name] = real
            elif name == "AGENTSANDBOX_CONFIG":
                out[name] = path
        return out


def executable() -> str:
    """The absolute path of the installed ``agentsandbox`` command."""
    env = os.environ.get("AGENTSANDBOX_EXE")
    if env:
        return env
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else ""
    if os.path.basename(argv0) == APP and os.path.isabs(argv0):
        return argv0
    beside = os.path.join(os.path.dirname(sys.executable), APP)
    if os.path.exists(beside):
        return beside
    import shutil

    found = shutil.which(APP)
    return os.path.abspath(found) if found else beside
