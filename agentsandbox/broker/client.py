"""Asking the host broker from inside the sandbox.  Stdlib only: no Twisted, fast start.

``call()`` creates ``<id>.tmp`` with O_EXCL (mode 0600), writes the request, renames it
to ``<id>.req`` and keeps the file open until the answer: the broker looks the
requester up by the open file in ``/proc``, never by anything the request says.  It
waits on an inotify watch of the spool (through ctypes; a short backoff poll where
inotify is not available), copies ``<id>.out`` to the caller's output while a
streamed call runs, and removes every file of the request on the way out.

No answer within the timeout is ``NoBroker``, a distinct error that names the spool.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import select
import stat
import time
from collections.abc import Callable, Mapping
from typing import BinaryIO

from agentsandbox.broker import spool as wire
from agentsandbox.broker.spool import Reply, Request

SPOOL_ENV = "AGENTSANDBOX_SPOOL"

#: How long a ping waits before the client says no broker runs.
PING_TIMEOUT = 5.0

_IN_MODIFY = 0x002
_IN_CLOSE_WRITE = 0x008
_IN_MOVED_TO = 0x080
_IN_CREATE = 0x100
_IN_NONBLOCK = 0o4000
_IN_CLOEXEC = 0o2000000

#: The longest we sleep between two looks at the spool, even with inotify: a missed
#: event (queue overflow) then costs at most this much.
_MAX_NAP = 0.25


class BrokerError(Exception):
    """The broker refused, or its answer could not be used.

    ``reply`` is the broker's whole answer when it gave one: a host command that timed
    out still carries the output it made.
    """

    def __init__(self, message: str, reply: Reply | None = None) -> None:
        super().__init__(message)
        self.reply = reply


class NoBroker(BrokerError):
    """No broker answered within the timeout."""

    def __init__(self, spool: str, timeout: float) -> None:
        BrokerError.__init__(
            self,
            f"no agentsandbox broker answered within {timeout:g}s in {spool}: the broker "
            "runs on the host (agentsandbox serve, or the agentsandbox user service); "
            "nothing was done inside the sandbox instead"
        )
        self.spool = spool
        self.timeout = timeout


def spoolDir(environ: Mapping[str, str] | None = None) -> str:
    """``$AGENTSANDBOX_SPOOL``, else the config's ``broker.spool``."""
    env = os.environ if environ is None else environ
    named = env.get(SPOOL_ENV)
    if named:
        return named
    from agentsandbox import loader

    return loader.load(None, env).broker.spool


def inSandbox(environ: Mapping[str, str] | None = None) -> bool:
    """True inside srt / Claude Code's sandbox, which sets SANDBOX_RUNTIME=1 everywhere."""
    env = os.environ if environ is None else environ
    return env.get("SANDBOX_RUNTIME") == "1"


def isAgentsandbox(program: str) -> bool:
    """True when ``program`` is this tool (or a launcher of it), which would loop.

    The SessionStart exports point git's gpg.program at ``agentsandbox gpg``; a person
    who sets it that way globally must not make ``agentsandbox gpg`` (or the broker)
    call itself.  A launcher script is recognised by naming agentsandbox in its first
    few hundred bytes.
    """
    from agentsandbox.policy import executable

    if os.path.basename(program).startswith("agentsandbox"):
        return True
    try:
        if os.path.realpath(program) == os.path.realpath(executable()):
            return True
        with open(program, "rb") as f:
            head = f.read(512)
    except OSError:
        return False
    return head.startswith(b"#!") and b"agentsandbox" in head


# --------------------------------------------------------------------------- waiting


class _Waiter:
    """Sleeps until something changes in the spool (inotify), or for a backoff period."""

    def __init__(self, directory: str, useInotify: bool = True) -> None:
        self.fd = -1
        self.poller: select.poll | None = None
        self.backoff = 0.001
        if useInotify:
            self.fd = _inotifyWatch(directory)
        if self.fd >= 0:
            self.poller = select.poll()
            self.poller.register(self.fd, select.POLLIN)

    def wait(self, seconds: float) -> None:
        seconds = max(0.0, min(seconds, _MAX_NAP))
        if self.poller is not None:
            if self.poller.poll(seconds * 1000):
                with contextlib.suppress(OSError):
                    os.read(self.fd, 65536)
            return
        # Without inotify: 1 ms doubling to 50 ms, so a quick answer is seen quickly
        # and a long call costs twenty wake-ups a second.
        time.sleep(min(seconds, self.backoff))
        self.backoff = min(self.backoff * 2, 0.05)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


_libc: ctypes.CDLL | None = None


def _loadLibc() -> ctypes.CDLL | None:
    """The C library, loaded once: ``find_library`` may run ``ldconfig``, so avoid it."""
    global _libc
    if _libc is None:
        for name in ("libc.so.6", ctypes.util.find_library("c")):
            if not name:
                continue
            try:
                _libc = ctypes.CDLL(name, use_errno=True)
                break
            except OSError:
                continue
    return _libc


