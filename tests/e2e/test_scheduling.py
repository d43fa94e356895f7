"""End to end: pods for ``hami-scheduler`` through kube-scheduler + Tessera on a dev cluster.

Scenario tests (one small cluster): the seed's binpack/spread choices, the seed's dynamic-MIG
example, a fragmented MIG GPU explained, and plain pods. Burst tests (a fresh 30-node cluster
each): hundreds of mixed pods, then the allocation invariants, once undisturbed and once with
the plugin server SIGKILLed and restarted half-way. Run with ``-s`` to see the throughput.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter
from typing import Any, Final

from api.hami import keys as ann
from api.hami.devices import decode_devices, decode_mig_allocations
from scheduler_plugins.devtools.cluster import processes
from scheduler_plugins.devtools.cluster.demo import fragmenting_pod
from scheduler_plugins.devtools.cluster.stack import PLUGIN_SERVER, restart_component
from tests.e2e.harness import (
    EVENTS_PATH,
    GPU,
    GPUCORES,
    GPUMEM,
    E2ECluster,
    Obj,
    PodWatcher,
    annots,
    bind_done,
    node_of,
    pod_manifest,
    scheduled_condition,
    wait_for,
    wants_gpu,
)
from tests.e2e.invariants import annotation_violations, capacity_violations, rebuild_state

HAMI_CORE: Final = {ann.VGPU_MODE: "hami-core"}
MIG: Final = {ann.VGPU_MODE: "mig"}
SETTLE_S: Final = 180.0  # a whole burst must settle within this
QUIET_S: Final = 3.0  # ... and then stay settled this long


def _gpu_uuids(pod: Obj) -> list[str]:
    return [d.uuid for c in decode_devices(annots(pod)[ann.DEVICES_ALLOCATED]) for d in c]


# Scenario tests ------------------------------------------------------------------------------


def test_node_binpack_and_spread(small_cluster: E2ECluster) -> None:
    """The busier node takes a binpack pod, the emptier one a spread pod."""
    c = small_cluster
    busy, idle = c.nodes_in_mode("hami-core")[:2]
    pair = [busy, idle]
    c.create(
        pod_manifest(
            "node-load", {GPU: 1, GPUMEM: 20000, GPUCORES: 50}, annotations=HAMI_CORE, nodes=[busy]
        )
    )
    assert node_of(c.wait_bound("node-load")) == busy
    for name, policy, want in (("node-binpack", "binpack", busy), ("node-spread", "spread", idle)):
        c.create(
            pod_manifest(
                name,
                {GPU: 1, GPUMEM: 2000},
                annotations={**HAMI_CORE, ann.NODE_POLICY: policy},
                nodes=pair,
            )
        )
        pod = c.wait_bound(name)
        assert node_of(pod) == want, f"{name} ({policy}) went to {node_of(pod)}, want {want}"
        assert annots(pod)[ann.BIND_PHASE] == "success"


def test_gpu_binpack_and_spread(small_cluster: E2ECluster) -> None:
    """Within one node: binpack shares the busier GPU, spread takes the emptier one."""
    c = small_cluster
    node = c.nodes_in_mode("hami-core")[2]
    busy_gpu, idle_gpu = (d.id for d in c.registers[node])
    c.create(
        pod_manifest(
            "gpu-load",
            {GPU: 1, GPUMEM: 20000, GPUCORES: 30},
            annotations={**HAMI_CORE, ann.USE_GPUUUID: busy_gpu},
            nodes=[node],
        )
    )
    assert _gpu_uuids(c.wait_bound("gpu-load")) == [busy_gpu]
    for name, policy, want in (
        ("gpu-binpack", "binpack", busy_gpu),
        ("gpu-spread", "spread", idle_gpu),
    ):
        c.create(
            pod_manifest(
                name,
                {GPU: 1, GPUMEM: 4000, GPUCORES: 10},
                annotations={**HAMI_CORE, ann.GPU_POLICY: policy},
                nodes=[node],
            )
        )
        pod = c.wait_bound(name)
        assert node_of(pod) == node
        assert _gpu_uuids(pod) == [want], f"{name} ({policy}) took {_gpu_uuids(pod)}, want {want}"
        assert annots(pod)[ann.BIND_PHASE] == "success"


def test_seed_mig_example(small_cluster: E2ECluster) -> None:
    """gpu 2 × 8000 MiB on an empty A100-PCIE-40GB MIG node: two 2g.10gb, not overlapping,
    created by the node agent (runtime identities) and bound with bind-phase success."""
    c = small_cluster
    node = c.nodes_in_mode("mig")[0]
    (gpu,) = c.registers[node]
    c.create(pod_manifest("mig-seed", {GPU: 2, GPUMEM: 8000}, annotations=MIG, nodes=[node]))
    pod = c.wait_bound("mig-seed")
    a = annots(pod)
    assert node_of(pod) == node and a[ann.BIND_PHASE] == "success"
    allocs = decode_mig_allocations(a[ann.MIG_ALLOCATIONS])
    assert [m.profile for m in allocs] == ["2g.10gb", "2g.10gb"]
    assert {m.gpu_uuid for m in allocs} == {gpu.id}
    first, second = sorted(allocs, key=lambda m: m.placement.start)
    assert first.placement.end <= second.placement.start, f"overlap: {allocs}"
    runtimes = [m.runtime for m in allocs]
    assert all(r is not None and r.mig_uuid.startswith("MIG-") for r in runtimes), runtimes
    assert len({r.mig_uuid for r in runtimes if r}) == 2
    assert len({r.gpu_instance_id for r in runtimes if r}) == 2
    assert _gpu_uuids(pod) == [gpu.id, gpu.id]
    assert not annotation_violations(pod, c.registers)


def _fragmented_node(c: E2ECluster) -> tuple[str, str]:
    """The second MIG node, its GPU holding 1g.5gb at slices 1, 3, 5 (made once per module)."""
    node = c.nodes_in_mode("mig")[1]
    (gpu,) = c.registers[node]
    if not any(p["metadata"]["name"] == "small-jobs" for p in c.pods()):
        c.create(fragmenting_pod(node, gpu.id))
        assert annots(c.wait_bound("small-jobs"))[ann.BIND_PHASE] == "success"
    return node, gpu.id


FREE_INTERVALS: Final = "free slices [0,1) [2,3) [4,5) [6,8)"


def test_fragmented_mig_gpu_explained(small_cluster: E2ECluster) -> None:
    """1g.5gb at slices 1, 3, 5: a 3g (needs [0,4) or [4,8)) pinned to that GPU stays Pending
    although four slices are free; the Event and the PodScheduled condition say fragmentation
    and list the free intervals."""
    c = small_cluster
    node, gpu = _fragmented_node(c)
    c.create(
        pod_manifest(
            "needs-3g",
            {GPU: 1, GPUMEM: 16000},
            annotations={**MIG, ann.USE_GPUUUID: gpu},
            nodes=[node],
        )
    )
    why = c.wait_event("needs-3g")[-1]
    print(f"\nneeds-3g event: {why}")
    assert "fragmentation" in why and f"{node}: GPU 0 {FREE_INTERVALS}" in why, why
    pod = c.pod("needs-3g")
    assert not node_of(pod)
    cond = scheduled_condition(pod)
    assert cond is not None and cond["status"] == "False" and cond["reason"] == "Unschedulable"
    print(f"needs-3g PodScheduled: {cond.get('message')}")
    assert "fragmentation" in cond["message"] and FREE_INTERVALS in cond["message"], cond


def test_fragmented_mig_gpu_explained_under_node_affinity(small_cluster: E2ECluster) -> None:
    """The same 3g, restricted to the fragmented node by node affinity only. Another MIG node
    could take it, so Tessera's PreFilter finds nodes (and posts no Event), but none the
    affinity allows: the PodScheduled condition carries Tessera's Filter reason for the node."""
    c = small_cluster
    node, _ = _fragmented_node(c)
    name = "needs-3g-affinity"
    c.create(pod_manifest(name, {GPU: 1, GPUMEM: 16000}, annotations=MIG, nodes=[node]))
    wait_for(
        f"{name} to be found unschedulable",
        lambda: (scheduled_condition(c.pod(name)) or {}).get("status") == "False",
        30.0,
    )
    pod = c.pod(name)
    cond = scheduled_condition(pod) or {}
    print(f"\n{name} PodScheduled: {cond.get('message')}")
    assert not node_of(pod)
    message = str(cond.get("message"))
    assert "fragmentation" in message and f"{node}: GPU 0 {FREE_INTERVALS}" in message, cond


