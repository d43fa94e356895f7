"""Hostile ``device-config.yaml`` files: ``load_config`` and ``tessera config convert`` either
return a config whose every field is in range, or raise ``InvalidConfigError`` with a short
message naming the field path; nothing else escapes, however the YAML is mangled (alias
bombs, deep nesting, timestamps and ints PyYAML cannot build, unhashable keys)."""

from __future__ import annotations

import copy
import time
from typing import Any

import yaml
from hypothesis import given
from hypothesis import strategies as st

from api.hami.config import (
    DeviceConfig,
    InvalidConfigError,
    convert_known_geometries,
    load_config,
)
from api.hami.policy import GpuPolicy, PlacementStrategy, Policy
from tests.fuzzing import (
    MAX_MESSAGE,
    FuzzLedger,
    fuzz_settings,
    json_values,
    mutate_json,
    mutate_text,
)

VALID_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "resourceCountName": st.sampled_from(["nvidia.com/gpu", "example.com/vgpu"]),
    "resourceMemoryName": st.just("nvidia.com/gpumem"),
    "resourceCoreName": st.just("nvidia.com/gpucores"),
    "deviceSplitCount": st.integers(1, 1000),
    "deviceMemoryScaling": st.floats(0.1, 100),
    "defaultMemory": st.integers(0, 2**31 - 1),
    "defaultCores": st.integers(0, 100),
    "defaultGPUNum": st.integers(1, 64),
    "migPlacementPolicy": st.sampled_from([s.value for s in PlacementStrategy]),
    "migProfileAllowlist": st.lists(
        st.fixed_dictionaries(
            {
                "models": st.lists(st.sampled_from(["A100-PCIE-40GB", "H100 80GB"]), min_size=1),
                "profiles": st.lists(st.sampled_from(["1g.5gb", "2g.10gb", "7g.80gb"]), min_size=1),
            }
        ),
        max_size=3,
    ),
    "nodeconfig": st.lists(
        st.fixed_dictionaries(
            {"name": st.sampled_from(["n1", "n2", "n3"])},
            optional={
                "operatingmode": st.sampled_from(["hami-core", "mig"]),
                "devicesplitcount": st.integers(1, 1000),
            },
        ),
        max_size=3,
        unique_by=lambda n: n["name"],
    ),
    "gpuCorePolicy": st.just("default"),
}
valid_docs = st.fixed_dictionaries(
    {},
    optional={
        "version": st.just("v1"),
        "nvidia": st.fixed_dictionaries({}, optional=VALID_FIELDS),
        "scheduler": st.fixed_dictionaries(
            {},
            optional={
                "defaultNodePolicy": st.sampled_from(["binpack", "spread"]),
                "defaultGpuPolicy": st.sampled_from(["binpack", "spread"]),
                "nodeScoreResources": st.sampled_from([["gpu"], ["gpu", "cpu", "memory"]]),
            },
        ),
    },
)

# YAML that PyYAML tokenizes but cannot (or should not) build into a config.
YAML_TRAPS = (
    "nvidia:\n  deviceSplitCount: 2024-13-45\n",
    "nvidia:\n  deviceSplitCount: " + "9" * 5000 + "\n",
    "nvidia:\n  deviceMemoryScaling: .nan\n",
    "nvidia:\n  deviceMemoryScaling: .inf\n",
    "nvidia:\n  migProfileAllowlist:\n  - {models: [a], profiles: [1g.5gb], 1: x, z: y}\n",
    "? [a, b]\n: c\n",
    "nvidia: !!python/object:os.system x\n",
    "nvidia: !!binary AAAA\n",
    "[" * 3000 + "]" * 3000,
    "a: " + "{a: " * 3000 + "1" + "}" * 3000,
    "version: v1\nnvidia: &a\n  defaultGPUNum: *a\n",
    "kind: ConfigMap\ndata:\n  device-config.yaml: 'kind: ConfigMap'\n",
    "kind: ConfigMap\ndata: [1]\n",
    "\ufeffnvidia: {}\n",
    "nvidia:\n  nodeconfig:\n  - name: n\n    operatingmode: [mig]\n",
    "nvidia: {migPlacementPolicy: {a: b}}\n",
)


def alias_bomb(levels: int, leaf: str = "x") -> str:
    """A billion-laughs value in flow style: tiny text, 9**levels leaves if expanded."""
    parts = [f"&a0 [{', '.join([leaf] * 9)}]"]
    for i in range(1, levels):
        parts.append(f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]")
    return f"[{', '.join(parts)}]"


