"""The sign and kubeconfig ops with the real tools (gpg, ssh-keygen, kubectl), in-process broker."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import Any

from twisted.internet import reactor, threads
from twisted.internet.utils import getProcessOutputAndValue
from twisted.trial import unittest

from agentsandbox.broker import client
from agentsandbox.broker.ops import minifyKubeconfig, proxyKubeconfig, socksProxy
from agentsandbox.broker.server import BrokerService
from agentsandbox.broker.spool import Request
from tests.support.broker_support import REPO, asyncTest, makeConfig, tempBase
from tests.support.gpg import makeSigningKey, stopGpgAgent

GPG_KEY_NAME = "Broker Test <broker-test@example.org>"


def makeGpgHome(base: str) -> tuple[str, str]:
    """A GNUPGHOME with one passphrase-less signing key; returns (home, fingerprint)."""
    home = os.path.join(base, "gnupg")
    return home, makeSigningKey(home, GPG_KEY_NAME)


class SignTests(unittest.TestCase):
    def setUp(self) -> Any:
        for tool in ("gpg", "gpgconf", "ssh-keygen", "git"):
            if shutil.which(tool) is None:
                raise unittest.SkipTest(f"{tool} is not installed")
        self.base = tempBase()
        self.addCleanup(shutil.rmtree, self.base, True)
        self.gnupg, self.fingerprint = makeGpgHome(self.base)
        self.addCleanup(stopGpgAgent, self.gnupg)
        self.sshKey = os.path.join(self.base, "ssh", "id_ed25519")
        os.makedirs(os.path.dirname(self.sshKey), mode=0o700)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "t@example.org", "-f", self.sshKey], check=True)
        self.config = makeConfig(self.base, {"sign": {"ssh_key": self.sshKey}})
        home = self.config.paths.home
        environ = {"PATH": os.environ.get("PATH", os.defpath), "HOME": home, "GNUPGHOME": self.gnupg}
        self.service = BrokerService(self.config, reactor=reactor, environ=environ)
        self.service.startService()
        self.addCleanup(self.service.stopService)
        return self.service.ready

    def call(self, request: Request) -> Any:
        return threads.deferToThread(client.call, request, self.config.broker.spool, 60.0)

    @asyncTest
    async def test_gpgSignsGitsShapeWithThePersonsKey(self) -> None:
        payload = b"tree 4b825dc642cb6eb9a060e54bf8d69288fbee4904\n\nmessage\n"
        reply = await self.call(
            Request(op="sign", args=("--status-fd=2", "-bsau", self.fingerprint), input=payload)
        )
        self.assertEqual(reply.code, 0, reply.err)
        self.assertIn(b"-----BEGIN PGP SIGNATURE-----", reply.out)
        self.assertIn(b"[GNUPG:] SIG_CREATED ", reply.err)
        sig = os.path.join(self.base, "sig.asc")
        data = os.path.join(self.base, "data")
        with open(sig, "wb") as f:
            f.write(reply.out)
        with open(data, "wb") as f:
            f.write(payload)
        verify = subprocess.run(
            ["gpg", "--batch", "--verify", sig, data],
            env=dict(os.environ, GNUPGHOME=self.gnupg), capture_output=True, timeout=60,
        )  # fmt: skip
        self.assertEqual(verify.returncode, 0, verify.stderr)

    @asyncTest
    async def test_anUnknownGpgKeyFailsWithGpgsOwnAnswer(self) -> None:
        reply = await self.call(
            Request(op="sign", args=("--status-fd=2", "-bsau", "nobody@example.org"), input=b"x")
        )
        self.assertNotEqual(reply.code, 0)
        self.assertEqual(reply.out, b"")

    @asyncTest
    async def test_sshSignsWithTheConfiguredKey(self) -> None:
        with open(self.sshKey + ".pub") as f:
            public = f.read()
        payload = b"tree 0\n\nssh signed\n"
        reply = await self.call(
            Request(op="sign", args=("-Y", "sign", "-n", "git", "-f", "/sandbox/key.pub"), input=payload, key=public)
        )
        self.assertEqual(reply.code, 0, reply.err)
        self.assertTrue(reply.out.startswith(b"-----BEGIN SSH SIGNATURE-----"))
        signers = os.path.join(self.base, "allowed")
        with open(signers, "w") as f:
            f.write("t@example.org " + public)
        sig = os.path.join(self.base, "payload.sig")
        with open(sig, "wb") as f:
            f.write(reply.out)
        verify = subprocess.run(
            ["ssh-keygen", "-Y", "verify", "-f", signers, "-I", "t@example.org", "-n", "git", "-s", sig],
            input=payload, capture_output=True, timeout=60,
        )  # fmt: skip
        self.assertEqual(verify.returncode, 0, verify.stderr)

    @asyncTest
    async def test_sshRefusesAnotherPublicKey(self) -> None:
        other = os.path.join(self.base, "other")
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", other], check=True)
        with open(other + ".pub") as f:
            public = f.read()
        with self.assertRaises(client.BrokerError) as caught:
            await self.call(
                Request(op="sign", args=("-Y", "sign", "-n", "git", "-f", "k"), input=b"x", key=public)
            )
        self.assertIn("not the public half of broker.sign.ssh_key", str(caught.exception))
        with self.assertRaises(client.BrokerError) as caught:
            await self.call(
                Request(op="sign", args=("-Y", "sign", "-n", "git", "-f", "k"), input=b"x", key="nonsense")
            )
        self.assertIn("not an OpenSSH public key", str(caught.exception))


KUBECONFIG = {
    "apiVersion": "v1",
    "kind": "Config",
    "current-context": "kind-lab",
    "clusters": [
        {"name": "kind-lab", "cluster": {"server": "https://127.0.0.1:6443", "certificate-authority-data": "Q0E="}},
        {"name": "prod", "cluster": {"server": "https://k8s.example.org:6443"}},
    ],
    "contexts": [
        {"name": "kind-lab", "context": {"cluster": "kind-lab", "user": "kind-lab"}},
        {"name": "prod", "context": {"cluster": "prod", "user": "prod"}},
    ],
    "users": [
        {"name": "kind-lab", "user": {"client-certificate-data": "Q0VSVA==", "client-key-data": "S0VZ"}},
        {"name": "prod", "user": {"token": "prod-token"}},
    ],
}


KUBECONFIG_YAML = """\
apiVersion: v1
kind: Config
current-context: kind-lab
clusters:
- name: kind-lab
  cluster:
    server: https://127.0.0.1:6443
    certificate-authority-data: Q0E=
