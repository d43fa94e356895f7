"""Process supervision of the dev cluster: stop, crash cleanup, recycled pids, strays."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from scheduler_plugins.devtools.cluster import processes
from scheduler_plugins.devtools.cluster.errors import ComponentFailedError

SH = shutil.which("sh") or "/bin/sh"


def group_members(pgid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        rest = stat[stat.rindex(")") + 2 :].split()
        if int(rest[2]) == pgid and rest[0] not in ("Z", "X"):
            out.append(int(entry.name))
    return out


def wait_until(cond: Callable[[], object], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.02)


SpawnSh = Callable[..., processes.ProcessRecord]


@pytest.fixture
def spawn_sh(tmp_path: Path) -> Iterator[SpawnSh]:
    """Spawn ``sh -c SCRIPT`` as a supervised process; kills its group at teardown."""
    spawned: list[processes.ProcessRecord] = []

    def run(script: str, name: str = "sh", exe: str = SH, *extra: str) -> processes.ProcessRecord:
        rec = processes.spawn(
            name,
            [exe, "-c", script, *extra],
            log_path=tmp_path / f"{name}.log",
            pid_path=tmp_path / f"{name}.pid",
        )
        spawned.append(rec)
        return rec

    yield run
    for rec in spawned:
        deadline = time.monotonic() + 5
        while group_members(rec.pid):
            assert time.monotonic() < deadline, f"group {rec.pid} survived SIGKILL"
            with contextlib.suppress(ProcessLookupError):
                os.killpg(rec.pid, signal.SIGKILL)  # the whole group, forks in flight too
            time.sleep(0.02)
        processes.is_running(rec)  # reaps the leader if it is a zombie


def test_stop_terminates_the_whole_process_group(spawn_sh: SpawnSh, tmp_path: Path) -> None:
    rec = spawn_sh("sleep 300 & sleep 300; wait")
    wait_until(lambda: len(group_members(rec.pid)) == 3)
    stopped = processes.stop(tmp_path / "sh.pid", timeout_s=5)
    assert stopped is not None and stopped.pid == rec.pid
    assert group_members(rec.pid) == []
    assert not (tmp_path / "sh.pid").exists()


def test_stale_pid_file_after_leader_crash_still_cleans_its_group(
    spawn_sh: SpawnSh, tmp_path: Path
) -> None:
    rec = spawn_sh("sleep 300 & wait")
    wait_until(lambda: len(group_members(rec.pid)) == 2)
    os.kill(rec.pid, signal.SIGKILL)
    wait_until(lambda: not processes.is_running(rec))
    assert len(group_members(rec.pid)) == 1  # the orphaned sleep
    processes.stop(tmp_path / "sh.pid")
    wait_until(lambda: group_members(rec.pid) == [])
    assert not (tmp_path / "sh.pid").exists()


def test_recycled_pid_is_not_taken_for_ours(spawn_sh: SpawnSh, tmp_path: Path) -> None:
    rec = spawn_sh("sleep 300")
    forged = dataclasses.replace(rec, start_ticks=rec.start_ticks - 1)
    assert processes.is_running(rec)
    assert not processes.is_running(forged)
    pid_path = tmp_path / "forged.pid"
    processes._write_record(pid_path, forged)
    processes.stop(pid_path)  # must leave the real process alone
    assert processes.is_running(rec)
    assert not pid_path.exists()


def test_stop_without_pid_file_is_a_no_op(tmp_path: Path) -> None:
    assert processes.stop(tmp_path / "none.pid") is None


def test_strays_are_found_by_state_dir_on_the_command_line(
    spawn_sh: SpawnSh, tmp_path: Path
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "sh"
    shutil.copy(SH, exe)
    marker = str(tmp_path / "state") + os.sep
    rec = spawn_sh("sleep 300; :", "stray", str(exe), marker + "etcd")
    (tmp_path / "stray.pid").unlink()
    strays = processes.find_strays(marker, bin_dir)
    # sh may have forked for `sleep` and not exec'd yet: that child is a stray of ours too.
    assert rec.pid in strays
    assert set(strays) <= {rec.pid, *group_members(rec.pid)}
    assert processes.find_strays(str(tmp_path / "stat") + os.sep, bin_dir) == []
    processes.kill_pids(strays)
    assert not processes.is_running(rec)


def test_wait_ready_reports_early_exit_with_log_tail(spawn_sh: SpawnSh, tmp_path: Path) -> None:
    rec = spawn_sh("echo 'bad flag --nope'; exit 3")
    with pytest.raises(ComponentFailedError, match="bad flag --nope"):
        processes.wait_ready(rec, lambda: "not yet", log_path=tmp_path / "sh.log", timeout_s=10)


def test_wait_ready_times_out_with_reason(spawn_sh: SpawnSh, tmp_path: Path) -> None:
    rec = spawn_sh("sleep 300")
    with pytest.raises(ComponentFailedError, match="port closed"):
        processes.wait_ready(
            rec, lambda: "port closed", log_path=tmp_path / "sh.log", timeout_s=0.3
        )


def test_wait_released_waits_for_the_last_thread_not_the_zombie_leader(
    spawn_sh: SpawnSh, tmp_path: Path
) -> None:
    # The main thread exits on its own while another keeps running (and the files open):
    # the leader shows as a zombie, which ``is_running`` counts as stopped.
    script = (
        "import ctypes, threading, time; "
        "threading.Thread(target=time.sleep, args=(300,)).start(); "
        "ctypes.CDLL(None).pthread_exit(None)"
    )
    rec = spawn_sh(script, "py", sys.executable)
    wait_until(lambda: not processes.is_running(rec))
    assert not processes.wait_released(rec, timeout_s=0.3)
    os.killpg(rec.pid, signal.SIGKILL)
    assert processes.wait_released(rec, timeout_s=5)
    assert not Path(f"/proc/{rec.pid}").exists()
