"""The house's one HTTP/1.1 grammar, sans IO: heads, framing, bodies, hop-by-hop fields.

Both proxy paths read HTTP/1.1 with this module and nothing else: the plain
``http://`` forward path (``http.py``) and the terminated TLS path
(``inject.py``).  So both refuse the same messages with the same texts, and
``tests/test_http11_differential.py`` holds this grammar to h11, which the
runtime no longer uses (h11 stays as the tests' oracle).

What it owns:

* ``Head``: a checked message head (start line, lower-case fields, framing,
  the options its ``Connection`` fields list).
* ``parseRequestHead`` / ``parseResponseHead``: one regular-expression pass
  over a whole head against RFC 9112's grammar, then one pass over its fields
  for the framing decision and the ``Connection`` options.  Refused, each with a text naming what: a bare LF line end,
  obsolete line folding, whitespace before a colon, a control character
  (NUL, CR, ...) in a value, a malformed request or status line, more than one
  or a list-valued ``Content-Length``, a signed, hex or over-long one,
  ``Content-Length`` together with ``Transfer-Encoding`` (RFC 9112 §6.1: an
  intermediary must not forward both), more than one ``Transfer-Encoding`` or
  any but exactly ``chunked``, a framing or hop-by-hop field's name spelled
  with ``_`` (``Transfer_Encoding``: what a server mapping ``_`` to ``-``
  frames by).
* ``takeRequestHead`` / ``takeResponseHead``: where a head ends in a buffer,
  the size limit (64 KiB; 431 for requests) and the refusals that need no
  complete head (a blank line before the request line, a bare LF, a byte no
  request's method holds: a TLS ClientHello or a SOCKS4 request is refused at
  its first byte).
* The body framers, each one message's framing state: ``LengthBody``,
  ``ChunkedBody`` (checked chunk by chunk and re-framed without extensions or
  trailers) and ``UntilClose``; ``requestBody`` and ``responseBody`` decide
  which one a head calls for.  Their work is per read or per chunk, never per
  byte.
* ``HOP_BY_HOP`` and ``forwardedLines``: the one table of fields that never
  cross a proxy, and the field lines a head passes on (also dropping every
  ``Proxy-*`` field and those its ``Connection`` names, never the framing).
* The framers, one per direction of a connection: ``RequestFramer`` (a
  server's reader: one request at a time, the next held until ``next``) and
  ``ResponseFramer`` (a client's reader: each response read once ``expect``
  says what it answers, a ``101`` only to the protocol asked for, bytes
  nobody asked for refused).  They own each message's framing state and the
  one body loop, and hand back parts (``Started``, body bytes, ``END``,
  ``SWITCHED``, a last ``Refused``) for the protocol above to act on, and
  count each message's body bytes (``payload``); both paths sit on them, the
  forward path (``http.py``) and the terminated path (``inject.py``).

Nothing here does IO, logs, or knows which path it serves.
"""

from __future__ import annotations

import re
from typing import Literal, NamedTuple, Protocol

#: Largest message head accepted, either direction.
MAX_HEAD = 64 * 1024
#: A chunk-size line (size and extensions) longer than this is refused.
MAX_CHUNK_LINE = 4096

#: Fields that never cross a proxy, either direction (RFC 9110 §7.6.1's
#: hop-by-hop fields plus the proxy's own); ``forwardedLines`` also drops every
#: ``Proxy-*`` field.  ``Transfer-Encoding`` is here because both paths
#: re-frame a chunked body and say ``chunked`` themselves.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
#: Never dropped because a ``Connection`` header names it: the body we pass
#: on is framed by it (h11 frames by it regardless).
FRAMING = frozenset({b"content-length", b"transfer-encoding"})
#: What a field name spelled with ``_`` is refused for reading as, once ``_``
#: is taken for ``-``: a server that maps one to the other (CGI and WSGI's
#: ``HTTP_TRANSFER_ENCODING``) would frame by, or act on, a field every
#: reader here passes on as an ordinary one.
_NOT_TO_BE_SPELLED_WITH_UNDERSCORE = HOP_BY_HOP | FRAMING

