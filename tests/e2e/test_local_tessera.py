"""End to end: a local Tessera as a newcomer runs it (``tessera up|status|env|down``).

``test_readme_try_your_own_pods`` runs the README's "Try your own pods" command block as
written, in bash, with its documented equivalents where the README calls ``make`` (``make up``
is ``tessera up`` after the demo's tool build, which the session fixture already did; ``make
down`` is ``tessera down``), each ``tessera`` command given this test's cluster name and free
ports so it cannot touch a cluster of the user's. The other tests apply ``examples/pods/`` to
a second ``tessera up`` and hold each pod to the outcome written at its top, then check that
``up`` is idempotent, that ``status`` names a dead component and ``up`` restarts the stack,
and that ``down`` leaves no process behind. About a minute on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import re
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pytest

from api.hami import keys as ann
from api.hami.devices import decode_devices, decode_mig_allocations
from api.hami.register import decode
from api.kube.client import KubeClient
from scheduler_plugins.devtools.cluster import processes
from scheduler_plugins.devtools.cluster.cluster import Cluster
from scheduler_plugins.devtools.cluster.layout import ClusterSettings, default_cache_dir, repo_root
from scheduler_plugins.devtools.cluster.testing import free_ports
from scheduler_plugins.server.events import REASON as TESSERA_UNSCHEDULABLE
from tests.waiting import eventually

ROOT: Final = repo_root()
TESSERA: Final = str(Path(sys.executable).parent / "tessera")
README_MARKER: Final = "<!-- readme-commands: try-your-own-pods -->"
NAMESPACE_PODS: Final = "/api/v1/namespaces/default/pods"


@dataclass(frozen=True)
class Local:
    name: str
    up_args: tuple[str, ...]

    @property
    def settings(self) -> ClusterSettings:
        return ClusterSettings.load(default_cache_dir() / "cluster" / self.name)


def _local(name: str) -> Local:
    apiserver, etcd, peer, kwok = free_ports(4)
    return Local(
        name,
        (
            "--name",
            name,
            "--apiserver-port",
            str(apiserver),
            "--etcd-port",
            str(etcd),
            "--etcd-peer-port",
            str(peer),
            "--kwok-port",
            str(kwok),
        ),
    )


def tessera(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [TESSERA, *args], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    if check and proc.returncode != 0:
        pytest.fail(f"tessera {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


def _left_running(local: Local) -> list[str]:
    s = local.settings
    alive = [
        f.stem
        for f in (s.run_dir.glob("*.pid") if s.run_dir.is_dir() else ())
        if (r := processes.read_record(f)) is not None and processes.is_running(r)
    ]
    return alive + [f"pid {p}" for p in Cluster(s).running_pids()]


def _down(local: Local) -> None:
    state_dir = default_cache_dir() / "cluster" / local.name
    if (state_dir / "cluster.json").is_file():
        tessera("down", "--name", local.name, check=False)
        left = _left_running(local)
        tessera("down", "--name", local.name, "--purge", check=False)
        assert not left, f"left running after `tessera down`: {left}"


# The README, as written ---------------------------------------------------------------------


def readme_block() -> list[str]:
    """The command lines of the README's "Try your own pods" block."""
    text = (ROOT / "README.md").read_text()
    at = text.index(README_MARKER)
    block = re.search(r"```sh\n(.*?)```", text[at:], re.S)
    assert block is not None, "README: no ```sh block after the try-your-own-pods marker"
    return [line for line in block.group(1).splitlines() if line.strip()]


def as_run_here(lines: Sequence[str], local: Local) -> str:
    """The block with its documented equivalents for this test's cluster."""
    out = []
    for line in lines:
        cmd = line.split("  #")[0].rstrip()
        if cmd == "make up":
            cmd = f"{TESSERA} up {' '.join(local.up_args)}"
        elif cmd == "make down":
            cmd = f"{TESSERA} down --name {local.name}"
        elif cmd.startswith(("tessera ", 'eval "$(.venv/bin/tessera ')):
            cmd = re.sub(r"(tessera \w+)", rf"\1 --name {local.name}", cmd, count=1)
        out.append(f"echo '+ {line.split('  #')[0].rstrip()}'\n{cmd}")
    return "set -euo pipefail\n" + "\n".join(out) + "\n"


def test_readme_block_is_the_one_this_test_knows() -> None:
    """Each line of the block is a command this test can run (a new one needs a rule here)."""
    known = ("make up", "make down", "eval ", "kubectl ", "curl ", "tessera ")
    for line in readme_block():
        assert line.startswith(known), f"README command this test cannot run: {line!r}"


