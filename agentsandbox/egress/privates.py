"""Sending a write at once when nothing is queued before it.

Twisted's socket transports queue every write for the next reactor turn: the
data waits for ``epoll`` to report the socket writable, which costs two
``epoll_ctl`` calls, a dispatch and a turn of latency per write.  A proxy
passes on each read as it arrives, so every hop of every exchange paid that
turn (the 200 to a CONNECT, each chunk of a tunnel, each part of a forwarded
answer).  Sending at once is safe only when the transport has nothing
buffered (order) and is still open for writing; otherwise, and for whatever
the socket did not take, the transport's own ``write`` queues as usual, so
back-pressure (a streaming producer paused when the buffer fills), half-close
and close work unchanged.

Only attributes Twisted 22.4 and current releases share on
``FileDescriptor`` are read; a transport without them (a test's in-memory
one, a TLS layer) gets its own ``write``.
"""

from __future__ import annotations

from typing import Any


def writeNow(transport: Any, data: bytes) -> None:
    """``transport.write(data)``, sent before returning when nothing is queued."""
    try:
        queued = (
            transport._tempDataBuffer
            or len(transport.dataBuffer) > transport.offset
            or not transport.connected
            or transport.disconnecting
            or transport._writeDisconnecting
            or transport._writeDisconnected
        )
        send = transport.writeSomeData
    except AttributeError:
        transport.write(data)
        return
    if queued or not data:
        transport.write(data)
        return
    sent = send(data)
    if not isinstance(sent, int):
        # The connection is gone; the transport's own write finds out and
        # reports it through connectionLost as usual.
        transport.write(data)
    elif sent < len(data):
        transport.write(data[sent:])