# RFC 9110/9112 grammar, checked over a whole head in one pass.  Field values
# are visible ASCII, obs-text, space and tab: no CR, LF, NUL or other control,
# so a bare LF, obsolete folding (a line starting with whitespace is not a
# token) and "Name : value" all fail the match.
_TOKEN_CHARS = rb"-!#$%&'*+.^_`|~0-9A-Za-z"
_TOKEN = rb"[" + _TOKEN_CHARS + rb"]+"
_FIELDS = rb"(?:" + _TOKEN + rb":[\t \x21-\x7e\x80-\xff]*\r\n)*\r\n"
_REQUEST_HEAD = re.compile(rb"(" + _TOKEN + rb") ([\x21-\x7e]+) HTTP/1\.([01])\r\n" + _FIELDS)
_REQUEST_LINE = re.compile(rb"(" + _TOKEN + rb") ([\x21-\x7e]+) HTTP/1\.([01])")
_RESPONSE_HEAD = re.compile(rb"HTTP/1\.([01]) ([1-9][0-9][0-9])(?: ([\t \x21-\x7e\x80-\xff]*))?\r\n" + _FIELDS)
_FIELD_LINE = re.compile(_TOKEN + rb":[\t \x21-\x7e\x80-\xff]*")
# A request's first bytes are its method, a token ended by SP: a leading SP,
# or a byte that is neither a token character nor SP, CR or LF before the
# first of those, is one no request line can hold (CR and LF have refusals of
# their own).  Matched from the start, it reads no further than the method.
_NOT_A_METHOD = re.compile(rb" |[" + _TOKEN_CHARS + rb"]*[^" + _TOKEN_CHARS + rb" \r\n]")
_DIGITS = re.compile(rb"[0-9]{1,18}")
# Whitespace may follow the size or the extensions, never come between them:
# h11 refuses "5 ;ext" and this parser accepts nothing h11 refuses.
_CHUNK_LINE = re.compile(rb"([0-9A-Fa-f]{1,16})(?:;[\t \x21-\x7e\x80-\xff]*|[\t ]*)")


class Out(Protocol):
    """Where a body framer appends the bytes it passes on (a list of bytes, or of a framer's parts)."""

    def append(self, item: bytes, /) -> None: ...


class Refused(Exception):
    """A message neither path forwards: the HTTP status to answer and what was refused."""

    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status = status
        self.why = why

    @property
    def text(self) -> str:
        """The error reply's text, the same on both paths."""
        return f"refused: {self.why}"


class Head(NamedTuple):
    """A checked message head: start line, (lower-case name, value) fields,
    framing, and the options its ``Connection`` fields list.

    (A named tuple, like ``Started``: one is made for every message, and a
    frozen dataclass costs three times as much to build.)
    """

    start: tuple[bytes, bytes]  # (method, target) of a request; (status, reason) of a response
    minor: int  # HTTP/1.<minor>
    fields: tuple[tuple[bytes, bytes], ...]
    length: int | None  # Content-Length, when given
    chunked: bool
    #: The lower-case options every ``Connection`` field lists (empty without one).
    connection: frozenset[bytes] = frozenset()

    def values(self, name: bytes) -> list[bytes]:
        """The values of every field called ``name`` (lower case), in order."""
        return [v for n, v in self.fields if n == name]


_NO_OPTIONS: frozenset[bytes] = frozenset()
# A NamedTuple's own __new__ is a Python function: a frame per message, on the
# path every request and response takes.  tuple.__new__ builds the same value.
_newTuple = tuple.__new__


def _parsed(head: bytes, start: tuple[bytes, bytes], minor: int, refusal: int) -> Head:
    """The ``Head`` of a head whose grammar matched: its fields, framing and
    ``Connection`` options read in one pass (this runs for every message, both
    paths), every ambiguous framing refused with ``refusal``."""
    fields = []
    lengths = codings = 0
    length = coding = b""
    connection = _NO_OPTIONS
    lines = head.split(b"\r\n")
    for line in lines[1:-2]:
        name, _, value = line.partition(b":")
        name = name.lower()
        value = value.strip(b" \t")
        fields.append((name, value))
        if name == b"content-length":
            lengths += 1
            length = value
        elif name == b"transfer-encoding":
            codings += 1
            coding = value
        elif name == b"connection":
            connection = connection | {t.strip().lower() for t in value.split(b",")}
    # Most heads hold no "_" at all: one memchr (an int operand: find() or a
    # bytes operand costs four times as much in argument handling) spares them
    # a look at every name.
    if 0x5F in head:
        _refuseFramingSpelledWithUnderscore(fields, lines, refusal)
    if not (lengths or codings):
        return _newTuple(Head, (start, minor, tuple(fields), None, False, connection))
    if lengths and codings:
        raise Refused(refusal, "Content-Length together with Transfer-Encoding")
    if lengths > 1:
        raise Refused(refusal, "more than one Content-Length")
    if codings > 1:
        raise Refused(refusal, "more than one Transfer-Encoding")
    if codings:
        if coding != b"chunked":
            raise Refused(refusal, "a Transfer-Encoding other than exactly chunked")
        return _newTuple(Head, (start, minor, tuple(fields), None, True, connection))
    if _DIGITS.fullmatch(length) is None:
        raise Refused(refusal, "a malformed Content-Length")
    return _newTuple(Head, (start, minor, tuple(fields), int(length), False, connection))


