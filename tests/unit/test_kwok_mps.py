"""kwok mode on fake mps nodes: simulated daemons per GPU, Allocate through the MPS branch,
and the register annotation's health flag following the daemons (set from outside by
fault files, as the e2e tests do)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from api.errors import InvalidAnnotationError
from api.hami.catalog import simulated_gpu_uuid, simulated_register_json
from api.hami.config import DeviceConfig
from api.hami.keys import BIND_PHASE, DEVICES_TO_ALLOCATE, NODE_REGISTER
from api.hami.register import decode
from api.kube.errors import ApiError, NotFoundError
from node_agent.kwok_mode import JSON_PATCH, KWOK_NODE_ANNOTATION, KwokAgents, with_gpu_health
from tests.node_agent_fakes import FakeKube, make_pod
from tests.waiting import eventually

NODE = "kwok-mps-0"
NODE_PATH = f"/api/v1/nodes/{NODE}"
G0, G1 = simulated_gpu_uuid(NODE, 0), simulated_gpu_uuid(NODE, 1)


class KwokKube(FakeKube):
    """``FakeKube`` plus what kwok mode calls besides: node lists and JSON patches of
    annotations (``test`` and ``add``, as the allocator's guarded patches send them)."""

    def list(
        self, path: str, *, field_selector: str | None = None, limit: int | None = None
    ) -> dict[str, Any]:
        if path == "/api/v1/nodes":
            nodes = [o for p, o in sorted(self.objects.items()) if p.startswith(path + "/")]
            return {"items": copy.deepcopy(nodes)}
        return super().list(path, field_selector=field_selector)

    def request(self, method: str, path: str, body: Any, *, content_type: str) -> Any:
        assert (method, content_type) == ("PATCH", JSON_PATCH)
        obj = self.objects.get(path)
        if obj is None:
            raise NotFoundError(method, path, 404, "NotFound", "not found")
        patched = copy.deepcopy(obj)
        for op in body:
            where = op["path"]
            if where == "/metadata/uid":
                assert op["op"] == "test"
                current = patched["metadata"].get("uid")
            else:
                prefix = "/metadata/annotations/"
                assert where.startswith(prefix)
                key = where[len(prefix) :].replace("~1", "/").replace("~0", "~")
                annotations = patched["metadata"].setdefault("annotations", {})
                if op["op"] == "add":
                    annotations[key] = op["value"]
                    continue
                current = annotations.get(key)
            if current != op["value"]:
                raise ApiError(method, path, 422, "Invalid", f"test failed at {where}")
        self.patches.append((path, {"json-patch": body}, None))
        self._bump(patched)
        self.objects[path] = patched
        return copy.deepcopy(patched)


def fake_node(name: str = NODE, gpus: int = 2) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {
                KWOK_NODE_ANNOTATION: "fake",
                NODE_REGISTER: simulated_register_json(name, "A100-PCIE-40GB", gpus, "mps"),
            },
        },
    }


@pytest.fixture
def kube() -> KwokKube:
    k = KwokKube()
    k.put(NODE_PATH, fake_node())
    return k


@pytest.fixture
def agents(kube: KwokKube, tmp_path: Path) -> Iterator[KwokAgents]:
    # Not started: no watch and no timer; the tests feed events and run passes themselves.
    a = KwokAgents(kube, DeviceConfig(), state_dir=tmp_path)  # type: ignore[arg-type]
    yield a
    a.stop()


def register(kube: FakeKube) -> str:
    return kube.annotations(NODE_PATH)[NODE_REGISTER]


def add_pod(kube: FakeKube, agents: KwokAgents, pod: dict[str, Any]) -> str:
    path = kube.add_pod(pod)
    agents.handle("ADDED", kube.get(path))
    eventually(agents.idle, timeout_s=10, interval_s=0.01)
    return path


def run_pass(agents: KwokAgents) -> None:
    agents.mps_pass()
    eventually(agents.idle, timeout_s=10, interval_s=0.01)


def crash(tmp_path: Path, gpu: str) -> None:
    faults = tmp_path / f"{NODE}.mps" / "faults"
    faults.mkdir(parents=True, exist_ok=True)
    (faults / f"{gpu}.crash").touch()


def without_health(value: str, gpu: str) -> str:
    """``value`` with the one GPU's ``,"health":true`` member removed (HAMi omits false)."""
    at = value.index(f'"id":"{gpu}"')
    member = value.index(',"health":true}', at)
    return value[:member] + value[member + len(',"health":true') :]


