"""The benchmark's clusters and schedulers: a dev cluster tuned for load, Tessera's stack, and
the stock kube-scheduler as the baseline.

``BenchCluster`` is the dev cluster with the apiserver's in-flight limits lifted (API
Priority and Fairness off, ``--max-requests-inflight=0``, ``--max-mutating-requests-inflight=0``)
so the clients, not the apiserver's queueing, decide how fast work arrives; etcd already
runs without fsync on a dev cluster. ``TesseraScheduler`` starts the devcluster stack
(plugin server, ``tessera-scheduler``, kwok node agent); ``StockScheduler`` runs the stock
``kube-scheduler`` built from the same Kubernetes version with the client qps/burst of
``examples/scheduler-config.yaml``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, Protocol

import structlog
import yaml

from api.hami.policy import Policy
from scheduler_plugins.devtools.bench import audit
from scheduler_plugins.devtools.bench.workload import (
    STOCK_SCHEDULER_NAME,
    BenchPod,
    stock_manifest,
    tessera_manifest,
)
from scheduler_plugins.devtools.cluster import processes
from scheduler_plugins.devtools.cluster.certs import Pki
from scheduler_plugins.devtools.cluster.cluster import COMPONENTS, Cluster
from scheduler_plugins.devtools.cluster.errors import ClusterError
from scheduler_plugins.devtools.cluster.layout import ClusterSettings, repo_root
from scheduler_plugins.devtools.cluster.stack import (
    SCHEDULER,
    STACK,
    StackPaths,
    metrics_address,
    record_loopback_address,
    restart_component,
    scheduler_metrics_url,
    scheduler_serving_args,
    start_stack,
    stop_stack,
)
from scheduler_plugins.devtools.cluster.webhook import WEBHOOK

log = structlog.get_logger(__name__)

STOCK: Final = "kube-scheduler"
APISERVER_LOAD_FLAGS: Final = (
    # With APF on, the two limits only size its queues and may not both be 0; with it off
    # 0 means unlimited.
    "--enable-priority-and-fairness=false",
    "--max-requests-inflight=0",
    "--max-mutating-requests-inflight=0",
)

Obj = dict[str, Any]


class SchedulerKind(enum.StrEnum):
    TESSERA = "tessera"
    STOCK = "stock"


class BenchCluster(Cluster):
    """A dev cluster whose apiserver does not throttle the benchmark's clients, and with
    ``audit`` writes an audit log (``audit.apiserver_flags``) that names each request's
    client."""

    def __init__(self, settings: ClusterSettings, *, audit: bool = False) -> None:
        super().__init__(settings)
        self.audit = audit

    def _apiserver_argv(self, pki: Pki) -> list[str]:
        s = self.settings
        flags = audit.apiserver_flags(s.state_dir, s.log_dir) if self.audit else []
        return [*super()._apiserver_argv(pki), *APISERVER_LOAD_FLAGS, *flags]

    def component_pids(self) -> dict[str, int]:
        """etcd, kube-apiserver and kwok by name (those running)."""
        return _pids(self.settings, COMPONENTS)


class Scheduler(Protocol):
    @property
    def kind(self) -> SchedulerKind: ...

    def start(self, settings: ClusterSettings) -> None: ...

    def stop(self, settings: ClusterSettings) -> None: ...

    def pause(self, settings: ClusterSettings) -> None:
        """Stop scheduling (the scheduler process only; the rest keeps running)."""
        ...

    def resume(self, settings: ClusterSettings) -> None:
        """Start scheduling again after ``pause``; returns once the scheduler is ready."""
        ...

    def pids(self, settings: ClusterSettings) -> dict[str, int]: ...

    def log_path(self, settings: ClusterSettings) -> Path:
        """The scheduler's log (kube-scheduler's ``-v 2``: it names each pod it bound)."""
        ...

    def manifest(self, pod: BenchPod, *, namespace: str, labels: Mapping[str, str]) -> Obj: ...

    @property
    def metrics_url(self) -> str | None:
        """The plugin server's /metrics (Tessera only)."""
        ...

    @property
    def scheduler_metrics_url(self) -> str | None:
        """kube-scheduler's own /metrics (HTTPS, self-signed), once started."""
        ...


