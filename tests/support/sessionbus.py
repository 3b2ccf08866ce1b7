"""A private session bus for tests: ``dbus-daemon --session`` on a socket in a temp directory.

``SessionBus`` starts one (and, with ``server=True``, ``tests/support/notifications.py``
owning org.freedesktop.Notifications on it, under Debian's python3-gi), and stops
both on ``close``.  ``environ`` is what a client needs to reach it.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import IO, Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: Debian's interpreter: python3-gi is a Debian package, not on PyPI's stack.
SYSTEM_PYTHON = "/usr/bin/python3"


class SessionBus:
    def __init__(self, directory: str, server: bool = False) -> None:
        self.daemon = subprocess.Popen(
            ["dbus-daemon", "--session", "--nofork", "--nopidfile", f"--address=unix:path={directory}/bus",
             "--print-address=1"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        assert self.daemon.stdout is not None
        self.address = self.daemon.stdout.readline().strip()
        self.environ = {"PATH": os.environ["PATH"], "DBUS_SESSION_BUS_ADDRESS": self.address}
        self.server: subprocess.Popen[str] | None = None
        if server:
            self.server = subprocess.Popen(
                [SYSTEM_PYTHON, "-m", "tests.support.notifications"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                text=True, env={**self.environ, "PYTHONPATH": REPO},
            )  # fmt: skip
            first = self.read()
            assert first.get("ready") == "org.freedesktop.Notifications", first

    def read(self) -> dict[str, Any]:
        """The server's next report (blocking)."""
        assert self.server is not None
        out: IO[str] | None = self.server.stdout
        assert out is not None
        return dict(json.loads(out.readline()))

    def until(self, predicate: Any) -> dict[str, Any]:
        """The server's reports, read (blocking) until one satisfies ``predicate``; that one."""
        while True:
            message = self.read()
            if predicate(message):
                return message

    def send(self, line: str) -> None:
        """A line to the server's stdin (``invoke ID KEY``, ``dismiss ID``)."""
        assert self.server is not None and self.server.stdin is not None
        self.server.stdin.write(line + "\n")
        self.server.stdin.flush()

    def close(self) -> None:
        for p in (self.server, self.daemon):
            if p is not None:
                p.terminate()
                p.wait(10)
