"""Fault injection end to end: Tessera's whole stack on a real kube-apiserver + etcd, with its
parts killed, restarted and cut off in the middle of pod bursts.

Scenarios (each a burst of fractional hami-core, whole-GPU and MIG pods):

- the plugin server SIGKILLed three times and restarted;
- ``tessera-scheduler`` (the shim) SIGKILLed and restarted;
- kube-apiserver restarted;
- watches broken: 410 Gone (every open watch ended, the resumed ones answered "too old
  resource version" by the apiserver itself) and dropped connections — through a loopback
  proxy (``tests/e2e/faultproxy.py``) that the plugin server and node agent talk through;
- the node agent SIGKILLed in the middle of a MIG creation (its GPU instance made, the compute
  instance not yet: the simulated NVML's test-only ``CreationHold``), then restarted.

After each, every pod must end bound with valid annotations or Pending with a PodScheduled
explanation (none lost), and ``tessera check`` (``scheduler_plugins.devtools.check``, simulated GPUs
included) must find nothing: no double allocation, no leaked or lost MIG instance. Then the
pods are deleted and every MIG instance must be reclaimed. Figures per scenario are printed
(run with ``-s``) and written to ``benchmarks/results/faults.json``.

The plugin-server scenario also runs as a 2000-pod burst (about two minutes here).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import random
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

import pytest

from api.errors import TemporaryError
from api.hami import keys as ann
from api.kube.errors import ConflictError
from node_agent.nvml.simulated import HOLD_ENV
from scheduler_plugins.cli import main as tessera_main
from scheduler_plugins.devtools.check import CheckReport
from scheduler_plugins.devtools.cluster import processes
from scheduler_plugins.devtools.cluster.cluster import APISERVER, Cluster
from scheduler_plugins.devtools.cluster.stack import (
    NODE_AGENT,
    PLUGIN_SERVER,
    SCHEDULER,
    StackPaths,
    restart_component,
    stop_stack,
)
from tests.e2e.faultproxy import FaultProxy, proxied_kubeconfig
from tests.e2e.harness import (
    GPU,
    GPUCORES,
    GPUMEM,
    HERE,
    E2ECluster,
    Obj,
    PodWatcher,
    annots,
    node_of,
    pod_manifest,
    scheduled_condition,
    tessera_cluster,
    wait_for,
    wants_gpu,
)
from tests.e2e.invariants import cluster_report

FAULT_NODES: Final = 100
BURST: Final = 200  # pods per always-run scenario
BIG_BURST: Final = 2000
STALL_S: Final = 120.0  # a wait fails once nothing has moved for this long
QUIET_S: Final = 3.0
CHECK_GRACE_S: Final = 20.0  # the node agent's periodic reconcile runs every 10 s
RESULTS: Final = HERE.parents[1] / "benchmarks" / "results" / "faults.json"
LABEL: Final = "e2e-faults"
MIG: Final = {ann.VGPU_MODE: "mig"}
HAMI_CORE: Final = {ann.VGPU_MODE: "hami-core"}


# The cluster ---------------------------------------------------------------------------------


@dataclass
class FaultCluster:
    c: E2ECluster
    proxy: FaultProxy
    kubeconfig: Path  # the proxied one, for the plugin server and node agent
    hold_dir: Path
    evidence_dir: Path  # logs and pods of a failed scenario are kept here
    figures: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def agent_state(self) -> Path:
        return StackPaths.of(self.c.settings).agent_state

    def restart(self, component: str) -> None:
        kubeconfig = None if component == SCHEDULER else self.kubeconfig
        restart_component(self.c.settings, component, kubeconfig=kubeconfig, timeout_s=90.0)

    def kill(self, component: str) -> None:
        """SIGKILL the component's process group (a crash) and wait until it is gone."""
        record = processes.read_record(self.c.settings.pid_file(component))
        assert record is not None and processes.is_running(record), f"{component} not running"
        os.killpg(record.pid, signal.SIGKILL)
        wait_for(f"{component} gone", lambda: not processes.is_running(record), 10.0, 0.05)

    def crash_apiserver(self) -> None:
        """SIGKILL kube-apiserver (a graceful stop waits for open watches) and start it again."""
        self.kill(APISERVER)
        Cluster(self.c.settings).restart(APISERVER, timeout_s=120.0)

    def log_count(self, component: str, marker: str) -> int:
        try:
            return self.c.settings.log_file(component).read_text(errors="replace").count(marker)
        except OSError:
            return 0


