"""Tessera's scheduling rules, each written once.

- which GPUs a pod considers at all (``modes``, ``type_allowed``, ``uuid_allowed``,
  ``static_reasons``): healthy, no inconsistent MIG reservations, allowed by the pod's
  type/UUID selectors and of a mode the pod accepts;
- when a GPU fits one device (``core_checks`` for the shared modes, hami-core and MPS;
  ``mig_checks`` for MIG): every condition with the reason it stands for, so the verdict and
  its explanation come from the same lines;
- the GPU score (``gpu_score``) and the node score (``node_score``), the seed's formulas;
- the memory a device asks of a GPU (``request_memory``);
- when a node has the CPU and memory a pod requests (``host_reasons``): kube-scheduler's
  NodeResourcesFit, which Tessera's verdicts include so that they are kube-scheduler's too.

The MIG profile and placement a device takes is ``mig_policy``'s rule (the choice table);
how nodes are ranked and scored for kube-scheduler is ``ranking``'s. Every function works on
numpy arrays of any shape: the engine (``decide``) applies them to its per-node tables, for
every node at once or for a few positions, with work arrays (``out``) or without.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from enum import IntFlag
from typing import Final, NamedTuple

import numpy as np
import numpy.typing as npt

from api.hami.keys import GpuMode
from api.hami.policy import ScoringWeights

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
B = npt.NDArray[np.bool_]


class Reason(IntFlag):
    """Why a GPU (and, OR-ed over its GPUs, a node) cannot take the request."""

    NO_GPU = 1 << 0
    UNHEALTHY = 1 << 1
    TYPE = 1 << 2
    UUID = 1 << 3
    MODE = 1 << 4
    SLOTS = 1 << 5
    MEMORY = 1 << 6
    CORES = 1 << 7
    EXCLUSIVE = 1 << 8
    TOO_FEW_GPUS = 1 << 9
    MIG_NO_PROFILE = 1 << 10
    MIG_CAPACITY = 1 << 11
    MIG_FRAGMENTATION = 1 << 12
    MIG_CONFLICT = 1 << 13
    TOO_FEW_FITTING = 1 << 14
    CORDONED = 1 << 15
    # 1 << 16 was "MPS GPU: not offered yet"; left unused so that the other bits keep theirs.
    MIG_LEGACY = 1 << 17
    MUTEX = 1 << 18
    NUMA = 1 << 19
    HOST_CPU = 1 << 20
    HOST_MEMORY = 1 << 21


REASON_TEXT: Final[dict[Reason, str]] = {
    Reason.NO_GPU: "no GPU registered",
    Reason.UNHEALTHY: "GPU unhealthy",
    Reason.TYPE: "GPU type excluded by use-gputype/nouse-gputype",
    Reason.UUID: "GPU excluded by use-gpuuuid/nouse-gpuuuid",
    Reason.MODE: "GPU mode does not match nvidia.com/vgpu-mode",
    Reason.SLOTS: "no free vGPU slot",
    Reason.MEMORY: "insufficient GPU memory",
    Reason.CORES: "insufficient GPU cores",
    Reason.EXCLUSIVE: "gpucores 100 needs an unused GPU",
    Reason.TOO_FEW_GPUS: "fewer GPUs than requested",
    Reason.MIG_NO_PROFILE: "no allowed MIG profile large enough",
    Reason.MIG_CAPACITY: "MIG capacity: not enough free slices",
    Reason.MIG_FRAGMENTATION: "MIG fragmentation: enough free slices but no legal placement",
    Reason.MIG_CONFLICT: "inconsistent MIG reservations on GPU (fail closed)",
    Reason.TOO_FEW_FITTING: "fewer fitting GPUs than requested",
    Reason.CORDONED: "GPU cordoned (hami.io/device-cordon)",
    Reason.MIG_LEGACY: (
        "GPU holds MIG instances HAMi <= v2.9 placed (legacy device strings): no new work until "
        "their pods end (fail closed)"
    ),
    Reason.MUTEX: "mutex: GPU in use",
    Reason.NUMA: "numa-bind: no single NUMA node has enough fitting GPUs",
    # kube-scheduler's NodeResourcesFit words them "Insufficient cpu", "Insufficient memory".
    Reason.HOST_CPU: "insufficient cpu",
    Reason.HOST_MEMORY: "insufficient memory",
}


def reason_names(bits: int) -> list[str]:
    return [REASON_TEXT[r] for r in Reason if bits & r]


class Amounts(NamedTuple):
    """vGPU slots, memory (MiB) and cores, per GPU: what GPUs have, or what holds them."""

    slots: F64
    mem: F64
    cores: F64


MODE_CODES: Final[tuple[GpuMode, ...]] = ("hami-core", "mig", "mps")
"""A GPU's mode as a small integer (its index here), as the state keeps it per GPU."""

