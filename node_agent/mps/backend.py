"""The MPS control daemon interface the node agent uses, and where its files live.

One ``nvidia-cuda-mps-control`` daemon per GPU in ``mps`` mode, each with its own
directories under the MPS root (default ``/var/lib/tessera/mps``)::

    <root>/                  0700: the agent's alone
      <gpu uuid>/            0700
        pipe/                0755: the daemon's pipes; bind-mounted into the GPU's pods
        log/                 0700: control.log, server.log

A pod's container reaches only its GPUs' ``pipe/`` directories, through its bind mounts
(the host path above them stays closed to it and to other host users).

``MpsBackend`` is implemented by ``real.ControlDaemons`` (the NVIDIA binary, through an
injected process runner) and ``simulated.SimulatedMps`` (a faithful model with a state file
and fault files). Every call raises only ``node_agent.mps.errors`` types.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol

from api.errors import short_repr
from node_agent.mps.errors import MpsError

DEFAULT_ROOT: Final = Path("/var/lib/tessera/mps")
# Where a container finds device i's pipe directory (the contract with the pods' CUDA).
CONTAINER_PIPE_ROOT: Final = "/tmp/nvidia-mps"
PRIVATE_DIR_MODE: Final = 0o700
PIPE_DIR_MODE: Final = 0o755  # clients of any uid connect to the daemon's pipes in it

# A GPU UUID names a directory: never let one point elsewhere ("..", "a/b").
_PLAIN_NAME: Final = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")


class MpsBackend(Protocol):
    """One control daemon per GPU, by GPU UUID.

    ``start`` refuses a GPU whose daemon runs (``MpsAlreadyRunningError``: adopt it instead)
    and ``stop`` one whose daemon does not (``MpsNotRunningError``), as the binary does.
    """

    def start(self, gpu: str) -> None: ...

    def stop(self, gpu: str) -> None: ...

    def running(self, gpu: str) -> bool: ...

    def daemons(self) -> frozenset[str]:
        """The GPUs whose daemon runs now, whoever started it (this agent or an earlier one)."""
        ...

    def pipe_dir(self, gpu: str) -> Path:
        """The host directory of the GPU's daemon pipes (what a pod mounts)."""
        ...


@dataclass(frozen=True)
class MpsLayout:
    """The directories of each GPU's daemon under ``root`` (see the module docstring)."""

    root: Path = DEFAULT_ROOT

    def gpu_dir(self, gpu: str) -> Path:
        if not _PLAIN_NAME.match(gpu):
            raise MpsError(gpu, "name its MPS directory", f"{short_repr(gpu)} is not a GPU UUID")
        return self.root / gpu

    def pipe_dir(self, gpu: str) -> Path:
        return self.gpu_dir(gpu) / "pipe"

    def log_dir(self, gpu: str) -> Path:
        return self.gpu_dir(gpu) / "log"

    def gpus(self) -> list[str]:
        """The GPUs that have a directory under the root (sorted); none without a root."""
        try:
            names = sorted(os.listdir(self.root))
        except FileNotFoundError:
            return []
        except OSError as e:
            raise MpsError("", f"list {self.root}", e.strerror or str(e)) from e
        return [n for n in names if _PLAIN_NAME.match(n) and (self.root / n).is_dir()]

    def create(self, gpu: str) -> None:
        """Create the GPU's directories, or bring existing ones to their modes: the root may
        have been created by someone else's default (a hostPath volume the kubelet makes
        0755); it must be this agent's own, never a symbolic link."""
        try:
            _own_dir(self.root, PRIVATE_DIR_MODE)
            _own_dir(self.gpu_dir(gpu), PRIVATE_DIR_MODE)
            _own_dir(self.log_dir(gpu), PRIVATE_DIR_MODE)
            _own_dir(self.pipe_dir(gpu), PIPE_DIR_MODE)
        except OSError as e:
            raise MpsError(gpu, "create its MPS directories", e.strerror or str(e)) from e


def _own_dir(path: Path, mode: int) -> None:
    path.mkdir(mode=mode, parents=True, exist_ok=True)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise MpsError("", f"use {path}", "it is not a directory (a symbolic link?)")
    if st.st_uid != os.geteuid():
        raise MpsError(
            "", f"use {path}", f"it is owned by uid {st.st_uid}, not by this agent's uid"
        )
    if stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode)  # the umask, or whoever created it, set other bits
