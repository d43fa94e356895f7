"""``tessera check``: every violation kind is caught on hand-built nodes, pods and simulated
GPUs, and a clean cluster passes (no cluster needed)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from api.hami import keys as ann
from api.hami.catalog import find_model
from api.hami.config import DeviceConfig
from api.hami.devices import RuntimeIdentity
from api.hami.register import GpuDevice, Placement, decode, encode
from node_agent.nvml.backend import full_compute_instance_profile
from node_agent.nvml.simulated import SimulatedGpuSpec, SimulatedNvml
from scheduler_plugins.cli import main
from scheduler_plugins.devtools.check import (
    CheckInputError,
    CheckReport,
    SimNode,
    Violation,
    ViolationKind,
    check_cluster,
    check_objects,
    load_sim_states,
    parse_sim_state,
)
from scheduler_plugins.devtools.cluster.nodes import NodeGroup, node_object

Obj = dict[str, Any]
MODEL = "A100-PCIE-40GB"
CORE = node_object("core", NodeGroup(MODEL, gpus_per_node=2), DeviceConfig(), now=0)
MIGN = node_object("mign", NodeGroup(MODEL, gpus_per_node=1, mode="mig"), DeviceConfig(), now=0)
NODES = (CORE, MIGN)


def _gpus(node: Obj) -> tuple[GpuDevice, ...]:
    return decode(node["metadata"]["annotations"][ann.NODE_REGISTER])


CORE_GPUS = _gpus(CORE)
(MIG_GPU,) = _gpus(MIGN)


# Builders ------------------------------------------------------------------------------------


def _pod(name: str, limits: dict[str, object], annotations: dict[str, str]) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "annotations": dict(annotations)},
        "spec": {
            "schedulerName": "hami-scheduler",
            "containers": [{"name": "main", "resources": {"limits": dict(limits)}}],
        },
        "status": {"phase": "Pending"},
    }


def _bound(name: str, node: str, limits: dict[str, object], extra: dict[str, str]) -> Obj:
    pod = _pod(
        name,
        limits,
        {
            ann.VGPU_NODE: node,
            ann.BIND_TIME: str(int(time.time())),
            ann.BIND_PHASE: "success",
            ann.DEVICES_TO_ALLOCATE: ";",
            **extra,
        },
    )
    pod["spec"]["nodeName"] = node
    pod["status"] = {"phase": "Running"}
    return pod


def shared(name: str, gpu: int = 0, mem: int = 10000, cores: int = 0) -> Obj:
    uuid = CORE_GPUS[gpu].id
    return _bound(
        name,
        "core",
        {"nvidia.com/gpu": 1, "nvidia.com/gpumem": mem, "nvidia.com/gpucores": cores},
        {ann.DEVICES_ALLOCATED: f"{uuid},NVIDIA,{mem},{cores}:;"},
    )


def mig(name: str, profile: str, start: int, runtime: RuntimeIdentity | None) -> Obj:
    fact = next(p for p in find_model(MODEL).profiles if p.name == profile)
    alloc: dict[str, object] = {
        "containerIndex": 0,
        "deviceIndex": 0,
        "gpuUUID": MIG_GPU.id,
        "profile": profile,
        "placement": {"start": start, "size": fact.placement_size},
    }
    if runtime is not None:
        alloc.update(
            migUUID=runtime.mig_uuid,
            gpuInstanceID=runtime.gpu_instance_id,
            computeInstanceID=runtime.compute_instance_id,
        )
    return _bound(
        name,
        "mign",
        {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 4000},
        {
            ann.VGPU_MODE: "mig",
            ann.DEVICES_ALLOCATED: f"{MIG_GPU.id},NVIDIA,{fact.memory_mib},0:;",
            ann.MIG_ALLOCATIONS: json.dumps([alloc]),
        },
    )


def pending(name: str, condition: Obj | None) -> Obj:
    pod = _pod(name, {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 1000}, {})
    if condition is not None:
        pod["status"]["conditions"] = [{"type": "PodScheduled", **condition}]
    return pod


UNSCHEDULABLE: Obj = {"status": "False", "reason": "Unschedulable", "message": "0/2 nodes fit"}


@dataclass
class Hardware:
    """The MIG node's simulated GPU, with instances made the way the node agent makes them."""

    backend: SimulatedNvml = field(
        default_factory=lambda: SimulatedNvml(
            [SimulatedGpuSpec(MODEL, uuid=MIG_GPU.id)], node_name="mign"
        )
    )

    wrote_state: bool = True  # False: the node never wrote a state file

    def __post_init__(self) -> None:
        self.backend.init()

    def create(self, profile: str, start: int) -> RuntimeIdentity:
        fact = next(p for p in find_model(MODEL).profiles if p.name == profile)
        gi = self.backend.create_gpu_instance_with_placement(
            0, fact.profile_id, Placement(start, fact.placement_size)
        )
        ci = self.backend.create_compute_instance(
            0, gi.id, full_compute_instance_profile(fact.slice_count)
        )
        return RuntimeIdentity(self.backend.mig_device_uuid(0, gi.id, ci.id), gi.id, ci.id)

    def sim(self) -> dict[str, SimNode]:
        if not self.wrote_state:
            return {}
        return {"mign": parse_sim_state(self.backend.state_snapshot(), where="mign")}


