"""The whole service end to end: the real Claude Code and ``agentsandbox run`` against it.

One module-wide stack:

* the real service (``makeService`` on a real config file, in a child process:
  proxy, broker, token keepers, watcher, audit log), with a fake GitHub behind
  its injected resolver and dialer (``support/service_harness.py``);
* a local allowed host: a web server on 127.0.0.1 that ``sandbox.domains``
  lists as ``127.0.0.1:PORT``;
* a fixture user whose home holds a canary SSH key, AWS credentials and a gpg
  signing key in ``~/.gnupg``, none of which a sandbox may read;
* the GitHub token as the service's own environment variable (an inject rule
  with ``token_env``): a canary that must reach the fake's Authorization header
  and nothing else.

Then one Claude Code session per binary (2.1.197 always; the newest where it
runs) with the drop-in installed in /etc/claude-code (restored afterwards), and
one ``agentsandbox run -- sh -c '…'``, each making the same calls:

(a) a plain ``curl http://127.0.0.1:PORT/`` to the allowed local host goes through
    our proxy (audit shows it), and one to an unlisted loopback port is refused
    by our proxy naming ``sandbox.domains``;
(b) ``curl`` to an unlisted host, refused by our proxy with our reason;
(c) ``git clone https://github.com/o/r`` with the token injected at the fake
    and absent from the sandbox's environment and files;
(d) ``git commit -S`` signed through the broker, verified on the host;
(e) ``cat ~/.ssh/id_ed25519`` denied by the sandbox;
and, for Claude Code, a Read of ``~/.aws/credentials`` denied.

Each check is its own test over the one recorded session.

Both sandboxes set ``NO_PROXY`` to loopback and the private ranges, so a plain
client would dial a listed ``127.0.0.1:PORT`` inside its own empty network
namespace.  The SessionStart hook (Claude Code) and ``agentsandbox run`` (srt)
narrow it inside the sandbox to the loopback names the allow list does not
claim (``Policy.noProxy``): the calls here are plain ``curl``, no ``--noproxy``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from agentsandbox.audit import readRecords
from agentsandbox.run import BRIDGE_WAIT
from tests.conftest import suiteEnv
from tests.support.claude_harness import (
    CANARY_ENV,
    CANARY_KEY,
    MANAGED_ROOT,
    ClaudeRun,
    ManagedSettingsGuard,
    ToolOutcome,
    World,
    freeLoopbackPort,
    installedBinaries,
    mockAPI,
    requireOrSkip,
    requireSomeBinary,
    runClaude,
    tempLeftoversRemoved,
)
from tests.support.inject_github import gitHttpBackend
from tests.support.mock_messages import MOCK_ERROR, MockMessagesAPI, ToolCall
from tests.support.service_harness import (
    SIGNER,
    LocalSite,
    ServiceProcess,
    filesHolding,
    makeSigningKey,
    runBounded,
    secretForms,
    sections,
    seedBareRepo,
    stopGpgAgent,
)

#: The GitHub token the service injects: a canary found only in the fake's headers.
TOKEN = "ghu_" + "SvcE2eCanary" * 3 + "Q7"
TOKEN_ENV = "AGENTSANDBOX_E2E_GITHUB_TOKEN"
AWS_CANARY = "AGENTSANDBOX-CANARY-AWS-SECRET-41b9"
README = "the fake GitHub's o/r, cloned through the proxy\n"
UNLISTED = "example.net"
REFUSAL = f"{UNLISTED}:80 is not on the sandbox's allow list"
#: What every session needs (Claude Code's sandbox drives bwrap, socat and rg itself).
TOOLS = ("bwrap", "socat", "rg", "git", "gpg", "gpgconf", "curl")
#: A bound on how long the proxy may take to write a record after a client closed.
AUDIT_WAIT = 10.0
#: A bound on one whole session (the goal is well under a minute).
SESSION_TIMEOUT = 120.0


def _missing() -> str | None:
    for tool in TOOLS:
        if shutil.which(tool) is None:
            return f"{tool} is not installed (.ci/install-deps installs it)"
    if gitHttpBackend() is None:
        return "git-http-backend is not installed (it comes with git)"
    return None


def _env(*names: str, **extra: str) -> dict[str, str]:
    env = {n: os.environ[n] for n in names if n in os.environ}
    env.update(suiteEnv())
    env.update(extra)
    return env


# --------------------------------------------------------------------------- the stack


@dataclass
class Stack:
    """Everything the sessions share; see the module docstring."""

    world: World
    runtime: Path
    gnupg: Path
    fingerprint: str
    site: LocalSite
    service: ServiceProcess
    #: A loopback web server the allow list does not name: never reached.
    unlisted: LocalSite

    @property
    def home(self) -> Path:
        return self.world.home

    @property
    def base(self) -> Path:
        return self.world.base

    @property
    def awsLink(self) -> Path:
        """A link in the project to ~/.aws/credentials: only a layer that resolves it can tell."""
        return self.world.project / "aws-credentials"

    def userEnv(self) -> dict[str, str]:
        """The person's environment for agentsandbox and Claude Code (no token, no GNUPGHOME)."""
        env = self.world.agentsandboxEnv()
        env["XDG_RUNTIME_DIR"] = str(self.runtime)
        return env

    def claudeEnv(self, api: MockMessagesAPI) -> dict[str, str]:
        env = self.world.claudeEnv(api)
        env["XDG_RUNTIME_DIR"] = str(self.runtime)
        return env

    def audit(self) -> list[dict[str, Any]]:
        return list(readRecords(str(self.home / ".local" / "state" / "agentsandbox" / "audit.jsonl")))

    def hostGit(self, *args: str) -> subprocess.CompletedProcess[str]:
        """git on the host, as the person: their gpg home, no sandbox."""
        env = _env("PATH", HOME=str(self.home), GNUPGHOME=str(self.gnupg), LANG="C.UTF-8")
        return subprocess.run(["git", *args], env=env, capture_output=True, text=True, timeout=60)

    def secretRoots(self) -> list[Path]:
        """Where a leaked token would land: the fixture home (state dir and clones
        included), the runtime dir, Claude Code's temp dir, the service's logs."""
        return [self.home, self.runtime, self.world.claudeTmp, self.service.workDir]


