"""A local Kubernetes dev cluster for Tessera: etcd + kube-apiserver + kwok with fake GPU nodes.

Developer and test tooling only: the scheduling core never imports this package. Binaries come
from ``hack/build-tools.sh`` (``make tools``); ``tessera cluster up|down|status|add-nodes`` is
registered by :func:`scheduler_plugins.devtools.cluster.cli.add_cluster_commands`.
"""

from __future__ import annotations
