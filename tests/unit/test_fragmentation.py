"""The fragmentation rule (``core.fragmentation``): worked values, the incremental per-GPU
deltas against a rebuild, the workload mix."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_plugins.core import fragmentation as fr

NAN = math.nan
INF = math.inf
HALF = fr.Shape(1000, 0, 1, 0.5)
WHOLE = fr.Shape(1000, 0, 1, 1.0)
# three pods of half a GPU for every whole-GPU pod
MIX = fr.TaskMix.of({HALF: 3, WHOLE: 1})


def frag(free: list[float], cpu: float = INF, mem: float = INF, mix: fr.TaskMix = MIX) -> float:
    return float(fr.fragmentation(np.array([free]), np.array([cpu]), np.array([mem]), mix)[0])


@pytest.mark.parametrize(
    ("free", "cpu", "mem", "want"),
    [
        pytest.param([1.0, 1.0], INF, INF, 0.0, id="empty node: every kind fits, nothing small"),
        pytest.param(
            [1.0, 0.5], INF, INF, 0.25 * 0.5, id="a half GPU is too small for a whole one"
        ),
        pytest.param([0.3, 1.0], INF, INF, 0.75 * 0.3 + 0.25 * 0.3, id="0.3 is small for both"),
        pytest.param([1.0, 0.5], 999, INF, 1.5, id="no CPU for any kind: all of it stranded"),
        pytest.param([1.0, NAN, NAN], INF, INF, 0.0, id="no GPU in the padding columns"),
        pytest.param([0.0, 0.0], INF, INF, 0.0, id="a full node strands nothing"),
        pytest.param([0.5, 0.5], INF, INF, 0.25 * 1.0, id="no whole GPU left for the whole kind"),
    ],
)
def test_fragmentation_worked_values(
    free: list[float], cpu: float, mem: float, want: float
) -> None:
    assert frag(free, cpu, mem) == pytest.approx(want)


def test_memory_counts_like_cpu() -> None:
    mix = fr.TaskMix.of({fr.Shape(0, 8 << 30, 1, 0.5): 1})
    assert frag([1.0], mem=4 << 30, mix=mix) == pytest.approx(1.0)
    assert frag([1.0], mem=8 << 30, mix=mix) == pytest.approx(0.0)


def test_a_kind_of_several_gpus_needs_that_many_with_room() -> None:
    mix = fr.TaskMix.of({fr.Shape(0, 0, 2, 1.0): 1})
    assert frag([1.0, 0.4], mix=mix) == pytest.approx(1.4)
    assert frag([1.0, 1.0, 0.4], mix=mix) == pytest.approx(0.4)


def test_a_half_pod_completes_a_half_used_gpu() -> None:
    d = fr.placement_delta(
        np.array([[1.0, 0.5, NAN], [1.0, 1.0, 1.0]]),
        np.full(2, 4000.0),
        np.full(2, INF),
        MIX,
        HALF,
    )
    assert d.delta.tolist() == pytest.approx([-0.125, 0.125])
    assert d.columns[:, 0].tolist() == [1, 2]  # equal GPUs: the last, as the engine picks


def test_a_cpu_pod_that_strands_a_nodes_gpus_costs_them() -> None:
    cpu_pod = fr.Shape(3000, 0, 0, 0.0)
    d = fr.placement_delta(
        np.array([[1.0, 1.0], [0.0, 0.0]]), np.full(2, 4000.0), np.full(2, INF), MIX, cpu_pod
    )
    # node 0 keeps 1000m, what each kind asks: nothing stranded; with 2000m asked it would be
    assert d.delta.tolist() == pytest.approx([0.0, 0.0])
    d = fr.placement_delta(
        np.array([[1.0, 1.0], [0.0, 0.0]]),
        np.full(2, 4000.0),
        np.full(2, INF),
        MIX,
        fr.Shape(3500, 0, 0, 0.0),
    )
    assert d.delta.tolist() == pytest.approx([2.0, 0.0])
    assert (d.columns == -1).all()


def test_several_devices_take_the_tightest_gpus_with_room() -> None:
    d = fr.placement_delta(
        np.array([[1.0, 0.6, 0.5, 0.2]]),
        np.full(1, INF),
        np.full(1, INF),
        MIX,
        fr.Shape(0, 0, 2, 0.5),
    )
    assert sorted(d.columns[0].tolist()) == [1, 2]


def test_no_room_is_never_chosen() -> None:
    free = np.array([[0.2, 0.3]])
    each = fr.device_deltas(
        free, np.full(1, INF), np.full(1, INF), MIX, HALF, fr.room_for(free, 0.5)
    )
    assert np.isinf(each).all()


@st.composite
def nodes_and_mix(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, fr.TaskMix, fr.Shape]:
    n = draw(st.integers(1, 4))
    w = draw(st.integers(1, 6))
    tenths = st.integers(0, 10).map(lambda t: t / 10)
    free = np.array([[draw(tenths) for _ in range(w)] for _ in range(n)], np.float64)
    for i in range(n):
        free[i, draw(st.integers(0, w)) :] = NAN  # padding after a node's GPUs
    cpu = np.array([draw(st.integers(0, 8)) * 1000.0 for _ in range(n)])
    kinds = draw(
        st.dictionaries(
            st.builds(
                fr.Shape,
                st.integers(0, 6).map(lambda c: c * 1000),
                st.just(0),
                st.integers(1, 3),
                st.integers(1, 10).map(lambda t: t / 10),
            ),
            st.integers(1, 5),
            min_size=1,
            max_size=5,
        )
    )
    pod = fr.Shape(draw(st.integers(0, 4)) * 1000, 0, 1, draw(st.integers(1, 10)) / 10)
    return free, cpu, fr.TaskMix.of(kinds, coverage=1.0), pod


@settings(max_examples=200, deadline=None)
@given(nodes_and_mix())
def test_per_gpu_deltas_match_a_rebuild(
    case: tuple[np.ndarray, np.ndarray, fr.TaskMix, fr.Shape],
) -> None:
    """The incremental per-GPU deltas equal F of the node rebuilt with the device minus F."""
    free, cpu, mix, pod = case
    mem = np.full(len(cpu), INF)
    room = fr.room_for(free, pod.share)
    each = fr.device_deltas(free, cpu, mem, mix, pod, room)
    before = fr.fragmentation(free, cpu, mem, mix)
    for i, j in zip(*np.nonzero(room), strict=True):
        after = free.copy()
        after[i, j] -= pod.share
        rebuilt = fr.fragmentation(after, cpu - pod.cpu_milli, mem, mix)[i] - before[i]
        assert each[i, j] == pytest.approx(rebuilt, abs=1e-9)
    assert np.isinf(each[~room]).all()


def test_scores_fall_as_the_delta_rises() -> None:
    s = fr.scores(np.array([-2.0, -0.5, 0.0, 0.5, 2.0, 50.0]))
    assert s.tolist() == sorted(s.tolist(), reverse=True)
    assert s[2] == 50
    assert s[-1] == 0 and s.min() >= 0 and s.max() <= 100


def test_mix_keeps_the_frequent_gpu_kinds() -> None:
    counts = {
        fr.Shape(0, 0, 1, 0.5): 60,
        fr.Shape(0, 0, 1, 1.0): 35,
        fr.Shape(0, 0, 1, 0.1): 5,
        fr.Shape(4000, 0, 0, 0.0): 500,  # CPU-only: never a kind that ranks nodes
    }
    mix = fr.TaskMix.of(counts, coverage=0.95)
    assert mix.share.tolist() == [0.5, 1.0]
    assert mix.weight.sum() == pytest.approx(1.0)
    assert mix.weight.tolist() == pytest.approx([60 / 95, 35 / 95])
    assert fr.TaskMix.of({fr.Shape(1, 0, 0, 0.0): 3}) is fr.DEFAULT_MIX


def test_mix_has_at_most_max_kinds() -> None:
    counts = {fr.Shape(i, 0, 1, 0.5): 1 for i in range(fr.MAX_KINDS * 2)}
    assert len(fr.TaskMix.of(counts, coverage=1.0).weight) == fr.MAX_KINDS


class Asking:
    """Pods asking for room, each a new one (``KindCounts.arrive``)."""

    def __init__(self, kinds: fr.KindCounts) -> None:
        self.kinds = kinds
        self.n = 0

    def __call__(self, cpu: int, share: float, times: int = 1) -> None:
        for _ in range(times):
            self.n += 1
            self.kinds.arrive(f"p{self.n}", fr.Shape(cpu, 0, 1, share))


def test_kind_counts_follow_the_pods_that_ask() -> None:
    kinds = fr.KindCounts(window=32)
    ask = Asking(kinds)
    ask(1000, 0.25)
    assert kinds.mix().share.tolist() == [0.25]  # the first GPU kind: at once
    ask(1000, 0.5)
    assert kinds.mix().share.tolist() == [0.25]  # later ones at the next reweigh
    ask(1000, 0.5, 15)
    assert kinds.mix().share.tolist() == [0.25, 0.5]  # by share
    for _ in range(40):
        kinds.arrive("p1", fr.Shape(1000, 0, 1, 0.25))  # a pod retried: counted once
    ask(1000, 0.5, 15)  # 32 pods: as many as the window holds
    assert kinds.mix().share.tolist() == [0.25, 0.5]
    ask(1000, 0.5)  # the 33rd: the 0.25 pod, the first, left the window
    assert kinds.mix().share.tolist() == [0.5]  # a kind of the mix gone: at once


@pytest.mark.parametrize(
    ("events", "fuller"),
    [
        ("", False),  # no pod without GPUs asked: another scheduler places them, or none
        ("a", True),  # Tessera places them
        ("gag", True),
        ("a" + "g" * 7, True),  # asked while the last window's GPU pods came
        ("a" + "g" * 8, False),  # not any more
        ("a" + "g" * 8 + "a", True),
    ],
)
def test_ties_go_to_the_fuller_node_while_tessera_places_cpu_pods(
    events: str, fuller: bool
) -> None:
    """``events``: a pod without GPUs asks (a), a GPU pod asks (g); window 8."""
    kinds = fr.KindCounts(window=8)
    ask = Asking(kinds)
    for e in events:
        if e == "a":
            kinds.host_only_asks()
        else:
            ask(0, 0.5)
    assert kinds.fuller_ties is fuller


def test_node_score_ties_to_the_fuller_or_the_emptier_node() -> None:
    delta = np.array([0.0, 0.0, -0.5])
    free = np.array([0.25, 0.75, 1.0])  # the third fragments least: first either way
    for fuller, order in ((True, [2, 0, 1]), (False, [2, 1, 0])):
        s = fr.node_score(delta, free, fuller)
        assert np.argsort(-s, kind="stable").tolist() == order
        assert s.min() >= 0.0 and s.max() <= fr.node_score_max(fuller)


def test_kind_counts_refuse_an_empty_window() -> None:
    with pytest.raises(ValueError, match="at least one"):
        fr.KindCounts(window=0)


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        ((-1, 0, 1, 0.5), "negative"),
        ((0, 0, -1, 0.5), "negative"),
        ((0, 0, 1, 0.0), r"share in \(0, 1\]"),
        ((0, 0, 1, 1.5), r"share in \(0, 1\]"),
    ],
)
def test_bad_shapes_are_refused(args: tuple[int, int, int, float], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        fr.Shape(*args)


def test_free_share_is_the_scarcer_of_cores_and_memory() -> None:
    one = np.array([1.0])
    got = fr.free_share(
        np.array([10.0, 10.0, 10.0]),
        np.array([0.0, 10.0, 3.0]),
        np.array([100.0, 100.0, 100.0]),
        np.array([20.0, 0.0, 50.0]),
        np.array([1000.0, 1000.0, 1000.0]),
        np.array([500.0, 0.0, 100.0]),
    )
    assert got.tolist() == pytest.approx([0.5, 0.0, 0.5])
    assert fr.free_share(one, one * 0, one * 0, one * 0, one, one * 0).tolist() == [0.0]


@settings(max_examples=200, deadline=None)
@given(nodes_and_mix())
def test_node_deltas_are_the_best_gpus(
    case: tuple[np.ndarray, np.ndarray, fr.TaskMix, fr.Shape],
) -> None:
    """The prefix-sum form equals the smallest per-GPU delta, at that GPU (ties: the last)."""
    free, cpu, mix, pod = case
    mem = np.full(len(cpu), INF)
    room = fr.room_for(free, pod.share)
    each = fr.device_deltas(free, cpu, mem, mix, pod, room)
    got = fr.node_deltas(free, cpu, mem, mix, pod, room)
    assert fr.node_best(free, cpu, mem, mix, pod, room).tolist() == got.delta.tolist()
    best = each.min(axis=1)
    fits = np.isfinite(best)
    assert got.delta[fits] == pytest.approx(best[fits], abs=1e-9)
    assert np.isinf(got.delta[~fits]).all()
    for i in np.flatnonzero(fits):
        at = int(got.columns[i, 0])
        assert each[i, at] == pytest.approx(best[i], abs=1e-9)
        assert not (each[i, at + 1 :] <= best[i] - 1e-12).any()
    # many nodes are summed another way (a row of nodes at a time): the same answers
    reps = -(-fr._ROW_SUMS // len(cpu))
    many = fr.node_deltas(
        np.tile(free, (reps, 1)),
        np.tile(cpu, reps),
        np.tile(mem, reps),
        mix,
        pod,
        np.tile(room, (reps, 1)),
    )
    assert many.delta.tolist() == pytest.approx(np.tile(got.delta, reps).tolist(), abs=1e-9)
    assert many.columns.tolist() == np.tile(got.columns, (reps, 1)).tolist()


@pytest.mark.parametrize(
    ("args", "want"),
    [
        ((1000, 0, 1, 0.00001), fr.Shape(1000, 0, 1, 0.001)),
        ((1000, 0, 1, 1.7), fr.Shape(1000, 0, 1, 1.0)),
        ((-5, -1, 1, 0.25), fr.Shape(0, 0, 1, 0.25)),
        ((1000, 0, 0, 0.5), fr.Shape(1000, 0, 0, 0.0)),
    ],
)
def test_what_a_pod_holds_is_always_a_shape(
    args: tuple[int, int, int, float], want: fr.Shape
) -> None:
    """A 1 MiB device of a large GPU, or odd counts: the state counts it, never refuses it."""
    assert fr.pod_shape(*args) == want


def test_a_mix_that_barely_moved_is_kept_so_kept_rows_stay_valid() -> None:
    """Rows kept per node are computed for one mix object: a rebuild whose weights moved less
    than ``MIX_DRIFT`` keeps the one in use; a real shift, or a new kind once it weighs that
    much, replaces it."""
    kinds = fr.KindCounts()
    ask = Asking(kinds)
    for _ in range(500):
        ask(1000, 0.5)
        ask(2000, 0.25)
    first = kinds.mix()
    ask(1000, 0.5, 160)  # a reweigh is due; 660:500 vs 500:500 is a drift of 0.07
    shifted = kinds.mix()
    assert shifted is not first and shifted.weight.tolist() == pytest.approx(
        [500 / 1160, 660 / 1160]
    )
    ask(2000, 0.25, 16)  # 660:516 vs 660:500, a drift of 0.006
    assert kinds.mix() is shifted
    ask(3000, 1.0)  # a new kind, within the 5 % the mix leaves out
    assert kinds.mix() is shifted
    ask(3000, 1.0, 15)  # 16 of 1192: a drift of 0.016
    assert kinds.mix() is shifted
    ask(3000, 1.0, 48)  # 64 of 1240: past MIX_DRIFT, and past the 5 % the mix leaves out
    assert kinds.mix().share.tolist() == [0.25, 0.5, 1.0]


def test_a_young_clusters_mix_follows_each_move_past_the_drift() -> None:
    """A few pods are the best guess of the workload there is: the mix follows them at each
    reweigh where it moved ``MIX_DRIFT`` or more."""
    kinds = fr.KindCounts()
    ask = Asking(kinds)
    for _ in range(8):
        ask(1000, 0.5)
        ask(2000, 0.25)
    first = kinds.mix()
    assert first.weight.tolist() == [0.5, 0.5]
    ask(1000, 0.5, 16)  # 24:8, a drift of 0.25
    second = kinds.mix()
    assert second is not first and second.weight.tolist() == [0.25, 0.75]
    ask(1000, 0.5, 16)  # 40:8 vs 24:8, a drift of 0.083
    assert kinds.mix().weight.tolist() == pytest.approx([8 / 48, 40 / 48])


def test_drift_is_total_variation_over_both_workloads_kinds() -> None:
    half, whole, quarter = fr.Shape(0, 0, 1, 0.5), fr.Shape(0, 0, 1, 1.0), fr.Shape(0, 0, 1, 0.25)
    a = {half: 3, whole: 1}
    assert fr.drift(a, {half: 1, whole: 1}) == pytest.approx(0.25)
    assert fr.drift(a, {half: 30, whole: 10}) == 0.0  # the same shares
    assert fr.drift(a, {half: 1}) == pytest.approx(0.25)  # the whole-GPU quarter is gone
    assert fr.drift({half: 1}, {quarter: 1}) == 1.0
    assert fr.drift({}, a) == 1.0 and fr.drift({}, {}) == 0.0


def test_kinds_trading_places_at_the_mix_cut_do_not_rebuild_it() -> None:
    """With more kinds than a mix keeps, all about as common, one more pod of each of a few
    left-out kinds puts them above kinds in the mix: the workload barely moved, the mix
    stays."""
    kinds = fr.KindCounts()
    ask = Asking(kinds)
    for i in range(2 * fr.MAX_KINDS):
        ask(1000 + i, 0.5, 30)
    first = kinds.mix()
    assert len(first.weight) == fr.MAX_KINDS
    for i in range(2 * fr.MAX_KINDS - 30, 2 * fr.MAX_KINDS):  # 30 pods, a reweigh is due
        ask(1000 + i, 0.5)
    assert kinds.mix() is first
