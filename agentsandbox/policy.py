"""The policy: which paths a session may read and write, decided the same way everywhere.

The lists come from the config plus what every session needs (the harness's own
project and plan files, git's config, the spool).  ``readable`` and ``writable``
are the decisions the PreToolUse hook and the broker make; the Claude Code
drop-in and the srt settings render the same lists for bubblewrap.

Stdlib only, and no ``dataclasses``, ``typing``, ``json``, ``re`` or ``fnmatch``
at import time: the hook decides on every file-tool call within a few
milliseconds of Python's own start-up, so ``Policy`` is a small slotted
immutable class, and the hook builds it from its cache (``hook.cachedPolicy``:
``toDict``/``fromDict``) while the config file is unchanged.  This module never
imports the config loader: the config builds a Policy to check its layout.
"""

from __future__ import annotations

import os
import sys

from agentsandbox.paths import APP, Paths

# Importing typing costs the hook more than its decision; mypy reads this name
# as true all the same.
TYPE_CHECKING = False

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    from agentsandbox.config import Config

ENV_MARKER = "AGENTSANDBOX"

#: What srt and Claude Code's sandbox set ``NO_PROXY``/``no_proxy`` to for every
#: sandboxed command (Claude Code 2.1.197 adds ``*.local,.local``).  A client
#: sends a matching destination directly, and inside the sandbox's network
#: namespace only loopback answers: a listed ``10.0.0.5:443`` then fails with
#: "Network is unreachable", a listed ``127.0.0.1:6443`` reaches the sandbox's
#: own loopback.  ``Policy.proxyVars`` narrows it (docs/run.md).
SANDBOX_NO_PROXY = (
    "localhost", "127.0.0.1", "::1", "169.254.0.0/16", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16",
)
#: The loopback entries of ``SANDBOX_NO_PROXY``: the only destinations a
#: sandboxed client can reach without the proxy (servers it runs itself).
LOOPBACK_NO_PROXY = ("localhost", "127.0.0.1", "::1")
#: Paths that name the reading process's own objects (``/proc/self``, open file
#: descriptors).  The hook runs in another process than the file tools, so it
#: cannot know what they mean there, and ``/proc/<pid>/environ`` or ``mem`` of
#: Claude Code hold its credentials: closed to the file tools, whatever the lists say.
PROCESS_PATHS = ("/proc", "/dev/fd", "/dev/stdin", "/dev/stdout", "/dev/stderr")


def _clean(path: str) -> str:
    return os.path.normpath(path) if path else path


def under(path: str, directory: str) -> bool:
    """``path`` is ``directory`` or inside it, compared component by component."""
    if directory == "/":
        return path.startswith("/")
    d = directory.rstrip("/")
    return path == d or path.startswith(d + "/")


def underGlob(path: str, pattern: str) -> bool:
    """``path`` is at or below a path matching ``pattern``; ``*`` never crosses ``/``.

    Each component is matched as ``fnmatch.fnmatchcase`` matches it; the
    components that are plain text or a lone ``*`` (all the harness's own
    patterns have) are decided without importing fnmatch and its ``re``.
    """
    parts = path.split("/")
    pats = pattern.split("/")
    if len(parts) < len(pats):
        return False
    for p, q in zip(parts, pats, strict=False):
        if q == "*":
            continue
        if "*" not in q and "?" not in q and "[" not in q:
            if p != q:
                return False
            continue
        import fnmatch

        if not fnmatch.fnmatchcase(p, q):
            return False
    return True


def tempDir(environ: Mapping[str, str]) -> str:
    """``$TMPDIR`` or ``/tmp`` (not Python's gettempdir, which probes and falls back)."""
    return environ.get("TMPDIR") or "/tmp"


def _absolute(path: str, cwd: str, home: str) -> str:
    """``path`` with ``~`` and the cwd applied, and ``..`` taken lexically (no links read)."""
    if path == "~":
        path = home
    elif path.startswith("~/"):
        # As Paths.expandUser: ``~//x`` is under the home, never ``/x``.
        path = os.path.join(home, path[2:].lstrip("/"))
    if not os.path.isabs(path):
        path = os.path.join(cwd or "/", path)
    path = os.path.normpath(path)
    if path.startswith("//"):
        path = "/" + path.lstrip("/")
    return path


