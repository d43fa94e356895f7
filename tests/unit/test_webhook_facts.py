"""Cluster facts of the webhook: per-node upper bounds and the list+watch store."""

from __future__ import annotations

from typing import Any

import pytest

from api.hami.keys import NODE_REGISTER
from api.hami.register import GpuDevice, encode
from scheduler_plugins.webhook.facts import (
    ClusterFacts,
    LargestGpu,
    NodeFactsStore,
    node_capacity,
)
from tests.builders import gpu, mig_gpu

A100 = "NVIDIA A100-PCIE-40GB"


@pytest.mark.parametrize(
    ("devices", "core", "mig", "core_mib", "mig_mib"),
    [
        ([gpu("G0", mem=16384), gpu("G1", index=1, mem=24576)], 2, 0, 24576, None),
        ([mig_gpu("M0")], 0, 7, None, 40448),  # 7 × 1g.5gb
        ([mig_gpu("M0"), mig_gpu("M1", index=1)], 0, 14, None, 40448),
        ([mig_gpu("H0", "H100 80GB")], 0, 7, None, 81152),
        ([gpu("G0", mem=8192), mig_gpu("M0", index=1)], 1, 7, 8192, 40448),
    ],
    ids=["hami-core", "one MIG A100", "two MIG A100", "MIG H100", "mixed"],
)
def test_node_capacity(
    devices: list[GpuDevice], core: int, mig: int, core_mib: int | None, mig_mib: int | None
) -> None:
    cap = node_capacity("n", devices)
    assert (cap.core_devices, cap.mig_devices) == (core, mig)
    assert (cap.core_largest.memory_mib if cap.core_largest else None) == core_mib
    assert (cap.mig_largest.memory_mib if cap.mig_largest else None) == mig_mib


def test_mig_devices_are_capped_by_the_gpus_slots() -> None:
    m = mig_gpu("M0")
    few_slots = GpuDevice(m.id, 0, 3, m.devmem, 100, m.type, 0, True, "mig", m.mig_profiles)
    assert node_capacity("n", [few_slots]).mig_devices == 3


def test_cluster_facts_take_the_best_node_per_mode() -> None:
    facts = ClusterFacts.of(
        [
            node_capacity("a", [gpu(f"G{i}", index=i, mem=40960, type=A100) for i in range(4)]),
            node_capacity("b", [gpu("G0", mem=81920, type="H100"), mig_gpu("M0", index=1)]),
        ]
    )
    assert facts.known and facts.nodes == 2
    assert facts.limit("hami-core").devices == 4
    assert facts.limit("hami-core").largest == LargestGpu(81920, "H100", "b")
    assert facts.limit("mig").devices == 7
    assert facts.limit(None).devices == 8  # node b: one hami-core GPU + 7 MIG instances
    assert facts.limit(None).largest == LargestGpu(81920, "H100", "b")


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
