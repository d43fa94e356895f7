"""The MIG instance manager realizes exact reservations, reclaims, and adopts after restarts."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from api.hami.catalog import find_model
from api.hami.devices import (
    MigAllocation,
    RuntimeIdentity,
    encode_mig_allocations,
)
from api.hami.register import Placement
from node_agent.mig_manager import (
    DesiredSet,
    InstanceKey,
    MigAllocationError,
    MigManager,
    Owner,
    Reservation,
)
from node_agent.mig_records import desired_from_pods
from node_agent.nvml import (
    ComputeInstance,
    GpuInstance,
    InUse,
    NvmlError,
    SimulatedGpuSpec,
    SimulatedNvml,
)
from tests.builders import make_pod

NODE = "node-a"
A100 = "NVIDIA A100-PCIE-40GB"
H100 = "NVIDIA H100 80GB HBM3"
RTX = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
MODELS = (A100, H100, RTX)  # GPU 0, 1, 2
MUTATIONS = frozenset(
    {
        "create_gpu_instance_with_placement",
        "create_compute_instance",
        "destroy_compute_instance",
        "destroy_gpu_instance",
    }
)


class Sim(SimulatedNvml):
    """The strict simulated NVML that also records mutations and can fail the n-th call."""

    def __init__(self, state_file: Path | None, models: tuple[str, ...] = MODELS) -> None:
        super().__init__([SimulatedGpuSpec(m) for m in models], state_file, node_name=NODE)
        self.mutations: list[tuple[Any, ...]] = []
        self._armed: dict[str, tuple[int, NvmlError]] = {}
        self._counts: dict[str, int] = {}

    def fail_on_call(self, method: str, nth: int, error: NvmlError) -> None:
        """Queue ``error`` (through ``fail_next``) for the ``nth`` call of ``method`` from now."""
        self._armed[method] = (nth, error)
        self._counts[method] = 0

    def _count(self, method: str, *args: Any) -> None:
        self._counts[method] = self._counts.get(method, 0) + 1
        armed = self._armed.get(method)
        if armed is not None and armed[0] == self._counts[method]:
            self.fail_next(method, armed[1])
        if method in MUTATIONS:
            self.mutations.append((method, *args))

    def create_gpu_instance_with_placement(
        self, index: int, profile_id: int, placement: Placement
    ) -> GpuInstance:
        self._count("create_gpu_instance_with_placement", index, placement.start)
        return super().create_gpu_instance_with_placement(index, profile_id, placement)

    def create_compute_instance(
        self, index: int, gi_id: int, ci_profile_index: int
    ) -> ComputeInstance:
        self._count("create_compute_instance", index, gi_id)
        return super().create_compute_instance(index, gi_id, ci_profile_index)

    def mig_device_uuid(self, index: int, gi_id: int, ci_id: int) -> str:
        self._count("mig_device_uuid", index, gi_id)
        return super().mig_device_uuid(index, gi_id, ci_id)

    def destroy_compute_instance(self, index: int, gi_id: int, ci_id: int) -> None:
        self._count("destroy_compute_instance", index, gi_id)
        super().destroy_compute_instance(index, gi_id, ci_id)

    def destroy_gpu_instance(self, index: int, gi_id: int) -> None:
        self._count("destroy_gpu_instance", index, gi_id)
        super().destroy_gpu_instance(index, gi_id)


@dataclass
class Rig:
    sim: Sim
    manager: MigManager
    state_file: Path

    def uuid(self, gpu: int) -> str:
        return self.sim.device(gpu).uuid

    def alloc(
        self,
        gpu: int,
        profile: str,
        start: int,
        *,
        container: int = 0,
        device: int = 0,
        runtime: RuntimeIdentity | None = None,
        size: int | None = None,
    ) -> MigAllocation:
        fact = find_model(MODELS[gpu]).profile(profile)
        psize = size if size is not None else (fact.placement_size if fact else 1)
        return MigAllocation(
            container, device, self.uuid(gpu), profile, Placement(start, psize), runtime
        )

    def gis(self, gpu: int) -> list[dict[str, Any]]:
        gis: list[dict[str, Any]] = self.sim.state_snapshot()["gpus"][gpu]["gpuInstances"]
        return gis

    def all_gis(self) -> list[tuple[int, int, int]]:
        """(gpu, start, size) of every GI in the simulated hardware."""
        snap = self.sim.state_snapshot()
        return sorted(
            (i, gi["start"], gi["size"])
            for i, g in enumerate(snap["gpus"])
            for gi in g["gpuInstances"]
        )

    def restart(self) -> Rig:
        """A new agent process: new NVML session over the same state file, new manager."""
        self.sim.shutdown()
        sim = Sim(self.state_file)
        sim.init()
        return Rig(sim, MigManager(sim, node_name=NODE), self.state_file)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    state = tmp_path / "nvml.json"
    sim = Sim(state)
    sim.init()
    r = Rig(sim, MigManager(sim, node_name=NODE), state)
    yield r
    r.sim.shutdown()


def desired(*pods: tuple[str, list[MigAllocation]]) -> DesiredSet:
    return DesiredSet.of(Reservation(p, a) for p, allocs in pods for a in allocs)


EMPTY = DesiredSet()


# -- creation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gpu", "profile", "start", "size", "gi_id"),
    [
        (0, "2g.10gb", 2, 2, 4),
        (0, "1g.5gb", 5, 1, 12),
        (0, "7g.40gb", 0, 8, 0),
        (1, "3g.40gb", 4, 4, 2),
        (1, "1g.20gb", 6, 2, 6),
        (2, "2g.48gb", 6, 6, 2),
        (2, "1g.24gb", 9, 3, 6),
    ],
)
def test_creates_the_gpu_instance_at_exactly_the_reserved_placement(
    rig: Rig, gpu: int, profile: str, start: int, size: int, gi_id: int
) -> None:
    a = rig.alloc(gpu, profile, start)
    [identity] = rig.manager.ensure("ns/p", [a], EMPTY)
    [gi] = rig.gis(gpu)
    assert (gi["start"], gi["size"], gi["id"]) == (start, size, gi_id)
    [ci] = gi["computeInstances"]
    assert identity == RuntimeIdentity(ci["migUUID"], gi_id, ci["id"])
    key = InstanceKey(gpu, profile, start, size)
    m = rig.manager.instances()[key]
    assert (m.owner, m.identity, m.adopted) == (Owner("ns/p", 0, 0), identity, False)


def test_repeated_allocate_returns_the_same_mig_device(rig: Rig) -> None:
    allocs = [rig.alloc(0, "2g.10gb", 2), rig.alloc(2, "1g.24gb", 3, device=1)]
    first = rig.manager.ensure("ns/p", allocs, EMPTY)
    created = len(rig.sim.mutations)
    again = rig.manager.ensure("ns/p", allocs, desired(("ns/p", allocs)))
    assert again == first
    assert len(rig.sim.mutations) == created
    assert rig.all_gis() == [(0, 2, 2), (2, 3, 3)]


def test_profiles_are_read_from_nvml_once_per_gpu(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[int] = []
    real = rig.sim.gpu_instance_profile_info

    def counting(index: int, profile_index: int) -> Any:
        asked.append(index)
        return real(index, profile_index)

    monkeypatch.setattr(rig.sim, "gpu_instance_profile_info", counting)
    rig.manager.ensure("ns/a", [rig.alloc(0, "1g.5gb", 0)], EMPTY)
    first = len(asked)
    assert first > 0 and set(asked) == {0}
    b = [rig.alloc(0, "1g.5gb", 1)]
    rig.manager.ensure("ns/b", b, desired(("ns/b", b)))
    assert len(asked) == first  # GPU 0's profiles came from the first read
    rig.manager.ensure("ns/c", [rig.alloc(1, "1g.10gb", 0)], EMPTY)
    assert set(asked[first:]) == {1}


@pytest.mark.parametrize(
    ("profile", "start"),
    [("2g.10gb", 2), ("3g.20gb", 0), ("7g.40gb", 0), ("1g.5gb", 3)],
    ids=["same-placement", "overlaps-from-left", "whole-gpu", "inside"],
)
def test_other_pods_reservation_on_an_occupied_placement_fails_without_creating(
    rig: Rig, profile: str, start: int
) -> None:
    held = rig.alloc(0, "2g.10gb", 2)
    rig.manager.ensure("ns/first", [held], EMPTY)
    before = rig.sim.state_snapshot()
    mutations = len(rig.sim.mutations)
    with pytest.raises(MigAllocationError) as e:
        rig.manager.ensure(
            "ns/second", [rig.alloc(0, profile, start)], desired(("ns/first", [held]))
        )
    assert rig.sim.state_snapshot() == before
    assert len(rig.sim.mutations) == mutations
    assert e.value.pod == "ns/second" and e.value.profile == profile
    assert e.value.placement.start == start and e.value.gpu == rig.uuid(0)


@pytest.mark.parametrize(
    ("method", "error"),
    [
        ("create_gpu_instance_with_placement", "insufficient"),
        ("create_compute_instance", "insufficient"),
        ("mig_device_uuid", "unknown"),
    ],
)
def test_multi_device_failure_rolls_back_only_this_attempts_instances(
    rig: Rig, method: str, error: str
) -> None:
    earlier = rig.alloc(0, "1g.5gb", 6)
    rig.manager.ensure("ns/earlier", [earlier], EMPTY)
    rig.sim.mutations.clear()
    allocs = [rig.alloc(0, "2g.10gb", 0), rig.alloc(1, "3g.40gb", 4, device=1)]
    live = desired(("ns/earlier", [earlier]))
    rig.sim.fail_on_call(method, 2, NvmlError("injected", error))  # the 2nd device's call
    with pytest.raises(MigAllocationError) as e:
        rig.manager.ensure("ns/p", allocs, live)
    assert e.value.profile == "3g.40gb" and e.value.gpu == rig.uuid(1)
    assert e.value.nvml_error is not None and "injected" in str(e.value)
    assert rig.all_gis() == [(0, 6, 1)]  # the earlier pod's instance only
    assert [k.profile for k in rig.manager.instances()] == ["1g.5gb"]
    destroys = [m for m in rig.sim.mutations if m[0].startswith("destroy")]
    assert ("destroy_gpu_instance", 0, 13) not in destroys
    # CI before GI, newest first; the first device's GI is destroyed after its CI.
    gi_of_first = 3
    assert destroys.index(("destroy_compute_instance", 0, gi_of_first)) < destroys.index(
        ("destroy_gpu_instance", 0, gi_of_first)
    )


def test_rollback_keeps_an_instance_created_by_an_earlier_allocate_of_the_same_pod(
    rig: Rig,
) -> None:
    first = rig.alloc(0, "2g.10gb", 4)
    [identity] = rig.manager.ensure("ns/p", [first], EMPTY)
    second = rig.alloc(1, "2g.20gb", 2, device=1)
    # The first device is already realized, so the only create is the second device's.
    rig.sim.fail_on_call("create_gpu_instance_with_placement", 1, NvmlError("injected"))
    with pytest.raises(MigAllocationError):
        rig.manager.ensure("ns/p", [first, second], desired(("ns/p", [first])))
    assert rig.all_gis() == [(0, 4, 2)]
    assert rig.manager.instances()[InstanceKey(0, "2g.10gb", 4, 2)].identity == identity


def test_rollback_never_destroys_an_adopted_instance(rig: Rig) -> None:
    a = rig.alloc(0, "3g.20gb", 4)
    [identity] = rig.manager.ensure("ns/p", [a], EMPTY)
    recorded = rig.alloc(0, "3g.20gb", 4, runtime=identity)
    rig = rig.restart()
    rig.manager.adopt_on_start(desired(("ns/p", [recorded])))
    rig.sim.fail_on_call("create_compute_instance", 1, NvmlError("injected"))
    with pytest.raises(MigAllocationError):
        rig.manager.ensure(
            "ns/p", [recorded, rig.alloc(1, "7g.80gb", 0, device=1)], desired(("ns/p", [recorded]))
        )
    assert rig.all_gis() == [(0, 4, 4)]
    assert rig.manager.instances()[InstanceKey(0, "3g.20gb", 4, 4)].adopted


# -- verification before any hardware call -------------------------------------------


@pytest.mark.parametrize(
    ("gpu", "profile", "start", "size", "message"),
    [
        (0, "2g.10gb", 1, 2, "not legal"),
        (0, "3g.20gb", 2, 4, "not legal"),
        (0, "2g.10gb", 0, 4, "not legal"),
        (0, "1g.24gb", 0, 3, "does not resolve"),
        (2, "2g.48gb", 3, 6, "not legal"),
    ],
)
def test_reservation_no_longer_legal_fails_before_any_hardware_call(
    rig: Rig, gpu: int, profile: str, start: int, size: int, message: str
) -> None:
    ok = rig.alloc(1, "1g.10gb", 0)
    bad = rig.alloc(gpu, profile, start, size=size, device=1)
    with pytest.raises(MigAllocationError, match=message):
        rig.manager.ensure("ns/p", [ok, bad], EMPTY)
    assert rig.sim.mutations == []
    assert rig.all_gis() == []


def test_reservation_for_a_gpu_of_another_node_fails_before_any_hardware_call(rig: Rig) -> None:
    a = MigAllocation(0, 0, "GPU-elsewhere", "2g.10gb", Placement(0, 2))
    with pytest.raises(MigAllocationError, match="no GPU with that UUID"):
        rig.manager.ensure("ns/p", [a], EMPTY)
    assert rig.sim.mutations == []


def test_nvml_failure_while_verifying_names_the_nvml_error(rig: Rig) -> None:
    rig.sim.fail_next("gpu_instance_possible_placements", NvmlError("placements", "gpu lost"))
    with pytest.raises(MigAllocationError, match="gpu lost") as e:
        rig.manager.ensure("ns/p", [rig.alloc(0, "2g.10gb", 0)], EMPTY)
    assert isinstance(e.value.__cause__, NvmlError)
    assert rig.sim.mutations == []


# -- reconcile and reclaim -----------------------------------------------------------


def test_reclaims_the_instance_after_its_pod_ends_ci_then_gi(rig: Rig) -> None:
    gone = rig.alloc(0, "2g.10gb", 2)
    stays = rig.alloc(0, "2g.10gb", 4)
    [gone_id] = rig.manager.ensure("ns/gone", [gone], EMPTY)
    rig.manager.ensure("ns/stays", [stays], desired(("ns/gone", [gone])))
    rig.sim.mutations.clear()
    report = rig.manager.reconcile(desired(("ns/stays", [stays])))
    assert report.destroyed == (InstanceKey(0, "2g.10gb", 2, 2),)
    gi = gone_id.gpu_instance_id
    assert rig.sim.mutations == [
        ("destroy_compute_instance", 0, gi),
        ("destroy_gpu_instance", 0, gi),
    ]
    assert rig.all_gis() == [(0, 4, 2)]
    assert list(rig.manager.instances()) == [InstanceKey(0, "2g.10gb", 4, 2)]


def test_an_instance_recorded_after_the_pods_were_read_is_kept(rig: Rig) -> None:
    """The reconcile pass reads the node's pods; a pod bound after that read is not in them,
    and its Allocate may realize its instance before the pass reaches its GPU: the pass
    keeps it (``newer``, so not settled), and the next one, reading the pod, leaves it."""
    a = rig.alloc(0, "2g.10gb", 2)
    as_of = rig.manager.changes  # the pass notes the count, then reads the pods: no ns/p
    stale = EMPTY
    rig.manager.ensure("ns/p", [a], desired(("ns/p", [a])))  # ns/p bound and allocated
    report = rig.manager.reconcile(stale, as_of=as_of)
    key = InstanceKey(0, "2g.10gb", 2, 2)
    assert report.newer == (key,) and not report.destroyed and not report.settled
    assert rig.all_gis() == [(0, 2, 2)]
    again = rig.manager.reconcile(desired(("ns/p", [a])), as_of=rig.manager.changes)
    assert again.settled and list(rig.manager.instances()) == [key]
    # read after the record, a set without the pod is current: the pod is gone
    gone = rig.manager.reconcile(EMPTY, as_of=rig.manager.changes)
    assert gone.destroyed == (key,) and rig.all_gis() == []


def test_an_allocate_with_an_older_pod_list_keeps_a_newer_instance(rig: Rig) -> None:
    """Two Allocates on one GPU: the second listed the node's pods before the first pod was
    bound, so its desired set lacks that pod; reclaiming on its own GPU keeps the first
    pod's instance, recorded after that list."""
    first, second = rig.alloc(0, "2g.10gb", 2), rig.alloc(0, "2g.10gb", 4)
    as_of = rig.manager.changes
    listed = desired(("ns/second", [second]))  # read before ns/first was bound
    rig.manager.ensure("ns/first", [first], desired(("ns/first", [first])))
    rig.manager.ensure("ns/second", [second], listed, as_of=as_of)
    assert sorted(rig.manager.instances()) == [
        InstanceKey(0, "2g.10gb", 2, 2),
        InstanceKey(0, "2g.10gb", 4, 2),
    ]


