"""``benchmarks.preemption_cost`` on a small cluster: it measures what it says it does."""

from __future__ import annotations

from benchmarks.preemption_cost import markdown, run


def test_every_node_is_preemptible_for_the_stuck_pod_and_every_call_is_timed() -> None:
    report = run(12, samples=3, seed=1)
    assert report["nodes"] == 12 and report["preemptible_nodes"] == 12
    assert set(report["results"]) == {
        "prefilter_plain",
        "prefilter_preemptible",
        "prefilter_fits_preemptible",
        "what_if_removed",
        "what_if_reprieve",
        "preemption_cycle",
    }
    assert all(r["samples"] == 3 and r["p50_ms"] > 0 for r in report["results"].values())
    # The dry run: every candidate node asked once with all victims gone, then once per
    # victim it tries to keep (12 nodes < 100 candidates: all of them).
    assert report["candidate_nodes"] == 12
    assert report["what_ifs_per_cycle"] > report["candidate_nodes"]
    table = markdown(report)
    assert "| prefilter_preemptible |" in table and table.startswith("Preemption cost at 12 nodes")
