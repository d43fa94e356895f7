"""The simulated MPS daemons: as strict as the binary, persistent, faults from outside."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from api.hami.keys import MPS_MAX_CLIENTS
from node_agent.mps import (
    MpsAlreadyRunningError,
    MpsClientLimitError,
    MpsError,
    MpsNotRunningError,
    MpsStartError,
    SimulatedMps,
)

G0, G1 = "GPU-00000000-0000-0000-0000-000000000000", "GPU-11111111-1111-1111-1111-111111111111"


def test_start_stop_and_health_are_as_strict_as_the_binary() -> None:
    mps = SimulatedMps()
    assert not mps.running(G0) and mps.daemons() == frozenset()
    mps.start(G0)
    assert mps.running(G0) and not mps.running(G1)
    assert mps.daemons() == {G0}
    with pytest.raises(MpsAlreadyRunningError):
        mps.start(G0)  # a second daemon on one pipe directory is refused
    mps.stop(G0)
    assert not mps.running(G0)
    with pytest.raises(MpsNotRunningError):
        mps.stop(G0)
    assert mps.starts(G0) == 1


@pytest.mark.parametrize("bad", ["", "..", "a/b", "GPU-0 1"])
def test_a_name_that_is_not_a_gpu_uuid_is_refused(bad: str) -> None:
    with pytest.raises(MpsError, match="not a GPU UUID"):
        SimulatedMps().start(bad)


def test_a_daemon_serves_at_most_the_client_limit_and_a_crash_drops_them() -> None:
    mps = SimulatedMps()
    with pytest.raises(MpsNotRunningError):
        mps.connect(G0)
    mps.start(G0)
    for _ in range(MPS_MAX_CLIENTS):
        mps.connect(G0)
    with pytest.raises(MpsClientLimitError):
        mps.connect(G0)
    mps.disconnect(G0)
    mps.connect(G0)
    mps.crash(G0)
    assert not mps.running(G0) and mps.clients(G0) == 0


def test_state_survives_a_restart_so_a_running_daemon_is_found_not_started_again(
    tmp_path: Path,
) -> None:
    first = SimulatedMps(tmp_path)
    first.start(G0)
    first.connect(G0)
    pid = first.pid(G0)
    again = SimulatedMps(tmp_path)  # the agent restarted; the daemon process did not
    assert again.running(G0) and again.pid(G0) == pid and again.clients(G0) == 1
    assert again.starts(G0) == 1
    state = json.loads((tmp_path / "simulated-mps.json").read_text())
    assert state == {
        "version": 1,
        "nextPid": pid + 1,
        "daemons": {G0: {"pid": pid, "clients": 1}},
        "starts": {G0: 1},
    }


def test_start_creates_the_pipe_directory_open_to_clients_under_a_private_root(
    tmp_path: Path,
) -> None:
    root = tmp_path / "mps"
    mps = SimulatedMps(root)
    mps.start(G0)
    assert mps.pipe_dir(G0) == root / G0 / "pipe"
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert stat.S_IMODE((root / G0).stat().st_mode) == 0o700
    assert stat.S_IMODE((root / G0 / "pipe").stat().st_mode) == 0o755
    assert stat.S_IMODE((root / G0 / "log").stat().st_mode) == 0o700


def test_a_crash_file_takes_the_daemon_down_once_and_is_consumed(tmp_path: Path) -> None:
    mps = SimulatedMps(tmp_path)
    mps.start(G0)
    mps.start(G1)
    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / f"{G0}.crash").touch()  # what a test does from outside the agent
    assert mps.daemons() == {G1}
    assert not (faults / f"{G0}.crash").exists()
    mps.start(G0)
    assert mps.running(G0)  # one file, one crash
    assert SimulatedMps(tmp_path).running(G0)


def test_a_fail_start_file_fails_every_start_until_deleted(tmp_path: Path) -> None:
    mps = SimulatedMps(tmp_path)
    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / f"{G0}.fail_start").touch()
    for _ in range(2):
        with pytest.raises(MpsStartError, match="fail_start"):
            mps.start(G0)
    mps.start(G1)  # other GPUs start
    (faults / f"{G0}.fail_start").unlink()
    mps.start(G0)
    assert mps.daemons() == {G0, G1}


def test_in_process_fault_hooks_without_a_root() -> None:
    mps = SimulatedMps()
    mps.set_fail_start(G0, True)
    with pytest.raises(MpsStartError):
        mps.start(G0)
    mps.set_fail_start(G0, False)
    mps.start(G0)
    mps.crash(G0)
    assert not mps.running(G0)


@pytest.mark.parametrize(
    "content",
    ["{", '{"version": 2}', '{"version": 1, "daemons": {}}', '{"version": 1, "daemons": []}'],
)
def test_a_malformed_state_file_is_refused_with_what_to_do(tmp_path: Path, content: str) -> None:
    (tmp_path / "simulated-mps.json").write_text(content)
    with pytest.raises(MpsError, match="simulated MPS state"):
        SimulatedMps(tmp_path)
