"""The broker over a real spool, real inotify, real /proc and real processes (trial tests).

Carries over beekeeper's spool tests (reference §8) and adds the refusals the issue
names: two holders, another uid, a planted symlink, a FIFO, malformed and garbage
requests, leftovers at start, and a stopping broker.
"""

from __future__ import annotations

import io
import os
import shutil
import stat
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any, ClassVar

from twisted.internet import defer, reactor, task, threads
from twisted.trial import unittest

from agentsandbox.broker import client, procfs
from agentsandbox.broker import spool as wire
from agentsandbox.broker.server import STOPPING, BrokerService
from agentsandbox.broker.spool import Request
from agentsandbox.reload import ConfigHolder
from tests.support.broker_support import (
    Held,
    asyncTest,
    awaitExec,
    killQuietly,
    makeConfig,
    readReply,
    readText,
    spoolNames,
    tempBase,
    until,
)


class _Recorder(io.RawIOBase):
    """A BinaryIO the client streams into; readable from the test thread."""

    def __init__(self) -> None:
        self.data = b""
        self.lock = threading.Lock()

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        with self.lock:
            self.data += bytes(b)
        return len(b)

    def value(self) -> bytes:
        with self.lock:
            return self.data


class BrokerCase(unittest.TestCase):
    """Starts a BrokerService on the real reactor over a temp spool."""

    broker: ClassVar[dict[str, Any]] = {}
    serviceArgs: ClassVar[dict[str, Any]] = {}

    def setUp(self) -> Any:
        self.base = tempBase()
        self.addCleanup(shutil.rmtree, self.base, True)
        self.config = makeConfig(self.base, self.broker)
        self.spool = self.config.broker.spool
        return self.startBroker()

    def startBroker(self, **overrides: Any) -> Any:
        args: dict[str, Any] = {"holderInterval": 0.2, "killDelay": 0.5, "environ": dict(os.environ)}
        args.update(self.serviceArgs)
        args.update(overrides)
        self.holder = ConfigHolder(self.config)
        self.service = BrokerService(self.holder, reactor=reactor, **args)
        self.service.startService()
        self.addCleanup(self.service.stopService)
        return self.service.ready

    def call(self, request: Request, timeout: float | None = 20.0, output: Any = None) -> Any:
        return threads.deferToThread(client.call, request, self.spool, timeout, output)

    async def refused(self, request: Request) -> str:
        try:
            await self.call(request)
        except client.BrokerError as e:
            return str(e)
        raise AssertionError(f"{request} was not refused")

    async def rawReply(self, held: Held) -> wire.Reply:
        reply = await until(lambda: readReply(held.replyPath()), what="the reply")
        held.close()
        return reply  # type: ignore[no-any-return]


RUN = {
    "run": {
        "slow": {
            "argv": [
                "/bin/sh",
                "-c",
                'i=0; while [ ! -e "$1" ] && [ $i -lt 2000 ]; do sleep 0.01; i=$((i+1)); done; '
                "echo out; echo err >&2; exit 1",
                "slow",
            ],
            "args": ["/tmp/[A-Za-z0-9._/-]+"],
            "stream": False,
        },
        "talk": {
            "argv": [
                "/bin/sh",
                "-c",
                'echo one; i=0; while [ ! -e "$1" ] && [ $i -lt 2000 ]; do sleep 0.01; i=$((i+1)); done; '
                "echo two; echo e >&2; exit 2",
                "talk",
            ],
            "args": ["/tmp/[A-Za-z0-9._/-]+"],
        },
        "linger": {
            # Writes its pid, notes SIGTERM, and lives at most 20 s.
            "argv": [
                "/bin/sh",
                "-c",
                'echo $$ > "$1"; trap \'echo term >> "$1"; exit 143\' TERM; '
                "i=0; while [ $i -lt 400 ]; do sleep 0.05; i=$((i+1)); done",
                "linger",
            ],
            "args": ["/tmp/[A-Za-z0-9._/-]+"],
        },
        "stubborn": {
            # Ignores SIGTERM: only the SIGKILL after killDelay ends it.
            "argv": [
                "/bin/sh",
                "-c",
                "trap '' TERM; echo $$ > \"$1\"; "
                "i=0; while [ $i -lt 400 ]; do sleep 0.05; i=$((i+1)); done",
                "stubborn",
            ],
            "args": ["/tmp/[A-Za-z0-9._/-]+"],
        },
        "quick": {
            "argv": ["/bin/sh", "-c", 'echo "$1"; pwd; echo "V=${V:-unset} W=${W:-unset} C=${C:-unset}"', "q"],
            "args": ["[a-z]+"],
            "env": ["PATH", "V"],
            "caller_env": ["C"],
        },
    }
}


