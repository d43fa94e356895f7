"""The cluster benchmark's numbers and report: batch summaries, ratios, targets, files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import pytest

from api.hami.register import GpuDevice
from api.kube.client import KubeClient
from scheduler_plugins.devtools.bench import scenarios
from scheduler_plugins.devtools.bench.batches import Batch, batch_json, burst_json, drain_json
from scheduler_plugins.devtools.bench.errors import BenchError
from scheduler_plugins.devtools.bench.report import decision_series, markdown, targets, write_report
from scheduler_plugins.devtools.bench.runner import ratios
from scheduler_plugins.devtools.bench.scenarios import (
    churn_pods,
    concurrency_bursts,
    delete_resurrected,
    run_check,
)
from scheduler_plugins.devtools.bench.statemem import offline_nodes_used
from scheduler_plugins.devtools.bench.workload import BenchPod, PodKind, generate, mig_burst
from scheduler_plugins.devtools.check import CheckReport, Violation, ViolationKind


def _batch(n: int, *, rate: float, latency: float, label: str = "main") -> Batch:
    """``n`` pods sent ``1/rate`` s apart, each bound ``latency`` s after its send."""
    b = Batch(label, generate(n, seed=1))
    for i, pod in enumerate(b.pods):
        b.sent[pod.name] = 100.0 + i / rate
        b.bound[pod.name] = b.sent[pod.name] + latency
        if pod.gpus:
            b.allocated[pod.name] = b.bound[pod.name] + 0.05
    b.done_at = max(b.bound.values()) + 1.0
    return b


def test_batch_json_numbers() -> None:
    b = _batch(100, rate=50.0, latency=0.2)
    out = batch_json(b, failed=set())
    assert (out["pods"], out["bound"], out["pending"]) == (100, 100, 0)
    assert out["latency_ms"]["p50_ms"] == pytest.approx(200.0)
    assert out["allocation_ms"]["p99_ms"] == pytest.approx(50.0)
    # 100 pods from t=100 to the last binding at 100 + 99/50 + 0.2
    assert out["throughput_pods_per_s"] == pytest.approx(100 / (99 / 50 + 0.2), rel=1e-3)
    assert out["create_rate_pods_per_s"] == pytest.approx(100 / (99 / 50), rel=1e-2)
    assert sum(out["rate_series"]) == 100
    assert len(out["latency_cdf_ms"]) == 101
    assert out["allocated"] == sum(1 for p in b.pods if p.gpus)


def test_batch_json_counts_pending_and_refuses_an_empty_batch() -> None:
    b = _batch(10, rate=10.0, latency=0.1)
    for name in list(b.bound)[:3]:
        del b.bound[name]
    assert batch_json(b, failed=set())["pending"] == 3
    with pytest.raises(BenchError, match="no pod could be created"):
        batch_json(Batch("empty", ()), failed=set())


def _phase(scheduler: str, rate: float, latency: float, **extra: Any) -> dict[str, Any]:
    main = batch_json(_batch(200, rate=rate, latency=latency), failed=set())
    b = _batch(7, rate=100.0, latency=0.1, label="mig-7x1g")
    queue = _batch(101, rate=rate, latency=0.0, label="drain")
    drain = drain_json(queue, 99.0, cpu_s={"etcd": 1.01}, requests=[])
    return {
        "scheduler": scheduler,
        "main": main,
        "drain": drain,
        "node_concurrency": [burst_json("mig-7x1g", "7 MIG pods", b)],
        "components": {"plugin-server": {"cpu_s": 3.0, "cpu_s_main": 2.0, "peak_rss_mib": 300.0}},
        "check": {"ok": True, "attempts": 1, "summary": "ok: 5 nodes", "violations": []},
        **extra,
    }


def _result() -> dict[str, Any]:
    rpc = [
        {
            "name": "tessera_scheduler_decision_duration_seconds",
            "labels": {},
            "count": 10,
            "unit": "ms",
            "mean": 2.0,
            "p50": 1.5,
            "p90": 3.0,
            "p99": 8.0,
        },
        {
            "name": "tessera_scheduler_decision_cpu_seconds",
            "labels": {},
            "count": 10,
            "unit": "ms",
            "mean": 1.0,
            "p50": 0.9,
            "p90": 1.5,
            "p99": 2.5,
        },
    ]
    runs = []
    for nodes in (1000, 5000):
        phases = {
            "tessera": _phase("tessera", 50.0, 0.4, plugin_rpc=rpc),
            "stock": _phase("stock", 100.0, 0.1),
        }
        runs.append({"nodes": nodes, "pods": 200, "phases": phases, "ratio": ratios(phases)})
    return {"started": "t0", "finished": "t1", "host": {"cpus": 2}, "options": {}, "runs": runs}


def test_drain_json_times_the_queue_from_the_first_binding() -> None:
    queue = _batch(101, rate=50.0, latency=0.0, label="drain")  # bound 100.0 .. 102.0
    d = drain_json(queue, 99.0, cpu_s={"plugin-server": 2.02}, requests=[{"count": 3}])
    assert d["drain_pods_per_s"] == pytest.approx(50.0)
    assert (d["first_bound_s"], d["drain_s"]) == (1.0, 3.0)
    assert d["cpu_ms_per_pod"] == {"plugin-server": pytest.approx(20.0)}
    assert sum(d["rate_series"]) == 101 and d["api_requests"] == [{"count": 3}]


def test_ratios_divide_tessera_by_stock() -> None:
    r = _result()["runs"][0]["ratio"]
    assert r["drain_throughput"] == pytest.approx(0.5)
    assert r["throughput"] == pytest.approx(
        (200 / (199 / 50 + 0.4)) / (200 / (199 / 100 + 0.1)), rel=1e-2
    )
    assert r["latency_p50_ms"] == pytest.approx(4.0)
    assert ratios({"tessera": {}}) is None


def test_targets_are_evaluated_on_the_node_counts_run() -> None:
    got = {t.what: t for t in targets(_result())}
    at1000 = got["Tessera throughput ≥ 0.8× stock at 1000 nodes (queue drain)"]
    assert at1000.met is False and at1000.measured == pytest.approx(0.5)
    decision = got["p99 plugin decision (PreFilter) ≤ 10 ms at 5000 nodes"]
    assert (decision.measured, decision.met) == (8.0, True)
    cpu = next(t for w, t in got.items() if w.startswith("p99 plugin decision CPU time"))
    assert (cpu.measured, cpu.met) == (2.5, True)
    rss = next(t for w, t in got.items() if w.startswith("plugin server peak RSS"))
    assert (rss.measured, rss.met) == (300.0, True)
    assert targets({"runs": []}) == []


def test_decision_series_falls_back_to_the_prefilter_rpc() -> None:
    prefilter = {"name": "rpc", "labels": {"method": "PreFilter", "code": "OK"}, "p99": 3.0}
    assert decision_series({"plugin_rpc": [prefilter]}) == prefilter
    assert decision_series({"plugin_rpc": []}) is None


def test_write_report_files(tmp_path: Path) -> None:
    # Plots are checked by tests/e2e/test_bench.py (importing matplotlib alone takes ~2 s).
    paths = write_report(_result(), tmp_path, "b", with_plots=False)
    assert sorted(p.name for p in paths) == ["b.json", "b.md"]
    saved = json.loads((tmp_path / "b.json").read_text())
    assert saved["runs"][0]["phases"]["tessera"]["main"]["bound"] == 200
    assert {t["met"] for t in saved["targets"]} == {False, True}
    md = (tmp_path / "b.md").read_text()
    for heading in ("## Main workload", "## Targets", "## Node concurrency", "## Invariant check"):
        assert heading in md
    assert "| 1000 | 200 | tessera | 200 | 0 |" in md
    assert "## Plots" not in md


def test_markdown_lists_the_rpcs_of_the_drain_and_of_the_main_workload() -> None:
    result = _result()
    tessera = result["runs"][0]["phases"]["tessera"]
    tessera["drain"]["plugin_rpc"] = [
        {
            "name": "rpc_duration_seconds",
            "labels": {"method": "PreBind", "code": "RESOURCE_EXHAUSTED"},
            "count": 42,
            "unit": "ms",
            "mean": 500.0,
            "p50": 400.0,
            "p90": 900.0,
            "p99": 1000.0,
        }
    ]
    text = markdown(result, [])
    assert (
        "| 1000 | drain | rpc_duration_seconds{code=RESOURCE_EXHAUSTED,method=PreBind} | 42 |"
        in text
    )
    assert "| 1000 | main | tessera_scheduler_decision_duration_seconds{} | 10 |" in text


def test_markdown_puts_nodes_used_and_prebind_waits_beside_the_drain() -> None:
    result = _result()
    run = result["runs"][0]
    run["offline_nodes_used"] = 12
    tessera, stock = run["phases"]["tessera"]["drain"], run["phases"]["stock"]["drain"]
    tessera["nodes_used"], stock["nodes_used"] = 14, 30

    def prebind(code: str, count: int, p50: float, p99: float) -> dict[str, Any]:
        return {
            "name": "tessera_scheduler_rpc_duration_seconds",
            "labels": {"method": "PreBind", "code": code},
            "count": count,
            "unit": "ms",
            "mean": p50,
            "p50": p50,
            "p90": p99,
            "p99": p99,
        }

    tessera["plugin_rpc"] = [
        prebind("OK", 40, 1500.0, 9000.0),
        prebind("RESOURCE_EXHAUSTED", 5, 0, 0),
    ]
    text = markdown(result, [])
    bound = tessera["bound"]
    assert f"| 1000 | tessera | 14 | 12 | 40 | 1.5 | 9 | {round(5 / bound, 3)} |" in text
    assert "| 1000 | stock | 30 | 12 | – | – | – | – |" in text


def test_markdown_compares_the_scheduling_cycle_with_stock() -> None:
    result = _result()
    phases = result["runs"][0]["phases"]

    def cycle(serial: float, prefilter: float) -> dict[str, Any]:
        point = {"count": 10, "mean": prefilter, "p50": prefilter, "p99": prefilter}
        return {
            "attempt": {"count": 10, "mean": 400.0, "p50": 400.0, "p99": 900.0},
            "algorithm": {"count": 10, "mean": serial, "p50": serial, "p99": serial},
            "extension_points": {"PreFilter": point},
            "serial_mean": serial,
        }

    phases["tessera"]["drain"]["scheduling_cycle"] = cycle(3.0, 1.5)
    phases["stock"]["drain"]["scheduling_cycle"] = cycle(2.0, 0.1)
    text = markdown(result, [])
    assert "| 1000 | tessera | drain | 10 | 3 | 1.50× | 3 | 1.5 | – | – | – | – | 400.0 |" in text
    assert "| 1000 | stock | drain | 10 | 2 | – | 2 | 0.1 | – | – | – | – | 400.0 |" in text


def test_markdown_says_how_many_reserves_came_with_the_next_prefilter() -> None:
    result = _result()
    result["runs"][0]["phases"]["tessera"]["drain"]["cycle_messages"] = {
        "messages": 100,
        "carried": 90,
    }
    text = markdown(result, [])
    assert (
        "- 1000 nodes, tessera: 100 messages on the plugin server's Cycle stream carried 190 "
        "calls; 90 of them (47 % of the calls) came in another's message" in text
    )


def test_offline_nodes_used_places_the_pods_by_the_core() -> None:
    pods = tuple(
        BenchPod(f"p{i}", PodKind.FRACTIONAL, gpus=1, gpumem_mib=4000, mode="hami-core")
        for i in range(6)
    )
    plain = (BenchPod("cpu", PodKind.PLAIN),)
    assert offline_nodes_used(pods + plain, 4) == 1  # binpack: all on one node


def test_markdown_says_why_rpc_histograms_are_missing() -> None:
    result = _result()
    result["runs"][0]["phases"]["tessera"]["plugin_rpc"] = []
    result["runs"][0]["phases"]["tessera"]["metrics_error"] = "http://x: refused"
    assert "no RPC histograms (http://x: refused)" in markdown(result, [])


def test_churn_split_is_deterministic_and_disjoint() -> None:
    bound = [f"p{i}" for i in range(100)]
    delete, succeed = churn_pods(bound, 0.2, seed=3)
    assert (len(delete), len(succeed)) == (10, 10)
    assert not set(delete) & set(succeed) and set(delete) | set(succeed) <= set(bound)
    assert churn_pods(list(reversed(bound)), 0.2, seed=3) == (delete, succeed)


def _gpu(node: str, i: int, mode: str, model: str = "NVIDIA A100-PCIE-40GB") -> GpuDevice:
    return GpuDevice(
        id=f"GPU-{node}-{i}",
        index=i,
        count=10,
        devmem=40960,
        devcore=100,
        type=model,
        numa=0,
        mode=mode,
        health=True,
    )


class _Pods:
    """Answers a list of pods and records deletes."""

    def __init__(self, phases: dict[str, str]) -> None:
        self.phases = phases
        self.deleted: list[str] = []
        self.selectors: list[str | None] = []

    def list(self, path: str, *, label_selector: str | None = None) -> dict[str, Any]:
        self.selectors.append(label_selector)
        items = [{"metadata": {"name": n}, "status": {"phase": p}} for n, p in self.phases.items()]
        return {"items": items}

    def request(self, method: str, path: str, body: object = None) -> dict[str, Any]:
        assert method == "DELETE" and body == {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "gracePeriodSeconds": 0,
        }
        self.deleted.append(path.rsplit("/", 1)[1])
        return {}


def test_pods_kwok_set_back_to_running_after_succeeded_are_deleted_and_named() -> None:
    api = _Pods({"a": "Succeeded", "b": "Running", "c": "Running", "d": "Pending"})
    revived = delete_resurrected(cast(KubeClient, api), ["a", "b", "d"], "main")
    assert revived == ["b", "d"] and api.deleted == ["b", "d"]  # "c" was never marked
    assert api.selectors == ["tessera.dev/bench=main"]
    assert delete_resurrected(cast(KubeClient, api), [], "main") == []
    assert len(api.selectors) == 1  # nothing marked: no list


def test_concurrency_bursts_pick_a100_40gb_nodes_of_each_mode() -> None:
    regs = {
        "a": tuple(_gpu("a", i, "hami-core", "NVIDIA H100 80GB HBM3") for i in range(8)),
        "b": tuple(_gpu("b", i, "mig") for i in range(8)),
        "c": tuple(_gpu("c", i, "hami-core") for i in range(8)),
        "d": tuple(_gpu("d", i, "hami-core") for i in range(8)),
    }
    bursts = {label: pods for label, _, pods in concurrency_bursts(regs)}
    assert set(bursts) == {
        "mig-7x1g",
        "fractional-10x",
        "fractional-10-unequal",
        "distinct-counts",
    }
    assert {(p.node, p.gpu_uuid) for p in bursts["mig-7x1g"]} == {("b", "GPU-b-0")}
    assert {(p.node, p.gpu_uuid) for p in bursts["fractional-10x"]} == {("c", "GPU-c-0")}
    assert {(p.node, p.gpu_uuid) for p in bursts["fractional-10-unequal"]} == {("c", "GPU-c-1")}
    assert [p.gpus for p in bursts["distinct-counts"]] == list(range(1, 9))
    assert {p.node for p in bursts["distinct-counts"]} == {"d"}
    assert concurrency_bursts({"a": regs["a"]}) == []


def test_burst_json() -> None:
    b = Batch("x", mig_burst("n", count=3))
    for i, p in enumerate(b.pods):
        b.sent[p.name] = 10.0
        b.bound[p.name] = 10.5 + i
        b.nodes[p.name] = "n"
    out = burst_json("x", "three", b)
    assert out["all_bound_s"] == 2.5 and out["bound_offsets_s"] == [0.5, 1.5, 2.5]
    assert out["all_allocated_s"] is None and out["nodes"] == ["n"]


def test_the_check_deletes_pods_kwok_revived_late_before_looking_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """kwok revived a pod after the bench's sweep: the first look sees its lost instance;
    the pod is deleted before the second look, which passes, and is named."""
    lost = Violation(ViolationKind.MIG_IDENTITY, "tessera-bench/late", "no instance (lost)")
    reports = iter([CheckReport((lost,), 1, 2, 2, 1, 0), CheckReport((), 1, 1, 1, 0, 0)])
    monkeypatch.setattr(scenarios, "check_cluster", lambda api, sim_state: next(reports))
    monkeypatch.setattr(scenarios, "CHECK_RETRY_S", 0.0)
    swept: list[str] = []

    def sweep() -> list[str]:
        swept.append("late")
        return ["late"]

    got = run_check(cast(KubeClient, None), None, before_retry=sweep)
    assert (got["ok"], got["attempts"], got["revived_late"], swept) == (True, 2, ["late"], ["late"])
    reports = iter([CheckReport((), 1, 1, 1, 0, 0)])
    got = run_check(cast(KubeClient, None), None, before_retry=sweep)
    assert (got["ok"], got["attempts"], got["revived_late"]) == (True, 1, [])
    assert swept == ["late"]  # a first look that passes sweeps nothing
