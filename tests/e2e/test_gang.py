"""End to end: gangs beside GPU sharing, on the real apiserver + kwok with the real
``tessera-scheduler`` (kube-scheduler 1.36's PodGroup gang scheduling over Tessera's
reservations).

Nodes (``nodes-gang.yaml``): two hami-core nodes with four A100-40GB each, one MIG node with
one A100-40GB. Each test starts from an empty cluster (its pods and PodGroups are deleted at
the end):

- a gang of four 2-GPU pods of which only three fit holds no GPU while it waits (another pod
  takes the GPUs it would need), its PodGroup's Event names the member that did not fit; once
  capacity frees, all four are admitted together;
- a gang whose members all land on one node (HAMi's node lock breaks exactly this) binds;
- a MIG gang reserves its members' exact placements together, and one that cannot fit
  because the GPU's free slices are fragmented says so;
- the plugin server SIGKILLed while a gang waits: after its restart nothing is reserved or
  allocated twice (``tessera check``), and the gang is admitted once it fits.
"""

from __future__ import annotations

import os
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import pytest

from api.hami import keys as ann
from api.hami.devices import decode_devices, decode_mig_allocations
from scheduler_plugins.devtools.cluster import processes
from scheduler_plugins.devtools.cluster.stack import (
    PLUGIN_SERVER,
    metrics_address,
    restart_component,
)
from scheduler_plugins.server.events import GANG_REASON
from tests.e2e.harness import (
    EVENTS_PATH,
    GPU,
    GPUMEM,
    HERE,
    NAMESPACE,
    E2ECluster,
    annots,
    bind_done,
    node_of,
    pod_manifest,
    scheduled_condition,
    tessera_cluster,
    wait_for,
)
from tests.e2e.invariants import cluster_report

CORE_A, MIG, CORE_B = "e2e-gang-0000", "e2e-gang-0001", "e2e-gang-0002"
LABEL: Final = {"tessera.dev/test": "gang"}
SELECTOR: Final = "tessera.dev/test=gang"
PODGROUPS: Final = f"/apis/scheduling.k8s.io/v1alpha2/namespaces/{NAMESPACE}/podgroups"
CORE: Final = {ann.VGPU_MODE: "hami-core"}
MIG_MODE: Final = {ann.VGPU_MODE: "mig"}
WHOLE_2: Final = {GPU: 2, GPUMEM: 40000}  # two whole A100-40GB (only hami-core GPUs left)


@pytest.fixture(scope="module")
def cluster(built_tools: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2ECluster]:
    state = tmp_path_factory.mktemp("e2e-gang")
    with tessera_cluster(state, "e2e-gang", HERE / "nodes-gang.yaml", 3) as c:
        yield c


@pytest.fixture
def empty(cluster: E2ECluster) -> Iterator[E2ECluster]:
    yield cluster
    cluster.delete_pods(SELECTOR)
    for pg in cluster.api.list(PODGROUPS).get("items") or []:
        cluster.api.request("DELETE", f"{PODGROUPS}/{pg['metadata']['name']}")


def podgroup(c: E2ECluster, name: str, min_count: int) -> None:
    c.api.post(
        PODGROUPS,
        {
            "apiVersion": "scheduling.k8s.io/v1alpha2",
            "kind": "PodGroup",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"schedulingPolicy": {"gang": {"minCount": min_count}}},
        },
    )


def member(
    gang: str,
    name: str,
    limits: dict[str, object],
    annotations: dict[str, str],
    nodes: list[str] | None = None,
) -> dict[str, Any]:
    obj = pod_manifest(name, limits, annotations=annotations, labels=LABEL, nodes=nodes)
    obj["spec"]["schedulingGroup"] = {"podGroupName": gang}
    return obj


