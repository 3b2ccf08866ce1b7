"""The broker: answers sandboxed processes that ask through the spool.

``BrokerService`` is a Twisted ``Service`` (the service issue adds it to the app's
``MultiService``).  inotify (moved-to and close-write) wakes it the moment a request
is renamed into place; a slow rescan on the injected clock catches anything an event
queue overflow lost.  Every request is answered on its own, side by side:

1. open ``<id>.req`` with O_NOFOLLOW and O_NONBLOCK (a planted symlink or FIFO
   cannot redirect or stall us), accept only a regular file of the broker's uid with
   one link, read at most 1 MiB;
2. decode it strictly and let the op validate it (no /proc work for garbage);
3. find exactly one process of the broker's uid holding the file open, scanning
   ``/proc/*/fd`` off the reactor thread (scans of a burst are coalesced into one);
4. act for that process; a call whose holder lets go is ended (SIGTERM, SIGKILL
   after ``killDelay``) and gets no reply;
5. write the reply to ``<id>.reply.tmp`` and rename it into place.

Given a ``ConfigHolder``, the broker follows reloads itself: a change to
``sandbox.*`` or the paths rebuilds the policy its own checks use (a host
command's cwd must be readable); ``[broker]`` and ``[scope]`` stay as they
were at start.  ``stopGrace`` bounds the SIGTERM-to-SIGKILL wait of host
commands while the broker stops.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import sys
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from twisted.application import service
from twisted.internet import defer, task, threads
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.filepath import FilePath
from twisted.python.threadpool import ThreadPool

from agentsandbox.broker import procfs
from agentsandbox.broker import spool as wire
from agentsandbox.broker.ops import OPS, Call, Host, Op, OpError
from agentsandbox.broker.spool import Reply, WireError
from agentsandbox.config import Config
from agentsandbox.policy import Policy
from agentsandbox.reload import ConfigHolder, asHolder

T = TypeVar("T")

log = Logger(namespace="agentsandbox.broker")

STOPPING = "broker stopping: the request was not carried out; ask again once it is back"


class _Refused(Exception):
    """A request refused before any op ran; the message is the reply's error."""


class _Dropped(Exception):
    """The requester went away: end quietly, leave no reply."""


class Stats:
    """Counts per op and outcome, for the ``status`` op."""

    def __init__(self) -> None:
        self.counts: dict[str, dict[str, int]] = {}
        #: Requesters found in /proc: inside a sandbox (another mount namespace) or not.
        self.requesters = {"sandboxed": 0, "host": 0}

    def count(self, op: str, outcome: str) -> None:
        per = self.counts.setdefault(op, {})
        per[outcome] = per.get(outcome, 0) + 1


