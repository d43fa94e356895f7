"""Codec of ``hami.io/node-nvidia-register``: one JSON object per GPU of a node.

Encoding is byte-exact with HAMi v2.10's device plugin (compact JSON, its struct's key order,
zero, false and empty fields left out). Decoding accepts every form a HAMi <= v2.10 plugin or an
earlier Tessera wrote: zero fields written or left out, v2.8/v2.9's trailing
``"devicepairscore":{}`` (unknown keys are ignored), ``"mode":"mps"``, a missing mode
(hami-core).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from api.errors import short_repr
from api.hami.jsonvalue import Bad, annotation_errors, load_json
from api.hami.keys import GPU_MODES, MPS_MAX_CLIENTS, NODE_REGISTER, GpuMode, parse_gpu_mode


@dataclass(frozen=True, order=True)
class Placement:
    """Half-open interval ``[start, start+size)`` of memory slices of one GPU."""

    start: int
    size: int

    @property
    def end(self) -> int:
        return self.start + self.size

    @property
    def mask(self) -> int:
        return ((1 << self.size) - 1) << self.start


@dataclass(frozen=True)
class MigProfile:
    """A MIG profile as NVML resolved it on one GPU (node-local facts)."""

    name: str
    memory_mb: int
    core: int
    slice_count: int
    placements: tuple[Placement, ...]


@dataclass(frozen=True)
class GpuDevice:
    """One physical GPU as the node agent registers it."""

    id: str
    index: int
    count: int
    devmem: int
    devcore: int
    type: str
    numa: int
    health: bool
    mode: GpuMode
    mig_profiles: tuple[MigProfile, ...] = ()


def registered_type(name: str) -> str:
    """The GPU type a node registers for NVML's device name: HAMi's, which prefixes a name
    that does not start with ``NVIDIA`` (``Tesla T4`` -> ``NVIDIA-Tesla T4``), so selectors
    written against HAMi's register (``nvidia.com/use-gputype``) match the same GPUs."""
    return name if name.startswith("NVIDIA") else f"NVIDIA-{name}"


def registered_count(mode: GpuMode, split_count: int, instance_counts: Sequence[int] = ()) -> int:
    """The ``count`` (slots) a GPU registers, as HAMi's device plugin: ``deviceSplitCount``;
    on an mps GPU at most ``MPS_MAX_CLIENTS`` (one daemon serves no more); on a mig GPU the
    most instances any of its registered profiles (``instance_counts``) allows (7 on an A100
    with 1g.5gb allowed), ``deviceSplitCount`` while it has none."""
    if mode == "mig" and instance_counts:
        return max(instance_counts)
    return min(split_count, MPS_MAX_CLIENTS) if mode == "mps" else split_count


def encode(devices: list[GpuDevice] | tuple[GpuDevice, ...]) -> str:
    """The bytes HAMi's device plugin writes for the same GPUs: Go ``encoding/json`` of its
    ``DeviceInfo`` list, keys in struct order, every field ``omitempty``."""
    text = json.dumps([_device_json(d) for d in devices], separators=(",", ":"), ensure_ascii=False)
    return text.translate(_GO_ESCAPES)


# Go's encoder writes UTF-8 as is, but escapes these (HTML-safe JSON); they occur in strings only.
_GO_ESCAPES = str.maketrans(
    {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}
)


def _device_json(d: GpuDevice) -> dict[str, object]:
    out: dict[str, object] = {"id": d.id}
    # (key, value) in HAMi's struct order; zero values (0, "", false, no profiles) are left out.
    fields: tuple[tuple[str, object], ...] = (
        ("index", d.index),
        ("count", d.count),
        ("devmem", d.devmem),
        ("devcore", d.devcore),
        ("type", d.type),
        ("numa", d.numa),
        ("mode", d.mode),
        ("migProfiles", [_profile_json(p) for p in d.mig_profiles]),
        ("health", d.health),
    )
    out.update((key, value) for key, value in fields if value)
    return out


def _profile_json(p: MigProfile) -> dict[str, object]:
    return {
        "name": p.name,
        "memoryMB": p.memory_mb,
        "core": p.core,
        "sliceCount": p.slice_count,
        "placements": [{"start": pl.start, "size": pl.size} for pl in p.placements],
    }


