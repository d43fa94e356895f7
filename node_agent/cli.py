"""``tessera node-agent …``: argparse wiring of the node agent's commands.

- ``run``: the agent of one real node (``node_agent.agent.NodeAgent``); the NVML backend is
  chosen by ``TESSERA_NVML`` (``real`` default, ``simulated`` with ``TESSERA_SIM_GPUS`` and
  ``TESSERA_SIM_STATE``), the MPS daemon backend by ``TESSERA_MPS`` (default: the NVML
  backend's kind) over ``--mps-root``. SIGTERM/SIGINT stop it cleanly.
- ``kwok``: simulated agents for every kwok fake node of a cluster (one process).
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Final

from api.hami.config import DeviceConfig, load_config_file
from api.kube.client import KubeClient

USER_AGENT: Final = "tessera-node-agent"  # how the apiserver's audit log names this client


def add_node_agent_commands(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    *,
    logging_flags: Callable[[argparse.ArgumentParser], None],
) -> argparse.ArgumentParser:
    """Register ``node-agent`` with its sub-commands on an ``add_subparsers()`` object;
    ``logging_flags`` adds the log flags to each long-running one (the ``tessera`` command
    configures logging from them before any command runs)."""
    agent = subparsers.add_parser("node-agent", help="the node agent (kubelet device plugin)")
    sub = agent.add_subparsers(dest="node_agent_command", required=True)
    run = sub.add_parser(
        "run", help="the node agent of this node (device plugin, MIG, registration)"
    )
    node_default = os.environ.get("NODE_NAME") or None
    run.add_argument(
        "--node-name",
        default=node_default,
        required=node_default is None,
        help="this node's name (default: $NODE_NAME)",
    )
    run.add_argument("--kubeconfig", help="kubeconfig (default: in-cluster service account)")
    run.add_argument("--config", help="device-config.yaml (default: built-in defaults)")
    run.add_argument(
        "--plugin-dir", help="kubelet device plugin dir (default: /var/lib/kubelet/device-plugins)"
    )
    run.add_argument(
        "--mps-root",
        help="the MPS control daemons' pipe and log directories (and the simulated backend's "
        "state and fault files) go under it (default: /var/lib/tessera/mps)",
    )
    run.add_argument(
        "--mps-check-interval",
        type=_seconds,
        default=5.0,
        help="seconds between MPS control daemon checks in mps mode",
    )
    run.add_argument(
        "--pod-resources-socket",
        default=None,
        help="the kubelet's PodResources socket, read to check which pod holds the GPUs "
        "handed to interchangeable pods (default: /var/lib/kubelet/pod-resources/kubelet.sock; "
        "'' turns the check off)",
    )
    run.add_argument(
        "--prepare-host-dirs",
        action="store_true",
        help="before answering a hami-core Allocate, create the container's host directory "
        "under /usr/local/vgpu/containers and /tmp/vgpulock world-writable, as HAMi's "
        "device plugin does (the host's /usr/local/vgpu and /tmp/vgpulock must be mounted at "
        "the same paths in the agent)",
    )
    logging_flags(run)
    run.set_defaults(func=_cmd_run)
    kwok = sub.add_parser("kwok", help="simulated node agents for kwok fake nodes")
    kwok.add_argument("--kubeconfig", help="kubeconfig (default: in-cluster service account)")
    kwok.add_argument("--config", help="device-config.yaml (default: built-in defaults)")
    kwok.add_argument("--state-dir", help="keep each fake node's simulated NVML state here")
    kwok.add_argument("--watch-timeout", type=int, default=10, help="seconds per watch round")
    kwok.add_argument(
        "--mps-check-interval",
        type=_seconds,
        default=0.5,
        help="seconds between checks of the fake mps nodes' simulated MPS daemons",
    )
    logging_flags(kwok)
    kwok.set_defaults(func=_cmd_kwok)
    return agent


def _seconds(text: str) -> float:
    """A check interval: a positive number of seconds (0 would spin)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"{text} must be in (0, 3600] seconds")
    return value


def _client(args: argparse.Namespace) -> KubeClient:
    if args.kubeconfig:
        return KubeClient.from_kubeconfig(Path(args.kubeconfig), user_agent=USER_AGENT)
    return KubeClient.in_cluster(user_agent=USER_AGENT)


def _stop_on_signals() -> threading.Event:
    done = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return done


def _cmd_run(args: argparse.Namespace) -> int:
    from node_agent.agent import NodeAgent
    from node_agent.allocator import HostDirs
    from node_agent.deviceplugin.server import DEFAULT_PLUGIN_DIR
    from node_agent.identities import DEFAULT_POD_RESOURCES_SOCKET, KubeletPodResources
    from node_agent.mps import DEFAULT_ROOT, mps_backend_from_env
    from node_agent.nvml import backend_from_env

    config = load_config_file(args.config) if args.config else DeviceConfig()
    backend = backend_from_env(node_name=args.node_name)
    mps = mps_backend_from_env(
        root=Path(args.mps_root) if args.mps_root else DEFAULT_ROOT, node_name=args.node_name
    )
    socket = (
        DEFAULT_POD_RESOURCES_SOCKET
        if args.pod_resources_socket is None
        else args.pod_resources_socket
    )
    done = _stop_on_signals()
    with _client(args) as kube:
        NodeAgent(
            args.node_name,
            kube,
            backend,
            config,
            plugin_dir=args.plugin_dir or DEFAULT_PLUGIN_DIR,
            mps_backend=mps,
            mps_check_interval_s=args.mps_check_interval,
            pod_resources=KubeletPodResources(socket) if socket else None,
            host_dirs=HostDirs() if args.prepare_host_dirs else None,
        ).run(done)
    return 0


def _cmd_kwok(args: argparse.Namespace) -> int:
    from node_agent.kwok_mode import KwokAgents

    config = load_config_file(args.config) if args.config else DeviceConfig()
    state = Path(args.state_dir) if args.state_dir else None
    if state is not None:
        state.mkdir(parents=True, exist_ok=True)
    done = _stop_on_signals()
    with (
        _client(args) as kube,
        KwokAgents(
            kube,
            config,
            state_dir=state,
            watch_timeout_s=args.watch_timeout,
            mps_check_interval_s=args.mps_check_interval,
        ),
    ):
        done.wait()
    return 0
