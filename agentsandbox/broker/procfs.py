"""Who asks: the requester found in ``/proc``, never taken from the request.

Every function here does blocking file-system work; the server calls them off the
reactor thread.  ``procDir`` is a parameter so tests can point at a crafted tree.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

FileKey = tuple[int, int]  # (st_dev, st_ino)


def _pids(procDir: str, uid: int) -> list[int]:
    out: list[int] = []
    try:
        names = os.listdir(procDir)
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            if os.stat(os.path.join(procDir, name)).st_uid != uid:
                continue
        except OSError:
            continue
        out.append(int(name))
    return out


def _fdKeys(procDir: str, pid: int) -> set[FileKey]:
    fdDir = os.path.join(procDir, str(pid), "fd")
    keys: set[FileKey] = set()
    try:
        fds = os.listdir(fdDir)
    except OSError:
        return keys
    for fd in fds:
        try:
            # stat() follows the magic link to the open file itself, wherever it is
            # mounted in the holder's namespace.
            st = os.stat(os.path.join(fdDir, fd))
        except OSError:
            continue
        keys.add((st.st_dev, st.st_ino))
    return keys


def holdersOf(procDir: str, keys: Iterable[FileKey], uid: int) -> dict[FileKey, list[int]]:
    """For each (dev, ino), the pids of ``uid`` that hold it open.  One pass over /proc."""
    wanted = set(keys)
    found: dict[FileKey, list[int]] = {k: [] for k in wanted}
    if not wanted:
        return found
    for pid in _pids(procDir, uid):
        for key in _fdKeys(procDir, pid) & wanted:
            found[key].append(pid)
    for pids in found.values():
        pids.sort()
    return found


def holders(procDir: str, dev: int, ino: int, uid: int | None = None) -> list[int]:
    """The pids of ``uid`` (default: ours) holding the file (dev, ino) open."""
    key = (dev, ino)
    return holdersOf(procDir, [key], os.getuid() if uid is None else uid)[key]


def holds(procDir: str, pid: int, dev: int, ino: int) -> bool:
    """Whether ``pid`` still has the file (dev, ino) open."""
    return (dev, ino) in _fdKeys(procDir, pid)


def socketHolders(procDir: str, inodes: Iterable[int], uid: int | None = None) -> dict[int, list[int]]:
    """For each socket inode, the pids holding it open (an fd link reads
    ``socket:[INODE]``), among ``uid``'s processes or, with None, every one this
    user may read.  One pass over /proc."""
    links = {f"socket:[{inode}]": inode for inode in inodes if inode}
    found: dict[int, list[int]] = {inode: [] for inode in links.values()}
    if not links:
        return found
    if uid is None:
        try:
            pids = [int(name) for name in os.listdir(procDir) if name.isdigit()]
        except OSError:
            pids = []
    else:
        pids = _pids(procDir, uid)
    for pid in pids:
        fdDir = os.path.join(procDir, str(pid), "fd")
        try:
            fds = os.listdir(fdDir)
        except OSError:
            continue
        for fd in fds:
            try:
                inode = links.get(os.readlink(os.path.join(fdDir, fd)))
            except OSError:
                continue
            if inode is not None and pid not in found[inode]:
                found[inode].append(pid)
    for pids in found.values():
        pids.sort()
    return found


#: What a process's name may show of itself: a name is the process's own to set
#: (``prctl(PR_SET_NAME)``), and it reaches a terminal (``watch``) and a
#: notification's markup, so anything else is shown as ``?``.
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ._+-:@/")


def commandName(procDir: str, pid: int) -> str | None:
    """``pid``'s command name (``/proc/PID/comm``), every character but
    letters, digits, spaces and ``._+-:@/`` shown as ``?``; None when the process is gone."""
    try:
        with open(os.path.join(procDir, str(pid), "comm"), encoding="utf-8", errors="replace") as f:
            raw = f.read().removesuffix("\n")
    except OSError:
        return None
    return "".join(c if c in _NAME_CHARS else "?" for c in raw) or "?"


@dataclass(frozen=True)
class Origin:
    """Where a requester stands: its working directory and the variables asked for."""

    pid: int
    cwd: str | None
    env: dict[str, str] = field(default_factory=dict)
    sandboxed: bool = False


def origin(procDir: str, pid: int, keys: Iterable[str]) -> Origin:
    """The requester's cwd (None when unreadable or deleted) and the named variables."""
    base = os.path.join(procDir, str(pid))
    try:
        cwd: str | None = os.readlink(os.path.join(base, "cwd"))
    except OSError:
        cwd = None
    if cwd is not None and (cwd.endswith(" (deleted)") or not cwd.startswith("/")):
        cwd = None
    wanted = set(keys)
    env: dict[str, str] = {}
    if wanted:
        try:
            with open(os.path.join(base, "environ"), "rb") as f:
                raw = f.read()
        except OSError:
            raw = b""
        for item in raw.split(b"\0"):
            name, sep, value = item.partition(b"=")
            if not sep:
                continue
            key = name.decode("utf-8", "surrogateescape")
            if key in wanted and key not in env:
                env[key] = value.decode("utf-8", "surrogateescape")
    return Origin(pid=pid, cwd=cwd, env=env, sandboxed=sandboxed(procDir, pid))


def sandboxed(procDir: str, pid: int) -> bool:
    """True when ``pid`` lives in another mount namespace than the broker.

    bubblewrap always makes its own mount namespace, which nothing inside can leave
    or fake.  An unreadable namespace link counts as sandboxed: the careful answer.
    """
    try:
        mine = os.readlink("/proc/self/ns/mnt")
        theirs = os.readlink(os.path.join(procDir, str(pid), "ns", "mnt"))
    except OSError:
        return True
    return mine != theirs


def cgroupOf(procDir: str, pid: int) -> str:
    """The text of ``/proc/<pid>/cgroup`` ('' when the process is gone)."""
    try:
        with open(os.path.join(procDir, str(pid), "cgroup")) as f:
            return f.read()
    except OSError:
        return ""
