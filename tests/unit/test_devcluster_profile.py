"""Node profiles of the dev cluster: parsing, validation with field paths, the model mix."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from api.hami.config import DeviceConfig
from api.hami.keys import NODE_REGISTER
from api.hami.register import decode
from scheduler_plugins.devtools.cluster.errors import ProfileError
from scheduler_plugins.devtools.cluster.nodes import (
    NodeGroup,
    NodeProfile,
    load_profile,
    node_object,
    parse_profile,
    plan,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cluster-profile.yaml"


def profile(**top: Any) -> dict[str, Any]:
    return {"version": "v1", "groups": [{"model": "A100-PCIE-40GB"}], **top}


def test_example_profile_loads_with_its_mix() -> None:
    p = load_profile(EXAMPLE)
    assert [g.model for g in p.groups] == [
        "A100-PCIE-40GB",
        "A100-SXM4-80GB",
        "H100 80GB",
        "H200",
        "RTX PRO 6000",
        "A100-PCIE-40GB",
    ]
    rtx = p.groups[-2]
    assert (rtx.gpus_per_node, rtx.cpu, rtx.memory, rtx.mode) == (4, "64", "512Gi", "hami-core")
    assert p.groups[2].labels == {"gpu": "on", "tessera.dev/pool": "h100"}
    assert (p.groups[-1].mode, p.groups[-1].labels["tessera.dev/pool"]) == ("mps", "mps")
    counts = Counter((g.model, g.mode) for _, g in plan(p, 100, 0))
    assert counts == {
        ("A100-PCIE-40GB", "hami-core"): 30,
        ("A100-SXM4-80GB", "mig"): 20,
        ("H100 80GB", "mig"): 20,
        ("H200", "hami-core"): 10,
        ("RTX PRO 6000", "hami-core"): 10,
        ("A100-PCIE-40GB", "mps"): 10,
    }


def test_round_robin_interleaves_groups() -> None:
    p = NodeProfile(groups=(NodeGroup("A100-PCIE-40GB", weight=2), NodeGroup("H200")))
    assert [g.model for g in p.schedule()] == ["A100-PCIE-40GB", "H200", "A100-PCIE-40GB"]


def test_plan_names_nodes_from_the_start_index() -> None:
    names = [n for n, _ in plan(NodeProfile(name_prefix="pool"), 3, 98)]
    assert names == ["pool-0098", "pool-0099", "pool-0100"]


def test_defaults_apply_to_groups_and_groups_override_them() -> None:
    p = parse_profile(
        profile(
            defaults={"gpusPerNode": 2, "labels": {"a": "1"}},
            groups=[{"model": "H200"}, {"model": "H200", "gpusPerNode": 4, "labels": {"b": "2"}}],
        ),
        base_dir=Path("."),
    )
    assert [(g.gpus_per_node, dict(g.labels)) for g in p.groups] == [
        (2, {"a": "1"}),
        (4, {"a": "1", "b": "2"}),
    ]


@pytest.mark.parametrize(
    ("raw", "path", "words"),
    [
        (profile(groups=[{"model": "Z9000"}]), "groups[0].model", "unknown GPU model"),
        (profile(groups=[{"model": "L4", "mode": "mig"}]), "groups[0].mode", "not MIG-capable"),
        (profile(groups=[{"model": "H200", "mode": "vgpu"}]), "groups[0].mode", "hami-core"),
        (profile(groups=[{"model": "H200", "gpus": 8}]), "groups[0].gpus", "unknown field"),
        (profile(groups=[{"model": "H200", "memory": "lots"}]), "groups[0].memory", "quantity"),
        (profile(groups=[{"model": "H200", "gpusPerNode": 0}]), "groups[0].gpusPerNode", "1..16"),
        (
            profile(groups=[{"model": "H200", "labels": {"a b": "x"}}]),
            "groups[0].labels.a b",
            "label",
        ),
        (profile(groups=[]), "groups", "non-empty"),
        (profile(version="v9"), "version", "unsupported"),
        (profile(namePrefix="Bad_Prefix"), "namePrefix", "DNS"),
        (profile(defaults={"model": "H200"}), "defaults.model", "unknown field"),
    ],
)
def test_invalid_profiles_name_the_bad_field(raw: dict[str, Any], path: str, words: str) -> None:
    with pytest.raises(ProfileError) as err:
        parse_profile(raw, base_dir=Path("."))
    assert err.value.path == path
    assert words in str(err.value)


def test_node_object_carries_kwok_markers_resources_and_register_annotation() -> None:
    group = NodeGroup("H100 80GB", gpus_per_node=8, mode="mig", labels={"gpu": "on"})
    node = node_object("gpu-node-0007", group, DeviceConfig(), now=0.0)
    meta = node["metadata"]
    assert meta["labels"]["type"] == "kwok"
    assert meta["labels"]["gpu"] == "on"
    assert meta["annotations"]["kwok.x-k8s.io/node"] == "fake"
    # the slots its GPUs register: in mig mode HAMi's count, seven 1g.10gb per H100
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "56"
    assert node["status"]["capacity"] == node["status"]["allocatable"]
    devices = decode(meta["annotations"][NODE_REGISTER])
    assert len(devices) == 8 and sum(d.count for d in devices) == 56
    assert all(d.mode == "mig" and d.mig_profiles for d in devices)


def test_node_object_uses_the_device_config_split_count() -> None:
    group = NodeGroup("A100-PCIE-40GB", gpus_per_node=4)
    node = node_object("n", group, DeviceConfig(device_split_count=5), now=0.0)
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "20"


def test_mps_node_registers_mps_gpus_and_at_most_the_client_limit_of_slots() -> None:
    [group] = parse_profile(
        profile(groups=[{"model": "A100-PCIE-40GB", "mode": "mps", "gpusPerNode": 2}]),
        base_dir=Path("."),
    ).groups
    assert group == NodeGroup("A100-PCIE-40GB", gpus_per_node=2, mode="mps")
    node = node_object("n", group, DeviceConfig(device_split_count=100), now=0.0)
    devices = decode(node["metadata"]["annotations"][NODE_REGISTER])
    assert [(d.mode, d.count, d.health) for d in devices] == [("mps", 48, True)] * 2
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "96"
