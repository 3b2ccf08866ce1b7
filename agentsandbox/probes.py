"""Stdlib probes of this machine and of the running service, shared by the CLI.

``doctor`` reports, ``run`` refuses to start unenforced and ``setup`` acts on
the same questions; this module owns the one answer to each:

* ``connectTCP``: does something accept a TCP connection on a loopback port
  (closed before any byte is sent, so the proxy records no request);
* ``listenerUids``, ``portHolders`` and ``proxyOwner``: which users (and, where
  /proc shows them, which processes) hold the listening socket on a port, read
  from the kernel's socket tables;
* ``askBroker`` and ``brokerAnswers``: the host broker's answer to an op;
* ``Runner``, ``systemRunner`` and ``firstLine``: run a program, keep what it
  said, never hang on it;
* ``SocketRow`` and ``parseProcAddress``: the one parser of a
  ``/proc/net/tcp{,6}`` row, which ``egress.peer``'s same-user check reads too.

Stdlib only, like the hook and the broker client: nothing here imports Twisted.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from agentsandbox.allowlist import IPAddress
from agentsandbox.broker.procfs import socketHolders

#: How long the broker gets to answer before it counts as not answering.
BROKER_TIMEOUT = 3.0
#: How long a port gets to accept a connection.
CONNECT_TIMEOUT = 2.0

#: The state column of a listening socket (``TCP_LISTEN``).
LISTEN = "0A"
#: The kernel's two TCP socket tables under ``<procDir>/net``.
TABLES = ("tcp", "tcp6")


# --------------------------------------------------------------------------- socket tables


def parseProcAddress(text: str) -> tuple[IPAddress, int]:
    """``0100007F:1F90`` -> (127.0.0.1, 8080); IPv6 works the same, word by word.

    Addresses are hex, stored in host byte order per 32-bit word (each 4-byte
    group reversed on little-endian machines).
    """
    hexIP, _, hexPort = text.partition(":")
    raw = bytes.fromhex(hexIP)
    if len(raw) not in (4, 16):
        raise ValueError(f"{text!r} is not an address from a socket table")
    words = b"".join(
        int.from_bytes(raw[i : i + 4], sys.byteorder).to_bytes(4, "big") for i in range(0, len(raw), 4)
    )
    return ipaddress.ip_address(words), int(hexPort, 16)


@dataclass(frozen=True)
class SocketRow:
    """One row of ``/proc/net/tcp`` or ``tcp6``: the socket's ends, state and owner.

    ``inode`` is the socket's inode, 0 when no process holds the socket any
    more (a TIME_WAIT row, or a socket its process closed), whose ``uid`` is
    then no owner's: the kernel prints 0 for a TIME_WAIT row.
    """

    local: tuple[IPAddress, int]
    remote: tuple[IPAddress, int]
    state: str
    uid: int
    inode: int

    @property
    def listening(self) -> bool:
        return self.state == LISTEN

    @classmethod
    def parse(cls, line: str) -> SocketRow | None:
        """The row on ``line``; None for the header and for anything malformed."""
        fields = line.split()
        if len(fields) < 10 or fields[0] == "sl":
            return None
        try:
            return cls(parseProcAddress(fields[1]), parseProcAddress(fields[2]), fields[3], int(fields[7]), int(fields[9]))
        except ValueError:
            return None


def socketRows(table: str) -> Iterator[SocketRow]:
    """Every well-formed row of one table's text."""
    for line in table.splitlines():
        row = SocketRow.parse(line)
        if row is not None:
            yield row


def readTable(name: str, procDir: str = "/proc") -> str | None:
    """The text of ``<procDir>/net/<name>``, or None where it cannot be read."""
    try:
        with open(os.path.join(procDir, "net", name), encoding="ascii") as f:
            return f.read()
    except OSError:
        return None


def listenerUids(port: int, procDir: str = "/proc") -> set[int]:
    """The uids owning a listening TCP socket on ``port`` (any local address)."""
    uids: set[int] = set()
    for name in TABLES:
        for row in socketRows(readTable(name, procDir) or ""):
            if row.listening and row.local[1] == port:
                uids.add(row.uid)
    return uids


@dataclass(frozen=True)
class PortHolder:
    """Who listens on a port: the socket's uid, and the processes holding it where /proc shows them."""

    uid: int
    pids: tuple[int, ...] = ()
    commands: tuple[str, ...] = ()

    def describe(self) -> str:
        import pwd

        try:
            who = f"uid {self.uid} ({pwd.getpwuid(self.uid).pw_name})"
        except KeyError:
            who = f"uid {self.uid}"
        if not self.pids:
            return who + " (its process is not visible in /proc to this user)"
        return who + ", " + "; ".join(f"pid {p}: {c or '?'}" for p, c in zip(self.pids, self.commands, strict=True))