def _config(world: World, site: LocalSite) -> str:
    # Write paths stay out of read paths (2.1.197 cannot start its sandbox otherwise).
    return (
        "[sandbox]\n"
        'read = ["~/docs"]\n'
        'write = ["~/work"]\n'
        f'domains = ["127.0.0.1:{site.port}", "github.com", "*.github.com"]\n'
        "\n[proxy]\n"
        f"port = {world.proxyPort}\n"
        "\n[[inject]]\n"
        'hosts = ["github.com"]\n'
        'format = "Basic {basic}"\n'
        'basic_user = "x-access-token"\n'
        f'token_env = "{TOKEN_ENV}"\n'
        "\n[[inject]]\n"
        'hosts = ["api.github.com", "uploads.github.com"]\n'
        'format = "token {token}"\n'
        f'token_env = "{TOKEN_ENV}"\n'
    )


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    why = _missing()
    if why is not None:
        requireOrSkip(why)
    # Not under /tmp: the temp dir is writable by policy, and a home inside it
    # would make the whole fixture home writable.
    base = Path(tempfile.mkdtemp(prefix="agentsandbox-svc-e2e-", dir="/var/tmp"))
    site = LocalSite()
    unlisted = LocalSite()
    world = World(base=base, proxyPort=freeLoopbackPort()).build()
    gnupg = world.home / ".gnupg"
    service: ServiceProcess | None = None
    try:
        (world.home / ".aws").mkdir()
        (world.home / ".aws" / "credentials").write_text(
            f"[default]\naws_secret_access_key = {AWS_CANARY}\n")
        (world.project / "aws-credentials").symlink_to(world.home / ".aws" / "credentials")
        runtime = base / "run"
        runtime.mkdir(mode=0o700)
        fingerprint = makeSigningKey(gnupg)
        gitRoot = base / "fake-git"
        gitRoot.mkdir()
        (base / "seed").mkdir()
        seedBareRepo(gitRoot / "r", base / "seed", README)
        world.config.write_text(_config(world, site))
        # The service's own environment: the person's, plus the token and the gpg home.
        serviceEnv = world.agentsandboxEnv()
        serviceEnv.update(XDG_RUNTIME_DIR=str(runtime), GNUPGHOME=str(gnupg), **{TOKEN_ENV: TOKEN})
        service = ServiceProcess(world.config, serviceEnv, base / "service", gitRoot).start()
        assert service.proxyPort == world.proxyPort
        yield Stack(world, runtime, gnupg, fingerprint, site, service, unlisted)
    finally:
        if service is not None:
            service.stop()
        stopGpgAgent(gnupg)
        site.close()
        unlisted.close()
        shutil.rmtree(base, ignore_errors=True)


