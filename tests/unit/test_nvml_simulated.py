"""The simulated NVML backend is as strict as the hardware and survives restarts."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from api.hami.catalog import find_model, simulated_gpu_uuid
from api.hami.register import Placement
from node_agent.nvml import (
    InsufficientResources,
    InUse,
    InvalidArgument,
    NotFound,
    NotSupported,
    NvmlError,
    SimulatedGpuSpec,
    SimulatedNvml,
    Uninitialized,
)
from node_agent.nvml.backend import full_compute_instance_profile

A100 = "NVIDIA A100-PCIE-40GB"
RTX = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
A30 = "NVIDIA A30"


def make_sim(*models: str, state_file: Path | None = None, **spec: object) -> SimulatedNvml:
    sim = SimulatedNvml(
        [SimulatedGpuSpec(m, **spec) for m in models],  # type: ignore[arg-type]
        state_file,
        node_name="node-a",
    )
    sim.init()
    return sim


@pytest.fixture
def a100() -> Iterator[SimulatedNvml]:
    sim = make_sim(A100)
    yield sim
    sim.shutdown()


def pid(model: str, profile: str) -> int:
    fact = find_model(model).profile(profile)
    assert fact is not None
    return fact.profile_id


def create(sim: SimulatedNvml, model: str, profile: str, start: int, index: int = 0) -> int:
    fact = find_model(model).profile(profile)
    assert fact is not None
    placement = Placement(start, fact.placement_size)
    return sim.create_gpu_instance_with_placement(index, fact.profile_id, placement).id


def create_full_ci(sim: SimulatedNvml, model: str, profile: str, gi_id: int) -> int:
    fact = find_model(model).profile(profile)
    assert fact is not None
    return sim.create_compute_instance(0, gi_id, full_compute_instance_profile(fact.slice_count)).id


@pytest.mark.parametrize(
    ("model", "profile", "start", "gi_id"),
    [
        (A100, "7g.40gb", 0, 0),
        (A100, "4g.20gb", 0, 1),
        (A100, "3g.20gb", 0, 1),
        (A100, "3g.20gb", 4, 2),
        (A100, "2g.10gb", 0, 3),
        (A100, "2g.10gb", 2, 4),
        (A100, "2g.10gb", 4, 5),
        (A100, "1g.10gb", 6, 6),
        *[(A100, "1g.5gb", s, 7 + s) for s in range(7)],
        (A100, "1g.5gb+me", 3, 10),
        *[(RTX, "1g.24gb", s, 3 + s // 3) for s in (0, 3, 6, 9)],
        (RTX, "2g.48gb", 0, 1),
        (RTX, "2g.48gb", 6, 2),
        (RTX, "4g.96gb", 0, 0),
        (A30, "4g.24gb", 0, 0),
        (A30, "2g.12gb", 0, 1),
        (A30, "2g.12gb", 2, 2),
        *[(A30, "1g.6gb", s, 3 + s) for s in range(4)],
    ],
)
def test_gpu_instance_ids_follow_the_observed_pattern(
    model: str, profile: str, start: int, gi_id: int
) -> None:
    sim = make_sim(model)
    assert create(sim, model, profile, start) == gi_id
    sim.shutdown()


@pytest.mark.parametrize(
    ("existing", "attempt", "error", "says"),
    [
        ([], ("2g.10gb", 1, 2), InvalidArgument, "may only start at 0, 2, 4"),
        ([], ("2g.10gb", 0, 4), InvalidArgument, "size 2"),
        ([], ("3g.20gb", 2, 4), InvalidArgument, "may only start at 0, 4"),
        ([], ("1g.5gb", 7, 1), InvalidArgument, "may only start"),
        ([("3g.20gb", 0)], ("2g.10gb", 2, 2), InsufficientResources, "overlaps GPU instance 1"),
        ([("7g.40gb", 0)], ("1g.5gb", 6, 1), InsufficientResources, "overlaps GPU instance 0"),
        ([("1g.10gb", 6)], ("1g.5gb", 6, 1), InsufficientResources, "overlaps"),
        ([("4g.20gb", 0)], ("3g.20gb", 0, 4), InsufficientResources, "overlaps"),
        ([("1g.5gb+me", 0)], ("1g.5gb+me", 1, 1), InsufficientResources, "1 instance(s)"),
        ([("3g.20gb", 0), ("3g.20gb", 4)], ("3g.20gb", 0, 4), InsufficientResources, "2 inst"),
    ],
)
def test_gpu_instance_creation_is_strict(
    a100: SimulatedNvml,
    existing: list[tuple[str, int]],
    attempt: tuple[str, int, int],
    error: type[NvmlError],
    says: str,
) -> None:
    for profile, start in existing:
        create(a100, A100, profile, start)
    before = a100.gpu_instances(0)
    profile, start, size = attempt
    with pytest.raises(error, match=re.escape(says)) as exc:
        a100.create_gpu_instance_with_placement(0, pid(A100, profile), Placement(start, size))
    assert f"placement {{start={start}, size={size}}} on GPU 0" in str(exc.value)
    assert a100.gpu_instances(0) == before  # a refused creation changes nothing


def test_unknown_profile_id_is_an_invalid_argument(a100: SimulatedNvml) -> None:
    with pytest.raises(InvalidArgument, match="no profile id 99"):
        a100.create_gpu_instance_with_placement(0, 99, Placement(0, 1))
    with pytest.raises(InvalidArgument):
        a100.gpu_instance_possible_placements(0, 99)


def test_rtx_pro_6000_geometry_is_strict() -> None:
    sim = make_sim(RTX)
    create(sim, RTX, "2g.48gb", 0)
    with pytest.raises(InsufficientResources):
        create(sim, RTX, "1g.24gb", 3)
    assert create(sim, RTX, "1g.24gb", 6) == 5
    assert create(sim, RTX, "1g.24gb", 9) == 6
    sim.shutdown()


def test_mig_disabled_refuses_mig_calls_except_possible_placements() -> None:
    sim = make_sim(A100, mig_enabled=False)
    assert tuple(sim.mig_mode(0)) == (False, False)
    assert sim.gpu_instance_possible_placements(0, pid(A100, "2g.10gb")) == [
        Placement(0, 2),
        Placement(2, 2),
        Placement(4, 2),
    ]
    calls = [
        lambda: sim.gpu_instance_profile_info(0, 1),
        lambda: sim.gpu_instances(0),
        lambda: sim.create_gpu_instance_with_placement(0, 14, Placement(0, 2)),
        lambda: sim.compute_instances(0, 3),
        lambda: sim.destroy_gpu_instance(0, 3),
        lambda: sim.mig_device_uuid(0, 3, 0),
    ]
    for call in calls:
        with pytest.raises(NotSupported, match="MIG mode is disabled"):
            call()
    sim.shutdown()


def test_non_mig_gpu_supports_no_mig_call() -> None:
    sim = make_sim("NVIDIA L4")
    assert sim.device(0).name == "NVIDIA L4"
    with pytest.raises(NotSupported, match="does not support MIG"):
        sim.mig_mode(0)
    with pytest.raises(NotSupported):
        sim.gpu_instance_possible_placements(0, 0)
    sim.shutdown()


@pytest.mark.parametrize(
    ("profile_index", "error"),
    [(4, None), (1, None), (9, None), (8, NotSupported), (17, NotSupported), (18, InvalidArgument)],
)
def test_profile_info_by_index(
    a100: SimulatedNvml, profile_index: int, error: type[NvmlError] | None
) -> None:
    if error is not None:
        with pytest.raises(error):
            a100.gpu_instance_profile_info(0, profile_index)
        return
    info = a100.gpu_instance_profile_info(0, profile_index)
    fact = next(p for p in find_model(A100).profiles if p.profile_index == profile_index)
    assert (info.id, info.slice_count, info.memory_mib, info.name) == (
        fact.profile_id,
        fact.slice_count,
        fact.memory_mib,
        f"MIG {fact.name}",
    )


def test_one_full_size_compute_instance_per_gpu_instance(a100: SimulatedNvml) -> None:
    gi = create(a100, A100, "2g.10gb", 2)
    assert create_full_ci(a100, A100, "2g.10gb", gi) == 0
    with pytest.raises(InsufficientResources, match="2 of 2 compute slices"):
        create_full_ci(a100, A100, "2g.10gb", gi)
    with pytest.raises(InsufficientResources):
        a100.create_compute_instance(0, gi, 0)  # a 1-slice CI in a full 2g GI
    ci = a100.compute_instances(0, gi)
    assert [(c.id, c.gi_id, c.profile_id) for c in ci] == [(0, 4, 1)]


@pytest.mark.parametrize(
    ("profile", "ci_profile_index", "error"),
    [
        ("2g.10gb", 4, NotSupported),  # 7-slice CI in a 2g GI
        ("3g.20gb", 3, NotSupported),  # 4-slice CI in a 3g GI
        ("2g.10gb", 42, InvalidArgument),
    ],
)
def test_compute_instance_profiles_must_fit_the_gpu_instance(
    a100: SimulatedNvml, profile: str, ci_profile_index: int, error: type[NvmlError]
) -> None:
    gi = create(a100, A100, profile, 0)
    with pytest.raises(error):
        a100.create_compute_instance(0, gi, ci_profile_index)


def test_smaller_compute_instances_share_a_gpu_instance(a100: SimulatedNvml) -> None:
    gi = create(a100, A100, "7g.40gb", 0)
    ids = [a100.create_compute_instance(0, gi, 1).id for _ in range(3)]  # 2c x 3
    assert ids == [0, 1, 2]
    assert a100.create_compute_instance(0, gi, 0).id == 3  # 1c fits the 7th slice
    with pytest.raises(InsufficientResources):
        a100.create_compute_instance(0, gi, 0)


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda s: s.destroy_gpu_instance(0, 5), NotFound),
        (lambda s: s.destroy_compute_instance(0, 5, 0), NotFound),
        (lambda s: s.destroy_compute_instance(0, 4, 1), NotFound),
        (lambda s: s.create_compute_instance(0, 5, 1), NotFound),
        (lambda s: s.compute_instances(0, 5), NotFound),
        (lambda s: s.mig_device_uuid(0, 4, 1), NotFound),
        (lambda s: s.destroy_gpu_instance(0, 4), InUse),
        (lambda s: s.device(1), InvalidArgument),
        (lambda s: s.gpu_instances(-1), InvalidArgument),
    ],
)
def test_unknown_ids_and_busy_instances(a100: SimulatedNvml, call: object, error: type) -> None:
    gi = create(a100, A100, "2g.10gb", 2)
    create_full_ci(a100, A100, "2g.10gb", gi)
    with pytest.raises(error):
        call(a100)  # type: ignore[operator]


def test_instances_with_processes_are_in_use(a100: SimulatedNvml) -> None:
    gi = create(a100, A100, "2g.10gb", 2)
    ci = create_full_ci(a100, A100, "2g.10gb", gi)
    other = create(a100, A100, "1g.5gb", 0)
    a100.set_processes(0, [4242, 17], gi_id=gi)
    a100.set_processes(0, [99])  # on the GPU, outside any GI
    assert a100.running_processes(0) == [17, 99, 4242]
    with pytest.raises(InUse, match=re.escape("processes [17, 4242]")):
        a100.destroy_compute_instance(0, gi, ci)
    a100.destroy_gpu_instance(0, other)  # processes elsewhere do not block it
    a100.set_processes(0, [], gi_id=gi)
    a100.destroy_compute_instance(0, gi, ci)
    a100.destroy_gpu_instance(0, gi)
    assert a100.gpu_instances(0) == []
    assert a100.running_processes(0) == [99]
    with pytest.raises(NotFound):
        a100.set_processes(0, [1], gi_id=gi)


def test_mig_uuids_are_stable_per_instance_and_new_per_creation(a100: SimulatedNvml) -> None:
    gi = create(a100, A100, "2g.10gb", 2)
    ci = create_full_ci(a100, A100, "2g.10gb", gi)
    first = a100.mig_device_uuid(0, gi, ci)
    assert re.fullmatch(r"MIG-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", first)
    assert a100.mig_device_uuid(0, gi, ci) == first
    a100.destroy_compute_instance(0, gi, ci)
    a100.destroy_gpu_instance(0, gi)
    gi = create(a100, A100, "2g.10gb", 2)
    ci = create_full_ci(a100, A100, "2g.10gb", gi)
    assert a100.mig_device_uuid(0, gi, ci) != first


def test_devices_come_from_the_catalog() -> None:
    specs = [SimulatedGpuSpec(A100), SimulatedGpuSpec("H200", uuid="GPU-x", numa=1)]
    sim = SimulatedNvml(specs, node_name="node-a")
    sim.init()
    assert sim.device_count() == 2
    d0, d1 = sim.device(0), sim.device(1)
    assert (d0.uuid, d0.name, d0.memory_mib, d0.multiprocessor_count, d0.numa_node) == (
        simulated_gpu_uuid("node-a", 0),
        A100,
        40960,
        98,
        0,
    )
    assert (d1.uuid, d1.name, d1.numa_node, d1.healthy) == ("GPU-x", "NVIDIA H200", 1, True)
    sim.set_health(1, False)
    assert not sim.device(1).healthy
    sim.shutdown()


def test_session_lifecycle() -> None:
    sim = SimulatedNvml([SimulatedGpuSpec(A100)])
    with pytest.raises(Uninitialized, match="count GPUs"):
        sim.device_count()
    sim.init()
    sim.init()  # idempotent while open
    create(sim, A100, "7g.40gb", 0)
    sim.shutdown()
    sim.shutdown()  # closing twice is harmless
    with pytest.raises(Uninitialized, match="list GPU instances on GPU 0"):
        sim.gpu_instances(0)
    sim.init()  # a new start cycle finds the hardware as it was left
    assert [gi.id for gi in sim.gpu_instances(0)] == [0]
    sim.shutdown()


def test_fail_next_injects_one_fault(a100: SimulatedNvml) -> None:
    a100.fail_next("create_gpu_instance_with_placement", InsufficientResources("boom"))
    with pytest.raises(InsufficientResources, match="boom"):
        create(a100, A100, "7g.40gb", 0)
    assert create(a100, A100, "7g.40gb", 0) == 0
    with pytest.raises(ValueError, match="not an NvmlBackend method"):
        a100.fail_next("create_gi", InUse("x"))


def test_parallel_creations_never_overlap(a100: SimulatedNvml) -> None:
    results: list[int | str] = []
    barrier = threading.Barrier(8)

    def worker(start: int) -> None:
        barrier.wait()
        try:
            results.append(create(a100, A100, "1g.5gb", start % 7))
        except InsufficientResources:
            results.append("refused")

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r for r in results if isinstance(r, int)) == list(range(7, 14))
    assert results.count("refused") == 1


def test_state_file_lets_a_restarted_agent_find_its_instances(tmp_path: Path) -> None:
    state = tmp_path / "nvml.json"
    first = make_sim(A100, A100, state_file=state)
    gi = create(first, A100, "2g.10gb", 2)
    ci = create_full_ci(first, A100, "2g.10gb", gi)
    first.set_processes(0, [7], gi_id=gi)
    uuid = first.mig_device_uuid(0, gi, ci)
    assert list(tmp_path.iterdir()) == [state]  # written atomically, no temp file left
    # The old agent dies without shutting down; a new one starts on the same hardware.
    second = make_sim(A100, A100, state_file=state)
    assert second.state_snapshot() == first.state_snapshot()
    assert second.mig_device_uuid(0, gi, ci) == uuid
    assert second.running_processes(0) == [7]
    ci2 = create_full_ci(second, A100, "2g.10gb", create(second, A100, "2g.10gb", 0))
    assert second.mig_device_uuid(0, 3, ci2) != uuid  # creation counter survived too
    first.shutdown()
    second.shutdown()


def test_state_file_follows_every_operation_on_either_gpu(tmp_path: Path) -> None:
    """Each GPU's part of the file is kept between writes: an operation on one GPU must
    rewrite that part and keep the other's."""
    state = tmp_path / "nvml.json"
    sim = make_sim(A100, A100, state_file=state)
    fact = find_model(A100).profile("1g.5gb")
    assert fact is not None
    ci_profile = full_compute_instance_profile(fact.slice_count)

    def gi(index: int, start: int) -> int:
        placement = Placement(start, fact.placement_size)
        return sim.create_gpu_instance_with_placement(index, fact.profile_id, placement).id

    ops = [
        lambda: gi(0, 0),
        lambda: gi(1, 3),
        lambda: sim.create_compute_instance(0, sim.gpu_instances(0)[0].id, ci_profile),
        lambda: sim.create_compute_instance(1, sim.gpu_instances(1)[0].id, ci_profile),
        lambda: sim.set_processes(1, [9]),
        lambda: sim.set_health(0, False),
        lambda: sim.destroy_compute_instance(0, sim.gpu_instances(0)[0].id, 0),
        lambda: sim.destroy_gpu_instance(0, sim.gpu_instances(0)[0].id),
        lambda: gi(0, 6),
    ]
    for op in ops:
        op()
        reloaded = make_sim(A100, A100, state_file=state)
        assert json.loads(state.read_text()) == sim.state_snapshot() == reloaded.state_snapshot()
        for index in (0, 1):
            assert reloaded.device(index) == sim.device(index)
            assert reloaded.gpu_instances(index) == sim.gpu_instances(index)
            assert reloaded.running_processes(index) == sim.running_processes(index)
        reloaded.shutdown()
    assert [p.name for p in tmp_path.iterdir()] == ["nvml.json"]  # no temporary file left


def test_state_file_of_another_configuration_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "nvml.json"
    make_sim(A100, state_file=state).set_health(0, True)
    other = SimulatedNvml([SimulatedGpuSpec("H200")], state, node_name="node-a")
    with pytest.raises(NvmlError, match="delete the file"):
        other.init()
    with pytest.raises(Uninitialized):
        other.device_count()
    state.write_text(json.dumps({"version": 1, "gpus": [{"uuid": 3}]}))
    with pytest.raises(NvmlError, match="malformed"):
        SimulatedNvml([SimulatedGpuSpec(A100)], state, node_name="node-a").init()