class SpoolTests(BrokerCase):
    broker = RUN

    @asyncTest
    async def test_answersAsTheHolder(self) -> None:
        """Reference: TestAskAnswersAsTheHolder (pid, exact request, error text, empty spool)."""
        seen: list[Any] = []

        class Spy:
            name = "spy"

            def validate(self, request: Request, config: Any) -> Request:
                return request

            def originKeys(self, plan: Any) -> tuple[str, ...]:
                return ()

            def perform(self, plan: Any, call: Any, host: Any) -> Any:
                seen.append((call.origin.pid, plan))
                if plan.args == ("refuse",):
                    from agentsandbox.broker.ops import OpError

                    return defer.fail(OpError("refused here"))
                return defer.succeed(wire.Reply(out=b"fine"))

        self.service.ops = {"spy": Spy()}
        reply = await self.call(Request(op="spy", args=("a", "b c")))
        self.assertEqual(reply.out, b"fine")
        self.assertEqual(seen[0], (os.getpid(), Request(op="spy", args=("a", "b c"))))
        error = await self.refused(Request(op="spy", args=("refuse",)))
        self.assertEqual(error, "refused here")
        self.assertEqual(spoolNames(self.spool), [])

    @asyncTest
    async def test_refusesARequestNobodyHolds(self) -> None:
        held = Held(self.spool, Request(op="ping").toJSON())
        os.close(held.fd)
        held.fd = -1
        held.send()
        reply = await self.rawReply(held)
        self.assertIn("held by 0 processes", reply.error or "")

    @asyncTest
    async def test_refusesTwoHolders(self) -> None:
        held = Held(self.spool, Request(op="ping").toJSON())
        # A second process holds the very same file (fd 3), as a forked child would.
        other = subprocess.Popen(
            ["/bin/sh", "-c", 'exec 3<"$1"; echo ready; exec sleep 30', "sh", held.base + wire.TMP],
            stdout=subprocess.PIPE,
        )
        self.addCleanup(killQuietly, other)
        awaitExec(other)
        reply = await self.rawReply(held.send())
        self.assertIn("held by 2 processes", reply.error or "")

    @asyncTest
    async def test_refusesAnotherUsersFile(self) -> None:
        if os.getuid() != 0:
            raise unittest.SkipTest("needs root to give a request file to another uid (nobody)")
        held = Held(self.spool, Request(op="ping").toJSON())
        os.fchown(held.fd, 65534, 65534)
        reply = await self.rawReply(held.send())
        self.assertIn("owned by uid 65534", reply.error or "")

    @asyncTest
    async def test_refusesASymlink(self) -> None:
        target = os.path.join(self.base, "target.json")
        with open(target, "wb") as f:
            f.write(Request(op="ping").toJSON())
        rid = wire.newId()
        base = os.path.join(self.spool, rid)
        os.symlink(target, base + wire.TMP)
        keep = os.open(target, os.O_RDONLY)
        self.addCleanup(os.close, keep)
        os.rename(base + wire.TMP, base + wire.REQ)
        reply = await until(lambda: readReply(base + wire.REPLY), what="the reply")
        self.assertIn("symlink", reply.error)

    @asyncTest
    async def test_refusesAFifoWithoutHanging(self) -> None:
        rid = wire.newId()
        base = os.path.join(self.spool, rid)
        os.mkfifo(base + wire.TMP, 0o600)
        os.rename(base + wire.TMP, base + wire.REQ)
        reply = await until(lambda: readReply(base + wire.REPLY), what="the reply")
        self.assertIn("not a regular file", reply.error)
        # Still serving.
        self.assertEqual((await self.call(Request(op="ping"))).error, None)

    @asyncTest
    async def test_refusesAnOversizedRequest(self) -> None:
        held = Held(self.spool, b'{"op": "ping", "args": ["' + b"x" * wire.REQUEST_LIMIT + b'"]}')
        reply = await self.rawReply(held.send())
        self.assertEqual(reply.error, f"request over {wire.REQUEST_LIMIT} bytes")

    @asyncTest
    async def test_malformedRequests(self) -> None:
        cases = {
            b"not json": "malformed request",
            b"[1, 2]": "not a JSON object",
            b'{"args": []}': "no 'op'",
            b'{"op": "ping", "evil": 1}': "unknown field 'evil'",
            b'{"op": "run", "args": "x"}': "'args' must be a list",
            b'{"op": "run", "args": [1]}': "args[0] must be a string",
            b'{"op": "run", "args": ["a\\u0000b"]}': "NUL",
            b'{"op": "sign", "input": "***"}': "not base64",
            b'{"op": "ping", "stream": "yes"}': "'stream' must be a bool",
            b"\xff\xfe": "not UTF-8",
            b'{"op": "exec"}': "unknown op 'exec'",
        }
        for raw, expected in cases.items():
            reply = await self.rawReply(Held(self.spool, raw).send())
            self.assertIn(expected, reply.error or "", raw)

    @asyncTest
    async def test_badArgumentsForEveryOp(self) -> None:
        big = b"x" * (wire.SIGN_PAYLOAD_LIMIT + 1)
        cases = [
            (Request(op="ping", args=("x",)), "ping takes no arguments"),
            (Request(op="status", input=b"x"), "status takes no arguments"),
            (Request(op="sign", args=("--status-fd=2", "-bsau", "K")), "needs the payload"),
            (Request(op="sign", args=("--status-fd=2", "-bsau", "K"), input=big), "over 524288 bytes"),
            (Request(op="sign", args=("--verify", "x"), input=b"p"), "signs only git's gpg call"),
            (Request(op="sign", args=("--status-fd=2", "-bsau", "-x"), input=b"p"), "starts with '-'"),
            (Request(op="sign", args=("--status-fd=2", "-bsau", "a\nb"), input=b"p"), "control character"),
            (Request(op="sign", args=("--status-fd=2", "-bsau", "K"), input=b"p", key="k"), "no 'key'"),
            (Request(op="sign", args=("-Y", "sign", "-n", "git", "-f", "k"), input=b"p"), "broker.sign.ssh_key"),
            (Request(op="sign", args=("-Y", "sign", "-n", "file", "-f", "k"), input=b"p"), "signs only git's ssh call"),
            (Request(op="run"), "needs the name of a host command"),
            (Request(op="run", args=("nosuch",)), "[broker.run.nosuch]"),
            (Request(op="run", args=("quick",)), "takes 1 argument(s), got 0"),
            (Request(op="run", args=("quick", "a", "b")), "takes 1 argument(s), got 2"),
            (Request(op="run", args=("quick", "A;rm")), "broker.run.quick.args[0]"),
            (Request(op="run", args=("quick", "a"), input=b"x"), "only a command name"),
            (Request(op="scope", args=("x",)), "only memory and cpu"),
            (Request(op="scope", memory="lots"), "not a size"),
            (Request(op="scope", memory="9G"), "scope.memory_max"),
            (Request(op="scope", cpu="0%"), "not a CPU percentage"),
            (Request(op="kubeconfig"), "exactly one context"),
            (Request(op="kubeconfig", args=("a", "b")), "exactly one context"),
            (Request(op="kubeconfig", args=("-h",)), "not a kubeconfig context name"),
            (Request(op="kubeconfig", args=("a b",)), "not a kubeconfig context name"),
            (Request(op="kubeconfig", args=("kind-lab",)), "set broker.kubeconfig"),
            (Request(op="exec"), "unknown op 'exec'"),
        ]
        for request, expected in cases:
            error = await self.refused(request)
            self.assertIn(expected, error, request)
        self.assertEqual(spoolNames(self.spool), [])
        status = await self.call(Request(op="status"))
        import json

        counts = json.loads(status.out)["requests"]
        self.assertEqual(counts["sign"]["error"], 8)
        self.assertEqual(counts["(unknown)"]["error"], 1)

    @asyncTest
    async def test_withoutABroker(self) -> None:
        await self.service.stopService()
        with self.assertRaises(client.NoBroker) as caught:
            await self.call(Request(op="ping"), timeout=0.05)
        self.assertIn(self.spool, str(caught.exception))
        self.assertEqual(spoolNames(self.spool), [])

    @asyncTest
    async def test_callsAreAnsweredSideBySide(self) -> None:
        """Reference: TestCallAnswersOutputSideBySide."""
        gate = os.path.join(self.base, "gate")
        slow = self.call(Request(op="run", args=("slow", gate)))
        await until(lambda: any(n.endswith(".req") for n in os.listdir(self.spool)), what="the slow call")
        await self.call(Request(op="ping"))
        self.assertFalse(slow.called)
        open(gate, "w").close()
        reply = await slow
        self.assertEqual((reply.out, reply.err, reply.code), (b"out\n", b"err\n", 1))

    @asyncTest
    async def test_streamCopiesOutputWhileTheCallRuns(self) -> None:
        gate = os.path.join(self.base, "gate")
        out = _Recorder()
        done = self.call(Request(op="run", args=("talk", gate), stream=True), None, out)
        await until(lambda: out.value() == b"one\n", what="the first line")
        self.assertFalse(done.called)
        open(gate, "w").close()
        reply = await done
        self.assertEqual(out.value(), b"one\ntwo\n")
        self.assertEqual((reply.out, reply.err, reply.code), (b"", b"e\n", 2))
        self.assertEqual(spoolNames(self.spool), [])

    def _requester(self, request: Request) -> tuple[subprocess.Popen[bytes], str]:
        """A ``sh`` that holds a request file on fd 3, as a requester that can be killed."""
        held = Held(self.spool, request.toJSON())
        sh = subprocess.Popen(
            ["/bin/sh", "-c", 'exec 3<"$1"; echo ready; exec sleep 60', "sh", held.base + wire.TMP],
            stdout=subprocess.PIPE,
        )
        self.addCleanup(killQuietly, sh)
        awaitExec(sh)
        held.close()
        held.send()
        return sh, held.base

    @asyncTest
    async def test_aStreamedCallEndsWithItsRequester(self) -> None:
        mark = os.path.join(self.base, "mark")
        sh, base = self._requester(Request(op="run", args=("linger", mark), stream=True))
        await until(lambda: os.path.exists(base + wire.OUT) and os.path.exists(mark), what="the call")
        sh.kill()
        sh.wait()
        await until(lambda: "term" in readText(mark), what="SIGTERM to the host command")
        await until(lambda: not self.service.inFlight, what="the call to end")
        self.assertEqual(spoolNames(self.spool), [])
        self.assertEqual(self.service.stats.counts["run"], {"dropped": 1})

    @asyncTest
    async def test_sigkillFollowsWhenSigtermIsIgnored(self) -> None:
        mark = os.path.join(self.base, "mark")
        sh, _ = self._requester(Request(op="run", args=("stubborn", mark), stream=True))
        await until(lambda: readText(mark).strip(), what="the call")
        pid = int(readText(mark))
        sh.kill()
        sh.wait()
        await until(lambda: not _alive(pid), what="SIGKILL after killDelay")
        await until(lambda: not self.service.inFlight, what="the call to end")
        self.assertEqual(spoolNames(self.spool), [])


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] != "Z"
    except OSError:
        return False


