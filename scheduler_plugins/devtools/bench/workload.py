"""The benchmark's workload: a deterministic pod mix, the node shape it runs on, and the two
renderings of every pod — for Tessera (GPU shares) and for the stock kube-scheduler (plain
resources only).

``generate`` draws ``count`` pods from a seeded RNG over four kinds (non-GPU, hami-core
fractional, whole-GPU, MIG). The stock rendering of a pod asks the same cpu/memory and a plain
``nvidia.com/gpu`` count (the node's vGPU slots), no annotations: the same cluster shape, and
the work a scheduler without GPU sharing does. The node-concurrency pods aim many GPU pods at
one node to time how binds on a single node overlap.
"""

from __future__ import annotations

import dataclasses
import enum
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Final

from api.errors import InvalidInputError
from api.hami import keys as ann
from api.hami.keys import GpuMode
from api.hami.policy import Policy
from scheduler_plugins.devtools.cluster.nodes import NodeGroup, NodeProfile
from scheduler_plugins.devtools.cluster.stack import SCHEDULER_NAME

STOCK_SCHEDULER_NAME: Final = "default-scheduler"
GPU: Final = "nvidia.com/gpu"
GPUMEM: Final = "nvidia.com/gpumem"
GPUMEM_PERCENT: Final = "nvidia.com/gpumem-percentage"
GPUCORES: Final = "nvidia.com/gpucores"
HOSTNAME_LABEL: Final = "kubernetes.io/hostname"
NAME_PREFIX: Final = "bench"
MAX_PODS: Final = 1_000_000
MAX_TEMPLATES: Final = 10_000

Obj = dict[str, Any]


class PodKind(enum.Enum):
    PLAIN = "plain"  # no GPU: still scheduled by the Tessera profile, no plugin RPC
    FRACTIONAL = "fractional"  # hami-core share of one or two GPUs
    WHOLE_GPU = "whole-gpu"  # hami-core, all memory and cores of one card
    MIG = "mig"  # dynamic MIG instance sized by memory


class WorkloadError(InvalidInputError):
    """A workload option is invalid; the message names it."""


@dataclass(frozen=True)
class Mix:
    """Relative weights of the pod kinds (any non-negative numbers, not all zero)."""

    plain: float = 0.10
    fractional: float = 0.45
    whole_gpu: float = 0.15
    mig: float = 0.30

    def __post_init__(self) -> None:
        weights = self.weights()
        bad = {k.value: w for k, w in weights.items() if not w >= 0.0}
        if bad:
            raise WorkloadError(f"mix weights must be ≥ 0, got {bad}")
        if sum(weights.values()) <= 0:
            raise WorkloadError("mix weights are all zero: give at least one kind a weight")

    def weights(self) -> dict[PodKind, float]:
        return {
            PodKind.PLAIN: self.plain,
            PodKind.FRACTIONAL: self.fractional,
            PodKind.WHOLE_GPU: self.whole_gpu,
            PodKind.MIG: self.mig,
        }

    @staticmethod
    def parse(text: str) -> Mix:
        """``"plain=1,fractional=4.5,whole-gpu=1.5,mig=3"`` (kinds left out weigh 0), or a
        named mix (``MIXES``)."""
        named = MIXES.get(text.strip())
        if named is not None:
            return named
        by_name = {k.value: f.name for k, f in zip(PodKind, fields(Mix), strict=True)}
        values: dict[str, float] = dict.fromkeys(by_name.values(), 0.0)
        for item in (x.strip() for x in text.split(",")):
            if not item:
                continue
            key, sep, raw = item.partition("=")
            if not sep or key.strip() not in by_name:
                raise WorkloadError(
                    f"--mix item {item!r}: expected KIND=WEIGHT with KIND one of "
                    f"{', '.join(by_name)}, or a named mix ({', '.join(MIXES)})"
                )
            try:
                values[by_name[key.strip()]] = float(raw)
            except ValueError:
                raise WorkloadError(f"--mix item {item!r}: {raw!r} is not a number") from None
        return Mix(**values)


DEFAULT_MIX: Final = Mix()
MIXES: Final[dict[str, Mix]] = {
    "default": DEFAULT_MIX,
    # HAMi's most common use: every GPU pod asks a share of one or two GPUs.
    "fractional": Mix(plain=0.0, fractional=1.0, whole_gpu=0.0, mig=0.0),
}


