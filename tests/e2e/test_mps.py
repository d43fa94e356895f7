"""End to end: MPS, the third sharing method of the unified pool, on the real apiserver + kwok.

One node of each method (``nodes-mps.yaml``: hami-core, MIG, MPS). Pods that name no mode are
spread over all three by score; ``vgpu-mode: mps`` pods land on MPS GPUs only and get
hami-core style annotations the kwok node agent allocates through its simulated MPS daemons.
A daemon that fails (crashes and cannot start again; the simulated backend's fault files,
``node_agent/README.md``) makes its GPU unhealthy in the node's register, so a pod that needs
that GPU waits, with the reason; when the daemon is back, the GPU is offered again and the
pod is placed. ``tessera check`` finds nothing wrong at the end. About 40 s on 2 cores.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest

from api.hami import keys as ann
from api.hami.devices import decode_devices
from api.hami.register import decode
from scheduler_plugins.core.rules import REASON_TEXT, Reason
from scheduler_plugins.devtools.cluster.stack import StackPaths
from tests.e2e.harness import (
    GPU,
    GPUCORES,
    GPUMEM,
    HERE,
    E2ECluster,
    annots,
    bind_done,
    node_of,
    pod_manifest,
    tessera_cluster,
)
from tests.e2e.invariants import cluster_report
from tests.waiting import eventually

CORE, MIG, MPS = "e2e-mps-0000", "e2e-mps-0001", "e2e-mps-0002"
SPREAD: Final = {ann.NODE_POLICY: "spread"}


@pytest.fixture(scope="module")
def cluster(built_tools: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2ECluster]:
    state = tmp_path_factory.mktemp("e2e-mps")
    with tessera_cluster(state, "e2e-mps", HERE / "nodes-mps.yaml", 3) as c:
        yield c


def _allocated(c: E2ECluster, name: str) -> dict[str, object]:
    """The pod once bound and allocated by the node agent (bind-phase success)."""
    pod: dict[str, object] = eventually(
        lambda: p if bind_done(p := c.pod(name)) else None,
        timeout_s=60,
        interval_s=0.2,
        what=f"pod {name} bound and allocated",
    )
    return pod


def _register_health(c: E2ECluster, node: str) -> dict[str, bool]:
    obj = c.api.get(f"/api/v1/nodes/{node}")
    return {d.id: d.health for d in decode(obj["metadata"]["annotations"][ann.NODE_REGISTER])}


def test_unified_pool_pods_spread_over_hami_core_mig_and_mps(cluster: E2ECluster) -> None:
    names = [f"pool-{i}" for i in range(6)]
    for name in names:  # one at a time: each placement counts for the next (spread)
        cluster.create(pod_manifest(name, {GPU: 1, GPUMEM: 8000}, annotations=SPREAD))
        _allocated(cluster, name)
    nodes = {name: node_of(cluster.pod(name)) for name in names}
    assert set(nodes.values()) == {CORE, MIG, MPS}, nodes
    for name in names:
        if nodes[name] == MPS:
            [[device]] = decode_devices(annots(cluster.pod(name))[ann.DEVICES_ALLOCATED])
            assert device.mem == 8000


def test_mps_pods_land_on_mps_gpus_only(cluster: E2ECluster) -> None:
    mps_gpus = {d.id for d in cluster.registers[MPS]}
    for i in range(3):
        name = f"mps-{i}"
        cluster.create(
            pod_manifest(
                name,
                {GPU: 1, GPUMEM: 4000, GPUCORES: 30},
                annotations={ann.VGPU_MODE: "mps", **SPREAD},
            )
        )
        pod = _allocated(cluster, name)
        assert node_of(pod) == MPS
        [[device]] = decode_devices(annots(pod)[ann.DEVICES_ALLOCATED])
        assert device.uuid in mps_gpus and (device.mem, device.cores) == (4000, 30)


def test_a_failed_daemon_keeps_pods_off_its_gpu_until_it_is_back(cluster: E2ECluster) -> None:
    gpu = cluster.registers[MPS][1].id
    faults = StackPaths.of(cluster.settings).agent_state / f"{MPS}.mps" / "faults"
    faults.mkdir(parents=True, exist_ok=True)
    (faults / f"{gpu}.fail_start").touch()  # restarts fail until removed
    (faults / f"{gpu}.crash").touch()  # the daemon goes down now
    eventually(
        lambda: _register_health(cluster, MPS)[gpu] is False,
        timeout_s=30,
        interval_s=0.2,
        what="the GPU reported unhealthy in the node's register",
    )

    name = "needs-that-gpu"
    cluster.create(
        pod_manifest(
            name,
            {GPU: 1, GPUMEM: 2000},
            annotations={ann.VGPU_MODE: "mps", ann.USE_GPUUUID: gpu},
        )
    )
    messages = cluster.wait_event(name)
    assert any(REASON_TEXT[Reason.UNHEALTHY] in m for m in messages), messages
    assert node_of(cluster.pod(name)) == ""

    (faults / f"{gpu}.fail_start").unlink()  # the next start succeeds
    eventually(
        lambda: _register_health(cluster, MPS)[gpu] is True,
        timeout_s=30,
        interval_s=0.2,
        what="the GPU healthy again once its daemon is back",
    )
    pod = _allocated(cluster, name)
    [[device]] = decode_devices(annots(pod)[ann.DEVICES_ALLOCATED])
    assert (node_of(pod), device.uuid) == (MPS, gpu)


def test_check_finds_no_double_allocation(cluster: E2ECluster) -> None:
    report = cluster_report(cluster)
    assert report.ok, str(report)