class BrokerService(service.Service):
    name = "broker"

    def __init__(
        self,
        config: Config | ConfigHolder,
        reactor: Any = None,
        clock: IReactorTime | None = None,
        procDir: str = "/proc",
        environ: dict[str, str] | None = None,
        watch: bool = True,
        rescanInterval: float = 5.0,
        holderInterval: float = 1.0,
        killDelay: float = 10.0,
        uid: int | None = None,
        ops: dict[str, Op] | None = None,
        stopGrace: float | None = None,
        statusSources: Mapping[str, Callable[[], Any]] | None = None,
        sessions: Any = None,
    ) -> None:
        if reactor is None:
            from twisted.internet import reactor as defaultReactor

            reactor = defaultReactor
        self.holder = asHolder(config)
        config = self.holder.current
        self.config = config
        #: Seconds a host command gets between SIGTERM and SIGKILL while the
        #: broker stops (None: its usual ``killDelay``).
        self.stopGrace = stopGrace
        self.reactor = reactor
        self.clock: IReactorTime = clock if clock is not None else reactor
        self.procDir = procDir
        self.environ = dict(os.environ if environ is None else environ)
        self.spool = config.broker.spool
        self.watch = watch
        self.rescanInterval = rescanInterval
        self.holderInterval = holderInterval
        self.uid = os.getuid() if uid is None else uid
        self.ops = OPS if ops is None else ops
        self.stats = Stats()
        #: Extra figures for ``status`` (the service's proxy and tokens): name -> callable.
        self.statusSources: dict[str, Callable[[], Any]] = dict(statusSources or {})
        self.inFlight: dict[str, Deferred[Any]] = {}
        self.ready: Deferred[None] = Deferred()
        self._started = 0.0
        self._stopping = False
        self._pool = self._newPool()
        self._inotify: Any = None
        self._rescan: task.LoopingCall | None = None
        self._pending: dict[procfs.FileKey, list[Deferred[list[int]]]] = {}
        self._scanning = False
        self.host = Host(
            config=config,
            reactor=reactor,
            clock=self.clock,
            environ=self.environ,
            procDir=procDir,
            killDelay=killDelay,
            inThread=self.inThread,
            status=self.statusReport,
            policy=Policy.fromConfig(config, environ=self.environ),
            sessions=sessions,
        )
        self._policyFrom = config

    # ------------------------------------------------------------------ lifecycle

    @staticmethod
    def _newPool() -> ThreadPool:
        return ThreadPool(minthreads=0, maxthreads=4, name="agentsandbox-broker")

    def startService(self) -> None:
        if not sys.platform.startswith("linux"):
            raise RuntimeError(
                "the broker runs on Linux only: it finds each requester in /proc and "
                "waits on inotify"
            )
        prepareSpool(self.spool, self.uid)
        current = self.holder.current
        if _policyChanged(self._policyFrom, current):
            self._adoptPolicy(current)
        self.holder.subscribe(self._configChanged)
        super().startService()
        self._stopping = False
        self._started = self.clock.seconds()
        if self._pool.joined:
            self._pool = self._newPool()
        self._pool.start()
        d = self.inThread(cleanLeftovers, self.spool, self.procDir, self.uid)
        d.addCallback(lambda removed: self._listen(removed))
        d.addErrback(lambda f: log.failure("broker start", f))
        d.addBoth(lambda _: self.ready.callback(None) if not self.ready.called else None)

    def _listen(self, removed: int) -> None:
        if self._stopping:
            return
        if removed:
            log.info("removed {n} leftover spool files of crashed clients", n=removed)
        if self.watch:
            from twisted.internet import inotify

            self._inotify = inotify.INotify(reactor=self.reactor)
            self._inotify.startReading()
            self._inotify.watch(
                FilePath(self.spool),
                mask=inotify.IN_MOVED_TO | inotify.IN_CLOSE_WRITE,
                callbacks=[self._notified],
            )
        self._rescan = task.LoopingCall(self.rescan)
        self._rescan.clock = self.clock
        self._rescan.start(self.rescanInterval, now=True)
        log.info("broker serving {spool}", spool=self.spool)

    def stopService(self) -> Deferred[None]:
        if not self.running:
            return defer.succeed(None)
        super().stopService()
        self.holder.unsubscribe(self._configChanged)
        self._stopping = True
        # A stopping broker waits for its host commands; one that ignores
        # SIGTERM (or gets it between fork and exec, where Twisted's handler
        # still eats it) would hold the stop for the whole killDelay.
        killDelay = self.host.killDelay
        if self.stopGrace is not None:
            self.host.killDelay = min(killDelay, self.stopGrace)
        if self._inotify is not None:
            self._inotify.loseConnection()
            self._inotify = None
        if self._rescan is not None and self._rescan.running:
            self._rescan.stop()
        self._rescan = None
        for rid, d in list(self.inFlight.items()):
            self._writeReplyQuietly(rid, Reply(error=STOPPING))
            self.stats.count("(stopped)", "error")
            d.cancel()
        running = list(self.host.running)
        done: Deferred[Any] = defer.DeferredList(running, consumeErrors=True)
        done.addBoth(lambda _: self._pool.stop())

        def stopped(result: object) -> object:
            self.host.killDelay = killDelay
            return result

        return done.addBoth(stopped).addCallback(lambda _: None)

    # ------------------------------------------------------------------ reload

    def _configChanged(self, old: Config, new: Config) -> None:
        if _policyChanged(old, new):
            self._adoptPolicy(new)

    def _adoptPolicy(self, config: Config) -> None:
        # The broker's own check (a host command's cwd must be readable)
        # follows the file at once: a narrowed policy must not wait for a restart.
        self.host.policy = Policy.fromConfig(config, environ=self.environ)
        self._policyFrom = config

    def inThread(self, f: Callable[..., T], *args: Any) -> Deferred[T]:
        return threads.deferToThreadPool(self.reactor, self._pool, f, *args)

    def statusReport(self) -> dict[str, Any]:
        report: dict[str, Any] = {
            "uptime": round(self.clock.seconds() - self._started, 3),
            "requests": self.stats.counts,
            "requesters": self.stats.requesters,
            "inFlight": len(self.inFlight),
            "spool": self.spool,
            "pid": os.getpid(),
        }
        for name, source in self.statusSources.items():
            try:
                report[name] = source()
            except Exception as e:
                report[name] = {"error": str(e)}
        return report

    # ------------------------------------------------------------------ noticing requests

    def _notified(self, ignored: Any, path: FilePath[Any], mask: int) -> None:
        name = path.basename()
        if isinstance(name, bytes):
            name = name.decode("utf-8", "surrogateescape")
        self.consider(name)

    def rescan(self) -> None:
        try:
            names = sorted(os.listdir(self.spool))
        except OSError as e:
            log.warn("cannot list the spool {spool}: {why}", spool=self.spool, why=e.strerror)
            return
        for name in names:
            self.consider(name)

    def consider(self, name: str) -> None:
        if self._stopping:
            return
        parts = wire.splitName(name)
        if parts is None or parts[1] != wire.REQ:
            return
        rid = parts[0]
        if rid in self.inFlight:
            return
        if os.path.lexists(os.path.join(self.spool, rid + wire.REPLY)):
            return  # answered; the requester has not collected it yet
        d = defer.ensureDeferred(self._answer(rid))
        self.inFlight[rid] = d

        def finished(result: Any) -> Any:
            if self.inFlight.get(rid) is d:
                del self.inFlight[rid]
            return result

        d.addBoth(finished)
        d.addErrback(self._cancelledOrLogged)

    def _cancelledOrLogged(self, f: Any) -> None:
        if not f.check(CancelledError):
            log.failure("answering a request", f)

    # ------------------------------------------------------------------ answering

    def _path(self, rid: str, suffix: str) -> str:
        return os.path.join(self.spool, rid + suffix)

    async def _answer(self, rid: str) -> None:
        opName = "(malformed)"
        try:
            raw, key = readRequest(self._path(rid, wire.REQ), self.uid)
            request = wire.parseRequest(raw)
            op = self.ops.get(request.op)
            if op is None:
                opName = "(unknown)"
                raise _Refused(
                    f"unknown op {request.op[:64]!r} (the broker knows {', '.join(sorted(self.ops))})"
                )
            opName = op.name
            plan = op.validate(request, self.config)
            pids = await self._holders(key)
            if len(pids) != 1:
                raise _Refused(
                    f"request held by {len(pids)} processes of uid {self.uid}, want exactly one "
                    "(the requester must keep its request file open, and only it)"
                )
            origin = await self.inThread(procfs.origin, self.procDir, pids[0], op.originKeys(plan))
            self.stats.requesters["sandboxed" if origin.sandboxed else "host"] += 1
            reply = await self._perform(rid, op, plan, request, origin, key)
        except FileNotFoundError:
            return  # the requester gave up before we looked
        except _Dropped:
            self.stats.count(opName, "dropped")
            self._removeQuietly(rid, wire.REQ, wire.OUT)
            return
        except (_Refused, WireError, OpError) as e:
            reply = Reply(error=str(e))
        except CancelledError:
            raise
        except Exception as e:  # the broker never dies of a request
            log.failure("op {op} failed", op=opName)
            reply = Reply(error=f"the broker failed on this request: {type(e).__name__}: {e}")
        if self._stopping:
            return  # stopService answered it already
        self.stats.count(opName, "error" if reply.error is not None else "ok")
        if reply.error is not None:
            log.info("refused {op}: {why}", op=opName, why=reply.error)
        self._writeReplyQuietly(rid, reply)

    async def _perform(
        self,
        rid: str,
        op: Op,
        plan: Any,
        request: wire.Request,
        origin: procfs.Origin,
        key: procfs.FileKey,
    ) -> Reply:
        outFd = -1
        output: Callable[[bytes], None] | None = None
        if request.stream:
            outFd = os.open(
                self._path(rid, wire.OUT),
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                wire.FILE_MODE,
            )

            def output(data: bytes) -> None:
                view = memoryview(data)
                while view:
                    view = view[os.write(outFd, view) :]

        gone = {"yes": False}
        performing = op.perform(plan, Call(request=request, origin=origin, output=output), self.host)

        def check() -> Deferred[None]:
            d = self.inThread(procfs.holds, self.procDir, origin.pid, key[0], key[1])

            def seen(held: bool) -> None:
                if not held and not gone["yes"]:
                    gone["yes"] = True
                    performing.cancel()

            return d.addCallback(seen)

        watcher = task.LoopingCall(check)
        watcher.clock = self.clock
        watcher.start(self.holderInterval, now=False).addErrback(
            lambda f: log.failure("watching a requester", f)
        )
        try:
            try:
                reply = await performing
            except CancelledError:
                if gone["yes"]:
                    raise _Dropped() from None
                raise
            if gone["yes"] or not await self.inThread(
                procfs.holds, self.procDir, origin.pid, key[0], key[1]
            ):
                raise _Dropped()
            return reply
        finally:
            if watcher.running:
                watcher.stop()
            if outFd >= 0:
                os.close(outFd)

    def _holders(self, key: procfs.FileKey) -> Deferred[list[int]]:
        d: Deferred[list[int]] = Deferred()
        self._pending.setdefault(key, []).append(d)
        self._scan()
        return d

    def _scan(self) -> None:
        """One /proc pass answers every request waiting at the time it starts."""
        if self._scanning or not self._pending:
            return
        batch, self._pending = self._pending, {}
        self._scanning = True
        d = self.inThread(procfs.holdersOf, self.procDir, list(batch), self.uid)

        def done(found: dict[procfs.FileKey, list[int]]) -> None:
            for key, waiting in batch.items():
                for w in waiting:
                    w.callback(found.get(key, []))

        def failed(f: Any) -> None:
            for waiting in batch.values():
                for w in waiting:
                    w.errback(f)

        def again(_: Any) -> None:
            self._scanning = False
            self._scan()

        d.addCallbacks(done, failed).addBoth(again)

    # ------------------------------------------------------------------ replies

    def _writeReplyQuietly(self, rid: str, reply: Reply) -> None:
        try:
            writeReply(self.spool, rid, reply)
        except OSError as e:
            log.warn("cannot write the reply {rid}: {why}", rid=rid, why=e.strerror or str(e))

    def _removeQuietly(self, rid: str, *suffixes: str) -> None:
        for suffix in suffixes:
            with contextlib.suppress(OSError):
                os.unlink(self._path(rid, suffix))


