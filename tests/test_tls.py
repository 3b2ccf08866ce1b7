"""The in-memory CA: name constraints that hold under real verifiers, leaves, server TLS."""

from __future__ import annotations

import datetime
import os
import subprocess
import tempfile
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID
from OpenSSL import crypto
from twisted.internet import defer, reactor
from twisted.trial import unittest

from agentsandbox.egress.compat import notValidAfter, notValidBefore, toX509
from agentsandbox.egress.tls import InjectionCA, NotInjectedError
from tests.support.inject_harness import AnySNI, InjectHarness

HOSTS = ("github.com", "api.github.com", "uploads.github.com")


def verify(ca: InjectionCA, leaf: x509.Certificate) -> str | None:
    store = crypto.X509Store()
    store.add_cert(toX509(ca.certificate))
    try:
        crypto.X509StoreContext(store, toX509(leaf)).verify_certificate()
    except crypto.X509StoreContextError as e:
        return str(e)
    return None


class CATests(unittest.TestCase):
    def setUp(self) -> None:
        self.ca = InjectionCA.create(HOSTS, label="test")

    def test_caShape(self) -> None:
        cert = self.ca.certificate
        bc = cert.extensions.get_extension_for_class(x509.BasicConstraints)
        self.assertTrue(bc.critical)
        self.assertTrue(bc.value.ca)
        self.assertEqual(bc.value.path_length, 0)
        ku = cert.extensions.get_extension_for_class(x509.KeyUsage).value
        self.assertTrue(ku.key_cert_sign and ku.crl_sign and not ku.digital_signature)
        nc = cert.extensions.get_extension_for_class(x509.NameConstraints)
        self.assertTrue(nc.critical)
        assert nc.value.permitted_subtrees is not None
        self.assertEqual(sorted(n.value for n in nc.value.permitted_subtrees), sorted(HOSTS))
        self.assertIsInstance(cert.public_key(), ec.EllipticCurvePublicKey)
        self.assertEqual(cert.public_key().curve.name, "secp256r1")  # type: ignore[union-attr]
        now = datetime.datetime.now(datetime.UTC)
        self.assertLess(notValidBefore(cert), now)
        self.assertGreater(notValidAfter(cert), now + datetime.timedelta(days=300))
        self.assertNotEqual(cert.serial_number, InjectionCA.create(HOSTS).certificate.serial_number)

    def test_pemIsTheCertificateOnly(self) -> None:
        self.assertTrue(self.ca.pem.startswith(b"-----BEGIN CERTIFICATE-----"))
        self.assertNotIn(b"PRIVATE", self.ca.pem)

    def test_leavesVerifyAndOthersDoNot(self) -> None:
        self.assertIsNone(verify(self.ca, self.ca.leaf("github.com")))
        self.assertIsNone(verify(self.ca, self.ca.leaf("api.github.com")))
        why = verify(self.ca, self.ca.issue("example.com"))
        self.assertIsNotNone(why)
        self.assertIn("subtree", why or "")
        self.assertRaises(NotInjectedError, self.ca.leaf, "example.com")

    def test_opensslVerifyAgrees(self) -> None:
        with tempfile.TemporaryDirectory() as d:
            caFile = os.path.join(d, "ca.pem")
            with open(caFile, "wb") as f:
                f.write(self.ca.pem)
            for host, ok in (("api.github.com", True), ("example.com", False)):
                leafFile = os.path.join(d, host)
                cert = self.ca.issue(host)
                with open(leafFile, "wb") as f:
                    f.write(cert.public_bytes(serialization.Encoding.PEM))
                r = subprocess.run(
                    ["openssl", "verify", "-CAfile", caFile, "-verify_hostname", host, leafFile],
                    capture_output=True,
                    text=True,
                )
                self.assertEqual(r.returncode == 0, ok, r.stdout + r.stderr)

    def test_leafShapeAndCache(self) -> None:
        leaf = self.ca.leaf("api.github.com")
        self.assertIs(leaf, self.ca.leaf("api.github.com"))
        san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        self.assertEqual(san.get_values_for_type(x509.DNSName), ["api.github.com"])
        eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        self.assertEqual(list(eku), [ExtendedKeyUsageOID.SERVER_AUTH])
        self.assertEqual(
            leaf.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo),
            self.ca.leaf("github.com").public_key().public_bytes(
                serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
            ),
        )

    def test_keyUsagesAreExactlyTheOnesEachCertificateNeeds(self) -> None:
        def setFlags(cert: x509.Certificate) -> set[str]:
            ku = cert.extensions.get_extension_for_class(x509.KeyUsage)
            self.assertTrue(ku.critical)
            # encipher_only/decipher_only are only defined (and raise otherwise) with key_agreement.
            self.assertFalse(ku.value.key_agreement)
            flags = ("digital_signature", "content_commitment", "key_encipherment", "data_encipherment",
                     "key_cert_sign", "crl_sign")  # fmt: skip
            return {flag for flag in flags if getattr(ku.value, flag)}

        self.assertEqual(setFlags(self.ca.certificate), {"key_cert_sign", "crl_sign"})
        self.assertEqual(setFlags(self.ca.leaf("api.github.com")), {"digital_signature"})

    def test_aMisspeltKeyUsageRaises(self) -> None:
        from agentsandbox.egress.tls import _keyUsage

        self.assertRaises(ValueError, _keyUsage, "key_cert_sing")

    def test_noHostsIsAnError(self) -> None:
        self.assertRaises(ValueError, InjectionCA.create, [])