class DroppedAnswerTests(BrokerCase):
    broker = RUN
    # The watcher never fires here: the final holder check alone must drop the answer.
    serviceArgs: ClassVar[dict[str, Any]] = {"holderInterval": 3600.0}

    @asyncTest
    async def test_anAnswerWithoutItsRequesterIsDropped(self) -> None:
        gate = os.path.join(self.base, "gate")
        sh, _ = self._requesterFor(Request(op="run", args=("slow", gate)))
        await until(lambda: self.service.inFlight, what="the call to start")
        sh.kill()
        sh.wait()
        open(gate, "w").close()
        await until(lambda: not self.service.inFlight, what="the call to end")
        self.assertEqual(spoolNames(self.spool), [])
        self.assertEqual(self.service.stats.counts["run"], {"dropped": 1})

    # Borrowed: it uses only BrokerCase's parts, but its self is typed SpoolTests.
    _requesterFor: Callable[..., tuple[subprocess.Popen[bytes], str]] = SpoolTests._requester


class OriginTests(unittest.TestCase):
    def test_originKeepsOnlyTheNamedVariables(self) -> None:
        base = tempBase()
        self.addCleanup(shutil.rmtree, base, True)
        proc = subprocess.Popen(
            ["/bin/sh", "-c", "echo ready; exec sleep 30"],
            cwd=base,
            env={"KEEP": "yes", "DROP": "secret", "PATH": os.defpath},
            stdout=subprocess.PIPE,
        )
        self.addCleanup(killQuietly, proc)
        awaitExec(proc)
        got = procfs.origin("/proc", proc.pid, ["KEEP", "ABSENT"])
        self.assertEqual(got.cwd, os.path.realpath(base))
        self.assertEqual(got.env, {"KEEP": "yes"})
        self.assertFalse(got.sandboxed)

    def test_sandboxedMeansAnotherMountNamespace(self) -> None:
        unshare = shutil.which("unshare")
        if unshare is None or os.getuid() != 0:
            raise unittest.SkipTest("needs root and unshare(1) to make a mount namespace")
        proc = subprocess.Popen(
            [unshare, "--mount", "/bin/sh", "-c", "echo ready; exec sleep 30"], stdout=subprocess.PIPE
        )
        self.addCleanup(killQuietly, proc)
        awaitExec(proc)
        self.assertTrue(procfs.sandboxed("/proc", proc.pid))
        self.assertFalse(procfs.sandboxed("/proc", os.getpid()))

    def test_holdersAndHolds(self) -> None:
        base = tempBase()
        self.addCleanup(shutil.rmtree, base, True)
        path = os.path.join(base, "f")
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        self.addCleanup(os.close, fd)
        st = os.fstat(fd)
        self.assertEqual(procfs.holders("/proc", st.st_dev, st.st_ino), [os.getpid()])
        self.assertTrue(procfs.holds("/proc", os.getpid(), st.st_dev, st.st_ino))
        # Processes of another uid are never counted.
        self.assertEqual(procfs.holders("/proc", st.st_dev, st.st_ino, uid=os.getuid() + 4242), [])
        # An empty proc dir finds nobody.
        self.assertEqual(procfs.holders(base, st.st_dev, st.st_ino), [])


