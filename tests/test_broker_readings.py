"""Where a check and its consumer read the same input (issue 10): the broker side.

``run``: the argument patterns against what the real exec'd program receives
(its argv bytes, echoed back).  ``sign``: the shapes the broker accepts against
what the real gpg and ssh-keygen would accept, and proof that the broker's own
argv, not the sandbox's, is what runs.  docs/broker.md ("Where a check and its
consumer read the same input") lists each pair and its verdict.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Any, ClassVar

from twisted.trial import unittest

from agentsandbox.broker import client
from agentsandbox.broker.spool import Request
from tests.support.broker_support import asyncTest, makeConfig
from tests.support.gpg import stopGpgAgent
from tests.test_broker_ops import makeGpgHome
from tests.test_broker_server import BrokerCase

#: Writes its arguments' bytes, NUL-separated: exactly what exec handed the program.
ECHO_ARGV = [sys.executable, "-c", "import os, sys; sys.stdout.buffer.write(b'\\0'.join(os.fsencode(a) for a in sys.argv[1:]))"]


def command(pattern: str) -> dict[str, Any]:
    return {"argv": ECHO_ARGV, "args": [pattern], "stream": False}


class RunArgumentReadings(BrokerCase):
    broker: ClassVar[dict[str, Any]] = {
        "run": {
            "ref": command("[a-z0-9./-]+"),
            "count": command("\\d+"),
            "depth": command("--depth=[0-9]+"),
            "anything": command(".+"),
        }
    }

    async def runs(self, name: str, arg: str) -> bytes:
        reply = await self.call(Request(op="run", args=(name, arg)))
        self.assertIsNone(reply.error)
        self.assertEqual(reply.code, 0, reply.err)
        return bytes(reply.out)

    @asyncTest
    async def test_whatMatchedIsWhatTheProgramGets(self) -> None:
        self.assertEqual(await self.runs("ref", "feature/x-1.2"), b"feature/x-1.2")
        self.assertEqual(await self.runs("count", "12"), b"12")
        self.assertEqual(await self.runs("depth", "--depth=3"), b"--depth=3")
        self.assertEqual(await self.runs("anything", "caf\u00e9 \u202e"), "caf\u00e9 \u202e".encode())

    @asyncTest
    async def test_aFinalNewlineIsNotMatchedAway(self) -> None:
        for name, arg in (("ref", "main\n"), ("count", "1\n"), ("depth", "--depth=1\n"), ("anything", "x\n")):
            why = await self.refused(Request(op="run", args=(name, arg)))
            self.assertIn("does not match", why)
            self.assertIn(f"broker.run.{name}.args[0]", why)

    @asyncTest
    async def test_anOperandPatternNeverDeliversAnOption(self) -> None:
        for arg in ("-rf", "--force", "-", "--"):
            why = await self.refused(Request(op="run", args=("ref", arg)))
            self.assertIn("starts with '-'", why)
            self.assertIn("broker.run.ref.args[0]", why)
        why = await self.refused(Request(op="run", args=("anything", "--help")))
        self.assertIn("read as an option", why)

    @asyncTest
    async def test_patternClassesAreTheProgramsAscii(self) -> None:
        for digits in ("\u0661\u0662", "\uff11", "\u00b2"):
            why = await self.refused(Request(op="run", args=("count", digits)))
            self.assertIn("does not match", why)

    @asyncTest
    async def test_noBytesWithoutAText(self) -> None:
        # '\udcff' matches '.+' but would reach exec as the byte 0xff
        # (surrogateescape): refused at the wire, like NUL.
        for arg, what in (("\udcff", "not valid Unicode"), ("\ud800", "not valid Unicode"), ("a\0b", "NUL")):
            why = await self.refused(Request(op="run", args=("anything", arg)))
            self.assertIn(what, why)


def test_aPatternTheProgramCannotReadIsAConfigError(tmp_path: Any) -> None:
    from agentsandbox.config import ConfigError

    try:
        makeConfig(str(tmp_path), {"run": {"up": command("(?u)\\w+")}})
    except ConfigError as e:
        assert "broker.run.up.args[0]" in str(e)
    else:
        raise AssertionError("a Unicode-flag pattern was accepted")


class SignShapeReadings(unittest.TestCase):
    """Real gpg and ssh-keygen accept many spellings; the broker takes one each and runs its own argv."""

    def setUp(self) -> Any:
        for tool in ("gpg", "gpgconf", "ssh-keygen", "git"):
            if shutil.which(tool) is None:
                raise unittest.SkipTest(f"{tool} is not installed")
        from twisted.internet import reactor

        from agentsandbox.broker.server import BrokerService
        from tests.support.broker_support import tempBase

        self.base = tempBase()
        self.addCleanup(shutil.rmtree, self.base, True)
        self.gnupg, self.fingerprint = makeGpgHome(self.base)
        self.addCleanup(stopGpgAgent, self.gnupg)
        self.sshKey = os.path.join(self.base, "ssh", "id_ed25519")
        os.makedirs(os.path.dirname(self.sshKey), mode=0o700)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "t@example.org", "-f", self.sshKey], check=True)
        self.config = makeConfig(self.base, {"sign": {"ssh_key": self.sshKey}})
        environ = {"PATH": os.environ.get("PATH", os.defpath), "HOME": self.config.paths.home, "GNUPGHOME": self.gnupg}
        self.service = BrokerService(self.config, reactor=reactor, environ=environ)
        self.service.startService()
        self.addCleanup(self.service.stopService)
        return self.service.ready

    def call(self, request: Request) -> Any:
        from twisted.internet import threads

        return threads.deferToThread(client.call, request, self.config.broker.spool, 60.0)

    async def refused(self, request: Request) -> str:
        try:
            await self.call(request)
        except client.BrokerError as e:
            return str(e)
        raise AssertionError(f"{request.args} was signed")

    def gpgAccepts(self, args: list[str]) -> bool:
        done = subprocess.run(
            ["gpg", "--batch", *args], input=b"payload", capture_output=True,
            env={**os.environ, "GNUPGHOME": self.gnupg}, check=False,
        )
        return done.returncode == 0

    @asyncTest
    async def test_gpgSpellingsGpgAcceptsAreRefused(self) -> None:
        key = self.fingerprint
        variants = [
            ["--status-fd", "2", "-bsau", key],
            ["--status-fd=2", "--detach-s", "-au", key],  # gpg takes unambiguous abbreviations
            ["--status-fd=2", "-b", "-s", "-a", "-u", key],
            ["--status-fd=2", "-bsa", "--local-us", key],
            ["--status-fd=2", "-bsau", key, "--"],
            ["--status-fd=2", "-bsau", key, "--output", os.path.join(self.base, "elsewhere")],
        ]
        for args in variants:
            self.assertTrue(self.gpgAccepts(args), f"gpg itself refuses {args}: the variant proves nothing")
            why = await self.refused(Request(op="sign", args=tuple(args), input=b"payload"))
            self.assertIn("--status-fd=2 -bsau KEY", why)
        for bad in ("--output=/tmp/x", "-", "", "a\nb", "\udcff"):
            why = await self.refused(Request(op="sign", args=("--status-fd=2", "-bsau", bad), input=b"p"))
            self.assertTrue(why, bad)

    @asyncTest
    async def test_sshSpellingsAreRefusedAndTheKeyFileIsTheBrokersOwn(self) -> None:
        variants = [
            ("-Y", "sign", "-n", "file", "-f", "k"),
            ("-Y", "sign", "-n", "git", "-f", "k", "-O", "hashalg=sha256"),
            ("-Y", "sign", "-f", "k", "-n", "git"),
            ("-Y", "check-novalidate", "-n", "git", "-f", "k"),
            ("-Ysign", "-n", "git", "-f", "k"),
            ("-Y", "sign", "-n", "git", "-f", "k", "--"),
        ]
        for args in variants:
            await self.refused(Request(op="sign", args=args, input=b"payload"))
        # KEYFILE names a file the sandbox chose; the broker never reads it: it signs
        # with broker.sign.ssh_key, and the signature verifies against that key.
        reply = await self.call(
            Request(op="sign", args=("-Y", "sign", "-n", "git", "-f", "/etc/shadow"), input=b"payload")
        )
        self.assertEqual(reply.code, 0, reply.err)
        signature = os.path.join(self.base, "payload.sig")
        with open(signature, "wb") as f:
            f.write(reply.out)
        check = subprocess.run(
            ["ssh-keygen", "-Y", "check-novalidate", "-n", "git", "-s", signature],
            input=b"payload", capture_output=True, check=False,
        )
        self.assertEqual(check.returncode, 0, check.stderr)
        with open(self.sshKey + ".pub") as f:
            fingerprint = subprocess.run(["ssh-keygen", "-lf", "-"], input=f.read().encode(), capture_output=True, check=True).stdout.split()[1]
        self.assertIn(fingerprint, check.stdout + check.stderr)
