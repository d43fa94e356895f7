"""Cluster state and scheduling invariants under random operation and request streams.

- The incremental state equals one rebuilt from scratch (what a restart does) after every
  operation: node add / re-register / remove, pod add / update / remove on existing or missing
  nodes, assume / forget — in usage and in the decisions taken from it.
- Placing random pods one after another (on hami-core, MIG and MPS nodes) never over-commits a
  GPU (MPS: its client slots, memory and cores), never overlaps two MIG placements, only uses
  legal placements of registered, allowlisted profiles and GPUs of a mode the pod accepts, and
  never calls a pod unschedulable while a node could obviously take it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from api.hami import keys as ann
from api.hami.catalog import MODELS, GpuModel
from api.hami.config import DeviceConfig
from api.hami.devices import DeviceAlloc, MigAllocation
from api.hami.keys import MPS_MAX_CLIENTS, GpuMode
from api.hami.register import GpuDevice, MigProfile, Placement
from scheduler_plugins.core.decide import Decision, PodPlan, decide
from scheduler_plugins.core.requests import PodAllocation, PodRequest, parse_request
from scheduler_plugins.core.state import ClusterState, build_state

CONFIG = DeviceConfig()
NODE_NAMES = ("n0", "n1", "n2", "n3")
POD_KEYS = tuple(f"ns/p{i}" for i in range(8))
UUIDS = tuple(f"GPU-{i}" for i in range(6))
MIG_MODELS = tuple(m for m in MODELS if m.mig_capable and CONFIG.allowed_profiles(m.name))
PROFILE_NAMES = (*sorted({p.name for m in MODELS for p in m.profiles}), "9g.1tb")

# ----- builders ----------------------------------------------------------------------------------


def registered_profiles(model: GpuModel, config: DeviceConfig = CONFIG) -> tuple[MigProfile, ...]:
    """What the node agent registers: the allowlisted profiles NVML resolves."""
    allowed = set(config.allowed_profiles(model.name))
    return tuple(model.mig_profile(p) for p in model.profiles if p.name in allowed)


def gpu(
    uuid: str,
    index: int,
    model: GpuModel,
    mode: GpuMode,
    *,
    count: int = 10,
    health: bool = True,
    profiles: tuple[MigProfile, ...] | None = None,
) -> GpuDevice:
    if profiles is None:
        profiles = registered_profiles(model) if mode == "mig" else ()
    return GpuDevice(
        id=uuid,
        index=index,
        count=count,
        devmem=model.memory_mib,
        devcore=100,
        type=model.name,
        numa=0,
        health=health,
        mode=mode,
        mig_profiles=profiles,
    )


def pod(
    name: str, containers: list[dict[str, int]], annotations: dict[str, str] | None = None
) -> dict[str, Any]:
    """A Pod dict; each container dict may hold gpu, gpumem, pct, cores."""
    specs = []
    for i, c in enumerate(containers):
        limits: dict[str, int] = {}
        for field, resource in (
            ("gpu", "nvidia.com/gpu"),
            ("gpumem", "nvidia.com/gpumem"),
            ("pct", "nvidia.com/gpumem-percentage"),
            ("cores", "nvidia.com/gpucores"),
        ):
            if field in c:
                limits[resource] = c[field]
        specs.append({"name": f"c{i}", "resources": {"limits": limits}})
    return {
        "metadata": {"name": name, "namespace": "ns", "annotations": annotations or {}},
        "spec": {"containers": specs},
    }


# ----- strategies ----------------------------------------------------------------------------


@st.composite
def node_devices(draw: st.DrawFn) -> tuple[GpuDevice, ...]:
    n = draw(st.integers(0, 4))
    uuids = draw(st.lists(st.sampled_from(UUIDS), min_size=n, max_size=n, unique=True))
    out = []
    for i, uuid in enumerate(uuids):
        mode: GpuMode = draw(st.sampled_from(["hami-core", "mig", "mps"]))
        model = draw(st.sampled_from(MIG_MODELS if mode == "mig" else MODELS))
        profiles = None
        if mode == "mig" and draw(st.booleans()):
            # NVML-resolved but not allowlisted profiles too: the scheduler must ignore them.
            profiles = tuple(model.mig_profile(p) for p in model.profiles)
        out.append(
            gpu(
                uuid,
                i,
                model,
                mode,
                count=draw(st.integers(1, 10)),
                health=draw(st.booleans() | st.just(True)),
                profiles=profiles,
            )
        )
    return tuple(out)


@st.composite
def mig_allocs(draw: st.DrawFn) -> tuple[MigAllocation, ...]:
    slots = draw(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2)), max_size=3, unique=True))
    out = []
    for ci, di in slots:
        name = draw(st.sampled_from(PROFILE_NAMES))
        size = draw(st.integers(1, 8))
        out.append(
            MigAllocation(
                ci,
                di,
                draw(st.sampled_from(UUIDS)),
                name,
                Placement(draw(st.integers(0, 8 - size)), size),
            )
        )
    return tuple(out)


@st.composite
def pod_allocations(draw: st.DrawFn, key: str | None = None) -> PodAllocation:
    return PodAllocation(
        key=key or draw(st.sampled_from(POD_KEYS)),
        node=draw(st.sampled_from((*NODE_NAMES, "gone"))),
        devices=tuple(
            draw(
                st.lists(
                    st.builds(
                        DeviceAlloc,
                        st.sampled_from(UUIDS),
                        st.integers(0, 50_000),
                        st.integers(0, 100),
                    ),
                    max_size=3,
                )
            )
        ),
        mig=draw(mig_allocs()),
        cpu_milli=draw(st.integers(0, 4000)),
        memory_bytes=draw(st.integers(0, 2**34)),
    )


Op = tuple[Any, ...]
ops = st.one_of(
    st.tuples(
        st.just("node"),
        st.sampled_from(NODE_NAMES),
        node_devices(),
        st.integers(0, 64_000),
        st.integers(0, 2**38),
    ),
    st.tuples(st.just("rmnode"), st.sampled_from(NODE_NAMES)),
    # Many re-registrations: enough dead rows that the state compacts or grows its arrays.
    st.tuples(
        st.just("churn"),
        st.sampled_from(NODE_NAMES),
        node_devices(),
        node_devices(),
        st.integers(20, 90),
    ),
    st.tuples(st.just("pod"), st.sampled_from(POD_KEYS), st.none() | pod_allocations()),
    st.tuples(st.just("rmpod"), st.sampled_from(POD_KEYS)),
    st.tuples(st.just("assume"), pod_allocations()),
    st.tuples(st.just("forget"), st.sampled_from(POD_KEYS)),
)

# ----- incremental state == rebuilt state -------------------------------------------------------

PROBES = (
    pod("probe-core", [{"gpu": 1, "gpumem": 4000, "cores": 20}], {ann.VGPU_MODE: "hami-core"}),
    pod("probe-mps", [{"gpu": 1, "gpumem": 4000, "cores": 20}], {ann.VGPU_MODE: "mps"}),
    pod("probe-mig", [{"gpu": 1, "gpumem": 9000}], {ann.VGPU_MODE: "mig"}),
    pod(
        "probe-any",
        [{"gpu": 2, "pct": 30}, {"gpu": 1, "gpumem": 1000}],
        {ann.NODE_POLICY: "spread", ann.GPU_POLICY: "binpack"},
    ),
)
PROBE_REQUESTS = tuple(parse_request(p, CONFIG) for p in PROBES)


def decision_view(state: ClusterState, request: PodRequest) -> dict[str, Any]:
    d = decide(state, request)
    best = d.best_node()
    return {
        "verdicts": d.verdicts(),
        "best": best,
        "plan": d.plan_for(best) if best else None,
    }


@settings(max_examples=120, deadline=None)
@given(st.lists(ops, min_size=1, max_size=25))
def test_incremental_state_equals_rebuilt(steps: list[Op]) -> None:
    state = ClusterState(CONFIG)
    nodes: dict[str, tuple[tuple[GpuDevice, ...], int, int]] = {}
    pods: dict[str, tuple[PodAllocation, bool]] = {}  # key -> (allocation, assumed)
    for step in steps:
        match step:
            case ("node", name, devices, cpu, mem):
                state.upsert_node(name, devices, cpu_milli=cpu, memory_bytes=mem)
                nodes[name] = (devices, cpu, mem)
            case ("churn", name, devices_a, devices_b, times):
                for i in range(times):
                    state.upsert_node(name, devices_b if i % 2 else devices_a)
                nodes[name] = (devices_b if (times - 1) % 2 else devices_a, 0, 0)
            case ("rmnode", name):
                state.remove_node(name)
                nodes.pop(name, None)
            case ("pod", key, alloc):
                state.upsert_pod(alloc, key)
                if alloc is None:
                    pods.pop(key, None)
                else:
                    pods[key] = (alloc, False)
            case ("rmpod", key):
                state.remove_pod(key)
                pods.pop(key, None)
            case ("assume", alloc):
                state.assume(alloc)
                pods[alloc.key] = (alloc, True)
            case ("forget", key):
                assumed = key in pods and pods[key][1]
                assert state.forget(key) == assumed
                if assumed:
                    del pods[key]
        for key, (alloc, assumed) in pods.items():
            assert state.allocation(key) == alloc
            assert state.is_assumed(key) == assumed
        rebuilt = build_state(
            CONFIG,
            [(name, devs, cpu, mem) for name, (devs, cpu, mem) in nodes.items()],
            {key: alloc for key, (alloc, _) in pods.items()},
        )
        snapshot = state.usage_snapshot()
        assert snapshot == rebuilt.usage_snapshot()
        for name, (devices, _, _) in nodes.items():  # node sums agree with their GPUs
            used = [snapshot[f"{name}/{d.id}"] for d in devices]
            assert snapshot[f"{name}/gpu-sums"] == (
                sum(u[0] for u in used),
                sum(u[1] for u in used),
                sum(u[2] for u in used),
                sum(d.count for d in devices),
                sum(d.devmem for d in devices),
                sum(d.devcore for d in devices),
            )
    for request in PROBE_REQUESTS:
        assert decision_view(state, request) == decision_view(rebuilt, request)


# ----- scheduling invariants -------------------------------------------------------------------


@st.composite
def clusters(draw: st.DrawFn) -> ClusterState:
    state = ClusterState(CONFIG)
    for n in range(draw(st.integers(1, 5))):
        mode: GpuMode = draw(st.sampled_from(["hami-core", "mig", "mps"]))
        count = draw(st.integers(1, 4))
        model = draw(st.sampled_from(MIG_MODELS if mode == "mig" else MODELS))
        split = draw(st.sampled_from([10, 10, 4, 2, MPS_MAX_CLIENTS if mode == "mps" else 10]))
        devices = tuple(gpu(f"GPU-n{n}-{i}", i, model, mode, count=split) for i in range(count))
        state.upsert_node(f"node-{n}", devices, cpu_milli=32_000, memory_bytes=2**38)
    return state


@st.composite
def pod_specs(draw: st.DrawFn, i: int) -> dict[str, Any]:
    containers = []
    for _ in range(draw(st.integers(1, 2))):
        c: dict[str, int] = {"gpu": draw(st.integers(1, 3))}
        memory = draw(st.sampled_from(["abs", "pct", "none"]))
        if memory == "abs":
            c["gpumem"] = draw(st.integers(1, 50_000))
        elif memory == "pct":
            c["pct"] = draw(st.integers(1, 100))
        cores = draw(st.sampled_from([None, 0, 100]) | st.integers(0, 100))
        if cores is not None:
            c["cores"] = cores
        containers.append(c)
    annotations: dict[str, str] = {}
    mode = draw(st.sampled_from([None, "hami-core", "mig", "mps", "hami-core,mps"]))
    if mode:
        annotations[ann.VGPU_MODE] = mode
    for key in (ann.NODE_POLICY, ann.GPU_POLICY):
        policy = draw(st.sampled_from([None, "binpack", "spread"]))
        if policy:
            annotations[key] = policy
    if draw(st.integers(0, 5)) == 0:
        annotations[ann.USE_GPUTYPE] = draw(st.sampled_from(["A100", "H100", "V100", "L4"]))
    return pod(f"p{i}", containers, annotations)


@dataclass
class GpuUse:
    slots: int = 0
    mem: int = 0
    cores: int = 0


def check_plan(state: ClusterState, request: PodRequest, plan: PodPlan) -> None:
    """The plan gives every container what it asked for, on GPUs it may use."""
    entry = state.nodes[plan.node]
    devices = {d.id: d for d in entry.devices}
    assert len(plan.containers) == request.container_count
    for c in request.containers:
        planned = plan.containers[c.index]
        assert len(planned) == c.count
        core_uuids = [d.uuid for d in planned if d.mig_profile is None]
        assert len(set(core_uuids)) == len(core_uuids), f"{plan.pod}: a GPU twice in {c.name}"
        modes = {devices[d.uuid].mode for d in planned}
        assert len(modes) <= 1, f"{plan.pod}: {c.name}'s devices of several modes: {modes}"
        for d in planned:
            dev = devices[d.uuid]
            assert dev.health
            if request.use_types:
                assert any(t.upper() in dev.type.upper() for t in request.use_types)
            assert request.modes is None or dev.mode in request.modes
            if d.mig_profile is None:
                assert dev.mode in ("hami-core", "mps")
                assert (d.mem, d.cores) == (c.mem_for(dev.devmem), c.cores)
            else:
                assert dev.mode == "mig"
                prof = next(p for p in dev.mig_profiles if p.name == d.mig_profile)
                assert prof.memory_mb >= c.mem_for(dev.devmem) and prof.core >= c.cores


def check_gpu_scores(state: ClusterState, allocs: list[PodAllocation], plan: PodPlan) -> None:
    """Each device's GPU score counts the usage before the pod plus the pod's earlier devices
    (in pod order) plus itself, each exactly once."""
    devices = {d.id: d for d in state.nodes[plan.node].devices}
    use: dict[str, GpuUse] = {}

    def add(uuid: str, mem: int, cores: int) -> None:
        u = use.setdefault(uuid, GpuUse())
        u.slots, u.mem, u.cores = u.slots + 1, u.mem + mem, u.cores + cores

    def mig_usage(uuid: str, profile: str) -> tuple[int, int]:
        p = next(p for p in devices[uuid].mig_profiles if p.name == profile)
        return p.memory_mb, p.core

    for a in allocs:
        if a.node == plan.node:
            for d in a.devices:
                add(d.uuid, d.mem, d.cores)
            for m in a.mig:
                add(m.gpu_uuid, *mig_usage(m.gpu_uuid, m.profile))
    for container in plan.containers:
        for pd in container:
            dev, u = devices[pd.uuid], use.get(pd.uuid, GpuUse())
            expected = (
                (u.slots + 1) / dev.count
                + (u.cores + pd.cores) / dev.devcore
                + (u.mem + pd.mem) / dev.devmem
            ) * 10
            assert abs(pd.gpu_score - expected) < 1e-6, f"{plan.pod} {pd}: expected {expected}"
            add(pd.uuid, pd.mem, pd.cores)


def check_cluster(state: ClusterState, allocs: list[PodAllocation]) -> None:
    """No GPU over capacity; MIG placements legal and disjoint — recomputed from the pods."""
    use: dict[tuple[str, str], GpuUse] = {}
    masks: dict[tuple[str, str], int] = {}
    for a in allocs:
        devices = {d.id: d for d in state.nodes[a.node].devices}
        for d in a.devices:
            u = use.setdefault((a.node, d.uuid), GpuUse())
            u.slots, u.mem, u.cores = u.slots + 1, u.mem + d.mem, u.cores + d.cores
        for m in a.mig:
            dev = devices[m.gpu_uuid]
            assert m.profile in CONFIG.allowed_profiles(dev.type)
            prof = next(p for p in dev.mig_profiles if p.name == m.profile)
            assert m.placement in prof.placements, f"{a.key}: illegal {m}"
            mask = masks.get((a.node, m.gpu_uuid), 0)
            assert mask & m.placement.mask == 0, f"{a.key}: {m} overlaps mask {mask:b}"
            masks[(a.node, m.gpu_uuid)] = mask | m.placement.mask
            u = use.setdefault((a.node, m.gpu_uuid), GpuUse())
            u.slots, u.mem = u.slots + 1, u.mem + prof.memory_mb
    for (node, uuid), u in use.items():
        dev = next(d for d in state.nodes[node].devices if d.id == uuid)
        assert u.slots <= dev.count, f"{node}/{uuid}: {u.slots} slots > {dev.count}"
        assert u.mem <= dev.devmem, f"{node}/{uuid}: {u.mem} MiB > {dev.devmem}"
        if dev.mode != "mig":
            # MIG profile cores are rounded up (7× A100 1g = 105%): slices bound MIG GPUs.
            assert u.cores <= dev.devcore, f"{node}/{uuid}: {u.cores}% cores > {dev.devcore}"


def obviously_fits(state: ClusterState, allocs: list[PodAllocation], request: PodRequest) -> bool:
    """Oracle for single-container pods: some node has ``count`` GPUs of one shared mode
    (hami-core or MPS) that each fit alone, or one MIG GPU with a free legal placement (a
    one-device MIG request)."""
    if len(request.containers) != 1:
        return False
    c = request.containers[0]
    use: dict[str, GpuUse] = {}
    masks: dict[str, int] = {}
    for a in allocs:
        for d in a.devices:
            u = use.setdefault(d.uuid, GpuUse())
            u.slots, u.mem, u.cores = u.slots + 1, u.mem + d.mem, u.cores + d.cores
        for m in a.mig:
            masks[m.gpu_uuid] = masks.get(m.gpu_uuid, 0) | m.placement.mask
            u = use.setdefault(m.gpu_uuid, GpuUse())
            u.slots += 1
    for entry in state.nodes.values():
        fitting = {"hami-core": 0, "mps": 0}
        for dev in entry.devices:
            if request.use_types and not any(
                t.upper() in dev.type.upper() for t in request.use_types
            ):
                continue
            u = use.get(dev.id, GpuUse())
            mem = c.mem_for(dev.devmem)
            accepted = request.modes is None or dev.mode in request.modes
            if dev.mode in fitting and accepted:
                fitting[dev.mode] += (
                    u.slots < dev.count
                    and dev.devmem - u.mem >= mem
                    and dev.devcore - u.cores >= c.cores
                    and u.cores < dev.devcore
                    and (c.cores < dev.devcore or u.slots == 0)
                )
            elif dev.mode == "mig" and accepted and c.count == 1:
                allowed = set(CONFIG.allowed_profiles(dev.type))
                mask = masks.get(dev.id, 0)
                if u.slots < dev.count and any(
                    p.name in allowed
                    and p.memory_mb >= mem
                    and p.core >= c.cores
                    and any(pl.mask & mask == 0 for pl in p.placements)
                    for p in dev.mig_profiles
                ):
                    return True
        if max(fitting.values()) >= c.count:
            return True
    return False


def place(state: ClusterState, request: PodRequest) -> tuple[Decision, PodPlan | None]:
    decision = decide(state, request)
    node = decision.best_node()
    if node is None:
        return decision, None
    assert decision.feasible[decision.node_index(node)]
    plan = decision.plan_for(node)
    assert plan is not None and plan.node == node
    return decision, plan


def place_all(state: ClusterState, data: st.DataObject, node_policy: str | None) -> None:
    """Place drawn pods one after another (``node_policy``: the annotation each names, None:
    its own), checking every plan and the cluster after each; the GPU scores too where the
    pods go by HAMi's policies (the fragmentation policy scores by its own rule)."""
    allocs: list[PodAllocation] = []
    for i in range(data.draw(st.integers(1, 20), label="pods")):
        spec = data.draw(pod_specs(i), label=f"pod {i}")
        if node_policy is not None:
            spec["metadata"].setdefault("annotations", {})[ann.NODE_POLICY] = node_policy
        request = parse_request(spec, CONFIG)
        decision, plan = place(state, request)
        if plan is None:
            assert decision.feasible_count() == 0
            assert not obviously_fits(state, allocs, request), (
                f"{request.key} unschedulable but fits: {decision.verdicts()}"
            )
            continue
        check_plan(state, request, plan)
        if node_policy is None:
            check_gpu_scores(state, allocs, plan)
        alloc = plan.allocation(request.cpu_milli, request.memory_bytes)
        state.assume(alloc)
        allocs.append(alloc)
        check_cluster(state, allocs)


