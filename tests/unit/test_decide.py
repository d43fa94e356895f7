from __future__ import annotations

import pytest

from api.hami.config import DeviceConfig
from api.hami.devices import DeviceAlloc, MigAllocation
from api.hami.register import GpuDevice, MigProfile, Placement
from scheduler_plugins.core.decide import decide
from scheduler_plugins.core.explain import explain
from scheduler_plugins.core.requests import PodAllocation, parse_request
from scheduler_plugins.core.rules import Reason
from scheduler_plugins.core.state import ClusterState
from tests.builders import gpu, make_pod, mig_gpu, state_with

CFG = DeviceConfig()


def _hold(state: ClusterState, key: str, node: str, *devices: tuple[str, int, int]) -> None:
    state.upsert_pod(
        PodAllocation(key, node, tuple(DeviceAlloc(u, m, c) for u, m, c in devices), ()), key
    )


def _seed_node_state() -> ClusterState:
    """Seed 004: node1 3/4 slots, 240/400 cores, 20480/32768 MiB; node2 2/4, 120, 8192."""
    state = state_with(
        node1=tuple(gpu(f"GPU-1{i}", index=i, count=1) for i in range(4)),
        node2=tuple(gpu(f"GPU-2{i}", index=i, count=1) for i in range(4)),
    )
    _hold(state, "a", "node1", ("GPU-10", 8192, 80), ("GPU-11", 8192, 80), ("GPU-12", 4096, 80))
    _hold(state, "b", "node2", ("GPU-20", 4096, 60), ("GPU-21", 4096, 60))
    return state


@pytest.mark.parametrize(("policy", "expected"), [("binpack", "node1"), ("spread", "node2")])
def test_seed_node_scores(policy: str, expected: str) -> None:
    state = _seed_node_state()
    pod = make_pod("p").gpu(1, mem=1000).annotate("hami.io/node-scheduler-policy", policy)
    d = decide(state, parse_request(pod.build(), CFG))
    scores = {name: round(float(d.score[i]), 2) for i, name in enumerate(d.layout.names)}
    assert scores == {"node1": 19.75, "node2": 10.50}
    assert d.best_node() == expected


@pytest.mark.parametrize(
    ("policy", "uuid", "score"), [("spread", "GPU-1", 9.75), ("binpack", "GPU-2", 24.75)]
)
def test_seed_gpu_scores(policy: str, uuid: str, score: float) -> None:
    state = state_with(n=(gpu("GPU-1", mem=8000), gpu("GPU-2", index=1, mem=8000)))
    _hold(state, "a", "n", ("GPU-1", 1000, 5))
    _hold(state, "b", "n", ("GPU-1", 1000, 5))
    for i in range(6):
        _hold(state, f"c{i}", "n", ("GPU-2", 1000, 20 if i == 0 else 10))
    pod = make_pod("p").gpu(1, mem=1000, cores=20).annotate("hami.io/gpu-scheduler-policy", policy)
    d = decide(state, parse_request(pod.build(), CFG))
    plan = d.plan_for("n")
    assert plan is not None
    (dev,) = plan.containers[0]
    assert dev.uuid == uuid
    assert dev.gpu_score == pytest.approx(score)


def test_seed_mig_example_two_2g_on_one_empty_a100() -> None:
    state = state_with(n=(mig_gpu("GPU-m"),))
    pod = make_pod("p").gpu(2, mem=8000).mode("mig").build()
    plan = decide(state, parse_request(pod, CFG)).plan_for("n")
    assert plan is not None
    devices = plan.containers[0]
    assert [d.mig_profile for d in devices] == ["2g.10gb", "2g.10gb"]
    assert [(d.mem, d.cores) for d in devices] == [(9984, 29), (9984, 29)]
    a, b = (d.placement for d in devices)
    assert (a is not None and b is not None and a.end <= b.start) or b.end <= a.start  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("cores", "profile"),
    [
        (0, "2g.10gb"),  # memory alone: 8000 MiB needs 2g.10gb (29 % of the cores)
        (29, "2g.10gb"),
        (30, "3g.20gb"),  # 43 %
        (43, "3g.20gb"),
        (44, "7g.40gb"),  # more than 3g's 43 %: only the whole GPU has it
        (100, "7g.40gb"),
    ],
)
def test_a_mig_profile_has_the_memory_and_the_cores_asked(cores: int, profile: str) -> None:
    """Of the profiles with enough memory the smallest with enough compute, too: a profile's
    ``core`` is the share of the GPU's compute its slices give, and a pod that asks for 50 %
    of a GPU's cores would get 29 % on a 2g.10gb."""
    state = state_with(n=(mig_gpu("GPU-m"),))
    pod = make_pod("p").gpu(1, mem=8000, cores=cores).mode("mig").build()
    plan = decide(state, parse_request(pod, CFG)).plan_for("n")
    assert plan is not None
    (dev,) = plan.containers[0]
    assert dev.mig_profile == profile


