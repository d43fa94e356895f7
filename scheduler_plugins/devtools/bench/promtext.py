"""Prometheus text exposition → histograms → quantiles (what ``histogram_quantile`` does).

The benchmark scrapes the plugin server's ``/metrics`` before and after a phase and reports
the quantiles of the difference, so only that phase's observations count.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from api.errors import InvalidInputError

_SAMPLE_RE: Final = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?$"
)
_LABEL_RE: Final = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')
_ESCAPES: Final = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}

Labels = tuple[tuple[str, str], ...]


class MetricsFormatError(InvalidInputError):
    """A /metrics answer is not Prometheus text format."""


@dataclass(frozen=True)
class Sample:
    name: str
    labels: Labels
    value: float


def parse(text: str) -> list[Sample]:
    """Every sample line of a text exposition (comments and blank lines skipped)."""
    out: list[Sample] = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE_RE.match(line)
        if m is None:
            raise MetricsFormatError(f"metrics line {n}: not a sample: {line[:120]!r}")
        try:
            value = float(m.group("value"))
        except ValueError:
            raise MetricsFormatError(
                f"metrics line {n}: value {m.group('value')!r} is not a number"
            ) from None
        out.append(Sample(m.group("name"), _labels(m.group("labels") or "", n), value))
    return out


def _labels(raw: str, line: int) -> Labels:
    pairs: list[tuple[str, str]] = []
    pos = 0
    raw = raw.strip()
    while pos < len(raw):
        m = _LABEL_RE.match(raw, pos)
        if m is None:
            raise MetricsFormatError(f"metrics line {line}: bad labels {raw[:120]!r}")
        value = re.sub(r"\\[\\\"n]", lambda e: _ESCAPES[e.group(0)], m.group(2))
        pairs.append((m.group(1), value))
        pos = m.end()
    return tuple(sorted(pairs))


@dataclass(frozen=True)
class Histogram:
    """One histogram series: cumulative buckets by upper bound (the last is +Inf)."""

    name: str
    labels: Labels
    buckets: tuple[tuple[float, float], ...]
    count: float
    total: float

    def label(self, key: str) -> str:
        return dict(self.labels).get(key, "")

    def quantile(self, q: float) -> float | None:
        """Linear interpolation inside the bucket holding rank ``q × count`` (as
        ``histogram_quantile``); the highest finite bound when that is the +Inf bucket;
        None for an empty histogram."""
        if not 0.0 <= q <= 1.0:
            raise MetricsFormatError(f"quantile must be in 0..1, got {q}")
        if self.count <= 0 or not self.buckets:
            return None
        rank = q * self.count
        lower_bound, lower_count = 0.0, 0.0
        for bound, cumulative in self.buckets:
            if cumulative >= rank:
                if math.isinf(bound):
                    return lower_bound
                width = cumulative - lower_count
                if width <= 0:
                    return bound
                return lower_bound + (bound - lower_bound) * (rank - lower_count) / width
            lower_bound, lower_count = bound, cumulative
        return lower_bound

    def mean(self) -> float | None:
        return self.total / self.count if self.count > 0 else None

    def minus(self, earlier: Histogram | None) -> Histogram:
        """The observations made since ``earlier`` (a scrape of the same series)."""
        if earlier is None:
            return self
        before = dict(earlier.buckets)
        return Histogram(
            self.name,
            self.labels,
            tuple((b, c - before.get(b, 0.0)) for b, c in self.buckets),
            self.count - earlier.count,
            self.total - earlier.total,
        )


def histograms(samples: Iterable[Sample]) -> list[Histogram]:
    """Every histogram series among ``samples`` (``<name>_bucket``/``_count``/``_sum``)."""
    buckets: dict[tuple[str, Labels], list[tuple[float, float]]] = {}
    counts: dict[tuple[str, Labels], float] = {}
    sums: dict[tuple[str, Labels], float] = {}
    for s in samples:
        if s.name.endswith("_bucket"):
            le = dict(s.labels).get("le")
            if le is None:
                continue
            key = (s.name[: -len("_bucket")], tuple(p for p in s.labels if p[0] != "le"))
            buckets.setdefault(key, []).append((float(le), s.value))
        elif s.name.endswith("_count"):
            counts[(s.name[: -len("_count")], s.labels)] = s.value
        elif s.name.endswith("_sum"):
            sums[(s.name[: -len("_sum")], s.labels)] = s.value
    out: list[Histogram] = []
    for key, bs in sorted(buckets.items()):
        ordered = tuple(sorted(bs))
        count = counts.get(key, ordered[-1][1] if ordered else 0.0)
        out.append(Histogram(key[0], key[1], ordered, count, sums.get(key, 0.0)))
    return out


def counter_totals(
    samples: Iterable[Sample], name: str, keep: Sequence[str]
) -> dict[Labels, float]:
    """The samples of counter ``name`` summed over every label but ``keep``."""
    out: dict[Labels, float] = {}
    for s in samples:
        if s.name != name:
            continue
        labels = dict(s.labels)
        key = tuple((k, labels.get(k, "")) for k in keep)
        out[key] = out.get(key, 0.0) + s.value
    return out


def find(hists: Sequence[Histogram], name: str, labels: Labels) -> Histogram | None:
    return next((h for h in hists if h.name == name and h.labels == labels), None)
