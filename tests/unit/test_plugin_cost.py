"""The in-process plugin server cost benchmark places every GPU pod it draws, over the
Cycle stream, and leaves no reservation unconfirmed."""

from __future__ import annotations

import pytest

from benchmarks.plugin_cost import STEPS, run, table


@pytest.mark.parametrize("batched", [False, True])
def test_every_gpu_pod_is_placed_and_confirmed_and_each_step_is_timed(batched: bool) -> None:
    r = run(nodes=20, pods=60, batched=batched)
    assert r["gpu_pods"] > 0 and r["placed"] + r["refused"] == r["gpu_pods"]
    assert r["placed"] >= 0.9 * r["gpu_pods"]
    assert r["assumed_left"] == 0  # the watch's events confirmed every reservation
    cpu = r["cpu_ms_per_pod"]
    assert all(cpu[s] > 0 for s in STEPS) and cpu["total"] >= max(cpu[s] for s in STEPS)
    how = "with the next PreFilter" if batched else "alone"
    assert f"| 20 | {how} | {r['gpu_pods']} | {r['placed']} |" in table([r])
