"""The egress seams: every implementation and every double provides its zope
interface in full, the doubles in ``agentsandbox.egress.testing`` behave as
documented, no test of a timeout waits on the wall clock, and ``bench/`` builds on
the package, never on ``tests/``.
"""

from __future__ import annotations

import ast
import ipaddress
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from twisted.internet import reactor as _reactor
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import Clock
from zope.interface import Interface
from zope.interface.verify import verifyObject

from agentsandbox.config import EnvSource
from agentsandbox.egress.askers import ProcAskers
from agentsandbox.egress.dial import TCPDialer
from agentsandbox.egress.inject import IUpstreamPool
from agentsandbox.egress.interfaces import (
    IAskers,
    IDialer,
    IDoorHandler,
    IFrontDoor,
    IPeerChecker,
    IResolver,
    ITerminator,
    ITokenHolder,
)
from agentsandbox.egress.peer import ProcNetPeers, SameUserPeers
from agentsandbox.egress.resolve import ResolveError, SystemResolver
from agentsandbox.egress.testing import (
    AllowAllPeers,
    FixedAskers,
    FixedResolver,
    FixedToken,
    MappedDialer,
    MemoryDialer,
    MemoryUpstreamPool,
    RefusingDialer,
)
from agentsandbox.tokens import TokenKeeper

REPO = Path(__file__).resolve().parent.parent
reactor: Any = _reactor


def implementations() -> Iterator[tuple[type[Interface], object]]:
    from tests.test_peer import RecordingPeers
    from tests.test_proxy import FakeTerminator

    yield IResolver, SystemResolver(reactor)
    yield IResolver, FixedResolver({})
    yield IDialer, TCPDialer(reactor)
    yield IDialer, MappedDialer(reactor)
    yield IDialer, RefusingDialer()
    yield IDialer, MemoryDialer()
    yield IUpstreamPool, MemoryUpstreamPool()
    yield IPeerChecker, SameUserPeers()
    yield IPeerChecker, ProcNetPeers()
    yield IPeerChecker, AllowAllPeers()
    yield IPeerChecker, RecordingPeers()
    yield ITokenHolder, TokenKeeper(EnvSource("AGENTSANDBOX_TEST_TOKEN"), reactor, Clock())
    yield ITokenHolder, FixedToken("t")
    yield ITerminator, FakeTerminator()
    yield IAskers, ProcAskers(reactor)
    yield IAskers, FixedAskers("4242 curl")
    yield from doorsAndHandlers()


def doorsAndHandlers() -> Iterator[tuple[type[Interface], object]]:
    """The door <-> handler contract: the proxy's door, the dispatcher's refusing
    door, and both handlers, each on a real door."""
    from agentsandbox.egress.dispatch import _RefusingDoor
    from agentsandbox.egress.http import HTTPHandler
    from agentsandbox.egress.proxy import EgressProxyFactory, FrontDoor
    from agentsandbox.egress.socks import SocksHandler
    from tests.support.egress_fixtures import makeConfig

    door = FrontDoor(EgressProxyFactory(makeConfig(), reactor, peers=AllowAllPeers()))
    refusing = _RefusingDoor(None)  # type: ignore[arg-type]  # (holds its refusal only to write to it)
    yield IFrontDoor, door
    yield IFrontDoor, refusing
    yield IDoorHandler, HTTPHandler(door)
    yield IDoorHandler, SocksHandler(door)
    yield IDoorHandler, SocksHandler(refusing)


def test_every_implementation_and_double_provides_its_interface() -> None:
    checked = 0
    for interface, implementation in implementations():
        assert verifyObject(interface, implementation), (interface, implementation)
        checked += 1
    assert checked == 21


def test_the_injector_is_a_terminator() -> None:
    from agentsandbox.egress.inject import Injector
    from agentsandbox.egress.tls import InjectionCA

    injector = Injector(InjectionCA.create(["api.github.com"], label="seams"), {}, MappedDialer(reactor), reactor)
    assert verifyObject(ITerminator, injector)
    assert injector.clock is reactor
    clock: Any = Clock()
    assert Injector(injector.ca, {}, MappedDialer(reactor), reactor, clock=clock).clock is clock


def test_the_clock_defaults_to_the_reactor() -> None:
    from agentsandbox.egress.proxy import EgressProxyFactory
    from agentsandbox.reload import ConfigHolder, ConfigWatcher
    from tests.support.egress_fixtures import makeConfig

    config = makeConfig()
    assert EgressProxyFactory(config, reactor, peers=AllowAllPeers()).clock is reactor
    assert ConfigWatcher(ConfigHolder(config), None, reactor, handleSignal=False).clock is reactor
    clock: Any = Clock()
    assert EgressProxyFactory(config, reactor, peers=AllowAllPeers(), clock=clock).clock is clock
    assert ConfigWatcher(ConfigHolder(config), None, reactor, handleSignal=False, clock=clock).clock is clock


# ---------------------------------------------------------------------- the doubles


