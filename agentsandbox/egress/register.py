"""The user side of the dispatcher: register, receive connections, adopt them.

When the system dispatcher's registration socket exists, a user's service
connects to it instead of binding the proxy port.  The dispatcher sends each
connection whose client socket belongs to this user as a file descriptor
(``SCM_RIGHTS``, one per ``{"op": "conn"}`` line, the connections of one of the
dispatcher's readiness events in one message; the wire is ``dispatchwire.py``'s);
each one is adopted into the same ``EgressProxyFactory`` a bound port would
feed (as ``IReactorSocket.adoptStreamConnection`` would, without its ``dup``),
so the front door runs its own same-user peer check on it exactly as on a
connection it accepted itself.

A lost registration (the dispatcher stopped or restarted) is retried with a
backoff capped at ``MAX_BACKOFF``; a *replaced* one (another service of this
user registered since) is not: that one serves from now on.  A *refused* one
(the dispatcher answered ``error``: root's service where the machine's config
does not let root register, say) is retried after ``REFUSED_RETRY``, and its
reason logged once, not once a second.
"""

from __future__ import annotations

import os
import random
import socket
from collections import deque
from collections.abc import Callable
from typing import Any

from twisted.application.service import Service
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.interfaces import IFileDescriptorReceiver
from twisted.internet.protocol import ClientFactory, Factory, Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from agentsandbox.egress.dispatchwire import (
    FDS_PER_MESSAGE,
    LineReader,
    WireError,
    encode,
    peerCredentials,
)
from agentsandbox.egress.privates import ENABLED as PRIVATES
from agentsandbox.egress.privates import peerAddress, serveConnected

log = Logger(namespace="agentsandbox.egress")

#: First and longest wait before registering again after a loss.
FIRST_BACKOFF = 0.05
MAX_BACKOFF = 1.0
#: Wait before registering again after the dispatcher refused this service:
#: what refused it (the machine's config) changes by an admin's hand, not in a second.
REFUSED_RETRY = 30.0

CONNECTING = "connecting"
REGISTERED = "registered"
REPLACED = "replaced"
STOPPED = "stopped"


@implementer(IFileDescriptorReceiver)
class _RegistrationProtocol(Protocol):
    #: A Unix client transport (IUNIXTransport, with getHandle).
    transport: Any

    def __init__(self, owner: DispatchRegistration) -> None:
        self.owner = owner
        self.reader = LineReader()
        self.descriptors: deque[int] = deque()

    def connectionMade(self) -> None:
        try:
            self.owner.dispatcherPid, self.owner.dispatcherUid = peerCredentials(self.transport.getHandle())
        except OSError:
            pass
        self.transport.write(encode({"op": "register"}))

    def fileDescriptorReceived(self, descriptor: int) -> None:
        self.descriptors.append(descriptor)

    def dataReceived(self, data: bytes) -> None:
        try:
            messages = self.reader.feed(data)
        except WireError as e:
            log.error("the dispatcher sent {why}; registering again", why=e)
            self.transport.loseConnection()
            return
        for message in messages:
            op = message["op"]
            if op == "conn":
                if not self.descriptors:
                    log.error("the dispatcher announced a connection without a descriptor; registering again")
                    self.transport.loseConnection()
                    return
                self.owner.adopt(self.descriptors.popleft())
            elif op == "registered":
                self.owner.registered(message)
            elif op == "replaced":
                self.owner.replaced()
            elif op == "error":
                self.owner.refused(str(message.get("error"))[:300])
        # Descriptors arrive with the first byte of their message, so a message
        # cut short leaves at most one message's worth waiting for their lines;
        # more than that is the dispatcher's mistake, and not adopted.
        while len(self.descriptors) > FDS_PER_MESSAGE:
            os.close(self.descriptors.popleft())

    def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
        while self.descriptors:
            os.close(self.descriptors.popleft())
        self.owner.lost(reason)