def test_replicas_on_one_node_bind_without_waiting_for_each_other(
    small_cluster: E2ECluster,
) -> None:
    """Six equal fractional replicas aimed at one node are interchangeable to its node agent:
    none waits at PreBind for another's allocation, and each ends allocated on that node."""
    c = small_cluster
    node = c.nodes_in_mode("hami-core")[2]
    log = c.settings.log_file(PLUGIN_SERVER)
    waiting = "waiting for ambiguous allocating pods"
    waits_before = log.read_text().count(waiting)
    labels = {"e2e-replicas": "yes"}
    limits = {GPU: 1, GPUMEM: 3000}
    c.create_many(
        [
            pod_manifest(f"replica-{i}", limits, annotations=HAMI_CORE, labels=labels, nodes=[node])
            for i in range(6)
        ]
    )
    try:
        pods = [c.wait_bound(f"replica-{i}") for i in range(6)]
        assert {node_of(p) for p in pods} == {node}
        assert all(annots(p)[ann.BIND_PHASE] == "success" for p in pods)
        gpus = Counter(u for p in pods for u in _gpu_uuids(p))
        assert sum(gpus.values()) == 6 and set(gpus) <= {g.id for g in c.registers[node]}
        assert log.read_text().count(waiting) == waits_before, "replicas waited at PreBind"
    finally:
        c.delete_pods("e2e-replicas=yes")


