"""The real MPS backend's command lines, environments and error mapping (injected runner:
no binary and no GPU here)."""

from __future__ import annotations

import stat
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from api.errors import InvalidConfigError
from node_agent.mps import (
    ControlDaemons,
    MpsAlreadyRunningError,
    MpsError,
    MpsLayout,
    MpsNotRunningError,
    MpsStartError,
    MpsUnavailableError,
    SimulatedMps,
    mps_backend_from_env,
)
from node_agent.mps.real import PID_FILE, Completed

G0 = "GPU-00000000-0000-0000-0000-000000000000"


@dataclass
class Call:
    argv: list[str]
    env: dict[str, str]
    stdin: str | None
    timeout_s: float


@dataclass
class FakeRunner:
    """Answers by the command: ``-d`` writes the pid file as the daemon does."""

    answers: dict[str, Completed | BaseException] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)

    def __call__(
        self, argv: Sequence[str], *, env: Mapping[str, str], stdin: str | None, timeout_s: float
    ) -> Completed:
        self.calls.append(Call(list(argv), dict(env), stdin, timeout_s))
        key = argv[-1] if stdin is None else stdin.strip()
        answer = self.answers.get(key, Completed(0))
        if isinstance(answer, BaseException):
            raise answer
        if key == "-d" and answer.returncode == 0:
            (Path(env["CUDA_MPS_PIPE_DIRECTORY"]) / PID_FILE).write_text("4242\n")
        if key == "quit" and answer.returncode == 0:
            (Path(env["CUDA_MPS_PIPE_DIRECTORY"]) / PID_FILE).unlink()
        return answer