def run(pods: list[Obj], hw: Hardware | None = None, nodes: tuple[Obj, ...] = NODES) -> CheckReport:
    return check_objects(list(nodes), pods, sim_states=hw.sim() if hw else None)


# A clean cluster -----------------------------------------------------------------------------


def test_clean_cluster_passes_with_its_counts() -> None:
    hw = Hardware()
    a, b = hw.create("1g.5gb", 0), hw.create("2g.10gb", 2)
    plain = _pod("plain", {}, {})
    plain["spec"]["nodeName"] = "core"
    pods = [
        shared("s1", 0, 20000, 50),
        shared("s2", 0, 20000, 50),
        shared("s3", 1),
        mig("m1", "1g.5gb", 0, a),
        mig("m2", "2g.10gb", 2, b),
        pending("waits", UNSCHEDULABLE),
        plain,
    ]
    report = run(pods, hw)
    assert report.ok, report.summary()
    assert (report.nodes, report.pods, report.gpu_pods) == (2, 7, 6)
    assert (report.mig_instances, report.sim_instances) == (2, 2)
    assert report.summary().startswith("ok: 2 nodes, 7 pods (6 GPU), 2 MIG instances")
    assert json.loads(report.to_json()) == {
        "ok": True,
        "nodes": 2,
        "pods": 7,
        "gpuPods": 6,
        "migInstances": 2,
        "simInstances": 2,
        "violations": [],
    }


def test_ended_and_deleting_pods_are_not_held_to_account() -> None:
    done = shared("done", 0, 40000)
    done["status"]["phase"] = "Succeeded"
    failed = pending("failed-pending", None)
    failed["status"]["phase"] = "Failed"
    deleting = pending("deleting", None)
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert run([shared("live", 0, 20000), done, failed, deleting]).ok


# Every violation kind ------------------------------------------------------------------------


def _mutated(pod: Obj, change: Callable[[Obj], None]) -> Obj:
    change(pod)
    return pod


def _drop(key: str) -> Callable[[Obj], None]:
    return lambda p: p["metadata"]["annotations"].pop(key)


def _set(key: str, value: str) -> Callable[[Obj], None]:
    return lambda p: p["metadata"]["annotations"].__setitem__(key, value)


def _leaked() -> tuple[list[Obj], Hardware]:
    hw = Hardware()
    hw.create("1g.5gb", 6)
    return [], hw


def _lost() -> tuple[list[Obj], Hardware]:
    hw = Hardware()
    ghost = RuntimeIdentity("MIG-00000000-0000-0000-0000-000000000001", 8, 0)
    return [mig("m", "1g.5gb", 1, ghost)], hw


