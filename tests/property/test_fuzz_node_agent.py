"""Hostile pods reaching the node agent: the annotations it did not write are untrusted.

A node (hami-core, MIG or MPS) runs one pod (``victim``); a second pod (``intruder``) arrives with
every Tessera annotation valid, mutated or garbage — GPUs of other nodes, memory beyond the
card, forged or partial MIG identities, placements over the victim's instance, unreadable
JSON — and a container list of any shape. Then:

- pod matching, the desired MIG set and ``ambiguous`` never raise (matching may refuse with
  ``PodMatchError`` or ``InvalidDeviceIdError``);
- ``Allocator.allocate`` for the intruder either answers or raises a ``TesseraError`` with a
  message; what it hands out names only this node's GPUs, memory within the card, host paths
  under the hook dir (MPS: the GPUs' own daemon pipe directories), and never the victim's
  MIG instance;
- the victim's annotations are never patched and its MIG instance survives the allocation
  and the reconcile pass after it; no GPU instance is left behind that the manager does not
  own.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from api.errors import InvalidAnnotationError, TesseraError
from api.hami import keys as ann
from api.hami.devices import (
    MigAllocation,
    RuntimeIdentity,
    decode_devices,
)
from api.hami.keys import GpuMode
from api.hami.matching import ambiguous
from api.hami.register import Placement
from api.kube.objects import annotations_of
from node_agent.allocator import HOST_HOOK_DIR, Allocator
from node_agent.deviceplugin.ids import InvalidDeviceIdError, device_id
from node_agent.mig_records import desired_from_pods
from node_agent.mps import CONTAINER_PIPE_ROOT, DEFAULT_ROOT
from node_agent.pod_matching import PodMatchError, match_pod, preferred_gpus
from tests.fuzzing import (
    AGENT_NODE,
    AgentNode,
    FuzzLedger,
    agent_node,
    fuzz_settings,
    hostile_variant,
    json_values,
    rare,
)
from tests.node_agent_fakes import make_pod as agent_pod

OTHER_GPU = "GPU-ffffffff-0000-0000-0000-000000000000"


@st.composite
def intruders(draw: st.DrawFn, node: AgentNode) -> dict[str, Any]:
    """Half the time a pod the scheduler could have placed (free GPU share or placement),
    else one whose fields and annotations are hostile."""
    g0, g1 = node.gpus
    hostile = draw(st.booleans())
    count = draw(st.integers(1, 2))
    if hostile:
        gpu = draw(st.sampled_from([g1, g0, OTHER_GPU, "not a uuid"]))
        mem = draw(st.sampled_from([1000, 9984, 20000, 32768, 40960, 2**31 - 1]))
        cores = draw(st.sampled_from([0, 30, 100]))
    else:
        gpu, mem, cores = draw(st.sampled_from([g0, g1])), draw(st.sampled_from([1000, 9984])), 30
    devices = [[(gpu, mem, cores)] * count]
    mig: list[MigAllocation] = []
    if node.mode == "mig" or (hostile and draw(rare(4))):
        profiles = ["2g.10gb", "1g.5gb", "3g.20gb", "7g.40gb", "9g.9gb"]
        profile = draw(st.sampled_from(profiles if hostile else profiles[:2]))
        size = {"1g.5gb": 1, "2g.10gb": 2, "3g.20gb": 4, "7g.40gb": 8}.get(profile, 3)
        # 0 and 1 overlap the victim's [0,2) on GPU 0; a genuine pod gets a free placement.
        start = draw(st.sampled_from([0, 1, 2, 4, 6] if hostile else [2, 4]))
        runtime = None
        if hostile and draw(st.booleans()):  # forged: the victim's identity, or invented
            runtime = draw(
                st.sampled_from([node.victim_identity, RuntimeIdentity("MIG-forged", 1, 0)])
            )
        mig = [
            MigAllocation(0, i, gpu, profile, Placement(start + i * size, size), runtime)
            for i in range(count)
        ]
    containers = None
    if hostile:
        containers = draw(
            st.sampled_from(
                [
                    None,
                    [],
                    [{"name": "c0"}, {"name": "c1"}],
                    [{"name": ".."}],
                    [{"name": "a/b", "env": "CUDA_DISABLE_CONTROL"}],
                    [{"name": "c0", "env": [{"name": "CUDA_DISABLE_CONTROL", "value": "true"}]}],
                ]
            )
        )
    pod = agent_pod("intruder", devices=devices, mig=mig, containers=containers)
    if not hostile:
        return pod
    data = draw(st.data())
    annotations = pod["metadata"]["annotations"]
    for key in (
        ann.DEVICES_TO_ALLOCATE,
        ann.DEVICES_ALLOCATED,
        ann.MIG_ALLOCATIONS,
        ann.BIND_PHASE,
        ann.BIND_TIME,
        ann.VGPU_NODE,
    ):
        if key in annotations and draw(rare(3)):
            is_json = key == ann.MIG_ALLOCATIONS
            annotations[key] = hostile_variant(annotations[key], data, is_json=is_json)
    if draw(rare(10)):
        pod["metadata"]["uid"] = draw(st.sampled_from(["..", "a/b", "", "uid-x"]))
    if draw(rare(15)):
        annotations[draw(st.sampled_from([ann.DEVICES_TO_ALLOCATE, ann.BIND_PHASE]))] = draw(
            json_values
        )
    return pod


def request_ids(node: AgentNode, pod: Mapping[str, Any], data: st.DataObject) -> list[str]:
    """What the kubelet would send: ids for the intruder's entry, or any advertised ids, or
    malformed ones."""
    how = data.draw(st.sampled_from(["entry", "entry", "advertised", "garbage"]), label="ids")
    if how == "entry":
        try:
            entry = next(
                c for c in decode_devices(pod["metadata"]["annotations"][ann.DEVICES_TO_ALLOCATE])
            )
            return Allocator.device_ids(entry) if entry else [device_id(node.gpus[0], 9)]
        except (InvalidAnnotationError, KeyError, StopIteration, TypeError, AttributeError):
            pass
    if how in ("entry", "advertised"):
        slots = [device_id(g, s) for g in node.gpus for s in range(10)]
        return data.draw(st.lists(st.sampled_from(slots), min_size=1, max_size=3, unique=True))
    return data.draw(st.lists(st.text(max_size=50), max_size=3), label="garbage ids")


def check_handed_out(node: AgentNode, envs: Mapping[str, str], mounts: Any) -> None:
    visible = envs.get("NVIDIA_VISIBLE_DEVICES", "").split(",")
    if node.victim_identity is not None:
        assert node.victim_identity.mig_uuid not in visible, "the victim's instance handed out"
    if node.mode == "hami-core":
        assert set(visible) <= set(node.gpus), visible
        limits = [int(v[:-1]) for k, v in envs.items() if k.startswith("CUDA_DEVICE_MEMORY_LIMIT")]
        assert all(0 <= m <= 32768 for m in limits), limits
    elif node.mode == "mps":
        assert set(visible) <= set(node.gpus) and len(set(visible)) == len(visible), visible
        pinned = envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"].split(",")
        assert pinned == [f"{i}={p.split('=')[1]}" for i, p in enumerate(pinned)], pinned
        assert len(pinned) == len(visible), pinned
        assert all(0 <= int(p.split("=")[1][:-1]) <= 32768 for p in pinned), pinned
        assert 0 < int(envs.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "1")) < 100, envs
        pipes = [(m.container_path, m.host_path, m.read_only) for m in mounts]
        expected = [
            (f"{CONTAINER_PIPE_ROOT}/{i}", f"{DEFAULT_ROOT}/{gpu}/pipe", False)
            for i, gpu in enumerate(visible)
        ]
        assert pipes == expected, pipes
        return
    else:
        assert all(v.startswith("MIG-") for v in visible), visible
    for m in mounts:
        assert os.path.normpath(m.host_path) == m.host_path, m
        assert m.host_path.startswith((HOST_HOOK_DIR + "/", "/tmp/vgpulock")), m


def check_victim(node: AgentNode) -> None:
    assert node.kube.annotations(node.victim_path) == node.victim_annotations
    assert all(path != node.victim_path for path, _, _ in node.kube.patches)
    assert node.victim_instance_intact(), "the victim's MIG instance was destroyed or replaced"
    assert node.instances_all_managed(), "a GPU instance leaked"


# ----- pure matching ----------------------------------------------------------------------------

MODES: tuple[GpuMode, ...] = ("hami-core", "mig", "mps")
NODES_BY_MODE = {m: agent_node(m) for m in MODES}


@fuzz_settings(100)
@given(mode=st.sampled_from(MODES), data=st.data())
def test_matching_hostile_pods_never_raises_unexpectedly(
    fuzz_ledger: FuzzLedger, mode: GpuMode, data: st.DataObject
) -> None:
    node = NODES_BY_MODE[mode]
    intruder = data.draw(intruders(node))
    pods = [node.kube.get(node.victim_path), intruder]
    ids = request_ids(node, intruder, data)
    with fuzz_ledger.case("node-agent/pod-matching") as case:
        try:
            match = match_pod(pods, AGENT_NODE, ids)
            assert match.key == "default/intruder"  # the victim is not allocating
        except (PodMatchError, InvalidDeviceIdError) as e:
            case.rejected(str(e))
        preferred_gpus(pods, AGENT_NODE, len(ids))
        read = desired_from_pods(pods, node_name=AGENT_NODE)
        assert read.desired is not None or read.reason
        victim_annotations = node.kube.annotations(node.victim_path)
        assert isinstance(ambiguous(victim_annotations, annotations_of(intruder)), bool)


# ----- Allocate end to end -----------------------------------------------------------------------


@fuzz_settings(100)
@given(mode=st.sampled_from(MODES), data=st.data())
def test_hostile_pod_allocates_only_its_own_and_never_touches_the_running_pod(
    fuzz_ledger: FuzzLedger, mode: GpuMode, data: st.DataObject
) -> None:
    node = agent_node(mode)
    intruder = data.draw(intruders(node))
    path = node.kube.add_pod(intruder)
    ids = request_ids(node, intruder, data)
    with fuzz_ledger.case(f"node-agent/allocate-{mode}") as case:
        try:
            [out] = node.allocator.allocate([ids])
        except TesseraError as e:
            case.rejected(str(e))
        else:
            check_handed_out(node, out.envs, out.mounts)
        assert {p for p, _, _ in node.kube.patches} <= {path}
        check_victim(node)
        if mode == "mig":
            read = desired_from_pods(node.kube.list("/api/v1/pods")["items"], node_name=AGENT_NODE)
            node.mig.reconcile(read.desired, reason=read.reason)
            check_victim(node)
