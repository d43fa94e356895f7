"""The dev cluster's processes (etcd, kube-apiserver, kwok) listen on loopback only: a
developer's cluster, with its admin token on disk, is never reachable from the network."""

from __future__ import annotations

from scheduler_plugins.devtools.cluster.cluster import Cluster
from scheduler_plugins.devtools.cluster.testing import ClusterClient
from tests.security_helpers import is_loopback, tcp_listeners


def test_dev_cluster_listens_on_loopback_only(dev_cluster: ClusterClient) -> None:
    pids = Cluster(dev_cluster.settings).running_pids()
    assert len(pids) >= 3  # etcd, kube-apiserver, kwok
    listeners = {pid: tcp_listeners(pid) for pid in pids}
    assert all(listeners.values()), listeners  # each of them does listen on something
    remote = {
        pid: [(host, port) for host, port in found if not is_loopback(host)]
        for pid, found in listeners.items()
    }
    assert not any(remote.values()), remote