def _frag_state() -> ClusterState:
    state = state_with(n=(mig_gpu("GPU-m"),))
    state.upsert_pod(
        PodAllocation(
            "x",
            "n",
            (),
            tuple(
                MigAllocation(0, i, "GPU-m", "1g.5gb", Placement(s, 1))
                for i, s in enumerate((1, 3, 5))
            ),
        ),
        "x",
    )
    return state


def test_mig_fragmentation_is_told_from_capacity_and_lists_free_intervals() -> None:
    state = _frag_state()
    d = decide(state, parse_request(make_pod("p").gpu(1, mem=16000).mode("mig").build(), CFG))
    assert d.best_node() is None
    assert d.reasons[0] & Reason.MIG_FRAGMENTATION
    text = explain(d, state)
    assert "fragmentation" in text and "[0,1) [2,3) [4,5) [6,8)" in text


def test_mig_capacity_when_free_slices_too_few() -> None:
    state = state_with(n=(mig_gpu("GPU-m"),))
    state.upsert_pod(
        PodAllocation(
            "x",
            "n",
            (),
            (
                MigAllocation(0, 0, "GPU-m", "3g.20gb", Placement(0, 4)),
                MigAllocation(0, 1, "GPU-m", "2g.10gb", Placement(4, 2)),
            ),
        ),
        "x",
    )
    d = decide(state, parse_request(make_pod("p").gpu(1, mem=16000).mode("mig").build(), CFG))
    assert d.reasons[0] & Reason.MIG_CAPACITY and not d.reasons[0] & Reason.MIG_FRAGMENTATION


def test_mig_larger_profile_only_as_fallback() -> None:
    # On real geometries every larger placement covers a smaller one, so the fallback shows on
    # a synthetic GPU: 1g only at slice 0, 2g only at [2,4).
    one = MigProfile("1g.5gb", 4864, 15, 1, (Placement(0, 1),))
    two = MigProfile("2g.10gb", 9984, 29, 2, (Placement(2, 2),))
    dev = GpuDevice("GPU-m", 0, 10, 40960, 100, "NVIDIA A100-PCIE-40GB", 0, True, "mig", (one, two))
    state = state_with(n=(dev,))
    req = parse_request(make_pod("p").gpu(1, mem=4000).mode("mig").build(), CFG)
    plan = decide(state, req).plan_for("n")
    assert plan is not None and plan.containers[0][0].mig_profile == "1g.5gb"
    state.assume(plan.allocation())
    plan = decide(state, req).plan_for("n")
    assert plan is not None and plan.containers[0][0].mig_profile == "2g.10gb"


CASES = [
    ("memory", dict(mem=9000), Reason.MEMORY),
    ("cores", dict(mem=100, cores=90), Reason.CORES),
    ("exclusive", dict(mem=100, cores=100), Reason.EXCLUSIVE),
]


@pytest.mark.parametrize(("name", "req", "reason"), CASES, ids=[c[0] for c in CASES])
def test_hami_core_failure_reasons(name: str, req: dict[str, int], reason: Reason) -> None:
    state = state_with(n=(gpu("GPU-1", mem=8192),))
    _hold(state, "a", "n", ("GPU-1", 1000, 20))
    d = decide(state, parse_request(make_pod("p").gpu(1, **req).build(), CFG))
    assert d.best_node() is None
    assert d.reasons[0] & reason


def test_slots_exhausted() -> None:
    state = state_with(n=(gpu("GPU-1", count=2),))
    _hold(state, "a", "n", ("GPU-1", 10, 0))
    _hold(state, "b", "n", ("GPU-1", 10, 0))
    d = decide(state, parse_request(make_pod("p").gpu(1, mem=10).build(), CFG))
    assert d.reasons[0] & Reason.SLOTS


def test_n_gpus_need_n_distinct_cards_of_one_node() -> None:
    state = state_with(a=(gpu("GPU-a0"),), b=(gpu("GPU-b0"), gpu("GPU-b1", index=1)))
    d = decide(state, parse_request(make_pod("p").gpu(2, mem=100).build(), CFG))
    assert d.best_node() == "b"
    plan = d.plan_for("b")
    assert plan is not None and {x.uuid for x in plan.containers[0]} == {"GPU-b0", "GPU-b1"}
    assert d.reasons[d.node_index("a")] & Reason.TOO_FEW_GPUS


