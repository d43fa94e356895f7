"""A plain, GPU-by-GPU evaluation of one scheduling decision: the test oracle of the engine.

Written straight from the contract (SPEC §3, docs/hami-compatibility.md) with Python loops and
floats, nothing shared with the engine but the state it reads and the MIG choice tables
(``mig_policy``, tested on their own). The engine's verdicts, failure reasons and planned
devices must equal what this finds on any state; it is slow and for tests only.

Per node, container by container (pod order), on each path the pod's modes allow (hami-core,
MIG and MPS: a container's devices all come from one):

- the GPUs a pod considers: healthy, no inconsistent or legacy MIG devices, not cordoned,
  allowed by its type/UUID selectors, of a mode it names (any, when it names none);
- hami-core and MPS alike: a GPU fits a device when it has a free slot (MPS: a client slot,
  as many as it registers), the memory, the cores, is unused if the device asks every core of
  it, and (mutex) has nothing on it;
- MIG: each device takes the smallest profile with the memory and cores asked that has a
  free placement (the choice table), on the best GPU, which counts it before the next device;
- the best GPU: by the GPU policy's keys (the highest NUMA node first when numa leads, the GPU
  score by binpack/spread, the highest NUMA node breaking score ties when numa follows or the
  policy is a single name), then the higher position (GPUs are in index order);
  topology-aware picks by pair scores among the hami-core (or MPS) GPUs that fit; numa-bind
  evaluates the container on one NUMA node at a time, the highest first (the lowest for the
  single name binpack).

The path with the better sum (on a tie hami-core, then MIG, then MPS) takes the container, and
its devices count for the pod's next containers.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from api.hami.register import GpuDevice
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
    legacy: int
    cordoned: bool
    healthy: bool
    mode: str
    numa: int
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


Found = tuple[float, list[Device]] | None  # (sum of desirability, devices) or nothing


def _score(
    g: _Gpu, used: tuple[float, float, float], req_mem: float, req_cores: float, w: PodRequest
) -> float:
    us, um, uc = used
    ws, wc, wm = w.weights.slot, w.weights.core, w.weights.memory
    try:
        a = (1 + us) / g.slots
        b = (req_cores + uc) / g.cores
        c = (req_mem + um) / g.mem
    except ZeroDivisionError:
        return 0.0
    s = (a + b + c) * 10 if w.weights.default else (a * ws + b * wc + c * wm) * 10
    return 0.0 if math.isnan(s) else s


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
    d: GpuDevice
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
                legacy=int(g.legacy[r]),
                cordoned=d.id in entry.cordoned,
                healthy=d.health,
                mode=d.mode,
                numa=d.numa,
                type=d.type,
                geometry=state.geometries[gid] if d.mode == "mig" and gid >= 0 else None,
            )
        )
    return out


def evaluate(state: ClusterState, request: PodRequest) -> dict[str, Verdict]:
    """Every node's verdict for ``request`` (GPU-less nodes included)."""
    return {name: _node(state, name, request) for name in sorted(state.nodes)}


class _Order:
    """The GPU policy's order of GPUs: which of several candidates a device takes first."""

    def __init__(self, request: PodRequest) -> None:
        self.numa_rank = request.gpu_policy.numa_rank

    def key(self, gp: _Gpu, desir: float, top: float) -> tuple[float, ...]:
        """Smaller is better; ``top``: the best desirability among the candidates (ties)."""
        tied = desir >= top - _TIE
        return (
            -gp.numa if self.numa_rank == 0 else 0,
            0 if tied else 1,
            -desir if not tied else 0,
            -gp.numa if self.numa_rank == 1 else 0,
            -gp.pos,  # the higher GPU index first
        )

    def best(self, candidates: list[tuple[_Gpu, float]]) -> tuple[_Gpu, float] | None:
        if not candidates:
            return None
        if self.numa_rank == 0:
            top_numa = max(gp.numa for gp, _ in candidates)
            candidates = [(gp, d) for gp, d in candidates if gp.numa == top_numa]
        top = max(d for _, d in candidates)
        return min(candidates, key=lambda c: self.key(c[0], c[1], top))

    def ranked(self, candidates: list[tuple[_Gpu, float]]) -> list[_Gpu]:
        """All ``candidates`` in the order repeated ``best`` takes them (rounded ties)."""

        def key(c: tuple[_Gpu, float]) -> tuple[float, ...]:
            gp, d = c
            return (
                -gp.numa if self.numa_rank == 0 else 0,
                -round(d, 9),
                -gp.numa if self.numa_rank == 1 else 0,
                -gp.pos,
            )

        return [gp for gp, _ in sorted(candidates, key=key)]


