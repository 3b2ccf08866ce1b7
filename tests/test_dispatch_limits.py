"""What one user can make the shared dispatcher hold (issue 23, item 6).

- A registration-socket client that asks and never reads is not read either
  while its answers wait (``Client.paused``): in memory, with the dispatcher
  in this process on real sockets, the queue and the unread bytes are
  measured; then the client reads, and every question is answered.
- Unserved connections of one uid take at most ``REFUSING_PER_UID`` refusal
  slots, so another uid still gets its 503 (in memory too, on real loopback
  sockets, with the refusals' timers on a ``task.Clock`` that never moves).
- Two real users: one floods the dispatcher (a registration that asks for the
  status without reading, idle connections to the port, idle registration
  clients) while the other is served and, once unserved, refused with its
  503, each within a second; the dispatcher's RSS (``/proc/PID/status`` of the
  real dispatcher process) stays under twice its idle figure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from twisted.internet import reactor as _reactor
from twisted.internet.task import Clock
from twisted.trial.unittest import TestCase

from agentsandbox.egress.dispatch import (
    READ_SIZE,
    REFUSING_PER_UID,
    Client,
    DispatchService,
    makeService,
)
from agentsandbox.egress.dispatchwire import MAX_LINE, LineReader, encode
from tests.support.broker_support import waitFor
from tests.support.dispatch_world import DispatchWorld, UnixUser, systemUsers, usersAvailable
from tests.support.egress_fixtures import deferredTest, sleep
from tests.support.service_harness import LocalSite

reactor: Any = _reactor

STATUS = encode({"op": "status"})


# --------------------------------------------------------------------------- the line reader, one message at a time


def test_the_line_reader_gives_one_message_at_a_time_and_keeps_the_rest_as_bytes() -> None:
    r = LineReader()
    r.push(b'{"op":"register"}\n{"op":"status"}\n{"op"')
    assert r.next() == {"op": "register"}
    assert r.pending == len(b'{"op":"status"}\n{"op"')
    r.push(b':"x"}\n')
    assert [r.next(), r.next(), r.next()] == [{"op": "status"}, {"op": "x"}, None]
    assert r.pending == 0
    # An unfinished line past the limit is refused when it is pushed, a finished
    # one when it is reached.
    with pytest.raises(Exception, match="longer than"):
        LineReader().push(b"{" + b"x" * MAX_LINE)
    long = LineReader()
    long.push(b'{"op":"status"}\n{' + b"x" * MAX_LINE + b"}\n")
    assert long.next() == {"op": "status"}
    with pytest.raises(Exception, match="longer than"):
        long.next()


# --------------------------------------------------------------------------- in memory, on real sockets


def _registered(service: DispatchService) -> Client:
    (client,) = [c for c in service.dispatcher.clients if c.registered]
    return client


class QuestionsWithoutReadingTests(TestCase):
    @deferredTest
    async def test_a_client_that_never_reads_is_not_read_either(self) -> None:
        base = Path(tempfile.mkdtemp(prefix="dispatch-unread-"))
        path = str(base / "dispatch.sock")
        # This process registers: root's when the suite runs as root.
        service = makeService(reactor, 0, path, serveRoot=True, holdAfterStart=0)
        service.startService()
        self.addCleanup(service.stopService)
        sock = socket.socket(socket.AF_UNIX)
        self.addCleanup(sock.close)
        sock.connect(path)
        sock.sendall(encode({"op": "register"}))
        sock.setblocking(False)
        for _ in range(1000):
            if service.dispatcher.registrations:
                break
            await sleep(0)
        registration = _registered(service)
        # Questions, never reading the answers: 4 MiB of them unless the
        # dispatcher stops reading (and the kernel's buffers fill) first.
        chunk = STATUS * 1024
        sent = stalls = 0
        while sent < 4 << 20 and stalls < 100:
            try:
                sent += sock.send(chunk)
                stalls = 0
            except BlockingIOError:
                stalls += 1
                await sleep(0)
        asked = sent // len(STATUS)
        # The dispatcher holds one answer being sent and the bytes of one read.
        self.assertLessEqual(len(registration.outgoing), 1)
        self.assertLessEqual(registration.reader.pending, READ_SIZE + MAX_LINE)
        self.assertTrue(registration.paused)
        self.assertLess(sent, 4 << 20, "the dispatcher read every question while its answers waited")
        # Reading: the dispatcher reads again, and every whole question gets its answer.
        received = b""
        answers = 0
        for _ in range(100000):
            try:
                data = sock.recv(1 << 20)
            except BlockingIOError:
                await sleep(0)
                continue
            received += data
            *lines, received = received.split(b"\n")
            answers += sum(1 for line in lines if b'"op":"status"' in line)
            if answers >= asked:
                break
        self.assertEqual(answers, asked)
        self.assertFalse(registration.paused)
        self.assertEqual(len(registration.outgoing), 0)
        print(f"asked {asked} times ({sent} bytes) before the dispatcher stopped reading; all answered")


class _Owners:
    """The socket table as a test says it: the owner of each client port."""

    def __init__(self) -> None:
        self.uids: dict[int, int] = {}

    def ownersOf(self, pairs: list[tuple[tuple[str, int], tuple[str, int]]]) -> list[int | None]:
        return [self.uids.get(client[1]) for client, _ in pairs]


class _Accepting:
    """A dispatcher in this process on a ``task.Clock``, fed by a real loopback
    listener whose clients' owners the test names (``accept(uid)``)."""

    def __init__(self, test: TestCase, backlog: int, **options: Any) -> None:
        self.owners = _Owners()
        self.clock: Any = Clock()
        base = tempfile.mkdtemp(prefix="dispatch-limits-")
        test.addCleanup(shutil.rmtree, base, True)
        service = makeService(reactor, 0, os.path.join(base, "d.sock"), owners=self.owners, clock=self.clock, **options)
        self.dispatcher = service.dispatcher
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(backlog)
        self.opened: list[socket.socket] = [self.listener]
        test.addCleanup(self._closeSockets)
        test.addCleanup(self.dispatcher.closeAll)

    def _closeSockets(self) -> None:
        for s in self.opened:
            s.close()

    def accept(self, uid: int) -> socket.socket:
        """A new client connection owned by ``uid``, handed to the dispatcher as accepted."""
        client = socket.create_connection(self.listener.getsockname())
        accepted, _ = self.listener.accept()
        self.opened.append(client)
        self.owners.uids[client.getsockname()[1]] = uid
        self.dispatcher.connectionsAccepted([(accepted, client.getsockname(), self.listener.getsockname())])
        return client