def _refuseFramingSpelledWithUnderscore(fields: list[tuple[bytes, bytes]], lines: list[bytes], refusal: int) -> None:
    """``Refused`` when a field's name, ``_`` taken for ``-``, is a framing or
    hop-by-hop field's (``Transfer_Encoding``, ``content_length``, ``Keep_Alive``)."""
    for name, _ in fields:
        if 0x5F in name and name.replace(b"_", b"-") in _NOT_TO_BE_SPELLED_WITH_UNDERSCORE:
            sent = next(n for n, _, _ in (line.partition(b":") for line in lines[1:]) if n.lower() == name)
            readAs = "-".join(word.capitalize() for word in name.decode("ascii").split("_"))
            raise Refused(refusal, f"a header named {sent.decode('ascii')}, read as {readAs} where _ is taken for -")


def parseRequestHead(head: bytes) -> Head:
    """A request head (through its blank line), checked strictly, or ``Refused`` (400)."""
    match = _REQUEST_HEAD.fullmatch(head)
    if match is None:
        raise Refused(400, _whyMalformed(head))
    method, target, minor = match.groups()
    return _parsed(head, (method, target), int(minor), 400)


def parseResponseHead(head: bytes) -> Head:
    """A response head (through its blank line), checked strictly, or ``Refused`` (502)."""
    match = _RESPONSE_HEAD.fullmatch(head)
    if match is None:
        raise Refused(502, "answered with a malformed response head")
    minor, status, reason = match.groups()
    return _parsed(head, (status, reason or b""), int(minor), 502)


def _impossibleMethod(data: bytes | bytearray) -> str | None:
    """Why ``data``, the start of a request, can be no request's start (its
    method holds a byte no method holds, or there is none), or None."""
    match = _NOT_A_METHOD.match(data)
    if match is None:
        return None
    at = match.end() - 1
    if at == 0:
        return f"a request starting with byte 0x{data[0]:02x}, which no HTTP method starts with"
    return f"byte 0x{data[at]:02x} in the request's method"


def _whyMalformed(head: bytes) -> str:
    # The first impossible byte names the refusal, as it does when the head
    # comes a byte at a time (``takeRequestHead``).
    why = _impossibleMethod(head)
    if why is not None:
        return why
    if head.count(b"\n") != head.count(b"\r\n"):
        return "a header line ends in a bare LF"
    if b"\n " in head or b"\n\t" in head:
        return "obsolete line folding in the header"
    first, _, rest = head.partition(b"\r\n")
    if _REQUEST_LINE.fullmatch(first) is None:
        return "a malformed request line"
    for line in rest[:-4].split(b"\r\n") if rest[:-4] else ():
        if _FIELD_LINE.fullmatch(line) is None:
            if line.partition(b":")[0][-1:] in (b" ", b"\t"):
                return "whitespace before a header's colon"
            return "a malformed header line"
    return "a malformed request head"


def headAnomaly(head: bytes) -> str | None:
    """Why a request head is refused for its grammar or framing, or None."""
    try:
        parseRequestHead(head)
    except Refused as e:
        return e.why
    return None


