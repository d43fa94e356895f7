"""A plain, GPU-by-GPU evaluation of one scheduling decision: the test oracle of the engine.

Written straight from the contract (SPEC §3) with Python loops and floats, nothing shared with
the engine but the state it reads and the MIG choice tables (``mig_policy``, tested on their
own). The engine's verdicts, failure reasons and planned devices must equal what this finds on
any state; it is slow and for tests only.

Per node, container by container (pod order), on each path the pod's mode allows:

- hami-core: the node's healthy hami-core GPUs the pod's selectors allow; a GPU fits a device
  when it has a free slot, the memory, the cores, and is unused if the device asks every core
  of it. The device count's GPUs are the best by GPU score (binpack: highest; spread:
  lowest), distinct, ties to the lower GPU position;
- MIG: the node's healthy MIG GPUs with allowed profiles; each device takes the smallest
  profile with the memory and cores asked that has a free placement (the choice table), on
  the best GPU, which counts it before the container's next device.

The path with the better sum (hami-core on a tie) takes the container, and its devices count
for the pod's next containers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from scheduler_plugins.core.decide import Decision
from scheduler_plugins.core.requests import ContainerRequest, PodRequest
from scheduler_plugins.core.rules import Reason
from scheduler_plugins.core.state import ClusterState, Geometry

_TIE = 1e-9


@dataclass
class _Gpu:
    uuid: str
    pos: int  # position in the node's device list
    slots: float
    mem: float
    cores: float
    used_slots: float
    used_mem: float
    used_cores: float
    mask: int
    conflict: int
    healthy: bool
    is_mig: bool
    type: str
    geometry: Geometry | None


@dataclass(frozen=True)
class Device:
    """One planned device: GPU position, MIG profile rank and start (-1: hami-core), score."""

    pos: int
    rank: int
    start: int
    gpu_score: float


@dataclass
class Verdict:
    feasible: bool
    reasons: int
    plan: list[list[Device]] = field(default_factory=list)  # per GPU container


def _score(g: _Gpu, used: tuple[float, float, float], req_mem: float, req_cores: float) -> float:
    us, um, uc = used
    try:
        s = ((1 + us) / g.slots + (req_cores + uc) / g.cores + (req_mem + um) / g.mem) * 10
    except ZeroDivisionError:
        return 0.0
    if math.isnan(s):
        return 0.0
    return s


def _best(candidates: list[tuple[int, float]]) -> int | None:
    """The first candidate (in GPU order) whose desirability is within the tie of the top."""
    if not candidates:
        return None
    top = max(d for _, d in candidates)
    return next(i for i, d in candidates if d >= top - _TIE)


def _type_ok(gpu_type: str, request: PodRequest) -> bool:
    upper = gpu_type.upper()
    if request.use_types and not any(t.upper() in upper for t in request.use_types):
        return False
    return not any(t.upper() in upper for t in request.nouse_types)


def _uuid_ok(uuid: str, request: PodRequest) -> bool:
    if uuid in request.nouse_uuids:
        return False
    return not request.use_uuids or uuid in request.use_uuids


def _min_rank(geom: Geometry, req_mem: float, req_cores: int) -> int | None:
    for rank, p in enumerate(geom.profiles):
        if p.memory_mb >= req_mem and p.core >= req_cores:
            return rank
    return None


def _gpus(state: ClusterState, node: str) -> list[_Gpu]:
    entry = state.nodes[node]
    g = state.gpus
    out = []
    for pos, d in enumerate(entry.devices):
        r = entry.rows[d.id]
        gid = int(g.geom[r])
        out.append(
            _Gpu(
                uuid=d.id,
                pos=pos,
                slots=float(d.count),
                mem=float(d.devmem),
                cores=float(d.devcore),
                used_slots=float(g.used_slots[r]),
                used_mem=float(g.used_mem[r]),
                used_cores=float(g.used_cores[r]),
                mask=int(g.mig_mask[r]),
                conflict=int(g.conflict[r]),
                healthy=d.health,
                is_mig=d.mode == "mig",
                type=d.type,
                geometry=state.geometries[gid] if d.mode == "mig" and gid >= 0 else None,
            )
        )
    return out


def evaluate(state: ClusterState, request: PodRequest) -> dict[str, Verdict]:
    """Every node's verdict for ``request`` (GPU-less nodes included)."""
    return {name: _node(state, name, request) for name in sorted(state.nodes)}