class RefusalSlotsTests(TestCase):
    def test_one_uids_unanswered_connections_leave_slots_for_another(self) -> None:
        # The refusals' timers never fire here.
        world = _Accepting(self, 512, holdAfterStart=0)
        dispatcher, accept = world.dispatcher, world.accept

        # Uid 2001 opens more connections than there were refusal slots for
        # everyone (256 before this bound) and sends nothing.
        flood = [accept(2001) for _ in range(300)]
        # Uid 2002 still gets its answer.
        other = accept(2002)
        other.sendall(b"GET http://example.org/ HTTP/1.1\r\nHost: example.org\r\n\r\n")
        other.settimeout(5)
        # The dispatcher answers from the reactor: run its reads by hand.
        for refusal in [r for r in dispatcher.refusing if r.uid == 2002]:
            refusal.doRead()
        answer = other.recv(65536).decode()
        self.assertTrue(answer.startswith("HTTP/1.1 503"), answer)
        self.assertIn("uid 2002", answer)
        # Uid 2001 holds its bound of slots; the rest were closed unanswered.
        self.assertEqual(dispatcher.refusingByUid[2001], REFUSING_PER_UID)
        self.assertEqual(dispatcher.status()["unanswered"], {"2001": 300 - REFUSING_PER_UID})
        flood[-1].settimeout(5)
        self.assertEqual(flood[-1].recv(100), b"")
        # A slot that ends is free again: the bound counts what is held, not what was.
        for refusal in [r for r in dispatcher.refusing if r.uid == 2001][:5]:
            refusal.close()
        self.assertEqual(dispatcher.refusingByUid[2001], REFUSING_PER_UID - 5)
        accept(2001)
        self.assertEqual(dispatcher.refusingByUid[2001], REFUSING_PER_UID - 4)


