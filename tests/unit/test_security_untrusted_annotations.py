"""Annotations Tessera did not write are untrusted input, in the plugin server and on nodes.

A user who can edit a pod can set ``hami.io/vgpu-*`` annotations (the admission webhook
refuses them at creation; nothing stops a later patch). Whatever they write must not crash
either component, must not make anything be handed out twice, and must not get a MIG
instance destroyed or adopted on the strength of a forged record.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest

from api.hami import keys as ann
from api.hami.config import DeviceConfig, NodeConfig
from api.hami.devices import (
    DeviceAlloc,
    MigAllocation,
    RuntimeIdentity,
    decode_mig_allocations,
    encode_devices,
    encode_mig_allocations,
)
from api.hami.register import Placement
from node_agent.allocator import AllocationRefusedError, Allocator
from node_agent.mig_manager import MigAllocationError, MigManager
from node_agent.mig_records import desired_from_pods
from scheduler_plugins.core.decide import decide
from scheduler_plugins.core.explain import explain
from scheduler_plugins.core.requests import parse_request
from tests.builders import make_pod
from tests.fuzzing import (
    AGENT_NODE,
    CONFIG,
    GB0,
    GC0,
    MIG_RESERVATION,
    VICTIMS,
    AgentNode,
    agent_node,
    cluster,
)
from tests.node_agent_fakes import make_pod as agent_pod


def _bound(name: str, node: str | None, annotations: dict[str, str]) -> dict[str, Any]:
    pod = make_pod(name).gpu(1)
    if node is not None:
        pod.on(node)
    for k, v in annotations.items():
        pod.annotate(k, v)
    return pod.build()


def _usage(snapshot: dict[str, Any], node: str) -> dict[str, Any]:
    return {k: v for k, v in snapshot.items() if k.startswith(f"{node}/")}


# ----- the plugin server's cache --------------------------------------------------------------


def test_devices_naming_another_nodes_gpu_count_on_neither_node() -> None:
    cache = cluster()
    before = cache.state.usage_snapshot()
    forged = encode_devices(((DeviceAlloc(GC0, 16000, 100),),))  # node-c's GPU
    cache.apply_pod(_bound("forger", "node-a", {ann.DEVICES_ALLOCATED: forged}))
    after = cache.state.usage_snapshot()
    assert _usage(after, "node-c") == _usage(before, "node-c")
    assert {k: v for k, v in after.items() if "cpu-mem" not in k} == {
        k: v for k, v in before.items() if "cpu-mem" not in k
    }


def test_oversized_garbage_is_unreadable_quickly_and_the_pod_keeps_its_record() -> None:
    cache = cluster()
    before = cache.state.usage_snapshot()
    victim = copy.deepcopy(VICTIMS["victim-a"])
    victim["metadata"]["annotations"][ann.DEVICES_ALLOCATED] = "GPU-a0,NVIDIA,1," * 200_000
    t0 = time.monotonic()
    cache.apply_pod(victim)
    assert time.monotonic() - t0 < 1.0
    assert cache.state.usage_snapshot() == before  # fail closed: still counts what it held


def test_forged_mig_reservation_over_a_running_one_takes_the_gpu_out_until_it_goes() -> None:
    """Two reservations of one placement: the core fails closed on that GPU (no new MIG
    device there, with a reason that says so) rather than trust either; the running pod
    keeps its placement, and the GPU schedules again once the forged record is gone."""
    cache = cluster()
    forged = MigAllocation(0, 0, GB0, "2g.10gb", Placement(0, 2), RuntimeIdentity("MIG-x", 9, 9))
    assert forged.placement == MIG_RESERVATION.placement  # victim-b's
    forger = _bound("forger", "node-b", {ann.MIG_ALLOCATIONS: encode_mig_allocations([forged])})
    cache.apply_pod(forger)
    req = parse_request(make_pod("new").gpu(1, mem=9000).mode("mig").build(), CONFIG)
    d = decide(cache.state, req)
    assert d.plan_for("node-b") is None
    assert "inconsistent MIG reservations on GPU (fail closed) (node-b)" in explain(d, cache.state)
    cache.delete_pod(forger)
    plan = decide(cache.state, req).plan_for("node-b")
    assert plan is not None
    [[device]] = plan.containers
    assert device.placement is not None and device.placement.start >= 2  # never over [0,2)


def test_unbound_pod_with_forged_node_annotation_only_ever_over_counts() -> None:
    """Before the watch shows a pod bound, its PreBind annotations are what reserves it: a
    forged one counts on the node it names (more conservative, never less), and stops
    counting when the annotations go."""
    cache = cluster()
    before = cache.state.usage_snapshot()
    claim = {
        ann.VGPU_NODE: "node-c",
        ann.DEVICES_ALLOCATED: encode_devices(((DeviceAlloc(GC0, 1000, 10),),)),
    }
    cache.apply_pod(_bound("squatter", None, claim))
    used_before = before["node-c/GPU-c0"][1]
    assert cache.state.usage_snapshot()["node-c/GPU-c0"][1] == used_before + 1000
    cache.apply_pod(_bound("squatter", None, {}))
    assert cache.state.usage_snapshot() == before


# ----- the node agent ------------------------------------------------------------------------


def _victim_untouched(node: AgentNode) -> None:
    assert node.kube.annotations(node.victim_path) == node.victim_annotations
    assert all(path != node.victim_path for path, _, _ in node.kube.patches)
    assert node.victim_instance_intact()


def test_allocation_naming_another_nodes_gpu_is_refused_and_marked_failed() -> None:
    node = agent_node("hami-core")
    path = node.kube.add_pod(
        agent_pod("forger", devices=[[("GPU-ffffffff-0000-0000-0000-000000000000", 1000, 10)]])
    )
    with pytest.raises(AllocationRefusedError, match=f"is not on node {AGENT_NODE}"):
        node.allocator.allocate([[f"{node.gpus[0]}-3"]])
    assert node.kube.annotations(path)[ann.BIND_PHASE] == "failed"
    _victim_untouched(node)


@pytest.mark.parametrize(
    ("uid", "container"), [("..", "c0"), ("uid-1", ".."), ("a/b", "c0"), ("uid-1", "x/../../etc")]
)
def test_uid_or_container_name_cannot_steer_the_writable_host_mount(
    uid: str, container: str
) -> None:
    node = agent_node("hami-core")
    pod = agent_pod(
        "forger", devices=[[(node.gpus[1], 1000, 10)]], containers=[{"name": container}]
    )
    pod["metadata"]["uid"] = uid
    node.kube.add_pod(pod)
    with pytest.raises(AllocationRefusedError, match="must be plain names"):
        node.allocator.allocate([[f"{node.gpus[1]}-0"]])
    _victim_untouched(node)


def _forger_over_victim(node: AgentNode) -> dict[str, Any]:
    """A pod on the node claiming the running pod's placement, with its identity copied."""
    assert node.victim_identity is not None
    forged = MigAllocation(
        0, 0, node.gpus[0], "2g.10gb", Placement(0, 2), node.victim_identity
    )  # fmt: skip
    return agent_pod("forger", devices=[[(node.gpus[0], 9984, 0)]], mig=[forged])