class TesseraScheduler:
    """Tessera's devcluster stack (plugin server, ``tessera-scheduler``, kwok node agent;
    the admission webhook only with ``webhook``: the benchmark's pods are already written
    for ``hami-scheduler``, and the stock baseline has no webhook in the create path)."""

    def __init__(
        self,
        *,
        device_config: Path | None = None,
        webhook: bool = False,
        node_policy: Policy | None = None,
    ) -> None:
        self._device_config = device_config
        self._webhook = webhook
        self._node_policy = node_policy
        self._metrics_url: str | None = None
        self._scheduler_metrics_url: str | None = None

    @property
    def kind(self) -> SchedulerKind:
        return SchedulerKind.TESSERA

    @property
    def metrics_url(self) -> str | None:
        return self._metrics_url

    @property
    def scheduler_metrics_url(self) -> str | None:
        return self._scheduler_metrics_url

    def start(self, settings: ClusterSettings) -> None:
        start_stack(
            settings, device_config=self._device_config, timeout_s=120.0, webhook=self._webhook
        )
        self._metrics_url = f"http://{metrics_address(settings)}/metrics"
        self._scheduler_metrics_url = scheduler_metrics_url(settings)

    def stop(self, settings: ClusterSettings) -> None:
        stop_stack(settings)

    def pause(self, settings: ClusterSettings) -> None:
        processes.stop(settings.pid_file(SCHEDULER))

    def resume(self, settings: ClusterSettings) -> None:
        restart_component(settings, SCHEDULER, device_config=self._device_config, timeout_s=120.0)

    def pids(self, settings: ClusterSettings) -> dict[str, int]:
        return _pids(settings, (*STACK, WEBHOOK))

    def log_path(self, settings: ClusterSettings) -> Path:
        return settings.log_file(SCHEDULER)

    def manifest(self, pod: BenchPod, *, namespace: str, labels: Mapping[str, str]) -> Obj:
        return tessera_manifest(
            pod, namespace=namespace, labels=labels, node_policy=self._node_policy
        )

    @staticmethod
    def agent_state(settings: ClusterSettings) -> Path:
        return StackPaths.of(settings).agent_state


class StockScheduler:
    """The stock kube-scheduler (default profile) with Tessera's client qps/burst."""

    def __init__(self) -> None:
        self._scheduler_metrics_url: str | None = None

    @property
    def kind(self) -> SchedulerKind:
        return SchedulerKind.STOCK

    @property
    def metrics_url(self) -> str | None:
        return None

    @property
    def scheduler_metrics_url(self) -> str | None:
        return self._scheduler_metrics_url

    def start(self, settings: ClusterSettings, *, timeout_s: float = 120.0) -> None:
        binary = settings.binary(STOCK)
        if not binary.is_file():
            raise ClusterError(
                f"{binary} is missing: build it with `bash hack/build-tools.sh {STOCK}`"
            )
        config = settings.state_dir / "stock-scheduler-config.yaml"
        config.write_text(yaml.safe_dump(stock_config(settings.kubeconfig), sort_keys=False))
        address = record_loopback_address(settings.state_dir / "stock-scheduler-address")
        self._scheduler_metrics_url = f"https://{address}/metrics"
        serving = scheduler_serving_args(address, settings.state_dir / "stock-scheduler-certs")
        record = processes.spawn(
            STOCK,
            [str(binary), "--config", str(config), *serving, "-v", "2"],
            log_path=settings.log_file(STOCK),
            pid_path=settings.pid_file(STOCK),
        )
        processes.wait_ready(
            record,
            lambda: _log_has(settings.log_file(STOCK), "Starting Kubernetes Scheduler"),
            log_path=settings.log_file(STOCK),
            timeout_s=timeout_s,
        )

    def stop(self, settings: ClusterSettings) -> None:
        processes.stop(settings.pid_file(STOCK))

    def pause(self, settings: ClusterSettings) -> None:
        self.stop(settings)

    def resume(self, settings: ClusterSettings) -> None:
        self.start(settings)

    def pids(self, settings: ClusterSettings) -> dict[str, int]:
        return _pids(settings, (STOCK,))

    def log_path(self, settings: ClusterSettings) -> Path:
        return settings.log_file(STOCK)

    def manifest(self, pod: BenchPod, *, namespace: str, labels: Mapping[str, str]) -> Obj:
        return stock_manifest(pod, namespace=namespace, labels=labels)


def stock_config(kubeconfig: Path) -> Obj:
    """KubeSchedulerConfiguration of the baseline: the default profile, leader election off,
    and the client qps/burst Tessera's own config uses (so both talk to the API alike)."""
    tessera: Obj = yaml.safe_load((repo_root() / "examples" / "scheduler-config.yaml").read_text())
    client = tessera.get("clientConnection") or {}
    return {
        "apiVersion": tessera.get("apiVersion", "kubescheduler.config.k8s.io/v1"),
        "kind": "KubeSchedulerConfiguration",
        "clientConnection": {
            "kubeconfig": str(kubeconfig),
            "qps": client.get("qps", 500),
            "burst": client.get("burst", 1000),
        },
        "leaderElection": {"leaderElect": False},
        "profiles": [{"schedulerName": STOCK_SCHEDULER_NAME}],
    }


def scheduler_for(
    kind: SchedulerKind, *, webhook: bool = False, node_policy: Policy | None = None
) -> Scheduler:
    if kind is SchedulerKind.TESSERA:
        return TesseraScheduler(webhook=webhook, node_policy=node_policy)
    return StockScheduler()


def _pids(settings: ClusterSettings, components: tuple[str, ...]) -> dict[str, int]:
    out: dict[str, int] = {}
    for component in components:
        record = processes.read_record(settings.pid_file(component))
        if record is not None and processes.is_running(record):
            out[component] = record.pid
    return out


def _log_has(path: Path, marker: str) -> str | None:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "no log yet"
    return None if marker in text else "not started yet"
