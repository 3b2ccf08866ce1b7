"""One event, many waiters: ``OneShotObserver``.

The service's "the proxy listens (or cannot)" and an upstream leg's "lost" are
each one event that any number of callers wait for, before or after it happens.
Each caller gets its own Deferred (a Deferred shared between callers would hand
the second one whatever the first one's callbacks returned), and one that asks
after the event gets the result at once.

Twisted has no public one: ``twisted.internet.defer`` (22.4 and 26.10) offers
``DeferredLock``, ``DeferredSemaphore``, ``DeferredQueue`` and ``race``, and the
waiter lists inside it and ``twisted.web._newclient`` are private.  This is
magic-wormhole's ``OneShotObserver``, typed, and fired with a value or a Failure.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from twisted.internet.defer import AlreadyCalledError, Deferred, fail, succeed
from twisted.python.failure import Failure

T = TypeVar("T")


class OneShotObserver(Generic[T]):
    """Fires every waiter once with one result; later waiters get it at once."""

    def __init__(self) -> None:
        self._waiters: list[Deferred[T]] = []
        self._fired = False
        self._result: T | Failure | None = None

    @property
    def fired(self) -> bool:
        return self._fired

    def whenFired(self) -> Deferred[T]:
        """A new Deferred: the result once fired (at once if it already was)."""
        if not self._fired:
            d: Deferred[T] = Deferred()
            self._waiters.append(d)
            return d
        result = self._result
        if isinstance(result, Failure):
            return fail(result)
        return succeed(result)  # type: ignore[arg-type]  # fired: it is a T

    def fire(self, result: T | Failure) -> None:
        """Fires the waiters with ``result`` (a Failure errbacks them); only once."""
        if self._fired:
            raise AlreadyCalledError(f"{self!r} fired already")
        self._fired = True
        self._result = result
        # A waiter's callback that asks again is answered at once, not queued
        # on the list being emptied.
        waiters, self._waiters = self._waiters, []
        for d in waiters:
            if isinstance(result, Failure):
                d.errback(result)
            else:
                d.callback(result)
