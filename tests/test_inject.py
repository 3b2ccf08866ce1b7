"""Termination and injection against the fake GitHub, with real curl over loopback."""

from __future__ import annotations

import json
from typing import Any

from twisted.internet import defer, reactor
from twisted.trial import unittest

from tests.support.inject_harness import TOKEN, InjectHarness


class CurlThroughTheInjector(unittest.TestCase):
    def setUp(self) -> None:
        self.h = InjectHarness(reactor)
        self.addCleanup(self.h.close)

    @defer.inlineCallbacks
    def test_apiGetsTokenHeader(self) -> Any:
        out, err, code = yield self.h.curl(*self.h.connectTo("api.github.com"), "https://api.github.com/user")
        self.assertEqual(code, 0, err)
        self.assertEqual(json.loads(out)["login"], "octocat")
        self.assertEqual(self.h.fake.seen[-1].authorization, [f"token {TOKEN}"])
