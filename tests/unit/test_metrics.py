"""The plugin server's metrics: HAMi's GPU families read from the state at scrape time, the
MIG instance info series, value and label text as HAMi's Go client writes them, and the
scheduling counters and histograms."""

from __future__ import annotations

import json
import math
import threading
import time
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from api.hami import keys as ann
from api.hami.config import DeviceConfig
from api.hami.devices import DeviceAlloc, MigAllocation, RuntimeIdentity
from api.hami.register import GpuDevice, Placement, encode
from api.plugin.v1 import plugin_pb2 as pb
from scheduler_plugins.core.cache import ClusterCache
from scheduler_plugins.core.requests import PodAllocation
from scheduler_plugins.core.rules import Reason
from scheduler_plugins.server.metrics import (
    PREFILTER_OUTCOMES,
    ReservationTracker,
    SchedulingMetrics,
    StateCollector,
    exposition,
    go_float,
    go_floats,
    reason_label,
)
from tests.builders import gpu, make_pod, mig_gpu, mps_gpu, state_with

MIG_HELP = (
    "# HELP hami_node_gpu_mig_instance_info Realized MIG instance identity and scheduler placement"
)
MIG_TYPE = "# TYPE hami_node_gpu_mig_instance_info gauge"
# The seed's line (HAMi v2.10 scheduler), byte for byte.
SEED_MIG_LINE = (
    'hami_node_gpu_mig_instance_info{compute_instance_id="0",device_index="0",'
    'device_uuid="GPU-xxxxxxxx",gpu_instance_id="4",mig_uuid="MIG-xxxxxxxx",node="MIG-NODE-A",'
    'placement_size="2",placement_start="2",profile="2g.10gb",zone="vGPU"} 1'
)


# ----- helpers --------------------------------------------------------------------------------


def node_obj(name: str, *devices: GpuDevice) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "annotations": {ann.NODE_REGISTER: encode(devices)}},
        "status": {"allocatable": {"cpu": "16", "memory": "64Gi"}},
    }


def mig_entry(
    gpu_uuid: str, profile: str, start: int, size: int, runtime: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "containerIndex": 0,
        "deviceIndex": 0,
        "gpuUUID": gpu_uuid,
        "profile": profile,
        "placement": {"start": start, "size": size},
        **(runtime or {}),
    }


COMPLETE = {"migUUID": "MIG-xxxxxxxx", "gpuInstanceID": 4, "computeInstanceID": 0}


def mig_pod(
    name: str, node: str, entries: list[dict[str, Any]], phase: str = "Running"
) -> dict[str, Any]:
    return (
        make_pod(name)
        .gpu(len(entries), mem=8000)
        .mode("mig")
        .on(node, phase)
        .annotate(ann.VGPU_NODE, node)
        .mig_allocations(entries)
        .build()
    )


def core_pod(
    name: str, node: str, devices: list[tuple[str, int, int]], phase: str = "Running"
) -> dict[str, Any]:
    allocated = "".join(f"{u},NVIDIA,{m},{c}:" for u, m, c in devices) + ";"
    return (
        make_pod(name)
        .gpu(len(devices))
        .on(node, phase)
        .annotate(ann.VGPU_NODE, node)
        .annotate(ann.DEVICES_ALLOCATED, allocated)
        .build()
    )


def scrape(cache: ClusterCache, tracker: ReservationTracker | None = None) -> str:
    registry = CollectorRegistry()
    registry.register(StateCollector(cache.state, cache.lock, tracker))
    return exposition(registry).decode()


def family(text: str, name: str) -> list[str]:
    """The HELP, TYPE and sample lines of family ``name`` (sample lines sorted)."""
    head = [ln for ln in text.splitlines() if ln.startswith(f"# HELP {name} ")]
    head += [ln for ln in text.splitlines() if ln.startswith(f"# TYPE {name} ")]
    return head + sorted(ln for ln in text.splitlines() if ln.startswith(name + "{"))


