"""Codec of ``hami.io/node-nvidia-register``: one JSON object per GPU of a node.

Encoding is byte-exact with the contract (compact JSON, fixed key order, zero values
written). Decoding accepts HAMi's encoder too, which omits zero/false fields.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, cast

from api.errors import InvalidAnnotationError, short_repr
from api.hami.keys import GPU_MODES, NODE_REGISTER, GpuMode, parse_gpu_mode


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


def encode(devices: list[GpuDevice] | tuple[GpuDevice, ...]) -> str:
    return json.dumps([_device_json(d) for d in devices], separators=(",", ":"))


def _device_json(d: GpuDevice) -> dict[str, object]:
    out: dict[str, object] = {
        "id": d.id,
        "index": d.index,
        "count": d.count,
        "devmem": d.devmem,
        "devcore": d.devcore,
        "type": d.type,
        "numa": d.numa,
        "health": d.health,
        "mode": d.mode,
    }
    if d.mig_profiles:
        out["migProfiles"] = [
            {
                "name": p.name,
                "memoryMB": p.memory_mb,
                "core": p.core,
                "sliceCount": p.slice_count,
                "placements": [{"start": pl.start, "size": pl.size} for pl in p.placements],
            }
            for p in d.mig_profiles
        ]
    return out


def decode(value: str, *, obj: str = "") -> tuple[GpuDevice, ...]:
    """Decode and validate; raises InvalidAnnotationError naming the GPU and field."""

    def bad(problem: str) -> InvalidAnnotationError:
        return InvalidAnnotationError(NODE_REGISTER, problem, obj=obj)

    try:
        raw = json.loads(value)
    except (ValueError, RecursionError) as e:  # ValueError: also ints over 4300 digits
        raise bad(f"not valid JSON ({e})") from e
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

    def __init__(self, raw: dict[str, Any], where: str, bad: Any) -> None:
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


def _decode_profiles(raw: object, where: str, bad: Any) -> tuple[MigProfile, ...]:
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
