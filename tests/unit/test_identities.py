"""Interchangeable pods: Allocate hands one of them out, and the GPUs recorded for each are
corrected from the kubelet's PodResources, never counting a GPU below its real use."""

from __future__ import annotations

import tempfile
import threading
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from api.hami.config import DeviceConfig, NodeConfig
from api.hami.devices import decode_devices
from api.hami.keys import BIND_PHASE, DEVICES_ALLOCATED
from api.podresources.v1 import api_pb2
from node_agent.agent import NodeAgent
from node_agent.allocator import Allocator
from node_agent.identities import (
    IdentityFixer,
    KubeletPodResources,
    PodResourcesError,
    corrections,
)
from node_agent.mig_manager import MigManager
from node_agent.nvml.simulated import SimulatedNvml
from tests.fake_kubelet import FakePodResources
from tests.node_agent_fakes import (
    G0,
    G1,
    NODE,
    SLOTS,
    FakeKube,
    FakeLister,
    ScriptedKube,
    make_pod,
    simulated_gpus,
)

RESOURCE = "nvidia.com/gpu"


class Recording(ScriptedKube):
    """Checks after every write that no GPU is recorded by fewer pods than really use it
    (and answers its ``fail_at``-th write with a conflict)."""

    def __init__(self, users: Mapping[str, int], fail_at: int = 0) -> None:
        super().__init__(fail_at, after=self._check)
        self.users = users

    def _check(self) -> None:
        counted: Counter[str] = Counter()
        for obj in self.objects.values():
            for entry in decode_devices(obj["metadata"]["annotations"].get(DEVICES_ALLOCATED, "")):
                counted.update({d.uuid for d in entry})
        for gpu, n in self.users.items():
            assert counted[gpu] >= n, f"after write {self.writes}: {gpu} counted {counted[gpu]}"


@pytest.fixture
def backend() -> Iterator[SimulatedNvml]:
    yield from simulated_gpus(G0, G1)


def recorded(kube: FakeKube, path: str) -> list[str]:
    return [d.uuid for c in decode_devices(kube.annotations(path)[DEVICES_ALLOCATED]) for d in c]


def setup(kube: FakeKube, backend: SimulatedNvml) -> tuple[Allocator, IdentityFixer, FakeLister]:
    lister = FakeLister()
    fixer = IdentityFixer(NODE, kube, lister, RESOURCE)
    cfg = DeviceConfig(nodeconfig=(NodeConfig(NODE, "hami-core"),))
    mig = MigManager(backend, node_name=NODE)
    alloc = Allocator(NODE, kube, backend, mig, cfg, cache_name=lambda: "x", identities=fixer)
    return alloc, fixer, lister


def test_a_swapped_hand_out_is_corrected_without_undercounting_a_gpu(
    backend: SimulatedNvml,
) -> None:
    kube = Recording({G0: 1, G1: 1})
    p = kube.add_pod(make_pod("p", devices=[[(G0, 1000, 10)]]))
    q = kube.add_pod(make_pod("q", devices=[[(G1, 1000, 10)]]))
    alloc, fixer, lister = setup(kube, backend)
    # The kubelet admits q first; Allocate cannot tell and hands out p's entry (on G0).
    first = alloc.preferred(SLOTS, [], 1)
    assert first == [f"{G0}-0"]
    [envs] = alloc.allocate([first])
    assert envs.envs["NVIDIA_VISIBLE_DEVICES"] == G0
    assert fixer.pending() == {"default/p", "default/q"}
    second = alloc.preferred([s for s in SLOTS if s not in first], [], 1)
    assert second == [f"{G1}-0"]
    alloc.allocate([second])
    assert kube.annotations(p)[BIND_PHASE] == kube.annotations(q)[BIND_PHASE] == "success"
    # Not listed by the kubelet yet: nothing to decide, both stay pending.
    writes = kube.writes
    assert fixer.check() is False
    assert kube.writes == writes and fixer.pending() == {"default/p", "default/q"}
    # The kubelet's record: q's container holds G0's ids, p's holds G1's.
    lister.held = {("default/q", "c0"): tuple(first), ("default/p", "c0"): tuple(second)}
    assert fixer.check() is True
    assert (recorded(kube, p), recorded(kube, q)) == ([G1], [G0])
    assert fixer.corrected == 2 and not fixer.pending()
    assert kube.writes == writes + 4  # two rounds, two pods
    entry = decode_devices(kube.annotations(q)[DEVICES_ALLOCATED])[0][0]
    assert (entry.mem, entry.cores) == (1000, 10)


