"""Percentiles, latency summaries, throughput and rate series of the cluster benchmark."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_plugins.devtools.bench.stats import (
    StatsError,
    latencies,
    percentile,
    rate_series,
    steady_rate,
    summarize_seconds,
    throughput,
)


@pytest.mark.parametrize(
    ("values", "q", "want"),
    [
        ([1.0, 2.0, 3.0, 4.0], 50, 2.5),
        ([1.0, 2.0, 3.0, 4.0], 0, 1.0),
        ([1.0, 2.0, 3.0, 4.0], 100, 4.0),
        ([4.0, 1.0, 3.0, 2.0], 25, 1.75),  # order does not matter
        ([7.0], 99, 7.0),
        ([0.0, 10.0], 90, 9.0),
    ],
)
def test_percentile_interpolates_between_closest_ranks(
    values: list[float], q: float, want: float
) -> None:
    assert percentile(values, q) == pytest.approx(want)


@settings(max_examples=20, deadline=None)
@given(
    values=st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=60),
    q=st.floats(0, 100),
)
def test_percentile_matches_numpy(values: list[float], q: float) -> None:
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), abs=1e-6)


@pytest.mark.parametrize(
    ("values", "q"), [([], 50), ([1.0], -1), ([1.0], 100.5), ([1.0], float("nan"))]
)
def test_percentile_rejects(values: list[float], q: float) -> None:
    with pytest.raises(StatsError):
        percentile(values, q)


def test_summary_is_in_milliseconds() -> None:
    s = summarize_seconds([0.001 * i for i in range(1, 101)])
    assert s is not None
    assert (s.count, s.max_ms) == (100, pytest.approx(100.0))
    assert s.mean_ms == pytest.approx(50.5)
    assert s.p50_ms == pytest.approx(50.5)
    assert s.p99_ms == pytest.approx(99.01)
    assert s.to_json()["p90_ms"] == pytest.approx(90.1)
    assert summarize_seconds([]) is None


def test_latencies_pair_by_key() -> None:
    start = {"a": 1.0, "b": 2.0, "c": 3.0}
    end = {"a": 1.5, "b": 4.0, "d": 9.0}
    assert sorted(latencies(start, end)) == [0.5, 2.0]


def test_throughput() -> None:
    assert throughput(10.0, [11.0, 12.0, 14.0]) == pytest.approx(0.75)
    assert throughput(0.0, []) == 0.0
    with pytest.raises(StatsError, match="not after the start"):
        throughput(5.0, [5.0])


def test_rate_series_bins_by_second_from_start() -> None:
    assert rate_series([10.1, 10.9, 12.5, 9.0], start=10.0) == [3, 0, 1]
    assert rate_series([], start=0.0) == []
    assert rate_series([1.0, 1.4, 2.1], start=1.0, bin_s=0.5) == [2, 0, 1]
    with pytest.raises(StatsError):
        rate_series([1.0], start=0.0, bin_s=0)


def test_steady_rate_drops_ramp_and_tail() -> None:
    series = [0, 1, 10, 10, 10, 10, 10, 10, 10, 10, 2, 0]
    # busy windows: index 1..10 (10 windows); 10% trimmed from each end -> 8 windows of 10
    assert steady_rate(series) == pytest.approx(10.0)
    assert steady_rate([0, 0]) == 0.0
    assert steady_rate([4], bin_s=2.0) == pytest.approx(2.0)
    with pytest.raises(StatsError):
        steady_rate([1], trim=0.5)
