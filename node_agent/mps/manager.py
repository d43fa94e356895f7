"""One MPS control daemon per MPS GPU of this node: started, watched, restarted, stopped.

``MpsDaemons.sync(gpus)`` is one check, run at agent start and then every check interval
(5 s on a node, 0.5 s in kwok mode) with the GPUs the node registers in ``mps`` mode (none
in other modes):

- a daemon that runs for a GPU not in ``gpus`` (the node left MPS mode, the GPU is filtered
  out or gone) is stopped;
- a GPU whose daemon runs is up; one found running at the first check is adopted (started
  by an earlier agent: its clients keep their daemon);
- a GPU whose daemon was up and is found down is reported down and restarted at the *next*
  check: the kubelet and the scheduler see the GPU unhealthy meanwhile, and a daemon that
  keeps crashing is restarted at most once per interval;
- a GPU whose daemon is down (never started, crashed before, failed to start) is started;
  until a start succeeds it stays down.

``sync`` returns whether any GPU's health changed, so the caller republishes (registration,
the device plugin's ListAndWatch). Health between checks comes from the last one
(``healthy``); Allocate asks the daemon itself once more (``require_up``). Every transition
is logged with the node and GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import structlog

from node_agent.mps.backend import MpsBackend
from node_agent.mps.errors import (
    MpsAlreadyRunningError,
    MpsDaemonDownError,
    MpsError,
    MpsNotRunningError,
)

log = structlog.get_logger(__name__)


class MpsDaemons:
    """Thread-safe: checks are serialized; ``healthy`` reads the last check's result."""

    def __init__(self, backend: MpsBackend, *, node_name: str) -> None:
        self._backend = backend
        self._node = node_name
        self._lock = threading.Lock()
        self._state = threading.Lock()  # guards _up only, never held across a backend call
        self._up: dict[str, bool] = {}  # this node's MPS GPUs -> daemon up at the last check

    def sync(self, gpus: Iterable[str]) -> bool:
        """One check (see the module docstring); True when some GPU's health changed.

        Raises ``MpsError`` when the running daemons cannot be listed; nothing changes then.
        """
        desired = list(dict.fromkeys(gpus))
        with self._lock:
            with self._state:
                before = dict(self._up)
            running = self._backend.daemons()
            for gpu in sorted(running - set(desired)):
                self._stop(gpu)
            after = {gpu: self._check(gpu, gpu in running, before.get(gpu)) for gpu in desired}
            with self._state:
                self._up = after
            return after != before

    def healthy(self, gpu: str) -> bool:
        """The GPU's daemon was up at the last check (False for a GPU never checked)."""
        with self._state:
            return self._up.get(gpu, False)

    def health(self) -> Mapping[str, bool]:
        with self._state:
            return dict(self._up)

    def require_up(self, gpus: Sequence[str]) -> None:
        """Allocate's check: every GPU's daemon was up at the last check and answers now;
        ``MpsDaemonDownError`` (temporary) otherwise."""
        down = tuple(g for g in dict.fromkeys(gpus) if not self.healthy(g))
        if down:
            raise MpsDaemonDownError(down)
        for gpu in dict.fromkeys(gpus):
            try:
                up = self._backend.running(gpu)
            except MpsError as e:
                raise MpsDaemonDownError((gpu,), str(e)) from e
            if not up:
                raise MpsDaemonDownError((gpu,), "found down at Allocate")

    def pipe_dir(self, gpu: str) -> Path:
        return self._backend.pipe_dir(gpu)

    # One GPU ------------------------------------------------------------------------------

    def _check(self, gpu: str, running: bool, was_up: bool | None) -> bool:
        if running:
            if was_up is None:
                log.info("mps.daemon_adopted", node=self._node, gpu=gpu)
            elif not was_up:
                log.info("mps.daemon_back", node=self._node, gpu=gpu)
            return True
        if was_up:
            log.warning("mps.daemon_down", node=self._node, gpu=gpu, restart="next check")
            return False
        return self._start(gpu, restart=was_up is not None)

    def _start(self, gpu: str, *, restart: bool) -> bool:
        try:
            self._backend.start(gpu)
        except MpsAlreadyRunningError:
            # Started between the listing and now (another agent's start-up): serve it.
            log.info("mps.daemon_adopted", node=self._node, gpu=gpu)
            return True
        except MpsError as e:
            log.warning("mps.daemon_start_failed", node=self._node, gpu=gpu, error=str(e))
            return False
        log.info("mps.daemon_started", node=self._node, gpu=gpu, restart=restart)
        return True

    def _stop(self, gpu: str) -> None:
        try:
            self._backend.stop(gpu)
        except MpsNotRunningError:
            return  # gone meanwhile: nothing to stop
        except MpsError as e:
            log.warning("mps.daemon_stop_failed", node=self._node, gpu=gpu, error=str(e))
            return
        log.info("mps.daemon_stopped", node=self._node, gpu=gpu, reason="not an MPS GPU here")