def test_mig_replicas_on_one_node_bind_without_waiting_for_each_other(
    small_cluster: E2ECluster,
) -> None:
    """Three MIG replicas of one profile aimed at one node are interchangeable to its node
    agent: none waits at PreBind for another's allocation, and each ends with its own
    instance on that node's GPU."""
    c = small_cluster
    node = c.nodes_in_mode("mig")[0]
    (gpu,) = c.registers[node]
    log = c.settings.log_file(PLUGIN_SERVER)
    waiting = "waiting for ambiguous allocating pods"
    waits_before = log.read_text().count(waiting)
    labels = {"e2e-mig-replicas": "yes"}
    c.create_many(
        [
            pod_manifest(
                f"mig-replica-{i}",
                {GPU: 1, GPUMEM: 4000},
                annotations=MIG,
                labels=labels,
                nodes=[node],
            )
            for i in range(3)
        ]
    )
    try:
        pods = [c.wait_bound(f"mig-replica-{i}") for i in range(3)]
        assert {node_of(p) for p in pods} == {node}
        assert all(annots(p)[ann.BIND_PHASE] == "success" for p in pods)
        allocs = [m for p in pods for m in decode_mig_allocations(annots(p)[ann.MIG_ALLOCATIONS])]
        assert {m.profile for m in allocs} == {"1g.5gb"} and {m.gpu_uuid for m in allocs} == {
            gpu.id
        }
        assert len({m.placement.start for m in allocs}) == 3
        assert len({m.runtime.mig_uuid for m in allocs if m.runtime is not None}) == 3
        assert all(not annotation_violations(p, c.registers) for p in pods)
        assert log.read_text().count(waiting) == waits_before, "MIG replicas waited at PreBind"
    finally:
        c.delete_pods("e2e-mig-replicas=yes")


def test_plain_pods_scheduled_by_same_profile(small_cluster: E2ECluster) -> None:
    c = small_cluster
    c.create(pod_manifest("plain"))
    c.create(pod_manifest("plain-cpu", requests={"cpu": "500m", "memory": "1Gi"}))
    for name in ("plain", "plain-cpu"):
        pod = c.wait_bound(name, timeout_s=30)
        assert node_of(pod) in c.registers
        assert not any(k.startswith(("hami.io/vgpu-", "hami.io/bind-")) for k in annots(pod))
        cond = scheduled_condition(pod)
        assert cond is not None and cond["status"] == "True"


# Burst tests ---------------------------------------------------------------------------------


def burst_pods(count: int, seed: int, label: str) -> list[Obj]:
    """A deterministic mix: 10% plain, 35% shared 1-GPU (a third without a mode: unified
    pool), 10% shared 2-GPU, 45% MIG sized for 1g.5gb / 2g.10gb / 3g.20gb."""
    rng = random.Random(seed)
    labels = {"e2e-burst": label}
    out: list[Obj] = []
    for i in range(count):
        name = f"{label}-{i:04d}"
        x = rng.random()
        if x < 0.10:
            out.append(pod_manifest(name, labels=labels))
        elif x < 0.45:
            limits = {
                GPU: 1,
                GPUMEM: rng.choice((2000, 4000, 8000, 12000)),
                GPUCORES: rng.choice((0, 0, 10, 25, 50)),
            }
            mode = HAMI_CORE if rng.random() < 2 / 3 else {}
            out.append(pod_manifest(name, limits, annotations=mode, labels=labels))
        elif x < 0.55:
            out.append(
                pod_manifest(name, {GPU: 2, GPUMEM: 6000}, annotations=HAMI_CORE, labels=labels)
            )
        else:
            mem = rng.choice((4000, 9000, 16000))
            out.append(pod_manifest(name, {GPU: 1, GPUMEM: mem}, annotations=MIG, labels=labels))
    return out


