"""``tessera node-agent …``: argparse wiring of the node agent's commands.

- ``kwok``: simulated agents for every kwok fake node of a cluster (one process).
"""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path
from types import FrameType

from scheduler_plugins.config import DeviceConfig, load_config_file
from scheduler_plugins.kube.client import KubeClient


def add_node_agent_commands(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Register ``node-agent`` with its sub-commands on an ``add_subparsers()`` object."""
    agent = subparsers.add_parser("node-agent", help="the node agent (kubelet device plugin)")
    sub = agent.add_subparsers(dest="node_agent_command", required=True)
    kwok = sub.add_parser("kwok", help="simulated node agents for kwok fake nodes")
    kwok.add_argument("--kubeconfig", help="kubeconfig (default: in-cluster service account)")
    kwok.add_argument("--config", help="device-config.yaml (default: built-in defaults)")
    kwok.add_argument("--state-dir", help="keep each fake node's simulated NVML state here")
    kwok.add_argument("--watch-timeout", type=int, default=10, help="seconds per watch round")
    kwok.set_defaults(func=_cmd_kwok)
    return agent


def _client(args: argparse.Namespace) -> KubeClient:
    if args.kubeconfig:
        return KubeClient.from_kubeconfig(Path(args.kubeconfig))
    return KubeClient.in_cluster()


def _cmd_kwok(args: argparse.Namespace) -> int:
    from node_agent.kwok_mode import KwokAgents

    config = load_config_file(args.config) if args.config else DeviceConfig()
    state = Path(args.state_dir) if args.state_dir else None
    if state is not None:
        state.mkdir(parents=True, exist_ok=True)
    done = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with (
        _client(args) as kube,
        KwokAgents(kube, config, state_dir=state, watch_timeout_s=args.watch_timeout),
    ):
        done.wait()
    return 0
