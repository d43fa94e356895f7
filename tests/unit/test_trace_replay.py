"""The trace replay benchmark on a tiny hand-made trace (no Go, no paper data needed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from api.hami.config import DeviceConfig
from api.hami.policy import Policy
from benchmarks import trace_replay as tr

NODES = """sn,cpu_milli,memory_mib,gpu,model
n0,8000,32768,2,T4
n1,8000,32768,2,V100M16
n2,4000,8192,1,T4
"""
PODS = """name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec
p0,2000,4096,1,500,
p1,2000,4096,1,500,
p2,1000,2048,1,1000,
p3,6000,4096,0,0,
p4,2000,4096,2,1000,V100M16
p5,1000,1024,1,300,T4
p6,64000,1024,1,100,
"""


@pytest.fixture
def trace(tmp_path: Path) -> tuple[tr.Cluster, list[tr.Pod]]:
    (tmp_path / "nodes.csv").write_text(NODES)
    (tmp_path / "pods.csv").write_text(PODS)
    return tr.load_cluster(tmp_path / "nodes.csv"), tr.load_pods(tmp_path / "pods.csv")


@pytest.mark.parametrize("policy", tr.POLICIES)
def test_every_policy_places_within_capacity(
    trace: tuple[tr.Cluster, list[tr.Pod]], policy: str
) -> None:
    cluster, pods = trace
    order = list(range(len(pods)))

    def engine(config: DeviceConfig, cpu_pods: bool) -> tr.Place:
        return tr.Engine(cluster, config, cpu_pods).place

    run = tr.replay(cluster, pods, order, tr.make_policy(policy, pods, 7, engine))
    # p6 asks more CPU than any node has: dropped by every policy
    assert run.dropped.get("shared", 0) >= 1
    assert 0.0 < run.allocation <= 100.0
    assert len(run.curve) == 131
    assert run.curve == sorted(run.curve)
    assert run.curve[-1] == pytest.approx(run.allocation, abs=1e-3)


def test_the_accounting_refuses_a_double_allocation(trace: tuple[tr.Cluster, list[tr.Pod]]) -> None:
    cluster, _ = trace
    nodes = tr.Nodes(cluster)
    whole = tr.Pod(0, 0, 1, 1000, ())
    nodes.place(0, whole, [0])
    with pytest.raises(AssertionError, match="double allocation"):
        nodes.place(0, whole, [0])


def test_a_restricted_pod_fits_only_its_model(trace: tuple[tr.Cluster, list[tr.Pod]]) -> None:
    cluster, pods = trace
    fits = tr.Nodes(cluster).fits(pods[4])
    assert fits.tolist() == [False, True, False]


def every_pod_engine(cluster: tr.Cluster) -> tr.Engine:
    """The engine placing every pod, which it knows from earlier pods without GPUs (the
    fragmentation policy's ties then go to the fuller node)."""
    engine = tr.Engine(cluster, DeviceConfig(default_node_policy=Policy.FRAGMENTATION), True)
    engine.state.kinds.host_only_asks()
    return engine


def test_the_engine_and_the_replay_agree_on_fit(trace: tuple[tr.Cluster, list[tr.Pod]]) -> None:
    """Tessera's engine never picks a node the replay's accounting refuses, and finds one
    whenever the accounting does (else ``Engine.place`` raises)."""
    cluster, pods = trace
    engine = every_pod_engine(cluster)
    nodes = tr.Nodes(cluster)
    for pod in pods:
        cand = np.flatnonzero(nodes.fits(pod))
        choice = engine.place(nodes, cand, pod)
        assert (choice is None) == (cand.size == 0)
        if choice is not None:
            nodes.place(choice[0], pod, choice[1])
    # every pod that fits somewhere is placed; p6 (64 cores) fits nowhere
    assert nodes.used_milli >= 500 + 500 + 1000 + 300


def test_every_arriving_pod_is_put_to_the_policy_dropped_ones_too(
    trace: tuple[tr.Cluster, list[tr.Pod]],
) -> None:
    """The live scheduler is asked about pods no node has room for: the replay asks the
    policy about every pod, and the engine counts those it cannot place in the workload."""
    cluster, pods = trace
    engine = every_pod_engine(cluster)
    asked: list[int] = []

    def place(nodes: tr.Nodes, cand: np.ndarray, pod: tr.Pod) -> tr.Choice | None:
        asked.append(cand.size)
        return engine.place(nodes, cand, pod)

    run = tr.replay(cluster, pods, list(range(len(pods))), place)
    assert len(asked) == len(pods) and asked[6] == 0  # p6 fits nowhere, and was asked about
    assert run.dropped == {"shared": 1}
    assert len(engine.state.kinds) == 6  # the GPU pods that asked, p6 too


def test_a_policy_dropping_a_pod_that_fits_is_an_error(
    trace: tuple[tr.Cluster, list[tr.Pod]],
) -> None:
    cluster, pods = trace
    with pytest.raises(AssertionError, match="dropped"):
        tr.replay(cluster, pods, [0], lambda nodes, cand, pod: None)


def test_bad_trace_files_name_the_problem(tmp_path: Path) -> None:
    bad = tmp_path / "nodes.csv"
    bad.write_text("sn,cpu_milli,memory_mib,gpu,model\nn0,8000,x,2,T4\n")
    with pytest.raises(tr.TraceError, match="n0: bad memory_mib"):
        tr.load_cluster(bad)
    bad.write_text("sn,cpu_milli,memory_mib,gpu,model\nn0,8000,1,-2,T4\n")
    with pytest.raises(tr.TraceError, match="negative gpu"):
        tr.load_cluster(bad)
    with pytest.raises(tr.TraceError, match="cannot read"):
        tr.load_pods(tmp_path / "missing.csv")


@pytest.mark.parametrize(
    "argv",
    [
        ["--traces", "nope"],
        ["--policies", "best"],
        ["--seeds", "x"],
    ],
)
def test_bad_arguments_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        tr.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "valid" in err or "integers" in err


def test_missing_data_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert tr.main(["--data", str(tmp_path)]) == 2
    assert "trace data not found" in capsys.readouterr().err
