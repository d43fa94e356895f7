"""kwok mode's reconcile of a fake MIG node: repeated only when something it reads changed
(the node's pods, its simulated GPUs, the MIG manager's records) or the last one left work."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from api.hami.catalog import simulated_gpu_uuid, simulated_register_json
from api.hami.config import DeviceConfig
from api.hami.devices import MigAllocation
from api.hami.keys import NODE_REGISTER
from api.hami.register import Placement
from node_agent.kwok_mode import KWOK_NODE_ANNOTATION, FakeNode, KwokAgents
from node_agent.mig_manager import DesiredSet, ReconcileReport
from node_agent.nvml import NvmlError
from tests.unit.test_kwok_mps import KwokKube

NODE = "kwok-mig-0"
G0 = simulated_gpu_uuid(NODE, 0)


def mig_node() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": NODE,
            "annotations": {
                KWOK_NODE_ANNOTATION: "fake",
                NODE_REGISTER: simulated_register_json(NODE, "A100-PCIE-40GB", 2, "mig"),
            },
        },
    }


def a_pod(name: str, rv: int, node: str = NODE) -> dict[str, Any]:
    return {
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "ns", "uid": name, "resourceVersion": str(rv)},
        "spec": {"nodeName": node},
    }


class Rig:
    def __init__(self, tmp_path: Path) -> None:
        kube = KwokKube()
        kube.objects[f"/api/v1/nodes/{NODE}"] = mig_node()
        self.agents = KwokAgents(kube, DeviceConfig(), state_dir=tmp_path)  # type: ignore[arg-type]
        node = self.agents.node(NODE)
        assert node is not None
        self.node: FakeNode = node
        self.reports: list[ReconcileReport] = []
        real = node.mig.reconcile

        def counted(*args: Any, **kwargs: Any) -> ReconcileReport:
            report = real(*args, **kwargs)
            self.reports.append(report)
            return report

        node.mig.reconcile = counted  # type: ignore[method-assign]

    def runs(self) -> int:
        """Reconcile once more; how many reconciles ran in all."""
        self.agents.reconcile(self.node)
        return len(self.reports)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    r = Rig(tmp_path)
    yield r
    r.node.backend.shutdown()


def test_a_reconcile_over_what_a_settled_one_read_is_skipped(rig: Rig) -> None:
    assert rig.runs() == 1 and rig.reports[-1].settled
    assert rig.runs() == 1  # nothing changed: the periodic pass costs no look at the GPUs
    rig.agents.pods.offer(a_pod("other", 2, node="kwok-mig-1"))
    assert rig.runs() == 1  # another node's pod


def test_the_periodic_pass_queues_only_nodes_a_reconcile_would_not_skip(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    queued: list[str] = []
    monkeypatch.setattr(rig.agents._queues, "submit", lambda node, item: queued.append(node))
    rig.agents.pass_all()
    assert queued == [NODE]  # never reconciled yet
    rig.runs()
    rig.agents.pass_all()
    assert queued == [NODE]  # settled: no worker woken
    rig.agents.pods.offer(a_pod("p", 2))
    rig.agents.pass_all()
    assert queued == [NODE, NODE]


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda r: r.agents.pods.offer(a_pod("p", 2)), id="a pod comes"),
        pytest.param(
            lambda r: (r.agents.pods.offer(a_pod("p", 2)), r.agents.pods.offer(a_pod("p", 3))),
            id="a newer version",
        ),
        pytest.param(lambda r: r.agents.pods.replace_all([]), id="a fresh list"),
        pytest.param(
            lambda r: r.node.backend.create_gpu_instance_with_placement(0, 19, Placement(0, 1)),
            id="a GPU changes behind the manager's back",
        ),
        pytest.param(lambda r: r.node.backend.set_health(1, False), id="a GPU's health"),
    ],
)
def test_any_change_it_reads_makes_it_run_again(rig: Rig, change: Any) -> None:
    assert rig.runs() == 1 and rig.runs() == 1
    change(rig)
    assert rig.runs() == 2
    assert rig.runs() == 2  # and settles again


def test_a_pod_going_makes_it_run_again(rig: Rig) -> None:
    rig.agents.pods.offer(a_pod("p", 2))
    assert rig.runs() == 1 and rig.runs() == 1
    rig.agents.pods.delete(a_pod("p", 3))
    assert rig.runs() == 2


def test_work_left_or_done_makes_the_next_one_run(rig: Rig) -> None:
    """An instance nobody desires: the failed destroy is retried, the destroy that worked is
    followed by one more look, and only then does the node settle."""
    alloc = MigAllocation(0, 0, G0, "1g.5gb", Placement(0, 1))
    rig.node.mig.ensure("ns/gone", [alloc], DesiredSet())
    rig.reports.clear()  # ensure's own reconcile of the GPU
    rig.node.backend.fail_next("destroy_compute_instance", NvmlError("destroy", "timeout"))
    assert rig.runs() == 1 and rig.reports[-1].failed
    assert rig.runs() == 2 and rig.reports[-1].destroyed
    assert rig.runs() == 3 and rig.reports[-1].settled
    assert rig.runs() == 3
    assert rig.node.backend.state_snapshot()["gpus"][0]["gpuInstances"] == []