@pytest.fixture(scope="module")
def faults(built_tools: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultCluster]:
    state = tmp_path_factory.mktemp("e2e-faults")
    hold_dir = state / "nvml-hold"
    hold_dir.mkdir()
    before = os.environ.get(HOLD_ENV)
    os.environ[HOLD_ENV] = str(hold_dir)  # inherited by the node agent: armed, not holding
    fc: FaultCluster | None = None
    try:
        with tessera_cluster(state, "e2e-faults", HERE / "nodes-faults.yaml", FAULT_NODES) as c:
            pki = c.settings.pki_dir
            with FaultProxy(
                c.settings.apiserver_port,
                ca_file=pki / "ca.crt",
                cert_file=pki / "apiserver.crt",
                key_file=pki / "apiserver.key",
            ) as proxy:
                kubeconfig = proxied_kubeconfig(
                    c.settings.kubeconfig, proxy.url, c.settings.state_dir / "kubeconfig-proxy"
                )
                evidence = tmp_path_factory.mktemp("e2e-faults-evidence")
                fc = FaultCluster(c, proxy, kubeconfig, hold_dir, evidence)
                for component in (PLUGIN_SERVER, NODE_AGENT):
                    fc.restart(component)
                yield fc
                stop_stack(c.settings)  # Tessera's processes go before the proxy they use
    finally:
        if before is None:
            os.environ.pop(HOLD_ENV, None)
        else:
            os.environ[HOLD_ENV] = before
        if fc is not None and fc.figures:
            _write_figures(fc.figures)
            print("\nfault scenarios (pods / faults / in flight / lost / violations / recovery s):")
            for name, f in fc.figures.items():
                print(
                    f"  {name:13} {f['pods']:5} {f['faults_injected']:3} {f['pods_in_flight']:5}"
                    f" {f['pods_lost']:3} {f['violations']:3} {f['recovery_s']}"
                )


