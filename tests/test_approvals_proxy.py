"""Asking the person about unlisted hosts (issue 28), end to end on loopback.

A real proxy (``ProxyHarness``: the documentation addresses bent to loopback
listeners, the address rules real), its registry, the control socket on a real
Unix socket, real curl as the agent's command and the real
``agentsandbox approve``/``deny``/``approvals`` as the person.  The registry's
timeouts run on a ``task.Clock`` so nothing here waits for a real timeout.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import struct
import sys
import tempfile
from typing import Any

from twisted.internet import threads
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.internet.utils import getProcessOutputAndValue
from twisted.trial.unittest import TestCase
from twisted.web.resource import Resource
from twisted.web.server import Site
from twisted.web.static import Data

from agentsandbox.approvals import controlSocket
from agentsandbox.controlpeer import namespacesOf
from agentsandbox.egress.approvals import ApprovalRegistry, configWriter
from agentsandbox.egress.control import ControlFactory, ControlService
from agentsandbox.egress.testing import FixedResolver, MappedDialer
from agentsandbox.loader import load
from agentsandbox.reload import ConfigHolder
from tests.support.dispatch_world import systemUsers, usersAvailable
from tests.support.egress_fixtures import (
    CURL,
    ProxyHarness,
    deferredTest,
    exchange,
    listen,
    reactor,
    waitFor,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONFIG = """\
# The person's own notes, kept by --always.
inject = []

[sandbox]
# hosts the agent reaches
domains = ["github.com"]

