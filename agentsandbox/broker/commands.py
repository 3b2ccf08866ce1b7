"""The broker's client commands: ``ask``, ``gpg``, ``ssh-sign``, ``host``, ``cap``, ``kubeconfig``.

They run inside the sandbox (git runs ``gpg`` and ``ssh-sign`` on every signed
commit), so they are stdlib only and start fast.  Without a broker each fails with the
same message and exit status 69 (EX_UNAVAILABLE); none falls back to doing the
action inside the sandbox.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from typing import BinaryIO

from agentsandbox.broker import client
from agentsandbox.broker import spool as wire
from agentsandbox.broker.client import BrokerError, NoBroker
from agentsandbox.broker.spool import Request
from agentsandbox.files import atomicWrite

EX_UNAVAILABLE = 69
EX_USAGE = 2
#: Set when ``agentsandbox gpg`` hands over to the real gpg, so a gpg.program that
#: leads back here cannot loop.
PASSTHROUGH_ENV = "AGENTSANDBOX_GPG_PASSTHROUGH"
SIGN_TIMEOUT = 150.0
SCOPE_TIMEOUT = 30.0
KUBECONFIG_TIMEOUT = 60.0


def _say(command: str, message: str) -> None:
    print(f"agentsandbox {command}: {message}", file=sys.stderr)


def _stdout() -> BinaryIO:
    return sys.stdout.buffer


def _spool(command: str) -> str | None:
    try:
        return client.spoolDir()
    except Exception as e:  # an unreadable config: say so, do nothing
        _say(command, f"cannot find the spool: {e}")
        return None


def _reachable(command: str, spool: str) -> int | None:
    """None when a broker answers a ping, else the exit status (the message is printed)."""
    try:
        client.call(Request(op="ping"), spool, client.PING_TIMEOUT)
    except NoBroker as e:
        _say(command, str(e))
        return EX_UNAVAILABLE
    except BrokerError as e:
        _say(command, str(e))
        return 1
    return None


def _emit(reply: wire.Reply) -> int:
    if reply.out:
        _stdout().write(reply.out)
        _stdout().flush()
    if reply.err:
        sys.stderr.buffer.write(reply.err)
        sys.stderr.flush()
    return reply.code if reply.code is not None else 0


def _run(command: str, request: Request, timeout: float | None, stream: bool = False) -> int:
    spool = _spool(command)
    if spool is None:
        return 1
    if timeout is None or timeout > client.PING_TIMEOUT:
        # A long call without a broker would wait its whole timeout: ping first.
        failed = _reachable(command, spool)
        if failed is not None:
            return failed
    try:
        if stream:
            reply = client.call(
                Request(op=request.op, args=request.args, stream=True), spool, timeout, _stdout()
            )
        else:
            reply = client.call(request, spool, timeout)
    except NoBroker as e:
        _say(command, str(e))
        return EX_UNAVAILABLE
    except BrokerError as e:
        if e.reply is not None:
            _emit(e.reply)  # what a command that failed (timed out) made before it ended
        _say(command, str(e))
        return 1
    return _emit(reply)


def _ask(command: str, request: Request, timeout: float, refusedSuffix: str = "") -> wire.Reply | int:
    """A non-streamed call after a ping; the Reply, or the exit status once reported."""
    spool = _spool(command)
    if spool is None:
        return 1
    failed = _reachable(command, spool)
    if failed is not None:
        return failed
    try:
        return client.call(request, spool, timeout)
    except NoBroker as e:
        _say(command, str(e))
        return EX_UNAVAILABLE
    except BrokerError as e:
        _say(command, f"{e}{refusedSuffix}")
        return 1


# --------------------------------------------------------------------------- ask


def askMain(argv: list[str]) -> int:
    """``agentsandbox ask ping|status``."""
    parser = argparse.ArgumentParser(prog="agentsandbox ask", description="Ask the host broker.")
    parser.add_argument("op", choices=("ping", "status"))
    args = parser.parse_args(argv)
    spool = _spool("ask")
    if spool is None:
        return 1
    try:
        reply = client.call(Request(op=args.op), spool, client.PING_TIMEOUT)
    except NoBroker as e:
        _say("ask", str(e))
        return EX_UNAVAILABLE
    except BrokerError as e:
        _say("ask", str(e))
        return 1
    if args.op == "ping":
        print(f"the broker answers in {spool}")
        return 0
    return _emit(reply)


# --------------------------------------------------------------------------- gpg


def realProgram(configKey: str, fallback: str, environ: Mapping[str, str]) -> str:
    """The person's git ``configKey`` program unless it leads back here, else ``fallback``."""
    if environ.get(PASSTHROUGH_ENV):
        return fallback
    try:
        found = subprocess.run(
            ["git", "config", "--get", configKey],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        found = ""
    if not found:
        return fallback
    import shutil

    resolved = found if os.path.isabs(found) else (shutil.which(found) or found)
    return fallback if client.isAgentsandbox(resolved) else found


def _execReal(command: str, program: str, args: list[str]) -> int:
    env = dict(os.environ)
    env[PASSTHROUGH_ENV] = "1"
    try:
        os.execvpe(program, [program, *args], env)
    except OSError as e:
        _say(command, f"cannot run {program}: {e.strerror or e}")
        return 127


def _readLimited(stream: BinaryIO, limit: int) -> bytes | None:
    data = stream.read(limit + 1)
    return None if len(data) > limit else data


def gpgMain(argv: list[str]) -> int:
    """git's ``gpg.program``: signs through the broker inside the sandbox, else is gpg."""
    if not client.inSandbox():
        return _execReal("gpg", realProgram("gpg.program", "gpg", os.environ), argv)
    try:
        wire.checkGpgArgs(argv)
    except wire.WireError as e:
        _say("gpg", f"inside the sandbox {e}; nothing else is brokered")
        return EX_USAGE
    payload = _readLimited(sys.stdin.buffer, wire.SIGN_PAYLOAD_LIMIT)
    if payload is None:
        _say("gpg", f"the payload to sign is over {wire.SIGN_PAYLOAD_LIMIT} bytes")
        return 1
    return _run("gpg", Request(op="sign", args=tuple(argv), input=payload), SIGN_TIMEOUT)


def sshSignMain(argv: list[str]) -> int:
    """git's ``gpg.ssh.program``: ``-Y sign`` goes to the broker inside the sandbox.

    Every other use (``-Y verify``, ``-Y find-principals``, ``-Y check-novalidate``)
    needs no secret and runs the real ssh-keygen with the same arguments.
    """
    if not client.inSandbox() or argv[:2] != ["-Y", "sign"]:
        return _execReal("ssh-sign", realProgram("gpg.ssh.program", "ssh-keygen", os.environ), argv)
    if len(argv) < 2:
        _say("ssh-sign", f"usage: {wire.SSH_SHAPE} FILE")
        return EX_USAGE
    shape, bufferFile = argv[:-1], argv[-1]
    try:
        keyFile = wire.checkSshArgs(shape)
    except wire.WireError as e:
        _say("ssh-sign", f"inside the sandbox {e} FILE")
        return EX_USAGE
    key: str | None = None
    with contextlib.suppress(OSError, UnicodeDecodeError), open(keyFile, encoding="utf-8") as f:
        key = wire.publicKeyOf(f.read(16384))
    try:
        with open(bufferFile, "rb") as f:
            payload = _readLimited(f, wire.SIGN_PAYLOAD_LIMIT)
    except OSError as e:
        _say("ssh-sign", f"cannot read {bufferFile}: {e.strerror}")
        return 1
    if payload is None:
        _say("ssh-sign", f"the payload to sign is over {wire.SIGN_PAYLOAD_LIMIT} bytes")
        return 1
    reply = _ask(
        "ssh-sign", Request(op="sign", args=tuple(shape), input=payload, key=key), SIGN_TIMEOUT
    )
    if isinstance(reply, int):
        return reply
    if reply.err:
        sys.stderr.buffer.write(reply.err)
        sys.stderr.flush()
    if reply.code == 0:
        try:
            atomicWrite(bufferFile + ".sig", reply.out, 0o644)
        except OSError as e:
            _say("ssh-sign", f"cannot write {bufferFile}.sig: {e.strerror}")
            return 1
    return reply.code if reply.code is not None else 1


# --------------------------------------------------------------------------- host


def hostMain(argv: list[str]) -> int:
    """``agentsandbox host NAME [ARGS...]``: a named host command; its exit code is ours."""
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: agentsandbox host NAME [ARGS...]\n\nRun the host command NAME from the "
            "config's [broker.run.NAME] through the broker; its output is streamed and its "
            "exit code passed through.",
            file=sys.stderr if not argv else sys.stdout,
        )
        return EX_USAGE if not argv else 0
    return _run("host", Request(op="run", args=tuple(argv)), None, stream=True)


