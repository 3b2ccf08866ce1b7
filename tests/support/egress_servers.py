"""Upstream servers for egress tests: a header-reporting web app, static files, git http-backend."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

from twisted.web import resource, server, static, twcgi

GIT_HTTP_BACKEND = "/usr/lib/git-core/git-http-backend"


class Headers(resource.Resource):
    """Answers with the request's method, path and headers as JSON (what the origin saw)."""

    isLeaf = True

    def render(self, request: Any) -> bytes:
        body = request.content.read() if request.content is not None else b""
        seen = {
            "method": request.method.decode(),
            "uri": request.uri.decode(),
            "headers": [[k.decode(), v.decode()] for k, vs in request.requestHeaders.getAllRawHeaders() for v in vs],
            "body": body.decode("latin-1"),
        }
        request.setHeader(b"content-type", b"application/json")
        request.setHeader(b"x-upstream", b"yes")
        return json.dumps(seen).encode()


class GitBackend(twcgi.CGIScript):
    """git http-backend over CGI, serving every repository under ``root``."""

    def __init__(self, root: str) -> None:
        super().__init__(GIT_HTTP_BACKEND)
        self.root = root

    def render(self, request: Any) -> Any:
        # twcgi joins postpath as text; Twisted hands it bytes (a long-standing
        # twcgi bug on Python 3), so give it text.
        request.postpath = [p.decode() if isinstance(p, bytes) else p for p in request.postpath]
        return super().render(request)

    def runProcess(self, env: dict[str, Any], request: Any, qargs: Any = ()) -> None:
        env = dict(env)
        env["GIT_PROJECT_ROOT"] = self.root
        env["GIT_HTTP_EXPORT_ALL"] = "1"
        super().runProcess(env, request, list(qargs))


def webSite(root: str) -> server.Site:
    top = resource.Resource()
    top.putChild(b"headers", Headers())
    top.putChild(b"files", static.File(os.path.join(root, "files")))
    top.putChild(b"git", GitBackend(os.path.join(root, "git")))
    return server.Site(top)


def makeRepository(root: str) -> str:
    """A bare repository with one commit under ``root/git/repo.git``; returns its HEAD."""
    work = os.path.join(root, "work")
    bare = os.path.join(root, "git", "repo.git")
    os.makedirs(os.path.join(root, "files"), exist_ok=True)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": root,
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.org",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.org",
    }
    run = lambda *a, cwd=None: subprocess.run(a, cwd=cwd, env=env, check=True, capture_output=True)  # noqa: E731
    run("git", "init", "-q", "-b", "main", work)
    with open(os.path.join(work, "README"), "w") as f:
        f.write("through the egress proxy\n")
    run("git", "add", "README", cwd=work)
    run("git", "commit", "-q", "-m", "first", cwd=work)
    run("git", "clone", "-q", "--bare", work, bare)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=work, env=env, check=True, capture_output=True, text=True).stdout.strip()
    return head