def _settle(
    c: E2ECluster, watcher: PodWatcher, names: set[str], timeout_s: float
) -> dict[str, Any]:
    """Wait until every pod is bound (node agent done) or Pending with a Tessera event, and
    stays so for ``QUIET_S`` (a reservation given up late can still let a pending pod in)."""
    state: dict[str, Any] = {"since": None, "bound": None}

    def settled() -> bool:
        pods = watcher.snapshot()
        events = c.tessera_events()
        open_ = [
            n
            for n in names
            if n not in pods or not (bind_done(pods[n]) or (not node_of(pods[n]) and n in events))
        ]
        bound = frozenset(n for n in names if n in pods and node_of(pods[n]))
        now = time.monotonic()
        if open_:
            state["since"] = None
        elif state["since"] is None or bound != state["bound"]:
            # (again) all settled: the quiet period starts. The last change may be a bind
            # phase (bound set unchanged), so "settled now" alone must start it too.
            state["since"] = now
        state.update(pods=pods, events=events, open=open_, bound=bound)
        return state["since"] is not None and now - state["since"] >= QUIET_S

    try:
        wait_for("the burst to settle", settled, timeout_s, interval_s=1.0)
    except TimeoutError as e:
        sample = sorted(state.get("open", []))[:10]
        detail = {n: _describe(state["pods"].get(n)) for n in sample}
        raise AssertionError(f"{e}: {len(state['open'])} pods unsettled, e.g. {detail}") from e
    return state


def _describe(pod: Obj | None) -> str:
    if pod is None:
        return "not seen"
    cond = scheduled_condition(pod) or {}
    return (
        f"node={node_of(pod) or '-'} phase={annots(pod).get(ann.BIND_PHASE)} "
        f"cond={cond.get('reason')}: {str(cond.get('message'))[:200]}"
    )


def _report_and_check(
    c: E2ECluster,
    what: str,
    watcher: PodWatcher,
    pods: list[Obj],
    t0: float,
    state: dict[str, Any],
    *,
    expect_pending: bool,
) -> None:
    names = {p["metadata"]["name"] for p in pods}
    listed: dict[str, Obj] = state["pods"]
    events: dict[str, list[str]] = state["events"]
    bound = [n for n in names if node_of(listed[n])]
    pending = sorted(names - set(bound))
    gpu_bound = [n for n in bound if wants_gpu(listed[n])]
    last_bound = max(watcher.bound_at[n] for n in bound)
    last_success = max((watcher.success_at.get(n, 0.0) for n in gpu_bound), default=t0)
    why = Counter(
        "fragmentation" if "fragmentation" in events[n][-1] else "capacity/other" for n in pending
    )
    print(
        f"\n{what}: {len(pods)} pods, {len(bound)} bound ({len(gpu_bound)} GPU), "
        f"{len(pending)} pending {dict(why)}; scheduled {len(bound) / (last_bound - t0):.1f} "
        f"pods/s (last bind {last_bound - t0:.1f}s after the first create), bind-phase success "
        f"for all GPU pods after {last_success - t0:.1f}s"
    )
    if pending:
        print(f"  e.g. {pending[0]}: {events[pending[0]][-1][:300]}")
    assert bound and len(bound) >= len(names) // 2, "most pods should fit this cluster"
    if expect_pending:
        assert pending, "the burst is sized so that some pods do not fit"

    # Invariants over everything the API shows (also the pods of other tests, if any).
    all_pods = c.all_pods()
    st = rebuild_state(c.all_nodes(), all_pods)
    problems = capacity_violations(st)
    for pod in all_pods:
        if node_of(pod) and wants_gpu(pod):
            problems += annotation_violations(pod, c.registers)
        elif not node_of(pod) and any(k.startswith("hami.io/vgpu-") for k in annots(pod)):
            problems.append(f"{pod['metadata']['name']}: Pending but carries {annots(pod)}")
    assert not problems, "\n".join(problems[:40])
    for n in bound:
        pod = listed[n]
        if wants_gpu(pod):
            assert annots(pod)[ann.BIND_PHASE] == "success", _describe(pod)
    for n in pending:
        cond = scheduled_condition(listed[n]) or {}
        assert cond.get("status") == "False" and cond.get("reason") == "Unschedulable", n