@dataclass
class Session:
    """One recorded session's outputs and what the service and the fake saw meanwhile."""

    label: str
    clone: Path
    texts: dict[str, str]
    audit: list[dict[str, Any]]
    fake: list[dict[str, Any]]
    outputs: list[str]
    errors: dict[str, bool] = field(default_factory=dict)
    run: ClaudeRun | None = None

    def describe(self) -> str:
        if self.run is not None:
            return self.run.describe()
        parts = [f"--- {k}\n{v}" for k, v in self.texts.items()]
        parts.append(f"--- stderr of agentsandbox run\n{self.outputs[-1] if self.outputs else ''}")
        parts.append(f"--- audit records of the session\n{json.dumps(self.audit, indent=1)}")
        return "\n".join(parts)


#: Claude Code wraps every Bash command like srt does, starting its in-sandbox
#: bridges in the background (see ``agentsandbox.run.BRIDGE_WAIT``): a command that
#: connects at once first waits for them, as ``agentsandbox run`` does for its command.
BRIDGES_UP = BRIDGE_WAIT.removesuffix('exec "$@"')


def _commands(stack: Stack, label: str, clone: Path) -> dict[str, str]:
    """The shell commands of checks (a) to (e) and the environment dump, by name."""
    path = f"/{label}-a"
    wait = BRIDGES_UP if label != "run" else ""
    return {
        "a": f"{wait}curl -sS http://127.0.0.1:{stack.site.port}{path}",
        "a-unlisted": f"{wait}curl -sS -i http://127.0.0.1:{stack.unlisted.port}/{label}-a-unlisted",
        "no-proxy": "echo NO_PROXY=$NO_PROXY no_proxy=$no_proxy",
        "b": f"{wait}curl -sS -i http://{UNLISTED}/{label}-b; curl -sS https://{UNLISTED}/ ; echo rc=$?",
        "env": "env",
        "c": f"{wait}git clone -q https://github.com/o/r {clone} && cat {clone}/README.md && git -C {clone} remote -v",
        "d": (
            f"cd {clone} && echo 'signed in the sandbox' > signed.txt && git add signed.txt && "
            f"git -c user.name=Signer -c user.email=signer@example.org -c user.signingkey={stack.fingerprint} "
            f"commit -S -q -m 'signed inside the sandbox ({label})' && echo COMMITTED"
        ),
        # The key the broker signed with, looked for where the sandbox could see it.
        "gnupg": "ls -A ~/.gnupg/private-keys-v1.d",
        "e": "cat ~/.ssh/id_ed25519",
    }


def _waitForAudit(stack: Stack, since: int, port: int) -> list[dict[str, Any]]:
    """The records written since ``since``, once the allowed request's record is there (bounded)."""
    deadline = time.monotonic() + AUDIT_WAIT
    while True:
        records = stack.audit()[since:]
        if any(r.get("event") == "forward" and r.get("port") == port for r in records):
            return records
        if time.monotonic() > deadline:
            return records
        time.sleep(0.05)


# --------------------------------------------------------------------------- Claude Code


@pytest.fixture(scope="module")
def api() -> Iterator[MockMessagesAPI]:
    with mockAPI() as server:
        yield server


