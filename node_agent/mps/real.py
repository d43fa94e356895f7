"""MPS control daemons driven through NVIDIA's ``nvidia-cuda-mps-control`` binary.

Per GPU (NVIDIA's MPS documentation, "Tools and Interface Reference"):

- start: ``nvidia-cuda-mps-control -d`` with ``CUDA_VISIBLE_DEVICES=<gpu uuid>``,
  ``CUDA_MPS_PIPE_DIRECTORY=<root>/<uuid>/pipe`` and ``CUDA_MPS_LOG_DIRECTORY=<root>/<uuid>/log``;
  the daemon forks into the background and writes ``nvidia-cuda-mps-control.pid`` into the
  pipe directory.
- health: no pid file there means no daemon (nothing is run); otherwise the daemon is asked
  ``get_server_list`` through that pipe directory, and it is up when it answers (exit 0)
  within the timeout. A daemon that does not answer in time is down: clients would hang
  on it the same way.
- stop: ``quit`` written to ``nvidia-cuda-mps-control`` with the same pipe directory.
- adoption: a daemon that already answers for the GPU's pipe directory (started by an
  earlier agent) is reported running, so the manager adopts it instead of starting a
  second one (``start`` refuses, as the binary refuses a second daemon on one directory).

Processes run through an injected ``ProcessRunner`` (``subprocess.run`` by default), so
the command lines and environments are unit-tested without the binary or a GPU. This
backend is not exercised against real hardware in Tessera's test suites.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol

import structlog

from node_agent.mps.backend import MpsLayout
from node_agent.mps.errors import (
    MpsAlreadyRunningError,
    MpsError,
    MpsNotRunningError,
    MpsStartError,
    MpsUnavailableError,
)

log = structlog.get_logger(__name__)

CONTROL_BINARY: Final = "nvidia-cuda-mps-control"
PID_FILE: Final = "nvidia-cuda-mps-control.pid"
QUERY_TIMEOUT_S: Final = 5.0
START_TIMEOUT_S: Final = 30.0


@dataclass(frozen=True)
class Completed:
    returncode: int
    stdout: str = ""
    stderr: str = ""


class ProcessRunner(Protocol):
    """Runs ``argv`` to completion. ``stdin`` None: no input and no output captured (a
    daemonizing command whose child keeps inherited pipes open would never reach EOF).
    Raises what ``subprocess.run`` raises: ``FileNotFoundError``, ``TimeoutExpired``,
    ``OSError``."""

    def __call__(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        stdin: str | None,
        timeout_s: float,
    ) -> Completed: ...


def run_process(
    argv: Sequence[str], *, env: Mapping[str, str], stdin: str | None, timeout_s: float
) -> Completed:
    if stdin is None:
        done = subprocess.run(
            list(argv),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=timeout_s,
            check=False,
        )
        return Completed(done.returncode)
    answered = subprocess.run(
        list(argv),
        env=dict(env),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    return Completed(answered.returncode, answered.stdout, answered.stderr)


class ControlDaemons:
    """``MpsBackend`` over ``nvidia-cuda-mps-control``; holds no state of its own (the pipe
    directories are the state), so it is thread-safe and an agent restart adopts."""

    def __init__(
        self,
        layout: MpsLayout | None = None,
        *,
        runner: ProcessRunner = run_process,
        binary: str = CONTROL_BINARY,
        base_env: Mapping[str, str] | None = None,
        query_timeout_s: float = QUERY_TIMEOUT_S,
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        self.layout = layout or MpsLayout()
        self._runner = runner
        self._binary = binary
        self._base_env = dict(os.environ if base_env is None else base_env)
        self._query_timeout_s = query_timeout_s
        self._start_timeout_s = start_timeout_s

    # MpsBackend ---------------------------------------------------------------------------

    def start(self, gpu: str) -> None:
        if self.running(gpu):
            raise MpsAlreadyRunningError(
                gpu, "start its MPS control daemon", f"one already serves {self.pipe_dir(gpu)}"
            )
        self.layout.create(gpu)
        what = "start its MPS control daemon"
        done = self._run(gpu, what, [self._binary, "-d"], None, self._start_timeout_s)
        if done.returncode != 0:
            raise MpsStartError(
                gpu,
                what,
                f"{self._binary} -d exited {done.returncode}; see "
                f"{self.layout.log_dir(gpu) / 'control.log'}",
            )

    def stop(self, gpu: str) -> None:
        what = "stop its MPS control daemon"
        if not self.running(gpu):
            raise MpsNotRunningError(gpu, what, f"no daemon serves {self.pipe_dir(gpu)}")
        done = self._run(gpu, what, [self._binary], "quit\n", self._query_timeout_s)
        if done.returncode != 0:
            raise MpsError(gpu, what, f"quit exited {done.returncode}: {_tail(done)}")

    def running(self, gpu: str) -> bool:
        if not (self.pipe_dir(gpu) / PID_FILE).exists():
            return False  # never started here, or quit: no process to ask
        try:
            done = self._run(
                gpu,
                "ask its MPS control daemon",
                [self._binary],
                "get_server_list\n",
                self._query_timeout_s,
            )
        except MpsUnavailableError as e:
            if isinstance(e.__cause__, subprocess.TimeoutExpired):
                log.warning("mps.daemon_not_answering", gpu=gpu, error=str(e))
                return False
            raise
        return done.returncode == 0

    def daemons(self) -> frozenset[str]:
        return frozenset(g for g in self.layout.gpus() if self.running(g))

    def pipe_dir(self, gpu: str) -> Path:
        return self.layout.pipe_dir(gpu)

    # Internals ------------------------------------------------------------------------------

    def env(self, gpu: str) -> dict[str, str]:
        """The environment every command for ``gpu`` runs with: the agent's own, less any
        CUDA setting it carries (which could point the daemon at other GPUs or pipes)."""
        env = {k: v for k, v in self._base_env.items() if not k.startswith("CUDA_")}
        env["CUDA_VISIBLE_DEVICES"] = gpu
        env["CUDA_MPS_PIPE_DIRECTORY"] = str(self.layout.pipe_dir(gpu))
        env["CUDA_MPS_LOG_DIRECTORY"] = str(self.layout.log_dir(gpu))
        return env

    def _run(
        self, gpu: str, what: str, argv: list[str], stdin: str | None, timeout_s: float
    ) -> Completed:
        try:
            return self._runner(argv, env=self.env(gpu), stdin=stdin, timeout_s=timeout_s)
        except FileNotFoundError as e:
            raise MpsUnavailableError(
                gpu,
                what,
                f"{self._binary} not found; install the NVIDIA driver utilities on the node "
                "or put it on the agent's PATH",
            ) from e
        except subprocess.TimeoutExpired as e:
            raise MpsUnavailableError(
                gpu, what, f"{self._binary} did not finish in {timeout_s:g}s"
            ) from e
        except OSError as e:
            raise MpsError(gpu, what, f"cannot run {self._binary}: {e.strerror or e}") from e


def _tail(done: Completed) -> str:
    text = (done.stderr or done.stdout).strip()
    return text[-300:] or "no output"