def test_ensure_reclaims_on_the_pods_own_gpus_and_leaves_the_rest_to_reconcile(
    rig: Rig,
) -> None:
    in_the_way = rig.alloc(0, "2g.10gb", 2)
    elsewhere = rig.alloc(1, "2g.20gb", 0)
    rig.manager.ensure("ns/gone", [in_the_way], EMPTY)
    rig.manager.ensure("ns/gone-too", [elsewhere], EMPTY)
    rig.sim.mutations.clear()
    # Same placement as the ended pod's: its instance is reclaimed before the new one.
    rig.manager.ensure("ns/new", [rig.alloc(0, "2g.10gb", 2)], EMPTY)
    assert [m[0] for m in rig.sim.mutations] == [
        "destroy_compute_instance",
        "destroy_gpu_instance",
        "create_gpu_instance_with_placement",
        "create_compute_instance",
    ]
    assert InstanceKey(1, "2g.20gb", 0, 2) in rig.manager.instances()  # not the pod's GPU
    report = rig.manager.reconcile(desired(("ns/new", [rig.alloc(0, "2g.10gb", 2)])))
    assert report.destroyed == (InstanceKey(1, "2g.20gb", 0, 2),)


def pod(name: str, allocs: list[MigAllocation], *, phase: str = "Running") -> dict[str, Any]:
    obj = make_pod(name).on(NODE, phase).build()
    obj["metadata"]["annotations"]["hami.io/vgpu-mig-allocations"] = encode_mig_allocations(allocs)
    return obj


