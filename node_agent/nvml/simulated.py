"""Simulated NVML: the catalog's MIG geometry, as strict as the hardware.

Serves ``api.hami.catalog`` facts through the ``NvmlBackend`` interface and refuses
what a real GPU refuses: an illegal placement (InvalidArgument), an overlap or a full
profile (InsufficientResources), MIG calls with MIG disabled (NotSupported; possible
placements excepted, as on hardware), destroying an instance that still has compute
instances or processes (InUse), unknown ids (NotFound), calls outside a session
(Uninitialized). State survives an agent restart through an optional JSON file, written
atomically after every mutation and read on ``init``.

Ids follow what NVML shows (see ``shared/reference/mig-geometry.md``):

- GPU instance id = the placement's node in the binary tree of memory-slice halves:
  ``2**level - 1 + start // size`` with ``level = log2(slices_of_gpu / size)``. On 8-slice
  GPUs this gives the observed 7g→0, 2g at 0/2/4→3/4/5, 1g at s→7+s, and 3g/4g→1 at start
  0, 2 at start 4 (inferred; "3g → 1 or 2" is what was observed, and it matches whenever
  the 3g instances were created in start order). On the RTX PRO 6000 (12 slices) it gives
  the observed 1g at 0/3/6/9→3/4/5/6 and 2g at 0→1, and 2g at 6→2 (inferred); on the A30
  (4 slices) 4g→0, 2g at 0/2→1/2, 1g at s→3+s (inferred, by analogy).
- Compute instance ids: the lowest free id, so the single full-size CI is 0. A CI's
  profile id equals its profile index (true of NVML's CI profiles).
- MIG device UUIDs hash (GPU UUID, GI id, a per-GPU creation counter): stable for one
  instance, different for a re-created one.

Test hook (fault tests only): with ``TESSERA_SIMULATED_NVML_HOLD_DIR`` set in the kwok node
agent's environment, ``CreationHold`` pauses every compute instance creation while the file
``hold`` exists in that directory (the GPU instance exists and is persisted, its compute
instance not yet), after writing ``held-<node>``: a test can kill the agent in the middle of a
MIG creation. Unset (always, outside tests), nothing pauses.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import orjson

from api.hami.catalog import (
    GpuModel,
    ProfileFact,
    find_model,
    simulated_gpu_uuid,
    simulated_numa,
)
from api.hami.register import Placement
from node_agent.nvml.backend import (
    COMPUTE_INSTANCE_PROFILE_SLICES,
    GPU_INSTANCE_PROFILE_INDEXES,
    ComputeInstance,
    DeviceInfo,
    GpuInstance,
    GpuInstanceProfileInfo,
    MigMode,
    NvmlBackend,
    SessionGate,
    describe_placement,
)
from node_agent.nvml.errors import (
    InsufficientResources,
    InUse,
    InvalidArgument,
    NotFound,
    NotSupported,
    NvmlError,
)
from node_agent.statefile import write_atomically

STATE_VERSION: Final = 1
HOLD_ENV: Final = "TESSERA_SIMULATED_NVML_HOLD_DIR"

# GI compute slices -> {CI compute slices: max CIs of that size} (MIG user guide).
_CI_LIMITS: Final[dict[int, dict[int, int]]] = {
    7: {1: 7, 2: 3, 3: 2, 4: 1, 7: 1},
    4: {1: 4, 2: 2, 4: 1},
    3: {1: 3, 2: 1, 3: 1},
    2: {1: 2, 2: 1},
    1: {1: 1},
}

_METHODS: Final = frozenset(n for n in dir(NvmlBackend) if not n.startswith("_"))


@dataclass(frozen=True)
class SimulatedGpuSpec:
    """One simulated GPU. ``uuid`` None: derived from the node name and index like the
    kwok nodes' (``simulated_gpu_uuid``); ``numa`` None: the catalog's rule for the node."""

    model_name: str
    uuid: str | None = None
    numa: int | None = None
    mig_enabled: bool = True  # ignored for models that are not MIG-capable
    healthy: bool = True


@dataclass(frozen=True)
class CreationHold:
    """Test-only pause between a MIG creation's GPU instance and its compute instance (see
    the module docstring)."""

    directory: Path
    poll_s: float = 0.05

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> CreationHold | None:
        value = (os.environ if env is None else env).get(HOLD_ENV, "")
        return cls(Path(value)) if value else None

    def wait(self, node: str, what: str) -> None:
        hold = self.directory / "hold"
        if not hold.exists():
            return
        # Atomic: a watcher that sees the marker reads it whole (write_text creates it empty
        # first, and a test polling for it read "" once).
        tmp = self.directory / f".held-{node}.tmp"
        tmp.write_text(what)
        tmp.replace(self.directory / f"held-{node}")
        while hold.exists():
            time.sleep(self.poll_s)


def gpu_instance_id(memory_slices: int, placement: Placement) -> int:
    """The GI id NVML gives an instance at ``placement`` (see the module docstring)."""
    ratio, rest = divmod(memory_slices, placement.size)
    if rest or ratio & (ratio - 1):
        raise ValueError(f"placement size {placement.size} does not halve {memory_slices} slices")
    level = ratio.bit_length() - 1
    return (1 << level) - 1 + placement.start // placement.size


def mig_uuid(gpu_uuid: str, gi_id: int, serial: int) -> str:
    h = hashlib.sha1(f"{gpu_uuid}/gi{gi_id}/{serial}".encode()).hexdigest()
    return f"MIG-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


@dataclass
class _Ci:
    id: int
    profile_index: int
    mig_uuid: str

    @property
    def slices(self) -> int:
        return COMPUTE_INSTANCE_PROFILE_SLICES[self.profile_index]


@dataclass
class _Gi:
    id: int
    profile: ProfileFact
    placement: Placement
    cis: dict[int, _Ci] = field(default_factory=dict)

    def view(self) -> GpuInstance:
        return GpuInstance(self.id, self.profile.profile_id, self.placement)


@dataclass
class _Gpu:
    index: int
    uuid: str
    model: GpuModel
    numa: int
    mig_enabled: bool
    healthy: bool
    serial: int = 0
    gis: dict[int, _Gi] = field(default_factory=dict)
    processes: dict[int, int | None] = field(default_factory=dict)  # pid -> GI id (None: GPU)

    def profile_by_id(self, profile_id: int) -> ProfileFact | None:
        return next((p for p in self.model.profiles if p.profile_id == profile_id), None)


class SimulatedNvml:
    """``NvmlBackend`` over simulated GPUs; thread-safe, one lock for all GPUs."""

    def __init__(
        self,
        gpus: list[SimulatedGpuSpec],
        state_file: Path | None = None,
        *,
        node_name: str = "tessera-sim",
        hold: CreationHold | None = None,
    ) -> None:
        self._state_file = state_file
        self._node_name = node_name
        self._hold = hold
        self._lock = threading.RLock()
        self._gate = SessionGate()
        self._faults: dict[str, deque[BaseException]] = {}
        self._gpus = [self._gpu_from_spec(i, s, node_name, len(gpus)) for i, s in enumerate(gpus)]
        # Each GPU's part of the state file, kept until an operation changes that GPU: the
        # kwok node agent persists every MIG operation, and an operation touches one GPU.
        self._json_of: list[bytes | None] = [None] * len(self._gpus)
        self._changes = 0  # operations that changed a GPU, state files loaded

    @property
    def changes(self) -> int:
        """How often the simulated hardware changed (a count, to tell whether it did since
        an earlier look): every operation that changed a GPU, every state file loaded. A
        simulated GPU changes only through this object."""
        with self._lock:
            return self._changes

    @staticmethod
    def _gpu_from_spec(index: int, spec: SimulatedGpuSpec, node: str, count: int) -> _Gpu:
        model = find_model(spec.model_name)
        return _Gpu(
            index=index,
            uuid=spec.uuid or simulated_gpu_uuid(node, index),
            model=model,
            numa=simulated_numa(index, count) if spec.numa is None else spec.numa,
            mig_enabled=spec.mig_enabled and model.mig_capable,
            healthy=spec.healthy,
        )

    # -- test hooks -------------------------------------------------------------------

    def fail_next(self, method_name: str, error: BaseException) -> None:
        """Make the next call of ``method_name`` raise ``error`` (queued, first in first out)."""
        if method_name not in _METHODS:
            raise ValueError(
                f"{method_name!r} is not an NvmlBackend method;"
                f" one of {', '.join(sorted(_METHODS))}"
            )
        with self._lock:
            self._faults.setdefault(method_name, deque()).append(error)

    def set_processes(self, index: int, pids: list[int], *, gi_id: int | None = None) -> None:
        """Replace the processes running on GPU ``index`` (or inside its GI ``gi_id``)."""
        with self._lock:
            gpu = self._gpu(index, f"set processes on GPU {index}")
            if gi_id is not None and gi_id not in gpu.gis:
                raise NotFound(
                    f"set processes in GPU instance {gi_id} on GPU {index}", "no such GI"
                )
            gpu.processes = {p: g for p, g in gpu.processes.items() if g != gi_id}
            gpu.processes.update(dict.fromkeys(pids, gi_id))
            self._persist(index)

    def set_health(self, index: int, healthy: bool) -> None:
        with self._lock:
            self._gpu(index, f"set health of GPU {index}").healthy = healthy
            self._persist(index)

    def state_snapshot(self) -> dict[str, Any]:
        """The full simulated state as the JSON document the state file holds."""
        with self._lock:
            state: dict[str, Any] = orjson.loads(self._state_bytes())
            return state

    # -- session ----------------------------------------------------------------------

    def init(self) -> None:
        def initialize() -> None:
            with self._lock:
                self._take_fault("init")
                if self._state_file is not None and self._state_file.exists():
                    self._load(self._state_file)

        self._gate.open(initialize)

    def shutdown(self) -> None:
        def finalize() -> None:
            with self._lock:
                self._take_fault("shutdown")

        self._gate.close(finalize)

    # -- queries ----------------------------------------------------------------------

    def device_count(self) -> int:
        with self._op("device_count", "count GPUs"):
            return len(self._gpus)

    def device(self, index: int) -> DeviceInfo:
        what = f"query GPU {index}"
        with self._op("device", what):
            g = self._gpu(index, what)
            return DeviceInfo(
                index=g.index,
                uuid=g.uuid,
                name=g.model.name,
                memory_mib=g.model.memory_mib,
                numa_node=g.numa,
                multiprocessor_count=g.model.multiprocessor_count,
                healthy=g.healthy,
            )

    def mig_mode(self, index: int) -> MigMode:
        what = f"query MIG mode of GPU {index}"
        with self._op("mig_mode", what):
            g = self._gpu(index, what)
            if not g.model.mig_capable:
                raise NotSupported(what, f"{g.model.name} does not support MIG", code=_NS)
            return MigMode(current=g.mig_enabled, pending=g.mig_enabled)

    def gpu_instance_profile_info(self, index: int, profile_index: int) -> GpuInstanceProfileInfo:
        what = f"query GPU instance profile index {profile_index} on GPU {index}"
        with self._op("gpu_instance_profile_info", what):
            g = self._mig_gpu(index, what)
            if profile_index not in GPU_INSTANCE_PROFILE_INDEXES:
                raise InvalidArgument(what, "not an NVML profile index (0..17)", code=_IA)
            fact = next((p for p in g.model.profiles if p.profile_index == profile_index), None)
            if fact is None:
                raise NotSupported(what, f"{g.model.name} has no such profile", code=_NS)
            return GpuInstanceProfileInfo(
                id=fact.profile_id,
                slice_count=fact.slice_count,
                instance_count=fact.instance_count,
                multiprocessor_count=fact.multiprocessor_count,
                memory_mib=fact.memory_mib,
                name=f"MIG {fact.name}",
            )

    def gpu_instance_possible_placements(self, index: int, profile_id: int) -> list[Placement]:
        what = f"list possible placements of GPU instance profile id {profile_id} on GPU {index}"
        with self._op("gpu_instance_possible_placements", what):
            g = self._gpu(index, what)
            if not g.model.mig_capable:  # works with MIG disabled, not on non-MIG GPUs
                raise NotSupported(what, f"{g.model.name} does not support MIG", code=_NS)
            return list(self._profile(g, profile_id, what).placements())

    def gpu_instances(self, index: int, profile_id: int | None = None) -> list[GpuInstance]:
        what = f"list GPU instances on GPU {index}"
        with self._op("gpu_instances", what):
            g = self._mig_gpu(index, what)
            if profile_id is not None:
                self._profile(g, profile_id, what)
            return sorted(
                gi.view()
                for gi in g.gis.values()
                if profile_id is None or gi.profile.profile_id == profile_id
            )

    def compute_instances(self, index: int, gi_id: int) -> list[ComputeInstance]:
        what = f"list compute instances of GPU instance {gi_id} on GPU {index}"
        with self._op("compute_instances", what):
            gi = self._gi(self._mig_gpu(index, what), gi_id, what)
            return sorted(ComputeInstance(c.id, gi.id, c.profile_index) for c in gi.cis.values())

    def mig_device_uuid(self, index: int, gi_id: int, ci_id: int) -> str:
        what = f"resolve MIG device of GPU instance {gi_id} compute instance {ci_id} on GPU {index}"
        with self._op("mig_device_uuid", what):
            return self._ci(self._gi(self._mig_gpu(index, what), gi_id, what), ci_id, what).mig_uuid

    def running_processes(self, index: int) -> list[int]:
        what = f"list processes on GPU {index}"
        with self._op("running_processes", what):
            return sorted(self._gpu(index, what).processes)

    # -- mutations --------------------------------------------------------------------

    def create_gpu_instance_with_placement(
        self, index: int, profile_id: int, placement: Placement
    ) -> GpuInstance:
        what = (
            f"create GPU instance of profile id {profile_id} at {describe_placement(placement)}"
            f" on GPU {index}"
        )
        with self._op("create_gpu_instance_with_placement", what):
            g = self._mig_gpu(index, what)
            fact = self._profile(g, profile_id, what)
            if placement not in fact.placements():
                legal = ", ".join(str(p.start) for p in fact.placements())
                raise InvalidArgument(
                    what,
                    f"{fact.name} may only start at {legal} with size {fact.placement_size}",
                    code=_IA,
                )
            same = [gi for gi in g.gis.values() if gi.profile.profile_id == profile_id]
            if len(same) >= fact.instance_count:
                raise InsufficientResources(
                    what,
                    f"{fact.name} allows {fact.instance_count} instance(s), all exist",
                    code=_IR,
                )
            for gi in g.gis.values():
                if gi.placement.mask & placement.mask:
                    raise InsufficientResources(
                        what,
                        f"overlaps GPU instance {gi.id} ({gi.profile.name} at"
                        f" {describe_placement(gi.placement)})",
                        code=_IR,
                    )
            gi = _Gi(gpu_instance_id(g.model.memory_slices, placement), fact, placement)
            g.gis[gi.id] = gi
            self._persist(index)
            return gi.view()

    def create_compute_instance(
        self, index: int, gi_id: int, ci_profile_index: int
    ) -> ComputeInstance:
        what = (
            f"create compute instance of profile index {ci_profile_index} in GPU instance"
            f" {gi_id} on GPU {index}"
        )
        if self._hold is not None:
            self._hold.wait(self._node_name, what)
        with self._op("create_compute_instance", what):
            g = self._mig_gpu(index, what)
            gi = self._gi(g, gi_id, what)
            slices = COMPUTE_INSTANCE_PROFILE_SLICES.get(ci_profile_index)
            if slices is None:
                raise InvalidArgument(what, "not an NVML compute instance profile index", code=_IA)
            limits = _CI_LIMITS.get(gi.profile.slice_count, {gi.profile.slice_count: 1})
            if slices not in limits:
                raise NotSupported(
                    what,
                    f"a {gi.profile.name} instance has no {slices}-slice compute profile",
                    code=_NS,
                )
            used = sum(c.slices for c in gi.cis.values())
            same = sum(1 for c in gi.cis.values() if c.slices == slices)
            if used + slices > gi.profile.slice_count or same >= limits[slices]:
                raise InsufficientResources(
                    what,
                    f"{used} of {gi.profile.slice_count} compute slices already in use",
                    code=_IR,
                )
            ci_id = next(i for i in range(len(gi.cis) + 1) if i not in gi.cis)
            g.serial += 1
            gi.cis[ci_id] = _Ci(ci_id, ci_profile_index, mig_uuid(g.uuid, gi.id, g.serial))
            self._persist(index)
            return ComputeInstance(ci_id, gi.id, ci_profile_index)

    def destroy_compute_instance(self, index: int, gi_id: int, ci_id: int) -> None:
        what = f"destroy compute instance {ci_id} of GPU instance {gi_id} on GPU {index}"
        with self._op("destroy_compute_instance", what):
            g = self._mig_gpu(index, what)
            gi = self._gi(g, gi_id, what)
            self._ci(gi, ci_id, what)
            self._refuse_if_busy(g, gi, what)
            del gi.cis[ci_id]
            self._persist(index)

    def destroy_gpu_instance(self, index: int, gi_id: int) -> None:
        what = f"destroy GPU instance {gi_id} on GPU {index}"
        with self._op("destroy_gpu_instance", what):
            g = self._mig_gpu(index, what)
            gi = self._gi(g, gi_id, what)
            if gi.cis:
                ids = ", ".join(str(i) for i in sorted(gi.cis))
                raise InUse(what, f"compute instance(s) {ids} still exist", code=_IU)
            self._refuse_if_busy(g, gi, what)
            del g.gis[gi_id]
            self._persist(index)

    # -- internals --------------------------------------------------------------------

    @contextmanager
    def _op(self, method: str, attempted: str) -> Iterator[None]:
        with self._gate.operation(attempted), self._lock:
            self._take_fault(method)
            yield

    def _take_fault(self, method: str) -> None:
        queue = self._faults.get(method)
        if queue:
            raise queue.popleft()

    def _gpu(self, index: int, what: str) -> _Gpu:
        if not 0 <= index < len(self._gpus):
            raise InvalidArgument(what, f"no GPU {index}; {len(self._gpus)} GPU(s)", code=_IA)
        return self._gpus[index]

    def _mig_gpu(self, index: int, what: str) -> _Gpu:
        g = self._gpu(index, what)
        if not g.model.mig_capable:
            raise NotSupported(what, f"{g.model.name} does not support MIG", code=_NS)
        if not g.mig_enabled:
            raise NotSupported(what, "MIG mode is disabled on this GPU", code=_NS)
        return g

    @staticmethod
    def _profile(g: _Gpu, profile_id: int, what: str) -> ProfileFact:
        fact = g.profile_by_id(profile_id)
        if fact is None:
            raise InvalidArgument(what, f"{g.model.name} has no profile id {profile_id}", code=_IA)
        return fact

    @staticmethod
    def _gi(g: _Gpu, gi_id: int, what: str) -> _Gi:
        gi = g.gis.get(gi_id)
        if gi is None:
            raise NotFound(what, f"no GPU instance {gi_id}", code=_NF)
        return gi

    @staticmethod
    def _ci(gi: _Gi, ci_id: int, what: str) -> _Ci:
        ci = gi.cis.get(ci_id)
        if ci is None:
            raise NotFound(what, f"no compute instance {ci_id} in GPU instance {gi.id}", code=_NF)
        return ci

    @staticmethod
    def _refuse_if_busy(g: _Gpu, gi: _Gi, what: str) -> None:
        pids = sorted(p for p, owner in g.processes.items() if owner == gi.id)
        if pids:
            raise InUse(what, f"processes {pids} still run in it", code=_IU)

    # -- persistence ------------------------------------------------------------------

    def _state_bytes(self) -> bytes:
        """The state file's document (compact JSON, keys sorted), from each GPU's part."""
        parts = b",".join(self._gpu_json(i) for i in range(len(self._gpus)))
        return b'{"gpus":[%s],"version":%d}' % (parts, STATE_VERSION)

    def _gpu_json(self, index: int) -> bytes:
        kept = self._json_of[index]
        if kept is not None:
            return kept
        g = self._gpus[index]
        fresh = {
            "uuid": g.uuid,
            "model": g.model.name,
            "numa": g.numa,
            "migEnabled": g.mig_enabled,
            "healthy": g.healthy,
            "serial": g.serial,
            "processes": [[pid, owner] for pid, owner in sorted(g.processes.items())],
            "gpuInstances": [
                {
                    "id": gi.id,
                    "profileId": gi.profile.profile_id,
                    "start": gi.placement.start,
                    "size": gi.placement.size,
                    "computeInstances": [
                        {"id": c.id, "profileIndex": c.profile_index, "migUUID": c.mig_uuid}
                        for _, c in sorted(gi.cis.items())
                    ],
                }
                for _, gi in sorted(g.gis.items())
            ],
        }
        # orjson: a tenth of the stdlib's C encoder's time, and the kwok node agent
        # persists every MIG operation (of which each changes one GPU's part).
        encoded = orjson.dumps(fresh, option=orjson.OPT_SORT_KEYS)
        self._json_of[index] = encoded
        return encoded

    def _persist(self, changed: int) -> None:
        """Write the state file after an operation changed GPU ``changed`` (lock held)."""
        self._changes += 1
        self._json_of[changed] = None
        if self._state_file is not None:
            write_atomically(self._state_file, self._state_bytes())

    def _load(self, path: Path) -> None:
        what = f"load simulated NVML state from {path}"
        try:
            raw = json.loads(path.read_text())
            if raw.get("version") != STATE_VERSION:
                raise NvmlError(what, f"version {raw.get('version')!r}, expected {STATE_VERSION}")
            gpus = raw["gpus"]
            if len(gpus) != len(self._gpus):
                raise NvmlError(
                    what,
                    f"it holds {len(gpus)} GPU(s) but {len(self._gpus)} are configured;"
                    " delete the file to start clean",
                )
            loaded = [
                self._gpu_from_json(cur, item, what)
                for cur, item in zip(self._gpus, gpus, strict=True)
            ]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise NvmlError(what, f"unreadable or malformed ({e!r})") from e
        self._gpus = loaded
        self._json_of = [None] * len(loaded)
        self._changes += 1

    @staticmethod
    def _gpu_from_json(cur: _Gpu, item: dict[str, Any], what: str) -> _Gpu:
        if item["uuid"] != cur.uuid or item["model"] != cur.model.name:
            raise NvmlError(
                what,
                f"GPU {cur.index} is {item['uuid']} ({item['model']}) in the file but"
                f" {cur.uuid} ({cur.model.name}) in the configuration; delete the file to start"
                " clean",
            )
        g = _Gpu(
            index=cur.index,
            uuid=cur.uuid,
            model=cur.model,
            numa=int(item["numa"]),
            mig_enabled=bool(item["migEnabled"]),
            healthy=bool(item["healthy"]),
            serial=int(item["serial"]),
            processes={int(pid): (None if o is None else int(o)) for pid, o in item["processes"]},
        )
        for gi_raw in item["gpuInstances"]:
            placement = Placement(int(gi_raw["start"]), int(gi_raw["size"]))
            fact = g.profile_by_id(int(gi_raw["profileId"]))
            if fact is None or placement not in fact.placements():
                raise NvmlError(what, f"GPU {g.index}: illegal GPU instance {gi_raw}")
            gi = _Gi(int(gi_raw["id"]), fact, placement)
            if gi.id != gpu_instance_id(g.model.memory_slices, placement) or any(
                o.placement.mask & placement.mask for o in g.gis.values()
            ):
                raise NvmlError(what, f"GPU {g.index}: inconsistent GPU instance {gi_raw}")
            for c in gi_raw["computeInstances"]:
                ci = _Ci(int(c["id"]), int(c["profileIndex"]), str(c["migUUID"]))
                if ci.profile_index not in COMPUTE_INSTANCE_PROFILE_SLICES:
                    raise NvmlError(what, f"GPU {g.index}: illegal compute instance {c}")
                gi.cis[ci.id] = ci
            g.gis[gi.id] = gi
        return g


_IA: Final = "NVML_ERROR_INVALID_ARGUMENT"
_NS: Final = "NVML_ERROR_NOT_SUPPORTED"
_NF: Final = "NVML_ERROR_NOT_FOUND"
_IR: Final = "NVML_ERROR_INSUFFICIENT_RESOURCES"
_IU: Final = "NVML_ERROR_IN_USE"
