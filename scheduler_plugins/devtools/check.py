"""``tessera check``: do the cluster's allocations hold together?

Reads what the API shows (nodes and pods) and, for the local dev cluster, the kwok node
agent's simulated NVML state files, and reports every broken invariant as a ``Violation``:

- ``mig-overlap``: two MIG reservations share memory slices of one GPU.
- ``over-capacity``: a GPU's vGPU slots (on MPS GPUs: client slots), memory or (hami-core and
  MPS) cores are over-committed, or its usage went negative (a pod counted off twice).
- ``bad-annotations``: a bound GPU pod's allocation annotations are missing, undecodable or
  inconsistent (wrong node, wrong mode, illegal MIG placement, no runtime identity after
  ``bind-phase: success``, ...).
- ``unexplained-pending``: a GPU pod is not bound and has no ``PodScheduled=False``
  (``Unschedulable``) condition with a message, or still carries allocation annotations.
- ``mig-identity``: a MIG runtime identity does not match the simulated hardware (no GPU
  instance at the placement, other GI/CI id or MIG UUID), or one MIG UUID is in two places.
- ``leaked-instance``: the simulated hardware holds a GPU instance no live pod reserves.
- ``unreadable``: a node's register annotation or a simulated state file cannot be decoded.

The check is a snapshot: run it on a quiet cluster. Pods in the middle of scheduling or
allocation (``bind-phase: allocating``, a GPU instance created but not yet annotated, a pod
not tried yet) show up as violations until they settle.

``check_objects`` is the pure core (tests call it with hand-built objects); ``check_cluster``
lists the objects through a Kubernetes client; ``add_check_command`` is the CLI adapter.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Final, Protocol

from api.errors import InvalidInputError
from api.hami import keys as ann
from api.hami.catalog import UnknownModelError, find_model
from api.hami.config import DeviceConfig, load_config_file
from api.hami.devices import (
    MigAllocation,
    decode_devices,
    decode_mig_allocations,
)
from api.hami.keys import GpuMode
from api.hami.register import GpuDevice, Placement
from api.kube.errors import ApiError, KubeError
from api.kube.objects import all_containers, annotations_of, pod_key
from scheduler_plugins.core.nodes import parse_node
from scheduler_plugins.core.requests import (
    PodRequest,
    counts_against_capacity,
    parse_allocation,
    parse_request,
)
from scheduler_plugins.core.rules import MODE_CODES, SHARED_MODES, modes
from scheduler_plugins.core.state import ClusterState

Obj = Mapping[str, Any]

INTERNAL_ANNOTATION_PREFIX: Final = "hami.io/vgpu-"


class ViolationKind(StrEnum):
    MIG_OVERLAP = "mig-overlap"
    OVER_CAPACITY = "over-capacity"
    BAD_ANNOTATIONS = "bad-annotations"
    UNEXPLAINED_PENDING = "unexplained-pending"
    MIG_IDENTITY = "mig-identity"
    LEAKED_INSTANCE = "leaked-instance"
    UNREADABLE = "unreadable"


@dataclass(frozen=True, order=True)
class Violation:
    kind: ViolationKind
    object: str  # "node/GPU 0 (mig)", "namespace/pod", "node state file"
    message: str

    def __str__(self) -> str:
        return f"{self.kind.value}: {self.object}: {self.message}"

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind.value, "object": self.object, "message": self.message}


@dataclass(frozen=True)
class CheckReport:
    violations: tuple[Violation, ...]
    nodes: int
    pods: int
    gpu_pods: int  # pods asking for GPUs (bound or not)
    mig_instances: int  # MIG reservations of live bound pods
    sim_instances: int | None = None  # GPU instances in the simulated state (None: not read)

    @property
    def ok(self) -> bool:
        return not self.violations

    def by_kind(self) -> dict[str, int]:
        return dict(sorted(Counter(v.kind.value for v in self.violations).items()))

    def summary(self) -> str:
        sim = "" if self.sim_instances is None else f", {self.sim_instances} simulated GIs"
        head = (
            f"{self.nodes} nodes, {self.pods} pods ({self.gpu_pods} GPU), "
            f"{self.mig_instances} MIG instances{sim}"
        )
        if self.ok:
            return f"ok: {head}"
        kinds = ", ".join(f"{n} {k}" for k, n in self.by_kind().items())
        lines = [f"{len(self.violations)} violations ({kinds}): {head}"]
        lines.extend(f"  {v}" for v in self.violations)
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(
            {
                "ok": self.ok,
                "nodes": self.nodes,
                "pods": self.pods,
                "gpuPods": self.gpu_pods,
                "migInstances": self.mig_instances,
                "simInstances": self.sim_instances,
                "violations": [v.to_dict() for v in self.violations],
            },
            separators=(",", ":"),
        )


class CheckInputError(InvalidInputError):
    """The check cannot read what it should check (cluster unreachable, bad state dir)."""


# Simulated hardware ----------------------------------------------------------------------


@dataclass(frozen=True)
class SimInstance:
    """One GPU instance in a simulated NVML state file, with its compute instances."""

    gpu_uuid: str
    gi_id: int
    profile_id: int
    placement: Placement
    compute: Mapping[int, str]  # CI id -> MIG UUID


@dataclass(frozen=True)
class SimNode:
    """The simulated NVML state of one node: GPU UUID -> model name, and its instances."""

    gpus: Mapping[str, str]
    instances: tuple[SimInstance, ...]


def parse_sim_state(raw: object, *, where: str) -> SimNode:
    """A state file's JSON (``node_agent.nvml.simulated`` format); InvalidInputError names
    ``where`` and the bad field."""
    try:
        if not isinstance(raw, dict) or not isinstance(raw.get("gpus"), list):
            raise ValueError("not an object with a gpus list")
        gpus: dict[str, str] = {}
        instances: list[SimInstance] = []
        for g in raw["gpus"]:
            uuid = str(g["uuid"])
            gpus[uuid] = str(g["model"])
            for gi in g["gpuInstances"]:
                instances.append(
                    SimInstance(
                        uuid,
                        int(gi["id"]),
                        int(gi["profileId"]),
                        Placement(int(gi["start"]), int(gi["size"])),
                        {int(c["id"]): str(c["migUUID"]) for c in gi["computeInstances"]},
                    )
                )
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidInputError(f"{where}: malformed simulated NVML state ({e!r})") from e
    return SimNode(gpus, tuple(instances))


def load_sim_states(directory: Path) -> tuple[dict[str, SimNode], list[Violation]]:
    """Every ``NODE.json`` of the kwok node agent's state dir, and the files it could not
    read (as ``unreadable`` violations). CheckInputError if ``directory`` is no directory."""
    if not directory.is_dir():
        raise CheckInputError(
            f"simulated state dir {directory}: not a directory (the kwok node agent's state dir, "
            "e.g. <cluster state dir>/node-agent)"
        )
    states: dict[str, SimNode] = {}
    problems: list[Violation] = []
    for path in sorted(directory.glob("*.json")):
        if path.name.startswith("."):
            continue  # the simulator's temporary files
        node = path.stem
        try:
            states[node] = parse_sim_state(json.loads(path.read_text()), where=str(path))
        except (OSError, ValueError, InvalidInputError) as e:
            problems.append(Violation(ViolationKind.UNREADABLE, f"{node} state file", str(e)))
    return states, problems


# The core ----------------------------------------------------------------------------------


def rebuild_state(
    nodes: Iterable[Obj], pods: Iterable[Obj], config: DeviceConfig | None = None
) -> ClusterState:
    """The scheduler's accounting of ``nodes`` and ``pods`` rebuilt from scratch, the way a
    restarted plugin server would; malformed objects raise InvalidInputError."""
    state = ClusterState(config or DeviceConfig())
    for node in nodes:
        info = parse_node(node)
        state.upsert_node_info(info)
    for pod in pods:
        if counts_against_capacity(pod):
            state.upsert_pod(parse_allocation(pod), pod_key(pod))
    return state


def capacity_violations(state: ClusterState) -> list[Violation]:
    """Per GPU: no overlapping MIG placements (nor MIG reservations beside MIG slots HAMi <= v2.9
    placed), slots ≤ count, memory ≤ devmem, and for shared GPUs (hami-core, MPS) cores ≤
    devcore (MIG profiles' core shares may add up past 100)."""
    out: list[Violation] = []
    g = state.gpus
    for name, entry in sorted(state.nodes.items()):
        for d in entry.devices:
            r = entry.rows[d.id]
            where = f"{name}/GPU {d.index} ({d.mode})"

            def over(message: str, where: str = where) -> None:
                out.append(Violation(ViolationKind.OVER_CAPACITY, where, message))

            if int(g.conflict[r]) != 0:
                use = g.slice_use[r].tolist()
                out.append(
                    Violation(
                        ViolationKind.MIG_OVERLAP,
                        where,
                        f"{int(g.conflict[r])} MIG slices used twice (use per slice {use})",
                    )
                )
            if int(g.legacy[r]) and int(g.mig_mask[r]):
                out.append(
                    Violation(
                        ViolationKind.MIG_OVERLAP,
                        where,
                        f"{int(g.legacy[r])} MIG slots HAMi <= v2.9 placed (placement unknown) "
                        "share the GPU with MIG reservations",
                    )
                )
            if g.used_slots[r] > d.count:
                over(f"{g.used_slots[r]:.0f} vGPUs > count {d.count}")
            if g.used_mem[r] > d.devmem:
                over(f"{g.used_mem[r]:.0f} MiB > devmem {d.devmem}")
            if d.mode in SHARED_MODES and g.used_cores[r] > d.devcore:
                over(f"{g.used_cores[r]:.0f}% cores > devcore {d.devcore}")
            if min(g.used_slots[r], g.used_mem[r], g.used_cores[r]) < 0:
                over("negative usage (a pod counted off twice?)")
    return out


def _named(offered: frozenset[GpuMode]) -> str:
    return ",".join(m for m in MODE_CODES if m in offered)


def annotation_violations(
    pod: Obj,
    node_gpus: Mapping[str, Sequence[GpuDevice]],
    config: DeviceConfig | None = None,
) -> list[Violation]:
    """What is wrong with a bound GPU pod's annotations (empty list: nothing)."""
    key = pod_key(pod)
    node = str((pod.get("spec") or {}).get("nodeName") or "")
    a = annotations_of(pod)
    out: list[Violation] = []

    def bad(problem: str) -> None:
        out.append(Violation(ViolationKind.BAD_ANNOTATIONS, key, f"on {node}: {problem}"))

    for k in (ann.VGPU_NODE, ann.BIND_TIME, ann.BIND_PHASE, ann.DEVICES_ALLOCATED):
        if k not in a:
            bad(f"missing {k}")
    if out:
        return out
    if a[ann.VGPU_NODE] != node:
        bad(f"{ann.VGPU_NODE}={a[ann.VGPU_NODE]!r} but bound to {node}")
    if a[ann.BIND_PHASE] != "success":
        bad(f"{ann.BIND_PHASE}={a[ann.BIND_PHASE]!r}, want success")
    gpus = {d.id: d for d in node_gpus.get(node, ())}
    try:
        request = parse_request(pod, config or DeviceConfig())
        devices = decode_devices(a[ann.DEVICES_ALLOCATED], obj=key)
        mig = (
            decode_mig_allocations(a[ann.MIG_ALLOCATIONS], obj=key)
            if ann.MIG_ALLOCATIONS in a
            else ()
        )
        if ann.DEVICES_TO_ALLOCATE in a:
            decode_devices(a[ann.DEVICES_TO_ALLOCATE], key=ann.DEVICES_TO_ALLOCATE, obj=key)
    except InvalidInputError as e:
        bad(f"undecodable: {e}")
        return out
    if a.get(ann.DEVICES_TO_ALLOCATE, "").strip(";"):
        bad(f"{ann.DEVICES_TO_ALLOCATE} not consumed after success: {a[ann.DEVICES_TO_ALLOCATE]!r}")
    if len(devices) != len(all_containers(pod)):
        bad(f"{len(devices)} container entries for {len(all_containers(pod))} containers")
    mig_slots = {(m.container_index, m.device_index): m for m in mig}
    offered = modes(request.modes)
    for c in request.containers:
        got = devices[c.index] if c.index < len(devices) else ()
        if len(got) != c.count:
            bad(f"container {c.name}: {len(got)} devices for {c.count} requested")
        uuids = [d.uuid for d in got]
        for di, d in enumerate(got):
            gpu = gpus.get(d.uuid)
            if gpu is None:
                bad(f"device {d.uuid} is not a GPU of {node}")
                continue
            m = mig_slots.get((c.index, di))
            if d.legacy is not None:  # a HAMi <= v2.9 MIG slot: its template's memory and cores
                if gpu.mode != "mig":
                    bad(f"MIG slot {d.written_uuid} on {gpu.mode} GPU {gpu.index}")
                continue
            if m is None:
                if gpu.mode == "mig":
                    bad(f"shared device on {gpu.mode} GPU {gpu.index}")
                if d.mem != c.mem_for(gpu.devmem) or d.cores != c.cores:
                    bad(f"device {d.uuid}: {d.mem} MiB {d.cores}% for request {c}")
                if gpu.mode != "mig" and gpu.mode not in offered:
                    bad(f"asked for {_named(offered)}, got a {gpu.mode} device")
            else:
                if gpu.mode != "mig":
                    bad(f"MIG device on {gpu.mode} GPU {gpu.index}")
                if m.gpu_uuid != d.uuid:
                    bad(f"MIG allocation {m} names another GPU than device {d.uuid}")
                profile = next((p for p in gpu.mig_profiles if p.name == m.profile), None)
                if profile is None:
                    bad(f"profile {m.profile} not offered by GPU {gpu.index}")
                elif m.placement not in profile.placements:
                    bad(f"{m.profile} at {m.placement} is not a legal placement")
                elif profile.memory_mb < c.mem_for(gpu.devmem):
                    bad(f"{m.profile} ({profile.memory_mb} MiB) below {c.mem_for(gpu.devmem)} MiB")
                if m.runtime is None:
                    bad(f"MIG device {m.profile}@{m.placement} has no runtime identity")
                if "mig" not in offered:
                    bad(f"asked for {_named(offered)}, got a MIG device")
        shared = [u for di, u in enumerate(uuids) if (c.index, di) not in mig_slots]
        if len(set(shared)) != len(shared):
            bad(f"container {c.name}: one GPU twice ({shared})")
    if len(mig_slots) != len(mig):
        bad("two MIG allocations for one device slot")
    for m in mig:
        if m.container_index >= len(devices) or m.device_index >= len(devices[m.container_index]):
            bad(f"MIG allocation {m} has no device entry")
    runtimes = [m.runtime.mig_uuid for m in mig if m.runtime is not None]
    if len(set(runtimes)) != len(runtimes):
        bad(f"MIG UUID used twice: {runtimes}")
    return out


def pending_violations(pod: Obj) -> list[Violation]:
    """A GPU pod that is not bound must say why (PodScheduled=False, Unschedulable, with a
    message) and hold no allocation annotations."""
    key = pod_key(pod)
    out: list[Violation] = []
    held = sorted(k for k in annotations_of(pod) if k.startswith(INTERNAL_ANNOTATION_PREFIX))
    if held:
        out.append(
            Violation(
                ViolationKind.UNEXPLAINED_PENDING,
                key,
                f"not bound but carries allocation annotations {', '.join(held)}",
            )
        )
    cond = _scheduled_condition(pod)
    if cond is None:
        out.append(Violation(ViolationKind.UNEXPLAINED_PENDING, key, "no PodScheduled condition"))
    elif (
        cond.get("status") != "False"
        or cond.get("reason") != "Unschedulable"
        or not cond.get("message")
    ):
        out.append(
            Violation(
                ViolationKind.UNEXPLAINED_PENDING,
                key,
                f"PodScheduled status={cond.get('status')!r} reason={cond.get('reason')!r} "
                f"message={str(cond.get('message') or '')[:120]!r}; want False/Unschedulable "
                "with a message",
            )
        )
    return out


def _scheduled_condition(pod: Obj) -> Mapping[str, Any] | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if isinstance(c, Mapping) and c.get("type") == "PodScheduled":
            return c
    return None


@dataclass(frozen=True)
class _Held:
    pod: str
    allocation: MigAllocation


@dataclass
class _MigHolders:
    """Live MIG reservations by (GPU UUID, placement), and per node."""

    by_slot: dict[tuple[str, Placement], list[_Held]] = field(
        default_factory=lambda: defaultdict(list)
    )
    by_node: dict[str, list[_Held]] = field(default_factory=lambda: defaultdict(list))

    def add(self, node: str, pod: str, allocations: Iterable[MigAllocation]) -> None:
        for a in allocations:
            held = _Held(pod, a)
            self.by_slot[(a.gpu_uuid, a.placement)].append(held)
            self.by_node[node].append(held)

    def count(self) -> int:
        return sum(len(v) for v in self.by_node.values())


def mig_uuid_violations(holders: _MigHolders) -> list[Violation]:
    """One MIG UUID recorded by two reservations (of one pod or of two)."""
    seen: dict[str, list[str]] = defaultdict(list)
    for held in holders.by_node.values():
        for h in held:
            if h.allocation.runtime is not None:
                a = h.allocation
                seen[h.allocation.runtime.mig_uuid].append(
                    f"{h.pod} container {a.container_index} device {a.device_index}"
                )
    return [
        Violation(ViolationKind.MIG_IDENTITY, uuid, f"recorded by {len(who)}: {'; '.join(who)}")
        for uuid, who in sorted(seen.items())
        if len(who) > 1
    ]


def sim_violations(
    node: str,
    sim: SimNode | None,
    registered: Sequence[GpuDevice],
    held: Sequence[_Held],
) -> list[Violation]:
    """The node's live MIG reservations against its simulated hardware: every recorded
    runtime identity exists there as recorded, and every GPU instance there is reserved."""
    out: list[Violation] = []
    index = {d.id: d.index for d in registered}

    def gpu_name(uuid: str) -> str:
        return f"{node}/GPU {index[uuid]}" if uuid in index else f"{node}/{uuid}"

    if sim is None:
        for h in held:
            if h.allocation.runtime is not None:
                out.append(
                    Violation(
                        ViolationKind.MIG_IDENTITY,
                        h.pod,
                        f"records MIG device {h.allocation.runtime.mig_uuid} on {node}, which "
                        "has no simulated state file",
                    )
                )
        return out
    for uuid in sorted(set(sim.gpus) - set(index)):
        if registered or any(i.gpu_uuid == uuid for i in sim.instances):
            out.append(
                Violation(
                    ViolationKind.UNREADABLE,
                    f"{node} state file",
                    f"GPU {uuid} ({sim.gpus[uuid]}) is not registered by the node",
                )
            )
    at = {(i.gpu_uuid, i.placement): i for i in sim.instances}
    reserved = {(h.allocation.gpu_uuid, h.allocation.placement): h for h in held}
    for (uuid, placement), inst in sorted(at.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        where = f"{gpu_name(uuid)} GI {inst.gi_id} at [{placement.start},{placement.end})"
        holder = reserved.get((uuid, placement))
        if holder is None:
            cis = ", ".join(sorted(inst.compute.values())) or "no compute instance"
            out.append(
                Violation(ViolationKind.LEAKED_INSTANCE, where, f"no live pod reserves it ({cis})")
            )
            continue
        want_profile = _profile_id(sim.gpus.get(uuid, ""), holder.allocation.profile)
        if want_profile is not None and want_profile != inst.profile_id:
            out.append(
                Violation(
                    ViolationKind.MIG_IDENTITY,
                    holder.pod,
                    f"{where} has profile id {inst.profile_id}, reserved "
                    f"{holder.allocation.profile} (profile id {want_profile})",
                )
            )
    for h in held:
        a, rt = h.allocation, h.allocation.runtime
        if rt is None:
            continue
        slot = f"{gpu_name(a.gpu_uuid)} {a.profile} at [{a.placement.start},{a.placement.end})"
        found = at.get((a.gpu_uuid, a.placement))

        def mismatch(problem: str, pod: str = h.pod, slot: str = slot) -> None:
            out.append(Violation(ViolationKind.MIG_IDENTITY, pod, f"{slot}: {problem}"))

        if found is None:
            mismatch(f"records {rt.mig_uuid} but the GPU has no instance there (lost)")
        elif found.gi_id != rt.gpu_instance_id:
            mismatch(f"GPU instance id is {found.gi_id}, recorded {rt.gpu_instance_id}")
        elif rt.compute_instance_id not in found.compute:
            mismatch(f"GPU instance {found.gi_id} has no compute instance {rt.compute_instance_id}")
        elif found.compute[rt.compute_instance_id] != rt.mig_uuid:
            mismatch(
                f"MIG device is {found.compute[rt.compute_instance_id]}, recorded {rt.mig_uuid}"
            )
    return out


def _profile_id(model: str, profile: str) -> int | None:
    """The NVML profile id of ``profile`` on ``model`` (None: unknown to the catalog)."""
    try:
        m = find_model(model)
    except UnknownModelError:
        return None
    return next((p.profile_id for p in m.profiles if p.name == profile), None)


def check_objects(
    nodes: Sequence[Obj],
    pods: Sequence[Obj],
    *,
    config: DeviceConfig | None = None,
    sim_states: Mapping[str, SimNode] | None = None,
    sim_problems: Sequence[Violation] = (),
) -> CheckReport:
    """Every invariant over ``nodes`` and ``pods`` (and the simulated hardware, when
    ``sim_states`` is given: node name -> its state)."""
    config = config or DeviceConfig()
    out: list[Violation] = list(sim_problems)
    state = ClusterState(config)
    registers: dict[str, tuple[GpuDevice, ...]] = {}
    for node in nodes:
        try:
            info = parse_node(node)
        except InvalidInputError as e:
            name = str((node.get("metadata") or {}).get("name", ""))
            out.append(Violation(ViolationKind.UNREADABLE, name, str(e)))
            continue
        registers[info.name] = tuple(sorted(info.devices, key=lambda d: d.index))
        state.upsert_node_info(info)
    holders = _MigHolders()
    gpu_pods = 0
    for pod in pods:
        key = pod_key(pod)
        live = counts_against_capacity(pod)
        request: PodRequest | None = None
        # Unparseable: reported by annotation_violations when bound; explained when pending.
        with contextlib.suppress(InvalidInputError):
            request = parse_request(pod, config)
        wants_gpu = request is None or request.wants_gpu
        gpu_pods += wants_gpu
        bound_to = str((pod.get("spec") or {}).get("nodeName") or "")
        if live:
            try:
                alloc = parse_allocation(pod)
            except InvalidInputError as e:
                if not (bound_to and wants_gpu):  # else annotation_violations says it
                    out.append(Violation(ViolationKind.BAD_ANNOTATIONS, key, f"undecodable: {e}"))
            else:
                state.upsert_pod(alloc, key)
                if alloc is not None:
                    holders.add(alloc.node, key, alloc.mig)
        if not live or not wants_gpu:
            continue
        if bound_to:
            out.extend(annotation_violations(pod, registers, config))
        elif not (pod.get("metadata") or {}).get("deletionTimestamp"):
            out.extend(pending_violations(pod))
    out.extend(capacity_violations(state))
    out.extend(mig_uuid_violations(holders))
    sim_instances: int | None = None
    if sim_states is not None:
        sim_instances = sum(len(s.instances) for s in sim_states.values())
        for name in sorted(set(registers) | set(sim_states) | set(holders.by_node)):
            out.extend(
                sim_violations(
                    name,
                    sim_states.get(name),
                    registers.get(name, ()),
                    holders.by_node.get(name, []),
                )
            )
    # Keep each violation once, in a stable order (one overlap shows on every GPU row it hits).
    violations = tuple(sorted(dict.fromkeys(out)))
    return CheckReport(
        violations=violations,
        nodes=len(registers),
        pods=len(pods),
        gpu_pods=gpu_pods,
        mig_instances=holders.count(),
        sim_instances=sim_instances,
    )


# Adapters ----------------------------------------------------------------------------------


class ListingClient(Protocol):
    """The part of ``KubeClient`` the check uses."""

    def list(self, path: str) -> dict[str, Any]: ...


def check_cluster(
    api: ListingClient, *, config: DeviceConfig | None = None, sim_state: Path | None = None
) -> CheckReport:
    """List every node and pod through ``api`` and check them (with the kwok node agent's
    state dir ``sim_state``: also against the simulated hardware)."""
    sim_states: dict[str, SimNode] | None = None
    problems: list[Violation] = []
    if sim_state is not None:
        sim_states, problems = load_sim_states(sim_state)
    try:
        nodes = list(api.list("/api/v1/nodes").get("items") or [])
        pods = list(api.list("/api/v1/pods").get("items") or [])
    except (ApiError, KubeError) as e:
        raise CheckInputError(f"cannot list nodes and pods: {e}") from e
    return check_objects(nodes, pods, config=config, sim_states=sim_states, sim_problems=problems)


def add_check_command(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Register ``check`` on an ``add_subparsers()`` object."""
    p = subparsers.add_parser(
        "check",
        help="check a cluster's GPU allocations (exit 0 ok, 1 violations, 2 bad input)",
        description=__doc__.split("\n\n", 1)[0] if __doc__ else None,
    )
    p.add_argument("--kubeconfig", required=True, metavar="PATH")
    p.add_argument(
        "--sim-state",
        metavar="DIR",
        help="the kwok node agent's state dir: also check against the simulated NVML state",
    )
    p.add_argument("--config", help="device-config.yaml (default: built-in defaults)")
    p.add_argument("--output", choices=("text", "json"), default="text")
    p.set_defaults(func=_cmd_check)
    return p


def _cmd_check(args: argparse.Namespace) -> int:
    from api.kube.client import KubeClient

    config = load_config_file(args.config) if args.config else DeviceConfig()
    kubeconfig = Path(args.kubeconfig)
    if not kubeconfig.is_file():
        raise CheckInputError(f"--kubeconfig {kubeconfig}: no such file")
    with KubeClient.from_kubeconfig(kubeconfig) as api:
        report = check_cluster(
            api, config=config, sim_state=Path(args.sim_state) if args.sim_state else None
        )
    print(report.to_json() if args.output == "json" else report.summary())
    return 0 if report.ok else 1