class ServerTLS(unittest.TestCase):
    timeout = 60

    def setUp(self) -> None:
        self.h = InjectHarness(reactor)
        self.addCleanup(self.h.close)

    @defer.inlineCallbacks
    def test_alpnAnswersHttp11Only(self) -> Any:
        raw = b"GET /user HTTP/1.1\r\nHost: api.github.com\r\nConnection: close\r\n\r\n"
        creator = AnySNI(self.h.ca.pem, "api.github.com", alpn=[b"h2", b"http/1.1"])
        from tests.support.inject_harness import rawTLS

        client = yield rawTLS(reactor, self.h.tunnels["api.github.com"], raw, creator)
        self.assertEqual(client.alpn, b"http/1.1")
        self.assertIn(b"200", client.received[:20])

    @defer.inlineCallbacks
    def test_anH2OnlyClientGetsNoALPNAndHTTP11(self) -> Any:
        raw = b"GET /user HTTP/1.1\r\nHost: api.github.com\r\nConnection: close\r\n\r\n"
        from tests.support.inject_harness import rawTLS

        client = yield rawTLS(reactor, self.h.tunnels["api.github.com"], raw, AnySNI(self.h.ca.pem, "x", alpn=[b"h2"]))
        self.assertIn(client.alpn, (b"", None))
        self.assertIn(b"200", client.received[:20])

    @defer.inlineCallbacks
    def test_tls11IsRefused(self) -> Any:
        from twisted.internet.utils import getProcessOutputAndValue

        _out, _err, code = yield getProcessOutputAndValue(
            "/usr/bin/curl",
            ["-sS", "--cacert", self.h.caFile, "--tls-max", "1.1", *self.h.connectTo("api.github.com"),
             "https://api.github.com/user"],
            env={"PATH": os.environ["PATH"]},
        )
        self.assertNotEqual(code, 0)
        self.assertEqual(self.h.fake.seen, [])

    @defer.inlineCallbacks
    def test_curlWithAndWithoutHttp11FlagConnects(self) -> Any:
        for extra in ([], ["--http1.1"], ["--http2"]):
            out, err, code = yield self.h.curl(*extra, *self.h.connectTo("api.github.com"), "https://api.github.com/user")
            self.assertEqual(code, 0, err)
            self.assertIn(b"octocat", out)
