"""The host actions the broker carries out: ping, status, sign, run, scope, kubeconfig.

Each op checks its request twice over: ``validate`` runs before anything else (no
/proc scan, no process) and refuses a bad shape with a message naming what was
refused and, where one exists, the config key that would allow it; ``perform`` then
acts for the requester the server found in /proc.  Host programs run through
``reactor.spawnProcess`` with an explicit environment; cancelling a call sends
SIGTERM and, ``killDelay`` seconds later, SIGKILL.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit, urlunsplit

from twisted.internet import defer, error, protocol
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorProcess, IReactorTime
from twisted.python.failure import Failure

from agentsandbox.allowlist import isLoopbackName
from agentsandbox.broker import scope as scopes
from agentsandbox.broker.client import isAgentsandbox
from agentsandbox.broker.procfs import Origin
from agentsandbox.broker.spool import (
    SIGN_PAYLOAD_LIMIT,
    Reply,
    Request,
    checkGpgArgs,
    checkSshArgs,
    publicKeyOf,
)
from agentsandbox.config import Config, RunCommand
from agentsandbox.policy import Policy

T = TypeVar("T")

#: A buffered stdout or stderr keeps at most this much; the rest is dropped with a note.
OUTPUT_LIMIT = 8 << 20
SIGN_TIMEOUT = 120.0
SCOPE_TIMEOUT = 15.0
KUBECONFIG_TIMEOUT = 30.0
#: How long the scope op waits for the requester to show up in its new cgroup.
SCOPE_SETTLE = 5.0
SCOPE_POLL = 0.02

_CONTEXT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@:/+-]{0,252}")
_SOCKS_VARS = ("ALL_PROXY", "all_proxy", "FTP_PROXY", "ftp_proxy")


class OpError(Exception):
    """A refusal or failure that becomes the reply's ``error``."""


class RequesterGone(Exception):
    """The requester stopped holding its request: end the call, write no reply."""


# --------------------------------------------------------------------------- context


@dataclass
class Host:
    """What the ops need from the broker: config, reactor, clock, the host environment."""

    config: Config
    reactor: Any  # IReactorProcess & IReactorTime
    clock: IReactorTime
    environ: Mapping[str, str]
    procDir: str
    killDelay: float
    inThread: Callable[..., Deferred[Any]]
    status: Callable[[], dict[str, Any]]
    policy: Policy
    #: Every running host process, so a stopping broker can wait for them to end.
    running: set[Deferred[Any]] = field(default_factory=set)
    #: The proxy's ``egress.sessions.SessionRegistry`` (None: a broker without a proxy).
    sessions: Any = None
    #: Where the cgroup hierarchies are mounted (the scope op reads its caps there).
    cgroupRoot: str = "/sys/fs/cgroup"


@dataclass
class Call:
    request: Request
    origin: Origin
    #: Receives a streamed call's stdout as it arrives; None buffers it in the reply.
    output: Callable[[bytes], None] | None = None


class Op(Protocol):
    name: str

    def validate(self, request: Request, config: Config) -> Any: ...

    def originKeys(self, plan: Any) -> tuple[str, ...]: ...

    def perform(self, plan: Any, call: Call, host: Host) -> Deferred[Reply]: ...


# --------------------------------------------------------------------------- processes


@dataclass(frozen=True)
class Result:
    code: int
    out: bytes
    err: bytes
    timedOut: bool = False


class _Collector(protocol.ProcessProtocol):
    def __init__(self, stdin: bytes | None, sink: Callable[[bytes], None] | None) -> None:
        self.stdin = stdin
        self.sink = sink
        self.out: list[bytes] = []
        self.err: list[bytes] = []
        self.sizes = {"out": 0, "err": 0}
        self.ended: Deferred[int] = Deferred()

    def connectionMade(self) -> None:
        assert self.transport is not None
        if self.stdin:
            self.transport.write(self.stdin)
        self.transport.closeStdin()

    def _keep(self, which: str, into: list[bytes], data: bytes) -> None:
        room = OUTPUT_LIMIT - self.sizes[which]
        if room > 0:
            into.append(data[:room])
        self.sizes[which] += len(data)

    def outReceived(self, data: bytes) -> None:
        if self.sink is not None:
            self.sink(data)
        else:
            self._keep("out", self.out, data)

    def errReceived(self, data: bytes) -> None:
        self._keep("err", self.err, data)

    def processEnded(self, reason: Failure) -> None:
        value = reason.value
        code = 0
        if isinstance(value, error.ProcessTerminated):
            if value.exitCode is not None:
                code = value.exitCode
            elif value.signal is not None:
                code = 128 + value.signal
            else:
                code = 1
        self.ended.callback(code)

    def collected(self, which: str) -> bytes:
        data = b"".join(self.out if which == "out" else self.err)
        if self.sizes[which] > OUTPUT_LIMIT:
            data += f"\n[agentsandbox: {self.sizes[which] - OUTPUT_LIMIT} more bytes dropped]\n".encode()
        return data


