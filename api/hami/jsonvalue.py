"""The JSON annotations of the contract (``hami.io/node-nvidia-register``,
``hami.io/vgpu-mig-allocations``, ``hami.io/node-nvidia-score``) read one way: an error names
the annotation and the object, and malformed JSON says so."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from api.errors import InvalidAnnotationError

Bad = Callable[[str], InvalidAnnotationError]
"""Makes the error of one annotation of one object from a problem."""


def annotation_errors(key: str, obj: str) -> Bad:
    return functools.partial(InvalidAnnotationError, key, obj=obj)


def load_json(value: str, bad: Bad) -> Any:
    try:
        return json.loads(value)
    except (ValueError, RecursionError) as e:  # ValueError: also ints over 4300 digits
        raise bad(f"not valid JSON ({e})") from e
