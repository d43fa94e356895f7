"""The webhook's pod rules, one table row per rule and per bad input."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from api.hami import keys as ann
from api.hami.config import DeviceConfig
from scheduler_plugins.core.requests import parse_request
from scheduler_plugins.webhook.facts import UNKNOWN, ClusterFacts, node_capacity
from scheduler_plugins.webhook.rules import (
    Settings,
    asks_tessera,
    pointer,
    review_pod,
    review_pod_update,
)
from tests.builders import PodBuilder, gpu, make_pod, mig_gpu, mps_gpu
from tests.jsonpatch import apply_patch

A100 = "NVIDIA A100-PCIE-40GB"
# A 4-GPU hami-core node (40960 MiB each) and a 1-GPU A100-40GB MIG node (up to 7 instances,
# the largest profile 7g.40gb = 40448 MiB).
FACTS = ClusterFacts.of(
    [
        node_capacity("core-0", [gpu(f"G{i}", index=i, mem=40960, type=A100) for i in range(4)]),
        node_capacity("mig-0", [mig_gpu("M0")]),
    ]
)
CORE_ONLY = ClusterFacts.of([node_capacity("core-0", [gpu("G0", mem=16384)])])
# FACTS and a node of two 16 GiB MPS GPUs.
WITH_MPS = ClusterFacts.of(
    [
        node_capacity("core-0", [gpu(f"G{i}", index=i, mem=40960, type=A100) for i in range(4)]),
        node_capacity("mig-0", [mig_gpu("M0")]),
        node_capacity(
            "mps-0",
            [mps_gpu(f"S{i}", index=i, count=48, mem=16384, type="NVIDIA L4") for i in range(2)],
        ),
    ]
)
SETTINGS = Settings()
GPU, MEM, PCT, CORES = (
    "nvidia.com/gpu",
    "nvidia.com/gpumem",
    "nvidia.com/gpumem-percentage",
    "nvidia.com/gpucores",
)


def pod(**limits: Any) -> PodBuilder:
    return make_pod("p").container("main", **limits)


@dataclass(frozen=True)
class Case:
    name: str
    pod: dict[str, Any]
    patch: tuple[str, ...] = ()  # paths of the expected patch
    code: int | None = None  # None: allowed
    message: tuple[str, ...] = ()  # substrings of the rejection message
    facts: ClusterFacts = FACTS
    user: str = "alice"
    settings: Settings = field(default_factory=Settings)


SCHED = pointer("spec", "schedulerName")
C0_LIMIT = pointer("spec", "containers", 0, "resources", "limits", GPU)
C0_REQUESTS = pointer("spec", "containers", 0, "resources", "requests")


def _with(p: PodBuilder, **spec: Any) -> dict[str, Any]:
    obj = p.build()
    obj["spec"].update(spec)
    return obj


def _privileged(obj: dict[str, Any]) -> dict[str, Any]:
    obj["spec"]["containers"][0]["securityContext"] = {"privileged": True}
    return obj


CASES = [
    # --- what is left alone
    Case("no GPU request: unchanged", pod(cpu="1").build()),
    Case("explicit zero GPUs: unchanged", pod(**{GPU: 0}).build()),
    Case(
        "another scheduler: unchanged, not validated",
        _with(pod(**{MEM: 1000, CORES: 150}), schedulerName="volcano"),
    ),
    Case(
        "Tessera's scheduler named, count given: nothing to do",
        _with(pod(**{GPU: 1, MEM: 1000}), schedulerName="hami-scheduler"),
    ),
    Case(
        "no node known: cluster checks skipped", pod(**{GPU: 64}).build(), (SCHED,), facts=UNKNOWN
    ),
    # --- mutations
    Case("count given: scheduler name only", pod(**{GPU: 2, MEM: 1000}).build(), (SCHED,)),
    Case(
        "default-scheduler is replaced",
        _with(pod(**{GPU: 1}), schedulerName="default-scheduler"),
        (SCHED,),
    ),
    Case(
        "memory only: count defaults to 1 in limits and requests",
        pod(**{MEM: 3000}).build(),
        (SCHED, C0_LIMIT, C0_REQUESTS),
    ),
    Case(
        "cores only: count defaults",
        pod(**{CORES: 30}).build(),
        (SCHED, C0_LIMIT, C0_REQUESTS),
    ),
    Case(
        "percentage only: count defaults",
        pod(**{PCT: 50}).build(),
        (SCHED, C0_LIMIT, C0_REQUESTS),
    ),
    Case(
        "init container gets its own path",
        make_pod("p").container("init", init=True, **{MEM: 100}).container("main").build(),
        (
            SCHED,
            pointer("spec", "initContainers", 0, "resources", "limits", GPU),
            pointer("spec", "initContainers", 0, "resources", "requests"),
        ),
    ),
    Case(
        "memory in requests only: limits map is added, requests key set",
        {
            "metadata": {"name": "p", "namespace": "default"},
            "spec": {"containers": [{"name": "c", "resources": {"requests": {MEM: "100"}}}]},
        },
        (
            SCHED,
            pointer("spec", "containers", 0, "resources", "limits"),
            pointer("spec", "containers", 0, "resources", "requests", GPU),
        ),
    ),
    Case(
        "MIG: two devices on a one-GPU MIG node are possible",
        pod(**{GPU: 2, MEM: 8000}).annotate(ann.VGPU_MODE, "mig").build(),
        (SCHED,),
    ),
    # --- presets only Tessera writes (403)
    *(
        Case(
            f"preset {key}",
            pod(**{GPU: 1}).annotate(key, "x").build(),
            code=403,
            message=(key, "remove it"),
        )
        for key in (
            ann.DEVICES_ALLOCATED,
            ann.DEVICES_TO_ALLOCATE,
            ann.MIG_ALLOCATIONS,
            ann.VGPU_NODE,
            ann.BIND_PHASE,
            ann.BIND_TIME,
        )
    ),
    Case(
        "internal annotation on a pod without GPUs is refused too",
        pod(cpu="1").annotate(ann.DEVICES_ALLOCATED, "x").build(),
        code=403,
        message=(ann.DEVICES_ALLOCATED,),
    ),
    Case(
        "internal annotation on another scheduler's pod is refused too",
        _with(pod(**{GPU: 1}).annotate(ann.BIND_PHASE, "success"), schedulerName="volcano"),
        code=403,
        message=(ann.BIND_PHASE,),
    ),
    Case(
        "user annotations under hami.io are fine",
        pod(**{GPU: 1}).annotate(ann.NODE_POLICY, "spread").build(),
        (SCHED,),
    ),
    Case(
        "nodeName on a GPU pod",
        _with(pod(**{GPU: 1}), nodeName="core-0"),
        code=403,
        message=("spec.nodeName", "'core-0'", "nodeSelector"),
    ),
    Case("nodeName on a pod without GPUs is fine", _with(pod(cpu="1"), nodeName="core-0")),
    Case(
        "trusted user may preset annotations and nodeName",
        _with(pod(**{GPU: 1}).annotate(ann.DEVICES_ALLOCATED, "x"), nodeName="core-0"),
        (SCHED,),
        user="tessera-admin",
        settings=Settings(trusted_users=frozenset({"tessera-admin"})),
    ),
    Case(
        "privileged container in a GPU pod",
        _privileged(pod(**{GPU: 1}).build()),
        code=403,
        message=("container 'main' is privileged", "every GPU"),
    ),
    Case(
        "trusted users may not run privileged GPU pods either",
        _privileged(pod(**{GPU: 1}).build()),
        code=403,
        message=("privileged",),
        user="tessera-admin",
        settings=Settings(trusted_users=frozenset({"tessera-admin"})),
    ),
    # --- invalid values (400), the scheduler's own validation
    Case("cores over 100", pod(**{GPU: 1, CORES: 150}).build(), code=400, message=(CORES, "150")),
    Case("percentage over 100", pod(**{PCT: 101}).build(), code=400, message=(PCT, "101")),
    Case("negative memory", pod(**{MEM: "-5"}).build(), code=400, message=(MEM, "-5")),
    Case("negative count", pod(**{GPU: -1}).build(), code=400, message=(GPU, "-1")),
    Case("fractional count", pod(**{GPU: "1.5"}).build(), code=400, message=("whole number",)),
    Case("fractional cores", pod(**{CORES: "500m"}).build(), code=400, message=("whole number",)),
    Case("not a quantity", pod(**{MEM: "lots"}).build(), code=400, message=("invalid quantity",)),
    Case("count over 64", pod(**{GPU: 65}).build(), code=400, message=("between 0 and 64",)),
    Case(
        "memory and percentage both",
        pod(**{MEM: 100, PCT: 10}).build(),
        code=400,
        message=("either", "not both"),
    ),
    Case(
        "memory with zero devices",
        pod(**{GPU: 0, MEM: 100}).build(),
        code=400,
        message=(f"{GPU}: 0",),
    ),
    Case(
        "unknown mode annotation",
        pod(**{GPU: 1}).annotate(ann.VGPU_MODE, "fast").build(),
        code=400,
        message=(ann.VGPU_MODE, "hami-core, mig"),
    ),
    Case(
        "unknown policy annotation",
        pod(**{GPU: 1}).annotate(ann.NODE_POLICY, "pack").build(),
        code=400,
        message=(ann.NODE_POLICY,),
    ),
    Case(
        "unknown name in a GPU policy chain",
        pod(**{GPU: 1}).annotate(ann.GPU_POLICY, "binpack,closest").build(),
        code=400,
        message=(ann.GPU_POLICY, "'closest'", "binpack, spread, numa, mutex, topology-aware"),
    ),
    Case(
        "GPU policy chain with known names",
        pod(**{GPU: 1}).annotate(ann.GPU_POLICY, "topology-aware,spread").build(),
        (SCHED,),
    ),
    Case(
        "scoring weights not slot=N,core=N,memory=N",
        pod(**{GPU: 1}).annotate(ann.SCORING_WEIGHTS, '{"memory":2}').build(),
        code=400,
        message=(ann.SCORING_WEIGHTS, "slot=N,core=N,memory=N"),
    ),
    Case(
        "numa-bind neither true nor false",
        pod(**{GPU: 1}).annotate(ann.NUMA_BIND, "maybe").build(),
        code=400,
        message=(ann.NUMA_BIND, "'maybe'"),
    ),
    Case(
        "MPS only, on MPS GPUs",
        pod(**{GPU: 2, MEM: 16384}).annotate(ann.VGPU_MODE, "mps").build(),
        (SCHED,),
        facts=WITH_MPS,
    ),
    # --- impossible on this cluster (400)
    Case(
        "more devices than any node (the MIG node holds 7)",
        pod(**{GPU: 8}).build(),
        code=400,
        message=(f"{GPU} = 8", "more than 7 GPU", "at most 7"),
    ),
    Case(
        "hami-core: more GPUs than any node has",
        pod(**{GPU: 5}).annotate(ann.VGPU_MODE, "hami-core").build(),
        code=400,
        message=("more than 4 hami-core GPU",),
    ),
    Case(
        "MIG: more instances than any GPU holds",
        pod(**{GPU: 8, MEM: 4000}).annotate(ann.VGPU_MODE, "mig").build(),
        code=400,
        message=("more than 7 MIG",),
    ),
    Case(
        "more memory than any GPU",
        pod(**{GPU: 1, MEM: 50000}).build(),
        code=400,
        message=("50000 MiB", "40960 MiB", A100, "core-0", "at most 40960"),
    ),
    Case(
        "MIG: more memory than the largest profile",
        pod(**{GPU: 1, MEM: 40900}).annotate(ann.VGPU_MODE, "mig").build(),
        code=400,
        message=("40448 MiB", "7g.40gb"),
    ),
    Case(
        "MIG asked of a cluster without MIG GPUs",
        pod(**{GPU: 1}).annotate(ann.VGPU_MODE, "mig").build(),
        code=400,
        message=("mig", "none of the 1 node"),
        facts=CORE_ONLY,
    ),
    Case(
        "MPS asked of a cluster without MPS GPUs",
        pod(**{GPU: 1}).annotate(ann.VGPU_MODE, "mps").build(),
        code=400,
        message=("MPS GPU devices", f"{ann.VGPU_MODE}: mps", "none of the 2 node"),
    ),
    Case(
        "MPS: more GPUs than any node has",
        pod(**{GPU: 3}).annotate(ann.VGPU_MODE, "mps").build(),
        code=400,
        message=(f"{GPU} = 3", "more than 2 MPS GPU device(s)", "at most 2"),
        facts=WITH_MPS,
    ),
    Case(
        "MPS: more memory than the largest MPS GPU",
        pod(**{GPU: 1, MEM: 20000}).annotate(ann.VGPU_MODE, "mps").build(),
        code=400,
        message=("20000 MiB", "largest MPS GPU", "16384 MiB", "NVIDIA L4 on node mps-0"),
        facts=WITH_MPS,
    ),
    Case(
        "hami-core or MPS: the larger GPU of either counts",
        pod(**{GPU: 1, MEM: 40000}).annotate(ann.VGPU_MODE, "hami-core,mps").build(),
        (SCHED,),
        facts=WITH_MPS,
    ),
    Case(
        "hami-core or MPS: more memory than either has",
        pod(**{GPU: 1, MEM: 41000}).annotate(ann.VGPU_MODE, "hami-core,mps").build(),
        code=400,
        message=("largest hami-core GPU or MPS GPU", "40960 MiB"),
        facts=WITH_MPS,
    ),
    Case(
        "no mode: MPS GPUs are in the pool",
        pod(**{GPU: 1, MEM: 41000}).build(),
        (SCHED,),
        facts=ClusterFacts.of([node_capacity("mps-0", [mps_gpu("S0", mem=49152)])]),
    ),
    Case(
        "every problem is named, presets decide the code",
        pod(**{GPU: 1, MEM: 90000}).annotate(ann.MIG_ALLOCATIONS, "[]").build(),
        code=403,
        message=(ann.MIG_ALLOCATIONS, "90000 MiB"),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_rules(case: Case) -> None:
    verdict = review_pod(case.pod, user=case.user, facts=case.facts, settings=case.settings)
    if case.code is None:
        assert verdict.allowed, verdict.message
        assert tuple(op.path for op in verdict.patch) == case.patch
    else:
        assert not verdict.allowed
        assert verdict.code == case.code
        for part in case.message:
            assert part in verdict.message


def _patched(obj: dict[str, Any], settings: Settings = SETTINGS) -> dict[str, Any]:
    verdict = review_pod(obj, user="u", facts=FACTS, settings=settings)
    assert verdict.allowed, verdict.message
    patched: dict[str, Any] = apply_patch(obj, [op.to_json() for op in verdict.patch])
    return patched


def test_patched_pod_asks_exactly_the_default_count_and_is_stable() -> None:
    obj = make_pod("p").container("a", **{MEM: 3000}).container("b", **{GPU: 2}).build()
    patched = _patched(obj)
    assert patched["spec"]["schedulerName"] == "hami-scheduler"
    a, b = patched["spec"]["containers"]
    assert a["resources"] == {
        "limits": {MEM: 3000, GPU: "1"},
        "requests": {GPU: "1"},
    }
    assert b["resources"] == {"limits": {GPU: 2}}  # untouched
    counts = [c.count for c in parse_request(patched, DeviceConfig()).containers]
    assert counts == [1, 2]
    assert review_pod(patched, user="u", facts=FACTS, settings=SETTINGS).patch == ()


def test_device_config_sets_runtime_class_and_hides_gpus_from_containers_without() -> None:
    settings = Settings(config=DeviceConfig(runtime_class_name="nvidia", overwrite_env=True))
    obj = (
        make_pod("p").container("gpu", **{GPU: 1}).container("sidecar").container("listed").build()
    )
    obj["spec"]["containers"][2]["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]
    patched = _patched(obj, settings)
    assert patched["spec"]["runtimeClassName"] == "nvidia"
    gpu, sidecar, listed = patched["spec"]["containers"]
    assert "env" not in gpu
    assert sidecar["env"] == [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"}]
    assert listed["env"][-1] == {"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"}
    assert review_pod(patched, user="u", facts=FACTS, settings=settings).patch == ()
    # A pod's own runtime class stays; a pod asking no GPU is left alone.
    own = make_pod("q").container("gpu", **{GPU: 1}).build()
    own["spec"]["runtimeClassName"] = "kata"
    assert _patched(own, settings)["spec"]["runtimeClassName"] == "kata"
    plain = make_pod("r").container("web").build()
    assert review_pod(plain, user="u", facts=FACTS, settings=settings).patch == ()


def test_config_names_resources_scheduler_and_default_count() -> None:
    config = DeviceConfig(
        resource_count_name="example.com/vgpu",
        resource_memory_name="example.com/vmem",
        default_gpu_num=2,
    )
    settings = Settings(scheduler_name="tessera", config=config)
    patched = _patched(make_pod("p").container("c", **{"example.com/vmem": 10}).build(), settings)
    assert patched["spec"]["schedulerName"] == "tessera"
    assert patched["spec"]["containers"][0]["resources"]["limits"]["example.com/vgpu"] == "2"
    # The default names mean nothing to this config.
    assert not asks_tessera(make_pod("p").container("c", **{GPU: 1}).build(), config)


def test_pointer_escapes_slash_and_tilde() -> None:
    assert pointer("a", "nvidia.com/gpu", "x~y", 0) == "/a/nvidia.com~1gpu/x~0y/0"


# ----- updates of existing pods ---------------------------------------------------------------

ALLOCATED = "GPU-0,NVIDIA,1000,0:;"
UPDATES: list[tuple[str, dict[str, Any], dict[str, Any], str, tuple[str, ...]]] = [
    # (name, old internal/other annotations, new ones, user, forbidden keys with their verb)
    (
        "removing one whose value is null",
        {ann.BIND_PHASE: None},
        {},
        "alice",
        (f"{ann.BIND_PHASE}: alice may not remove",),
    ),
    (
        "adding one whose value is null",
        {},
        {ann.BIND_PHASE: None},
        "alice",
        (f"{ann.BIND_PHASE}: alice may not add",),
    ),
    (
        "nothing internal changes",
        {ann.BIND_PHASE: "success"},
        {ann.BIND_PHASE: "success", "a": "b"},
        "alice",
        (),
    ),
    (
        "a user annotation changes",
        {ann.NODE_POLICY: "spread"},
        {ann.NODE_POLICY: "binpack"},
        "alice",
        (),
    ),
    (
        "forge an allocation",
        {},
        {ann.DEVICES_ALLOCATED: ALLOCATED},
        "alice",
        (f"{ann.DEVICES_ALLOCATED}: alice may not add",),
    ),
    (
        "shrink an allocation",
        {ann.DEVICES_ALLOCATED: ALLOCATED},
        {ann.DEVICES_ALLOCATED: "GPU-0,NVIDIA,1,0:;"},
        "alice",
        (f"{ann.DEVICES_ALLOCATED}: alice may not change",),
    ),
    (
        "drop a record",
        {ann.MIG_ALLOCATIONS: "[]", ann.VGPU_NODE: "n"},
        {},
        "alice",
        (f"{ann.MIG_ALLOCATIONS}: alice may not remove", f"{ann.VGPU_NODE}: alice may not remove"),
    ),
    (
        "mark allocated",
        {ann.BIND_PHASE: "allocating"},
        {ann.BIND_PHASE: "success"},
        "alice",
        (f"{ann.BIND_PHASE}: alice may not change",),
    ),
    ("a trusted user may", {}, {ann.DEVICES_ALLOCATED: ALLOCATED}, "restore-tool", ()),
]


@pytest.mark.parametrize(
    ("old", "new", "user", "forbidden"), [u[1:] for u in UPDATES], ids=[u[0] for u in UPDATES]
)
def test_update_may_not_alter_internal_annotations(
    old: dict[str, Any], new: dict[str, Any], user: str, forbidden: tuple[str, ...]
) -> None:
    settings = Settings(trusted_users=frozenset({"restore-tool"}))
    before = make_pod("p").gpu(1).build()
    after = make_pod("p").gpu(1).build()
    before["metadata"]["annotations"] = dict(old)
    after["metadata"]["annotations"] = dict(new)
    verdict = review_pod_update(before, after, user=user, settings=settings)
    assert verdict.patch == ()
    assert len(verdict.forbidden) == len(forbidden)
    for expected, got in zip(forbidden, verdict.forbidden, strict=True):
        key, _, words = expected.partition(": ")
        assert got.startswith(f"annotation {key} is written only by Tessera's"), got
        assert f"{words} it on an existing pod" in got
    assert verdict.allowed == (not forbidden)
    if forbidden:
        assert verdict.code == 403


ROUTING = Settings(host_only_pods=True, host_only_exclude=frozenset({"kube-system", "tessera"}))
# What the device config would set on a GPU pod must not reach a routed pod.
ROUTING_CONFIGURED = Settings(
    config=DeviceConfig(runtime_class_name="nvidia", overwrite_env=True),
    host_only_pods=True,
)
TO_TESSERA = (("add", "/spec/schedulerName", "hami-scheduler"),)


def _cpu_pod(**spec: Any) -> dict[str, Any]:
    p = make_pod("web", "team-a").container("main", cpu="1").build()
    p["spec"].update(spec)
    return p


def _without_namespace(p: dict[str, Any]) -> dict[str, Any]:
    del p["metadata"]["namespace"]
    return p


HOST_ONLY = [
    ("option off: left to kube-scheduler", SETTINGS, _cpu_pod(), "team-a", ()),
    ("routed", ROUTING, _cpu_pod(), "team-a", TO_TESSERA),
    (
        "names default-scheduler: routed",
        ROUTING,
        _cpu_pod(schedulerName="default-scheduler"),
        "team-a",
        TO_TESSERA,
    ),
    ("names Tessera already", ROUTING, _cpu_pod(schedulerName="hami-scheduler"), "team-a", ()),
    ("names another scheduler", ROUTING, _cpu_pod(schedulerName="volcano"), "team-a", ()),
    ("preset nodeName", ROUTING, _cpu_pod(nodeName="n1"), "team-a", ()),
    ("kube-system", ROUTING, _cpu_pod(), "kube-system", ()),
    ("Tessera's own namespace", ROUTING, _cpu_pod(), "tessera", ()),
    (
        "namespace from the pod when the review names none",
        ROUTING,
        make_pod("x", "tessera").container("c", cpu="1").build(),
        "",
        (),
    ),
    (
        "zero GPUs: asks for none",
        ROUTING,
        make_pod("z", "team-a").gpu(0).build(),
        "team-a",
        TO_TESSERA,
    ),
    (
        "namespace of the review, not of the pod",
        ROUTING,
        make_pod("y", "team-a").container("c", cpu="1").build(),
        "tessera",
        (),
    ),
    (
        "no namespace anywhere: default, routed",
        ROUTING,
        _without_namespace(_cpu_pod()),
        "",
        TO_TESSERA,
    ),
    (
        "scheduler name only: no runtime class, env or count",
        ROUTING_CONFIGURED,
        _cpu_pod(),
        "team-a",
        TO_TESSERA,
    ),
]


@pytest.mark.parametrize(
    ("settings", "obj", "namespace", "patch"),
    [c[1:] for c in HOST_ONLY],
    ids=[c[0] for c in HOST_ONLY],
)
def test_pods_without_a_gpu_go_to_tessera_only_when_routed(
    settings: Settings, obj: dict[str, Any], namespace: str, patch: tuple[Any, ...]
) -> None:
    verdict = review_pod(obj, user="alice", facts=FACTS, settings=settings, namespace=namespace)
    assert verdict.allowed
    assert tuple((op.op, op.path, op.value) for op in verdict.patch) == patch


def test_routing_leaves_gpu_pods_as_they_were() -> None:
    obj = pod(**{GPU: 1, MEM: 1000}).build()
    plain = review_pod(obj, user="alice", facts=FACTS, settings=SETTINGS, namespace="team-a")
    routed = review_pod(obj, user="alice", facts=FACTS, settings=ROUTING, namespace="team-a")
    assert routed == plain and plain.patch