def _node(state: ClusterState, node: str, request: PodRequest) -> Verdict:
    gpus = _gpus(state, node)
    if not gpus:
        return Verdict(False, int(Reason.NO_GPU))
    allowed = request.modes
    bits = {gp.pos: 0 for gp in gpus}
    for gp in gpus:
        b = 0
        if not gp.healthy:
            b |= Reason.UNHEALTHY
        elif gp.conflict:
            b |= Reason.MIG_CONFLICT
        if gp.legacy:
            b |= Reason.MIG_LEGACY
        if gp.cordoned:
            b |= Reason.CORDONED
        if not _type_ok(gp.type, request):
            b |= Reason.TYPE
        if not _uuid_ok(gp.uuid, request):
            b |= Reason.UUID
        if allowed is not None and gp.mode not in allowed:
            b |= Reason.MODE
        if not b and gp.mode == "mig" and gp.geometry is None:
            b |= Reason.MIG_NO_PROFILE
        bits[gp.pos] = b
    core_gpus = [gp for gp in gpus if not bits[gp.pos] and gp.mode == "hami-core"]
    mig_gpus = [gp for gp in gpus if not bits[gp.pos] and gp.mode == "mig"]
    mps_gpus = [gp for gp in gpus if not bits[gp.pos] and gp.mode == "mps"]
    pairs = state.nodes[node].pair_scores if request.gpu_policy.topology_aware else None
    order = _Order(request)
    node_bits = 0
    feasible = True
    plan: list[list[Device]] = []
    remaining = request.device_count
    sign = request.gpu_policy.score_sign
    for c in request.containers:
        remaining -= c.count
        options: list[tuple[float, list[Device]]] = []
        paths: list[tuple[list[_Gpu], Callable[[list[_Gpu]], tuple[Found, dict[int, int], int]]]]
        paths = []
        if core_gpus:
            paths.append(
                (core_gpus, lambda gs: _core(gs, c, sign, order, request, pairs))  # noqa: B023
            )
        if mig_gpus:
            paths.append((mig_gpus, lambda gs: _mig(gs, c, sign, order, request)))  # noqa: B023
        if mps_gpus:  # MPS GPUs fit and score as hami-core ones do
            paths.append(
                (mps_gpus, lambda gs: _core(gs, c, sign, order, request, pairs))  # noqa: B023
            )
        for eligible, run in paths:
            found, why, extra = run(eligible)
            if request.numa_bind:
                fits_anywhere = found is not None
                found = None
                lowest_first = request.gpu_policy.numa_groups_ascending
                for u in sorted({gp.numa for gp in eligible}, reverse=not lowest_first):
                    found = run([gp for gp in eligible if gp.numa == u])[0]
                    if found is not None:
                        break
                if fits_anywhere and found is None:
                    extra |= Reason.NUMA
            node_bits |= extra
            for pos, b in why.items():
                bits[pos] |= b
            if found is not None:
                options.append(found)
        chosen: tuple[float, list[Device]] | None = None
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
    eligible: list[_Gpu],
    c: ContainerRequest,
    sign: float,
    order: _Order,
    request: PodRequest,
    pairs: object,
) -> tuple[Found, dict[int, int], int]:
    why: dict[int, int] = {}
    fitting: list[tuple[_Gpu, float]] = []
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
        if request.gpu_policy.mutex and gp.used_slots != 0:
            b |= Reason.MUTEX
        why[gp.pos] = b
        if not b:
            used = (gp.used_slots, gp.used_mem, gp.used_cores)
            fitting.append((gp, _score(gp, used, req_mem, c.cores, request) * sign))
    extra = 0
    if c.count > 1 and 0 < len(fitting) < c.count:
        extra = Reason.TOO_FEW_FITTING
    if len(fitting) < c.count:
        return None, why, extra
    desir = {gp.pos: d for gp, d in fitting}
    if pairs is not None:
        picked = _topology([gp for gp in order.ranked(fitting)], c.count, pairs)  # type: ignore[arg-type]
    else:
        picked = []
        left = list(fitting)
        for _ in range(c.count):
            best = order.best(left)
            assert best is not None
            picked.append(best[0])
            left = [x for x in left if x[0].pos != best[0].pos]
    total = 0.0
    devices = []
    for gp in picked:
        total += desir[gp.pos]
        devices.append(Device(gp.pos, -1, -1, desir[gp.pos] * sign))
    return (total, devices), why, extra


