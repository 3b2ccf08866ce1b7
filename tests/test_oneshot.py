"""``OneShotObserver``: one result for every waiter, before or after it fires."""

from __future__ import annotations

from typing import Any

import pytest
from twisted.internet.defer import AlreadyCalledError, Deferred
from twisted.python.failure import Failure

from agentsandbox.oneshot import OneShotObserver


def results(d: Deferred[Any]) -> list[object]:
    seen: list[object] = []
    d.addBoth(seen.append)
    return seen


def test_every_waiter_gets_the_result_once() -> None:
    observer: OneShotObserver[str] = OneShotObserver()
    first, second = results(observer.whenFired()), results(observer.whenFired())
    assert (first, second, observer.fired) == ([], [], False)
    observer.fire("port")
    assert (first, second, observer.fired) == (["port"], ["port"], True)


def test_a_later_waiter_gets_the_result_at_once() -> None:
    observer: OneShotObserver[str] = OneShotObserver()
    observer.fire("port")
    assert results(observer.whenFired()) == ["port"]
    assert results(observer.whenFired()) == ["port"]


def test_each_waiter_has_its_own_deferred() -> None:
    # One waiter's callbacks change only its own result.
    observer: OneShotObserver[int] = OneShotObserver()
    changed = observer.whenFired().addCallback(lambda n: n + 1)
    plain = observer.whenFired()
    observer.fire(1)
    assert (results(changed), results(plain), results(observer.whenFired())) == ([2], [1], [1])


def test_a_failure_errbacks_every_waiter_and_later_ones() -> None:
    observer: OneShotObserver[str] = OneShotObserver()
    before = results(observer.whenFired())
    observer.fire(Failure(OSError("address in use")))
    after = results(observer.whenFired())
    for seen in (before, after):
        [failure] = seen
        assert isinstance(failure, Failure)
        assert failure.getErrorMessage() == "address in use"


def test_a_waiter_that_asks_again_while_firing_is_answered() -> None:
    observer: OneShotObserver[str] = OneShotObserver()
    again: list[object] = []
    observer.whenFired().addCallback(lambda _: again.extend(results(observer.whenFired())))
    observer.fire("port")
    assert again == ["port"]


def test_it_fires_once() -> None:
    observer: OneShotObserver[None] = OneShotObserver()
    observer.fire(None)
    with pytest.raises(AlreadyCalledError):
        observer.fire(None)
