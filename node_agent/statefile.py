"""Writing the simulated backends' state files (NVML's MIG instances, MPS daemons)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` in one rename: a restarted agent reads the old state or
    the new one, never half. Not fsynced: the state must outlive the agent's process, which
    the page cache does; a machine crash loses it, as a reboot clears a real GPU's MIG
    instances and MPS daemons. (An fsync per MIG operation held a kwok worker for
    milliseconds on a busy disk.) Raises OSError."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
