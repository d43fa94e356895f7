"""The node agent of one real node: NVML session, registration, device plugin, MIG lifecycle.

``NodeAgent.run(stop)`` is one start cycle of the agent, until ``stop`` is set:

1. ``backend.init()``: the one NVML session of this cycle.
2. In ``mig`` operating mode, restart adoption (``MigManager.adopt_on_start``) with the
   desired set read from the API (pods with ``spec.nodeName`` = this node). When the API
   cannot be read the desired set is None and adoption touches nothing.
3. Threads: registration (``Registrar.sync`` at once, every ``register_interval_s`` and
   whenever discovery sees a change), health (rediscovery every ``health_interval_s`` into
   the ``SlotInventory``, whose changes ListAndWatch pushes to the kubelet) and, in ``mig``
   mode, reconcile (every ``reconcile_interval_s`` against the desired set from the API;
   an unreadable set skips every destructive step), and with a PodResources API
   (hami-core and MPS) identities: Allocate's interchangeable hand-outs checked against the
   kubelet's record of which container holds which ids (``node_agent.identities``).
   With an MPS backend, the daemons are checked once before the first registration
   (``MpsDaemons.sync``: in ``mps`` mode started or adopted, in other modes any left
   running stopped) and, in ``mps`` mode, every ``mps_check_interval_s`` (restarted when
   down); a health change updates the ``SlotInventory`` and wakes registration at once.
4. The ``DevicePluginServer`` with the ``Allocator`` as Allocate handler and
   ``Allocator.preferred`` as GetPreferredAllocation policy, started again every
   ``plugin_retry_s`` until the kubelet answers Register; afterwards the server itself
   re-registers when the kubelet restarts.

Stopping: the device plugin stops first (its socket is removed and in-flight Allocate
calls finish), then the loops are told to end and joined, then ``backend.shutdown()``,
which waits for any hardware operation already accepted (the backends' ``SessionGate``).
MPS daemons are left running: their clients keep working, and the next agent adopts them.
A failure during start-up (NVML cannot be initialized, discovery fails) goes through the
same teardown and is raised.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final, Protocol

import structlog

from api.errors import TemporaryError, TesseraError
from api.hami.config import DeviceConfig
from api.hami.keys import GpuMode
from node_agent.allocator import Allocator, HostDirs
from node_agent.deviceplugin.ids import SlotInventory
from node_agent.deviceplugin.server import DEFAULT_PLUGIN_DIR, DevicePluginServer
from node_agent.identities import IdentityFixer, PodResourcesLister
from node_agent.mig_manager import MigManager
from node_agent.mig_records import DesiredRead, desired_from_pods
from node_agent.mps.backend import MpsBackend
from node_agent.mps.manager import MpsDaemons
from node_agent.nvml.backend import NvmlBackend
from node_agent.nvml.discovery import unregistered
from node_agent.registration import Registrar

log = structlog.get_logger(__name__)

DEFAULT_SOCKET: Final = "tessera-gpu.sock"
IDENTITY_BACKOFF_MAX_S: Final = 30.0


class AgentApi(Protocol):
    """The Kubernetes calls the agent makes (``api.kube.KubeClient``)."""

    def get(self, path: str) -> Any: ...

    def list(self, path: str, *, field_selector: str | None = None) -> dict[str, Any]: ...

    def merge_patch(
        self, path: str, patch: Mapping[str, Any], *, resource_version: str | None = None
    ) -> Any: ...


class NodeAgent:
    """One node's agent; ``run`` may be called again after it returned (a new cycle)."""

    def __init__(
        self,
        node_name: str,
        kube: AgentApi,
        backend: NvmlBackend,
        config: DeviceConfig,
        *,
        plugin_dir: str | Path = DEFAULT_PLUGIN_DIR,
        resource_name: str | None = None,
        socket_name: str = DEFAULT_SOCKET,
        reconcile_interval_s: float = 5.0,
        register_interval_s: float = 30.0,
        health_interval_s: float = 5.0,
        plugin_retry_s: float = 2.0,
        plugin_watch_interval_s: float = 1.0,
        mps_backend: MpsBackend | None = None,
        mps_check_interval_s: float = 5.0,
        pod_resources: PodResourcesLister | None = None,
        identity_check_s: float = 0.5,
        host_dirs: HostDirs | None = None,
    ) -> None:
        self.node_name = node_name
        self._kube = kube
        self._backend = backend
        self._config = config
        self._host_dirs = host_dirs
        self.plugin_dir = Path(plugin_dir)
        self.resource_name = resource_name or config.resource_count_name
        self.socket_name = socket_name
        self._reconcile_s = reconcile_interval_s
        self._register_s = register_interval_s
        self._health_s = health_interval_s
        self._retry_s = plugin_retry_s
        self._watch_s = plugin_watch_interval_s
        self._mps_backend = mps_backend
        self._mps_s = mps_check_interval_s
        self._pod_resources = pod_resources
        self._identity_s = identity_check_s
        self.identities: IdentityFixer | None = None
        self.mode: GpuMode = config.node(node_name).operating_mode
        self.ready = threading.Event()  # set while the device plugin is registered and serving
        self.mig_manager: MigManager | None = None
        self.mps: MpsDaemons | None = None

    @property
    def socket_path(self) -> Path:
        return self.plugin_dir / self.socket_name

    # The start cycle ----------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Run until ``stop`` is set, then tear down cleanly (see the module docstring)."""
        self.ready.clear()
        halt = threading.Event()  # ends the loops; set on stop and on a failed start
        wake_register = threading.Event()
        threads: list[threading.Thread] = []
        server: DevicePluginServer | None = None
        self._backend.init()
        try:
            mig = (
                MigManager(self._backend, node_name=self.node_name) if self.mode == "mig" else None
            )
            self.mig_manager = mig
            if mig is not None:
                read = self._desired()
                # GPUs the config leaves out (filterdevices) are not this agent's to clean.
                left_out = unregistered(self._backend, self._config.node(self.node_name).registers)
                mig.adopt_on_start(read.desired, left_out, reason=read.reason)
            mps = (
                MpsDaemons(self._mps_backend, node_name=self.node_name)
                if self._mps_backend is not None
                else None
            )
            self.mps = mps
            registrar = Registrar(self.node_name, self._kube, self._backend, self._config, mps=mps)
            if mps is not None:
                self._check_mps(mps, registrar)
            inventory = SlotInventory(registrar.devices())
            identities = (
                IdentityFixer(self.node_name, self._kube, self._pod_resources, self.resource_name)
                if self._pod_resources is not None
                else None
            )
            self.identities = identities
            if mig is not None and identities is not None:
                mig.protect(identities.protected)
            allocator = Allocator(
                self.node_name,
                self._kube,
                self._backend,
                mig,
                self._config,
                operating_mode=self.mode,
                mps=mps,
                identities=identities,
                host_dirs=self._host_dirs,
            )
            loops: list[tuple[str, Callable[[], None]]] = [
                ("register", lambda: self._register_loop(registrar, halt, wake_register)),
                ("health", lambda: self._health_loop(registrar, inventory, halt, wake_register)),
            ]
            if mig is not None:
                loops.append(("reconcile", lambda: self._reconcile_loop(mig, halt)))
            if identities is not None:
                loops.append(("identities", lambda: self._identity_loop(identities, halt)))
            if mps is not None and self.mode == "mps":
                loops.append(
                    ("mps", lambda: self._mps_loop(mps, registrar, inventory, halt, wake_register))
                )
            for name, target in loops:
                t = threading.Thread(target=target, name=f"node-agent-{name}", daemon=True)
                t.start()
                threads.append(t)
            server = DevicePluginServer(
                self.resource_name,
                self.plugin_dir,
                self.socket_name,
                inventory,
                allocator,
                preferred=allocator.preferred,
                watch_interval_s=self._watch_s,
            )
            if self._start_plugin(server, stop):
                self.ready.set()
                log.info(
                    "node_agent.running",
                    node=self.node_name,
                    mode=self.mode,
                    resource=self.resource_name,
                    devices=len(inventory.devices()),
                )
            while not stop.wait(0.5):
                pass
        finally:
            self.ready.clear()
            if server is not None:
                server.stop()
            halt.set()
            wake_register.set()
            if self.identities is not None:
                self.identities.wake.set()
            for t in threads:
                t.join()
            self._backend.shutdown()
            log.info("node_agent.stopped", node=self.node_name)

    def _start_plugin(self, server: DevicePluginServer, stop: threading.Event) -> bool:
        """Start serving and register; retry while the kubelet is unreachable."""
        while not stop.is_set():
            try:
                server.start()
                return True
            except TemporaryError as e:
                log.warning("node_agent.plugin_start_failed", node=self.node_name, error=str(e))
                stop.wait(self._retry_s)
        return False

    # Loops --------------------------------------------------------------------------------

    def _register_loop(
        self, registrar: Registrar, halt: threading.Event, wake: threading.Event
    ) -> None:
        while not halt.is_set():
            wake.clear()
            try:
                registrar.sync()
            except TesseraError as e:
                log.warning("node_agent.register_failed", node=self.node_name, error=str(e))
            except Exception:
                log.exception("node_agent.register_crashed", node=self.node_name)
            wake.wait(self._register_s)

    def _health_loop(
        self,
        registrar: Registrar,
        inventory: SlotInventory,
        halt: threading.Event,
        wake_register: threading.Event,
    ) -> None:
        while not halt.wait(self._health_s):
            try:
                if inventory.update(registrar.devices()):
                    log.info("node_agent.devices_changed", node=self.node_name)
                    wake_register.set()
            except TesseraError as e:
                log.warning("node_agent.discovery_failed", node=self.node_name, error=str(e))
            except Exception:
                log.exception("node_agent.discovery_crashed", node=self.node_name)

    def _mps_loop(
        self,
        mps: MpsDaemons,
        registrar: Registrar,
        inventory: SlotInventory,
        halt: threading.Event,
        wake_register: threading.Event,
    ) -> None:
        while not halt.wait(self._mps_s):
            try:
                if self._check_mps(mps, registrar):
                    inventory.update(registrar.devices())
                    wake_register.set()
            except TesseraError as e:
                log.warning("node_agent.discovery_failed", node=self.node_name, error=str(e))
            except Exception:
                log.exception("node_agent.mps_check_crashed", node=self.node_name)

    def _check_mps(self, mps: MpsDaemons, registrar: Registrar) -> bool:
        """One daemon check; True when a GPU's health changed. A daemon listing that fails
        is logged and changes nothing (the next check tries again)."""
        gpus = registrar.mps_gpus()
        try:
            changed = mps.sync(gpus)
        except TesseraError as e:
            log.warning("node_agent.mps_check_failed", node=self.node_name, error=str(e))
            return False
        if changed:
            log.info("node_agent.mps_health", node=self.node_name, health=dict(mps.health()))
        return changed

    def _reconcile_loop(self, mig: MigManager, halt: threading.Event) -> None:
        while not halt.wait(self._reconcile_s):
            try:
                as_of = mig.changes  # before the pods: instances recorded since are kept
                read = self._desired()
                report = mig.reconcile(read.desired, reason=read.reason, as_of=as_of)
                if report.destroyed or report.adopted:
                    log.info(
                        "node_agent.reconciled",
                        node=self.node_name,
                        destroyed=[str(k) for k in report.destroyed],
                        adopted=[str(k) for k in report.adopted],
                    )
            except Exception:
                log.exception("node_agent.reconcile_crashed", node=self.node_name)

    def _identity_loop(self, fixer: IdentityFixer, halt: threading.Event) -> None:
        """Check interchangeable hand-outs against PodResources while any is pending (every
        ``identity_check_s``); sleep until the next one otherwise. A failing check (the
        kubelet's socket missing, the API down) is retried with a doubling pause up to
        ``IDENTITY_BACKOFF_MAX_S``, logged once per streak and when it recovers."""
        adopted = False
        delay = self._identity_s
        failing: str | None = None
        while not halt.is_set():
            error: str | None = None
            try:
                if not adopted:
                    answer = self._kube.list(
                        "/api/v1/pods", field_selector=f"spec.nodeName={self.node_name}"
                    )
                    fixer.adopt(answer.get("items") or [])
                    adopted = True
                idle = fixer.check()
            except TesseraError as e:
                error, idle = str(e), False
            except Exception as e:
                log.exception("node_agent.identity_check_crashed", node=self.node_name)
                error, idle = repr(e), False
            if error is not None and failing is None:
                log.warning("node_agent.identity_check_failed", node=self.node_name, error=error)
            elif error is None and failing is not None:
                log.info("node_agent.identity_check_recovered", node=self.node_name)
            failing = error
            delay = min(2 * delay, IDENTITY_BACKOFF_MAX_S) if error else self._identity_s
            if idle:
                fixer.wake.wait()  # set by a hand-out, and at stop
                fixer.wake.clear()
            else:
                halt.wait(delay)

    def _desired(self) -> DesiredRead:
        """The MIG desired set of the pods on this node; unreadable on any API failure."""
        try:
            answer = self._kube.list(
                "/api/v1/pods", field_selector=f"spec.nodeName={self.node_name}"
            )
        except TesseraError as e:
            return DesiredRead.unreadable(f"cannot list the pods of node {self.node_name}: {e}")
        items = answer.get("items")
        if not isinstance(items, list):
            return DesiredRead.unreadable("the pod list has no items")
        return desired_from_pods(items, node_name=self.node_name)
