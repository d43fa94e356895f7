"""What the scenarios need besides batches: which nodes the node-concurrency bursts aim at,
which pods churn ends and how, why pods stayed pending, and the closing invariant check."""

from __future__ import annotations

import contextlib
import dataclasses
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import structlog

from api.errors import TesseraError
from api.hami import keys as ann
from api.hami.register import GpuDevice, decode
from api.kube.client import KubeClient
from api.kube.errors import ApiError, KubeError, NotFoundError
from scheduler_plugins.devtools.bench.batches import BATCH_LABEL, PODS_PATH
from scheduler_plugins.devtools.bench.workload import (
    BenchPod,
    distinct_count_burst,
    fractional_burst,
    mig_burst,
)
from scheduler_plugins.devtools.check import CheckReport, check_cluster

log = structlog.get_logger(__name__)

CHECK_RETRY_S: Final = 5.0
DELETE_NOW: Final = {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0}
RUNNING_WAIT_S: Final = 60.0
JSON_PATCH: Final = "application/json-patch+json"
TEST_FAILED: Final = 422  # a JSON patch "test" op that does not hold

Json = dict[str, Any]


def registers(api: KubeClient, names: Iterable[str]) -> dict[str, tuple[GpuDevice, ...]]:
    """Each node's registered GPUs by index (from ``hami.io/node-nvidia-register``)."""
    wanted = set(names)
    out: dict[str, tuple[GpuDevice, ...]] = {}
    for node in api.list("/api/v1/nodes").get("items") or []:
        name = str(node["metadata"]["name"])
        raw = (node["metadata"].get("annotations") or {}).get(ann.NODE_REGISTER)
        if name in wanted and raw:
            out[name] = tuple(sorted(decode(raw, obj=f"node {name}"), key=lambda d: d.index))
    return out


def concurrency_bursts(
    regs: Mapping[str, tuple[GpuDevice, ...]],
) -> list[tuple[str, str, tuple[BenchPod, ...]]]:
    """(label, what, pods) of the node-concurrency bursts the cluster has nodes for."""

    def nodes(mode: str) -> list[str]:
        return sorted(
            n
            for n, devs in regs.items()
            if devs and devs[0].mode == mode and "A100" in devs[0].type and "40GB" in devs[0].type
        )

    out: list[tuple[str, str, tuple[BenchPod, ...]]] = []
    mig = nodes("mig")
    core = nodes("hami-core")
    if mig:
        gpu = regs[mig[0]][0]
        out.append(
            (
                "mig-7x1g",
                f"7 MIG 1g.5gb pods on one A100-40GB ({mig[0]} GPU 0)",
                _pin_uuid(mig_burst(mig[0]), gpu.id),
            )
        )
    if core:
        gpu = regs[core[0]][0]
        out.append(
            (
                "fractional-10x",
                f"10 equal hami-core shares of one GPU ({core[0]} GPU 0)",
                fractional_burst(core[0], gpu.id),
            )
        )
    if core and len(regs[core[0]]) > 1:
        out.append(
            (
                "fractional-10-unequal",
                f"10 unequal hami-core shares of one GPU ({core[0]} GPU 1)",
                fractional_burst(core[0], regs[core[0]][1].id, prefix="conc-unequal", equal=False),
            )
        )
    if len(core) > 1:
        count = len(regs[core[1]])
        out.append(
            (
                "distinct-counts",
                f"{count} pods asking 1..{count} GPUs on one node ({core[1]})",
                distinct_count_burst(core[1], count),
            )
        )
    return out


def _pin_uuid(pods: tuple[BenchPod, ...], uuid: str) -> tuple[BenchPod, ...]:
    return tuple(dataclasses.replace(p, gpu_uuid=uuid) for p in pods)


