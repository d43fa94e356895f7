"""glibc allocator settings for a long-running plugin server.

With glibc's defaults, numpy arrays of a few hundred KiB (per-GPU columns of a large cluster)
are mmapped or carved from the heap top and, once freed, handed back to the kernel: the next
decision faults the same pages in again. ``tune_allocator`` keeps freed memory in the process
instead. Call it once at start, before the state is built.
"""

from __future__ import annotations

import ctypes
import sys

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

TRIM_THRESHOLD = 256 << 20  # keep up to 256 MiB free at the heap top
TOP_PAD = 64 << 20  # grow the heap in steps of 64 MiB more than asked
# Setting either of the above turns off glibc's adaptive mmap threshold (it would stay at
# 128 KiB, and every larger array would be a fresh mmap, faulted in page by page): fix it.
MMAP_THRESHOLD = 32 << 20


def tune_allocator(
    trim_threshold: int = TRIM_THRESHOLD,
    top_pad: int = TOP_PAD,
    mmap_threshold: int | None = MMAP_THRESHOLD,
) -> str:
    """Set glibc's M_TRIM_THRESHOLD / M_TOP_PAD (and M_MMAP_THRESHOLD unless None) with
    ``mallopt``. A no-op elsewhere (musl, macOS, Windows); never raises. Returns what was done,
    for a log line."""
    try:
        if not sys.platform.startswith("linux"):
            return f"default (no glibc on {sys.platform})"
        libc = ctypes.CDLL(None)
        if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
            return "default (not glibc)"
        mallopt = libc.mallopt
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
        settings = [(M_TRIM_THRESHOLD, trim_threshold), (M_TOP_PAD, top_pad)]
        if mmap_threshold is not None:
            settings.append((M_MMAP_THRESHOLD, mmap_threshold))
        if any(not 0 <= value < 1 << 31 for _, value in settings):
            return f"default (out of range: {settings})"
        refused = [param for param, value in settings if mallopt(param, value) != 1]
        if refused:
            return f"partly tuned (mallopt refused {refused})"
        text = f"tuned (M_TRIM_THRESHOLD {trim_threshold >> 20} MiB, M_TOP_PAD {top_pad >> 20} MiB"
        if mmap_threshold is not None:
            text += f", M_MMAP_THRESHOLD {mmap_threshold >> 20} MiB"
        return text + ")"
    except Exception as exc:  # never fail a server start over a tuning knob
        return f"default (mallopt failed: {exc!r})"


__all__ = ["tune_allocator"]
