"""ClusterState.confirm: a reservation the pod's own record shows is kept, not recounted."""

from __future__ import annotations

import dataclasses

from api.hami.config import DeviceConfig
from api.hami.devices import DeviceAlloc
from scheduler_plugins.core.requests import PodAllocation
from scheduler_plugins.core.state import ClusterState
from tests.builders import gpu

KEY = "default/p"


def _state() -> tuple[ClusterState, PodAllocation]:
    state = ClusterState(DeviceConfig())
    state.upsert_node("n1", (gpu("GPU-1"),))
    reserved = PodAllocation(KEY, "n1", (DeviceAlloc("GPU-1", 3000, 10),), ())
    state.assume(reserved)
    return state, reserved


def test_the_same_devices_are_confirmed_in_place_with_the_pods_own_record() -> None:
    state, reserved = _state()
    before, clock = state.usage_snapshot(), state.usage_clock
    own = dataclasses.replace(reserved, devices_written="GPU-1,NVIDIA,3000,10:;", uid="u-p")
    state.confirm(own)
    assert state.allocation(KEY) is own and not state.is_assumed(KEY)
    assert state.usage_clock == clock and state.usage_snapshot() == before
    assert not state.forget(KEY)


def test_anything_else_is_recorded_in_full() -> None:
    for change in (
        {"priority": 7},  # the device ledger ranks by it
        {"devices": (DeviceAlloc("GPU-1", 2000, 10),)},
        {"key": "default/other"},  # no such reservation
    ):
        state, reserved = _state()
        clock = state.usage_clock
        other = dataclasses.replace(reserved, **change)  # type: ignore[arg-type]
        state.confirm(other)
        assert state.allocation(other.key) is other and not state.is_assumed(other.key)
        assert state.usage_clock > clock, change