def sample_value_of(text: str, name: str) -> float:
    values = [
        s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name
    ]
    assert len(values) == 1, (name, values)
    return values[0]


def samples(text: str) -> set[tuple[str, tuple[tuple[str, str], ...], float]]:
    return {
        (s.name, tuple(sorted(s.labels.items())), s.value)
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


@pytest.fixture
def cache() -> ClusterCache:
    return ClusterCache(DeviceConfig(), clock=time.monotonic)


# ----- MIG instance info ----------------------------------------------------------------------


def test_mig_instance_with_complete_identity_exports_the_seed_line(cache: ClusterCache) -> None:
    cache.apply_node(node_obj("MIG-NODE-A", mig_gpu("GPU-xxxxxxxx", "A100-PCIE-40GB")))
    cache.apply_pod(
        mig_pod("p", "MIG-NODE-A", [mig_entry("GPU-xxxxxxxx", "2g.10gb", 2, 2, COMPLETE)])
    )
    assert family(scrape(cache), "hami_node_gpu_mig_instance_info") == [
        MIG_HELP,
        MIG_TYPE,
        SEED_MIG_LINE,
    ]


def test_mig_series_appears_only_once_the_node_agent_completes_the_identity(
    cache: ClusterCache,
) -> None:
    cache.apply_node(node_obj("MIG-NODE-A", mig_gpu("GPU-xxxxxxxx", "A100-PCIE-40GB")))
    stages = [
        ("reserved, not created yet", None, []),
        (
            "partial identity: the decoder rejects it, the reservation stays as it was",
            {"migUUID": "MIG-xxxxxxxx", "gpuInstanceID": 4},
            [],
        ),
        ("complete identity", COMPLETE, [SEED_MIG_LINE]),
    ]
    for what, runtime, lines in stages:
        entry = mig_entry("GPU-xxxxxxxx", "2g.10gb", 2, 2, runtime)
        cache.apply_pod(mig_pod("p", "MIG-NODE-A", [entry]))
        text = scrape(cache)
        assert family(text, "hami_node_gpu_mig_instance_info")[2:] == lines, what
        # The reservation counts in every stage: its GPU is shared by one device.
        assert sample_value_of(text, "hami_gpu_shared_count") == 1, what


@pytest.mark.parametrize("phase", ["Succeeded", "Failed"])
def test_pods_that_no_longer_hold_capacity_do_not_export(cache: ClusterCache, phase: str) -> None:
    cache.apply_node(node_obj("MIG-NODE-A", mig_gpu("GPU-xxxxxxxx", "A100-PCIE-40GB")))
    entry = mig_entry("GPU-xxxxxxxx", "2g.10gb", 2, 2, COMPLETE)
    cache.apply_pod(mig_pod("p", "MIG-NODE-A", [entry]))
    assert SEED_MIG_LINE in scrape(cache)
    cache.apply_pod(mig_pod("p", "MIG-NODE-A", [entry], phase=phase))
    assert "hami_node_gpu_mig_instance_info" not in scrape(cache)
    cache.apply_pod(mig_pod("q", "MIG-NODE-A", [entry], phase=phase))
    assert "hami_node_gpu_mig_instance_info" not in scrape(cache)


def test_mig_instances_are_exported_per_instance_and_only_on_registered_mig_gpus(
    cache: ClusterCache,
) -> None:
    cache.apply_node(
        node_obj(
            "m",
            mig_gpu("GPU-m0", "A100-PCIE-40GB", index=0),
            mig_gpu("GPU-m1", "A100-PCIE-40GB", index=1),
        )
    )
    cache.apply_node(node_obj("c", gpu("GPU-c0")))
    rt = [{"migUUID": f"MIG-{i}", "gpuInstanceID": i, "computeInstanceID": 0} for i in range(4)]
    cache.apply_pod(
        mig_pod(
            "two",
            "m",
            [
                mig_entry("GPU-m0", "1g.5gb", 6, 1, rt[0]),
                {**mig_entry("GPU-m1", "3g.20gb", 4, 4, rt[1]), "deviceIndex": 1},
            ],
        )
    )
    cache.apply_pod(mig_pod("on-core-gpu", "c", [mig_entry("GPU-c0", "1g.5gb", 0, 1, rt[2])]))
    cache.apply_pod(mig_pod("unknown-gpu", "m", [mig_entry("GPU-gone", "1g.5gb", 0, 1, rt[3])]))
    lines = family(scrape(cache), "hami_node_gpu_mig_instance_info")[2:]
    assert lines == [
        'hami_node_gpu_mig_instance_info{compute_instance_id="0",device_index="0",'
        'device_uuid="GPU-m0",gpu_instance_id="0",mig_uuid="MIG-0",node="m",placement_size="1",'
        'placement_start="6",profile="1g.5gb",zone="vGPU"} 1',
        'hami_node_gpu_mig_instance_info{compute_instance_id="0",device_index="1",'
        'device_uuid="GPU-m1",gpu_instance_id="1",mig_uuid="MIG-1",node="m",placement_size="4",'
        'placement_start="4",profile="3g.20gb",zone="vGPU"} 1',
    ]


def test_a_changed_identity_replaces_the_series(cache: ClusterCache) -> None:
    cache.apply_node(node_obj("MIG-NODE-A", mig_gpu("GPU-xxxxxxxx", "A100-PCIE-40GB")))
    entry = mig_entry("GPU-xxxxxxxx", "2g.10gb", 2, 2, COMPLETE)
    cache.apply_pod(mig_pod("p", "MIG-NODE-A", [entry]))
    assert SEED_MIG_LINE in scrape(cache)
    recreated = {**COMPLETE, "migUUID": "MIG-yyyyyyyy", "gpuInstanceID": 5}
    cache.apply_pod(mig_pod("p", "MIG-NODE-A", [{**entry, **recreated}]))
    lines = family(scrape(cache), "hami_node_gpu_mig_instance_info")[2:]
    assert lines == [
        SEED_MIG_LINE.replace("MIG-xxxxxxxx", "MIG-yyyyyyyy").replace(
            'gpu_instance_id="4"', 'gpu_instance_id="5"'
        )
    ]
    cache.delete_pod(mig_pod("p", "MIG-NODE-A", [entry]))
    assert "hami_node_gpu_mig_instance_info" not in scrape(cache)


# ----- per-GPU gauges -------------------------------------------------------------------------

V100 = "NVIDIA Tesla V100-PCIE-32GB"
A100_40 = "NVIDIA A100-PCIE-40GB"
GPU_LABELS = f'device_index="0",device_type="{V100}",device_uuid="GPU-10",node="node1",zone="vGPU"'


def test_hami_core_pods_give_hamis_per_gpu_gauges(cache: ClusterCache) -> None:
    cache.apply_node(node_obj("node1", gpu("GPU-10", index=0), gpu("GPU-11", index=1)))
    cache.apply_pod(core_pod("a", "node1", [("GPU-10", 2000, 30)]))
    cache.apply_pod(core_pod("b", "node1", [("GPU-10", 1000, 20)]))
    text = scrape(cache)
    expected = {
        "hami_gpu_memory_limit_bytes": [
            "# HELP hami_gpu_memory_limit_bytes Device memory limit for a certain GPU",
            f"hami_gpu_memory_limit_bytes{{{GPU_LABELS}}} 8.589934592e+09",
        ],
        "hami_gpu_core_limit_ratio": [
            "# HELP hami_gpu_core_limit_ratio Device core limit for a certain GPU",
            f"hami_gpu_core_limit_ratio{{{GPU_LABELS}}} 100",
        ],
        "hami_gpu_memory_allocated_bytes": [
            "# HELP hami_gpu_memory_allocated_bytes Device memory allocated for a certain GPU",
            f'hami_gpu_memory_allocated_bytes{{device_cores="100",{GPU_LABELS}}} 3.145728e+09',
        ],
        "hami_gpu_shared_count": [
            "# HELP hami_gpu_shared_count Number of containers sharing this GPU",
            f"hami_gpu_shared_count{{{GPU_LABELS}}} 2",
        ],
        "hami_gpu_core_allocated_ratio": [
            "# HELP hami_gpu_core_allocated_ratio Device core allocated for a certain GPU",
            f"hami_gpu_core_allocated_ratio{{{GPU_LABELS}}} 50",
        ],
        "hami_node_gpu_overview": [
            "# HELP hami_node_gpu_overview GPU overview on a certain node",
            'hami_node_gpu_overview{device_cores="100",device_index="0",'
            f'device_memory_limit="8192",device_type="{V100}",device_uuid="GPU-10",node="node1",'
            'zone="vGPU"} 3.145728e+09',
        ],
        "hami_node_gpu_memory_allocated_ratio": [
            "# HELP hami_node_gpu_memory_allocated_ratio GPU Memory Allocated Percentage on a "
            "certain GPU",
            'hami_node_gpu_memory_allocated_ratio{device_index="0",device_uuid="GPU-10",'
            'node="node1",zone="vGPU"} 0.3662109375',
        ],
    }
    for name, (help_line, gpu0_line) in expected.items():
        lines = family(text, name)
        assert lines[:2] == [help_line, f"# TYPE {name} gauge"], name
        assert lines[2] == gpu0_line, name
        assert len(lines) == 4 and 'device_uuid="GPU-11"' in lines[3], name  # the idle GPU too
    assert 'hami_gpu_shared_count{device_index="1"' in text and "GPU-11" in text
    assert "hami_node_gpu_mig_instance_info" not in text


def test_gpus_that_take_no_new_work_are_exported_with_the_reason(cache: ClusterCache) -> None:
    node = node_obj("node1", *(gpu(f"GPU-1{i}", index=i) for i in range(3)))
    node["metadata"]["annotations"][ann.DEVICE_CORDON] = "GPU-11"
    cache.apply_node(node)
    cache.apply_pod(core_pod("old", "node1", [("GPU-10[1-1]", 19968, 28)]))

    def unavailable() -> set[tuple[str, str]]:
        return {
            (dict(labels)["device_uuid"], dict(labels)["reason"])
            for name, labels, value in samples(scrape(cache))
            if name == "tessera_gpu_unavailable" and value == 1.0
        }

    assert unavailable() == {("GPU-10", "legacy_mig"), ("GPU-11", "cordoned")}
    cache.apply_pod(core_pod("old", "node1", [("GPU-10[1-1]", 19968, 28)], phase="Succeeded"))
    node["metadata"]["annotations"][ann.DEVICE_CORDON] = ""
    cache.apply_node(node)
    assert unavailable() == set()
    assert "# TYPE tessera_gpu_unavailable gauge" in scrape(cache)


def test_mps_gpus_are_in_hamis_families_and_every_gpu_names_its_mode(cache: ClusterCache) -> None:
    cache.apply_node(node_obj("mps1", mps_gpu("GPU-10", count=48), mps_gpu("GPU-11", index=1)))
    cache.apply_node(node_obj("node2", gpu("GPU-20")))
    cache.apply_node(node_obj("mig1", mig_gpu("GPU-30")))
    mps_pod = core_pod("a", "mps1", [("GPU-10", 2000, 30)])
    mps_pod["metadata"]["annotations"][ann.VGPU_MODE] = "mps"
    cache.apply_pod(mps_pod)
    cache.apply_pod(core_pod("b", "mps1", [("GPU-10", 1000, 20)]))
    text = scrape(cache)
    labels = GPU_LABELS.replace("node1", "mps1")
    # HAMi's per-GPU families: an MPS GPU exactly as a hami-core one (the same lines as in
    # test_hami_core_pods_give_hamis_per_gpu_gauges).
    for line in (
        f"hami_gpu_memory_limit_bytes{{{labels}}} 8.589934592e+09",
        f'hami_gpu_memory_allocated_bytes{{device_cores="100",{labels}}} 3.145728e+09',
        f"hami_gpu_shared_count{{{labels}}} 2",
        f"hami_gpu_core_allocated_ratio{{{labels}}} 50",
    ):
        assert line in text.splitlines(), line
    container = (
        'hami_vgpu_memory_allocated_bytes{container_index="0",device_uuid="GPU-10",'
        'namespace="default",node="mps1",pod="a",zone="vGPU"} 2.097152e+09'
    )
    assert container in text.splitlines()
    assert family(text, "tessera_gpu_info") == [
        "# HELP tessera_gpu_info 1 for every registered GPU, by its mode: hami-core, mig or mps",
        "# TYPE tessera_gpu_info gauge",
        f'tessera_gpu_info{{device_index="0",device_type="{A100_40}",device_uuid="GPU-30",'
        'mode="mig",node="mig1",zone="vGPU"} 1',
        f'tessera_gpu_info{{device_index="0",device_type="{V100}",device_uuid="GPU-10",'
        'mode="mps",node="mps1",zone="vGPU"} 1',
        f'tessera_gpu_info{{device_index="0",device_type="{V100}",device_uuid="GPU-20",'
        'mode="hami-core",node="node2",zone="vGPU"} 1',
        f'tessera_gpu_info{{device_index="1",device_type="{V100}",device_uuid="GPU-11",'
        'mode="mps",node="mps1",zone="vGPU"} 1',
    ]
    # The rendered text and prometheus_client's exposition of the samples agree.
    registry = CollectorRegistry()
    registry.register(StateCollector(cache.state, cache.lock))
    assert samples(exposition(registry).decode()) == samples(generate_latest(registry).decode())


def test_an_mps_gpu_whose_daemon_is_down_is_unavailable_as_unhealthy(cache: ClusterCache) -> None:
    def unavailable() -> set[tuple[str, str]]:
        return {
            (dict(labels)["device_uuid"], dict(labels)["reason"])
            for name, labels, value in samples(scrape(cache))
            if name == "tessera_gpu_unavailable" and value == 1.0
        }

    up, down = mps_gpu("GPU-10"), mps_gpu("GPU-11", index=1, healthy=False)
    cache.apply_node(node_obj("mps1", up, down))
    assert unavailable() == {("GPU-11", "unhealthy")}
    cache.apply_node(node_obj("mps1", up, mps_gpu("GPU-11", index=1)))  # the daemon is back
    assert unavailable() == set()


def test_per_container_gauges_as_hami_writes_them(cache: ClusterCache) -> None:
    cache.apply_node(node_obj("node1", gpu("GPU-10", index=0), gpu("GPU-11", index=1)))
    cache.apply_node(node_obj("MIG-NODE-A", mig_gpu("GPU-xxxxxxxx")))
    two = core_pod("two", "node1", [("GPU-10", 2000, 30)])
    # a second container, with a device on each GPU
    two["metadata"]["annotations"][ann.DEVICES_ALLOCATED] = (
        "GPU-10,NVIDIA,2000,30:;GPU-10,NVIDIA,1000,0:GPU-11,NVIDIA,1000,0:;"
    )
    cache.apply_pod(two)
    m = mig_pod("m", "MIG-NODE-A", [mig_entry("GPU-xxxxxxxx", "2g.10gb", 2, 2)])
    m["metadata"]["annotations"][ann.DEVICES_ALLOCATED] = "GPU-xxxxxxxx,NVIDIA,9984,29:;"
    cache.apply_pod(m)
    text = scrape(cache)
    assert family(text, "hami_vgpu_memory_allocated_bytes") == [
        "# HELP hami_vgpu_memory_allocated_bytes vGPU memory allocated from a container",
        "# TYPE hami_vgpu_memory_allocated_bytes gauge",
        'hami_vgpu_memory_allocated_bytes{container_index="0",device_uuid="GPU-10",'
        'namespace="default",node="node1",pod="two",zone="vGPU"} 2.097152e+09',
        'hami_vgpu_memory_allocated_bytes{container_index="0",device_uuid="GPU-xxxxxxxx",'
        'namespace="default",node="MIG-NODE-A",pod="m",zone="vGPU"} 1.0468982784e+10',
        'hami_vgpu_memory_allocated_bytes{container_index="1",device_uuid="GPU-10",'
        'namespace="default",node="node1",pod="two",zone="vGPU"} 1.048576e+09',
        'hami_vgpu_memory_allocated_bytes{container_index="1",device_uuid="GPU-11",'
        'namespace="default",node="node1",pod="two",zone="vGPU"} 1.048576e+09',
    ]
    cores = family(text, "hami_vgpu_core_allocated_ratio")
    assert cores[0] == "# HELP hami_vgpu_core_allocated_ratio vGPU core allocated from a container"
    assert [ln.rsplit(" ", 1)[1] for ln in cores[2:]] == ["30", "29", "0", "0"]
    cache.apply_pod(core_pod("two", "node1", [("GPU-10", 2000, 30)], phase="Succeeded"))
    assert 'pod="two"' not in scrape(cache)


def test_gauges_follow_pods_and_nodes_as_they_change(cache: ClusterCache) -> None:
    cache.apply_node(node_obj("node1", gpu("GPU-10")))
    cache.apply_pod(core_pod("a", "node1", [("GPU-10", 2000, 30)]))
    assert f"hami_gpu_core_allocated_ratio{{{GPU_LABELS}}} 30\n" in scrape(cache)
    cache.apply_pod(core_pod("a", "node1", [("GPU-10", 2000, 30)], phase="Succeeded"))
    assert f"hami_gpu_core_allocated_ratio{{{GPU_LABELS}}} 0\n" in scrape(cache)
    cache.apply_node(node_obj("node2", gpu("GPU-20")))
    assert 'hami_gpu_shared_count{device_index="0",device_type' in scrape(cache)
    assert 'device_uuid="GPU-20",node="node2"' in scrape(cache)
    cache.delete_node("node1")
    text = scrape(cache)
    assert "GPU-10" not in text and "GPU-20" in text
    cache.delete_node("node2")
    assert scrape(cache) == ""  # no GPUs: no families at all, as HAMi's Go client writes


def test_label_values_are_escaped_and_the_text_parses(cache: ClusterCache) -> None:
    odd = 'Acme "GPU"\\X\nv2'
    cache.apply_node(node_obj("node1", gpu("GPU-10", type=odd)))
    text = scrape(cache)
    assert 'device_type="Acme \\"GPU\\"\\\\X\\nv2"' in text
    types = {
        s.labels["device_type"]
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if "device_type" in s.labels
    }
    assert types == {odd}


def test_columns_and_samples_give_the_same_series() -> None:
    """The rendered text and ``prometheus_client``'s exposition of the same families (built
    from ``samples``) agree, values included (up to the number format)."""
    state = state_with(
        node1=(gpu("GPU-10", index=0), gpu("GPU-11", index=1, mem=0)),
        MIG_NODE_A=(mig_gpu("GPU-xxxxxxxx", "A100-PCIE-40GB"),),
    )
    device = DeviceAlloc("GPU-10", 2500, 30)
    written = "GPU-10,NVIDIA,2500,30:;"
    state.upsert_pod(
        PodAllocation("default/a", "node1", (device,), (), devices_written=written), "default/a"
    )
    runtime = RuntimeIdentity("MIG-xxxxxxxx", 4, 0)
    mig = MigAllocation(0, 0, "GPU-xxxxxxxx", "2g.10gb", Placement(2, 2), runtime)
    state.upsert_pod(PodAllocation("default/p", "MIG-NODE-A", (), (mig,)), "default/p")
    registry = CollectorRegistry()
    registry.register(StateCollector(state, threading.RLock(), ReservationTracker(state)))
    ours = samples(exposition(registry).decode())
    theirs = samples(generate_latest(registry).decode())
    assert ours == theirs
    assert SEED_MIG_LINE in exposition(registry).decode()
    # A GPU registering no memory has no allocated-memory ratio (HAMi skips it too).
    ratio = {dict(lb)["device_uuid"] for n, lb, _ in ours if n.endswith("memory_allocated_ratio")}
    assert ratio == {"GPU-10", "GPU-xxxxxxxx"}
    assert len({dict(lb)["device_uuid"] for n, lb, _ in ours if n.endswith("shared_count")}) == 3


def test_reservations_held_count_until_the_api_shows_them(cache: ClusterCache) -> None:
    cache.apply_node(node_obj("node1", gpu("GPU-10")))
    tracker = ReservationTracker(cache.state)

    def held() -> float:
        text = scrape(cache, tracker)
        return sample_value_of(text, "tessera_scheduler_reservations_held")

    assert held() == 0
    for name in ("a", "b"):  # what Reserve does
        with cache.lock:
            device = DeviceAlloc("GPU-10", 1000, 10)
            cache.assume(PodAllocation(f"default/{name}", "node1", (device,), ()))
            tracker.reserved(f"default/{name}")
    assert held() == 2
    cache.apply_pod(core_pod("a", "node1", [("GPU-10", 1000, 10)]))  # the watch shows a bound
    assert held() == 1
    cache.forget("default/b")  # Unreserve
    assert held() == 0
    assert "tessera_scheduler_reservations_held" not in scrape(cache)  # no tracker: no family


def test_reservation_tracker_stays_bounded_without_scrapes(cache: ClusterCache) -> None:
    tracker = ReservationTracker(cache.state)
    for i in range(10 * ReservationTracker._PRUNE_AT):
        tracker.reserved(f"default/never-assumed-{i}")
    assert len(tracker._keys) < ReservationTracker._PRUNE_AT
    assert tracker.held() == 0


def test_scrape_waits_for_the_state_lock_and_releases_it(cache: ClusterCache) -> None:
    """A scrape reads the state only under its lock: while another thread holds it, the
    scrape waits; afterwards the lock is free again."""
    cache.apply_node(node_obj("node1", gpu("GPU-10")))
    collector = StateCollector(cache.state, cache.lock)
    done = threading.Event()

    def run() -> None:
        collector.snapshot()
        done.set()

    with cache.lock:
        t = threading.Thread(target=run)
        t.start()
        assert not done.wait(0.2)
    t.join(5)
    assert done.is_set()
    assert cache.lock.acquire(blocking=False)
    cache.lock.release()


# ----- number format --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0.0, "0"),
        (-0.0, "0"),
        (1.0, "1"),
        (-1.0, "-1"),
        (45.0, "45"),
        (100.0, "100"),
        (999999.0, "999999"),
        (1e6, "1e+06"),
        (-1e6, "-1e+06"),
        (1234567.5, "1.2345675e+06"),
        (34359738368.0, "3.4359738368e+10"),
        (3221225472.0, "3.221225472e+09"),
        (2.0**53, "9.007199254740992e+15"),
        (1e21, "1e+21"),
        (0.5, "0.5"),
        (0.3662109375, "0.3662109375"),
        (0.1 + 0.2, "0.30000000000000004"),
        (1e-4, "0.0001"),
        (1e-5, "1e-05"),
        (5e-324, "5e-324"),
        (1.7976931348623157e308, "1.7976931348623157e+308"),
        (math.inf, "+Inf"),
        (-math.inf, "-Inf"),
        (math.nan, "NaN"),
    ],
)
def test_go_float_writes_what_prometheus_go_client_writes(value: float, text: str) -> None:
    assert go_float(value) == text


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_go_float_reads_back_exactly(value: float) -> None:
    text = go_float(value)
    assert float(text) == value
    exponent = math.floor(math.log10(abs(value))) if value else 0
    assert ("e" in text) == (exponent < -4 or exponent >= 6), text