class HoldAfterStartTests(TestCase):
    """Issue 26: after a dispatcher restart the services register again within about a
    second; a connection that waited in the socket's backlog meanwhile is held for its
    uid's service, not refused, and a uid that does not register gets its 503 once the
    hold is over."""

    def test_a_connection_before_its_service_registers_is_held_then_handed_on(self) -> None:
        world = _Accepting(self, 16, holdAfterStart=5, serveRoot=True)
        dispatcher, accept, clock, opened = world.dispatcher, world.accept, world.clock, world.opened
        me = os.getuid()

        mine = accept(me)
        theirs = accept(me + 1)
        self.assertEqual(dispatcher.status()["held"], 2)
        self.assertEqual(dispatcher.refusing, set())
        clock.advance(1.5)
        # This uid's service registers: the held connection goes to it.
        ours, dispatchers = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        opened += [ours, dispatchers]
        registration = Client(dispatcher, dispatchers)
        dispatcher.clients.add(registration)
        dispatcher.register(registration)
        ours.settimeout(5)
        data, fds, _, _ = socket.recv_fds(ours, 65536, 4)
        self.assertIn(b'"registered"', data)
        if not fds:
            data, fds, _, _ = socket.recv_fds(ours, 65536, 4)
        self.assertEqual(len(fds), 1)
        handed = socket.socket(fileno=fds[0])
        opened.append(handed)
        mine.sendall(b"x")
        handed.settimeout(5)
        self.assertEqual(handed.recv(1), b"x")
        self.assertEqual(dispatcher.status()["heldThenHanded"], 1)
        # The other uid never registers: its 503 comes when the hold is over, not before.
        self.assertEqual(dispatcher.refusing, set())
        clock.advance(3.5)
        self.assertEqual(dispatcher.status()["held"], 0)
        theirs.sendall(b"GET http://example.org/ HTTP/1.1\r\nHost: example.org\r\n\r\n")
        for refusal in list(dispatcher.refusing):
            refusal.doRead()
        theirs.settimeout(5)
        self.assertTrue(theirs.recv(65536).startswith(b"HTTP/1.1 503"))
        # After the hold, a uid without a service is refused at once.
        accept(me + 2)
        self.assertEqual(dispatcher.status()["held"], 0)
        self.assertEqual(len(dispatcher.refusing), 2)


# --------------------------------------------------------------------------- two real users


why = usersAvailable()

_FLOODER = textwrap.dedent(
    """
    import json, select, socket, sys, time
    path, port, idle, registrations, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    sent = 0
    if mode == "registered":
        s = socket.socket(socket.AF_UNIX)
        s.connect(path)
        s.sendall(b'{"op":"register"}\\n')
        print(s.recv(4096).decode().strip(), flush=True)
        # Ask for the status without ever reading the answers, until the
        # dispatcher stops reading (the send stalls for a second) or 4 MiB went.
        s.setblocking(False)
        chunk = b'{"op":"status"}\\n' * 4096
        while sent < 4 << 20:
            _, writable, _ = select.select([], [s], [], 1.0)
            if not writable:
                break
            try:
                sent += s.send(chunk)
            except BlockingIOError:
                pass
    # Idle connections to the proxy port and to the registration socket.
    held = []
    for _ in range(idle):
        held.append(socket.create_connection(("127.0.0.1", port)))
    for _ in range(registrations):
        r = socket.socket(socket.AF_UNIX)
        try:
            r.connect(path)
        except OSError:
            break
        held.append(r)
    print(json.dumps({"sent": sent, "idle": idle, "registrations": registrations}), flush=True)
    sys.stdin.read()
    """
)