def test_readme_try_your_own_pods(built_tools: Path) -> None:
    local = _local("e2e-readme")
    script = as_run_here(readme_block(), local)
    try:
        proc = subprocess.run(
            ["bash", "-c", script],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
            env={k: v for k, v in os.environ.items() if k != "KUBECONFIG"},
        )
        out = proc.stdout
        assert proc.returncode == 0, f"README block failed:\n{out[-4000:]}\n{proc.stderr[-4000:]}"
        rows = {
            m.group(1): (m.group(2), m.group(3))
            for m in re.finditer(r"^(\S+)\s+\S+\s+(\w+)\s+\d+\s+\S+\s+\S+\s+(\S+)", out, re.M)
        }
        for pod in ("hami-core", "mig", "mps", "unified-pool", "h200-only"):
            assert rows.get(pod, ("?", "?"))[0] == "Running", f"{pod}: {rows.get(pod)}\n{out}"
        assert rows.get("waits-for-mig-h200", ("?",))[0] == "Pending", out
        assert "GPU mode does not match nvidia.com/vgpu-mode" in out, out
        assert re.search(r'^hami_vgpu_memory_allocated_bytes\{.*pod="hami-core"', out, re.M), out
        for component in ("plugin-server", "tessera-scheduler", "node-agent", "webhook"):
            assert re.search(rf"^\s+{component}\s+healthy", out, re.M), out
        assert "tessera down" in out
        assert not _left_running(local), "the README's `make down` left processes running"
    finally:
        _down(local)


# The examples, one by one -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_up(built_tools: Path) -> Iterator[tuple[Local, KubeClient]]:
    local = _local("e2e-local")
    try:
        tessera("up", *local.up_args)
        with KubeClient.from_kubeconfig(local.settings.kubeconfig) as api:
            yield local, api
    finally:
        _down(local)


def kubectl(local: Local, *args: str) -> subprocess.CompletedProcess[str]:
    s = local.settings
    return subprocess.run(
        [str(s.binary("kubectl")), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "KUBECONFIG": str(s.kubeconfig)},
    )


def _node_gpus(api: KubeClient, node: str) -> list[Any]:
    obj = api.get(f"/api/v1/nodes/{node}")
    return list(decode(obj["metadata"]["annotations"][ann.NODE_REGISTER]))


def _bound(api: KubeClient, name: str) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        pod: dict[str, Any] = api.get(f"{NAMESPACE_PODS}/{name}")
        phase = (pod["metadata"].get("annotations") or {}).get(ann.BIND_PHASE)
        return pod if pod["spec"].get("nodeName") and phase == "success" else None

    result: dict[str, Any] = eventually(done, timeout_s=120, interval_s=0.2, what=f"{name} bound")
    return result


def test_examples_end_as_their_files_say(local_up: tuple[Local, KubeClient]) -> None:
    local, api = local_up
    applied = kubectl(local, "apply", "-f", "examples/pods/")
    assert applied.returncode == 0, applied.stderr

    pod = _bound(api, "hami-core")
    gpus = _node_gpus(api, pod["spec"]["nodeName"])
    assert {g.mode for g in gpus} == {"hami-core"}
    [[device]] = decode_devices(pod["metadata"]["annotations"][ann.DEVICES_ALLOCATED])
    assert (device.mem, device.cores) == (4000, 30)

    pod = _bound(api, "mig")
    assert {g.mode for g in _node_gpus(api, pod["spec"]["nodeName"])} == {"mig"}
    [mig] = decode_mig_allocations(pod["metadata"]["annotations"][ann.MIG_ALLOCATIONS])
    assert mig.profile == "1g.10gb"

    pod = _bound(api, "mps")
    assert pod["spec"]["nodeName"] == "gpu-node-0006"
    assert {g.mode for g in _node_gpus(api, "gpu-node-0006")} == {"mps"}
    [[device]] = decode_devices(pod["metadata"]["annotations"][ann.DEVICES_ALLOCATED])
    assert (device.mem, device.cores) == (6000, 20)

    pod = _bound(api, "unified-pool")
    assert pod["metadata"]["annotations"][ann.DEVICES_ALLOCATED]

    workers = [_bound(api, f"trainer-{i}") for i in range(2)]
    assert all(w["metadata"]["annotations"][ann.DEVICES_ALLOCATED] for w in workers)
    group = api.get("/apis/scheduling.k8s.io/v1alpha2/namespaces/default/podgroups/trainer")
    conditions = {c["type"]: c["status"] for c in group["status"]["conditions"]}
    assert conditions["PodGroupScheduled"] == "True", group["status"]

    pod = _bound(api, "h200-only")
    types = {g.type for g in _node_gpus(api, pod["spec"]["nodeName"])}
    assert len(types) == 1 and next(iter(types)).endswith("H200"), types

    def explained() -> str | None:
        events = api.get(
            "/api/v1/namespaces/default/events",
            query={"fieldSelector": "involvedObject.name=waits-for-mig-h200"},
        )
        texts = [e["message"] for e in events["items"] if e["reason"] == TESSERA_UNSCHEDULABLE]
        return texts[0] if texts else None

    message = eventually(explained, timeout_s=60, interval_s=0.2, what="the Pending explanation")
    assert "GPU mode does not match nvidia.com/vgpu-mode" in message
    assert "gpu-node-0003" in message  # the H200 node, named
    waiting = api.get(f"{NAMESPACE_PODS}/waits-for-mig-h200")
    assert not waiting["spec"].get("nodeName")

    refused = kubectl(local, "apply", "-f", "examples/refused-pod.yaml")
    assert refused.returncode != 0
    assert "more than the largest GPU in the cluster has" in refused.stderr