def test_go_floats_formats_columns_in_order() -> None:
    import numpy as np

    assert go_floats(np.array([3.0, 1e6, 3.0, 0.5])) == [b"3", b"1e+06", b"3", b"0.5"]
    assert go_floats(np.array([])) == []


# ----- scheduling metrics ---------------------------------------------------------------------


def sample_value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    assert value is not None, (name, labels)
    return value


def test_every_prefilter_code_the_server_sends_has_an_outcome() -> None:
    codes = {v for n, v in pb.PreFilterResponse.Code.items() if n != "CODE_UNSPECIFIED"}
    assert set(PREFILTER_OUTCOMES) == codes


def test_decisions_count_by_outcome_and_pending_reasons_by_kind() -> None:
    registry = CollectorRegistry()
    m = SchedulingMetrics(registry)
    for reason in Reason:  # every kind is there from the start, at 0
        assert (
            sample_value(
                registry, "tessera_scheduler_pending_reasons_total", reason=reason_label(reason)
            )
            == 0
        )
    m.observe_decision(0.002, int(Reason.MEMORY | Reason.MIG_FRAGMENTATION), cpu_seconds=0.0015)
    m.observe_decision(0.004, int(Reason.MEMORY), cpu_seconds=0.001)
    m.observe_decision(0.001)
    m.count_answer(pb.PreFilterResponse.UNSCHEDULABLE)
    m.count_answer(pb.PreFilterResponse.OK)
    m.count_answer(pb.PreFilterResponse.SKIP)
    m.count_answer(pb.PreFilterResponse.CODE_UNSPECIFIED)  # logged, not counted, no error
    pending = {
        r: sample_value(registry, "tessera_scheduler_pending_reasons_total", reason=r)
        for r in ("memory", "mig_fragmentation", "cores", "type")
    }
    assert pending == {"memory": 2, "mig_fragmentation": 1, "cores": 0, "type": 0}
    outcomes = {
        o: sample_value(registry, "tessera_scheduler_decisions_total", outcome=o)
        for o in ("schedulable", "unschedulable", "skipped", "invalid")
    }
    assert outcomes == {"schedulable": 1, "unschedulable": 1, "skipped": 1, "invalid": 0}
    assert sample_value(registry, "tessera_scheduler_decision_duration_seconds_count") == 3
    assert sample_value(registry, "tessera_scheduler_decision_duration_seconds_sum") == (
        pytest.approx(0.007)
    )
    assert (
        sample_value(registry, "tessera_scheduler_decision_duration_seconds_bucket", le="0.0025")
        == 2
    )
    assert sample_value(registry, "tessera_scheduler_decision_cpu_seconds_count") == 2
    assert sample_value(registry, "tessera_scheduler_decision_cpu_seconds_sum") == (
        pytest.approx(0.0025)
    )


def test_reason_labels_are_snake_case_names() -> None:
    assert reason_label(Reason.MIG_FRAGMENTATION) == "mig_fragmentation"
    assert reason_label(Reason.TYPE) == "type"
    assert len({reason_label(r) for r in Reason}) == len(list(Reason))


def test_exposition_keeps_prometheus_client_families_as_they_are() -> None:
    registry = CollectorRegistry()
    m = SchedulingMetrics(registry)
    m.observe_rpc("PreBind", "UNAVAILABLE", 0.3)
    text = exposition(registry).decode()
    assert text == generate_latest(registry).decode()
    assert (
        'tessera_scheduler_rpc_duration_seconds_count{code="UNAVAILABLE",method="PreBind"} 1.0'
        in text
    )
    assert json.dumps(text)  # plain text, nothing binary
