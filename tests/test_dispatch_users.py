"""Several real Unix users behind one dispatcher port (issue 11's "Must show").

Users A, B and C are made with ``useradd`` for the module (removed after, under
the system lock); the dispatcher runs as ``nobody``; A's and B's services run
as A and B (``agentsandbox serve``), registering through
``$AGENTSANDBOX_DISPATCH_SOCKET``; every client runs as its user (setpriv), so
the kernel's socket table names the right uid.  A allows host X only, B host Y
only; C has no service.

The tests share one world and run in file order; each leaves A and B
registered for the next.
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
import threading
from collections.abc import Iterator

import pytest

from harness.service_process import HelloServer
from tests.support.broker_support import waitFor
from tests.support.dispatch_world import (
    REGISTERED,
    DispatchWorld,
    UnixUser,
    curl,
    systemUsers,
    usersAvailable,
    waitRegistered,
)

why = usersAvailable()
pytestmark = pytest.mark.skipif(why is not None, reason=why or "")


class HelloX(HelloServer):
    BODY = b"hello from X\n"


class HelloY(HelloServer):
    BODY = b"hello from Y\n"


class World:
    def __init__(self, users: list[UnixUser]) -> None:
        self.a, self.b, self.c = users
        self.x, self.y = HelloX(), HelloY()
        self.base = tempfile.mkdtemp(prefix="dispatch-users-")
        os.chmod(self.base, 0o755)
        self.d = DispatchWorld(self.base)
        self.d.configure(self.a, [f"127.0.0.1:{self.x.port}"])
        self.d.configure(self.b, [f"127.0.0.1:{self.y.port}"])
        self.d.startDispatcher()
        self.d.startService(self.a)
        self.d.startService(self.b)

    @property
    def urlX(self) -> str:
        return f"http://127.0.0.1:{self.x.port}/"

    @property
    def urlY(self) -> str:
        return f"http://127.0.0.1:{self.y.port}/"

    def close(self) -> None:
        self.d.stop()
        self.x.close()
        self.y.close()


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    with systemUsers(3) as users:
        w = World(users)
        try:
            yield w
        finally:
            w.close()


def test_each_user_gets_their_own_policy_through_one_port(world: World) -> None:
    d = world.d
    a = curl(world.a, world.urlX, port=d.port)
    assert (a.status, a.body) == (200, "hello from X"), a
    refused = curl(world.a, world.urlY, port=d.port)
    assert refused.status == 403 and "not on the sandbox's allow list" in refused.body, refused
    b = curl(world.b, world.urlY, port=d.port)
    assert (b.status, b.body) == (200, "hello from Y"), b
    refusedB = curl(world.b, world.urlX, port=d.port)
    assert refusedB.status == 403 and "not on the sandbox's allow list" in refusedB.body, refusedB
    # Over SOCKS5 and over the IPv6 listener too.
    socksA = curl(world.a, world.urlX, port=d.port, socks=True)
    assert socksA.body == "hello from X", socksA

    overV6 = curl(world.a, world.urlX, port=d.port, proxyHost="[::1]")
    assert overV6.body == "hello from X", overV6

    def ports(user: UnixUser, event: str) -> set[int]:
        return {int(r["port"]) for r in d.audit(user) if r.get("event") == event}  # type: ignore[call-overload]

    # Each log holds its own user's decisions only.
    assert ports(world.a, "forward") == {world.x.port} and ports(world.a, "refused") == {world.y.port}
    assert ports(world.b, "forward") == {world.y.port} and ports(world.b, "refused") == {world.x.port}
    assert all(r.get("event") != "peer" for r in d.audit(world.a) + d.audit(world.b))
    status = d.status()
    assert {world.a.uid, world.b.uid} == d.registeredUids()
    assert "/" not in json.dumps(status["registered"])


def test_a_user_without_a_service_gets_503_and_a_socks_failure(world: World) -> None:
    d = world.d
    http = curl(world.c, world.urlX, port=d.port)
    assert http.status == 503, http
    assert f"uid {world.c.uid}" in http.body and "systemctl --user start agentsandbox" in http.body
    assert "agentsandbox serve" in http.body
    socks = curl(world.c, world.urlX, port=d.port, socks=True)
    assert socks.returncode == 97 and "(1)" in socks.stderr, socks  # SOCKS5 reply 1: general failure
    assert d.dispatcher is not None and d.dispatcher.proc.poll() is None
    assert d.status()["unserved"] == {str(world.c.uid): 2}
    assert f"uid {world.c.uid} has no registered service" in d.dispatcher.output()
    # Nobody else noticed.
    assert curl(world.a, world.urlX, port=d.port).status == 200


_CLAIM = textwrap.dedent(
    """
    import json, socket, sys
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])
    s.sendall(json.dumps({"op": "register", "uid": int(sys.argv[2])}).encode() + b"\\n")
    reply = b""
    while not reply.endswith(b"\\n"):
        reply += s.recv(4096)
    print(reply.decode().strip(), flush=True)
    if len(sys.argv) > 3:
        # Serve one handed-off connection: answer it ourselves.
        msg, fds, _, _ = socket.recv_fds(s, 4096, 1)
        print(msg.decode().strip(), len(fds), flush=True)
        conn = socket.socket(fileno=fds[0])
        conn.recv(65536)
        body = b"served by the second registration\\n"
        conn.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Length: %d\\r\\nConnection: close\\r\\n\\r\\n" % len(body) + body)
        conn.close()
    sys.stdin.read()
    """
)


def _claimer(user: UnixUser, world: World, claim: int, serve: bool = False) -> subprocess.Popen[str]:
    argv = user.argv(sys.executable, "-c", _CLAIM, world.d.socket, str(claim), *(["serve"] if serve else []))
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def test_a_registration_cannot_claim_another_uid(world: World) -> None:
    liar = _claimer(world.b, world, claim=world.a.uid)
    try:
        assert liar.stdout is not None
        reply = json.loads(liar.stdout.readline())
        # B said A's uid; the dispatcher registered B (SO_PEERCRED), and so
        # replaced B's own service, never A's.
        assert reply["op"] == "registered" and reply["uid"] == world.b.uid
        assert curl(world.a, world.urlX, port=world.d.port).body == "hello from X"
    finally:
        liar.kill()
        liar.wait()
    # B's service was replaced by that registration: it says so and stops
    # taking connections; a restart registers it again.
    b = world.d.services[world.b.name]
    b.waitFor(re.compile("another agentsandbox service of this user registered"), 30, "B to be told")
    assert curl(world.b, world.urlY, port=world.d.port).status == 503
    b.kill()
    world.d.startService(world.b)
    assert curl(world.b, world.urlY, port=world.d.port).body == "hello from Y"


def test_a_second_registration_replaces_the_first(world: World) -> None:
    second = _claimer(world.a, world, claim=world.a.uid, serve=True)
    try:
        assert second.stdout is not None
        assert json.loads(second.stdout.readline())["uid"] == world.a.uid
        got = curl(world.a, world.urlX, port=world.d.port)
        assert got.body == "served by the second registration", got
        assert second.stdout.readline().split() == ['{"op":"conn"}', "1"]
        first = world.d.services[world.a.name]
        first.waitFor(re.compile("another agentsandbox service of this user registered"), 30, "A told")
    finally:
        second.kill()
        second.wait()
    # The first got no more connections: with the second gone, A has no service.
    assert curl(world.a, world.urlX, port=world.d.port).status == 503
    world.d.services[world.a.name].kill()
    world.d.startService(world.a)
    assert curl(world.a, world.urlX, port=world.d.port).body == "hello from X"


def test_kill_9_of_a_service(world: World) -> None:
    d = world.d
    a = d.services[world.a.name]
    os.kill(a.pid, signal.SIGKILL)
    a.proc.wait(10)
    # The very next connection gets the 503: a hand-off to a dead registration
    # fails at once and becomes a refusal.
    gone = curl(world.a, world.urlX, port=d.port)
    assert gone.status == 503 and f"uid {world.a.uid}" in gone.body, gone
    assert curl(world.b, world.urlY, port=d.port).body == "hello from Y"
    d.startService(world.a)
    assert curl(world.a, world.urlX, port=d.port).body == "hello from X"


def test_dispatcher_restart_both_reregister(world: World) -> None:
    d = world.d
    assert d.dispatcher is not None
    offsets = {name: len(s.output()) for name, s in d.services.items()}
    d.dispatcher.terminate()
    d.startDispatcher()
    # Re-registration is bounded by the 1 s backoff cap: polled with a deadline.
    waitRegistered(d, {world.a.uid, world.b.uid}, 2.0, "both services to re-register")
    for name, service in d.services.items():
        service.waitFor(REGISTERED, 5, f"{name} re-registered", after=offsets[name])
    assert curl(world.a, world.urlX, port=d.port).body == "hello from X"
    assert curl(world.b, world.urlY, port=d.port).body == "hello from Y"


_FLOOD = textwrap.dedent(
    """
    import json, socket, sys, threading
    port, target, n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    results = []
    def one():
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=20)
            s.sendall(("GET %s HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n" % target).encode())
            data = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
            s.close()
            results.append(data.decode("latin-1"))
        except OSError as e:
            results.append("error: %s" % e)
    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        print(json.dumps(r))
    """
)


def test_200_connections_during_b_restart_never_reach_a(world: World) -> None:
    d = world.d
    before = len(d.audit(world.a))
    flood = subprocess.Popen(
        world.b.argv(sys.executable, "-c", _FLOOD, str(d.port), world.urlY, "200"),
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    restarter = threading.Thread(target=lambda: (d.services[world.b.name].terminate(), d.startService(world.b)))
    restarter.start()
    out, _ = flood.communicate(timeout=120)
    restarter.join(120)
    results = [json.loads(line) for line in out.splitlines()]
    assert len(results) == 200
    kinds = {"served": 0, "503": 0, "closed": 0}
    for r in results:
        assert "hello from X" not in r
        if r.startswith("HTTP/1.0 200") or r.startswith("HTTP/1.1 200"):
            assert "hello from Y" in r
            kinds["served"] += 1
        elif r.startswith("HTTP/1.1 503"):
            assert f"uid {world.b.uid}" in r or "is stopping" in r or "limit" in r, r
            kinds["503"] += 1
        else:
            # Cut by B's stopping service: never answered by anyone else.
            assert r == "" or r.startswith("error:"), r
            kinds["closed"] += 1
    # Not one reached A: A's audit log did not grow, no peer refusal in it.
    assert len(d.audit(world.a)) == before
    print("200 connections during B's restart:", kinds)
    waitFor(lambda: world.b.uid in d.registeredUids(), 10, "B registered again")
    assert curl(world.b, world.urlY, port=d.port).body == "hello from Y"


_BAD = textwrap.dedent(
    """
    import json, os, socket, sys, time
    path, what = sys.argv[1], sys.argv[2]
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    if what == "garbage":
        s.sendall(b"\\x00\\xffnot json at all\\n")
    elif what == "huge":
        try:
            s.sendall(b"{" + b"x" * (1 << 20))
        except OSError:
            pass
    elif what == "fds":
        r, w = os.pipe()
        socket.send_fds(s, [b'{"op":"register"}\\n'], [r, w])
    elif what == "unknown":
        s.sendall(b'{"op":"give-me-everything"}\\n')
    elif what == "silent":
        pass
    s.settimeout(30)
    got = b""
    try:
        while True:
            chunk = s.recv(4096)
            if not chunk:
                break
            got += chunk
    except OSError as e:
        got += b" (" + str(e).encode() + b")"
    print(got.decode("utf-8", "replace").strip())
    """
)


@pytest.mark.parametrize(
    ("what", "logged"),
    [
        ("garbage", "sent a message that is not JSON"),
        ("huge", "sent a message longer than 4096 bytes"),
        ("fds", "sent file descriptors to the dispatcher"),
        ("unknown", "sent an unknown op 'give-me-everything'"),
        ("silent", "connected and said nothing for 1s"),
    ],
)
def test_bad_input_on_the_registration_socket(world: World, what: str, logged: str) -> None:
    d = world.d
    assert d.dispatcher is not None
    offset = len(d.dispatcher.output())
    out = subprocess.run(
        world.c.argv(sys.executable, "-c", _BAD, d.socket, what), capture_output=True, text=True, timeout=60
    )
    line = d.dispatcher.waitFor(re.compile(f"uid {world.c.uid} .*{re.escape(logged)}"), 30, logged, offset)
    assert line
    if what != "silent":
        assert '"op":"error"' in out.stdout, out
    # No effect on anyone else: both still registered and served.
    assert {world.a.uid, world.b.uid} <= d.registeredUids()
    assert curl(world.a, world.urlX, port=d.port).body == "hello from X"
    assert curl(world.b, world.urlY, port=d.port).body == "hello from Y"


def test_doctor_and_status_as_a_registered_user(world: World) -> None:
    d = world.d
    dirs = d.dirs[world.a.name]
    env = dirs.env(extra={"AGENTSANDBOX_DISPATCH_SOCKET": d.socket, "AGENTSANDBOX_CONFIG": d.configs[world.a.name]})
    out = subprocess.run(world.a.argv(sys.executable, "-m", "agentsandbox", "status", "--json"), capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    proxy = json.loads(out.stdout)["proxy"]
    assert proxy["mode"] == "dispatcher" and proxy["dispatcher"]["state"] == "registered"
    assert proxy["dispatcher"]["uid"] == world.a.uid and proxy["dispatcher"]["adopted"] > 0
    doc = subprocess.run(world.a.argv(sys.executable, "-m", "agentsandbox", "doctor", "--json"), capture_output=True, text=True, env=env, timeout=120)
    checks = {c["name"]: c for c in json.loads(doc.stdout)}
    assert checks["dispatcher"]["status"] == "ok" and "registered with the dispatcher" in checks["dispatcher"]["detail"]
    assert checks["same user"]["status"] == "ok", checks["same user"]
    # C has no service: doctor says the dispatcher serves the port but not for C.
    d.configure(world.c, [f"127.0.0.1:{world.x.port}"])
    envC = d.dirs[world.c.name].env(extra={"AGENTSANDBOX_DISPATCH_SOCKET": d.socket, "AGENTSANDBOX_CONFIG": d.configs[world.c.name]})
    docC = subprocess.run(world.c.argv(sys.executable, "-m", "agentsandbox", "doctor", "--json"), capture_output=True, text=True, env=envC, timeout=120)
    checksC = {c["name"]: c for c in json.loads(docC.stdout)}
    assert checksC["dispatcher"]["status"] == "FAIL"
    assert f"no service of uid {world.c.uid} is registered" in checksC["dispatcher"]["detail"]


def test_dispatcher_absent_or_unreachable_in_doctor(world: World, tmp_path: object) -> None:
    d = world.d
    dirs = d.dirs[world.a.name]
    stale = os.path.join(d.base, "stale.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(stale)
    s.close()
    os.chmod(stale, 0o666)
    for path, status, text in ((stale, "FAIL", "unreachable"), (os.path.join(d.base, "none.sock"), "ok", "absent")):
        env = dirs.env(extra={"AGENTSANDBOX_DISPATCH_SOCKET": path, "AGENTSANDBOX_CONFIG": d.configs[world.a.name]})
        doc = subprocess.run(world.a.argv(sys.executable, "-m", "agentsandbox", "doctor", "--json"), capture_output=True, text=True, env=env, timeout=120)
        check = {c["name"]: c for c in json.loads(doc.stdout)}["dispatcher"]
        assert check["status"] == status and text in check["detail"], check
