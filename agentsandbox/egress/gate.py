"""The gate: may a connection to ``host:port`` go, and where.  Sans IO.

One object owns the whole decision the front door used to share with the
factory, ``resolve.py`` and ``check host``, in this order:

1. **the name** against ``sandbox.domains`` (``allowlist.decideHost``), no DNS;
   a refusal here names the entry that would allow it;
2. **a tunnel slot** (``proxy.max_tunnels``), when the caller asks for one;
3. **the addresses**: an IP literal is its own address; a name is resolved
   once, by the caller, and every answer classified (``rules.decideAddress``):
   refused ranges pass only through CIDR/IP entries.  A name that does not
   resolve goes to ``proxy.parent`` on the name rule alone when one is set
   (names only the organisation's resolver knows), else it is refused.

The gate never does IO and never raises for a refusal: ``decide`` returns a
``Step``, which is a finished ``Verdict`` (``Grant | Refusal``) or a
``Resolve`` meaning "resolve this name, then hand me the addresses
(``resolved``) or the resolver's error (``unresolved``)".  So the only Deferred
left is the resolver's, held by the front door; ``check host`` resolves
synchronously (``decideResolving``) and reads the same values, so the two
cannot decide or word differently.

Issue 28 adds a third verdict, ``Ask``, at step 1: under ``proxy.unlisted =
"ask"`` a name that is merely not listed (a host name on a TCP port, with no
entry for it, not on ``sandbox.refused_domains``, not a literal address the
address rules refuse anyway) is not refused but returned as ``Ask``, before
any DNS.  The door holds it for the person (``egress/approvals.py``); on an
allow it hands the ``Ask`` back to ``approved``, which takes steps 2 and 3 as
for a listed name: the address rules are never asked.  ``sandbox.refused_domains``
is read at step 1 too, before the allow list: a refused host is refused
whatever lists it, and never asked about.

One gate per config: ``EgressProxyFactory`` builds one for each config its
``ConfigHolder`` serves, so the decision caches (measured by
``bench/egress.py``) are pure functions of the gate's own allow list.  The
tunnel slots are not the config's: they live in ``TunnelSlots``, handed from
gate to gate, so a tunnel opened under the old config keeps its slot after a
reload and gives it back to whichever gate is current when it closes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agentsandbox.allowlist import AllowList, HostDecision, IPAddress, decideHost, unwrapMapped
from agentsandbox.egress.grant import Grant, Refusal
from agentsandbox.egress.names import ResolveError
from agentsandbox.egress.rules import AddressDecision, classifyAddress, decideAddress

if TYPE_CHECKING:
    from agentsandbox.config import Config

#: Most remembered decisions of each kind (a full cache is emptied, not evicted).
DECISION_CACHE = 4096


@dataclass(frozen=True, slots=True)
class Resolve:
    """Not finished yet: resolve ``name.host`` once, then ask ``Gate.resolved``
    with every answer, or ``Gate.unresolved`` with why nothing answered."""

    name: HostDecision
    #: Whether a tunnel slot was taken for this decision (given back on a refusal).
    reserved: bool

    @property
    def host(self) -> str:
        """The canonical name to resolve: the name the allow list judged."""
        return self.name.host

    @property
    def port(self) -> int:
        return self.name.port


@dataclass(frozen=True, slots=True)
class Ask:
    """Not listed, and ``proxy.unlisted`` is ask: hold it for the person, nothing
    resolved or dialled, then hand it to ``Gate.approved`` on an allow."""

    name: HostDecision
    #: Whether the caller wants a tunnel slot (taken only once the person allows).
    reserve: bool

    @property
    def host(self) -> str:
        return self.name.host

    @property
    def port(self) -> int:
        return self.name.port

    def refusal(self, reason: str) -> Refusal:
        """The person said no, or nobody answered: refused in ``reason``'s words."""
        return Refusal("policy", reason, allow=self.name.allow)


#: A finished decision.
Verdict = Grant | Refusal
#: What ``Gate.decide`` returns: an answer to an ``Ask`` is then a Grant or a
#: Refusal like any other, so ``Ask`` joins this union, not ``Verdict``.
Step = Grant | Refusal | Resolve | Ask