def runProcess(
    host: Host,
    argv: list[str],
    env: Mapping[str, str],
    cwd: str | None = None,
    stdin: bytes | None = None,
    sink: Callable[[bytes], None] | None = None,
    timeout: float | None = None,
) -> Deferred[Result]:
    """Run ``argv`` and collect its result.  Cancelling ends it (SIGTERM, then SIGKILL)."""
    proto = _Collector(stdin, sink)
    reactor: IReactorProcess = host.reactor
    transport = reactor.spawnProcess(proto, argv[0], argv, env=dict(env), path=cwd)
    state = {"timedOut": False, "ended": False}
    killer: list[IDelayedCall] = []

    def signalIt(sig: str) -> None:
        if state["ended"]:
            return
        try:
            transport.signalProcess(sig)
        except error.ProcessExitedAlready:
            pass

    def terminate() -> None:
        signalIt("TERM")
        if not killer:
            killer.append(host.clock.callLater(host.killDelay, signalIt, "KILL"))

    timer: IDelayedCall | None = None
    if timeout is not None:

        def onTimeout() -> None:
            state["timedOut"] = True
            terminate()

        timer = host.clock.callLater(timeout, onTimeout)

    result: Deferred[Result] = Deferred(lambda d: terminate())

    def ended(code: int) -> int:
        state["ended"] = True
        host.running.discard(proto.ended)
        for delayed in (timer, *killer):
            if delayed is not None and delayed.active():
                delayed.cancel()
        if not result.called:
            result.callback(
                Result(code, proto.collected("out"), proto.collected("err"), state["timedOut"])
            )
        return code

    host.running.add(proto.ended)
    proto.ended.addCallback(ended)
    return result


def which(program: str, environ: Mapping[str, str]) -> str | None:
    if os.path.isabs(program):
        return program if os.access(program, os.X_OK) else None
    return shutil.which(program, path=environ.get("PATH") or os.defpath)


def hostEnv(environ: Mapping[str, str]) -> dict[str, str]:
    """The broker's own environment for the person's own tools (gpg, ssh-keygen, kubectl)."""
    return dict(environ)


# --------------------------------------------------------------------------- ping, status


@dataclass(frozen=True)
class _NoPlan:
    pass


def _noArgs(request: Request) -> None:
    if request.args or request.input is not None or request.memory or request.cpu or request.key:
        raise OpError(f"{request.op} takes no arguments")


class Ping:
    name = "ping"

    def validate(self, request: Request, config: Config) -> _NoPlan:
        _noArgs(request)
        return _NoPlan()

    def originKeys(self, plan: Any) -> tuple[str, ...]:
        return ()

    def perform(self, plan: Any, call: Call, host: Host) -> Deferred[Reply]:
        return defer.succeed(Reply())


class Status(Ping):
    name = "status"

    def perform(self, plan: Any, call: Call, host: Host) -> Deferred[Reply]:
        body = json.dumps(host.status(), sort_keys=True, indent=1) + "\n"
        return defer.succeed(Reply(out=body.encode()))


# --------------------------------------------------------------------------- session


@dataclass(frozen=True)
class SessionPlan:
    session: str
    digest: str


class Session:
    """``session NAME SHA256``: the proxy attributes connections whose credential has
    that SHA-256 to session NAME (``egress/sessions.py``).  The credential itself
    never travels: the request, a file in the spool, holds only its digest."""

    name = "session"

    def validate(self, request: Request, config: Config) -> SessionPlan:
        if len(request.args) != 2 or request.input is not None or request.memory or request.cpu or request.key:
            raise OpError("session takes two arguments: the session's name and the SHA-256 of its credential")
        return SessionPlan(*request.args)

    def originKeys(self, plan: Any) -> tuple[str, ...]:
        return ()

    def perform(self, plan: SessionPlan, call: Call, host: Host) -> Deferred[Reply]:
        if call.origin.sandboxed:
            # The hook and `agentsandbox run` register from the host; a sandboxed
            # process could only claim a session it is not.
            raise OpError("session: a sandboxed process cannot register a session")
        if host.sessions is None:
            raise OpError("this broker serves no proxy: there is nothing to attribute")
        why = host.sessions.register(plan.session, plan.digest)
        if why is not None:
            raise OpError(f"session refused: {why}")
        return defer.succeed(Reply())


