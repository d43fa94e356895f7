"""Cluster facts of the webhook: per-node upper bounds and the list+watch store."""

from __future__ import annotations

from typing import Any

import pytest

from api.hami.keys import NODE_REGISTER
from api.hami.register import GpuDevice, encode
from scheduler_plugins.webhook.facts import (
    ClusterFacts,
    LargestGpu,
    ModeLimit,
    NodeFactsStore,
    node_capacity,
)
from tests.builders import gpu, mig_gpu, mps_gpu

A100 = "NVIDIA A100-PCIE-40GB"


@pytest.mark.parametrize(
    ("devices", "counts", "largest_mib"),
    [
        ([gpu("G0", mem=16384), gpu("G1", index=1, mem=24576)], (2, 0, 0), (24576, None, None)),
        ([mig_gpu("M0")], (0, 7, 0), (None, 40448, None)),  # 7 × 1g.5gb
        ([mig_gpu("M0"), mig_gpu("M1", index=1)], (0, 14, 0), (None, 40448, None)),
        ([mig_gpu("H0", "H100 80GB")], (0, 7, 0), (None, 81152, None)),
        ([gpu("G0", mem=8192), mig_gpu("M0", index=1)], (1, 7, 0), (8192, 40448, None)),
        # An MPS GPU: one device per container per GPU, whatever its client slots.
        (
            [mps_gpu("S0", mem=16384, count=48), mps_gpu("S1", index=1)],
            (0, 0, 2),
            (None, None, 16384),
        ),
        ([gpu("G0", mem=8192), mps_gpu("S0", index=1, mem=4096)], (1, 0, 1), (8192, None, 4096)),
    ],
    ids=["hami-core", "one MIG A100", "two MIG A100", "MIG H100", "mixed", "MPS", "hami-core+MPS"],
)
def test_node_capacity(
    devices: list[GpuDevice],
    counts: tuple[int, int, int],
    largest_mib: tuple[int | None, int | None, int | None],
) -> None:
    cap = node_capacity("n", devices)
    modes = ("hami-core", "mig", "mps")
    assert tuple(cap.devices[m] for m in modes) == counts
    largest = tuple(cap.largest[m] for m in modes)
    assert tuple(big.memory_mib if big else None for big in largest) == largest_mib


def test_mig_devices_are_capped_by_the_gpus_slots() -> None:
    m = mig_gpu("M0")
    few_slots = GpuDevice(m.id, 0, 3, m.devmem, 100, m.type, 0, True, "mig", m.mig_profiles)
    assert node_capacity("n", [few_slots]).devices["mig"] == 3


def test_cluster_facts_take_the_best_node_per_mode() -> None:
    facts = ClusterFacts.of(
        [
            node_capacity("a", [gpu(f"G{i}", index=i, mem=40960, type=A100) for i in range(4)]),
            node_capacity("b", [gpu("G0", mem=81920, type="H100"), mig_gpu("M0", index=1)]),
            node_capacity("s", [mps_gpu(f"S{i}", index=i, mem=24576, type="L4") for i in range(3)]),
        ]
    )
    assert facts.known and facts.nodes == 3
    assert facts.limit("hami-core").devices == 4
    assert facts.limit("hami-core").largest == LargestGpu(81920, "H100", "b")
    assert facts.limit("mig").devices == 7
    assert facts.limit("mps") == ModeLimit(3, LargestGpu(24576, "L4", "s"))
    assert facts.limit(None).devices == 8  # node b: one hami-core GPU + 7 MIG instances
    assert facts.limit(None).largest == LargestGpu(81920, "H100", "b")
    assert facts.limit(frozenset({"mig", "mps"})) == ModeLimit(
        7, LargestGpu(40448, f"{A100} 7g.40gb", "b")
    )
    assert facts.limit(frozenset({"hami-core", "mps"})).devices == 4
    assert facts.limit(frozenset({"hami-core", "mig", "mps"})) == facts.limit(None)


def node(name: str, devices: list[GpuDevice] | None, raw: str | None = None) -> dict[str, Any]:
    annotations = {}
    if devices is not None:
        annotations[NODE_REGISTER] = encode(devices)
    if raw is not None:
        annotations[NODE_REGISTER] = raw
    return {"metadata": {"name": name, "annotations": annotations}}


def test_store_follows_list_and_watch() -> None:
    store = NodeFactsStore()
    assert not store.facts().known and not store.synced.is_set()
    store.replace([node("a", [gpu("G0", mem=8000)]), node("plain", None)])
    assert store.synced.is_set()
    assert store.facts().nodes == 1
    store.event("ADDED", node("b", [gpu("G0", mem=16000), gpu("G1", index=1)]))
    assert store.facts().limit("hami-core").devices == 2
    assert store.facts().limit(None).largest == LargestGpu(16000, gpu("x").type, "b")
    store.event("MODIFIED", node("b", [gpu("G0", mem=4000)]))
    assert store.facts().limit(None).largest == LargestGpu(8000, gpu("x").type, "a")
    store.event("DELETED", node("a", None))
    store.event("DELETED", node("b", None))
    assert not store.facts().known


@pytest.mark.parametrize(
    "bad",
    [node("bad", None, raw="not json"), node("bad", None, raw='[{"id": "G"}]'), node("bad", [])],
    ids=["not JSON", "missing fields", "no GPUs"],
)
def test_store_ignores_nodes_it_cannot_use(bad: dict[str, Any]) -> None:
    store = NodeFactsStore()
    store.replace([bad])
    assert not store.facts().known
    store.event("MODIFIED", node("bad", [gpu("G0")]))
    assert store.facts().known
    store.event("MODIFIED", bad)  # a node that loses its annotation stops counting
    assert not store.facts().known


def test_relist_drops_nodes_gone_meanwhile() -> None:
    store = NodeFactsStore()
    store.replace([node("a", [gpu("G0")]), node("b", [gpu("G0")])])
    store.replace([node("b", [gpu("G0")])])
    assert store.facts().nodes == 1
