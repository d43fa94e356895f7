"""Smoke test of the MIG placement-quality benchmark on a few streams."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import placement_quality as bench
from scheduler_plugins.core.mig_policy import build_choice_table


def test_tessera_beats_hami_order_and_nears_the_optimum() -> None:
    report = bench.run(streams=50, seed=bench.DEFAULT_SEED)
    assert [g["geometry"] for g in report["geometries"]] == [g.label for g in bench.GEOMETRIES]
    for g in report["geometries"]:
        tessera = g["policies"]["tessera"]
        hami = g["policies"]["hami-v2.10"]
        assert tessera["mean_admitted"] >= hami["mean_admitted"], g["geometry"]
        assert tessera["mean_stream_share"] >= 0.95, g["geometry"]
        assert tessera["share_of_optimum"] >= 0.95, g["geometry"]
        # Exact expectations: no sampling noise, so these hold on every run.
        assert tessera["expected_admitted"] >= hami["expected_admitted"]
        assert g["optimum"]["mean_admitted"] >= tessera["mean_admitted"]


def test_online_policy_never_beats_the_offline_optimum_per_stream() -> None:
    geometry = bench.GEOMETRIES[0]
    profiles = geometry.profiles()
    table = build_choice_table(profiles)
    feasible = bench.feasible_counts(table.profiles)
    for stream in ([0, 0, 2, 1, 1, 0, 0, 0, 0], [2, 2, 0, 0, 0], [1, 1, 1, 2, 0, 0, 0, 0, 0]):
        admitted, _ = bench.replay(table, stream)
        assert admitted <= bench.offline_optimum(feasible, stream, len(table.profiles))


def test_main_writes_the_json_report(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert bench.main(["--streams", "5", "--seed", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["streams_per_geometry"] == 5
    assert {g["geometry"] for g in report["geometries"]} == {g.label for g in bench.GEOMETRIES}
