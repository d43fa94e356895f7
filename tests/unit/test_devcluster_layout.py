"""Where a dev cluster keeps what lives in memory: a private directory per state dir."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from scheduler_plugins.devtools.cluster import layout
from scheduler_plugins.devtools.cluster.cluster import Cluster
from scheduler_plugins.devtools.cluster.errors import ClusterError
from scheduler_plugins.devtools.cluster.layout import ClusterSettings, private_dir


def test_memory_dir_is_on_shm_one_per_state_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(layout, "SHM_DIR", shm)
    a = ClusterSettings(name="t", state_dir_override=tmp_path / "a")
    b = ClusterSettings(name="t", state_dir_override=tmp_path / "b")
    assert a.memory_dir.parent == shm and b.memory_dir.parent == shm
    assert a.memory_dir != b.memory_dir  # same name, other state dir: never shared
    assert a.memory_dir == ClusterSettings(name="t", state_dir_override=tmp_path / "a").memory_dir
    assert a.memory_dir.name.startswith(f"tessera-{os.getuid()}-")


@pytest.mark.parametrize("shm", ["absent", "read-only"])
def test_without_a_usable_shm_memory_dir_is_in_the_state_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shm: str
) -> None:
    there = tmp_path / "shm"
    if shm == "read-only":
        there.mkdir()
        monkeypatch.setattr(layout.os, "access", lambda path, mode: Path(path) != there)
    monkeypatch.setattr(layout, "SHM_DIR", there)
    s = ClusterSettings(name="t", state_dir_override=tmp_path / "state")
    assert s.memory_dir == tmp_path / "state" / "memory"


def test_private_dir_is_made_for_this_user_only(tmp_path: Path) -> None:
    made = private_dir(tmp_path / "m")
    assert made.is_dir() and made.stat().st_mode & 0o777 == 0o700
    assert private_dir(made) == made  # a second start takes its own directory again


@pytest.mark.parametrize("planted", ["link", "file", "open"])
def test_private_dir_refuses_what_someone_else_could_have_planted(
    tmp_path: Path, planted: str
) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    path = tmp_path / "m"
    if planted == "link":
        path.symlink_to(target)
    elif planted == "file":
        path.write_text("x")
    else:
        path.mkdir(mode=0o700)
        path.chmod(0o777)
    with pytest.raises(ClusterError, match="not a private directory of this user"):
        private_dir(path)
    assert list(target.iterdir()) == []  # nothing written through the link


def test_private_dir_names_a_missing_parent(tmp_path: Path) -> None:
    with pytest.raises(ClusterError, match="cannot create"):
        private_dir(tmp_path / "no" / "m")


@pytest.mark.parametrize(("mode", "removed"), [(0o700, True), (0o777, False)])
def test_purge_removes_the_memory_dir_it_made_and_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: int, removed: bool
) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(layout, "SHM_DIR", shm)
    s = ClusterSettings(name="t", state_dir_override=tmp_path / "state")
    s.state_dir.mkdir()
    s.memory_dir.mkdir()
    s.memory_dir.chmod(mode)  # 0o777: not what private_dir makes (someone else's to remove)
    (s.memory_dir / "node.json").write_text("{}")
    Cluster(s).down(purge=True)
    assert not s.state_dir.exists()
    assert s.memory_dir.exists() is not removed