class BurstTests(BrokerCase):
    @asyncTest
    async def test_aThousandGarbageRequestsLeaveTheBrokerServing(self) -> None:
        garbage = [
            b"\x00\x01garbage",
            b"{",
            b'{"op": 7}',
            b'{"op": "nope"}',
            b'{"op": "run", "args": ["x"]}',
            Request(op="ping").toJSON(),  # well formed but held by nobody
        ]
        rids = []
        for i in range(1000):
            rid = wire.newId()
            base = os.path.join(self.spool, rid)
            if i % 50 == 7:
                os.mkfifo(base + wire.TMP)
            elif i % 50 == 13:
                os.symlink("/etc/passwd", base + wire.TMP)
            else:
                with open(base + wire.TMP, "wb") as f:
                    f.write(garbage[i % len(garbage)])
            os.rename(base + wire.TMP, base + wire.REQ)
            rids.append(rid)
        reply = await self.call(Request(op="ping"), timeout=60.0)
        self.assertIsNone(reply.error)

        def allAnswered() -> bool:
            return all(os.path.exists(os.path.join(self.spool, r + wire.REPLY)) for r in rids)

        await until(allAnswered, 60.0, "every garbage request to be answered")
        for rid in rids:
            answer = readReply(os.path.join(self.spool, rid + wire.REPLY))
            assert answer is not None
            self.assertIsNotNone(answer.error)
        self.assertIsNone((await self.call(Request(op="ping"))).error)


