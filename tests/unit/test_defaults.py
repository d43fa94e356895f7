"""Defaults that other languages and files must repeat (Go, the Helm chart, the example
profile) are the ones the Python code defines once: these tests hold the copies to them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from api.hami import keys as ann
from api.hami.config import DeviceConfig
from scheduler_plugins.core import ranking, requests
from scheduler_plugins.core.requests import parse_request
from scheduler_plugins.core.reservations import DEFAULT_PREBIND_WAIT_S
from scheduler_plugins.server.app import DEFAULT_RPC_WORKERS
from tests.builders import make_pod

ROOT = Path(__file__).resolve().parents[2]
CFG = DeviceConfig()
RESOURCE_NAMES = {
    "ResourceCountName": CFG.resource_count_name,
    "ResourceMemoryName": CFG.resource_memory_name,
    "ResourceMemoryPercentageName": CFG.resource_memory_percentage_name,
    "ResourceCoreName": CFG.resource_core_name,
}


def _lower_first(s: str) -> str:
    return s[0].lower() + s[1:]


def test_the_shim_defaults_to_the_device_configs_resource_names() -> None:
    go = (ROOT / "sidecar-go" / "pkg" / "tessera" / "plugin.go").read_text()
    found = dict(re.findall(r'Default(Resource\w+Name)\s*=\s*"([^"]+)"', go))
    assert found == RESOURCE_NAMES


def test_the_example_profile_names_the_device_configs_resources() -> None:
    profile = yaml.safe_load((ROOT / "examples" / "scheduler-config.yaml").read_text())
    args: dict[str, Any] = next(
        c["args"] for p in profile["profiles"] for c in p["pluginConfig"] if c["name"] == "Tessera"
    )
    assert {k: args[_lower_first(k)] for k in RESOURCE_NAMES} == RESOURCE_NAMES


def test_the_chart_defaults_are_the_codes() -> None:
    template = (ROOT / "charts" / "tessera" / "templates" / "configmaps.yaml").read_text()
    defaults = dict(re.findall(r'default "([^"]+)" \$nvidia\.(resource\w+Name)', template))
    assert {v: k for k, v in defaults.items()} == {
        _lower_first(k): v for k, v in RESOURCE_NAMES.items()
    }
    values = yaml.safe_load((ROOT / "charts" / "tessera" / "values.yaml").read_text())
    server = values["scheduler"]["pluginServer"]
    assert server["prebindWait"] == DEFAULT_PREBIND_WAIT_S
    assert server["rpcWorkers"] == DEFAULT_RPC_WORKERS


def test_the_shipped_profiles_weigh_tessera_as_documented() -> None:
    example = yaml.safe_load((ROOT / "examples" / "scheduler-config.yaml").read_text())
    weights = [
        plugin["weight"]
        for profile in example["profiles"]
        for plugin in profile["plugins"]["score"]["enabled"]
        if plugin["name"] == "Tessera"
    ]
    assert weights == [ranking.SCORE_WEIGHT]
    values = yaml.safe_load((ROOT / "charts" / "tessera" / "values.yaml").read_text())
    assert values["scheduler"]["tesseraPlugin"]["scoreWeight"] == ranking.SCORE_WEIGHT


def test_the_shim_signs_and_requeues_by_the_annotations_a_decision_reads() -> None:
    go = (ROOT / "sidecar-go" / "pkg" / "tessera" / "sign.go").read_text()
    block = re.search(r"var policyAnnotations = \[\]string\{(.*?)\n\}", go, re.S)
    assert block is not None, "sign.go no longer defines policyAnnotations"
    assert tuple(re.findall(r'^\s*"([^"]+)",$', block.group(1), re.M)) == (ann.DECISION_ANNOTATIONS)


class _Reading(dict[str, str]):
    """Annotations that remember which keys were asked for."""

    def __init__(self, values: dict[str, str], asked: set[str]) -> None:
        super().__init__(values)
        self.asked = asked

    def get(self, key: str, default: Any = None) -> Any:
        self.asked.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> str:
        self.asked.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.asked.add(str(key))
        return super().__contains__(key)


def test_a_decision_reads_exactly_the_decision_annotations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What ``parse_request`` reads of a pod's annotations is DECISION_ANNOTATIONS: a key it
    reads beyond them would change decisions without changing the shim's signature or
    requeueing the pod that waits for it."""
    values = {
        ann.VGPU_MODE: "hami-core",
        ann.NODE_POLICY: "spread",
        ann.GPU_POLICY: "binpack",
        ann.USE_GPUTYPE: "A100",
        ann.NOUSE_GPUTYPE: "T4",
        ann.USE_GPUUUID: "GPU-1",
        ann.NOUSE_GPUUUID: "GPU-2",
        ann.NUMA_BIND: "true",
        ann.SCORING_WEIGHTS: "slot=1,core=1,memory=3",
        "team": "ml",
    }
    asked: set[str] = set()
    monkeypatch.setattr(requests, "annotations_of", lambda pod: _Reading(values, asked))
    pod = make_pod("p").gpu(1, mem=1000, cores=20).build()
    parse_request(pod, CFG)
    assert asked == set(ann.DECISION_ANNOTATIONS)
