"""``tessera plugin-server`` flags: bad values stop it before it starts, naming the flag."""

from __future__ import annotations

import argparse

import pytest

from scheduler_plugins.server.app import DEFAULT_RPC_WORKERS, MIN_RPC_WORKERS
from scheduler_plugins.server.cli import add_plugin_server_commands


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tessera", exit_on_error=False)
    add_plugin_server_commands(parser.add_subparsers())
    return parser.parse_args(["plugin-server", "--kubeconfig", "k", "--socket", "/s", *argv])


@pytest.mark.parametrize(
    ("argv", "workers"),
    [((), DEFAULT_RPC_WORKERS), (("--rpc-workers", "64"), 64), (("--rpc-workers", "32"), 32)],
)
def test_rpc_workers(argv: tuple[str, ...], workers: int) -> None:
    assert _parse(*argv).rpc_workers == workers


@pytest.mark.parametrize(
    ("value", "why"),
    [("31", f"at least {MIN_RPC_WORKERS}"), ("-5", "too few"), ("many", "not a whole number")],
)
def test_rpc_workers_refuses(value: str, why: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse("--rpc-workers", value)
    err = capsys.readouterr().err
    assert "--rpc-workers" in err and why in err
