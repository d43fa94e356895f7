"""Errors of the MPS daemon backends and manager, named by what the caller should do.

Both backends raise only these: the real one wraps what running ``nvidia-cuda-mps-control``
raised or answered (``raise … from e``, so ``subprocess`` and ``OSError`` types never leak),
the simulated one raises them directly. Messages name the GPU and what to look at.
"""

from __future__ import annotations

from api.errors import TemporaryError, TesseraError


class MpsError(TesseraError):
    """An MPS control daemon operation failed; ``gpu`` is the GPU UUID when one is meant."""

    def __init__(self, gpu: str, attempted: str, detail: str) -> None:
        self.gpu = gpu
        self.attempted = attempted
        self.detail = detail
        where = f"GPU {gpu}: " if gpu else ""
        super().__init__(f"{where}{attempted}: {detail}")


class MpsStartError(MpsError, TemporaryError):
    """The control daemon did not start; the manager tries again at its next check."""


class MpsAlreadyRunningError(MpsError):
    """A control daemon already serves this GPU's pipe directory (adopt it, don't start)."""


class MpsNotRunningError(MpsError):
    """No control daemon serves this GPU's pipe directory."""


class MpsClientLimitError(MpsError, TemporaryError):
    """The daemon serves as many clients as it can (``MPS_MAX_CLIENTS``)."""


class MpsUnavailableError(MpsError, TemporaryError):
    """MPS cannot be driven here: ``nvidia-cuda-mps-control`` is missing or timed out."""


class MpsDaemonDownError(TemporaryError):
    """Allocate on a GPU whose control daemon is down: retry once it is back (the agent
    restarts it and reports the GPU healthy again)."""

    def __init__(self, gpus: tuple[str, ...], detail: str = "") -> None:
        self.gpus = gpus
        what = ", ".join(gpus)
        super().__init__(
            f"the MPS control daemon of GPU {what} is down{': ' + detail if detail else ''}; "
            "the node agent restarts it and the GPU is reported unhealthy until then; retry"
        )