@dataclass(frozen=True)
class BenchPod:
    """One pod of the workload, independent of which scheduler will place it."""

    name: str
    kind: PodKind
    gpus: int = 0  # device count; 0 for PLAIN
    gpumem_mib: int = 0  # per device; 0 with whole_card
    whole_card: bool = False  # gpumem-percentage 100
    gpucores: int = 0
    mode: GpuMode | None = None
    cpu_milli: int = 250
    memory_mib: int = 512
    node: str | None = None  # pinned to this node (nodeSelector on the hostname label)
    gpu_uuid: str | None = None  # only this GPU (nvidia.com/use-gpuuuid)


_FRACTIONAL_MEM: Final = (2000, 4000, 8000, 12000)
_FRACTIONAL_CORES: Final = (0, 0, 10, 25, 50)
_MIG_MEM: Final = (4000, 4000, 9000, 9000, 16000, 30000)
_CPU_MILLI: Final = (100, 250, 500, 1000, 2000)
_MEMORY_MIB: Final = (256, 512, 1024, 4096, 8192)


def generate(
    count: int,
    *,
    seed: int,
    mix: Mix = DEFAULT_MIX,
    prefix: str = NAME_PREFIX,
    replicas: int = 0,
) -> tuple[BenchPod, ...]:
    """``count`` pods named ``<prefix>-00000``…, the same for the same arguments.

    ``replicas``: fractional pods are copies of that many templates (drawn first), as the
    replicas of that many Deployments are; 0: each is drawn on its own."""
    if not 0 <= count <= MAX_PODS:
        raise WorkloadError(f"pod count must be in 0..{MAX_PODS}, got {count}")
    if not 0 <= replicas <= MAX_TEMPLATES:
        raise WorkloadError(f"replica templates must be in 0..{MAX_TEMPLATES}, got {replicas}")
    rng = random.Random(seed)
    templates = [_draw("template", PodKind.FRACTIONAL, rng) for _ in range(replicas)]
    kinds = list(mix.weights())
    weights = list(mix.weights().values())
    width = max(5, len(str(max(count - 1, 0))))
    out: list[BenchPod] = []
    for i in range(count):
        kind = rng.choices(kinds, weights)[0]
        name = f"{prefix}-{i:0{width}d}"
        if templates and kind is PodKind.FRACTIONAL:
            out.append(dataclasses.replace(rng.choice(templates), name=name))
        else:
            out.append(_draw(name, kind, rng))
    return tuple(out)


def _draw(name: str, kind: PodKind, rng: random.Random) -> BenchPod:
    cpu = rng.choice(_CPU_MILLI)
    memory = rng.choice(_MEMORY_MIB)
    if kind is PodKind.PLAIN:
        return BenchPod(name, kind, cpu_milli=cpu, memory_mib=memory)
    if kind is PodKind.FRACTIONAL:
        # A quarter without a mode: Tessera weighs them on every pool (the costlier path).
        mode: GpuMode | None = "hami-core" if rng.random() < 0.75 else None
        return BenchPod(
            name,
            kind,
            gpus=2 if rng.random() < 0.15 else 1,
            gpumem_mib=rng.choice(_FRACTIONAL_MEM),
            gpucores=rng.choice(_FRACTIONAL_CORES),
            mode=mode,
            cpu_milli=cpu,
            memory_mib=memory,
        )
    if kind is PodKind.WHOLE_GPU:
        return BenchPod(
            name,
            kind,
            gpus=1,
            whole_card=True,
            gpucores=100,
            mode="hami-core",
            cpu_milli=cpu,
            memory_mib=memory,
        )
    return BenchPod(
        name,
        kind,
        gpus=1,
        gpumem_mib=rng.choice(_MIG_MEM),
        mode="mig",
        cpu_milli=cpu,
        memory_mib=memory,
    )


# Node-concurrency pods ---------------------------------------------------------------------


def mig_burst(node: str, *, count: int = 7, prefix: str = "conc-mig") -> tuple[BenchPod, ...]:
    """``count`` smallest-MIG pods (4000 MiB: 1g.5gb on an A100-40GB) pinned to ``node``."""
    return tuple(
        BenchPod(f"{prefix}-{i}", PodKind.MIG, gpus=1, gpumem_mib=4000, mode="mig", node=node)
        for i in range(count)
    )


def fractional_burst(
    node: str,
    gpu_uuid: str,
    *,
    count: int = 10,
    prefix: str = "conc-frac",
    equal: bool = True,
) -> tuple[BenchPod, ...]:
    """``count`` shares of one GPU (10% cores each), by node and UUID: equal (4000 MiB each,
    replicas the node agent may interchange) or not (2000, 2100, … MiB: each pod waits for
    the one before it to be allocated)."""
    return tuple(
        BenchPod(
            f"{prefix}-{i}",
            PodKind.FRACTIONAL,
            gpus=1,
            gpumem_mib=4000 if equal else 2000 + 100 * i,
            gpucores=10,
            mode="hami-core",
            node=node,
            gpu_uuid=gpu_uuid,
        )
        for i in range(count)
    )