@pytest.fixture(scope="module")
def managed(stack: Stack) -> Iterator[None]:
    """The drop-in rendered from the stack's config, in an otherwise empty /etc/claude-code."""
    requireSomeBinary()
    with ManagedSettingsGuard(), tempLeftoversRemoved():
        env = stack.userEnv()
        installed = subprocess.run(
            [str(stack.world.launcher), "install", "--managed-dir", str(MANAGED_ROOT)],
            env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert installed.returncode == 0, installed.stderr
        yield


class Sessions:
    """Each session runs once, when a test first asks for it, and is kept for the others."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.done: dict[str, Session] = {}

    def get(self, label: str, request: pytest.FixtureRequest) -> Session:
        if label not in self.done:
            if label == "run":
                if shutil.which("srt") is None:
                    pytest.skip("srt is not installed (npm install -g @anthropic-ai/sandbox-runtime)")
                self.done[label] = self.agentsandboxRun()
            else:
                binary = installedBinaries()[label.removeprefix("claude-")]
                path = binary.require()
                request.getfixturevalue("managed")
                self.done[label] = self.claude(label, path, request.getfixturevalue("api"))
        return self.done[label]

    def claude(self, label: str, binary: str, api: MockMessagesAPI) -> Session:
        stack = self.stack
        clone = stack.home / "work" / f"clone-{label}"
        commands = _commands(stack, label, clone)
        names = list(commands)
        calls = [ToolCall("Bash", {"command": commands[n]}) for n in names]
        names += ["read", "read-link"]
        calls += [ToolCall("Read", {"file_path": str(stack.home / ".aws" / "credentials")}),
                  ToolCall("Read", {"file_path": str(stack.awsLink)})]
        auditBefore, fakeBefore = len(stack.audit()), len(stack.service.fakeSeen())
        run = runClaude(binary, calls, cwd=stack.world.project, env=stack.claudeEnv(api), api=api,
                        timeout=SESSION_TIMEOUT)
        assert not run.timedOut, run.describe()
        assert run.result is not None, f"no result event\n{run.describe()}"
        assert MOCK_ERROR not in str(run.result.get("result")), run.describe()
        assert len(run.outcomes) == len(calls), run.describe()
        outcomes: dict[str, ToolOutcome] = dict(zip(names, run.outcomes, strict=True))
        return Session(
            label=label,
            clone=clone,
            texts={n: o.text for n, o in outcomes.items()},
            errors={n: o.isError for n, o in outcomes.items()},
            audit=_waitForAudit(stack, auditBefore, stack.site.port),
            fake=stack.service.fakeSeen()[fakeBefore:],
            outputs=[run.everything],
            run=run,
        )

    def agentsandboxRun(self) -> Session:
        stack = self.stack
        label = "run"
        clone = stack.home / "work" / f"clone-{label}"
        commands = _commands(stack, label, clone)
        # srt points TMPDIR at /tmp/claude without creating it: use one the policy lets it write.
        tmp = stack.home / "work" / "tmp-run"
        # First of all, before anything else could give the bridges time: do they listen?
        script = (
            "echo '=== bridges ==='\n"
            "grep -c ':0C38 00000000:0000 0A' /proc/net/tcp; grep -c ':0438 00000000:0000 0A' /proc/net/tcp\n"
            f'export TMPDIR={tmp}; mkdir -p "$TMPDIR"\n'
        ) + "".join(
            f"echo '=== {name} ==='\n( {command} ) 2>&1\necho \"rc=$?\"\n" for name, command in commands.items()
        )
        env = stack.userEnv()
        # Credentials in the caller's environment: deny-by-default passing must drop them.
        env.update(CANARY_ENV)
        auditBefore, fakeBefore = len(stack.audit()), len(stack.service.fakeSeen())
        done = runBounded([str(stack.world.launcher), "run", "--", "sh", "-c", script],
                          env=env, cwd=stack.world.project, timeout=SESSION_TIMEOUT)
        assert done.returncode == 0, f"agentsandbox run exited {done.returncode}\n{done.stdout}\n{done.stderr}"
        texts = sections(done.stdout)
        return Session(
            label=label,
            clone=clone,
            texts=texts,
            errors={n: "\nrc=0\n" not in "\n" + t for n, t in texts.items()},
            audit=_waitForAudit(stack, auditBefore, stack.site.port),
            fake=stack.service.fakeSeen()[fakeBefore:],
            outputs=[done.stdout, done.stderr],
        )


@pytest.fixture(scope="module")
def sessions(stack: Stack) -> Sessions:
    return Sessions(stack)


CLAUDE = [pytest.param(label, marks=pytest.mark.claude) for label in ("claude-pinned", "claude-latest")]
EVERY = [*CLAUDE, pytest.param("run", marks=pytest.mark.srt)]


@pytest.fixture(params=EVERY)
def session(request: pytest.FixtureRequest, sessions: Sessions) -> Session:
    """Each check over a Claude Code session (2.1.197, the newest) and over ``agentsandbox run``."""
    return sessions.get(request.param, request)


@pytest.fixture(params=CLAUDE)
def claudeSession(request: pytest.FixtureRequest, sessions: Sessions) -> Session:
    return sessions.get(request.param, request)


# --------------------------------------------------------------------------- the checks


def _text(session: Session, name: str) -> str:
    """What the check's command printed, stdout and stderr."""
    return session.texts.get(name, "")


def test_a_allowed_local_host_through_our_proxy(stack: Stack, session: Session) -> None:
    path = f"/{session.label}-a"
    assert f"{LocalSite.BODY}: {path}" in _text(session, "a"), session.describe()
    assert path in stack.site.paths
    forwarded = [r for r in session.audit if r.get("event") == "forward" and r.get("port") == stack.site.port]
    assert forwarded, f"no audit record for 127.0.0.1:{stack.site.port}: {session.audit}"
    assert forwarded[0]["host"] == "127.0.0.1" and forwarded[0]["status"] == 200


def test_a_unlisted_loopback_port_refused_by_our_proxy(stack: Stack, session: Session) -> None:
    text = _text(session, "a-unlisted")
    port = stack.unlisted.port
    assert "HTTP/1.1 403" in text, session.describe()
    assert f"127.0.0.1:{port} is not on the sandbox's allow list" in text and "sandbox.domains" in text, session.describe()
    assert stack.unlisted.paths == []
    refused = [r for r in session.audit if r.get("event") == "refused" and r.get("port") == port]
    assert refused and refused[0]["host"] == "127.0.0.1", session.audit


def test_a_no_proxy_narrowed_inside_the_sandbox(session: Session) -> None:
    # 127.0.0.1 is claimed by the allow list; localhost and ::1 stay direct, for
    # servers the command runs inside its own network namespace.
    assert "NO_PROXY=localhost,::1 no_proxy=localhost,::1" in _text(session, "no-proxy"), session.describe()


def test_b_unlisted_host_refused_by_our_proxy(session: Session) -> None:
    text = _text(session, "b")
    assert "HTTP/1.1 403" in text, session.describe()
    assert REFUSAL in text and "sandbox.domains" in text, session.describe()
    assert "CONNECT tunnel failed, response 403" in text, session.describe()
    refused = [r for r in session.audit if r.get("event") == "refused" and r.get("host") == UNLISTED]
    assert {r.get("port") for r in refused} == {80, 443}, session.audit
    assert all("sandbox.domains" in r.get("reason", "") for r in refused)


def test_c_git_clone_with_the_token_injected_at_the_fake(stack: Stack, session: Session) -> None:
    text = _text(session, "c")
    assert README.strip() in text, session.describe()
    assert (session.clone / "README.md").read_text() == README
    gitRequests = [s for s in session.fake if s["path"].startswith("/o/r/")]
    assert any(s["path"].startswith("/o/r/info/refs") for s in gitRequests), session.fake
    # The fake accepts nothing else, and saw exactly the injected Basic credential every time.
    assert {s["authorization"] for s in gitRequests} == {"basic"}, session.fake
    injected = [r for r in session.audit if r.get("event") == "tunnel" and r.get("host") == "github.com" and r.get("via") == "inject"]
    assert injected, session.audit
    # Both directions are counted: the clone came down through the terminated tunnel.
    assert all(r.get("up", 0) > 0 and r.get("down", 0) > 0 for r in injected), injected


def test_c_token_absent_from_sandbox_env_outputs_and_files(stack: Stack, session: Session) -> None:
    env = session.texts["env"]
    assert "SANDBOX_RUNTIME=1" in env and "AGENTSANDBOX=1" in env, session.describe()
    names = {line.split("=", 1)[0] for line in env.splitlines() if "=" in line}
    assert not names & {*CANARY_ENV, TOKEN_ENV, "GNUPGHOME"}, sorted(names & {*CANARY_ENV, TOKEN_ENV})
    forms = secretForms(TOKEN)
    for output in session.outputs:
        for form in forms:
            assert form.decode() not in output, f"the token reached {session.label}'s output"
    assert filesHolding(stack.secretRoots(), forms) == []
    assert filesHolding([session.clone], forms) == []


def test_d_commit_signed_through_the_broker_verifies_on_the_host(stack: Stack, session: Session) -> None:
    text = _text(session, "d")
    assert "COMMITTED" in text, session.describe()
    assert session.errors["gnupg"] and ".key" not in session.texts["gnupg"], session.describe()
    subject = stack.hostGit("-C", str(session.clone), "log", "-1", "--format=%s")
    assert subject.stdout.strip() == f"signed inside the sandbox ({session.label})"
    verify = stack.hostGit("-C", str(session.clone), "verify-commit", "-v", "HEAD")
    assert verify.returncode == 0, verify.stderr
    assert f'Good signature from "{SIGNER}"' in verify.stderr
    signer = stack.hostGit("-C", str(session.clone), "log", "-1", "--format=%GF")
    assert signer.stdout.strip() == stack.fingerprint


def test_e_ssh_key_denied_by_the_sandbox(stack: Stack, session: Session) -> None:
    text = _text(session, "e")
    assert "No such file or directory" in text, session.describe()
    assert session.errors["e"], session.describe()
    for output in session.outputs:
        assert CANARY_KEY not in output
    assert (stack.home / ".ssh" / "id_ed25519").read_text().count(CANARY_KEY) == 1


def test_read_aws_credentials_denied(stack: Stack, claudeSession: Session) -> None:
    session = claudeSession
    assert session.run is not None
    credentials = str(stack.home / ".aws" / "credentials")
    for output in session.outputs:
        assert AWS_CANARY not in output, session.describe()
    direct = session.texts["read"]
    assert session.errors["read"], session.describe()
    if installedBinaries()[session.label.removeprefix("claude-")].checksBeforeHooks:
        # 2.1.197 applies the drop-in's Read(~/.aws/**) rule (ours too) before any hook runs.
        assert "denied by your permission settings" in direct, session.describe()
    else:
        assert "agentsandbox refused to read" in direct and credentials in direct, session.describe()
    # The same file through a link in the project: no permission rule sees it, and on
    # every version our hook refuses it, naming the file it leads to.
    linked = session.texts["read-link"]
    assert session.errors["read-link"], session.describe()
    assert f"agentsandbox refused to read {stack.awsLink} (a link to {credentials})" in linked, session.describe()


@pytest.mark.srt
def test_run_starts_the_command_once_the_bridges_listen(sessions: Sessions, request: pytest.FixtureRequest) -> None:
    # srt starts its socat bridges (localhost:3128 and :1080) in the background;
    # agentsandbox run holds the command until both listen (run.BRIDGE_WAIT).
    session = sessions.get("run", request)
    assert session.texts["bridges"].split() == ["1", "1"], session.describe()


# --------------------------------------------------------------------------- attribution (issue 29)

#: What a sandboxed command prints of its proxy variables: the credential shown as
#: CRED (sed reads the value on stdin: it never stands in an argv).
_PROXY_VARS = (
    'echo "SESSION=$AGENTSANDBOX_SESSION"; for v in HTTP_PROXY HTTPS_PROXY ALL_PROXY; do '
    'eval "u=\\${$v-}"; printf "%s=%s\\n" "$v" "$u" | sed -E "s/s1\\.[A-Za-z0-9_-]+/CRED/"; done'
)


def _sessionRecords(stack: Stack, session: str) -> list[dict[str, Any]]:
    done = subprocess.run(
        [str(stack.world.launcher), "log", "--json", "--session", session],
        env=stack.userEnv(), capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


@pytest.mark.claude
@pytest.mark.parametrize("label", ["claude-pinned", "claude-latest"])
def test_two_claude_sessions_at_once_are_attributed_apart(stack: Stack, label: str, request: pytest.FixtureRequest) -> None:
    """Two sessions of one release run at once, each with its own mock API; each
    one's Bash reaches the proxy with its own credential, and `agentsandbox log
    --session` shows each one's requests and nothing of the other's.

    Each session works in a project of its own: two Claude Code processes in one
    directory race over the empty files bwrap leaves as mount points (`.mcp.json`
    and the other protected names), each removing them when its own commands end,
    so the other's next sandbox can fail to start ("bwrap: Can't find source
    path .../.mcp.json"); seen on 2.1.197, and not ours to hold (docs/hook.md, "Known limits")."""
    import threading

    binary = installedBinaries()[label.removeprefix("claude-")].require()
    request.getfixturevalue("managed")
    targets = {"one": stack.site.port, "two": stack.unlisted.port}
    projects = {"one": stack.world.project, "two": stack.world.project.parent / f"{label}-two"}
    projects["two"].mkdir(exist_ok=True)
    runs: dict[str, ClaudeRun] = {}
    with mockAPI() as apiOne, mockAPI() as apiTwo:
        apis = {"one": apiOne, "two": apiTwo}

        def play(name: str) -> None:
            command = (f"{BRIDGES_UP}curl -sS -i http://127.0.0.1:{targets[name]}/{label}-{name}; echo; "
                       + _PROXY_VARS)
            runs[name] = runClaude(binary, [ToolCall("Bash", {"command": command})], cwd=projects[name],
                                   env=stack.claudeEnv(apis[name]), api=apis[name], timeout=SESSION_TIMEOUT)

        threads = [threading.Thread(target=play, args=(name,)) for name in targets]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    ids: dict[str, str] = {}
    for name, run in runs.items():
        assert not run.timedOut and run.result is not None, run.describe()
        ids[name] = next(e["session_id"] for e in run.events if e.get("session_id"))
        text = run.outcomes[0].text
        assert "SESSION=" in text, run.describe()
        print(f"\n{label} session {name}: what its sandboxed Bash sees\n{text[text.index('SESSION='):]}")
        assert f"SESSION={ids[name]}" in text, run.describe()
        assert "HTTPS_PROXY=http://agentsandbox:CRED@localhost:3128" in text, run.describe()
    assert ids["one"] != ids["two"]
    deadline = time.monotonic() + AUDIT_WAIT
    while True:
        one, two = _sessionRecords(stack, ids["one"]), _sessionRecords(stack, ids["two"])
        if any(r["event"] == "forward" for r in one) and any(r["event"] == "refused" for r in two):
            break
        assert time.monotonic() < deadline, (one, two)
        time.sleep(0.05)
    assert {r["port"] for r in one} == {stack.site.port}, one
    assert {r["port"] for r in two} == {stack.unlisted.port}, two
    assert all(r["session"] == ids["one"] for r in one) and all(r["session"] == ids["two"] for r in two)
    assert f"/{label}-one" in stack.site.paths and f"/{label}-two" not in stack.unlisted.paths


@pytest.mark.srt
def test_run_is_a_session_of_its_own(stack: Stack) -> None:
    if shutil.which("srt") is None:
        pytest.skip("srt is not installed (npm install -g @anthropic-ai/sandbox-runtime)")
    done = runBounded(
        [str(stack.world.launcher), "run", "--", "sh", "-c",
         f"curl -sS http://127.0.0.1:{stack.site.port}/run-session; echo; {_PROXY_VARS}; "
         "echo CREDENTIAL_VAR=${AGENTSANDBOX_SESSION_CREDENTIAL-unset}"],
        env=stack.userEnv(), cwd=stack.world.project, timeout=SESSION_TIMEOUT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    print(f"\nagentsandbox run: what its command sees\n{done.stdout}")
    session = done.stdout.split("SESSION=", 1)[1].split()[0]
    assert session.startswith("run-") and f"session {session}" in done.stderr
    assert "HTTPS_PROXY=http://agentsandbox:CRED@localhost:3128" in done.stdout
    assert "CREDENTIAL_VAR=unset" in done.stdout  # moved into the URLs, then unset
    deadline = time.monotonic() + AUDIT_WAIT
    while not (records := _sessionRecords(stack, session)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert [(r["event"], r["port"]) for r in records] == [("forward", stack.site.port)]


def test_the_service_kept_the_token_to_itself(stack: Stack) -> None:
    """Whatever ran in this module: no log, audit record or report of the service holds it."""
    assert stack.service.alive(), stack.service.log()
    forms = secretForms(TOKEN)
    log = stack.service.log()
    assert "token renewed" in log
    for form in forms:
        assert form.decode() not in log
    assert filesHolding([stack.service.workDir, stack.home / ".local" / "state"], forms) == []