# --------------------------------------------------------------------------- cap


def capMain(argv: list[str]) -> int:
    """``agentsandbox cap [--memory SIZE] [--cpu PCT] -- CMD...``: run CMD in a capped scope."""
    parser = argparse.ArgumentParser(
        prog="agentsandbox cap",
        description="Ask the broker to move this process into a capped systemd scope, then "
        "run CMD in it.",
    )
    parser.add_argument("--memory", metavar="SIZE", help="MemoryMax, at most scope.memory_max")
    parser.add_argument("--cpu", metavar="PCT", help="CPU quota such as 150%%, at most scope.cpu_quota")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    request = Request(op="scope", memory=args.memory, cpu=args.cpu)
    reply = _ask("cap", request, SCOPE_TIMEOUT, f"; not running {command[0]} uncapped")
    if isinstance(reply, int):
        return reply
    unit = reply.out.decode("utf-8", "replace").strip()
    if reply.err:
        # The broker ran it uncapped on scope.allow_uncapped: said loudly, every time.
        sys.stderr.write(reply.err.decode("utf-8", "replace"))
        sys.stderr.flush()
    if os.environ.get("AGENTSANDBOX_CAP_VERBOSE"):
        _say("cap", f"running in {unit}")
    try:
        os.execvp(command[0], command)
    except FileNotFoundError:
        _say("cap", f"{command[0]}: command not found")
        return 127
    except OSError as e:
        _say("cap", f"cannot run {command[0]}: {e.strerror or e}")
        return 126


