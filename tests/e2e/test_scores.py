"""Tessera's score sums honestly with kube-scheduler's own score plugins (the real
``tessera-scheduler``, the example profile's weight 5).

Three one-GPU nodes (10 slots, 100 cores, 40960 MiB each). A node's Tessera score under the
default node binpack is 100 × its node score / 30, the node score being (slots share + cores
share + memory share) × 10. A preferred node affinity or a topology spread adds up to 2 × 100
for the node it prefers: it wins between nodes whose Tessera scores are close, and loses to a
clearly fuller node.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import pytest

from api.hami import keys as ann
from tests.e2e.harness import (
    GPU,
    GPUCORES,
    GPUMEM,
    HERE,
    E2ECluster,
    node_of,
    pod_manifest,
    tessera_cluster,
)

APP: Final = {"tessera.dev/e2e-app": "scores"}
HAMI_CORE: Final = {ann.VGPU_MODE: "hami-core"}


@pytest.fixture(scope="module")
def cluster(built_tools: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2ECluster]:
    state = tmp_path_factory.mktemp("e2e-scores")
    with tessera_cluster(state, "e2e-scores", HERE / "nodes-scores.yaml", 3) as c:
        yield c


def _pod(
    name: str,
    nodes: Sequence[str],
    *,
    mem: int = 2000,
    cores: int = 0,
    prefer: str | None = None,
    spread: bool = False,
) -> dict[str, Any]:
    pod = pod_manifest(
        name, {GPU: 1, GPUMEM: mem, GPUCORES: cores}, annotations=HAMI_CORE, labels=APP, nodes=nodes
    )
    spec = pod["spec"]
    if prefer is not None:
        spec["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"] = [
            {
                "weight": 100,
                "preference": {
                    "matchFields": [{"key": "metadata.name", "operator": "In", "values": [prefer]}]
                },
            }
        ]
    if spread:
        spec["topologySpreadConstraints"] = [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": APP},
            }
        ]
    return pod


def _place(c: E2ECluster, pod: dict[str, Any]) -> str:
    c.create(pod)
    return node_of(c.wait_bound(pod["metadata"]["name"]))


def test_preferences_win_between_close_nodes_and_lose_to_a_clearly_fuller_one(
    cluster: E2ECluster,
) -> None:
    c = cluster
    a, b, far = c.nodes_in_mode("hami-core")
    assert _place(c, _pod("load-a", [a])) == a
    # Binpack alone: a (1 slot, 2000 MiB: Tessera 5) over the empty b (0).
    assert _place(c, _pod("plain", [a, b])) == a
    # a holds 2 pods (Tessera 10), b none (0): 5 × 10 = 50 < a preferred node affinity's 200.
    assert _place(c, _pod("prefers-b", [a, b], prefer=b)) == b
    # a 10, b 5 (one pod): the topology spread's preference for b (fewer of these pods there)
    # outweighs Tessera's 5 × 5.
    assert _place(c, _pod("spreads", [a, b], spread=True)) == b
    # far holds 1 slot, 80 cores, 36000 MiB: Tessera 59; b, with two small pods, 10.
    # 5 × 49 = 245 beats the affinity's 200: binpack keeps the pod on the fuller node.
    assert _place(c, _pod("load-far", [far], mem=36000, cores=80)) == far
    assert _place(c, _pod("prefers-b-far", [b, far], prefer=b)) == far
