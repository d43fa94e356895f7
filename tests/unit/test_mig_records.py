"""The desired MIG set is read all-or-nothing from pods; runtime identities are written back."""

from __future__ import annotations

import json
from typing import Any

import pytest

from api.errors import InvalidAnnotationError
from api.hami.devices import (
    MigAllocation,
    RuntimeIdentity,
    decode_mig_allocations,
    encode_mig_allocations,
)
from api.hami.keys import DEVICES_ALLOCATED
from api.hami.register import Placement
from node_agent.mig_manager import Owner
from node_agent.mig_records import container_reservations, desired_from_pods, with_runtime
from tests.builders import make_pod

NODE = "node-a"
KEY = "hami.io/vgpu-mig-allocations"


def entry(ci: int = 0, di: int = 0, gpu: str = "GPU-a", start: int = 0, **extra: Any) -> Any:
    e: dict[str, Any] = {
        "containerIndex": ci,
        "deviceIndex": di,
        "gpuUUID": gpu,
        "profile": "2g.10gb",
        "placement": {"start": start, "size": 2},
    }
    e.update(extra)
    return e


def pod(name: str, *entries: Any, node: str = NODE, phase: str = "Running") -> dict[str, Any]:
    return make_pod(name).on(node, phase).mig_allocations(list(entries)).build()


def owners(pods: list[dict[str, Any]]) -> list[Owner]:
    read = desired_from_pods(pods, node_name=NODE)
    assert read.desired is not None, read.reason
    return sorted(r.owner for r in read.desired.reservations)


def test_live_pods_on_this_node_form_the_desired_set() -> None:
    p = pod("p", entry(0, 0, start=0), entry(1, 0, start=2))
    q = pod("q", entry(0, 0, gpu="GPU-b"), phase="Pending")
    assert owners([p, q]) == [
        Owner("default/p", 0, 0),
        Owner("default/p", 1, 0),
        Owner("default/q", 0, 0),
    ]


def deleting(p: dict[str, Any]) -> dict[str, Any]:
    p["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    return p


def unbound_reserved_here(p: dict[str, Any]) -> dict[str, Any]:
    del p["spec"]["nodeName"]
    p["metadata"]["annotations"]["hami.io/vgpu-node"] = NODE
    return p


@pytest.mark.parametrize(
    ("obj", "included"),
    [
        (pod("p", entry()), True),
        (deleting(pod("p", entry())), False),
        (pod("p", entry(), phase="Succeeded"), False),
        (pod("p", entry(), phase="Failed"), False),
        (pod("p", entry(), node="node-b"), False),
        (unbound_reserved_here(pod("p", entry())), True),
        (make_pod("p").on(NODE).build(), False),
    ],
    ids=["running", "deleting", "succeeded", "failed", "other-node", "binding", "no-mig"],
)
def test_which_pods_hold_reservations(obj: dict[str, Any], included: bool) -> None:
    assert (owners([obj]) == [Owner("default/p", 0, 0)]) is included


def raw(value: str) -> dict[str, Any]:
    p = make_pod("bad").on(NODE).build()
    p["metadata"]["annotations"][KEY] = value
    return p


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (raw("{oops"), "not valid JSON"),
        (raw(""), "not valid JSON"),
        (raw('{"a":1}'), "JSON array"),
        (pod("bad", entry(migUUID="MIG-1", gpuInstanceID=3)), "partial runtime identity"),
        (pod("bad", entry(gpuInstanceID=3, computeInstanceID=0)), "partial runtime identity"),
        (pod("bad", entry(0, 0), entry(0, 0, start=2)), "duplicates"),
        (pod("bad", entry(start=1, placement={"size": 0})), "valid slice range"),
        (pod("bad", entry(start=2)), "overlapping placements"),
        ({"metadata": "nope"}, "metadata is not an object"),
    ],
)
def test_one_malformed_record_makes_the_whole_set_unreadable(bad: Any, reason: str) -> None:
    good = pod("good", entry(start=2))
    read = desired_from_pods([good, bad], node_name=NODE)
    assert read.desired is None
    assert reason in read.reason