def test_burst_invariants(burst_cluster: E2ECluster) -> None:
    c = burst_cluster
    pods = burst_pods(500, seed=7, label="burst")
    with PodWatcher(c.api, "e2e-burst=burst") as watcher:
        t0 = time.monotonic()
        c.create_many(pods)
        print(f"\ncreated {len(pods)} pods in {time.monotonic() - t0:.1f}s")
        state = _settle(c, watcher, {p["metadata"]["name"] for p in pods}, SETTLE_S)
        _report_and_check(c, "burst", watcher, pods, t0, state, expect_pending=True)
        # Tessera's Bind writes node and devices in one Binding: no event shows a pod
        # annotated while unbound (the patch path) or a GPU pod bound without its devices.
        assert not watcher.annotated_unbound, sorted(watcher.annotated_unbound)[:10]
        assert not watcher.bound_bare, sorted(watcher.bound_bare)[:10]


def test_burst_survives_plugin_server_restart(burst_cluster: E2ECluster) -> None:
    """SIGKILL the plugin server after 150 of 300 pods, create the rest while it is down,
    restart it: nothing is double-allocated and every pod settles."""
    c = burst_cluster
    pods = burst_pods(300, seed=11, label="restart")
    with PodWatcher(c.api, "e2e-burst=restart") as watcher:
        t0 = time.monotonic()
        c.create_many(pods[:150])
        record = processes.read_record(c.settings.pid_file(PLUGIN_SERVER))
        assert record is not None and processes.is_running(record)
        os.killpg(record.pid, signal.SIGKILL)
        wait_for("plugin server gone", lambda: not processes.is_running(record), 10.0)
        killed_at = time.monotonic() - t0
        bound_at_kill = sum(1 for p in watcher.snapshot().values() if node_of(p))
        c.create_many(pods[150:])
        time.sleep(2.0)  # let the scheduler meet the dead server
        restart_component(c.settings, PLUGIN_SERVER)
        restarted = processes.read_record(c.settings.pid_file(PLUGIN_SERVER))
        assert restarted is not None and restarted.pid != record.pid
        print(
            f"\nplugin server killed {killed_at:.1f}s in (150 pods created, {bound_at_kill} "
            f"bound), restarted {time.monotonic() - t0:.1f}s in"
        )
        state = _settle(c, watcher, {p["metadata"]["name"] for p in pods}, SETTLE_S)
        _report_and_check(c, "burst with restart", watcher, pods, t0, state, expect_pending=False)


# Candidate nodes -----------------------------------------------------------------------------


def test_rejected_candidates_retry_at_once_over_every_feasible_node(
    one_candidate_cluster: E2ECluster,
) -> None:
    """kube-scheduler sees only Tessera's best node (candidateNodes: 1); there a taint Tessera
    does not weigh keeps the pod off. The shim sends the pod straight back for every feasible
    node: bound within seconds elsewhere, not Pending until kube-scheduler's next flush
    (minutes). (CPU no longer does it: Tessera's verdicts include kube-scheduler's CPU fit.)"""
    c = one_candidate_cluster
    busy, *others = c.nodes_in_mode("hami-core")
    # The busiest GPU node (binpack's best), then tainted against new pods.
    c.create(pod_manifest("load", {GPU: 1, GPUMEM: 4000}, annotations=HAMI_CORE, nodes=[busy]))
    c.wait_bound("load", timeout_s=30)
    taint = {"key": "tessera.dev/e2e-keep-off", "effect": "NoSchedule"}
    c.api.merge_patch(f"/api/v1/nodes/{busy}", {"spec": {"taints": [taint]}})
    t0 = time.monotonic()
    c.create(pod_manifest("wants-cpu", {GPU: 1, GPUMEM: 2000}, annotations=HAMI_CORE))
    pod = c.wait_bound("wants-cpu", timeout_s=30)
    assert node_of(pod) in others, node_of(pod)
    print(f"\nbound on {node_of(pod)} {time.monotonic() - t0:.1f}s after its create")
    events = c.api.list(EVENTS_PATH, field_selector="involvedObject.name=wants-cpu")
    failed = [
        str(e.get("message", ""))
        for e in events.get("items") or []
        if e.get("reason") == "FailedScheduling"
    ]
    assert any("rejected the 1 best of" in m for m in failed), failed
