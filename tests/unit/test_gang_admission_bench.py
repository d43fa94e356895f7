"""The gang admission benchmark's pure parts: manifests, per-group statistics, the report."""

from __future__ import annotations

import pytest

from api.hami.keys import VGPU_MODE
from benchmarks import gang_admission as bench
from scheduler_plugins.devtools.cluster.stack import SCHEDULER_NAME


def test_a_plain_pod_asks_one_whole_hami_core_gpu_and_names_no_group() -> None:
    pod = bench.pod_manifest("plain", 7, 3, gang=False)
    assert pod["metadata"]["name"] == "plain-007-3"
    assert pod["metadata"]["labels"] == {
        bench.PHASE_LABEL: "plain",
        bench.GROUP_LABEL: "plain-007",
    }
    assert pod["metadata"]["annotations"] == {VGPU_MODE: "hami-core"}
    spec = pod["spec"]
    assert spec["schedulerName"] == SCHEDULER_NAME
    assert "schedulingGroup" not in spec
    [container] = spec["containers"]
    assert container["resources"] == {
        "limits": {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 40000},
        "requests": {"cpu": "1", "memory": "1Gi"},
    }


def test_a_gang_member_names_its_podgroup() -> None:
    pod = bench.pod_manifest("gang", 12, 0, gang=True)
    assert pod["spec"]["schedulingGroup"] == {"podGroupName": "gang-012"}
    group = bench.podgroup_manifest("gang", 12, 8)
    assert group["apiVersion"] == "scheduling.k8s.io/v1alpha2"
    assert group["kind"] == "PodGroup"
    assert group["metadata"]["name"] == "gang-012"
    assert group["metadata"]["labels"] == {bench.PHASE_LABEL: "gang"}
    assert group["spec"] == {"schedulingPolicy": {"gang": {"minCount": 8}}}
    assert bench.PODGROUPS_PATH == "/apis/scheduling.k8s.io/v1alpha2/namespaces/default/podgroups"
    assert bench.selector("gang") == f"{bench.PHASE_LABEL}=gang"


def test_group_times_start_at_the_first_create_and_keep_only_bound_members() -> None:
    members = {"g0": ["a", "b"], "g1": ["c", "d"]}
    sent = {"a": 1.0, "b": 0.5, "c": 2.0, "d": 2.1}
    bound = {"a": 3.0, "b": 2.0, "c": 4.0}
    g0, g1 = bench.group_times(members, sent, bound)
    assert g0 == bench.GroupTimes(size=2, started=0.5, bound=(2.0, 3.0))
    assert g0.complete and not g0.partial
    assert g0.latency_s == pytest.approx(2.5)
    assert g0.spread_s == pytest.approx(1.0)
    assert g1.partial and not g1.complete
    assert g1.latency_s is None and g1.spread_s is None


def _round(*groups: bench.GroupTimes, created_s: float = 0.1) -> bench.Round:
    return bench.Round(tuple(groups), created_s)


def test_phase_result_summarises_latency_drain_and_spread() -> None:
    first = _round(
        bench.GroupTimes(size=2, started=0.0, bound=(0.9, 1.0)),
        bench.GroupTimes(size=2, started=1.0, bound=(2.8, 3.0)),
        created_s=1.5,
    )
    second = _round(
        bench.GroupTimes(size=2, started=10.0, bound=(12.7, 13.0)),
        bench.GroupTimes(size=2, started=11.0, bound=(14.6, 15.0)),
    )
    r = bench.phase_result([first, second])
    assert (r["rounds"], r["groups"], r["pods"], r["bound"]) == (2, 4, 8, 8)
    # Latencies 1, 2, 3, 4 s pooled over the rounds; spreads 0.1 .. 0.4 s.
    assert r["admission"] is not None
    assert r["admission"]["count"] == 4
    assert r["admission"]["p50_ms"] == pytest.approx(2500.0)
    assert r["admission"]["max_ms"] == pytest.approx(4000.0)
    assert r["admission"]["mean_ms"] == pytest.approx(2500.0)
    assert r["bind_spread"]["p50_s"] == pytest.approx(0.25)
    assert r["bind_spread"]["max_s"] == pytest.approx(0.4)
    assert r["complete_groups"] == 4 and r["partial_groups"] == 0 and r["all_or_nothing"]
    # Drains 3 s and 5 s: the median is their mean; the rates 4/3 and 4/5 pods/s.
    assert [x["drain_s"] for x in r["per_round"]] == [3.0, 5.0]
    assert r["per_round"][0]["create_s"] == 1.5
    assert r["per_round"][0]["p50_ms"] == pytest.approx(1500.0)
    assert r["drain_s"] == pytest.approx(4.0)
    assert r["pods_per_s"] == pytest.approx((4 / 3 + 4 / 5) / 2, abs=0.01)


def test_cpu_time_is_per_bound_pod_and_the_median_of_the_rounds() -> None:
    group = bench.GroupTimes(size=2, started=0.0, bound=(1.0, 2.0))
    rounds = [
        bench.Round((group,), 0.1, {"etcd": 0.002, "plugin-server": 0.01}, 0.5),
        bench.Round((group,), 0.1, {"etcd": 0.004, "plugin-server": 0.03}, 0.7),
    ]
    r = bench.phase_result(rounds)
    assert r["per_round"][0]["cpu_ms_per_pod"] == {"etcd": 1.0, "plugin-server": 5.0}
    assert r["per_round"][1]["load_1m"] == 0.7
    assert r["cpu_ms_per_pod"] == {"etcd": 1.5, "plugin-server": 10.0}