def _write_figures(figures: dict[str, dict[str, Any]]) -> None:
    try:
        doc = json.loads(RESULTS.read_text())
    except (OSError, ValueError):
        doc = {}
    doc.setdefault("scenarios", {}).update(figures)
    doc["machine"] = f"{platform.machine()}, {os.cpu_count()} CPUs"
    doc["note"] = (
        "tests/e2e/test_faults.py: pods_lost and violations must be 0; recovery_s is the "
        "longest time from a fault's end (component ready again) to the next pod bound"
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


# Pods ----------------------------------------------------------------------------------------


def fault_pods(count: int, seed: int, label: str, *, mig_share: float = 0.40) -> list[Obj]:
    """A deterministic mix: MIG pods sized for 1g.5gb / 2g.10gb / 3g.20gb (``mig_share``),
    whole GPUs (gpucores 100, all memory: 15%) and fractional hami-core vGPUs (the rest)."""
    rng = random.Random(seed)
    labels = {LABEL: label}
    out: list[Obj] = []
    for i in range(count):
        name = f"{label}-{i:04d}"
        x = rng.random()
        if x < mig_share:
            limits: dict[str, object] = {GPU: 1, GPUMEM: rng.choice((4000, 9000, 16000))}
            out.append(pod_manifest(name, limits, annotations=MIG, labels=labels))
        elif x < mig_share + 0.15:
            limits = {GPU: 1, GPUCORES: 100, "nvidia.com/gpumem-percentage": 100}
            out.append(pod_manifest(name, limits, annotations=HAMI_CORE, labels=labels))
        else:
            limits = {
                GPU: 1,
                GPUMEM: rng.choice((2000, 4000, 8000)),
                GPUCORES: rng.choice((0, 10, 25)),
            }
            out.append(pod_manifest(name, limits, annotations=HAMI_CORE, labels=labels))
    return out


def wait_progress(
    what: str, check: Callable[[], tuple[bool, object]], *, interval_s: float = 0.2
) -> None:
    """Poll ``check`` (done, progress marker) until done; TimeoutError once the marker has
    not changed for ``STALL_S`` (slow is fine on a busy 2-core box, stuck is not)."""
    marker: object = None
    since = time.monotonic()
    while True:
        done, now = check()
        if done:
            return
        if now != marker:
            marker, since = now, time.monotonic()
        elif time.monotonic() - since > STALL_S:
            raise TimeoutError(f"no progress for {STALL_S:.0f}s waiting for {what} (at {marker})")
        time.sleep(interval_s)


def _good(pod: Obj) -> bool:
    """Settled well: bound (GPU pods: node agent done, success) or Pending and explained."""
    if node_of(pod):
        return not wants_gpu(pod) or annots(pod).get(ann.BIND_PHASE) == "success"
    cond = scheduled_condition(pod) or {}
    return (
        cond.get("status") == "False"
        and cond.get("reason") == "Unschedulable"
        and bool(cond.get("message"))
    )


def _failed(pod: Obj) -> bool:
    return bool(node_of(pod)) and annots(pod).get(ann.BIND_PHASE) == "failed"


# One scenario --------------------------------------------------------------------------------


@dataclass
class Fault:
    what: str
    at_s: float  # since the first create
    recovered_s: float  # component ready again / fault over
    in_flight: int  # pods created and not yet settled when it hit


@dataclass
class Burst:
    """A burst of pods being created (on a thread) and watched, and the faults that hit it."""

    fc: FaultCluster
    label: str
    pods: list[Obj]
    watcher: PodWatcher
    t0: float = field(default_factory=time.monotonic)
    created: set[str] = field(default_factory=set)
    faults: list[Fault] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def create_all(self) -> None:
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(self._create, self.pods))

    def _create(self, pod: Obj) -> None:
        """POST, retried while the apiserver is away (AlreadyExists: an earlier try made it)."""
        name = pod["metadata"]["name"]
        deadline = time.monotonic() + STALL_S
        while not self.stop.is_set():
            try:
                self.fc.c.create(pod)
                break
            except ConflictError:
                break
            except TemporaryError:
                if time.monotonic() > deadline:
                    raise
                self.stop.wait(0.5)
        else:
            return
        with self._lock:
            self.created.add(name)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def counts(self) -> tuple[int, int]:
        """(bound, in flight: created and not yet settled)."""
        pods = self.watcher.snapshot()
        with self._lock:
            created = set(self.created)
        bound = sum(1 for p in pods.values() if node_of(p))
        settled = sum(1 for n in created if n in pods and (_good(pods[n]) or _failed(pods[n])))
        return bound, len(created) - settled

    def wait_bound(self, count: int) -> None:
        def check() -> tuple[bool, object]:
            bound = self.counts()[0]
            return bound >= count, bound

        wait_progress(f"{count} pods of {self.label} bound", check)

    def inject(self, what: str, action: Callable[[], object]) -> None:
        at = self.now()
        in_flight = self.counts()[1]
        action()
        self.faults.append(Fault(what, round(at, 2), round(self.now(), 2), in_flight))