def rss(pid: int) -> int:
    """Resident set size of ``pid`` in KiB, from /proc/PID/status."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def timedCurl(user: UnixUser, url: str, port: int) -> tuple[int | None, str, float]:
    """curl as ``user`` through the proxy: (status, body, seconds from connect to the end of the answer)."""
    out = subprocess.run(
        user.argv("curl", "-sS", "--noproxy", "", "--max-time", "20", "-o", "-", "-w", "\n%{http_code} %{time_total}",
                  "-x", f"http://127.0.0.1:{port}", url),
        capture_output=True, text=True, timeout=60, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
    )  # fmt: skip
    body, _, tail = out.stdout.rpartition("\n")
    code, seconds = tail.split()
    return (int(code) if code != "000" else None), body.strip(), float(seconds)


@pytest.fixture
def pair() -> Iterator[list[UnixUser]]:
    with systemUsers(2) as users:
        yield users


@pytest.mark.skipif(why is not None, reason=why or "")
def test_one_users_flood_leaves_the_dispatcher_bounded_and_the_other_user_served(pair: list[UnixUser]) -> None:
    flooder, other = pair
    site = LocalSite()
    base = tempfile.mkdtemp(prefix="dispatch-flood-")
    os.chmod(base, 0o755)
    world = DispatchWorld(base)
    flood: subprocess.Popen[str] | None = None
    try:
        world.configure(other, [f"127.0.0.1:{site.port}"])
        dispatcher = world.startDispatcher()
        world.startService(other)
        for _ in range(5):
            assert timedCurl(other, f"http://127.0.0.1:{site.port}/warm", world.port)[0] == 200
        idle = rss(dispatcher.pid)

        # The flooder registers, asks without reading, then holds idle
        # connections: more on the port than the refusal slots there were, and
        # registration clients past its bound.
        flood = subprocess.Popen(
            flooder.argv(sys.executable, "-c", _FLOODER, world.socket, str(world.port), "400", "40", "registered"),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert flood.stdout is not None
        assert json.loads(flood.stdout.readline())["uid"] == flooder.uid
        figures = json.loads(flood.stdout.readline())
        waitFor(lambda: world.status()["registered"], 30, "the dispatcher to answer")
        flooded = rss(dispatcher.pid)
        # Every finding is kept and asserted at the end, so a run says all that went wrong.
        problems: list[str] = []
        if not flooded < 2 * idle:
            problems.append(f"the unread-status flood ({figures['sent']} bytes) took the RSS from {idle} to {flooded} KiB")
        served = timedCurl(other, f"http://127.0.0.1:{site.port}/during", world.port)
        if served[0] != 200 or not served[2] < 1.0 or "/during" not in site.paths:
            problems.append(f"the other user, registered, got {served} during the flood")

        # Unserved, the flooder's idle connections take its refusal slots only:
        # the other user, unserved too, still gets its 503.
        flood.kill()
        flood.wait()
        waitFor(lambda: flooder.uid not in {r["uid"] for r in world.status()["registered"]}, 30, "the flooder's registration to end")
        before = world.status()["unserved"].get(str(flooder.uid), 0)
        flood = subprocess.Popen(
            flooder.argv(sys.executable, "-c", _FLOODER, world.socket, str(world.port), "400", "40", "unserved"),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert flood.stdout is not None
        flood.stdout.readline()
        waitFor(
            lambda: world.status()["unserved"].get(str(flooder.uid), 0) >= before + 400, 30, "the flooder's connections refused"
        )
        world.services[other.name].kill()
        waitFor(lambda: other.uid not in {r["uid"] for r in world.status()["registered"]}, 30, "the other user's registration to end")
        refused = timedCurl(other, f"http://127.0.0.1:{site.port}/unserved", world.port)
        if refused[0] != 503 or f"uid {other.uid}" not in refused[1] or not refused[2] < 1.0:
            problems.append(f"the other user, unserved, got {refused} instead of its 503 while the flooder held idle connections")
        after = rss(dispatcher.pid)
        if not after < 2 * idle:
            problems.append(f"the idle-connection flood took the RSS from {idle} to {after} KiB")
        state = world.status()
        print(
            f"dispatcher RSS: idle {idle} KiB, during the unread-status flood ({figures['sent']} bytes sent) "
            f"{flooded} KiB, after the idle-connection flood {after} KiB; the other user answered in "
            f"{served[2]:.3f} s (served) and {refused[2]:.3f} s (503); unanswered {state.get('unanswered')}"
        )
        assert problems == [], problems
        assert state["unanswered"].get(str(flooder.uid), 0) >= 400 - REFUSING_PER_UID, state
        assert re.search(rf"uid {flooder.uid} has {REFUSING_PER_UID} connections being refused already", dispatcher.output())
    finally:
        if flood is not None:
            flood.kill()
            flood.wait()
        world.stop()
        site.server.shutdown()
