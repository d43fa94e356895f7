"""Bounded polling for tests that wait on other processes or the API server."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def eventually(
    check: Callable[[], Any], *, timeout_s: float = 30.0, interval_s: float = 0.1, what: str = ""
) -> Any:
    """Poll ``check`` until it returns a truthy value (returned); fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what or check}")
        time.sleep(interval_s)
