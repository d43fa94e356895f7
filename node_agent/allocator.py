"""The node agent's Allocate: which pod, what the container gets, and the annotations after.

``Allocator`` is the device plugin's ``AllocateHandler``, and ``Allocator.preferred`` its
GetPreferredAllocation policy (steering the kubelet's ids to the GPUs of the one pod whose
next container asks that many devices). For each container request it finds the pod
(``node_agent.pod_matching``: by device count, no node lock; among interchangeable pods the
one whose GPUs the ids name, the hand-out then checked against the kubelet's PodResources by
``node_agent.identities``), takes the devices and limits
from *that pod's* ``hami.io/vgpu-devices-to-allocate`` entry (never from another pod), checks
what it did not write (the entry's GPUs are this node's, limits in range, the container's
MIG reservations agree with it), then:

- hami-core: HAMi-core's envs and mounts (``libvgpu.so``, ``ld.so.preload`` unless the
  container sets ``CUDA_DISABLE_CONTROL=true``, a per-container cache dir, ``/tmp/vgpulock``);
- MIG: ``MigManager.ensure`` (reconcile first, exact placement, idempotent, rollback of this
  attempt) and ``NVIDIA_VISIBLE_DEVICES=MIG-…``;
- MPS: each GPU's control daemon must be up (``MpsDaemons.require_up``; a temporary refusal
  otherwise), then its pipe directory is mounted at ``/tmp/nvidia-mps/<i>`` and the MPS
  client limits are set (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``,
  ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``); no HAMi-core library: MPS enforces the limits.

Then one merge patch with a resourceVersion precondition empties the container's
to-allocate entry (plus, for MIG, writes the runtime identities into
``hami.io/vgpu-mig-allocations``) and sets ``bind-phase: success`` once every entry is empty;
a 409 re-reads the pod and retries. A permanent failure after the pod is known sets
``bind-phase: failed``; a temporary one (API unreachable) leaves the pod allocating so a
retried Allocate completes it, returning the same MIG instance.
"""

from __future__ import annotations

import math
import re
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Final, NamedTuple, Protocol

import structlog

from api.errors import InvalidInputError, TemporaryError, TesseraError, short_repr
from api.hami.config import DeviceConfig
from api.hami.devices import (
    ContainerDevices,
    MigAllocation,
    RuntimeIdentity,
    encode_devices,
)
from api.hami.keys import (
    BIND_PHASE,
    DEVICES_TO_ALLOCATE,
    MIG_ALLOCATIONS,
    VGPU_NODE_LABEL,
    GpuMode,
    parse_go_bool,
    vgpu_node_labels,
)
from api.hami.matching import next_container, to_allocate
from api.kube.errors import ConflictError, NotFoundError
from api.kube.objects import annotations_of, as_object, parse_quantity, pod_key
from node_agent.deviceplugin.ids import device_id, prefer_gpus, prefer_spread
from node_agent.deviceplugin.types import ContainerAllocation, Mount
from node_agent.identities import IdentityFixer
from node_agent.mig_manager import MigManager
from node_agent.mig_records import container_reservations, desired_from_pods, with_runtime
from node_agent.mps.backend import CONTAINER_PIPE_ROOT
from node_agent.mps.manager import MpsDaemons
from node_agent.nvml.backend import NvmlBackend
from node_agent.pod_matching import match_pod, preferred_gpus, requested_gpus

log = structlog.get_logger(__name__)

HOOK_DIR: Final = "/usr/local/vgpu"
HOST_HOOK_DIR: Final = "/usr/local"  # HAMi's hostHookPath: libvgpu.so under <it>/vgpu/
LIBVGPU: Final = f"{HOOK_DIR}/libvgpu.so"
LD_PRELOAD: Final = "/etc/ld.so.preload"
VGPU_LOCK: Final = "/tmp/vgpulock"
PATCH_ATTEMPTS: Final = 5


class PodApi(Protocol):
    """The Kubernetes calls the allocator makes (``api.kube.KubeClient``)."""

    def get(self, path: str) -> Any: ...

    def list(self, path: str, *, field_selector: str | None = None) -> dict[str, Any]: ...

    def merge_patch(
        self, path: str, patch: Mapping[str, Any], *, resource_version: str | None = None
    ) -> Any: ...


class _Given(NamedTuple):
    """What one container was given: the kubelet's answer, and the MIG instances realized
    for it (their reservations with the runtime identities; none for shared devices)."""

    allocation: ContainerAllocation
    mig: tuple[MigAllocation, ...] = ()