def distinct_count_burst(
    node: str, gpus_per_node: int, *, prefix: str = "conc-count"
) -> tuple[BenchPod, ...]:
    """One pod per device count 1..``gpus_per_node`` on ``node``: no two of them are ambiguous
    to the node agent, so none has to wait for another's allocation."""
    return tuple(
        BenchPod(
            f"{prefix}-{n}",
            PodKind.FRACTIONAL,
            gpus=n,
            gpumem_mib=1000,
            mode="hami-core",
            node=node,
        )
        for n in range(1, gpus_per_node + 1)
    )


# Rendering ---------------------------------------------------------------------------------


def tessera_manifest(
    pod: BenchPod,
    *,
    namespace: str,
    labels: Mapping[str, str],
    node_policy: Policy | None = None,
) -> Obj:
    """The pod as a Tessera user writes it (``hami-scheduler``, GPU shares, annotations);
    ``node_policy`` overrides the cluster's default node policy on GPU pods, and under the
    fragmentation policy on pods without a GPU too (Tessera then places those as well, as it
    does pods the webhook's ``hostOnlyPods`` routes to it)."""
    limits: dict[str, object] = {}
    if pod.gpus:
        limits[GPU] = pod.gpus
        if pod.whole_card:
            limits[GPUMEM_PERCENT] = 100
        elif pod.gpumem_mib:
            limits[GPUMEM] = pod.gpumem_mib
        if pod.gpucores:
            limits[GPUCORES] = pod.gpucores
    annotations: dict[str, str] = {}
    if pod.mode is not None:
        annotations[ann.VGPU_MODE] = pod.mode
    if pod.gpu_uuid is not None:
        annotations[ann.USE_GPUUUID] = pod.gpu_uuid
    if node_policy is not None and (pod.gpus or node_policy is Policy.FRAGMENTATION):
        annotations[ann.NODE_POLICY] = node_policy.value
    return _manifest(pod, SCHEDULER_NAME, limits, annotations, namespace, labels)


def stock_manifest(pod: BenchPod, *, namespace: str, labels: Mapping[str, str]) -> Obj:
    """The equivalent pod for the stock scheduler: plain resources only (a vGPU slot count
    instead of GPU shares), no annotations."""
    limits: dict[str, object] = {GPU: pod.gpus} if pod.gpus else {}
    return _manifest(pod, STOCK_SCHEDULER_NAME, limits, {}, namespace, labels)


def _manifest(
    pod: BenchPod,
    scheduler: str,
    limits: Mapping[str, object],
    annotations: Mapping[str, str],
    namespace: str,
    labels: Mapping[str, str],
) -> Obj:
    resources: Obj = {"requests": {"cpu": f"{pod.cpu_milli}m", "memory": f"{pod.memory_mib}Mi"}}
    if limits:
        resources["limits"] = dict(limits)
    spec: Obj = {
        "schedulerName": scheduler,
        "terminationGracePeriodSeconds": 0,
        "containers": [{"name": "main", "image": "busybox", "resources": resources}],
    }
    if pod.node is not None:
        spec["nodeSelector"] = {HOSTNAME_LABEL: pod.node}
    meta: Obj = {"name": pod.name, "namespace": namespace, "labels": dict(labels)}
    if annotations:
        meta["annotations"] = dict(annotations)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def kind_counts(pods: Sequence[BenchPod]) -> dict[str, int]:
    """How many pods of each kind (every kind listed, in declaration order)."""
    counts = dict.fromkeys((k.value for k in PodKind), 0)
    for p in pods:
        counts[p.kind.value] += 1
    return counts


# The cluster shape -------------------------------------------------------------------------


def bench_profile(name_prefix: str = "bench-node") -> NodeProfile:
    """8-GPU nodes: 2/3 hami-core (A100-40GB, H100 80GB, H200), 1/3 MIG (A100-40GB,
    A100-80GB, H100 80GB). The A100-40GB of both modes are what the node-concurrency
    scenario aims at."""

    def group(model: str, weight: int, mode: GpuMode = "hami-core") -> NodeGroup:
        return NodeGroup(
            model, weight=weight, gpus_per_node=8, mode=mode, cpu="128", memory="1Ti", pods="110"
        )

    return NodeProfile(
        name_prefix=name_prefix,
        groups=(
            group("A100-PCIE-40GB", 3),
            group("H100 80GB", 2),
            group("H200", 1),
            group("A100-PCIE-40GB", 1, "mig"),
            group("A100-SXM4-80GB", 1, "mig"),
            group("H100 80GB", 1, "mig"),
        ),
    )