# --------------------------------------------------------------------------- file work


def _policyChanged(old: Config, new: Config) -> bool:
    return new.sandbox != old.sandbox or new.paths != old.paths


def prepareSpool(directory: str, uid: int) -> None:
    """Create the spool 0700, or make sure an existing one is ours and private."""
    os.makedirs(directory, mode=wire.DIR_MODE, exist_ok=True)
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(errno.ENOTDIR, f"the spool {directory} is not a directory")
    if st.st_uid != uid:
        raise OSError(errno.EPERM, f"the spool {directory} belongs to uid {st.st_uid}, not {uid}")
    if stat.S_IMODE(st.st_mode) != wire.DIR_MODE:
        os.chmod(directory, wire.DIR_MODE)


def readRequest(path: str, uid: int) -> tuple[bytes, procfs.FileKey]:
    """The request's bytes and (dev, ino); _Refused for anything but our own plain file."""
    name = os.path.basename(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _Refused(f"refused {name}: it is a symlink") from None
        if e.errno == errno.ENXIO:
            raise _Refused(f"refused {name}: not a regular file") from None
        raise _Refused(f"refused {name}: cannot open it ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _Refused(f"refused {name}: not a regular file")
        if st.st_uid != uid:
            raise _Refused(f"refused {name}: owned by uid {st.st_uid}, not the broker's uid {uid}")
        if st.st_nlink != 1:
            raise _Refused(f"refused {name}: it has {st.st_nlink} links, want one")
        chunks: list[bytes] = []
        size = 0
        while size <= wire.REQUEST_LIMIT:
            chunk = os.read(fd, wire.REQUEST_LIMIT + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > wire.REQUEST_LIMIT:
            raise _Refused(f"request over {wire.REQUEST_LIMIT} bytes")
        return b"".join(chunks), (st.st_dev, st.st_ino)
    finally:
        os.close(fd)


def writeReply(spool: str, rid: str, reply: Reply) -> None:
    """Write aside and rename, so a reply that exists is whole; drop it if the requester left."""
    base = os.path.join(spool, rid)
    tmp = base + wire.REPLY_TMP
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(
        tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, wire.FILE_MODE
    )
    try:
        view = memoryview(reply.toJSON())
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    os.rename(tmp, base + wire.REPLY)
    if not os.path.lexists(base + wire.REQ):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(base + wire.REPLY)


def cleanLeftovers(spool: str, procDir: str, uid: int) -> int:
    """Remove the files of requests nobody holds any more (clients that crashed)."""
    ids: dict[str, list[str]] = {}
    try:
        names = os.listdir(spool)
    except OSError:
        return 0
    for name in names:
        parts = wire.splitName(name)
        if parts is not None:
            ids.setdefault(parts[0], []).append(name)
    keys: dict[procfs.FileKey, str] = {}
    for rid, files in ids.items():
        for suffix in (wire.REQ, wire.TMP):
            if rid + suffix in files:
                try:
                    st = os.lstat(os.path.join(spool, rid + suffix))
                except OSError:
                    continue
                keys[(st.st_dev, st.st_ino)] = rid
    held = {keys[k] for k, pids in procfs.holdersOf(procDir, keys, uid).items() if pids}
    removed = 0
    for rid, files in ids.items():
        if rid in held:
            continue
        for name in files:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(spool, name))
                removed += 1
    return removed


# --------------------------------------------------------------------------- command


def main(argv: list[str]) -> int:
    """``agentsandbox broker [--config FILE] [--poll SECONDS]``: just the broker, in the foreground."""
    from agentsandbox import cli

    parser = cli.parser(
        "broker",
        "Run only the host broker in the foreground (tests, debugging); "
        "`agentsandbox serve` runs the whole app.",
    )
    parser.add_argument(
        "--poll",
        type=float,
        metavar="SECONDS",
        help="no inotify: look at the spool every SECONDS (a baseline for benchmarks)",
    )
    args = parser.parse_args(argv)
    from agentsandbox.broker.client import inSandbox

    if inSandbox():
        print("agentsandbox broker: the broker runs on the host, not inside the sandbox", file=sys.stderr)
        return 2
    if args.poll is not None and args.poll <= 0:
        parser.error("--poll must be greater than zero")
    config = cli.loadConfig("broker", args.config)
    from twisted.internet import reactor
    from twisted.logger import globalLogBeginner, textFileLogObserver

    globalLogBeginner.beginLoggingTo([textFileLogObserver(sys.stderr)], redirectStandardIO=False)
    broker = BrokerService(
        config,
        reactor=reactor,
        watch=args.poll is None,
        rescanInterval=args.poll if args.poll is not None else 5.0,
    )
    try:
        broker.startService()
    except OSError as e:
        print(f"agentsandbox broker: {e.strerror or e}", file=sys.stderr)
        return 1
    reactor.addSystemEventTrigger("before", "shutdown", broker.stopService)
    broker.ready.addCallback(lambda _: print(f"serving {broker.spool}", flush=True))
    reactor.run()
    return 0