def resolve(path: str, cwd: str, home: str) -> str:
    """Absolute, clean, and with symlinks resolved through the nearest existing parent."""
    return physical(_absolute(path, cwd, home))


def inProcessPath(path: str) -> bool:
    """``path`` (absolute) is one of ``PROCESS_PATHS`` or inside one."""
    return any(path == d or path.startswith(d + "/") for d in PROCESS_PATHS)


def physical(path: str) -> str:
    """The kernel's reading of the absolute ``path``, link by link; ``os.path.realpath`` else.

    Each component is looked up where the ones before it led, a link's target is
    read in its place and ``..`` climbs the directory reached so far, as the
    kernel walks a path.  Like non-strict realpath it follows every link it can
    read, dangling ones included, and keeps missing components as they are (a
    Write through a dangling link creates the link's target, so the target is
    what must be decided), and a link loop is left holding the looping link.

    Unlike realpath it stops where the walk enters ``PROCESS_PATHS``, whether
    the path names it or a link anywhere on the way leads there: what
    ``/proc/self/cwd`` or ``/dev/fd/3`` mean depends on the process reading them,
    and the hook is not the process that opens the file (a project link to
    ``/proc/self/cwd`` is the hook's working directory here and Claude Code's
    there).  The answer is then that process path with the rest of the walk
    appended as written, never normalised, so ``..`` cannot climb out of it;
    ``inProcessPath`` is true of it, and the policy refuses it.
    """
    return _physical(path)[0]


def _physical(path: str) -> tuple[str, int]:
    """``physical(path)`` and how its walk ended (``_DONE``, ``_LOOP`` or ``_STOPPED``)."""
    real, state = _walk("/", path, {})
    return (real if state == _STOPPED else os.path.normpath(real)), state


#: How ``_walk`` ended: every component read, a link loop met, a process path entered.
_DONE, _LOOP, _STOPPED = 0, 1, 2


def _walk(path: str, rest: str, seen: dict[str, str | None]) -> tuple[str, int]:
    """``rest`` walked from the resolved directory ``path``: posixpath's realpath walk."""
    import stat

    if rest.startswith("/"):
        rest = rest[1:]
        path = "/"
    while rest:
        name, _, rest = rest.partition("/")
        if not name or name == ".":
            continue
        if name == "..":
            path = os.path.dirname(path)
            continue
        newpath = path + name if path == "/" else path + "/" + name
        if inProcessPath(newpath):
            return (newpath + "/" + rest if rest else newpath), _STOPPED
        try:
            isLink = stat.S_ISLNK(os.lstat(newpath).st_mode)
        except OSError:
            isLink = False
        if not isLink:
            path = newpath
            continue
        if newpath in seen:
            known = seen[newpath]
            if known is not None:
                path = known
                continue
            return os.path.join(newpath, rest), _LOOP
        seen[newpath] = None
        try:
            target = os.readlink(newpath)
        except OSError:
            path = newpath
            continue
        path, state = _walk(path, target, seen)
        if state != _DONE:
            return (os.path.join(path, rest) if rest else path), state
        seen[newpath] = path
    return path, _DONE


#: Paths with more components than this are resolved by ``os.path.realpath``
#: alone: remembering every prefix of a 64 KiB path would cost more than it saves.
_REMEMBERED_DEPTH = 64


