"""A local fake GitHub for the injection tests: a TLS server with its own test CA.

Nothing here is reachable by name: the tests give the injector (or the proxy)
a dialer that maps documentation addresses to these loopback listeners, and
pass the test CA as the upstream trust root.  The fake records what reached
it (method, path, Host, every Authorization value, body digest) so a test can
show the token arrived in headers and nowhere else.

Routes:
- ``GET /user``: ``{"login": "octocat"}`` when ``Authorization: token T``,
  else 401.
- ``POST|PUT /echo``: the body, byte for byte.
- ``PUT /upload``: the body's length and SHA-256, read in pieces.
- ``GET /download?n=N``: N bytes, produced as the client reads.
- ``/o/NAME.git/...``: git's smart HTTP (``git http-backend``), Basic
  ``x-access-token:T`` required, so clone and push show the injected header.
- ``/other/NAME.git/...``: the same, for repositories of another owner
  (``GIT_PROJECT_ROOT`` is ``gitRoot/other``).
- ``/repos/...``, ``/graphql``, ``/gists...``, ``/markdown``: a stand-in for the REST and
  GraphQL API, enough for ``gh`` to print what it got: ``{"ok": true,
  "method": ..., "path": ..., "data": {...}, "html_url": ...}``.
- ``GET /leak/WHAT``: a careless origin echoing the credential it was sent
  back: ``header`` (in a response header), ``chunked`` (the token split
  across chunks, each written in a reactor turn of its own so each is a TLS
  record of its own), ``base64`` (``base64("x-access-token:" + T)`` inside a
  JSON body, split the same way), ``length`` (a Content-Length body with the
  token split across records), ``none`` (the same body shapes, no token).
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import shutil
from dataclasses import dataclass, field
from typing import Any

from twisted.internet import ssl
from twisted.internet.interfaces import IListeningPort, IProtocolFactory, IReactorTCP
from twisted.internet.protocol import Protocol
from twisted.web import resource, server, twcgi

GIT_HTTP_BACKEND_CANDIDATES = ("/usr/lib/git-core/git-http-backend", "/usr/libexec/git-core/git-http-backend")


def gitHttpBackend() -> str | None:
    for path in GIT_HTTP_BACKEND_CANDIDATES:
        if os.access(path, os.X_OK):
            return path
    found = shutil.which("git")
    if found:
        candidate = os.path.join(os.path.dirname(os.path.realpath(found)), "..", "lib", "git-core", "git-http-backend")
        if os.access(candidate, os.X_OK):
            return os.path.normpath(candidate)
    return None


# ---------------------------------------------------------------------- the fake


@dataclass
class Seen:
    method: str
    path: str
    host: str
    authorization: list[str]
    headers: dict[str, list[str]]
    bodyLength: int
    bodyDigest: str


@dataclass
class FakeGitHub:
    """What reached the fake, and the token it expects."""

    token: str
    gitRoot: str
    seen: list[Seen] = field(default_factory=list)

    def record(self, request: server.Request, body: bytes | None = None, length: int = 0, digest: str = "") -> Seen:
        headers: dict[str, list[str]] = {}
        for name, values in request.requestHeaders.getAllRawHeaders():
            headers[name.decode().lower()] = [v.decode("latin-1") for v in values]
        if body is not None:
            length, digest = len(body), hashlib.sha256(body).hexdigest()
        seen = Seen(
            method=request.method.decode(),
            path=request.uri.decode("latin-1"),
            host=(request.getHeader(b"host") or b"").decode("latin-1"),
            authorization=headers.get("authorization", []),
            headers=headers,
            bodyLength=length,
            bodyDigest=digest,
        )
        self.seen.append(seen)
        return seen

    def basic(self) -> str:
        import base64

        return "Basic " + base64.b64encode(f"x-access-token:{self.token}".encode()).decode()

    def site(self) -> server.Site:
        root = resource.Resource()
        root.putChild(b"user", _User(self))
        root.putChild(b"echo", _Echo(self))
        root.putChild(b"upload", _Upload(self))
        root.putChild(b"download", _Download(self))
        root.putChild(b"o", _Git(self))
        root.putChild(b"other", _Git(self, "other"))
        root.putChild(b"leak", _Leak(self))
        for name in (b"repos", b"graphql", b"gists", b"markdown"):
            root.putChild(name, _Api(self))
        site = server.Site(root)
        site.displayTracebacks = False
        site.noisy = False
        return site


class _Route(resource.Resource):
    """One of the fake's routes: a leaf that records into the fake."""

    isLeaf = True

    def __init__(self, fake: FakeGitHub) -> None:
        super().__init__()
        self.fake = fake