def test_forged_record_over_a_running_instance_is_not_adopted_after_a_restart() -> None:
    node = agent_node("mig")
    node.kube.add_pod(_forger_over_victim(node))
    # The agent restarts: its map of managed instances is gone, the instance is not.
    restarted = MigManager(node.backend, node_name=AGENT_NODE)
    read = desired_from_pods(node.kube.list("/api/v1/pods")["items"], node_name=AGENT_NODE)
    assert read.desired is None and "overlapping" in read.reason
    report = restarted.adopt_on_start(read.desired, reason=read.reason)
    assert report.skipped and restarted.instances() == {}
    config = DeviceConfig(nodeconfig=(NodeConfig(AGENT_NODE, "mig"),))
    allocator = Allocator(AGENT_NODE, node.kube, node.backend, restarted, config)
    with pytest.raises(MigAllocationError, match="not taken over until they can"):
        allocator.allocate([[f"{node.gpus[0]}-0"]])
    assert restarted.instances() == {}  # neither adopted for the forger nor destroyed
    _victim_untouched(node)


def test_forged_record_over_a_managed_instance_is_refused_and_nothing_is_reclaimed() -> None:
    node = agent_node("mig")
    node.kube.add_pod(_forger_over_victim(node))
    with pytest.raises(MigAllocationError, match="held by default/victim"):
        node.allocator.allocate([[f"{node.gpus[0]}-0"]])
    read = desired_from_pods(node.kube.list("/api/v1/pods")["items"], node_name=AGENT_NODE)
    report = node.mig.reconcile(read.desired, reason=read.reason)
    assert report.skipped and report.destroyed == ()
    _victim_untouched(node)


def test_forged_identity_on_a_free_placement_gets_a_new_instance_not_the_running_one() -> None:
    node = agent_node("mig")
    assert node.victim_identity is not None
    forged = MigAllocation(0, 0, node.gpus[0], "2g.10gb", Placement(2, 2), node.victim_identity)
    path = node.kube.add_pod(agent_pod("forger", devices=[[(node.gpus[0], 9984, 0)]], mig=[forged]))
    [out] = node.allocator.allocate([[f"{node.gpus[0]}-0"]])
    assert out.envs["NVIDIA_VISIBLE_DEVICES"] != node.victim_identity.mig_uuid
    [record] = decode_mig_allocations(node.kube.annotations(path)[ann.MIG_ALLOCATIONS])
    assert record.runtime is not None and record.runtime != node.victim_identity
    assert record.runtime.mig_uuid == out.envs["NVIDIA_VISIBLE_DEVICES"]
    _victim_untouched(node)
    assert node.instances_all_managed()