def condition(c: E2ECluster, gang: str) -> tuple[str, str] | None:
    pg = c.api.get(f"{PODGROUPS}/{gang}")
    for cond in (pg.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "PodGroupScheduled":
            return str(cond["status"]), str(cond.get("reason", ""))
    return None


def gang_events(c: E2ECluster, gang: str) -> list[str]:
    found = c.api.list(EVENTS_PATH, field_selector=f"reason={GANG_REASON}")
    return [
        str(e.get("message", ""))
        for e in found.get("items") or []
        if (e.get("involvedObject") or {}).get("name") == gang
        and (e.get("involvedObject") or {}).get("kind") == "PodGroup"
    ]


def gangs_total(c: E2ECluster, outcome: str) -> float:
    with urllib.request.urlopen(f"http://{metrics_address(c.settings)}/metrics") as r:
        text = r.read().decode()
    prefix = f'tessera_gangs_total{{outcome="{outcome}"}} '
    [line] = [ln for ln in text.splitlines() if ln.startswith(prefix)]
    return float(line[len(prefix) :])


def no_reservation_held(c: E2ECluster) -> None:
    """No reservation counts. A refused gang is tried again after its backoff, and holds trial
    reservations for the milliseconds that takes: wait for a moment between tries."""
    wait_for("no reservation held", lambda: reservations_held(c) == 0, 10, interval_s=0.05)


def reservations_held(c: E2ECluster) -> float:
    with urllib.request.urlopen(f"http://{metrics_address(c.settings)}/metrics") as r:
        text = r.read().decode()
    [line] = [
        ln for ln in text.splitlines() if ln.startswith("tessera_scheduler_reservations_held ")
    ]
    return float(line.split()[1])


def gpus_of(p: dict[str, Any]) -> list[str]:
    return [d.uuid for ctr in decode_devices(annots(p)[ann.DEVICES_ALLOCATED]) for d in ctr]


def names(prefix: str, n: int) -> list[str]:
    return [f"{prefix}-{i}" for i in range(n)]


def waits_unschedulable(c: E2ECluster, gang: str, members: list[str]) -> None:
    """The gang's cycle failed: its PodGroup says so and none of its members is bound."""
    wait_for(
        f"gang {gang} unschedulable",
        lambda: condition(c, gang) == ("False", "Unschedulable"),
        timeout_s=60,
        interval_s=0.5,
    )
    assert not [m for m in members if node_of(c.pod(m))], "a member of a refused gang is bound"


def admitted(c: E2ECluster, members: list[str], timeout_s: float = 90) -> list[dict[str, Any]]:
    wait_for(
        "every member bound",
        lambda: all(bind_done(c.pod(m)) for m in members),
        timeout_s=timeout_s,
        interval_s=0.5,
    )
    return [c.pod(m) for m in members]


def test_a_gang_that_does_not_fit_holds_nothing_and_is_admitted_whole(empty: E2ECluster) -> None:
    c = empty
    # Two of CORE_B's four GPUs taken: room for three 2-GPU members (two on CORE_A, one here).
    c.create(pod_manifest("blocker", WHOLE_2, annotations=CORE, labels=LABEL, nodes=[CORE_B]))
    c.wait_bound("blocker")
    unschedulable_before = gangs_total(c, "unschedulable")

    podgroup(c, "train", 4)
    members = names("train", 4)
    c.create_many([member("train", m, WHOLE_2, CORE) for m in members])
    waits_unschedulable(c, "train", members)
    assert gangs_total(c, "unschedulable") > unschedulable_before

    wait_for("the gang's Event", lambda: bool(gang_events(c, "train")), 30, interval_s=0.5)
    [message] = gang_events(c, "train")
    assert "3 of 4 members" in message and "not placed" in message, message
    assert "fewer fitting GPUs than requested" in message or "insufficient" in message, message

    # It holds nothing: no reservation counts, and another pod takes the GPUs of CORE_A it
    # would have had.
    no_reservation_held(c)
    report = cluster_report(c)
    assert report.ok, str(report)
    c.create(
        pod_manifest(
            "taker", {GPU: 4, GPUMEM: 40000}, annotations=CORE, labels=LABEL, nodes=[CORE_A]
        )
    )
    assert node_of(c.wait_bound("taker")) == CORE_A
    assert not [m for m in members if node_of(c.pod(m))]

    # Capacity frees (both pods go): all four are admitted together.
    admitted_before = gangs_total(c, "admitted")
    for name in ("taker", "blocker"):
        c.api.request(
            "DELETE",
            f"/api/v1/namespaces/{NAMESPACE}/pods/{name}",
            {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0},
        )
    pods = admitted(c, members)
    assert condition(c, "train") == ("True", "Scheduled")
    assert gangs_total(c, "admitted") == admitted_before + 1
    gpus = [g for p in pods for g in gpus_of(p)]
    assert len(gpus) == len(set(gpus)) == 8, gpus
    assert sorted(node_of(p) for p in pods) == [CORE_A, CORE_A, CORE_B, CORE_B]
    report = cluster_report(c)
    assert report.ok, str(report)


def test_a_gang_on_one_node_binds(empty: E2ECluster) -> None:
    c = empty
    podgroup(c, "local", 6)
    members = names("local", 6)
    # Identical fractional members, all on one node: the node agent cannot tell them apart,
    # so they bind one after another there, and every one of them binds.
    c.create_many(
        [member("local", m, {GPU: 1, GPUMEM: 10000}, CORE, nodes=[CORE_A]) for m in members]
    )
    pods = admitted(c, members)
    assert {node_of(p) for p in pods} == {CORE_A}
    assert all(annots(p)[ann.BIND_PHASE] == "success" for p in pods)
    report = cluster_report(c)
    assert report.ok, str(report)


def test_a_mig_gang_reserves_exact_placements_together(empty: E2ECluster) -> None:
    c = empty
    # One 3g.20gb and two 2g.10gb fill the A100-40GB only as 3g at [4,8) and 2g at 0 and 2.
    podgroup(c, "mig-fit", 3)
    members = ["mig-fit-3g", "mig-fit-2g-a", "mig-fit-2g-b"]
    c.create(member("mig-fit", members[0], {GPU: 1, GPUMEM: 16000}, MIG_MODE))
    c.create_many([member("mig-fit", m, {GPU: 1, GPUMEM: 8000}, MIG_MODE) for m in members[1:]])
    pods = admitted(c, members)
    spans = []
    for p in pods:
        assert node_of(p) == MIG
        [alloc] = decode_mig_allocations(annots(p)[ann.MIG_ALLOCATIONS])
        spans.append((alloc.profile, alloc.placement.start, alloc.placement.end))
    assert sorted(spans) == [("2g.10gb", 0, 2), ("2g.10gb", 2, 4), ("3g.20gb", 4, 8)], spans
    report = cluster_report(c)
    assert report.ok, str(report)


def test_a_mig_gang_that_fragmentation_blocks_says_so(empty: E2ECluster) -> None:
    c = empty
    # Seven 1g.5gb pods fill the A100-40GB; the two at slices 1 and 3 go: two free slices,
    # but no 2g.10gb placement (at 0, 2 or 4) is free.
    ones = names("one", 7)
    c.create_many(
        [pod_manifest(n, {GPU: 1, GPUMEM: 4000}, annotations=MIG_MODE, labels=LABEL) for n in ones]
    )
    start = {}
    for p in admitted(c, ones):
        [alloc] = decode_mig_allocations(annots(p)[ann.MIG_ALLOCATIONS])
        start[alloc.placement.start] = p["metadata"]["name"]
    assert sorted(start) == list(range(7))
    for s in (1, 3):
        c.api.request(
            "DELETE",
            f"/api/v1/namespaces/{NAMESPACE}/pods/{start[s]}",
            {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0},
        )
    wait_for("two slices free", lambda: len(c.pods(SELECTOR)) == 5, 30, interval_s=0.2)

    podgroup(c, "frag", 2)
    members = ["frag-1g", "frag-2g"]
    c.create(member("frag", members[0], {GPU: 1, GPUMEM: 4000}, MIG_MODE))
    c.create(member("frag", members[1], {GPU: 1, GPUMEM: 8000}, MIG_MODE))
    waits_unschedulable(c, "frag", members)
    wait_for("the gang's Event", lambda: bool(gang_events(c, "frag")), 30, interval_s=0.5)
    [message] = gang_events(c, "frag")
    assert "1 of 2 members" in message and "default/frag-2g" in message, message
    assert "MIG fragmentation" in message, message
    no_reservation_held(c)
    report = cluster_report(c)
    assert report.ok, str(report)


def test_a_plugin_server_killed_while_a_gang_waits_leaks_nothing(empty: E2ECluster) -> None:
    c = empty
    c.create(pod_manifest("blocker", WHOLE_2, annotations=CORE, labels=LABEL, nodes=[CORE_B]))
    c.wait_bound("blocker")
    podgroup(c, "crash", 4)
    members = names("crash", 4)
    c.create_many([member("crash", m, WHOLE_2, CORE) for m in members])
    waits_unschedulable(c, "crash", members)

    record = processes.read_record(c.settings.pid_file(PLUGIN_SERVER))
    assert record is not None and processes.is_running(record)
    os.killpg(record.pid, signal.SIGKILL)
    wait_for("plugin server gone", lambda: not processes.is_running(record), 10.0, 0.05)
    restart_component(c.settings, PLUGIN_SERVER, timeout_s=90.0)
    # Cycles that asked the dead server failed with an error; the next ones refuse the gang
    # again, on the restarted server's state.
    wait_for(
        "the gang refused again",
        lambda: all(
            (scheduled_condition(c.pod(m)) or {}).get("reason") == "Unschedulable" for m in members
        ),
        timeout_s=60,
        interval_s=0.5,
    )

    assert not [m for m in members if node_of(c.pod(m))]
    no_reservation_held(c)
    report = cluster_report(c)
    assert report.ok, str(report)

    c.api.request(
        "DELETE",
        f"/api/v1/namespaces/{NAMESPACE}/pods/blocker",
        {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0},
    )
    pods = admitted(c, members)
    gpus = [g for p in pods for g in gpus_of(p)]
    assert len(gpus) == len(set(gpus)) == 8, gpus
    report = cluster_report(c)
    assert report.ok, str(report)