def run_burst(
    fc: FaultCluster,
    label: str,
    pods: list[Obj],
    inject: Callable[[Burst], None],
) -> dict[str, Any]:
    """Create ``pods`` while ``inject`` hits the stack, let everything settle, check it,
    record the figures, delete the pods and check that every MIG instance is reclaimed."""
    names = {p["metadata"]["name"] for p in pods}
    ok = False
    try:
        with PodWatcher(fc.c.api, f"{LABEL}={label}") as watcher:
            burst = Burst(fc, label, pods, watcher)
            creator = threading.Thread(target=burst.create_all, name=f"create-{label}", daemon=True)
            creator.start()
            try:
                inject(burst)
            except BaseException:
                burst.stop.set()
                raise
            finally:
                wait_progress(
                    "the burst's pods to be created",
                    lambda: (not creator.is_alive(), len(burst.created)),
                )
            assert burst.created == names, f"{len(names - burst.created)} pods never created"
            final, settled_at = _settle(fc, label, names)
            figures = _figures(burst, final, settled_at)
        report = _check(fc)
        figures["violations"] = len(report.violations)
        figures["check"] = report.summary().splitlines()[0]
        fc.figures[label] = figures
        print(f"\n{label}: {json.dumps(figures)}")
        if not report.ok:
            print(report.summary())
            _keep_evidence(fc, label)
        lost = [n for n in sorted(names) if n not in final or not _good(final[n])]
        assert not lost, (
            f"{len(lost)} pods lost, e.g. {[_describe(final.get(n)) for n in lost[:5]]}"
        )
        assert report.ok, report.summary()
        ok = True
    finally:
        if ok:
            _clean_up(fc, label)
        else:  # keep the failure in view; still leave the cluster usable for the next test
            with contextlib.suppress(Exception):
                _clean_up(fc, label)
    return figures


def _settle(fc: FaultCluster, label: str, names: set[str]) -> tuple[dict[str, Obj], float]:
    """Wait until every pod is settled (well or failed) and the bound set has not changed for
    ``QUIET_S``; the pods then and when they settled. When it stalls, what there is."""
    state: dict[str, Any] = {"since": None, "bound": None, "pods": {}, "open": []}

    def settled() -> tuple[bool, object]:
        progress = (len(state["open"]), len(state["bound"] or ()))
        try:
            pods = {p["metadata"]["name"]: p for p in fc.c.pods(f"{LABEL}={label}")}
        except TemporaryError:
            return False, progress  # the apiserver is away (restarting): ask again
        open_ = [n for n in names if n not in pods or not (_good(pods[n]) or _failed(pods[n]))]
        bound = frozenset(n for n in names if n in pods and node_of(pods[n]))
        now = time.monotonic()
        if open_:
            state["since"] = None
        elif state["since"] is None or bound != state["bound"]:
            state["since"] = now  # (again) all settled: the quiet period starts
        state.update(pods=pods, bound=bound, open=open_)
        done = state["since"] is not None and now - state["since"] >= QUIET_S
        return done, (len(open_), len(bound))

    try:
        wait_progress("the burst to settle", settled, interval_s=1.0)
    except TimeoutError as e:
        print(f"\n{label}: {e}")
        return state["pods"], time.monotonic()
    return state["pods"], float(state["since"])


def _figures(burst: Burst, final: dict[str, Obj], settled_at: float) -> dict[str, Any]:
    names = {p["metadata"]["name"] for p in burst.pods}
    bound_at = dict(burst.watcher.bound_at)
    bound = [n for n in names if n in final and node_of(final[n])]
    lost = [n for n in names if n not in final or not _good(final[n])]
    recoveries = []
    for f in burst.faults:
        after = [t - burst.t0 for t in bound_at.values() if t - burst.t0 >= f.recovered_s]
        if after:
            recoveries.append(min(after) - f.recovered_s)
    last_fault = max((f.recovered_s for f in burst.faults), default=0.0)
    last_bind = max(bound_at.values(), default=burst.t0) - burst.t0
    return {
        "pods": len(names),
        "bound": len(bound),
        "pending": len(names) - len(bound),
        "faults_injected": len(burst.faults),
        "faults": [asdict(f) for f in burst.faults],
        "pods_in_flight": sum(f.in_flight for f in burst.faults),
        "pods_lost": len(lost),
        "recovery_s": round(max(recoveries), 2) if recoveries else None,
        "settled_after_last_fault_s": round(settled_at - burst.t0 - last_fault, 2),
        "scheduled_pods_per_s": round(len(bound) / last_bind, 1) if last_bind > 0 else None,
    }


