"""Invariants of the MIG placement policy over real and random geometries."""

from __future__ import annotations

import functools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from api.hami.catalog import MODELS
from api.hami.policy import PlacementStrategy
from api.hami.register import MigProfile, Placement
from scheduler_plugins.core.mig_policy import ChoiceTable, build_choice_table

# Table builds take milliseconds, but the first of a geometry can exceed the default deadline.
relaxed = settings(deadline=None, max_examples=150)

_MIG_MODELS = [m for m in MODELS if m.mig_capable]


@st.composite
def catalog_geometry(draw: st.DrawFn) -> tuple[MigProfile, ...]:
    model = draw(st.sampled_from(_MIG_MODELS))
    names = draw(st.sets(st.sampled_from([p.name for p in model.profiles]), min_size=1))
    return tuple(model.mig_profile(p) for p in model.profiles if p.name in names)


@st.composite
def random_geometry(draw: st.DrawFn) -> tuple[MigProfile, ...]:
    total = draw(st.integers(1, 10))
    out = []
    for i in range(draw(st.integers(1, 4))):
        size = draw(st.integers(1, total))
        starts = draw(st.sets(st.integers(0, total - size), max_size=total - size + 1))
        out.append(
            MigProfile(
                name=f"p{i}",
                memory_mb=draw(st.integers(1, 4)) * 1000,
                core=10,
                slice_count=draw(st.integers(1, 4)),
                placements=tuple(Placement(s, size) for s in sorted(starts)),
            )
        )
    return tuple(out)


geometries = st.one_of(catalog_geometry(), random_geometry())
strategies = st.sampled_from(list(PlacementStrategy))


@st.composite
def tables(draw: st.DrawFn) -> ChoiceTable:
    profiles = draw(geometries)
    weights = draw(
        st.none()
        | st.fixed_dictionaries(
            {p.name: st.floats(0, 10, allow_nan=False, allow_infinity=False) for p in profiles}
        )
    )
    return build_choice_table(profiles, draw(strategies), weights)


def free_placements(profile: MigProfile, mask: int) -> list[Placement]:
    return [pl for pl in profile.placements if pl.mask & mask == 0]


def contract_rank(table: ChoiceTable, mask: int, min_rank: int) -> int | None:
    """The product contract, by brute force: first rank >= min_rank with a free placement."""
    for rank in range(min_rank, len(table.profiles)):
        if free_placements(table.profiles[rank], mask):
            return rank
    return None


def has_room(profile: MigProfile, mask: int) -> bool:
    if not profile.placements:
        return False
    usable = functools.reduce(lambda a, b: a | b, (pl.mask for pl in profile.placements))
    return (usable & ~mask).bit_count() >= min(pl.size for pl in profile.placements)


@relaxed
@given(table=tables(), data=st.data())
def test_replayed_choices_follow_the_contract_and_never_overlap(
    table: ChoiceTable, data: st.DataObject
) -> None:
    n = len(table.profiles)
    requests = data.draw(st.lists(st.integers(0, n - 1), max_size=20))
    mask = data.draw(st.integers(0, table.full_mask))  # any pre-existing occupancy
    for r in requests:
        choice = table.choose(mask, r)
        want = contract_rank(table, mask, r)
        if choice is None:
            assert want is None
            expected_fragmented = any(has_room(p, mask) for p in table.profiles[r:])
            assert table.is_fragmented(mask, r) is expected_fragmented
            continue
        rank, start = choice
        assert rank == want and rank >= r
        pl = table.placement(rank, start)  # a legal placement of the chosen profile
        assert pl in table.profiles[rank].placements
        assert pl.mask & mask == 0
        assert not table.is_fragmented(mask, r)
        assert table.start_for(mask, rank) == start
        mask |= pl.mask


@relaxed
@given(table=tables())
def test_more_occupancy_never_creates_a_choice(table: ChoiceTable) -> None:
    has = table.profile >= 0
    masks = np.arange(table.full_mask + 1)
    for bit in range(table.total_slices):
        without = masks[(masks >> bit & 1) == 0]
        # A choice at mask | bit implies a choice at mask.
        assert not bool((has[without | (1 << bit)] & ~has[without]).any())


@relaxed
@given(table=tables())
def test_a_choice_for_rank_r_means_a_choice_for_every_smaller_min_rank(
    table: ChoiceTable,
) -> None:
    has = table.profile >= 0
    for r in range(1, len(table.profiles)):
        assert not bool((has[:, r] & ~has[:, r - 1]).any())


@relaxed
@given(profiles=geometries, data=st.data())
def test_fragmentation_aware_is_an_argmax_and_dominates_fixed_orders(
    profiles: tuple[MigProfile, ...], data: st.DataObject
) -> None:
    best = build_choice_table(profiles)
    for strategy in (PlacementStrategy.HAMI_V2_10, PlacementStrategy.LOWEST_START):
        fixed = build_choice_table(profiles, strategy)
        assert bool((best.value >= fixed.value - 1e-9).all())
    mask = data.draw(st.integers(0, best.full_mask))
    for rank, profile in enumerate(best.profiles):
        free = sorted(free_placements(profile, mask), key=lambda pl: pl.start)
        start = best.start_for(mask, rank)
        if not free:
            assert start is None
            continue
        top = max(best.value[mask | pl.mask] for pl in free)
        first_best = next(pl for pl in free if best.value[mask | pl.mask] >= top - 1e-9)
        assert start == first_best.start


@relaxed
@given(table=tables(), data=st.data())
def test_free_intervals_are_the_maximal_free_runs(table: ChoiceTable, data: st.DataObject) -> None:
    mask = data.draw(st.integers(0, table.full_mask))
    runs = table.free_intervals(mask)
    covered = 0
    prev_end = -1
    for start, end in runs:
        assert prev_end < start < end <= table.total_slices  # sorted, disjoint, non-adjacent
        covered |= ((1 << (end - start)) - 1) << start
        prev_end = end
    assert covered == table.full_mask & ~mask