def realpathRemembering(path: str, memo: dict[str, str]) -> str:
    """``physical(path)`` of an absolute, normalised path, each parent resolved once.

    The same answer as realpath (tests/test_policy compares them on generated
    trees of links, loops and dangling links included): a component that is no
    link is appended to its parent's resolution; one that is a link is handed,
    with that resolution, to ``physical`` itself.  A link whose walk meets a loop
    sends the whole path to ``physical``: realpath keeps the rest of a looping
    walk as written and normalises it, so no answer at or below it is remembered.
    ``memo`` maps each resolved prefix to its resolution.
    """
    found = memo.get(path)
    if found is not None:
        return found
    if path.count("/") > _REMEMBERED_DEPTH or not path.startswith("/") or path.startswith("//"):
        found = memo[path] = physical(path)
        return found
    # The nearest remembered parent, then each component below it in turn.
    todo: list[str] = []
    head = path
    while head != "/" and head not in memo:
        todo.append(head)
        head = head.rpartition("/")[0] or "/"
    real = "/" if head == "/" else memo[head]
    import stat

    for prefix in reversed(todo):
        name = prefix.rpartition("/")[2]
        candidate = real + name if real == "/" else real + "/" + name
        if inProcessPath(candidate):
            # Below a process path nothing is read: the rest stays as written.
            real = memo[prefix] = candidate
            continue
        try:
            link = stat.S_ISLNK(os.lstat(candidate).st_mode)
        except OSError:
            link = False
        if not link:
            real = memo[prefix] = candidate
            continue
        real, state = _physical(candidate)
        if state == _LOOP:
            # realpath keeps the rest of a looping walk as written, and what is
            # kept can normalise away (a -> a/..): no answer below it is reusable,
            # this path's included (a longer one would build on it).
            return physical(path)
        memo[prefix] = real
    return real


#: The proxy as sandboxed commands see it: the in-sandbox bridge srt and
#: Claude Code start (their ``HTTPS_PROXY``), which leads to ``proxy.port``.
SANDBOX_PROXY_URL = "http://localhost:3128"


#: The sandboxed clients the narrowed ``NO_PROXY`` serves.
PROXY_AWARE = "clients that use $HTTPS_PROXY/$HTTP_PROXY and $NO_PROXY (curl, wget, git, pip, Python)"


def noProxyNote(noProxy: str) -> str:
    """Which ``NO_PROXY`` sandboxed commands get, and since when."""
    return (
        f"sessions get NO_PROXY={noProxy or '(empty)'} over the sandbox's own, which sends every "
        "loopback and private address direct into an empty network (Claude Code sessions "
        "started after the config changed; every `agentsandbox run`)"
    )


def literalFixes(text: str) -> list[str] | None:
    """For an allow-list entry that is an address (an IP, a CIDR block, a loopback
    name such as ``localhost:8080``): what clients that the narrowed ``NO_PROXY``
    does not serve need to reach it.  None for a host name entry."""
    from agentsandbox.allowlist import Entry, EntryError, isLoopbackName

    try:
        entry = Entry.parse(text)
    except EntryError:
        return None
    name = entry.host if entry.host is not None else entry.suffix
    loopback = name is not None and isLoopbackName(name)
    if not (entry.isAddressEntry or loopback):
        return None
    fixes = [
        "clients that ignore the proxy variables dial direct and fail (Node's fetch and http, raw "
        f"TCP such as ssh, psql or nc): give them the proxy, {SANDBOX_PROXY_URL} inside the sandbox "
        "(HTTP CONNECT to the listed address), e.g. "
        "`ssh -o ProxyCommand='socat - PROXY:localhost:%h:%p,proxyport=3128' ...`"
    ]
    if loopback:
        fixes.append(
            "Go programs (kubectl, gh, terraform) never proxy a loopback address, whatever "
            "NO_PROXY says: use the client's own proxy setting (for kubectl, "
            "`export KUBECONFIG=$(agentsandbox kubeconfig CONTEXT)` sets proxy-url on loopback "
            f"clusters; elsewhere {SANDBOX_PROXY_URL})"
        )
    return fixes


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


_FIELDS = (
    "home",
    "runtime",
    "read",
    "write",
    "deny",
    "harness",
    "toolWrite",
    "domains",
    "proxyPort",
    "spool",
    "egress",
    "exe",
    "configFile",
    "allowTools",
    "others",
)


