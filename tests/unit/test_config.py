from __future__ import annotations

import pytest

from api.errors import InvalidConfigError
from api.hami.config import DeviceConfig, convert_known_geometries, load_config
from api.hami.policy import PlacementStrategy, Policy


def test_empty_config_gives_defaults() -> None:
    cfg = load_config("")
    assert cfg == DeviceConfig()
    assert cfg.device_split_count == 10
    assert cfg.default_node_policy is Policy.BINPACK
    assert cfg.default_gpu_policy is Policy.SPREAD
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
        ("NVIDIA B200", "1g.23gb"),
        ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "1g.24gb"),
    ],
)
def test_default_allowlist_covers_spec_models(device: str, first_profile: str) -> None:
    assert DeviceConfig().allowed_profiles(device)[0] == first_profile


@pytest.mark.parametrize(
    ("text", "path", "fragment"),
    [
        ("nvidia: {deviceSplitCount: 0}", "nvidia.deviceSplitCount", "between 1 and 1000"),
        ("nvidia: {deviceSplitcount: 5}", "nvidia.deviceSplitcount", "unknown field"),
        ("nvidia: {migPlacementPolicy: best}", "nvidia.migPlacementPolicy", "fragmentation-aware"),
        ("scheduler: {defaultNodePolicy: pack}", "scheduler.defaultNodePolicy", "binpack, spread"),
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