def _other_uuid() -> tuple[list[Obj], Hardware]:
    hw = Hardware()
    rt = hw.create("1g.5gb", 0)
    wrong = RuntimeIdentity("MIG-00000000-0000-0000-0000-000000000002", rt.gpu_instance_id, 0)
    return [mig("m", "1g.5gb", 0, wrong)], hw


def _other_gi() -> tuple[list[Obj], Hardware]:
    hw = Hardware()
    rt = hw.create("1g.5gb", 0)
    return [mig("m", "1g.5gb", 0, RuntimeIdentity(rt.mig_uuid, 9, 0))], hw


def _other_profile() -> tuple[list[Obj], Hardware]:
    hw = Hardware()
    rt = hw.create("1g.10gb", 0)  # same [0,2) slot as a 2g.10gb, other profile
    return [mig("m", "2g.10gb", 0, rt)], hw


def _no_state_file() -> tuple[list[Obj], Hardware]:
    hw = Hardware()
    rt = hw.create("1g.5gb", 0)
    hw.wrote_state = False
    return [mig("m", "1g.5gb", 0, rt)], hw


def _twice() -> tuple[list[Obj], Hardware | None]:
    rt = RuntimeIdentity("MIG-00000000-0000-0000-0000-000000000003", 7, 0)
    return [mig("m1", "1g.5gb", 0, rt), mig("m2", "1g.5gb", 1, rt)], None


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], tuple[list[Obj], Hardware | None]]
    kind: ViolationKind
    fragment: str


