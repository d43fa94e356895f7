"""``tessera simulate``: where would these pods go, and if not, why — offline.

Reads a cluster snapshot (Nodes and existing Pods) and a list of pods to place, runs the
same core the plugin server runs, and places the pods one after another, each placement
counting for the next.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import yaml

from api.errors import InvalidAnnotationError, InvalidInputError, InvalidRequestError
from api.hami.config import YAML_LOADER, DeviceConfig
from api.kube.objects import pod_key
from scheduler_plugins.core.binding import bind_annotations
from scheduler_plugins.core.decide import decide
from scheduler_plugins.core.explain import explain
from scheduler_plugins.core.nodes import parse_node
from scheduler_plugins.core.requests import counts_against_capacity, parse_allocation, parse_request
from scheduler_plugins.core.state import ClusterState


class SimulationInputError(InvalidInputError):
    """An input file or one of its objects is invalid; the message names both."""


@dataclass(frozen=True)
class Result:
    pod: str
    status: Literal["Scheduled", "Unschedulable"]
    node: str | None
    annotations: dict[str, str]
    reason: str

    def to_json(self) -> str:
        return json.dumps(
            {
                "pod": self.pod,
                "status": self.status,
                "node": self.node,
                "annotations": self.annotations,
                "reason": self.reason,
            },
            separators=(",", ":"),
        )


def load_objects(path: Path) -> list[dict[str, Any]]:
    """Kubernetes objects from multi-document YAML, or a ``kind: List``."""
    try:
        docs = list(yaml.load_all(path.read_text(), Loader=YAML_LOADER))
    except OSError as e:
        raise SimulationInputError(f"{path}: cannot read: {e.strerror}") from e
    except (yaml.YAMLError, ValueError) as e:  # ValueError: e.g. a 2024-13-45 timestamp
        raise SimulationInputError(f"{path}: not valid YAML: {_one_line(str(e))}") from e
    except RecursionError as e:
        raise SimulationInputError(f"{path}: not valid YAML: nested too deeply") from e
    out: list[dict[str, Any]] = []
    for i, doc in enumerate(docs):
        if doc is None:
            continue
        if not isinstance(doc, dict):
            raise SimulationInputError(f"{path}: document {i + 1} is not a Kubernetes object")
        kind = doc.get("kind", "")
        items = doc.get("items") if isinstance(kind, str) and kind.endswith("List") else [doc]
        if not isinstance(items, list):
            raise SimulationInputError(f"{path}: document {i + 1}: items must be a list")
        for j, item in enumerate(items):
            if not isinstance(item, dict) or item.get("kind") not in ("Node", "Pod"):
                kind = item.get("kind") if isinstance(item, dict) else type(item).__name__
                raise SimulationInputError(
                    f"{path}: document {i + 1} item {j + 1}: expected a Node or Pod, got {kind!r}"
                )
            meta = item.get("metadata")
            if not isinstance(meta, dict) or not meta.get("name"):
                raise SimulationInputError(
                    f"{path}: document {i + 1} item {j + 1}: {item['kind']} has no metadata.name"
                )
            out.append(cast("dict[str, Any]", item))
    return out


def _bare(e: InvalidInputError) -> str:
    """The problem without the object name (the caller names file and object once)."""
    if isinstance(e, InvalidAnnotationError):
        return f"annotation {e.key}: {e.problem}"
    if isinstance(e, InvalidRequestError):
        return e.problem
    return str(e)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def build_cluster(
    objects: list[dict[str, Any]], config: DeviceConfig, source: Path
) -> ClusterState:
    state = ClusterState(config)
    seen_nodes: set[str] = set()
    for obj in objects:
        if obj["kind"] != "Node":
            continue
        name = obj["metadata"]["name"]
        if name in seen_nodes:
            raise SimulationInputError(f"{source}: Node {name}: appears twice")
        seen_nodes.add(name)
        try:
            info = parse_node(obj)
        except InvalidInputError as e:
            raise SimulationInputError(f"{source}: Node {name}: {_bare(e)}") from e
        state.upsert_node(
            info.name, info.devices, cpu_milli=info.cpu_milli, memory_bytes=info.memory_bytes
        )
    seen_pods: set[str] = set()
    for obj in objects:
        if obj["kind"] != "Pod":
            continue
        key = pod_key(obj)
        if key in seen_pods:
            raise SimulationInputError(f"{source}: Pod {key}: appears twice")
        seen_pods.add(key)
        if not counts_against_capacity(obj):
            continue
        try:
            alloc = parse_allocation(obj)
        except InvalidInputError as e:
            raise SimulationInputError(f"{source}: Pod {key}: {_bare(e)}") from e
        if alloc is not None and alloc.node not in state.nodes:
            raise SimulationInputError(
                f"{source}: Pod {key}: bound to node {alloc.node!r}, which the cluster lacks"
            )
        state.upsert_pod(alloc, key)
    return state


def simulate(cluster_path: Path, pods_path: Path, config: DeviceConfig) -> Iterator[Result]:
    """Validate both inputs fully, then yield one Result per pod, in order."""
    state = build_cluster(load_objects(cluster_path), config, cluster_path)
    pods = load_objects(pods_path)
    requests = []
    seen: set[str] = set()
    for obj in pods:
        if obj["kind"] != "Pod":
            raise SimulationInputError(
                f"{pods_path}: Node {obj['metadata']['name']}: only Pods may be placed"
            )
        key = pod_key(obj)
        if key in seen:
            raise SimulationInputError(f"{pods_path}: Pod {key}: appears twice")
        seen.add(key)
        try:
            requests.append(parse_request(obj, config))
        except InvalidInputError as e:
            raise SimulationInputError(f"{pods_path}: Pod {key}: {_bare(e)}") from e
    for req in requests:
        if not req.wants_gpu:
            yield Result(
                req.key,
                "Scheduled",
                None,
                {},
                "no GPU request: Tessera leaves the node to kube-scheduler's plugins",
            )
            continue
        decision = decide(state, req)
        node = decision.best_node()
        if node is None:
            yield Result(req.key, "Unschedulable", None, {}, explain(decision, state))
            continue
        plan = decision.plan_for(node)
        assert plan is not None
        i = decision.node_index(node)
        feasible = decision.feasible_count()
        total = len(decision.layout.names) + len(decision.layout.gpu_less)
        gpu_scores = ", ".join(f"{d.gpu_score:.2f}" for c in plan.containers for d in c)
        kube = int(decision.preference.kube_scores(decision.score[i : i + 1])[0])
        reason = (
            f"node score {decision.score[i]:.2f} ({req.node_policy.value}: {kube}/100 to "
            f"kube-scheduler), GPU score {gpu_scores} ({req.gpu_policy.value}), "
            f"{feasible}/{total} nodes feasible"
        )
        state.assume(plan.allocation(req.cpu_milli, req.memory_bytes))
        yield Result(req.key, "Scheduled", node, bind_annotations(plan), reason)


def render_table(results: list[Result]) -> str:
    rows = [("POD", "STATUS", "NODE", "DEVICES", "REASON")]
    for r in results:
        rows.append((r.pod, r.status, r.node or "-", _devices_summary(r.annotations), r.reason))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join(
        "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:4])) + "  " + row[4]
        for row in rows
    )


def _devices_summary(annotations: Mapping[str, str]) -> str:
    from api.hami import keys as ann
    from api.hami.devices import decode_devices, decode_mig_allocations

    if ann.MIG_ALLOCATIONS in annotations:
        return " ".join(
            f"{m.gpu_uuid[:12]}:{m.profile}@[{m.placement.start},{m.placement.end})"
            for m in decode_mig_allocations(annotations[ann.MIG_ALLOCATIONS])
        )
    if ann.DEVICES_ALLOCATED in annotations:
        return " ".join(
            f"{d.uuid[:12]}:{d.mem}MiB/{d.cores}%"
            for c in decode_devices(annotations[ann.DEVICES_ALLOCATED])
            for d in c
        )
    return "-"
