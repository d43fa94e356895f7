"""Fixtures of the end-to-end tests: real dev clusters running Tessera's whole stack.

``built_tools`` builds (or finds cached) the cluster binaries and ``tessera-scheduler``;
a build failure fails the tests loudly. ``small_cluster`` (one per module) has five
hand-sized nodes for the scenario tests; ``burst_cluster`` is a fresh 30-node cluster per
test, so each burst starts from empty GPUs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from scheduler_plugins.devtools.cluster.errors import ClusterError
from scheduler_plugins.devtools.cluster.testing import build_tools
from tests.e2e.harness import HERE, E2ECluster, tessera_cluster

SMALL_NODES = 5
BURST_NODES = 30


@pytest.fixture(scope="session")
def built_tools() -> Path:
    try:
        return build_tools()
    except ClusterError as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="module")
def small_cluster(
    built_tools: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[E2ECluster]:
    state = tmp_path_factory.mktemp("e2e-small")
    with tessera_cluster(state, "e2e-small", HERE / "nodes-small.yaml", SMALL_NODES) as c:
        yield c


@pytest.fixture
def one_candidate_cluster(
    built_tools: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[E2ECluster]:
    """The small cluster with kube-scheduler given only Tessera's best node per GPU pod."""
    state = tmp_path_factory.mktemp("e2e-cand")
    with tessera_cluster(
        state,
        "e2e-cand",
        HERE / "nodes-small.yaml",
        SMALL_NODES,
        tessera_args={"candidateNodes": 1},
    ) as c:
        yield c


@pytest.fixture
def burst_cluster(
    built_tools: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[E2ECluster]:
    state = tmp_path_factory.mktemp("e2e-burst")
    with tessera_cluster(state, "e2e-burst", HERE / "nodes-burst.yaml", BURST_NODES) as c:
        yield c
