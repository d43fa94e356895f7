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
from api.hami.keys import VGPU_NODE_LABEL, vgpu_node_labels
from api.hami.nodes import decode_cordon, decode_pair_scores
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


# --- HAMi v2.10's own bytes ---------------------------------------------------------------------
# What HAMi v2.10's device plugin and scheduler write (their Go encoders' output, byte for byte),
# what v2.8/v2.9 left behind, and Tessera's output of the same facts.

HAMI_REGISTER_CORE = (
    '[{"id":"GPU-3f9a1c2e-8b7d-4e6f-a1b2-c3d4e5f60718","count":10,"devmem":15360,'
    '"devcore":100,"type":"NVIDIA-Tesla T4","mode":"hami-core","health":true}]'
)
HAMI_REGISTER_MIG = (
    '[{"id":"GPU-9e8d7c6b-5a49-3827-1605-f4e3d2c1b0a9","index":1,"count":2,"devmem":81920,'
    '"devcore":100,"type":"NVIDIA A100-SXM4-80GB","numa":1,"mode":"mig","migProfiles":'
    '[{"name":"3g.40gb","memoryMB":40192,"core":43,"sliceCount":3,"placements":'
    '[{"start":0,"size":4},{"start":4,"size":4}]}],"health":true}]'
)
HAMI_REGISTER_UNHEALTHY_NO_MODE = (
    '[{"id":"GPU-x","index":3,"count":10,"devmem":15360,"devcore":100,'
    '"type":"NVIDIA-Tesla T4","numa":1}]'
)
HAMI_REGISTER_MPS = (
    '[{"id":"GPU-m","count":4,"devmem":15360,"devcore":100,"type":"NVIDIA-Tesla T4",'
    '"mode":"mps","health":true}]'
)


@pytest.mark.parametrize("value", [HAMI_REGISTER_CORE, HAMI_REGISTER_MIG, HAMI_REGISTER_MPS])
def test_hami_register_bytes_read_and_written_back_identically(value: str) -> None:
    assert encode(decode(value)) == value


def test_hami_register_without_mode_or_health_is_an_unhealthy_hami_core_gpu() -> None:
    (d,) = decode(HAMI_REGISTER_UNHEALTHY_NO_MODE)
    assert (d.index, d.numa, d.mode, d.health) == (3, 1, "hami-core", False)


def test_v2_9_register_with_empty_pair_score_is_read() -> None:
    old = HAMI_REGISTER_CORE[:-2] + ',"devicepairscore":{}}]'
    assert decode(old) == decode(HAMI_REGISTER_CORE)


def test_register_with_two_gpus_in_map_order_is_read_in_that_order() -> None:
    both = "[" + HAMI_REGISTER_MIG[1:-1] + "," + HAMI_REGISTER_CORE[1:-1] + "]"
    assert [d.index for d in decode(both)] == [1, 0]


@pytest.mark.parametrize(
    ("value", "containers"),
    [
        # HAMi's scheduler: one container, one GPU
        ("GPU-a,NVIDIA,1000,30:;", [[("GPU-a", 1000, 30)]]),
        # two containers, the first with two GPUs
        (
            "GPU-a,NVIDIA,4000,25:GPU-b,NVIDIA,4000,25:;GPU-a,NVIDIA,2000,10:;",
            [[("GPU-a", 4000, 25), ("GPU-b", 4000, 25)], [("GPU-a", 2000, 10)]],
        ),
        # v2.9: placeholders for the containers without GPUs
        (";GPU-a,NVIDIA,1000,30:;;", [[], [("GPU-a", 1000, 30)], []]),
        # to-allocate after HAMi's device plugin emptied both entries
        (";;", [[], []]),
        # a MIG device of HAMi v2.10: the plain UUID with the profile's memory and cores
        (
            "GPU-9e8d7c6b-5a49-3827-1605-f4e3d2c1b0a9,NVIDIA,40192,43:;",
            [[("GPU-9e8d7c6b-5a49-3827-1605-f4e3d2c1b0a9", 40192, 43)]],
        ),
    ],
)
def test_hami_device_strings(value: str, containers: list[list[tuple[str, int, int]]]) -> None:
    decoded = decode_devices(value)
    assert [[(d.uuid, d.mem, d.cores) for d in c] for c in decoded] == containers
    assert encode_devices(decoded) == value


def test_hami_v2_9_legacy_mig_device_string_is_read_and_kept() -> None:
    value = "GPU-9e8d7c6b-5a49-3827-1605-f4e3d2c1b0a9[1-1],NVIDIA,19968,28:;"
    ((d,),) = decode_devices(value)
    assert (d.uuid, d.legacy, d.mem, d.cores) == (
        "GPU-9e8d7c6b-5a49-3827-1605-f4e3d2c1b0a9",
        "1-1",
        19968,
        28,
    )
    assert encode_devices(((d,),)) == value


@pytest.mark.parametrize(
    "value",
    [
        # HAMi v2.10's scheduler at Filter
        '[{"containerIndex":1,"deviceIndex":0,"gpuUUID":"GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee",'
        '"profile":"3g.40gb","placement":{"start":4,"size":4}}]',
        # its device plugin after Allocate
        '[{"containerIndex":0,"deviceIndex":0,"gpuUUID":"GPU-a","profile":"3g.40gb",'
        '"placement":{"start":4,"size":4},"migUUID":"MIG-b","gpuInstanceID":2,'
        '"computeInstanceID":0}]',
    ],
)
def test_hami_mig_allocations_bytes(value: str) -> None:
    assert encode_mig_allocations(list(decode_mig_allocations(value))) == value


def test_hami_node_annotations_cordon_and_pair_scores() -> None:
    assert decode_cordon(" GPU-a ,,GPU-b,") == {"GPU-a", "GPU-b"}
    assert decode_cordon("   ") == frozenset()
    scores = decode_pair_scores(
        '[{"uuid":"GPU-b","score":{"GPU-a":200,"GPU-c":10}},'
        '{"uuid":"GPU-a","score":{"GPU-b":200,"GPU-c":10}}]'
    )
    assert scores == {"GPU-b": {"GPU-a": 200, "GPU-c": 10}, "GPU-a": {"GPU-b": 200, "GPU-c": 10}}
    assert decode_pair_scores("null") == {}
    with pytest.raises(InvalidAnnotationError, match="node-nvidia-score"):
        decode_pair_scores('[{"uuid":"GPU-a","score":{"GPU-b":1.5}}]')


@pytest.mark.parametrize(
    ("node", "labels"),
    [
        ("gpu-1", {VGPU_NODE_LABEL: "gpu-1"}),
        ("a" * 63, {VGPU_NODE_LABEL: "a" * 63}),
        # a node name may have 253 characters, a label value 63: no label, the pod still binds
        ("a" * 64, {}),
        ("ip-10-0-0-1." + "compute." * 20 + "internal", {}),
    ],
)
def test_the_vgpu_node_label_only_where_the_node_name_is_a_label_value(
    node: str, labels: dict[str, str]
) -> None:
    assert vgpu_node_labels(node) == labels
