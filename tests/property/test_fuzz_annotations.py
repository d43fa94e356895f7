"""Hostile annotations and pod specs reaching the plugin server's cluster model.

Every case feeds one hostile object (a node's ``hami.io/node-nvidia-register``; a pod's
allocation annotations, user selectors/mode and resources) to the same code the watch and
PreFilter run (``ClusterCache.apply_node``/``apply_pod``, ``parse_request`` + ``decide``) on a
small cluster with running pods, and checks:

- nothing raises but the documented ``InvalidInputError`` family (then the case counts as
  rejected, with its message);
- no other node's usage and verdicts and no other pod's recorded allocation change;
- taking the hostile object back (re-registering the node, deleting the pod, re-applying the
  pod as it was) restores exactly the usage there was before.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from api.errors import InvalidInputError
from api.hami import keys as ann
from api.hami.devices import (
    DeviceAlloc,
    encode_devices,
    encode_mig_allocations,
)
from api.hami.register import decode, encode
from api.kube.objects import pod_key
from scheduler_plugins.core.cache import ClusterCache
from scheduler_plugins.core.decide import decide
from scheduler_plugins.core.explain import explain
from scheduler_plugins.core.requests import counts_against_capacity, parse_allocation, parse_request
from scheduler_plugins.core.state import ClusterState
from tests.builders import make_pod
from tests.fuzzing import (
    CONFIG,
    GA0,
    GA1,
    GB0,
    GC0,
    MIG_RESERVATION,
    NODES,
    VICTIM_KEYS,
    VICTIMS,
    FuzzLedger,
    cluster,
    fuzz_settings,
    hostile_variant,
    json_values,
    nasty_text,
    node_obj,
    rare,
)


def verdicts(state: ClusterState) -> dict[str, bool]:
    """Per node: does a 1-GPU, 1000 MiB pod fit (the probe every case compares)."""
    probe = parse_request(make_pod("probe").gpu(1, mem=1000).build(), CONFIG)
    d = decide(state, probe)
    return {str(n): bool(f) for n, f in zip(d.layout.names, d.feasible, strict=True)}


def without_node(snapshot: dict[str, Any], nodes: set[str]) -> dict[str, Any]:
    return {k: v for k, v in snapshot.items() if k.split("/", 1)[0] not in nodes}


def records(cache: ClusterCache, keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: cache.state.allocation(k) for k in keys}


VICTIM_RECORDS = records(cluster(), VICTIM_KEYS)
assert all(VICTIM_RECORDS.values())


# ----- hostile values of the node and pod annotations ------------------------------------------

gpu_uuids = st.sampled_from([GA0, GA1, GB0, GC0, "GPU-elsewhere"]) | st.text(max_size=12)
device_lists = st.lists(
    st.lists(
        st.builds(DeviceAlloc, gpu_uuids, st.integers(0, 2**32), st.integers(0, 150)),
        max_size=3,
    ).map(tuple),
    max_size=3,
).map(tuple)


@st.composite
def hostile_pod(draw: st.DrawFn, name: str) -> dict[str, Any]:
    """A pod whose every Tessera annotation is valid, mutated or garbage."""
    devices = draw(device_lists)
    node = draw(st.sampled_from([*NODES, "node-x", ""]) | st.text(max_size=8))
    pod = make_pod(name)
    for container in devices:
        pod.gpu(max(len(container), 1))
    if draw(st.booleans()):
        pod.on(node, draw(st.sampled_from(["Running", "Pending", "Succeeded", "Failed"])))
    data = draw(st.data())
    canonical: dict[str, tuple[str, bool]] = {
        ann.VGPU_NODE: (node, False),
        ann.BIND_PHASE: (draw(st.sampled_from(["allocating", "success", "failed"])), False),
        ann.BIND_TIME: (str(draw(st.integers(0, 2**40))), False),
        ann.DEVICES_ALLOCATED: (encode_devices(devices), False),
        ann.DEVICES_TO_ALLOCATE: (encode_devices(devices), False),
        ann.MIG_ALLOCATIONS: (encode_mig_allocations([MIG_RESERVATION]), True),
    }
    for key, (value, is_json) in canonical.items():
        if draw(st.booleans()):
            pod.annotate(key, hostile_variant(value, data, is_json=is_json))
    obj = pod.build()
    if draw(rare(10)):  # never from the API server, but never a crash either
        obj["metadata"]["annotations"][draw(st.sampled_from(list(canonical)))] = draw(json_values)
    return obj


# ----- node registration -------------------------------------------------------------------------


@fuzz_settings(100)
@given(target=st.sampled_from(["node-a", "node-b", "node-new"]), data=st.data())
def test_hostile_node_register_touches_only_that_node(
    fuzz_ledger: FuzzLedger, target: str, data: st.DataObject
) -> None:
    cache = cluster()
    before = cache.state.usage_snapshot()
    verdicts_before = verdicts(cache.state)
    records_before = records(cache, VICTIM_KEYS)
    canonical = encode(NODES.get(target, NODES["node-c"]))
    value = hostile_variant(canonical, data, is_json=True)
    with fuzz_ledger.case("plugin-server/node-register") as case:
        try:
            decode(value, obj=f"node {target}")
        except InvalidInputError as e:
            case.rejected(str(e))
        cache.apply_node(node_obj(target, register=value))
        assert without_node(cache.state.usage_snapshot(), {target}) == without_node(
            before, {target}
        )
        after = verdicts(cache.state)
        assert {n: v for n, v in after.items() if n != target} == {
            n: v for n, v in verdicts_before.items() if n != target
        }
        assert records(cache, VICTIM_KEYS) == records_before
        if target in NODES:
            cache.apply_node(node_obj(target))
        else:
            cache.delete_node(target)
        assert cache.state.usage_snapshot() == before


# ----- pod allocation annotations ---------------------------------------------------------------


def _named_nodes(pod: dict[str, Any]) -> set[str]:
    spec_node = pod.get("spec", {}).get("nodeName")
    annotated = pod["metadata"]["annotations"].get(ann.VGPU_NODE)
    return {n for n in (spec_node, annotated) if isinstance(n, str)}


@fuzz_settings(100)
@given(data=st.data())
def test_hostile_new_pod_touches_only_the_node_it_names(
    fuzz_ledger: FuzzLedger, data: st.DataObject
) -> None:
    cache = cluster()
    before = cache.state.usage_snapshot()
    pod = data.draw(hostile_pod("intruder"))
    with fuzz_ledger.case("plugin-server/pod-annotations") as case:
        try:
            parse_allocation(pod)
        except InvalidInputError as e:
            case.rejected(str(e))
        cache.apply_pod(pod)
        named = _named_nodes(pod)
        assert without_node(cache.state.usage_snapshot(), named) == without_node(before, named)
        assert records(cache, VICTIM_KEYS) == VICTIM_RECORDS
        for node in named:
            cache.blocking(node, "default/probe", VICTIMS["victim-a"]["metadata"]["annotations"])
        cache.delete_pod(pod)
        assert cache.state.usage_snapshot() == before


@fuzz_settings(100)
@given(victim=st.sampled_from(sorted(VICTIMS)), data=st.data())
def test_hostile_update_of_a_pod_keeps_others_and_is_undone(
    fuzz_ledger: FuzzLedger, victim: str, data: st.DataObject
) -> None:
    cache = cluster()
    before = cache.state.usage_snapshot()
    original = VICTIMS[victim]
    updated = data.draw(hostile_pod(victim))
    updated["spec"]["nodeName"] = original["spec"]["nodeName"]
    others = tuple(k for k in VICTIM_KEYS if k != pod_key(original))
    with fuzz_ledger.case("plugin-server/pod-annotations") as case:
        try:
            parse_allocation(updated)
        except InvalidInputError as e:
            case.rejected(str(e))
            cache.apply_pod(updated)
            if counts_against_capacity(updated):
                # Fail closed: an unreadable update keeps what the pod held before.
                assert (
                    cache.state.allocation(pod_key(original)) == VICTIM_RECORDS[pod_key(original)]
                )
                assert cache.state.usage_snapshot() == before
        else:
            cache.apply_pod(updated)
        named = _named_nodes(updated) | {original["spec"]["nodeName"]}
        assert without_node(cache.state.usage_snapshot(), named) == without_node(before, named)
        assert records(cache, others) == {k: VICTIM_RECORDS[k] for k in others}
        cache.apply_pod(copy.deepcopy(original))
        assert cache.state.usage_snapshot() == before


# ----- what a pod asks for: resources, mode, policies, selectors ---------------------------------

quantities = (
    st.sampled_from(["1", "2", "0", "500m", "1Gi", "1e3", "100", "64", "65", "-1", "1.5", "+1"])
    | st.integers(-5, 200)
    | st.floats()
    | nasty_text
    | json_values
)
RESOURCES = (
    "nvidia.com/gpu",
    "nvidia.com/gpumem",
    "nvidia.com/gpumem-percentage",
    "nvidia.com/gpucores",
    "cpu",
    "memory",
)
USER_ANNOTATIONS = (
    ann.VGPU_MODE,
    ann.NODE_POLICY,
    ann.GPU_POLICY,
    ann.USE_GPUTYPE,
    ann.NOUSE_GPUTYPE,
    ann.USE_GPUUUID,
    ann.NOUSE_GPUUUID,
)
user_values = (
    st.sampled_from(["mig", "hami-core", "binpack", "spread", "V100", "A100", GA0, "", ","])
    | st.text(max_size=30)
    | nasty_text
)


container_names = st.sampled_from(["c0", "c1", ""]) | st.text(max_size=8)
resource_maps = st.fixed_dictionaries(
    {}, optional={r: quantities for r in RESOURCES}
)  # fmt: skip
resource_sections = st.builds(
    lambda section, values: {section: values}, st.sampled_from(["limits", "requests"]),
    resource_maps,
) | json_values  # fmt: skip
request_containers = st.lists(
    st.fixed_dictionaries({"name": container_names, "resources": resource_sections}), max_size=3
)
user_annotation_maps = st.fixed_dictionaries(
    {}, optional=dict.fromkeys(USER_ANNOTATIONS, user_values)
)


@st.composite
def hostile_request_pod(draw: st.DrawFn) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "metadata": {
            "name": "asker",
            "namespace": "default",
            "annotations": draw(user_annotation_maps),
        },
        "spec": {"containers": draw(request_containers)},
    }
    if draw(rare(10)):
        pod[draw(st.sampled_from(["metadata", "spec"]))] = draw(json_values)
    return pod


SHARED = cluster()


@fuzz_settings(150)
@given(pod=hostile_request_pod())
def test_hostile_request_is_refused_or_decided_without_changing_state(
    fuzz_ledger: FuzzLedger, pod: dict[str, Any]
) -> None:
    before = SHARED.state.usage_snapshot()
    with fuzz_ledger.case("core/pod-request") as case:
        try:
            req = parse_request(json.loads(json.dumps(pod)), CONFIG)
        except InvalidInputError as e:
            case.rejected(str(e))
            return
        if req.wants_gpu:
            d = decide(SHARED.state, req)
            if not d.feasible.all():
                assert explain(d, SHARED.state)
            for i in np.flatnonzero(d.feasible).tolist()[:2]:
                plan = d.plan_for(str(d.layout.names[i]))
                assert plan is not None
        assert SHARED.state.usage_snapshot() == before


def test_ledger_counts_outcomes_and_a_silent_rejection_is_a_crash() -> None:
    ledger = FuzzLedger()
    with ledger.case("s"):
        pass
    with ledger.case("s") as case:
        case.rejected("nvidia.com/gpu: invalid quantity 'x'")
    with pytest.raises(AssertionError), ledger.case("s") as case:
        case.rejected("  ")
    with pytest.raises(KeyError), ledger.case("s"):
        raise KeyError("boom")
    report = ledger.report()
    assert report["surfaces"]["s"] == {
        "cases": 4,
        "accepted": 1,
        "rejected": 1,
        "crashes": 2,
        "first_crash": "AssertionError: a rejection must carry a message naming the problem",
    }
    assert (report["total_cases"], report["total_crashes"]) == (4, 2)