def _inotifyWatch(directory: str) -> int:
    """An inotify fd watching ``directory``, or -1 where inotify is not available."""
    libc = _loadLibc()
    try:
        init = libc.inotify_init1  # type: ignore[union-attr]
        add = libc.inotify_add_watch  # type: ignore[union-attr]
    except AttributeError:
        return -1
    fd = int(init(_IN_NONBLOCK | _IN_CLOEXEC))
    if fd < 0:
        return -1
    mask = _IN_MOVED_TO | _IN_CLOSE_WRITE | _IN_MODIFY | _IN_CREATE
    if int(add(fd, os.fsencode(directory), ctypes.c_uint32(mask))) < 0:
        os.close(fd)
        return -1
    return fd


# --------------------------------------------------------------------------- the call


def _prepareSpool(directory: str) -> None:
    try:
        os.makedirs(directory, mode=wire.DIR_MODE, exist_ok=True)
    except OSError as e:
        raise BrokerError(f"cannot create the spool {directory}: {e.strerror or e}") from None
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise BrokerError(f"the spool {directory} is not a directory")
    if st.st_mode & 0o022:
        raise BrokerError(
            f"the spool {directory} is writable by others (mode {stat.S_IMODE(st.st_mode):o}); "
            "it must be 0700"
        )


def call(
    request: Request,
    spool: str,
    timeout: float | None,
    output: BinaryIO | None = None,
    useInotify: bool = True,
    onSent: Callable[[str], None] | None = None,
) -> Reply:
    """Ask the broker and wait for its reply.

    ``timeout`` None waits as long as the call runs (use it only after a ping showed a
    broker).  ``output`` receives a streamed call's output as it arrives.  A reply
    with an ``error`` raises BrokerError; no reply in time raises NoBroker.
    """
    _prepareSpool(spool)
    rid = wire.newId()
    base = os.path.join(spool, rid)
    paths = {s: base + s for s in wire.SUFFIXES}
    waiter = _Waiter(spool, useInotify)
    fd = -1
    try:
        fd = os.open(
            paths[wire.TMP],
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            wire.FILE_MODE,
        )
        data = request.toJSON()
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.rename(paths[wire.TMP], paths[wire.REQ])
        if onSent is not None:
            onSent(rid)
        return _await(paths, spool, timeout, output, waiter)
    finally:
        for name in (wire.REQ, wire.TMP, wire.REPLY, wire.OUT):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(paths[name])
        if fd >= 0:
            os.close(fd)
        waiter.close()


def _await(
    paths: dict[str, str],
    spool: str,
    timeout: float | None,
    output: BinaryIO | None,
    waiter: _Waiter,
) -> Reply:
    deadline = None if timeout is None else time.monotonic() + timeout
    tail = _Tail(paths[wire.OUT]) if output is not None else None
    while True:
        raw = _readReply(paths[wire.REPLY])
        if tail is not None:
            # The reply is written after the call ends, so once it exists the output
            # file holds everything: one more copy after seeing it completes it.
            tail.copyTo(output)  # type: ignore[arg-type]
        if raw is not None:
            try:
                reply = wire.parseReply(raw)
            except wire.WireError as e:
                raise BrokerError(str(e)) from None
            if reply.error is not None:
                raise BrokerError(reply.error, reply)
            return reply
        if deadline is None:
            waiter.wait(_MAX_NAP)
            continue
        left = deadline - time.monotonic()
        if left <= 0:
            raise NoBroker(spool, timeout or 0.0)
        waiter.wait(left)


def _readReply(path: str) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise BrokerError(f"the reply {path} is a symlink; refusing it") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise BrokerError(f"the reply {path} is not a regular file; refusing it")
        chunks: list[bytes] = []
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    finally:
        os.close(fd)


class _Tail:
    """Copies what a growing file gained since the last look."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.offset = 0

    def copyTo(self, output: BinaryIO) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except (FileNotFoundError, OSError):
            return
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return
            os.lseek(fd, self.offset, os.SEEK_SET)
            while True:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                self.offset += len(chunk)
                output.write(chunk)
            output.flush()
        finally:
            os.close(fd)


def ask(
    op: str, spool: str | None = None, timeout: float | None = PING_TIMEOUT, **fields: object
) -> Reply:
    """One non-streamed call: ``ask("ping")``, ``ask("sign", args=(...), input=b"...")``."""
    request = Request(op=op, **fields)  # type: ignore[arg-type]
    return call(request, spool or spoolDir(), timeout)


def stream(
    request: Request, output: BinaryIO, spool: str | None = None, timeout: float | None = None
) -> Reply:
    """A streamed call: the broker's ``<id>.out`` is copied to ``output`` while it runs."""
    streamed = Request(
        op=request.op,
        args=request.args,
        input=request.input,
        stream=True,
        memory=request.memory,
        cpu=request.cpu,
        key=request.key,
    )
    return call(streamed, spool or spoolDir(), timeout, output)

