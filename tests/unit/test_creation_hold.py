"""The simulated NVML's test-only ``CreationHold``: a MIG creation pauses between its GPU
instance and its compute instance while the hold file exists, and never without one."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from api.hami.catalog import find_model
from api.hami.register import Placement
from node_agent.nvml.backend import full_compute_instance_profile
from node_agent.nvml.simulated import HOLD_ENV, CreationHold, SimulatedGpuSpec, SimulatedNvml

MODEL = "A100-PCIE-40GB"


def _backend(tmp_path: Path, hold: CreationHold | None) -> SimulatedNvml:
    b = SimulatedNvml([SimulatedGpuSpec(MODEL)], tmp_path / "n1.json", node_name="n1", hold=hold)
    b.init()
    return b


def test_hold_is_read_from_the_environment_only_when_set(tmp_path: Path) -> None:
    assert CreationHold.from_env({}) is None
    assert CreationHold.from_env({HOLD_ENV: ""}) is None
    assert CreationHold.from_env({HOLD_ENV: str(tmp_path)}) == CreationHold(tmp_path)


def test_creation_pauses_after_the_gpu_instance_while_the_hold_file_exists(
    tmp_path: Path,
) -> None:
    hold_dir = tmp_path / "hold-dir"
    hold_dir.mkdir()
    b = _backend(tmp_path, CreationHold(hold_dir, poll_s=0.01))
    fact = next(p for p in find_model(MODEL).profiles if p.name == "1g.5gb")
    gi = b.create_gpu_instance_with_placement(0, fact.profile_id, Placement(3, 1))
    (hold_dir / "hold").touch()
    done = threading.Event()

    def create_ci() -> None:
        b.create_compute_instance(0, gi.id, full_compute_instance_profile(fact.slice_count))
        done.set()

    worker = threading.Thread(target=create_ci)
    worker.start()
    deadline = time.monotonic() + 5
    while not (hold_dir / "held-n1").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "GPU instance 10" in (hold_dir / "held-n1").read_text()
    assert not done.wait(0.1)
    assert b.compute_instances(0, gi.id) == []  # the GI is there, its CI not yet
    (hold_dir / "hold").unlink()
    worker.join(5)
    assert done.is_set() and len(b.compute_instances(0, gi.id)) == 1


def test_without_a_hold_file_nothing_pauses(tmp_path: Path) -> None:
    b = _backend(tmp_path, CreationHold(tmp_path))
    fact = next(p for p in find_model(MODEL).profiles if p.name == "7g.40gb")
    gi = b.create_gpu_instance_with_placement(0, fact.profile_id, Placement(0, 8))
    b.create_compute_instance(0, gi.id, full_compute_instance_profile(fact.slice_count))
    assert not list(tmp_path.glob("held-*"))
