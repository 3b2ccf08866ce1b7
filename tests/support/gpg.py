"""A throwaway gpg signing key for tests that sign commits for real."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def _env(gnupgHome: Path | str) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GNUPGHOME": str(gnupgHome)}


def makeSigningKey(gnupgHome: Path | str, uid: str) -> str:
    """A passphrase-less ed25519 signing key for ``uid`` in ``gnupgHome`` (0700); its fingerprint."""
    home = Path(gnupgHome)
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    home.chmod(0o700)
    subprocess.run(
        ["gpg", "--batch", "--pinentry-mode", "loopback", "--passphrase", "",
         "--quick-gen-key", uid, "ed25519", "sign", "never"],
        env=_env(home), check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    listing = subprocess.run(
        ["gpg", "--batch", "--with-colons", "--list-secret-keys"],
        env=_env(home), check=True, capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    return next(line.split(":")[9] for line in listing.splitlines() if line.startswith("fpr:"))


def stopGpgAgent(gnupgHome: Path | str) -> None:
    """gpg-agent daemonizes out of every process group: end it by its home."""
    subprocess.run(["gpgconf", "--kill", "gpg-agent"], env=_env(gnupgHome), capture_output=True, timeout=30)
