"""What the end-to-end tests share: a running Tessera dev cluster, pod manifests, waits.

``tessera_cluster`` brings up etcd + kube-apiserver + kwok on free ports, adds the fake GPU
nodes of a profile, starts Tessera's stack (plugin server, ``tessera-scheduler``, kwok node
agent) and tears it all down again, checking that no process of the cluster is left.
``PodWatcher`` follows a set of pods with one list+watch and records when each was first
seen bound and first seen with ``bind-phase: success`` (the burst's throughput comes from it).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import structlog

from api.hami import keys as ann
from api.hami.register import GpuDevice, decode
from api.kube.errors import GoneError, KubeError
from scheduler_plugins.devtools.cluster import processes
from scheduler_plugins.devtools.cluster.cluster import COMPONENTS, Cluster
from scheduler_plugins.devtools.cluster.kubeapi import KubeApi
from scheduler_plugins.devtools.cluster.layout import ClusterSettings
from scheduler_plugins.devtools.cluster.nodes import add_nodes, load_profile, wait_ready
from scheduler_plugins.devtools.cluster.stack import SCHEDULER_NAME, STACK, start_stack
from scheduler_plugins.devtools.cluster.testing import settings_in
from scheduler_plugins.server.events import REASON as TESSERA_UNSCHEDULABLE

log = structlog.get_logger(__name__)

NAMESPACE: Final = "default"
GPU: Final = "nvidia.com/gpu"
GPUMEM: Final = "nvidia.com/gpumem"
GPUCORES: Final = "nvidia.com/gpucores"
HERE: Final = Path(__file__).parent
PODS_PATH: Final = f"/api/v1/namespaces/{NAMESPACE}/pods"
EVENTS_PATH: Final = f"/api/v1/namespaces/{NAMESPACE}/events"

Obj = dict[str, Any]


# Pods ----------------------------------------------------------------------------------------


def pod_manifest(
    name: str,
    limits: Mapping[str, object] | None = None,
    *,
    annotations: Mapping[str, str] | None = None,
    labels: Mapping[str, str] | None = None,
    nodes: Sequence[str] | None = None,
    requests: Mapping[str, object] | None = None,
) -> Obj:
    """A one-container pod for ``hami-scheduler``; ``nodes`` restricts it to those nodes."""
    resources: Obj = {"limits": dict(limits or {})}
    if requests:
        resources["requests"] = dict(requests)
    spec: Obj = {
        "schedulerName": SCHEDULER_NAME,
        "containers": [{"name": "main", "image": "busybox", "resources": resources}],
    }
    if nodes is not None:
        spec["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    # Terms are ORed; a metadata.name field selector takes one value each.
                    "nodeSelectorTerms": [
                        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [n]}]}
                        for n in nodes
                    ]
                }
            }
        }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "labels": dict(labels or {}),
            "annotations": dict(annotations or {}),
        },
        "spec": spec,
    }


def wants_gpu(pod: Mapping[str, Any]) -> bool:
    return any(
        k.startswith("nvidia.com/")
        for c in pod["spec"]["containers"]
        for section in ("limits", "requests")
        for k in ((c.get("resources") or {}).get(section) or {})
    )


def annots(pod: Mapping[str, Any]) -> dict[str, str]:
    return dict(pod["metadata"].get("annotations") or {})


def node_of(pod: Mapping[str, Any]) -> str:
    return str(pod["spec"].get("nodeName") or "")


def bind_done(pod: Mapping[str, Any]) -> bool:
    """Bound, and for a GPU pod the node agent has finished (success or failed)."""
    if not node_of(pod):
        return False
    return not wants_gpu(pod) or annots(pod).get(ann.BIND_PHASE) in ("success", "failed")


def scheduled_condition(pod: Mapping[str, Any]) -> Obj | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "PodScheduled":
            return dict(c)
    return None


def wait_for(
    what: str, check: Callable[[], bool], timeout_s: float, interval_s: float = 0.2
) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)


# The cluster ---------------------------------------------------------------------------------


@dataclass
class E2ECluster:
    settings: ClusterSettings
    api: KubeApi
    registers: dict[str, tuple[GpuDevice, ...]]  # node -> its registered GPUs, by index

    def nodes_in_mode(self, mode: str) -> list[str]:
        return sorted(n for n, devs in self.registers.items() if devs and devs[0].mode == mode)

    def create(self, pod: Obj) -> Obj:
        created: Obj = self.api.post(PODS_PATH, pod)
        return created

    def create_many(self, pods: Sequence[Obj], workers: int = 8) -> None:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(self.create, pods))

    def pod(self, name: str) -> Obj:
        pod: Obj = self.api.get(f"{PODS_PATH}/{name}")
        return pod

    def pods(self, label_selector: str | None = None) -> list[Obj]:
        return list(self.api.list(PODS_PATH, label_selector=label_selector).get("items") or [])

    def all_pods(self) -> list[Obj]:
        return list(self.api.list("/api/v1/pods").get("items") or [])

    def all_nodes(self) -> list[Obj]:
        return list(self.api.list("/api/v1/nodes").get("items") or [])

    def tessera_events(self) -> dict[str, list[str]]:
        """Pod name -> messages of its ``TesseraUnschedulable`` events (oldest first)."""
        items = self.api.list(EVENTS_PATH, field_selector=f"reason={TESSERA_UNSCHEDULABLE}")
        out: dict[str, list[str]] = {}
        for e in sorted(items.get("items") or [], key=lambda e: str(e.get("lastTimestamp") or "")):
            name = str((e.get("involvedObject") or {}).get("name", ""))
            out.setdefault(name, []).append(str(e.get("message", "")))
        return out

    def wait_bound(self, name: str, timeout_s: float = 60.0) -> Obj:
        """Wait until the pod is bound and (GPU pods) the node agent has answered."""
        wait_for(f"pod {name} bound", lambda: bind_done(self.pod(name)), timeout_s)
        return self.pod(name)

    def wait_event(self, name: str, timeout_s: float = 60.0) -> list[str]:
        wait_for(
            f"a {TESSERA_UNSCHEDULABLE} event for {name}",
            lambda: name in self.tessera_events(),
            timeout_s,
            interval_s=0.5,
        )
        return self.tessera_events()[name]

    def delete_pods(self, label_selector: str, timeout_s: float = 60.0) -> None:
        """Delete pods at once (kwok has no kubelet to wait for) and wait until they are gone."""
        self.api.request(
            "DELETE",
            PODS_PATH,
            {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0},
            query={"labelSelector": label_selector},
        )
        wait_for(
            f"pods {label_selector} deleted",
            lambda: not self.pods(label_selector),
            timeout_s,
            interval_s=0.5,
        )


def _registers(api: KubeApi, names: Iterable[str]) -> dict[str, tuple[GpuDevice, ...]]:
    out: dict[str, tuple[GpuDevice, ...]] = {}
    for name in names:
        node = api.get(f"/api/v1/nodes/{name}")
        raw = node["metadata"]["annotations"][ann.NODE_REGISTER]
        out[name] = tuple(sorted(decode(raw, obj=name), key=lambda d: d.index))
    return out


def _live_processes(settings: ClusterSettings) -> list[processes.ProcessRecord]:
    records = [processes.read_record(settings.pid_file(c)) for c in (*COMPONENTS, *STACK)]
    return [r for r in records if r is not None and processes.is_running(r)]


def _mentioning(marker: str) -> list[int]:
    """Live (non-zombie) processes whose command line mentions ``marker``."""
    found: list[int] = []
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if marker in cmdline and stat[stat.rindex(")") + 2 :].split()[0] not in ("Z", "X"):
            found.append(int(entry.name))
    return found


@contextlib.contextmanager
def tessera_cluster(
    state_dir: Path,
    name: str,
    profile: Path,
    node_count: int,
    *,
    timeout_s: float = 120.0,
    tessera_args: Mapping[str, object] | None = None,
    prepare: Callable[[KubeApi, list[str]], None] | None = None,
    webhook_args: Sequence[str] = (),
) -> Iterator[E2ECluster]:
    """A dev cluster with the profile's fake GPU nodes and Tessera's stack; torn down (purged)
    on exit, failing if any of its processes outlives ``down``. ``tessera_args`` override the
    example profile's Tessera plugin args; ``prepare(api, node names)`` runs once the nodes
    are ready and before Tessera starts (what another scheduler left in the cluster);
    ``webhook_args``: more flags of the webhook."""
    settings = settings_in(state_dir, name)
    cluster = Cluster(settings)
    t0 = time.monotonic()
    try:
        info = cluster.up(timeout_s=timeout_s)
        with info.api() as api:
            names = add_nodes(api, load_profile(profile), node_count)
            wait_ready(api, names, timeout_s=timeout_s)
            if prepare is not None:
                prepare(api, names)
            start_stack(
                settings, timeout_s=60.0, tessera_args=tessera_args, webhook_args=webhook_args
            )
            log.info("e2e.cluster_ready", cluster=name, seconds=round(time.monotonic() - t0, 1))
            yield E2ECluster(settings, api, _registers(api, names))
    finally:
        before = _live_processes(settings)
        cluster.down(purge=True)
        left = [r for r in before if processes.is_running(r)]
        strays = _mentioning(str(settings.state_dir) + os.sep)
        assert not left and not strays, (
            f"processes of cluster {name} left running after down: "
            f"{[(r.component, r.pid) for r in left]}, strays {strays}"
        )


# Watching a burst ----------------------------------------------------------------------------


@dataclass
class PodWatcher:
    """Keeps the latest object of every pod matching ``label_selector`` (list + watch on a
    thread) and when each was first seen bound / with ``bind-phase: success``."""

    api: KubeApi
    label_selector: str
    pods: dict[str, Obj] = field(default_factory=dict)
    bound_at: dict[str, float] = field(default_factory=dict)
    success_at: dict[str, float] = field(default_factory=dict)
    # Pods seen carrying a device allocation while unbound, or bound (GPU pods) without one.
    annotated_unbound: set[str] = field(default_factory=set)
    bound_bare: set[str] = field(default_factory=set)
    error: BaseException | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _watch: Any = None

    def start(self) -> PodWatcher:
        self._thread = threading.Thread(target=self._run, name="e2e-pod-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            watch = self._watch
        if watch is not None:
            watch.close()
        if self._thread is not None:
            self._thread.join(10.0)
            assert not self._thread.is_alive(), "pod watcher did not stop"

    def snapshot(self) -> dict[str, Obj]:
        if self.error is not None:
            raise RuntimeError(f"pod watcher failed: {self.error!r}") from self.error
        with self._lock:
            return dict(self.pods)

    def _see(self, event_type: str, pod: Obj) -> None:
        name = str(pod["metadata"]["name"])
        now = time.monotonic()
        with self._lock:
            if event_type == "DELETED":
                self.pods.pop(name, None)
                return
            self.pods[name] = pod
            allocated = ann.DEVICES_ALLOCATED in annots(pod)
            if not node_of(pod) and allocated:
                self.annotated_unbound.add(name)
            if node_of(pod) and wants_gpu(pod) and not allocated:
                self.bound_bare.add(name)
            if node_of(pod):
                self.bound_at.setdefault(name, now)
                if annots(pod).get(ann.BIND_PHASE) == "success":
                    self.success_at.setdefault(name, now)

    def _run(self) -> None:
        rv: str | None = None
        try:
            while not self._stop.is_set():
                try:
                    if rv is None:
                        listed = self.api.list(PODS_PATH, label_selector=self.label_selector)
                        rv = str(listed["metadata"]["resourceVersion"])
                        for pod in listed.get("items") or []:
                            self._see("ADDED", pod)
                    watch = self.api.watch(
                        PODS_PATH, rv, label_selector=self.label_selector, timeout_s=30
                    )
                    with self._lock:
                        self._watch = watch
                    if self._stop.is_set():
                        watch.close()
                    for event in watch:
                        obj = event.get("object") or {}
                        rv = str((obj.get("metadata") or {}).get("resourceVersion") or rv)
                        if event["type"] != "BOOKMARK":
                            self._see(str(event["type"]), obj)
                except GoneError:
                    rv = None
                except KubeError:
                    if self._stop.is_set():
                        return
                    self._stop.wait(0.5)
        except BaseException as e:  # surfaced by snapshot()
            self.error = e

    def __enter__(self) -> PodWatcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