def _describe(pod: Obj | None) -> str:
    if pod is None:
        return "not seen"
    cond = scheduled_condition(pod) or {}
    return (
        f"{pod['metadata']['name']}: node={node_of(pod) or '-'} "
        f"phase={annots(pod).get(ann.BIND_PHASE)} cond={cond.get('reason')}: "
        f"{str(cond.get('message'))[:160]}"
    )


def _keep_evidence(fc: FaultCluster, label: str) -> None:
    """Copy the cluster's logs and the burst's pods where they outlive the cluster."""
    where = fc.evidence_dir / label
    shutil.copytree(fc.c.settings.log_dir, where / "logs", dirs_exist_ok=True)
    pods = fc.c.pods(f"{LABEL}={label}")
    (where / "pods.json").write_text(json.dumps(pods, indent=1))
    print(f"evidence of {label}: {where}")


def _check(fc: FaultCluster) -> CheckReport:
    """``tessera check`` once the node agent had a reconcile pass to catch up."""
    deadline = time.monotonic() + CHECK_GRACE_S
    while True:
        report = cluster_report(fc.c)
        if report.ok or time.monotonic() > deadline:
            return report
        time.sleep(1.0)


def _clean_up(fc: FaultCluster, label: str) -> None:
    """Delete the burst's pods; every MIG instance must then be reclaimed."""
    fc.c.delete_pods(f"{LABEL}={label}", timeout_s=120.0)
    deadline = time.monotonic() + 60.0
    while True:
        report = cluster_report(fc.c)
        if report.ok and not report.sim_instances:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"after deleting {label}'s pods: {report.summary()}")
        time.sleep(1.0)


# Scenarios -----------------------------------------------------------------------------------