def bomb_inside(field: str, levels: int) -> str:
    return f"nvidia:\n  {field}: {alias_bomb(levels)}\n"


bombs = st.builds(
    bomb_inside,
    st.sampled_from(["resourceCountName", "deviceSplitCount", "migPlacementPolicy", "nodeconfig"]),
    st.integers(2, 9),
)


@st.composite
def hostile_config_text(draw: st.DrawFn) -> str:
    doc = draw(valid_docs)
    data = draw(st.data())
    how = draw(st.sampled_from(["valid", "tree", "text", "trap", "bomb", "garbage", "configmap"]))
    if how == "valid":
        return yaml.safe_dump(doc)
    if how == "tree":
        return yaml.safe_dump(mutate_json(copy.deepcopy(doc), data), allow_unicode=True)
    if how == "text":
        return mutate_text(yaml.safe_dump(doc), data)
    if how == "trap":
        return draw(st.sampled_from(YAML_TRAPS))
    if how == "bomb":
        return draw(bombs)
    if how == "configmap":
        inner = yaml.safe_dump(doc)
        if draw(st.booleans()):
            inner = mutate_text(inner, data)
        return yaml.safe_dump({"kind": "ConfigMap", "data": {"device-config.yaml": inner}})
    return draw(st.text(max_size=300) | json_values.map(yaml.safe_dump))


def _check_config(c: DeviceConfig) -> None:
    assert 1 <= c.device_split_count <= 1000
    assert 0 < c.device_memory_scaling <= 100
    assert 0 <= c.default_cores <= 100 and 1 <= c.default_gpu_num <= 64
    assert isinstance(c.default_node_policy, Policy) and isinstance(c.default_gpu_policy, GpuPolicy)
    assert isinstance(c.mig_placement_policy, PlacementStrategy)
    for entry in c.mig_profile_allowlist:
        assert entry.models and entry.profiles
    for n in c.nodeconfig:
        assert n.operating_mode in ("hami-core", "mig") and c.node(n.name) == n
    c.allowed_profiles("NVIDIA A100-PCIE-40GB")


@fuzz_settings(150)
@given(text=hostile_config_text())
def test_hostile_config_loads_or_names_the_field(fuzz_ledger: FuzzLedger, text: str) -> None:
    with fuzz_ledger.case("config/device-config.yaml") as case:
        try:
            config = load_config(text)
        except InvalidConfigError as e:
            case.rejected(str(e))
            assert len(str(e)) <= MAX_MESSAGE, str(e)[:300]
        else:
            _check_config(config)


old_geometry_docs = st.fixed_dictionaries(
    {
        "nvidia": st.fixed_dictionaries(
            {
                "knownMigGeometries": st.lists(
                    st.fixed_dictionaries(
                        {
                            "models": st.lists(st.sampled_from(["A30", "A100"]), min_size=1),
                            "allowedGeometries": st.lists(
                                st.lists(
                                    st.fixed_dictionaries(
                                        {
                                            "name": st.sampled_from(["1g.5gb", "2g.10gb"]),
                                            "memory": st.integers(1, 50000),
                                            "count": st.integers(1, 7),
                                        }
                                    ),
                                    max_size=3,
                                ),
                                max_size=3,
                            ),
                        }
                    ),
                    min_size=1,
                    max_size=2,
                )
            }
        )
    }
)  # fmt: skip


@fuzz_settings(80)
@given(doc=old_geometry_docs, data=st.data())
def test_hostile_old_config_converts_or_names_the_field(
    fuzz_ledger: FuzzLedger, doc: dict[str, Any], data: st.DataObject
) -> None:
    text = yaml.safe_dump(mutate_json(doc, data) if data.draw(st.booleans()) else doc)
    with fuzz_ledger.case("config/convert") as case:
        try:
            converted = convert_known_geometries(text)
        except InvalidConfigError as e:
            case.rejected(str(e))
            assert len(str(e)) <= MAX_MESSAGE
            return
        _check_config(load_config(converted))


def test_alias_bomb_in_any_field_fails_fast_with_a_short_message() -> None:
    t0 = time.monotonic()
    for field in ("resourceCountName", "deviceSplitCount", "migPlacementPolicy", "nodeconfig"):
        try:
            load_config(bomb_inside(field, 12))
        except InvalidConfigError as e:
            assert f"nvidia.{field}" in str(e) and len(str(e)) < 400
    assert time.monotonic() - t0 < 2.0
