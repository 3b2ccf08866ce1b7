"""Responses never carry the token back: a streaming search for its forms.

Sans-IO and stdlib only.  ``tokenForms(token)`` lists the byte strings whose
presence in a response means the token is in it: the token itself, its
URL-encoded form, and for each of the three alignments the token can have
inside a longer base64 text (standard and URL-safe alphabets), the part of
its encoding that does not depend on the bytes around it.  So
``base64("x-access-token:" + T)``, the Basic header GitHub's git host gets,
is found too.

``LeakScanner.feed(data)`` is given a message's bytes as they stream and
returns the bytes safe to pass on now, or None when a form is found.  It
holds back only the shortest tail that could be the start of a form split
across reads (at most ``len(longest form) - 1`` bytes, usually none) and
gives it back with the next read or at ``end()``: a form is never passed on
in part, and a body is never buffered whole.  The work per read is a few
``bytes.find`` calls over the read and the held tail (C loops, no per-byte
Python).
"""

from __future__ import annotations

import base64
from urllib.parse import quote

#: Below this many characters a base64 fragment would match unrelated text.
MIN_FRAGMENT = 8


def tokenForms(token: str) -> tuple[bytes, ...]:
    """The byte strings that show ``token`` in a response (distinct, longest first)."""
    raw = token.encode("utf-8")
    forms = {raw, quote(token, safe="").encode("ascii")}
    for skip in range(3):
        encoded = base64.b64encode(b"\0" * skip + raw)
        # Characters 0..ceil(4*skip/3) depend on the bytes before the token;
        # the last group, on the bytes after it (or the padding).
        start = (4 * skip + 2) // 3
        end = 4 * ((skip + len(raw)) // 3)
        middle = encoded[start:end]
        if len(middle) >= MIN_FRAGMENT:
            forms.add(middle)
            forms.add(middle.replace(b"+", b"-").replace(b"/", b"_"))
    return tuple(sorted(forms, key=lambda f: (-len(f), f)))


class LeakScanner:
    """Searches one stream of messages for any of ``forms``; see the module."""

    __slots__ = ("_firsts", "_held", "_keep", "forms", "found")

    def __init__(self, forms: tuple[bytes, ...]) -> None:
        self.forms = forms
        self._keep = max(len(f) for f in forms) - 1
        #: Each form with its first byte, for the held-tail search.
        self._firsts = tuple((f, f[:1]) for f in forms)
        self._held = b""
        #: The form found, once one was (the scanner then passes nothing on).
        self.found: bytes | None = None

    @property
    def holding(self) -> bool:
        """Whether a tail is held back (a message is under way)."""
        return bool(self._held)

    def whole(self, data: bytes) -> bool:
        """Whether ``data`` (a complete piece, such as a head) holds a form."""
        for form in self.forms:
            if form in data:
                self.found = form
                return True
        return False

    def feed(self, data: bytes) -> bytes | None:
        """What of ``data`` (and what was held) may go on now; None when a form is found."""
        held = self._held
        if held:
            data = held + data
        for form in self.forms:
            if form in data:
                self.found = form
                self._held = b""
                return None
        # Hold back the earliest position in the last ``keep`` bytes from which
        # the rest of ``data`` is the start of some form.
        size = len(data)
        lowest = max(0, size - self._keep)
        cut = size
        for form, first in self._firsts:
            at = data.find(first, lowest, cut)
            while at >= 0:
                if form.startswith(data[at:size]):
                    cut = at
                    break
                at = data.find(first, at + 1, cut)
        if cut == size:
            self._held = b""
            return data
        self._held = data[cut:]
        return data[:cut]

    def end(self) -> bytes:
        """The held tail, at the end of a message (no form can complete now)."""
        held, self._held = self._held, b""
        return held
