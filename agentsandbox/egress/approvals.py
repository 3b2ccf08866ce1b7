"""The service's registry of requests held for a person's answer (issue 28).

Under ``proxy.unlisted = "ask"`` the door hands a request for an unlisted host
here (``ask``) before anything is resolved or dialled, and gets a Deferred
that fires with an ``Outcome`` once the person answers, the request times
out (``proxy.ask_timeout``) or it cannot be held at all (``proxy.max_held``).
Everything else is plain state driven by calls and the injected clock, so the
tests drive it with a ``task.Clock`` and no sockets:

- ``answer(target, Answer)``: a request id, or a host (every request held for
  it, and with ``for``/``always`` the ones that follow);
- answers remembered: ``for`` until a time on the clock or until the service
  stops; ``always`` written into the user's own config (``configedit``) and
  remembered until then, since the watcher follows the file a moment later;
- every held request, answer and timeout is an audit record naming who
  answered (``Answer.by``: the channel and the answering process), how, and
  for how long; subscribers get the wire's event dicts (``approvals.py``).

Where answers come from is not this module's business: the control socket
(``egress/control.py``) checks who is asking before it calls ``answer``.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from agentsandbox.allowlist import EntryError, canonicalHost, suggestEntry
from agentsandbox.approvals import (
    Answer,
    HeldRequest,
    decidedEvent,
    describeAnswer,
    heldEvent,
    observedEvent,
    timedoutEvent,
    withdrawnEvent,
)
from agentsandbox.config import Config
from agentsandbox.configedit import addEntry, userFileFor
from agentsandbox.loader import loads

#: How many decided requests ``list`` shows.
RECENT = 50

Observer = Callable[[dict[str, Any]], None]
#: Writes an always-answer: (key, entry) -> the file written.  Raises with words.
Writer = Callable[[str, str], str]


@dataclass(frozen=True, slots=True)
class Outcome:
    """What became of an asked request: let through, or refused with words for the agent."""

    allowed: bool
    #: allowed | denied | timedout | full | remembered
    how: str
    #: The refusal's words (the 403 body, the audit record's reason); "" when allowed.
    text: str = ""


@dataclass
class _Held:
    request: HeldRequest
    deferred: Deferred[Outcome]
    timer: IDelayedCall | None


def refusedText(host: str, port: int, by: str, how: str) -> str:
    entry = suggestEntry(host, port)
    return (
        f"{host}:{port} is not on sandbox.domains and the person refused it "
        f"({how}, by {by or 'the person'}; proxy.unlisted = \"ask\"). To allow it they can run "
        f"`agentsandbox approve {host}` while a request waits, or add {entry!r} to sandbox.domains"
    )


def timedoutText(host: str, port: int, timeout: float) -> str:
    entry = suggestEntry(host, port)
    return (
        f"{host}:{port} is not on sandbox.domains; it was held for the person's answer "
        f"(proxy.unlisted = \"ask\") but nobody answered within proxy.ask_timeout ({timeout:g}s). "
        f"Next time the person can answer while it waits: `agentsandbox approvals`, then "
        f"`agentsandbox approve {host}` (or add {entry!r} to sandbox.domains)"
    )


def fullText(host: str, port: int, held: int) -> str:
    entry = suggestEntry(host, port)
    return (
        f"{host}:{port} is not on sandbox.domains and {held} requests already wait for the "
        f"person's answer, the most proxy.max_held allows, so it was refused without asking. "
        f"The person can answer the waiting ones (`agentsandbox approvals`) or add {entry!r} "
        "to sandbox.domains"
    )


def configWriter(config: Callable[[], Config]) -> Writer:
    """Writes an always-answer into the user's own file of the config in force."""

    def write(key: str, entry: str) -> str:
        current = config()
        path = userFileFor(current.source, current.machine, current.paths.userConfig)
        seed = current.sandbox.domains if key == "domains" else current.sandbox.refused_domains
        addEntry(path, "sandbox", key, entry, seed, lambda text: loads(text.encode(), path, current.paths))
        return path

    return write


