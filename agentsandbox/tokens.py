"""The keepers that renew a token for the terminating proxy, one per token source.

A keeper fetches its token at start and every ``renew`` seconds after that,
from one of the sources ``agentsandbox.config`` defines (those values, and the
``describe()``/``fix()`` texts naming them, live there): a command (``gh auth
token`` by default), a file, or the service's own environment.  A failed fetch
keeps the token it has and retries sooner, with a doubling backoff capped at
the renewal period, so a flaky ``gh`` never leaves the proxy without a token it
already held.

The token goes nowhere but into memory: never into a log line, an error, an
argv, or a child's environment.  Errors say what failed and are scrubbed of
the token and of whatever the source printed.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from twisted.application.service import MultiService, Service
from twisted.internet import error as ierror
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import (
    IDelayedCall,
    IProcessTransport,
    IReactorProcess,
    IReactorTime,
)
from twisted.internet.protocol import ProcessProtocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from agentsandbox.config import CommandSource, EnvSource, FileSource, InjectRule, TokenSource
from agentsandbox.egress.interfaces import ITokenHolder

#: What a source may print: a header value must never carry CR, LF or spaces.
_TOKEN = re.compile(r"[\x21-\x7e]{1,8192}")
MAX_OUTPUT = 64 * 1024
FIRST_BACKOFF = 5.0

log = Logger(namespace="agentsandbox.tokens")


class TokenError(Exception):
    """A fetch that gave no token; the message never holds a token."""


@dataclass(frozen=True)
class TokenStatus:
    """What ``agentsandbox status`` shows for one keeper (never the token)."""

    source: str
    hosts: tuple[str, ...]
    present: bool
    age: float | None
    lastError: str | None
    failures: int
    nextAttempt: float | None

    def describe(self) -> str:
        hosts = ", ".join(self.hosts) or "no host"
        if self.present and self.age is not None:
            state = f"token present, fetched {_duration(self.age)} ago"
        else:
            state = "no token yet"
        parts = [f"{hosts} ({self.source}): {state}"]
        if self.lastError:
            parts.append(f"last error after {self.failures} failure(s): {self.lastError}")
        if self.nextAttempt is not None:
            parts.append(f"next fetch in {_duration(self.nextAttempt)}")
        return "; ".join(parts)


def _duration(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def checkToken(raw: bytes, what: str) -> str:
    """The token in a source's output, or TokenError saying why (without it)."""
    text = raw.strip()
    if not text:
        raise TokenError(f"{what} gave no token (empty output)")
    try:
        token = text.decode("ascii")
    except UnicodeDecodeError:
        raise TokenError(f"{what} gave {len(text)} bytes that are not ASCII, so no token") from None
    if not _TOKEN.fullmatch(token):
        raise TokenError(
            f"{what} gave {len(text)} bytes with spaces or control characters, so no token"
        )
    return token


class _CommandProtocol(ProcessProtocol):
    def __init__(self, done: Deferred[tuple[bytes, bytes, Failure]]) -> None:
        self._done = done
        self._out = bytearray()
        self._err = bytearray()

    def outReceived(self, data: bytes) -> None:
        if len(self._out) < MAX_OUTPUT:
            self._out += data[: MAX_OUTPUT - len(self._out)]

    def errReceived(self, data: bytes) -> None:
        if len(self._err) < MAX_OUTPUT:
            self._err += data[: MAX_OUTPUT - len(self._err)]

    def processEnded(self, reason: Failure) -> None:
        self._done.callback((bytes(self._out), bytes(self._err), reason))


