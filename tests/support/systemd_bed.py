"""A real systemd, booted as PID 1 of new namespaces on a Debian 12 tree (tests/bed).

The machines this project runs on boot without systemd (``systemd-nspawn`` refuses:
"System has not been booted with systemd as init system"), yet Debian 12's systemd 252
boots as PID 1 of namespaces made with ``unshare`` (shared/reference/systemd-bed.md):

- **The tree** is made once by ``debootstrap --variant=minbase`` with systemd, the user
  session pieces and what the .deb depends on, and kept under ``CACHE`` (named by a hash of
  its package list, so a changed list builds a new tree). The mirror is the host's own,
  read from ``/etc/apt/sources.list*`` at run time. Packages the tests install later
  (``ca-certificates``, which the package now depends on) are downloaded into the tree's
  apt cache, so the bed needs no network: it has its own network namespace (only its
  own loopback; no port of the host is touched).
- **Each boot** mounts an overlay (the pristine tree below, a fresh upper dir per boot) in
  a private mount namespace and enters it with ``pivot_root`` (a ``chroot`` into a plain
  directory makes every unit with mount sandboxing fail with 226/NAMESPACE).
- **Cgroups**: the new PID 1 moves itself into a child ``agentsandbox-bed-<id>`` of its own
  cgroup in every hierarchy, unshares its cgroup namespace and mounts fresh cgroupfs, so
  what the inner systemd makes stays below that child; the children are removed after.
- **Stop**: ``systemctl poweroff`` inside, wait; only then kill what is left by its pid
  and remove the cgroups and the overlay. ``Bed.leftovers`` says what is left on the host.

Commands run inside with ``nsenter`` into all of PID 1's namespaces and its root.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

CACHE = Path(os.environ.get("AGENTSANDBOX_BED_CACHE", "/var/cache/agentsandbox-bed"))
SUITE = "bookworm"
#: What a Debian 12 admin's machine has that a minbase tree lacks: systemd as init,
#: logind and the user bus (user managers need libpam-systemd; the user bus needs
#: dbus-user-session), and what the .deb depends on, so apt installs it offline.
#: ca-certificates is left out on purpose: the package must pull it in itself.
BOOT_PACKAGES = ("systemd", "systemd-sysv", "dbus", "libpam-systemd", "dbus-user-session")
PACKAGES = (
    *BOOT_PACKAGES,
    "python3", "python3-cryptography", "python3-h11", "python3-openssl",
    "python3-service-identity", "python3-tomlkit", "python3-twisted", "python3-zope.interface",
)
#: Downloaded into the tree's apt cache, not installed: what the package (or a test)
#: may make apt install inside the offline bed.
DOWNLOADED = ("ca-certificates",)
#: Bumped when the way the tree is made changes.
TREE_FORMAT = "2"
#: The bed's "kernel command line" (systemd reads its own argv in a container).
SYSTEMD_ARGS = (
    "systemd.unified_cgroup_hierarchy=0",
    "systemd.mask=systemd-networkd.service",
    "systemd.mask=systemd-resolved.service",
    "systemd.mask=systemd-timesyncd.service",
    "systemd.mask=apt-daily.timer",
    "systemd.mask=apt-daily-upgrade.timer",
    "systemd.mask=e2scrub_all.timer",
    "systemd.mask=fstrim.timer",
    "systemd.mask=getty@tty1.service",
    "systemd.mask=console-getty.service",
)


class BedUnavailable(RuntimeError):
    """The host cannot give a bed (not root, no debootstrap, no mirror): the reason."""


def mirror(sourcesGlob: str = "/etc/apt/sources.list*") -> str:
    """The host's own Debian mirror for SUITE, read from its apt sources (never written down)."""
    paths = [p for p in glob.glob(sourcesGlob) if os.path.isfile(p)]
    paths += glob.glob("/etc/apt/sources.list.d/*")
    for path in paths:
        try:
            text = Path(path).read_text()
        except OSError:
            continue
        # one-line format: deb [opts] URI SUITE COMPONENTS
        for line in text.splitlines():
            m = re.match(r"\s*deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+(\S+)\s+(.*)", line)
            if m and m.group(2) == SUITE and "main" in m.group(3).split():
                return m.group(1)
        # deb822 format: stanzas separated by blank lines
        for stanza in re.split(r"\n\s*\n", text):
            fields: dict[str, str] = {}
            for ln in stanza.splitlines():
                if not ln.lstrip().startswith("#") and ":" in ln:
                    k, _, v = ln.partition(":")
                    fields[k.strip().lower()] = v.strip()
            suites = fields.get("suites", "").split()
            if SUITE in suites and "main" in fields.get("components", "").split():
                uris = fields.get("uris", "").split()
                if uris and "deb" in fields.get("types", "").split():
                    return uris[0]
    raise BedUnavailable(f"no Debian {SUITE} main mirror in {sourcesGlob} or sources.list.d")


