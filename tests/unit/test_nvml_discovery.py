"""discover() registers exactly what the simulated kwok nodes register."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from api.errors import InvalidConfigError
from api.hami.catalog import MODELS, simulated_devices
from api.hami.config import DeviceConfig, load_config
from api.hami.keys import GpuMode
from api.hami.register import decode, encode, registered_type
from node_agent.nvml import (
    BACKEND_KINDS,
    GpuInstanceProfileInfo,
    PynvmlBackend,
    SimulatedGpuSpec,
    SimulatedNvml,
    backend_from_env,
    make_backend,
)
from node_agent.nvml.backend import DeviceInfo
from node_agent.nvml.discovery import discover, unregistered

A100 = "NVIDIA A100-PCIE-40GB"
MIG_MODELS = [m.name for m in MODELS if m.mig_capable]


def node(model: str, count: int, **spec: object) -> SimulatedNvml:
    sim = SimulatedNvml(
        [SimulatedGpuSpec(model, **spec) for _ in range(count)],  # type: ignore[arg-type]
        node_name="node-a",
    )
    sim.init()
    return sim


@pytest.mark.parametrize("model", [m.name for m in MODELS])
@pytest.mark.parametrize("mode", ["mig", "hami-core", "mps"])
@pytest.mark.parametrize("count", [2, 8])
def test_discovery_matches_the_simulated_node_register(
    model: str, mode: GpuMode, count: int
) -> None:
    cfg = DeviceConfig()
    sim = node(model, count)
    got = discover(sim, cfg.allowed_profiles, mode, 10, 1.0)
    assert got == simulated_devices("node-a", model, count, mode, cfg)
    sim.shutdown()


def test_a100_registers_the_seed_example() -> None:
    sim = node(A100, 1)
    (dev,) = discover(sim, DeviceConfig().allowed_profiles, "mig", 10, 1.0)
    two_g = next(p for p in dev.mig_profiles if p.name == "2g.10gb")
    assert (two_g.memory_mb, two_g.core, two_g.slice_count) == (9984, 29, 2)
    assert [(p.start, p.size) for p in two_g.placements] == [(0, 2), (2, 2), (4, 2)]
    assert [p.name for p in dev.mig_profiles] == ["1g.5gb", "2g.10gb", "3g.20gb", "7g.40gb"]
    sim.shutdown()


def test_memory_scaling_applies_to_shared_gpus_not_mig() -> None:
    sim = node(A100, 1)
    (core,) = discover(sim, DeviceConfig().allowed_profiles, "hami-core", 4, 1.5)
    (mig,) = discover(sim, DeviceConfig().allowed_profiles, "mig", 4, 1.5)
    assert (core.devmem, core.count, core.mig_profiles) == (61440, 4, ())
    assert mig.devmem == 40960
    sim.shutdown()


def test_mps_caps_slots_at_the_client_limit_and_scales_like_hami_core() -> None:
    sim = node(A100, 1)
    (capped,) = discover(sim, DeviceConfig().allowed_profiles, "mps", 100, 1.5, core_scaling=2)
    (under,) = discover(sim, DeviceConfig().allowed_profiles, "mps", 10, 1.0)
    assert (capped.count, capped.devmem, capped.devcore, capped.mode) == (48, 61440, 200, "mps")
    assert under.count == 10
    cfg = DeviceConfig(device_split_count=100, device_memory_scaling=1.5)
    assert [(d.count, d.devmem) for d in simulated_devices("n", A100, 1, "mps", cfg)] == [
        (48, 61440)
    ]
    sim.shutdown()


def test_core_scaling_applies_to_shared_gpus_not_mig() -> None:
    sim = node(A100, 1)
    (core,) = discover(sim, DeviceConfig().allowed_profiles, "hami-core", 4, 1.0, core_scaling=2)
    (mig,) = discover(sim, DeviceConfig().allowed_profiles, "mig", 4, 1.0, core_scaling=2)
    assert (core.devcore, mig.devcore) == (200, 100)
    sim.shutdown()


def test_filtered_devices_are_not_registered_and_not_the_agents() -> None:
    sim = node(A100, 3)
    cfg = load_config(
        "nvidia:\n  nodeconfig:\n    - name: n\n      filterdevices:\n"
        f"        uuid: [{sim.device(0).uuid}]\n        index: [2]\n"
    )
    keep = cfg.node("n").registers
    devs = discover(sim, cfg.allowed_profiles, "hami-core", 10, 1.0, registers=keep)
    assert [d.index for d in devs] == [1]
    assert unregistered(sim, keep) == {0, 2}
    sim.shutdown()


def test_in_mig_mode_a_gpu_with_mig_disabled_is_left_out() -> None:
    """As HAMi: it offers no profile, so a mig-mode node has nothing of it to register."""
    sim = SimulatedNvml(
        [SimulatedGpuSpec(A100, mig_enabled=False), SimulatedGpuSpec(A100)], node_name="node-a"
    )
    sim.init()
    (dev,) = discover(sim, DeviceConfig().allowed_profiles, "mig", 10, 1.0)
    assert dev.index == 1 and dev.mig_profiles
    sim.shutdown()


@pytest.mark.parametrize(
    ("allowed", "count"),
    [
        (("1g.5gb", "2g.10gb", "3g.20gb", "7g.40gb"), 7),  # seven 1g.5gb
        (("2g.10gb", "7g.40gb"), 3),
        (("3g.20gb",), 2),
        (("7g.40gb",), 1),
    ],
)
def test_a_mig_gpu_counts_the_most_instances_of_one_profile(
    allowed: tuple[str, ...], count: int
) -> None:
    """HAMi's ``count`` for a GPU in mig mode: the most instances any registered profile
    allows (its device plugin's slots on that GPU), not deviceSplitCount."""
    sim = node(A100, 1)
    (dev,) = discover(sim, lambda _name: allowed, "mig", 10, 1.0)
    assert dev.count == count
    sim.shutdown()


def test_health_comes_from_the_device() -> None:
    sim = node(A100, 2)
    sim.set_health(1, False)
    devs = discover(sim, DeviceConfig().allowed_profiles, "mig", 10, 1.0)
    assert [d.health for d in devs] == [True, False]
    sim.shutdown()


class _SizeUnknown(SimulatedNvml):
    """GPU 1 is lost and NVML never told its size (memory 0)."""

    def device(self, index: int) -> DeviceInfo:
        info = super().device(index)
        return dataclasses.replace(info, memory_mib=0, healthy=False) if index == 1 else info


def test_a_lost_gpu_of_unknown_size_is_left_out_and_the_rest_register() -> None:
    sim = _SizeUnknown([SimulatedGpuSpec(A100) for _ in range(3)], node_name="node-a")
    sim.init()
    devs = discover(sim, DeviceConfig().allowed_profiles, "hami-core", 10, 1.0)
    assert [d.index for d in devs] == [0, 2]
    assert decode(encode(devs)) == devs
    sim.shutdown()


def test_only_allowlisted_profiles_nvml_resolves_are_registered() -> None:
    sim = node(A100, 1)
    allow = ("7g.40gb", "9g.99gb", "1g.10gb")
    (dev,) = discover(sim, lambda _name: allow, "mig", 10, 1.0)
    assert [p.name for p in dev.mig_profiles] == ["7g.40gb", "1g.10gb"]
    sim.shutdown()


class _V1Info(SimulatedNvml):
    """Bindings that return v1 profile info, without names."""

    def gpu_instance_profile_info(self, index: int, profile_index: int) -> GpuInstanceProfileInfo:
        info = super().gpu_instance_profile_info(index, profile_index)
        return dataclasses.replace(info, name=None)


@pytest.mark.parametrize("model", MIG_MODELS)
def test_names_fall_back_to_the_catalog_without_v2_info(model: str) -> None:
    cfg = DeviceConfig()
    sim = _V1Info([SimulatedGpuSpec(model)], node_name="node-a")
    sim.init()
    assert discover(sim, cfg.allowed_profiles, "mig", 10, 1.0) == simulated_devices(
        "node-a", model, 1, "mig", cfg
    )
    sim.shutdown()


# -- backend factory ----------------------------------------------------------------------


def test_backend_from_env_builds_a_simulated_node(tmp_path: Path) -> None:
    env = {
        "TESSERA_NVML": "simulated",
        "TESSERA_SIM_GPUS": "A100-PCIE-40GB, H200",
        "TESSERA_SIM_STATE": str(tmp_path / "s.json"),
    }
    backend = backend_from_env(env, node_name="node-a")
    assert isinstance(backend, SimulatedNvml)
    backend.init()
    assert [backend.device(i).name for i in range(2)] == [A100, "NVIDIA H200"]
    backend.create_gpu_instance_with_placement(
        0, 0, backend.gpu_instance_possible_placements(0, 0)[0]
    )
    assert (tmp_path / "s.json").exists()
    backend.shutdown()


def test_backend_from_env_defaults_to_real() -> None:
    assert isinstance(backend_from_env({}), PynvmlBackend)


@pytest.mark.parametrize(
    ("env", "says"),
    [
        (
            {"TESSERA_NVML": "fake"},
            "TESSERA_NVML: unknown NVML backend 'fake'; valid: real, simulated",
        ),
        ({"TESSERA_NVML": "simulated"}, "TESSERA_SIM_GPUS: set it to a comma-separated list"),
        ({"TESSERA_NVML": "simulated", "TESSERA_SIM_GPUS": "Z9000"}, "unknown GPU model 'Z9000'"),
    ],
)
def test_bad_backend_settings_fail_clearly(env: dict[str, str], says: str) -> None:
    with pytest.raises(InvalidConfigError, match=says):
        backend_from_env(env)


def test_make_backend_lists_valid_kinds() -> None:
    assert BACKEND_KINDS == ("real", "simulated")
    with pytest.raises(InvalidConfigError, match="valid: real, simulated"):
        make_backend("mock")
    with pytest.raises(InvalidConfigError, match="at least one GPU"):
        make_backend("simulated")


@pytest.mark.parametrize(
    ("name", "registered"),
    [
        ("NVIDIA A100-PCIE-40GB", "NVIDIA A100-PCIE-40GB"),
        ("Tesla T4", "NVIDIA-Tesla T4"),
        ("Quadro RTX 8000", "NVIDIA-Quadro RTX 8000"),
    ],
)
def test_the_registered_type_is_hamis(name: str, registered: str) -> None:
    assert registered_type(name) == registered