def _swapped(kube: FakeKube, backend: SimulatedNvml) -> tuple[IdentityFixer, FakeLister]:
    """p (G0) and q (G1) alike; the kubelet gave q p's entry and p q's."""
    kube.add_pod(make_pod("p", devices=[[(G0, 1000, 10)]]))
    kube.add_pod(make_pod("q", devices=[[(G1, 1000, 10)]]))
    alloc, fixer, lister = setup(kube, backend)
    alloc.allocate([[f"{G0}-0"]])
    alloc.allocate([[f"{G1}-0"]])
    return fixer, lister


P, Q = "/api/v1/namespaces/default/pods/p", "/api/v1/namespaces/default/pods/q"


def test_a_pod_the_kubelet_does_not_list_yet_keeps_what_others_record_counted(
    backend: SimulatedNvml,
) -> None:
    """q is listed holding G0 (p's entry); p is not listed yet and will get G1, which q
    records: q may add G0 but not drop G1 until p is listed."""
    kube = Recording({G0: 1, G1: 1})
    fixer, lister = _swapped(kube, backend)
    lister.held = {("default/q", "c0"): (f"{G0}-0",)}
    assert fixer.check() is False
    assert sorted(recorded(kube, Q)) == sorted([G1, G0])  # both: nothing under-counted
    assert recorded(kube, P) == [G0]
    writes = kube.writes
    assert fixer.check() is False and kube.writes == writes  # no growing record meanwhile
    lister.held[("default/p", "c0")] = (f"{G1}-0",)
    assert fixer.check() is True
    assert (recorded(kube, P), recorded(kube, Q)) == ([G1], [G0])


@pytest.mark.parametrize("fail_at", [1, 2])
def test_a_conflict_in_round_one_holds_round_two_back(backend: SimulatedNvml, fail_at: int) -> None:
    """p's or q's first round fails: the other keeps its old and real GPUs (round two would
    drop a GPU the failed one's holder still uses), and the next check finishes both."""
    kube = Recording({G0: 1, G1: 1}, fail_at=2 + fail_at)  # after the two allocations
    fixer, lister = _swapped(kube, backend)
    lister.held = {("default/q", "c0"): (f"{G0}-0",), ("default/p", "c0"): (f"{G1}-0",)}
    assert fixer.check() is False
    if fail_at == 2:  # p's round one held, q's failed
        assert sorted(recorded(kube, P)) == sorted([G0, G1]) and recorded(kube, Q) == [G1]
    else:
        assert (recorded(kube, P), recorded(kube, Q)) == ([G0], [G1])
    assert fixer.check() is True
    assert (recorded(kube, P), recorded(kube, Q)) == ([G1], [G0])


def test_a_hand_out_that_named_the_right_pod_writes_nothing(backend: SimulatedNvml) -> None:
    kube = FakeKube()
    kube.add_pod(make_pod("p", devices=[[(G0, 1000, 10)]]))
    kube.add_pod(make_pod("q", devices=[[(G1, 1000, 10)]]))
    alloc, fixer, lister = setup(kube, backend)
    alloc.allocate([[f"{G0}-0"]])
    alloc.allocate([[f"{G1}-0"]])
    lister.held = {("default/p", "c0"): (f"{G0}-0",), ("default/q", "c0"): (f"{G1}-0",)}
    patches = len(kube.patches)
    assert fixer.check() is True
    assert len(kube.patches) == patches and fixer.corrected == 0


def test_a_unique_pod_is_never_pending(backend: SimulatedNvml) -> None:
    kube = FakeKube()
    kube.add_pod(make_pod("p", devices=[[(G0, 1000, 10)]]))
    kube.add_pod(make_pod("q", devices=[[(G1, 2000, 10)]], bind_time=200))
    alloc, fixer, lister = setup(kube, backend)
    kube.objects["/api/v1/namespaces/default/pods/q"]["spec"]["nodeName"] = "elsewhere"
    alloc.allocate([[f"{G0}-0"]])
    assert fixer.pending() == set()
    assert fixer.check() is True and lister.calls == 0  # nothing pending: no List


def test_pods_gone_before_the_check_are_dropped(backend: SimulatedNvml) -> None:
    kube = FakeKube()
    kube.add_pod(make_pod("p", devices=[[(G0, 1000, 10)]]))
    q = kube.add_pod(make_pod("q", devices=[[(G1, 1000, 10)]]))
    alloc, fixer, _ = setup(kube, backend)
    alloc.allocate([[f"{G0}-0"]])
    del kube.objects["/api/v1/namespaces/default/pods/p"]
    kube.objects[q]["metadata"]["deletionTimestamp"] = "2024-01-01T00:00:05Z"
    assert fixer.check() is True and fixer.pending() == set()