class Policy:
    """The lists, absolute and clean (immutable).  Build it with ``fromConfig``.

    ``environ`` is the environment decisions read (``$TMPDIR``); it is not part
    of the value.
    """

    __slots__ = (*_FIELDS, "_resolved", "environ")

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
    #: Tools the drop-in removes by default that the config re-opens (``sandbox.allow_tools``).
    allowTools: tuple[str, ...]
    #: Every other person's home on this machine (``otherHomes``): closed like this one.
    others: tuple[str, ...]
    environ: Mapping[str, str]
    #: Each absolute path and parent resolved so far, in a ``remembering`` copy; else None.
    _resolved: dict[str, str] | None

    def __init__(
        self,
        *,
        home: str,
        runtime: str | None,
        read: tuple[str, ...],
        write: tuple[str, ...],
        deny: tuple[str, ...],
        harness: str,
        toolWrite: tuple[str, ...],
        domains: tuple[str, ...],
        proxyPort: int,
        spool: str,
        egress: str | None,
        exe: str,
        configFile: str | None,
        allowTools: tuple[str, ...] = (),
        others: tuple[str, ...] = (),
        environ: Mapping[str, str] | None = None,
    ) -> None:
        values = locals()
        for name in _FIELDS:
            value = values[name]
            object.__setattr__(self, name, tuple(value) if isinstance(value, list) else value)
        object.__setattr__(self, "environ", {} if environ is None else environ)
        object.__setattr__(self, "_resolved", None)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Policy is immutable; cannot set {name}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Policy) and self.toDict() == other.toDict()

    def __hash__(self) -> int:
        import json

        return hash(json.dumps(self.toDict(), sort_keys=True))

    def __repr__(self) -> str:
        return f"Policy({self.toDict()!r})"

    def toDict(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in _FIELDS}

    @classmethod
    def fromDict(cls, data: Mapping[str, object], environ: Mapping[str, str]) -> Policy:
        return cls(**{name: data[name] for name in _FIELDS}, environ=environ)  # type: ignore[arg-type]

    @classmethod
    def fromConfig(
        cls,
        config: Config,
        environ: Mapping[str, str] | None = None,
        exe: str | None = None,
        others: tuple[str, ...] | None = None,
    ) -> Policy:
        """The policy of ``config`` for this user.

        ``others`` are the homes closed beside this one; by default every other
        person's on this machine (``otherHomes``).  The machine's drop-in is
        rendered with none: it is the same for every user, and each session's
        own settings (the policy helper's) close the others.
        """
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
            allowTools=config.sandbox.allow_tools,
            others=otherHomes(os.getuid(), paths.home) if others is None else others,
            environ=env,
        )

    # ------------------------------------------------------------------ decisions

    def closed(self) -> tuple[str, ...]:
        """The directories denied for reading apart from what the lists re-allow."""
        own = (self.home,) if self.runtime is None else (self.home, self.runtime)
        return own + self.others

    def remembering(self) -> Policy:
        """This policy, resolving each path once: for one decision, such as the hook's.

        One Read decides two readings against every list entry, so most paths
        (and most of their parents) would be resolved several times.  A
        long-lived policy (the broker's) must not remember: a link may change
        between two decisions.
        """
        copy = Policy(**self.toDict(), environ=self.environ)  # type: ignore[arg-type]
        object.__setattr__(copy, "_resolved", {})
        return copy

    def _resolve(self, path: str, cwd: str) -> str:
        memo = self._resolved
        if memo is None:
            return resolve(path, cwd, self.home)
        return realpathRemembering(_absolute(path, cwd, self.home), memo)

    def processPath(self, path: str, cwd: str) -> str | None:
        """The entry of ``PROCESS_PATHS`` that ``path`` is in, as written or resolved.

        Resolved means link by link (``physical``): a link anywhere on the way
        into a process path puts ``path`` there too.
        """
        plain = _absolute(path, cwd, self.home)
        for p in (plain, self._resolve(path, cwd)):
            for d in PROCESS_PATHS:
                if under(p, d):
                    return d
        return None

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
        if self._denied(p) is not None or self.processPath(path, cwd) is not None:
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
        if self._denied(p) is not None or self.processPath(path, cwd) is not None:
            return None
        if not any(under(p, c) for c in self.closed()):
            return "outside the closed directories (home, the runtime dir)"
        for r in self.read:
            if under(p, self._resolve(r, "/")):
                return f"sandbox.read {r}"
        return self.whyWritable(path, cwd)

    def closedBelow(self, path: str, cwd: str) -> str | None:
        """A closed or denied directory strictly inside ``path``, if any.

        A recursive search (Grep, Glob) from an ancestor of home would read what
        the closed directory holds, though the root itself is readable.  A closed
        directory that the lists re-allow whole (the root is a listed path, or
        inside one) does not count.
        """
        p = self._resolve(path, cwd)
        for d in (*self.closed(), *(self._resolve(x, "/") for x in self.deny), *PROCESS_PATHS):
            if d != p and under(d, p):
                return d
        return None

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

    def noProxy(self) -> str:
        """``NO_PROXY`` for sandboxed commands: the loopback entries no allow-list entry needs.

        Every other destination goes to the proxy, which forwards what
        ``sandbox.domains`` lists and refuses the rest naming that key (a direct
        attempt could only fail).  A loopback entry stays unless a listed entry
        reaches it (``127.0.0.1:6443`` drops ``127.0.0.1``, ``localhost:8080``
        drops ``localhost``), so servers a command runs inside its sandbox stay
        reachable by the names the allow list does not claim.
        """
        from agentsandbox.allowlist import Entry, EntryError, isLoopbackName, parseIP, unwrapMapped

        claimed: set[str] = set()
        for text in self.domains:
            try:
                entry = Entry.parse(text)
            except EntryError:
                continue  # the config loader refused it already
            host = entry.host if entry.host is not None else entry.suffix
            if host is None or not isLoopbackName(host):
                continue
            ip = parseIP(host) if entry.host is not None else None
            if ip is None:
                claimed.add("localhost")
            else:
                claimed.add(str(unwrapMapped(ip)))
        return ",".join(e for e in LOOPBACK_NO_PROXY if e not in claimed)

    def proxyVars(self) -> dict[str, str]:
        """The proxy variables sandboxed commands get over the sandbox's own (``noProxy``).

        They must be set *inside* the sandbox: srt and Claude Code set theirs
        with bubblewrap's ``--setenv``, over anything the caller passed.
        """
        value = self.noProxy()
        return {"NO_PROXY": value, "no_proxy": value}

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


