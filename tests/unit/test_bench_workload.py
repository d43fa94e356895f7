"""The benchmark's workload: deterministic mix, the two renderings of a pod, the bursts."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api.hami import keys as ann
from api.hami.config import DeviceConfig
from api.hami.policy import Policy
from scheduler_plugins.core.requests import parse_request
from scheduler_plugins.devtools.bench.workload import (
    GPU,
    GPUCORES,
    GPUMEM,
    GPUMEM_PERCENT,
    STOCK_SCHEDULER_NAME,
    BenchPod,
    Mix,
    PodKind,
    WorkloadError,
    bench_profile,
    distinct_count_burst,
    fractional_burst,
    generate,
    kind_counts,
    mig_burst,
    stock_manifest,
    tessera_manifest,
)
from scheduler_plugins.devtools.cluster.nodes import plan
from scheduler_plugins.devtools.cluster.stack import SCHEDULER_NAME

LABELS = {"tessera.dev/bench": "main"}


def test_same_seed_same_pods_other_seed_other_pods() -> None:
    assert generate(300, seed=7) == generate(300, seed=7)
    assert generate(300, seed=7) != generate(300, seed=8)


def test_names_are_numbered_and_unique() -> None:
    pods = generate(12, seed=1, prefix="w")
    assert [p.name for p in pods] == [f"w-{i:05d}" for i in range(12)]
    assert generate(0, seed=1) == ()


def test_mix_shares_are_followed() -> None:
    counts = kind_counts(generate(4000, seed=3))
    shares = {k: n / 4000 for k, n in counts.items()}
    for kind, want in (("plain", 0.10), ("fractional", 0.45), ("whole-gpu", 0.15), ("mig", 0.30)):
        assert abs(shares[kind] - want) < 0.03, (kind, shares)


def test_a_zero_weight_kind_never_appears() -> None:
    pods = generate(500, seed=1, mix=Mix(plain=0, fractional=1, whole_gpu=0, mig=1))
    assert {p.kind for p in pods} == {PodKind.FRACTIONAL, PodKind.MIG}


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("plain=1,mig=3", Mix(plain=1, fractional=0, whole_gpu=0, mig=3)),
        (" fractional = 2 , whole-gpu=0.5 ", Mix(plain=0, fractional=2, whole_gpu=0.5, mig=0)),
        ("plain=1,", Mix(plain=1, fractional=0, whole_gpu=0, mig=0)),
        ("fractional", Mix(plain=0, fractional=1, whole_gpu=0, mig=0)),
        (" default ", Mix()),
    ],
)
def test_mix_parse(text: str, want: Mix) -> None:
    assert Mix.parse(text) == want


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("gpu=1", "expected KIND=WEIGHT"),
        ("replicas", "or a named mix \\(default, fractional\\)"),
        ("plain", "expected KIND=WEIGHT"),
        ("plain=x", "is not a number"),
        ("plain=-1", "must be ≥ 0"),
        ("plain=0,mig=0", "all zero"),
        ("plain=nan", "must be ≥ 0"),
    ],
)
def test_mix_parse_rejects(text: str, problem: str) -> None:
    with pytest.raises(WorkloadError, match=problem):
        Mix.parse(text)


def test_generate_rejects_a_negative_count() -> None:
    with pytest.raises(WorkloadError, match="pod count"):
        generate(-1, seed=1)
    with pytest.raises(WorkloadError, match="replica templates"):
        generate(1, seed=1, replicas=-1)


def test_replicas_copy_a_few_templates_and_only_fractional_pods() -> None:
    mix = Mix(plain=1, fractional=3, whole_gpu=0, mig=1)
    pods = generate(400, seed=5, mix=mix, replicas=3)
    shape = lambda p: dataclasses.replace(p, name="")  # noqa: E731
    fractional = {shape(p) for p in pods if p.kind is PodKind.FRACTIONAL}
    assert len(fractional) == 3
    assert len({shape(p) for p in pods if p.kind is PodKind.MIG}) > 3
    assert generate(400, seed=5, mix=mix, replicas=3) == pods
    assert len({p.name for p in pods}) == 400


@pytest.mark.parametrize(
    ("pod", "limits", "annotations"),
    [
        (BenchPod("p", PodKind.PLAIN), {}, {}),
        (
            BenchPod(
                "f", PodKind.FRACTIONAL, gpus=2, gpumem_mib=4000, gpucores=25, mode="hami-core"
            ),
            {GPU: 2, GPUMEM: 4000, GPUCORES: 25},
            {ann.VGPU_MODE: "hami-core"},
        ),
        (
            BenchPod(
                "w", PodKind.WHOLE_GPU, gpus=1, whole_card=True, gpucores=100, mode="hami-core"
            ),
            {GPU: 1, GPUMEM_PERCENT: 100, GPUCORES: 100},
            {ann.VGPU_MODE: "hami-core"},
        ),
        (
            BenchPod("m", PodKind.MIG, gpus=1, gpumem_mib=9000, mode="mig", gpu_uuid="GPU-x"),
            {GPU: 1, GPUMEM: 9000},
            {ann.VGPU_MODE: "mig", ann.USE_GPUUUID: "GPU-x"},
        ),
    ],
)
def test_tessera_manifest_per_kind(
    pod: BenchPod, limits: dict[str, object], annotations: dict[str, str]
) -> None:
    m = tessera_manifest(pod, namespace="ns", labels=LABELS)
    (c,) = m["spec"]["containers"]
    assert m["spec"]["schedulerName"] == SCHEDULER_NAME
    assert c["resources"].get("limits", {}) == limits
    assert m["metadata"].get("annotations", {}) == annotations
    assert m["metadata"]["labels"] == LABELS
    assert m["metadata"]["namespace"] == "ns"


def test_node_policy_goes_on_gpu_pods_and_fragmentation_on_every_pod() -> None:
    gpu, plain = BenchPod("g", PodKind.MIG, gpus=1, mode="mig"), BenchPod("p", PodKind.PLAIN)
    m = tessera_manifest(gpu, namespace="ns", labels=LABELS, node_policy=Policy.SPREAD)
    assert m["metadata"]["annotations"][ann.NODE_POLICY] == "spread"
    m = tessera_manifest(plain, namespace="ns", labels=LABELS, node_policy=Policy.SPREAD)
    assert "annotations" not in m["metadata"]
    m = tessera_manifest(plain, namespace="ns", labels=LABELS, node_policy=Policy.FRAGMENTATION)
    assert m["metadata"]["annotations"][ann.NODE_POLICY] == "fragmentation"


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32), count=st.integers(1, 40))
def test_stock_pod_asks_the_same_plain_resources(seed: int, count: int) -> None:
    cfg = DeviceConfig()
    for pod in generate(count, seed=seed):
        t = tessera_manifest(pod, namespace="ns", labels=LABELS)
        s = stock_manifest(pod, namespace="ns", labels=LABELS)
        assert s["spec"]["schedulerName"] == STOCK_SCHEDULER_NAME
        assert "annotations" not in s["metadata"]
        (tc,), (sc,) = t["spec"]["containers"], s["spec"]["containers"]
        assert sc["resources"]["requests"] == tc["resources"]["requests"]
        assert set(sc["resources"].get("limits", {})) <= {GPU}
        req = parse_request(t, cfg)
        assert sc["resources"].get("limits", {}).get(GPU, 0) == sum(c.count for c in req.containers)
        assert req.wants_gpu == (pod.kind is not PodKind.PLAIN)


def test_pinned_pods_select_their_node() -> None:
    (pod,) = mig_burst("n1", count=1)
    for m in (
        tessera_manifest(pod, namespace="ns", labels=LABELS),
        stock_manifest(pod, namespace="ns", labels=LABELS),
    ):
        assert m["spec"]["nodeSelector"] == {"kubernetes.io/hostname": "n1"}


def test_bursts() -> None:
    mig = mig_burst("m", count=7)
    assert len(mig) == 7 and {(p.mode, p.gpumem_mib, p.node) for p in mig} == {("mig", 4000, "m")}
    frac = fractional_burst("c", "GPU-1", count=10)
    assert len(frac) == 10 and len({p.gpumem_mib for p in frac}) == 1
    unequal = fractional_burst("c", "GPU-1", count=10, equal=False, prefix="u")
    assert len({p.gpumem_mib for p in unequal}) == 10
    assert sum(p.gpumem_mib for p in unequal) <= 40960
    assert {(p.gpu_uuid, p.node, p.gpus) for p in frac} == {("GPU-1", "c", 1)}
    assert sum(p.gpucores for p in frac) <= 100 and sum(p.gpumem_mib for p in frac) <= 40960
    counts = distinct_count_burst("c", 8)
    assert [p.gpus for p in counts] == list(range(1, 9))
    assert len({p.name for p in (*mig, *frac, *counts)}) == 7 + 10 + 8


def test_bench_profile_has_both_a100_modes_in_a_small_cluster() -> None:
    planned = plan(bench_profile(), 9, 0)
    kinds = Counter((g.model, g.mode) for _, g in planned)
    assert kinds[("A100-PCIE-40GB", "mig")] == 1
    assert kinds[("A100-PCIE-40GB", "hami-core")] == 3
    assert sum(n for (_, mode), n in kinds.items() if mode == "mig") == 3
    assert {g.gpus_per_node for _, g in planned} == {8}