def decode(value: str, *, obj: str = "") -> tuple[GpuDevice, ...]:
    """Decode and validate; raises InvalidAnnotationError naming the GPU and field."""

    bad = annotation_errors(NODE_REGISTER, obj)
    raw = load_json(value, bad)
    if not isinstance(raw, list):
        raise bad("must be a JSON array with one object per GPU")
    devices: list[GpuDevice] = []
    seen_ids: set[str] = set()
    seen_index: set[int] = set()
    for i, item in enumerate(raw):
        where = f"GPU [{i}]"
        if not isinstance(item, dict):
            raise bad(f"{where} must be an object")
        f = _Fields(cast("dict[str, Any]", item), where, bad)
        dev_id = f.string("id", required=True)
        mode_raw = f.string("mode") or "hami-core"
        mode = parse_gpu_mode(mode_raw)
        if mode is None:
            raise bad(f"{where}.mode {short_repr(mode_raw)} is not one of {', '.join(GPU_MODES)}")
        dev = GpuDevice(
            id=dev_id,
            index=f.integer("index", minimum=0),
            count=f.integer("count", minimum=1, required=True),
            devmem=f.integer("devmem", minimum=1, required=True),
            devcore=f.integer("devcore", minimum=1, required=True),
            type=f.string("type"),
            numa=f.integer("numa", minimum=0),
            health=f.boolean("health"),
            mode=mode,
            mig_profiles=_decode_profiles(item.get("migProfiles"), where, bad),
        )
        if dev.id in seen_ids:
            raise bad(f"{where}.id {short_repr(dev.id)} appears twice")
        if dev.index in seen_index:
            raise bad(f"{where}.index {dev.index} appears twice")
        seen_ids.add(dev.id)
        seen_index.add(dev.index)
        devices.append(dev)
    return tuple(devices)


class _Fields:
    """Typed field access with HAMi's omit-zero convention and precise error paths."""

    def __init__(self, raw: dict[str, Any], where: str, bad: Bad) -> None:
        self.raw = raw
        self.where = where
        self.bad = bad

    def integer(self, key: str, *, minimum: int, required: bool = False) -> int:
        v = self.raw.get(key)
        if v is None:
            if required:
                raise self.bad(f"{self.where}.{key} is missing")
            return 0
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.bad(f"{self.where}.{key} must be an integer, got {short_repr(v)}")
        if v < minimum or v > 2**31 - 1:
            raise self.bad(f"{self.where}.{key} = {v} is out of range (>= {minimum})")
        return v

    def string(self, key: str, *, required: bool = False) -> str:
        v = self.raw.get(key)
        if v is None or v == "":
            if required:
                raise self.bad(f"{self.where}.{key} is missing")
            return ""
        if not isinstance(v, str):
            raise self.bad(f"{self.where}.{key} must be a string, got {short_repr(v)}")
        return v

    def boolean(self, key: str) -> bool:
        v = self.raw.get(key, False)
        if not isinstance(v, bool):
            raise self.bad(f"{self.where}.{key} must be true or false, got {short_repr(v)}")
        return v


def _decode_profiles(raw: object, where: str, bad: Bad) -> tuple[MigProfile, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise bad(f"{where}.migProfiles must be an array")
    out: list[MigProfile] = []
    names: set[str] = set()
    for j, p in enumerate(raw):
        pw = f"{where}.migProfiles[{j}]"
        if not isinstance(p, dict):
            raise bad(f"{pw} must be an object")
        f = _Fields(cast("dict[str, Any]", p), pw, bad)
        name = f.string("name", required=True)
        if name in names:
            raise bad(f"{pw}.name {short_repr(name)} appears twice")
        names.add(name)
        pls_raw = p.get("placements")
        if not isinstance(pls_raw, list) or not pls_raw:
            raise bad(f"{pw}.placements must be a non-empty array")
        placements: list[Placement] = []
        for k, pl in enumerate(pls_raw):
            if not isinstance(pl, dict):
                raise bad(f"{pw}.placements[{k}] must be an object")
            pf = _Fields(cast("dict[str, Any]", pl), f"{pw}.placements[{k}]", bad)
            placement = Placement(
                pf.integer("start", minimum=0), pf.integer("size", minimum=1, required=True)
            )
            if placement.end > 16:
                raise bad(f"{pw}.placements[{k}] ends at slice {placement.end}, beyond 16")
            placements.append(placement)
        if len(set(placements)) != len(placements):
            raise bad(f"{pw}.placements has duplicates")
        out.append(
            MigProfile(
                name=name,
                memory_mb=f.integer("memoryMB", minimum=1, required=True),
                core=f.integer("core", minimum=1, required=True),
                slice_count=f.integer("sliceCount", minimum=1, required=True),
                placements=tuple(placements),
            )
        )
    return tuple(out)
