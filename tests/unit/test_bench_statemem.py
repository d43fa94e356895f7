"""The plugin server's state measured without a cluster (``tessera bench --state-only``)."""

from __future__ import annotations

from scheduler_plugins.devtools.bench.statemem import measure


def test_measure_places_the_workload_and_reports_memory_and_decisions() -> None:
    out = measure(9, 60, seed=1, decisions=40)
    assert (out["nodes"], out["pods"]) == (9, 60)
    assert out["placed"] + out["unplaced"] == 60 and out["placed"] > 50
    assert out["peak_rss_mib"] >= out["rss_mib_loaded"] > 0
    assert out["decision_ms"]["count"] > 0 and out["decision_ms"]["p99_ms"] > 0
