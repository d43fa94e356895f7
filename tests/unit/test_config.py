from __future__ import annotations

import pytest

from api.errors import InvalidConfigError
from api.hami.config import DeviceConfig, convert_known_geometries, load_config
from api.hami.policy import GpuPolicy, GpuSortKey, PlacementStrategy, Policy


def test_empty_config_gives_defaults() -> None:
    cfg = load_config("")
    assert cfg == DeviceConfig()
    assert cfg.device_split_count == 10
    assert cfg.default_node_policy is Policy.BINPACK
    assert cfg.default_gpu_policy == GpuPolicy((GpuSortKey.SPREAD,))
    assert cfg.mig_placement_policy is PlacementStrategy.FRAGMENTATION_AWARE


def test_spec_example_loads() -> None:
    cfg = load_config(
        """
nvidia:
  resourceCountName: nvidia.com/gpu
  resourceMemoryName: nvidia.com/gpumem
  resourceCoreName: nvidia.com/gpucores
  deviceSplitCount: 10
  migProfileAllowlist:
    - models: ["A100-SXM4-40GB", "A100-PCIE-40GB"]
      profiles: ["1g.5gb", "2g.10gb", "3g.20gb", "7g.40gb"]
  nodeconfig:
    - name: nodeA
      operatingmode: hami-core
    - name: nodeB
      operatingmode: mig
"""
    )
    assert cfg.node("nodeB").operating_mode == "mig"
    assert cfg.node("unknown").operating_mode == "hami-core"
    assert cfg.allowed_profiles("NVIDIA A100-PCIE-40GB") == (
        "1g.5gb",
        "2g.10gb",
        "3g.20gb",
        "7g.40gb",
    )
    assert cfg.allowed_profiles("NVIDIA H100 80GB HBM3") == ()


@pytest.mark.parametrize(
    ("device", "first_profile"),
    [
        ("NVIDIA A30", "1g.6gb"),
        ("NVIDIA A100-SXM4-80GB", "1g.10gb"),
        ("NVIDIA H100 80GB HBM3", "1g.10gb"),
        ("NVIDIA H100 NVL", "1g.12gb"),
        ("NVIDIA H20", "1g.12gb"),
        ("NVIDIA H200", "1g.18gb"),
        ("NVIDIA H200 NVL", "1g.18gb"),
        ("NVIDIA GH200 480GB", "1g.12gb"),
        ("NVIDIA B200", "1g.23gb"),
        ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "1g.24gb"),
    ],
)
def test_default_allowlist_covers_spec_models(device: str, first_profile: str) -> None:
    assert DeviceConfig().allowed_profiles(device)[0] == first_profile


def test_no_allowlisted_model_is_shadowed_by_an_earlier_entry() -> None:
    """Models match as substrings, first entry first: a GPU named after each model gets that
    model's entry, not an earlier one whose model is part of its name (GH200 holds H200)."""
    cfg = DeviceConfig()
    for entry in cfg.mig_profile_allowlist:
        for model in entry.models:
            assert cfg.allowed_profiles(f"NVIDIA {model}") == entry.profiles, model


def test_the_fragmentation_node_policy_loads() -> None:
    cfg = load_config("scheduler: {defaultNodePolicy: fragmentation}")
    assert cfg.default_node_policy is Policy.FRAGMENTATION


