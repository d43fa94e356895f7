"""``tessera up|down|status|env``: a local Tessera to try one's own pods on.

``up`` starts (or keeps) a dev cluster, tops its fake GPU nodes up to ``--nodes`` from a
profile, and runs the whole Tessera stack on it: plugin server, ``tessera-scheduler``, the
kwok-mode node agent, the admission webhook and, on request, Jaeger with every span exported
to it. Everything stays up until ``down``. Running ``up`` again changes nothing that is
healthy: a crashed component, or a different ``--jaeger`` choice, restarts the stack only.
``status`` probes each component; ``env`` prints the shell lines that point ``kubectl`` at
the cluster.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import re
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import structlog

from scheduler_plugins.devtools.cluster import jaeger, stack
from scheduler_plugins.devtools.cluster.cli import logged
from scheduler_plugins.devtools.cluster.cluster import Cluster, ComponentStatus, component_status
from scheduler_plugins.devtools.cluster.errors import ClusterError
from scheduler_plugins.devtools.cluster.kubeapi import KubeApi
from scheduler_plugins.devtools.cluster.layout import (
    DEFAULT_NAME,
    ClusterSettings,
    default_cache_dir,
    repo_root,
)
from scheduler_plugins.devtools.cluster.nodes import (
    KWOK_LABEL,
    NodeProfile,
    add_nodes,
    load_profile,
    wait_ready,
)
from scheduler_plugins.devtools.cluster.webhook import WEBHOOK, probe_webhook

log = structlog.get_logger(__name__)

DEFAULT_NODES: Final = 10  # one of each node of the default profile's weighted cycle
DEFAULT_PROFILE: Final = Path("examples") / "cluster-profile.yaml"
FIRST_EXAMPLE: Final = Path("examples") / "pods" / "hami-core.yaml"
_STACK_FILE: Final = "stack.json"  # how the stack was started: {"jaeger": bool}


@dataclass(frozen=True)
class LocalInfo:
    settings: ClusterSettings
    nodes: int
    metrics_url: str
    jaeger_url: str | None


def up(
    settings: ClusterSettings,
    profile: NodeProfile,
    nodes: int,
    *,
    with_jaeger: bool = False,
    timeout_s: float = 120.0,
    say: Callable[[str], None] = print,
) -> LocalInfo:
    """Bring everything up (idempotent) and return where to find it."""
    t0 = time.monotonic()
    cluster = Cluster(settings)
    say(f"cluster {settings.name}: starting etcd, kube-apiserver, kwok (or keeping them) ...")
    info = cluster.up(timeout_s=timeout_s)
    with info.api() as api:
        have = _count_nodes(api, profile.name_prefix)
        if have < nodes:
            say(f"nodes: {have} of {nodes} exist; adding {nodes - have} ({profile.name_prefix}-*)")
            names = add_nodes(api, profile, nodes - have, progress=True)
            wait_ready(api, names, timeout_s=timeout_s, progress=True)
        else:
            say(f"nodes: {have} fake GPU nodes ({profile.name_prefix}-*)")
    ports: jaeger.JaegerPorts | None = None
    if _stack_healthy(settings) and _stack_started_with(settings) == with_jaeger:
        say("tessera: plugin server, scheduler, node agent and webhook already running")
        if with_jaeger:
            ports = jaeger.start_jaeger(settings, timeout_s=timeout_s)  # keeps a healthy one
    else:
        say("tessera: starting plugin server, tessera-scheduler, node agent, webhook ...")
        stack.stop_stack(settings)  # whatever is left of an earlier stack, Jaeger included
        if with_jaeger:
            ports = jaeger.start_jaeger(settings, timeout_s=timeout_s)
        stack.start_stack(
            settings,
            timeout_s=timeout_s,
            tracing_env=jaeger.tracing_env(ports) if ports else None,
        )
        (settings.state_dir / _STACK_FILE).write_text(json.dumps({"jaeger": with_jaeger}) + "\n")
    if not with_jaeger:
        jaeger.stop_jaeger(settings)
    log.info("local.up", cluster=settings.name, seconds=round(time.monotonic() - t0, 2))
    return LocalInfo(
        settings=settings,
        nodes=max(have, nodes),
        metrics_url=f"http://{stack.metrics_address(settings)}/metrics",
        jaeger_url=ports.ui_url if ports else None,
    )


def down(settings: ClusterSettings, *, purge: bool = False) -> list[str]:
    """Stop every process ``up`` started (the stack, Jaeger, the cluster)."""
    stopped = Cluster(settings).down(purge=purge)
    (settings.state_dir / _STACK_FILE).unlink(missing_ok=True)
    return stopped


def status(settings: ClusterSettings) -> list[ComponentStatus]:
    """Each component's state: the cluster's, the stack's, the webhook and Jaeger (when it
    was asked for)."""
    out = Cluster(settings).status()
    out.extend(_stack_states(settings))
    if _stack_started_with(settings) or jaeger.running(settings):
        ports = jaeger.recorded_ports(settings)
        out.append(
            component_status(
                settings,
                jaeger.JAEGER,
                lambda: "no recorded ports" if ports is None else jaeger.probe(ports),
            )
        )
    return out


def env_lines(settings: ClusterSettings) -> list[str]:
    """``export`` lines for a shell: kubeconfig, the built kubectl and ``tessera`` on PATH,
    the plugin server's and tessera-scheduler's metrics URLs and (when running) Jaeger's
    URL."""
    if not settings.kubeconfig.is_file():
        raise ClusterError(
            f"cluster {settings.name} has no kubeconfig at {settings.kubeconfig}: run `tessera up`"
        )
    tools = [str(settings.bin_dir), str(Path(sys.executable).parent)]
    lines = [
        f"export KUBECONFIG={shlex.quote(str(settings.kubeconfig))}",
        f'export PATH={":".join(shlex.quote(t) for t in tools)}:"$PATH"',
    ]
    with contextlib.suppress(ClusterError):  # the stack never started: nothing to point at
        metrics = stack.metrics_address(settings)
        lines.append(f"export TESSERA_METRICS_URL=http://{metrics}/metrics")
        lines.append(
            f"export TESSERA_SCHEDULER_METRICS_URL={stack.scheduler_metrics_url(settings)}"
        )
    ports = jaeger.recorded_ports(settings)
    if ports is not None and jaeger.running(settings):
        lines.append(f"export TESSERA_JAEGER_URL={ports.ui_url}")
    return lines


def _count_nodes(api: KubeApi, prefix: str) -> int:
    pattern = re.compile(rf"^{re.escape(prefix)}-\d+$")
    items = api.get("/api/v1/nodes", query={"labelSelector": f"{KWOK_LABEL[0]}={KWOK_LABEL[1]}"})
    return sum(1 for n in items.get("items", []) if pattern.match(n["metadata"]["name"]))


def _stack_started_with(settings: ClusterSettings) -> bool | None:
    """Whether the running stack was started with Jaeger; None when ``up`` never ran."""
    try:
        return bool(json.loads((settings.state_dir / _STACK_FILE).read_text())["jaeger"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _stack_states(settings: ClusterSettings) -> list[ComponentStatus]:
    out = [
        component_status(settings, c, functools.partial(stack.probe, settings, c))
        for c in stack.STACK
    ]
    out.append(component_status(settings, WEBHOOK, functools.partial(probe_webhook, settings)))
    return out


def _stack_healthy(settings: ClusterSettings) -> bool:
    return all(st.healthy for st in _stack_states(settings))


# Command line ------------------------------------------------------------------------------


def add_local_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p_up = sub.add_parser(
        "up",
        help="a local cluster with fake GPU nodes and the whole Tessera stack, kept running",
        description="Start (or keep) a local cluster, fake GPU nodes and Tessera's plugin "
        "server, scheduler, node agent and webhook; they run until `tessera down`.",
    )
    _common(p_up)
    p_up.add_argument(
        "--nodes", type=int, default=DEFAULT_NODES, help=f"fake GPU nodes (default {DEFAULT_NODES})"
    )
    p_up.add_argument("--profile", type=Path, help=f"node profile YAML (default {DEFAULT_PROFILE})")
    p_up.add_argument("--jaeger", action="store_true", help="also run Jaeger and trace into it")
    p_up.add_argument("--timeout", type=float, default=120.0, help="seconds per component")
    p_up.add_argument("--apiserver-port", type=int, help="kube-apiserver port (default 6443)")
    p_up.add_argument("--etcd-port", type=int, help="etcd client port (default 2379)")
    p_up.add_argument("--etcd-peer-port", type=int, help="etcd peer port (default etcd port + 1)")
    p_up.add_argument("--kwok-port", type=int, help="kwok health port (default 10247)")
    p_up.set_defaults(func=logged(_cmd_up))

    p_down = sub.add_parser("down", help="stop everything `tessera up` started")
    _common(p_down)
    p_down.add_argument("--purge", action="store_true", help="also delete the cluster's state")
    p_down.set_defaults(func=logged(_cmd_down))

    p_status = sub.add_parser("status", help="health of each component; exit 1 unless all is")
    _common(p_status)
    p_status.set_defaults(func=logged(_cmd_status))

    p_env = sub.add_parser("env", help='shell lines for the cluster: eval "$(tessera env)"')
    _common(p_env)
    p_env.set_defaults(func=_cmd_env)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", default=DEFAULT_NAME, help=f"cluster name (default {DEFAULT_NAME})")


def _settings(a: argparse.Namespace) -> ClusterSettings:
    base = ClusterSettings(name=a.name, cache_dir=default_cache_dir()).saved_or_self()
    ports = {
        "apiserver_port": getattr(a, "apiserver_port", None),
        "etcd_port": getattr(a, "etcd_port", None),
        "etcd_peer_port": getattr(a, "etcd_peer_port", None),
        "kwok_port": getattr(a, "kwok_port", None),
    }
    chosen = {k: v for k, v in ports.items() if v is not None}
    if not chosen:
        return base
    if "etcd_port" in chosen and "etcd_peer_port" not in chosen:
        chosen["etcd_peer_port"] = chosen["etcd_port"] + 1
    return ClusterSettings(
        name=base.name,
        cache_dir=base.cache_dir,
        etcd_port=chosen.get("etcd_port", base.etcd_port),
        etcd_peer_port=chosen.get("etcd_peer_port", base.etcd_peer_port),
        apiserver_port=chosen.get("apiserver_port", base.apiserver_port),
        kwok_port=chosen.get("kwok_port", base.kwok_port),
        state_dir_override=base.state_dir_override,
        bin_dir_override=base.bin_dir_override,
        etcd_fsync=base.etcd_fsync,
    )


def _cmd_up(a: argparse.Namespace) -> int:
    if a.nodes < 0:
        raise ClusterError(f"--nodes must be ≥ 0, got {a.nodes}")
    settings = _settings(a)
    profile = load_profile(a.profile or repo_root() / DEFAULT_PROFILE)
    t0 = time.monotonic()
    info = up(settings, profile, a.nodes, with_jaeger=a.jaeger, timeout_s=a.timeout)
    name_flag = "" if settings.name == DEFAULT_NAME else f" --name {settings.name}"
    print(
        f"\nTessera is up in {time.monotonic() - t0:.0f}s: cluster {settings.name}, "
        f"{info.nodes} fake GPU nodes\n"
        f"  kubeconfig  {settings.kubeconfig}\n"
        f"  metrics     {info.metrics_url}\n"
        f"  traces      {info.jaeger_url or 'off (tessera up --jaeger)'}\n"
        f"  logs        {settings.log_dir}\n"
        f"Try your own pods:\n"
        f'  eval "$({Path(sys.executable).parent / "tessera"} env{name_flag})"\n'
        f"  kubectl apply -f {FIRST_EXAMPLE}\n"
        f"  kubectl get pods -o wide\n"
        f"Stop everything: tessera down{name_flag}"
    )
    return 0


def _cmd_down(a: argparse.Namespace) -> int:
    settings = _settings(a)
    stopped = down(settings, purge=a.purge)
    what = ", ".join(stopped) if stopped else "nothing was running"
    print(f"tessera down ({settings.name}): {what}{' (state purged)' if a.purge else ''}")
    return 0


def _cmd_status(a: argparse.Namespace) -> int:
    settings = _settings(a)
    states = status(settings)
    print(f"cluster {settings.name} ({settings.state_dir})")
    for st in states:
        print(st.line(18))
    if all(st.healthy for st in states):
        for line in env_lines(settings):
            print(f"  {line.removeprefix('export ')}")
        return 0
    return 1


def _cmd_env(a: argparse.Namespace) -> int:
    for line in env_lines(_settings(a)):
        print(line)
    return 0


__all__ = ["LocalInfo", "add_local_commands", "down", "env_lines", "status", "up"]
