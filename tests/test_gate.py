"""The gate (``egress/gate.py``): its steps as values, its slots across reloads,
and ``check host`` and a live proxy agreeing on every row of the SSRF table."""

from __future__ import annotations

import contextlib
import io
import ipaddress

from twisted.internet import reactor
from twisted.internet.protocol import Factory
from twisted.trial.unittest import TestCase

from agentsandbox.commands import _checkHost
from agentsandbox.egress.gate import Gate, Resolve, TunnelSlots
from agentsandbox.egress.grant import Grant, Refusal
from agentsandbox.egress.proxy import EgressProxyFactory
from agentsandbox.egress.testing import AllowAllPeers, FixedResolver, MappedDialer
from agentsandbox.reload import ConfigHolder
from tests.support.egress_fixtures import (
    Echo,
    ProxyHarness,
    deferredTest,
    domainsToml,
    exchange,
    listen,
    makeConfig,
)
from tests.test_rules import NAME, SSRF


def gate(domains: list[str], **proxy: object) -> Gate:
    return Gate.ofConfig(makeConfig(domainsToml(domains, **proxy)))


def test_a_name_is_a_resolve_step_and_a_literal_a_verdict() -> None:
    g = gate([NAME, "192.0.2.7"])
    step = g.decide(NAME, 443)
    assert isinstance(step, Resolve) and step.host == NAME and step.port == 443
    assert isinstance(g.decide("192.0.2.7", 443), Grant)
    refused = g.decide("example.net", 443)
    assert isinstance(refused, Refusal) and refused.kind == "policy" and refused.allow == "example.net"


def test_an_unresolved_name_goes_to_the_parent_on_the_name_rule_alone() -> None:
    step = gate([NAME], parent="http://127.0.0.1:3128").decide(NAME, 443)
    assert isinstance(step, Resolve)
    verdict = gate([NAME], parent="http://127.0.0.1:3128").unresolved(step, f"{NAME} does not resolve (x)")
    assert isinstance(verdict, Grant) and verdict.viaParent and verdict.addresses == ()
    refused = gate([NAME]).unresolved(step, f"{NAME} does not resolve (x)")
    assert refused == Refusal("resolve", f"{NAME} does not resolve (x)")


def test_slots_are_taken_once_the_name_passes_and_given_back_by_a_refusal() -> None:
    g = gate([NAME, "example.org"], max_tunnels=1)
    step = g.decide(NAME, 443, reserve=True)
    assert isinstance(step, Resolve) and step.reserved and g.slots.inUse == 1
    full = g.decide("example.org", 443, reserve=True)
    assert isinstance(full, Refusal) and full.kind == "limit" and "proxy.max_tunnels" in full.reason
    assert isinstance(g.decide("example.net", 443, reserve=True), Refusal) and g.slots.inUse == 1
    assert isinstance(g.resolved(step, [ipaddress.ip_address("10.0.0.1")]), Refusal)
    assert g.slots.inUse == 0


def test_one_gate_per_config_and_the_slots_carry_over_a_reload() -> None:
    holder = ConfigHolder(makeConfig(domainsToml([NAME], max_tunnels=4)))
    factory = EgressProxyFactory(holder, reactor, resolver=FixedResolver({}), peers=AllowAllPeers())
    old = factory.gate
    assert isinstance(old.decide(NAME, 443, reserve=True), Resolve)
    holder.swap(makeConfig(domainsToml(["example.org"], max_tunnels=1)))
    assert factory.gate is not old and factory.gate.slots is old.slots
    # The open tunnel keeps its slot under the new config's cap of one.
    refused = factory.gate.decide("example.org", 443, reserve=True)
    assert isinstance(refused, Refusal) and refused.kind == "limit"
    factory.release()
    assert factory.reserved == 0
    assert isinstance(factory.gate.decide("example.org", 443, reserve=True), Resolve)


def test_slots_never_go_below_zero() -> None:
    slots = TunnelSlots()
    slots.give()
    assert slots.inUse == 0 and slots.take(1) and not slots.take(1)


def checkHost(config: object, target: str, resolver: FixedResolver) -> tuple[int, list[str]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = _checkHost(config, target, True, resolver.addresses)  # type: ignore[arg-type]
    return code, out.getvalue().splitlines()


class CheckHostIsTheProxy(TestCase):
    @deferredTest
    async def test_every_ssrf_row_gets_the_same_verdict_and_words(self) -> None:
        """``check host --resolve`` and a live CONNECT through the proxy, row by row."""
        server = await listen(Factory.forProtocol(Echo))
        self.addCleanup(server.stopListening)
        dialer = MappedDialer(reactor)
        for _case, answers, _expected in SSRF:
            for a in answers:
                dialer.map(str(ipaddress.ip_address(a)), server.getHost().port)
        h = ProxyHarness([NAME], FixedResolver({}), dialer)
        await h.start()
        self.addCleanup(h.stop)
        for case, answers, expected in SSRF:
            table = FixedResolver({NAME: answers})
            h.resolver.table = table.table
            code, lines = checkHost(h.config, NAME, table)
            out = await exchange(h.port, f"CONNECT {NAME}:443 HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            if expected is None:
                head, _, body = out.partition(b"\r\n\r\n")
                self.assertTrue(head.startswith(b"HTTP/1.1 403 "), (case, out))
                self.assertEqual((code, lines[-1]), (1, "refused: " + body.decode().rstrip("\n")), case)
            else:
                self.assertTrue(out.startswith(b"HTTP/1.1 200 Connection established"), (case, out))
                self.assertEqual(code, 0, case)
                shown = ", ".join(str(ipaddress.ip_address(a)) for a in expected)
                self.assertEqual(lines[-1], f"allowed: {NAME}:443 is dialled at {shown}", case)

    @deferredTest
    async def test_an_unlisted_and_an_unresolved_name_are_worded_alike(self) -> None:
        h = ProxyHarness([NAME], FixedResolver({}))
        await h.start()
        self.addCleanup(h.stop)
        for target in ("example.net:443", f"{NAME}:443"):
            code, lines = checkHost(h.config, target, FixedResolver({}))
            out = await exchange(h.port, f"CONNECT {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            body = out.partition(b"\r\n\r\n")[2].decode().rstrip("\n")
            self.assertEqual((code, lines[-1]), (1, f"refused: {body}"), target)
