"""Cluster-wide allocation invariants for the end-to-end tests (``tessera check``).

The checks themselves live in the library (``tessera check``); this module keeps the
string-returning helpers the burst tests use and adds ``cluster_report``, the whole check of a
running e2e cluster (API objects and the kwok node agent's simulated NVML state).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from api.hami.register import GpuDevice
from scheduler_plugins.core.state import ClusterState
from scheduler_plugins.devtools import check
from scheduler_plugins.devtools.check import CheckReport, check_cluster, rebuild_state
from scheduler_plugins.devtools.cluster.stack import StackPaths
from tests.e2e.harness import E2ECluster

__all__ = ["annotation_violations", "capacity_violations", "cluster_report", "rebuild_state"]


def capacity_violations(state: ClusterState) -> list[str]:
    return [str(v) for v in check.capacity_violations(state)]


def annotation_violations(
    pod: Mapping[str, Any], node_gpus: Mapping[str, Sequence[GpuDevice]]
) -> list[str]:
    return [str(v) for v in check.annotation_violations(pod, node_gpus)]


def cluster_report(c: E2ECluster) -> CheckReport:
    """``tessera check`` of the cluster, including its simulated GPUs."""
    return check_cluster(c.api, sim_state=StackPaths.of(c.settings).agent_state)
