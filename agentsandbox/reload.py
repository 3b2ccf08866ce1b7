"""Live config: a holder of the current config, and a service that reloads it.

This is the one reload path.  The watcher is the holder's only writer; every
child of the service is handed the same holder and follows it itself: one that
keeps derived state subscribes (the injection service, the broker's policy, the
restart notice, the proxy's endpoint warning), one that decides per connection
reads ``holder.current`` (the proxy, once per connection, so a reload changes
the allow list and limits for new connections while open tunnels keep what
they were granted).  Nobody pushes a config into a child.  The watcher reloads on
inotify events for the user's and the machine's config files (one appearing or
going included) and on SIGHUP, and each reload finds the files again.  A broken file keeps the old
config and logs the error with the file and the key (``ConfigError`` says
both).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from twisted.application.service import Service
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.filepath import FilePath

from agentsandbox.config import Config, ConfigError

Listener = Callable[[Config, Config], None]


class ConfigHolder:
    """The config in force now; ``swap`` replaces it and tells the listeners (old, new)."""

    def __init__(self, config: Config) -> None:
        self.current = config
        self._listeners: list[Listener] = []

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def unsubscribe(self, listener: Listener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def swap(self, config: Config) -> None:
        old, self.current = self.current, config
        for listener in list(self._listeners):
            listener(old, config)


def asHolder(config: Config | ConfigHolder) -> ConfigHolder:
    return config if isinstance(config, ConfigHolder) else ConfigHolder(config)


# inotify masks (linux/inotify.h); the watcher watches the directory because
# editors and config managers replace the file by rename.
_IN_CLOSE_WRITE = 0x00000008
_IN_MOVED_TO = 0x00000080
_IN_CREATE = 0x00000100
_IN_DELETE = 0x00000200
_IN_MOVED_FROM = 0x00000040
_MASK = _IN_CLOSE_WRITE | _IN_MOVED_TO | _IN_CREATE | _IN_DELETE | _IN_MOVED_FROM


class ConfigWatcher(Service):
    """Reloads ``holder`` on inotify events for any of ``paths`` and on SIGHUP.

    ``paths`` are the files the config is made of, present or not (the user's
    and the machine's: a file that appears or goes is followed too); each
    reload runs ``loader``, which discovers the files again (default
    ``loader.load()``).  Events are coalesced over ``settle`` seconds of
    ``clock`` (default: ``reactor``, which also reads inotify and hears the
    signal), so an editor's write-then-rename reloads once, and a test
    advances a ``task.Clock`` instead of waiting.  ``unwatched`` says which
    files a change of would go unnoticed until SIGHUP, and why.
    """

    log = Logger(namespace="agentsandbox.reload")

    def __init__(
        self,
        holder: ConfigHolder,
        paths: str | Sequence[str] | None,
        reactor: Any,
        loader: Callable[[], Config] | None = None,
        settle: float = 0.2,
        handleSignal: bool = True,
        clock: IReactorTime | None = None,
    ) -> None:
        self.holder = holder
        self.paths: tuple[str, ...] = (
            () if paths is None else (paths,) if isinstance(paths, str) else tuple(paths)
        )
        self.reactor = reactor
        self.clock: IReactorTime = clock if clock is not None else reactor
        self.settle = settle
        self.handleSignal = handleSignal
        self._loader = loader or self._discover
        self._pending: IDelayedCall | None = None
        self._notifier: Any = None
        self._oldHandler: Any = None
        #: Each watched directory's file names that matter.
        self._names: dict[str, set[str]] = {}
        #: File -> why a change of it is not seen until SIGHUP.
        self.unwatched: dict[str, str] = {}
        self.reloads = 0
        self.failures = 0

    @property
    def path(self) -> str | None:
        """The first file watched (the user's), for the messages that name one."""
        return self.paths[0] if self.paths else None

    def _discover(self) -> Config:
        from agentsandbox.loader import load

        return load(None)

    def startService(self) -> None:
        super().startService()
        if self.paths:
            self._watch(self.paths)
        if self.handleSignal:
            self._oldHandler = signal.signal(signal.SIGHUP, self._onSignal)
        self.log.info("serving the config from {served}", served=self.holder.current.served)

    def stopService(self) -> None:
        if self._pending is not None and self._pending.active():
            self._pending.cancel()
        self._pending = None
        if self._notifier is not None:
            self._notifier.loseConnection()
            self._notifier = None
        if self.handleSignal and self._oldHandler is not None:
            signal.signal(signal.SIGHUP, self._oldHandler)
            self._oldHandler = None
        return super().stopService()  # type: ignore[no-any-return]

    def _watch(self, paths: Sequence[str]) -> None:
        try:
            from twisted.internet import inotify
        except ImportError:
            self.unwatched = {p: "no inotify here: SIGHUP reloads" for p in paths}
            self.log.warn("no inotify here: the config reloads on SIGHUP only")
            return
        try:
            notifier = inotify.INotify(reactor=self.reactor)
            notifier.startReading()
        except Exception as e:  # inotify limits: SIGHUP still works
            self.unwatched = {p: f"inotify: {e}; SIGHUP reloads" for p in paths}
            self.log.warn("not watching the config ({why}): it reloads on SIGHUP only", why=e)
            return
        self._notifier = notifier
        for path in paths:
            directory = os.path.dirname(os.path.abspath(path))
            if directory not in self._names:
                try:
                    notifier.watch(FilePath(directory), mask=_MASK, callbacks=[self._onEvent])
                except Exception as e:  # a missing directory: SIGHUP still works
                    self.unwatched[path] = f"cannot watch {directory} ({e}); SIGHUP reloads"
                    self.log.warn("not watching {dir} ({why}): a change of {file} is read on SIGHUP",
                                  dir=directory, why=e, file=path)
                    continue
                self._names[directory] = set()
            self._names[directory].add(os.path.basename(path))

    def _onEvent(self, _ignored: object, filepath: FilePath[Any], mask: int) -> None:
        # Twisted reports the path as bytes whatever we watched with.
        name = os.fsdecode(filepath.basename())
        directory = os.fsdecode(filepath.dirname())
        if name in self._names.get(directory, ()):
            self.schedule()

    def _onSignal(self, signum: int, frame: FrameType | None) -> None:
        self.reactor.callFromThread(self.reload, "SIGHUP")

    def schedule(self) -> None:
        """Reload after ``settle`` seconds, once however many events arrive meanwhile."""
        if self._pending is not None and self._pending.active():
            self._pending.reset(self.settle)
            return
        self._pending = self.clock.callLater(self.settle, self.reload, "change of the file")

    def reload(self, why: str = "request") -> bool:
        """Load the config now; keep the old one when the new one is broken."""
        self._pending = None
        try:
            config = self._loader()
        except ConfigError as e:
            self.failures += 1
            self.log.error(
                "config reload after {why} failed, keeping the previous config: {error}",
                why=why,
                error=str(e),
                file=e.source,
                key=e.key,
            )
            return False
        except Exception as e:  # a loader bug must not take the proxy down
            self.failures += 1
            self.log.failure("config reload after {why} failed, keeping the previous config", why=why)
            del e
            return False
        self.reloads += 1
        self.holder.swap(config)
        self.log.info("config reloaded after {why} from {served}", why=why, served=config.served)
        for notice in config.notices:
            self.log.warn("not granted: {notice}", notice=notice)
        return True

    def figures(self) -> dict[str, Any]:
        """For ``status``: which files make the config, what is watched, what the machine left out."""
        current = self.holder.current
        return {
            "served": current.served,
            "watching": sorted(p for p in self.paths if p not in self.unwatched),
            "unwatched": dict(self.unwatched),
            "notices": list(current.notices),
            "reloads": self.reloads,
            "failures": self.failures,
        }


