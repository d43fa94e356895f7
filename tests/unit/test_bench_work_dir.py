"""One ``tessera bench`` per work dir: a second one would purge the first's live cluster."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from scheduler_plugins.devtools.bench.errors import BenchError
from scheduler_plugins.devtools.bench.runner import LOCK_FILE, BenchOptions, exclusive_work_dir, run


def test_a_second_run_in_the_same_work_dir_is_refused_naming_the_first(tmp_path: Path) -> None:
    with exclusive_work_dir(tmp_path):
        assert (tmp_path / LOCK_FILE).read_text() == f"{os.getpid()}\n"
        with pytest.raises(BenchError) as info, exclusive_work_dir(tmp_path):
            pass
    message = str(info.value)
    assert f"another tessera bench (pid {os.getpid()}) is running in {tmp_path}" in message
    assert "--work-dir" in message


def test_the_work_dir_is_free_again_after_a_run_even_a_failed_one(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), exclusive_work_dir(tmp_path):
        raise RuntimeError("phase failed")
    assert (tmp_path / LOCK_FILE).read_text() == ""
    with exclusive_work_dir(tmp_path / "nested" / "dir"):
        pass
    with exclusive_work_dir(tmp_path):
        pass


def test_run_refuses_before_touching_any_cluster(tmp_path: Path) -> None:
    opts = BenchOptions(nodes=(1,), pods=1, work_dir=tmp_path)
    with exclusive_work_dir(tmp_path), pytest.raises(BenchError, match="another tessera bench"):
        run(opts)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILE]