def test_overlap_on_different_gpus_or_disjoint_placements_is_fine() -> None:
    pods = [pod("a", entry(start=0)), pod("b", entry(start=2)), pod("c", entry(gpu="GPU-b"))]
    assert len(owners(pods)) == 3


def test_malformed_record_of_an_ended_pod_is_ignored() -> None:
    ended = raw("{oops")
    ended["status"]["phase"] = "Succeeded"
    assert owners([ended, pod("p", entry())]) == [Owner("default/p", 0, 0)]


def test_without_node_name_every_listed_pod_counts() -> None:
    read = desired_from_pods([pod("p", entry(), node="node-b")])
    assert read.desired is not None and len(read.desired.reservations) == 1


# -- writing runtime identities back -------------------------------------------------

A = MigAllocation(0, 0, "GPU-a", "1g.5gb", Placement(0, 1))
B1 = MigAllocation(1, 1, "GPU-a", "1g.5gb", Placement(2, 1))
B0 = MigAllocation(1, 0, "GPU-b", "2g.10gb", Placement(4, 2))
ID0 = RuntimeIdentity("MIG-aaaa", 11, 0)
ID1 = RuntimeIdentity("MIG-bbbb", 9, 0)


def test_container_reservations_are_in_device_order() -> None:
    value = encode_mig_allocations([A, B1, B0])
    assert container_reservations(value, 1) == (B0, B1)
    assert container_reservations(value, 5) == ()


def test_with_runtime_fills_that_containers_entries_and_keeps_the_rest() -> None:
    value = encode_mig_allocations([A, B1, B0])
    out = with_runtime(value, 1, [ID0, ID1])
    assert decode_mig_allocations(out) == (
        A,
        MigAllocation(1, 1, "GPU-a", "1g.5gb", Placement(2, 1), ID1),
        MigAllocation(1, 0, "GPU-b", "2g.10gb", Placement(4, 2), ID0),
    )
    item = json.loads(out)[1]
    assert (item["migUUID"], item["gpuInstanceID"], item["computeInstanceID"]) == ("MIG-bbbb", 9, 0)


def test_with_runtime_replaces_a_stale_identity() -> None:
    value = with_runtime(encode_mig_allocations([A]), 0, [ID0])
    assert decode_mig_allocations(with_runtime(value, 0, [ID1]))[0].runtime == ID1


def test_with_runtime_refuses_a_count_mismatch() -> None:
    with pytest.raises(InvalidAnnotationError, match="2 runtime identit"):
        with_runtime(encode_mig_allocations([A]), 0, [ID0, ID1])


def test_gpus_held_through_hami_legacy_mig_slots_are_read() -> None:
    def holding(name: str, value: str, node: str = NODE, phase: str = "Running") -> Any:
        return make_pod(name).on(node, phase).annotate(DEVICES_ALLOCATED, value).build()

    pods = [
        holding("old", "GPU-a[1-1],NVIDIA,19968,28:GPU-b,NVIDIA,1000,10:;"),
        holding("done", "GPU-c[1-2],NVIDIA,19968,28:;", phase="Succeeded"),
        holding("elsewhere", "GPU-d[1-1],NVIDIA,19968,28:;", node="node-b"),
        holding("plain", "GPU-e,NVIDIA,1000,10:;"),
        holding("malformed-plain", "not a device list"),
    ]
    read = desired_from_pods(pods, node_name=NODE)
    assert read.desired is not None, read.reason
    assert read.desired.held_gpus == {"GPU-a"}
    assert read.desired.with_pod("default/x", []).held_gpus == {"GPU-a"}


def test_malformed_legacy_device_list_makes_the_set_unreadable() -> None:
    bad = make_pod("bad").on(NODE).annotate(DEVICES_ALLOCATED, "GPU-a[1-1],NVIDIA,x,28:;").build()
    read = desired_from_pods([bad], node_name=NODE)
    assert read.desired is None and "default/bad" in read.reason
