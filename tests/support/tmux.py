"""A real terminal for tests: a private tmux server, its pane read with capture-pane.

Each ``Tmux`` has its own server socket (``-S``), so a test never sees the
person's sessions nor another test's; ``close`` kills only that server.
Waiting is polling with a bound: ``waitFor`` reads the pane until a predicate
holds and fails with the last screen when the bound passes.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from collections.abc import Callable, Sequence


class Tmux:
    def __init__(self, directory: str, width: int = 100, height: int = 30) -> None:
        self.socket = os.path.join(directory, "tmux.sock")
        self.width, self.height = width, height

    def tmux(self, *args: str) -> str:
        return subprocess.run(
            ["tmux", "-S", self.socket, *args], capture_output=True, text=True, check=True, timeout=30
        ).stdout

    def start(self, argv: Sequence[str], env: dict[str, str] | None = None) -> None:
        """Run ``argv`` through ``sh -c`` in a new detached session named ``t``."""
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
        command = (f"env {prefix} " if prefix else "") + " ".join(shlex.quote(a) for a in argv)
        self.tmux("new-session", "-d", "-s", "t", "-x", str(self.width), "-y", str(self.height), command)

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "t")

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "t", *keys)

    def waitFor(self, predicate: Callable[[str], bool], bound: float = 15.0, every: float = 0.02) -> str:
        deadline = time.monotonic() + bound
        while True:
            screen = self.screen()
            if predicate(screen):
                return screen
            if time.monotonic() > deadline:
                raise AssertionError(f"the pane did not show what was awaited in {bound}s; it shows:\n{screen}")
            time.sleep(every)

    def alive(self) -> bool:
        return subprocess.run(["tmux", "-S", self.socket, "has-session", "-t", "t"], capture_output=True).returncode == 0

    def close(self) -> None:
        subprocess.run(["tmux", "-S", self.socket, "kill-server"], capture_output=True)


def waitUntil(predicate: Callable[[], bool], bound: float = 15.0, what: str = "the condition") -> None:
    """Poll ``predicate`` until it holds; fail naming ``what`` after ``bound`` seconds."""
    deadline = time.monotonic() + bound
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen in {bound}s")
        time.sleep(0.02)