def test_fixed_resolver_answers_from_its_table_and_counts() -> None:
    resolver = FixedResolver({"a.example.org": ["192.0.2.1", "2001:db8::1"]})
    got: list[Any] = []
    resolver.resolve("a.example.org", 443).addBoth(got.append)
    resolver.resolve("b.example.org", 443).addBoth(got.append)
    assert [str(a) for a in got[0]] == ["192.0.2.1", "2001:db8::1"]
    assert got[1].check(ResolveError) and "b.example.org" in got[1].getErrorMessage()
    assert resolver.lookups == ["a.example.org", "b.example.org"]


def test_mapped_dialer_bends_only_what_it_was_told_and_nothing_leaves_the_machine() -> None:
    dialer = MappedDialer(reactor)
    dialer.route("192.0.2.10", 443, 4443)
    dialer.map("203.0.113.7", 8443)
    ip = ipaddress.ip_address
    ends = [dialer(ip(a), p) for a, p in [("192.0.2.10", 443), ("203.0.113.7", 80), ("127.0.0.2", 22), ("192.0.2.10", 80), ("198.51.100.1", 443)]]
    targets = [(e._host, e._port) for e in ends]  # type: ignore[attr-defined]
    assert targets == [("127.0.0.1", 4443), ("127.0.0.1", 8443), ("127.0.0.2", 22), ("127.0.0.1", 1), ("127.0.0.1", 1)]
    assert dialer.dialled[0] == ("192.0.2.10", 443) and len(dialer.dialled) == 5


def test_refusing_dialer_refuses_without_a_socket() -> None:
    dialer = RefusingDialer()
    got: list[Any] = []
    dialer(ipaddress.ip_address("192.0.2.1"), 443).connect(Factory.forProtocol(Protocol)).addBoth(got.append)
    (failure,) = got
    assert failure.check(ConnectionRefusedError)
    assert dialer.dialled == [("192.0.2.1", 443)]


def test_fixed_token_and_allow_all() -> None:
    token = FixedToken(None)
    assert token.token() is None
    token.value = "t"
    assert token.token() == "t"
    assert AllowAllPeers().check(("127.0.0.1", 1), ("127.0.0.1", 2)) is None


# ---------------------------------------------------------------------- no test of a timeout waits

#: A test named for a timer of the code under test.
_TIMEOUT_NAME = re.compile(r"(?i:timeout|idle|settle|coalesce|expire|deadline)|HangingCommand")
#: Calls that wait out wall-clock time: a sleep, a timed Deferred, or polling.
_WAITS = {"sleep", "deferLater", "waitFor"}
#: What moving a ``task.Clock`` looks like.
_MOVES = {"advance", "pump"}


def _called(node: ast.AST) -> set[str]:
    names = set()
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            f = call.func
            names.add(f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else "")
    return names


def _timeoutTests() -> Iterator[tuple[str, set[str]]]:
    for path in sorted((REPO / "tests").glob("test_*.py")):
        if path.name == "test_seams.py":  # this module names timeouts without being a test of one
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_") and _TIMEOUT_NAME.search(node.name):
                yield f"{path.name}::{node.name}", _called(node)


def test_no_test_of_a_timeout_waits_on_the_wall_clock() -> None:
    found = dict(_timeoutTests())
    # The finder finds the timeout tests it is meant for.
    assert {"test_proxy.py::test_headerTimeout", "test_proxy.py::test_idleTimeoutClosesTunnel", "test_reload.py::test_eventsCoalesce"} <= set(found)
    waiting = {name: sorted(calls & _WAITS) for name, calls in found.items() if calls & _WAITS}
    assert waiting == {}, f"timeout tests that sleep or poll: {waiting}"
    unclocked = sorted(name for name, calls in found.items() if not calls & _MOVES)
    assert unclocked == [], f"timeout tests that do not advance a task.Clock: {unclocked}"


def test_the_wait_finder_sees_a_sleep() -> None:
    source = "async def test_x():\n    await sleep(0.2)\n    clock.advance(1)\n"
    assert _called(ast.parse(source)) >= {"sleep", "advance"}
    assert _TIMEOUT_NAME.search("test_headerTimeout") and _TIMEOUT_NAME.search("test_aHangingCommandIsKilledAtItsBound")
    assert not _TIMEOUT_NAME.search("test_the_cache_follows_config_changes")
    assert not _TIMEOUT_NAME.search("test_refusesAFifoWithoutHanging")


# ---------------------------------------------------------------------- bench builds on the package


@pytest.mark.parametrize("path", sorted((REPO / "bench").glob("*.py")), ids=lambda p: p.name)
def test_bench_imports_nothing_from_tests(path: Path) -> None:
    tree = ast.parse(path.read_text(), str(path))
    imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    fromTests = [m for m in imported if m == "tests" or m.startswith("tests.")]
    assert fromTests == []


def test_the_exchange_bench_drives_both_paths_on_the_shipped_doubles() -> None:
    """``bench/exchange.py`` builds its exchanges from ``agentsandbox.egress.testing``
    alone; a tiny run checks each path answers (the figures are not judged)."""
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "exchange.py"), "--rounds", "1", "--exchanges", "20"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 0, out.stderr
    for target in ("h11", "terminated", "forward", "tunnel"):
        assert re.search(rf"^  {target} +[0-9.]+ .* vs h11 +[0-9.]+x$", out.stdout, re.M), out.stdout
