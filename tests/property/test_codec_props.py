"""Wire codecs: encode∘decode is identity, HAMi's omit-zero form reads the same, and no
input, however mangled, raises anything but InvalidAnnotationError."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from api.errors import InvalidAnnotationError
from api.hami.catalog import MODELS
from api.hami.devices import (
    DeviceAlloc,
    MigAllocation,
    RuntimeIdentity,
    decode_bind_phase,
    decode_bind_time,
    decode_devices,
    decode_mig_allocations,
    encode_devices,
    encode_mig_allocations,
)
from api.hami.keys import GPU_MODES
from api.hami.register import GpuDevice, MigProfile, Placement
from api.hami.register import decode as decode_register
from api.hami.register import encode as encode_register

relaxed = settings(deadline=None, max_examples=200)

INT32 = 2**31 - 1
uuids = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9_.\-]{0,40}\Z")
gpu_uuids = st.one_of(uuids, st.uuids().map(lambda u: f"GPU-{u}"))

# ----- strategies of valid values ----------------------------------------------------------


@st.composite
def placements(draw: st.DrawFn) -> tuple[Placement, ...]:
    size = draw(st.integers(1, 16))
    starts = draw(st.sets(st.integers(0, 16 - size), min_size=1, max_size=8))
    return tuple(Placement(s, size) for s in sorted(starts))


mig_profiles_random = st.builds(
    MigProfile,
    name=st.text(min_size=1, max_size=12),
    memory_mb=st.integers(1, INT32),
    core=st.integers(1, INT32),
    slice_count=st.integers(1, INT32),
    placements=placements(),
)
_CATALOG_PROFILES = [m.mig_profile(p) for m in MODELS for p in m.profiles]


@st.composite
def profile_lists(draw: st.DrawFn) -> tuple[MigProfile, ...]:
    profiles = draw(
        st.lists(
            st.one_of(st.sampled_from(_CATALOG_PROFILES), mig_profiles_random),
            max_size=6,
            unique_by=lambda p: p.name,
        )
    )
    return tuple(profiles)


@st.composite
def gpu_device_lists(draw: st.DrawFn) -> tuple[GpuDevice, ...]:
    n = draw(st.integers(0, 6))
    ids = draw(
        st.lists(
            st.one_of(gpu_uuids, st.text(min_size=1, max_size=20)),
            min_size=n,
            max_size=n,
            unique=True,
        )
    )
    indexes = draw(st.lists(st.integers(0, INT32), min_size=n, max_size=n, unique=True))
    out: list[GpuDevice] = []
    for dev_id, index in zip(ids, indexes, strict=True):
        mode = draw(st.sampled_from(GPU_MODES))
        out.append(
            GpuDevice(
                id=dev_id,
                index=index,
                count=draw(st.integers(1, INT32)),
                devmem=draw(st.integers(1, INT32)),
                devcore=draw(st.integers(1, INT32)),
                type=draw(st.one_of(st.sampled_from([m.name for m in MODELS]), st.text())),
                numa=draw(st.integers(0, INT32)),
                health=draw(st.booleans()),
                mode=mode,
                mig_profiles=draw(profile_lists()) if draw(st.booleans()) else (),
            )
        )
    return tuple(out)


vendors = st.text(st.characters(exclude_characters=",:;"), min_size=1, max_size=10)
device_allocs = st.builds(
    DeviceAlloc,
    uuid=gpu_uuids,
    mem=st.integers(0, INT32),
    cores=st.integers(0, 100),
    vendor=st.one_of(st.just("NVIDIA"), vendors),
)
pod_devices = st.lists(st.lists(device_allocs, max_size=4).map(tuple), max_size=5).map(tuple)

runtime_identities = st.builds(
    RuntimeIdentity,
    mig_uuid=st.uuids().map(lambda u: f"MIG-{u}"),
    gpu_instance_id=st.integers(0, INT32),
    compute_instance_id=st.integers(0, INT32),
)


@st.composite
def mig_allocation_lists(draw: st.DrawFn) -> tuple[MigAllocation, ...]:
    slots = draw(
        st.lists(st.tuples(st.integers(0, INT32), st.integers(0, INT32)), max_size=6, unique=True)
    )
    out: list[MigAllocation] = []
    for ci, di in slots:
        size = draw(st.integers(1, 16))
        out.append(
            MigAllocation(
                container_index=ci,
                device_index=di,
                gpu_uuid=draw(gpu_uuids),
                profile=draw(st.text(min_size=1, max_size=12)),
                placement=Placement(draw(st.integers(0, 16 - size)), size),
                runtime=draw(st.none() | runtime_identities),
            )
        )
    return tuple(out)


# ----- encode∘decode and decode∘encode ---------------------------------------------------------


@relaxed
@given(gpu_device_lists())
def test_node_register_round_trips(devices: tuple[GpuDevice, ...]) -> None:
    text = encode_register(devices)
    assert decode_register(text) == devices
    assert encode_register(decode_register(text)) == text


@relaxed
@given(pod_devices)
def test_devices_annotation_round_trips(devices: tuple[tuple[DeviceAlloc, ...], ...]) -> None:
    text = encode_devices(devices)
    assert decode_devices(text) == devices
    assert encode_devices(decode_devices(text)) == text


@relaxed
@given(mig_allocation_lists())
def test_mig_allocations_round_trip(allocs: tuple[MigAllocation, ...]) -> None:
    text = encode_mig_allocations(allocs)
    assert decode_mig_allocations(text) == allocs
    assert encode_mig_allocations(decode_mig_allocations(text)) == text


def test_empty_containers_are_kept() -> None:
    assert decode_devices(";;") == ((), ())
    assert encode_devices(((), (DeviceAlloc("GPU-a", 3000, 0),), ())) == ";GPU-a,NVIDIA,3000,0:;;"


# ----- HAMi's omit-zero encoding ---------------------------------------------------------------

# Runtime identity fields are never omitted: a missing one makes a partial (invalid) identity.
_NEVER_OMITTED = frozenset({"gpuInstanceID", "computeInstanceID", "migUUID"})


def _omit_zero(value: Any, drop: st.DataObject) -> Any:
    """Drop zero/false/empty fields as Go's ``omitempty`` does; each one independently."""
    if isinstance(value, list):
        return [_omit_zero(v, drop) for v in value]
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            zero = v in (0, "", [], {}) or v is False
            if zero and k not in _NEVER_OMITTED and drop.draw(st.booleans(), label=f"omit {k}"):
                continue
            out[k] = _omit_zero(v, drop)
        return out
    return value


