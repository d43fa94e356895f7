"""Interchangeable MIG pods (one profile per device, alike otherwise): Allocate hands one of
them the instance reserved for another, and the records follow the kubelet's PodResources:
no reserved placement is ever recorded by nobody while a container uses it, and the node
agent's reconcile never destroys an instance a container runs on."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from api.hami.config import DeviceConfig, NodeConfig
from api.hami.devices import MigAllocation, RuntimeIdentity, decode_devices, decode_mig_allocations
from api.hami.keys import BIND_PHASE, DEVICES_ALLOCATED, MIG_ALLOCATIONS
from node_agent.allocator import Allocator
from node_agent.identities import IdentityFixer
from node_agent.mig_manager import DesiredSet, MigManager, Reservation
from node_agent.mig_records import desired_from_pods
from node_agent.nvml.simulated import SimulatedNvml
from tests.node_agent_fakes import (
    G0,
    G1,
    NODE,
    SLOTS,
    FakeKube,
    FakeLister,
    ScriptedKube,
    make_pod,
    mig_alloc,
    simulated_gpus,
)

RESOURCE = "nvidia.com/gpu"
A100 = "A100-PCIE-40GB"
P, Q = "/api/v1/namespaces/default/pods/p", "/api/v1/namespaces/default/pods/q"
ONE_GPU = [{"name": "c0", "image": "x", "resources": {"limits": {RESOURCE: "1"}}}]


@pytest.fixture
def backend() -> Iterator[SimulatedNvml]:
    yield from simulated_gpus(G0, G1)


def mig_of(kube: FakeKube, path: str) -> list[MigAllocation]:
    return list(decode_mig_allocations(kube.annotations(path)[MIG_ALLOCATIONS]))


def gpus_of(kube: FakeKube, path: str) -> list[str]:
    return [d.uuid for c in decode_devices(kube.annotations(path)[DEVICES_ALLOCATED]) for d in c]


def live_instances(backend: SimulatedNvml) -> set[str]:
    out: set[str] = set()
    for idx in range(backend.device_count()):
        for gi in backend.gpu_instances(idx):
            for ci in backend.compute_instances(idx, gi.id):
                out.add(backend.mig_device_uuid(idx, gi.id, ci.id))
    return out


def guard(
    kube: FakeKube,
    backend: SimulatedNvml,
    mig: MigManager,
    in_use: set[str],
    *,
    records: bool = True,
) -> None:
    """After a write: every MIG instance a container runs on is recorded by some pod (with
    ``records``), and the agent's reconcile (as it runs between any two writes) destroys
    none of them."""
    if records:
        recorded = {
            a.runtime.mig_uuid
            for path in (P, Q)
            if path in kube.objects
            for a in mig_of(kube, path)
            if a.runtime is not None
        }
        assert in_use <= recorded, f"instances in use but recorded by nobody: {in_use - recorded}"
    read = desired_from_pods(kube.list("/api/v1/pods")["items"], node_name=NODE)
    report = mig.reconcile(read.desired, reason=read.reason)
    assert not report.destroyed
    assert in_use <= live_instances(backend)


def setup(
    kube: ScriptedKube, backend: SimulatedNvml, q_gpu: str, q_start: int
) -> tuple[Allocator, IdentityFixer, FakeLister, MigManager]:
    kube.add_pod(
        make_pod(
            "p",
            devices=[[(G0, 9984, 29)]],
            mig=[mig_alloc(0, 0, G0, "2g.10gb", 2, 2)],
            containers=ONE_GPU,
        )
    )
    kube.add_pod(
        make_pod(
            "q",
            devices=[[(q_gpu, 9984, 29)]],
            mig=[mig_alloc(0, 0, q_gpu, "2g.10gb", q_start, 2)],
            containers=ONE_GPU,
        )
    )
    lister = FakeLister()
    fixer = IdentityFixer(NODE, kube, lister, RESOURCE)
    cfg = DeviceConfig(nodeconfig=(NodeConfig(NODE, "mig"),))
    mig = MigManager(backend, node_name=NODE)
    alloc = Allocator(NODE, kube, backend, mig, cfg, cache_name=lambda: "x", identities=fixer)
    mig.protect(fixer.protected)  # as the node agent wires them
    return alloc, fixer, lister, mig


def allocate_swapped(
    kube: ScriptedKube, alloc: Allocator, lister: FakeLister
) -> tuple[str, str, set[str]]:
    """The kubelet admits q first; Allocate hands out p's reservation (the first in admission
    order), then q's to p's container. Returns the two MIG UUIDs handed out and the set in use."""
    first = alloc.preferred(SLOTS, [], 1)
    [one] = alloc.allocate([first])
    second = alloc.preferred([s for s in SLOTS if s not in first], [], 1)
    [two] = alloc.allocate([second])
    assert kube.annotations(P)[BIND_PHASE] == kube.annotations(Q)[BIND_PHASE] == "success"
    lister.held = {("default/q", "c0"): tuple(first), ("default/p", "c0"): tuple(second)}
    x, y = one.envs["NVIDIA_VISIBLE_DEVICES"], two.envs["NVIDIA_VISIBLE_DEVICES"]
    return x, y, {x, y}


@pytest.mark.parametrize(
    ("q_gpu", "q_start"), [(G1, 2), (G0, 4)], ids=["other GPU", "same GPU, other placement"]
)
def test_a_swapped_mig_hand_out_moves_the_records_and_keeps_both_instances(
    backend: SimulatedNvml, q_gpu: str, q_start: int
) -> None:
    kube = ScriptedKube()
    alloc, fixer, lister, mig = setup(kube, backend, q_gpu, q_start)
    x, y, in_use = allocate_swapped(kube, alloc, lister)
    assert fixer.pending() == {"default/p", "default/q"}
    # From now on every write is checked: nothing in use unrecorded, nothing destroyed.
    kube.after = lambda: guard(kube, backend, mig, in_use)
    assert fixer.check() is True
    assert fixer.corrected == 2 and not fixer.pending()
    [p_rec], [q_rec] = mig_of(kube, P), mig_of(kube, Q)
    assert p_rec.runtime is not None and q_rec.runtime is not None
    assert (q_rec.runtime.mig_uuid, p_rec.runtime.mig_uuid) == (x, y)
    assert (q_rec.gpu_uuid, q_rec.placement.start) == (G0, 2)  # p's reservation, q holds it
    assert (p_rec.gpu_uuid, p_rec.placement.start) == (q_gpu, q_start)
    assert (p_rec.device_index, q_rec.device_index) == (0, 0)
    assert (gpus_of(kube, P), gpus_of(kube, Q)) == ([q_gpu], [G0])
    # The instances stay, each now owned by the pod that runs on it.
    guard(kube, backend, mig, in_use)
    owners = {m.identity.mig_uuid: m.owner.pod for m in mig.instances().values()}
    assert owners == {x: "default/q", y: "default/p"}
    # When q ends, its instance (x, reserved for p) goes; p's container keeps y.
    kube.objects.pop(Q)
    read = desired_from_pods(kube.list("/api/v1/pods")["items"], node_name=NODE)
    report = mig.reconcile(read.desired)
    assert len(report.destroyed) == 1 and live_instances(backend) == {y}


def test_a_correction_cut_after_its_first_round_is_finished_by_a_restarted_agent(
    backend: SimulatedNvml,
) -> None:
    """Round one wrote both pods' old and real instances and round two reached q only; the
    agent then restarts (no record of its hand-outs): it finds p's double record and
    finishes it from its second half."""
    kube = ScriptedKube(fail_at=5)  # two allocations, two first rounds, then p's second fails
    alloc, fixer, lister, mig = setup(kube, backend, G1, 2)
    x, y, in_use = allocate_swapped(kube, alloc, lister)
    kube.after = lambda: guard(kube, backend, mig, in_use)
    assert fixer.check() is False
    assert (len(mig_of(kube, P)), len(mig_of(kube, Q))) == (2, 1)  # p: old and real
    restarted = IdentityFixer(NODE, kube, lister, RESOURCE)
    restarted.adopt(kube.list("/api/v1/pods")["items"])
    assert restarted.pending() == {"default/p"}
    assert restarted.check() is True
    [p_rec], [q_rec] = mig_of(kube, P), mig_of(kube, Q)
    assert p_rec.runtime is not None and q_rec.runtime is not None
    assert (q_rec.runtime.mig_uuid, p_rec.runtime.mig_uuid) == (x, y)
    assert (gpus_of(kube, P), gpus_of(kube, Q)) == ([G1], [G0])


def test_an_instance_handed_out_is_kept_until_its_holder_is_known(
    backend: SimulatedNvml,
) -> None:
    """p ends before the kubelet's record is read: it recorded x, which q runs on, and q
    records y. The instances of a pending hand-out are kept whatever the records say, and
    once q's record follows the kubelet's, y (nobody's) goes and x stays."""
    kube = ScriptedKube()
    alloc, fixer, lister, mig = setup(kube, backend, G1, 2)
    x, y, _ = allocate_swapped(kube, alloc, lister)
    kube.objects.pop(P)
    del lister.held[("default/p", "c0")]
    assert fixer.protected() == {x, y}
    # p is gone and q records y: nobody records x, yet the agent keeps it.
    guard(kube, backend, mig, {x}, records=False)
    kube.after = lambda: guard(kube, backend, mig, {x})
    assert fixer.check() is True
    [q_rec] = mig_of(kube, Q)
    assert q_rec.runtime is not None and q_rec.runtime.mig_uuid == x
    assert fixer.protected() == frozenset()
    read = desired_from_pods(kube.list("/api/v1/pods")["items"], node_name=NODE)
    report = mig.reconcile(read.desired)
    assert len(report.destroyed) == 1 and live_instances(backend) == {x}
    assert {m.identity.mig_uuid: m.owner.pod for m in mig.instances().values()} == {x: "default/q"}


def test_a_mig_hand_out_that_named_the_right_pod_writes_nothing(backend: SimulatedNvml) -> None:
    kube = ScriptedKube()
    alloc, fixer, lister, _ = setup(kube, backend, G1, 2)
    first = alloc.preferred(SLOTS, [], 1)
    alloc.allocate([first])
    second = alloc.preferred([s for s in SLOTS if s not in first], [], 1)
    alloc.allocate([second])
    writes = kube.calls
    lister.held = {("default/p", "c0"): tuple(first), ("default/q", "c0"): tuple(second)}
    assert fixer.check() is True
    assert kube.calls == writes and fixer.corrected == 0


def test_reconcile_moves_an_instance_only_to_a_record_of_its_own_identity(
    backend: SimulatedNvml,
) -> None:
    """An instance whose owner no longer reserves it goes to the pod that records its exact
    runtime identity at that placement; a pod reserving the placement without it (a new
    reservation of a freed placement) does not keep it alive."""
    mig = MigManager(backend, node_name=NODE)
    a = mig_alloc(0, 0, G0, "2g.10gb", 2, 2)
    [rt] = mig.ensure("default/a", [a], DesiredSet.of([]))
    held = MigAllocation(0, 0, G0, "2g.10gb", a.placement, rt)
    report = mig.reconcile(DesiredSet.of([Reservation("default/b", held)]))
    assert not report.destroyed
    [m] = mig.instances().values()
    assert m.owner.pod == "default/b"
    other = MigAllocation(0, 0, G0, "2g.10gb", a.placement, RuntimeIdentity("MIG-other", 1, 0))
    report = mig.reconcile(DesiredSet.of([Reservation("default/c", other)]))
    assert len(report.destroyed) == 1 and not mig.instances()


def test_an_unreadable_mig_record_is_left_alone_and_the_others_still_corrected(
    backend: SimulatedNvml,
) -> None:
    """q's record became unreadable after the hand-out: the check settles it with a warning
    and writes nothing to it (the scheduler keeps counting what it last read), while p's
    record still follows the kubelet's."""
    kube = ScriptedKube()
    alloc, fixer, lister, _ = setup(kube, backend, G1, 2)
    _, y, _ = allocate_swapped(kube, alloc, lister)
    kube.objects[Q]["metadata"]["annotations"][MIG_ALLOCATIONS] = "[{"
    assert fixer.check() is True and not fixer.pending()
    assert kube.annotations(Q)[MIG_ALLOCATIONS] == "[{"
    [p_rec] = mig_of(kube, P)
    assert p_rec.runtime is not None and p_rec.runtime.mig_uuid == y