class LifecycleTests(BrokerCase):
    broker = RUN

    def setUp(self) -> Any:
        self.base = tempBase()
        self.addCleanup(shutil.rmtree, self.base, True)
        self.config = makeConfig(self.base, self.broker)
        self.spool = self.config.broker.spool
        os.makedirs(self.spool, mode=0o755)

    @asyncTest
    async def test_leftoversAreCleanedAtStartAndTheSpoolMadePrivate(self) -> None:
        stale = wire.newId()
        for suffix in (wire.REQ, wire.REPLY, wire.OUT, wire.TMP, wire.REPLY_TMP):
            with open(os.path.join(self.spool, stale + suffix), "wb") as f:
                f.write(b"{}")
        with open(os.path.join(self.spool, "not-ours.txt"), "wb") as f:
            f.write(b"x")
        live = Held(self.spool, Request(op="ping").toJSON())
        await self.startBroker()
        self.assertEqual(stat.S_IMODE(os.stat(self.spool).st_mode), 0o700)
        self.assertEqual(
            sorted(n for n in os.listdir(self.spool) if stale in n), [], "stale files removed"
        )
        self.assertTrue(os.path.exists(os.path.join(self.spool, "not-ours.txt")))
        self.assertIn(live.rid + wire.TMP, os.listdir(self.spool))
        live.send()
        reply = await until(lambda: readReply(live.replyPath()), what="the live request's reply")
        self.assertIsNone(reply.error)
        live.close()

    @asyncTest
    async def test_stoppingAnswersInFlightRequests(self) -> None:
        await self.startBroker()
        gate = os.path.join(self.base, "gate")
        slow = self.call(Request(op="run", args=("slow", gate)))
        await until(lambda: self.service.inFlight, what="the call to start")
        await until(lambda: self.service.host.running, what="the host command to start")
        await self.service.stopService()
        with self.assertRaises(client.BrokerError) as caught:
            await slow
        self.assertEqual(str(caught.exception), STOPPING)
        self.assertEqual(self.service.host.running, set())

    @asyncTest
    async def test_theRescanFindsWhatInotifyMissed(self) -> None:
        clock = task.Clock()
        await self.startBroker(watch=False, clock=clock, rescanInterval=5.0)
        pending = self.call(Request(op="ping"), timeout=30.0)
        await until(lambda: any(n.endswith(wire.REQ) for n in os.listdir(self.spool)), what="the request")
        self.assertFalse(pending.called)
        clock.advance(5.0)
        reply = await pending
        self.assertIsNone(reply.error)