- name: prod
  cluster:
    server: https://k8s.example.org:6443
contexts:
- name: kind-lab
  context:
    cluster: kind-lab
    user: kind-lab
- name: prod
  context:
    cluster: prod
    user: prod
users:
- name: kind-lab
  user:
    client-certificate-data: Q0VSVA==
    client-key-data: S0VZ
- name: prod
  user:
    token: prod-token
"""


class KubeconfigHelperTests(unittest.TestCase):
    def test_socksProxySelection(self) -> None:
        self.assertEqual(
            socksProxy({"ALL_PROXY": "http://localhost:3128", "FTP_PROXY": "socks5h://u:p@localhost:1080"}),
            "socks5://u:p@localhost:1080",
        )
        self.assertEqual(socksProxy({"all_proxy": "socks5://localhost:1080"}), "socks5://localhost:1080")
        self.assertIsNone(socksProxy({"ALL_PROXY": "http://localhost:3128"}))
        self.assertIsNone(socksProxy({"ALL_PROXY": "socks5h://"}))
        self.assertIsNone(socksProxy({}))

    def test_onlyLoopbackClustersGetTheProxy(self) -> None:
        doc = json.loads(json.dumps(KUBECONFIG))
        self.assertTrue(proxyKubeconfig(doc, "socks5://localhost:1080"))
        self.assertEqual(doc["clusters"][0]["cluster"]["proxy-url"], "socks5://localhost:1080")
        self.assertNotIn("proxy-url", doc["clusters"][1]["cluster"])
        self.assertFalse(proxyKubeconfig(doc, "socks5://localhost:1080"), "idempotent")
        self.assertEqual(doc["contexts"], KUBECONFIG["contexts"])
        self.assertEqual(doc["users"], KUBECONFIG["users"])

    def test_minifyKeepsOneContext(self) -> None:
        small = minifyKubeconfig(KUBECONFIG, "kind-lab")
        self.assertEqual([c["name"] for c in small["clusters"]], ["kind-lab"])
        self.assertEqual([u["name"] for u in small["users"]], ["kind-lab"])
        self.assertEqual(small["current-context"], "kind-lab")
        self.assertNotIn("prod-token", json.dumps(small))


class KubeconfigOpTests(unittest.TestCase):
    kubectl = True

    def setUp(self) -> Any:
        self.base = tempBase()
        self.addCleanup(shutil.rmtree, self.base, True)
        self.source = os.path.join(self.base, "kubeconfig")
        self.writeSource()
        self.config = makeConfig(self.base, {"kubeconfig": self.source})
        path = os.environ.get("PATH", os.defpath)
        if not self.kubectl:
            path = os.path.join(self.base, "nobin")
        elif shutil.which("kubectl") is None:
            raise unittest.SkipTest("kubectl is not installed (the JSON fallback is tested without it)")
        self.service = BrokerService(self.config, reactor=reactor, environ={"PATH": path, "HOME": self.base})
        self.service.startService()
        self.addCleanup(self.service.stopService)
        return self.service.ready

    def writeSource(self) -> None:
        # Block-style YAML, as kind writes it, for kubectl; JSON for the fallback.
        with open(self.source, "w") as f:
            if self.kubectl:
                f.write(KUBECONFIG_YAML)
            else:
                json.dump(KUBECONFIG, f)

    async def kubeconfig(self, context: str, env: dict[str, str]) -> tuple[bytes, bytes, int]:
        full = {
            "PATH": os.environ.get("PATH", os.defpath),
            "PYTHONPATH": str(REPO),
            "AGENTSANDBOX_SPOOL": self.config.broker.spool,
            "TMPDIR": self.base,
            **env,
        }
        return await getProcessOutputAndValue(  # type: ignore[no-any-return]
            sys.executable, ["-m", "agentsandbox", "kubeconfig", context], env=full, path=self.base
        )

    @asyncTest
    async def test_aLoopbackClusterIsReachedThroughTheSandboxSocksProxy(self) -> None:
        out, err, code = await self.kubeconfig("kind-lab", {"ALL_PROXY": "socks5h://srt:tok@localhost:1080"})
        self.assertEqual(code, 0, err)
        path = out.decode().strip()
        self.assertEqual(os.stat(path).st_mode & 0o777, 0o600)
        with open(path) as f:
            doc = json.load(f)
        self.assertEqual([c["name"] for c in doc["clusters"]], ["kind-lab"])
        self.assertEqual(doc["clusters"][0]["cluster"]["proxy-url"], "socks5://srt:tok@localhost:1080")
        self.assertNotIn("prod-token", json.dumps(doc))

    @asyncTest
    async def test_unknownContextIsAClearError(self) -> None:
        _out, err, code = await self.kubeconfig("nosuch", {})
        self.assertEqual(code, 1)
        self.assertIn(b"nosuch", err)


class KubeconfigWithoutKubectlTests(KubeconfigOpTests):
    kubectl = False

    @asyncTest
    async def test_yamlWithoutKubectlIsAClearError(self) -> None:
        with open(self.source, "w") as f:
            f.write("apiVersion: v1\nkind: Config\n")
        _out, err, code = await self.kubeconfig("kind-lab", {})
        self.assertEqual(code, 1)
        self.assertIn(b"is not JSON and kubectl", err)
