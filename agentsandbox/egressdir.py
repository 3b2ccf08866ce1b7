"""The egress directory the sandbox reads, and the variables that point clients at it.

``<runtime>/agentsandbox/egress`` (0700) holds:

- ``ca.pem``: the proxy's in-memory CA, certificate only (the key never
  leaves the service);
- ``bundle.pem``: the first readable system bundle plus that CA, for clients
  that take one file (curl, git, Python, Go);
- ``gh/hosts.yml``: a login for github.com whose "token" is a fixed,
  non-secret word; the proxy replaces the header gh sends, so gh needs no
  real token to work.

``egressVars`` is what the SessionStart hook exports.  Stdlib only: the hook
imports this module on every session start.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from agentsandbox.files import atomicWrite

#: The fixed word gh sends as its token; the proxy replaces the header.
GH_PLACEHOLDER = "agentsandbox-egress-proxy"

#: Where distributions keep their root bundle, in Go's order.
SYSTEM_BUNDLES = (
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/ca-bundle.pem",
    "/etc/pki/tls/cacert.pem",
    "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem",
    "/etc/ssl/cert.pem",
)

BUNDLE_VARS = ("SSL_CERT_FILE", "GIT_SSL_CAINFO", "CURL_CA_BUNDLE", "REQUESTS_CA_BUNDLE")

#: git config carried in the environment: ssh remotes of github.com go over
#: https (where the proxy injects), and none of the person's credential
#: helpers runs for github.com (an empty value resets the helper list).
GITHUB_GIT_CONFIG = (
    ("url.https://github.com/.insteadOf", "git@github.com:"),
    ("url.https://github.com/.insteadOf", "ssh://git@github.com/"),
    ("credential.https://github.com.helper", ""),
)

#: How many GIT_CONFIG_KEY_n/VALUE_n pairs ``env --unset`` clears: ours plus
#: room for the ones other parts add (gpg.program).
UNSET_GIT_PAIRS = 8


class EgressDirError(Exception):
    """The egress directory cannot be written; the message says which file and why."""


def systemBundle(candidates: Sequence[str] = SYSTEM_BUNDLES) -> tuple[str, bytes]:
    """The first readable system root bundle and its bytes."""
    for path in candidates:
        try:
            with open(path, "rb") as f:
                return path, f.read()
        except OSError:
            continue
    raise EgressDirError(f"no system root bundle ({', '.join(candidates)})")


def ghHosts() -> bytes:
    return (
        f"github.com:\n    oauth_token: {GH_PLACEHOLDER}\n    user: {GH_PLACEHOLDER}\n"
        "    git_protocol: https\n"
    ).encode("ascii")


def bundle(roots: bytes, caPEM: bytes) -> bytes:
    return roots.rstrip(b"\n") + b"\n" + caPEM.rstrip(b"\n") + b"\n"


def writeEgressDir(
    directory: str, caPEM: bytes, bundles: Sequence[str] = SYSTEM_BUNDLES
) -> None:
    """Write ``ca.pem``, ``bundle.pem`` and ``gh/hosts.yml`` atomically (0600 in 0700 dirs)."""
    if b"PRIVATE KEY" in caPEM:
        raise EgressDirError("refusing to write a private key into the egress directory")
    _, roots = systemBundle(bundles)
    gh = os.path.join(directory, "gh")
    for d in (directory, gh):
        try:
            os.makedirs(d, mode=0o700, exist_ok=True)
            os.chmod(d, 0o700)
        except OSError as e:
            raise EgressDirError(f"cannot create {d}: {e.strerror or e}") from None
    _atomic(os.path.join(directory, "ca.pem"), caPEM)
    _atomic(os.path.join(directory, "bundle.pem"), bundle(roots, caPEM))
    _atomic(os.path.join(gh, "hosts.yml"), ghHosts())


def _atomic(path: str, data: bytes) -> None:
    try:
        atomicWrite(path, data, 0o600)
    except OSError as e:
        raise EgressDirError(f"cannot write {path}: {e.strerror or e}") from None


WRAPPERS = {"gpg": "gpg", "ssh-sign": "ssh-sign"}

#: Where the Debian package (and any other system install) puts the wrappers, so
#: ``git config --global gpg.program /usr/libexec/agentsandbox/gpg`` names one
#: path that works for every user, inside the sandbox and outside it.
PACKAGED_WRAPPERS = "/usr/libexec/agentsandbox"


def wrapperScript(exe: str, command: str) -> str:
    import shlex

    return f'#!/bin/sh\nexec {shlex.quote(exe)} {command} "$@"\n'


def writeWrappers(directory: str, exe: str, shared: bool = False) -> None:
    """``gpg`` and ``ssh-sign`` scripts that run ``agentsandbox gpg|ssh-sign``.

    git takes one program path for ``gpg.program`` and ``gpg.ssh.program``, so the
    subcommand needs a script; inside the sandbox the command asks the broker to
    sign, outside it runs the person's own gpg or ssh-keygen.  The per-user copies
    in the egress dir are 0700; ``shared`` ones (a package's) are 0755.
    """
    mode = 0o755 if shared else 0o700
    os.makedirs(directory, mode=mode, exist_ok=True)
    for name, command in WRAPPERS.items():
        path = os.path.join(directory, name)
        _atomic(path, wrapperScript(exe, command).encode())
        os.chmod(path, mode)


def packagedWrappers(exe: str, directory: str = PACKAGED_WRAPPERS) -> str | None:
    """``directory`` when it holds both wrappers, each running ``exe``; else None.

    A wrapper that runs another install (a packaged one beside a pip install in
    the user's home) is not used: the session signs with the agentsandbox it runs.
    """
    for name, command in WRAPPERS.items():
        try:
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                if f.read(4096) != wrapperScript(exe, command):
                    return None
        except (OSError, UnicodeDecodeError):
            return None
    return directory


def signingGitConfig(
    directory: str, exe: str | None = None, packagedDir: str = PACKAGED_WRAPPERS
) -> list[tuple[str, str]]:
    """git config pairs that sign through the wrappers: the packaged ones when they
    run ``exe``, else those ``writeWrappers`` made in ``directory``."""
    where = (packagedWrappers(exe, packagedDir) if exe else None) or directory
    return [
        ("gpg.program", os.path.join(where, "gpg")),
        ("gpg.ssh.program", os.path.join(where, "ssh-sign")),
    ]


def gitConfigVars(pairs: Sequence[tuple[str, str]]) -> dict[str, str]:
    """``GIT_CONFIG_COUNT`` and ``GIT_CONFIG_KEY_n``/``VALUE_n`` for ``pairs``."""
    env = {"GIT_CONFIG_COUNT": str(len(pairs))}
    for i, (key, value) in enumerate(pairs):
        env[f"GIT_CONFIG_KEY_{i}"] = key
        env[f"GIT_CONFIG_VALUE_{i}"] = value
    return env


def egressVars(egressDir: str, gitConfig: Sequence[tuple[str, str]] = ()) -> dict[str, str]:
    """The variables that point sandboxed clients at the egress dir.

    ``gitConfig`` adds pairs after GitHub's (the gpg wrapper's ``gpg.program``).
    """
    bundlePath = os.path.join(egressDir, "bundle.pem")
    env = {name: bundlePath for name in BUNDLE_VARS}
    env["NODE_EXTRA_CA_CERTS"] = os.path.join(egressDir, "ca.pem")
    env["GH_CONFIG_DIR"] = os.path.join(egressDir, "gh")
    env.update(gitConfigVars([*GITHUB_GIT_CONFIG, *gitConfig]))
    return env


def egressVarNames() -> list[str]:
    """Every variable ``egressVars`` may set, for ``env --unset``."""
    names = [*BUNDLE_VARS, "NODE_EXTRA_CA_CERTS", "GH_CONFIG_DIR", "GIT_CONFIG_COUNT"]
    for i in range(UNSET_GIT_PAIRS):
        names += [f"GIT_CONFIG_KEY_{i}", f"GIT_CONFIG_VALUE_{i}"]
    return names


def _quote(value: str) -> str:
    import shlex

    return shlex.quote(value)


def exportLines(env: dict[str, str]) -> str:
    return "".join(f"export {k}={_quote(v)}\n" for k, v in env.items())


def unsetLine() -> str:
    return "unset " + " ".join(egressVarNames()) + "\n"


USAGE = """\
usage: agentsandbox env [--unset]

Print the shell lines that point clients at the egress proxy's CA bundle and
gh config (what the SessionStart hook exports inside the sandbox).
  --unset   print the line that removes all of them, for shells outside the sandbox
"""


def main(argv: list[str]) -> int:
    """``agentsandbox env [--unset]``."""
    if argv in (["-h"], ["--help"]):
        sys.stdout.write(USAGE)
        return 0
    if argv == ["--unset"]:
        sys.stdout.write(unsetLine())
        return 0
    if argv:
        sys.stderr.write(f"agentsandbox env: unknown argument {argv[0]!r}\n\n{USAGE}")
        return 2
    from agentsandbox.paths import Paths

    egressDir = Paths.fromEnvironment().egressDir
    if egressDir is None:
        sys.stderr.write(
            "agentsandbox env: XDG_RUNTIME_DIR is not set, so there is no egress directory "
            "(the service writes it under the user's runtime dir)\n"
        )
        return 1
    sys.stdout.write(exportLines(egressVars(egressDir)))
    return 0