def takeRequestHead(buf: bytearray) -> Head | None:
    """The request head at the start of ``buf`` (removed from it), None while
    it is not all there, or ``Refused``."""
    if buf and buf[0] in b"\r\n":
        # RFC 9112 §2.2 lets a server skip blank lines here, but h11 refuses
        # them, and this parser accepts nothing h11 refuses.
        raise Refused(400, "a blank line before the request line")
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        # A TLS ClientHello or a SOCKS4 request sent here may never end a
        # head: it is refused at its first byte, not at the header timeout.
        # (A complete head skips this: its grammar's one match covers it.)
        why = _impossibleMethod(buf)
        if why is not None:
            raise Refused(400, why)
        if len(buf) > MAX_HEAD:
            raise Refused(431, f"a request head over {MAX_HEAD} bytes")
        if buf.count(b"\n") != buf.count(b"\r\n"):
            raise Refused(400, "a header line ends in a bare LF")
        return None
    if end + 4 > MAX_HEAD:
        why = _impossibleMethod(buf)
        if why is not None:
            raise Refused(400, why)
        raise Refused(431, f"a request head over {MAX_HEAD} bytes")
    head = parseRequestHead(bytes(buf[: end + 4]))
    del buf[: end + 4]
    return head


def takeResponseHead(buf: bytearray) -> Head | None:
    """The response head at the start of ``buf`` (removed from it), None while
    it is not all there, or ``Refused`` (502)."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        if len(buf) > MAX_HEAD:
            raise Refused(502, f"answered with a head over {MAX_HEAD} bytes")
        return None
    head = parseResponseHead(bytes(buf[: end + 4]))
    del buf[: end + 4]
    return head


#: RFC 9112 §3.2: a request with no Host, or more than one, is answered 400.
ONE_HOST = "a request needs exactly one Host header"


def oneHost(head: Head) -> bytes:
    """A request's one ``Host`` value, or ``Refused``."""
    hosts = head.values(b"host")
    if len(hosts) != 1:
        raise Refused(400, ONE_HOST)
    return hosts[0]


#: ``HOP_BY_HOP | drop`` per ``drop`` a caller passes (a few constants).
_GONE: dict[frozenset[bytes], frozenset[bytes]] = {}


def forwardedLines(head: Head, drop: frozenset[bytes] = frozenset()) -> bytes:
    """The ``name: value`` lines (each with its CRLF) a proxy passes on of
    ``head``'s fields: no field of ``HOP_BY_HOP``, no ``Proxy-*``, none its
    ``Connection`` names (except the framing), none in ``drop``."""
    gone = _GONE.get(drop)
    if gone is None:
        gone = _GONE[drop] = HOP_BY_HOP | drop
    if head.connection:
        gone = gone | (head.connection - FRAMING)
    # (n[0] first: an int, so no slice is made for names that cannot match)
    return b"".join(
        [b"%b: %b\r\n" % (n, v) for n, v in head.fields if n not in gone and not (n[0] == 0x70 and n[:6] == b"proxy-")]
    )


# ---------------------------------------------------------------------- bodies


class LengthBody:
    """A body of ``Content-Length`` bytes, passed through as it arrives."""

    __slots__ = ("left", "length")

    def __init__(self, length: int) -> None:
        self.length = length
        self.left = length

    @property
    def done(self) -> bool:
        return not self.left

    @property
    def payload(self) -> int:
        """Body bytes passed so far."""
        return self.length - self.left

    def feed(self, buf: bytearray, out: Out) -> bool:
        """Take what ``buf`` holds of the body (deleting it), appending it to
        ``out``; whether the body ended."""
        left = self.left
        if len(buf) <= left:
            self.left = left - len(buf)
            out.append(bytes(buf))
            buf.clear()
        else:
            self.left = 0
            out.append(bytes(buf[:left]))
            del buf[:left]
        return not self.left

    def split(self, data: bytes) -> tuple[bytes, bytes]:
        """(the part of ``data`` that is body, the rest), without copying a
        read that is all body: the fast path of a protocol with nothing buffered."""
        left = self.left
        if len(data) <= left:
            self.left = left - len(data)
            return data, b""
        self.left = 0
        return data[:left], data[left:]


class UntilClose:
    """A response body delimited by the connection's close (RFC 9112 §6.3 rule 8)."""

    __slots__ = ("payload",)
    done = False

    def __init__(self) -> None:
        self.payload = 0

    def feed(self, buf: bytearray, out: Out) -> bool:
        self.payload += len(buf)
        out.append(bytes(buf))
        buf.clear()
        return False

    def split(self, data: bytes) -> tuple[bytes, bytes]:
        """(``data``, nothing): every byte until the close is body."""
        self.payload += len(data)
        return data, b""


