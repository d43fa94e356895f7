"""Tessera's gRPC Unix sockets are private: whoever can connect is trusted (no auth).

The plugin server's socket lives in a directory only its owner can reach (created 0700; an
existing directory open to group/others is refused), the device plugin's in the kubelet's
plugin dir (which no one else may write to); both sockets are 0600 before they serve, and a
path that holds a symlink, a file or a live socket is refused, never followed or deleted.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from api.errors import TemporaryError
from api.hami.config import DeviceConfig
from api.sockets import (
    UnsafeSocketPathError,
    claim_socket_path,
    ensure_private_dir,
)
from node_agent.deviceplugin.ids import SlotInventory
from node_agent.deviceplugin.server import DevicePluginServer
from scheduler_plugins.server.app import PluginServer, ServerAddressError
from tests.builders import gpu
from tests.fake_kubelet import FakeKubelet
from tests.security_helpers import IdleKube, NoAllocations


@pytest.fixture
def base() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="tsec-", dir="/tmp"))  # short: sun_path is 108 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def plugin_server(sock: Path) -> PluginServer:
    return PluginServer(IdleKube(), DeviceConfig(), socket_path=sock)


def device_plugin(plugin_dir: Path) -> DevicePluginServer:
    return DevicePluginServer(
        "nvidia.com/gpu",
        plugin_dir,
        "tessera.sock",
        SlotInventory([gpu("GPU-a")]),
        NoAllocations(),
        register_timeout_s=2.0,
    )


# ----- the plugin server -------------------------------------------------------------------------


def test_plugin_server_creates_a_private_dir_and_a_0600_socket_even_under_umask_0(
    base: Path,
) -> None:
    sock = base / "run" / "tessera" / "plugin.sock"
    old = os.umask(0)
    try:
        server = plugin_server(sock)
        server.start()
    finally:
        os.umask(old)
    try:
        assert mode(sock.parent) == 0o700
        assert stat.S_ISSOCK(os.lstat(sock).st_mode) and mode(sock) == 0o600
    finally:
        server.stop()
    assert not sock.exists()


@pytest.mark.parametrize("dir_mode", [0o755, 0o750, 0o711, 0o777, 0o1777], ids=oct)
def test_plugin_server_refuses_a_directory_others_can_reach(base: Path, dir_mode: int) -> None:
    shared = base / "shared"
    shared.mkdir()
    os.chmod(shared, dir_mode)
    with pytest.raises(ServerAddressError) as e:
        plugin_server(shared / "plugin.sock").start()
    assert f"mode {dir_mode:04o}" in str(e.value) and "group or others" in str(e.value)
    assert "new subdirectory" in str(e.value)
    assert list(shared.iterdir()) == []
    assert mode(shared) == dir_mode  # refused, not "fixed" behind the operator's back


def test_plugin_server_accepts_a_subdirectory_it_creates_inside_a_shared_one(base: Path) -> None:
    shared = base / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # e.g. an emptyDir volume shared by the scheduler pod's containers
    with plugin_server(shared / "tessera" / "plugin.sock") as server:
        assert mode(shared / "tessera") == 0o700
        assert mode(shared / "tessera" / "plugin.sock") == 0o600
        assert server.address.startswith("unix:")


@pytest.mark.parametrize(
    "make",
    ["regular file", "symlink to a file", "dangling symlink", "symlink to a socket", "directory"],
)
def test_plugin_server_refuses_what_is_not_a_stale_socket_and_leaves_it_alone(
    base: Path, make: str
) -> None:
    target = base / "target"
    sock = base / "plugin.sock"
    if make == "regular file":
        sock.write_text("precious")
    elif make == "symlink to a file":
        target.write_text("precious")
        sock.symlink_to(target)
    elif make == "dangling symlink":
        sock.symlink_to(base / "nowhere")
    elif make == "symlink to a socket":
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(target))
        sock.symlink_to(target)
    else:
        sock.mkdir()
    before = os.lstat(sock)
    with pytest.raises(ServerAddressError, match="not a socket"):
        plugin_server(sock).start()
    after = os.lstat(sock)
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)
    if make in ("regular file", "symlink to a file"):
        assert sock.read_text() == "precious"
    if make == "symlink to a socket":
        assert stat.S_ISSOCK(os.lstat(target).st_mode)  # the target was not removed either


def test_plugin_server_refuses_a_live_socket_and_replaces_a_stale_one(base: Path) -> None:
    sock = base / "plugin.sock"
    live = socket.socket(socket.AF_UNIX)
    live.bind(str(sock))
    live.listen()
    try:
        with pytest.raises(ServerAddressError, match="another server is listening"):
            plugin_server(sock).start()
        assert stat.S_ISSOCK(os.lstat(sock).st_mode)
    finally:
        live.close()
    # Closed but never unlinked: what a crashed server leaves behind.
    with plugin_server(sock):
        assert mode(sock) == 0o600


def test_plugin_server_refuses_a_socket_dir_owned_by_someone_else(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    owned = base / "owned"
    owned.mkdir(mode=0o700)
    someone_else = os.stat(owned).st_uid + 1
    monkeypatch.setattr(os, "geteuid", lambda: someone_else)
    with pytest.raises(ServerAddressError, match=f"not by this process's uid {someone_else}"):
        plugin_server(owned / "plugin.sock").start()


def test_a_file_where_the_socket_dir_should_be_is_refused(base: Path) -> None:
    (base / "notadir").write_text("x")
    with pytest.raises(UnsafeSocketPathError, match="not a directory"):
        ensure_private_dir(base / "notadir")
    with pytest.raises(UnsafeSocketPathError, match="not a socket"):
        claim_socket_path(base / "notadir")


# ----- the device plugin --------------------------------------------------------------------------


@pytest.mark.parametrize("dir_mode", [0o700, 0o750, 0o755], ids=oct)
def test_device_plugin_socket_is_0600_in_a_dir_no_one_else_writes(
    base: Path, dir_mode: int
) -> None:
    plugin_dir = base / "device-plugins"
    plugin_dir.mkdir()
    os.chmod(plugin_dir, dir_mode)  # the kubelet creates its dir 0750 or 0755
    kubelet = FakeKubelet(plugin_dir)
    try:
        with device_plugin(plugin_dir):
            assert mode(plugin_dir / "tessera.sock") == 0o600
            assert mode(plugin_dir) == dir_mode
    finally:
        kubelet.stop()


def test_device_plugin_creates_a_missing_plugin_dir_0700(base: Path) -> None:
    plugin_dir = base / "var" / "device-plugins"
    with pytest.raises(TemporaryError, match="is the kubelet running"):
        device_plugin(plugin_dir).start()
    assert mode(plugin_dir) == 0o700
    assert not (plugin_dir / "tessera.sock").exists()  # nothing left serving


@pytest.mark.parametrize("dir_mode", [0o775, 0o777, 0o757], ids=oct)
def test_device_plugin_refuses_a_plugin_dir_others_can_write(base: Path, dir_mode: int) -> None:
    plugin_dir = base / "device-plugins"
    plugin_dir.mkdir()
    os.chmod(plugin_dir, dir_mode)
    with pytest.raises(UnsafeSocketPathError, match="may write to"):
        device_plugin(plugin_dir).start()
    assert list(plugin_dir.iterdir()) == []


@pytest.mark.parametrize("make", ["regular file", "symlink", "live socket"])
def test_device_plugin_refuses_what_is_not_a_stale_socket(base: Path, make: str) -> None:
    plugin_dir = base / "device-plugins"
    plugin_dir.mkdir(mode=0o700)
    sock = plugin_dir / "tessera.sock"
    live = None
    if make == "regular file":
        sock.write_text("precious")
    elif make == "symlink":
        (base / "elsewhere").write_text("precious")
        sock.symlink_to(base / "elsewhere")
    else:
        live = socket.socket(socket.AF_UNIX)
        live.bind(str(sock))
        live.listen()
    before = os.lstat(sock)
    try:
        with pytest.raises(UnsafeSocketPathError):
            device_plugin(plugin_dir).start()
        after = os.lstat(sock)
        assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)
        if make != "live socket":
            assert sock.read_text() == "precious"
    finally:
        if live is not None:
            live.close()
