"""The simulated backends' state file writes: whole or not at all, never through a link."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from node_agent.statefile import write_atomically


def _temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")


def test_a_write_replaces_the_file_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    write_atomically(path, b"old")
    write_atomically(path, b"new")
    assert path.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_a_link_planted_at_the_temporary_name_is_not_followed(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    write_atomically(path, b"kept")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"untouched")
    _temp_name(path).symlink_to(elsewhere)
    with pytest.raises(OSError):
        write_atomically(path, b"new")
    assert path.read_bytes() == b"kept"  # the old state stands
    assert elsewhere.read_bytes() == b"untouched"
    assert not _temp_name(path).exists() and not _temp_name(path).is_symlink()
    write_atomically(path, b"new")  # the next write goes through
    assert path.read_bytes() == b"new"


def test_a_leftover_temporary_file_of_a_killed_write_is_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    _temp_name(path).write_bytes(b"a partial write, longer than the next one")
    write_atomically(path, b"whole")
    assert path.read_bytes() == b"whole"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]
