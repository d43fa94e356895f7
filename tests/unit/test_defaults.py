"""Defaults that other languages and files must repeat (Go, the Helm chart, the example
profile) are the ones the Python code defines once: these tests hold the copies to them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from api.hami.config import DeviceConfig
from scheduler_plugins.core import ranking
from scheduler_plugins.core.reservations import DEFAULT_PREBIND_WAIT_S
from scheduler_plugins.server.app import DEFAULT_RPC_WORKERS

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
