"""Marks record process samples and metric scrapes, together or each alone."""

from __future__ import annotations

import os
from typing import Any, cast

from api.kube.client import KubeClient
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
