"""Binding commit times from the scheduler's log, and the queue drain timed by them."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from scheduler_plugins.devtools.bench.batches import Batch, drain_json
from scheduler_plugins.devtools.bench.bindlog import committed_at, committed_in_log
from scheduler_plugins.devtools.bench.workload import BenchPod, PodKind

NS = "tessera-bench"


def _line(stamp: str, pod: str, ns: str = NS) -> str:
    return (
        f'I{stamp}   29312 schedule_one.go:481] "Successfully bound pod to node" '
        f'pod="{ns}/{pod}" node="bench-node-0050" evaluatedNodes=100 feasibleNodes=100\n'
    )


def _epoch(year: int, month: int, day: int, hms: str) -> float:
    h, m, s = (int(x) for x in hms.split(":"))
    return time.mktime((year, month, day, h, m, s, 0, 0, -1))


NOW = _epoch(2026, 12, 2, "01:00:00")


def test_each_named_pods_first_binding_in_local_time_with_microseconds() -> None:
    lines = [
        'I1202 00:43:03.000001   29312 eventhandlers.go:1] "Added pod" pod="tessera-bench/a"\n',
        _line("1202 00:43:03.829351", "a"),
        _line("1202 00:43:04.100000", "other-ns", ns="default"),
        _line("1202 00:43:05.000000", "b"),
        _line("1202 00:43:09.000000", "a"),  # a later line for the same pod
        _line("1202 00:43:06.250000", "not-asked"),
        'E1202 00:43:07.000000   29312 schedule_one.go:1] "Error" pod="tessera-bench/c"\n',
    ]
    got = committed_at(lines, NS, {"a", "b", "c", "other-ns"}, now=NOW)
    assert set(got) == {"a", "b"}
    assert got["a"] == pytest.approx(_epoch(2026, 12, 2, "00:43:03") + 0.829351)
    assert got["b"] - got["a"] == pytest.approx(1.170649)


def test_a_late_december_line_read_in_january_is_last_years() -> None:
    now = _epoch(2027, 1, 1, "00:00:10")
    got = committed_at([_line("1231 23:59:59.500000", "a")], NS, {"a"}, now=now)
    assert got["a"] == pytest.approx(_epoch(2026, 12, 31, "23:59:59") + 0.5)


def test_no_log_file_gives_nothing(tmp_path: Path) -> None:
    assert committed_in_log(tmp_path / "missing.log", NS, {"a"}, now=NOW) == {}
    log = tmp_path / "kube-scheduler.log"
    log.write_text(_line("1202 00:43:03.5", "a"))
    assert set(committed_in_log(log, NS, {"a"}, now=NOW)) == {"a"}


def _drained(watched: dict[str, float]) -> Batch:
    b = Batch("drain", tuple(BenchPod(n, PodKind.PLAIN) for n in watched))
    b.sent = dict.fromkeys(watched, 0.0)
    b.bound = dict(watched)
    return b


def test_the_drain_is_timed_by_the_commits_when_the_log_names_every_pod() -> None:
    # The watch saw the last two bindings 3 s late; the scheduler committed one pod a second.
    b = _drained({"p0": 11.0, "p1": 12.0, "p2": 16.0, "p3": 17.0})
    committed = {"p0": 11.0, "p1": 12.0, "p2": 13.0, "p3": 14.0}
    out = drain_json(b, 10.0, cpu_s={}, requests=[], committed=committed)
    assert out["bound_times"] == "scheduler log"
    assert out["drain_pods_per_s"] == 1.0
    assert out["drain_s"] == 4.0
    assert out["watched_pods_per_s"] == 0.5
    assert out["watch_lag_last_s"] == 3.0


def test_the_drain_falls_back_to_the_watch_when_the_log_misses_a_pod() -> None:
    b = _drained({"p0": 11.0, "p1": 12.0, "p2": 16.0})
    out = drain_json(b, 10.0, cpu_s={}, requests=[], committed={"p0": 11.0, "p1": 12.0})
    assert out["bound_times"] == "watch"
    assert out["drain_pods_per_s"] == 0.4
    assert out["watched_pods_per_s"] == 0.4
    assert out["watch_lag_last_s"] is None
    assert drain_json(b, 10.0, cpu_s={}, requests=[])["bound_times"] == "watch"