class HostDirs:
    """The host directories a hami-core container mounts writable, created before Allocate
    answers, as HAMi's device plugin does: the container's own cache directory and
    ``/tmp/vgpulock``, world-writable (0777 whatever the umask) so that HAMi-core in a
    container of any user can write its shared cache and locks (a bind mount's missing host
    directory would be created root-owned). The paths are the host's, which the agent sees
    at the same paths (the chart mounts them there)."""

    def __init__(self, lock_dir: str = VGPU_LOCK) -> None:
        self.lock_dir = lock_dir

    def prepare(self, container_dir: str) -> None:
        for path in (Path(container_dir), Path(self.lock_dir)):
            path.mkdir(parents=True, exist_ok=True)
            path.chmod(0o777)


class _Listed(NamedTuple):
    """The node's pods as one list read them, and the MIG manager's ``changes`` count read
    just before (None without a MIG manager)."""

    pods: list[dict[str, Any]]
    mig_as_of: int | None


class AllocationRefusedError(InvalidInputError):
    """The matched pod's annotations are not something this node can allocate."""


class PatchGaveUpError(TemporaryError):
    """The pod kept changing under the resourceVersion precondition."""


PatchBuilder = Callable[[Mapping[str, str]], dict[str, str] | None]


class Allocator:
    """Allocate for one node; thread-safe (no state besides the injected objects)."""

    def __init__(
        self,
        node_name: str,
        kube: PodApi,
        backend: NvmlBackend,
        mig_manager: MigManager | None,
        config: DeviceConfig,
        *,
        operating_mode: GpuMode | None = None,
        host_hook_dir: str = HOST_HOOK_DIR,
        cache_name: Callable[[], str] = lambda: str(uuid.uuid4()),
        mps: MpsDaemons | None = None,
        identities: IdentityFixer | None = None,
        host_dirs: HostDirs | None = None,
    ) -> None:
        self.node_name = node_name
        self._identities = identities
        self._host_dirs = host_dirs
        self._kube = kube
        self._backend = backend
        self._mig = mig_manager
        self._mps = mps
        self._config = config
        node = config.node(node_name)
        self._mode: GpuMode = operating_mode or node.operating_mode
        self._scaling = node.device_memory_scaling or config.device_memory_scaling
        self._log_level = node.lib_cuda_log_level or config.lib_cuda_log_level
        self._host_hook = host_hook_dir.rstrip("/")
        self._cache_name = cache_name
        self._memory_of: dict[str, int] | None = None  # GPU UUID -> MiB, read once

    # AllocateHandler ------------------------------------------------------------------------

    def allocate(self, containers: Sequence[Sequence[str]]) -> Sequence[ContainerAllocation]:
        out: list[ContainerAllocation] = []
        for ids in containers:
            listed = self._listed()
            match = match_pod(listed.pods, self.node_name, ids)
            if requested_gpus(ids) != Counter(d.uuid for d in match.devices):
                # The kubelet did not take our preferred ids (or had to choose itself): the
                # pod is still the only one asking this many devices, and what it gets
                # comes from its own entry; only the kubelet's slot bookkeeping differs.
                log.info(
                    "allocate.unsteered_ids",
                    pod=match.key,
                    node=self.node_name,
                    container=match.container_index,
                    ids=list(ids),
                )
            given = self._allocate_guarded(match.pod, match.container_index, listed)
            out.append(given.allocation)
            if self._identities is not None:
                siblings = (match.key, *match.siblings) if match.siblings else ()
                self._identities.handed(
                    ids, [d.uuid for d in match.devices], siblings, mig=given.mig, pod=match.key
                )
        return out

    def preferred(
        self, available: Sequence[str], must_include: Sequence[str], size: int
    ) -> list[str]:
        """GetPreferredAllocation (a ``PreferredPolicy``): the slots of the GPUs reserved by
        the unique allocating pod whose next container asks ``size`` devices, so the ids the
        kubelet then sends to Allocate name that pod's GPUs; spread over GPUs when no single
        pod can be named (or the pods cannot be listed)."""
        prefer_spread(available, must_include, 0)  # validates every id before the API call
        try:
            gpus = preferred_gpus(self._list_pods(), self.node_name, size)
        except TesseraError as e:
            log.warning("preferred_allocation.pods_unreadable", node=self.node_name, error=str(e))
            gpus = None
        if gpus is None:
            return prefer_spread(available, must_include, size)
        return prefer_gpus(available, must_include, size, gpus)

    def pre_start(self, device_ids: Sequence[str]) -> None:
        return None

    # kwok mode: the pod is known, the kubelet's device ids are derived from its entry -------

    def allocate_next(self, namespace: str, name: str) -> ContainerAllocation | None:
        """Allocate the pod's next container (as the kubelet's Allocate would); None when
        the pod has nothing left to allocate or is no longer allocating."""
        listed = self._listed()
        pod = next(
            (p for p in listed.pods if pod_key(p) == f"{namespace}/{name}"),
            None,
        )
        if pod is None or annotations_of(pod).get(BIND_PHASE) != "allocating":
            return None
        nxt = next_container(annotations_of(pod), obj=f"{namespace}/{name}")
        if nxt is None:
            return None
        return self._allocate_guarded(pod, nxt[0], listed).allocation

    @staticmethod
    def device_ids(entry: ContainerDevices) -> list[str]:
        """Kubelet-style ids for an entry: one slot per device, distinct per GPU."""
        seen: Counter[str] = Counter()
        ids: list[str] = []
        for d in entry:
            ids.append(device_id(d.uuid, seen[d.uuid]))
            seen[d.uuid] += 1
        return ids

    # Flow ---------------------------------------------------------------------------------

    def _list_pods(self) -> list[dict[str, Any]]:
        answer = self._kube.list("/api/v1/pods", field_selector=f"spec.nodeName={self.node_name}")
        return list(answer.get("items") or [])

    def _listed(self) -> _Listed:
        """The node's pods, and how often the MIG manager's records had changed before they
        were read (its ``reconcile`` keeps instances recorded since: their pods may be
        missing from the list)."""
        as_of = self._mig.changes if self._mig is not None else None
        return _Listed(self._list_pods(), as_of)

    def _allocate_guarded(self, pod: Mapping[str, Any], ci: int, listed: _Listed) -> _Given:
        key = pod_key(pod)
        try:
            return self._allocate(pod, ci, listed)
        except TemporaryError:
            raise  # the pod stays allocating; a retried Allocate completes it
        except TesseraError as e:
            log.warning("allocate.failed", pod=key, node=self.node_name, container=ci, error=str(e))
            self._mark_failed(pod)
            raise

    def _allocate(self, pod: Mapping[str, Any], ci: int, listed: _Listed) -> _Given:
        key = pod_key(pod)
        ann = annotations_of(pod)
        pending = to_allocate(ann, obj=f"pod {key}")
        entry = pending[ci]
        container = self._container(pod, ci)
        self._check_devices(key, ci, entry)
        reservations = self._reservations(key, ann, ci)
        mode: GpuMode
        if self._mode == "mps":
            if reservations:
                raise AllocationRefusedError(
                    f"pod {key} container {ci}: node {self.node_name} runs MPS but the "
                    f"container has a {MIG_ALLOCATIONS} reservation; the pod must be rescheduled"
                )
            allocation, mode = self._mps_allocation(key, ci, entry), "mps"
        elif reservations:
            return self._allocate_mig(pod, ci, entry, reservations, listed)
        elif self._mode == "mig":
            raise AllocationRefusedError(
                f"pod {key} container {ci}: node {self.node_name} runs MIG but the container "
                f"has no {MIG_ALLOCATIONS} reservation; the pod must be rescheduled"
            )
        else:
            allocation, mode = self._hami_core(pod, container, entry), "hami-core"

        def build(fresh: Mapping[str, str]) -> dict[str, str] | None:
            return self._emptied(key, fresh, ci, entry)

        self._patch(pod, build)
        log.info("allocate.done", pod=key, node=self.node_name, container=ci, mode=mode)
        return _Given(allocation)

    def _allocate_mig(
        self,
        pod: Mapping[str, Any],
        ci: int,
        entry: ContainerDevices,
        reservations: tuple[MigAllocation, ...],
        listed: _Listed,
    ) -> _Given:
        key = pod_key(pod)
        if self._mig is None:
            raise AllocationRefusedError(f"pod {key}: this agent has no MIG manager")
        if Counter(r.gpu_uuid for r in reservations) != Counter(d.uuid for d in entry):
            raise AllocationRefusedError(
                f"pod {key} container {ci}: {MIG_ALLOCATIONS} reserves GPUs "
                f"{sorted(r.gpu_uuid for r in reservations)} but {DEVICES_TO_ALLOCATE} lists "
                f"{sorted(d.uuid for d in entry)}"
            )
        read = desired_from_pods(listed.pods, node_name=self.node_name)
        identities = self._mig.ensure(
            key, reservations, read.desired, desired_reason=read.reason, as_of=listed.mig_as_of
        )

        def build(fresh: Mapping[str, str]) -> dict[str, str] | None:
            patch = self._emptied(key, fresh, ci, entry)
            if patch is None:
                self._check_recorded(key, fresh, ci, identities)
                return None
            patch[MIG_ALLOCATIONS] = with_runtime(
                fresh.get(MIG_ALLOCATIONS, ""), ci, identities, obj=f"pod {key}"
            )
            return patch

        self._patch(pod, build)
        log.info(
            "allocate.done",
            pod=key,
            node=self.node_name,
            container=ci,
            mode="mig",
            mig=[i.mig_uuid for i in identities],
        )
        return _Given(
            ContainerAllocation(
                envs={"NVIDIA_VISIBLE_DEVICES": ",".join(i.mig_uuid for i in identities)}
            ),
            tuple(replace(r, runtime=i) for r, i in zip(reservations, identities, strict=True)),
        )

    # Checks on annotations this agent did not write ----------------------------------------

    def _container(self, pod: Mapping[str, Any], ci: int) -> Mapping[str, Any]:
        spec = as_object(pod.get("spec"))
        containers = [*_list(spec.get("initContainers")), *_list(spec.get("containers"))]
        if not 0 <= ci < len(containers) or not isinstance(containers[ci], Mapping):
            raise AllocationRefusedError(
                f"pod {pod_key(pod)}: {DEVICES_TO_ALLOCATE} has an entry for container {ci} "
                f"but the pod has {len(containers)} containers"
            )
        return containers[ci]  # type: ignore[no-any-return]

    def _gpu_memory(self) -> dict[str, int]:
        """Each GPU's memory by UUID: what NVML says once (the node's GPUs and their sizes do
        not change while the agent runs; the MIG manager keeps its UUIDs the same way). Read
        again while a GPU's size is unknown (lost before it was ever read)."""
        known = self._memory_of
        if known is None:
            known = {}
            for i in range(self._backend.device_count()):
                info = self._backend.device(i)
                known[info.uuid] = info.memory_mib
            if all(mib > 0 for mib in known.values()):
                self._memory_of = known
        return known

    def _check_devices(self, key: str, ci: int, entry: ContainerDevices) -> None:
        gpus = self._gpu_memory()
        for d in entry:
            if d.legacy is not None:
                raise AllocationRefusedError(
                    f"pod {key} container {ci}: device {d.written_uuid} is a MIG slot of HAMi's "
                    f"<= v2.9 layouts, which Tessera does not create; delete the pod so it is "
                    f"scheduled again with a reserved MIG placement"
                )
            memory_mib = gpus.get(d.uuid)
            if memory_mib is None:
                raise AllocationRefusedError(
                    f"pod {key} container {ci}: GPU {d.uuid} is not on node {self.node_name}"
                )
            scaled = self._mode in ("hami-core", "mps")  # as registered (discovery)
            limit = int(memory_mib * (self._scaling if scaled else 1.0))
            if d.mem > limit:
                raise AllocationRefusedError(
                    f"pod {key} container {ci}: {d.mem} MiB asked on GPU {d.uuid}, "
                    f"which has {limit} MiB"
                )

    def _reservations(self, key: str, ann: Mapping[str, str], ci: int) -> tuple[MigAllocation, ...]:
        value = ann.get(MIG_ALLOCATIONS)
        if value is None:
            return ()
        return container_reservations(value, ci, obj=f"pod {key}")

    # hami-core ------------------------------------------------------------------------------

    def _hami_core(
        self, pod: Mapping[str, Any], container: Mapping[str, Any], entry: ContainerDevices
    ) -> ContainerAllocation:
        envs: dict[str, str] = {"NVIDIA_VISIBLE_DEVICES": ",".join(d.uuid for d in entry)}
        for i, d in enumerate(entry):
            envs[f"CUDA_DEVICE_MEMORY_LIMIT_{i}"] = f"{d.mem}m"
        envs["CUDA_DEVICE_SM_LIMIT"] = str(entry[0].cores)
        envs["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = f"{HOOK_DIR}/{self._cache_name()}.cache"
        if self._scaling > 1:
            envs["CUDA_OVERSUBSCRIBE"] = "true"
        envs.update(self._hami_core_settings(container))
        uid = str(as_object(pod.get("metadata")).get("uid", ""))
        name = str(container.get("name", ""))
        if not _HOST_DIR_PART.match(uid) or not _HOST_DIR_PART.match(name):
            # Both name a host directory: never let a value the API server would refuse
            # ("..", "a/b") point the writable mount elsewhere on the host.
            raise AllocationRefusedError(
                f"pod {pod_key(pod)}: uid {short_repr(uid)} and container name "
                f"{short_repr(name)} must be plain names to name the container's host directory"
            )
        container_dir = f"{self._host_hook}/vgpu/containers/{uid}_{name}"
        if self._host_dirs is not None:
            try:
                self._host_dirs.prepare(container_dir)
            except OSError as e:
                raise AllocationRefusedError(
                    f"pod {pod_key(pod)}: cannot prepare the host directories HAMi-core "
                    f"writes in ({container_dir}, {self._host_dirs.lock_dir}): {e}"
                ) from e
        mounts = [
            Mount(LIBVGPU, f"{self._host_hook}/vgpu/libvgpu.so", True),
            Mount(HOOK_DIR, container_dir, False),
            Mount(VGPU_LOCK, VGPU_LOCK, False),
        ]
        if not _control_disabled(container):
            mounts.append(Mount(LD_PRELOAD, f"{self._host_hook}/vgpu/ld.so.preload", True))
        return ContainerAllocation(envs=envs, mounts=tuple(mounts))

    def _hami_core_settings(self, container: Mapping[str, Any]) -> dict[str, str]:
        """HAMi-core's switches from the device config (HAMi's webhook and device plugin
        set the same): the core limit policy, the log level, the container's task priority."""
        cfg = self._config
        envs: dict[str, str] = {}
        policy = "disable" if cfg.disable_core_limit else cfg.gpu_core_policy
        if policy != "default":
            envs["GPU_CORE_UTILIZATION_POLICY"] = policy
        level = self._log_level
        if level is not None:
            envs["LIBCUDA_LOG_LEVEL"] = level
        limits = as_object(as_object(container.get("resources")).get("limits"))
        priority = limits.get(cfg.resource_priority_name)
        if priority is not None:
            try:
                envs["CUDA_TASK_PRIORITY"] = str(math.ceil(parse_quantity(priority)))
            except ValueError as e:
                raise AllocationRefusedError(
                    f"container {short_repr(container.get('name'))}: "
                    f"{cfg.resource_priority_name}: {e}"
                ) from None
        return envs

    # MPS ------------------------------------------------------------------------------------

    def _mps_allocation(self, key: str, ci: int, entry: ContainerDevices) -> ContainerAllocation:
        """Device i's daemon pipes at ``/tmp/nvidia-mps/<i>`` and the MPS client limits.

        A CUDA process talks to one daemon (``CUDA_MPS_PIPE_DIRECTORY``, set to device 0's):
        a container on several MPS GPUs runs one process per GPU, each pointing the
        variable at its device's directory. The pinned memory limit is indexed by position
        among the container's visible devices; the thread percentage is the container's
        gpucores (one value for all its devices, as HAMi-core's SM limit), left unset for
        0 (no limit asked) and 100 (the whole GPU).
        """
        if self._mps is None:
            raise AllocationRefusedError(
                f"pod {key}: node {self.node_name} runs MPS but this agent has no MPS daemons"
            )
        gpus = [d.uuid for d in entry]
        if len(set(gpus)) != len(gpus):
            raise AllocationRefusedError(
                f"pod {key} container {ci}: {DEVICES_TO_ALLOCATE} lists a GPU twice, which "
                "MPS cannot limit per entry; the pod must be rescheduled"
            )
        self._mps.require_up(gpus)
        envs = {
            "NVIDIA_VISIBLE_DEVICES": ",".join(gpus),
            "CUDA_MPS_PIPE_DIRECTORY": f"{CONTAINER_PIPE_ROOT}/0",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": ",".join(
                f"{i}={d.mem}M" for i, d in enumerate(entry)
            ),
        }
        cores = entry[0].cores
        if 0 < cores < 100:
            envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(cores)
        mounts = tuple(
            Mount(f"{CONTAINER_PIPE_ROOT}/{i}", str(self._mps.pipe_dir(gpu)), False)
            for i, gpu in enumerate(gpus)
        )
        return ContainerAllocation(envs=envs, mounts=mounts)

    # Patching -------------------------------------------------------------------------------

    def _emptied(
        self, key: str, fresh: Mapping[str, str], ci: int, entry: ContainerDevices
    ) -> dict[str, str] | None:
        """The to-allocate/bind-phase patch for ``fresh`` annotations; None if already done."""
        pending = list(to_allocate(fresh, obj=f"pod {key}"))
        if ci >= len(pending):
            raise AllocationRefusedError(f"pod {key}: container {ci} left {DEVICES_TO_ALLOCATE}")
        if not pending[ci]:
            return None
        if pending[ci] != entry:
            raise AllocationRefusedError(
                f"pod {key} container {ci}: {DEVICES_TO_ALLOCATE} changed while allocating"
            )
        pending[ci] = ()
        patch = {DEVICES_TO_ALLOCATE: encode_devices(tuple(pending))}
        if not any(pending):
            patch[BIND_PHASE] = "success"
        return patch

    def _check_recorded(
        self, key: str, fresh: Mapping[str, str], ci: int, identities: Sequence[RuntimeIdentity]
    ) -> None:
        """A concurrent Allocate finished this container first: it must have recorded the
        same instances (the manager is idempotent), else the records are inconsistent."""
        recorded = [r.runtime for r in self._reservations(key, fresh, ci)]
        if recorded != list(identities):
            raise AllocationRefusedError(
                f"pod {key} container {ci}: already allocated with other MIG instances"
            )
        return None

    def _patch(self, pod: Mapping[str, Any], build: PatchBuilder) -> None:
        meta = as_object(pod.get("metadata"))
        path = _pod_path(pod)
        uid = meta.get("uid")
        current: Mapping[str, Any] = pod
        for _ in range(PATCH_ATTEMPTS):
            patch = build(annotations_of(current))
            if patch is None:
                return
            current_meta = as_object(current.get("metadata"))
            rv = current_meta.get("resourceVersion")
            body: dict[str, Any] = {"annotations": patch}
            labels = vgpu_node_labels(self.node_name)
            if labels and VGPU_NODE_LABEL not in as_object(current_meta.get("labels")):
                # Pods bound before Tessera wrote the label (or by a scheduler that did not):
                # HAMi's monitor finds a node's pods by it.
                body["labels"] = labels
            try:
                self._kube.merge_patch(path, {"metadata": body}, resource_version=rv)
                return
            except ConflictError:
                current = self._kube.get(path)
                if as_object(current.get("metadata")).get("uid") != uid:
                    raise AllocationRefusedError(
                        f"pod {pod_key(pod)} was replaced while allocating"
                    ) from None
        raise PatchGaveUpError(
            f"pod {pod_key(pod)} changed {PATCH_ATTEMPTS} times while allocating; retry"
        )

    def _mark_failed(self, pod: Mapping[str, Any]) -> None:
        try:
            self._kube.merge_patch(
                _pod_path(pod), {"metadata": {"annotations": {BIND_PHASE: "failed"}}}
            )
        except NotFoundError:
            pass
        except TesseraError as e:
            log.warning("allocate.mark_failed_failed", pod=pod_key(pod), error=str(e))


# Kubernetes uids and container names (DNS-1123 labels) match this; "." and ".." do not.
_HOST_DIR_PART: Final = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,252}\Z")


def _pod_path(pod: Mapping[str, Any]) -> str:
    meta = as_object(pod.get("metadata"))
    return f"/api/v1/namespaces/{meta.get('namespace') or 'default'}/pods/{meta.get('name', '')}"


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []


def _control_disabled(container: Mapping[str, Any]) -> bool:
    """Whether the container opts out of HAMi-core's preload: as HAMi, any
    ``CUDA_DISABLE_CONTROL`` entry that Go's ``ParseBool`` reads as true (``1``, ``t``,
    ``TRUE``, ...); false or unreadable entries are passed over."""
    return any(
        isinstance(env, Mapping)
        and env.get("name") == "CUDA_DISABLE_CONTROL"
        and parse_go_bool(str(env.get("value", ""))) is True
        for env in _list(container.get("env"))
    )