SHARED_MODES: Final[tuple[GpuMode, ...]] = ("hami-core", "mps")
"""The modes whose GPUs are shared by count, memory and cores (``core_checks``, the devices
written as ``UUID,NVIDIA,MiB,cores``): an MPS GPU is accounted exactly like a hami-core one,
within what it registers (its ``count`` already carries the MPS client limit). The rest, MIG,
is shared by profiles and placements."""


Check = tuple[Reason | I64, B]
"""A condition a GPU must meet, and the reason it fails where the condition does not hold
(one for all, or per GPU)."""


# ----- which GPUs a pod considers ------------------------------------------------------------


def modes(allowed: frozenset[GpuMode] | None) -> frozenset[GpuMode]:
    """The GPU modes offered to a pod whose ``nvidia.com/vgpu-mode`` names ``allowed`` (None:
    it names none, and the unified pool offers every mode)."""
    return frozenset(MODE_CODES) if allowed is None else allowed


def type_allowed(gpu_type: str, use: Sequence[str], nouse: Sequence[str]) -> bool:
    """``use-gputype``/``nouse-gputype``: case-insensitive substrings of the GPU's type; a
    type ``nouse`` names is refused even if ``use`` names it too."""
    upper = gpu_type.upper()
    if use and not any(t.upper() in upper for t in use):
        return False
    return not any(t.upper() in upper for t in nouse)


def uuid_allowed(
    n_rows: int, rows_of: Mapping[str, Sequence[int]], use: Sequence[str], nouse: Sequence[str]
) -> B:
    """Per GPU row (``rows_of``: UUID -> rows): allowed by ``use-gpuuuid``/``nouse-gpuuuid``
    (nouse wins)."""
    ok = np.full(n_rows, not use, np.bool_)
    for uuids, value in ((use, True), (nouse, False)):
        for uuid in uuids:
            ok[list(rows_of.get(uuid, ()))] = value
    return ok


def static_reasons(
    healthy: B,
    conflict: npt.NDArray[np.int32],
    type_ok: B,
    uuid_ok: B,
    mode: npt.NDArray[np.int8],
    has_geometry: B,
    allowed: frozenset[GpuMode] | None,
    *,
    cordoned: B,
    legacy: npt.NDArray[np.int32],
) -> I64:
    """Per GPU, what refuses it whatever its usage; 0 where the pod may consider it.

    A GPU with inconsistent MIG reservations (``conflict``), or holding MIG devices of HAMi <=
    v2.9 whose placement is unknown (``legacy``), is refused as a whole (fail closed); so is a
    cordoned one, and an unhealthy one (for MPS GPUs also while the MPS control daemon is down).
    ``mode``: ``MODE_CODES`` per GPU; a GPU of a mode not offered to the pod (``modes``) is
    refused; a MIG GPU the pod could use whose node registers no allowed profile has no MIG
    profile for any request.
    """
    offered = modes(allowed)
    accepted = np.array([m in offered for m in MODE_CODES], np.bool_)[mode]
    is_mig = mode == MODE_CODES.index("mig")
    bits = _bits(~healthy, Reason.UNHEALTHY)
    bits |= _bits(healthy & (conflict > 0), Reason.MIG_CONFLICT)
    bits |= _bits(legacy > 0, Reason.MIG_LEGACY)
    bits |= _bits(cordoned, Reason.CORDONED)
    bits |= _bits(~type_ok, Reason.TYPE)
    bits |= _bits(~uuid_ok, Reason.UUID)
    bits |= _bits(~accepted, Reason.MODE)
    eligible_mig = (bits == 0) & is_mig
    bits |= _bits(eligible_mig & ~has_geometry, Reason.MIG_NO_PROFILE)
    return bits


# ----- when a GPU fits one device ------------------------------------------------------------


def request_memory(
    mem_mib: int, mem_percent: int, gpu_mem: F64, out: F64 | None = None
) -> F64 | float:
    """The MiB one shared (hami-core or MPS) device asks of each GPU: ``gpumem``, else
    ``gpumem-percentage`` of the GPU's memory (rounded down)."""
    if mem_mib:
        return float(mem_mib)
    if out is None:
        return np.floor(gpu_mem * mem_percent / 100)
    np.multiply(gpu_mem, mem_percent, out=out)
    np.divide(out, 100, out=out)
    return np.floor(out, out=out)


