"""Simulated MPS control daemons: as strict as the binary, with faults set from outside.

Per GPU a daemon that is up or down, with a pid and the clients it serves (at most
``MPS_MAX_CLIENTS``; a crash or stop drops them). ``start`` refuses a GPU whose daemon runs
and ``stop`` one whose daemon does not, as ``nvidia-cuda-mps-control`` does.

With a ``root`` directory (the agent's MPS root; in kwok mode ``<state-dir>/<node>.mps``):

- ``<root>/simulated-mps.json`` holds the daemons, written atomically after every change
  and read at construction, so a restarted agent finds the daemons an earlier one started
  still running and adopts them (they are separate processes on a real node)::

      {"version": 1, "nextPid": 1003,
       "daemons": {"GPU-…": {"pid": 1001, "clients": 0}},
       "starts": {"GPU-…": 1}}

  ``starts`` counts the successful starts per GPU (what tests read to see that a restart
  adopted rather than started again).
- ``<root>/faults/`` holds fault files that a test creates from outside the agent process;
  every backend call looks at them first:

  - ``<gpu uuid>.crash``: that GPU's daemon goes down (its clients with it). The file is
    consumed (deleted) when taken, so each file is one crash; create it again for another.
  - ``<gpu uuid>.fail_start``: every start of that GPU's daemon fails while the file
    exists; delete it to clear.

- ``<root>/<gpu uuid>/pipe`` is created on start, as the real backend does, so the host
  path handed to the container runtime exists.

Without a root everything lives in memory and faults come from ``crash`` and
``set_fail_start`` only.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import orjson
import structlog

from api.hami.keys import MPS_MAX_CLIENTS
from node_agent.mps.backend import DEFAULT_ROOT, MpsLayout
from node_agent.mps.errors import (
    MpsAlreadyRunningError,
    MpsClientLimitError,
    MpsError,
    MpsNotRunningError,
    MpsStartError,
)
from node_agent.statefile import write_atomically

log = structlog.get_logger(__name__)

STATE_VERSION: Final = 1
STATE_FILE: Final = "simulated-mps.json"
FAULTS_DIR: Final = "faults"
CRASH: Final = ".crash"
FAIL_START: Final = ".fail_start"
FIRST_PID: Final = 1000


@dataclass
class _Daemon:
    pid: int
    clients: int = 0


class SimulatedMps:
    """``MpsBackend`` over simulated daemons; thread-safe (one lock)."""

    def __init__(
        self,
        root: Path | None = None,
        *,
        node_name: str = "tessera-sim",
        max_clients: int = MPS_MAX_CLIENTS,
    ) -> None:
        self.root = root
        self._layout = MpsLayout(root or DEFAULT_ROOT)
        self._node = node_name
        self.max_clients = max_clients
        self._lock = threading.RLock()
        self._daemons: dict[str, _Daemon] = {}
        self._starts: dict[str, int] = {}
        self._next_pid = FIRST_PID
        self._fail_start: set[str] = set()
        if root is not None and (root / STATE_FILE).exists():
            self._load(root / STATE_FILE)

    # MpsBackend ---------------------------------------------------------------------------

    def start(self, gpu: str) -> None:
        what = "start its MPS control daemon"
        with self._op(gpu):
            if gpu in self._daemons:
                raise MpsAlreadyRunningError(
                    gpu, what, f"one already serves {self.pipe_dir(gpu)} (pid {self.pid(gpu)})"
                )
            if gpu in self._fail_start or self._has_fault(gpu, FAIL_START):
                raise MpsStartError(gpu, what, "the daemon exited at start (simulated fail_start)")
            if self.root is not None:
                self._layout.create(gpu)
            self._daemons[gpu] = _Daemon(self._next_pid)
            self._next_pid += 1
            self._starts[gpu] = self._starts.get(gpu, 0) + 1
            self._persist()

    def stop(self, gpu: str) -> None:
        with self._op(gpu):
            if self._daemons.pop(gpu, None) is None:
                raise MpsNotRunningError(
                    gpu, "stop its MPS control daemon", f"no daemon serves {self.pipe_dir(gpu)}"
                )
            self._persist()

    def running(self, gpu: str) -> bool:
        with self._op(gpu):
            return gpu in self._daemons

    def daemons(self) -> frozenset[str]:
        with self._op(None):
            return frozenset(self._daemons)

    def pipe_dir(self, gpu: str) -> Path:
        return self._layout.pipe_dir(gpu)

    # The model's clients (what a pod's CUDA processes would be) ---------------------------

    def connect(self, gpu: str) -> None:
        """A client connects to the GPU's daemon."""
        what = "connect an MPS client"
        with self._op(gpu):
            daemon = self._daemons.get(gpu)
            if daemon is None:
                raise MpsNotRunningError(gpu, what, "no control daemon runs")
            if daemon.clients >= self.max_clients:
                raise MpsClientLimitError(
                    gpu, what, f"the daemon already serves {self.max_clients} clients"
                )
            daemon.clients += 1
            self._persist()

    def disconnect(self, gpu: str) -> None:
        with self._op(gpu):
            daemon = self._daemons.get(gpu)
            if daemon is None or daemon.clients == 0:
                raise MpsNotRunningError(gpu, "disconnect an MPS client", "no client connected")
            daemon.clients -= 1
            self._persist()

    def clients(self, gpu: str) -> int:
        with self._op(gpu):
            daemon = self._daemons.get(gpu)
            return 0 if daemon is None else daemon.clients

    # Test hooks and facts -----------------------------------------------------------------

    def crash(self, gpu: str) -> None:
        """The GPU's daemon dies (in-process; fault files do the same from outside)."""
        with self._op(gpu):
            self._crash(gpu)

    def set_fail_start(self, gpu: str, failing: bool) -> None:
        with self._lock:
            if failing:
                self._fail_start.add(gpu)
            else:
                self._fail_start.discard(gpu)

    def starts(self, gpu: str) -> int:
        with self._lock:
            return self._starts.get(gpu, 0)

    def pid(self, gpu: str) -> int | None:
        with self._lock:
            daemon = self._daemons.get(gpu)
            return None if daemon is None else daemon.pid

    def faults_dir(self) -> Path | None:
        return None if self.root is None else self.root / FAULTS_DIR

    # Internals ------------------------------------------------------------------------------

    @contextmanager
    def _op(self, gpu: str | None) -> Iterator[None]:
        if gpu is not None:
            self._layout.gpu_dir(gpu)  # refuses what is not a GPU UUID
        with self._lock:
            self._take_crashes()
            yield

    def _has_fault(self, gpu: str, suffix: str) -> bool:
        faults = self.faults_dir()
        return faults is not None and (faults / f"{gpu}{suffix}").exists()

    def _take_crashes(self) -> None:
        faults = self.faults_dir()
        if faults is None:
            return
        try:
            names = os.listdir(faults)
        except FileNotFoundError:
            return
        except OSError as e:
            raise MpsError("", f"read the fault files in {faults}", e.strerror or str(e)) from e
        for name in sorted(names):
            if not name.endswith(CRASH):
                continue
            try:
                (faults / name).unlink()
            except FileNotFoundError:
                continue  # taken by another call meanwhile
            self._crash(name.removesuffix(CRASH))

    def _crash(self, gpu: str) -> None:
        daemon = self._daemons.pop(gpu, None)
        log.info(
            "mps.simulated_crash",
            node=self._node,
            gpu=gpu,
            pid=None if daemon is None else daemon.pid,
            was_running=daemon is not None,
        )
        if daemon is not None:
            self._persist()

    def _to_json(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "nextPid": self._next_pid,
            "daemons": {
                gpu: {"pid": d.pid, "clients": d.clients}
                for gpu, d in sorted(self._daemons.items())
            },
            "starts": dict(sorted(self._starts.items())),
        }

    def _persist(self) -> None:
        if self.root is None:
            return
        path = self.root / STATE_FILE
        data = orjson.dumps(self._to_json(), option=orjson.OPT_SORT_KEYS)
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            write_atomically(path, data)
        except OSError as e:
            raise MpsError("", f"write {path}", e.strerror or str(e)) from e

    def _load(self, path: Path) -> None:
        what = f"load the simulated MPS state from {path}"
        try:
            raw = json.loads(path.read_text())
            if raw.get("version") != STATE_VERSION:
                raise MpsError(
                    "", what, f"version {raw.get('version')!r}, expected {STATE_VERSION}"
                )
            daemons = {
                str(gpu): _Daemon(int(d["pid"]), int(d["clients"]))
                for gpu, d in raw["daemons"].items()
            }
            starts = {str(gpu): int(n) for gpu, n in raw["starts"].items()}
            next_pid = int(raw["nextPid"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise MpsError("", what, f"unreadable or malformed ({e!r}); delete it") from e
        for gpu in daemons:
            self._layout.gpu_dir(gpu)  # a name that is not a GPU UUID: refused
        self._daemons, self._starts, self._next_pid = daemons, starts, next_pid