def _node(state: ClusterState, node: str, request: PodRequest) -> Verdict:
    gpus = _gpus(state, node)
    if not gpus:
        return Verdict(False, int(Reason.NO_GPU))
    allow_core = request.mode in (None, "hami-core")
    allow_mig = request.mode in (None, "mig")
    bits = {gp.pos: 0 for gp in gpus}
    base: dict[int, bool] = {}
    for gp in gpus:
        b = 0
        if not gp.healthy:
            b |= Reason.UNHEALTHY
        elif gp.conflict:
            b |= Reason.MIG_CONFLICT
        if not _type_ok(gp.type, request):
            b |= Reason.TYPE
        if not _uuid_ok(gp.uuid, request):
            b |= Reason.UUID
        if (gp.is_mig and not allow_mig) or (not gp.is_mig and not allow_core):
            b |= Reason.MODE
        bits[gp.pos] |= b
        base[gp.pos] = (b & ~Reason.MODE) == 0
        if base[gp.pos] and gp.is_mig and allow_mig and gp.geometry is None:
            bits[gp.pos] |= Reason.MIG_NO_PROFILE
    node_bits = 0
    feasible = True
    plan: list[list[Device]] = []
    remaining = request.device_count
    sign = request.gpu_policy.sign
    for c in request.containers:
        remaining -= c.count
        options: list[tuple[float, list[Device], str]] = []
        if allow_core:
            found, why, extra = _core(
                gpus, [gp for gp in gpus if base[gp.pos] and not gp.is_mig], c, sign
            )
            node_bits |= extra
            for pos, b in why.items():
                bits[pos] |= b
            if found is not None:
                options.append((*found, "core"))
        if allow_mig:
            mig_gpus = [gp for gp in gpus if base[gp.pos] and gp.is_mig and gp.geometry is not None]
            found, why = _mig(mig_gpus, c, sign)
            for pos, b in why.items():
                bits[pos] |= b
            if found is not None:
                options.append((*found, "mig"))
        chosen: tuple[float, list[Device], str] | None = None
        for option in options:
            if chosen is None or option[0] > chosen[0]:
                chosen = option
        if chosen is None:
            feasible = False
            plan.append([])
            continue
        plan.append(chosen[1])
        if remaining > 0:
            _commit(gpus, c, chosen[1])
    if feasible:
        return Verdict(True, 0, plan)
    for b in bits.values():
        node_bits |= b
    if max((c.count for c in request.containers), default=0) > max(len(gpus), 1):
        node_bits |= Reason.TOO_FEW_GPUS
    return Verdict(False, node_bits, plan)


def _req_mem(gp: _Gpu, c: ContainerRequest) -> float:
    return float(c.mem_mib) if c.mem_mib else float(math.floor(gp.mem * c.mem_percent / 100))


def _core(
    gpus: list[_Gpu], eligible: list[_Gpu], c: ContainerRequest, sign: float
) -> tuple[tuple[float, list[Device]] | None, dict[int, int], int]:
    why: dict[int, int] = {}
    fitting: list[tuple[int, float]] = []
    for gp in eligible:
        req_mem = _req_mem(gp, c)
        b = 0
        if not gp.used_slots < gp.slots:
            b |= Reason.SLOTS
        if not gp.mem - gp.used_mem >= req_mem:
            b |= Reason.MEMORY
        if not (gp.cores - gp.used_cores >= c.cores and gp.used_cores < gp.cores):
            b |= Reason.CORES
        if not (c.cores < gp.cores or gp.used_slots == 0):
            b |= Reason.EXCLUSIVE
        why[gp.pos] = b
        if not b:
            used = (gp.used_slots, gp.used_mem, gp.used_cores)
            fitting.append((gp.pos, _score(gp, used, req_mem, c.cores) * sign))
    extra = 0
    if c.count > 1 and 0 < len(fitting) < c.count:
        extra = Reason.TOO_FEW_FITTING
    devices: list[Device] = []
    total = 0.0
    left = list(fitting)
    for _ in range(c.count):
        pos = _best(left)
        if pos is None:
            return None, why, extra
        d = next(d for p, d in left if p == pos)
        left = [(p, x) for p, x in left if p != pos]
        total += d
        devices.append(Device(pos, -1, -1, d * sign))
    return (total, devices), why, extra