def backend(root: Path, runner: FakeRunner) -> ControlDaemons:
    return ControlDaemons(
        MpsLayout(root),
        runner=runner,
        base_env={"PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "0", "CUDA_MPS_PIPE_DIRECTORY": "/x"},
    )


def test_start_runs_the_control_daemon_for_that_gpu_alone(tmp_path: Path) -> None:
    runner = FakeRunner()
    mps = backend(tmp_path / "mps", runner)
    mps.start(G0)
    pipe, logs = tmp_path / "mps" / G0 / "pipe", tmp_path / "mps" / G0 / "log"
    expected_env = {
        "PATH": "/usr/bin",  # the agent's CUDA settings are not inherited
        "CUDA_VISIBLE_DEVICES": G0,
        "CUDA_MPS_PIPE_DIRECTORY": str(pipe),
        "CUDA_MPS_LOG_DIRECTORY": str(logs),
    }
    [start] = runner.calls  # no pid file before: nothing to ask
    assert start == Call(["nvidia-cuda-mps-control", "-d"], expected_env, None, 30.0)
    assert pipe.is_dir() and logs.is_dir()
    runner.calls.clear()
    assert mps.running(G0)
    assert runner.calls == [
        Call(["nvidia-cuda-mps-control"], expected_env, "get_server_list\n", 5.0)
    ]


def test_a_running_daemon_is_adopted_not_started_twice(tmp_path: Path) -> None:
    runner = FakeRunner()
    backend(tmp_path, runner).start(G0)
    again = backend(tmp_path, runner)  # a restarted agent
    assert again.daemons() == {G0}
    with pytest.raises(MpsAlreadyRunningError):
        again.start(G0)
    assert [c.argv[-1] for c in runner.calls].count("-d") == 1


def test_stop_writes_quit_to_the_gpus_daemon(tmp_path: Path) -> None:
    runner = FakeRunner()
    mps = backend(tmp_path, runner)
    mps.start(G0)
    runner.calls.clear()
    mps.stop(G0)
    assert [(c.argv, c.stdin) for c in runner.calls] == [
        (["nvidia-cuda-mps-control"], "get_server_list\n"),
        (["nvidia-cuda-mps-control"], "quit\n"),
    ]
    assert runner.calls[-1].env["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / G0 / "pipe")
    assert not mps.running(G0)
    with pytest.raises(MpsNotRunningError):
        mps.stop(G0)


def test_a_daemon_that_does_not_answer_is_down(tmp_path: Path) -> None:
    runner = FakeRunner()
    mps = backend(tmp_path, runner)
    mps.start(G0)
    runner.answers["get_server_list"] = Completed(1, "", "cannot connect")
    assert not mps.running(G0)
    runner.answers["get_server_list"] = subprocess.TimeoutExpired("nvidia-cuda-mps-control", 5)
    assert not mps.running(G0)
    assert mps.daemons() == frozenset()


def test_a_failed_start_points_at_the_control_log(tmp_path: Path) -> None:
    runner = FakeRunner(answers={"-d": Completed(1)})
    with pytest.raises(MpsStartError, match=f"{tmp_path}/{G0}/log/control.log"):
        backend(tmp_path, runner).start(G0)


def test_a_missing_binary_is_reported_as_such(tmp_path: Path) -> None:
    runner = FakeRunner(answers={"-d": FileNotFoundError("nvidia-cuda-mps-control")})
    with pytest.raises(MpsUnavailableError, match="not found"):
        backend(tmp_path, runner).start(G0)


def test_no_root_means_no_daemons_and_nothing_run(tmp_path: Path) -> None:
    runner = FakeRunner()
    assert backend(tmp_path / "absent", runner).daemons() == frozenset()
    assert runner.calls == []


def test_the_backend_follows_the_nvml_kind_unless_set(tmp_path: Path) -> None:
    assert isinstance(mps_backend_from_env({}, root=tmp_path), ControlDaemons)
    sim = mps_backend_from_env({"TESSERA_NVML": "simulated"}, root=tmp_path)
    assert isinstance(sim, SimulatedMps) and sim.root == tmp_path
    real = mps_backend_from_env({"TESSERA_NVML": "simulated", "TESSERA_MPS": "real"}, root=tmp_path)
    assert isinstance(real, ControlDaemons)
    with pytest.raises(InvalidConfigError, match="unknown MPS backend 'x'; valid: real, simulated"):
        mps_backend_from_env({"TESSERA_MPS": "x"})


def test_directories_get_their_modes_even_when_created_open_beforehand(tmp_path: Path) -> None:
    root = tmp_path / "mps"
    root.mkdir(mode=0o755)  # as a hostPath volume the kubelet creates
    (root / G0).mkdir(mode=0o777)
    MpsLayout(root).create(G0)
    modes = {p: stat.S_IMODE((root / p).stat().st_mode) for p in ("", G0, f"{G0}/log")}
    assert modes == {"": 0o700, G0: 0o700, f"{G0}/log": 0o700}
    assert stat.S_IMODE((root / G0 / "pipe").stat().st_mode) == 0o755


def test_a_symbolic_link_in_place_of_a_gpu_directory_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "mps"
    root.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / G0).symlink_to(elsewhere)
    runner = FakeRunner()
    with pytest.raises(MpsError, match="not a directory"):
        backend(root, runner).start(G0)
    assert list(elsewhere.iterdir()) == []
    assert [c.argv for c in runner.calls] == []


def test_cli_takes_the_mps_root_and_a_positive_check_interval() -> None:
    from scheduler_plugins.cli import build_parser

    parser = build_parser()
    run = ["node-agent", "run", "--node-name", "n"]
    args = parser.parse_args([*run, "--mps-root", "/srv/mps", "--mps-check-interval", "2"])
    assert (args.mps_root, args.mps_check_interval) == ("/srv/mps", 2.0)
    assert parser.parse_args(run).mps_check_interval == 5.0
    assert parser.parse_args(["node-agent", "kwok"]).mps_check_interval == 0.5
    for bad in ("0", "-1", "nan", "x"):
        with pytest.raises(SystemExit):
            parser.parse_args([*run, "--mps-check-interval", bad])
