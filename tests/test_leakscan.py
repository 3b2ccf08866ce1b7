"""``egress/leakscan.py``, sans IO: every form of an injected token is found, a form split
anywhere is never passed on in part, and a body without the token passes whole.

The injector holding responses back with it is ``test_inject_rules``."""

from __future__ import annotations

import base64

import pytest

from agentsandbox.egress.leakscan import LeakScanner, tokenForms
from tests.support.inject_harness import TOKEN


def test_everyFormOfTheTokenIsFound() -> None:
    forms = tokenForms(TOKEN)
    for prefix in (b"", b"a", b"ab", b"x-access-token:"):
        for encode in (base64.b64encode, base64.urlsafe_b64encode):
            assert any(f in encode(prefix + TOKEN.encode() + b"!") for f in forms)
    weird = "tok/en+with%sp@ce"
    assert b"tok%2Fen%2Bwith%25sp%40ce" in tokenForms(weird)


@pytest.mark.parametrize("form", tokenForms(TOKEN))
def test_aFormSplitAnywhereIsNeverPassedOnInPart(form: bytes) -> None:
    body = b"0123456789" * 3 + form + b"abcdefghij" * 3
    start = body.index(form)
    for cut in range(1, len(body)):
        for second in (cut + 1, cut + 7, len(body)):
            scanner = LeakScanner(tokenForms(TOKEN))
            passed = b""
            found = False
            for piece in (body[:cut], body[cut:second], body[second:]):
                out = scanner.feed(piece)
                if out is None:
                    found = True
                    break
                passed += out
            assert found, (cut, second)
            assert passed == body[: len(passed)] and len(passed) <= start


def test_aBodyWithoutTheTokenPassesWhole() -> None:
    forms = tokenForms(TOKEN)
    body = (TOKEN[:-1] + "|" + TOKEN[1:] + "|" + base64.b64encode(TOKEN[:-2].encode()).decode()).encode() * 50
    for size in (1, 3, 17, 64, 1000):
        scanner = LeakScanner(forms)
        out = b""
        for i in range(0, len(body), size):
            passed = scanner.feed(body[i : i + size])
            assert passed is not None
            out += passed
        out += scanner.end()
        assert out == body