@settings(max_examples=80, deadline=None)
@given(clusters(), st.data())
def test_placements_never_overcommit_or_overlap(state: ClusterState, data: st.DataObject) -> None:
    place_all(state, data, None)


@settings(max_examples=60, deadline=None)
@given(clusters(), st.data())
def test_fragmentation_placements_never_overcommit_or_overlap(
    state: ClusterState, data: st.DataObject
) -> None:
    """The same under the fragmentation node policy (its own node and GPU choice)."""
    place_all(state, data, "fragmentation")


# ----- regressions found by the properties above (shrunk) ---------------------------------------

A100_40 = next(m for m in MODELS if m.name == "NVIDIA A100-PCIE-40GB")


def test_multi_device_mig_pod_counts_each_device_once() -> None:
    """Three 1g devices fit a MIG GPU with three slots; the third device's score counts two
    before it (once each), not the first container's first device twice."""
    state = ClusterState(CONFIG)
    state.upsert_node("n0", (gpu("GPU-0", 0, A100_40, "mig", count=3),))
    for user_annotations in ({ann.VGPU_MODE: "mig"}, {}):
        request = parse_request(
            pod("p", [{"gpu": 2, "gpumem": 1000}, {"gpu": 1, "gpumem": 1000}], user_annotations),
            CONFIG,
        )
        _, plan = place(state, request)
        assert plan is not None
        check_plan(state, request, plan)
        check_gpu_scores(state, [], plan)