@implementer(ITokenHolder)
class TokenKeeper(Service):
    """Keeps one source's token fresh.  A ``Service``: add it to the app's MultiService.

    ``reactor`` spawns the command; ``clock`` (the reactor unless given) times
    renewal, backoff and the command's bound, so tests drive time with a
    ``Clock`` while the process is real.
    """

    def __init__(
        self,
        source: TokenSource,
        reactor: IReactorProcess,
        clock: IReactorTime | None = None,
        environ: Mapping[str, str] | None = None,
        hosts: tuple[str, ...] = (),
        firstBackoff: float = FIRST_BACKOFF,
    ) -> None:
        self.source = source
        self.hosts = hosts
        self.name = "token " + (", ".join(hosts) or source.describe())
        self._reactor = reactor
        self._clock: IReactorTime = clock if clock is not None else reactor  # type: ignore[assignment]
        self._environ = dict(os.environ if environ is None else environ)
        self._firstBackoff = firstBackoff
        self._token: str | None = None
        self._fetchedAt: float | None = None
        self._lastError: str | None = None
        self._failures = 0
        self._timer: IDelayedCall | None = None
        self._running: Deferred[None] | None = None
        self._process: IProcessTransport | None = None

    # ------------------------------------------------------------------ reading

    def token(self) -> str | None:
        """The current token, or None before the first successful fetch."""
        return self._token

    def status(self) -> TokenStatus:
        now = self._clock.seconds()
        nextAttempt = None
        if self._timer is not None and self._timer.active():
            nextAttempt = max(0.0, self._timer.getTime() - now)
        return TokenStatus(
            source=self.source.describe(),
            hosts=self.hosts,
            present=self._token is not None,
            age=None if self._fetchedAt is None else now - self._fetchedAt,
            lastError=self._lastError,
            failures=self._failures,
            nextAttempt=nextAttempt,
        )

    # ------------------------------------------------------------------ service

    def startService(self) -> None:
        super().startService()
        self._schedule(0)

    def stopService(self) -> Deferred[None] | None:
        super().stopService()
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        if self._process is not None:
            self._kill()
        return None

    def refresh(self) -> Deferred[None]:
        """Fetch now (unless a fetch is running); fires when that fetch ends."""
        if self._running is not None:
            waiter: Deferred[None] = Deferred()
            self._running.addBoth(self._notify, waiter)
            return waiter
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        running = self._running = Deferred()
        self._fetch().addCallbacks(self._succeeded, self._failed).addBoth(self._finished)
        return running

    @staticmethod
    def _notify(result: object, waiter: Deferred[None]) -> object:
        waiter.callback(None)
        return result

    def _schedule(self, delay: float) -> None:
        if not self.running:
            return
        self._timer = self._clock.callLater(delay, self.refresh)

    def _succeeded(self, token: str) -> None:
        changed = token != self._token
        self._token = token
        self._fetchedAt = self._clock.seconds()
        if self._failures or changed:
            log.info("{name}: token {how}", name=self.name, how="renewed" if changed else "fetched again")
        self._failures = 0
        self._lastError = None
        self._schedule(self.source.renew)

    def _failed(self, failure: Failure) -> None:
        why = failure.getErrorMessage() if failure.check(TokenError) else _describe(failure)
        self._lastError = self._scrub(why)
        self._failures += 1
        delay = min(self.source.renew, self._firstBackoff * 2 ** (self._failures - 1))
        if self._token is None:
            kept = "no token yet, so requests go out without one"
        else:
            kept = f"keeping the token fetched {_duration(self._clock.seconds() - (self._fetchedAt or 0))} ago"
        log.warn(
            "{name}: not renewed ({why}); {kept}; retrying in {delay}",
            name=self.name,
            why=self._lastError,
            kept=kept,
            delay=_duration(delay),
        )
        self._schedule(delay)

    def _finished(self, _: object) -> None:
        running, self._running = self._running, None
        if running is not None:
            running.callback(None)

    def _scrub(self, text: str) -> str:
        if self._token:
            text = text.replace(self._token, "[token]")
        return text[:300]

    # ------------------------------------------------------------------ sources

    def _fetch(self) -> Deferred[str]:
        try:
            match self.source:
                case CommandSource() as command:
                    return self._runCommand(command)
                case FileSource() as file:
                    return _succeed(self._readFile(file))
                case EnvSource() as variable:
                    return _succeed(self._readEnviron(variable))
        except TokenError as e:
            d: Deferred[str] = Deferred()
            d.errback(Failure(e))
            return d

    def _readFile(self, source: FileSource) -> str:
        what = source.describe()
        try:
            with open(source.file, "rb") as f:
                raw = f.read(MAX_OUTPUT + 1)
        except OSError as e:
            raise TokenError(f"cannot read {what}: {e.strerror or e}") from None
        if len(raw) > MAX_OUTPUT:
            raise TokenError(f"{what} is larger than {MAX_OUTPUT} bytes, so no token")
        return checkToken(raw, what)

    def _readEnviron(self, source: EnvSource) -> str:
        what = source.describe()
        value = self._environ.get(source.env)
        if value is None:
            raise TokenError(f"{what} is not set in the service's environment")
        return checkToken(value.encode("utf-8", "replace"), what)

    def _runCommand(self, source: CommandSource) -> Deferred[str]:
        argv = source.command
        what = source.describe()
        program = argv[0]
        if os.sep not in program:
            found = shutil.which(program, path=self._environ.get("PATH", os.defpath))
            if found is None:
                raise TokenError(f"{what}: {program} is not on the service's PATH")
            program = found
        done: Deferred[tuple[bytes, bytes, Failure]] = Deferred()
        try:
            self._process = self._reactor.spawnProcess(
                _CommandProtocol(done), program, list(argv), env=self._environ, path=None
            )
        except OSError as e:
            raise TokenError(f"{what}: cannot start ({e.strerror or e})") from None
        timedOut: list[bool] = []

        def expire() -> None:
            timedOut.append(True)
            self._kill()

        bound = self._clock.callLater(source.timeout, expire)

        def ended(result: tuple[bytes, bytes, Failure]) -> str:
            self._process = None
            if bound.active():
                bound.cancel()
            out, err, reason = result
            if timedOut:
                raise TokenError(f"{what} took longer than {_duration(source.timeout)} and was killed")
            if not reason.check(ierror.ProcessDone):
                code = getattr(reason.value, "exitCode", None)
                sig = getattr(reason.value, "signal", None)
                how = f"exited {code}" if code is not None else f"died of signal {sig}"
                detail = _firstLine(err, out)
                raise TokenError(f"{what} {how}" + (f": {detail}" if detail else ""))
            return checkToken(out, what)

        return done.addCallback(ended)

    def _kill(self) -> None:
        process = self._process
        if process is None:
            return
        try:
            process.signalProcess("KILL")
        except ierror.ProcessExitedAlready:
            pass
        except OSError:  # pragma: no cover - the process vanished between checks
            os.kill(process.pid or 0, signal.SIGKILL) if process.pid else None


