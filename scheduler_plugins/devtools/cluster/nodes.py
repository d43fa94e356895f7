"""Fake GPU nodes for the dev cluster: a node profile (YAML) → kwok Node objects → the API.

Each node is managed by kwok (annotation ``kwok.x-k8s.io/node: fake``, label ``type: kwok``),
advertises ``nvidia.com/gpu`` = the slots its GPUs register (GPUs × deviceSplitCount in
hami-core mode), and carries the
``hami.io/node-nvidia-register`` annotation a simulated node agent would write for its GPUs.

Profile format (``examples/cluster-profile.yaml``)::

    version: v1
    namePrefix: gpu-node          # nodes are <prefix>-0000, <prefix>-0001, ...
    deviceConfig: device-config.yaml   # optional, relative to the profile: split count etc.
    defaults: {gpusPerNode: 8, mode: hami-core, cpu: "64", memory: 512Gi, pods: "110",
               labels: {gpu: "on"}}
    groups:                       # the model mix: weighted round-robin over the nodes
      - {model: A100-PCIE-40GB, weight: 2}
      - {model: H100 80GB, weight: 1, mode: mig, labels: {pool: h100}}
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, cast

import structlog
import yaml

from api.errors import InvalidConfigError
from api.hami.catalog import UnknownModelError, find_model, simulated_devices
from api.hami.config import DeviceConfig, load_config_file
from api.hami.keys import GPU_MODES, NODE_REGISTER, GpuMode
from api.hami.register import encode
from scheduler_plugins.devtools.cluster.errors import ClusterError, ProfileError
from scheduler_plugins.devtools.cluster.kubeapi import KubeApi
from scheduler_plugins.devtools.progress import Progress

log = structlog.get_logger(__name__)

PROFILE_VERSION: Final = "v1"
HANDSHAKE_ANNOTATION: Final = "hami.io/node-handshake"
KWOK_NODE_ANNOTATION: Final = "kwok.x-k8s.io/node"
KWOK_LABEL: Final = ("type", "kwok")
DEFAULT_WORKERS: Final = 32

_QUANTITY_RE: Final = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_LABEL_NAME_RE: Final = re.compile(
    r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
_LABEL_VALUE_RE: Final = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_PREFIX_RE: Final = re.compile(r"^[a-z0-9]([-a-z0-9]{0,40}[a-z0-9])?$")


@dataclass(frozen=True)
class NodeGroup:
    """Nodes of one GPU model; ``weight`` is its share of the mix."""

    model: str
    weight: int = 1
    gpus_per_node: int = 8
    mode: GpuMode = "hami-core"
    cpu: str = "64"
    memory: str = "512Gi"
    pods: str = "110"
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class NodeProfile:
    name_prefix: str = "gpu-node"
    groups: tuple[NodeGroup, ...] = (NodeGroup("A100-PCIE-40GB"),)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)

    def schedule(self) -> tuple[NodeGroup, ...]:
        """One round of the weighted round-robin (smooth: groups interleave)."""
        total = sum(g.weight for g in self.groups)
        current = [0] * len(self.groups)
        out: list[NodeGroup] = []
        for _ in range(total):
            for i, g in enumerate(self.groups):
                current[i] += g.weight
            best = max(range(len(self.groups)), key=lambda i: current[i])
            current[best] -= total
            out.append(self.groups[best])
        return tuple(out)


# Loading --------------------------------------------------------------------------------------


def load_profile(path: Path) -> NodeProfile:
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ProfileError("", f"cannot read {path}: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise ProfileError("", f"{path} is not valid YAML: {e}") from e
    try:
        return parse_profile(raw if raw is not None else {}, base_dir=path.parent)
    except ProfileError as e:
        raise ProfileError(e.path, f"{e.problem} (in {path})") from e


def parse_profile(raw: object, *, base_dir: Path) -> NodeProfile:
    top = _mapping(raw, "")
    _only(top, "", {"version", "namePrefix", "deviceConfig", "defaults", "groups"})
    version = top.get("version", PROFILE_VERSION)
    if version != PROFILE_VERSION:
        raise ProfileError("version", f"unsupported {version!r}; supported: {PROFILE_VERSION}")
    prefix = str(top.get("namePrefix", NodeProfile.name_prefix))
    if not _PREFIX_RE.match(prefix):
        raise ProfileError(
            "namePrefix", f"{prefix!r} is not a DNS label prefix (lowercase, digits, '-', ≤42)"
        )
    device_config = DeviceConfig()
    if top.get("deviceConfig"):
        cfg_path = base_dir / str(top["deviceConfig"])
        try:
            device_config = load_config_file(cfg_path)
        except InvalidConfigError as e:
            raise ProfileError("deviceConfig", str(e)) from e
    defaults = _mapping(top.get("defaults", {}), "defaults")
    _only(defaults, "defaults", _GROUP_KEYS - {"model", "weight"})
    base = _group_fields(defaults, "defaults", NodeGroup(model=""))
    raw_groups = top.get("groups")
    if not isinstance(raw_groups, list) or not raw_groups:
        raise ProfileError("groups", "must be a non-empty list of {model: ..., weight: ...}")
    groups = []
    for i, item in enumerate(raw_groups):
        where = f"groups[{i}]"
        g = _mapping(item, where)
        _only(g, where, _GROUP_KEYS)
        if "model" not in g:
            raise ProfileError(f"{where}.model", "is required (e.g. A100-PCIE-40GB, H200)")
        groups.append(_group_fields(g, where, base))
    return NodeProfile(name_prefix=prefix, groups=tuple(groups), device_config=device_config)


_GROUP_KEYS: Final = frozenset(
    {"model", "weight", "gpusPerNode", "mode", "cpu", "memory", "pods", "labels"}
)


def _group_fields(raw: Mapping[str, Any], where: str, base: NodeGroup) -> NodeGroup:
    model = str(raw.get("model", base.model))
    weight = _int(raw.get("weight", base.weight), f"{where}.weight", 1, 1000)
    gpus = _int(raw.get("gpusPerNode", base.gpus_per_node), f"{where}.gpusPerNode", 1, 16)
    mode = raw.get("mode", base.mode)
    if mode not in GPU_MODES:
        raise ProfileError(f"{where}.mode", f"{mode!r} is not one of {', '.join(GPU_MODES)}")
    if model:  # empty only in `defaults`
        try:
            gpu = find_model(model)
        except UnknownModelError as e:
            raise ProfileError(f"{where}.model", str(e)) from e
        if mode == "mig" and not gpu.mig_capable:
            raise ProfileError(f"{where}.mode", f"{gpu.name} is not MIG-capable; use hami-core")
    qty = {}
    for key, default in (("cpu", base.cpu), ("memory", base.memory), ("pods", base.pods)):
        value = str(raw.get(key, default))
        if not _QUANTITY_RE.match(value):
            raise ProfileError(f"{where}.{key}", f"{value!r} is not a quantity like 64, 512Gi")
        qty[key] = value
    labels = _labels(raw.get("labels", {}), f"{where}.labels")
    return NodeGroup(
        model=model,
        weight=weight,
        gpus_per_node=gpus,
        mode=cast("GpuMode", mode),
        cpu=qty["cpu"],
        memory=qty["memory"],
        pods=qty["pods"],
        labels={**base.labels, **labels},
    )


def _mapping(raw: object, where: str) -> Mapping[str, Any]:
    if not isinstance(raw, dict):
        raise ProfileError(where, f"must be a mapping, got {type(raw).__name__}")
    return cast("Mapping[str, Any]", raw)


def _only(raw: Mapping[str, Any], where: str, allowed: Iterable[str]) -> None:
    allowed = set(allowed)
    for key in raw:
        if key not in allowed:
            path = f"{where}.{key}" if where else str(key)
            raise ProfileError(path, f"unknown field; valid: {', '.join(sorted(allowed))}")


def _int(value: object, where: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ProfileError(where, f"must be an integer in {lo}..{hi}, got {value!r}")
    return value


def _labels(raw: object, where: str) -> dict[str, str]:
    labels = _mapping(raw, where)
    out: dict[str, str] = {}
    for k, v in labels.items():
        value = "" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
        if not _LABEL_NAME_RE.match(str(k)):
            raise ProfileError(f"{where}.{k}", "is not a valid label name")
        if not _LABEL_VALUE_RE.match(value):
            raise ProfileError(f"{where}.{k}", f"{value!r} is not a valid label value")
        out[str(k)] = value
    return out


# Node objects ---------------------------------------------------------------------------------


def node_object(name: str, group: NodeGroup, config: DeviceConfig, *, now: float) -> dict[str, Any]:
    """The Node a kwok fake GPU node is created as (status included)."""
    devices = simulated_devices(name, group.model, group.gpus_per_node, group.mode, config)
    return _kwok_node(
        name,
        {
            "cpu": group.cpu,
            "memory": group.memory,
            "pods": group.pods,
            # the device plugin's slots: each GPU's registered count
            config.resource_count_name: str(sum(d.count for d in devices)),
        },
        group.labels,
        {
            NODE_REGISTER: encode(devices),
            # HAMi's scheduler only trusts a register annotation with a fresh handshake.
            HANDSHAKE_ANNOTATION: "Reported "
            + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)),
        },
    )


def cpu_node_object(
    name: str, *, cpu: str, memory: str, pods: str = "110", labels: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """A kwok fake node without GPUs (no register annotation, no device resource)."""
    return _kwok_node(name, {"cpu": cpu, "memory": memory, "pods": pods}, labels or {}, {})


def _kwok_node(
    name: str,
    resources: Mapping[str, str],
    labels: Mapping[str, str],
    annotations: Mapping[str, str],
) -> dict[str, Any]:
    """A Node kwok manages, with ``resources`` allocatable (status included)."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                **labels,
                KWOK_LABEL[0]: KWOK_LABEL[1],
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
            },
            "annotations": {
                KWOK_NODE_ANNOTATION: "fake",
                "node.alpha.kubernetes.io/ttl": "0",
                **annotations,
            },
        },
        "spec": {},
        "status": {"allocatable": dict(resources), "capacity": dict(resources)},
    }


