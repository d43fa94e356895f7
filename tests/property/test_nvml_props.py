"""Invariants of the simulated NVML under random create/destroy sequences."""

from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from api.hami.catalog import MODELS, GpuModel
from api.hami.register import Placement
from node_agent.nvml import NvmlError, SimulatedGpuSpec, SimulatedNvml

_MIG_MODELS = [m for m in MODELS if m.mig_capable]

# (kind, a, b, c): the meaning of a/b/c depends on kind; out-of-range values exercise
# the refusals (illegal placements, unknown ids).
_op = st.tuples(
    st.sampled_from(["gi", "gi_any", "ci", "destroy_ci", "destroy_gi", "procs"]),
    st.integers(0, 15),
    st.integers(0, 15),
    st.integers(0, 7),
)


def _apply(sim: SimulatedNvml, model: GpuModel, op: tuple[str, int, int, int]) -> None:
    kind, a, b, c = op
    gis = sim.gpu_instances(0)
    try:
        if kind == "gi":  # a legal placement of some profile
            fact = model.profiles[a % len(model.profiles)]
            starts = fact.placement_starts
            sim.create_gpu_instance_with_placement(
                0, fact.profile_id, Placement(starts[b % len(starts)], fact.placement_size)
            )
        elif kind == "gi_any":  # anything, mostly illegal
            fact = model.profiles[a % len(model.profiles)]
            sim.create_gpu_instance_with_placement(0, fact.profile_id, Placement(b, c + 1))
        elif kind == "ci" and gis:
            sim.create_compute_instance(0, gis[a % len(gis)].id, c)
        elif kind == "destroy_ci" and gis:
            gi = gis[a % len(gis)]
            cis = sim.compute_instances(0, gi.id)
            sim.destroy_compute_instance(0, gi.id, cis[b % len(cis)].id if cis else b)
        elif kind == "destroy_gi":
            sim.destroy_gpu_instance(0, gis[a % len(gis)].id if gis and b % 4 else a)
        elif kind == "procs" and gis:
            sim.set_processes(0, [1000 + b] if c % 2 else [], gi_id=gis[a % len(gis)].id)
    except NvmlError:
        pass  # refusals are expected; the invariants must hold either way


def _check_invariants(sim: SimulatedNvml, model: GpuModel) -> None:
    gis = sim.gpu_instances(0)
    masks = 0
    for gi in gis:
        assert gi.placement.mask & masks == 0, f"overlapping GPU instances: {gis}"
        masks |= gi.placement.mask
        fact = next(p for p in model.profiles if p.profile_id == gi.profile_id)
        assert gi.placement in fact.placements()
    per_profile = Counter(gi.profile_id for gi in gis)
    for profile_id, n in per_profile.items():
        fact = next(p for p in model.profiles if p.profile_id == profile_id)
        assert n <= fact.instance_count
    assert len({gi.id for gi in gis}) == len(gis)


@settings(max_examples=60, deadline=None)
@given(model=st.sampled_from(_MIG_MODELS), ops=st.lists(_op, max_size=40))
def test_random_sequences_keep_the_hardware_consistent_and_persisted(
    model: GpuModel, ops: list[tuple[str, int, int, int]]
) -> None:
    with tempfile.TemporaryDirectory() as d:
        state = Path(d) / "nvml.json"
        sim = SimulatedNvml([SimulatedGpuSpec(model.name)], state, node_name="n")
        sim.init()
        for op in ops:
            _apply(sim, model, op)
            _check_invariants(sim, model)
        if ops:  # a restarted agent finds exactly the live state
            reloaded = SimulatedNvml([SimulatedGpuSpec(model.name)], state, node_name="n")
            reloaded.init()
            assert reloaded.state_snapshot() == sim.state_snapshot()
            assert reloaded.gpu_instances(0) == sim.gpu_instances(0)
            reloaded.shutdown()
        sim.shutdown()