@pytest.mark.parametrize(
    ("text", "path", "fragment"),
    [
        ("nvidia: {deviceSplitCount: 0}", "nvidia.deviceSplitCount", "between 1 and 1000"),
        ("nvidia: {deviceSplitcount: 5}", "nvidia.deviceSplitcount", "unknown field"),
        ("nvidia: {migPlacementPolicy: best}", "nvidia.migPlacementPolicy", "fragmentation-aware"),
        (
            "scheduler: {defaultNodePolicy: pack}",
            "scheduler.defaultNodePolicy",
            "binpack, spread, fragmentation",
        ),
        (
            "nvidia: {nodeconfig: [{name: a, operatingmode: vgpu}]}",
            "nvidia.nodeconfig[0].operatingmode",
            "hami-core, mig",
        ),
        (
            "nvidia: {nodeconfig: [{name: a}, {name: a}]}",
            "nvidia.nodeconfig[1].name",
            "configured twice",
        ),
        (
            "nvidia: {migProfileAllowlist: [{models: [A30], profiles: [big]}]}",
            "nvidia.migProfileAllowlist[0].profiles[0]",
            "not a MIG profile name",
        ),
        (
            "nvidia: {migProfileAllowlist: [{models: [A30]}]}",
            "nvidia.migProfileAllowlist[0].profiles",
            "list of non-empty strings",
        ),
        ("scheduler: {nodeScoreResources: [gpu, cpu]}", "scheduler.nodeScoreResources", "together"),
        ("version: v9", "version", "unsupported"),
        ("gpus: {}", "gpus", "unknown section"),
        ("nvidia: [1]", "nvidia", "must be a mapping"),
    ],
)
def test_invalid_config_names_the_field(text: str, path: str, fragment: str) -> None:
    with pytest.raises(InvalidConfigError) as e:
        load_config(text)
    assert e.value.path == path
    assert fragment in str(e.value)


OLD = """
nvidia:
  deviceSplitCount: 10
  knownMigGeometries:
  - models: [ "A30" ]
    allowedGeometries:
      - - name: 1g.6gb
          memory: 6144
          count: 4
      - - name: 2g.12gb
          memory: 12288
          count: 2
        - name: 1g.6gb
          memory: 6144
          count: 2
  - models: [ "A100-SXM4-40GB", "A100-PCIE-40GB" ]
    allowedGeometries:
      - - name: 7g.40gb
          memory: 40960
          count: 1
"""


def test_known_mig_geometries_is_rejected_with_directions() -> None:
    with pytest.raises(InvalidConfigError) as e:
        load_config(OLD)
    assert e.value.path == "nvidia.knownMigGeometries"
    assert "tessera config convert" in str(e.value)
    assert "migProfileAllowlist" in str(e.value)


def test_convert_builds_allowlist_from_union_of_geometries() -> None:
    cfg = load_config(convert_known_geometries(OLD))
    assert cfg.device_split_count == 10
    assert cfg.allowed_profiles("NVIDIA A30") == ("1g.6gb", "2g.12gb")
    assert cfg.allowed_profiles("NVIDIA A100-PCIE-40GB") == ("7g.40gb",)


def test_configmap_wrapper_is_accepted() -> None:
    cm = """
apiVersion: v1
kind: ConfigMap
metadata: {name: hami-scheduler-device}
data:
  device-config.yaml: |
    nvidia:
      deviceSplitCount: 4
"""
    assert load_config(cm).device_split_count == 4


@pytest.mark.parametrize(
    ("value", "keys", "mutex", "topology"),
    [
        ("spread", (GpuSortKey.SPREAD,), False, False),
        ("binpack, numa", (GpuSortKey.BINPACK, GpuSortKey.NUMA), False, False),
        ("topology-aware", (GpuSortKey.SPREAD,), False, True),
        ("mutex,binpack", (GpuSortKey.BINPACK,), True, False),
    ],
)
def test_default_gpu_policy_is_a_chain_as_hamis_flag(
    value: str, keys: tuple[GpuSortKey, ...], mutex: bool, topology: bool
) -> None:
    policy = load_config(f"scheduler:\n  defaultGpuPolicy: '{value}'\n").default_gpu_policy
    assert (policy.keys, policy.mutex, policy.topology_aware) == (keys, mutex, topology)
    assert policy.chain == ("," in value)


@pytest.mark.parametrize(
    ("value", "problem"),
    [("closest", "unknown GPU policy 'closest'"), ("' '", "is empty"), ("3", "unknown GPU")],
)
def test_default_gpu_policy_refuses_what_it_cannot_apply(value: str, problem: str) -> None:
    with pytest.raises(InvalidConfigError, match=problem) as e:
        load_config(f"scheduler:\n  defaultGpuPolicy: {value}\n")
    assert "scheduler.defaultGpuPolicy" in str(e.value)