CASES = [
    Case(
        "two MIG reservations overlap",
        lambda: ([mig("m1", "2g.10gb", 0, None), mig("m2", "1g.5gb", 1, None)], None),
        ViolationKind.MIG_OVERLAP,
        "mign/GPU 0 (mig): 1 MIG slices used twice",
    ),
    Case(
        "memory over devmem",
        lambda: ([shared("a", 0, 30000), shared("b", 0, 20000)], None),
        ViolationKind.OVER_CAPACITY,
        "50000 MiB > devmem 40960",
    ),
    Case(
        "cores over devcore",
        lambda: ([shared("a", 0, 1000, 60), shared("b", 0, 1000, 60)], None),
        ViolationKind.OVER_CAPACITY,
        "120% cores > devcore 100",
    ),
    Case(
        "vGPU slots over count",
        lambda: ([shared(f"p{i}", 1, 100) for i in range(11)], None),
        ViolationKind.OVER_CAPACITY,
        "11 vGPUs > count 10",
    ),
    Case(
        "bound GPU pod without devices-allocated",
        lambda: ([_mutated(shared("p"), _drop(ann.DEVICES_ALLOCATED))], None),
        ViolationKind.BAD_ANNOTATIONS,
        f"missing {ann.DEVICES_ALLOCATED}",
    ),
    Case(
        "bind-phase still allocating",
        lambda: ([_mutated(shared("p"), _set(ann.BIND_PHASE, "allocating"))], None),
        ViolationKind.BAD_ANNOTATIONS,
        "bind-phase='allocating', want success",
    ),
    Case(
        "vgpu-node names another node",
        lambda: ([_mutated(shared("p"), _set(ann.VGPU_NODE, "mign"))], None),
        ViolationKind.BAD_ANNOTATIONS,
        "vgpu-node='mign' but bound to core",
    ),
    Case(
        "device of another node",
        lambda: (
            [_mutated(shared("p"), lambda p: p["spec"].__setitem__("nodeName", "mign"))],
            None,
        ),
        ViolationKind.BAD_ANNOTATIONS,
        "is not a GPU of mign",
    ),
    Case(
        "devices-allocated undecodable",
        lambda: ([_mutated(shared("p"), _set(ann.DEVICES_ALLOCATED, "garbage"))], None),
        ViolationKind.BAD_ANNOTATIONS,
        "undecodable",
    ),
    Case(
        "allocated memory differs from the request",
        lambda: (
            [
                _mutated(
                    shared("p", mem=1000),
                    _set(ann.DEVICES_ALLOCATED, f"{CORE_GPUS[0].id},NVIDIA,500,0:;"),
                )
            ],
            None,
        ),
        ViolationKind.BAD_ANNOTATIONS,
        "500 MiB 0% for request",
    ),
    Case(
        "illegal MIG placement",
        lambda: ([mig("m", "2g.10gb", 1, None)], None),
        ViolationKind.BAD_ANNOTATIONS,
        "not a legal placement",
    ),
    Case(
        "MIG device without runtime identity after success",
        lambda: ([mig("m", "1g.5gb", 2, None)], None),
        ViolationKind.BAD_ANNOTATIONS,
        "has no runtime identity",
    ),
    Case(
        "pending GPU pod without PodScheduled condition",
        lambda: ([pending("p", None)], None),
        ViolationKind.UNEXPLAINED_PENDING,
        "no PodScheduled condition",
    ),
    Case(
        "pending GPU pod without a message",
        lambda: ([pending("p", {**UNSCHEDULABLE, "message": ""})], None),
        ViolationKind.UNEXPLAINED_PENDING,
        "want False/Unschedulable with a message",
    ),
    Case(
        "pending GPU pod with allocation annotations",
        lambda: ([_mutated(pending("p", UNSCHEDULABLE), _set(ann.DEVICES_ALLOCATED, ";"))], None),
        ViolationKind.UNEXPLAINED_PENDING,
        f"not bound but carries allocation annotations {ann.DEVICES_ALLOCATED}",
    ),
    Case(
        "instance reserved by nobody",
        _leaked,
        ViolationKind.LEAKED_INSTANCE,
        "mign/GPU 0 GI 13 at [6,7): no live pod reserves it (MIG-",
    ),
    Case(
        "recorded instance missing from the hardware",
        _lost,
        ViolationKind.MIG_IDENTITY,
        "the GPU has no instance there (lost)",
    ),
    Case(
        "recorded MIG UUID differs",
        _other_uuid,
        ViolationKind.MIG_IDENTITY,
        "recorded MIG-00000000-0000-0000-0000-000000000002",
    ),
    Case(
        "recorded GI id differs",
        _other_gi,
        ViolationKind.MIG_IDENTITY,
        "GPU instance id is 7, recorded 9",
    ),
    Case(
        "instance of another profile at the reserved slot",
        _other_profile,
        ViolationKind.MIG_IDENTITY,
        "reserved 2g.10gb",
    ),
    Case(
        "runtime identity on a node without simulated state",
        _no_state_file,
        ViolationKind.MIG_IDENTITY,
        "which has no simulated state file",
    ),
    Case(
        "one MIG UUID recorded twice",
        _twice,
        ViolationKind.MIG_IDENTITY,
        "recorded by 2: default/m1 container 0 device 0; default/m2",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_violation_is_caught(case: Case) -> None:
    pods, hw = case.build()
    report = run(pods, hw)
    assert not report.ok
    found = [v for v in report.violations if v.kind == case.kind and case.fragment in str(v)]
    assert found, report.summary()
    assert f"{case.kind.value}: " in report.summary()
    assert any(
        v["kind"] == case.kind.value and case.fragment in f"{v['object']}: {v['message']}"
        for v in json.loads(report.to_json())["violations"]
    )


def test_each_violation_is_reported_once_and_in_order() -> None:
    report = run([shared("a", 0, 30000), shared("b", 0, 20000), pending("p", None)])
    assert list(report.violations) == sorted(set(report.violations))
    assert report.by_kind() == {"over-capacity": 1, "unexplained-pending": 1}
    assert (
        report.summary()
        .splitlines()[0]
        .startswith("2 violations (1 over-capacity, 1 unexplained-pending): 2 nodes, 3 pods")
    )


def test_malformed_node_register_is_reported_not_raised() -> None:
    broken = json.loads(json.dumps(CORE))
    broken["metadata"]["annotations"][ann.NODE_REGISTER] = "not json"
    report = run([], nodes=(broken, MIGN))
    assert [v.kind for v in report.violations] == [ViolationKind.UNREADABLE]
    assert report.violations[0].object == "core"


def test_malformed_mig_annotation_is_reported_not_raised() -> None:
    pod = _mutated(mig("m", "1g.5gb", 0, None), _set(ann.MIG_ALLOCATIONS, "[{"))
    (violation,) = run([pod]).violations
    assert violation.kind == ViolationKind.BAD_ANNOTATIONS and "undecodable" in violation.message


# State files and the cluster adapter -----------------------------------------------------------


def test_state_dir_files_are_read_and_bad_ones_reported(tmp_path: Path) -> None:
    hw = Hardware()
    hw.create("3g.20gb", 4)
    (tmp_path / "mign.json").write_text(json.dumps(hw.backend.state_snapshot()))
    (tmp_path / "broken.json").write_text('{"gpus": [{"uuid": "GPU-x"}]}')
    (tmp_path / ".mign.json.123.tmp").write_text("partial")
    states, problems = load_sim_states(tmp_path)
    assert list(states) == ["mign"]
    assert [i.placement for i in states["mign"].instances] == [Placement(4, 4)]
    assert [(p.kind, p.object) for p in problems] == [
        (ViolationKind.UNREADABLE, "broken state file")
    ]
    assert "malformed simulated NVML state" in problems[0].message


def test_state_dir_must_exist(tmp_path: Path) -> None:
    with pytest.raises(CheckInputError, match="not a directory"):
        load_sim_states(tmp_path / "missing")


@dataclass
class FakeApi:
    nodes: list[Obj]
    pods: list[Obj]

    def list(self, path: str) -> dict[str, Any]:
        return {"items": self.nodes if path == "/api/v1/nodes" else self.pods}


def test_check_cluster_lists_and_checks(tmp_path: Path) -> None:
    hw = Hardware()
    rt = hw.create("1g.5gb", 0)
    hw.create("1g.5gb", 3)  # leaked
    (tmp_path / "mign.json").write_text(json.dumps(hw.backend.state_snapshot()))
    report = check_cluster(FakeApi(list(NODES), [mig("m", "1g.5gb", 0, rt)]), sim_state=tmp_path)
    assert [v.kind for v in report.violations] == [ViolationKind.LEAKED_INSTANCE]
    assert report.violations[0] == Violation(
        ViolationKind.LEAKED_INSTANCE,
        "mign/GPU 0 GI 10 at [3,4)",
        report.violations[0].message,
    )


# The command line ----------------------------------------------------------------------------


def _kubeconfig(tmp_path: Path, server: str) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(
        json.dumps(
            {
                "current-context": "c",
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                "clusters": [
                    {"name": "c", "cluster": {"server": server, "insecure-skip-tls-verify": True}}
                ],
                "users": [{"name": "u", "user": {"token": "t"}}],
            }
        )
    )
    return path


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kubeconfig", "/nonexistent/kubeconfig"], "no such file"),
        (["--kubeconfig", "{kc}", "--sim-state", "/nonexistent"], "not a directory"),
        (["--kubeconfig", "{kc}", "--config", "/nonexistent.yaml"], "cannot read config file"),
        (["--kubeconfig", "{kc}"], "cannot list nodes and pods"),
    ],
    ids=["missing kubeconfig", "missing state dir", "missing config", "unreachable apiserver"],
)
def test_cli_bad_input_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    kc = _kubeconfig(tmp_path, "https://127.0.0.1:1")  # nothing listens on port 1
    argv = ["check", *(a.replace("{kc}", str(kc)) for a in args)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("tessera: ") and message in err, err


def legacy(name: str) -> Obj:
    """A pod HAMi <= v2.9 placed on the MIG GPU: its template's memory and cores."""
    return _bound(
        name,
        "mign",
        {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 15000},
        {ann.DEVICES_ALLOCATED: f"{MIG_GPU.id}[1-1],NVIDIA,19968,28:;"},
    )


# MPS GPUs: counted like hami-core ones -------------------------------------------------------

MPSN = node_object("mpsn", NodeGroup(MODEL, gpus_per_node=2, mode="mps"), DeviceConfig(), now=0)
MPS_GPUS = _gpus(MPSN)


def client(
    name: str, gpu: int = 0, mem: int = 10000, cores: int = 0, mode: str = "mps", node: str = "mpsn"
) -> Obj:
    """A pod the scheduler placed on an MPS GPU (or, with ``node="core"``, a hami-core one)."""
    uuid = (MPS_GPUS if node == "mpsn" else CORE_GPUS)[gpu].id
    return _bound(
        name,
        node,
        {"nvidia.com/gpu": 1, "nvidia.com/gpumem": mem, "nvidia.com/gpucores": cores},
        {ann.VGPU_MODE: mode, ann.DEVICES_ALLOCATED: f"{uuid},NVIDIA,{mem},{cores}:;"},
    )


def test_mps_clients_pass_and_count() -> None:
    pods = [client("a", 0, 20000, 50), client("b", 0, 20000, 50), shared("c", 1)]
    report = run([*pods, client("d", 1, mode="hami-core,mps")], nodes=(*NODES, MPSN))
    assert report.ok, report.summary()
    assert (report.nodes, report.gpu_pods) == (3, 4)


@pytest.mark.parametrize(
    ("pods", "kind", "fragment"),
    [
        (
            [client("a", 0, 30000), client("b", 0, 20000)],
            ViolationKind.OVER_CAPACITY,
            "mpsn/GPU 0 (mps): 50000 MiB > devmem 40960",
        ),
        (
            [client("a", 0, 1000, 60), client("b", 0, 1000, 60)],
            ViolationKind.OVER_CAPACITY,
            "mpsn/GPU 0 (mps): 120% cores > devcore 100",
        ),
        (
            [client(f"p{i}", 1, 100) for i in range(11)],
            ViolationKind.OVER_CAPACITY,
            "mpsn/GPU 1 (mps): 11 vGPUs > count 10",
        ),
        (
            [client("a", mode="hami-core")],
            ViolationKind.BAD_ANNOTATIONS,
            "asked for hami-core, got a mps device",
        ),
        (
            [client("a", node="core")],
            ViolationKind.BAD_ANNOTATIONS,
            "asked for mps, got a hami-core device",
        ),
    ],
    ids=["memory", "cores", "client slots", "hami-core pod on MPS", "MPS pod on hami-core"],
)
def test_mps_violations_are_caught(pods: list[Obj], kind: ViolationKind, fragment: str) -> None:
    report = run(pods, nodes=(*NODES, MPSN))
    assert [str(v) for v in report.violations if v.kind == kind and fragment in str(v)], (
        report.summary()
    )


def test_what_hami_left_passes() -> None:
    mps_node = json.loads(json.dumps(CORE))
    mps_gpus = tuple(
        GpuDevice(d.id, d.index, d.count, d.devmem, d.devcore, d.type, d.numa, d.health, "mps")
        for d in CORE_GPUS
    )
    mps_node["metadata"]["annotations"][ann.NODE_REGISTER] = encode(mps_gpus)
    report = run([legacy("old"), shared("on-mps", 0, 4000)], nodes=(mps_node, MIGN))
    assert report.ok, report.summary()


def test_a_mig_reservation_beside_a_legacy_slot_is_caught() -> None:
    hw = Hardware()
    runtime = hw.create("1g.5gb", 6)
    report = run([legacy("old"), mig("new", "1g.5gb", 6, runtime)], hw)
    assert [v.kind for v in report.violations] == [ViolationKind.MIG_OVERLAP]
    assert "HAMi <= v2.9" in report.violations[0].message
