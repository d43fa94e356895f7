"""Nothing Tessera opens listens beyond this machine unless configured to.

- Every listen flag of every ``tessera`` command defaults to loopback or to nothing.
- The plugin server's TCP (development) and metrics addresses must be loopback unless
  ``--allow-remote`` is given; anything else is refused with a message that says so.
- Started servers really bind what they say: the process's TCP listeners (read from /proc)
  are all loopback, and the device plugin opens none.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from api.hami.config import DeviceConfig
from node_agent.deviceplugin.ids import SlotInventory
from node_agent.deviceplugin.server import DevicePluginServer
from scheduler_plugins.cli import build_parser
from scheduler_plugins.server.app import PluginServer, ServerAddressError
from tests.builders import gpu
from tests.fake_kubelet import FakeKubelet
from tests.security_helpers import IdleKube, NoAllocations, is_loopback, tcp_listeners


def _walk(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.Action]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, (*path, name))
        else:
            yield path, action


def _is_listen_flag(action: argparse.Action) -> bool:
    dest = action.dest
    return dest == "listen" or (dest.endswith("address") and not dest.endswith("_file"))


def _host(address: str) -> str:
    return address.rpartition(":")[0].strip("[]")


def test_every_listen_flag_defaults_to_loopback_or_nothing() -> None:
    found: dict[str, object] = {}
    for path, action in _walk(build_parser()):
        if not _is_listen_flag(action):
            continue
        flag = f"{' '.join(path)} {action.option_strings[0]}"
        found[flag] = action.default
        if action.default:
            assert isinstance(action.default, str), flag
            host = _host(action.default)
            assert host == "localhost" or is_loopback(host), f"{flag} defaults to {host}"
    # The walk sees every listener Tessera has today (a new one is checked automatically).
    assert {
        "plugin-server --address",
        "plugin-server --metrics-address",
        "webhook serve --listen",
    } <= set(found)
    assert found["plugin-server --address"] is None  # Unix socket unless asked


def test_plugin_server_needs_a_socket_or_an_explicit_address() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plugin-server", "--kubeconfig", "k"])


@pytest.fixture
def short_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="tlis-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


REMOTE = ["0.0.0.0:0", "[::]:0", ":0", "10.1.2.3:9395", "example.com:80", "localhost.evil:1"]
LOCAL = ["127.0.0.1:0", "[::1]:0", "localhost:0", "127.9.9.9:0"]


@pytest.mark.parametrize("address", REMOTE)
def test_non_loopback_tcp_and_metrics_addresses_need_allow_remote(
    address: str, short_dir: Path
) -> None:
    with pytest.raises(ServerAddressError, match="not loopback"):
        PluginServer(IdleKube(), DeviceConfig(), tcp_address=address)
    with pytest.raises(ServerAddressError, match=r"not loopback|must be HOST:PORT"):
        PluginServer(
            IdleKube(), DeviceConfig(), socket_path=short_dir / "s.sock", metrics_address=address
        )
    # Explicitly allowed: accepted (not started: nothing binds beyond this machine here).
    PluginServer(IdleKube(), DeviceConfig(), tcp_address=address, allow_remote=True)


@pytest.mark.parametrize("address", LOCAL)
def test_loopback_addresses_need_no_opt_in(address: str, short_dir: Path) -> None:
    PluginServer(IdleKube(), DeviceConfig(), tcp_address=address)
    PluginServer(
        IdleKube(), DeviceConfig(), socket_path=short_dir / "s.sock", metrics_address=address
    )


def test_started_servers_listen_on_loopback_only(short_dir: Path) -> None:
    pid = os.getpid()
    before = set(tcp_listeners(pid))
    tcp = PluginServer(
        IdleKube(), DeviceConfig(), tcp_address="127.0.0.1:0", metrics_address="localhost:0"
    )
    unix = PluginServer(
        IdleKube(),
        DeviceConfig(),
        socket_path=short_dir / "run" / "plugin.sock",
        metrics_address="[::1]:0",
    )
    kubelet = FakeKubelet(short_dir)
    plugin = DevicePluginServer(
        "nvidia.com/gpu",
        short_dir,
        "tessera.sock",
        SlotInventory([gpu("GPU-a")]),
        NoAllocations(),
        register_timeout_s=2.0,
    )
    with tcp, unix, plugin:
        opened = set(tcp_listeners(pid)) - before
        assert len(opened) == 3, opened  # plugin TCP + two metrics; Unix sockets aren't TCP
        assert all(is_loopback(host) for host, _ in opened), opened
        ports = {port for _, port in opened}
        assert int(tcp.address.rpartition(":")[2]) in ports
    kubelet.stop()
    assert set(tcp_listeners(pid)) - before == set()
