"""Errors of the cluster benchmark, named by what the caller should do."""

from __future__ import annotations

from api.errors import InvalidInputError, TesseraError


class BenchError(TesseraError):
    """The benchmark could not run as asked; the message says what failed."""


class BenchInputError(InvalidInputError):
    """A ``tessera bench`` option is invalid; the message names it."""
