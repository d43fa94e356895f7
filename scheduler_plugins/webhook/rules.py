"""What a new pod may ask of Tessera, and what Tessera fills in: pure, one pod at a time.

Rules, in the order a user meets them:

- Internal annotations (``hami.io/vgpu-*``, ``hami.io/bind-*``) are written by Tessera's
  scheduler and node agent only: a pod that presets one is refused (403), whatever its
  scheduler, since the scheduler counts any bound pod's recorded devices; an update of an
  existing pod (or its status) that adds, changes or removes one is refused the same way
  (``review_pod_update``): a forged record would let the scheduler over-commit a GPU or
  hand a container another pod's devices.
- A pod that asks for Tessera resources must not preset ``spec.nodeName``: it would bypass
  the scheduler, so its devices would be neither reserved nor counted (403); nor run a
  privileged container, which sees every GPU of the node (403, as HAMi's webhook).
- Trusted users (``Settings.trusted_users``, e.g. an operator restoring placed pods) may
  preset both.
- A pod that asks for Tessera resources and names no scheduler (or ``default-scheduler``)
  gets ``spec.schedulerName`` set to Tessera's; a pod naming another scheduler is left to it.
- With ``Settings.host_only_pods`` (off by default), so does a pod that asks for no GPU,
  names no scheduler (or ``default-scheduler``), presets no ``spec.nodeName`` and is not in
  one of ``Settings.host_only_exclude`` (``kube-system``; the chart adds Tessera's own
  namespace, whose pods must not wait on the scheduler they are part of): Tessera places
  such pods under the fragmentation policy, so their CPU and memory strand as little GPU
  capacity as possible. Nothing else is set on them.
- For Tessera's pods: each container that asks for memory or cores but not for a device
  count gets the config's default count (``nvidia.com/gpu: 1``) in its limits and requests;
  requests that no GPU could ever satisfy are refused (400): the same validation the
  scheduler applies (``pods.parse_request``: whole numbers, ranges, annotations) plus, when
  nodes are known, more devices than any node holds or more memory than any GPU has, among
  the GPUs of the modes the pod accepts (hami-core, MIG, MPS; every mode when it names none).
- From the device config, as HAMi's webhook: ``runtimeClassName`` on Tessera's pods that name
  none; with ``overwriteEnv``, ``NVIDIA_VISIBLE_DEVICES=none`` on their containers that ask
  for no GPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal, cast

from api.errors import InvalidRequestError
from api.hami import keys as ann
from api.hami.config import DeviceConfig
from api.hami.keys import GPU_MODES, GpuMode
from scheduler_plugins.core.requests import PodRequest, parse_request
from scheduler_plugins.core.rules import modes
from scheduler_plugins.webhook.facts import ClusterFacts

DEFAULT_SCHEDULER: Final = "default-scheduler"
TESSERA_SCHEDULER: Final = "hami-scheduler"


HOST_ONLY_EXCLUDE: Final = frozenset({"kube-system"})
"""Namespaces whose pods without a GPU the webhook never routes to Tessera's scheduler."""


@dataclass(frozen=True)
class Settings:
    scheduler_name: str = TESSERA_SCHEDULER
    config: DeviceConfig = field(default_factory=DeviceConfig)
    trusted_users: frozenset[str] = frozenset()
    # Route pods that ask for no GPU to Tessera's scheduler too (outside host_only_exclude).
    host_only_pods: bool = False
    host_only_exclude: frozenset[str] = HOST_ONLY_EXCLUDE


@dataclass(frozen=True)
class PatchOp:
    """One RFC 6902 operation; the webhook only ever adds (which also replaces)."""

    path: str
    value: Any
    op: Literal["add"] = "add"

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, "path": self.path, "value": self.value}


@dataclass(frozen=True)
class PodVerdict:
    patch: tuple[PatchOp, ...] = ()
    forbidden: tuple[str, ...] = ()  # presets only Tessera may write: HTTP 403
    invalid: tuple[str, ...] = ()  # requests that cannot be satisfied: HTTP 400

    @property
    def allowed(self) -> bool:
        return not self.forbidden and not self.invalid

    @property
    def code(self) -> int:
        return 403 if self.forbidden else 400

    @property
    def message(self) -> str:
        return "; ".join((*self.forbidden, *self.invalid))


def pointer(*parts: str | int) -> str:
    """A JSON pointer (RFC 6901) from path segments."""
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def _dict(v: object) -> dict[str, Any]:
    return cast("dict[str, Any]", v) if isinstance(v, dict) else {}


def _containers(pod: Mapping[str, Any]) -> list[tuple[str, int, dict[str, Any]]]:
    """(field, index in that field, container) in pod order, init containers first."""
    spec = _dict(pod.get("spec"))
    out: list[tuple[str, int, dict[str, Any]]] = []
    for fld in ("initContainers", "containers"):
        items = spec.get(fld)
        if isinstance(items, list):
            out.extend((fld, i, _dict(c)) for i, c in enumerate(items))
    return out


