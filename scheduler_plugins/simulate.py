"""``tessera simulate``: where would these pods go, and if not, why — offline.

Reads a cluster snapshot (Nodes and existing Pods) and a list of pods to place, runs the
same core the plugin server runs, and places the pods one after another, each placement
counting for the next.

What kube-scheduler decides beside Tessera is modelled for CPU and memory: every pod must fit
a node's ``status.allocatable`` less what the pods there request (existing and placed before
it; NodeResourcesFit, ``rules.host_reasons``; a node that shows no allocatable CPU or memory is
not checked for it). A GPU pod goes to Tessera's choice among the nodes where both its devices
and its CPU and memory fit. A pod without a GPU request goes where kube-scheduler's default
scores put it (``core.hostfit``: least allocated plus balanced allocation; exact ties to the
first name, where kube-scheduler picks at random), unless Tessera's scheduler gets it (it names
``hami-scheduler``, or names none with ``--host-only-pods``, the webhook's option) under the
fragmentation policy: then Tessera places it (``core.hostonly``: a node without GPUs first).
kube-scheduler's other plugins (taints, affinity, topology spread, ...) are not modelled.

A pod that fits nowhere but outranks pods there (``spec.priority``; a ``priorityClassName`` is
not resolved here) gets the pods kube-scheduler's preemption would preempt for it, and the
node: its DefaultPreemption algorithm over Tessera's what-ifs and the nodes' CPU and memory
(``core.whatif.select_victims``/``pick_node``), on the nodes the live scheduler offers it (for
a GPU pod, those where lower-priority GPU pods are in the way: ``preemptible_nodes``).
PodDisruptionBudgets are not modelled (kube-scheduler tries to spare the pods whose preemption
would violate one first, and prefers nodes with fewer of them). The preemption is only shown:
the victims stay in the simulated cluster, as they do until they are gone, and the pod stays
unschedulable in this attempt.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, cast

import yaml

from api.errors import InvalidAnnotationError, InvalidInputError, InvalidRequestError
from api.hami.config import YAML_LOADER, DeviceConfig
from api.kube.objects import as_object, pod_key
from scheduler_plugins.core.binding import bind_annotations
from scheduler_plugins.core.decide import decide
from scheduler_plugins.core.explain import explain, explain_host
from scheduler_plugins.core.hostfit import place
from scheduler_plugins.core.hostonly import allocation, place_host_only, wants_placing
from scheduler_plugins.core.nodes import parse_node
from scheduler_plugins.core.requests import (
    PodRequest,
    counts_against_capacity,
    parse_allocation,
    parse_request,
)
from scheduler_plugins.core.state import ClusterState
from scheduler_plugins.core.whatif import Candidate, pick_node, preemptible_nodes, select_victims
from scheduler_plugins.webhook.rules import DEFAULT_SCHEDULER, TESSERA_SCHEDULER


class SimulationInputError(InvalidInputError):
    """An input file or one of its objects is invalid; the message names both."""


@dataclass(frozen=True)
class Preempt:
    """What kube-scheduler's preemption would do for an unschedulable pod: preempt
    ``victims`` (most important first) on ``node``."""

    node: str
    victims: tuple[str, ...]

    def __str__(self) -> str:
        return f"would preempt {', '.join(self.victims)} on node {self.node}"


@dataclass(frozen=True)
class Result:
    pod: str
    status: Literal["Scheduled", "Unschedulable"]
    node: str | None
    annotations: dict[str, str]
    reason: str
    preempt: Preempt | None = None

    def to_json(self) -> str:
        return json.dumps(
            {
                "pod": self.pod,
                "status": self.status,
                "node": self.node,
                "annotations": self.annotations,
                "reason": self.reason,
                "preempt": None
                if self.preempt is None
                else {"node": self.preempt.node, "victims": list(self.preempt.victims)},
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


@dataclass(frozen=True)
class Skipped:
    """A cluster object left out of the simulation, and why (the rest goes on); ``kept``: only
    the part ``reason`` names is left out (a node's GPU pair scores, its allocatable CPU or
    memory)."""

    kind: Literal["Node", "Pod"]
    name: str
    reason: str
    kept: bool = False

    def __str__(self) -> str:
        return (
            f"{self.kind} {self.name} {'read in part' if self.kept else 'skipped'}: {self.reason}"
        )


def start_time(pod: Mapping[str, Any]) -> float:
    """``status.startTime`` in seconds; ``math.inf`` when the pod has not started (or the time
    cannot be read): kube-scheduler takes "now" for those, later than any start."""
    raw = as_object(pod.get("status")).get("startTime")
    if not isinstance(raw, str):
        return math.inf
    try:
        return datetime.fromisoformat(raw.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return math.inf


def build_cluster(
    objects: list[dict[str, Any]], config: DeviceConfig, source: Path
) -> tuple[ClusterState, list[Skipped]]:
    """The cluster the objects describe. A node whose GPU registration cannot be read is left
    out (and the pods bound to it), as the live scheduler leaves it out."""
    state = ClusterState(config)
    skipped: list[Skipped] = []
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
            skipped.append(Skipped("Node", name, _bare(e)))
            continue
        skipped.extend(Skipped("Node", name, w, kept=True) for w in info.warnings)
        state.upsert_node_info(info)
    unread = {s.name for s in skipped if s.kind == "Node" and s.name not in state.nodes}

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
        if alloc is not None and alloc.node in unread:
            skipped.append(
                Skipped("Pod", key, f"bound to node {alloc.node}, whose GPUs could not be read")
            )
            continue
        if alloc is not None and alloc.node not in state.nodes:
            raise SimulationInputError(
                f"{source}: Pod {key}: bound to node {alloc.node!r}, which the cluster lacks"
            )
        state.upsert_pod(alloc, key)
    return state, skipped


class Simulation:
    """Both inputs validated at construction (``skipped``: what was left out, and why);
    iterating places the pods one after another, each placement counting for the next."""

    def __init__(
        self,
        cluster_path: Path,
        pods_path: Path,
        config: DeviceConfig,
        *,
        host_only_pods: bool = False,
    ) -> None:
        cluster = load_objects(cluster_path)
        self._state, self.skipped = build_cluster(cluster, config, cluster_path)
        self._started = {pod_key(o): start_time(o) for o in cluster if o["kind"] == "Pod"}
        self._requests: list[PodRequest] = []
        # Pods without a GPU request that Tessera's scheduler gets: those naming it, and with
        # ``host_only_pods`` (the webhook's option) those naming no other scheduler.
        self._tesseras: set[str] = set()
        seen: set[str] = set()
        for obj in load_objects(pods_path):
            if obj["kind"] != "Pod":
                raise SimulationInputError(
                    f"{pods_path}: Node {obj['metadata']['name']}: only Pods may be placed"
                )
            key = pod_key(obj)
            if key in seen:
                raise SimulationInputError(f"{pods_path}: Pod {key}: appears twice")
            seen.add(key)
            try:
                self._requests.append(parse_request(obj, config))
            except InvalidInputError as e:
                raise SimulationInputError(f"{pods_path}: Pod {key}: {_bare(e)}") from e
            scheduler = as_object(obj.get("spec")).get("schedulerName") or DEFAULT_SCHEDULER
            if scheduler == TESSERA_SCHEDULER or (
                host_only_pods and scheduler == DEFAULT_SCHEDULER
            ):
                self._tesseras.add(key)

    def __iter__(self) -> Iterator[Result]:
        state = self._state
        for req in self._requests:
            if not req.wants_gpu:
                if req.key in self._tesseras and wants_placing(req):
                    yield self._place_host_only(req)
                else:
                    yield self._place_host(req)
                continue
            decision = decide(state, req)
            node = decision.best_node()
            if node is None:
                nodes = preemptible_nodes(state, req, decision.feasible)
                yield self._unschedulable(req, explain(decision, state), nodes)
                continue
            plan = decision.plan_for(node)
            assert plan is not None
            i = decision.node_index(node)
            feasible = decision.feasible_count()
            total = len(decision.layout.names) + len(decision.layout.gpu_less)
            gpu_scores = ", ".join(f"{d.gpu_score:.2f}" for c in plan.containers for d in c)
            kube = int(decision.preference.kube_scores(decision.score[i : i + 1])[0])
            if decision.delta is not None:
                tie = (
                    "the fuller (Tessera places the pods without GPUs)"
                    if state.kinds.fuller_ties
                    else "the emptier (the pods without GPUs are kube-scheduler's)"
                )
                reason = (
                    f"fragmentation score {decision.score[i]:.2f} ({kube}/100 to "
                    f"kube-scheduler): the GPU capacity the workload could not use there "
                    f"changes by {float(decision.delta[i]):+.2f} GPU, "
                    f"{feasible}/{total} nodes feasible; of nodes alike, {tie}"
                )
            else:
                reason = (
                    f"node score {decision.score[i]:.2f} ({req.node_policy.value}: {kube}/100 "
                    f"to kube-scheduler), GPU score {gpu_scores} ({req.gpu_policy}), "
                    f"{feasible}/{total} nodes feasible"
                )
            state.assume(
                plan.allocation(req.cpu_milli, req.memory_bytes, uid=req.uid, priority=req.priority)
            )
            yield Result(req.key, "Scheduled", node, bind_annotations(plan), reason)

    def _place_host(self, req: PodRequest) -> Result:
        """A pod without a GPU request, where kube-scheduler's default profile puts it
        (``hostfit``); its CPU and memory then count on that node."""
        state = self._state
        placement = place(state, req.cpu_milli, req.memory_bytes)
        best = placement.best()
        if best < 0:  # every node lacks its CPU or memory
            return self._unschedulable(req, explain_host(placement, state), placement.names)
        node = placement.names[best]
        least, balanced = int(placement.least[best]), int(placement.balanced[best])
        fitting = int(placement.fits.sum())
        reason = (
            f"no GPU request: kube-scheduler's scores {least} (NodeResourcesFit, least "
            f"allocated) + {balanced} (NodeResourcesBalancedAllocation), "
            f"{fitting}/{len(placement.names)} nodes fit its CPU and memory"
        )
        self._count_host(req, node)
        return Result(req.key, "Scheduled", node, {}, reason)

    def _place_host_only(self, req: PodRequest) -> Result:
        """A pod without a GPU request that Tessera places (``hostonly``: the fragmentation
        policy); its CPU and memory then count on that node."""
        state = self._state
        placement = place_host_only(state, req)
        node = placement.best()
        if node is None:  # kube-scheduler's verdict: the server leaves such a pod to it
            everywhere = place(state, req.cpu_milli, req.memory_bytes)
            return self._unschedulable(req, explain_host(everywhere, state), everywhere.names)
        if placement.gpu_less:
            reason = (
                "no GPU request (fragmentation policy): a node without GPUs, where it strands "
                f"no GPU capacity ({placement.gpu_less} such nodes fit, in kube-scheduler's "
                "order)"
            )
        else:
            d = placement.decision
            assert d is not None  # the GPU nodes were ranked: no node without GPUs had room
            i = d.node_index(node)
            delta = float(d.delta[i]) if d.delta is not None else 0.0
            reason = (
                "no GPU request (fragmentation policy): no node without GPUs has room; the GPU "
                f"capacity the workload could not use here changes by {delta:+.2f} GPU "
                f"({placement.scores[0]}/100 to kube-scheduler), "
                f"{len(placement.names)} GPU nodes fit"
            )
        self._count_host(req, node)
        return Result(req.key, "Scheduled", node, {}, reason)

    def _count_host(self, req: PodRequest, node: str) -> None:
        """A pod without a GPU request placed on ``node``: its CPU and memory count there."""
        if req.cpu_milli > 0 or req.memory_bytes > 0:
            self._state.assume(allocation(req, node))

    def _unschedulable(self, req: PodRequest, why: str, nodes: Iterable[str]) -> Result:
        """``req`` fits no node (``why``), with whom preemption would preempt for it on
        ``nodes`` (those it may try)."""
        preempt = self._preemption(req, nodes)
        if preempt is not None:
            why += f"; {preempt} (kube-scheduler's preemption; PodDisruptionBudgets not modelled)"
        return Result(req.key, "Unschedulable", None, {}, why, preempt)

    def _preemption(self, req: PodRequest, nodes: Iterable[str]) -> Preempt | None:
        """Whom kube-scheduler's preemption would preempt for ``req``, and where: its choice
        of victims on each of ``nodes`` where preempting could make room, then its choice of
        node (ties: the first by name)."""
        state = self._state
        candidates = []
        for node in sorted(nodes):
            pods = [
                Candidate(a.key, a.priority, self._started.get(a.key, math.inf))
                for a in state.pods_on(node)
            ]
            victims = select_victims(state, req, node, pods)
            if victims is not None:
                candidates.append(victims)
        chosen = pick_node(candidates)
        if chosen is None:
            return None
        return Preempt(chosen.node, tuple(v.key for v in chosen.pods))


def simulate(
    cluster_path: Path, pods_path: Path, config: DeviceConfig, *, host_only_pods: bool = False
) -> Simulation:
    """``Simulation``: validate both inputs fully; iterate it for one Result per pod.
    ``host_only_pods``: the webhook routes pods without a GPU request to Tessera's scheduler
    (they place by ``hostonly`` under the fragmentation policy)."""
    return Simulation(cluster_path, pods_path, config, host_only_pods=host_only_pods)


def render_table(results: list[Result], skipped: Sequence[Skipped] = ()) -> str:
    """One row per pod; an unschedulable pod's reason ends with the pods kube-scheduler's
    preemption would preempt for it ("would preempt a, b on node X")."""
    rows = [("POD", "STATUS", "NODE", "DEVICES", "REASON")]
    for r in results:
        rows.append((r.pod, r.status, r.node or "-", _devices_summary(r.annotations), r.reason))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [
        "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:4])) + "  " + row[4]
        for row in rows
    ]
    return "\n".join([*lines, *(f"warning: {s}" for s in skipped)])


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
