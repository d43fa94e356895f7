"""MIG placement policy: which profile and which placement a MIG request gets on one GPU.

This module owns the product's profile-choice rule and the placement strategies. A GPU's
geometry (the MIG profiles its node registered) is compiled once into a ``ChoiceTable``
indexed by occupancy bitmask (bit i set = memory slice i taken), so a scheduling cycle only
looks answers up. Pure: no I/O, no clock, no cluster state.

Profile choice (product contract): for a request whose smallest acceptable profile has rank r
(rank = index in ``sort_profiles`` order), take the first profile of rank >= r that has a free
legal placement; a larger profile is only the fallback when no smaller one fits. The strategy
only picks the placement inside that profile, deterministically, ties to the lowest start.

``FRAGMENTATION_AWARE`` is the exact expected-value policy for a request mix: with request
classes r drawn i.i.d. with probabilities w_r,

    V(mask) = sum_r w_r * [1 + max_pl V(mask | pl) if (mask, r) has a choice else 0]

is the expected number of further admissions before the first rejection, and the policy takes
the placement that maximises V of the resulting occupancy. V of a mask only depends on masks
with more bits set, so it is computed level by level (popcount descending), vectorised over
all masks of a level: a 12-slice GPU (4096 masks) builds in a few milliseconds.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from api.errors import InvalidInputError
from api.hami.policy import PlacementStrategy
from api.hami.register import MigProfile, Placement

MAX_SLICES: Final = 16
"""Most memory slices a geometry may span (real GPUs have 4, 8 or 12)."""

_NONE: Final = -1
# Values of symmetric placements can differ by float noise; closer than this counts as a tie
# so that the tie rule (lowest start) decides and the table stays deterministic across builds.
_TIE_EPS: Final = 1e-9


DEFAULT_STRATEGY: Final = PlacementStrategy.FRAGMENTATION_AWARE


def _never_reversed(_profile: MigProfile) -> bool:
    return False


def _hami_reversed(profile: MigProfile) -> bool:
    return profile.slice_count in (1, 3)


# Fixed-order strategies: does this profile try its placements highest start first?
# FRAGMENTATION_AWARE has no entry: it ranks placements by expected value instead.
_FIXED_ORDER_REVERSED: Final[Mapping[PlacementStrategy, Callable[[MigProfile], bool]]] = {
    PlacementStrategy.LOWEST_START: _never_reversed,
    PlacementStrategy.HAMI_V2_10: _hami_reversed,
}


def sort_profiles(profiles: Sequence[MigProfile]) -> tuple[MigProfile, ...]:
    """Profiles in choice order: by (memory_mb, slice_count, name). Rank = index here."""
    return tuple(sorted(profiles, key=lambda p: (p.memory_mb, p.slice_count, p.name)))


Int8Array = npt.NDArray[np.int8]
BoolArray = npt.NDArray[np.bool_]
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, eq=False)
class ChoiceTable:
    """Every answer of the placement policy for one GPU geometry, indexed [mask, rank].

    Arrays are read-only and shared between callers (tables are cached).
    """

    profiles: tuple[MigProfile, ...]
    """Sorted by ``sort_profiles``; rank r is ``profiles[r]``."""
    total_slices: int
    """Largest placement end: masks range over ``[0, 2**total_slices)``."""
    profile: Int8Array
    """[mask, min_rank] -> rank of the chosen profile, -1 when nothing fits."""
    start: Int8Array
    """[mask, min_rank] -> start of the chosen placement, -1 when nothing fits."""
    fragmented: BoolArray
    """[mask, min_rank] -> no choice, yet some profile of rank >= min_rank has at least as
    many free slices among those its placements can use as its placement size: capacity
    exists, only no legal contiguous placement does. False = plain lack of capacity (or a
    choice exists)."""
    exact_start: Int8Array
    """[mask, rank] -> the strategy's start for exactly this profile (no fallback), -1 if
    it has no free placement."""
    value: FloatArray
    """[mask] -> expected further admissions before the first rejection under this table's
    own policy and the request mix it was built with (see module docstring)."""
    strategy: PlacementStrategy
    weights: tuple[float, ...]
    """Normalised request-mix probability per rank."""

    @property
    def full_mask(self) -> int:
        return (1 << self.total_slices) - 1

    def rank_of(self, name: str) -> int:
        """Rank of the profile called ``name``; KeyError if the geometry lacks it."""
        for rank, p in enumerate(self.profiles):
            if p.name == name:
                return rank
        raise KeyError(f"no MIG profile {name!r} in {[p.name for p in self.profiles]}")

    def min_rank_for_memory(self, memory_mb: int) -> int | None:
        """Rank of the smallest profile with at least ``memory_mb`` MiB, None if none has."""
        memory = np.array([p.memory_mb for p in self.profiles], np.int64)
        rank = int(smallest_rank(memory, np.zeros_like(memory), float(memory_mb), 0))
        return rank if rank < len(self.profiles) else None

    def choose(self, mask: int, min_rank: int) -> tuple[int, int] | None:
        """(rank, start) of the profile and placement a request of ``min_rank`` gets."""
        m = self._index(mask)
        self._check_rank(min_rank)
        rank = int(self.profile[m, min_rank])
        if rank == _NONE:
            return None
        return rank, int(self.start[m, min_rank])

    def start_for(self, mask: int, rank: int) -> int | None:
        """Start the strategy gives exactly profile ``rank`` (no fallback); None if no room."""
        m = self._index(mask)
        self._check_rank(rank)
        start = int(self.exact_start[m, rank])
        return None if start == _NONE else start

    def is_fragmented(self, mask: int, min_rank: int) -> bool:
        m = self._index(mask)
        self._check_rank(min_rank)
        return bool(self.fragmented[m, min_rank])

    def placement(self, rank: int, start: int) -> Placement:
        """The legal placement of profile ``rank`` at ``start``."""
        self._check_rank(rank)
        for pl in self.profiles[rank].placements:
            if pl.start == start:
                return pl
        raise KeyError(f"profile {self.profiles[rank].name} has no placement at start {start}")

    def free_intervals(self, mask: int) -> list[tuple[int, int]]:
        """Maximal runs ``[start, end)`` of free slices, ascending (for explanations)."""
        m = self._index(mask)
        runs: list[tuple[int, int]] = []
        run_start: int | None = None
        for i in range(self.total_slices):
            if m >> i & 1:
                if run_start is not None:
                    runs.append((run_start, i))
                    run_start = None
            elif run_start is None:
                run_start = i
        if run_start is not None:
            runs.append((run_start, self.total_slices))
        return runs

    def _index(self, mask: int) -> int:
        if mask < 0:
            raise ValueError(f"occupancy mask must be >= 0, got {mask}")
        # Slices beyond every allowed placement (e.g. an instance of a profile since removed
        # from the allowlist) can't change any answer, so they are ignored, not rejected.
        return mask & self.full_mask

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < len(self.profiles):
            raise ValueError(
                f"rank {rank} out of range: the geometry has {len(self.profiles)} profiles"
            )


def smallest_rank(
    memory: npt.NDArray[np.int64],
    cores: npt.NDArray[np.int64],
    req_mem: npt.NDArray[np.float64] | float,
    req_cores: int,
) -> npt.NDArray[np.int64]:
    """The smallest acceptable profile: the rank (choice order, ``memory``/``cores`` per rank)
    of the first profile with at least ``req_mem`` MiB and ``req_cores`` cores, per request
    memory; ``len(memory)`` where no profile has that much."""
    mem = np.atleast_1d(np.asarray(req_mem, np.float64))
    fits = (memory[None, :] >= mem[:, None]) & (cores[None, :] >= req_cores)
    ranks: npt.NDArray[np.int64] = np.where(fits.any(axis=1), fits.argmax(axis=1), memory.size)
    return ranks.reshape(np.shape(req_mem))


def build_choice_table(
    profiles: Sequence[MigProfile],
    strategy: PlacementStrategy = DEFAULT_STRATEGY,
    weights: Mapping[str, float] | None = None,
) -> ChoiceTable:
    """The (cached) choice table of a geometry under ``strategy``.

    ``weights`` maps profile name -> relative frequency of requests whose smallest acceptable
    profile is that one (default: uniform over ``profiles``; names not present are ignored;
    if no present profile has a positive weight the mix is unknown and uniform is used).
    Raises InvalidInputError for an illegal geometry, ValueError for bad weights.
    """
    ordered = sort_profiles(profiles)
    _validate_geometry(ordered)
    return _build_cached(ordered, PlacementStrategy.parse(strategy), _normalise(ordered, weights))


def _validate_geometry(profiles: tuple[MigProfile, ...]) -> None:
    names = [p.name for p in profiles]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise InvalidInputError(f"MIG profiles listed twice: {', '.join(dupes)}")
    if len(profiles) > 127:
        raise InvalidInputError(f"{len(profiles)} MIG profiles on one GPU; at most 127")
    for p in profiles:
        starts = [pl.start for pl in p.placements]
        if len(set(starts)) != len(starts):
            raise InvalidInputError(f"MIG profile {p.name}: two placements share a start")
        for pl in p.placements:
            if pl.start < 0 or pl.size < 1 or pl.end > MAX_SLICES:
                raise InvalidInputError(
                    f"MIG profile {p.name}: placement {{start {pl.start}, size {pl.size}}} "
                    f"must lie within {MAX_SLICES} memory slices and have size >= 1"
                )


def _normalise(
    profiles: tuple[MigProfile, ...], weights: Mapping[str, float] | None
) -> tuple[float, ...]:
    n = len(profiles)
    if n == 0:
        return ()
    if weights is None:
        return (1.0 / n,) * n
    raw = [float(weights.get(p.name, 0.0)) for p in profiles]
    for p, w in zip(profiles, raw, strict=True):
        if not math.isfinite(w) or w < 0:
            raise ValueError(
                f"request-mix weight of MIG profile {p.name} must be finite and >= 0, got {w}"
            )
    total = sum(raw)
    if total <= 0:
        return (1.0 / n,) * n
    return tuple(w / total for w in raw)


# Keyed by (geometry, strategy, mix); a cluster has a handful of each. Callers that derive the
# mix from live traffic should round it, or every small drift builds a new table.
@functools.lru_cache(maxsize=64)
def _build_cached(
    profiles: tuple[MigProfile, ...],
    strategy: PlacementStrategy,
    weights: tuple[float, ...],
) -> ChoiceTable:
    return _build(profiles, strategy, weights)


def _build(
    profiles: tuple[MigProfile, ...],
    strategy: PlacementStrategy,
    weights: tuple[float, ...],
) -> ChoiceTable:
    n = len(profiles)
    total = max((pl.end for p in profiles for pl in p.placements), default=0)
    n_masks = 1 << total
    masks = np.arange(n_masks, dtype=np.int64)
    popcount = np.bitwise_count(masks)

    # Placements of each profile in preference order. By-value ranking scans them lowest start
    # first, so among equal values the lowest start wins.
    reversed_of = _FIXED_ORDER_REVERSED.get(strategy)
    ordered_pls: list[tuple[Placement, ...]] = []
    for p in profiles:
        by_start = sorted(p.placements, key=lambda pl: pl.start)
        if reversed_of is not None and reversed_of(p):
            by_start.reverse()
        ordered_pls.append(tuple(by_start))

    exact_start = np.full((n_masks, n), _NONE, dtype=np.int8)
    value = np.zeros(n_masks, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    for level in range(total, -1, -1):
        ms = masks[popcount == level]
        best = np.full((ms.size, n), -np.inf)
        for k, pls in enumerate(ordered_pls):
            if not pls:
                continue
            fits = np.stack([(ms & pl.mask) == 0 for pl in pls], axis=1)
            after = np.stack([ms | pl.mask for pl in pls], axis=1)
            vals = np.where(fits, value[after], -np.inf)
            if reversed_of is None:
                top = vals.max(axis=1)
                pick = np.argmax(vals >= top[:, None] - _TIE_EPS, axis=1)
            else:
                pick = np.argmax(fits, axis=1)
            has = fits.any(axis=1)
            starts = np.asarray([pl.start for pl in pls], dtype=np.int8)
            exact_start[ms[has], k] = starts[pick[has]]
            best[:, k] = np.where(has, vals[np.arange(ms.size), pick], -np.inf)
        # Fallback: class r is served by the first rank >= r that fits.
        served = np.full(ms.size, -np.inf)
        expected = np.zeros(ms.size)
        for r in range(n - 1, -1, -1):
            served = np.where(np.isfinite(best[:, r]), best[:, r], served)
            expected += w[r] * np.where(np.isfinite(served), 1.0 + served, 0.0)
        value[ms] = expected

    chosen = np.full((n_masks, n), _NONE, dtype=np.int8)
    chosen_start = np.full((n_masks, n), _NONE, dtype=np.int8)
    fragmented = np.zeros((n_masks, n), dtype=np.bool_)
    next_rank = np.full(n_masks, _NONE, dtype=np.int8)
    next_start = np.full(n_masks, _NONE, dtype=np.int8)
    room_from_r = np.zeros(n_masks, dtype=np.bool_)
    for r in range(n - 1, -1, -1):
        fits_r = exact_start[:, r] != _NONE
        next_rank = np.where(fits_r, np.int8(r), next_rank)
        next_start = np.where(fits_r, exact_start[:, r], next_start)
        chosen[:, r] = next_rank
        chosen_start[:, r] = next_start
        legal = profiles[r].placements
        if legal:
            usable = functools.reduce(lambda a, b: a | b, (pl.mask for pl in legal))
            need = min(pl.size for pl in legal)
            room_from_r |= np.bitwise_count(~masks & usable) >= need
        fragmented[:, r] = (next_rank == _NONE) & room_from_r

    for arr in (chosen, chosen_start, fragmented, exact_start, value):
        arr.setflags(write=False)
    return ChoiceTable(
        profiles=profiles,
        total_slices=total,
        profile=chosen,
        start=chosen_start,
        fragmented=fragmented,
        exact_start=exact_start,
        value=value,
        strategy=strategy,
        weights=weights,
    )