class ChunkedBody:
    """Checks a chunked body as it streams, and re-frames it.

    Each run of chunk data goes out as a chunk of its own without extensions;
    the last chunk goes out as ``0\\r\\n\\r\\n`` (trailers are checked and
    dropped).  A malformed size line, a chunk not followed by CRLF, or a bad
    trailer raises ``Refused``.  The work is per chunk, not per byte.
    """

    _SIZE, _DATA, _DATA_END, _TRAILER, _DONE = range(5)

    def __init__(self, refusal: int) -> None:
        #: Chunk data bytes passed so far (the framing not counted).
        self.payload = 0
        self._state = self._SIZE
        self._left = 0
        self._trailer = 0
        self._refusal = refusal

    @property
    def done(self) -> bool:
        return self._state == self._DONE

    def feed(self, buf: bytearray, out: Out) -> bool:
        """Take what ``buf`` holds of the body (deleting it), appending
        re-framed bytes to ``out``; whether the body ended."""
        pos = 0
        end = len(buf)
        refusal = self._refusal
        while pos < end:
            state = self._state
            if state == self._DATA:
                take = min(self._left, end - pos)
                out.append(b"%x\r\n%b\r\n" % (take, bytes(buf[pos : pos + take])))
                pos += take
                self.payload += take
                self._left -= take
                if not self._left:
                    self._state = self._DATA_END
            elif state == self._DATA_END:
                if end - pos < 2:
                    if buf[pos:end] != b"\r":
                        raise Refused(refusal, "a chunk not followed by CRLF")
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    raise Refused(refusal, "a chunk not followed by CRLF")
                pos += 2
                self._state = self._SIZE
            elif state == self._SIZE or state == self._TRAILER:
                nl = buf.find(b"\r\n", pos)
                if nl < 0:
                    tail = bytes(buf[pos:end])
                    if b"\n" in tail:
                        raise Refused(refusal, "a bare LF in the chunked body")
                    limit = MAX_CHUNK_LINE if state == self._SIZE else MAX_HEAD - self._trailer
                    if len(tail) > limit:
                        raise Refused(refusal, "an overlong line in the chunked body")
                    break
                line = bytes(buf[pos:nl])
                pos = nl + 2
                if state == self._SIZE:
                    match = _CHUNK_LINE.fullmatch(line)
                    if match is None:
                        raise Refused(refusal, "a malformed chunk size line")
                    size = int(match.group(1), 16)
                    if size:
                        self._left = size
                        self._state = self._DATA
                    else:
                        self._state = self._TRAILER
                elif not line:
                    out.append(b"0\r\n\r\n")
                    self._state = self._DONE
                    break
                else:
                    self._trailer += len(line) + 2
                    if _FIELD_LINE.fullmatch(line) is None or self._trailer > MAX_HEAD:
                        raise Refused(refusal, "a malformed trailer in the chunked body")
            else:
                break
        del buf[:pos]
        return self._state == self._DONE


Body = LengthBody | ChunkedBody | UntilClose

NO_BODY_STATUSES = frozenset({b"204", b"304"})


def requestBody(head: Head) -> LengthBody | ChunkedBody | None:
    """The framer for a request's body, None when it has none (RFC 9112 §6.3)."""
    if head.chunked:
        return ChunkedBody(400)
    if head.length:
        return LengthBody(head.length)
    return None


def responseBody(head: Head, method: bytes) -> Body | None:
    """The framer for a final response's body to a ``method`` request, None
    when it has none: HEAD, 204, 304 (RFC 9112 §6.3); else chunked, by
    length, or until the connection closes."""
    if method == b"HEAD" or head.start[0] in NO_BODY_STATUSES:
        return None
    if head.chunked:
        return ChunkedBody(502)
    if head.length is not None:
        return LengthBody(head.length) if head.length else None
    return UntilClose()


# ---------------------------------------------------------------------- framers
#
# One framer per direction of a connection, below the protocol that serves it
# (magic-wormhole's dilation layers it so: the framer knows where messages
# begin and end, the protocol what to do with them).  A framer is fed the bytes
# that arrive and hands back the parts they complete, in order:
#
# * ``Started``: a message head, with how its body is framed;
# * ``bytes``: body bytes ready to pass on (a chunked body re-framed, every
#   other body as it came: a read that is all body is handed back as it is,
#   not copied);
# * ``END``: the message ended;
# * ``SWITCHED``: the connection switched protocols; every byte after it is the
#   other protocol's, handed back as it comes;
# * a ``Refused``, always last: the stream cannot be read on.  It is a part,
#   not an exception, so that a protocol passing bytes on as they come
#   (responses) keeps what came before it, and one passing on nothing of a
#   read that did not all parse (requests) sees it before acting on any part.