# --------------------------------------------------------------------------- sign

@dataclass(frozen=True)
class GpgPlan:
    key: str
    payload: bytes


@dataclass(frozen=True)
class SshPlan:
    payload: bytes
    publicKey: str | None


class Sign:
    name = "sign"

    def validate(self, request: Request, config: Config) -> GpgPlan | SshPlan:
        if request.memory or request.cpu:
            raise OpError("sign takes no memory or cpu")
        payload = request.input
        if payload is None:
            raise OpError("sign needs the payload to sign as input")
        if len(payload) > SIGN_PAYLOAD_LIMIT:
            raise OpError(f"the payload to sign is over {SIGN_PAYLOAD_LIMIT} bytes")
        if request.args[:1] == ("-Y",):
            checkSshArgs(request.args)
            if config.broker.ssh_key is None:
                raise OpError(
                    "ssh signing is off: set broker.sign.ssh_key to the private key the "
                    "broker signs with"
                )
            publicKey = None
            if request.key is not None:
                publicKey = publicKeyOf(request.key)
                if publicKey is None:
                    raise OpError("the key sent with an ssh sign call is not an OpenSSH public key")
            return SshPlan(payload=payload, publicKey=publicKey)
        if request.key is not None:
            raise OpError("a gpg sign call takes no 'key' field (the key is in args)")
        return GpgPlan(key=checkGpgArgs(request.args), payload=payload)

    def originKeys(self, plan: Any) -> tuple[str, ...]:
        return ()

    def perform(self, plan: Any, call: Call, host: Host) -> Deferred[Reply]:
        if isinstance(plan, SshPlan):
            return defer.ensureDeferred(self._ssh(plan, host))
        return defer.ensureDeferred(self._gpg(plan, host))

    async def _gpg(self, plan: GpgPlan, host: Host) -> Reply:
        program = await gpgProgram(host)
        result = await runProcess(
            host,
            [program, "--status-fd=2", "-bsau", plan.key],
            hostEnv(host.environ),
            cwd=_home(host.environ),
            stdin=plan.payload,
            timeout=SIGN_TIMEOUT,
        )
        if result.timedOut:
            raise OpError(f"{program} did not sign within {SIGN_TIMEOUT:g}s")
        return Reply(out=result.out, err=result.err, code=result.code)

    async def _ssh(self, plan: SshPlan, host: Host) -> Reply:
        keyFile = host.config.broker.ssh_key
        assert keyFile is not None
        sshKeygen = which("ssh-keygen", host.environ)
        if sshKeygen is None:
            raise OpError("ssh-keygen is not on the broker's PATH")
        if plan.publicKey is not None:
            configured = await _configuredPublicKey(host, sshKeygen, keyFile)
            if configured != plan.publicKey:
                raise OpError(
                    f"the sandbox asked to sign with {plan.publicKey[:40]}…, which is not the "
                    f"public half of broker.sign.ssh_key ({keyFile})"
                )
        workDir = tempfile.mkdtemp(prefix="agentsandbox-sign-")
        try:
            buffer = os.path.join(workDir, "payload")
            with open(buffer, "wb") as f:
                f.write(plan.payload)
            result = await runProcess(
                host,
                [sshKeygen, "-Y", "sign", "-n", "git", "-f", keyFile, buffer],
                hostEnv(host.environ),
                cwd=workDir,
                timeout=SIGN_TIMEOUT,
            )
            if result.timedOut:
                raise OpError(f"ssh-keygen did not sign within {SIGN_TIMEOUT:g}s")
            signature = b""
            if result.code == 0:
                try:
                    with open(buffer + ".sig", "rb") as f:
                        signature = f.read()
                except OSError as e:
                    raise OpError(f"ssh-keygen wrote no signature: {e.strerror}") from None
            return Reply(out=signature, err=result.out + result.err, code=result.code)
        finally:
            shutil.rmtree(workDir, ignore_errors=True)


def _home(environ: Mapping[str, str]) -> str | None:
    home = environ.get("HOME")
    return home if home and os.path.isdir(home) else None