class _Factory(ClientFactory):
    noisy = False

    def __init__(self, owner: DispatchRegistration) -> None:
        self.owner = owner

    def buildProtocol(self, addr: Any) -> Protocol:
        return _RegistrationProtocol(self.owner)

    def clientConnectionFailed(self, connector: Any, reason: Failure) -> None:
        self.owner.lost(reason)


class DispatchRegistration(Service):
    """Keeps this user's service registered with the dispatcher at ``path``.

    ``factory`` is the proxy's ``EgressProxyFactory``; every adopted connection
    goes to it, and it is started and stopped with this service as a listening
    port starts and stops its factory (its sweeper of stale half-read
    connections runs while the registration does).  ``reactor`` must provide
    ``IReactorUNIX`` and ``IReactorSocket``.
    """

    def __init__(
        self,
        factory: Factory,
        path: str,
        reactor: Any,
        clock: Any = None,
        onRegistered: Callable[[DispatchRegistration], None] | None = None,
    ) -> None:
        self.factory = factory
        self.onRegistered = onRegistered
        self.path = path
        self.reactor = reactor
        self.clock = clock if clock is not None else reactor
        self.state = STOPPED
        #: The uid the dispatcher registered us as (from its SO_PEERCRED), once registered.
        self.uid: int | None = None
        self.ports: list[str] = []
        self.dispatcherPid: int | None = None
        self.dispatcherUid: int | None = None
        self.adopted = 0
        self.registrations = 0
        self.lastError: str | None = None
        #: Why this user's proxy.port is not the port served (the dispatcher's wins), or None.
        self.portOverridden: str | None = None
        #: The dispatcher's last refusal of this service, said once however often it repeats.
        self.refusal: str | None = None
        self._refusedNow = False
        self._backoff = FIRST_BACKOFF
        self._retry: Any = None
        self._connector: Any = None
        self._everRegistered = False

    # ------------------------------------------------------------------ lifecycle

    def startService(self) -> None:
        super().startService()
        self.factory.doStart()
        self._connect()

    def stopService(self) -> None:
        super().stopService()
        self.factory.doStop()
        self.state = STOPPED
        if self._retry is not None and self._retry.active():
            self._retry.cancel()
        self._retry = None
        if self._connector is not None:
            self._connector.disconnect()
            self._connector = None

    def _connect(self) -> None:
        self._retry = None
        self.state = CONNECTING
        self._connector = self.reactor.connectUNIX(self.path, _Factory(self), timeout=5)

    # ------------------------------------------------------------------ events from the protocol

    def registered(self, message: dict[str, Any]) -> None:
        self.state = REGISTERED
        self.registrations += 1
        self._backoff = FIRST_BACKOFF
        self.lastError = None
        self.refusal = None
        uid = message.get("uid")
        self.uid = uid if isinstance(uid, int) else None
        ports = message.get("ports")
        self.ports = [str(p) for p in ports] if isinstance(ports, list) else []
        if self.uid is not None and self.uid != os.getuid():
            # Cannot happen with a real dispatcher (the uid is our SO_PEERCRED);
            # the peer check would refuse every connection anyway.
            log.critical("the dispatcher on {path} registered this service as uid {uid}, not {me}", path=self.path, uid=self.uid, me=os.getuid())
        log.info(
            "egress proxy {again}registered with the dispatcher on {path} (serving {ports} for uid {uid})",
            again="re-" if self._everRegistered else "", path=self.path, ports=", ".join(self.ports) or "?", uid=self.uid,
        )  # fmt: skip
        self._everRegistered = True
        self._notePort()
        if self.onRegistered is not None:
            self.onRegistered(self)

    def _notePort(self) -> None:
        """Say once (not at every re-registration) that the dispatcher's port overrides proxy.port."""
        config: Any = getattr(getattr(self.factory, "holder", None), "current", None)
        port = getattr(getattr(config, "proxy", None), "port", None)
        if config is None or port is None or not self.ports:
            return
        note = None
        if f"127.0.0.1:{port}" not in self.ports:
            note = (
                f"proxy.port {port} in {config.source} is not used: the dispatcher hands this service "
                f"the connections of this user to {', '.join(self.ports)} (the machine's port, which "
                f"the drop-in names); a sandbox that dials {port} (`agentsandbox run`, a bridge) reaches "
                "nothing, so set proxy.port to the dispatcher's port or leave it unset"
            )
            if note != self.portOverridden:
                log.warn("{note}", note=note)
        self.portOverridden = note

    def replaced(self) -> None:
        self.state = REPLACED
        log.critical(
            "another agentsandbox service of this user registered with the dispatcher on {path}; "
            "this one gets no more connections (stop one of them)",
            path=self.path,
        )

    def refused(self, why: str) -> None:
        """The dispatcher refused this service (and closes the connection)."""
        if why != self.refusal:
            log.error("the dispatcher refused this service: {why}", why=why)
        self.refusal = why
        self._refusedNow = True

    def lost(self, reason: Failure) -> None:
        self._connector = None
        if not self.running or self.state in (REPLACED, STOPPED):
            return
        if self._refusedNow:
            # Said already; asking again at once would be refused the same way.
            self._refusedNow = False
            self.lastError = self.refusal
            self.state = CONNECTING
            self._retry = self.clock.callLater(REFUSED_RETRY, self._connect)
            return
        why = reason.getErrorMessage() if reason is not None else "closed"
        if self.state == REGISTERED:
            log.warn("lost the dispatcher on {path} ({why}); registering again", path=self.path, why=why)
        elif self.lastError != why:
            log.warn("cannot register with the dispatcher on {path}: {why}; retrying", path=self.path, why=why)
        self.lastError = why
        self.state = CONNECTING
        delay = self._backoff * random.uniform(0.8, 1.0)
        self._backoff = min(self._backoff * 2, MAX_BACKOFF)
        self._retry = self.clock.callLater(delay, self._connect)

    def adopt(self, descriptor: int) -> None:
        """One connection from the dispatcher, into the proxy factory (the peer check runs there)."""
        try:
            # Asks the kernel the descriptor's family, type and protocol.
            sock = socket.socket(fileno=descriptor)
        except OSError as e:
            os.close(descriptor)
            log.error("the dispatcher sent a descriptor that is not a socket: {e}", e=e)
            return
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
            log.error("the dispatcher sent a socket that is not TCP ({family}); closed", family=sock.family)
            sock.close()
            return
        try:
            _serveAdopted(sock, self.factory, self.reactor)
            self.adopted += 1
        except OSError as e:
            sock.close()
            log.warn("a connection from the dispatcher could not be adopted: {e}", e=e)

    # ------------------------------------------------------------------ status

    def figures(self) -> dict[str, Any]:
        return {
            "socket": self.path,
            "state": self.state,
            "uid": self.uid,
            "ports": self.ports,
            "dispatcherUid": self.dispatcherUid,
            "adopted": self.adopted,
            "registrations": self.registrations,
            "lastError": self.lastError,
            "portOverridden": self.portOverridden,
        }


def _serveAdopted(sock: socket.socket, factory: Factory, reactor: Any) -> None:
    """``sock`` (a connected TCP socket) served by ``factory``, as
    ``IReactorSocket.adoptStreamConnection`` would serve its descriptor.

    That call duplicates the descriptor and wraps the copy, so each adopted
    connection would cost a ``dup``, a second socket object and a ``close``
    of ours; ``privates.serveConnected`` is the same construction on the
    socket we already hold.  With the private fast paths off it is that call.
    """
    if not PRIVATES:
        try:
            reactor.adoptStreamConnection(sock.fileno(), sock.family, factory)
        finally:
            sock.close()
        return
    addressType = IPv6Address if sock.family == socket.AF_INET6 else IPv4Address
    peer = peerAddress(sock)
    protocol = factory.buildProtocol(addressType("TCP", *peer))
    if protocol is None:
        sock.close()
        return
    serveConnected(sock, protocol, peer, reactor, "adopted from the dispatcher")
