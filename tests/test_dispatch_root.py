"""Root behind the dispatcher (issue 23, item 7): root's service registers only
when the machine's config says ``proxy.dispatch_root = true``, and a client that
closed before the lookup is never taken for root's.

The dispatcher runs as ``nobody`` (a real process, ``DispatchWorld``); root's
service is a real ``agentsandbox serve`` run as root; the other user is made
with ``useradd`` for the test.  A closed client's socket is a TIME_WAIT or
orphaned FIN_WAIT2 minisock, which the kernel reports as uid 0: to close the
client before the lookup, the dispatcher is stopped (SIGSTOP) while the kernel
completes the handshake, the client sends its request and closes, and only
then is it continued.
"""

from __future__ import annotations

import json
import os
import re
import signal
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
from twisted.internet.protocol import ServerFactory
from twisted.internet.task import Clock
from twisted.trial.unittest import TestCase

from agentsandbox import doctor
from agentsandbox.egress.dispatch import ROOT_KEY, makeService
from agentsandbox.egress.peer import CLOSED_REFUSAL
from agentsandbox.egress.register import REFUSED_RETRY, DispatchRegistration
from agentsandbox.loader import loads
from agentsandbox.paths import Paths
from tests.support.broker_support import waitFor
from tests.support.dispatch_world import ROOT, DispatchWorld, curl, systemUsers, usersAvailable
from tests.support.egress_fixtures import deferredTest
from tests.support.egress_fixtures import waitFor as waitForAsync
from tests.support.service_harness import LocalSite

reactor: Any = _reactor

why = usersAvailable()
pytestmark = pytest.mark.skipif(why is not None, reason=why or "")


@pytest.fixture
def base() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="dispatch-root-")
    os.chmod(path, 0o755)
    yield path


def _register(path: str) -> dict[str, Any]:
    """Registers this process (root) on ``path``; the dispatcher's first answer."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(30)
        s.connect(path)
        s.sendall(b'{"op":"register"}\n')
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = s.recv(4096)
            if not chunk:
                break
            reply += chunk
    answer: dict[str, Any] = json.loads(reply)
    return answer


def test_a_root_registration_is_refused_without_the_key_and_taken_with_it(base: str) -> None:
    site = LocalSite()
    without = DispatchWorld(os.path.join(base, "without"), serveRoot=False)
    with_ = DispatchWorld(os.path.join(base, "with"), serveRoot=True)
    try:
        for world in (without, with_):
            os.chmod(world.base, 0o755)
            world.configure(ROOT, [f"127.0.0.1:{site.port}"])
            world.startDispatcher()

        refused = _register(without.socket)
        assert refused["op"] == "error", refused
        config = os.path.join(without.base, "dispatcher.toml")
        assert refused["error"] == (
            f"registered as uid 0 (root), which this dispatcher does not serve: {ROOT_KEY} is not true in "
            f"{config} (set it and restart the dispatcher to serve root's sandboxes)"
        )
        assert without.dispatcher is not None
        without.dispatcher.waitFor(re.compile(r"uid 0 \(pid \d+\) registered as uid 0 \(root\), .*proxy\.dispatch_root"), 30, "the refusal logged")
        assert "uid 0 may not register: proxy.dispatch_root is not true in" in without.dispatcher.output()
        status = without.status()
        assert status["registered"] == [] and status["servesRoot"] is False
        # Root's own service is told so once, keeps its reason for status, and
        # does not hammer the dispatcher; root's sandboxes get a 503 naming the key.
        service = without.startService(ROOT, registers=False)
        service.waitFor(re.compile(r"the dispatcher refused this service: registered as uid 0 \(root\)"), 60, "root's service refused")
        answer = curl(ROOT, f"http://127.0.0.1:{site.port}/", port=without.port)
        assert answer.status == 503 and "does not serve uid 0 (root)" in answer.body and ROOT_KEY in answer.body, answer
        assert site.paths == []

        registered = _register(with_.socket)
        assert (registered["op"], registered["uid"]) == ("registered", 0), registered
        assert with_.status()["servesRoot"] is True
        with_.startService(ROOT)
        served = curl(ROOT, f"http://127.0.0.1:{site.port}/root", port=with_.port)
        assert served.status == 200 and site.paths == ["/root"], served
    finally:
        without.stop()
        with_.stop()
        site.server.shutdown()


_SEND_AND_CLOSE = textwrap.dedent(
    """
    import socket, sys
    s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
    s.sendall(("GET %s HTTP/1.1\\r\\nHost: 127.0.0.1\\r\\n\\r\\n" % sys.argv[2]).encode())
    print(s.getsockname()[1], flush=True)
    s.close()
    """
)


def _row(port: int) -> tuple[str, str, str] | None:
    """(state, uid, inode) of the row whose local port is ``port`` in /proc/net/tcp, read raw."""
    with open("/proc/net/tcp") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 9 and fields[0] != "sl" and fields[1].endswith(f":{port:04X}"):
                return fields[3], fields[7], fields[9]
    return None


def _state(pid: int) -> str:
    """The one-letter state of a process (``T``: stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0]