async def _configuredPublicKey(host: Host, sshKeygen: str, keyFile: str) -> str | None:
    try:
        with open(keyFile + ".pub") as f:
            return publicKeyOf(f.read())
    except OSError:
        pass
    result = await runProcess(
        host, [sshKeygen, "-y", "-f", keyFile], hostEnv(host.environ), timeout=SIGN_TIMEOUT
    )
    return publicKeyOf(result.out.decode("ascii", "replace")) if result.code == 0 else None


async def gpgProgram(host: Host) -> str:
    """broker.sign.program, else the person's git ``gpg.program``, else ``gpg``."""
    chosen = host.config.broker.sign_program
    if chosen is None:
        git = which("git", host.environ)
        if git is not None:
            result = await runProcess(
                host,
                [git, "config", "--global", "--get", "gpg.program"],
                hostEnv(host.environ),
                cwd=_home(host.environ),
                timeout=SIGN_TIMEOUT,
            )
            value = result.out.decode("utf-8", "replace").strip()
            if result.code == 0 and value:
                chosen = value
    if chosen is None or isAgentsandbox(which(chosen, host.environ) or chosen):
        chosen = "gpg"
    found = which(chosen, host.environ)
    if found is None:
        raise OpError(f"the gpg program {chosen!r} is not on the broker's PATH (broker.sign.program)")
    return found


# --------------------------------------------------------------------------- run


@dataclass(frozen=True)
class RunPlan:
    command: RunCommand
    args: tuple[str, ...]


class Run:
    name = "run"

    def validate(self, request: Request, config: Config) -> RunPlan:
        if request.input is not None or request.memory or request.cpu or request.key:
            raise OpError("run takes only a command name and its arguments")
        if not request.args:
            raise OpError("run needs the name of a host command")
        name, *args = request.args
        command = config.broker.command(name)
        if command is None:
            known = ", ".join(c.name for c in config.broker.run) or "none configured"
            raise OpError(
                f"no host command {name!r} (known: {known}); a person allows one with "
                f"[broker.run.{name}] in the config"
            )
        if len(args) != len(command.args):
            raise OpError(
                f"host command {name!r} takes {len(command.args)} argument(s), got {len(args)} "
                f"(broker.run.{name}.args)"
            )
        for i, (arg, pattern) in enumerate(zip(args, command.args, strict=True)):
            # The program reads bytes: ``\d``, ``\w`` and ``\s`` mean their ASCII
            # classes (a Unicode digit is not a digit to the program), and the
            # whole argument must match (``fullmatch``: ``$`` would let a final
            # newline through).
            if re.fullmatch(pattern, arg, re.ASCII) is None:
                raise OpError(
                    f"argument {i + 1} of host command {name!r}, {arg!r}, does not match "
                    f"{pattern!r} (broker.run.{name}.args[{i}])"
                )
            # A program reads a leading '-' as an option, whatever the pattern
            # meant: an operand pattern such as '[a-z0-9.-]+' must not deliver
            # '--upload-pack=...'.  Options pass only through a pattern that
            # itself starts with a literal '-'.
            if arg.startswith("-") and not pattern.startswith(("-", "\\-")):
                raise OpError(
                    f"argument {i + 1} of host command {name!r}, {arg!r}, starts with '-', "
                    f"which the program would read as an option; a pattern that means an "
                    f"option starts with '-' (broker.run.{name}.args[{i}] is {pattern!r})"
                )
        return RunPlan(command=command, args=tuple(args))

    def originKeys(self, plan: Any) -> tuple[str, ...]:
        assert isinstance(plan, RunPlan)
        return plan.command.caller_env

    def perform(self, plan: Any, call: Call, host: Host) -> Deferred[Reply]:
        return defer.ensureDeferred(self._run(plan, call, host))

    async def _run(self, plan: RunPlan, call: Call, host: Host) -> Reply:
        command = plan.command
        cwd = call.origin.cwd
        if cwd is None:
            raise OpError("the requester's working directory cannot be read (deleted?)")
        if not host.policy.readable(cwd, cwd):
            raise OpError(
                f"host command {command.name!r} would run in {cwd}, which the policy does not "
                "let the session read (sandbox.read)"
            )
        env = {n: host.environ[n] for n in command.env if n in host.environ}
        env.update({n: v for n, v in call.origin.env.items() if n in command.caller_env})
        sink = call.output if command.stream else None
        result = await runProcess(
            host,
            [*command.argv, *plan.args],
            env,
            cwd=cwd,
            sink=sink,
            timeout=command.timeout,
        )
        if result.timedOut:
            return Reply(
                error=f"host command {command.name!r} timed out after {command.timeout:g}s "
                f"(broker.run.{command.name}.timeout)",
                out=result.out,
                err=result.err,
                code=result.code,
            )
        return Reply(out=result.out, err=result.err, code=result.code)


