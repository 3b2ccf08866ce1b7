"""Reading a chunked body back as a client does, for the framing tests."""

from __future__ import annotations


def dechunk(data: bytes) -> tuple[bytes, bytes]:
    """(body, what follows the last chunk) of a chunked body, as a client reads it."""
    body = b""
    while True:
        line, _, data = data.partition(b"\r\n")
        size = int(line.split(b";")[0], 16)
        if size == 0:
            return body, data
        body += data[:size]
        assert data[size : size + 2] == b"\r\n"
        data = data[size + 2 :]