def _hami_form(canonical: str, data: st.DataObject) -> str:
    # HAMi's Go encoder also writes spaces nowhere, but readers must not care about layout.
    indent = data.draw(st.sampled_from([None, 1]), label="indent")
    return json.dumps(_omit_zero(json.loads(canonical), data), indent=indent)


@relaxed
@given(gpu_device_lists(), st.data())
def test_node_register_reads_hami_omit_zero_form(
    devices: tuple[GpuDevice, ...], data: st.DataObject
) -> None:
    assert decode_register(_hami_form(encode_register(devices), data)) == devices


@relaxed
@given(mig_allocation_lists(), st.data())
def test_mig_allocations_read_hami_omit_zero_form(
    allocs: tuple[MigAllocation, ...], data: st.DataObject
) -> None:
    assert decode_mig_allocations(_hami_form(encode_mig_allocations(allocs), data)) == allocs


def test_hami_example_without_zero_fields() -> None:
    got = decode_register(
        '[{"id":"GPU-1","count":10,"devmem":40960,"devcore":100,"type":"NVIDIA A100-PCIE-40GB",'
        '"health":true,"mode":"mig","migProfiles":[{"name":"2g.10gb","memoryMB":9984,"core":29,'
        '"sliceCount":2,"placements":[{"size":2},{"start":2,"size":2}]}]}]'
    )
    assert (got[0].index, got[0].numa) == (0, 0)
    assert got[0].mig_profiles[0].placements == (Placement(0, 2), Placement(2, 2))
    mig = decode_mig_allocations('[{"gpuUUID":"GPU-1","profile":"1g.5gb","placement":{"size":1}}]')
    assert mig == (MigAllocation(0, 0, "GPU-1", "1g.5gb", Placement(0, 1)),)


