"""Writing the simulated backends' state files (NVML's MIG instances, MPS daemons)."""

from __future__ import annotations

import os
import threading
from pathlib import Path


def write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` in one rename: a restarted agent reads the old state or
    the new one, never half. Not fsynced: the state must outlive the agent's process, which
    the page cache does; a machine crash loses it, as a reboot clears a real GPU's MIG
    instances and MPS daemons. (An fsync per MIG operation held a kwok worker for
    milliseconds on a busy disk.) Raises OSError.

    The temporary file is named for this process and thread, which write one file at a time,
    so no two writers share it and no random name is drawn per write (the kwok node agent
    writes a state file per MIG operation); O_NOFOLLOW keeps a planted link from redirecting
    the write."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            rest = memoryview(data)
            while rest:
                rest = rest[os.write(fd, rest) :]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
