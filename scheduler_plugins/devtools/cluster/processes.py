"""Background processes of the dev cluster: spawn, identify, wait for readiness, stop.

Each process runs in its own session (so its process group id is its pid) with output to a
log file, and is recorded in a pid file with its kernel start time. The start time guards
against a recycled pid: a pid file only names a process whose start time matches. Stopping
signals the whole process group, so helpers a binary forked go too, even after the leader
crashed; processes whose pid file was lost are found by the state dir on their command line.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import structlog

from scheduler_plugins.devtools.cluster.errors import ClusterError, ComponentFailedError

log = structlog.get_logger(__name__)

_POLL_S: Final = 0.05
_LOG_TAIL_LINES: Final = 25


@dataclass(frozen=True)
class ProcessRecord:
    """What a pid file holds."""

    component: str
    pid: int
    start_ticks: int  # field 22 of /proc/PID/stat
    argv: tuple[str, ...]


def spawn(
    component: str,
    argv: Sequence[str],
    *,
    log_path: Path,
    pid_path: Path,
    env: Mapping[str, str] | None = None,
) -> ProcessRecord:
    """Start ``argv`` detached (own session, stdin /dev/null, stdout+stderr to ``log_path``)
    with this process's environment, updated with ``env``."""
    exe = Path(argv[0])
    if not os.access(exe, os.X_OK):
        raise ClusterError(f"{component}: {exe} is not an executable file")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    pid_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as f:
        f.write(f"\n=== {time.strftime('%Y-%m-%dT%H:%M:%S')} start {' '.join(argv)}\n".encode())
    actions = [
        (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
        (os.POSIX_SPAWN_OPEN, 1, str(log_path), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644),
        (os.POSIX_SPAWN_DUP2, 1, 2),
    ]
    try:
        # posix_spawn rather than subprocess.Popen: the process outlives this one (`cluster up`
        # returns), so there is no Popen object to keep; stop() reaps it if it is our child.
        pid = os.posix_spawn(
            str(exe), list(argv), {**os.environ, **(env or {})}, file_actions=actions, setsid=True
        )
    except OSError as e:
        raise ClusterError(f"{component}: cannot start {exe}: {e.strerror}") from e
    ticks = _start_ticks(pid)
    record = ProcessRecord(component, pid, ticks if ticks is not None else -1, tuple(argv))
    _write_record(pid_path, record)
    log.info("process.started", component=component, pid=pid, log=str(log_path))
    return record


def read_record(pid_path: Path) -> ProcessRecord | None:
    """The record in ``pid_path``, or None when there is none (or it is unreadable)."""
    try:
        raw = json.loads(pid_path.read_text())
        return ProcessRecord(
            component=str(raw["component"]),
            pid=int(raw["pid"]),
            start_ticks=int(raw["start_ticks"]),
            argv=tuple(str(a) for a in raw["argv"]),
        )
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("pidfile.unreadable", path=str(pid_path), error=str(e))
        return None


def is_running(record: ProcessRecord) -> bool:
    """True when the recorded process (the same one, not a recycled pid) is alive."""
    state = _proc_state(record.pid)
    if state is None:
        return False
    ticks, status = state
    if ticks != record.start_ticks:
        return False
    if status in ("Z", "X"):
        _reap(record.pid)
        return False
    return True


def stop(pid_path: Path, *, timeout_s: float = 10.0) -> ProcessRecord | None:
    """Stop the process group recorded in ``pid_path`` (TERM, then KILL) and remove the file.

    Safe on a stale pid file (crashed or already stopped process): the group is still
    signalled, since helpers of a crashed leader keep its process group id.
    """
    record = read_record(pid_path)
    if record is None:
        pid_path.unlink(missing_ok=True)
        return None
    if is_running(record):
        _signal_group(record.pid, signal.SIGTERM)
        if not _wait_gone(record, timeout_s):
            log.warning("process.kill", component=record.component, pid=record.pid)
            _signal_group(record.pid, signal.SIGKILL)
            if not _wait_gone(record, 5.0):
                raise ClusterError(
                    f"{record.component} (pid {record.pid}) survived SIGKILL; check `ps -o "
                    f"pid,stat,cmd -g {record.pid}`"
                )
        log.info("process.stopped", component=record.component, pid=record.pid)
    else:
        # Leader gone (crash): take down whatever is left in its group. The kernel does not
        # hand out a pid that is still some group's id, so if the pid now names another
        # process, our group is empty and that process must be left alone.
        if _proc_state(record.pid) is None:
            _signal_group(record.pid, signal.SIGKILL)
        log.info("process.stale_pidfile", component=record.component, pid=record.pid)
    pid_path.unlink(missing_ok=True)
    return record


def wait_released(record: ProcessRecord, *, timeout_s: float = 10.0) -> bool:
    """Wait until the recorded process has fully exited; whether it did in time.

    ``stop`` (like ``is_running``) counts a zombie leader as stopped, but a killed
    multi-threaded process turns zombie before its last thread is gone, and until then its
    files (a listening socket) stay open: a replacement started at once on the same port
    can fail with "address already in use".
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = _proc_state(record.pid)
        if state is None or state[0] != record.start_ticks:
            return True
        if state[1] in ("Z", "X"):
            _reap(record.pid)  # succeeds once the whole thread group has exited
        time.sleep(_POLL_S)
    return False


def find_strays(marker: str, exe_dir: Path) -> list[int]:
    """Pids of processes run from ``exe_dir`` whose command line mentions ``marker``.

    ``marker`` is a cluster's state dir, which every component has on its command line, so
    this finds exactly that cluster's processes even when their pid files are gone.
    """
    me = os.getpid()
    found: list[int] = []
    exe_prefix = str(exe_dir.resolve()) + os.sep
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if not args or not args[0]:
            continue
        argv0 = os.fsdecode(args[0])
        if not argv0.startswith(exe_prefix):
            continue
        if any(marker in os.fsdecode(a) for a in args[1:]):
            found.append(int(entry.name))
    return found


def kill_pids(pids: Sequence[int], *, timeout_s: float = 5.0) -> None:
    """TERM then KILL each pid (used for strays only; they were matched by find_strays)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive_pid(p)]
        time.sleep(_POLL_S)
    for pid in alive:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
        _reap(pid)


