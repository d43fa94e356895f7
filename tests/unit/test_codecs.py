from __future__ import annotations

import pytest

from api.errors import InvalidAnnotationError
from api.hami.devices import (
    DeviceAlloc,
    decode_bind_phase,
    decode_bind_time,
    decode_devices,
    decode_mig_allocations,
    empty_devices,
    encode_devices,
    encode_mig_allocations,
)
from api.hami.register import decode, encode

# HAMi v2.10's encoding (SPEC §2): struct key order, zero, false and empty fields left out.
SPEC_REGISTER = (
    '[{"id":"GPU-1","count":10,"devmem":40960,"devcore":100,'
    '"type":"NVIDIA A100-PCIE-40GB","mode":"mig","migProfiles":'
    '[{"name":"2g.10gb","memoryMB":9984,"core":29,"sliceCount":2,"placements":'
    '[{"start":0,"size":2},{"start":2,"size":2},{"start":4,"size":2}]}],"health":true}]'
)
# What an earlier Tessera wrote (zero fields, health before mode): still read.
OLD_TESSERA_REGISTER = (
    '[{"id":"GPU-1","index":0,"count":10,"devmem":40960,"devcore":100,'
    '"type":"NVIDIA A100-PCIE-40GB","numa":0,"health":true,"mode":"mig","migProfiles":'
    '[{"name":"2g.10gb","memoryMB":9984,"core":29,"sliceCount":2,"placements":'
    '[{"start":0,"size":2},{"start":2,"size":2},{"start":4,"size":2}]}]}]'
)


def test_register_spec_example_round_trips_byte_exact() -> None:
    devices = decode(SPEC_REGISTER)
    assert devices[0].mig_profiles[0].core == 29
    assert encode(devices) == SPEC_REGISTER
    assert decode(OLD_TESSERA_REGISTER) == devices


def test_register_accepts_hami_omit_zero_form() -> None:
    hami = '[{"id":"GPU-a","count":10,"devmem":32768,"devcore":100,"type":"V100","health":true}]'
    (d,) = decode(hami)
    assert (d.index, d.numa, d.mode, d.health) == (0, 0, "hami-core", True)


def test_register_missing_health_means_unhealthy() -> None:
    (d,) = decode('[{"id":"GPU-a","count":10,"devmem":1,"devcore":100}]')
    assert d.health is False


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("nope", "not valid JSON"),
        ("{}", "JSON array"),
        ('[{"count":10,"devmem":1,"devcore":1}]', "GPU [0].id is missing"),
        ('[{"id":"G","count":"10","devmem":1,"devcore":1}]', "GPU [0].count must be an integer"),
        ('[{"id":"G","count":0,"devmem":1,"devcore":1}]', "GPU [0].count = 0 is out of range"),
        ('[{"id":"G","count":1,"devmem":1,"devcore":1,"mode":"x"}]', "GPU [0].mode 'x'"),
        (
            '[{"id":"G","count":1,"devmem":1,"devcore":1},{"id":"G","index":1,"count":1,'
            '"devmem":1,"devcore":1}]',
            "appears twice",
        ),
        (
            '[{"id":"G","count":1,"devmem":1,"devcore":1,"migProfiles":[{"name":"1g","memoryMB":1,'
            '"core":1,"sliceCount":1,"placements":[]}]}]',
            "placements must be a non-empty array",
        ),
    ],
)
def test_register_rejects_malformed(value: str, fragment: str) -> None:
    with pytest.raises(InvalidAnnotationError, match=r"hami\.io/node-nvidia-register") as e:
        decode(value, obj="node n1")
    assert fragment in str(e.value)
    assert "node n1" in str(e.value)


@pytest.mark.parametrize(
    "value",
    [
        "GPU-0fc3eda5-e98b-a25b-5b0d-cf5c855d1448,NVIDIA,3000,0:;",
        ";",
        ";;",
        "GPU-a,NVIDIA,1,2:GPU-b,NVIDIA,3,4:;;GPU-c,NVIDIA,5,100:;",
    ],
)
def test_devices_round_trip(value: str) -> None:
    assert encode_devices(decode_devices(value)) == value


def test_devices_keeps_empty_containers_in_order() -> None:
    pod = decode_devices(";GPU-x,NVIDIA,1000,10:;")
    assert pod == ((), (DeviceAlloc("GPU-x", 1000, 10),))
    assert empty_devices(2) == ";;"


@pytest.mark.parametrize(
    "value",
    [
        "GPU-a,NVIDIA,1,2:",
        "GPU-a,NVIDIA,1,2;",
        "GPU-a,NVIDIA,x,2:;",
        "GPU-a,NVIDIA,1:;",
        "GPU-a,NVIDIA,1,101:;",
        ",NVIDIA,1,1:;",
    ],
)
def test_devices_rejects_malformed(value: str) -> None:
    with pytest.raises(InvalidAnnotationError):
        decode_devices(value)


MIG = (
    '[{"containerIndex":0,"deviceIndex":0,"gpuUUID":"GPU-x","profile":"2g.10gb",'
    '"placement":{"start":2,"size":2},"migUUID":"MIG-1","gpuInstanceID":4,"computeInstanceID":0}]'
)


def test_mig_allocations_round_trip_with_runtime_identity() -> None:
    (a,) = decode_mig_allocations(MIG)
    assert a.runtime is not None and a.runtime.gpu_instance_id == 4
    assert encode_mig_allocations([a]) == MIG


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (
            '[{"gpuUUID":"GPU-x","profile":"1g.5gb","placement":{"size":1},"migUUID":"MIG-1"}]',
            "partial runtime identity",
        ),
        (
            '[{"gpuUUID":"GPU-x","profile":"1g.5gb","placement":{"size":1}},'
            '{"gpuUUID":"GPU-x","profile":"1g.5gb","placement":{"start":1,"size":1}}]',
            "duplicates (containerIndex 0, deviceIndex 0)",
        ),
        ('[{"gpuUUID":"GPU-x","profile":"1g.5gb"}]', "placement must be an object"),
        (
            '[{"gpuUUID":"GPU-x","profile":"1g.5gb","placement":{"start":15,"size":4}}]',
            "not a valid slice range",
        ),
        ('[{"gpuUUID":"GPU-x","profile":"","placement":{"size":1}}]', "profile must be"),
        (
            '[{"containerIndex":-1,"gpuUUID":"GPU-x","profile":"a","placement":{"size":1}}]',
            "non-negative",
        ),
    ],
)
def test_mig_allocations_strict(value: str, fragment: str) -> None:
    with pytest.raises(InvalidAnnotationError) as e:
        decode_mig_allocations(value)
    assert fragment in str(e.value)


def test_bind_phase_and_time() -> None:
    assert decode_bind_phase("allocating") == "allocating"
    assert decode_bind_time("1716199325") == 1716199325
    with pytest.raises(InvalidAnnotationError, match="bind-phase"):
        decode_bind_phase("done")
    with pytest.raises(InvalidAnnotationError, match="bind-time"):
        decode_bind_time("-1")