def _succeed(value: str) -> Deferred[str]:
    d: Deferred[str] = Deferred()
    d.callback(value)
    return d


def _firstLine(err: bytes, out: bytes) -> str:
    """The first line of stderr, as a hint; stdout is never quoted (it may be a token)."""
    for line in err.decode("utf-8", "replace").splitlines():
        if line.strip():
            return line.strip()[:200]
    return ""


def _describe(failure: Failure) -> str:
    return f"{type(failure.value).__name__}: {failure.getErrorMessage()}"


class TokenKeepers(MultiService):
    """One keeper per distinct token source of a set of inject rules.

    The built-in GitHub rules share one ``gh auth token``, so GitHub's three
    hosts share one keeper and one command.
    """

    def __init__(
        self,
        rules: tuple[InjectRule, ...],
        reactor: IReactorProcess,
        clock: IReactorTime | None = None,
        environ: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        self.setName("tokens")
        hostsBySource: dict[TokenSource, list[str]] = {}
        for rule in rules:
            hostsBySource.setdefault(rule.token, []).extend(rule.hosts)
        self._bySource: dict[TokenSource, TokenKeeper] = {}
        for source, hosts in hostsBySource.items():
            keeper = TokenKeeper(source, reactor, clock, environ, hosts=tuple(hosts), **kwargs)
            keeper.setServiceParent(self)
            self._bySource[source] = keeper

    def keeperFor(self, source: TokenSource) -> TokenKeeper:
        return self._bySource[source]

    def statuses(self) -> list[TokenStatus]:
        return [k.status() for k in self._bySource.values()]
