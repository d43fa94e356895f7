"""Simulated node agents for kwok's fake nodes, all in one process.

kwok runs no kubelet, so nothing calls Allocate on a fake node. ``KwokAgents`` stands in:
per fake node (``kwok.x-k8s.io/node: fake``) a ``SimulatedNvml`` with the GPUs the node's
``hami.io/node-nvidia-register`` names (model from ``type``, same UUIDs, MIG on in mig
mode), a ``MigManager`` and an ``Allocator``. It watches pods; for a pod bound to a fake
node with ``bind-phase: allocating`` it runs the allocator's flow for each container in
order (the device ids the kubelet would send are derived from the to-allocate entry),
writing the same annotations a real node would. When pods end (deleted, Succeeded,
Failed) and after every watch round it reconciles, so MIG instances of ended pods are
destroyed. With ``state_dir`` each node's simulated NVML state survives restarts and is
adopted on start.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import structlog

from node_agent.allocator import Allocator
from node_agent.gpu_catalog import find_model
from node_agent.mig_manager import MigManager
from node_agent.mig_records import desired_from_pods
from node_agent.nvml.simulated import SimulatedGpuSpec, SimulatedNvml
from node_agent.pod_matching import annotations_of
from scheduler_plugins.annotations import BIND_PHASE, NODE_REGISTER
from scheduler_plugins.config import DeviceConfig
from scheduler_plugins.errors import TesseraError
from scheduler_plugins.kube.client import KubeClient
from scheduler_plugins.kube.errors import NotFoundError
from scheduler_plugins.kube.reflector import Reflector
from scheduler_plugins.node_register import decode

log = structlog.get_logger(__name__)

KWOK_NODE_ANNOTATION: Final = "kwok.x-k8s.io/node"
MAX_CONTAINERS: Final = 256


@dataclass
class FakeNode:
    name: str
    backend: SimulatedNvml
    mig: MigManager
    allocator: Allocator


class KwokAgents:
    """One simulated agent per fake node, created when a pod first lands on it."""

    def __init__(
        self,
        kube: KubeClient,
        config: DeviceConfig,
        *,
        state_dir: Path | None = None,
        watch_timeout_s: int = 10,
    ) -> None:
        self._kube = kube
        self._config = config
        self._state_dir = state_dir
        self._watch_timeout_s = watch_timeout_s
        self._nodes: dict[str, FakeNode | None] = {}
        self._lock = threading.Lock()
        self._reflector: Reflector | None = None

    # Per node -----------------------------------------------------------------------------

    def node(self, name: str) -> FakeNode | None:
        """The agent of fake node ``name`` (built on first use); None for other nodes."""
        with self._lock:
            if name in self._nodes:
                return self._nodes[name]
        agent = self._build(name)
        with self._lock:
            self._nodes.setdefault(name, agent)
            return self._nodes[name]

    def _build(self, name: str) -> FakeNode | None:
        try:
            node = self._kube.get(f"/api/v1/nodes/{name}")
        except NotFoundError:
            return None
        ann: Mapping[str, str] = (node.get("metadata") or {}).get("annotations") or {}
        if ann.get(KWOK_NODE_ANNOTATION) != "fake" or NODE_REGISTER not in ann:
            return None
        devices = sorted(decode(ann[NODE_REGISTER], obj=f"node {name}"), key=lambda d: d.index)
        specs = [
            SimulatedGpuSpec(
                find_model(d.type).name, uuid=d.id, numa=d.numa, mig_enabled=d.mode == "mig"
            )
            for d in devices
        ]
        state = self._state_dir / f"{name}.json" if self._state_dir else None
        backend = SimulatedNvml(specs, state, node_name=name)
        backend.init()
        mig = MigManager(backend, node_name=name)
        mode = devices[0].mode if devices else None
        allocator = Allocator(name, self._kube, backend, mig, self._config, operating_mode=mode)
        read = desired_from_pods(self._pods_on(name), node_name=name)
        mig.adopt_on_start(read.desired, reason=read.reason)
        log.info("kwok.node_agent_started", node=name, gpus=len(specs))
        return FakeNode(name, backend, mig, allocator)

    def _pods_on(self, node: str) -> list[dict[str, Any]]:
        answer = self._kube.list("/api/v1/pods", field_selector=f"spec.nodeName={node}")
        return list(answer.get("items") or [])

    def allocate(self, node: FakeNode, namespace: str, name: str) -> None:
        """Every remaining container of the pod, in order, as the kubelet would."""
        for _ in range(MAX_CONTAINERS):
            if node.allocator.allocate_next(namespace, name) is None:
                return

    def reconcile(self, node: FakeNode) -> None:
        read = desired_from_pods(self._pods_on(node.name), node_name=node.name)
        node.mig.reconcile(read.desired, reason=read.reason)

    def handle(self, event_type: str, pod: Mapping[str, Any]) -> None:
        """React to one pod event (also used for the listed pods, as ADDED)."""
        meta = pod.get("metadata") or {}
        node_name = (pod.get("spec") or {}).get("nodeName")
        if not node_name:
            return
        node = self.node(node_name)
        if node is None:
            return
        ended = (
            event_type == "DELETED"
            or meta.get("deletionTimestamp")
            or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")
        )
        try:
            if ended:
                self.reconcile(node)
            elif annotations_of(pod).get(BIND_PHASE) == "allocating":
                self.allocate(node, meta.get("namespace") or "default", meta.get("name", ""))
        except TesseraError as e:
            log.warning("kwok.pod_failed", node=node_name, pod=meta.get("name"), error=str(e))

    def pass_all(self) -> None:
        """Reconcile every fake node known so far (the periodic pass)."""
        with self._lock:
            nodes = [n for n in self._nodes.values() if n is not None]
        for node in nodes:
            try:
                self.reconcile(node)
            except TesseraError as e:
                log.warning("kwok.reconcile_failed", node=node.name, error=str(e))

    # Loop ---------------------------------------------------------------------------------

    def _listed(self, pods: list[dict[str, Any]], listed_at: float) -> None:
        for pod in pods:
            self.handle("ADDED", pod)

    def start(self) -> None:
        """List + watch all pods (relists on 410 Gone, backs off on errors); every watch
        stream that ends also runs the periodic reconcile pass."""
        self._reflector = Reflector(
            self._kube,
            "/api/v1/pods",
            on_list=self._listed,
            on_event=self.handle,
            on_watch_end=self.pass_all,
            watch_timeout_s=self._watch_timeout_s,
        )
        self._reflector.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the loop, wait for it, and shut every simulated NVML session down."""
        if self._reflector is not None:
            self._reflector.stop(timeout_s)
            self._reflector = None
        with self._lock:
            nodes = [n for n in self._nodes.values() if n is not None]
        for node in nodes:
            node.backend.shutdown()

    def __enter__(self) -> KwokAgents:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