#: Where login accounts' uids lie when /etc/login.defs does not say (Debian's defaults).
_UID_RANGE = (1000, 60000)


def otherHomes(uid: int, home: str, passwd: str = "/etc/passwd", loginDefs: str = "/etc/login.defs") -> tuple[str, ...]:
    """The homes of every other person on this machine: root's and each login account's.

    A login account is one whose uid lies in login.defs' UID_MIN..UID_MAX
    (service accounts' homes, such as ``/bin`` or ``/var/lib/…``, are not
    people's).  ``uid``'s own entry, and a home that holds ``home`` (the
    session's), are left out: the session's own home is closed apart from its
    lists already.  Read from the files, not NSS: a directory service's users
    are not listed (docs/config.md says so).
    """
    low, high = _uidRange(loginDefs)
    homes: set[str] = set()
    try:
        with open(passwd, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return ()
    for line in lines:
        fields = line.split(":")
        if len(fields) < 7 or not fields[2].isdigit():
            continue
        owner, directory = int(fields[2]), fields[5]
        if owner == uid or (owner != 0 and not low <= owner <= high):
            continue
        if not directory.startswith("/"):
            continue
        directory = _clean(directory)
        if directory == "/" or under(home, directory) or not os.path.isdir(directory):
            continue
        homes.add(directory)
    return tuple(sorted(homes))


def _uidRange(loginDefs: str) -> tuple[int, int]:
    low, high = _UID_RANGE
    try:
        with open(loginDefs, encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2 and parts[1].isdigit():
                    if parts[0] == "UID_MIN":
                        low = int(parts[1])
                    elif parts[0] == "UID_MAX":
                        high = int(parts[1])
    except OSError:
        pass
    return low, high


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
