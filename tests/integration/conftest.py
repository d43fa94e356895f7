"""A real dev cluster (etcd + kube-apiserver + kwok) for the integration tests.

The session fixture builds the tools (``hack/build-tools.sh``: seconds when cached, many
minutes cold), starts a cluster on free loopback ports in a temp dir, adds a few fake GPU
nodes and tears everything down at the end, checking that no process is left. A build or
start failure fails the tests loudly: nothing here skips.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from api.kube.errors import NotFoundError
from scheduler_plugins.devtools.cluster.cluster import Cluster, ClusterInfo
from scheduler_plugins.devtools.cluster.errors import ClusterError
from scheduler_plugins.devtools.cluster.layout import ClusterSettings
from scheduler_plugins.devtools.cluster.nodes import NodeGroup, NodeProfile, add_nodes, wait_ready
from scheduler_plugins.devtools.cluster.stack import SCHEDULER_NAME
from scheduler_plugins.devtools.cluster.testing import ClusterClient, build_tools, settings_in
from scheduler_plugins.devtools.cluster.webhook import start_webhook, stop_webhook
from scheduler_plugins.webhook.manifest import API_PATH, DEFAULT_NAME

BUILD_TIMEOUT_S = 3600  # a cold build of kube-apiserver on 2 cores takes many minutes

# Two models, both modes: enough to check the register annotation end to end.
PROFILE = NodeProfile(
    name_prefix="it-gpu",
    groups=(
        NodeGroup("A100-PCIE-40GB", gpus_per_node=4, mode="hami-core", labels={"gpu": "on"}),
        NodeGroup("H100 80GB", gpus_per_node=8, mode="mig", labels={"gpu": "on"}),
    ),
)
NODE_COUNT = 4


@pytest.fixture(scope="session")
def built_tools() -> Path:
    """Build (or find cached) etcd, kube-apiserver, kubectl, kwok; fail loudly if impossible."""
    try:
        return build_tools(BUILD_TIMEOUT_S)
    except ClusterError as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="session")
def dev_cluster(
    built_tools: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ClusterClient]:
    settings = settings_in(tmp_path_factory.mktemp("devcluster"), "it")
    cluster = Cluster(settings)
    with ExitStack() as stack:
        stack.callback(_assert_nothing_left, cluster)
        stack.callback(cluster.down)
        info: ClusterInfo = cluster.up(timeout_s=120)
        api = stack.enter_context(info.api())
        names = add_nodes(api, PROFILE, NODE_COUNT)
        wait_ready(api, names, timeout_s=120)
        yield ClusterClient(
            server=info.server,
            token=info.token,
            kubeconfig=info.kubeconfig,
            ca_file=info.ca_file,
            api=api,
            settings=settings,
            profile=PROFILE,
            nodes=tuple(names),
        )


@pytest.fixture(scope="module")
def webhook(dev_cluster: ClusterClient) -> Iterator[str]:
    """Tessera's admission webhook registered with the dev cluster (its URL), trusting no
    user, so the tests' admin meets every rule; unregistered and stopped afterwards."""
    url = start_webhook(
        dev_cluster.settings, scheduler_name=SCHEDULER_NAME, trusted_users=(), timeout_s=60
    )
    try:
        yield url
    finally:
        stop_webhook(dev_cluster.settings)
    # Left registered, it would refuse every later pod (failurePolicy Fail).
    with pytest.raises(NotFoundError):
        dev_cluster.api.get(f"{API_PATH}/{DEFAULT_NAME}")


@pytest.fixture
def spare_settings(built_tools: Path, tmp_path: Path) -> ClusterSettings:
    """Settings for one more cluster (own temp state dir, free ports)."""
    return settings_in(tmp_path / "state", "spare")


def _assert_nothing_left(cluster: Cluster) -> None:
    left = cluster.running_pids()
    assert not left, f"cluster processes left running after down: {left}"
