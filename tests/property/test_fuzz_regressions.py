"""Inputs the bad-input suites found crashing (or hanging) Tessera, kept as fixed cases.

Each used to escape as an unexpected exception (``decimal.Overflow``, ``OverflowError``,
``RecursionError``, a ``ValueError`` from ``int()`` or PyYAML, ``TypeError``) or to take
seconds; each must now end in the documented error, quickly.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from api.errors import InvalidRequestError
from api.hami.config import InvalidConfigError, load_config, load_config_file
from api.hami.matching import is_candidate
from api.kube.objects import parse_quantity
from node_agent.deviceplugin.ids import InvalidDeviceIdError, gpu_of, prefer_spread
from node_agent.pod_matching import NoMatchingPodError, match_pod
from scheduler_plugins.core.nodes import parse_node
from scheduler_plugins.core.requests import parse_request
from scheduler_plugins.simulate import SimulationInputError, load_objects
from tests.builders import make_pod
from tests.fuzzing import CONFIG

FAST_S = 1.0


@pytest.mark.parametrize(
    "value",
    ["1e999999999", "1e999999Ki", "1e900000", float("inf"), float("nan"), 2**80, "9" * 30, 1e300],
    ids=repr,
)
def test_out_of_range_quantities_are_invalid_not_a_crash(value: object) -> None:
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="quantity"):
        parse_quantity(value)
    for resource in ("cpu", "memory", "nvidia.com/gpu", "nvidia.com/gpumem"):
        limits: dict[str, Any] = {"nvidia.com/gpu": 1, resource: value}
        pod = make_pod("p").container("c", **limits).build()
        with pytest.raises(InvalidRequestError, match="container 'c'"):
            parse_request(pod, CONFIG)
    node = {"metadata": {"name": "n"}, "status": {"allocatable": {"cpu": value, "memory": value}}}
    assert (parse_node(node).cpu_milli, parse_node(node).memory_bytes) == (0, 0)
    assert time.monotonic() - t0 < FAST_S


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("nvidia:\n  deviceSplitCount: 2024-13-45\n", "not valid YAML: month must be in 1..12"),
        ("nvidia:\n  deviceSplitCount: " + "9" * 5000 + "\n", "not valid YAML: Exceeds the limit"),
        ("[" * 3000 + "]" * 3000, "not valid YAML"),
        ("a: " + "{a: " * 3000 + "1" + "}" * 3000, "not valid YAML"),
        (
            "nvidia:\n  migProfileAllowlist:\n  - {models: [a], profiles: [1g.5gb], 1: x, z: y}\n",
            "nvidia.migProfileAllowlist[0].1: unknown field",
        ),
        (
            "nvidia:\n  migPlacementPolicy: [&a [x,x,x,x,x,x,x,x,x],"
            + "".join(
                f" &{b} [{', '.join([f'*{a}'] * 9)}],"
                for a, b in zip("abcdefg", "bcdefgh", strict=True)
            )
            + "]\n",
            "nvidia.migPlacementPolicy: unknown MIG placement strategy",
        ),
        ("scheduler:\n  defaultGpuPolicy: '" + "1" * 5000 + "'\n", "scheduler.defaultGpuPolicy"),
    ],
    ids=["timestamp", "huge-int", "deep-list", "deep-map", "mixed-keys", "alias-bomb", "long"],
)
def test_hostile_config_yaml_is_an_invalid_config(text: str, problem: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(InvalidConfigError) as e:
        load_config(text)
    assert problem in str(e.value) and len(str(e.value)) < 400
    assert time.monotonic() - t0 < FAST_S


@pytest.mark.parametrize(
    "text",
    ["kind: 5\n", "a: 2024-13-45\n", "[" * 3000 + "]" * 3000, "kind: [List]\nitems: []\n"],
    ids=["kind-int", "timestamp", "deep", "kind-list"],
)
def test_hostile_simulate_input_is_a_simulation_input_error(text: str, tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    with pytest.raises(SimulationInputError, match=str(path)):
        load_objects(path)


@pytest.mark.parametrize("device", ["GPU-a-" + "1" * 5000, "GPU-a-1234567890", "GPU-a-01"])
def test_device_ids_with_impossible_slots_are_invalid_ids(device: str) -> None:
    with pytest.raises(InvalidDeviceIdError, match="expected <gpu-uuid>-<slot>"):
        gpu_of(device)
    with pytest.raises(InvalidDeviceIdError):
        prefer_spread([device], [], 1)
    assert len(str(InvalidDeviceIdError(device, "x"))) < 200


@pytest.mark.parametrize(
    ("pod", "candidate"),
    [
        ({"metadata": [], "spec": {"nodeName": "n"}}, False),
        ({"metadata": {"annotations": {"hami.io/bind-phase": 1}}, "spec": "n"}, False),
        ({"metadata": {"annotations": ["allocating"]}, "status": 3}, False),
        (["not", "a", "pod"], False),
        (
            {"metadata": {"annotations": {"hami.io/bind-phase": "allocating",
                                          "hami.io/vgpu-node": "n",
                                          "hami.io/vgpu-devices-to-allocate": 5}}},
            True,  # a candidate whose non-string entry reads as nothing left to allocate
        ),
    ],
)  # fmt: skip
def test_malformed_pod_objects_do_not_crash_matching(pod: Any, candidate: bool) -> None:
    assert is_candidate(pod, "n") is candidate
    with pytest.raises(NoMatchingPodError, match="no pod on node n"):
        match_pod([pod], "n", ["GPU-a-0"])


def test_binary_config_and_simulate_files_are_invalid_input(tmp_path: Path) -> None:
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"nvidia:\n  resourceCountName: \xff\xfe\n")
    with pytest.raises(InvalidConfigError, match="is not UTF-8 text"):
        load_config_file(path)
    with pytest.raises(SimulationInputError, match="not valid YAML"):
        load_objects(path)