def _topology(ranked: list[_Gpu], n: int, pairs: dict[str, dict[str, int]]) -> list[_Gpu]:
    """topology-aware among the fitting GPUs (``ranked``: in the policy's order)."""

    def s(a: _Gpu, b: _Gpu) -> int:
        return pairs.get(a.uuid, {}).get(b.uuid, 0)

    if n == 1:
        links = [(sum(s(d, e) for e in ranked if e is not d), i) for i, d in enumerate(ranked)]
        return [ranked[min(links)[1]]]
    best: tuple[int, tuple[int, ...]] | None = None
    for combo in itertools.combinations(range(len(ranked)), n):
        total = sum(s(ranked[i], ranked[j]) for i, j in itertools.combinations(combo, 2))
        if best is None or total > best[0]:
            best = (total, combo)
    assert best is not None
    return [ranked[i] for i in best[1]]


def _mig(
    eligible: list[_Gpu], c: ContainerRequest, sign: float, order: _Order, request: PodRequest
) -> tuple[Found, dict[int, int], int]:
    why: dict[int, int] = {}
    # The container's earlier devices count for its later ones (on copies: another path may
    # take the container).
    used = {gp.pos: [gp.used_slots, gp.used_mem, gp.used_cores, gp.mask] for gp in eligible}
    devices: list[Device] = []
    total = 0.0
    for k in range(c.count):
        options: list[tuple[_Gpu, float]] = []
        choice: dict[int, tuple[int, int]] = {}
        for gp in eligible:
            assert gp.geometry is not None
            us, um, uc, mask = used[gp.pos]
            table = gp.geometry.table
            minr = _min_rank(
                gp.geometry,
                float(c.mem_mib) if c.mem_mib else math.floor(gp.mem * c.mem_percent / 100),
                c.cores,
            )
            got = table.choose(int(mask), minr) if minr is not None else None
            mutex_bad = request.gpu_policy.mutex and us != 0
            if k == 0:
                b = 0 if us < gp.slots else Reason.SLOTS
                if minr is None:
                    b |= Reason.MIG_NO_PROFILE
                elif got is None:
                    b |= (
                        Reason.MIG_FRAGMENTATION
                        if table.is_fragmented(int(mask), minr)
                        else Reason.MIG_CAPACITY
                    )
                if mutex_bad:
                    b |= Reason.MUTEX
                why[gp.pos] = b
            if got is None or not us < gp.slots or mutex_bad:
                continue
            rank, start = got
            prof = gp.geometry.profiles[rank]
            d = _score(gp, (us, um, uc), float(prof.memory_mb), float(prof.core), request) * sign
            options.append((gp, d))
            choice[gp.pos] = got
        best = order.best(options)
        if best is None:
            return None, why, 0
        gp, d = best
        rank, start = choice[gp.pos]
        assert gp.geometry is not None
        prof = gp.geometry.profiles[rank]
        u = used[gp.pos]
        u[0] += 1
        u[1] += prof.memory_mb
        u[2] += prof.core
        u[3] = int(u[3]) | gp.geometry.table.placement(rank, start).mask
        total += d
        devices.append(Device(gp.pos, rank, start, d * sign))
    return (total, devices), why, 0


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
            gp.mask |= gp.geometry.table.placement(d.rank, d.start).mask
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
            got_bits, want_bits = Reason(int(d.reasons[s])), Reason(v.reasons)
            assert got_bits == want_bits, (name, got_bits, want_bits)
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
