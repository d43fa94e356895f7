"""Node ranking (``core.ranking``): Tessera's absolute scores, the one order, the candidates."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from api.hami.policy import Policy
from scheduler_plugins.core import ranking
from scheduler_plugins.core.ranking import Preference

BINPACK = Preference(Policy.BINPACK, 30.0)
SPREAD = Preference(Policy.SPREAD, 30.0)


@pytest.mark.parametrize(
    ("pref", "scores", "want"),
    [
        (BINPACK, [0.0, 19.75, 10.5, 30.0], [0, 66, 35, 100]),  # the seed's node scores
        (SPREAD, [0.0, 19.75, 10.5, 30.0], [100, 34, 65, 0]),
        (BINPACK, [0.14], [0]),  # a pod's worth on a big node: below one point
        (Preference(Policy.BINPACK, 50.0), [25.0], [50]),  # with CPU and memory terms
        (BINPACK, [31.0, -1.0], [100, 0]),  # never outside 0..100
    ],
)
def test_tessera_scores_are_the_policy_preference_on_an_absolute_scale(
    pref: Preference, scores: list[float], want: list[int]
) -> None:
    assert pref.kube_scores(np.array(scores)).tolist() == want


def test_one_node_alone_is_not_stretched_to_the_maximum() -> None:
    assert BINPACK.kube_scores(np.array([3.0])).tolist() == [10]


def _names(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.int64)  # name rank = segment here


def test_order_is_score_then_desirability_then_name() -> None:
    # 10.2 and 10.3 both round to 34 but 10.3 is fuller; 3 and 4 tie exactly: name decides.
    score = np.array([10.2, 10.3, 20.0, 5.0, 5.0])
    name_rank = np.array([0, 1, 2, 4, 3])
    got = ranking.order(np.arange(5), score, BINPACK, name_rank).tolist()
    assert got == [2, 1, 0, 4, 3]
    got = ranking.order(np.arange(5), score, SPREAD, name_rank).tolist()
    assert got == [4, 3, 0, 1, 2]


def test_sums_in_another_order_do_not_decide_between_nodes() -> None:
    a = 0.1 + 0.2 + 0.3
    b = 0.3 + 0.2 + 0.1  # a != b in the last bit
    assert a != b
    score = np.array([max(a, b), min(a, b)])
    name_rank = np.array([1, 0])  # segment 1 has the first name
    assert ranking.order(np.arange(2), score, BINPACK, name_rank).tolist() == [1, 0]
    assert ranking.best(np.ones(2, np.bool_), score, BINPACK, name_rank) == 1


@given(
    st.lists(st.sampled_from([0.0, 1.5, 10.2, 10.3, 10.3000000001, 29.9]), min_size=1, max_size=30),
    st.lists(st.booleans(), min_size=30, max_size=30),
    st.sampled_from([BINPACK, SPREAD]),
    st.randoms(),
)
def test_best_is_the_first_of_the_order(
    scores: list[float], feasible: list[bool], pref: Preference, rnd: object
) -> None:
    n = len(scores)
    score = np.array(scores)
    mask = np.array(feasible[:n])
    name_rank = np.array(sorted(range(n), key=lambda _: rnd.random()))  # type: ignore[attr-defined]
    segs = np.flatnonzero(mask)
    want = int(ranking.order(segs, score, pref, name_rank)[0]) if segs.size else -1
    assert ranking.best(mask, score, pref, name_rank) == want


def test_candidates_without_a_limit_are_every_node_best_first() -> None:
    score = np.array([1.0, 9.0, 5.0])
    waits = np.array([0, 3, 0])
    got = ranking.candidates(np.arange(3), score, BINPACK, _names(3), waits, 0)
    assert got.tolist() == [1, 2, 0]  # waiting does not matter without a limit


def test_candidates_with_a_limit_are_the_best_where_the_pod_waits_least() -> None:
    score = np.array([1.0, 9.0, 5.0, 7.0])
    segs = np.arange(4)
    assert ranking.candidates(segs, score, BINPACK, _names(4), None, 2).tolist() == [1, 3]
    waits = np.array([0, 1, 0, 2])
    assert ranking.candidates(segs, score, BINPACK, _names(4), waits, 10).tolist() == [2, 0]
    every_node_busy = np.array([2, 1, 3, 1])
    got = ranking.candidates(segs, score, BINPACK, _names(4), every_node_busy, 10)
    assert got.tolist() == [1, 3]  # the fewest pods to wait behind, best first


def test_no_candidates_of_no_nodes() -> None:
    empty = np.zeros(0, np.int64)
    assert ranking.candidates(empty, np.zeros(0), BINPACK, empty, empty, 5).tolist() == []