def churn_pods(bound: Sequence[str], fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """(to delete, to mark Succeeded): ``fraction`` of ``bound``, split in halves."""
    k = int(len(bound) * fraction)
    chosen = random.Random(seed).sample(sorted(bound), k)
    return chosen[: k // 2], chosen[k // 2 :]


@dataclass
class Ended:
    """What ``end_pods`` did."""

    deleted: int = 0
    succeeded: int = 0
    deleted_instead: int = 0  # never Running in time: deleted rather than marked Succeeded
    errors: list[str] = field(default_factory=list)
    marked: list[str] = field(default_factory=list)  # names marked Succeeded


def end_pods(
    api: KubeClient,
    delete: Sequence[str],
    succeed: Sequence[str],
    workers: int,
    *,
    running_wait_s: float = RUNNING_WAIT_S,
) -> Ended:
    """Delete (grace 0) and mark Succeeded, in parallel.

    A pod is marked Succeeded only once it is Running (a test in the patch): kwok makes a
    bound pod Running from what it saw, so a pod marked Succeeded before that would be set
    back to Running and hold its devices again, which no kubelet does. A pod still not
    Running after ``running_wait_s`` is deleted instead.
    """
    done = Ended()
    lock = threading.Lock()
    to_succeeded = [
        {"op": "test", "path": "/status/phase", "value": "Running"},
        {"op": "replace", "path": "/status/phase", "value": "Succeeded"},
    ]

    def count(field_name: str) -> None:
        with lock:
            setattr(done, field_name, getattr(done, field_name) + 1)

    def one(item: tuple[str, str]) -> None:
        how, name = item
        path = f"{PODS_PATH}/{name}"
        try:
            if how == "succeed":
                deadline = time.monotonic() + running_wait_s
                while True:
                    try:
                        api.request(
                            "PATCH", f"{path}/status", to_succeeded, content_type=JSON_PATCH
                        )
                        count("succeeded")
                        with lock:
                            done.marked.append(name)
                        return
                    except ApiError as e:
                        if e.status != TEST_FAILED:
                            raise
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.5)
                count("deleted_instead")
            api.request("DELETE", path, DELETE_NOW)
            if how == "delete":
                count("deleted")
        except NotFoundError:
            pass
        except KubeError as e:
            with lock:
                done.errors.append(f"{how} {name}: {e}")

    items = [("delete", n) for n in delete] + [("succeed", n) for n in succeed]
    random.Random(len(items)).shuffle(items)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        list(pool.map(one, items))
    return done


def delete_resurrected(api: KubeClient, marked: Sequence[str], label: str) -> list[str]:
    """Pods of batch ``label`` marked Succeeded that are no longer Succeeded, deleted (grace 0).

    Under load kwok can apply its pod-ready stage to a stale copy of a pod after the pod was
    marked Succeeded, setting it back to Running (its status patch has no precondition). No
    kubelet revives a terminated pod: by then the node agent has destroyed the pod's MIG
    instances and the scheduler has given its devices to others, so the revived pod would
    show as overlapping them. Such pods are removed before the invariant check, and counted.
    """
    if not marked:
        return []
    wanted = set(marked)
    answer = api.list(PODS_PATH, label_selector=f"{BATCH_LABEL}={label}")
    revived = sorted(
        str((pod.get("metadata") or {}).get("name"))
        for pod in answer.get("items") or []
        if (pod.get("metadata") or {}).get("name") in wanted
        and (pod.get("status") or {}).get("phase") != "Succeeded"
    )
    for name in revived:
        with contextlib.suppress(NotFoundError):  # gone already
            api.request("DELETE", f"{PODS_PATH}/{name}", DELETE_NOW)
    if revived:
        log.warning("bench.kwok_revived_pods", count=len(revived), first=revived[:5])
    return revived


def pending_reasons(api: KubeClient, label: str, limit: int = 5) -> dict[str, int]:
    """The most common PodScheduled messages of the batch's unbound pods (shortened)."""
    answer = api.list(
        PODS_PATH, label_selector=f"{BATCH_LABEL}={label}", field_selector="spec.nodeName="
    )
    reasons: Counter[str] = Counter()
    for pod in answer.get("items") or []:
        cond = next(
            (
                c
                for c in (pod.get("status") or {}).get("conditions") or []
                if c.get("type") == "PodScheduled"
            ),
            None,
        )
        message = str((cond or {}).get("message") or "(no PodScheduled condition yet)")
        reasons[message[:200]] += 1
    return dict(reasons.most_common(limit))


def run_check(
    api: KubeClient,
    sim_state: Path | None,
    *,
    before_retry: Callable[[], Sequence[str]] | None = None,
) -> Json:
    """``check_cluster``, once more after a pause if the first snapshot caught pods in flight.

    ``before_retry`` runs before the second look (the bench deletes the pods kwok revived
    since its last look: kwok can revive one seconds after the first sweep); the pods it
    names are reported as ``revived_late``."""
    late: Sequence[str] = ()
    try:
        report: CheckReport = check_cluster(api, sim_state=sim_state)
        attempts = 1
        if not report.ok:
            if before_retry is not None:
                late = before_retry()
            time.sleep(CHECK_RETRY_S)
            report = check_cluster(api, sim_state=sim_state)
            attempts = 2
    except TesseraError as e:
        return {"ok": False, "attempts": 1, "summary": f"check failed: {e}", "violations": []}
    return {
        "ok": report.ok,
        "attempts": attempts,
        "revived_late": list(late),
        "summary": report.summary().splitlines()[0],
        "violations": [str(v) for v in report.violations[:20]],
        "violation_count": len(report.violations),
        "by_kind": report.by_kind(),
        "nodes": report.nodes,
        "pods": report.pods,
        "gpu_pods": report.gpu_pods,
        "mig_instances": report.mig_instances,
        "sim_instances": report.sim_instances,
    }
