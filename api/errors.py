"""Tessera's exception hierarchy, named by what the caller should do.

- ``InvalidInputError`` and its children: the input is wrong and retrying will not help;
  the message names the object and field and says what to change.
- ``TemporaryError``: the operation may succeed later (an API or hardware hiccup).
"""

from __future__ import annotations

import reprlib


class TesseraError(Exception):
    """Base of every error Tessera raises on purpose."""


class InvalidInputError(TesseraError):
    """Permanent: the input is malformed or violates the contract."""


class InvalidAnnotationError(InvalidInputError):
    """An annotation value does not follow its wire format."""

    def __init__(self, key: str, problem: str, *, obj: str = "") -> None:
        self.key = key
        self.problem = problem
        self.obj = obj
        where = f"{obj}: " if obj else ""
        super().__init__(f"{where}annotation {key}: {problem}")


class InvalidConfigError(InvalidInputError):
    """The device config is invalid; ``path`` is the dotted path of the bad field."""

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(f"{path}: {problem}" if path else problem)


class InvalidRequestError(InvalidInputError):
    """A pod asks for GPU resources in a way Tessera cannot satisfy on any cluster."""

    def __init__(self, pod: str, problem: str) -> None:
        self.pod = pod
        self.problem = problem
        super().__init__(f"pod {pod}: {problem}")


class TemporaryError(TesseraError):
    """Transient: retry later."""


class _ShortRepr(reprlib.Repr):
    def __init__(self) -> None:
        super().__init__()
        self.maxstring = self.maxother = 100

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 128:  # repr() itself refuses ints past 4300 digits
            return f"<integer of {x.bit_length()} bits>"
        return super().repr_int(x, level)


_SHORT_REPR = _ShortRepr()


def short_repr(value: object, limit: int = 120) -> str:
    """``repr`` of a bad input value cut to ``limit`` characters, for error messages.

    Inputs are untrusted: a megabyte string, a YAML alias bomb (whose full repr is
    exponential) or an int past ``repr``'s 4300-digit limit must still give a short message.
    """
    text = _SHORT_REPR.repr(value)
    return text if len(text) <= limit else f"{text[: limit - 1]}…"