@pytest.mark.parametrize(
    ("phase", "deleting", "reclaimed"),
    [
        ("Running", False, False),
        ("Pending", False, False),
        ("Running", True, True),
        ("Succeeded", False, True),
        ("Failed", False, True),
    ],
)
def test_deleting_and_finished_pods_are_not_desired(
    rig: Rig, phase: str, deleting: bool, reclaimed: bool
) -> None:
    a = rig.alloc(1, "2g.20gb", 0)
    [identity] = rig.manager.ensure("default/p", [a], EMPTY)
    obj = pod("p", [rig.alloc(1, "2g.20gb", 0, runtime=identity)], phase=phase)
    if deleting:
        obj["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    read = desired_from_pods([obj], node_name=NODE)
    report = rig.manager.reconcile(read.desired, reason=read.reason)
    assert (len(report.destroyed) == 1) is reclaimed
    assert (rig.all_gis() == []) is reclaimed


def test_unreadable_desired_set_skips_every_destruction(rig: Rig) -> None:
    a = rig.alloc(0, "2g.10gb", 0)
    rig.manager.ensure("ns/p", [a], EMPTY)
    rig.sim.mutations.clear()
    report = rig.manager.reconcile(None, reason="list pods: 503")
    assert report.skipped and report.reason == "list pods: 503"
    rig.manager.ensure("ns/q", [rig.alloc(0, "2g.10gb", 4)], None)  # creation still works
    assert [m[0] for m in rig.sim.mutations if m[0].startswith("destroy")] == []
    assert rig.all_gis() == [(0, 0, 2), (0, 4, 2)]


def test_malformed_record_makes_reconcile_skip(rig: Rig) -> None:
    rig.manager.ensure("default/p", [rig.alloc(0, "1g.5gb", 0)], EMPTY)
    obj = make_pod("p").on(NODE).build()
    obj["metadata"]["annotations"]["hami.io/vgpu-mig-allocations"] = (
        '[{"gpuUUID":"GPU-1","profile":"1g.5gb","placement":{"size":1},"migUUID":"MIG-x"}]'
    )
    read = desired_from_pods([obj], node_name=NODE)
    assert read.desired is None and "partial runtime identity" in read.reason
    assert rig.manager.reconcile(read.desired, reason=read.reason).skipped
    assert rig.all_gis() == [(0, 0, 1)]


def test_destroy_refused_in_use_is_reported_and_retried(rig: Rig) -> None:
    a = rig.alloc(2, "1g.24gb", 6)
    [identity] = rig.manager.ensure("ns/p", [a], EMPTY)
    rig.sim.set_processes(2, [4242], gi_id=identity.gpu_instance_id)
    key = InstanceKey(2, "1g.24gb", 6, 3)
    report = rig.manager.reconcile(EMPTY)
    assert report.in_use == (key,) and report.destroyed == ()
    assert key in rig.manager.instances() and rig.all_gis() == [(2, 6, 3)]
    rig.sim.set_processes(2, [], gi_id=identity.gpu_instance_id)
    report = rig.manager.reconcile(EMPTY)
    assert report.destroyed == (key,) and rig.all_gis() == []


def test_other_nvml_failure_on_destroy_is_reported_and_retried(rig: Rig) -> None:
    rig.manager.ensure("ns/p", [rig.alloc(0, "2g.10gb", 0)], EMPTY)
    rig.sim.fail_next("destroy_compute_instance", NvmlError("destroy", "timeout"))
    report = rig.manager.reconcile(EMPTY)
    assert len(report.failed) == 1 and "timeout" in report.failed[0].detail
    assert rig.manager.reconcile(EMPTY).destroyed == (InstanceKey(0, "2g.10gb", 0, 2),)


def test_instance_destroyed_behind_the_managers_back_is_forgotten_not_destroyed(rig: Rig) -> None:
    [identity] = rig.manager.ensure("ns/p", [rig.alloc(0, "7g.40gb", 0)], EMPTY)
    rig.sim.destroy_compute_instance(0, identity.gpu_instance_id, identity.compute_instance_id)
    rig.sim.destroy_gpu_instance(0, identity.gpu_instance_id)
    report = rig.manager.reconcile(EMPTY)
    assert report.vanished == (InstanceKey(0, "7g.40gb", 0, 8),)
    assert rig.manager.instances() == {}


def test_placement_freed_by_an_ended_pod_is_reused_by_the_next(rig: Rig) -> None:
    a = rig.alloc(0, "3g.20gb", 0)
    [old] = rig.manager.ensure("ns/old", [a], EMPTY)
    [new] = rig.manager.ensure("ns/new", [a], EMPTY)  # old pod no longer desired
    assert new.mig_uuid != old.mig_uuid
    assert rig.manager.instances()[InstanceKey(0, "3g.20gb", 0, 4)].owner.pod == "ns/new"


def test_ensure_takes_over_an_instance_whose_identity_never_reached_the_annotation(
    rig: Rig,
) -> None:
    a = rig.alloc(1, "4g.40gb", 0)
    [identity] = rig.manager.ensure("ns/p", [a], EMPTY)
    rig = rig.restart()  # crashed before patching the pod: no runtime identity recorded
    report = rig.manager.adopt_on_start(desired(("ns/p", [a])))
    assert report.kept_gpus == (1,) and report.pending == (Owner("ns/p", 0, 0),)
    assert rig.manager.ensure("ns/p", [a], desired(("ns/p", [a]))) == [identity]
    assert rig.sim.mutations == []
    assert rig.manager.instances()[InstanceKey(1, "4g.40gb", 0, 4)].adopted


def test_reconcile_adopts_an_unmanaged_instance_matching_a_recorded_identity(rig: Rig) -> None:
    a = rig.alloc(0, "1g.5gb", 3)
    [identity] = rig.manager.ensure("ns/p", [a], EMPTY)
    rig = rig.restart()
    rig.manager.adopt_on_start(None)  # state was unreadable at start: nothing adopted
    assert rig.manager.instances() == {}
    recorded = rig.alloc(0, "1g.5gb", 3, runtime=identity)
    report = rig.manager.reconcile(desired(("ns/p", [recorded])))
    assert report.adopted == (InstanceKey(0, "1g.5gb", 3, 1),)
    assert rig.manager.ensure("ns/p", [recorded], desired(("ns/p", [recorded]))) == [identity]


# -- restart adoption ----------------------------------------------------------------


def test_restart_adopts_complete_identities_cleans_idle_gpus_keeps_busy_ones(rig: Rig) -> None:
    live = rig.alloc(0, "2g.10gb", 2)
    [live_id] = rig.manager.ensure("ns/live", [live], None)
    pending = rig.alloc(0, "1g.5gb", 0, device=1)
    rig.manager.ensure("ns/pending", [pending], None)
    wrong = rig.alloc(0, "1g.5gb", 6, container=1)
    [wrong_id] = rig.manager.ensure("ns/wrong", [wrong], None)
    rig.manager.ensure("ns/ended", [rig.alloc(1, "3g.40gb", 0)], None)  # GPU 1: idle after
    rig.manager.ensure("ns/ended2", [rig.alloc(2, "4g.96gb", 0)], None)  # GPU 2: processes
    rig.sim.set_processes(2, [77])
    rig = rig.restart()

    # Right GI and CI ids, but not the MIG device NVML has there.
    spoofed = replace(wrong_id, mig_uuid="MIG-00000000-0000-0000-0000-000000000000")
    state = desired(
        ("ns/live", [rig.alloc(0, "2g.10gb", 2, runtime=live_id)]),
        ("ns/pending", [pending]),
        ("ns/wrong", [rig.alloc(0, "1g.5gb", 6, container=1, runtime=spoofed)]),
    )
    report = rig.manager.adopt_on_start(state)

    assert report.kept_gpus == (0, 2) and report.cleaned_gpus == (1,)
    assert report.adopted == (InstanceKey(0, "2g.10gb", 2, 2),)
    assert report.pending == (Owner("ns/pending", 0, 1),)
    [mismatch] = report.mismatched
    assert mismatch.owner == Owner("ns/wrong", 1, 0) and "MIG device" in mismatch.detail
    assert rig.all_gis() == [(0, 0, 1), (0, 2, 2), (0, 6, 1), (2, 0, 12)]
    [m] = rig.manager.instances().values()
    assert (m.owner, m.identity, m.adopted) == (Owner("ns/live", 0, 0), live_id, True)


def test_restart_with_unreadable_allocation_state_touches_nothing(rig: Rig) -> None:
    rig.manager.ensure("ns/p", [rig.alloc(1, "1g.10gb", 4)], EMPTY)
    rig = rig.restart()
    obj = pod("p", [])
    obj["metadata"]["annotations"]["hami.io/vgpu-mig-allocations"] = "{not json"
    read = desired_from_pods([obj], node_name=NODE)
    report = rig.manager.adopt_on_start(read.desired, reason=read.reason)
    assert report.skipped and "not valid JSON" in report.reason
    assert rig.sim.mutations == [] and rig.all_gis() == [(1, 4, 1)]


def test_restart_keeps_gpus_the_caller_reports_busy(rig: Rig) -> None:
    rig.manager.ensure("ns/p", [rig.alloc(1, "7g.80gb", 0)], EMPTY)
    rig = rig.restart()
    report = rig.manager.adopt_on_start(EMPTY, busy_gpus={1})
    assert report.kept_gpus == (1,) and report.cleaned_gpus == (0, 2)
    assert rig.all_gis() == [(1, 0, 8)]


@pytest.mark.parametrize(("phase", "kept"), [("Running", True), ("Succeeded", False)])
def test_restart_keeps_gpus_live_pods_hold_through_hami_legacy_mig_slots(
    rig: Rig, phase: str, kept: bool
) -> None:
    # Stands for the instances HAMi <= v2.9 laid out (Tessera never made them).
    rig.manager.ensure("hami/layout", [rig.alloc(1, "2g.20gb", 0)], EMPTY)
    rig = rig.restart()
    old = make_pod("old").on(NODE, phase).build()
    old["metadata"]["annotations"]["hami.io/vgpu-devices-allocated"] = (
        f"{rig.uuid(1)}[1-1],NVIDIA,19968,28:;"
    )
    read = desired_from_pods([old], node_name=NODE)
    assert read.desired is not None, read.reason
    report = rig.manager.adopt_on_start(read.desired)
    assert (1 in report.kept_gpus) is kept
    assert (rig.all_gis() == [(1, 0, 2)]) is kept
    assert rig.manager.instances() == {}  # held, not adopted: Tessera will not destroy it


def test_idle_cleaning_that_hits_in_use_reports_it_and_keeps_going(rig: Rig) -> None:
    rig.manager.ensure("ns/p", [rig.alloc(0, "2g.10gb", 0)], None)
    rig.manager.ensure("ns/q", [rig.alloc(1, "2g.20gb", 0)], None)
    rig = rig.restart()
    rig.sim.fail_next("destroy_gpu_instance", InUse("destroy", "busy"))
    report = rig.manager.adopt_on_start(EMPTY)
    assert report.cleaned_gpus == (1, 2) and len(report.failed) == 1
    assert rig.all_gis() == [(0, 0, 2)]


# -- concurrency ---------------------------------------------------------------------


def test_concurrent_allocates_for_one_placement_create_exactly_one_instance(rig: Rig) -> None:
    results: list[str] = []
    lock = threading.Lock()

    def allocate(name: str) -> None:
        try:
            rig.manager.ensure(name, [rig.alloc(0, "4g.20gb", 0)], None)
            outcome = "ok"
        except MigAllocationError:
            outcome = "refused"
        with lock:
            results.append(outcome)

    threads = [threading.Thread(target=allocate, args=(f"ns/p{i}",)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["ok"] + ["refused"] * 5
    assert rig.all_gis() == [(0, 0, 4)]