def portHolders(port: int, procDir: str = "/proc") -> list[PortHolder]:
    """Every uid listening on TCP ``port``, with the processes that hold those sockets.

    The processes are found by the sockets' inodes in ``<procDir>/*/fd``, so
    another user's appear only to root."""
    inodes: dict[int, int] = {}
    for name in TABLES:
        for row in socketRows(readTable(name, procDir) or ""):
            if row.listening and row.local[1] == port:
                inodes[row.inode] = row.uid
    byInode = socketHolders(procDir, inodes)
    found: dict[int, set[int]] = {}
    for inode, pids in byInode.items():
        found.setdefault(inodes[inode], set()).update(pids)
    holders = []
    for uid in sorted(set(inodes.values())):
        held = tuple(sorted(found.get(uid, ())))
        holders.append(PortHolder(uid, held, tuple(_command(pid, procDir) for pid in held)))
    return holders


def _command(pid: int, procDir: str) -> str:
    try:
        with open(os.path.join(procDir, str(pid), "cmdline"), "rb") as f:
            raw = f.read(4096)
    except OSError:
        return ""
    # One line, whatever the arguments hold (a `python -c` script has newlines).
    text = " ".join(" ".join(a.decode("utf-8", "replace").split()) for a in raw.split(b"\0") if a)
    return text if len(text) <= 200 else text[:197] + "..."


def proxyOwner(
    port: int,
    procDir: str = "/proc",
    uid: int | None = None,
    dispatched: Callable[[], bool] = lambda: False,
) -> str | None:
    """None unless another user holds the listening socket on ``port``, else who does.

    When the service is down, any local user may listen on the proxy port and
    would then see every connection a sandboxed command makes.  Nobody
    listening is None too: ``connectTCP`` says so.  The one other holder
    allowed is the system dispatcher, when ``dispatched()`` says it holds the
    port and hands this user's connections to this user's service (asked only
    when another uid holds the port).
    """
    owners = listenerUids(port, procDir)
    me = os.getuid() if uid is None else uid
    if not owners or owners == {me} or dispatched():
        return None
    return f"port {port} is held by uid {', '.join(map(str, sorted(owners)))}, not by this user (uid {me})"


# --------------------------------------------------------------------------- the service


def connectTCP(port: int, timeout: float = CONNECT_TIMEOUT, host: str = "127.0.0.1") -> str | None:
    """None when ``host``:``port`` accepts a TCP connection, else why not.

    The connection is closed before any byte is sent: that is not a request,
    and the proxy records nothing for it.
    """
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as e:
        return e.strerror or str(e)


def askBroker(spool: str, op: str, timeout: float = BROKER_TIMEOUT) -> bytes:
    """The broker's answer to ``op`` (its output).  Raises BrokerError or OSError."""
    from agentsandbox.broker import client
    from agentsandbox.broker.spool import Request

    return client.call(Request(op=op), spool, timeout).out


def brokerAnswers(spool: str, timeout: float = BROKER_TIMEOUT) -> str | None:
    """None when the broker answers a ping in ``spool``, else why not."""
    from agentsandbox.broker.client import BrokerError

    try:
        askBroker(spool, "ping", timeout)
    except BrokerError as e:
        return str(e)
    except OSError as e:
        return f"cannot use the spool {spool}: {e.strerror or e}"
    return None


# --------------------------------------------------------------------------- programs

#: Runs argv and returns the completed process (stdout and stderr as text).
Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


def systemRunner(environ: Mapping[str, str] | None = None, timeout: float = 60.0) -> Runner:
    """A runner for real programs; a missing program is exit status 127, a hang 124."""
    env = dict(os.environ if environ is None else environ)

    def run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(
                list(argv), capture_output=True, text=True, env=env, timeout=timeout,
                stdin=subprocess.DEVNULL,
            )
        except FileNotFoundError:
            return subprocess.CompletedProcess(list(argv), 127, "", f"{argv[0]}: not found")
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(list(argv), 124, "", f"{argv[0]}: no answer in {timeout:g}s")
        except OSError as e:
            return subprocess.CompletedProcess(list(argv), 126, "", f"{argv[0]}: {e.strerror or e}")

    return run


def firstLine(text: str) -> str:
    """The first line of ``text`` that is not blank, stripped; "" when there is none."""
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return ""
