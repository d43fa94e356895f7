"""Codecs of the node annotations beside the register: ``hami.io/device-cordon`` (GPUs an
operator closed to new allocations) and ``hami.io/node-nvidia-score`` (GPU pair scores a HAMi
device plugin writes for the ``topology-aware`` GPU policy)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from api.errors import short_repr
from api.hami.jsonvalue import annotation_errors, load_json
from api.hami.keys import DEVICE_CORDON, NODE_PAIR_SCORES

PairScores = Mapping[str, Mapping[str, int]]
"""GPU UUID -> other GPU's UUID -> how well the two are connected (higher is better)."""


def decode_cordon(value: str) -> frozenset[str]:
    """The GPU UUIDs of ``hami.io/device-cordon``: a comma list, spaces around entries and
    empty entries ignored (HAMi v2.10). Unknown UUIDs are harmless."""
    return frozenset(u.strip() for u in value.split(",") if u.strip())


def decode_pair_scores(value: str, *, obj: str = "") -> PairScores:
    """``[{"uuid":"GPU-a","score":{"GPU-b":200}}, ...]``; ``null`` is no scores. Raises
    InvalidAnnotationError naming the entry and field."""

    bad = annotation_errors(NODE_PAIR_SCORES, obj)
    raw = load_json(value, bad)
    if raw is None:
        return {}
    if not isinstance(raw, list):
        raise bad("must be a JSON array with one object per GPU")
    out: dict[str, dict[str, int]] = {}
    for i, item in enumerate(raw):
        where = f"entry [{i}]"
        if not isinstance(item, dict):
            raise bad(f"{where} must be an object")
        it = cast("dict[str, Any]", item)
        uuid = it.get("uuid")
        if not isinstance(uuid, str) or not uuid:
            raise bad(f"{where}.uuid must be a GPU UUID, got {short_repr(uuid)}")
        scores = it.get("score")
        if scores is None:
            scores = {}
        if not isinstance(scores, dict):
            raise bad(f"{where}.score must be an object of GPU UUID to score")
        row: dict[str, int] = {}
        for other, score in cast("dict[str, Any]", scores).items():
            if isinstance(score, bool) or not isinstance(score, int) or abs(score) > 2**31:
                raise bad(f"{where}.score[{short_repr(other)}] must be an integer")
            row[other] = score
        out.setdefault(uuid, row)  # HAMi matches a GPU's first entry
    return out


__all__ = ["DEVICE_CORDON", "NODE_PAIR_SCORES", "PairScores", "decode_cordon", "decode_pair_scores"]