def wait_ready(
    record: ProcessRecord,
    probe: Callable[[], str | None],
    *,
    log_path: Path,
    timeout_s: float,
) -> None:
    """Poll ``probe`` (None = ready, else why not) until ready; fail early if the process dies."""
    deadline = time.monotonic() + timeout_s
    why = "not probed yet"
    while True:
        if not is_running(record):
            raise ComponentFailedError(
                f"{record.component} exited during startup; last log lines of {log_path}:\n"
                f"{tail(log_path)}"
            )
        why_not = probe()
        if why_not is None:
            return
        why = why_not
        if time.monotonic() >= deadline:
            raise ComponentFailedError(
                f"{record.component} not ready after {timeout_s:.0f}s ({why}); last log lines "
                f"of {log_path}:\n{tail(log_path)}"
            )
        time.sleep(0.1)


def tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            data = f.read().decode(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(data.splitlines()[-lines:])


# ---------------------------------------------------------------------------------------------


def _write_record(pid_path: Path, record: ProcessRecord) -> None:
    tmp = pid_path.with_name(pid_path.name + ".tmp")
    tmp.write_text(
        json.dumps(
            {
                "component": record.component,
                "pid": record.pid,
                "start_ticks": record.start_ticks,
                "argv": list(record.argv),
            }
        )
        + "\n"
    )
    os.replace(tmp, pid_path)


def _proc_state(pid: int) -> tuple[int, str] | None:
    """(start ticks, state letter) of ``pid`` from /proc, or None if there is no such pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    rest = stat[stat.rindex(")") + 2 :].split()
    return int(rest[19]), rest[0]


def _start_ticks(pid: int) -> int | None:
    state = _proc_state(pid)
    return None if state is None else state[0]


def _alive_pid(pid: int) -> bool:
    state = _proc_state(pid)
    if state is None:
        return False
    if state[1] in ("Z", "X"):
        _reap(pid)
        return False
    return True


def _reap(pid: int) -> None:
    """Collect the exit status if ``pid`` is our child (else it is init's business)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _wait_gone(record: ProcessRecord, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not is_running(record) and not _group_alive(record.pid):
            return True
        time.sleep(_POLL_S)
    return not is_running(record) and not _group_alive(record.pid)


def _group_alive(pgid: int) -> bool:
    """True while any non-zombie process remains in the group."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    # killpg(0) succeeds on zombies too: look for a live member.
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        rest = stat[stat.rindex(")") + 2 :].split()
        if int(rest[2]) == pgid:
            if rest[0] not in ("Z", "X"):
                return True
            _reap(int(entry.name))
    return False
