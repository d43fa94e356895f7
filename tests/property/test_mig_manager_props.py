"""Invariants of the MIG manager under random Allocate / pod end / reconcile / restart sequences.

The model plays the scheduler (non-overlapping reservations of live pods), kubelet (repeated
Allocate) and the allocator (runtime identities written back after a successful Allocate).
After every step the manager's view must match the simulated hardware: each managed instance
exists there with its identity, and every instance there is managed, except the ones a
restart could not attribute (left on busy GPUs, or everything when the state was unreadable).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from api.hami.catalog import find_model
from api.hami.devices import MigAllocation
from api.hami.register import Placement
from node_agent.mig_manager import DesiredSet, MigAllocationError, MigManager, Reservation
from node_agent.nvml import SimulatedGpuSpec, SimulatedNvml

MODELS = ("NVIDIA A100-PCIE-40GB", "NVIDIA RTX PRO 6000 Blackwell Server Edition")
KINDS = (
    "new",
    "new",
    "new",
    "repeat",
    "end",
    "end",
    "reconcile",
    "reconcile_unreadable",
    "procs",
    "clear_procs",
    "restart",
    "restart_unreadable",
)

# (gpu, gi id, placement start, placement size) of a hardware GI.
Gi = tuple[int, int, int, int]


@dataclass
class World:
    sim: SimulatedNvml
    manager: MigManager
    state_file: Path
    pods: dict[str, list[MigAllocation]] = field(default_factory=dict)  # live pods
    orphans: set[Gi] = field(default_factory=set)
    serial: int = 0

    def desired(self) -> DesiredSet:
        return DesiredSet.of(Reservation(p, a) for p, allocs in self.pods.items() for a in allocs)

    def hardware(self) -> set[Gi]:
        return {
            (i, g.id, g.placement.start, g.placement.size)
            for i in range(len(MODELS))
            for g in self.sim.gpu_instances(i)
        }

    def managed(self) -> set[Gi]:
        return {
            (k.gpu_index, m.identity.gpu_instance_id, k.start, k.size)
            for k, m in self.manager.instances().items()
        }

    def restart(self) -> None:
        self.sim.shutdown()
        self.sim = new_sim(self.state_file)
        self.manager = MigManager(self.sim, node_name="node-a")


def new_sim(state_file: Path) -> SimulatedNvml:
    sim = SimulatedNvml([SimulatedGpuSpec(m) for m in MODELS], state_file, node_name="node-a")
    sim.init()
    return sim


def pick_alloc(w: World, gpu: int, p: int, s: int, device: int) -> MigAllocation:
    # As the allowlist does: profiles whose instance limit is below their placement count
    # (the +me ones) are never reserved, since placements alone cannot account for them.
    profiles = [
        f for f in find_model(MODELS[gpu]).profiles if f.instance_count >= len(f.placements())
    ]
    fact = profiles[p % len(profiles)]
    placement = fact.placements()[s % len(fact.placements())]
    return MigAllocation(0, device, w.sim.device(gpu).uuid, fact.name, placement)


def overlaps(a: MigAllocation, b: MigAllocation) -> bool:
    return a.gpu_uuid == b.gpu_uuid and bool(a.placement.mask & b.placement.mask)


def step_new(w: World, a: int, b: int, c: int, d: int) -> None:
    allocs = [pick_alloc(w, a % len(MODELS), b, c, 0)]
    if d % 3 == 0:
        allocs.append(pick_alloc(w, (a + 1) % len(MODELS), b // 7, c // 7, 1))
    live = [x for v in w.pods.values() for x in v]
    if any(overlaps(x, y) for i, x in enumerate(allocs) for y in live + allocs[i + 1 :]):
        return  # the scheduler would not reserve it
    w.serial += 1
    name = f"ns/p{w.serial}"
    w.pods[name] = allocs
    allocate(w, name)


def allocate(w: World, name: str) -> None:
    allocs = w.pods[name]
    before = {x.runtime for x in allocs}
    try:
        identities = w.manager.ensure(name, allocs, w.desired())
    except MigAllocationError:
        # Only ever refused because some other instance sits across a reserved placement.
        mine = {
            (k.gpu_index, k.start) for k, m in w.manager.instances().items() if m.owner.pod == name
        }
        blocking = [
            g
            for g in w.hardware()
            for x in allocs
            if (g[0], g[2]) not in mine
            and w.sim.device(g[0]).uuid == x.gpu_uuid
            and Placement(g[2], g[3]).mask & x.placement.mask
        ]
        assert blocking, f"{name} refused with nothing in the way"
        return
    if None not in before:  # identities already recorded: a repeat returns them
        assert identities == [x.runtime for x in allocs]
    w.pods[name] = [replace(x, runtime=i) for x, i in zip(allocs, identities, strict=True)]


def check(w: World) -> None:
    hardware = w.hardware()
    w.orphans &= hardware
    managed = w.managed()
    assert managed <= hardware
    assert hardware - managed <= w.orphans, "an instance the manager does not track"
    for k, m in w.manager.instances().items():
        fact = find_model(MODELS[k.gpu_index]).profile(k.profile)
        assert fact is not None
        [gi] = [g for g in w.sim.gpu_instances(k.gpu_index) if g.id == m.identity.gpu_instance_id]
        assert (gi.placement, gi.profile_id) == (k.placement, fact.profile_id)
        uuid = w.sim.mig_device_uuid(k.gpu_index, gi.id, m.identity.compute_instance_id)
        assert uuid == m.identity.mig_uuid


def run(ops: list[tuple[str, int, int, int, int]], state_file: Path) -> None:
    sim = new_sim(state_file)
    w = World(sim, MigManager(sim, node_name="node-a"), state_file)
    try:
        for kind, a, b, c, d in ops:
            if kind == "new":
                step_new(w, a, b, c, d)
            elif kind == "repeat" and w.pods:
                allocate(w, sorted(w.pods)[a % len(w.pods)])
            elif kind == "end" and w.pods:
                del w.pods[sorted(w.pods)[a % len(w.pods)]]
            elif kind == "reconcile":
                report = w.manager.reconcile(w.desired())
                wanted = {
                    (r.owner, r.allocation.gpu_uuid, r.allocation.placement)
                    for r in w.desired().reservations
                }
                for k, m in w.manager.instances().items():
                    owned = (m.owner, w.sim.device(k.gpu_index).uuid, k.placement) in wanted
                    assert owned or k in report.in_use, f"{k} kept but not desired"
            elif kind == "reconcile_unreadable":
                before = w.sim.state_snapshot()
                assert w.manager.reconcile(None).skipped
                assert w.sim.state_snapshot() == before
            elif kind == "procs":
                gis = sorted(w.sim.gpu_instances(a % len(MODELS)))
                if gis:
                    w.sim.set_processes(a % len(MODELS), [100 + b], gi_id=gis[c % len(gis)].id)
            elif kind == "clear_procs":
                for i in range(len(MODELS)):
                    for g in w.sim.gpu_instances(i):
                        w.sim.set_processes(i, [], gi_id=g.id)
            elif kind == "restart":
                w.restart()
                adopted = w.manager.adopt_on_start(w.desired())
                w.orphans = w.hardware() - w.managed()
                for i in adopted.cleaned_gpus:
                    assert not w.sim.gpu_instances(i)
                used = {w.sim.device(i).uuid for i in range(len(MODELS))} & {
                    x.gpu_uuid for v in w.pods.values() for x in v
                }
                for i in adopted.cleaned_gpus:
                    assert w.sim.device(i).uuid not in used
            elif kind == "restart_unreadable":
                before = w.sim.state_snapshot()
                w.restart()
                assert w.manager.adopt_on_start(None).skipped
                assert w.sim.state_snapshot() == before
                w.orphans = w.hardware()
            check(w)
    finally:
        w.sim.shutdown()


_ops = st.lists(
    st.tuples(
        st.sampled_from(KINDS),
        st.integers(0, 63),
        st.integers(0, 63),
        st.integers(0, 63),
        st.integers(0, 63),
    ),
    max_size=30,
)


@settings(max_examples=100, deadline=None)
@given(_ops)
def test_manager_view_matches_hardware_and_reconcile_leaves_nothing_undesired(
    ops: list[tuple[str, int, int, int, int]],
) -> None:
    # The simulated NVML fsyncs its state file on every mutation: keep it in memory if we can.
    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(dir=shm) as d:
        run(ops, Path(d) / "nvml.json")