def test_a_correction_interrupted_between_its_rounds_is_finished_after_a_restart() -> None:
    kube = FakeKube()
    # p recorded both its old (G0) and real (G1) devices when the agent stopped.
    half = make_pod("p", devices=[[(G0, 1000, 10), (G1, 1000, 10)]])
    half["spec"]["containers"][0]["resources"] = {"limits": {RESOURCE: "1"}}
    p = kube.add_pod(half)
    whole = make_pod("q", devices=[[(G1, 1000, 10)]])
    whole["spec"]["containers"][0]["resources"] = {"limits": {RESOURCE: "1"}}
    kube.add_pod(whole)
    lister = FakeLister()
    lister.held = {("default/p", "c0"): (f"{G1}-3",), ("default/q", "c0"): (f"{G1}-1",)}
    fixer = IdentityFixer(NODE, kube, lister, RESOURCE)  # a new agent: no hand-out record
    fixer.adopt(kube.list("/api/v1/pods")["items"])
    assert fixer.pending() == {"default/p"}
    assert fixer.check() is True
    assert recorded(kube, p) == [G1]


def test_corrections_read_the_kubelets_containers_by_name() -> None:
    pod = make_pod(
        "p",
        devices=[[], [(G0, 1000, 10)]],
        containers=[{"name": "init"}, {"name": "main"}],
    )
    held = {("default/p", "main"): (f"{G1}-0",), ("default/p", "init"): (f"{G0}-9",)}
    fixes, settled = corrections([pod], {"default/p"}, lambda ids: (G1,), held)
    assert [(f.key, f.container, [d.uuid for d in f.after]) for f in fixes] == [
        ("default/p", 1, [G1])
    ]
    assert settled == set()
    unreadable = make_pod("u", devices=[[(G0, 1, 1)]])
    unreadable["metadata"]["annotations"][DEVICES_ALLOCATED] = "garbage"
    fixes, settled = corrections([unreadable], {"default/u"}, lambda ids: (G1,), held)
    assert fixes == [] and settled == {"default/u"}


# The PodResources client, against a gRPC server on a unix socket -------------------------------


@pytest.fixture
def podres() -> Iterator[FakePodResources]:
    with tempfile.TemporaryDirectory(prefix="podres-") as d:
        server = FakePodResources(Path(d) / "kubelet.sock", RESOURCE)
        try:
            yield server
        finally:
            server.stop()


def test_kubelet_pod_resources_lists_one_resources_ids_per_container(
    podres: FakePodResources,
) -> None:
    podres.held = {("ns/p", "main"): ["a-0", "a-1"]}
    podres.extra = [
        api_pb2.PodResources(
            name="other",
            namespace="ns",
            containers=[
                api_pb2.ContainerResources(
                    name="x",
                    devices=[
                        api_pb2.ContainerDevices(resource_name="other.io/x", device_ids=["x"])
                    ],
                ),
                api_pb2.ContainerResources(name="sidecar"),
            ],
        )
    ]
    assert KubeletPodResources(str(podres.path)).list(RESOURCE) == {
        ("ns/p", "main"): ("a-0", "a-1")
    }


def test_kubelet_pod_resources_failure_is_temporary_and_names_the_socket(
    podres: FakePodResources,
) -> None:
    podres.fail = True
    with pytest.raises(PodResourcesError, match=f"{podres.path}.*UNAVAILABLE: kubelet busy"):
        KubeletPodResources(str(podres.path)).list(RESOURCE)


# The agent's check loop -----------------------------------------------------------------------


class _Halt:
    """A stop event whose waits return at once and are recorded."""

    def __init__(self, stop_after: int) -> None:
        self.waits: list[float] = []
        self.stop_after = stop_after

    def is_set(self) -> bool:
        return len(self.waits) >= self.stop_after

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(float(timeout or 0.0))
        return self.is_set()


class _FlakyFixer:
    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.checks = 0
        self.wake = threading.Event()
        self.wake.set()  # the idle wait returns at once

    def adopt(self, pods: Any) -> None:
        pass

    def check(self) -> bool:
        self.checks += 1
        if self.checks <= self.failures:
            raise PodResourcesError("list pod resources at /x: UNAVAILABLE")
        return False  # still pending: the loop keeps its pace


def test_the_check_loop_backs_off_while_failing_and_logs_once(
    backend: SimulatedNvml, capsys: pytest.CaptureFixture[str]
) -> None:
    agent = NodeAgent(NODE, FakeKube(), backend, DeviceConfig(), identity_check_s=0.5)
    halt = _Halt(stop_after=8)
    fixer = _FlakyFixer(failures=5)
    agent._identity_loop(fixer, halt)  # type: ignore[arg-type]
    assert halt.waits == [1.0, 2.0, 4.0, 8.0, 16.0, 0.5, 0.5, 0.5]
    out = capsys.readouterr().out + capsys.readouterr().err
    assert out.count("identity_check_failed") == 1
    assert out.count("identity_check_recovered") == 1
