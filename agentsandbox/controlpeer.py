"""Is the process on the other end of the control socket the person, as far as the kernel can tell?

The control socket (``egress/control.py``) takes an answer to a held request
only from a process that is not sandboxed and has no sandboxed or agent
process among its ancestors (issue 28).  What is read, all from ``/proc``
(the peer's pid comes from ``SO_PEERCRED``, translated by the kernel into the
service's pid namespace):

- **namespaces**: the peer's ``net``, ``mnt``, ``user`` and ``pid`` namespaces
  must be those of the session the service serves.  A process under bwrap
  (Claude Code's sandbox, srt, ``agentsandbox run``) or ``unshare`` has
  others.  The reference is the service's *parent* (the user's systemd
  manager under ``systemd --user``, the shell that ran ``agentsandbox serve``),
  read when the service starts, not the service itself: a unit with
  hardening (``PrivateTmp``, ``ProtectSystem`` and friends) runs the service in
  a mount namespace of its own, which no person's terminal shares.
- **ancestors**, the peer included, up the ``PPid`` chain: Claude Code (its
  native binary or its node package, by ``exe`` and ``argv``, and the
  ``CLAUDECODE`` variable Claude Code sets for every command it starts), srt
  (the sandbox runtime), bwrap, and ``agentsandbox run``.

What is not seen (docs/approvals.md says so): a process of the same uid in
the same namespaces whose ancestry no longer leads to an agent (started for
it by ``systemd-run --user``, or re-parented after a double fork, with
``CLAUDECODE`` removed) is the person as far as the kernel can tell.

Twisted-free and stdlib only: the tests call it directly.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

#: The namespaces a peer must share with the session the service serves.
NAMESPACES = ("net", "mnt", "user", "pid")

#: Argument words that mark a sandbox or an agent, by what they run.
_CLAUDE_PACKAGE = "/@anthropic-ai/claude-code/"
_SRT_PACKAGE = "/@anthropic-ai/sandbox-runtime/"

#: How far up the chain to look: deeper chains are refused rather than half read.
MAX_DEPTH = 128


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    pid: int
    ppid: int
    name: str
    argv: tuple[str, ...]
    exe: str | None
    #: Whether ``CLAUDECODE`` is in its environment (None: the environment could not be read).
    claudeEnv: bool | None

    def describe(self) -> str:
        shown = " ".join(self.argv)[:80] or self.name
        return f"pid {self.pid} ({shown})"


def readProcess(pid: int, proc: str = "/proc") -> ProcessInfo | None:
    """What ``/proc/PID`` tells of a process, or None when it is gone."""
    base = os.path.join(proc, str(pid))
    try:
        with open(os.path.join(base, "status"), encoding="utf-8", errors="replace") as f:
            status = f.read()
        with open(os.path.join(base, "cmdline"), "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields: dict[str, str] = {}
    for line in status.splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    try:
        exe: str | None = os.readlink(os.path.join(base, "exe"))
    except OSError:
        exe = None
    try:
        with open(os.path.join(base, "environ"), "rb") as f:
            env = f.read()
        claudeEnv: bool | None = any(v.startswith(b"CLAUDECODE=") for v in env.split(b"\0"))
    except OSError:
        claudeEnv = None
    argv = tuple(a.decode("utf-8", "replace") for a in raw.split(b"\0") if a)
    return ProcessInfo(pid, int(fields.get("PPid", "0") or 0), fields.get("Name", ""), argv, exe, claudeEnv)


def agentOf(info: ProcessInfo) -> str | None:
    """What sandbox or agent ``info`` is, by its binary and arguments, or None."""
    exeName = os.path.basename((info.exe or "").removesuffix(" (deleted)"))
    arg0 = os.path.basename(info.argv[0]) if info.argv else ""
    words = " ".join(info.argv[:4])
    if exeName in ("claude", "claude.exe") or arg0 in ("claude", "claude.exe") or _CLAUDE_PACKAGE in words:
        return "Claude Code"
    if exeName == "bwrap" or arg0 == "bwrap" or info.name == "bwrap":
        return "bwrap (a sandbox)"
    if exeName == "srt" or arg0 == "srt" or _SRT_PACKAGE in words:
        return "srt (the sandbox runtime)"
    if _isAgentsandboxRun(info.argv):
        return "agentsandbox run (a sandbox)"
    return None


def _isAgentsandboxRun(argv: tuple[str, ...]) -> bool:
    # `agentsandbox run ...`, `python3 -m agentsandbox run ...`, `.../agentsandbox run`
    for i, word in enumerate(argv[:4]):
        if os.path.basename(word) == "agentsandbox" and i + 1 < len(argv) and argv[i + 1] == "run":
            return True
    return False


def namespacesOf(pid: int, proc: str = "/proc") -> dict[str, str] | None:
    """The peer's namespaces (``net:[4026531840]``...), or None when they cannot be read."""
    found: dict[str, str] = {}
    for name in NAMESPACES:
        try:
            found[name] = os.readlink(os.path.join(proc, str(pid), "ns", name))
        except OSError:
            return None
    return found


def sessionNamespaces(proc: str = "/proc") -> dict[str, str] | None:
    """The namespaces of the session the service serves: its parent's, else its own."""
    return namespacesOf(os.getppid(), proc) or namespacesOf(os.getpid(), proc)


def whyNotThePerson(pid: int, reference: Mapping[str, str] | None, proc: str = "/proc") -> str | None:
    """Why the process ``pid`` may not answer for the person, in words; None when it may."""
    if pid <= 0:
        return "the kernel did not say which process is asking"
    if reference is None:
        return "the service could not read its session's namespaces, so it cannot tell a sandbox from the person"
    own = namespacesOf(pid, proc)
    if own is None:
        return f"process {pid} could not be read in /proc, so it cannot be told from a sandboxed one"
    differs = [n for n in NAMESPACES if own.get(n) != reference.get(n)]
    if differs:
        return (
            f"process {pid} runs in other {'/'.join(differs)} namespaces than your session "
            "(a sandbox, or unshare): answers come only from outside every sandbox"
        )
    chain: list[ProcessInfo] = []
    current = pid
    while True:
        if len(chain) >= MAX_DEPTH:
            return f"the process chain of {pid} is deeper than {MAX_DEPTH}, so it was not read to its end"
        info = readProcess(current, proc)
        if info is None:
            # Gone while we looked (or unreadable): it cannot vouch for the chain.
            return f"process {current}, an ancestor of the asking process {pid}, could not be read"
        chain.append(info)
        if info.ppid <= 1:
            break
        current = info.ppid
    # The agent itself first, by its binary (the more precise words), then the
    # variable Claude Code leaves in what it started (which outlives a broken chain).
    found = [(info, agent) for info in chain if (agent := agentOf(info)) is not None]
    found = found or [(info, _CLAUDE_STARTED) for info in chain if info.claudeEnv]
    if not found:
        return None
    info, agent = found[0]
    whose = "the asking process" if info.pid == pid else f"its ancestor {info.describe()}"
    return f"{whose} is {agent}: an agent or a sandbox may not answer for the person; answer from your own terminal"


_CLAUDE_STARTED = "a command Claude Code started (CLAUDECODE is set)"