def _mig(
    eligible: list[_Gpu], c: ContainerRequest, sign: float
) -> tuple[tuple[float, list[Device]] | None, dict[int, int]]:
    why: dict[int, int] = {}
    # The container's earlier devices count for its later ones (on copies: another path may
    # take the container).
    used = {gp.pos: [gp.used_slots, gp.used_mem, gp.used_cores, gp.mask] for gp in eligible}
    devices: list[Device] = []
    total = 0.0
    for k in range(c.count):
        options: list[tuple[int, float]] = []
        choice: dict[int, tuple[int, int]] = {}
        for gp in eligible:
            assert gp.geometry is not None
            us, um, uc, mask = used[gp.pos]
            table = gp.geometry.table
            minr = _min_rank(
                gp.geometry,
                float(c.mem_mib) if c.mem_mib else gp.mem * c.mem_percent // 100,
                c.cores,
            )
            got = table.choose(mask, minr) if minr is not None else None
            if k == 0:
                b = 0 if us < gp.slots else Reason.SLOTS
                if minr is None:
                    b |= Reason.MIG_NO_PROFILE
                elif got is None:
                    b |= (
                        Reason.MIG_FRAGMENTATION
                        if table.is_fragmented(mask, minr)
                        else Reason.MIG_CAPACITY
                    )
                why[gp.pos] = b
            if got is None or not us < gp.slots:
                continue
            rank, start = got
            prof = gp.geometry.profiles[rank]
            d = _score(gp, (us, um, uc), float(prof.memory_mb), float(prof.core)) * sign
            options.append((gp.pos, d))
            choice[gp.pos] = got
        pos = _best(options)
        if pos is None:
            return None, why
        d = next(d for p, d in options if p == pos)
        rank, start = choice[pos]
        gp = next(gp for gp in eligible if gp.pos == pos)
        assert gp.geometry is not None
        prof = gp.geometry.profiles[rank]
        u = used[pos]
        u[0] += 1
        u[1] += prof.memory_mb
        u[2] += prof.core
        u[3] = int(u[3]) | table_mask(gp.geometry, rank, start)
        total += d
        devices.append(Device(pos, rank, start, d * sign))
    return (total, devices), why


def table_mask(geom: Geometry, rank: int, start: int) -> int:
    return geom.table.placement(rank, start).mask


def _commit(gpus: list[_Gpu], c: ContainerRequest, devices: list[Device]) -> None:
    by_pos = {gp.pos: gp for gp in gpus}
    for d in devices:
        gp = by_pos[d.pos]
        gp.used_slots += 1
        if d.rank >= 0:
            assert gp.geometry is not None
            prof = gp.geometry.profiles[d.rank]
            gp.used_mem += prof.memory_mb
            gp.used_cores += prof.core
            gp.mask |= table_mask(gp.geometry, d.rank, d.start)
        else:
            gp.used_mem += c.mem_mib if c.mem_mib else gp.mem * c.mem_percent // 100
            gp.used_cores += c.cores


def assert_agrees(state: ClusterState, request: PodRequest, d: Decision) -> None:
    """``d`` (the engine's decision on ``state``) has the oracle's verdict and reasons for every
    node, and for every feasible node its planned devices."""
    want = evaluate(state, request)
    layout = d.layout
    assert sorted([*layout.names, *layout.gpu_less]) == sorted(want)
    for name in layout.gpu_less:
        assert not want[name].feasible and want[name].reasons == Reason.NO_GPU
    for s, name in enumerate(layout.names):
        v = want[name]
        assert bool(d.feasible[s]) == v.feasible, name
        if not v.feasible:
            assert int(d.reasons[s]) == v.reasons, (
                name,
                Reason(int(d.reasons[s])),
                Reason(v.reasons),
            )
            continue
        plan = d.plan_for(name)
        assert plan is not None
        entry = state.nodes[name]
        got = [
            [
                (
                    dev.uuid,
                    dev.mig_profile,
                    dev.placement.start if dev.placement else -1,
                    dev.gpu_score,
                )
                for dev in cont
            ]
            for cont in plan.containers
            if cont
        ]
        expected = []
        for cont in v.plan:
            row = []
            for dv in cont:
                dev = entry.devices[dv.pos]
                profile = None
                if dv.rank >= 0:
                    geom = state.geometries[int(state.gpus.geom[entry.rows[dev.id]])]
                    profile = geom.profiles[dv.rank].name
                row.append((dev.id, profile, dv.start, dv.gpu_score))
            expected.append(row)
        assert got == expected, (name, got, expected)
