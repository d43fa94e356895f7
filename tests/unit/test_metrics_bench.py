"""Smoke test of the metrics scrape benchmark on a small cluster."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import metrics_scrape as bench
from benchmarks.decision_latency import GPUS_PER_NODE
from scheduler_plugins.server.metrics import GPU_GAUGES


def test_small_cluster_scrapes_every_gpu_and_matches_the_naive_exposition() -> None:
    r = bench.run_config(
        6,
        pods_per_gpu=2,
        repeat=1,
        seed=bench.DEFAULT_SEED,
        naive=True,
        naive_events=50,
        http=False,
    )
    assert r["gpus"] == 6 * GPUS_PER_NODE
    # Every family has one series per GPU (all register memory); run_config also checked that
    # the naive exposition carries exactly the same GPU series.
    assert r["series"] >= len(GPU_GAUGES) * r["gpus"] + r["mig_instances"]
    assert r["mig_instances"] > 0
    assert r["naive_scrape_s"] is not None and r["naive_event_update_us"] is not None
    assert r["scrape"]["median_s"] > 0 and r["gzip_bytes"] < r["body_bytes"]


def test_main_writes_the_json_report(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    argv = ["--nodes", "2", "--repeat", "1", "--naive-max-nodes", "0", "--json", str(out)]
    assert bench.main(argv) == 0
    report = json.loads(out.read_text())
    (result,) = report["results"]
    assert result["nodes"] == 2 and result["naive_scrape_s"] is None
    assert result["http_scrape"] is not None and result["http_scrape"]["samples"] == 1
