"""Numbers from timestamps: percentiles, latency summaries, throughput and rate series.

Pure functions over floats (seconds on one monotonic clock); no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Final

from api.errors import InvalidInputError

QUANTILES: Final = (50.0, 90.0, 99.0)


class StatsError(InvalidInputError):
    """A statistic was asked of data it is not defined for."""


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between closest ranks
    (numpy's default): ``percentile([1, 2, 3, 4], 50) == 2.5``."""
    if not values:
        raise StatsError("percentile of no values")
    if not 0.0 <= q <= 100.0 or math.isnan(q):
        raise StatsError(f"percentile must be in 0..100, got {q}")
    ordered = sorted(values)
    rank = q / 100.0 * (len(ordered) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


@dataclass(frozen=True)
class Summary:
    """A latency distribution in milliseconds."""

    count: int
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float

    def to_json(self) -> dict[str, float | int]:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def summarize_seconds(values: Sequence[float]) -> Summary | None:
    """Summary (in ms) of durations given in seconds; None when there are none."""
    if not values:
        return None
    ms = [v * 1000.0 for v in values]
    p50, p90, p99 = (percentile(ms, q) for q in QUANTILES)
    return Summary(
        count=len(ms), mean_ms=sum(ms) / len(ms), p50_ms=p50, p90_ms=p90, p99_ms=p99, max_ms=max(ms)
    )


def latencies(start: Mapping[str, float], end: Mapping[str, float]) -> list[float]:
    """``end[k] - start[k]`` for every key in both (seconds)."""
    return [end[k] - start[k] for k in start.keys() & end.keys()]


def throughput(first_start: float, ends: Iterable[float]) -> float:
    """Events per second from ``first_start`` to the last of ``ends`` (0 when none)."""
    ends = list(ends)
    if not ends:
        return 0.0
    span = max(ends) - first_start
    if span <= 0:
        raise StatsError(f"the last event is not after the start ({span:.6f}s)")
    return len(ends) / span


def rate_series(times: Iterable[float], *, start: float, bin_s: float = 1.0) -> list[int]:
    """How many of ``times`` fall in each ``bin_s`` window from ``start`` (times before
    ``start`` count in the first window)."""
    if bin_s <= 0:
        raise StatsError(f"bin width must be > 0, got {bin_s}")
    counts: list[int] = []
    for t in times:
        i = max(0, int((t - start) // bin_s))
        if i >= len(counts):
            counts.extend([0] * (i + 1 - len(counts)))
        counts[i] += 1
    return counts


def steady_rate(series: Sequence[int], *, bin_s: float = 1.0, trim: float = 0.1) -> float:
    """Mean rate over the middle of a rate series (the first and last ``trim`` share of the
    busy windows dropped: ramp-up and the tail of stragglers)."""
    if not 0.0 <= trim < 0.5:
        raise StatsError(f"trim must be in [0, 0.5), got {trim}")
    busy = [i for i, n in enumerate(series) if n > 0]
    if not busy:
        return 0.0
    window = series[busy[0] : busy[-1] + 1]
    cut = int(len(window) * trim)
    middle = window[cut : len(window) - cut] or window
    return sum(middle) / (len(middle) * bin_s)
