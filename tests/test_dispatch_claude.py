"""The real Claude Code, offline, as a real user A behind the dispatcher.

A user made with ``useradd`` gets the claude harness's fixture home (chowned to
them), their own ``agentsandbox serve`` registered with a dispatcher that runs
as ``nobody`` on the drop-in's port, and the system drop-in rendered by
``agentsandbox install``.  Claude Code runs as A (setpriv) against the mock
Messages API; its sandboxed ``curl`` goes to the dispatcher's port, which hands
the connection to A's service: the body comes back and A's audit log has it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.service_process import ServiceProcess
from tests.support.claude_harness import (
    MANAGED_ROOT,
    ManagedSettingsGuard,
    World,
    mockAPI,
    pinnedClaude,
    runClaude,
    tempLeftoversRemoved,
    writeLauncher,
)
from tests.support.dispatch_world import (
    REGISTERED,
    DispatchWorld,
    UnixUser,
    systemUsers,
    usersAvailable,
)
from tests.support.mock_messages import MOCK_ERROR, ToolCall
from tests.support.service_harness import LocalSite
from tests.test_service_e2e import BRIDGES_UP

why = usersAvailable() or (None if shutil.which("srt") and shutil.which("bwrap") else "srt/bwrap not installed")
pytestmark = [pytest.mark.claude, pytest.mark.skipif(why is not None, reason=why or "")]


def _chownTree(root: Path, user: UnixUser) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            os.lchown(os.path.join(dirpath, name), user.uid, user.gid)
    os.chown(root, user.uid, user.gid)


@pytest.fixture(scope="module")
def userA() -> Iterator[UnixUser]:
    with systemUsers(1) as users:
        yield users[0]


def test_claude_code_as_user_a_through_the_dispatcher(userA: UnixUser) -> None:
    claude = pinnedClaude().require()
    top = tempfile.mkdtemp(prefix="dispatch-claude-", dir="/var/tmp")
    os.chmod(top, 0o755)
    site = LocalSite()
    d = DispatchWorld(top)
    try:
        d.startDispatcher()
        # Not under /tmp: the temp dir is writable by policy.
        world = World(base=Path(top) / "a", proxyPort=d.port).build()
        world.config.write_text(
            "inject = []\n[sandbox]\n"
            'read = ["~/docs"]\nwrite = ["~/work"]\n'
            f'domains = ["127.0.0.1:{site.port}"]\n'
            f"\n[proxy]\nport = {d.port}\n"
        )
        runtime = world.base / "run"
        runtime.mkdir(mode=0o700)
        _chownTree(world.base, userA)
        env = {**world.agentsandboxEnv(), "XDG_RUNTIME_DIR": str(runtime), "AGENTSANDBOX_DISPATCH_SOCKET": d.socket}
        service = ServiceProcess(
            userA.argv(str(world.launcher), "serve", "--config", str(world.config)), env, str(world.base),
            os.path.join(top, "service-a.log"),
        )  # fmt: skip
        d.services[userA.name] = service
        service.waitFor(REGISTERED, 60, "A's service to register")

        wrapper = Path(top) / "claude-as-a"
        wrapper.write_text(f'#!/bin/sh\nexec {" ".join(userA.argv(claude))} "$@"\n')
        wrapper.chmod(0o755)
        # The drop-in's programs must be root's alone (install refuses a user's,
        # which every user's sessions would run): a launcher and helper outside A's tree.
        (Path(top) / "bin").mkdir(mode=0o755)
        rootLauncher = writeLauncher(Path(top) / "bin" / "agentsandbox")
        with ManagedSettingsGuard(), tempLeftoversRemoved(), mockAPI() as api:
            installed = subprocess.run(
                [str(rootLauncher), "install", "--managed-dir", str(MANAGED_ROOT)],
                env={**env, "AGENTSANDBOX_EXE": str(rootLauncher)}, capture_output=True, text=True, timeout=60,
                stdin=subprocess.DEVNULL,
            )  # fmt: skip
            assert installed.returncode == 0, installed.stderr
            command = f"{BRIDGES_UP}curl -sS --noproxy '' http://127.0.0.1:{site.port}/via-dispatcher"
            claudeEnv = {**world.claudeEnv(api), "XDG_RUNTIME_DIR": str(runtime)}
            claudeEnv.pop("IS_SANDBOX", None)  # A is not root
            run = runClaude(str(wrapper), [ToolCall("Bash", {"command": command})], cwd=world.project,
                            env=claudeEnv, api=api, timeout=120)  # fmt: skip
        assert not run.timedOut and run.result is not None, run.describe()
        assert MOCK_ERROR not in str(run.result.get("result")), run.describe()
        assert f"{LocalSite.BODY}: /via-dispatcher" in run.outcomes[0].text, run.describe()
        assert "/via-dispatcher" in site.paths
        status = d.status()
        assert [r["uid"] for r in status["registered"]] == [userA.uid]
        assert status["handedOff"] >= 1
        audit = [json.loads(line) for line in (world.home / ".local/state/agentsandbox/audit.jsonl").read_text().splitlines()]
        assert any(r["event"] == "forward" and r["port"] == site.port for r in audit), audit
    finally:
        d.stop()
        site.close()
        shutil.rmtree(top, ignore_errors=True)