def core_checks(
    cap: Amounts,
    used: Amounts,
    req_mem: F64 | float,
    req_cores: int,
    *,
    exclusive_possible: bool = True,
    mutex: bool = False,
    out: tuple[B, B, F64] | None = None,
) -> Iterator[Check]:
    """The conditions for a shared GPU (hami-core or MPS; capacity ``cap``, in use ``used``)
    to take one device: a free vGPU slot (on MPS a client slot), the memory, the cores, and
    an unused GPU when the device asks every core of it, or (``mutex``, the ``mutex`` GPU
    policy) whatever it asks.

    ``exclusive_possible`` False says no GPU looked at has as few cores as the device asks
    (the last condition then holds everywhere and is skipped). With ``out`` (two bool arrays
    and a float array of the inputs' shape) each condition is written there: read it before
    asking for the next.
    """
    if out is None:
        yield Reason.SLOTS, used.slots < cap.slots
        yield Reason.MEMORY, cap.mem - used.mem >= req_mem
        yield Reason.CORES, (cap.cores - used.cores >= req_cores) & (used.cores < cap.cores)
        if exclusive_possible:
            yield Reason.EXCLUSIVE, (req_cores < cap.cores) | (used.slots == 0)
        if mutex:
            yield Reason.MUTEX, used.slots == 0
        return
    b, b2, f = out
    yield Reason.SLOTS, np.less(used.slots, cap.slots, out=b)
    yield Reason.MEMORY, np.greater_equal(np.subtract(cap.mem, used.mem, out=f), req_mem, out=b)
    held = np.greater_equal(np.subtract(cap.cores, used.cores, out=f), req_cores, out=b)
    yield Reason.CORES, np.logical_and(held, np.less(used.cores, cap.cores, out=b2), out=b)
    if exclusive_possible:
        unused = np.equal(used.slots, 0, out=b2)
        yield Reason.EXCLUSIVE, np.logical_or(np.less(req_cores, cap.cores, out=b), unused, out=b)
    if mutex:
        yield Reason.MUTEX, np.equal(used.slots, 0, out=b)


def mig_checks(
    slots: F64,
    used_slots: F64,
    profile: I64,
    choice_reason: I64 | Reason,
    *,
    mutex: bool = False,
    out: B | None = None,
) -> Iterator[Check]:
    """The conditions for a MIG GPU to take one device: a free vGPU slot (each MIG device takes
    one, as kubelet counts them), a profile with a free legal placement (``profile``, the
    choice table's answer, -1 for none; ``choice_reason`` says why there is none), and with
    ``mutex`` nothing else on the GPU. With ``out``, as ``core_checks``."""
    if out is None:
        yield Reason.SLOTS, used_slots < slots
        yield choice_reason, profile >= 0
        if mutex:
            yield Reason.MUTEX, used_slots == 0
        return
    yield Reason.SLOTS, np.less(used_slots, slots, out=out)
    yield choice_reason, np.greater_equal(profile, 0, out=out)
    if mutex:
        yield Reason.MUTEX, np.equal(used_slots, 0, out=out)


def fold(checks: Iterator[Check], ok: B, *, fit: B | None = None, why: I64 | None = None) -> B:
    """Where every check holds (among ``ok``), written into ``fit`` when given; with ``why``,
    OR each failed check's reason into it where ``ok``."""
    folded: B | None = None
    for reason, holds in checks:
        if folded is None:
            folded = np.logical_and(ok, holds, out=fit)
        else:
            folded &= holds
        if why is not None:
            failed = ok & ~holds
            why |= failed * (reason if isinstance(reason, np.ndarray) else np.int64(reason))
    if folded is not None:
        return folded
    if fit is None:  # nothing to check
        return ok.copy()
    np.copyto(fit, ok)
    return fit


# ----- a node's CPU and memory --------------------------------------------------------------


class HostAmounts(NamedTuple):
    """CPU (millicores) and memory (bytes) per node: what nodes have allocatable, or what the
    pods on them request."""

    cpu: F64
    memory: F64


def host_reasons(
    allocatable: HostAmounts,
    requested: HostAmounts,
    cpu_milli: int,
    memory_bytes: int,
    *,
    at: I64 | None = None,
) -> I64:
    """Per node, ``HOST_CPU``/``HOST_MEMORY`` where a pod requesting ``cpu_milli`` and
    ``memory_bytes`` does not fit what the node has allocatable less what the pods there
    request (``requested``), 0 where it fits: kube-scheduler's NodeResourcesFit for CPU and
    memory, to the unit ("Insufficient cpu" where the request exceeds what is left).

    As kube-scheduler, a resource the pod does not request is not checked (it fits a node
    already overcommitted). Unlike it, a node whose allocatable CPU (or memory) is 0 is not
    checked for it either: 0 is what the state holds when the Node shows none or it could not
    be read (and on the tests' and benchmarks' nodes), so it stands for "unknown", never for
    "full". ``at``: only these entries of the inputs (computed over all of them, then taken:
    one gather instead of one per column, as ``node_score``). A vector compare, no loop.
    """
    bits: I64 | None = None
    for asked, have, used, reason in (
        (cpu_milli, allocatable.cpu, requested.cpu, Reason.HOST_CPU),
        (memory_bytes, allocatable.memory, requested.memory, Reason.HOST_MEMORY),
    ):
        if asked <= 0:
            continue
        short = np.subtract(have, used) < asked
        short &= have > 0
        bits = _bits(short, reason) if bits is None else bits | _bits(short, reason)
    if bits is None:
        bits = np.zeros(allocatable.cpu.shape, np.int64)
    return bits if at is None else bits[at]


