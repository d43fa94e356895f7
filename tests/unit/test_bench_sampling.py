"""Marks record process samples and metric scrapes, together or each alone."""

from __future__ import annotations

import os
from typing import Any, cast

import pytest

from api.kube.client import KubeClient
from scheduler_plugins.devtools.bench import sampling
from scheduler_plugins.devtools.bench.sampling import Sampler


class Api:
    """Answers /metrics with a request counter that grows by 3 per scrape."""

    def __init__(self) -> None:
        self.total = 0

    def probe(self, path: str) -> tuple[int, str]:
        assert path == "/metrics"
        self.total += 3
        line = 'apiserver_request_total{verb="POST",resource="pods",subresource="binding"}'
        watch = "apiserver_watch_events_total"
        events = (
            f'{watch}{{group="",resource="pods",version="v1"}} {4 * self.total}\n'
            f'{watch}{{group="",kind="Node",version="v1"}} {self.total}\n'
        )
        return 200, f"{line} {self.total}\n{events}"


def test_a_mark_can_scrape_before_and_sample_processes_after() -> None:
    api = Api()
    sampler = Sampler(lambda: {"me": os.getpid()}, None, cast(KubeClient, cast(Any, api)))
    sampler.mark("start", procs=False)  # before the process is (re)started
    assert "start" not in sampler.marks and "start" in sampler.requests
    sampler.mark("start", scrapes=False)  # its pid now
    assert set(sampler.marks["start"]) == {"me"}
    assert api.total == 3  # the second call scraped nothing
    sampler.mark("end")
    rows = sampler.requests_json("start", "end", per=3)
    assert [(r["verb"], r["count"]) for r in rows] == [("POST", 3)]
    assert sampler.cpu_between("start", "end")["me"] >= 0


def test_watch_events_per_pod_by_resource() -> None:
    api = Api()
    sampler = Sampler(lambda: {}, None, cast(KubeClient, cast(Any, api)))
    sampler.mark("start")
    sampler.mark("end")
    assert sampler.watch_events_json("start", "end", per=3) == {"pods": 4.0, "Node": 1.0}
    assert sampler.watch_events_json("start", "missing", per=3) == {}


def _scheduler_metrics(scheduled: int, reserve_ms_bucket: str) -> str:
    """kube-scheduler's two cycle histograms: ``scheduled`` cycles of 1-2 ms, as many
    Reserve runs in the bucket ending at ``reserve_ms_bucket``, and series to ignore."""
    attempt = "scheduler_scheduling_attempt_duration_seconds"
    point = "scheduler_framework_extension_point_duration_seconds"
    reserve = 'extension_point="Reserve",profile="p",status="Success"'
    return "\n".join(
        [
            f'{attempt}_bucket{{profile="p",result="scheduled",le="0.001"}} 0',
            f'{attempt}_bucket{{profile="p",result="scheduled",le="0.002"}} {scheduled}',
            f'{attempt}_bucket{{profile="p",result="scheduled",le="+Inf"}} {scheduled}',
            f'{attempt}_count{{profile="p",result="scheduled"}} {scheduled}',
            f'{attempt}_sum{{profile="p",result="scheduled"}} {scheduled * 0.0015}',
            f'{attempt}_bucket{{profile="p",result="unschedulable",le="+Inf"}} 99',
            f'scheduler_scheduling_algorithm_duration_seconds_bucket{{le="0.001"}} {scheduled}',
            f'scheduler_scheduling_algorithm_duration_seconds_bucket{{le="+Inf"}} {scheduled}',
            f"scheduler_scheduling_algorithm_duration_seconds_sum {scheduled * 0.0007}",
            f'{attempt}_count{{profile="p",result="unschedulable"}} 99',
            f'{point}_bucket{{{reserve},le="{reserve_ms_bucket}"}} {scheduled}',
            f'{point}_bucket{{{reserve},le="+Inf"}} {scheduled}',
            f"{point}_count{{{reserve}}} {scheduled}",
            f"{point}_sum{{{reserve}}} {scheduled * 0.0003}",
            f'{point}_bucket{{extension_point="Reserve",profile="p",status="Error",le="+Inf"}} 5',
            f'{point}_bucket{{extension_point="Bind",profile="p",status="Success",le="+Inf"}} 7',
            'scheduler_other_seconds_bucket{le="+Inf"} 1',
            "",
        ]
    )


def test_cycle_summary_counts_scheduled_cycles_since_the_scheduler_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    answers: list[str | OSError] = [
        OSError("connection refused"),  # paused at the first mark
        _scheduler_metrics(10, "0.0004"),
        _scheduler_metrics(30, "0.0004"),
    ]

    def http_text(url: str, *, insecure: bool = False) -> str:
        assert url == "https://127.0.0.1:1/metrics" and insecure
        answer = answers.pop(0)
        if isinstance(answer, OSError):
            raise answer
        return answer

    monkeypatch.setattr(sampling, "_http_text", http_text)
    sampler = Sampler(lambda: {}, None, scheduler_metrics_url="https://127.0.0.1:1/metrics")
    sampler.mark("down")
    sampler.mark("up")
    sampler.mark("end")
    since_start = sampler.cycle_json("down", "end")
    assert since_start["attempt"]["count"] == 30
    assert 1.0 < since_start["attempt"]["p50"] <= 2.0
    assert since_start["extension_points"] == {
        "Reserve": {"count": 30, "mean": 0.3, "p50": 0.2, "p99": 0.396}
    }
    assert since_start["algorithm"]["mean"] == 0.7
    assert "serial_mean" not in since_start  # no Permit series: no sum to make
    assert sampler.cycle_json("up", "end")["attempt"]["count"] == 20
    assert sampler.cycle_json("up", "never") == {}


def test_cycle_messages_are_the_plugin_servers_counters_between_two_marks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    name = sampling.CYCLE_CALLS
    answers = [
        f'{name}{{carried="false"}} 10\n{name}{{carried="true"}} 4\n',
        f'{name}{{carried="false"}} 110\n{name}{{carried="true"}} 94\n',
    ]

    def http_text(url: str, *, insecure: bool = False) -> str:
        assert url == "http://127.0.0.1:2/metrics"
        return answers.pop(0)

    monkeypatch.setattr(sampling, "_http_text", http_text)
    sampler = Sampler(lambda: {}, "http://127.0.0.1:2/metrics")
    sampler.mark("start")
    sampler.mark("end")
    assert sampler.cycle_messages_json("start", "end") == {"messages": 100, "carried": 90}
    assert sampler.cycle_messages_json("start", "never") == {}