def test_a_partial_group_breaks_all_or_nothing_and_an_unbound_one_does_not() -> None:
    r = bench.phase_result(
        [
            _round(
                bench.GroupTimes(size=2, started=0.0, bound=(1.0, 2.0)),
                bench.GroupTimes(size=2, started=0.0, bound=(1.5,)),
                bench.GroupTimes(size=2, started=0.0, bound=()),
            )
        ]
    )
    assert (r["bound"], r["complete_groups"], r["partial_groups"]) == (3, 1, 1)
    assert not r["all_or_nothing"]
    assert r["admission"] is not None and r["admission"]["count"] == 1
    nothing = bench.phase_result([_round(bench.GroupTimes(2, 0.0, ()))])
    assert nothing["all_or_nothing"] and nothing["admission"] is None
    assert nothing["drain_s"] is None and nothing["pods_per_s"] is None
    assert nothing["per_round"][0]["p50_ms"] is None
    assert nothing["bind_spread"] == {"p50_s": None, "max_s": None}


def _phase(p50_ms: float, drain_s: float, pods_per_s: float) -> bench.PhaseResult:
    cpu = {"plugin-server": p50_ms / 100}
    per_round = bench.RoundResult(
        load_1m=1.5,
        bound=8,
        create_s=0.1,
        p50_ms=p50_ms,
        p99_ms=p50_ms,
        drain_s=drain_s,
        pods_per_s=pods_per_s,
        cpu_ms_per_pod=cpu,
    )
    return bench.PhaseResult(
        rounds=1,
        groups=1,
        pods=8,
        bound=8,
        admission={
            "count": 1,
            "mean_ms": p50_ms,
            "p50_ms": p50_ms,
            "p90_ms": p50_ms,
            "p99_ms": p50_ms,
            "max_ms": p50_ms,
        },
        drain_s=drain_s,
        pods_per_s=pods_per_s,
        cpu_ms_per_pod=cpu,
        per_round=[per_round],
        complete_groups=1,
        partial_groups=0,
        all_or_nothing=True,
        bind_spread=bench.Spread(p50_s=0.01, max_s=0.02),
    )


def test_ratios_are_gang_over_plain() -> None:
    q = bench.ratios(_phase(100.0, 10.0, 80.0), _phase(150.0, 12.0, 60.0))
    assert q["admission_p50_ms"] == 1.5 and q["admission_p99_ms"] == 1.5
    assert q["drain_s"] == 1.2 and q["pods_per_s"] == 0.75
    assert q["round_p50"] == [1.5]
    assert q["cpu_ms_per_pod"] == {"plugin-server": 1.5}
    empty = bench.PhaseResult(**{**_phase(1.0, 0.0, 0.0), "admission": None, "drain_s": None})
    assert bench.ratios(empty, _phase(1.0, 1.0, 1.0))["admission_p50_ms"] is None
    assert bench.ratios(empty, _phase(1.0, 1.0, 1.0))["drain_s"] is None


def test_rounds_alternate_which_phase_goes_first() -> None:
    assert [bench.order(i) for i in range(3)] == [
        ("plain", "gang"),
        ("gang", "plain"),
        ("plain", "gang"),
    ]
    assert bench.tag("gang", 2) == "gang-2"
    assert bench.pod_name(bench.tag("gang", 2), 5, 1) == "gang-2-005-1"


def test_markdown_has_a_row_per_phase_the_ratios_and_the_rounds() -> None:
    plain, gang = _phase(100.0, 10.0, 80.0), _phase(150.0, 12.0, 60.0)
    report = bench.Report(
        machine={"commit": "abc1234", "cpus": 2, "load_before": [1.0], "load_after": [2.0]},
        options={"nodes": 1000, "gangs": 1, "size": 8, "workers": 8, "rounds": 1},
        phases={"plain": plain, "gang": gang},
        ratios=bench.ratios(plain, gang),
        gang_outcomes={"admitted": 1.0},
        log_errors={"plugin-server": {"count": 0, "first": [], "warnings": 2}},
    )
    text = bench.markdown(report)
    assert "at 1000 nodes" in text and "commit abc1234" in text
    assert "| plain | 8/8 | 100.0 | 100.0 | 100.0 | 100.0 | 100.0 | 10.00 | 80.0 |" in text
    assert "| gang | 8/8 | 150.0 |" in text
    assert "| ratio | 1.50 | 1.50 | 1.50 | 1.50 | 1.50 | 1.20 | 0.75 |" in text
    assert "| 0 | plain | 100.0 | 150.0 | 1.50 | 100.0 | 150.0 | 10.00 | 12.00 | 1.5, 1.5 |" in text
    assert "| plain | 1.00 |" in text and "| gang / plain | 1.50 |" in text
    assert "admitted 1" in text and "plugin-server 0 (2 warnings)" in text


def test_gang_outcomes_and_log_errors_are_read_from_text() -> None:
    metrics = (
        "# HELP tessera_gangs_total gangs\n"
        'tessera_gangs_total{outcome="admitted"} 100.0\n'
        'tessera_gangs_total{outcome="unschedulable"} 2.0\n'
        "tessera_other 1\n"
    )
    assert bench.gang_outcomes(metrics) == {"admitted": 100.0, "unschedulable": 2.0}
    lines = [
        "I1202 11:18:30.1 1 x.go:1] fine",
        "E1202 11:18:30.2 1 x.go:2] broken",
        "W1202 11:18:30.3 1 x.go:3] odd",
        '{"event": "boom", "level": "error"}',
        '{"event": "hm", "level":"warning"}',
    ]
    found = bench.log_errors(lines)
    assert found["count"] == 2 and found["warnings"] == 2
    assert found["first"][0].startswith("E1202")
