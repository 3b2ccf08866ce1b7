"""``policy.physical`` and ``policy.realpathRemembering`` are ``os.path.realpath``, on generated
trees of links (one memo for many paths), except that both stop where a path enters ``/proc`` or
``/dev/fd``, as written or through any link on the way."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentsandbox.policy import (
    _REMEMBERED_DEPTH,
    Policy,
    inProcessPath,
    physical,
    realpathRemembering,
)
from tests.conftest import User

NAMES = ["a", "b", "c", "l1", "l2", "l3"]

#: What a link may point at: below, beside, up, absolute inside the tree, itself, nowhere.
TARGETS = st.one_of(
    st.sampled_from(NAMES),
    st.sampled_from(["..", "../a", "../..", "a/b", "../l1", "./c", "/", "missing", "missing/deeper", "l1/../b"]),
    st.lists(st.sampled_from([*NAMES, "..", "."]), min_size=1, max_size=4).map("/".join),
    st.lists(st.sampled_from(NAMES), min_size=0, max_size=3).map(lambda parts: "@ROOT/" + "/".join(parts)),
)

#: One tree entry: (relative location, kind, link target).
ENTRIES = st.lists(
    st.tuples(
        st.lists(st.sampled_from(NAMES), min_size=1, max_size=3).map("/".join),
        st.sampled_from(["dir", "file", "link"]),
        TARGETS,
    ),
    max_size=14,
)
PATHS = st.lists(st.lists(st.sampled_from([*NAMES, "missing"]), min_size=0, max_size=6).map("/".join),
                 min_size=1, max_size=12)


def build(root: Path, entries: list[tuple[str, str, str]]) -> None:
    for location, kind, target in entries:
        path = root / location
        # Only where no link leads: a link to '..' would put the entry outside the tree.
        if os.path.realpath(path.parent) != str(path.parent) or not path.parent.is_dir():
            continue
        if path.is_symlink() or path.exists():
            continue
        if kind == "dir":
            path.mkdir()
        elif kind == "file":
            path.write_text("x")
        else:
            path.symlink_to(target.replace("@ROOT", str(root)))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(entries=ENTRIES, paths=PATHS)
def test_it_is_realpath_on_generated_trees(tmp_path_factory: pytest.TempPathFactory,
                                           entries: list[tuple[str, str, str]], paths: list[str]) -> None:
    root = tmp_path_factory.mktemp("tree").resolve()
    build(root, entries)
    memo: dict[str, str] = {}
    for rel in paths:
        path = os.path.normpath(str(root / rel))
        assert realpathRemembering(path, memo) == os.path.realpath(path), (path, entries)
        assert physical(path) == os.path.realpath(path), (path, entries)


def test_loops_dangling_links_and_files_in_the_way(tmp_path: Path) -> None:
    root = tmp_path.resolve()
    (root / "self").symlink_to("self")
    (root / "ping").symlink_to("pong/x")
    (root / "pong").symlink_to("ping/y")
    (root / "dangling").symlink_to("nowhere/deeper")
    (root / "file").write_text("x")
    (root / "up").symlink_to("..")
    (root / "abs").symlink_to(root / "up" / "up")
    memo: dict[str, str] = {}
    (root / "dotdot").symlink_to("dotdot/..")  # a loop whose kept rest normalises away
    for rel in ("self", "self/a/b", "ping/q", "pong", "dangling/z", "file/under", "up/up/x", "abs/y", "up/self/k",
                "dotdot", "dotdot/dotdot", "dotdot/x/dotdot"):
        path = str(root / rel)
        assert realpathRemembering(path, memo) == os.path.realpath(path), rel
        assert physical(path) == os.path.realpath(path), rel
    assert realpathRemembering("/", memo) == physical("/") == "/"


#: Links whose meaning depends on the process that reads them, and what the walk keeps of them.
PROCESS_LINKS = {
    "/proc/self/cwd": "/proc/self/cwd/private/notes.txt",
    "/proc/thread-self/cwd": "/proc/thread-self/cwd/private/notes.txt",
    "/proc/self/root/etc": "/proc/self/root/etc/private/notes.txt",
    "/dev/fd/3": "/dev/fd/3/private/notes.txt",
    "/dev/stdin": "/dev/stdin/private/notes.txt",
    "/proc": "/proc/private/notes.txt",
}


@pytest.mark.parametrize("target", sorted(PROCESS_LINKS))
def test_a_link_into_a_process_path_stops_the_walk(tmp_path: Path, target: str) -> None:
    """A project link to /proc/self/cwd is the hook's cwd to realpath, the reader's to the kernel."""
    root = tmp_path.resolve()
    (root / "l").symlink_to(target)
    (root / "rel").symlink_to("l")
    (root / "viaDotDot").symlink_to("../" + root.name + "/l")
    wanted = PROCESS_LINKS[target]
    for link in ("l", "rel", "viaDotDot"):
        path = f"{root}/{link}/private/notes.txt"
        assert physical(path) == wanted, link
        assert realpathRemembering(path, {}) == wanted, link
        assert inProcessPath(physical(path))


def test_nothing_climbs_out_of_a_process_path(tmp_path: Path) -> None:
    """``..`` after /proc/self/cwd climbs the reader's cwd: the rest is kept as written."""
    root = tmp_path.resolve()
    (root / "l").symlink_to("/proc/self/cwd/../..")
    (root / "m").symlink_to("/proc/self/cwd")
    assert physical(f"{root}/l/etc") == "/proc/self/cwd/../../etc"
    assert physical(f"{root}/m/../../etc") == "/proc/self/cwd/../../etc"
    assert inProcessPath(physical(f"{root}/m/../../etc"))
    for path in ("/proc/self/root/etc", "/dev/fd/0", "/proc/1/environ", "/dev/stdout"):
        assert physical(path) == path
        assert realpathRemembering(path, {}) == path


def test_a_very_deep_path_is_left_to_realpath(tmp_path: Path) -> None:
    memo: dict[str, str] = {}
    deep = str(tmp_path.resolve()) + "/d" * (_REMEMBERED_DEPTH + 10)
    assert realpathRemembering(deep, memo) == os.path.realpath(deep)
    assert list(memo) == [deep], "no prefix of a path that deep is remembered"


def test_only_a_remembering_policy_remembers(user: User) -> None:
    """A link changed between two decisions of a long-lived policy is read again."""
    policy = user.policy('[sandbox]\nread = ["~/projects"]\n')
    link = user.home / "link"
    (user.home / "projects").mkdir(exist_ok=True)
    link.symlink_to(user.home / "projects")
    assert policy.readable(str(link / "x"), "/")
    once = policy.remembering()
    assert once.readable(str(link / "x"), "/")
    link.unlink()
    (user.home / ".ssh").mkdir(exist_ok=True)
    link.symlink_to(user.home / ".ssh")
    assert not policy.readable(str(link / "x"), "/")
    assert once.readable(str(link / "x"), "/"), "one decision reads each link once"
    assert not policy.remembering().readable(str(link / "x"), "/")
    assert once == policy and isinstance(once, Policy)
