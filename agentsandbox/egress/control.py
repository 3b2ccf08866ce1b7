"""The control socket: where the person lists, follows and answers held requests (issue 28).

One Unix socket per user, ``approvals.controlSocket(runtimeDir)`` (mode 0600
in the 0700 ``$XDG_RUNTIME_DIR/agentsandbox``), served by the service.  Never
the broker's spool: the sandbox writes that.  Each connection is checked:

- its uid (``SO_PEERCRED``) must be the service's, for every operation;
- an ``answer`` is taken only when the asking process is the person as far
  as the kernel can tell (``controlpeer.whyNotThePerson``: the session's
  namespaces, no sandbox or agent among its ancestors).

A refusal is answered with words (``{"ok": false, "error": ...}``) and is an
audit record (``control``).  The wire is ``approvals.py``'s.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Callable, Mapping
from typing import Any

from twisted.application.service import Service
from twisted.internet.endpoints import UNIXServerEndpoint
from twisted.internet.protocol import Factory
from twisted.logger import Logger
from twisted.protocols.basic import LineOnlyReceiver
from twisted.python.failure import Failure

from agentsandbox.approvals import MAX_LINE, OPS, Answer, decode, encode
from agentsandbox.controlpeer import readProcess, sessionNamespaces, whyNotThePerson
from agentsandbox.egress.approvals import ApprovalRegistry

_UCRED = struct.Struct("3i")


def peerCredentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of a Unix socket's peer, from the kernel."""
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return pid, uid, gid


class ControlProtocol(LineOnlyReceiver):
    delimiter = b"\n"
    MAX_LENGTH = MAX_LINE
    factory: ControlFactory
    transport: Any

    def connectionMade(self) -> None:
        self.following = False
        self.done = False
        self.factory.open.add(self)
        try:
            self.pid, self.uid, _ = peerCredentials(self.transport.getHandle())
        except (OSError, AttributeError):
            self.pid, self.uid = 0, -1
        #: Said in answer to the first line (a client that is still sending would
        #: otherwise meet a closed socket instead of the words).
        self.refusal: str | None = None
        if self.uid != self.factory.uid:
            self.refusal = (
                f"this control socket answers only uid {self.factory.uid}; uid {self.uid} asked "
                "(each user answers for their own service)"
            )

    def _send(self, message: dict[str, Any]) -> None:
        self.transport.write(encode(message))

    def _refuse(self, why: str) -> None:
        self.factory.record("control", client=f"pid {self.pid} uid {self.uid}", reason=why)
        self._finish({"ok": False, "error": why})

    def _finish(self, message: dict[str, Any]) -> None:
        self.done = True
        self._send(message)
        self.transport.loseConnection()

    def lineLengthExceeded(self, line: bytes) -> None:
        self._finish({"ok": False, "error": f"a control message is longer than {MAX_LINE} bytes"})

    def lineReceived(self, line: bytes) -> None:
        if self.done or self.following:
            return
        if self.refusal is not None:
            self._refuse(self.refusal)
            return
        try:
            message = decode(line)
        except ValueError as e:
            self._finish({"ok": False, "error": str(e)})
            return
        op = message.get("op")
        registry = self.factory.registry
        if op == "list":
            self._finish(registry.snapshot())
        elif op == "follow":
            self.following = True
            self._send(registry.snapshot())
            registry.subscribe(self._event)
        elif op == "answer":
            self._answer(message)
        else:
            self._finish({"ok": False, "error": f"op must be one of {', '.join(OPS)}, not {op!r}"})

    def _answer(self, message: dict[str, Any]) -> None:
        why = self.factory.whyNot(self.pid)
        if why is not None:
            self._refuse(f"the answer was not taken: {why}")
            return
        target = message.get("target")
        try:
            if not isinstance(target, str) or not target:
                raise ValueError("an answer names a waiting request's id or a host (target)")
            given = message.get("answer")
            if not isinstance(given, dict):
                raise ValueError("an answer carries an answer object")
            answer = Answer.fromWire(given)
            answer = Answer(answer.verdict, answer.scope, answer.seconds, self._by(answer.by))
            answered = self.factory.registry.answer(target, answer)
        except ValueError as e:
            self._finish({"ok": False, "error": str(e)})
            return
        self._finish({"ok": True, "answered": answered})

    def _by(self, channel: str) -> str:
        """Who answered, for the record: the channel the client names, and what the kernel says."""
        said = "".join(c for c in channel if c.isprintable())[:40] or "control socket"
        info = readProcess(self.pid)
        name = f" {info.name}" if info is not None and info.name else ""
        return f"{said} (pid {self.pid}{name}, uid {self.uid})"

    def _event(self, event: dict[str, Any]) -> None:
        self._send(event)

    def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
        self.factory.open.discard(self)
        if self.following:
            self.factory.registry.unsubscribe(self._event)


class ControlFactory(Factory):
    protocol = ControlProtocol  # type: ignore[assignment]
    noisy = False

    def __init__(
        self,
        registry: ApprovalRegistry,
        record: Callable[..., Any] | None = None,
        uid: int | None = None,
        whyNot: Callable[[int], str | None] | None = None,
        reference: Mapping[str, str] | None = None,
    ) -> None:
        self.registry = registry
        self._record = record
        self.uid = os.getuid() if uid is None else uid
        if whyNot is None:
            session = reference if reference is not None else sessionNamespaces()
            whyNot = lambda pid: whyNotThePerson(pid, session)  # noqa: E731
        self.whyNot = whyNot
        #: The connections open now: a stopping service closes them (a ``follow``
        #: stays open for as long as its client watches).
        self.open: set[ControlProtocol] = set()

    def record(self, event: str, **fields: Any) -> None:
        if self._record is not None:
            self._record(event, **fields)


def _answers(path: str) -> bool:
    """Whether a live service listens on ``path`` (a refused connect means a stale file)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        return False
    finally:
        probe.close()
    return True


class ControlService(Service):
    """Listens on the control socket while the service runs; removes it when stopping."""

    log = Logger(namespace="agentsandbox.approvals")

    def __init__(self, factory: ControlFactory, path: str, reactor: Any) -> None:
        self.factory = factory
        self.path = path
        self.reactor = reactor
        self.port: Any = None

    def startService(self) -> None:
        super().startService()
        directory = os.path.dirname(self.path)
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            os.chmod(directory, 0o700)
            if os.path.lexists(self.path):
                if _answers(self.path):
                    self.log.error(
                        "approvals: another service answers on {path}; this one takes no answers",
                        path=self.path,
                    )
                    return
                # Ours (the directory is ours alone): a service that stopped without removing it.
                os.unlink(self.path)
        except OSError as e:
            self.log.error("approvals: no control socket at {path}: {why}", path=self.path, why=e.strerror or e)
            return
        endpoint = UNIXServerEndpoint(self.reactor, self.path, mode=0o600)
        d = endpoint.listen(self.factory)

        def listening(port: Any) -> None:
            self.port = port
            self.log.info("approvals: answering on {path}", path=self.path)

        def failed(f: Failure) -> None:
            self.log.error("approvals: no control socket at {path}: {why}", path=self.path, why=f.getErrorMessage())

        d.addCallbacks(listening, failed)

    def stopService(self) -> Any:
        super().stopService()
        # Held requests are refused now, not left to a timer that will not run.
        self.factory.registry.stop()
        for protocol in list(self.factory.open):
            protocol.transport.loseConnection()
        port, self.port = self.port, None
        if port is None:
            return None
        return port.stopListening()
