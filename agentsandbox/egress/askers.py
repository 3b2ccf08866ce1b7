"""Who asks: the process holding a held request's client end, shown to the person deciding.

A person asked about an unlisted host (``proxy.unlisted = "ask"``) decides better
knowing what asks: ``4242 curl``, not only an address on loopback.  TCP carries no
pid, so the client's socket is found in the kernel's table (``/proc/net/tcp{,6}``,
its inode) and then among the file descriptors of the service user's processes
(``/proc/PID/fd`` links reading ``socket:[INODE]``).  That walk costs milliseconds
on a busy machine, beyond what one reactor event may take (issue 25's stalls),
and is needed only when a request is held, so it runs in the reactor's thread
pool before the request is shown.  What it cannot read is left out, never guessed.

A process in a sandbox that shares the host's network is found like any other:
bubblewrap's pid namespace hides nothing from the host's ``/proc``, and the user
owns the sandbox's user namespace, so its descriptors are the user's to read.
Claude Code's and srt's sandboxes have their own network, bridged to the host by
socat: the holder found there is the bridge, and the connection's session names
the asker.  Only the service user's processes are looked at: the peer check let
in no other user's socket.
"""

from __future__ import annotations

import os

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorThreads
from twisted.internet.threads import deferToThreadPool
from zope.interface import implementer

from agentsandbox.broker.procfs import commandName, socketHolders
from agentsandbox.egress.interfaces import IAskers
from agentsandbox.egress.peer import socketInode

#: Processes named for one request; a socket shared wider than this is said as a count.
MAX_NAMED = 3


def holderText(procDir: str, uid: int, client: tuple[str, int], server: tuple[str, int]) -> str | None:
    """``"PID COMM"`` of each process of ``uid`` holding the client's end of
    ``client`` -> ``server``, comma-separated; None when none is found.  Blocking."""
    try:
        inode = socketInode(procDir, client, server)
        if inode is None:
            return None
        pids = socketHolders(procDir, [inode], uid)[inode]
        named = [f"{pid} {commandName(procDir, pid) or '?'}" for pid in pids[:MAX_NAMED]]
    except OSError:
        return None
    if len(pids) > MAX_NAMED:
        named.append(f"{len(pids) - MAX_NAMED} more")
    return ", ".join(named) or None


@implementer(IAskers)
class ProcAskers:
    """The asking process from ``/proc``, looked up in the reactor's thread pool."""

    def __init__(self, reactor: IReactorThreads, uid: int | None = None, procDir: str = "/proc") -> None:
        self._reactor = reactor
        self.uid = os.getuid() if uid is None else uid
        self.procDir = procDir

    def find(self, client: tuple[str, int], server: tuple[str, int]) -> Deferred[str | None]:
        return deferToThreadPool(
            self._reactor, self._reactor.getThreadPool(), holderText, self.procDir, self.uid, client, server
        )
