"""twistd: ``twistd -n agentsandbox``, the plugin-free ``agentsandbox-twistd``, and ``serve``.

Each command runs as a real child process from an installed copy of the tree
(the package and ``twisted/plugins/agentsandbox_plugin.py``, byte-compiled) on
PYTHONPATH, serves a real curl request through its proxy and answers a broker
ping, then stops on SIGTERM.  The read-only cases make that copy read-only
(``chmod -R a-w``) and run as ``nobody`` (root ignores file modes), which is
what an install under /usr or in the Nix store looks like to a user: there the
runner must never mention the plugin cache.  Which twistd: the venv's
``twistd`` on the PyPI stack, ``/usr/bin/twistd3`` on Debian's.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest

from agentsandbox.broker import client
from harness.service_process import (
    NOBODY,
    HelloServer,
    ServiceProcess,
    UserDirs,
    installCopy,
    makeReadOnly,
    makeWritable,
    runnerArgv,
    serveArgv,
    twistdArgv,
    writeConfig,
)

CURL = "/usr/bin/curl"
CACHE_WORDS = re.compile(r"dropin\.cache|plugin cache", re.IGNORECASE)


# --------------------------------------------------------------------------- in-process


def test_tapOptions() -> None:
    from agentsandbox.tap import Options

    options = Options()
    options.parseOptions(["--config", "/etc/agentsandbox/config.toml"])
    assert options["config"] == "/etc/agentsandbox/config.toml"
    options = Options()
    options.parseOptions([])
    assert options["config"] is None


def test_tapRefusesABrokenConfigNamingFileAndKey(tmp_path: os.PathLike[str]) -> None:
    from twisted.python import usage

    from agentsandbox.tap import Options, makeService

    path = os.path.join(tmp_path, "config.toml")
    with open(path, "w") as f:
        f.write('[proxy]\nport = "3190"\n')
    options = Options()
    options.parseOptions(["--config", path])
    with pytest.raises(usage.UsageError) as caught:
        makeService(options)
    assert path in str(caught.value)
    assert "proxy.port" in str(caught.value)


def test_runnerExitsWithTheConfigErrorStatus(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "config.toml")
    with open(path, "w") as f:
        f.write("[proxy]\nprot = 1\n")
    code = (
        "from agentsandbox.tap import runTwistd\n"
        f"runTwistd(['--nodaemon', '--pidfile=', '--logfile=-', 'agentsandbox', '--config', {path!r}])\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr == f"agentsandbox-twistd: {path}: proxy.prot: unknown key (a typo here must not weaken the policy)\n"


def test_pluginModuleNamesTheTap() -> None:
    # Imported by path, not through getPlugins: scanning would write a
    # dropin.cache into the checkout.
    import importlib.util

    from twisted.application.service import IServiceMaker, ServiceMaker
    from twisted.plugin import IPlugin

    from agentsandbox.tap import serviceMaker

    spec = importlib.util.spec_from_file_location(
        "agentsandbox_plugin_under_test", os.path.join(os.path.dirname(__file__), "..", "twisted", "plugins", "agentsandbox_plugin.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    maker: ServiceMaker = module.agentsandbox
    assert IServiceMaker.providedBy(maker) and IPlugin.providedBy(maker)
    assert (maker.tapname, maker.module) == ("agentsandbox", "agentsandbox.tap")
    assert (serviceMaker.tapname, serviceMaker.module) == (maker.tapname, maker.module)


def test_runnerNeverTouchesThePluginCache() -> None:
    """The runner's --help works with ``getCache`` made to blow up, and lists only our command."""
    code = (
        "import twisted.plugin as p\n"
        "def boom(*a, **k): raise AssertionError('the plugin cache was touched')\n"
        "p.getCache = boom\n"
        "from agentsandbox.tap import runTwistd\n"
        "runTwistd(['--help'])\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    commands = done.stdout.split("Commands:", 1)[1]
    assert re.search(r"^\s+agentsandbox\s", commands, re.MULTILINE), done.stdout
    # A command starts at four spaces; wrapped descriptions are indented further.
    assert re.findall(r"^    (\S+)", commands, re.MULTILINE) == ["agentsandbox"], commands


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------- child processes


@dataclass
class Site:
    base: str
    site: str
    dirs: UserDirs
    config: str
    hello: HelloServer
    asNobody: bool

    def env(self) -> dict[str, str]:
        return self.dirs.env(pythonPath=self.site)

    def prefix(self) -> list[str]:
        return list(NOBODY) if self.asNobody else []

    def start(self, argv: Sequence[str]) -> ServiceProcess:
        return ServiceProcess([*self.prefix(), *argv], self.env(), cwd=self.dirs.home, logPath=os.path.join(self.base, "service.log"))

    def curl(self, proxyPort: int, url: str) -> tuple[int, str]:
        argv = [*self.prefix(), CURL, "-sS", "--max-time", "20", "--proxy", f"http://127.0.0.1:{proxyPort}", "-w", "\n%{http_code}", url]
        done = subprocess.run(argv, env=self.env(), capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        body, _, status = done.stdout.rpartition("\n")
        return int(status), body

    def ping(self) -> None:
        if not self.asNobody:
            client.ask("ping", self.dirs.spool, 20.0)
            return
        code = f"from agentsandbox.broker.client import ask; ask('ping', {self.dirs.spool!r}, 20.0); print('answered')"
        done = subprocess.run([*NOBODY, sys.executable, "-c", code], env=self.env(), capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "answered" in done.stdout, done.stderr

    def importedFrom(self) -> str:
        code = "import agentsandbox, twisted.plugins.agentsandbox_plugin as p; print(agentsandbox.__file__); print(p.__file__)"
        done = subprocess.run([*self.prefix(), sys.executable, "-c", code], env=self.env(), capture_output=True, text=True, timeout=60, cwd=self.dirs.home)
        assert done.returncode == 0, done.stderr
        return done.stdout


def _site(asNobody: bool, readOnly: bool) -> Iterator[Site]:
    base = tempfile.mkdtemp(prefix="twistd-", dir="/tmp")
    os.chmod(base, 0o755)
    hello = HelloServer()
    try:
        site = installCopy(base)
        if readOnly:
            makeReadOnly(site)
        dirs = UserDirs(base, uid=65534 if asNobody else None)
        config = writeConfig(os.path.join(base, "config.toml"), [f"127.0.0.1:{hello.port}"])
        yield Site(base=base, site=site, dirs=dirs, config=config, hello=hello, asNobody=asNobody)
    finally:
        hello.close()
        makeWritable(base)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def site() -> Iterator[Site]:
    yield from _site(asNobody=False, readOnly=False)


def _needNobody() -> None:
    if os.getuid() != 0:
        pytest.skip("becoming nobody needs root (setpriv --reuid); a non-root run cannot show a read-only install as another user")
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")


@pytest.fixture
def readOnlySite() -> Iterator[Site]:
    _needNobody()
    yield from _site(asNobody=True, readOnly=True)


#: What the service's own log never shows at the default level: Twisted's factory
#: start/stop lines and object reprs (addresses are written HOST:PORT).
NOISE = re.compile(r"Starting factory|Stopping factory| object at 0x|IPv4Address|IPv6Address")


def serves(site: Site, service: ServiceProcess) -> str:
    """Show the service working (allowed, refused, ping, status), stop it; its log."""
    try:
        port = service.proxyPort()
        service.brokerServing()
        status, body = site.curl(port, f"http://127.0.0.1:{site.hello.port}/")
        assert (status, body) == (200, HelloServer.BODY.decode()), (status, body)
        status, body = site.curl(port, "http://example.org/")
        assert status == 403 and "example.org" in body, (status, body)
        site.ping()
        shown = subprocess.run(
            [*site.prefix(), sys.executable, "-m", "agentsandbox", "status", "--config", site.config],
            env=site.env(), capture_output=True, text=True, timeout=60, cwd=site.dirs.home,
        )  # fmt: skip
        assert shown.returncode == 0, shown.stderr
        assert any(line.split() == ["listening", f"127.0.0.1:{port}"] for line in shown.stdout.splitlines()), shown.stdout
        assert not re.search(r'[{}"]|Address\(', shown.stdout), shown.stdout
        assert f"egress proxy listening on 127.0.0.1:{port}\n" in service.output()
        seconds = service.terminate(bound=30.0)
        # twistd ends by re-raising the SIGTERM it handled (systemd counts that as
        # a clean stop); serve returns 0.
        assert service.proc.returncode in (0, -signal.SIGTERM), service.output()
        print(f"{service.argv}: stopped {seconds:.2f}s after SIGTERM")
        output = service.output()
        assert not [line for line in output.splitlines() if NOISE.search(line)], output
        return output
    finally:
        service.kill()


def test_twistdPluginServes(site: Site) -> None:
    # Exactly the command people type, run in a writable directory (it writes twistd.pid there).
    output = serves(site, site.start([*twistdArgv(), "-n", "agentsandbox", "--config", site.config]))
    assert "egress proxy listening" in output


def test_runnerServesAndWritesNoPluginCache(site: Site) -> None:
    argv = [*runnerArgv(), "--nodaemon", "--pidfile=", "--logfile=-", "agentsandbox", "--config", site.config]
    output = serves(site, site.start(argv))
    assert not CACHE_WORDS.search(output), output
    assert not os.path.exists(os.path.join(site.site, "twisted", "plugins", "dropin.cache"))
    assert not os.path.exists(os.path.join(site.dirs.home, "twistd.pid"))


def test_serveServes(site: Site) -> None:
    output = serves(site, site.start([*serveArgv(), "--config", site.config]))
    assert "broker serving" in output


def test_readOnlyInstallRunnerAsAnotherUser(readOnlySite: Site) -> None:
    site = readOnlySite
    assert site.importedFrom().count(site.site) == 2, "the copy, not the checkout, is what runs"
    argv = [*runnerArgv(), "--nodaemon", "--pidfile=", "--logfile=-", "agentsandbox", "--config", site.config]
    output = serves(site, site.start(argv))
    assert not CACHE_WORDS.search(output), output
    assert not os.path.exists(os.path.join(site.site, "twisted", "plugins", "dropin.cache"))


def test_readOnlyInstallPlainTwistdAsAnotherUser(readOnlySite: Site) -> None:
    """Plain twistd still finds and runs the plugin; what it says about the cache is recorded.

    It scans every twisted/plugins directory on the path and tries to write a
    dropin.cache next to each stale one: in a read-only install it cannot, and
    Twisted logs it (docs/service.md quotes the line).  That noise is why the
    unit runs ``agentsandbox-twistd``.
    """
    site = readOnlySite
    argv = [*twistdArgv(), "--nodaemon", "--pidfile=", "--logfile=-", "agentsandbox", "--config", site.config]
    output = serves(site, site.start(argv))
    warned = [ln for ln in output.splitlines() if CACHE_WORDS.search(ln)]
    print("plain twistd about the plugin cache:", *warned, sep="\n  ")
    assert any(os.path.join(site.site, "twisted", "plugins", "dropin.cache") in ln for ln in warned), output


def test_aBusyPortStopsTheServiceAndSaysWhy(site: Site) -> None:
    """A proxy that cannot listen must not leave a broker-only service running."""
    import socket

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        busy = squatter.getsockname()[1]
        config = writeConfig(
            os.path.join(site.base, "busy.toml"), [f"127.0.0.1:{site.hello.port}"], listen=f"tcp:{busy}:interface=127.0.0.1"
        )
        for argv, code in (
            ([*runnerArgv(), "--nodaemon", "--pidfile=", "--logfile=-", "agentsandbox", "--config", config], 1),
            # Plain twistd has no way to set its exit code; it stops all the same.
            ([*twistdArgv(), "--nodaemon", "--pidfile=", "--logfile=-", "agentsandbox", "--config", config], 0),
            ([*serveArgv(), "--config", config], 1),
        ):
            service = site.start(argv)
            try:
                assert service.proc.wait(60) == code, service.output()
            finally:
                service.kill()
            output = service.output()
            assert f"cannot listen on tcp:{busy}:interface=127.0.0.1" in output, output
            assert f"proxy.listen in {config}" in output, output


def test_freezeStartupHeapCollectsFirstThenFreezes() -> None:
    """What the entry points call once the reactor runs (issue 25: no full
    collection walks start-up's objects again), without keeping garbage for good."""
    import gc
    import weakref

    from agentsandbox.service import freezeStartupHeap

    class Node:
        me: object = None

    cycle = Node()
    cycle.me = cycle
    gone = weakref.ref(cycle)
    del cycle
    try:
        freezeStartupHeap()
        assert gone() is None  # collected, not frozen
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()  # this test process keeps collecting as before
