"""Apply RFC 6902 ``add`` operations as the kube-apiserver does, to check webhook patches."""

from __future__ import annotations

import copy
from typing import Any


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def apply_patch(doc: Any, ops: list[dict[str, Any]]) -> Any:
    """A patched deep copy of ``doc``; raises ValueError where the apiserver would refuse."""
    out = copy.deepcopy(doc)
    for op in ops:
        if op.get("op") != "add":
            raise ValueError(f"unsupported op {op!r}")
        path = op["path"]
        if not path.startswith("/"):
            raise ValueError(f"path {path!r} is not a JSON pointer")
        *parents, last = [_unescape(t) for t in path[1:].split("/")]
        target = out
        for token in parents:
            if isinstance(target, list):
                target = target[int(token)]
            elif isinstance(target, dict) and token in target:
                target = target[token]
            else:
                raise ValueError(f"{path}: parent {token!r} does not exist")
        if isinstance(target, dict):
            target[last] = copy.deepcopy(op["value"])
        elif isinstance(target, list):
            index = len(target) if last == "-" else int(last)
            if not 0 <= index <= len(target):
                raise ValueError(f"{path}: index out of range")
            target.insert(index, copy.deepcopy(op["value"]))
        else:
            raise ValueError(f"{path}: parent is not a container")
    return out
