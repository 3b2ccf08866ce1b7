"""Where a check and its consumer read the same input (issue 10): the config's paths vs srt.

The renderer (``agentsandbox.srt`` from ``Policy``) writes the config's paths;
srt's bubblewrap mounts them.  These runs spell the same directories as the
config may (``~/``, ``//``, a trailing slash, ``/./``, a symlink) and probe from
inside the real sandbox what is readable and writable: a closed directory
stays closed and a write path stays writable under every spelling.
docs/run.md ("Where a check and its consumer read the same input") has the verdict.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_run import Host, _makeHost, _needSrt

MARKER = "closed-marker-5e1b"

#: Each spelling of the closed directory and of the write directory a config may hold.
SPELLINGS = [
    ("~/projects/private", "~/out"),
    ("~/projects/private/", "~/out/"),
    ("~//projects//private", "~//out"),
    ("~/./projects/private", "~/./out"),
    ("{home}/projects/private", "{home}/out"),
    ("/{home}/projects/private/", "/{home}/out/"),
    ("~/projects/private-link", "~/out-link"),
    ("~/projects/private-link/", "~/out-link/"),
]


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    _needSrt()
    h = _makeHost(tmp_path_factory.mktemp("readings"))
    projects = h.home / "projects"
    (projects / "private").mkdir()
    (projects / "private" / "marker").write_text(MARKER + "\n")
    (h.home / "out").mkdir()
    (projects / "private-link").symlink_to(projects / "private")
    (h.home / "out-link").symlink_to(h.home / "out")
    h.startService()
    yield h
    h.stopService()


def configure(h: Host, closed: str, write: str) -> None:
    home = str(h.home)
    closed, write = closed.format(home=home), write.format(home=home)
    h.config.write_text(
        f'[sandbox]\nread = ["~/projects"]\nwrite = ["{h.work}", "{write}"]\ndeny = ["{closed}"]\n'
        f'domains = ["example.org"]\n\n[proxy]\nport = {h.port}\n'
    )


@pytest.mark.parametrize("closed,write", SPELLINGS)
def test_everySpellingIsMountedAsThePolicyDecided(host: Host, closed: str, write: str) -> None:
    configure(host, closed, write)
    for leftover in (host.home / "out").iterdir():
        leftover.unlink()
    home = host.home
    projects = home / "projects"
    spelled = write.format(home=home).replace("~", str(home), 1).rstrip("/")  # the write path as written
    probe = (
        f"cat {projects}/private/marker {projects}/private-link/marker {projects}//private/marker 2>&1; "
        f"ls {projects}/private {projects}/private-link/ 2>&1; "
        f"echo a > {home}/out/a; echo b > {spelled}/b; "
        f"echo c > {projects}/private/c 2>&1; true"
    )
    p = host.run("--", "sh", "-c", probe)
    assert p.returncode == 0, p.stderr
    assert MARKER not in p.stdout + p.stderr, (closed, p.stdout)
    assert "marker" not in p.stdout.split("\n"), (closed, p.stdout)  # ls listed nothing
    # A symlinked write entry: bubblewrap mounts the link's target (listed too), and the
    # link itself lives in the unmounted home, so writing through it fails closed.
    written = ["a"] if "link" in write else ["a", "b"]
    assert sorted(x.name for x in (home / "out").iterdir()) == written, (write, p.stdout, p.stderr)
    assert not (projects / "private" / "c").exists()


def test_theRenderedSettingsNameTheLinkAndItsTarget(host: Host) -> None:
    configure(host, "~/projects/private-link", "~/out-link")
    p = host.run("--print", "--", "true")
    assert p.returncode == 0, p.stderr
    projects = host.home / "projects"
    for path in (projects / "private-link", projects / "private", host.home / "out-link", host.home / "out"):
        assert f'"{Path(path)}"' in p.stdout, (path, p.stdout)
