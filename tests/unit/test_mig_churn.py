"""The MIG churn benchmark: its fit rules, each policy's choices, the replay's counts, the CLI."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from api.hami.catalog import find_model
from benchmarks import mig_churn as bench
from benchmarks.mig_churn import Device

A100 = "NVIDIA A100-PCIE-40GB"
H100 = "NVIDIA H100 80GB HBM3"


def _memory(model: str, profile: str) -> int:
    fact = find_model(model).profile(profile)
    assert fact is not None
    return fact.memory_mib


def make_pod(
    index: int,
    arrival: float,
    departure: float,
    profile: str = "1g.5gb",
    *,
    devices: int = 1,
    gpu_type: str | None = None,
    model: str = A100,
) -> bench.Pod:
    return bench.Pod(
        index=index,
        arrival=arrival,
        departure=departure,
        reference=model,
        profile=profile,
        memory_mib=_memory(model, profile),
        devices=devices,
        gpu_type=gpu_type,
        slices=1,
    )


def make_stream(horizon: float, *pods: bench.Pod) -> bench.Stream:
    return bench.Stream(seed=0, rate=0.0, horizon=horizon, pods=pods)


def rank(cluster: bench.Cluster, profile: str, geometry: int = 0) -> int:
    names = [p.name for p in cluster.geometries[geometry].profiles]
    return names.index(profile)


# Two nodes of one A100 each. p3 finds both full; p0's departure at 0.5 frees node-0, so the same
# request (p4) fits after it.
TWO_A100 = ("A100-PCIE-40GB", "A100-PCIE-40GB")
CHURN = (
    make_pod(0, 0.0, 0.5, "7g.40gb"),
    make_pod(1, 0.1, 2.0, "3g.20gb"),
    make_pod(2, 0.2, 2.0, "3g.20gb"),
    make_pod(3, 0.3, 2.0, "1g.5gb"),
    make_pod(4, 0.6, 2.0, "1g.5gb"),
    make_pod(5, 0.7, 2.0, "2g.10gb", devices=2),
    make_pod(6, 0.8, 2.0, "1g.5gb"),
)


def test_first_fit_on_a_hand_checked_stream() -> None:
    cluster = bench.make_cluster(TWO_A100, gpus_per_node=1)
    result, occ = bench.replay(cluster, make_stream(1.0, *CHURN), bench.FIRST_FIT, warmup=0.0)
    assert (result["offered"], result["accepted"]) == (7, 6)
    assert result["rejected"] == {"capacity": 1, "fragmentation": 0, "node_split": 0}
    assert result["rejected_while_fitting"] == 0
    r1, r2, r3 = (rank(cluster, p) for p in ("1g.5gb", "2g.10gb", "3g.20gb"))
    # Still held at the horizon: node-1 has both 3g halves; node-0 1g at 0, 2g at 2 and 4
    # (the lowest free starts), then 1g at 1.
    assert occ.holders == {
        1: (Device(1, r3, 0),),
        2: (Device(1, r3, 4),),
        4: (Device(0, r1, 0),),
        5: (Device(0, r2, 2), Device(0, r2, 4)),
        6: (Device(0, r1, 1),),
    }
    # Slices held: 8, 12, 16 (t 0.2-0.5), 8, 9, 13, 14 (t 0.8-1.0) of 16.
    area = 8 * 0.1 + 12 * 0.1 + 16 * 0.3 + 8 * 0.1 + 9 * 0.1 + 13 * 0.1 + 14 * 0.2
    assert result["utilisation"] == pytest.approx(area / 16)
    assert result["accepted_by_devices"] == {"1": 5, "2": 1}


@pytest.mark.parametrize("policy", bench.POLICIES)
def test_a_departure_frees_room_for_a_request_rejected_before_it(policy: str) -> None:
    cluster = bench.make_cluster(TWO_A100, gpus_per_node=1)
    result, occ = bench.replay(cluster, make_stream(1.0, *CHURN), policy, warmup=0.0)
    assert 3 not in occ.holders and 4 in occ.holders
    assert (result["accepted"], result["rejected_while_fitting"]) == (6, 0)


@pytest.mark.parametrize(
    ("profile", "starts"),
    [
        # first-fit, hami-v2.10 (1g and 3g from the top), hami-2855 (longest free run left,
        # then most surviving placements, then v2.10's order)
        ("1g.5gb", {bench.FIRST_FIT: 0, bench.HAMI_V2_10: 6, bench.HAMI_2855: 0}),
        ("2g.10gb", {bench.FIRST_FIT: 0, bench.HAMI_V2_10: 0, bench.HAMI_2855: 0}),
        ("3g.20gb", {bench.FIRST_FIT: 0, bench.HAMI_V2_10: 4, bench.HAMI_2855: 4}),
    ],
)
def test_where_each_baseline_puts_one_device_on_an_empty_gpu(
    profile: str, starts: dict[str, int]
) -> None:
    cluster = bench.make_cluster(("A100-PCIE-40GB",), gpus_per_node=1)
    for policy, start in starts.items():
        _, occ = bench.replay(
            cluster, make_stream(1.0, make_pod(0, 0.0, 2.0, profile)), policy, 0.0
        )
        assert occ.holders[0] == (Device(0, rank(cluster, profile), start),), policy


def test_hami_takes_the_fullest_node_and_first_fit_the_first_name() -> None:
    cluster = bench.make_cluster(TWO_A100, gpus_per_node=1)
    stream = make_stream(
        1.0,
        make_pod(0, 0.0, 0.5, "7g.40gb"),  # node-0
        make_pod(1, 0.1, 2.0, "1g.5gb"),  # node-1: node-0 is full
        make_pod(2, 0.6, 2.0, "1g.5gb"),  # node-0 is empty again
    )
    nodes = {}
    for policy in (bench.FIRST_FIT, bench.HAMI_V2_10, bench.HAMI_2855):
        _, occ = bench.replay(cluster, stream, policy, 0.0)
        nodes[policy] = occ.holders[2][0].row
    assert nodes == {bench.FIRST_FIT: 0, bench.HAMI_V2_10: 1, bench.HAMI_2855: 1}


def test_hami_fills_one_gpu_with_a_containers_devices_before_the_next() -> None:
    cluster = bench.make_cluster(("A100-PCIE-40GB",), gpus_per_node=2)
    stream = make_stream(1.0, make_pod(0, 0.0, 2.0, "1g.5gb", devices=4))
    _, occ = bench.replay(cluster, stream, bench.HAMI_V2_10, 0.0)
    # spread: equal scores, so the highest index first; 1g from the top.
    assert [(d.row, d.start) for d in occ.holders[0]] == [(1, 6), (1, 5), (1, 4), (1, 3)]


def test_use_gputype_restricts_every_policy_to_that_family() -> None:
    cluster = bench.make_cluster(("A100-PCIE-40GB", "H100 80GB HBM3"), gpus_per_node=1)
    pod = make_pod(0, 0.0, 2.0, "1g.10gb", gpu_type="H100", model=H100)
    for policy in bench.POLICIES:
        result, occ = bench.replay(cluster, make_stream(1.0, pod), policy, 0.0)
        assert occ.holders[0][0].row == 1, policy
        assert result["unrestricted_devices_by_geometry"] == {"A100-40GB": 0, "H100-80GB": 0}


@dataclass(frozen=True)
class BadPlacement:
    name: str
    pod: bench.Pod
    devices: tuple[Device, ...]


def _bad_cases(cluster: bench.Cluster) -> list[BadPlacement]:
    r1, r2, r7 = (rank(cluster, p) for p in ("1g.5gb", "2g.10gb", "7g.40gb"))
    two = make_pod(1, 0.0, 1.0, "1g.5gb", devices=2)
    return [
        BadPlacement("overlaps a held instance", make_pod(1, 0, 1), (Device(0, r1, 1),)),
        BadPlacement("overlaps itself", two, (Device(2, r1, 3), Device(2, r1, 3))),
        BadPlacement("illegal start", make_pod(1, 0, 1), (Device(2, r1, 7),)),
        BadPlacement("two nodes", two, (Device(2, r1, 0), Device(4, r1, 0))),
        BadPlacement("profile too small", make_pod(1, 0, 1, "2g.10gb"), (Device(2, r1, 0),)),
        BadPlacement("too few devices", two, (Device(2, r1, 0),)),
        BadPlacement("excluded type", make_pod(1, 0, 1, gpu_type="H100"), (Device(2, r2, 0),)),
        BadPlacement("unknown rank", make_pod(1, 0, 1), (Device(2, r7 + 1, 0),)),
    ]


def test_occupancy_refuses_every_double_or_illegal_allocation() -> None:
    cluster = bench.make_cluster(("A100-PCIE-40GB",) * 3, gpus_per_node=2)
    occ = bench.Occupancy(cluster)
    held = make_pod(0, 0.0, 1.0, "3g.20gb")
    occ.place(held, (Device(0, rank(cluster, "3g.20gb"), 0),))
    before = occ.masks.copy()
    for case in _bad_cases(cluster):
        with pytest.raises(bench.DoubleAllocationError):
            occ.place(case.pod, case.devices)
        # nothing was counted
        assert (occ.masks == before).all(), case.name
        assert set(occ.holders) == {0}, case.name
    with pytest.raises(bench.DoubleAllocationError, match="twice"):
        occ.place(held, (Device(1, rank(cluster, "3g.20gb"), 0),))
    occ.release(held)
    assert not occ.masks.any() and occ.occupied == 0


@pytest.mark.parametrize("policy", bench.POLICIES)
def test_no_policy_double_allocates_on_a_random_stream(policy: str) -> None:
    cluster = bench.make_cluster(bench.cluster_models(4, seed=7))
    stream = bench.make_stream(cluster, seed=3, load=1.3, horizon=1.5)
    result, occ = bench.replay(cluster, stream, policy, warmup=0.5)
    assert result["offered"] > result["accepted"] > 0
    assert result["rejected_while_fitting"] == 0
    # The masks are exactly the union of what the pods still running hold.
    masks = np.zeros_like(occ.masks)
    for devices in occ.holders.values():
        for d in devices:
            pl = cluster.geometries[int(occ.gpu_geom[d.row])].placement(d.rank, d.start)
            assert pl is not None and int(masks[d.row]) & pl.mask == 0
            masks[d.row] |= pl.mask
    assert (masks == occ.masks).all()


def test_streams_are_seeded_and_offer_the_load_asked() -> None:
    cluster = bench.make_cluster(bench.cluster_models(8, seed=1))
    a, b = (bench.make_stream(cluster, seed=5, load=1.2, horizon=3.0) for _ in range(2))
    assert a == b
    assert bench.make_stream(cluster, seed=6, load=1.2, horizon=3.0).pods != a.pods
    assert len(a.pods) == pytest.approx(a.rate * 3.0, rel=0.15)
    offered = sum(p.slices * p.devices for p in a.pods) / len(a.pods) * a.rate
    assert offered / cluster.total_slices == pytest.approx(1.2, rel=0.1)
    assert {p.devices for p in a.pods} == {1, 2, 4}
    assert {p.size for p in a.pods} == {"1g", "2g", "3g", "7g"}
    assert {p.gpu_type for p in a.pods} == {None, "A100", "H100", "H200"}


def test_cluster_models_follow_the_shares() -> None:
    models = bench.cluster_models(200, seed=1)
    assert {m: models.count(m) for m in set(models)} == {
        "NVIDIA A100-PCIE-40GB": 50,
        "NVIDIA A100-SXM4-40GB": 50,
        "NVIDIA H100 80GB HBM3": 60,
        "NVIDIA H200": 40,
    }
    assert models != bench.cluster_models(200, seed=2)


def test_main_writes_the_report_and_its_table(tmp_path: Path) -> None:
    out = tmp_path / "churn.json"
    args = ["--nodes", "4", "--streams", "2", "--horizon", "1.2", "--warmup", "0.4"]
    assert bench.main([*args, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["streams"] == 2 and report["nodes"] == 4 and report["gpus"] == 32
    assert list(report["policies"]) == list(bench.POLICIES)
    first = report["policies"][bench.FIRST_FIT]
    assert first["accepted_vs_first_fit"] == 1.0
    assert report["policies"][bench.HAMI_2855]["accepted_vs_hami_2855"] == 1.0
    assert len(report["per_stream"]) == 2
    table = out.with_suffix(".md").read_text()
    assert "| tessera |" in table and "target:" in table


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nodes", "0"], "--nodes must be at least 1"),
        (["--nodes", "many"], "invalid int value"),
        (["--streams", "0"], "--streams must be at least 1"),
        (["--load", "-1"], "--load must be a positive number"),
        (["--load", "nan"], "--load must be a positive number"),
        (["--horizon", "2", "--warmup", "3"], "--warmup must be >= 0 and below --horizon"),
        (["--policies", "best-fit"], "unknown 'best-fit'"),
        (["--policies", ","], "empty list"),
    ],
)
def test_bad_command_lines_fail_with_a_clear_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        bench.main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_run_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="--streams"):
        bench.run(nodes=2, streams=0)
    with pytest.raises(ValueError, match="unknown policy"):
        bench.run(nodes=2, streams=1, policies=["random"])
