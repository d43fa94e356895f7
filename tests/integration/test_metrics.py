"""The plugin server's ``/metrics`` on a running dev cluster: a MIG pod and a hami-core pod are
scheduled by Tessera's stack (tessera-scheduler, plugin server, kwok node agent), and the
series HAMi's dashboards read appear on the real HTTP endpoint with the pods' devices."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from api.hami import keys as ann
from api.hami.devices import decode_devices, decode_mig_allocations
from api.hami.register import GpuDevice
from scheduler_plugins.devtools.cluster.stack import metrics_address
from tests.e2e.harness import (
    GPU,
    GPUCORES,
    GPUMEM,
    HERE,
    E2ECluster,
    annots,
    pod_manifest,
    tessera_cluster,
)
from tests.waiting import eventually

NODES = 5  # tests/e2e/nodes-small.yaml: three hami-core nodes, two one-GPU MIG nodes
MIB = 1 << 20


@pytest.fixture(scope="module")
def cluster(built_tools: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2ECluster]:
    state = tmp_path_factory.mktemp("it-metrics")
    with tessera_cluster(state, "it-metrics", HERE / "nodes-small.yaml", NODES) as c:
        yield c


def scrape(c: E2ECluster) -> str:
    url = f"http://{metrics_address(c.settings)}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text: str = r.read().decode()
    return text


def value_of(text: str, line_start: str) -> float:
    line = next(ln for ln in text.splitlines() if ln.startswith(line_start))
    return float(line[len(line_start) :])


def device(c: E2ECluster, node: str, uuid: str) -> GpuDevice:
    return next(d for d in c.registers[node] if d.id == uuid)


def test_scraped_endpoint_shows_the_mig_instance_and_the_hami_core_gpu(
    cluster: E2ECluster,
) -> None:
    c = cluster
    mig_node, core_node = c.nodes_in_mode("mig")[0], c.nodes_in_mode("hami-core")[0]
    c.create(
        pod_manifest(
            "metrics-mig",
            {GPU: 1, GPUMEM: 8000},
            annotations={ann.VGPU_MODE: "mig"},
            nodes=[mig_node],
        )
    )
    c.create(pod_manifest("metrics-core", {GPU: 1, GPUMEM: 3000, GPUCORES: 25}, nodes=[core_node]))

    # The node agent completes the MIG runtime identity; the scheduler then exports it.
    mig_pod = c.wait_bound("metrics-mig")
    (alloc,) = decode_mig_allocations(annots(mig_pod)[ann.MIG_ALLOCATIONS])
    assert alloc.runtime is not None, annots(mig_pod)
    rt = alloc.runtime
    mig_line = (
        f'hami_node_gpu_mig_instance_info{{compute_instance_id="{rt.compute_instance_id}",'
        f'device_index="{device(c, mig_node, alloc.gpu_uuid).index}",'
        f'device_uuid="{alloc.gpu_uuid}",gpu_instance_id="{rt.gpu_instance_id}",'
        f'mig_uuid="{rt.mig_uuid}",node="{mig_node}",placement_size="{alloc.placement.size}",'
        f'placement_start="{alloc.placement.start}",profile="{alloc.profile}",zone="vGPU"}} 1\n'
    )
    eventually(lambda: mig_line in scrape(c), timeout_s=30, what=f"series {mig_line}")

    core_pod = c.wait_bound("metrics-core")
    ((core_dev,),) = decode_devices(annots(core_pod)[ann.DEVICES_ALLOCATED])
    gpu = device(c, core_node, core_dev.uuid)
    labels = (
        f'device_index="{gpu.index}",device_type="{gpu.type}",device_uuid="{gpu.id}",'
        f'node="{core_node}",zone="vGPU"'
    )
    core_lines = [
        f"hami_gpu_shared_count{{{labels}}} 1\n",
        f"hami_gpu_core_allocated_ratio{{{labels}}} 25\n",
        f'hami_gpu_memory_allocated_bytes{{device_cores="{gpu.devcore}",{labels}}} 3.145728e+09\n',
    ]

    def with_core_lines() -> str | None:
        text = scrape(c)
        return text if all(line in text for line in core_lines) else None

    text = eventually(with_core_lines, timeout_s=30, what=f"series {core_lines}")
    assert value_of(text, f"hami_gpu_memory_limit_bytes{{{labels}}} ") == gpu.devmem * MIB

    # Both pods went through PreFilter and Reserve of this plugin server (Reserve handed
    # their annotations over: PreBind was skipped).
    assert value_of(text, 'tessera_scheduler_decisions_total{outcome="schedulable"} ') >= 2
    reserves = 'tessera_scheduler_rpc_duration_seconds_count{code="OK",method="Reserve"} '
    assert value_of(text, reserves) >= 2
    assert value_of(text, "tessera_scheduler_decision_duration_seconds_count ") >= 2

    # A deleted pod's instance is no longer reported.
    c.api.request(
        "DELETE",
        "/api/v1/namespaces/default/pods/metrics-mig",
        {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0},
    )
    eventually(lambda: mig_line not in scrape(c), timeout_s=30, what="the MIG series gone")