def plan(profile: NodeProfile, count: int, start_index: int) -> list[tuple[str, NodeGroup]]:
    """Names and groups of ``count`` new nodes numbered from ``start_index``."""
    if count < 0:
        raise ClusterError(f"node count must be ≥ 0, got {count}")
    cycle = profile.schedule()
    return [
        (f"{profile.name_prefix}-{i:04d}", cycle[i % len(cycle)])
        for i in range(start_index, start_index + count)
    ]


def next_index(api: KubeApi, prefix: str) -> int:
    """One past the highest ``<prefix>-N`` kwok node in the cluster (0 when none)."""
    pattern = re.compile(rf"^{re.escape(prefix)}-(\d+)$")
    items = api.get("/api/v1/nodes", query={"labelSelector": f"{KWOK_LABEL[0]}={KWOK_LABEL[1]}"})
    indices = [
        int(m.group(1))
        for item in items.get("items", [])
        if (m := pattern.match(item["metadata"]["name"]))
    ]
    return max(indices) + 1 if indices else 0


def add_nodes(
    api: KubeApi,
    profile: NodeProfile,
    count: int,
    *,
    start_index: int | None = None,
    workers: int = DEFAULT_WORKERS,
    progress: bool = False,
) -> list[str]:
    """Create ``count`` fake GPU nodes in parallel; returns their names. ``progress``: a
    progress bar on stderr (command lines; hundreds of nodes take a while)."""
    start = next_index(api, profile.name_prefix) if start_index is None else start_index
    planned = plan(profile, count, start)
    now = time.time()
    objects = [node_object(name, group, profile.device_config, now=now) for name, group in planned]
    t0 = time.monotonic()
    bar = Progress("creating nodes", len(objects), enabled=progress)
    names: list[str] = []
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(objects) or 1))) as pool:
        for name in pool.map(lambda obj: create_node(api, obj), objects):
            names.append(name)
            bar.update(len(names))
    bar.close(len(names))
    log.info(
        "nodes.created",
        count=len(names),
        first=names[:1],
        seconds=round(time.monotonic() - t0, 2),
    )
    return names