class _User(_Route):
    def render(self, request: server.Request) -> bytes:
        assert request.content is not None
        seen = self.fake.record(request, request.content.read())
        request.setHeader(b"content-type", b"application/json")
        if seen.authorization != [f"token {self.fake.token}"]:
            request.setResponseCode(401)
            return b'{"message": "Bad credentials"}'
        return json.dumps({"login": "octocat", "id": 1}).encode()


class _Echo(_Route):
    def render(self, request: server.Request) -> bytes:
        assert request.content is not None
        body: bytes = request.content.read()
        self.fake.record(request, body)
        request.setHeader(b"content-type", b"application/octet-stream")
        return body


class _Upload(_Route):
    def render(self, request: server.Request) -> bytes:
        digest = hashlib.sha256()
        length = 0
        assert request.content is not None
        request.content.seek(0)
        while True:
            chunk = request.content.read(1 << 20)
            if not chunk:
                break
            digest.update(chunk)
            length += len(chunk)
        self.fake.record(request, None, length, digest.hexdigest())
        return json.dumps({"length": length, "sha256": digest.hexdigest()}).encode()


class _Download(_Route):
    def render(self, request: server.Request) -> Any:
        self.fake.record(request, b"")
        size = int(request.args.get(b"n", [b"0"])[0])
        request.setHeader(b"content-length", str(size).encode())
        _Producer(request, size).start()
        return server.NOT_DONE_YET


class _Leak(_Route):
    """Echoes the token back, as a careless origin might (see the module)."""

    def render(self, request: server.Request) -> Any:
        import base64

        from twisted.internet import reactor

        self.fake.record(request, b"")
        assert request.postpath is not None
        what = request.postpath[0].decode() if request.postpath else ""
        token = self.fake.token
        if what == "header":
            request.setHeader(b"x-echo", f"you sent token {token}".encode())
            return b"ok\n"
        if what in ("chunked", "length", "none"):
            secret = b"" if what == "none" else token.encode()
            pieces = [b'{"debug": "auth was token ' + secret[:7], secret[7:20], secret[20:] + b'", "x": 1}\n']
        elif what == "base64":
            encoded = base64.b64encode(f"x-access-token:{token}".encode())
            pieces = [b'{"echo": "Basic ' + encoded[:21], encoded[21:33], encoded[33:] + b'"}\n']
        else:
            request.setResponseCode(404)
            return b""
        if what == "length":
            request.setHeader(b"content-length", str(sum(map(len, pieces))).encode())

        def writeNext() -> None:
            request.write(pieces.pop(0))
            if pieces:
                reactor.callLater(0.01, writeNext)  # type: ignore[attr-defined,unused-ignore]
            else:
                request.finish()

        request.write(b"")
        writeNext()
        return server.NOT_DONE_YET


class _Producer:
    """Writes ``size`` bytes only as fast as the client takes them."""

    CHUNK = b"x" * 65536

    def __init__(self, request: server.Request, size: int) -> None:
        self.request = request
        self.left = size
        self.paused = False

    def start(self) -> None:
        self.request.registerProducer(self, True)
        self.resumeProducing()

    def pauseProducing(self) -> None:
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False
        while not self.paused and self.left > 0:
            n = min(self.left, len(self.CHUNK))
            self.left -= n
            self.request.write(self.CHUNK[:n])
        if self.left == 0 and not self.paused:
            self.left = -1
            self.request.unregisterProducer()
            self.request.finish()

    def stopProducing(self) -> None:
        self.left = -1


