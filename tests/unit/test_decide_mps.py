"""MPS GPUs, the third sharing method of the unified pool: fit and scored by hami-core's rule
(within what they register: ``count`` carries the MPS client limit), offered to pods whose
``nvidia.com/vgpu-mode`` names mps or that name no mode, refused while unhealthy (MPS control
daemon down), competing with hami-core and MIG GPUs by the same node and GPU policy scores."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import pytest

from api.hami import keys as ann
from api.hami.config import DeviceConfig
from api.hami.devices import DeviceAlloc
from api.hami.register import GpuDevice, encode
from scheduler_plugins.core.cache import ClusterCache
from scheduler_plugins.core.decide import Decision, decide
from scheduler_plugins.core.explain import explain
from scheduler_plugins.core.requests import PodAllocation, parse_request
from scheduler_plugins.core.rules import Reason
from scheduler_plugins.core.state import ClusterState
from tests.builders import PodBuilder, gpu, make_pod, mig_gpu, mps_gpu, state_with
from tests.oracle import assert_agrees

CFG = DeviceConfig()
V100 = "NVIDIA Tesla V100-PCIE-32GB"


def _hold(state: ClusterState, key: str, node: str, *devices: tuple[str, int, int]) -> None:
    state.upsert_pod(
        PodAllocation(key, node, tuple(DeviceAlloc(u, m, c) for u, m, c in devices), ()), key
    )


# ----- the fit and score rule: hami-core's, on what the MPS GPU registers ---------------------


@dataclass(frozen=True)
class Case:
    name: str
    pod: PodBuilder
    reasons: int = 0  # Reason bits; 0: fits
    count: int = 4  # registered client slots
    healthy: bool = True
    used: tuple[tuple[int, int], ...] = ((2000, 30),)  # (MiB, cores) per client already there
    device: tuple[int, int] | None = None  # (MiB, cores) of the planned device, when it fits


def pod(mode: str | None = None, **request: Any) -> PodBuilder:
    p = make_pod("p").gpu(1, **request)
    return p if mode is None else p.annotate(ann.VGPU_MODE, mode)


CASES = [
    Case("fits: memory and cores", pod(mem=6000, cores=70), device=(6000, 70)),
    Case("percentage of the GPU's memory", pod(pct=50), device=(4096, 0)),
    Case("memory short by one MiB", pod(mem=6193), Reason.MEMORY),
    Case("cores short", pod(mem=100, cores=71), Reason.CORES),
    Case(
        "every core needs an unused GPU", pod(mem=100, cores=100), Reason.CORES | Reason.EXCLUSIVE
    ),
    Case("every core, unused GPU", pod(mem=100, cores=100), used=(), device=(100, 100)),
    Case(
        "client slots full (count carries the MPS limit)",
        pod(mem=100),
        Reason.SLOTS,
        count=2,
        used=((100, 0), (100, 0)),
    ),
    Case("the last client slot", pod(mem=100), count=2, device=(100, 0)),
    Case("MPS control daemon down: unhealthy", pod(mem=100), Reason.UNHEALTHY, healthy=False),
    Case("mode mps", pod("mps", mem=100), device=(100, 0)),
    Case("mode hami-core,mps", pod("hami-core,mps", mem=100), device=(100, 0)),
    Case("no mode: the unified pool", pod(None, mem=100), device=(100, 0)),
    Case("mode hami-core", pod("hami-core", mem=100), Reason.MODE),
    Case("mode mig", pod("mig", mem=100), Reason.MODE),
    Case("mode hami-core,mig", pod("hami-core,mig", mem=100), Reason.MODE),
]


def _one_gpu_state(case: Case, device: GpuDevice) -> ClusterState:
    state = state_with(n=(device,))
    for i, (mem, cores) in enumerate(case.used):
        _hold(state, f"held-{i}", "n", (device.id, mem, cores))
    return state


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_mps_gpu_fits_and_scores_as_hami_core(case: Case) -> None:
    mps = mps_gpu("GPU-s", count=case.count, healthy=case.healthy)
    state = _one_gpu_state(case, mps)
    request = parse_request(case.pod.build(), CFG)
    d = decide(state, request)
    assert_agrees(state, request, d)
    if d.feasible[0]:
        assert not case.reasons
    else:
        assert Reason(int(d.reasons[0])) == case.reasons
    plan = d.plan_for("n")
    if case.device is None:
        assert plan is None
        return
    assert plan is not None
    (dev,) = plan.containers[0]
    assert (dev.uuid, dev.mem, dev.cores, dev.mig_profile) == ("GPU-s", *case.device, None)
    # The same GPU in hami-core mode, asked without a mode: the same verdict and GPU score.
    twin = _one_gpu_state(case, replace(mps, mode="hami-core"))
    twin_plan = decide(twin, parse_request(replace_mode(case.pod, None), CFG)).plan_for("n")
    assert twin_plan is not None
    assert twin_plan.containers[0][0].gpu_score == pytest.approx(dev.gpu_score)


def replace_mode(p: PodBuilder, mode: str | None) -> dict[str, Any]:
    obj = p.build()
    annotations = dict(obj["metadata"]["annotations"])
    annotations.pop(ann.VGPU_MODE, None)
    if mode is not None:
        annotations[ann.VGPU_MODE] = mode
    return {**obj, "metadata": {**obj["metadata"], "annotations": annotations}}


# The cases that name no mode: an MPS GPU and its hami-core twin are one rule's two inputs.
UNNAMED = [c for c in CASES if ann.VGPU_MODE not in c.pod.build()["metadata"]["annotations"]]


@pytest.mark.parametrize("case", UNNAMED, ids=[c.name for c in UNNAMED])
def test_mps_and_hami_core_twins_side_by_side_get_the_same_verdict(case: Case) -> None:
    mps = mps_gpu("GPU-s", count=case.count, healthy=case.healthy)
    core = replace(mps, id="GPU-c", mode="hami-core")
    state = state_with(mps=(mps,), core=(core,))
    for i, (mem, cores) in enumerate(case.used):
        _hold(state, f"s{i}", "mps", ("GPU-s", mem, cores))
        _hold(state, f"c{i}", "core", ("GPU-c", mem, cores))
    d = decide(state, parse_request(case.pod.build(), CFG))
    s, c = d.node_index("mps"), d.node_index("core")
    assert bool(d.feasible[s]) == bool(d.feasible[c]) == (case.device is not None)
    assert int(d.reasons[s]) == int(d.reasons[c])
    assert float(d.score[s]) == float(d.score[c])  # the node score too


# ----- the unified pool: three modes, one order -------------------------------------------------


def _three_modes() -> ClusterState:
    return state_with(
        core=tuple(gpu(f"GPU-c{i}", index=i, mem=40960) for i in range(2)),
        mig=(mig_gpu("GPU-m"),),
        mps=tuple(mps_gpu(f"GPU-s{i}", index=i, mem=40960) for i in range(2)),
    )


def _place(state: ClusterState, p: dict[str, Any]) -> tuple[Decision, str | None]:
    d = decide(state, parse_request(p, CFG))
    best = d.best_node()
    if best is not None:
        plan = d.plan_for(best)
        assert plan is not None
        state.assume(plan.allocation())
    return d, best


def test_unified_pool_spreads_a_stream_over_the_three_modes_by_node_score() -> None:
    state = _three_modes()
    placed: list[str] = []
    for i in range(12):
        p = make_pod(f"p{i}").gpu(1, mem=8000).annotate(ann.NODE_POLICY, "spread").build()
        d, best = _place(state, p)
        assert best is not None
        feasible = [s for s in range(len(d.layout.names)) if d.feasible[s]]
        lowest = min(float(d.score[s]) for s in feasible)
        assert float(d.score[d.node_index(best)]) == pytest.approx(lowest)  # spread: emptiest
        placed.append(best)
    # A 2g.10gb instance fills the one-GPU MIG node's shares fastest: it takes the fewest.
    assert {n: placed.count(n) for n in ("core", "mig", "mps")} == {"core": 5, "mig": 2, "mps": 5}
    # The MPS node's clients were written as hami-core devices.
    mps_pods = [a for a in state.allocations() if a.node == "mps"]
    assert mps_pods and all(not a.mig and len(a.devices) == 1 for a in mps_pods)


def test_unified_pool_binpacks_one_node_at_a_time_whatever_its_mode() -> None:
    state = _three_modes()
    _hold(state, "warm", "mps", ("GPU-s0", 1000, 0))  # the fullest node: binpack fills it first
    placed = []
    for i in range(6):
        p = make_pod(f"p{i}").gpu(1, mem=15000).annotate(ann.NODE_POLICY, "binpack").build()
        placed.append(_place(state, p)[1])
    # The MPS node takes four 15000 MiB clients (two on each 40960 MiB GPU), then binpack
    # moves on to the fullest of the others.
    assert placed[:4] == ["mps"] * 4
    assert placed[4] != "mps"


@pytest.mark.parametrize(("policy", "uuid"), [("spread", "GPU-s"), ("binpack", "GPU-c")])
def test_on_one_node_hami_core_and_mps_gpus_compete_by_gpu_score(policy: str, uuid: str) -> None:
    state = state_with(n=(gpu("GPU-c", mem=8192), mps_gpu("GPU-s", index=1, mem=8192)))
    _hold(state, "a", "n", ("GPU-c", 4000, 40))
    request = parse_request(
        make_pod("p").gpu(1, mem=1000).annotate(ann.GPU_POLICY, policy).build(), CFG
    )
    d = decide(state, request)
    assert_agrees(state, request, d)
    plan = d.plan_for("n")
    assert plan is not None and plan.containers[0][0].uuid == uuid


def test_a_score_tie_goes_to_hami_core_then_mig_then_mps() -> None:
    state = state_with(n=(gpu("GPU-c", index=1), mps_gpu("GPU-s", index=0)))
    plan = decide(state, parse_request(make_pod("p").gpu(1, mem=1000).build(), CFG)).plan_for("n")
    assert plan is not None and plan.containers[0][0].uuid == "GPU-c"


# ----- explanations ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("devices", "mode", "held", "message"),
    [
        (
            (gpu("GPU-c"),),
            "mps",
            0,
            f"0/1 nodes are available: 1 node [1× {V100} (hami-core)]: GPU mode does not match "
            "nvidia.com/vgpu-mode (n)",
        ),
        (
            (mps_gpu("GPU-s", healthy=False),),
            None,
            0,
            f"0/1 nodes are available: 1 node [1× {V100} (mps)]: GPU unhealthy (n)",
        ),
        (
            (mps_gpu("GPU-s", count=2),),
            "mps",
            2,
            f"0/1 nodes are available: 1 node [1× {V100} (mps)]: no free vGPU slot (n)",
        ),
        (
            (mps_gpu("GPU-s"),),
            "hami-core",
            0,
            f"0/1 nodes are available: 1 node [1× {V100} (mps)]: GPU mode does not match "
            "nvidia.com/vgpu-mode (n)",
        ),
    ],
    ids=["mps asked, no MPS GPU", "daemon down", "client slots full", "MPS GPU, hami-core asked"],
)
def test_explanations_name_the_mode(
    devices: tuple[GpuDevice, ...], mode: str | None, held: int, message: str
) -> None:
    state = state_with(n=devices)
    for i in range(held):
        _hold(state, f"h{i}", "n", (devices[0].id, 100, 0))
    d = decide(state, parse_request(pod(mode, mem=100).build(), CFG))
    assert explain(d, state) == message


# ----- health follows the node's register annotation --------------------------------------------


def _node(*devices: GpuDevice) -> dict[str, Any]:
    return {
        "metadata": {"name": "n", "annotations": {ann.NODE_REGISTER: encode(devices)}},
        "status": {"allocatable": {"cpu": "16", "memory": "64Gi"}},
    }


def test_a_health_flip_in_the_register_annotation_updates_the_state() -> None:
    cache = ClusterCache(CFG, clock=time.monotonic)
    up = (mps_gpu("GPU-s0"), mps_gpu("GPU-s1", index=1))
    request = parse_request(make_pod("p").gpu(2, mem=100).mode("mps").build(), CFG)

    def verdict() -> tuple[bool, Reason]:
        with cache.lock:
            d = decide(cache.state, request)
            return bool(d.feasible[0]), Reason(int(d.reasons[0]))

    cache.apply_node(_node(*up))
    assert verdict() == (True, Reason(0))
    cache.apply_node(_node(up[0], replace(up[1], health=False)))  # one daemon down
    assert verdict() == (False, Reason.UNHEALTHY | Reason.TOO_FEW_FITTING)
    cache.apply_node(_node(*up))  # back up
    assert verdict() == (True, Reason(0))