def treeKey() -> str:
    text = "\n".join([TREE_FORMAT, SUITE, *PACKAGES, "--", *DOWNLOADED])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _run(argv: Sequence[str], log: Path, **kw: object) -> None:
    with log.open("ab") as out:
        out.write(("$ " + " ".join(argv) + "\n").encode())
        out.flush()
        proc = subprocess.run(list(argv), stdout=out, stderr=subprocess.STDOUT, **kw)  # type: ignore[call-overload]
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-30:]
        raise RuntimeError(f"{argv[0]} failed ({proc.returncode}); {log}:\n" + "\n".join(tail))


@contextlib.contextmanager
def cacheLock(cache: Path, exclusive: bool) -> Iterator[int]:
    """The cache's lock: exclusive to build or drop a tree, shared while a bed boots on one."""
    cache.mkdir(parents=True, exist_ok=True)
    fd = os.open(cache / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield fd
    finally:
        os.close(fd)


def ensureTree(cache: Path = CACHE) -> tuple[Path, float]:
    """The pristine tree for this package list, built when missing; (path, seconds spent)."""
    if os.geteuid() != 0:
        raise BedUnavailable("the bed needs root (debootstrap, namespaces, cgroups, mounts)")
    if shutil.which("debootstrap") is None:
        raise BedUnavailable("no debootstrap (.ci/install-deps installs it)")
    with cacheLock(cache, exclusive=True):
        return _ensureTree(cache)


def _ensureTree(cache: Path) -> tuple[Path, float]:
    key = treeKey()
    tree = cache / key / "tree"
    if (cache / key / "complete").exists():
        return tree, 0.0
    start = time.monotonic()
    cache.mkdir(parents=True, exist_ok=True)
    # Trees of older package lists are dropped: one tree is kept, the current one.
    for old in cache.iterdir():
        if old.name != key and (old / "complete").exists():
            shutil.rmtree(old, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{key}.", dir=cache))
    log = staging / "build.log"
    try:
        url = mirror()
        # debootstrap installs what boots; apt (which orders configuration better than
        # debootstrap does for a long list) the rest.
        _run(
            ["debootstrap", "--variant=minbase", "--include=" + ",".join(BOOT_PACKAGES),
             SUITE, str(staging / "tree"), url],
            log,
        )
        t = staging / "tree"
        (t / "etc/apt/sources.list").write_text(f"deb {url} {SUITE} main\n")
        (t / "etc/hostname").write_text("bed\n")
        # apt in the bed works offline from the lists and the debs kept here.
        (t / "etc/apt/apt.conf.d/99agentsandbox-bed").write_text(
            'APT::Install-Recommends "false";\nBinary::apt::APT::Keep-Downloaded-Packages "true";\n'
            'APT::Keep-Downloaded-Packages "true";\n'
        )
        apt = (
            f"mount -t proc proc {t}/proc && chroot {t} apt-get update -qq"
            f" && chroot {t} apt-get install -y -qq {' '.join(PACKAGES[len(BOOT_PACKAGES):])}"
            f" && chroot {t} apt-get install --download-only -y -qq {' '.join(DOWNLOADED)}"
        )
        _run(["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-ec", apt], log,
             env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        target = cache / key
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
        (target / "complete").write_text(time.strftime("%Y-%m-%dT%H:%M:%SZ\n", time.gmtime()))
        return target / "tree", time.monotonic() - start
    except BaseException:
        try:
            shutil.copyfile(log, cache / "failed-build.log")
        except OSError:
            pass
        shutil.rmtree(staging, ignore_errors=True)
        raise


# The bed's PID 1, before it becomes systemd: runs as PID 1 of new pid, mount, uts, ipc
# and net namespaces (unshare --fork), still in the host's cgroup namespace.
_STAGE1 = r"""
set -eu
id=$1 tree=$2 work=$3; shift 3
# 1. into a child of our own cgroup in every hierarchy, then a cgroup namespace of our own
for h in /sys/fs/cgroup/*/; do
  h=${h%/}; name=${h##*/}
  case $name in unified) key=0 ;; systemd) key=name=systemd ;; *) key=$name ;; esac
  mine=$(awk -F: -v k="$key" '{n=split($2,a,","); for(i=1;i<=n;i++) if(a[i]==k || ($1==0 && k==0)) print $3}' /proc/self/cgroup | head -1)
  [ -n "$mine" ] || continue
  child=$h${mine%/}/agentsandbox-bed-$id
  mkdir -p "$child"
  echo "$child" >> "$work/cgroups"
  if [ "$name" = cpuset ]; then
    cat "${child%/*}/cpuset.cpus" > "$child/cpuset.cpus"
    cat "${child%/*}/cpuset.mems" > "$child/cpuset.mems"
  fi
  echo 0 > "$child/cgroup.procs"
done
exec unshare --cgroup -- /bin/sh -eu -c '
work=$1 tree=$2; shift 2
root=$work/root
mount --make-rprivate /
mkdir -p "$work/upper" "$work/ovl" "$root"
mount -t overlay overlay -o "lowerdir=$tree,upperdir=$work/upper,workdir=$work/ovl" "$root"
mount -t proc proc "$root/proc"
mount -t sysfs -o ro sysfs "$root/sys"
mount -t tmpfs -o mode=755 tmpfs "$root/sys/fs/cgroup"
for h in /sys/fs/cgroup/*/; do
  h=${h%/}; name=${h##*/}
  mkdir -p "$root/sys/fs/cgroup/$name"
  case $name in
    unified) mount -t cgroup2 cgroup2 "$root/sys/fs/cgroup/unified" ;;
    systemd) mount -t cgroup -o none,name=systemd cgroup "$root/sys/fs/cgroup/systemd" ;;
    *) mount -t cgroup -o "$name" cgroup "$root/sys/fs/cgroup/$name" ;;
  esac
done
mount -o remount,ro -t tmpfs tmpfs "$root/sys/fs/cgroup"
mount -t tmpfs -o mode=755,nosuid tmpfs "$root/dev"
for d in null zero full random urandom tty; do
  touch "$root/dev/$d"; mount --bind "/dev/$d" "$root/dev/$d"
done
mkdir -p "$root/dev/pts" "$root/dev/shm" "$root/dev/mqueue"
mount -t devpts -o newinstance,ptmxmode=0666,mode=620 devpts "$root/dev/pts"
ln -s pts/ptmx "$root/dev/ptmx"
mount -t tmpfs -o mode=1777 tmpfs "$root/dev/shm"
ln -s /proc/self/fd "$root/dev/fd"
mount -t tmpfs -o mode=755 tmpfs "$root/run"
mount -t tmpfs -o mode=1777 tmpfs "$root/tmp"
touch "$root/etc/machine-id"
mkdir -p "$root/oldroot"
cd "$root"
pivot_root . oldroot
umount -l /oldroot
rmdir /oldroot
exec env -i container=other TERM=dumb /lib/systemd/systemd "$@"
' stage2 "$work" "$tree" "$@"
"""


def _rootCgroups() -> set[str]:
    return {p for p in glob.glob("/sys/fs/cgroup/*/*") if os.path.isdir(p)}


@dataclass
class Result:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str

    @property
    def out(self) -> str:
        return self.stdout + self.stderr


@dataclass
class Bed:
    """One booted systemd; ``run`` a command inside, ``stop`` it, ``leftovers`` after."""

    tree: Path
    id: str = field(default_factory=lambda: f"{os.getpid()}-{time.monotonic_ns() % 10**9}")
    work: Path = field(init=False)
    pid: int = 0
    proc: subprocess.Popen[bytes] | None = None
    bootSeconds: float = 0.0
    stopSeconds: float = 0.0
    _uids: dict[str, int] = field(default_factory=dict)
    _lock: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    _rootCgroups: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.work = Path(tempfile.mkdtemp(prefix="agentsandbox-bed."))

    # -- boot and stop -------------------------------------------------------------

    def boot(self, timeout: float = 60.0) -> None:
        start = time.monotonic()
        # Held until stop: no other run drops this tree while it is the overlay's lower dir.
        self._lock = contextlib.ExitStack()
        self._lock.enter_context(cacheLock(self.tree.parent.parent, exclusive=False))
        self._rootCgroups = _rootCgroups()
        stage1 = self.work / "stage1.sh"
        stage1.write_text(_STAGE1)
        self.proc = subprocess.Popen(
            ["unshare", "--fork", "--pid", "--mount", "--uts", "--ipc", "--net",
             "--propagation", "private", "--", "/bin/sh", str(stage1),
             self.id, str(self.tree), str(self.work), *SYSTEMD_ARGS],
            stdin=subprocess.DEVNULL,
            stdout=(self.work / "console").open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        # PID 1 of the bed is unshare's only child.
        deadline = time.monotonic() + timeout
        while not self.pid:
            kids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
            try:
                found = kids.read_text().split()
            except OSError:
                found = []
            if found:
                self.pid = int(found[0])
            elif self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the bed did not start:\n" + self.console())
            else:
                time.sleep(0.02)
        state = ""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("the bed's systemd exited:\n" + self.console())
            r = self.run(["systemctl", "is-system-running"], check=False, timeout=10)
            state = r.stdout.strip()
            if state in ("running", "degraded"):
                break
            time.sleep(0.2)
        else:
            raise RuntimeError(f"the bed's systemd is {state!r} after {timeout}s:\n" + self.console())
        self.bootSeconds = time.monotonic() - start

    def console(self) -> str:
        try:
            return (self.work / "console").read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> None:
        """poweroff inside, wait; then kill what is left by pid and undo the host side."""
        start = time.monotonic()
        if self.proc is not None and self.proc.poll() is None:
            self.run(["systemctl", "poweroff"], check=False, timeout=15)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                if self.pid:
                    try:
                        os.kill(self.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(10)
        self.stopSeconds = time.monotonic() - start
        self._removeCgroups()
        shutil.rmtree(self.work, ignore_errors=True)
        self._lock.close()

    def _cgroups(self) -> list[Path]:
        try:
            return [Path(p) for p in (self.work / "cgroups").read_text().split()]
        except OSError:
            return []

    def _removeCgroups(self) -> None:
        # Deepest first; a cgroup with a process left in it cannot go (and is reported).
        for top in self._cgroups():
            if not top.exists():
                continue
            dirs = sorted((Path(d) for d, _, _ in os.walk(top)), key=lambda p: -len(p.parts))
            for d in dirs:
                try:
                    d.rmdir()
                except OSError:
                    pass

    def leftovers(self) -> list[str]:
        """What this bed left on the host: its cgroups, processes, mounts."""
        left = [f"cgroup {p}" for p in self._cgroups() if p.exists()]
        for path in glob.glob("/sys/fs/cgroup/*/agentsandbox-bed-" + self.id):
            if f"cgroup {path}" not in left:
                left.append(f"cgroup {path}")
        if self.pid and Path(f"/proc/{self.pid}").exists():
            try:
                comm = Path(f"/proc/{self.pid}/comm").read_text().strip()
            except OSError:
                comm = "?"
            left.append(f"process {self.pid} ({comm})")
        with open("/proc/self/mountinfo") as f:
            left += [f"mount {ln.split()[4]}" for ln in f if str(self.work) in ln]
        # What a systemd that saw the host's hierarchies would have made at their roots
        # (init.scope, system.slice, user.slice ...): none may appear.
        if self._rootCgroups:
            left += [f"cgroup {p} (new at a host root)" for p in sorted(_rootCgroups() - self._rootCgroups)
                     if "agentsandbox-bed-" not in p]  # fmt: skip
        return left

    # -- inside -------------------------------------------------------------------

    def run(
        self,
        argv: Sequence[str],
        *,
        user: str | None = None,
        check: bool = True,
        timeout: float = 120.0,
        input: str | None = None,
        env: dict[str, str] | None = None,
    ) -> Result:
        """ARGV inside the bed, as root or (``user``) as that user."""
        full = self.argv(argv, user, env)
        proc = subprocess.run(
            full, capture_output=True, text=True, timeout=timeout, input=input,
            stdin=None if input is not None else subprocess.DEVNULL,
        )
        result = Result(list(argv), proc.returncode, proc.stdout, proc.stderr)
        if check and proc.returncode != 0:
            raise AssertionError(
                f"in the bed{' as ' + user if user else ''}: {' '.join(argv)} "
                f"exited {proc.returncode}\n{result.out[-3000:]}"
            )
        return result

    def argv(self, argv: Sequence[str], user: str | None = None, env: dict[str, str] | None = None) -> list[str]:
        """The host command line that runs ARGV inside (as ``user``: their uid, groups and
        runtime dir, so ``systemctl --user`` reaches their manager)."""
        environ = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
        inner: list[str] = []
        if user is not None:
            uid = self.uid(user)
            environ.update(HOME=f"/home/{user}", USER=user, LOGNAME=user, XDG_RUNTIME_DIR=f"/run/user/{uid}")
            inner = ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups", "--"]
        environ.update(env or {})
        return ["nsenter", "-t", str(self.pid), "-a", "--", *inner, "env", "-i",
                *(f"{k}={v}" for k, v in environ.items()), *argv]

    def popen(self, argv: Sequence[str], user: str | None = None, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        return subprocess.Popen(self.argv(argv, user, env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, text=True)

    def sh(self, script: str, **kw: object) -> Result:
        return self.run(["/bin/sh", "-c", script], **kw)  # type: ignore[arg-type]

    def uid(self, user: str) -> int:
        if user not in self._uids:
            r = subprocess.run(["nsenter", "-t", str(self.pid), "-a", "--", "id", "-u", user],
                               capture_output=True, text=True, timeout=30, check=True)
            self._uids[user] = int(r.stdout)
        return self._uids[user]

    def copyIn(self, src: Path, dest: str) -> None:
        """A host file into the bed (through PID 1's root)."""
        target = Path(f"/proc/{self.pid}/root") / dest.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, target)
