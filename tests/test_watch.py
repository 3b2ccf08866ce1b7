"""``agentsandbox watch``: the view sans-IO, then the real program in a real terminal (tmux).

The terminal tests run ``python -m agentsandbox watch`` in a private tmux server
against ``tests.support.control``'s fake control server (the contract's wire),
read the pane with capture-pane and type with send-keys.  Every wait polls
with a bound; the one timed claim is the issue's: a held request is on the
screen within a second of being held.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentsandbox.approvals import Answer, HeldRequest, controlSocket
from agentsandbox.watch import DEFAULT_FOR, QUIT, Send, WatchState, parseDuration, splitKeys
from tests.support.control import FakeControlServer, FakeRegistry
from tests.support.tmux import Tmux, waitUntil

REPO = Path(__file__).resolve().parent.parent


def held(id: str, host: str = "example.org", port: int = 443, since: float = 1000.0) -> HeldRequest:
    return HeldRequest(id, host, port, "connect", "127.0.0.1:5000", "1234 curl", since)


def snapshot(*requests: HeldRequest, mode: str = "ask") -> dict[str, object]:
    return {"ok": True, "mode": mode, "held": [h.toWire() for h in requests], "recent": []}


# --------------------------------------------------------------------------- the view, sans-IO


def test_the_view_shows_what_waits_and_for_how_long() -> None:
    state = WatchState()
    state.load(snapshot(held("h1", since=1000.0)))
    screen = "\n".join(state.lines(100, 30, now=1075.0))
    assert "example.org:443" in screen and "connect" in screen and "1234 curl" in screen
    assert "1m15s" in screen
    assert "o once" in screen and "D deny always" in screen


def test_a_narrow_terminal_still_shows_every_key_and_no_line_is_wider() -> None:
    state = WatchState()
    state.load(snapshot(held("h1", host="a-rather-long-name.build.example.com")))
    lines = state.lines(32, 40, now=1001.0)
    assert all(len(line) <= 32 for line in lines)
    screen = " ".join(lines)
    for key in ("o once", "f for a while", "a always", "d deny", "D deny always", "q quit"):
        assert key in screen
    assert "connect, 1234 curl" in screen


def test_each_key_answers_the_selected_request_as_the_contract_says() -> None:
    state = WatchState(by="watch pid 7")
    state.load(snapshot(held("h1"), held("h2", host="git.example.com", since=1001.0)))
    assert state.key("down") is None and state.current() == held("h2", host="git.example.com", since=1001.0)
    assert state.key("o") == Send("h2", Answer("allow", "once", None, "watch pid 7"), "git.example.com:443: allowed once")
    send = state.key("1") or state.key("a")
    assert isinstance(send, Send) and (send.target, send.answer.scope) == ("example.org", "always")
    send = state.key("D")
    assert isinstance(send, Send) and (send.target, send.answer.verdict, send.answer.scope) == ("example.org", "deny", "always")
    send = state.key("d")
    assert isinstance(send, Send) and (send.target, send.answer.verdict, send.answer.scope) == ("h1", "deny", "once")
    assert state.key("q") is QUIT


def test_for_a_while_asks_how_long_and_enter_takes_the_documented_default() -> None:
    state = WatchState()
    state.load(snapshot(held("h1")))
    assert state.key("f") is None and state.prompt == ""
    assert "for how long" in "\n".join(state.lines(100, 30, 1000.0))
    for c in "30m":
        state.key(c)
    send = state.key("enter")
    assert isinstance(send, Send) and send.answer == Answer("allow", "for", 1800.0)
    state.key("f")
    send = state.key("enter")
    assert isinstance(send, Send) and send.answer.seconds == DEFAULT_FOR
    state.key("f")
    assert state.key("esc") is None
    assert "for how long" not in "\n".join(state.lines(100, 30, 1000.0))
    state.key("f")
    for c in "soon":
        state.key(c)
    assert state.key("enter") is None and "not a duration" in state.status


def test_a_decision_moves_the_request_below_and_keeps_the_selection() -> None:
    state = WatchState()
    a, b, c = held("h1"), held("h2", host="git.example.com", since=1001.0), held("h3", host="c.example.com")
    state.load(snapshot(a, b, c))
    state.apply({"event": "withdrawn", "request": c.toWire()}, 1005.0)
    state.key("2")
    state.apply({"event": "decided", "request": a.toWire(), "answer": Answer("allow", "once", by="cli").toWire()}, 1010.0)
    assert state.held == [b] and state.current() == b
    state.apply({"event": "timedout", "request": b.toWire()}, 1020.0)
    screen = "\n".join(state.lines(100, 30, 1020.0))
    assert "WAITING: nothing" in screen
    assert "example.org:443 allowed once by cli" in screen and "git.example.com:443 nobody answered" in screen
    assert "c.example.com:443 the client went away" in screen


def test_observe_and_refuse_modes_say_what_the_machine_does() -> None:
    state = WatchState()
    state.load(snapshot(mode="observe"))
    state.apply({"event": "observed", "host": "example.org", "port": 443, "kind": "connect"}, 1000.0)
    screen = "\n".join(state.lines(100, 30, 1000.0))
    assert "OBSERVING, NOT ENFORCING" in screen and "example.org:443 would be refused" in screen
    state.load(snapshot(mode="refuse"))
    assert "nothing is held" in state.lines(100, 30, 1000.0)[0]


def test_keys_are_read_from_what_the_terminal_sends() -> None:
    assert list(splitKeys("\x1b[Aj\x1bOB\r\x7f\x1b\x1b[15~D")) == ["up", "j", "down", "enter", "backspace", "esc", "D"]


@pytest.mark.parametrize(("text", "seconds"), [("90", 90.0), ("30s", 30.0), ("10m", 600.0), ("2h", 7200.0), ("1d", 86400.0)])
def test_durations(text: str, seconds: float) -> None:
    assert parseDuration(text) == seconds


def test_watch_imports_no_twisted() -> None:
    code = "import sys, agentsandbox.watch; print(any(m.startswith('twisted') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=_env())
    assert out.stdout == "False\n"


# --------------------------------------------------------------------------- the program


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), **extra}


def test_without_the_service_it_says_so_in_words() -> None:
    with tempfile.TemporaryDirectory() as runtime:
        p = subprocess.run(
            [sys.executable, "-m", "agentsandbox", "watch"],
            capture_output=True, text=True, env=_env(XDG_RUNTIME_DIR=runtime), timeout=30,
        )  # fmt: skip
    assert p.returncode == 1
    assert "the agentsandbox service is not running for this user" in p.stderr
    assert controlSocket(runtime) in p.stderr and "systemctl --user start agentsandbox" in p.stderr


@pytest.fixture
def world() -> Iterator[tuple[FakeRegistry, FakeControlServer, Tmux, str]]:
    if shutil.which("tmux") is None:
        pytest.fail("tmux is not installed (.ci/install-deps installs it)")
    directory = tempfile.mkdtemp(prefix="watch-")
    registry = FakeRegistry()
    server = FakeControlServer(registry, controlSocket(os.path.join(directory, "run"))).start()
    term = Tmux(directory)
    try:
        yield registry, server, term, directory
    finally:
        term.close()
        server.stop()
        shutil.rmtree(directory, ignore_errors=True)


def _watch(term: Tmux, socket: str, after: str = "") -> None:
    """``agentsandbox watch`` in the pane, then ``after`` (a shell line), through sh."""
    # sh keeps running on Ctrl-C (a trap, so the child still takes SIGINT) to run ``after``.
    line = f"trap 'true' INT; {sys.executable} -m agentsandbox watch --socket {socket}; {after}"
    term.start(["sh", "-c", line], env={"PYTHONPATH": str(REPO), "TERM": "xterm-256color"})


def test_in_a_real_terminal_a_held_request_shows_at_once_and_keys_answer_it(
    world: tuple[FakeRegistry, FakeControlServer, Tmux, str],
) -> None:
    registry, server, term, _ = world
    _watch(term, server.path, "sleep 600")
    term.waitFor(lambda s: "WAITING: nothing" in s)
    waitUntil(lambda: server.following == 1, what="watch following the stream")

    first = registry.hold("example.org", 443, process="4242 curl")
    heldAt = time.monotonic()
    term.waitFor(lambda s: "example.org:443" in s and "4242 curl" in s)
    shownAfter = time.monotonic() - heldAt
    assert shownAfter < 1.0, f"the held request took {shownAfter:.2f}s to show"

    term.keys("o")
    waitUntil(lambda: len(registry.answers) == 1, what="the answer reaching the service")
    target, answer = registry.answers[0]
    assert (target, answer.verdict, answer.scope) == (first.id, "allow", "once")
    assert answer.by.startswith("watch pid ")
    term.waitFor(lambda s: "WAITING: nothing" in s and "example.org:443 allowed once" in s)

    registry.hold("git.example.com", 443)
    term.waitFor(lambda s: "git.example.com:443" in s)
    term.keys("f")
    term.waitFor(lambda s: "for how long" in s)
    term.keys("20m", "Enter")
    waitUntil(lambda: len(registry.answers) == 2, what="the for-a-while answer")
    assert registry.answers[1][0] == "git.example.com"
    assert (registry.answers[1][1].scope, registry.answers[1][1].seconds) == ("for", 1200.0)

    registry.hold("a.example.com", 80, kind="forward")
    registry.hold("b.example.com", 443, kind="socks")
    term.waitFor(lambda s: "WAITING (2)" in s)
    term.keys("Down", "D")
    waitUntil(lambda: len(registry.answers) == 3, what="the deny-always answer")
    assert registry.answers[2][0] == "b.example.com"
    assert (registry.answers[2][1].verdict, registry.answers[2][1].scope) == ("deny", "always")
    term.keys("a")
    waitUntil(lambda: len(registry.answers) == 4, what="the allow-always answer")
    assert registry.answers[3][0] == "a.example.com"


def test_a_narrow_terminal_shows_the_request_and_every_key(
    world: tuple[FakeRegistry, FakeControlServer, Tmux, str],
) -> None:
    registry, server, _, directory = world
    term = Tmux(directory, width=36, height=20)
    registry.hold("a-long-host-name.build.example.com", 8443, process="999 git-remote-https")
    _watch(term, server.path, "sleep 600")
    screen = term.waitFor(lambda s: "a-long-host-name" in s)
    assert all(len(line) <= 36 for line in screen.splitlines())
    for key in ("o once", "a always", "D deny always", "q quit"):
        assert key in " ".join(screen.split())


@pytest.mark.parametrize("leave", ["q", "C-c"])
def test_the_terminal_is_put_back_however_watch_ends(
    world: tuple[FakeRegistry, FakeControlServer, Tmux, str], leave: str
) -> None:
    _, server, term, directory = world
    after = os.path.join(directory, "stty")
    _watch(term, server.path, f"stty -a > {after}; echo watch-ended-$?; sleep 600")
    term.waitFor(lambda s: "WAITING: nothing" in s)
    term.keys(leave)
    screen = term.waitFor(lambda s: "watch-ended-0" in s)
    assert "WAITING" not in screen  # the alternate screen is gone
    modes = Path(after).read_text().split()
    assert "icanon" in modes and "echo" in modes


def test_when_the_service_stops_the_view_says_so_and_follows_it_again(
    world: tuple[FakeRegistry, FakeControlServer, Tmux, str],
) -> None:
    registry, server, term, _ = world
    registry.hold("old.example.org")
    _watch(term, server.path, "sleep 600")
    term.waitFor(lambda s: "old.example.org:443" in s)
    server.stop()
    term.waitFor(lambda s: "the service is not running; waiting for it" in s and "old.example.org" not in s)
    registry.held.clear()
    again = FakeControlServer(registry, server.path).start()
    try:
        registry.hold("example.org")
        term.waitFor(lambda s: "example.org:443" in s and "asking for unlisted hosts" in s)
    finally:
        again.stop()
