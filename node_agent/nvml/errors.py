"""Errors of the NVML backends, named by what the node agent should do.

Both backends raise only these: the real one maps ``pynvml.NVMLError`` return codes here
(``raise … from e``, so pynvml types never leak), the simulated one raises them directly
with the return-code name the hardware would give. Messages say what was attempted (GPU
index, profile, placement) and why it failed.
"""

from __future__ import annotations

from typing import Final

from api.errors import InvalidInputError, TemporaryError, TesseraError


class NvmlError(TesseraError):
    """An NVML call failed; ``code`` is the NVML return-code name when known."""

    def __init__(self, attempted: str, detail: str = "", *, code: str | None = None) -> None:
        self.attempted = attempted
        self.detail = detail
        self.code = code
        reason = detail or (code or "failed")
        suffix = f" [{code}]" if code and detail else ""
        super().__init__(f"{attempted}: {reason}{suffix}")


class InsufficientResources(NvmlError):
    """The GPU has no room for the instance (overlap, instance limit, no compute slices)."""


class InUse(NvmlError, TemporaryError):
    """The instance still has compute instances or processes; retry after they are gone."""


class NotFound(NvmlError):
    """No GPU instance, compute instance or MIG device has that id."""


class NotSupported(NvmlError):
    """The GPU (or its current MIG mode) does not support the operation or profile."""


class InvalidArgument(NvmlError, InvalidInputError):
    """An argument is not legal for this GPU (index, profile id, placement)."""


class Uninitialized(NvmlError):
    """The backend is not initialized, or already shut down."""


class NvmlUnavailable(NvmlError, TemporaryError):
    """NVML cannot be used here: library missing, driver not loaded or mismatched."""


# Return codes from nvml.h (part of NVML's ABI, stable across versions).
CODE_NAMES: Final[dict[int, str]] = {
    1: "NVML_ERROR_UNINITIALIZED",
    2: "NVML_ERROR_INVALID_ARGUMENT",
    3: "NVML_ERROR_NOT_SUPPORTED",
    4: "NVML_ERROR_NO_PERMISSION",
    5: "NVML_ERROR_ALREADY_INITIALIZED",
    6: "NVML_ERROR_NOT_FOUND",
    7: "NVML_ERROR_INSUFFICIENT_SIZE",
    8: "NVML_ERROR_INSUFFICIENT_POWER",
    9: "NVML_ERROR_DRIVER_NOT_LOADED",
    10: "NVML_ERROR_TIMEOUT",
    11: "NVML_ERROR_IRQ_ISSUE",
    12: "NVML_ERROR_LIBRARY_NOT_FOUND",
    13: "NVML_ERROR_FUNCTION_NOT_FOUND",
    14: "NVML_ERROR_CORRUPTED_INFOROM",
    15: "NVML_ERROR_GPU_IS_LOST",
    16: "NVML_ERROR_RESET_REQUIRED",
    17: "NVML_ERROR_OPERATING_SYSTEM",
    18: "NVML_ERROR_LIB_RM_VERSION_MISMATCH",
    19: "NVML_ERROR_IN_USE",
    20: "NVML_ERROR_MEMORY",
    21: "NVML_ERROR_NO_DATA",
    22: "NVML_ERROR_VGPU_ECC_NOT_SUPPORTED",
    23: "NVML_ERROR_INSUFFICIENT_RESOURCES",
    24: "NVML_ERROR_FREQ_NOT_SUPPORTED",
    25: "NVML_ERROR_ARGUMENT_VERSION_MISMATCH",
    26: "NVML_ERROR_DEPRECATED",
    27: "NVML_ERROR_NOT_READY",
    28: "NVML_ERROR_GPU_NOT_FOUND",
    29: "NVML_ERROR_INVALID_STATE",
    30: "NVML_ERROR_RESET_TYPE_NOT_SUPPORTED",
    999: "NVML_ERROR_UNKNOWN",
}

# Return-code name -> error class; codes not listed become a plain NvmlError.
ERROR_BY_CODE: Final[dict[str, type[NvmlError]]] = {
    "NVML_ERROR_INSUFFICIENT_RESOURCES": InsufficientResources,
    "NVML_ERROR_IN_USE": InUse,
    "NVML_ERROR_NOT_FOUND": NotFound,
    "NVML_ERROR_NOT_SUPPORTED": NotSupported,
    "NVML_ERROR_FUNCTION_NOT_FOUND": NotSupported,  # the installed library predates the call
    "NVML_ERROR_INVALID_ARGUMENT": InvalidArgument,
    "NVML_ERROR_UNINITIALIZED": Uninitialized,
    "NVML_ERROR_LIBRARY_NOT_FOUND": NvmlUnavailable,
    "NVML_ERROR_DRIVER_NOT_LOADED": NvmlUnavailable,
    "NVML_ERROR_LIB_RM_VERSION_MISMATCH": NvmlUnavailable,
}


def code_name(code: int) -> str:
    return CODE_NAMES.get(code, f"NVML return code {code}")


def error_for_code(code: int, attempted: str, detail: str = "") -> NvmlError:
    """The Tessera error for an NVML return code, carrying the code's name."""
    name = code_name(code)
    return ERROR_BY_CODE.get(name, NvmlError)(attempted, detail, code=name)