def create_node(api: KubeApi, obj: dict[str, Any]) -> str:
    """Create the Node ``obj`` (``node_object``, ``cpu_node_object``) with its status."""
    name = str(obj["metadata"]["name"])
    created = api.post("/api/v1/nodes", obj)
    want = obj["status"]["allocatable"]
    got = (created or {}).get("status", {}).get("allocatable", {})
    if any(got.get(k) != v for k, v in want.items()):
        # Some apiservers drop status on create: set it through the status subresource.
        api.merge_patch(f"/api/v1/nodes/{name}/status", {"status": obj["status"]})
    return name


def wait_ready(
    api: KubeApi, names: Sequence[str], *, timeout_s: float = 300.0, progress: bool = False
) -> float:
    """Wait until kwok has marked every named node Ready; returns the seconds waited.
    ``progress``: a progress bar on stderr."""
    t0 = time.monotonic()
    pending = set(names)
    bar = Progress("nodes Ready", len(pending), enabled=progress)
    while pending:
        rows = api.table(
            "/api/v1/nodes", query={"labelSelector": f"{KWOK_LABEL[0]}={KWOK_LABEL[1]}"}
        )
        # The Status cell is what `kubectl get nodes` shows: "Ready", "NotReady", "Ready,…".
        pending -= {r["Name"] for r in rows if r.get("Status", "").split(",")[0] == "Ready"}
        bar.update(len(names) - len(pending))
        if not pending:
            break
        if time.monotonic() - t0 > timeout_s:
            sample = ", ".join(sorted(pending)[:5])
            raise ClusterError(
                f"{len(pending)} of {len(names)} nodes not Ready after {timeout_s:.0f}s "
                f"(e.g. {sample}); is kwok running? see `tessera cluster status` and the kwok log"
            )
        time.sleep(0.5)
    bar.close(len(names))
    return time.monotonic() - t0


def node_ready(node: Mapping[str, Any]) -> bool:
    conditions = node.get("status", {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