# ----- garbage never raises anything but InvalidAnnotationError ----------------------------------

_DECODERS: dict[str, Callable[[str], object]] = {
    "register": decode_register,
    "devices": decode_devices,
    "mig": decode_mig_allocations,
    "bind-time": decode_bind_time,
    "bind-phase": decode_bind_phase,
}


_UUID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")


def _decodes_or_rejects(which: str, text: str) -> None:
    """Either InvalidAnnotationError, or a value that is well-formed and re-encodes."""
    try:
        value = _DECODERS[which](text)
    except InvalidAnnotationError:
        return
    if which == "register":
        assert isinstance(value, tuple)
        assert decode_register(encode_register(value)) == value
    elif which == "devices":
        assert isinstance(value, tuple)
        assert decode_devices(encode_devices(value)) == value
        assert all(_UUID.fullmatch(d.uuid) for c in value for d in c), value
    elif which == "mig":
        assert isinstance(value, tuple)
        assert decode_mig_allocations(encode_mig_allocations(value)) == value
        assert all(_UUID.fullmatch(m.gpu_uuid) for m in value), value


def _containers(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    _containers,
    max_leaves=8,
)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    elif isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    return out


def _mutate_json(value: Any, data: st.DataObject) -> Any:
    """Replace or delete the value at one random path of a JSON document."""
    path = data.draw(st.sampled_from(_paths(value)), label="path")
    new = data.draw(json_values, label="new value")
    if not path:
        return new
    parent = value
    for p in path[:-1]:
        parent = parent[p]
    if isinstance(parent, dict) and data.draw(st.booleans(), label="delete"):
        del parent[path[-1]]
    else:
        parent[path[-1]] = new
    return value


def _mutate_text(text: str, data: st.DataObject) -> str:
    for _ in range(data.draw(st.integers(1, 4), label="edits")):
        i = data.draw(st.integers(0, len(text)), label="at")
        j = data.draw(st.integers(i, min(len(text), i + 4)), label="to")
        text = text[:i] + data.draw(st.text(max_size=4), label="insert") + text[j:]
    return text


# Strings that break naive decoders: unicode digits int() refuses, huge JSON integers, trailing
# newlines regexes with '$' let through, deep nesting.
_NASTY = [
    "\u00b2",
    "\u0663",
    "\n",
    "1" * 5000,
    "[" * 5000,
    "1e999",
    "NaN",
    "-0",
    "\ufeff",
    "\x00",
]


@relaxed
@given(st.sampled_from(sorted(_DECODERS)), st.text())
def test_random_text_is_rejected_cleanly(which: str, text: str) -> None:
    _decodes_or_rejects(which, text)


@relaxed
@given(
    st.sampled_from(sorted(_DECODERS)),
    st.lists(st.sampled_from(_NASTY) | st.text(max_size=3), max_size=4).map("".join),
)
def test_nasty_fragments_are_rejected_cleanly(which: str, text: str) -> None:
    _decodes_or_rejects(which, text)


@relaxed
@given(gpu_device_lists(), mig_allocation_lists(), pod_devices, st.data())
def test_mutated_valid_values_are_rejected_cleanly(
    devices: tuple[GpuDevice, ...],
    allocs: tuple[MigAllocation, ...],
    pod_devs: tuple[tuple[DeviceAlloc, ...], ...],
    data: st.DataObject,
) -> None:
    register = encode_register(devices)
    mig = encode_mig_allocations(allocs)
    for which, canonical in (("register", register), ("mig", mig)):
        _decodes_or_rejects(which, json.dumps(_mutate_json(json.loads(canonical), data)))
        _decodes_or_rejects(which, _mutate_text(canonical, data))
    devs = encode_devices(pod_devs)
    _decodes_or_rejects("devices", _mutate_text(devs, data))
    nasty = data.draw(st.sampled_from(_NASTY), label="nasty")
    fields = devs.split(",")
    i = data.draw(st.integers(0, len(fields) - 1), label="field")
    fields[i] = nasty
    _decodes_or_rejects("devices", ",".join(fields))