def test_selectors_mode_and_health() -> None:
    state = state_with(
        a100=(gpu("GPU-a", type="NVIDIA A100-PCIE-40GB"),),
        t4=(gpu("GPU-t", type="NVIDIA Tesla T4"),),
        sick=(gpu("GPU-s", healthy=False),),
        mig=(mig_gpu("GPU-m"),),
    )

    def feasible(pod: dict[str, object]) -> set[str]:
        d = decide(state, parse_request(pod, CFG))
        return {n for i, n in enumerate(d.layout.names) if d.feasible[i]}

    base = make_pod("p").gpu(1, mem=100)
    assert feasible(base.build()) == {"a100", "t4", "mig"}
    assert feasible(
        make_pod("p").gpu(1, mem=100).annotate("nvidia.com/use-gputype", "a100").build()
    ) == {"a100", "mig"}
    assert feasible(
        make_pod("p").gpu(1, mem=100).annotate("nvidia.com/nouse-gputype", "A100").build()
    ) == {"t4"}
    assert feasible(
        make_pod("p").gpu(1, mem=100).annotate("nvidia.com/use-gpuuuid", "GPU-t").build()
    ) == {"t4"}
    assert feasible(make_pod("p").gpu(1, mem=100).mode("hami-core").build()) == {"a100", "t4"}
    assert feasible(make_pod("p").gpu(1, mem=100).mode("mig").build()) == {"mig"}
    d = decide(state, parse_request(base.build(), CFG))
    assert d.reasons[d.node_index("sick")] & Reason.UNHEALTHY


def test_unified_pool_same_request_works_on_both_modes() -> None:
    state = state_with(mig=(mig_gpu("GPU-m"),))
    plan = decide(state, parse_request(make_pod("p").gpu(1, mem=8000).build(), CFG)).plan_for("mig")
    assert plan is not None and plan.containers[0][0].mig_profile == "2g.10gb"


def test_overlapping_reservations_fail_closed() -> None:
    state = state_with(n=(mig_gpu("GPU-m"),))
    for key in ("x", "y"):
        state.upsert_pod(
            PodAllocation(key, "n", (), (MigAllocation(0, 0, "GPU-m", "1g.5gb", Placement(0, 1)),)),
            key,
        )
    d = decide(state, parse_request(make_pod("p").gpu(1, mem=100).mode("mig").build(), CFG))
    assert d.best_node() is None and d.reasons[0] & Reason.MIG_CONFLICT
    state.remove_pod("y")
    assert (
        decide(
            state, parse_request(make_pod("p").gpu(1, mem=100).mode("mig").build(), CFG)
        ).best_node()
        == "n"
    )


def test_assume_counts_before_bind_and_forget_releases() -> None:
    state = state_with(n=(gpu("GPU-1", mem=1000),))
    req = parse_request(make_pod("p").gpu(1, mem=1000).build(), CFG)
    plan = decide(state, req).plan_for("n")
    assert plan is not None
    state.assume(plan.allocation())
    assert decide(state, req).best_node() is None
    assert state.forget("default/p")
    assert not state.forget("default/p")  # idempotent
    assert decide(state, req).best_node() == "n"


def test_multi_container_pod_counts_first_container_for_second() -> None:
    state = state_with(n=(gpu("GPU-1", mem=1000),))
    pod = make_pod("p").gpu(1, mem=600).gpu(1, mem=600).build()
    d = decide(state, parse_request(pod, CFG))
    assert d.best_node() is None
    state.upsert_node("m", (gpu("GPU-2", mem=1000), gpu("GPU-3", index=1, mem=1000)))
    plan = decide(state, parse_request(pod, CFG)).plan_for("m")
    assert plan is not None
    assert {plan.containers[0][0].uuid, plan.containers[1][0].uuid} == {"GPU-2", "GPU-3"}


def test_cpu_memory_terms_join_node_score_when_configured() -> None:
    cfg = DeviceConfig(node_score_cpu_memory=True)
    state = ClusterState(cfg)
    state.upsert_node("n", (gpu("GPU-1"),), cpu_milli=4000, memory_bytes=1000)
    state.upsert_pod(PodAllocation("a", "n", (), (), 2000, 500), "a")
    d = decide(state, parse_request(make_pod("p").gpu(1, mem=10).build(), cfg))
    assert float(d.score[0]) == pytest.approx(10.0)


def test_cluster_without_gpus_explains_instead_of_failing() -> None:
    state = state_with(a=(gpu("GPU-1"),))
    state.remove_node("a")
    state.upsert_node("b", ())
    d = decide(state, parse_request(make_pod("p").gpu(1).build(), CFG))
    assert d.best_node() is None
    assert explain(d, state) == "0/1 nodes are available: 1 node [no GPUs]: no GPU registered (b)"


def test_node_reasons_drop_the_count_header_kube_scheduler_adds_itself() -> None:
    from scheduler_plugins.core.explain import node_reasons

    state = _frag_state()
    d = decide(state, parse_request(make_pod("p").gpu(1, mem=16000).mode("mig").build(), CFG))
    text = node_reasons(explain(d, state))
    assert text.startswith("Tessera: 1 node [1× NVIDIA A100-PCIE-40GB (mig)]: MIG fragmentation")
    assert "nodes are available" not in text