# --------------------------------------------------------------------------- kubeconfig


def kubeconfigMain(argv: list[str]) -> int:
    """``agentsandbox kubeconfig CONTEXT [-o FILE]``: write a usable kubeconfig, print its path."""
    parser = argparse.ArgumentParser(
        prog="agentsandbox kubeconfig",
        description="Get a kubeconfig for CONTEXT from the host; loopback clusters are "
        "reached through the sandbox's SOCKS proxy.  Prints the file's path, so "
        "`export KUBECONFIG=$(agentsandbox kubeconfig CONTEXT)` works.",
    )
    parser.add_argument("context")
    parser.add_argument("-o", "--output", metavar="FILE", help="where to write it (mode 0600)")
    args = parser.parse_args(argv)
    reply = _ask("kubeconfig", Request(op="kubeconfig", args=(args.context,)), KUBECONFIG_TIMEOUT)
    if isinstance(reply, int):
        return reply
    path = args.output
    if path is None:
        directory = os.path.join(os.environ.get("TMPDIR") or "/tmp", "agentsandbox")
        os.makedirs(directory, mode=0o700, exist_ok=True)
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", args.context)
        path = os.path.join(directory, f"kubeconfig-{safe}")
    try:
        atomicWrite(path, reply.out, 0o600)
    except OSError as e:
        _say("kubeconfig", f"cannot write {path}: {e.strerror}")
        return 1
    print(path)
    return 0
