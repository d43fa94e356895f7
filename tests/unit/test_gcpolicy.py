"""``OldObjectsFrozen``: when the plugin server's objects are frozen out of full collections."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from typing import Any

import pytest

from scheduler_plugins.server.gcpolicy import OldObjectsFrozen


class FakeGc:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.gen2 = 0
        self.frozen = 0

    def collect(self, generation: int = 2) -> int:
        self.calls.append(f"collect({generation})")
        self.gen2 += 1
        return 7

    def freeze(self) -> None:
        self.calls.append("freeze")
        self.frozen += 1

    def unfreeze(self) -> None:
        self.calls.append("unfreeze")

    def get_stats(self) -> list[dict[str, Any]]:
        return [{"collections": 0}, {"collections": 0}, {"collections": self.gen2}]

    def get_freeze_count(self) -> int:
        return self.frozen


def test_freezes_once_built_after_each_full_collection_and_collects_all_hourly() -> None:
    fake, now, ready = FakeGc(), [0.0], [False]
    policy = OldObjectsFrozen(
        lambda: ready[0], full_every_s=3600, clock=lambda: now[0], gc_module=fake
    )
    policy.tick()
    assert fake.calls == []  # the state is not built yet: nothing to freeze
    ready[0] = True
    policy.tick()
    assert fake.calls == ["unfreeze", "collect(2)", "freeze"]
    fake.calls.clear()
    now[0] = 10.0
    policy.tick()
    assert fake.calls == []  # no full collection since
    fake.gen2 += 1  # the interpreter ran one (it walked only what was new)
    policy.tick()
    policy.tick()
    assert fake.calls == ["freeze"]  # its survivors are frozen, once
    fake.calls.clear()
    now[0] = 3600.0
    policy.tick()
    assert fake.calls == ["unfreeze", "collect(2)", "freeze"]  # everything, once an hour


def test_a_period_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match="full_every_s must be > 0, got 0"):
        OldObjectsFrozen(lambda: True, full_every_s=0)


_WALKED = """
import gc, json
from scheduler_plugins.server.gcpolicy import OldObjectsFrozen
pod = lambda i: {"metadata": {"name": f"p{i}", "labels": {"a": "b"}}, "spec": {"c": [1]}}
state = [pod(i) for i in range(100_000)]
walked_before = len(gc.get_objects())  # what a full collection walks
policy = OldObjectsFrozen(lambda: True)
policy.tick()
new = [{"n": i} for i in range(1000)]
walked_after = len(gc.get_objects())
print(json.dumps({"before": walked_before, "after": walked_after, "frozen": gc.get_freeze_count()}))
"""


def test_with_the_real_gc_a_full_collection_walks_only_what_is_new() -> None:
    # In a fresh interpreter: freezing this test process's objects would outlive the test.
    out = subprocess.run(
        [sys.executable, "-c", _WALKED], capture_output=True, text=True, check=True, timeout=120
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["before"] > 400_000  # the 100k pods' four containers each
    assert got["frozen"] >= got["before"] - 1000
    assert got["after"] < 2000  # the 1000 new dicts and the list holding them, little else
    assert gc.get_freeze_count() == 0  # this process untouched