def _has(container: Mapping[str, Any], name: str) -> bool:
    res = _dict(container.get("resources"))
    return any(name in _dict(res.get(section)) for section in ("limits", "requests"))


def _tessera_names(config: DeviceConfig) -> tuple[str, str, str, str]:
    return (
        config.resource_count_name,
        config.resource_memory_name,
        config.resource_memory_percentage_name,
        config.resource_core_name,
    )


def asks_tessera(pod: Mapping[str, Any], config: DeviceConfig) -> bool:
    """Whether any container names one of Tessera's resources (whatever the value)."""
    names = _tessera_names(config)
    return any(_has(c, n) for _, _, c in _containers(pod) for n in names)


def review_pod(
    pod: Mapping[str, Any],
    *,
    user: str,
    facts: ClusterFacts,
    settings: Settings,
    namespace: str = "",
) -> PodVerdict:
    """The verdict on a pod being created by ``user`` in ``namespace`` (the AdmissionReview's;
    a new pod's own metadata often names none)."""
    config = settings.config
    tessera = asks_tessera(pod, config)
    forbidden: list[str] = []
    if user not in settings.trusted_users:
        forbidden += _preset_internal(pod)
        node = _dict(pod.get("spec")).get("nodeName")
        if tessera and node:
            forbidden.append(
                f"spec.nodeName is preset ({node!r}): pods that ask for "
                f"{', '.join(_tessera_names(config))} must be placed by the "
                f"{settings.scheduler_name} scheduler, which reserves their devices; remove "
                "spec.nodeName and use a nodeSelector or node affinity instead"
            )
    scheduler = _dict(pod.get("spec")).get("schedulerName") or DEFAULT_SCHEDULER
    if not tessera:
        return PodVerdict(_route_host_only(pod, scheduler, namespace, settings), tuple(forbidden))
    if scheduler not in (DEFAULT_SCHEDULER, settings.scheduler_name):
        return PodVerdict(forbidden=tuple(forbidden))
    forbidden += [
        f"container {c.get('name')!r} is privileged: it would see every GPU of its node, "
        f"not the share {settings.scheduler_name} gives it; drop securityContext.privileged"
        for _, _, c in _containers(pod)
        if _dict(c.get("securityContext")).get("privileged") is True
    ]
    try:
        request = parse_request(pod, config)
    except InvalidRequestError as e:
        return PodVerdict(forbidden=tuple(forbidden), invalid=(e.problem,))
    if not request.wants_gpu:  # every container asks for 0 devices
        return PodVerdict(_route_host_only(pod, scheduler, namespace, settings), tuple(forbidden))
    invalid = _impossible(request, facts, config)
    patch: list[PatchOp] = []
    if scheduler != settings.scheduler_name:
        patch.append(PatchOp(pointer("spec", "schedulerName"), settings.scheduler_name))
    patch += _default_counts(pod, config)
    patch += _device_config_settings(pod, config)
    return PodVerdict(tuple(patch), tuple(forbidden), tuple(invalid))


def _route_host_only(
    pod: Mapping[str, Any], scheduler: str, namespace: str, settings: Settings
) -> tuple[PatchOp, ...]:
    """The patch that gives a pod asking for no GPU to Tessera's scheduler, if the settings
    route such pods and this one may go (see the module's rules)."""
    spec = _dict(pod.get("spec"))
    namespace = namespace or str(_dict(pod.get("metadata")).get("namespace") or "default")
    if (
        not settings.host_only_pods
        or scheduler != DEFAULT_SCHEDULER
        or spec.get("nodeName")
        or namespace in settings.host_only_exclude
    ):
        return ()
    return (PatchOp(pointer("spec", "schedulerName"), settings.scheduler_name),)


def review_pod_update(
    old: Mapping[str, Any], new: Mapping[str, Any], *, user: str, settings: Settings
) -> PodVerdict:
    """The verdict on ``user`` updating a pod from ``old`` to ``new``: only whether it
    alters internal annotations (nothing is mutated on update)."""
    if user in settings.trusted_users:
        return PodVerdict()
    before = _internal(old)
    after = _internal(new)
    # Present with a null value is present: taking such a key away is a removal.
    changed = sorted(
        k
        for k in before.keys() | after.keys()
        if k not in before or k not in after or before[k] != after[k]
    )
    return PodVerdict(
        forbidden=tuple(
            f"annotation {k} is written only by Tessera's scheduler and node agent: "
            f"{user or 'this user'} may not {_change(k, before, after)} it on an existing pod"
            for k in changed
        )
    )


def _internal(pod: Mapping[str, Any]) -> dict[str, object]:
    annotations = _dict(_dict(pod.get("metadata")).get("annotations"))
    return {str(k): v for k, v in annotations.items() if str(k).startswith(ann.INTERNAL_PREFIXES)}


