"""Where the fragmentation policy puts a pod that asks for no GPU (``core.hostonly``): nodes
without GPUs first, in kube-scheduler's order; else the GPU node whose GPUs its CPU and memory
strand least; and who places such a pod at all."""

from __future__ import annotations

from typing import Any

import pytest

from api.hami.config import DeviceConfig
from api.hami.policy import Policy
from scheduler_plugins.core import ranking
from scheduler_plugins.core.decide import decide
from scheduler_plugins.core.hostonly import place_host_only, wants_placing
from scheduler_plugins.core.requests import PodAllocation, PodRequest, parse_request
from scheduler_plugins.core.state import ClusterState
from tests.builders import gpu, make_pod

FRAG = DeviceConfig(default_node_policy=Policy.FRAGMENTATION)
GIB = 1 << 30


def cluster(cfg: DeviceConfig = FRAG, **nodes: tuple[int, int]) -> ClusterState:
    """Nodes by name: (GPUs, CPU millicores); 64 GiB memory each."""
    st = ClusterState(cfg)
    for name, (gpus, cpu) in nodes.items():
        devices = tuple(gpu(f"{name}-{i}", index=i, mem=1000) for i in range(gpus))
        st.upsert_node(name, devices, cpu_milli=cpu, memory_bytes=64 * GIB)
    return st


def cpu_pod(name: str, cpu: str, cfg: DeviceConfig = FRAG, **annotations: str) -> PodRequest:
    pod = make_pod(name).container("c").build()
    pod["spec"]["containers"][0]["resources"] = {"requests": {"cpu": cpu}}
    pod["metadata"]["annotations"].update(annotations)
    return parse_request(pod, cfg)


def gpu_pod(name: str, pct: int, cpu: str, cfg: DeviceConfig = FRAG) -> PodRequest:
    pod = make_pod(name).gpu(1, pct=pct, cores=pct).build()
    pod["spec"]["containers"][0]["resources"]["requests"] = {"cpu": cpu}
    return parse_request(pod, cfg)


def hold(st: ClusterState, node: str, cpu_milli: int, key: str) -> None:
    st.assume(PodAllocation(key, node, (), (), cpu_milli, 0))


@pytest.mark.parametrize(
    ("cfg", "annotations", "placed"),
    [
        (FRAG, {}, True),
        (DeviceConfig(), {}, False),  # binpack: kube-scheduler's, as HAMi leaves it
        (DeviceConfig(), {"hami.io/node-scheduler-policy": "fragmentation"}, True),
        (FRAG, {"hami.io/node-scheduler-policy": "spread"}, False),
    ],
)
def test_tessera_places_a_pod_without_a_gpu_only_under_fragmentation(
    cfg: DeviceConfig, annotations: dict[str, str], placed: bool
) -> None:
    assert wants_placing(cpu_pod("p", "1", cfg, **annotations)) is placed
    assert wants_placing(gpu_pod("g", 50, "1", cfg))


def test_a_node_without_gpus_comes_first() -> None:
    st = cluster(a=(2, 16000), cpu=(0, 16000))
    p = place_host_only(st, cpu_pod("p", "4"))
    assert p.names == ("cpu", "a")
    assert p.gpu_less == 1
    assert p.scores[0] == ranking.MAX_SCORE
    assert p.best() == "cpu"


def test_nodes_without_gpus_go_by_kube_schedulers_scores() -> None:
    """Least allocated first among them: the emptier node; equal ones by name."""
    st = cluster(c1=(0, 16000), c2=(0, 16000), c3=(0, 16000))
    hold(st, "c1", 8000, "x/busy")
    p = place_host_only(st, cpu_pod("p", "2"))
    assert p.names == ("c2", "c3", "c1")
    assert set(p.scores) == {ranking.MAX_SCORE}


def test_a_full_node_without_gpus_is_passed_over() -> None:
    st = cluster(a=(2, 16000), cpu=(0, 4000))
    hold(st, "cpu", 3000, "x/busy")
    p = place_host_only(st, cpu_pod("p", "2"))
    assert p.names == ("a",)
    assert p.gpu_less == 0


def test_on_gpu_nodes_the_one_it_strands_least_wins() -> None:
    """Half-GPU pods asking 4 cores each are the workload. On ``tight`` (8 cores, one GPU
    half used) a 4-core pod would leave 0 cores: the free half GPU is stranded. On ``roomy``
    it strands nothing, although binpack (fuller node first) would pick ``tight``."""
    st = cluster(tight=(1, 8000), roomy=(2, 32000))
    for i, node in enumerate(("tight", "roomy")):
        d = decide(st, gpu_pod(f"w{i}", 50, "4"))
        plan = d.plan_for(node)
        assert plan is not None
        st.assume(plan.allocation(4000, 0, uid=f"w{i}"))
    p = place_host_only(st, cpu_pod("p", "4"))
    assert p.best() == "roomy"
    assert p.scores[0] > p.scores[1]


def test_nothing_fits_anywhere() -> None:
    st = cluster(a=(1, 2000), cpu=(0, 2000))
    p = place_host_only(st, cpu_pod("p", "4"))
    assert p.names == () and p.best() is None
    assert p.offered(1) == ([], [])
    assert list(p.bare.names) == ["cpu"] and not p.bare.fits.any()


def test_offered_is_the_best_alone_unless_every_node_is_asked_for() -> None:
    st = cluster(a=(2, 16000), b=(2, 16000), cpu=(0, 16000))
    p = place_host_only(st, cpu_pod("p", "1"))
    assert p.offered(8) == (["cpu"], [ranking.MAX_SCORE])
    names, scores = p.offered(0)
    assert names == list(p.names) and len(scores) == 3


def test_a_gpu_pod_is_decides_not_this() -> None:
    with pytest.raises(ValueError, match="asks for a GPU"):
        place_host_only(cluster(a=(1, 8000)), gpu_pod("g", 50, "1"))


def test_memory_counts_too() -> None:
    st = cluster(cpu=(0, 16000), a=(1, 16000))
    pod: dict[str, Any] = make_pod("big").container("c").build()
    pod["spec"]["containers"][0]["resources"] = {"requests": {"memory": "100Gi"}}
    p = place_host_only(st, parse_request(pod, FRAG))
    assert p.names == ()


def test_only_the_best_wanted_skips_ranking_gpu_nodes_while_a_bare_node_has_room() -> None:
    st = cluster(a=(2, 16000), b=(2, 16000), cpu=(0, 16000))
    lazy = place_host_only(st, cpu_pod("p", "1"), every=False)
    assert lazy.decision is None and lazy.names == ("cpu",) and lazy.fitting == 3
    assert lazy.offered(8) == place_host_only(st, cpu_pod("p", "1")).offered(8)
    hold(st, "cpu", 16000, "x/busy")  # no room off the GPU nodes: they are ranked after all
    ranked = place_host_only(st, cpu_pod("p", "1"), every=False)
    assert ranked.decision is not None and set(ranked.names) == {"a", "b"}


@pytest.mark.parametrize("every", [True, False])
def test_a_pod_without_a_gpu_that_asks_turns_the_ties_to_the_fuller_node(every: bool) -> None:
    """Whether or not it needs a whole decision (a node without GPUs has room: the best alone
    is not one), the pod tells the fragmentation policy that Tessera places such pods."""
    st = cluster(c1=(0, 8000), g1=(2, 8000))
    assert not st.kinds.fuller_ties
    assert place_host_only(st, cpu_pod("web", "1"), every=every).best() == "c1"
    assert st.kinds.fuller_ties
