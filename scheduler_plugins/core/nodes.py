"""Nodes as the scheduling core sees them: registered GPUs, the GPUs an operator cordoned, how
the GPUs are connected, and allocatable CPU/memory."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from api.errors import InvalidAnnotationError, short_repr
from api.hami.keys import DEVICE_CORDON, NODE_PAIR_SCORES, NODE_REGISTER
from api.hami.nodes import PairScores, decode_cordon, decode_pair_scores
from api.hami.register import GpuDevice, decode
from api.kube.objects import annotations_of, as_object, parse_quantity


@dataclass(frozen=True)
class NodeInfo:
    name: str
    devices: tuple[GpuDevice, ...]
    cpu_milli: int
    memory_bytes: int
    cordoned: frozenset[str] = frozenset()
    pair_scores: PairScores = field(default_factory=dict)
    # What could not be read but does not stop the node (e.g. malformed pair scores).
    warnings: tuple[str, ...] = ()


def parse_node(node: Mapping[str, Any]) -> NodeInfo:
    """Raises InvalidAnnotationError if the register annotation is malformed; malformed pair
    scores only lose topology-aware placement on the node (a warning): HAMi would drop the
    node's GPUs altogether. An allocatable CPU or memory that is unreadable or negative counts
    as 0, unknown (a warning): pods' requests of it are not checked on the node."""
    meta = as_object(node.get("metadata"))
    name = str(meta.get("name", ""))
    annotations = annotations_of(node)
    raw = annotations.get(NODE_REGISTER)
    devices = decode(raw, obj=f"node {name}") if raw else ()
    warnings: list[str] = []
    alloc = as_object(as_object(node.get("status")).get("allocatable"))
    amounts = [0, 0]
    for i, (resource, scale) in enumerate((("cpu", 1000), ("memory", 1))):
        if resource not in alloc:
            continue
        try:
            q = parse_quantity(alloc[resource])
            if q < 0:
                raise ValueError(f"quantity {short_repr(alloc[resource])} is negative")
        except ValueError as e:
            warnings.append(
                f"status.allocatable.{resource}: {e}; pods' {resource} requests are not "
                "checked on this node"
            )
            continue
        amounts[i] = int(q * scale)
    cpu, mem = amounts
    pair_scores: PairScores = {}
    scores_raw = annotations.get(NODE_PAIR_SCORES)
    if scores_raw:
        try:
            pair_scores = decode_pair_scores(scores_raw, obj=f"node {name}")
        except InvalidAnnotationError as e:
            warnings.append(f"{e}; the node's GPUs are placed without topology scores")
    cordoned = decode_cordon(annotations.get(DEVICE_CORDON, ""))
    return NodeInfo(name, devices, cpu, mem, cordoned, pair_scores, tuple(warnings))
