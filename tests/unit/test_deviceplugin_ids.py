"""Kubelet device ids: ``<gpu-uuid>-<slot>``, the advertised list and the preferred choice."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from api.errors import InvalidInputError
from node_agent.deviceplugin.ids import (
    InvalidDeviceIdError,
    SlotInventory,
    device_id,
    gpu_of,
    plugin_devices,
    prefer_gpus,
    prefer_spread,
)
from node_agent.deviceplugin.types import PluginDevice
from tests.builders import gpu

UUID_A = "GPU-8a3c1d2e-0b1f-4e5a-9c7d-1234567890ab"
UUID_B = "GPU-0f0e0d0c-1111-2222-3333-444455556666"
UUID_C = "GPU-c0ffee00-aaaa-bbbb-cccc-ddddeeeeffff"


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        (f"{UUID_A}-0", (UUID_A, 0)),
        (f"{UUID_A}-9", (UUID_A, 9)),
        (f"{UUID_A}-10", (UUID_A, 10)),
        (
            "MIG-5b6f2f9e-1b2c-5d3e-8f4a-0123456789ab-3",
            ("MIG-5b6f2f9e-1b2c-5d3e-8f4a-0123456789ab", 3),
        ),
        ("gpu0-1", ("gpu0", 1)),
        ("a--2", ("a-", 2)),  # not a negative slot: the uuid part may end in a dash
    ],
)
def test_gpu_of_splits_at_the_last_dash(device: str, expected: tuple[str, int]) -> None:
    assert gpu_of(device) == expected


@pytest.mark.parametrize(
    "device",
    [
        "",
        "GPU-abc",  # no slot: "abc" is not decimal
        UUID_A,  # ends in hex, not a slot
        f"{UUID_A}-",  # empty slot
        "-0",  # empty uuid
        f"{UUID_A}-01",  # non-canonical slot
        f"{UUID_A}-+1",
        f"{UUID_A}-1 ",
        "GPU x-1",
        f"{UUID_A}-\u0661",  # Arabic-Indic digit one
        f"{UUID_A}-1\n",
    ],
)
def test_gpu_of_rejects_malformed_ids_with_a_clear_error(device: str) -> None:
    with pytest.raises(InvalidDeviceIdError, match=r"expected <gpu-uuid>-<slot>") as info:
        gpu_of(device)
    assert info.value.device_id == device
    assert isinstance(info.value, InvalidInputError)


@given(
    uuid=st.text(
        alphabet=st.characters(codec="ascii", categories=["L", "N", "Pd"]), min_size=1
    ).filter(lambda s: not s.isspace()),
    slot=st.integers(min_value=0, max_value=10_000),
)
def test_gpu_of_inverts_device_id(uuid: str, slot: int) -> None:
    assert gpu_of(device_id(uuid, slot)) == (uuid, slot)


@pytest.mark.parametrize(("uuid", "slot"), [("", 0), ("GPU a", 0), (UUID_A, -1)])
def test_device_id_rejects_bad_parts(uuid: str, slot: int) -> None:
    with pytest.raises(InvalidInputError):
        device_id(uuid, slot)


def test_plugin_devices_one_per_slot_with_gpu_health_and_numa() -> None:
    devices = plugin_devices(
        [gpu(UUID_A, count=2, numa=0), gpu(UUID_B, index=1, count=3, numa=1, healthy=False)]
    )
    assert devices == (
        PluginDevice(f"{UUID_A}-0", True, 0),
        PluginDevice(f"{UUID_A}-1", True, 0),
        PluginDevice(f"{UUID_B}-0", False, 1),
        PluginDevice(f"{UUID_B}-1", False, 1),
        PluginDevice(f"{UUID_B}-2", False, 1),
    )


def test_plugin_devices_of_a_gpu_without_slots_is_empty() -> None:
    assert plugin_devices([gpu(UUID_A, count=0)]) == ()


def ids(uuid: str, *slots: int) -> list[str]:
    return [f"{uuid}-{s}" for s in slots]


@pytest.mark.parametrize(
    ("available", "must_include", "size", "expected"),
    [
        pytest.param(
            ids(UUID_A, 0, 1, 2) + ids(UUID_B, 0, 1),
            [],
            2,
            [f"{UUID_A}-0", f"{UUID_B}-0"],
            id="two-devices-land-on-two-gpus",
        ),
        pytest.param(
            ids(UUID_A, 0) + ids(UUID_B, 0, 1, 2),
            [],
            1,
            [f"{UUID_B}-0"],
            id="first-pick-is-the-gpu-with-most-free-slots",
        ),
        pytest.param(
            ids(UUID_A, 0, 1) + ids(UUID_B, 0, 1),
            [],
            1,
            [f"{UUID_A}-0"],
            id="tie-goes-to-first-gpu-in-available",
        ),
        pytest.param(
            ids(UUID_A, 0, 1, 2) + ids(UUID_B, 0, 1) + ids(UUID_C, 5),
            [f"{UUID_A}-2"],
            3,
            [f"{UUID_A}-2", f"{UUID_B}-0", f"{UUID_C}-5"],
            id="must-include-first-then-other-gpus",
        ),
        pytest.param(
            ids(UUID_A, 3, 1, 2),
            [],
            2,
            [f"{UUID_A}-1", f"{UUID_A}-2"],
            id="one-gpu-lowest-slots-first",
        ),
        pytest.param(
            ids(UUID_A, 0, 1) + ids(UUID_B, 0),
            [],
            3,
            [f"{UUID_A}-0", f"{UUID_B}-0", f"{UUID_A}-1"],
            id="second-round-after-every-gpu-used-once",
        ),
        pytest.param(
            ids(UUID_A, 0),
            [],
            2,
            [f"{UUID_A}-0"],
            id="fewer-than-asked-when-not-enough",
        ),
        pytest.param(
            ids(UUID_A, 0, 1),
            [f"{UUID_B}-1", f"{UUID_B}-1"],
            1,
            [f"{UUID_B}-1"],
            id="must-include-deduplicated-and-kept-even-if-not-available",
        ),
    ],
)
def test_prefer_spread(
    available: list[str], must_include: list[str], size: int, expected: list[str]
) -> None:
    assert prefer_spread(available, must_include, size) == expected


def test_prefer_spread_rejects_malformed_available_id() -> None:
    with pytest.raises(InvalidDeviceIdError, match="'nope'"):
        prefer_spread(["nope"], [], 1)


@pytest.mark.parametrize(
    ("available", "must_include", "size", "gpus", "expected"),
    [
        pytest.param(
            ids(UUID_A, 0, 1) + ids(UUID_B, 2, 0, 1),
            [],
            1,
            {UUID_B: 1},
            [f"{UUID_B}-0"],
            id="the-reserved-gpu-not-the-spread-choice",
        ),
        pytest.param(
            ids(UUID_A, 0, 1) + ids(UUID_B, 0, 1),
            [],
            2,
            {UUID_A: 2},
            [f"{UUID_A}-0", f"{UUID_A}-1"],
            id="two-devices-on-one-gpu-stay-on-it",
        ),
        pytest.param(
            ids(UUID_A, 0, 1) + ids(UUID_B, 0, 1) + ids(UUID_C, 0),
            [],
            2,
            {UUID_C: 1, UUID_B: 1},
            [f"{UUID_B}-0", f"{UUID_C}-0"],
            id="several-gpus-in-available-order",
        ),
        pytest.param(
            ids(UUID_A, 0, 1) + ids(UUID_B, 0, 1),
            [f"{UUID_B}-1"],
            2,
            {UUID_B: 2},
            [f"{UUID_B}-1", f"{UUID_B}-0"],
            id="must-include-counts-toward-its-gpu",
        ),
        pytest.param(
            ids(UUID_A, 0, 1) + ids(UUID_B, 0),
            [],
            2,
            {UUID_B: 2},
            [f"{UUID_B}-0", f"{UUID_A}-0"],
            id="short-gpu-filled-by-spread",
        ),
        pytest.param(
            ids(UUID_A, 0),
            [],
            1,
            {UUID_C: 1},
            [f"{UUID_A}-0"],
            id="gpu-not-offered-falls-back-to-spread",
        ),
    ],
)
def test_prefer_gpus(
    available: list[str],
    must_include: list[str],
    size: int,
    gpus: dict[str, int],
    expected: list[str],
) -> None:
    assert prefer_gpus(available, must_include, size, gpus) == expected


def test_prefer_gpus_rejects_malformed_ids() -> None:
    with pytest.raises(InvalidDeviceIdError):
        prefer_gpus(["nope"], [], 1, {UUID_A: 1})


def test_slot_inventory_bumps_version_only_on_change() -> None:
    inv = SlotInventory([gpu(UUID_A, count=2)])
    assert inv.version() == 0
    assert not inv.update([gpu(UUID_A, count=2)])
    assert inv.version() == 0
    assert inv.update([gpu(UUID_A, count=2, healthy=False)])
    assert inv.version() == 1
    assert [d.healthy for d in inv.devices()] == [False, False]


def test_slot_inventory_wait_changed_times_out_or_wakes_on_update() -> None:
    inv = SlotInventory([gpu(UUID_A, count=1)])
    assert inv.wait_changed(0, timeout=0.01) == 0
    updater = threading.Timer(0.05, inv.update, args=([gpu(UUID_A, count=1, numa=1)],))
    updater.start()
    try:
        assert inv.wait_changed(0, timeout=5) == 1
    finally:
        updater.join()
    assert inv.wait_changed(0, timeout=0) == 1  # already newer: no wait