#: How a message's body is framed (``Started.framing``).
Framing = Literal["no body", "by length", "chunked", "until close"]
NO_BODY: Framing = "no body"
BY_LENGTH: Framing = "by length"
CHUNKED: Framing = "chunked"
UNTIL_CLOSE: Framing = "until close"


class _Marker:
    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name


#: The part that ends a message.
END = _Marker("END")
#: The part after which the connection speaks another protocol.
SWITCHED = _Marker("SWITCHED")


class Started(NamedTuple):
    """A message head a framer read, and how the body after it is framed.

    (A named tuple, not a frozen dataclass: two are made for every exchange on
    both proxy paths, and a tuple is built in a third of the time.)
    """

    head: Head
    framing: Framing
    #: A 1xx response (a 101 included): the final response follows, or the switch.
    informational: bool = False


Part = bytes | Started | _Marker | Refused


_FRAMING_OF: dict[type, Framing] = {
    type(None): NO_BODY,
    LengthBody: BY_LENGTH,
    ChunkedBody: CHUNKED,
    UntilClose: UNTIL_CLOSE,
}


# The framers' states: reading a head, a body, waiting between messages,
# switched to another protocol, refused.
_HEAD, _BODY, _WAIT, _SWITCHED, _BROKEN = range(5)


class _Framer:
    """What both directions share: the buffer, the one body loop, the fast path."""

    __slots__ = ("_body", "_buf", "_counted", "_state", "closing", "switched")

    def __init__(self, state: int) -> None:
        self._buf = bytearray()
        self._body: Body | None = None
        #: The body of the message begun last, kept past its end for ``payload``.
        self._counted: Body | None = None
        self._state = state
        #: A message said the connection ends after it (HTTP/1.0,
        #: ``Connection: close``, a body delimited by the close).
        self.closing = False
        #: The connection speaks another protocol: bytes pass as they come.
        #: (An attribute, not a property: a protocol asks at every read.)
        self.switched = False

    @property
    def buffered(self) -> int:
        """Bytes received and not handed out yet (the start of what comes next)."""
        return len(self._buf)

    @property
    def payload(self) -> int:
        """Body bytes (the framing not counted) of the message begun last:
        passed so far, or in all once it ended; 0 before any, or for one with
        no body (a 1xx response begins none)."""
        counted = self._counted
        return 0 if counted is None else counted.payload

    def _switch(self) -> None:
        self._state = _SWITCHED
        self._body = None
        self.switched = True

    def feed(self, data: bytes) -> list[Part]:
        """The parts ``data`` completes, with what was held before it."""
        parts: list[Part] = []
        buf = self._buf
        state = self._state
        if state == _BODY and not buf:
            body = self._body
            assert body is not None
            if not isinstance(body, ChunkedBody):
                # Nothing held and a body passed as it came: hand back a slice.
                part, data = body.split(data)
                if part:
                    parts.append(part)
                if not body.done:
                    return parts
                parts.append(END)
                self._body = None
                self._state = _WAIT
                if not data:
                    return parts
        elif state == _SWITCHED:
            if data:
                parts.append(data)
            return parts
        elif state == _BROKEN:
            return parts
        buf += data
        try:
            # (The loop is here, not in a method of its own: it runs for every
            # message on both paths, and a call is a frame.)
            while buf:
                state = self._state
                if state == _BODY:
                    body = self._body
                    assert body is not None
                    if not body.feed(buf, parts):
                        break  # all of it taken, or what is left is part of a chunk line
                    parts.append(END)
                    self._body = None
                    self._state = _WAIT
                elif state == _HEAD:
                    if not self._head(buf, parts):
                        break
                elif state == _SWITCHED:
                    parts.append(bytes(buf))
                    buf.clear()
                else:
                    self._between(parts)
                    break
        except Refused as e:
            self._state = _BROKEN
            parts.append(e)
        return parts

    def _begin(self, head: Head, body: Body | None, parts: list[Part]) -> None:
        """A message with ``body`` (None: none) starts; its head is ``parts``' next."""
        framing = _FRAMING_OF[type(body)]
        # HTTP/1.0 (h11 keeps no 1.0 connection alive either), a body the
        # close delimits, or Connection: close.
        if not self.closing and (head.minor == 0 or framing is UNTIL_CLOSE or b"close" in head.connection):
            self.closing = True
        parts.append(_newTuple(Started, (head, framing, False)))
        self._counted = body
        if body is None:
            parts.append(END)
            self._state = _WAIT
        else:
            self._body = body
            self._state = _BODY

    def _ended(self, parts: list[Part]) -> None:
        parts.append(END)
        self._body = None
        self._state = _WAIT

    def _head(self, buf: bytearray, parts: list[Part]) -> bool:
        """Read a head from ``buf`` into ``parts``; False while it is not all there."""
        raise NotImplementedError

    def _between(self, parts: list[Part]) -> None:
        """Bytes arrived while no message is read: held until the next one is."""