def test_mig_devices_take_vgpu_slots() -> None:
    state = ClusterState(CONFIG)
    state.upsert_node("n0", (gpu("GPU-0", 0, A100_40, "mig", count=2),))
    request = parse_request(pod("p", [{"gpu": 3, "gpumem": 1000}], {ann.VGPU_MODE: "mig"}), CONFIG)
    decision, plan = place(state, request)
    assert plan is None and decision.feasible_count() == 0


def test_reasons_ignore_rows_a_reregistered_node_left_behind() -> None:
    healthy = gpu("GPU-0", 0, A100_40, "hami-core", count=1)
    state = ClusterState(CONFIG)
    state.upsert_node("n0", (healthy,))
    state.upsert_node("n1", (gpu("GPU-0", 0, A100_40, "hami-core", health=False),))
    state.upsert_node("n1", ())  # its unhealthy row is now dead, inside n0's segment
    pod_x = PodAllocation("ns/x", "n0", (DeviceAlloc("GPU-0", 1, 0),), ())
    state.assume(pod_x)
    rebuilt = build_state(CONFIG, [("n0", (healthy,), 0, 0), ("n1", (), 0, 0)], {"ns/x": pod_x})
    for request in PROBE_REQUESTS:
        assert decision_view(state, request) == decision_view(rebuilt, request)