class RunOpTests(BrokerCase):
    broker = RUN

    @asyncTest
    async def test_environmentIsDenyByDefaultAndCwdIsTheRequesters(self) -> None:
        env = dict(os.environ, V="from-host", W="never", C="from-caller", AGENTSANDBOX_SPOOL=self.spool)
        env["PYTHONPATH"] = os.getcwd()
        workdir = os.path.join(self.base, "work")
        os.makedirs(workdir)
        from twisted.internet.utils import getProcessOutputAndValue

        self.service.environ["V"] = "from-host"
        self.service.environ["W"] = "never"
        out, err, code = await getProcessOutputAndValue(
            sys.executable, ["-m", "agentsandbox", "host", "quick", "hello"], env=env, path=workdir
        )
        self.assertEqual(code, 0, err)
        self.assertEqual(
            out.decode().splitlines(),
            ["hello", os.path.realpath(workdir), "V=from-host W=unset C=from-caller"],
        )

    @asyncTest
    async def test_aCwdThePolicyHidesIsRefused(self) -> None:
        # The home itself opens nothing (policy: a cwd holding a closed directory), and
        # a sandbox.deny path is closed even as a cwd.
        denied = os.path.join(self.base, "denied")
        os.makedirs(denied)
        self.config = makeConfig(self.base, self.broker, sandbox={"deny": [denied]})
        await self.service.stopService()
        # The fixture home lies in /tmp; a TMPDIR elsewhere keeps "the temp dir" rule out.
        await self.startBroker(environ=dict(os.environ, TMPDIR=os.path.join(self.base, "tmp")))
        env = dict(os.environ, AGENTSANDBOX_SPOOL=self.spool, PYTHONPATH=os.getcwd())
        from twisted.internet.utils import getProcessOutputAndValue

        for cwd in (self.config.paths.home, denied):
            out, err, code = await getProcessOutputAndValue(
                sys.executable, ["-m", "agentsandbox", "host", "quick", "hello"], env=env, path=cwd
            )
            self.assertEqual(code, 1)
            self.assertIn(f"would run in {cwd}, which the policy does not", err.decode())
            self.assertIn("sandbox.read", err.decode())
            self.assertEqual(out, b"")


