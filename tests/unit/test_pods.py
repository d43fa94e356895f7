from __future__ import annotations

from dataclasses import replace

import pytest

from api.errors import InvalidRequestError
from api.hami.config import DeviceConfig
from api.hami.policy import GpuPolicy, GpuSortKey, Policy
from api.kube.objects import parse_quantity
from scheduler_plugins.core.requests import parse_allocation, parse_request
from tests.builders import make_pod

CFG = DeviceConfig()


@pytest.mark.parametrize(
    ("limits", "expected"),
    [
        ({"nvidia.com/gpu": 1}, (1, 0, 100, 0)),  # no memory: whole card
        ({"nvidia.com/gpu": 2, "nvidia.com/gpumem": 3000}, (2, 3000, 0, 0)),
        ({"nvidia.com/gpu": 1, "nvidia.com/gpumem-percentage": 25}, (1, 0, 25, 0)),
        ({"nvidia.com/gpu": "1", "nvidia.com/gpucores": "30"}, (1, 0, 100, 30)),
        ({"nvidia.com/gpumem": 1024}, (1, 1024, 0, 0)),  # count defaults to 1
        # 0 is "not asked", as HAMi reads it: the whole card
        ({"nvidia.com/gpu": 1, "nvidia.com/gpumem": 0}, (1, 0, 100, 0)),
        ({"nvidia.com/gpu": 1, "nvidia.com/gpumem-percentage": 0}, (1, 0, 100, 0)),
    ],
)
def test_container_requests_and_defaults(
    limits: dict[str, object], expected: tuple[int, int, int, int]
) -> None:
    req = parse_request(make_pod("p").container(**limits).build(), CFG)
    (c,) = req.containers
    assert (c.count, c.mem_mib, c.mem_percent, c.cores) == expected


def test_default_memory_from_config() -> None:
    cfg = DeviceConfig(default_memory=2048)
    (c,) = parse_request(make_pod("p").gpu(1).build(), cfg).containers
    assert (c.mem_mib, c.mem_percent) == (2048, 0)


def test_memory_factor_scales_gpumem_and_bounds_it() -> None:
    cfg = DeviceConfig(memory_factor=1024)
    (c,) = parse_request(make_pod("p").gpu(1, mem=12).build(), cfg).containers
    assert c.mem_mib == 12 * 1024
    with pytest.raises(InvalidRequestError, match="between 0 and 2097151"):
        parse_request(make_pod("p").gpu(1, mem=2097152).build(), cfg)
    # defaultMemory is in MiB already
    (d,) = parse_request(make_pod("p").gpu(1).build(), replace(cfg, default_memory=500)).containers
    assert d.mem_mib == 500


def test_init_containers_come_first_and_empty_ones_count() -> None:
    pod = make_pod("p").container("init", init=True).gpu(1, mem=100).build()
    req = parse_request(pod, CFG)
    assert req.container_count == 2
    assert [c.index for c in req.containers] == [1]


def test_annotations_mode_policies_and_selectors() -> None:
    pod = (
        make_pod("p")
        .gpu(1)
        .mode("mig")
        .annotate("hami.io/node-scheduler-policy", "spread")
        .annotate("hami.io/gpu-scheduler-policy", "binpack")
        .annotate("nvidia.com/use-gputype", "A100, H100")
        .annotate("nvidia.com/nouse-gpuuuid", "GPU-1")
        .build()
    )
    req = parse_request(pod, CFG)
    assert req.modes == frozenset({"mig"})
    assert (req.node_policy, req.gpu_policy) == (Policy.SPREAD, GpuPolicy((GpuSortKey.BINPACK,)))
    assert req.use_types == ("A100", "H100")
    assert req.nouse_uuids == ("GPU-1",)


def test_no_gpu_request() -> None:
    pod = make_pod("p").container(cpu="500m", memory="1Gi").build()
    req = parse_request(pod, CFG)
    assert not req.wants_gpu
    assert (req.cpu_milli, req.memory_bytes) == (500, 2**30)


@pytest.mark.parametrize(
    ("limits", "annotations", "fragment"),
    [
        ({"nvidia.com/gpu": 1, "nvidia.com/gpucores": 101}, {}, "between 0 and 100"),
        ({"nvidia.com/gpu": 1, "nvidia.com/gpumem": "lots"}, {}, "invalid quantity"),
        ({"nvidia.com/gpu": 1, "nvidia.com/gpumem": "1.5"}, {}, "whole number"),
        (
            {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 1, "nvidia.com/gpumem-percentage": 5},
            {},
            "not both",
        ),
        ({"nvidia.com/gpu": 0, "nvidia.com/gpumem": 1}, {}, "nvidia.com/gpu: 0"),
        ({"nvidia.com/gpu": 1}, {"nvidia.com/vgpu-mode": "vgpu"}, "names none of"),
        ({"nvidia.com/gpu": 1}, {"hami.io/gpu-scheduler-policy": "tight"}, "binpack, spread"),
    ],
)
def test_bad_requests_name_the_problem(
    limits: dict[str, object], annotations: dict[str, str], fragment: str
) -> None:
    b = make_pod("bad", "ns").container("main", **limits)
    for k, v in annotations.items():
        b.annotate(k, v)
    with pytest.raises(InvalidRequestError) as e:
        parse_request(b.build(), CFG)
    assert "ns/bad" in str(e.value)
    assert fragment in str(e.value)


def test_quantities() -> None:
    assert parse_quantity("1Gi") == 2**30
    assert parse_quantity("250m") * 1000 == 250
    assert parse_quantity(3) == 3
    with pytest.raises(ValueError):
        parse_quantity("1e")


def test_allocation_splits_mig_devices_from_shared_ones() -> None:
    pod = (
        make_pod("p")
        .gpu(2)
        .on("n1")
        .annotate("hami.io/vgpu-devices-allocated", "GPU-a,NVIDIA,1000,0:GPU-b,NVIDIA,9984,29:;")
        .mig_allocations(
            [
                {
                    "containerIndex": 0,
                    "deviceIndex": 1,
                    "gpuUUID": "GPU-b",
                    "profile": "2g.10gb",
                    "placement": {"start": 0, "size": 2},
                }
            ]
        )
        .build()
    )
    alloc = parse_allocation(pod)
    assert alloc is not None
    assert [d.uuid for d in alloc.devices] == ["GPU-a"]
    assert [m.gpu_uuid for m in alloc.mig] == ["GPU-b"]