HAMI_V2_10_NVIDIA = """
nvidia:
  resourceCountName: nvidia.com/gpu
  resourceMemoryName: nvidia.com/gpumem
  resourceMemoryPercentageName: nvidia.com/gpumem-percentage
  resourceCoreName: nvidia.com/gpucores
  resourcePriorityName: nvidia.com/priority
  overwriteEnv: true
  defaultMemory: 0
  defaultCores: 0
  defaultGPUNum: 1
  memoryFactor: 1024
  disableCoreLimit: false
  gpuCorePolicy: force
  runtimeClassName: nvidia
  deviceSplitCount: 10
  deviceMemoryScaling: 1
  deviceCoreScaling: 2
  preConfiguredDeviceMemory: 40960
  libCudaLogLevel: 1
  enableNumaTopology: true
  migProfileAllowlist:
    - models: [A100-SXM4-40GB]
      profiles: [1g.5gb, 2g.10gb]
  nodeconfig:
    - name: gpu-1
      operatingmode: mps
      devicesplitcount: 4
      devicecorescaling: 1.5
      libcudaloglevel: 4
      migstrategy: none
      filterdevices: {uuid: [GPU-a], index: [3]}
      enablegetpreferredallocation: true
      preconfigureddevicememory: 1000
      enablenumatopology: false
"""


def test_every_key_of_a_hami_v2_10_nvidia_section_loads() -> None:
    cfg = load_config(HAMI_V2_10_NVIDIA)
    assert (cfg.memory_factor, cfg.device_core_scaling) == (1024, 2.0)
    assert (cfg.gpu_core_policy, cfg.disable_core_limit, cfg.lib_cuda_log_level) == (
        "force",
        False,
        "1",
    )
    assert (cfg.runtime_class_name, cfg.overwrite_env) == ("nvidia", True)
    node = cfg.node("gpu-1")
    assert (node.operating_mode, node.device_split_count, node.device_core_scaling) == (
        "mps",
        4,
        1.5,
    )
    assert node.lib_cuda_log_level == "4"
    assert not node.registers("GPU-a", 0) and not node.registers("GPU-b", 3)
    assert node.registers("GPU-b", 0)


def test_memory_factor_zero_reads_as_one_as_in_hami() -> None:
    assert load_config("nvidia:\n  memoryFactor: 0\n").memory_factor == 1


@pytest.mark.parametrize(
    ("text", "path", "problem"),
    [
        ("nvidia:\n  gpuCorePolicy: off\n", "nvidia.gpuCorePolicy", "default, force, disable"),
        ("nvidia:\n  libCudaLogLevel: 2\n", "nvidia.libCudaLogLevel", "0, 1, 3, 4"),
        ("nvidia:\n  overwriteEnv: 'yes'\n", "nvidia.overwriteEnv", "true or false"),
        ("nvidia:\n  runtimeClassName: Bad_Name\n", "nvidia.runtimeClassName", "RuntimeClass"),
        ("nvidia:\n  memoryFactor: -1\n", "nvidia.memoryFactor", "between 0"),
        ("nvidia:\n  deviceCoreScaling: 0\n", "nvidia.deviceCoreScaling", "(0, 100]"),
        (
            "nvidia:\n  nodeconfig:\n    - name: n\n      filterdevices: {index: [x]}\n",
            "nvidia.nodeconfig[0].filterdevices.index",
            "GPU indexes",
        ),
        (
            "nvidia:\n  nodeconfig:\n    - name: n\n      filterdevices: {name: [a]}\n",
            "nvidia.nodeconfig[0].filterdevices.name",
            "uuid, index",
        ),
    ],
)
def test_hami_settings_with_bad_values_name_the_field(text: str, path: str, problem: str) -> None:
    with pytest.raises(InvalidConfigError) as e:
        load_config(text)
    assert e.value.path == path and problem in e.value.problem
