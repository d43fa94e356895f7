"""Test doubles for node-agent unit tests: an in-memory apiserver and pod builders.

``FakeKube`` is a test double only (integration tests use the real apiserver): it stores
objects by path, bumps ``metadata.resourceVersion`` on every write, honours a
resourceVersion precondition in a merge patch (409 ConflictError), applies JSON merge
patch semantics (null deletes) and can be told to fail the next calls.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from api.hami.devices import (
    DeviceAlloc,
    MigAllocation,
    encode_devices,
    encode_mig_allocations,
)
from api.hami.keys import (
    BIND_PHASE,
    BIND_TIME,
    DEVICES_ALLOCATED,
    DEVICES_TO_ALLOCATE,
    MIG_ALLOCATIONS,
    VGPU_NODE,
)
from api.hami.register import Placement
from api.kube.errors import ConflictError, NotFoundError
from node_agent.identities import Held
from node_agent.nvml.simulated import SimulatedGpuSpec, SimulatedNvml


def _merge(target: dict[str, Any], patch: Mapping[str, Any]) -> None:
    for k, v in patch.items():
        if v is None:
            target.pop(k, None)
        elif isinstance(v, Mapping):
            sub = target.get(k)
            if not isinstance(sub, dict):
                sub = target[k] = {}
            _merge(sub, v)
        else:
            target[k] = copy.deepcopy(v)


class FakeKube:
    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.rv = 0
        self.patches: list[tuple[str, dict[str, Any], str | None]] = []
        self.fail_patch: list[Exception] = []
        self.before_patch: Callable[[str], None] | None = None

    def _bump(self, obj: dict[str, Any]) -> None:
        self.rv += 1
        obj.setdefault("metadata", {})["resourceVersion"] = str(self.rv)

    def put(self, path: str, obj: dict[str, Any]) -> None:
        obj = copy.deepcopy(obj)
        self._bump(obj)
        self.objects[path] = obj

    def add_pod(self, pod: dict[str, Any]) -> str:
        meta = pod["metadata"]
        path = f"/api/v1/namespaces/{meta.get('namespace', 'default')}/pods/{meta['name']}"
        self.put(path, pod)
        return path

    def get(self, path: str) -> Any:
        if path not in self.objects:
            raise NotFoundError("GET", path, 404, "NotFound", "not found")
        return copy.deepcopy(self.objects[path])

    def list(self, path: str, *, field_selector: str | None = None) -> dict[str, Any]:
        assert path == "/api/v1/pods"
        items = [copy.deepcopy(o) for p, o in sorted(self.objects.items()) if "/pods/" in p]
        if field_selector:
            key, _, value = field_selector.partition("=")
            assert key == "spec.nodeName"
            items = [i for i in items if i.get("spec", {}).get("nodeName") == value]
        return {"items": items, "metadata": {"resourceVersion": str(self.rv)}}

    def merge_patch(
        self, path: str, patch: Mapping[str, Any], *, resource_version: str | None = None
    ) -> Any:
        if self.before_patch is not None:
            hook, self.before_patch = self.before_patch, None
            hook(path)
        self.patches.append((path, copy.deepcopy(dict(patch)), resource_version))
        if self.fail_patch:
            raise self.fail_patch.pop(0)
        obj = self.objects.get(path)
        if obj is None:
            raise NotFoundError("PATCH", path, 404, "NotFound", "not found")
        if resource_version is not None and obj["metadata"]["resourceVersion"] != resource_version:
            raise ConflictError("PATCH", path, 409, "Conflict", "the object has been modified")
        _merge(obj, patch)
        self._bump(obj)
        return copy.deepcopy(obj)

    def annotations(self, path: str) -> dict[str, str]:
        return dict(self.objects[path]["metadata"].get("annotations") or {})


class ScriptedKube(FakeKube):
    """A ``FakeKube`` whose ``fail_at``-th merge patch (counting from 1, in ``calls``) is
    answered with a conflict, and which runs ``after`` after every write that went through
    (counted in ``writes``): a check that must hold between any two writes."""

    def __init__(self, fail_at: int = 0, after: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.fail_at = fail_at
        self.after: Callable[[], None] = after or (lambda: None)
        self.calls = 0
        self.writes = 0

    def merge_patch(
        self, path: str, patch: Mapping[str, Any], *, resource_version: str | None = None
    ) -> Any:
        self.calls += 1
        if self.calls == self.fail_at:
            raise ConflictError("PATCH", path, 409, "Conflict", "the object has been modified")
        out = super().merge_patch(path, patch, resource_version=resource_version)
        self.writes += 1
        self.after()
        return out


class FakeLister:
    """What the kubelet's PodResources List shows: (pod key, container) -> device ids."""

    def __init__(self, resource: str = "nvidia.com/gpu") -> None:
        self.resource = resource
        self.held: dict[tuple[str, str], tuple[str, ...]] = {}
        self.calls = 0

    def list(self, resource: str) -> Held:
        assert resource == self.resource
        self.calls += 1
        return dict(self.held)


NODE = "node-a"
G0, G1 = "GPU-00000000-0000-0000-0000-000000000000", "GPU-11111111-1111-1111-1111-111111111111"
SLOTS = [f"{g}-{s}" for g in (G0, G1) for s in range(4)]
"""A node with two GPUs, and the kubelet-style ids of their four slots each."""


def simulated_gpus(*uuids: str, model: str = "A100-PCIE-40GB") -> Iterator[SimulatedNvml]:
    """An initialized in-memory simulated NVML with one GPU of ``model`` per UUID (MIG
    capable where the model is), shut down after (a fixture's body: ``yield from``)."""
    backend = SimulatedNvml([SimulatedGpuSpec(model, uuid=u) for u in uuids], None)
    backend.init()
    yield backend
    backend.shutdown()


def make_pod(
    name: str,
    node: str | None = "node-a",
    *,
    devices: Sequence[Sequence[tuple[str, int, int]]] = (),
    mig: Sequence[MigAllocation] = (),
    phase_annotation: str = "allocating",
    bind_time: int | None = 100,
    containers: Sequence[Mapping[str, Any]] | None = None,
    vgpu_node: str | None = None,
    created: str = "2024-01-01T00:00:00Z",
    extra_annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A pod as the scheduler leaves it: ``devices`` per container as (uuid, mem, cores)."""
    pod_devices = tuple(tuple(DeviceAlloc(u, m, c) for u, m, c in ctr) for ctr in devices)
    ann: dict[str, str] = {
        BIND_PHASE: phase_annotation,
        DEVICES_ALLOCATED: encode_devices(pod_devices),
        DEVICES_TO_ALLOCATE: encode_devices(pod_devices),
        VGPU_NODE: vgpu_node or node or "",
    }
    if bind_time is not None:
        ann[BIND_TIME] = str(bind_time)
    if mig:
        ann[MIG_ALLOCATIONS] = encode_mig_allocations(list(mig))
    ann.update(extra_annotations or {})
    ctrs = (
        list(containers)
        if containers is not None
        else [{"name": f"c{i}", "image": "x"} for i in range(max(1, len(pod_devices)))]
    )
    spec: dict[str, Any] = {"containers": ctrs}
    if node is not None:
        spec["nodeName"] = node
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "default",
            "uid": f"uid-{name}",
            "creationTimestamp": created,
            "annotations": ann,
        },
        "spec": spec,
        "status": {"phase": "Pending"},
    }


def mig_alloc(ci: int, di: int, gpu: str, profile: str, start: int, size: int) -> MigAllocation:
    return MigAllocation(ci, di, gpu, profile, Placement(start, size))
