"""The burst tests' string helpers report what ``tessera check`` finds (no cluster needed;
every violation kind is covered in ``tests/unit/test_check.py``)."""

from __future__ import annotations

from tests.e2e.invariants import annotation_violations, capacity_violations, rebuild_state
from tests.unit.test_check import CORE, CORE_GPUS, MIG_GPU, MIGN, mig, shared

REGISTERS = {"core": CORE_GPUS, "mign": (MIG_GPU,)}


def test_clean_allocations_give_no_strings() -> None:
    pods = [shared("a", 0, 20000), shared("b", 0, 20000)]
    assert capacity_violations(rebuild_state([CORE, MIGN], pods)) == []
    assert [annotation_violations(p, REGISTERS) for p in pods] == [[], []]


def test_strings_name_kind_object_and_problem() -> None:
    pods = [
        shared("a", 0, 30000),
        shared("b", 0, 20000),
        mig("m1", "2g.10gb", 0, None),
        mig("m2", "1g.5gb", 1, None),
    ]
    found = capacity_violations(rebuild_state([CORE, MIGN], pods))
    assert "over-capacity: core/GPU 0 (hami-core): 50000 MiB > devmem 40960" in found, found
    assert any(
        s.startswith("mig-overlap: mign/GPU 0 (mig): 1 MIG slices used twice") for s in found
    )
    assert annotation_violations(pods[2], REGISTERS) == [
        "bad-annotations: default/m1: on mign: MIG device 2g.10gb@Placement(start=0, size=2) "
        "has no runtime identity"
    ]
