"""``device-config.yaml``: load, validate (errors name the field path), defaults in one place.

The format is HAMi's scheduler device ConfigMap, plus a ``scheduler`` section for Tessera's
own settings. The MIG profile allowlist is policy only; profile geometry is node-local NVML
fact and never configured here. The old ``knownMigGeometries`` is rejected with a pointer to
``tessera config convert``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, TypeVar, cast

import yaml

from api.errors import InvalidConfigError, short_repr
from api.hami.keys import GPU_MODES, GpuMode
from api.hami.policy import GpuPolicy, PlacementStrategy, Policy

CONFIG_VERSION: Final = "v1"

GpuCorePolicy = Literal["default", "force", "disable"]
GPU_CORE_POLICIES: Final[tuple[GpuCorePolicy, ...]] = ("default", "force", "disable")
LibCudaLogLevel = Literal["0", "1", "3", "4"]
LIB_CUDA_LOG_LEVELS: Final[tuple[LibCudaLogLevel, ...]] = ("0", "1", "3", "4")

T = TypeVar("T")


@dataclass(frozen=True)
class AllowlistEntry:
    models: tuple[str, ...]
    profiles: tuple[str, ...]


DEFAULT_ALLOWLIST: Final[tuple[AllowlistEntry, ...]] = (
    AllowlistEntry(("A30",), ("1g.6gb", "2g.12gb", "4g.24gb")),
    AllowlistEntry(
        ("A100-SXM4-40GB", "A100-40GB-PCIe", "A100-PCIE-40GB"),
        ("1g.5gb", "2g.10gb", "3g.20gb", "7g.40gb"),
    ),
    AllowlistEntry(
        ("A100-SXM4-80GB", "A100-80GB-PCIe", "A100-PCIE-80GB", "A100 80GB PCIe"),
        ("1g.10gb", "2g.20gb", "3g.40gb", "7g.80gb"),
    ),
    # Models match as substrings of the NVML name and the first entry wins: GH200 before
    # H200, H200 before H20 (a unit test checks that no model is shadowed by an earlier one).
    AllowlistEntry(("GH200",), ("1g.12gb", "2g.24gb", "3g.48gb", "7g.96gb")),
    AllowlistEntry(("H200",), ("1g.18gb", "2g.35gb", "3g.71gb", "7g.141gb")),
    AllowlistEntry(
        ("H100 NVL", "H100-NVL", "H100 94GB"), ("1g.12gb", "2g.24gb", "3g.47gb", "7g.94gb")
    ),
    AllowlistEntry(
        ("H100 80GB", "H100-SXM5-80GB", "H100 PCIe", "H100-PCIE-80GB"),
        ("1g.10gb", "2g.20gb", "3g.40gb", "7g.80gb"),
    ),
    AllowlistEntry(("H20",), ("1g.12gb", "2g.24gb", "3g.48gb", "7g.96gb")),
    AllowlistEntry(("B200",), ("1g.23gb", "2g.45gb", "3g.90gb", "7g.180gb")),
    AllowlistEntry(("RTX PRO 6000 Blackwell Server Edition",), ("1g.24gb", "2g.48gb", "4g.96gb")),
)


@dataclass(frozen=True)
class NodeConfig:
    name: str
    operating_mode: GpuMode = "hami-core"
    device_split_count: int | None = None
    device_memory_scaling: float | None = None
    device_core_scaling: float | None = None
    lib_cuda_log_level: LibCudaLogLevel | None = None
    # ``filterdevices``: GPUs the node agent leaves out of the registration.
    filter_uuids: frozenset[str] = frozenset()
    filter_indexes: frozenset[int] = frozenset()

    def registers(self, uuid: str, index: int) -> bool:
        return uuid not in self.filter_uuids and index not in self.filter_indexes


@dataclass(frozen=True)
class DeviceConfig:
    resource_count_name: str = "nvidia.com/gpu"
    resource_memory_name: str = "nvidia.com/gpumem"
    resource_memory_percentage_name: str = "nvidia.com/gpumem-percentage"
    resource_core_name: str = "nvidia.com/gpucores"
    device_split_count: int = 10
    device_memory_scaling: float = 1.0
    default_memory: int = 0
    default_cores: int = 0
    default_gpu_num: int = 1
    mig_profile_allowlist: tuple[AllowlistEntry, ...] = DEFAULT_ALLOWLIST
    mig_placement_policy: PlacementStrategy = PlacementStrategy.FRAGMENTATION_AWARE
    nodeconfig: tuple[NodeConfig, ...] = ()
    default_node_policy: Policy = Policy.BINPACK
    # A chain, as HAMi's --gpu-scheduler-policy.
    default_gpu_policy: GpuPolicy = field(default_factory=GpuPolicy)
    # HAMi's container-facing settings: the gpumem unit, registered cores per GPU, the
    # HAMi-core environment the node agent hands out, and what the webhook sets on pods.
    memory_factor: int = 1
    device_core_scaling: float = 1.0
    resource_priority_name: str = "nvidia.com/priority"
    gpu_core_policy: GpuCorePolicy = "default"
    disable_core_limit: bool = False
    lib_cuda_log_level: LibCudaLogLevel | None = None
    runtime_class_name: str = ""
    overwrite_env: bool = False
    node_score_cpu_memory: bool = False
    _nodes: Mapping[str, NodeConfig] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_nodes", {n.name: n for n in self.nodeconfig})

    def node(self, name: str) -> NodeConfig:
        return self._nodes.get(name) or NodeConfig(name)

    def allowed_profiles(self, device_name: str) -> tuple[str, ...]:
        """Allowlisted profiles of a GPU: first entry whose model is a substring of its name."""
        upper = device_name.upper()
        for entry in self.mig_profile_allowlist:
            if any(m.upper() in upper for m in entry.models):
                return entry.profiles
        return ()


# HAMi fields Tessera accepts for compatibility but does not use (docs/hami-compatibility.md
# says why for each).
_IGNORED_NVIDIA_KEYS: Final = frozenset(
    {
        "preConfiguredDeviceMemory",
        "enableNumaTopology",
        "defaultGPUCoreScaling",
        "disablecorelimit",
        "migstrategy",
        "migStrategy",
        "gpuMemoryFactor",
        "mockModeSkipHealthCheck",
        "dynamicConfigFile",
    }
)
# Per-node keys of HAMi's device-plugin config Tessera accepts but does not use.
_IGNORED_NODE_KEYS: Final = frozenset(
    {
        "migstrategy",
        "enablegetpreferredallocation",
        "preconfigureddevicememory",
        "enablenumatopology",
    }
)
_VENDOR_SECTIONS: Final = frozenset(
    {
        "cambricon",
        "hygon",
        "metax",
        "mthreads",
        "iluvatar",
        "iluvatars",
        "enflame",
        "kunlun",
        "awsneuron",
        "ascend",
        "vnpus",
        "vastai",
        "amd",
    }
)


def load_config_file(path: str | Path) -> DeviceConfig:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise InvalidConfigError("", f"cannot read config file {p}: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise InvalidConfigError("", f"config file {p} is not UTF-8 text: {e.reason}") from e
    try:
        return load_config(text)
    except InvalidConfigError as e:
        raise InvalidConfigError(e.path, f"{e.problem} (in {p})") from e


def load_config(text: str) -> DeviceConfig:
    raw = _load_yaml(text)
    if raw is None:
        return DeviceConfig()
    if not isinstance(raw, dict):
        raise InvalidConfigError("", "the config must be a mapping with an 'nvidia' section")
    # A ConfigMap wrapping device-config.yaml is accepted as it is.
    if raw.get("kind") == "ConfigMap":
        data = raw.get("data")
        if not isinstance(data, dict) or not isinstance(data.get("device-config.yaml"), str):
            raise InvalidConfigError("data", "ConfigMap has no data['device-config.yaml']")
        return load_config(data["device-config.yaml"])
    return parse_config(cast("dict[str, Any]", raw))


# libyaml's parser where PyYAML has it: PyYAML's pure-Python one takes seconds on a few
# thousand nested "[" (time grows faster than the depth); libyaml's is linear and refuses
# documents nested over 1000 deep. Both build objects with the same safe constructor.
YAML_LOADER: Final[Any] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _load_yaml(text: str) -> Any:
    try:
        return yaml.load(text, Loader=YAML_LOADER)
    except yaml.YAMLError as e:
        raise InvalidConfigError("", f"not valid YAML: {e}") from e
    # PyYAML's constructors raise ValueError for values it scanned but cannot build (a
    # 2024-13-45 timestamp, an int past 4300 digits), and recurse once per nesting level.
    except ValueError as e:
        raise InvalidConfigError("", f"not valid YAML: {e}") from e
    except RecursionError as e:
        raise InvalidConfigError("", "not valid YAML: nested too deeply") from e


def parse_config(raw: Mapping[str, Any]) -> DeviceConfig:
    for key in raw:
        if key not in {"version", "nvidia", "scheduler"} and key not in _VENDOR_SECTIONS:
            raise InvalidConfigError(
                str(key), "unknown section; expected version, nvidia, scheduler"
            )
    version = raw.get("version", CONFIG_VERSION)
    if version != CONFIG_VERSION:
        raise InvalidConfigError(
            "version", f"unsupported {short_repr(version)}; supported: {CONFIG_VERSION}"
        )
    nv = _mapping(raw.get("nvidia", {}), "nvidia")
    sched = _mapping(raw.get("scheduler", {}), "scheduler")
    if "knownMigGeometries" in nv:
        raise InvalidConfigError(
            "nvidia.knownMigGeometries",
            "is no longer supported: MIG geometry now comes from each node's NVML. Replace it "
            "with nvidia.migProfileAllowlist (models + profile names); "
            "`tessera config convert OLD.yaml` writes the converted config",
        )
    known = {
        "resourceCountName",
        "resourceMemoryName",
        "resourceMemoryPercentageName",
        "resourceCoreName",
        "deviceSplitCount",
        "deviceMemoryScaling",
        "defaultMemory",
        "defaultCores",
        "defaultGPUNum",
        "migProfileAllowlist",
        "migPlacementPolicy",
        "nodeconfig",
        "memoryFactor",
        "deviceCoreScaling",
        "resourcePriorityName",
        "gpuCorePolicy",
        "disableCoreLimit",
        "libCudaLogLevel",
        "runtimeClassName",
        "overwriteEnv",
    }
    for key in nv:
        if key not in known and key not in _IGNORED_NVIDIA_KEYS:
            raise InvalidConfigError(
                f"nvidia.{key}", f"unknown field; valid: {', '.join(sorted(known))}"
            )
    d = DeviceConfig()
    sched_known = {"defaultNodePolicy", "defaultGpuPolicy", "nodeScoreResources"}
    for key in sched:
        if key not in sched_known:
            raise InvalidConfigError(
                f"scheduler.{key}", f"unknown field; valid: {', '.join(sorted(sched_known))}"
            )
    resources = _str_list(sched.get("nodeScoreResources", ["gpu"]), "scheduler.nodeScoreResources")
    if "gpu" not in resources or not set(resources) <= {"gpu", "cpu", "memory"}:
        raise InvalidConfigError(
            "scheduler.nodeScoreResources",
            f"must be [gpu] or [gpu, cpu, memory], got {short_repr(resources)}",
        )
    if set(resources) not in ({"gpu"}, {"gpu", "cpu", "memory"}):
        raise InvalidConfigError(
            "scheduler.nodeScoreResources", "cpu and memory are added together: [gpu, cpu, memory]"
        )
    return DeviceConfig(
        resource_count_name=_str(nv, "resourceCountName", d.resource_count_name),
        resource_memory_name=_str(nv, "resourceMemoryName", d.resource_memory_name),
        resource_memory_percentage_name=_str(
            nv, "resourceMemoryPercentageName", d.resource_memory_percentage_name
        ),
        resource_core_name=_str(nv, "resourceCoreName", d.resource_core_name),
        device_split_count=_int(nv, "deviceSplitCount", d.device_split_count, 1, 1000, "nvidia"),
        device_memory_scaling=_float(nv, "deviceMemoryScaling", d.device_memory_scaling, "nvidia"),
        default_memory=_int(nv, "defaultMemory", d.default_memory, 0, 2**31 - 1, "nvidia"),
        default_cores=_int(nv, "defaultCores", d.default_cores, 0, 100, "nvidia"),
        default_gpu_num=_int(nv, "defaultGPUNum", d.default_gpu_num, 1, 64, "nvidia"),
        mig_profile_allowlist=_allowlist(nv.get("migProfileAllowlist")),
        mig_placement_policy=_enum(
            nv, "migPlacementPolicy", PlacementStrategy.parse, d.mig_placement_policy, "nvidia"
        ),
        nodeconfig=_nodeconfig(nv.get("nodeconfig")),
        default_node_policy=_enum(
            sched, "defaultNodePolicy", Policy.parse, d.default_node_policy, "scheduler"
        ),
        default_gpu_policy=_enum(
            sched, "defaultGpuPolicy", _gpu_policy, d.default_gpu_policy, "scheduler"
        ),
        node_score_cpu_memory="cpu" in resources,
        # HAMi reads 0 (its default) as 1.
        memory_factor=max(1, _int(nv, "memoryFactor", d.memory_factor, 0, 1 << 20, "nvidia")),
        device_core_scaling=_float(nv, "deviceCoreScaling", d.device_core_scaling, "nvidia"),
        resource_priority_name=_str(nv, "resourcePriorityName", d.resource_priority_name),
        gpu_core_policy=_choice(
            nv, "gpuCorePolicy", GPU_CORE_POLICIES, d.gpu_core_policy, "nvidia"
        ),
        disable_core_limit=_bool(nv, "disableCoreLimit", d.disable_core_limit, "nvidia"),
        lib_cuda_log_level=_log_level(nv, "libCudaLogLevel", "nvidia"),
        runtime_class_name=_name(nv, "runtimeClassName", "nvidia"),
        overwrite_env=_bool(nv, "overwriteEnv", d.overwrite_env, "nvidia"),
    )


def _choice(m: Mapping[str, Any], key: str, valid: Sequence[T], default: T, sect: str) -> T:
    v = m.get(key, default)
    if v not in valid:
        raise InvalidConfigError(
            f"{sect}.{key}", f"{short_repr(v)} is not one of {', '.join(map(str, valid))}"
        )
    return cast("T", v)


def _bool(m: Mapping[str, Any], key: str, default: bool, sect: str) -> bool:
    v = m.get(key, default)
    if not isinstance(v, bool):
        raise InvalidConfigError(f"{sect}.{key}", f"must be true or false, got {short_repr(v)}")
    return v


def _log_level(m: Mapping[str, Any], key: str, sect: str) -> LibCudaLogLevel | None:
    """HAMi-core's LIBCUDA_LOG_LEVEL: 0 errors, 1 warnings, 3 infos, 4 debugs (a YAML number
    or string)."""
    v = m.get(key)
    if v is None:
        return None
    text = str(v) if isinstance(v, int) and not isinstance(v, bool) else v
    if text not in LIB_CUDA_LOG_LEVELS:
        raise InvalidConfigError(
            f"{sect}.{key}", f"{short_repr(text)} is not one of {', '.join(LIB_CUDA_LOG_LEVELS)}"
        )
    return cast("LibCudaLogLevel", text)


_DNS_SUBDOMAIN: Final = re.compile(r"\A[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?\Z")


def _name(m: Mapping[str, Any], key: str, sect: str) -> str:
    v = m.get(key, "")
    if v == "":
        return ""
    if not isinstance(v, str) or not _DNS_SUBDOMAIN.match(v):
        raise InvalidConfigError(
            f"{sect}.{key}", f"must be a RuntimeClass name (DNS subdomain), got {short_repr(v)}"
        )
    return v


def _gpu_policy(value: str) -> GpuPolicy:
    if not value.strip():
        raise ValueError(
            "is empty; name a GPU policy or a comma chain, e.g. spread or binpack,numa"
        )
    return GpuPolicy.parse(value)


def _mapping(v: object, path: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise InvalidConfigError(path, f"must be a mapping, got {type(v).__name__}")
    return cast("dict[str, Any]", v)


def _str(m: Mapping[str, Any], key: str, default: str) -> str:
    v = m.get(key, default)
    if not isinstance(v, str) or not v:
        raise InvalidConfigError(
            f"nvidia.{key}", f"must be a non-empty string, got {short_repr(v)}"
        )
    return v


def _int(m: Mapping[str, Any], key: str, default: int, lo: int, hi: int, sect: str) -> int:
    v = m.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise InvalidConfigError(f"{sect}.{key}", f"must be an integer, got {short_repr(v)}")
    if not lo <= v <= hi:
        raise InvalidConfigError(f"{sect}.{key}", f"must be between {lo} and {hi}, got {v}")
    return v


def _float(m: Mapping[str, Any], key: str, default: float, sect: str) -> float:
    v = m.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v <= 100:
        raise InvalidConfigError(
            f"{sect}.{key}", f"must be a number in (0, 100], got {short_repr(v)}"
        )
    return float(v)


def _enum(m: Mapping[str, Any], key: str, parse: Any, default: T, sect: str) -> T:
    if key not in m:
        return default
    v = m[key]
    try:
        return cast("T", parse(v) if isinstance(v, str) else parse(short_repr(v)))
    except ValueError as e:
        raise InvalidConfigError(f"{sect}.{key}", str(e)) from None


def _str_list(v: object, path: str) -> list[str]:
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        raise InvalidConfigError(path, f"must be a list of non-empty strings, got {short_repr(v)}")
    return cast("list[str]", v)


def _allowlist(v: object) -> tuple[AllowlistEntry, ...]:
    path = "nvidia.migProfileAllowlist"
    if v is None:
        return DEFAULT_ALLOWLIST
    if not isinstance(v, list):
        raise InvalidConfigError(path, "must be a list of {models, profiles}")
    out: list[AllowlistEntry] = []
    for i, e in enumerate(v):
        ep = f"{path}[{i}]"
        em = _mapping(e, ep)
        extra = set(em) - {"models", "profiles"}
        if extra:
            raise InvalidConfigError(
                f"{ep}.{sorted(map(str, extra))[0]}", "unknown field; valid: models, profiles"
            )
        models = _str_list(em.get("models"), f"{ep}.models")
        profiles = _str_list(em.get("profiles"), f"{ep}.profiles")
        if not models or not profiles:
            raise InvalidConfigError(ep, "models and profiles must both be non-empty")
        for j, p in enumerate(profiles):
            if not _looks_like_profile(p):
                raise InvalidConfigError(
                    f"{ep}.profiles[{j}]",
                    f"{short_repr(p)} is not a MIG profile name like '2g.10gb'",
                )
        out.append(AllowlistEntry(tuple(models), tuple(profiles)))
    return tuple(out)


_PROFILE_RE: Final = re.compile(r"^[1-9][0-9]?g\.[0-9]+gb([+-][a-z.]+)*$")


def _looks_like_profile(name: str) -> bool:
    return bool(_PROFILE_RE.match(name))


def _nodeconfig(v: object) -> tuple[NodeConfig, ...]:
    path = "nvidia.nodeconfig"
    if v is None:
        return ()
    if not isinstance(v, list):
        raise InvalidConfigError(path, "must be a list of {name, operatingmode}")
    out: list[NodeConfig] = []
    names: set[str] = set()
    valid = {
        "name",
        "operatingmode",
        "devicesplitcount",
        "devicememoryscaling",
        "devicecorescaling",
        "libcudaloglevel",
        "filterdevices",
        *_IGNORED_NODE_KEYS,
    }
    for i, e in enumerate(v):
        ep = f"{path}[{i}]"
        em = _mapping(e, ep)
        for key in em:
            if key not in valid:
                raise InvalidConfigError(
                    f"{ep}.{key}", f"unknown field; valid: {', '.join(sorted(valid))}"
                )
        name = em.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidConfigError(f"{ep}.name", "must be a node name")
        if name in names:
            raise InvalidConfigError(f"{ep}.name", f"node {short_repr(name)} is configured twice")
        names.add(name)
        mode = em.get("operatingmode", "hami-core")
        if mode not in GPU_MODES:
            raise InvalidConfigError(
                f"{ep}.operatingmode", f"{short_repr(mode)} is not one of {', '.join(GPU_MODES)}"
            )
        split = em.get("devicesplitcount")
        if split is not None:
            split = _int(em, "devicesplitcount", 10, 1, 1000, ep)
        scaling = em.get("devicememoryscaling")
        if scaling is not None:
            scaling = _float(em, "devicememoryscaling", 1.0, ep)
        core_scaling = em.get("devicecorescaling")
        if core_scaling is not None:
            core_scaling = _float(em, "devicecorescaling", 1.0, ep)
        log_level = _log_level(em, "libcudaloglevel", ep)
        uuids, indexes = _filter_devices(em.get("filterdevices"), f"{ep}.filterdevices")
        out.append(
            NodeConfig(
                name,
                cast("GpuMode", mode),
                split,
                scaling,
                core_scaling,
                log_level,
                uuids,
                indexes,
            )
        )
    return tuple(out)


def convert_known_geometries(text: str) -> str:
    """Turn a config with ``knownMigGeometries`` into one with ``migProfileAllowlist``.

    The allowlist of each models entry is the union, in first-seen order, of every profile
    name any of its allowed geometries used. Everything else is kept as it was.
    """
    root = _mapping(_load_yaml(text), "")
    nv = _mapping(root.get("nvidia", {}), "nvidia")
    old = nv.get("knownMigGeometries")
    if old is None:
        raise InvalidConfigError("nvidia.knownMigGeometries", "not present; nothing to convert")
    if not isinstance(old, list):
        raise InvalidConfigError("nvidia.knownMigGeometries", "must be a list")
    allow: list[dict[str, list[str]]] = []
    for i, entry in enumerate(old):
        ep = f"nvidia.knownMigGeometries[{i}]"
        em = _mapping(entry, ep)
        models = _str_list(em.get("models"), f"{ep}.models")
        geoms = em.get("allowedGeometries")
        if not isinstance(geoms, list):
            raise InvalidConfigError(f"{ep}.allowedGeometries", "must be a list of geometries")
        names: list[str] = []
        for j, geom in enumerate(geoms):
            items = geom if isinstance(geom, list) else [geom]
            for k, item in enumerate(items):
                gm = _mapping(item, f"{ep}.allowedGeometries[{j}][{k}]")
                name = gm.get("name")
                if not isinstance(name, str) or not name:
                    raise InvalidConfigError(f"{ep}.allowedGeometries[{j}][{k}].name", "missing")
                if name not in names:
                    names.append(name)
        allow.append({"models": list(models), "profiles": names})
    new_nv: dict[str, Any] = {}
    for key, value in nv.items():
        if key == "knownMigGeometries":
            new_nv["migProfileAllowlist"] = allow
        else:
            new_nv[key] = value
    out = dict(root)
    out["nvidia"] = new_nv
    converted = yaml.safe_dump(out, sort_keys=False)
    parse_config(cast("dict[str, Any]", yaml.safe_load(converted)))  # the output must load
    return converted


def profile_names(entries: Sequence[AllowlistEntry]) -> frozenset[str]:
    return frozenset(p for e in entries for p in e.profiles)


def _filter_devices(v: object, path: str) -> tuple[frozenset[str], frozenset[int]]:
    """HAMi's ``filterdevices: {uuid: [...], index: [...]}``."""
    if v is None:
        return frozenset(), frozenset()
    m = _mapping(v, path)
    extra = set(m) - {"uuid", "index"}
    if extra:
        raise InvalidConfigError(
            f"{path}.{sorted(map(str, extra))[0]}", "unknown field; valid: uuid, index"
        )
    uuids = _str_list(m.get("uuid") or [], f"{path}.uuid")
    indexes = m.get("index") or []
    if not isinstance(indexes, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 1024 for i in indexes
    ):
        raise InvalidConfigError(
            f"{path}.index", f"must be a list of GPU indexes, got {short_repr(indexes)}"
        )
    return frozenset(uuids), frozenset(indexes)