def test_a_client_that_closed_before_the_lookup_is_never_handed_to_roots_service(base: str) -> None:
    site = LocalSite()
    world = DispatchWorld(base, serveRoot=True)
    try:
        with systemUsers(1) as (bob,):
            # Root's allow list has the site; bob has no service (and no say).
            world.configure(ROOT, [f"127.0.0.1:{site.port}"])
            dispatcher = world.startDispatcher()
            world.startService(ROOT)
            assert curl(ROOT, f"http://127.0.0.1:{site.port}/root", port=world.port).status == 200
            assert site.paths == ["/root"]
            # The proxy writes a request's record when its connection closes,
            # which may be after curl has its answer: count once it is there.
            waitFor(lambda: len(world.audit(ROOT)) >= 1, 10, "root's record of its own request")
            records = len(world.audit(ROOT))
            os.kill(dispatcher.pid, signal.SIGSTOP)
            try:
                waitFor(lambda: _state(dispatcher.pid) == "T", 10, "the dispatcher to stop")
                out = subprocess.run(
                    bob.argv(sys.executable, "-c", _SEND_AND_CLOSE, str(world.port), f"http://127.0.0.1:{site.port}/bob"),
                    capture_output=True, text=True, timeout=60, check=True,
                )  # fmt: skip
                port = int(out.stdout)
                # Bob's socket is held by no process now.  Orphaned in FIN_WAIT1 it
                # keeps bob's uid until the (delayed) ACK of its FIN; then it is a
                # timewait minisock (FIN_WAIT2 or TIME_WAIT), which the kernel
                # reports as uid 0: the case that was handed to root.
                waitFor(lambda: _row(port) in (("05", "0", "0"), ("06", "0", "0")), 10, "bob's socket to be a timewait minisock")
            finally:
                os.kill(dispatcher.pid, signal.SIGCONT)
            closed = re.compile(rf"127\.0\.0\.1:{port}: (.*); closed, not handed on")
            # Either the dispatcher says it closed the connection, or bob's request
            # went through root's service to the site (what this test is against).
            try:
                waitFor(lambda: "/bob" in site.paths or closed.search(dispatcher.output()), 30, "the dispatcher's decision")
            except AssertionError as e:
                raise AssertionError(f"{e}; root's audit: {world.audit(ROOT)[records:]}; the dispatcher said: {dispatcher.output()[-800:]}") from None
            assert site.paths == ["/root"], "bob's request was forwarded under root's policy"
            line = closed.search(dispatcher.output())
            assert line is not None and line.group(1) == CLOSED_REFUSAL
            assert world.status()["closedPeers"] == 1
            # Nothing reached root's service: not even a record of a refusal.
            assert len(world.audit(ROOT)) == records
    finally:
        world.stop()
        site.server.shutdown()


# --------------------------------------------------------------------------- the service's side, in memory


class RefusedRegistrationTests(TestCase):
    @deferredTest
    async def test_a_refused_service_asks_again_after_REFUSED_RETRY(self) -> None:
        """Root's service refused (no key): said once, then asked again on the
        service's clock after ``REFUSED_RETRY``, not on the 1 s loss backoff."""
        base = Path(tempfile.mkdtemp(prefix="dispatch-refused-"))
        path = str(base / "dispatch.sock")
        service = makeService(reactor, 0, path, serveRoot=False, configSource="/etc/agentsandbox/config.toml", holdAfterStart=0)
        service.startService()
        self.addCleanup(service.stopService)
        clock: Any = Clock()
        registration = DispatchRegistration(ServerFactory(), path, reactor, clock=clock)
        registration.startService()
        self.addCleanup(registration.stopService)
        await waitForAsync(lambda: registration.lastError is not None, "the refusal")
        self.assertEqual(registration.state, "connecting")
        self.assertIn(f"{ROOT_KEY} is not true in /etc/agentsandbox/config.toml", registration.lastError or "")
        (retry,) = clock.getDelayedCalls()
        self.assertEqual(retry.getTime(), REFUSED_RETRY)
        self.assertEqual(registration.figures()["lastError"], registration.refusal)


# --------------------------------------------------------------------------- doctor


def test_doctor_tells_root_which_key_lets_it_register(tmp_path: Path) -> None:
    sock = tmp_path / "dispatch.sock"
    sock.write_text("")
    config = loads(b"[proxy]\nport = 3190\n", str(tmp_path / "c.toml"), Paths.fromEnvironment({"HOME": str(tmp_path)}))
    status = {"ports": ["127.0.0.1:3190"], "registered": [], "servesRoot": False, "answeredBy": 65534}
    env = {"AGENTSANDBOX_DISPATCH_SOCKET": str(sock)}
    check = doctor.checkDispatcher(config, env, None, ask=lambda _: status, uid=0, procDir=str(tmp_path))
    assert check.status == doctor.FAIL and "does not let uid 0 (root) register" in check.detail
    assert "proxy.dispatch_root = true" in (check.fix or "")
    # Another uid gets the usual fix, and root the usual one where root is served.
    other = doctor.checkDispatcher(config, env, None, ask=lambda _: status, uid=1000, procDir=str(tmp_path))
    assert other.status == doctor.FAIL and "no service of uid 1000 is registered" in other.detail
    served = doctor.checkDispatcher(config, env, None, ask=lambda _: {**status, "servesRoot": True}, uid=0, procDir=str(tmp_path))
    assert "no service of uid 0 is registered" in served.detail