def _kill_plugin_server(fc: FaultCluster, times: int) -> Callable[[Burst], None]:
    def inject(b: Burst) -> None:
        total = len(b.pods)
        for i in range(times):
            b.wait_bound(total * (i + 1) // (times + 2))

            def crash() -> None:
                fc.kill(PLUGIN_SERVER)
                time.sleep(1.0)  # the scheduler meets the dead server
                fc.restart(PLUGIN_SERVER)

            b.inject("plugin-server SIGKILL + restart", crash)

    return inject


def test_plugin_server_killed_three_times(faults: FaultCluster) -> None:
    fig = run_burst(
        faults, "ps-kill", fault_pods(BURST, 1, "ps-kill"), _kill_plugin_server(faults, 3)
    )
    assert fig["faults_injected"] == 3


def test_plugin_server_killed_three_times_2000_pods(faults: FaultCluster) -> None:
    pods = fault_pods(BIG_BURST, 2, "ps-kill-2000")
    fig = run_burst(faults, "ps-kill-2000", pods, _kill_plugin_server(faults, 3))
    assert fig["faults_injected"] == 3


def test_scheduler_killed(faults: FaultCluster, capsys: pytest.CaptureFixture[str]) -> None:
    def inject(b: Burst) -> None:
        b.wait_bound(len(b.pods) // 3)

        def crash() -> None:
            faults.kill(SCHEDULER)
            faults.restart(SCHEDULER)

        b.inject("tessera-scheduler SIGKILL + restart", crash)

    run_burst(faults, "sched-kill", fault_pods(BURST, 3, "sched-kill"), inject)
    # The command line agrees (exit 0) on the cleaned-up cluster.
    capsys.readouterr()
    argv = ["check", "--kubeconfig", str(faults.c.settings.kubeconfig), "--output", "json"]
    assert tessera_main([*argv, "--sim-state", str(faults.agent_state)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is True and out["nodes"] == FAULT_NODES and out["violations"] == []


def test_apiserver_restarted(faults: FaultCluster) -> None:
    def inject(b: Burst) -> None:
        b.wait_bound(len(b.pods) // 3)
        b.inject("kube-apiserver SIGKILL + restart", faults.crash_apiserver)

    run_burst(faults, "apiserver", fault_pods(BURST, 4, "apiserver"), inject)


def test_watches_expire_410_gone(faults: FaultCluster) -> None:
    """Every open watch of the plugin server and node agent ends and is resumed from a version
    the apiserver calls too old (410): they list again and carry on."""
    # A restarted apiserver's watch caches begin at the current revision, so it answers 410
    # to anything older (a fresh one would still serve version 1 from its cache).
    faults.crash_apiserver()
    markers = {c: faults.log_count(c, "watch version expired") for c in (PLUGIN_SERVER, NODE_AGENT)}
    expired = faults.proxy.stats.watches_expired

    def inject(b: Burst) -> None:
        for share in (4, 2):
            b.wait_bound(len(b.pods) // share)
            b.inject("watches ended + 410 Gone", lambda: faults.proxy.expire_watches(2.0))

    run_burst(faults, "watch-410", fault_pods(BURST, 5, "watch-410"), inject)
    assert faults.proxy.stats.watches_expired > expired
    for component, before in markers.items():
        assert faults.log_count(component, "watch version expired") > before, (
            f"{component} never saw 410 Gone"
        )


def test_watch_connections_dropped(faults: FaultCluster) -> None:
    dropped = faults.proxy.stats.dropped

    def inject(b: Burst) -> None:
        for share in (4, 2, 4 / 3):
            b.wait_bound(int(len(b.pods) / share))
            b.inject("all apiserver connections dropped", faults.proxy.drop)

    run_burst(faults, "conn-drop", fault_pods(BURST, 6, "conn-drop"), inject)
    assert faults.proxy.stats.dropped > dropped


def test_node_agent_killed_mid_mig_creation(faults: FaultCluster) -> None:
    """The node agent dies between a MIG creation's GPU instance and its compute instance; the
    restarted agent takes that GPU instance over (no leak, no second one) and finishes."""
    hold = faults.hold_dir / "hold"
    for stale in faults.hold_dir.glob("held-*"):
        stale.unlink()
    hold.touch()
    try:

        def inject(b: Burst) -> None:
            wait_for(
                "a MIG creation to pause",
                lambda: any(faults.hold_dir.glob("held-*")),
                120.0,
                interval_s=0.1,
            )
            time.sleep(0.5)  # creations on other nodes may pause too: all the better
            held = sorted(m.name.removeprefix("held-") for m in faults.hold_dir.glob("held-*"))
            for node in held:
                half_made = _half_made_instances(faults.agent_state / f"{node}.json")
                assert half_made, f"{node}: no GPU instance without compute instance while held"

            def crash() -> None:
                faults.kill(NODE_AGENT)
                hold.unlink()
                faults.restart(NODE_AGENT)

            b.inject(f"node agent SIGKILL mid MIG creation on {', '.join(held)}", crash)

        pods = fault_pods(BURST // 2, 7, "agent-kill", mig_share=0.8)
        run_burst(faults, "agent-kill", pods, inject)
    finally:
        hold.unlink(missing_ok=True)


def _half_made_instances(state_file: Path) -> list[tuple[str, int]]:
    doc = json.loads(state_file.read_text())
    return [
        (g["uuid"], gi["id"])
        for g in doc["gpus"]
        for gi in g["gpuInstances"]
        if not gi["computeInstances"]
    ]
