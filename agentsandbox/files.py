"""Writing a file so that readers see the old bytes or the new, never a mix.

Stdlib only: the hook, the broker client and the setup commands use it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile


def atomicWrite(path: str, data: bytes, mode: int = 0o600) -> None:
    """Write ``data`` to a temp file beside ``path`` (created ``mode``), then rename it over."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".agentsandbox-", dir=directory)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
