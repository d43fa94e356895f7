"""Helpers for tests that run against a dev cluster (tests/integration, tests/e2e)."""

from __future__ import annotations

import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

from scheduler_plugins.devtools.cluster.errors import ClusterError
from scheduler_plugins.devtools.cluster.kubeapi import KubeApi
from scheduler_plugins.devtools.cluster.layout import (
    LOOPBACK,
    ClusterSettings,
    default_cache_dir,
    repo_root,
)
from scheduler_plugins.devtools.cluster.nodes import NodeProfile


@dataclass(frozen=True)
class ClusterClient:
    """What a test needs to talk to a running dev cluster."""

    server: str
    token: str
    kubeconfig: Path
    ca_file: Path
    api: KubeApi
    settings: ClusterSettings
    profile: NodeProfile
    nodes: tuple[str, ...]

    def kubectl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.settings.binary("kubectl")), f"--kubeconfig={self.kubeconfig}", *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports free right now (the OS picks them)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((LOOPBACK, 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def settings_in(state_dir: Path, name: str) -> ClusterSettings:
    """A cluster living in ``state_dir`` on free ports, using the shared tools bin dir."""
    etcd, peer, apiserver, kwok = free_ports(4)
    return ClusterSettings(
        name=name,
        cache_dir=default_cache_dir(),
        etcd_port=etcd,
        etcd_peer_port=peer,
        apiserver_port=apiserver,
        kwok_port=kwok,
        state_dir_override=state_dir,
    )


def build_tools(timeout_s: float = 3600.0, *, tool_set: str = "test") -> Path:
    """Run ``hack/build-tools.sh --set TOOL_SET`` (seconds when cached, many minutes cold);
    returns the bin dir. The ``test`` set has what the tests run (no Jaeger: the tracing test
    reads spans from its own OTLP receiver, and from Jaeger too where it is built).

    Raises ClusterError with the script's stderr tail when it fails or runs too long.
    """
    script = repo_root() / "hack" / "build-tools.sh"
    try:
        proc = subprocess.run(
            ["bash", str(script), "--set", tool_set],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        raise ClusterError(f"{script} did not finish in {timeout_s:.0f}s: {e}") from e
    if proc.returncode != 0:
        raise ClusterError(
            f"{script} failed (exit {proc.returncode}); the tests need its binaries.\n"
            f"--- stderr (tail) ---\n{proc.stderr[-6000:]}"
        )
    return default_cache_dir() / "bin"