class RequestFramer(_Framer):
    """A server's reader of the requests on one connection.

    After a request's ``END`` it waits, holding what follows, until ``next``:
    one request is served at a time, and a pipelining client's next request is
    read only once the current one is answered.  Requests are held to the
    grammar and the framing only; what a path accepts (methods, targets,
    ``Host``, versions) is the path's own.
    """

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(_HEAD)

    @property
    def waiting(self) -> bool:
        """A request ended and ``next`` was not called since."""
        return self._state == _WAIT

    @property
    def ahead(self) -> int:
        """Bytes held past a request that ended (what a pipelining client sent ahead)."""
        return len(self._buf) if self._state == _WAIT else 0

    def next(self) -> list[Part]:
        """Read on: the parts of the next request, as far as it is held."""
        if self._state != _WAIT:
            return []
        self._state = _HEAD
        return self.feed(b"") if self._buf else []

    def switch(self) -> bytes:
        """Speak another protocol from now on: what is held, returned now, and
        every byte fed after are passed as they are."""
        self._switch()
        held = bytes(self._buf)
        self._buf.clear()
        return held

    def _head(self, buf: bytearray, parts: list[Part]) -> bool:
        head = takeRequestHead(buf)
        if head is None:
            return False
        self._begin(head, requestBody(head), parts)
        return True


class ResponseFramer(_Framer):
    """A client's reader of the responses on one connection.

    Each response is read once ``expect`` says what it answers: its request's
    method (a HEAD's response has no body) and the protocol the request asked
    to switch to, if any (a ``101`` is refused unless it switches to exactly
    that one).  Bytes that arrive when no response is expected are refused:
    nobody asked for them.
    """

    __slots__ = ("_method", "_upgrade")

    def __init__(self) -> None:
        super().__init__(_WAIT)
        self._method = b""
        self._upgrade: bytes | None = None

    @property
    def idle(self) -> bool:
        """Every response asked for was read to its end (and nothing was refused)."""
        return self._state == _WAIT

    @property
    def reusable(self) -> bool:
        """Idle, and no response said the connection ends after it."""
        return self._state == _WAIT and not self.closing

    def expect(self, method: bytes, upgrade: bytes | None = None) -> None:
        """A request of ``method`` went out (asking to switch to ``upgrade``): read its response."""
        self._method = method
        self._upgrade = upgrade
        self._state = _HEAD

    def closed(self, clean: bool) -> list[Part]:
        """The connection ended (``clean``: by the peer's orderly close): ``[END]``
        when that ends a body delimited by the close, else nothing."""
        parts: list[Part] = []
        if clean and self._state == _BODY and isinstance(self._body, UntilClose):
            self._ended(parts)
        return parts

    def _between(self, parts: list[Part]) -> None:
        raise Refused(502, "answered more than it was asked")

    def _head(self, buf: bytearray, parts: list[Part]) -> bool:
        head = takeResponseHead(buf)
        if head is None:
            return False
        status = head.start[0]
        if status[0] != 0x31:  # not 1xx
            self._begin(head, responseBody(head, self._method), parts)
            return True
        if status != b"101":
            parts.append(_newTuple(Started, (head, NO_BODY, True)))  # the final response follows
            return True
        upgrade = self._upgrade
        if upgrade is None:
            raise Refused(502, "switched protocols without being asked to")
        if [v.lower() for v in head.values(b"upgrade")] != [upgrade]:
            raise Refused(502, f"switched to something other than {upgrade.decode('ascii', 'replace')}")
        parts.append(_newTuple(Started, (head, NO_BODY, True)))
        parts.append(SWITCHED)
        self._switch()
        return True
