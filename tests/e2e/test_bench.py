"""``tessera bench`` end to end, tiny: both schedulers on fresh 20-node kwok clusters, every
scenario, the invariant check, the JSON, Markdown and PNG report; nothing left running."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Final

import pytest

from scheduler_plugins.devtools.cluster import processes

NODES: Final = 20
PODS: Final = 80
TIMEOUT_S: Final = 300  # typically 2 minutes on a quiet 2-core machine
PNG_MAGIC: Final = b"\x89PNG\r\n\x1a\n"


def test_bench_runs_both_schedulers_and_reports(
    built_tools: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    base = tmp_path_factory.mktemp("b")  # short: the plugin server's socket path lives here
    out, work = base / "out", base / "w"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "scheduler_plugins.cli",
            "bench",
            f"--nodes={NODES}",
            f"--pods={PODS}",
            "--settle=15",
            "--churn=0.25",
            f"--output-dir={out}",
            f"--work-dir={work}",
            "--name=tiny",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.split() == [
        str(out / n)
        for n in (
            "tiny.json",
            "tiny.md",
            "tiny-throughput.png",
            "tiny-latency.png",
            "tiny-concurrency.png",
        )
    ]
    for png in out.glob("*.png"):
        assert png.read_bytes()[:8] == PNG_MAGIC, png

    result = json.loads((out / "tiny.json").read_text())
    (run,) = result["runs"]
    assert (run["nodes"], run["pods"]) == (NODES, PODS)
    assert 0 < run["offline_nodes_used"] <= NODES
    assert set(run["phases"]) == {"tessera", "stock"}
    for name, phase in run["phases"].items():
        assert "error" not in phase, phase["error"]
        drain, main = phase["drain"], phase["main"]
        assert drain["created"] + main["created"] == PODS, name  # --drain 0.5 by default
        assert drain["created"] == PODS // 2
        for scenario in (drain, main):
            assert scenario["bound"] >= scenario["pods"] * 0.9, (name, scenario)
        assert drain["drain_pods_per_s"] > 0 and drain["api_requests"], (name, drain)
        # Both schedulers' logs named every pod they bound: the drain is timed by the commits.
        assert drain["bound_times"] == "scheduler log", (name, drain)
        assert drain["watch_lag_last_s"] is not None and drain["watched_pods_per_s"] > 0
        assert main["throughput_pods_per_s"] > 0 and main["latency_ms"]["p99_ms"] > 0
        assert {c for c in phase["components"]} >= {"kube-apiserver", "etcd", "bench-client"}
        assert [b["label"] for b in phase["node_concurrency"]] == [
            "mig-7x1g",
            "fractional-10x",
            "fractional-10-unequal",
            "distinct-counts",
        ]
        assert 0 < drain["nodes_used"] <= NODES
        for burst in phase["node_concurrency"]:
            assert burst["bound"] == burst["pods"], (name, burst)
            assert len(burst["nodes"]) == 1, (name, burst)
        churn = phase["churn"]
        ended = churn["deleted"] + churn["succeeded"] + churn["deleted_instead"]
        assert ended == churn["pods"] > 0, churn
        assert not churn["end_errors"]

    tessera = run["phases"]["tessera"]
    assert tessera["check"]["ok"], tessera["check"]
    assert tessera["check"]["sim_instances"] == tessera["check"]["mig_instances"]
    assert {"plugin-server", "tessera-scheduler", "node-agent"} <= set(tessera["components"])
    assert tessera["components"]["plugin-server"]["peak_rss_mib"] > 0
    assert tessera["main"]["allocated"] > 0
    series = {(h["name"], h["labels"].get("method")) for h in tessera["plugin_rpc"]}
    assert ("tessera_scheduler_decision_duration_seconds", None) in series
    assert ("tessera_scheduler_rpc_duration_seconds", "PreFilter") in series
    drained = {(h["name"], h["labels"].get("method")) for h in tessera["drain"]["plugin_rpc"]}
    assert ("tessera_scheduler_rpc_duration_seconds", "Reserve") in drained
    # Every GPU pod's PreFilter and Reserve came over the Cycle stream, in fewer messages
    # than calls when a Reserve rode with the next PreFilter.
    stream = tessera["drain"]["cycle_messages"]
    assert stream["messages"] > 0 and stream["carried"] >= 0, stream
    assert run["phases"]["stock"]["check"] is None
    assert run["ratio"]["throughput"] > 0
    # The apiserver's audit log names each request's client: the bindings are the
    # scheduler's, the node agent's allocation patches its own.
    writes = {
        name: {
            (r["client"], r["verb"], r["resource"])
            for r in phase["drain"]["api_requests_by_client"]
        }
        for name, phase in run["phases"].items()
    }
    assert ("tessera-scheduler", "create", "pods/binding") in writes["tessera"]
    assert ("tessera-node-agent", "patch", "pods") in writes["tessera"]
    assert ("kube-scheduler", "create", "pods/binding") in writes["stock"]
    assert not any(client.startswith("tessera-node") for client, _, _ in writes["stock"])
    assert all(p["drain"]["audit_unreadable_lines"] == 0 for p in run["phases"].values())

    md = (out / "tiny.md").read_text()
    assert "## Main workload" in md and "![tiny-throughput](tiny-throughput.png)" in md
    assert "## API requests per bound pod by client" in md
    left = [
        pid
        for exe_dir in (built_tools, Path(sys.executable).parent)
        for pid in processes.find_strays(str(work), exe_dir)
    ]
    assert not left, f"benchmark processes left running: {left}"