class TunnelSlots:
    """How many tunnels hold a slot (``proxy.max_tunnels``), across config swaps."""

    def __init__(self) -> None:
        self.inUse = 0

    def take(self, most: int) -> bool:
        if self.inUse >= most:
            return False
        self.inUse += 1
        return True

    def give(self) -> None:
        self.inUse = max(0, self.inUse - 1)


class Gate:
    """The decisions of one config: names, slots, addresses and the parent fallback."""

    def __init__(
        self,
        allow: AllowList,
        maxTunnels: int,
        parent: str | None = None,
        slots: TunnelSlots | None = None,
        refused: AllowList | None = None,
        unlisted: str = "refuse",
    ) -> None:
        self.allow = allow
        #: ``sandbox.refused_domains``: refused at step 1 whatever lists them, never asked.
        self.refused = refused
        #: ``proxy.unlisted``: "ask" makes an unlisted name an ``Ask``.
        self.unlisted = unlisted
        self.maxTunnels = maxTunnels
        self.parent = parent
        self.slots = slots if slots is not None else TunnelSlots()
        # Pure functions of (allow list, arguments): never emptied but when full,
        # since a new config gets a new gate.
        self._names: dict[tuple[str, int], HostDecision] = {}
        self._addresses: dict[tuple[str, int, IPAddress], AddressDecision] = {}
        self._literals: dict[tuple[str, int], Verdict] = {}

    @classmethod
    def ofConfig(cls, config: Config, slots: TunnelSlots | None = None) -> Gate:
        """The gate of ``config`` (its one parse of ``sandbox.domains``), sharing ``slots``."""
        return cls(
            config.sandbox.allowList, config.proxy.max_tunnels, config.proxy.parent, slots,
            config.sandbox.refusedList if config.sandbox.refused_domains else None, config.proxy.unlisted,
        )

    # ------------------------------------------------------------------ the steps
    def name(self, host: str, port: int) -> HostDecision:
        """Step 1 alone: ``host:port`` by name (``check host`` prints it)."""
        key = (host, port)
        found = self._names.get(key)
        if found is None:
            if len(self._names) >= DECISION_CACHE:
                self._names.clear()
            found = decideHost(self.allow, host, port)
            if self.refused is not None:
                found = _refusedName(self.refused, found)
            self._names[key] = found
        return found

    def decide(self, host: str, port: int, reserve: bool = False) -> Step:
        """Decide ``host:port`` as far as it can be without DNS.

        With ``reserve``, a tunnel slot is taken once the name passes, and given
        back by whichever step refuses; the caller gives back a granted one
        (``release``) when its tunnel ends.
        """
        name = self.name(host, port)
        if name.entry is None:
            if self.unlisted == "ask" and name.allow is not None and not _refusedLiteral(name):
                return Ask(name, reserve)
            return Refusal("policy", name.reason, allow=name.allow)
        return self._afterName(name, reserve)

    def approved(self, ask: Ask) -> Step:
        """The person allowed ``ask``'s host: steps 2 and 3 as for a listed name,
        the address rules included (a name the person allowed that resolves to a
        private or loopback address is still refused unless an entry covers it)."""
        name = ask.name
        return self._afterName(
            HostDecision(name.host, name.port, None, f"{name.host}:{name.port} was allowed by the person", name.allow),
            ask.reserve,
        )

    def _afterName(self, name: HostDecision, reserve: bool) -> Step:
        port = name.port
        if reserve and not self.slots.take(self.maxTunnels):
            return Refusal(
                "limit",
                f"{self.maxTunnels} tunnels are open, the most proxy.max_tunnels "
                f"allows; {name.host}:{port} was not opened",
            )
        literal = name.literal
        if literal is None:
            return Resolve(name, reserve)
        key = (name.host, port)
        verdict = self._literals.get(key)
        if verdict is None:
            if len(self._literals) >= DECISION_CACHE:
                self._literals.clear()
            verdict = self._literals[key] = self._checked(name, (literal,))
        if reserve and verdict.__class__ is Refusal:
            self.slots.give()
        return verdict

    def resolved(self, step: Resolve, addresses: Sequence[IPAddress]) -> Verdict:
        """Step 3 for a name: every address it resolved to, in the resolver's order."""
        verdict = self._checked(step.name, addresses)
        if step.reserved and verdict.__class__ is Refusal:
            self.slots.give()
        return verdict

    def unresolved(self, step: Resolve, why: str) -> Verdict:
        """Step 3 for a name nothing answered for; ``why`` is the resolver's
        error text, which names the host (``names.ResolveError``)."""
        name = step.name
        if self.parent is not None:
            # Names only the organisation's resolver knows: the parent resolves them.
            return Grant(name.host, name.port, (), _entryText(name), True)
        if step.reserved:
            self.slots.give()
        return Refusal("resolve", why)

    def release(self) -> None:
        """A granted tunnel ended (or was never opened): its slot is free."""
        self.slots.give()

    def abandon(self, step: Resolve) -> None:
        """The caller gives up on ``step`` without a verdict (its resolver broke)."""
        if step.reserved:
            self.slots.give()

    def decideResolving(self, host: str, port: int, resolve: Callable[[str, int], Sequence[IPAddress]]) -> Verdict:
        """The whole decision, resolving synchronously with ``resolve`` (which
        raises ``names.ResolveError``): ``check host`` and the hook's WebFetch."""
        step = self.decide(host, port)
        if isinstance(step, Ask):
            # No one to hold a synchronous question for: not listed is refused.
            return step.refusal(step.name.reason)
        if not isinstance(step, Resolve):
            return step
        try:
            addresses = resolve(step.host, step.port)
        except ResolveError as e:
            return self.unresolved(step, str(e))
        return self.resolved(step, addresses)

    def addresses(self, name: HostDecision, addresses: Sequence[IPAddress]) -> list[AddressDecision]:
        """The decision on each of ``addresses`` for the allowed ``name`` (``check host`` prints them)."""
        out = []
        table = self._addresses
        for ip in addresses:
            key = (name.host, name.port, ip)
            found = table.get(key)
            if found is None:
                if len(table) >= DECISION_CACHE:
                    table.clear()
                found = table[key] = decideAddress(self.allow, name.host, name.port, ip, name.entry)
            out.append(found)
        return out

    def _checked(self, name: HostDecision, addresses: Sequence[IPAddress]) -> Verdict:
        port = name.port
        if not addresses:
            return Refusal("resolve", f"{name.host} does not resolve (no A or AAAA answer)")
        decisions = self.addresses(name, addresses)
        ok = tuple(x.address for x in decisions if x.allowed)
        if not ok:
            first = decisions[0]
            shown = unwrapMapped(first.address)
            allowText = f"{shown}:{port}" if shown.version == 4 else f"[{shown}]:{port}"
            reason = "; ".join(x.reason for x in decisions)
            return Refusal("policy", reason, allow=allowText, address=str(first.address))
        viaParent = self.parent is not None and any(classifyAddress(a) is None for a in ok)
        single = str(ok[0]) if len(ok) == 1 else None
        return Grant(name.host, port, ok, _entryText(name), viaParent, single)


def _entryText(name: HostDecision) -> str:
    return name.entry.text if name.entry is not None else ""


def _refusedName(refused: AllowList, name: HostDecision) -> HostDecision:
    """``name`` refused when ``sandbox.refused_domains`` names it (before any allow entry)."""
    if name.allow is None and name.entry is None:
        return name  # no host name or no TCP port: its own words say why
    entry = refused.byName(name.host, name.port)
    if entry is None:
        return name
    return HostDecision(
        name.host, name.port, None,
        f"{name.host}:{name.port} is refused by {entry.text!r} in sandbox.refused_domains "
        "(the person refused it; remove that entry to allow it or be asked again)",
    )


def _refusedLiteral(name: HostDecision) -> bool:
    """An IP literal the address rules refuse anyway (loopback, private, ...): never asked."""
    literal = name.literal
    return literal is not None and classifyAddress(literal) is not None