[proxy]
listen = "127.0.0.1:0"
unlisted = "ask"      # ask me
ask_timeout = 45
"""

#: The unlisted hosts: app.example.org is public (a documentation address bent to
#: a loopback server), inside.example.org resolves to a private address.
TABLE = {"app.example.org": ["192.0.2.20"], "inside.example.org": ["10.0.0.5"], "github.com": ["192.0.2.30"]}


class AskingTests(TestCase):
    async def _world(self) -> None:
        self.base = tempfile.mkdtemp(prefix="ask-")
        self.addCleanup(shutil.rmtree, self.base, True)
        self.home = os.path.join(self.base, "home")
        self.runtime = os.path.join(self.base, "run")
        os.makedirs(os.path.join(self.home, ".config", "agentsandbox"))
        os.makedirs(self.runtime, mode=0o700)
        self.env = {
            "HOME": self.home, "XDG_RUNTIME_DIR": self.runtime, "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "PYTHONPATH": REPO, "XDG_CONFIG_HOME": os.path.join(self.home, ".config"),
        }
        self.configFile = os.path.join(self.home, ".config", "agentsandbox", "config.toml")
        with open(self.configFile, "w") as f:
            f.write(CONFIG)
        self.holder = ConfigHolder(self.load())
        site = await listen(Site(_hello()))
        self.addCleanup(site.stopListening)
        dialer = MappedDialer(reactor)
        for address in ("192.0.2.20", "192.0.2.30", "10.0.0.5"):
            dialer.map(address, site.getHost().port)
        self.dialer = dialer
        self.harness = ProxyHarness(resolver=FixedResolver(TABLE), dialer=dialer, config=self.holder)
        self.clock = Clock()
        self.registry = ApprovalRegistry(
            lambda: self.holder.current, self.clock, self.harness.factory.record,
            configWriter(lambda: self.holder.current),
        )
        self.harness.factory.approvals = self.registry
        await self.harness.start()
        self.addCleanup(self.harness.stop)
        self.socket = controlSocket(self.runtime)
        self.control = ControlService(
            ControlFactory(self.registry, self.harness.factory.record, reference=namespacesOf(os.getpid())),
            self.socket, reactor,
        )
        self.control.startService()
        self.addCleanup(self.control.stopService)
        await waitFor(lambda: os.path.exists(self.socket), "the control socket")

    def load(self) -> Any:
        """The user's config as the service loads it (the watcher's part, in these tests)."""
        from agentsandbox import paths

        assert not os.path.exists(paths.SYSTEM_CONFIG), "these tests assume no machine config"
        return load(None, self.env)

    # ------------------------------------------------------------------ clients
    def curl(self, *args: str) -> Deferred[tuple[bytes, bytes, int]]:
        d: Deferred[tuple[bytes, bytes, int]] = getProcessOutputAndValue(
            CURL, ("--silent", "--show-error", "--noproxy", "", "--max-time", "60", *args), env=self.env
        )
        return d

    def viaConnect(self, host: str) -> Deferred[tuple[bytes, bytes, int]]:
        return self.curl("-p", "-x", f"http://127.0.0.1:{self.harness.port}", f"http://{host}/")

    def viaForward(self, host: str) -> Deferred[tuple[bytes, bytes, int]]:
        return self.curl("-x", f"http://127.0.0.1:{self.harness.port}", f"http://{host}/")

    def viaSocks(self, host: str) -> Deferred[tuple[bytes, bytes, int]]:
        return self.curl("--socks5-hostname", f"127.0.0.1:{self.harness.port}", f"http://{host}/")

    def cli(self, *args: str, prefix: tuple[str, ...] = (), env: dict[str, str] | None = None) -> Deferred[tuple[bytes, bytes, int]]:
        argv = (*prefix, sys.executable, "-m", "agentsandbox", *args)
        d: Deferred[tuple[bytes, bytes, int]] = getProcessOutputAndValue(
            argv[0], argv[1:], env={**self.env, **(env or {})}
        )
        return d

    async def held(self, count: int = 1) -> None:
        await waitFor(lambda: len(self.registry.held) == count, f"{count} held request(s)")

    def records(self, event: str) -> list[dict[str, Any]]:
        return [r for r in self.harness.records() if r["event"] == event]

    # ------------------------------------------------------------------ tests
    @deferredTest
    async def test_each_door_waits_and_approve_once_lets_it_through_and_the_next_is_asked_again(self) -> None:
        await self._world()
        for kind, request in (("connect", self.viaConnect), ("forward", self.viaForward), ("socks", self.viaSocks)):
            waiting = request("app.example.org")
            await self.held()
            self.assertEqual(self.dialer.dialled, [])  # nothing dialled (nor resolved) before the answer
            self.assertEqual(self.harness.resolver.lookups, [])
            listed = json.loads((await self.cli("approvals", "--json"))[0])
            self.assertEqual([(h["host"], h["kind"]) for h in listed["held"]], [("app.example.org", kind)])
            # The person sees what asks: curl, by its pid (egress/askers.py).
            self.assertRegex(listed["held"][0]["process"], r"^\d+ curl$")
            out, err, code = await self.cli("approve", "app.example.org", "--once")
            self.assertEqual(code, 0, err)
            self.assertIn(b"allow once: answered request", out)
            body, err, code = await waiting
            self.assertEqual((body, code), (b"hello\n", 0), err)
            self.dialer.dialled.clear()
            self.harness.resolver.lookups.clear()
        again = self.viaForward("app.example.org")
        await self.held()  # once was that request only
        await self.cli("deny", "app.example.org")
        await again
        decided = self.records("decided")
        self.assertEqual([(r["verdict"], r["scope"]) for r in decided], [("allow", "once")] * 3 + [("deny", "once")])
        self.assertRegex(decided[0]["by"], r"^agentsandbox approve \(pid \d+ python3?[.0-9]*, uid \d+\)$")
        table = (await self.cli("approvals"))[0].decode()
        self.assertIn('proxy.unlisted = "ask"', table)
        self.assertIn("app.example.org:80 forward: denied (deny once, by agentsandbox deny", table)

    @deferredTest
    async def test_deny_and_timeout_give_the_documented_words(self) -> None:
        await self._world()
        waiting = Deferred.fromCoroutine(
            exchange(self.harness.port, b"CONNECT app.example.org:443 HTTP/1.1\r\nHost: x\r\n\r\n")
        )
        await self.held()
        _, err, code = await self.cli("deny", "1")
        self.assertEqual(code, 0, err)
        answer = await waiting
        self.assertIn(b"HTTP/1.1 403 Forbidden", answer)
        self.assertIn(
            b"app.example.org:443 is not on sandbox.domains and the person refused it (deny once, by agentsandbox deny",
            answer,
        )
        self.assertIn(b"`agentsandbox approve app.example.org`", answer)
        refused = self.records("refused")[-1]
        self.assertIn(refused["reason"].encode(), answer)  # the same words in the audit log

        # Held again; the registry's clock decides when nobody answered.
        forward = self.viaForward("app.example.org")
        await self.held()
        self.clock.advance(45)
        body, _, _ = await forward
        self.assertIn(b"nobody answered within proxy.ask_timeout (45s)", body)
        self.assertIn(b"`agentsandbox approvals`, then `agentsandbox approve app.example.org`", body)
        self.assertEqual(self.records("timedout")[-1]["reason"] + "\n", body.decode())

    @deferredTest
    async def test_always_writes_the_line_with_comments_intact_and_a_new_request_passes_without_asking(self) -> None:
        await self._world()
        os.chmod(self.configFile, 0o640)
        waiting = self.viaSocks("app.example.org")
        await self.held()
        out, err, code = await self.cli("approve", "app.example.org", "--always")
        self.assertEqual(code, 0, err)
        self.assertEqual((await waiting)[0], b"hello\n")
        with open(self.configFile) as f:
            text = f.read()
        self.assertEqual(text, CONFIG.replace('domains = ["github.com"]', 'domains = ["github.com", "app.example.org"]'))
        self.assertEqual(stat.S_IMODE(os.stat(self.configFile).st_mode), 0o640)
        self.registry.stop()  # forget what the service remembered: only the file says yes now
        self.holder.swap(self.load())  # the watcher's part
        body, err, code = await self.viaConnect("app.example.org")
        self.assertEqual((body, code), (b"hello\n", 0), err)
        self.assertEqual(self.registry.held, [])
        # deny --always: written as a refusal the person can read, refused before any asking.
        out, err, code = await self.cli("deny", "inside.example.org", "--always")
        self.assertEqual(code, 0, err)
        self.assertIn(b"nothing was waiting", out)
        self.holder.swap(self.load())
        body, _, _ = await self.viaForward("inside.example.org")
        self.assertIn(b"is refused by 'inside.example.org' in sandbox.refused_domains", body)
        self.assertEqual(self.registry.held, [])

    @deferredTest
    async def test_address_rules_still_refuse_after_an_approve(self) -> None:
        await self._world()
        waiting = self.viaForward("inside.example.org")
        await self.held()
        await self.cli("approve", "inside.example.org")
        body, _, _ = await waiting
        self.assertIn(b"inside.example.org resolves to 10.0.0.5, which is", body)
        self.assertIn(b"sandbox.domains", body)
        self.assertEqual(self.dialer.dialled, [])
        # A private literal is never even asked.
        body, _, _ = await self.curl("-x", f"http://127.0.0.1:{self.harness.port}", "http://10.0.0.5/")
        self.assertEqual(self.registry.held, [])
        self.assertIn(b"10.0.0.5:80 is not on the sandbox's allow list", body)

    @deferredTest
    async def test_more_than_max_held_is_refused_at_once(self) -> None:
        await self._world()
        with open(self.configFile, "a") as f:
            f.write("max_held = 1\n")
        self.holder.swap(self.load())
        first = self.viaForward("app.example.org")
        await self.held()
        body, _, _ = await self.viaForward("app.example.org")
        self.assertIn(b"1 requests already wait for the person's answer, the most proxy.max_held allows", body)
        self.clock.advance(45)
        await first

    @deferredTest
    async def test_a_client_that_resets_while_held_withdraws_its_request_and_a_fin_alone_does_not(self) -> None:
        # A FIN alone is what a client that half-closes after its request and waits
        # for the answer sends, and what a killed curl sends: the two cannot be told
        # apart, so the request stays held (docs/approvals.md).  A reset is a client gone.
        await self._world()
        clients = []
        for _ in range(2):
            client = socket.create_connection(("127.0.0.1", self.harness.port))
            self.addCleanup(client.close)
            client.sendall(b"CONNECT app.example.org:443 HTTP/1.1\r\nHost: app.example.org:443\r\n\r\n")
            clients.append(client)
        await self.held(2)
        halfClosed, reset = clients
        halfClosed.shutdown(socket.SHUT_WR)
        reset.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        reset.close()
        await self.held(1)
        self.assertEqual([r["host"] for r in self.records("withdrawn")], ["app.example.org"])
        self.assertEqual(len(self.records("held")), 2)
        self.clock.advance(45)
        halfClosed.settimeout(30)
        answer = await threads.deferToThread(halfClosed.recv, 65536)
        self.assertIn(b"nobody answered within proxy.ask_timeout", answer)

    @deferredTest
    async def test_an_answer_from_under_an_agent_or_a_sandbox_is_refused_and_recorded(self) -> None:
        await self._world()
        waiting = self.viaForward("app.example.org")
        await self.held()
        for prefix, env, words in (
            # A process named claude runs the command as its child, as Claude Code runs Bash.
            (("bash", "-c", """exec -a claude bash -c '"$@"; rc=$?; exit $rc' inner "$@" """, "outer"), {}, b"is Claude Code"),
            ((), {"CLAUDECODE": "1"}, b"is a command Claude Code started (CLAUDECODE is set)"),
            (("bwrap", "--dev-bind", "/", "/", "--unshare-pid", "--unshare-net", "--"), {},
             b"runs in other net/mnt/pid namespaces than your session"),
        ):
            out, err, code = await self.cli("approve", "app.example.org", prefix=prefix, env=env)
            self.assertEqual(code, 1, (prefix, out, err))
            self.assertIn(b"agentsandbox approve: the answer was not taken: ", err)
            self.assertIn(words, err)
        self.assertEqual(len(self.registry.held), 1)  # still waiting for the person
        refusals = self.records("control")
        self.assertEqual(len(refusals), 3)
        self.assertIn("the answer was not taken", refusals[0]["reason"])
        # The person, from their own terminal, is heard; the list is for them too.
        await self.cli("approve", "app.example.org")
        self.assertEqual((await waiting)[0], b"hello\n")

    @deferredTest
    async def test_follow_streams_the_list_then_each_event(self) -> None:
        await self._world()
        client = (
            "import socket,sys;s=socket.socket(socket.AF_UNIX);s.connect(sys.argv[1]);"
            "s.sendall(b'{\"op\":\"follow\"}\\n');f=s.makefile('rb')\n"
            "for _ in range(3): sys.stdout.write(f.readline().decode())"
        )
        following = getProcessOutputAndValue(sys.executable, ("-c", client, self.socket), env=self.env)
        await waitFor(lambda: len(self.registry._observers) == 1, "the follower's subscription")
        waiting = self.viaForward("app.example.org")
        await self.held()
        await self.cli("approve", "app.example.org")
        await waiting
        out, err, code = await following
        self.assertEqual(code, 0, err)
        lines = [json.loads(line) for line in out.decode().splitlines()]
        self.assertEqual((lines[0]["ok"], lines[0]["mode"], lines[0]["held"]), (True, "ask", []))
        self.assertEqual([line["event"] for line in lines[1:]], ["held", "decided"])
        self.assertEqual(lines[2]["answer"]["scope"], "once")
        await waitFor(lambda: not self.registry._observers, "the follower's unsubscription")

    @deferredTest
    async def test_a_second_service_leaves_a_live_socket_alone_and_a_stale_one_is_replaced(self) -> None:
        await self._world()
        inode = os.stat(self.socket).st_ino
        second = ControlService(ControlFactory(self.registry), self.socket, reactor)
        second.startService()
        self.addCleanup(second.stopService)
        self.assertEqual(os.stat(self.socket).st_ino, inode)
        self.assertEqual((await self.cli("approvals"))[2], 0)
        await self.control.stopService()
        import socket

        stale = socket.socket(socket.AF_UNIX)
        stale.bind(self.socket)  # a file nobody listens on: a service that died
        stale.close()
        self.assertEqual((await self.cli("approvals"))[2], 1)  # nothing answers there
        self.control.startService()
        await waitFor(lambda: self.control.port is not None, "the control socket again")
        self.assertEqual((await self.cli("approvals"))[2], 0)

    @deferredTest
    async def test_the_socket_is_the_users_alone(self) -> None:
        await self._world()
        self.assertEqual(stat.S_IMODE(os.stat(self.socket).st_mode), 0o600)
        self.assertEqual(stat.S_IMODE(os.stat(os.path.dirname(self.socket)).st_mode), 0o700)
        missing = await self.cli("approvals", env={"XDG_RUNTIME_DIR": os.path.join(self.base, "nowhere")})
        self.assertEqual(missing[2], 1)
        self.assertIn(b"the agentsandbox service is not running", missing[1])
        why = usersAvailable()
        if why is not None:
            self.skipTest(why)
        # Another real user: the file mode stops them; opened up, SO_PEERCRED does.
        client = (
            "import socket,sys;s=socket.socket(socket.AF_UNIX);s.connect(sys.argv[1]);"
            's.sendall(b\'{"op":"list"}\\n\');print(s.recv(65536).decode())'
        )
        for d in (self.base, self.runtime):
            os.chmod(d, 0o755)
        with systemUsers(1) as (other,):
            argv = other.argv(sys.executable, "-c", client, self.socket)
            closed = await getProcessOutputAndValue(argv[0], argv[1:], env={"PATH": "/usr/bin:/bin"})
            self.assertIn(b"PermissionError", closed[1])
            os.chmod(os.path.dirname(self.socket), 0o755)
            os.chmod(self.socket, 0o666)
            opened = await getProcessOutputAndValue(argv[0], argv[1:], env={"PATH": "/usr/bin:/bin"})
        self.assertTrue(opened[0], opened)
        reply = json.loads(opened[0])
        self.assertEqual(reply["ok"], False)
        self.assertIn(f"this control socket answers only uid {os.getuid()}; uid {other.uid} asked", reply["error"])
        self.assertEqual(self.records("control")[-1]["client"].split()[-1], str(other.uid))


def _hello() -> Resource:
    root = Resource()
    page = Data(b"hello\n", "text/plain")
    root.putChild(b"", page)
    return root