class _Api(_Route):
    def render(self, request: server.Request) -> bytes:
        assert request.content is not None
        seen = self.fake.record(request, request.content.read())
        request.setHeader(b"content-type", b"application/json")
        if seen.authorization != [f"token {self.fake.token}"]:
            request.setResponseCode(401)
            return b'{"message": "Bad credentials"}'
        if seen.method == "POST" and seen.path.startswith("/gists"):
            request.setResponseCode(201)
        return json.dumps(
            {"ok": True, "method": seen.method, "path": seen.path, "id": "1", "files": {},
             "data": {"viewer": {"login": "octocat"}}, "html_url": "https://gist.github.com/octocat/1"}
        ).encode()


class _Git(_Route):
    """``git http-backend`` as CGI under /o/ (or /OWNER/), behind the injected Basic credential."""

    def __init__(self, fake: FakeGitHub, owner: str = "") -> None:
        super().__init__(fake)
        backend = gitHttpBackend()
        root = os.path.join(fake.gitRoot, owner) if owner else fake.gitRoot
        self.cgi = _Backend(backend or "/nonexistent", root)

    def render(self, request: server.Request) -> Any:
        seen = self.fake.record(request, None)
        if seen.authorization != [self.fake.basic()]:
            request.setResponseCode(401)
            request.setHeader(b"www-authenticate", b'Basic realm="fake GitHub"')
            return b"the fake GitHub wants the injected credential\n"
        # twcgi joins postpath as text; traversal (and Request's annotation) leave it bytes.
        assert request.postpath is not None
        request.postpath = [p.decode() if isinstance(p, bytes) else p for p in request.postpath]  # type: ignore[misc]
        return self.cgi.render(request)


class _Backend(twcgi.CGIScript):
    def __init__(self, program: str, root: str) -> None:
        super().__init__(program)
        self.root = root

    def runProcess(self, env: dict[str, str], request: server.Request, qargs: list[bytes] = []) -> None:  # noqa: B006
        env = dict(env)
        env.update(
            GIT_PROJECT_ROOT=self.root,
            GIT_HTTP_EXPORT_ALL="1",
            REMOTE_USER="x-access-token",  # lets http-backend accept a push
            PATH=os.environ.get("PATH", "/usr/bin:/bin"),
        )
        super().runProcess(env, request, qargs)


# ---------------------------------------------------------------------- listening


def listenTLS(reactor: IReactorTCP, site: IProtocolFactory, options: ssl.CertificateOptions) -> IListeningPort:
    port: IListeningPort = reactor.listenSSL(0, site, options, interface="127.0.0.1")  # type: ignore[attr-defined]
    return port


class RawWebSocketish(Protocol):
    """Answers one Upgrade: websocket request with 101, then echoes raw bytes."""

    def connectionMade(self) -> None:
        self.buffer = b""
        self.switched = False

    def dataReceived(self, data: bytes) -> None:
        if self.switched:
            self.transport.write(data)  # type: ignore[union-attr]
            return
        self.buffer += data
        if b"\r\n\r\n" in self.buffer:
            head, _, rest = self.buffer.partition(b"\r\n\r\n")
            self.factory.heads.append(head)  # type: ignore[union-attr,unused-ignore]
            self.switched = True
            self.transport.write(  # type: ignore[union-attr]
                b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
            )
            if rest:
                self.transport.write(rest)  # type: ignore[union-attr]


def documentationAddress(n: int) -> ipaddress.IPv4Address:
    """TEST-NET-3 addresses stand for the fake's hosts; only the test dialer knows them."""
    return ipaddress.IPv4Address(f"203.0.113.{n}")