def test_a_pod_on_a_fake_mps_node_is_allocated_as_hami_core_pods_are(
    kube: KwokKube, agents: KwokAgents
) -> None:
    path = add_pod(kube, agents, make_pod("p", NODE, devices=[[(G0, 2000, 30), (G1, 1000, 30)]]))
    ann = kube.annotations(path)
    assert (ann[BIND_PHASE], ann[DEVICES_TO_ALLOCATE]) == ("success", ";")
    fake = agents.node(NODE)
    assert fake is not None and fake.mps_backend is not None
    assert fake.mps_backend.daemons() == {G0, G1}
    assert NODE_PATH not in {p for p, _, _ in kube.patches}  # every daemon up: nothing to say


def test_a_crash_flips_exactly_that_gpus_register_health_and_back(
    kube: KwokKube, agents: KwokAgents, tmp_path: Path
) -> None:
    before = register(kube)
    fake = agents.node(NODE)
    assert fake is not None and fake.mps_backend is not None
    crash(tmp_path, G1)
    run_pass(agents)
    assert register(kube) == without_health(before, G1)
    assert [d.health for d in decode(register(kube))] == [True, False]
    run_pass(agents)  # the next check restarts the daemon
    assert register(kube) == before
    assert fake.mps_backend.starts(G1) == 2 and fake.mps_backend.starts(G0) == 1


def test_a_pod_refused_while_a_daemon_was_down_is_allocated_once_it_is_back(
    kube: KwokKube, agents: KwokAgents, tmp_path: Path
) -> None:
    agents.node(NODE)
    faults = tmp_path / f"{NODE}.mps" / "faults"
    faults.mkdir(parents=True)
    (faults / f"{G0}.fail_start").touch()
    crash(tmp_path, G0)
    run_pass(agents)
    run_pass(agents)  # the restart fails: still down
    assert [d.health for d in decode(register(kube))] == [False, True]
    path = add_pod(kube, agents, make_pod("p", NODE, devices=[[(G0, 2000, 0)]]))
    assert kube.annotations(path)[BIND_PHASE] == "allocating"  # refused for now
    (faults / f"{G0}.fail_start").unlink()
    run_pass(agents)
    assert [d.health for d in decode(register(kube))] == [True, True]
    eventually(lambda: kube.annotations(path)[BIND_PHASE] == "success", timeout_s=10)


def test_restarted_kwok_agents_adopt_the_running_daemons(
    kube: KwokKube, agents: KwokAgents, tmp_path: Path
) -> None:
    agents.node(NODE)
    agents.stop()
    again = KwokAgents(kube, DeviceConfig(), state_dir=tmp_path)  # type: ignore[arg-type]
    try:
        fake = again.node(NODE)
        assert fake is not None and fake.mps_backend is not None
        assert fake.mps_backend.daemons() == {G0, G1}
        assert fake.mps_backend.starts(G0) == fake.mps_backend.starts(G1) == 1
    finally:
        again.stop()


# with_gpu_health ------------------------------------------------------------------------------


def test_health_edits_touch_only_that_gpus_flag() -> None:
    value = (
        '[ {"id":"GPU-a","count":10,"devmem":1000,"devcore":100,"type":"A<&>","mode":"mps",'
        '"health":true,"devicepairscore":{}} ,\n'
        ' {"id":"GPU-b","index":1,"count":10,"devmem":1000,"devcore":100,"mode":"mps",'
        '"health" : false}]'
    )
    down = with_gpu_health(value, {"GPU-a": False, "GPU-b": False})
    assert down == value.replace(',"health":true', "")
    up = with_gpu_health(value, {"GPU-b": True})
    assert up == value.replace('"health" : false', '"health" : true')
    added = with_gpu_health(down, {"GPU-a": True})
    assert added == down.replace('"devicepairscore":{}}', '"devicepairscore":{},"health":true}')
    assert with_gpu_health(value, {"GPU-a": True, "GPU-other": False}) == value


@pytest.mark.parametrize(
    "value",
    [
        "not json",
        '[{"health":true,"id":"GPU-a","count":1,"devmem":1,"devcore":1}]',  # not Go's order
    ],
)
def test_health_edits_refuse_what_they_cannot_edit_in_place(value: str) -> None:
    with pytest.raises(InvalidAnnotationError):
        with_gpu_health(value, {"GPU-a": False})