class ApprovalRegistry:
    """Requests held for a person's answer, and the answers remembered."""

    log = Logger(namespace="agentsandbox.approvals")

    def __init__(
        self,
        config: Callable[[], Config],
        clock: IReactorTime,
        record: Callable[..., Any] | None = None,
        writer: Writer | None = None,
    ) -> None:
        self._config = config
        self.clock = clock
        self._record = record
        self._writer = writer
        self._ids: Iterator[int] = itertools.count(1)
        self._held: dict[str, _Held] = {}
        #: host -> (verdict, until: clock seconds or None for "until the service stops")
        self._remembered: dict[str, tuple[str, float | None]] = {}
        self._recent: deque[dict[str, Any]] = deque(maxlen=RECENT)
        self._observers: list[Observer] = []

    # ------------------------------------------------------------ subscribers
    def subscribe(self, observer: Observer) -> None:
        self._observers.append(observer)

    def unsubscribe(self, observer: Observer) -> None:
        if observer in self._observers:
            self._observers.remove(observer)

    def _tell(self, event: dict[str, Any]) -> None:
        for observer in list(self._observers):
            try:
                observer(event)
            except Exception:
                self.log.failure("an approvals subscriber failed on {event}", event=event["event"])

    def _audit(self, event: str, request: HeldRequest, **fields: Any) -> None:
        if self._record is not None:
            self._record(
                event, id=request.id, kind=request.kind, client=request.client,
                host=request.host, port=request.port, **fields,
            )

    # ------------------------------------------------------------ the door's side
    @property
    def held(self) -> list[HeldRequest]:
        return [h.request for h in self._held.values()]

    def remembered(self, host: str) -> str | None:
        """``allow`` or ``deny`` when an earlier answer for ``host`` still holds."""
        found = self._remembered.get(host)
        if found is None:
            return None
        verdict, until = found
        if until is not None and self.clock.seconds() >= until:
            del self._remembered[host]
            return None
        return verdict

    def ask(self, host: str, port: int, kind: str, client: str, process: str | None = None) -> Deferred[Outcome]:
        """Hold ``host:port`` until the person answers; the Deferred fires with the Outcome.

        Cancelling it (the client went away) withdraws the request.
        """
        config = self._config()
        remembered = self.remembered(host)
        if remembered == "allow":
            return succeed(Outcome(True, "remembered"))
        if remembered == "deny":
            return succeed(Outcome(False, "remembered", refusedText(host, port, "an earlier answer", "deny for a while")))
        if len(self._held) >= config.proxy.max_held:
            return succeed(Outcome(False, "full", fullText(host, port, len(self._held))))
        request = HeldRequest(
            id=str(next(self._ids)), host=host, port=port, kind=kind, client=client,
            process=process, since=self.clock.seconds(),
        )
        d: Deferred[Outcome] = Deferred(lambda _: self._withdraw(request.id))
        timeout = config.proxy.ask_timeout
        held = _Held(request, d, None)
        self._held[request.id] = held
        held.timer = self.clock.callLater(timeout, self._timedOut, request.id, timeout)
        self._audit("held", request, reason=f"held for the person's answer (up to {timeout:g}s, proxy.ask_timeout)")
        self._tell(heldEvent(request))
        return d

    def _withdraw(self, id: str) -> None:
        held = self._held.pop(id, None)
        if held is None:
            return
        if held.timer is not None and held.timer.active():
            held.timer.cancel()
        # The held record gets its end: nobody answered, nobody needs to.
        self._audit("withdrawn", held.request, reason="the client went away before the person answered")
        self._tell(withdrawnEvent(held.request))

    def _timedOut(self, id: str, timeout: float) -> None:
        held = self._held.pop(id, None)
        if held is None:
            return
        request = held.request
        text = timedoutText(request.host, request.port, timeout)
        self._recent.append(
            {"request": request.toWire(), "answer": None, "outcome": "timedout", "at": self.clock.seconds()}
        )
        self._audit("timedout", request, reason=text)
        self._tell(timedoutEvent(request))
        held.deferred.callback(Outcome(False, "timedout", text))

    # ------------------------------------------------------------ the person's side
    def answer(self, target: str, answer: Answer) -> list[str]:
        """Answer a held request by id, or every one held for a host; the ids answered.

        A host target with ``for`` or ``always`` also decides the requests that
        follow, and is taken even when nothing is held.  Raises ValueError with
        words for the person when nothing matches or the config cannot be written.
        """
        byId = self._held.get(target)
        if byId is not None:
            host = byId.request.host
            matched = [byId]
        elif target.isdigit():
            raise ValueError(f"no request {target} is waiting (`agentsandbox approvals` lists them)")
        else:
            try:
                host = canonicalHost(target)
            except EntryError:
                raise ValueError(f"{target!r} is neither a waiting request's id nor a host name") from None
            matched = [h for h in self._held.values() if h.request.host == host]
            if byId is None and answer.scope == "once" and not matched:
                raise ValueError(
                    f"no request for {host} is waiting (`agentsandbox approvals` lists them); "
                    "--for DURATION or --always decide the requests that follow too"
                )
        if answer.scope == "always":
            self._writeAlways(host, answer, [h.request.port for h in matched])
        if answer.scope in ("for", "always"):
            seconds = answer.seconds if answer.scope == "for" else None
            until = None if seconds is None else self.clock.seconds() + seconds
            self._remembered[host] = (answer.verdict, until)
        if not matched:
            self.log.info("approvals: {how} for {host} by {by}", how=describeAnswer(answer), host=host, by=answer.by)
        for held in matched:
            self._decide(held, answer)
        return [h.request.id for h in matched]

    def _writeAlways(self, host: str, answer: Answer, ports: list[int]) -> None:
        if self._writer is None:
            raise ValueError("this service cannot write your config, so --always is not available; use --for")
        key = "domains" if answer.verdict == "allow" else "refused_domains"
        entries = sorted({suggestEntry(host, p) for p in ports}) if ports else [host]
        if answer.verdict == "deny":
            entries = [host]  # refused on every port: the person named the host
        for entry in entries:
            try:
                self._writer(key, entry)
            except Exception as e:
                raise ValueError(f"sandbox.{key} was not written, so nothing was answered: {e}") from None

    def _decide(self, held: _Held, answer: Answer) -> None:
        self._held.pop(held.request.id, None)
        if held.timer is not None and held.timer.active():
            held.timer.cancel()
        request = held.request
        allowed = answer.verdict == "allow"
        how = describeAnswer(answer)
        text = "" if allowed else refusedText(request.host, request.port, answer.by, how)
        self._recent.append(
            {
                "request": request.toWire(),
                "answer": answer.toWire(),
                "outcome": "allowed" if allowed else "denied",
                "at": self.clock.seconds(),
            }
        )
        self._audit(
            "decided", request, by=answer.by, verdict=answer.verdict, scope=answer.scope,
            seconds=answer.seconds, reason=text or f"allowed by the person ({how}, by {answer.by})",
        )
        self._tell(decidedEvent(request, answer))
        held.deferred.callback(Outcome(allowed, "allowed" if allowed else "denied", text))

    def observed(self, host: str, port: int, kind: str) -> None:
        """Observe mode let an unlisted host through: ``watch`` shows it (the door audits it)."""
        self._tell(observedEvent(host, port, kind))

    def snapshot(self) -> dict[str, Any]:
        """The ``list`` reply's body."""
        return {
            "ok": True,
            "mode": self._config().proxy.unlisted,
            "held": [h.request.toWire() for h in self._held.values()],
            "recent": list(self._recent),
        }

    def stop(self) -> None:
        """The service stops: held requests are refused, and what was remembered
        ``for`` the service's life goes with it."""
        for held in list(self._held.values()):
            self._held.pop(held.request.id, None)
            if held.timer is not None and held.timer.active():
                held.timer.cancel()
            request = held.request
            text = (
                f"{request.host}:{request.port} is not on sandbox.domains and the agentsandbox "
                "service stopped before anyone answered; ask again once it runs"
            )
            self._audit("timedout", request, reason=text)
            self._tell(timedoutEvent(request))
            held.deferred.callback(Outcome(False, "stopped", text))
        self._remembered.clear()
