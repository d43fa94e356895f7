"""One MPS control daemon per MPS GPU: start, adoption, crash and restart, failed starts,
GPUs leaving MPS mode, Allocate's check."""

from __future__ import annotations

from pathlib import Path

import pytest
from structlog.testing import capture_logs

from node_agent.mps import MpsDaemonDownError, MpsDaemons, SimulatedMps

NODE = "node-a"
G0, G1 = "GPU-00000000-0000-0000-0000-000000000000", "GPU-11111111-1111-1111-1111-111111111111"


def manager(root: Path | None = None) -> tuple[MpsDaemons, SimulatedMps]:
    backend = SimulatedMps(root, node_name=NODE)
    return MpsDaemons(backend, node_name=NODE), backend


def events(logs: list[dict[str, object]]) -> list[tuple[object, object]]:
    return [(e["event"], e.get("gpu")) for e in logs if str(e["event"]).startswith("mps.")]


def test_the_first_check_starts_a_daemon_per_gpu() -> None:
    mps, backend = manager()
    assert not mps.healthy(G0)  # never checked: not vouched for
    with capture_logs() as logs:
        assert mps.sync([G0, G1])
    assert mps.health() == {G0: True, G1: True}
    assert backend.daemons() == {G0, G1}
    assert events(logs) == [("mps.daemon_started", G0), ("mps.daemon_started", G1)]
    assert not mps.sync([G0, G1])  # nothing changed: nothing to republish
    assert backend.starts(G0) == 1


def test_a_crash_shows_the_gpu_unhealthy_then_the_next_check_restarts_it() -> None:
    mps, backend = manager()
    mps.sync([G0, G1])
    backend.crash(G0)
    with capture_logs() as logs:
        assert mps.sync([G0, G1])
    assert mps.health() == {G0: False, G1: True}
    assert events(logs) == [("mps.daemon_down", G0)]
    with capture_logs() as logs:
        assert mps.sync([G0, G1])
    assert mps.health() == {G0: True, G1: True}
    assert backend.starts(G0) == 2
    assert logs[0]["restart"] is True and events(logs) == [("mps.daemon_started", G0)]


def test_a_failing_start_keeps_the_gpu_unhealthy_until_the_fault_is_cleared(
    tmp_path: Path,
) -> None:
    mps, backend = manager(tmp_path)
    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / f"{G0}.fail_start").touch()
    with capture_logs() as logs:
        mps.sync([G0, G1])
    assert mps.health() == {G0: False, G1: True}
    assert ("mps.daemon_start_failed", G0) in events(logs)
    assert not mps.sync([G0, G1])  # tried again, failed again: still down
    assert not mps.healthy(G0)
    (faults / f"{G0}.fail_start").unlink()
    assert mps.sync([G0, G1])
    assert mps.health() == {G0: True, G1: True} and backend.starts(G0) == 1


def test_a_restarted_agent_adopts_the_running_daemons(tmp_path: Path) -> None:
    first, backend = manager(tmp_path)
    first.sync([G0, G1])
    pids = backend.pid(G0), backend.pid(G1)
    again, backend_again = manager(tmp_path)  # a new agent process, same MPS root
    with capture_logs() as logs:
        assert again.sync([G0, G1])
    assert again.health() == {G0: True, G1: True}
    assert (backend_again.pid(G0), backend_again.pid(G1)) == pids
    assert backend_again.starts(G0) == backend_again.starts(G1) == 1  # no second start
    assert events(logs) == [("mps.daemon_adopted", G0), ("mps.daemon_adopted", G1)]


def test_a_daemon_of_a_gpu_no_longer_in_mps_mode_is_stopped() -> None:
    mps, backend = manager()
    mps.sync([G0, G1])
    with capture_logs() as logs:
        assert mps.sync([G0])  # G1 filtered out, or the node left mps mode for it
    assert backend.daemons() == {G0}
    assert mps.health() == {G0: True}
    assert events(logs) == [("mps.daemon_stopped", G1)]
    assert mps.sync([])  # the node left mps mode
    assert backend.daemons() == frozenset()


def test_a_daemon_that_came_back_by_itself_is_up_again() -> None:
    mps, backend = manager()
    mps.sync([G0])
    backend.crash(G0)
    mps.sync([G0])
    backend.start(G0)  # someone else started it before the agent's restart
    with capture_logs() as logs:
        assert mps.sync([G0])
    assert mps.healthy(G0) and events(logs) == [("mps.daemon_back", G0)]


def test_allocate_check_refuses_a_gpu_down_now_or_at_the_last_check() -> None:
    mps, backend = manager()
    mps.sync([G0, G1])
    mps.require_up([G0, G1])
    backend.crash(G1)  # not seen by a check yet: the live question finds it
    with pytest.raises(MpsDaemonDownError, match=f"GPU {G1} is down: found down at Allocate"):
        mps.require_up([G0, G1])
    mps.sync([G0, G1])
    with pytest.raises(MpsDaemonDownError, match="retry"):
        mps.require_up([G1])
