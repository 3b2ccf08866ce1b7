"""JSON for the PreToolUse hook, without importing ``json``.

``import json`` imports ``re``, and ``re`` compiles json's patterns in pure
Python: measured with callgrind under ``python3 -I -S``, that costs more
instructions than the interpreter's own start-up and more than the hook's
whole decision.  The standard library's C scanner and string encoder
(``_json``, which ``json`` itself runs) need none of it.

``loads`` takes the C scanner for input that json would decode as UTF-8 and
that the scanner reads without error; for anything else (a BOM, UTF-16 or
UTF-32, any error at all) it calls ``json.loads`` itself, so values and errors
are json's exactly: the fast path can only agree with json or give way to it
(tests/test_hookjson.py compares them on generated input).

Stdlib only.
"""

from __future__ import annotations

TYPE_CHECKING = False

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

#: What json's decoder skips around a value (its WHITESPACE pattern).
_JSON_WHITESPACE = " \t\n\r"


class _DecoderSettings:
    """The attributes the C scanner reads: those of ``json.JSONDecoder()``."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}.__getitem__


def _cScanner() -> Callable[[str, int], tuple[Any, int]] | None:
    try:
        from _json import make_scanner
    except ImportError:
        return None
    # typeshed types the context as another scanner; the C code reads only
    # the attributes _DecoderSettings has.
    scanner: Callable[[str, int], tuple[Any, int]] = make_scanner(_DecoderSettings())  # type: ignore[arg-type]
    return scanner


_scan = _cScanner()


def _fallback(raw: bytes) -> Any:
    import json

    return json.loads(raw)


def loads(raw: bytes) -> Any:
    """``json.loads(raw)``: the same value, or the same exception."""
    # json decodes bytes as UTF-8 unless they start with a BOM or a NUL in
    # either of the first two bytes (json.detect_encoding).
    if _scan is None or len(raw) < 2 or not raw[0] or not raw[1] or raw[0] in (0xEF, 0xFE, 0xFF):
        return _fallback(raw)
    try:
        text = raw.decode("utf-8", "surrogatepass")
        start = len(text) - len(text.lstrip(_JSON_WHITESPACE))
        value, end = _scan(text, start)
        if end == len(text) or not text[end:].strip(_JSON_WHITESPACE):
            return value
    except Exception:
        # The scanner reports errors through json.decoder, which is not
        # loaded: json itself says what was wrong.
        pass
    return _fallback(raw)


def _cEncoder() -> Callable[[str], str]:
    try:
        from _json import encode_basestring_ascii
    except ImportError:
        import json.encoder

        return json.encoder.encode_basestring_ascii
    encoder: Callable[[str], str] = encode_basestring_ascii
    return encoder


#: ``json.dumps(text, ensure_ascii=True)`` of one string: the quoted literal,
#: every code point past ASCII (a lone surrogate too) escaped.
asciiString = _cEncoder()
