"""Nodes as the scheduling core sees them: registered GPUs and allocatable CPU/memory."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from api.hami.keys import NODE_REGISTER
from api.hami.register import GpuDevice, decode
from api.kube.objects import parse_quantity


@dataclass(frozen=True)
class NodeInfo:
    name: str
    devices: tuple[GpuDevice, ...]
    cpu_milli: int
    memory_bytes: int


def _dict(v: object) -> dict[str, Any]:
    return cast("dict[str, Any]", v) if isinstance(v, dict) else {}


def parse_node(node: Mapping[str, Any]) -> NodeInfo:
    """Raises InvalidAnnotationError if the register annotation is malformed."""
    meta = _dict(node.get("metadata"))
    name = str(meta.get("name", ""))
    annotations = _dict(meta.get("annotations"))
    raw = annotations.get(NODE_REGISTER)
    devices = decode(raw, obj=f"node {name}") if isinstance(raw, str) and raw else ()
    alloc = _dict(_dict(node.get("status")).get("allocatable"))
    try:
        cpu = int(parse_quantity(alloc["cpu"]) * 1000) if "cpu" in alloc else 0
        mem = int(parse_quantity(alloc["memory"])) if "memory" in alloc else 0
    except ValueError:
        cpu, mem = 0, 0
    return NodeInfo(name, devices, cpu, mem)