class TimeoutTests(BrokerCase):
    broker: ClassVar[dict[str, Any]] = {
        "run": {
            "hang": {
                "argv": [
                    "/bin/sh",
                    "-c",
                    "echo partial; i=0; while [ $i -lt 400 ]; do sleep 0.05; i=$((i+1)); done",
                ],
                "timeout": 0.3,
                "stream": False,
            }
        }
    }

    @asyncTest
    async def test_aHostCommandThatOverrunsIsEnded(self) -> None:
        error = await self.refused(Request(op="run", args=("hang",)))
        self.assertIn("timed out after 0.3s (broker.run.hang.timeout)", error)
        self.assertEqual(self.service.host.running, set())

    @asyncTest
    async def test_hostShowsWhatATimedOutCommandMade(self) -> None:
        from twisted.internet.utils import getProcessOutputAndValue

        env = dict(os.environ, AGENTSANDBOX_SPOOL=self.spool, PYTHONPATH=os.getcwd())
        out, err, code = await getProcessOutputAndValue(
            sys.executable, ["-m", "agentsandbox", "host", "hang"], env=env, path=self.base
        )
        self.assertEqual((out, code), (b"partial\n", 1))
        self.assertIn(b"timed out after 0.3s", err)



class ReloadTests(BrokerCase):
    """The broker follows the holder it was built with (BrokerCase hands it one): nobody sets its policy or killDelay from outside."""

    broker = RUN
    serviceArgs: ClassVar[dict[str, Any]] = {"killDelay": 30.0, "stopGrace": 0.25}

    def test_aSwapReachesTheBrokersOwnPolicy(self) -> None:
        project = os.path.join(self.base, "home", "project")
        os.makedirs(project)
        self.assertTrue(self.service.host.policy.readable(project, project))
        self.holder.swap(replace(self.config, sandbox=replace(self.config.sandbox, deny=(project,))))
        self.assertFalse(self.service.host.policy.readable(project, project))
        # A change the broker does not read leaves its policy as it was.
        policy = self.service.host.policy
        self.holder.swap(replace(self.holder.current, audit=replace(self.config.audit, keep=self.config.audit.keep + 1)))
        self.assertIs(self.service.host.policy, policy)
        self.holder.swap(self.config)
        self.assertTrue(self.service.host.policy.readable(project, project))

    def test_aSwapBeforeStartIsTakenAtStart(self) -> None:
        base = tempBase()
        self.addCleanup(shutil.rmtree, base, True)
        config = makeConfig(base)
        project = os.path.join(base, "home", "project")
        os.makedirs(project)
        holder = ConfigHolder(config)
        broker = BrokerService(holder, reactor=reactor, environ=dict(os.environ))
        holder.swap(replace(config, sandbox=replace(config.sandbox, deny=(project,))))
        self.assertTrue(broker.host.policy.readable(project, project))
        broker.startService()
        self.addCleanup(broker.stopService)
        self.assertFalse(broker.host.policy.readable(project, project))

    @asyncTest
    async def test_aStoppedBrokerNoLongerFollowsAndItsStopGraceIsItsOwn(self) -> None:
        mark = os.path.join(self.base, "mark")
        call = self.call(Request(op="run", args=("stubborn", mark)))
        call.addErrback(lambda f: f.trap(client.BrokerError))
        await until(lambda: readText(mark).strip(), what="the host command to start")
        pid = int(readText(mark))
        stopping = self.service.stopService()
        # While it stops, a host command that ignores SIGTERM gets stopGrace, not killDelay ...
        self.assertEqual(self.service.host.killDelay, 0.25)
        await stopping
        self.assertFalse(_alive(pid))
        # ... and afterwards the usual killDelay is back.
        self.assertEqual(self.service.host.killDelay, 30.0)
        await call
        policy = self.service.host.policy
        self.holder.swap(replace(self.config, sandbox=replace(self.config.sandbox, deny=(self.base,))))
        self.assertIs(self.service.host.policy, policy)
