"""``hookjson`` is ``json`` for the hook: the same values and the same errors, on any input."""

from __future__ import annotations

import codecs
import json
import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from agentsandbox import hook, hookjson

#: Every code point, lone surrogates included (Node emits them as ``\\ud800``).
ANY_TEXT = st.text(st.characters(min_codepoint=0, max_codepoint=0x10FFFF, blacklist_categories=()))

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | ANY_TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(ANY_TEXT, inner, max_size=4),
    max_leaves=12,
)
WHITESPACE = st.text(st.sampled_from(" \t\n\r\x0b\x0c\u00a0\ufeff"), max_size=3)
ENCODINGS = st.sampled_from(
    ["utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be"]
)


def outcome(parse: Any, raw: bytes) -> tuple[str, str]:
    """What ``parse(raw)`` gave, comparably: the value's repr or the exception's type and text."""
    try:
        value = parse(raw)
    except Exception as e:  # the comparison is the point: json's errors are json's
        return type(e).__name__, str(e)
    return "value", _comparable(value)


def _comparable(value: Any) -> str:
    # NaN is not equal to itself; its repr is.
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return repr(value)


def assertSame(raw: bytes) -> None:
    assert outcome(hookjson.loads, raw) == outcome(json.loads, raw), raw


@settings(max_examples=300, deadline=None)
@given(JSON_VALUES, st.booleans(), WHITESPACE, WHITESPACE)
def test_loads_agrees_with_json_on_json(value: Any, ascii: bool, before: str, after: str) -> None:
    assertSame((before + json.dumps(value, ensure_ascii=ascii) + after).encode("utf-8", "surrogatepass"))


@settings(max_examples=200, deadline=None)
@given(JSON_VALUES, ENCODINGS)
def test_loads_agrees_with_json_in_every_encoding_json_detects(value: Any, encoding: str) -> None:
    text = json.dumps(value, ensure_ascii=True)
    assertSame(text.encode(encoding))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_loads_agrees_with_json_on_any_bytes(raw: bytes) -> None:
    assertSame(raw)


@settings(max_examples=300, deadline=None)
@given(JSON_VALUES)
def test_loads_agrees_with_json_on_truncated_and_extended_json(value: Any) -> None:
    raw = json.dumps(value).encode()
    for cut in {0, 1, len(raw) // 2, len(raw) - 1}:
        assertSame(raw[:cut])
    assertSame(raw + b" x")
    assertSame(raw + b"\x00")


def test_the_corners_json_treats_specially() -> None:
    for raw in (
        b"", b" ", b"{", b"NaN", b"-Infinity", b"[Infinity]", b'"\\ud800"', b'"\\udc00\\ud800"',
        b'"\xed\xa0\x80"',  # a surrogate encoded as UTF-8, which json decodes with surrogatepass
        b'"a\x01b"',  # a control character inside a string: strict json refuses it
        codecs.BOM_UTF8 + b"{}", b"\xef\xbb", b"{}\xef\xbb\xbf", b'{"a": 1, "a": 2}',
        b"1" * 5000,  # past the int-from-string digit limit
        b"[" * 100_000 + b"]" * 100_000,  # deeper than the recursion limit
        b"1e999", b"-0", b"0x10", b"01", b"1.", b'{"a" 1}', b"\x00{}", b"{}\x00", b"\xff\xfe{\x00}\x00",
    ):
        assertSame(raw)


@settings(max_examples=500, deadline=None)
@given(ANY_TEXT)
def test_ascii_string_is_jsons_ascii_encoding(text: str) -> None:
    assert hookjson.asciiString(text) == json.dumps(text, ensure_ascii=True)


@settings(max_examples=200, deadline=None)
@given(ANY_TEXT)
def test_the_deny_line_is_what_json_would_write(reason: str) -> None:
    expected = {
        "hookSpecificOutput": {
            "hookEventName": "PreToolUse",
            "permissionDecision": "deny",
            "permissionDecisionReason": reason,
        }
    }
    line = hook.deny(reason)
    assert line == json.dumps(expected, ensure_ascii=True) + "\n"
    assert line.isascii()