def _change(key: str, before: Mapping[str, object], after: Mapping[str, object]) -> str:
    if key not in before:
        return "add"
    return "remove" if key not in after else "change"


def _preset_internal(pod: Mapping[str, Any]) -> list[str]:
    annotations = _dict(_dict(pod.get("metadata")).get("annotations"))
    keys = sorted(str(k) for k in annotations if str(k).startswith(ann.INTERNAL_PREFIXES))
    return [
        f"annotation {k} is written only by Tessera's scheduler and node agent: remove it from "
        "the pod (or its template)"
        for k in keys
    ]


def _default_counts(pod: Mapping[str, Any], config: DeviceConfig) -> list[PatchOp]:
    """``nvidia.com/gpu: <defaultGPUNum>`` for containers asking memory or cores only."""
    count_name = config.resource_count_name
    others = _tessera_names(config)[1:]
    value = str(config.default_gpu_num)
    ops: list[PatchOp] = []
    for fld, i, c in _containers(pod):
        if _has(c, count_name) or not any(_has(c, n) for n in others):
            continue
        resources = c.get("resources")
        if not isinstance(resources, dict):
            ops.append(
                PatchOp(
                    pointer("spec", fld, i, "resources"),
                    {"limits": {count_name: value}, "requests": {count_name: value}},
                )
            )
            continue
        for section in ("limits", "requests"):
            if isinstance(resources.get(section), dict):
                ops.append(
                    PatchOp(pointer("spec", fld, i, "resources", section, count_name), value)
                )
            else:
                ops.append(
                    PatchOp(pointer("spec", fld, i, "resources", section), {count_name: value})
                )
    return ops


def _device_config_settings(pod: Mapping[str, Any], config: DeviceConfig) -> list[PatchOp]:
    """What HAMi's webhook sets on a GPU pod from the device config: ``runtimeClassName``
    when the pod names none, and with ``overwriteEnv`` ``NVIDIA_VISIBLE_DEVICES=none`` on
    every container that asks for no GPU (appended: the last value of a name wins, so a
    value from the manifest cannot reopen the node's GPUs)."""
    ops: list[PatchOp] = []
    spec = _dict(pod.get("spec"))
    if config.runtime_class_name and not spec.get("runtimeClassName"):
        ops.append(PatchOp(pointer("spec", "runtimeClassName"), config.runtime_class_name))
    if not config.overwrite_env:
        return ops
    names = _tessera_names(config)
    hidden = {"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"}
    for fld, i, c in _containers(pod):
        if any(_has(c, n) for n in names):
            continue
        env = c.get("env")
        visible = [e for e in env if _dict(e).get("name") == hidden["name"]] if env else []
        if visible and visible[-1] == hidden:
            continue  # already hidden (a reinvoked webhook adds nothing)
        if isinstance(env, list):
            ops.append(PatchOp(pointer("spec", fld, i, "env", "-"), hidden))
        else:
            ops.append(PatchOp(pointer("spec", fld, i, "env"), [hidden]))
    return ops


# What a pod asks for, by the modes offered to it (in ``GPU_MODES`` order when several).
_KIND: Final[dict[GpuMode, str]] = {"hami-core": "hami-core GPU", "mig": "MIG", "mps": "MPS GPU"}


def _impossible(request: PodRequest, facts: ClusterFacts, config: DeviceConfig) -> list[str]:
    """Requests larger than anything a registered node holds (nothing when none is known),
    among the GPUs of the modes offered to the pod (every mode when it names none)."""
    if not facts.known:
        return []
    offered = modes(request.modes)
    every = offered == frozenset(GPU_MODES)
    limit = facts.limit(offered)
    named = [m for m in GPU_MODES if m in offered]
    kind = "GPU" if every else " or ".join(_KIND[m] for m in named)
    if limit.devices == 0 or limit.largest is None:
        if every:
            return [f"none of the {facts.nodes} node(s) with registered GPUs can hold a device"]
        return [
            f"the pod asks for {kind} devices ({ann.VGPU_MODE}: {','.join(named)}), but none of "
            f"the {facts.nodes} node(s) with registered GPUs has one; use another mode or "
            "leave the annotation out"
        ]
    big = limit.largest
    out: list[str] = []
    for c in request.containers:
        if c.count > limit.devices:
            out.append(
                f"container {c.name!r}: {config.resource_count_name} = {c.count}, but no node "
                f"in the cluster can give one container more than {limit.devices} {kind} "
                f"device(s); ask for at most {limit.devices} or split the work across pods"
            )
        if c.mem_mib > big.memory_mib:
            out.append(
                f"container {c.name!r}: {config.resource_memory_name} = {c.mem_mib} MiB per "
                f"device is more than the largest {kind} in the cluster has ({big.memory_mib} "
                f"MiB, {big.model} on node {big.node}); ask for at most {big.memory_mib}, or "
                f"use {config.resource_memory_percentage_name}"
            )
    return out