# --------------------------------------------------------------------------- scope


class Scope:
    name = "scope"

    def validate(self, request: Request, config: Config) -> scopes.Caps:
        if request.args or request.input is not None or request.key:
            raise OpError("scope takes only memory and cpu")
        try:
            return scopes.decideCaps(config.scope, request.memory, request.cpu)
        except scopes.ScopeError as e:
            raise OpError(str(e)) from None

    def originKeys(self, plan: Any) -> tuple[str, ...]:
        return ()

    def perform(self, plan: Any, call: Call, host: Host) -> Deferred[Reply]:
        return defer.ensureDeferred(self._scope(plan, call, host))

    async def _scope(self, caps: scopes.Caps, call: Call, host: Host) -> Reply:
        problem = scopes.userBusProblem(host.environ)
        if problem is not None:
            raise OpError(problem)
        busctl = which("busctl", host.environ)
        if busctl is None:
            raise OpError("busctl is not on the broker's PATH (it ships with systemd)")
        pid = call.origin.pid
        unit = scopes.unitName(pid)
        env = {
            k: host.environ[k]
            for k in ("PATH", "HOME", "XDG_RUNTIME_DIR", "DBUS_SESSION_BUS_ADDRESS")
            if k in host.environ
        }
        result = await runProcess(
            host, scopes.busctlArgv(busctl, unit, pid, caps), env, timeout=SCOPE_TIMEOUT
        )
        if result.code != 0 or result.timedOut:
            why = result.err.decode("utf-8", "replace").strip() or f"exit {result.code}"
            raise OpError(f"the user systemd did not start {unit}: {scopes.busHint(why)}")
        from agentsandbox.broker.procfs import cgroupOf

        waited = 0.0
        while waited < SCOPE_SETTLE:
            text = await host.inThread(cgroupOf, host.procDir, pid)
            if scopes.inScope(text, unit):
                return await self._enforced(caps, unit, text, host)
            await _sleep(host.clock, SCOPE_POLL)
            waited += SCOPE_POLL
        raise OpError(f"process {pid} is not in {unit} after {SCOPE_SETTLE:g}s")

    async def _enforced(self, caps: scopes.Caps, unit: str, cgroupText: str, host: Host) -> Reply:
        """The reply once the scope exists: refused unless its caps reached the kernel."""
        problem = await host.inThread(scopes.capProblem, cgroupText, unit, caps, host.cgroupRoot)
        if problem is None:
            return Reply(out=unit.encode() + b"\n")
        if not host.config.scope.allow_uncapped:
            raise OpError(
                f"{unit} was made but its caps do not reach the kernel, so the command would run "
                f"uncapped: {problem} (scope.allow_uncapped = true runs it anyway, with a warning)"
            )
        warning = (
            f"agentsandbox cap: WARNING: running UNCAPPED: {unit} was made but its caps do not "
            f"reach the kernel: {problem} (scope.allow_uncapped = true lets it run)\n"
        )
        return Reply(out=unit.encode() + b"\n", err=warning.encode())


def _sleep(clock: IReactorTime, seconds: float) -> Deferred[None]:
    d: Deferred[None] = Deferred()
    call = clock.callLater(seconds, d.callback, None)
    d.addErrback(lambda f: call.cancel() if call.active() else None)
    return d


# --------------------------------------------------------------------------- kubeconfig


@dataclass(frozen=True)
class KubePlan:
    context: str
    source: str


def socksProxy(env: Mapping[str, str]) -> str | None:
    """The first socks5/socks5h proxy URL of ALL_PROXY … ftp_proxy, scheme forced to socks5.

    client-go dials only ``socks5``; the loopback clusters are IP literals, so nothing
    is lost by resolving locally.
    """
    for name in _SOCKS_VARS:
        value = env.get(name)
        if not value:
            continue
        try:
            parts = urlsplit(value)
        except ValueError:
            continue
        if parts.scheme in ("socks5", "socks5h") and parts.hostname:
            return urlunsplit(("socks5", parts.netloc, parts.path, parts.query, parts.fragment))
    return None


