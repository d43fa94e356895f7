"""Fragmentation-aware placement: put a pod where it strands the least of what the workload uses.

A node's *fragmentation* for a workload (the design documents' GPU, CPU and memory combined
placement; measured as Weng et al., USENIX ATC '23, define it) is the GPU capacity the workload's
pods could not use, weighted by how often each kind of pod comes:

    F(node) = sum_m w_m * stranded_m(node)

    stranded_m = every free GPU share,          if the node cannot host a pod of kind m at all
                                                (too little CPU or memory left, or fewer GPUs
                                                with room for it than it asks),
               = the free shares of the GPUs    otherwise (the rest of the node can take one).
                 that are each too small for m,

A pod goes where placing it raises F the least (``delta``: F after minus F before; placing
GPU work removes its share from F, so a good placement has a negative delta), and on that node
to the GPU that raises it least. CPU-only pods are placed by the same rule: their CPU and
memory can strand a node's free GPUs.

The workload (``TaskMix``) is what asks for room (``KindCounts``, kept by the cluster state:
the last ``WINDOW`` shared-GPU pods that asked): the kinds covering most of them, by count. Its
unit is the *share* of one GPU: a shared (hami-core, MPS) GPU's free share is the smaller of
its free cores and free memory shares (0 without a free slot); a device takes the larger of
its cores and memory shares of the GPU, a whole-GPU device all of it (only an unused GPU has
room for one).

Node choice (``node_score``): ``scores`` turns a node's delta into 0..100 (100 ×
sigmoid(−delta): about 23 points per GPU share near 0), plus a tie term. Where Tessera places
the pods without GPUs too, ``TIE_WEIGHT`` points for a node whose GPUs are all used
(``pack_key``): of nodes the pod fragments alike, the fuller goes first, keeping emptier
nodes for what needs them. Otherwise (another scheduler places those pods, or there are
none) ``EMPTIER_TIE_WEIGHT`` points for a node whose GPUs are all free: GPU pods spread,
each node's fit still decided by what it strands (``KindCounts.fuller_ties`` tells the cases
apart). The engine (``decide``) applies this to the pods it places by the fragmentation
policy; ``ranking`` orders nodes by it.

Pure: numpy arrays in, numpy arrays out; no cluster state, no clock.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, NamedTuple

import numpy as np
import numpy.typing as npt

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
B = npt.NDArray[np.bool_]

COVERAGE: Final = 0.95
"""The kinds of pods a mix keeps: the most frequent, until they cover this share of those seen."""

MAX_KINDS: Final = 48
"""At most this many kinds (the cost of a decision grows with them)."""

_EPS: Final = 1e-9

_ROW_SUMS: Final = 200
"""From this many nodes on, ``node_deltas`` sums kinds a row of nodes at a time."""


@dataclass(frozen=True, order=True)
class Shape:
    """One kind of pod: its CPU (millicores) and memory (bytes) requests, and its GPU devices
    (``gpus`` devices of ``share`` of a GPU each; 0 devices for a CPU-only pod)."""

    cpu_milli: int
    memory_bytes: int
    gpus: int
    share: float

    def __post_init__(self) -> None:
        if self.gpus < 0 or self.cpu_milli < 0 or self.memory_bytes < 0:
            raise ValueError(f"{self}: requests must not be negative")
        if self.gpus and not 0.0 < self.share <= 1.0:
            raise ValueError(f"{self}: a GPU device asks a share in (0, 1]")


class TaskMix(NamedTuple):
    """The workload's kinds of GPU pods, as arrays (one entry per kind, by ``share``
    ascending); ``weight`` sums to 1."""

    cpu: F64
    memory: F64
    gpus: F64
    share: F64
    weight: F64

    @staticmethod
    def of(counts: Mapping[Shape, float], coverage: float = COVERAGE) -> TaskMix:
        """The most frequent GPU kinds of ``counts`` covering ``coverage`` of its GPU pods
        (CPU-only kinds strand every free GPU wherever they go: they do not rank nodes),
        weights renormalised. Ties in frequency by shape, so the mix is deterministic."""
        gpu_kinds = sorted(
            ((n, s) for s, n in counts.items() if s.gpus and n > 0),
            key=lambda x: (-x[0], x[1].cpu_milli, x[1].memory_bytes, x[1].gpus, x[1].share),
        )
        total = sum(n for n, _ in gpu_kinds)
        kept: list[tuple[float, Shape]] = []
        covered = 0.0
        for n, s in gpu_kinds:
            if covered >= coverage * total or len(kept) >= MAX_KINDS:
                break
            kept.append((n, s))
            covered += n
        if not kept:
            return DEFAULT_MIX
        kept.sort(key=lambda x: (x[1].share, -x[0], x[1]))  # by share: ``node_deltas`` needs it
        w = np.array([n for n, _ in kept], np.float64)
        return TaskMix(
            np.array([s.cpu_milli for _, s in kept], np.float64),
            np.array([s.memory_bytes for _, s in kept], np.float64),
            np.array([s.gpus for _, s in kept], np.float64),
            np.array([s.share for _, s in kept], np.float64),
            w / w.sum(),
        )


DEFAULT_MIX: Final = TaskMix(np.zeros(1), np.zeros(1), np.ones(1), np.ones(1), np.ones(1))
"""Before any pod is seen: one whole GPU, no CPU or memory."""


MIX_DRIFT: Final = 0.02
"""The mix is rebuilt only once the workload moved this far (``drift``) from the one it was
built from. (Waiting also until it moved farther than chance, sqrt(kinds / pods) / 2, kept a
young cluster on the mix of its first pods far too long: 0.34 % of the GPUs less on seeds 49
and 50 of the FGD paper's gpushare40 trace.)"""


def _shapes(mix: TaskMix) -> frozenset[Shape]:
    """The kinds ``mix`` weighs (none for the default)."""
    if mix is DEFAULT_MIX:
        return frozenset()
    columns = (mix.cpu.tolist(), mix.memory.tolist(), mix.gpus.tolist(), mix.share.tolist())
    return frozenset(Shape(int(c), int(m), int(g), s) for c, m, g, s in zip(*columns, strict=True))


def drift(a: Mapping[Shape, float], b: Mapping[Shape, float]) -> float:
    """How far workload ``b`` is from ``a`` (pods per kind, each scaled to its total): total
    variation over both's kinds (a kind one of them lacks weighs 0 there)."""
    ta, tb = sum(a.values()), sum(b.values())
    if not ta or not tb:
        return 0.0 if ta == tb else 1.0
    return sum(abs(a.get(k, 0.0) / ta - b.get(k, 0.0) / tb) for k in a.keys() | b.keys()) / 2


WINDOW: Final = 4096
"""The workload is the kinds of the last this many GPU pods that asked for room
(``KindCounts``)."""


class KindCounts:
    """The workload: the kinds of the last ``window`` GPU pods that asked for room, each pod
    once (by its identity, however often it is retried), counted as they come (a cluster
    state keeps one). What arrives, not what is held: the placement keeps room for the pods
    to come, and what the cluster holds under-counts the kinds it could not place (README.md,
    "Fragmentation-aware placement", has what each allocates on the FGD paper's traces). A pod
    found holding GPUs without having asked (bound before a restart, or by another
    scheduler) counts as arriving then.

    ``mix`` is looked at once the counts moved by a hundredth (at least ``_REWEIGH`` pods)
    since the last look, at once when a kind of the mix in use left the window or the first
    GPU pod comes. It is rebuilt when a kind of the one in use is gone, or when the pods
    counted (every kind of them, not only the mix's) are ``MIX_DRIFT`` away from those it was
    built from. What the policy keeps per node is computed for one mix (a new mix moves
    every node to it), so neither a burst of pods of known kinds, nor new kinds one pod at a
    time, nor kinds trading places at the mix's cut (many about as common) does that per
    pod."""

    _REWEIGH: Final = 16

    def __init__(self, coverage: float = COVERAGE, window: int = WINDOW) -> None:
        if window < 1:
            raise ValueError(f"a window of {window} pods: it must hold at least one")
        self._coverage = coverage
        self._window = window
        self._arrived: deque[tuple[str, Shape]] = deque()
        self._seen: set[str] = set()
        self._counts: Counter[Shape] = Counter()
        self._moved = 0
        self._kinds_changed = False
        self._mix: TaskMix = DEFAULT_MIX
        self._mix_kinds: frozenset[Shape] = frozenset()
        self._built_from: dict[Shape, int] = {}  # the GPU pods the mix in use was built from
        self._gpu_pods = 0  # GPU pods counted so far
        self._asked_at: int | None = None  # ``_gpu_pods`` when a pod without GPUs last asked

    def arrive(self, ident: str, shape: Shape) -> None:
        """Pod ``ident`` (its uid, else namespace/name), of kind ``shape`` (``pod_shape``),
        asks for room: counted unless it is in the window already ("" is never a repeat)."""
        if ident and ident in self._seen:
            return
        self._gpu_pods += 1
        self._arrived.append((ident, shape))
        if ident:
            self._seen.add(ident)
        self._count(shape, +1)
        if len(self._arrived) > self._window:
            old, old_shape = self._arrived.popleft()
            self._seen.discard(old)
            self._count(old_shape, -1)

    def __len__(self) -> int:
        """The pods in the window."""
        return len(self._arrived)

    def host_only_asks(self) -> None:
        """A pod without GPUs asks for room: Tessera places such pods here."""
        self._asked_at = self._gpu_pods

    @property
    def fuller_ties(self) -> bool:
        """Whether the policy's ties go to the fuller node (``node_score``): while Tessera
        places the pods without GPUs too (one asked while the last ``window`` GPU pods did).
        Measured on the FGD paper's traces (README.md, "Fragmentation-aware placement"): the
        fuller first allocates more where Tessera places every pod; the emptier where
        kube-scheduler places the pods without GPUs (its LeastAllocated spreads them over
        every node), and where there are none."""
        at = self._asked_at
        return at is not None and self._gpu_pods - at < self._window

    def _count(self, shape: Shape, sign: int) -> None:
        n = self._counts[shape] + sign
        if n > 0:
            # a first GPU kind replaces the default at once; later ones wait for a reweigh
            # (one pod of a kind moves the mix by 1/n, under its noise of 1/sqrt(n))
            self._kinds_changed |= self._mix is DEFAULT_MIX and shape.gpus > 0
            self._counts[shape] = n
        else:
            self._kinds_changed |= shape in self._mix_kinds  # a kind of the mix is gone
            del self._counts[shape]
        self._moved += 1

    def mix(self) -> TaskMix:
        if self._kinds_changed or self._moved >= max(self._REWEIGH, len(self._arrived) // 100):
            gpu = {s: n for s, n in self._counts.items() if s.gpus}
            gone = not self._mix_kinds.issubset(self._counts)
            if gone or drift(self._built_from, gpu) >= MIX_DRIFT:
                self._mix = TaskMix.of(gpu, self._coverage)
                self._mix_kinds = _shapes(self._mix)
                self._built_from = gpu
            self._moved = 0
            self._kinds_changed = False
        return self._mix


def free_share(
    slots_cap: F64, slots_used: F64, cores_cap: F64, cores_used: F64, mem_cap: F64, mem_used: F64
) -> F64:
    """Per shared GPU, its free share: the smaller of its free cores and memory shares, 0 with
    no free slot or no capacity."""
    with np.errstate(divide="ignore", invalid="ignore"):
        c = (cores_cap - cores_used) / cores_cap
        m = (mem_cap - mem_used) / mem_cap
        free = np.minimum(c, m)
    free = np.where((slots_used < slots_cap) & np.isfinite(free), free, 0.0)
    return np.clip(free, 0.0, 1.0)


def _filled(free: F64) -> F64:
    """``free`` with -1 where there is no GPU (NaN): free shares are in [0, 1], so ``fmax``
    does it (a tenth of what ``nan_to_num`` costs on a few nodes' GPUs)."""
    out: F64 = np.fmax(free, -1.0)
    return out


class Parts(NamedTuple):
    """Per node, what its fragmentation is made of (``parts``)."""

    total: F64  # [...] free share summed over the node's GPUs
    small: F64  # [..., K] free share of the GPUs too small for kind k
    room: F64  # [..., K] how many GPUs have room for a device of kind k


def parts(free: F64, mix: TaskMix) -> Parts:
    """``free`` [..., W]: per GPU its free share, NaN where there is no GPU. Depends on the
    GPUs and the mix only (not on a pod): a caller may keep it per node between pods."""
    fz = np.fmax(free, 0.0)  # no GPU: 0 free, which no kind fits (every share is > 0)
    fits = fz[..., None] >= mix.share - _EPS  # [..., W, K]
    small = (fz[..., None] * ~fits).sum(axis=-2)
    return Parts(fz.sum(axis=-1), small, fits.sum(axis=-2).astype(np.float64))


def _stranded(p: Parts, cpu_left: F64, mem_left: F64, mix: TaskMix) -> F64:
    host = (
        (cpu_left[..., None] >= mix.cpu)
        & (mem_left[..., None] >= mix.memory)
        & (p.room >= mix.gpus)
    )
    per_kind = np.where(host, p.small, p.total[..., None])
    out: F64 = per_kind @ mix.weight
    return out


def fragmentation(
    free: F64, cpu_left: F64, mem_left: F64, mix: TaskMix, node_parts: Parts | None = None
) -> F64:
    """Per node, its fragmentation for ``mix`` (in GPU shares). ``free`` [N, W]: each GPU's
    free share (NaN: no GPU there; a GPU the workload may not use counts 0 free);
    ``cpu_left``/``mem_left`` [N]: what the node has left (inf where unknown);
    ``node_parts``: ``parts`` of ``free`` when the caller keeps them."""
    return _stranded(
        parts(free, mix) if node_parts is None else node_parts, cpu_left, mem_left, mix
    )


class Delta(NamedTuple):
    """Per candidate node, F after the pod minus F before, and the GPU columns its devices
    take there (-1 past its devices; all -1 for a CPU-only pod)."""

    delta: F64
    columns: I64


def room_for(free: F64, share: float) -> B:
    """Where a device of ``share`` has room by ``fragmentation``'s measure (the engine passes
    its exact fit instead)."""
    room: B = _filled(free) >= share - _EPS
    return room


def device_deltas(
    free: F64,
    cpu_left: F64,
    mem_left: F64,
    mix: TaskMix,
    pod: Shape,
    room: B,
    take: F64 | float | None = None,
) -> F64:
    """[N, W]: F after one device of ``pod`` (and its CPU and memory) on each GPU minus F
    before; inf where the GPU has no ``room``. ``take``: the share the device takes of each
    GPU (by default ``pod.share``; a device asking memory in MiB takes a different share of
    GPUs of different sizes). Only that GPU's terms change, so each is evaluated from the
    node's sums without rebuilding them."""
    f = _filled(free)
    share = pod.share if take is None else take
    base = parts(free, mix)
    before = _stranded(base, cpu_left, mem_left, mix)
    need = mix.share - _EPS
    fz = np.where(f >= 0.0, f, 0.0)[..., None]
    left = (f - share)[..., None]
    fits, fits_after = fz >= need, left >= need
    small = base.small[:, None, :] - np.where(fits, 0.0, fz) + np.where(fits_after, 0.0, left)
    room_k = base.room[:, None, :] - fits + fits_after
    total = base.total[:, None] - share + np.zeros(f.shape)
    after = _stranded(
        Parts(total, small, room_k),
        (cpu_left - pod.cpu_milli)[:, None],
        (mem_left - pod.memory_bytes)[:, None],
        mix,
    )
    out: F64 = np.where(room, after - before[:, None], np.inf)
    return out


def node_deltas(
    free: F64,
    cpu_left: F64,
    mem_left: F64,
    mix: TaskMix,
    pod: Shape,
    room: B,
    take: F64 | float | None = None,
    node_parts: Parts | None = None,
) -> Delta:
    """For a one-device ``pod``: per node the smallest of ``device_deltas`` over its GPUs and
    the GPU it is at (ties: the last), without its [N, W, kinds] table. Per kind, one GPU's
    device changes the node's terms in one of three ways, by where the kind's share falls
    against the GPU's free share before (f) and after (f'): at most f' (the GPU still fits
    it: only the CPU, memory and total change), above f (it was too small already: it gives
    up the device's share too), or between (the GPU stops fitting it: one GPU less with room,
    f' more too small). With the kinds by share, each GPU's F after is three ranges of
    per-node prefix sums, [N, kinds] work instead of [N, W, kinds]. ``node_parts``: ``parts``
    of ``free`` when the caller keeps them."""
    each = _gpu_deltas(free, cpu_left, mem_left, mix, pod, room, take, node_parts)
    col = last_min(each)
    d = each[np.arange(each.shape[0]), col]
    return Delta(d, np.where(np.isfinite(d), col, -1)[:, None].astype(np.int64))


def node_best(
    free: F64,
    cpu_left: F64,
    mem_left: F64,
    mix: TaskMix,
    pod: Shape,
    room: B,
    take: F64 | float | None = None,
    node_parts: Parts | None = None,
) -> F64:
    """``node_deltas(...).delta`` without the GPUs (what ranking nodes needs)."""
    out: F64 = _gpu_deltas(free, cpu_left, mem_left, mix, pod, room, take, node_parts).min(axis=1)
    return out


def _gpu_deltas(
    free: F64,
    cpu_left: F64,
    mem_left: F64,
    mix: TaskMix,
    pod: Shape,
    room: B,
    take: F64 | float | None,
    node_parts: Parts | None,
) -> F64:
    """[N, W] ``device_deltas`` by ``node_deltas``'s prefix sums."""
    n, w = free.shape
    f = _filled(free).ravel()  # per GPU, flat: no [N, 1] broadcasts below
    share = np.asarray(pod.share if take is None else take, np.float64)
    if share.shape != free.shape:
        share = np.broadcast_to(share, free.shape)
    share = share.ravel()
    p = parts(free, mix) if node_parts is None else node_parts
    wk = mix.weight[:, None]
    k = len(mix.weight)
    # kinds by rows, nodes along them: the prefix sums over kinds are whole-row additions
    small, room_k = np.ascontiguousarray(p.small.T), np.ascontiguousarray(p.room.T)
    ok_after = (cpu_left - pod.cpu_milli) >= mix.cpu[:, None]
    ok_after &= (mem_left - pod.memory_bytes) >= mix.memory[:, None]
    h_a = ok_after & (room_k >= mix.gpus[:, None])  # kinds the GPU's fit does not change
    h_b = ok_after & (room_k - 1 >= mix.gpus[:, None])  # kinds it stops fitting
    total = p.total[None, :]
    # the per-kind terms times the kind's weight, summed over kinds at once: a0 - t*a1 where
    # the GPU's fit does not change, b0 + f'*b2 - t*b1 where it stops fitting (b2, the
    # weights where it still hosts the kind, is the weights' sum, the last row, less b1)
    terms = np.zeros((5, k + 1, n))
    np.multiply(wk, np.where(h_a, small, total), out=terms[0, 1:])
    np.multiply(wk, ~h_a, out=terms[1, 1:])
    np.multiply(wk, np.where(h_b, small, total), out=terms[2, 1:])
    np.multiply(wk, ~h_b, out=terms[3, 1:])
    terms[4, 1:] = wk
    if n < _ROW_SUMS:
        np.cumsum(terms, axis=1, out=terms)
    else:  # a row of nodes at a time: cumsum's inner loop would stride across nodes
        for j in range(1, k + 1):
            terms[:, j] += terms[:, j - 1]
    pre = terms.reshape(5, -1)
    thresholds = mix.share - _EPS
    left = f - share
    node = np.repeat(np.arange(n), w)
    i1 = np.searchsorted(thresholds, left, side="right")  # kinds the GPU still fits after
    i2 = np.searchsorted(thresholds, f, side="right")  # kinds it fits before
    g1 = pre[:, i1 * n + node]  # [5, N*W] the prefix sums up to each range's bounds
    g2 = pre[:, i2 * n + node]
    last = pre[:, k * n + node]
    between = g2 - g1
    after = (
        g1[0]
        - share * g1[1]
        + between[2]
        + left * (between[4] - between[3])
        - share * between[3]
        + (last[0] - g2[0])
        - share * (last[4] - g2[4])
    )
    after -= _stranded(p, cpu_left, mem_left, mix)[node]
    each: F64 = np.where(room.ravel(), after, np.inf).reshape(n, w)
    return each


def last_min(values: F64) -> I64:
    """Per row, the column of the smallest value, ties to the last column (the engine's GPU
    order: HAMi tries the highest index first)."""
    w = values.shape[1]
    found: I64 = w - 1 - values[:, ::-1].argmin(axis=1)
    return found


def placement_delta(
    free: F64,
    cpu_left: F64,
    mem_left: F64,
    mix: TaskMix,
    pod: Shape,
    room: B | None = None,
    take: F64 | float | None = None,
    node_parts: Parts | None = None,
) -> Delta:
    """What placing ``pod`` does to each node's fragmentation (the nodes of ``free`` [N, W],
    each assumed to fit it; ``room``: the GPUs that can take one of its devices, by default
    ``room_for``; ``take``, ``node_parts``: as ``node_deltas``'s). A one-device pod is tried
    on every GPU with room and takes the best; a pod of several devices takes the GPUs with
    the least free share among those with room (ties: the highest index, as the engine
    picks); inf where too few have room."""
    n, w = free.shape
    columns = np.full((n, max(pod.gpus, 1)), -1, np.int64)
    if not pod.gpus:
        p = parts(free, mix) if node_parts is None else node_parts
        before = _stranded(p, cpu_left, mem_left, mix)
        after = _stranded(p, cpu_left - pod.cpu_milli, mem_left - pod.memory_bytes, mix)
        return Delta(after - before, columns)
    if room is None:
        room = room_for(free, pod.share)
    if pod.gpus == 1:
        each = device_deltas(free, cpu_left, mem_left, mix, pod, room, take)
        col = last_min(each)
        d = each[np.arange(n), col]
        columns[:, 0] = np.where(np.isfinite(d), col, -1)
        return Delta(d, columns)
    f = _filled(free)
    share = np.broadcast_to(np.asarray(pod.share if take is None else take, np.float64), f.shape)
    # tightest first, ties to the highest index: sort by (free, -column)
    key = np.where(room, f, np.inf) - np.arange(w) * 1e-12
    cols = np.argsort(key, axis=1, kind="stable")[:, : pod.gpus]
    ok = np.take_along_axis(room, cols, axis=1)
    columns[:] = np.where(ok, cols, -1)
    rows = np.arange(n)[:, None]
    trial = np.array(free, np.float64)
    trial[rows, cols] = np.where(ok, f[rows, cols] - share[rows, cols], f[rows, cols])
    p = parts(free, mix) if node_parts is None else node_parts
    before = _stranded(p, cpu_left, mem_left, mix)
    after = _stranded(parts(trial, mix), cpu_left - pod.cpu_milli, mem_left - pod.memory_bytes, mix)
    return Delta(np.where(ok.all(axis=1), after - before, np.inf), columns)


TIE_WEIGHT: Final = 3.0
"""Ties to the fuller node: its used GPU share (0..1) times this is added to its score
(``node_score``): it orders nodes of equal score towards the fuller one, and outweighs a few
points of score (measured on the FGD paper's traces, ``benchmarks/trace_replay.py``, Tessera
placing every pod: 0.5, under one point, allocates 0.1-0.3 % of the GPUs less than 3; 10
and 25 no better)."""

EMPTIER_TIE_WEIGHT: Final = 100.0
"""Ties to the emptier node: its free GPU share (0..1) times this is added to its score, as
much as the whole range of ``scores``. Measured on the same traces, Tessera placing the GPU
pods only (kube-scheduler's LeastAllocated the others), seeds 42-45: 3, 20, 40, 100, 300 and
3000 allocate 94.13, 95.33, 95.43, 95.62, 95.47 and 95.06 % on the default trace, 100 the
most on all four; with no pods without GPUs at all, 100 allocates 95.65 and 95.62 % on the
default and cpu050 traces' GPU pods against the fuller first's 95.46 and 95.36; where
Tessera places every pod, 90.12, 89.14, 91.29, 95.28 % on the four traces against the
fuller first's 95.48, 93.99, 96.43, 95.44."""


def node_score_max(fuller: bool) -> float:
    """The highest ``node_score`` with ties to the ``fuller`` node or to the emptier."""
    return 100.0 + (TIE_WEIGHT if fuller else EMPTIER_TIE_WEIGHT)


SCORE_STEP: Final = 1.0
"""The delta (in GPU shares) that moves ``scores`` across most of its range: 100 × sigmoid."""


def scores(delta: F64) -> I64:
    """kube-scheduler's 0..100 for each delta: 100 × sigmoid(−delta), floored. A node's score
    depends on that node alone."""
    # rounded first: sums of the same shares in another order differ in their last bits, and
    # a delta of exactly 0 (common) must not fall below a score boundary by them
    with np.errstate(over="ignore"):
        s = 100.0 / (1.0 + np.exp(np.round(delta, 9) / SCORE_STEP))
    return np.floor(s).astype(np.int64)


def node_score(delta: F64, free_share: F64, fuller: bool) -> F64:
    """The fragmentation policy's node score, 0..``node_score_max(fuller)``: ``scores`` of
    the pod's delta there plus ``TIE_WEIGHT`` times the node's used GPU share
    (``free_share``: its ``pack_key``), or with ``fuller`` false ``EMPTIER_TIE_WEIGHT``
    times its free share (``KindCounts.fuller_ties`` says which)."""
    if fuller:
        tie = TIE_WEIGHT * np.clip(1.0 - free_share, 0.0, 1.0)
    else:
        tie = EMPTIER_TIE_WEIGHT * np.clip(free_share, 0.0, 1.0)
    out: F64 = scores(delta) + tie
    return out


def pack_key(free: F64) -> F64:
    """Within equal scores, the node with the least free GPU share (as a share of its GPUs)
    first: lower is better."""
    count = np.maximum((free == free).sum(axis=1), 1)  # the GPUs (NaN: none)
    out: F64 = np.fmax(free, 0.0).sum(axis=1) / count
    return out


def pod_shape(cpu_milli: int, memory_bytes: int, gpus: int, share: float) -> Shape:
    """A ``Shape`` of what a pod holds, never refused: ``share`` rounded to 1/1000 (kinds
    that differ by float noise are one) within [1/1000, 1], negative requests as 0."""
    share = min(1.0, max(0.001, round(float(share), 3))) if gpus > 0 else 0.0
    return Shape(max(0, cpu_milli), max(0, memory_bytes), max(0, gpus), share)


__all__ = [
    "COVERAGE",
    "DEFAULT_MIX",
    "MIX_DRIFT",
    "WINDOW",
    "Delta",
    "KindCounts",
    "Parts",
    "Shape",
    "TaskMix",
    "device_deltas",
    "drift",
    "fragmentation",
    "free_share",
    "last_min",
    "node_best",
    "node_deltas",
    "node_score",
    "node_score_max",
    "pack_key",
    "parts",
    "placement_delta",
    "pod_shape",
    "room_for",
    "scores",
]
