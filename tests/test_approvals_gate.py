"""The gate's third verdict, Ask (issue 28): sans IO, no sockets."""

from __future__ import annotations

from agentsandbox.egress.gate import Ask, Gate, Resolve
from agentsandbox.egress.grant import Grant, Refusal
from tests.support.egress_fixtures import domainsToml, makeConfig


def gate(domains: list[str], refused: list[str] | None = None, **proxy: object) -> Gate:
    toml = domainsToml(domains, **proxy)
    if refused is not None:
        toml = toml.replace("[sandbox]\n", f"[sandbox]\nrefused_domains = {refused!r}\n".replace("'", '"'))
    return Gate.ofConfig(makeConfig(toml))


def test_an_unlisted_name_is_asked_only_under_ask() -> None:
    refusing = gate(["github.com"])
    assert isinstance(refusing.decide("example.org", 443), Refusal)
    asking = gate(["github.com"], unlisted="ask")
    step = asking.decide("Example.ORG.", 443, reserve=True)
    assert isinstance(step, Ask) and (step.host, step.port, step.reserve) == ("example.org", 443, True)
    assert asking.slots.inUse == 0  # no slot is taken while a person decides
    assert isinstance(asking.decide("github.com", 443), Resolve)


def test_an_approved_ask_takes_the_address_steps_of_a_listed_name() -> None:
    asking = gate(["github.com"], unlisted="ask")
    ask = asking.decide("example.org", 443, reserve=True)
    assert isinstance(ask, Ask)
    step = asking.approved(ask)
    assert isinstance(step, Resolve) and step.reserved and asking.slots.inUse == 1
    import ipaddress

    refused = asking.resolved(step, [ipaddress.ip_address("10.0.0.5")])
    assert isinstance(refused, Refusal) and "10.0.0.5, which is" in refused.reason
    assert asking.slots.inUse == 0
    literal = asking.decide("192.0.2.10", 443)
    assert isinstance(literal, Ask)
    assert isinstance(asking.approved(literal), Grant)


def test_what_is_never_asked() -> None:
    asking = gate(["github.com", "*.example.com"], refused=["bad.example.com", "evil.example.net"], unlisted="ask")
    for host, port, words in (
        ("bad.example.com", 443, "is refused by 'bad.example.com' in sandbox.refused_domains"),
        ("evil.example.net", 22, "is refused by 'evil.example.net' in sandbox.refused_domains"),
        ("10.0.0.5", 443, "10.0.0.5:443 is not on the sandbox's allow list"),
        ("127.0.0.1", 8080, "127.0.0.1:8080 is not on the sandbox's allow list"),
        ("bad host", 443, "is not a host name the sandbox reaches"),
    ):
        step = asking.decide(host, port)
        assert isinstance(step, Refusal) and words in step.reason, (host, step)
    # Refused whatever lists it: a refusal is a narrowing.
    assert isinstance(asking.decide("ok.example.com", 443), Resolve)


def test_check_host_and_the_hook_read_an_ask_as_not_listed() -> None:
    asking = gate(["github.com"], unlisted="ask")
    verdict = asking.decideResolving("example.org", 443, lambda h, p: [])
    assert isinstance(verdict, Refusal) and "is not on the sandbox's allow list" in verdict.reason


def test_check_host_says_it_would_be_asked(capsys: object) -> None:
    from agentsandbox.commands import _checkHost

    config = makeConfig(domainsToml(["github.com"], unlisted="ask"))
    assert _checkHost(config, "example.org", resolve=False) == 1
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    assert out.startswith('asked: example.org:443 is not on sandbox.domains; with proxy.unlisted = "ask"')
    assert "(agentsandbox approve example.org)" in out