# ----- scores --------------------------------------------------------------------------------

GPU_SCORE_MAX: Final = 30.0
"""The seed's scores are three usage shares times 10."""


def gpu_score(
    cap: Amounts,
    used: Amounts,
    req_mem: F64 | float,
    req_cores: F64 | float,
    out: tuple[F64, F64, B] | None = None,
    *,
    weights: ScoringWeights | None = None,
) -> F64:
    """The seed's GPU score, usage including this device: (slots share + cores share + memory
    share) × 10, 0..30; each share times its weight (``hami.io/device-scoring-weights``; None:
    1 each). Binpack takes the highest GPU, spread the lowest. A GPU without capacity (a zero
    share) scores 0. With ``out`` (result, temporary, finite flags: arrays of the inputs'
    shape) nothing is allocated and the result is ``out[0]``."""
    if weights is not None and weights.default:
        weights = None
    if out is None:
        with np.errstate(divide="ignore", invalid="ignore"):
            shares = (
                (1 + used.slots) / cap.slots,
                (req_cores + used.cores) / cap.cores,
                (req_mem + used.mem) / cap.mem,
            )
            if weights is not None:
                shares = (
                    shares[0] * weights.slot,
                    shares[1] * weights.core,
                    shares[2] * weights.memory,
                )
            s = (shares[0] + shares[1] + shares[2]) * 10
        return s if np.isfinite(s).all() else np.nan_to_num(s)
    s, t, finite = out
    with np.errstate(divide="ignore", invalid="ignore"):
        np.add(used.slots, 1, out=s)
        np.divide(s, cap.slots, out=s)
        if weights is not None:
            s *= weights.slot
        np.add(used.cores, req_cores, out=t)
        np.divide(t, cap.cores, out=t)
        if weights is not None:
            t *= weights.core
        np.add(s, t, out=s)
        np.add(used.mem, req_mem, out=t)
        np.divide(t, cap.mem, out=t)
        if weights is not None:
            t *= weights.memory
        np.add(s, t, out=s)
        np.multiply(s, 10, out=s)
    if not np.isfinite(s, out=finite).all():
        np.nan_to_num(s, copy=False)
    return s


def node_score(
    cap: Amounts,
    used: Amounts,
    cpu: tuple[F64, F64, F64, F64] | None = None,
    *,
    at: I64 | None = None,
) -> F64:
    """The seed's node score, usage before this pod: (slots share + cores share + memory share)
    × 10 over the node's GPUs (``cap``/``used``: the node's sums), 0..30; with ``cpu``
    (requested and allocatable CPU, requested and allocatable memory), the node's CPU and
    memory shares × 10 are added (0..50). A node lacking some capacity (a share of nothing)
    scores 0. ``at``: only these entries of the inputs (computed over all of them, then taken:
    one gather instead of one per column)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        score = (used.slots / cap.slots + used.cores / cap.cores + used.mem / cap.mem) * 10
        if cpu is not None:
            cpu_req, cpu_alloc, mem_req, mem_alloc = cpu
            score += (cpu_req / cpu_alloc + mem_req / mem_alloc) * 10
    if at is not None:
        score = score[at]
    if not np.isfinite(score).all():
        score = np.nan_to_num(score, nan=0.0, posinf=0.0, neginf=0.0)
    return score


def node_score_max(cpu_memory_terms: bool) -> float:
    """The highest ``node_score``: every share full."""
    return 50.0 if cpu_memory_terms else 30.0


def _bits(mask: B, reason: Reason) -> I64:
    """``reason`` where ``mask``, else 0. A multiply: np.where is ~8x slower on mixed masks."""
    return mask * np.int64(reason)


__all__ = [
    "MODE_CODES",
    "REASON_TEXT",
    "SHARED_MODES",
    "Amounts",
    "Check",
    "HostAmounts",
    "Reason",
    "core_checks",
    "fold",
    "gpu_score",
    "host_reasons",
    "mig_checks",
    "modes",
    "node_score",
    "reason_names",
    "request_memory",
    "static_reasons",
    "type_allowed",
    "uuid_allowed",
]