def proxyKubeconfig(doc: dict[str, Any], proxy: str) -> bool:
    """Point every loopback cluster at ``proxy``; True when something changed."""
    changed = False
    for entry in doc.get("clusters") or []:
        cluster = entry.get("cluster") if isinstance(entry, dict) else None
        if not isinstance(cluster, dict):
            continue
        server = cluster.get("server")
        if not isinstance(server, str):
            continue
        try:
            host = urlsplit(server).hostname
        except ValueError:
            continue
        if host and isLoopbackName(host) and cluster.get("proxy-url") != proxy:
            cluster["proxy-url"] = proxy
            changed = True
    return changed


def minifyKubeconfig(doc: dict[str, Any], context: str) -> dict[str, Any]:
    """The one context, its cluster and its user (what ``kubectl config view --minify`` gives)."""

    def named(kind: str, name: str) -> list[Any]:
        return [e for e in doc.get(kind) or [] if isinstance(e, dict) and e.get("name") == name]

    contexts = named("contexts", context)
    if not contexts:
        raise OpError(f"the kubeconfig has no context {context!r}")
    ctx = contexts[0].get("context") or {}
    out = dict(doc)
    out["contexts"] = contexts[:1]
    out["clusters"] = named("clusters", str(ctx.get("cluster", "")))[:1]
    out["users"] = named("users", str(ctx.get("user", "")))[:1]
    out["current-context"] = context
    return out


class Kubeconfig:
    name = "kubeconfig"

    def validate(self, request: Request, config: Config) -> KubePlan:
        if request.input is not None or request.memory or request.cpu or request.key:
            raise OpError("kubeconfig takes only a context name")
        if len(request.args) != 1:
            raise OpError("kubeconfig takes exactly one context name")
        context = request.args[0]
        if not _CONTEXT.fullmatch(context):
            raise OpError(f"{context!r} is not a kubeconfig context name")
        if config.broker.kubeconfig is None:
            raise OpError(
                "the broker hands out no kubeconfig: set broker.kubeconfig to the file whose "
                "contexts sandboxed sessions may use"
            )
        return KubePlan(context=context, source=config.broker.kubeconfig)

    def originKeys(self, plan: Any) -> tuple[str, ...]:
        return _SOCKS_VARS

    def perform(self, plan: Any, call: Call, host: Host) -> Deferred[Reply]:
        return defer.ensureDeferred(self._kube(plan, call, host))

    async def _kube(self, plan: KubePlan, call: Call, host: Host) -> Reply:
        proxy = socksProxy(call.origin.env)
        if proxy is None and call.origin.sandboxed:
            raise OpError(
                "the requester's environment names no SOCKS5 proxy (ALL_PROXY, FTP_PROXY), "
                "so its loopback clusters would be out of reach"
            )
        doc = await self._load(plan, host)
        if proxy is not None:
            proxyKubeconfig(doc, proxy)
        return Reply(out=(json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())

    async def _load(self, plan: KubePlan, host: Host) -> dict[str, Any]:
        kubectl = which("kubectl", host.environ)
        if kubectl is not None:
            result = await runProcess(
                host,
                [
                    kubectl, "config", "view", "--raw", "--minify", "--flatten",
                    f"--kubeconfig={plan.source}", f"--context={plan.context}", "-o", "json",
                ],
                {k: v for k, v in host.environ.items() if k in ("PATH", "HOME")},
                timeout=KUBECONFIG_TIMEOUT,
            )
            if result.code != 0:
                why = result.err.decode("utf-8", "replace").strip()
                raise OpError(f"kubectl could not read context {plan.context!r}: {why}")
            raw = result.out
        else:
            try:
                raw = await host.inThread(_readFile, plan.source)
            except OSError as e:
                raise OpError(
                    f"cannot read broker.kubeconfig {plan.source}: {e.strerror or e}"
                ) from None
        try:
            doc = json.loads(raw)
        except ValueError:
            raise OpError(
                f"broker.kubeconfig {plan.source} is not JSON and kubectl, which reads YAML, "
                "is not on the broker's PATH"
            ) from None
        if not isinstance(doc, dict):
            raise OpError(f"broker.kubeconfig {plan.source} is not a kubeconfig")
        return minifyKubeconfig(doc, plan.context) if kubectl is None else doc


def _readFile(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read(4 << 20)


# --------------------------------------------------------------------------- table

OPS: dict[str, Op] = {op.name: op for op in (Ping(), Status(), Sign(), Run(), Scope(), Kubeconfig(), Session())}

__all__ = [
    "OPS",
    "Call",
    "Host",
    "OpError",
    "RequesterGone",
    "Result",
    "runProcess",
]