def test_up_again_keeps_what_is_healthy_and_restarts_what_is_not(
    local_up: tuple[Local, KubeClient],
) -> None:
    local, _ = local_up
    s = local.settings

    def pids() -> dict[str, int]:
        out = {}
        for f in sorted(s.run_dir.glob("*.pid")):
            record = processes.read_record(f)
            assert record is not None
            out[record.component] = record.pid
        return out

    before = pids()
    tessera("up", *local.up_args)
    assert pids() == before, "a second `tessera up` restarted healthy components"

    processes.stop(s.pid_file("node-agent"))
    status = tessera("status", "--name", local.name, check=False)
    assert status.returncode == 1
    assert re.search(r"^\s+node-agent\s+stopped", status.stdout, re.M), status.stdout

    tessera("up", *local.up_args)
    after = pids()
    assert after["etcd"] == before["etcd"] and after["kube-apiserver"] == before["kube-apiserver"]
    assert "node-agent" in after
    status = tessera("status", "--name", local.name)
    assert status.returncode == 0, status.stdout
    env = tessera("env", "--name", local.name).stdout
    assert f"export KUBECONFIG={s.kubeconfig}" in env
    assert "TESSERA_METRICS_URL=http://127.0.0.1:" in env
    # kube-scheduler's own metrics (scheduling cycle, extension points) on loopback, readable
    # without credentials like its health checks.
    url = next(
        line.split("=", 1)[1]
        for line in env.splitlines()
        if line.startswith("export TESSERA_SCHEDULER_METRICS_URL=")
    )
    assert url.startswith("https://127.0.0.1:")
    insecure = ssl.create_default_context()
    insecure.check_hostname, insecure.verify_mode = False, ssl.CERT_NONE
    with urllib.request.urlopen(url, timeout=10, context=insecure) as resp:
        assert "scheduler_framework_extension_point_duration_seconds" in resp.read().decode()


def test_up_with_jaeger_traces_each_pod(built_tools: Path) -> None:
    if not (built_tools / "jaeger").is_file():
        pytest.skip(
            "jaeger is not built (hack/build-tools.sh jaeger); `tessera up --jaeger` needs it"
        )
    local = _local("e2e-jaeger")
    try:
        out = tessera("up", *local.up_args, "--nodes", "2", "--jaeger").stdout
        url = re.search(r"traces\s+(http://\S+)", out)
        assert url is not None, out
        pod = "traced-by-up"
        manifest = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": pod},
            "spec": {
                "containers": [
                    {
                        "name": "main",
                        "image": "busybox",
                        "resources": {"limits": {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 1000}},
                    }
                ]
            },
        }
        with KubeClient.from_kubeconfig(local.settings.kubeconfig) as api:
            api.post(NAMESPACE_PODS, manifest)
            _bound(api, pod)

        def traced() -> bool:
            import urllib.parse
            import urllib.request

            query = urllib.parse.urlencode(
                {"service": "tessera-scheduler", "tags": json.dumps({"k8s.pod.name": pod})}
            )
            with urllib.request.urlopen(f"{url.group(1)}/api/traces?{query}", timeout=5) as r:
                return bool(json.load(r).get("data"))

        eventually(traced, timeout_s=30, interval_s=0.5, what="the pod's trace in Jaeger")
    finally:
        _down(local)


def test_demo_places_every_workload_as_it_says(built_tools: Path) -> None:
    """``make demo`` (``tessera demo``) on its own ports: each workload ends as its row says."""
    apiserver, etcd, peer, kwok = free_ports(4)
    proc = tessera(
        "demo",
        "--name",
        "e2e-demo",
        "--apiserver-port",
        str(apiserver),
        "--etcd-port",
        str(etcd),
        "--etcd-peer-port",
        str(peer),
        "--kwok-port",
        str(kwok),
    )
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if line.strip()}
    for name in ("binpack-1", "binpack-2", "spread-1", "mig-seed", "mps-1"):
        assert "Bound (success)" in rows[name], rows[name]
    assert rows["binpack-1"].split()[-4] == rows["binpack-2"].split()[-4]  # the same node
    assert "2g.10gb@[0,2)" in rows["mig-seed"] and "2g.10gb@[2,4)" in rows["mig-seed"]
    assert "8000MiB 25%" in rows["mps-1"]
    assert "Pending" in rows["needs-3g"] and "MIG fragmentation" in rows["needs-3g"]
    assert "Bound" in rows["plain"]
    assert not (default_cache_dir() / "cluster" / "e2e-demo").exists(), "the demo left its state"
