"""MIG churn: requests accepted by a whole MIG cluster under arrivals and departures.

A cluster of ``--nodes`` nodes (default 200), each with 8 GPUs in MIG mode: A100-PCIE-40GB and
A100-SXM4-40GB (one geometry), H100 80GB HBM3 and H200, a fixed share of nodes each, the model
of every node drawn once from ``--seed``. Every GPU registers the catalog's profiles that the
device config's default allowlist keeps (``api/hami/catalog.py``, ``DeviceConfig()``): 1g, 2g,
3g and 7g. The catalog also knows 4g profiles, but the default allowlist leaves them out on
these models (a 4g has a 3g's memory, and its one placement at slice 0 blocks both 3g halves),
so no GPU offers one and a "4g" request by memory is a 3g request: the stream has no 4g class.

Requests (seeded, ``--streams`` independent streams from ``--seed``): Poisson arrivals and
exponential lifetimes (mean 1) over ``--horizon`` mean lifetimes. A pod has one container that
asks ``nvidia.com/gpu`` = 1, 2 or 4 MIG devices (80/15/5%) of ``nvidia.com/gpumem`` = the
memory of a 1g/2g/3g/7g profile (40/25/20/15%) of a reference model drawn by its share of the
cluster's GPUs. 30% of pods name that model's family in ``nvidia.com/use-gputype`` (A100,
H100, H200); the others take any GPU with a profile that large: the smallest profile with that
memory on the GPU's own geometry (an A100 2g.10gb request is a 1g.10gb on an H100). The
arrival rate makes the offered load ``--load`` (default 1.2): arrival rate x mean lifetime x
mean memory slices per pod, over the cluster's slices, counting each device at the fewest
slices any GPU it may use would give it (so even the most compact placement of every request
exceeds the cluster by that factor). A pod that fits nowhere when it arrives is rejected,
never retried.

The fit rules, the same for every policy (and the core's own): a container's devices are all
on one node, each one MIG instance of the smallest profile with the memory asked (a larger one
only when the smallest has no free placement, which on these geometries never happens: every
larger profile's placements cover a smaller one's, checked at start) at a legal placement on
some GPU of the node allowed by ``use-gputype``; devices of one container may share a GPU.
Every policy's placements are replayed on one occupancy model (a slice bitmask per GPU) that
refuses any illegal or overlapping placement (``DoubleAllocationError``), so no policy can
count slices twice. Policies, each on the same cluster and the same streams:

- ``first-fit``: nodes in name order, GPUs in index order, on each GPU the lowest free legal
  start of the smallest profile that fits;
- ``hami-v2.10``: HAMi v2.10 as this repository models it (``rules``, ``ranking``,
  ``docs/hami-compatibility.md``): the node with the highest node score (binpack; usage before
  the pod: slots + cores + memory shares x 10; ties by name); on it, GPUs by the default GPU
  policy (spread: the lowest GPU score with the request first, then the highest NUMA node,
  then the highest index); placements in its fixed order (``PlacementStrategy.HAMI_V2_10``: 1g
  and 3g highest start first, others lowest first). As HAMi's ``Fit`` does (it revisits a MIG
  GPU before moving on), a container's devices fill the first GPU in that order as far as
  they fit before the next GPU is tried;
- ``hami-2855``: the same nodes and GPU order with the placement scorer HAMi PR #2855
  describes ("feat(nvidia): score MIG placements and add backtracking fallback",
  https://github.com/Project-HAMi/HAMi/pull/2855; its description: "Each and every candidate
  position is scored by the largest free run it leaves, after then by how many legal placements
  survive", and "the profile with the fewest free positions is placed first" when a container
  asks several slices on one card, with a backtracking fallback). Implemented here from that
  description: a candidate placement's key is (longest run of free memory slices after it,
  free legal placements of every registered profile after it), the highest key wins, ties go
  to v2.10's fixed order. A container's devices here all ask one profile, whose placements on
  these geometries are disjoint, so the plan order and the fallback never change the outcome:
  devices are placed one after another by the score;
- ``tessera``: the real core with the default ``DeviceConfig()``, whatever it ships now: each
  arrival is a pod dict through ``parse_request``, ``decide``, ``best_node`` and
  ``plan_for``; an accepted plan is ``assume``d into the ``ClusterState`` and a departure is
  ``remove_pod``. Its placements go through the same occupancy checks; a pod the core rejects
  while some node fits it by the rules above is counted (``rejected_while_fitting``).

Measured over the window after ``--warmup`` mean lifetimes (arrivals before it load the
cluster but are not counted): per policy, requests accepted (count and share of offered) and
accepted MIG slice-time (memory slices held x time, over all slices x the window: the
utilisation), their means over streams and the ratios of the means to first-fit's and to
hami-2855's; per geometry the utilisation, per reference family and per device count the
share accepted; and why requests were rejected: ``capacity`` (not enough free slices on the
allowed GPUs), ``fragmentation`` (free slices enough, legal placements not), ``node_split``
(enough placements in the cluster, not on one node).

Target (issue): tessera accepts >= 10% more requests than first-fit, and more than hami-2855.

Run: ``python -m benchmarks.mig_churn [--nodes N] [--streams K] [--seed S] [--json PATH]``
(also ``--load``, ``--horizon``, ``--warmup``, ``--policies``; ``--quick`` for a small run).
Writes the report as JSON (default ``benchmarks/results/mig_churn.json``) and its markdown
table beside it. A default run takes about 2.5 minutes on 2 cores (most of it the core's arm).
"""

from __future__ import annotations

import argparse
import functools
import heapq
import math
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, NamedTuple, Protocol, TypedDict

import numpy as np
import numpy.typing as npt

from api.hami import keys as ann
from api.hami.catalog import find_model
from api.hami.config import DeviceConfig
from api.hami.policy import PlacementStrategy
from api.hami.register import GpuDevice, MigProfile, Placement
from benchmarks.results_io import save_results
from scheduler_plugins.core.decide import decide
from scheduler_plugins.core.mig_policy import ChoiceTable, build_choice_table, sort_profiles
from scheduler_plugins.core.requests import parse_request
from scheduler_plugins.core.state import ClusterState

DEFAULT_NODES: Final = 200
DEFAULT_STREAMS: Final = 4
DEFAULT_SEED: Final = 20240601
DEFAULT_LOAD: Final = 1.2
DEFAULT_HORIZON: Final = 5.0  # mean lifetimes
DEFAULT_WARMUP: Final = 1.0  # mean lifetimes
DEFAULT_JSON: Final = Path(__file__).resolve().parent / "results" / "mig_churn.json"
QUICK: Final = {"nodes": 24, "streams": 2, "horizon": 2.5, "warmup": 0.5}
TARGET_VS_FIRST_FIT: Final = 1.10

GPUS_PER_NODE: Final = 8
SLOTS_PER_GPU: Final = DeviceConfig().device_split_count
NODE_CPU_MILLI: Final = 64_000
NODE_MEMORY: Final = 512 * 2**30
NAMESPACE: Final = "churn"

# (model, share of nodes, use-gputype value naming its family, geometry label)
MODELS: Final[tuple[tuple[str, float, str, str], ...]] = (
    ("NVIDIA A100-PCIE-40GB", 0.25, "A100", "A100-40GB"),
    ("NVIDIA A100-SXM4-40GB", 0.25, "A100", "A100-40GB"),
    ("NVIDIA H100 80GB HBM3", 0.30, "H100", "H100-80GB"),
    ("NVIDIA H200", 0.20, "H200", "H200-141GB"),
)
PROFILE_MIX: Final[tuple[tuple[str, float], ...]] = (
    ("1g", 0.40),
    ("2g", 0.25),
    ("3g", 0.20),
    ("7g", 0.15),
)
DEVICE_MIX: Final[tuple[tuple[int, float], ...]] = ((1, 0.80), (2, 0.15), (4, 0.05))
RESTRICTED_SHARE: Final = 0.30

FIRST_FIT: Final = "first-fit"
HAMI_V2_10: Final = "hami-v2.10"
HAMI_2855: Final = "hami-2855"
TESSERA: Final = "tessera"
POLICIES: Final = (FIRST_FIT, HAMI_V2_10, HAMI_2855, TESSERA)
REJECTION_KINDS: Final = ("capacity", "fragmentation", "node_split")

I64 = npt.NDArray[np.int64]
B = npt.NDArray[np.bool_]
F64 = npt.NDArray[np.float64]


class DoubleAllocationError(AssertionError):
    """A policy placed a device where the fit rules forbid it: on slices already held, at an
    illegal placement, on another node, on a GPU the pod excludes, or of too small a profile."""


# ----- cluster ---------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Geometry:
    """One registered MIG geometry and the per-mask tables the baselines look answers up in."""

    label: str
    profiles: tuple[MigProfile, ...]  # rank order (``sort_profiles``)
    total_slices: int
    lowest: ChoiceTable  # first-fit's placements
    hami: ChoiceTable  # HAMi v2.10's fixed order
    pr2855: I64  # [mask, rank] -> start PR #2855's scorer picks, -1 when no room
    free: I64  # [mask, rank] -> free legal placements of the profile
    slices_free: I64  # [mask] -> free memory slices

    def placement(self, rank: int, start: int) -> Placement | None:
        return next((pl for pl in self.profiles[rank].placements if pl.start == start), None)


def _runs(mask: int, total: int) -> int:
    """The longest run of free slices in ``mask``."""
    best = run = 0
    for i in range(total):
        run = 0 if mask >> i & 1 else run + 1
        best = max(best, run)
    return best


def _pr2855_table(profiles: tuple[MigProfile, ...], total: int, free: I64) -> I64:
    """PR #2855's choice per (mask, profile): the free placement that leaves the longest free run,
    then the most free legal placements; ties in v2.10's fixed order."""
    n_masks = 1 << total
    out = np.full((n_masks, len(profiles)), -1, np.int64)
    survivors = free.sum(axis=1)
    for mask in range(n_masks):
        for rank, p in enumerate(profiles):
            # v2.10's fixed order: 1g and 3g profiles highest start first, others lowest first.
            reverse = p.slice_count in (1, 3)
            order = sorted(p.placements, key=lambda pl: pl.start, reverse=reverse)
            best: tuple[int, int] | None = None
            for pl in order:
                if mask & pl.mask:
                    continue
                after = mask | pl.mask
                key = (_runs(after, total), int(survivors[after]))
                if best is None or key > best:
                    best = key
                    out[mask, rank] = pl.start
    out.setflags(write=False)
    return out


@functools.lru_cache(maxsize=16)
def geometry_of(label: str, profiles: tuple[MigProfile, ...]) -> Geometry:
    ordered = sort_profiles(profiles)
    lowest = build_choice_table(ordered, PlacementStrategy.LOWEST_START)
    _check_no_fallback(lowest)
    total = lowest.total_slices
    masks = np.arange(1 << total, dtype=np.int64)
    free = np.zeros((masks.size, len(ordered)), np.int64)
    for rank, p in enumerate(ordered):
        for pl in p.placements:
            free[:, rank] += (masks & pl.mask) == 0
    free.setflags(write=False)
    slices_free = total - np.bitwise_count(masks).astype(np.int64)
    slices_free.setflags(write=False)
    return Geometry(
        label=label,
        profiles=lowest.profiles,
        total_slices=total,
        lowest=lowest,
        hami=build_choice_table(ordered, PlacementStrategy.HAMI_V2_10),
        pr2855=_pr2855_table(lowest.profiles, total, free),
        free=free,
        slices_free=slices_free,
    )


def _check_no_fallback(table: ChoiceTable) -> None:
    # Where a profile has no free placement no larger one may have one: then "the smallest
    # profile that fits" is always the smallest acceptable one and capacity is exact.
    for r in range(len(table.profiles)):
        no_room = table.exact_start[:, r] < 0
        if bool((table.profile[no_room, r] >= 0).any()):
            raise AssertionError(
                f"a larger profile than {table.profiles[r].name} fits where it does not: the "
                "benchmark's capacity model assumes nested placements"
            )


def registered_profiles(model: str, config: DeviceConfig) -> tuple[MigProfile, ...]:
    m = find_model(model)
    allowed = set(config.allowed_profiles(m.name))
    return tuple(m.mig_profile(p) for p in m.profiles if p.name in allowed)


@dataclass(frozen=True, eq=False)
class Cluster:
    names: tuple[str, ...]  # in name order = index order
    models: tuple[str, ...]  # per node
    gpus_per_node: int
    geometries: tuple[Geometry, ...]
    node_geom: I64  # per node: index into ``geometries``
    devices: tuple[tuple[GpuDevice, ...], ...]  # per node, as it registers them
    config: DeviceConfig = field(default_factory=DeviceConfig)

    @property
    def n_nodes(self) -> int:
        return len(self.names)

    @property
    def n_gpus(self) -> int:
        return self.n_nodes * self.gpus_per_node

    @property
    def total_slices(self) -> int:
        per_gpu = sum(self.geometries[int(g)].total_slices for g in self.node_geom)
        return per_gpu * self.gpus_per_node


def make_cluster(
    models: Sequence[str],
    gpus_per_node: int = GPUS_PER_NODE,
    config: DeviceConfig | None = None,
) -> Cluster:
    """Nodes ``node-0000``, ``node-0001``, ... of these models, in this order."""
    cfg = config or DeviceConfig()
    labels = {m: label for m, _, _, label in MODELS}
    geoms: list[Geometry] = []
    node_geom: list[int] = []
    devices: list[tuple[GpuDevice, ...]] = []
    names = tuple(f"node-{i:04d}" for i in range(len(models)))
    for name, model in zip(names, models, strict=True):
        m = find_model(model)
        profiles = registered_profiles(m.name, cfg)
        geom = geometry_of(labels.get(m.name, m.name), sort_profiles(profiles))
        if geom not in geoms:
            geoms.append(geom)
        node_geom.append(geoms.index(geom))
        devices.append(
            tuple(
                GpuDevice(
                    id=f"GPU-{name}-{j}",
                    index=j,
                    count=cfg.device_split_count,
                    devmem=m.memory_mib,
                    devcore=100,
                    type=m.name,
                    numa=j * 2 // gpus_per_node if gpus_per_node > 4 else 0,
                    health=True,
                    mode="mig",
                    mig_profiles=profiles,
                )
                for j in range(gpus_per_node)
            )
        )
    return Cluster(
        names=names,
        models=tuple(find_model(m).name for m in models),
        gpus_per_node=gpus_per_node,
        geometries=tuple(geoms),
        node_geom=np.asarray(node_geom, np.int64),
        devices=tuple(devices),
        config=cfg,
    )


def cluster_models(n_nodes: int, seed: int) -> list[str]:
    """``MODELS``' shares of ``n_nodes`` (largest remainders), shuffled by ``seed``."""
    shares = [share for _, share, _, _ in MODELS]
    exact = [s * n_nodes / sum(shares) for s in shares]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: counts[i] - exact[i])
    for i in by_remainder[: n_nodes - sum(counts)]:
        counts[i] += 1
    models = [m for (m, _, _, _), c in zip(MODELS, counts, strict=True) for _ in range(c)]
    np.random.default_rng([seed, 0]).shuffle(models)
    return models


# ----- requests --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pod:
    index: int
    arrival: float
    departure: float
    reference: str  # the model the request is sized on
    profile: str  # the profile of ``reference`` whose memory it asks
    memory_mib: int  # per device
    devices: int
    gpu_type: str | None  # nvidia.com/use-gputype; None: any GPU
    slices: int  # the fewest memory slices a device takes on a GPU it may use

    @property
    def size(self) -> str:
        """The reference profile's size class: 1g, 2g, 3g or 7g."""
        return self.profile.split(".", 1)[0]

    @property
    def family(self) -> str:
        return next((fam for m, _, fam, _ in MODELS if m == self.reference), self.reference)


@dataclass(frozen=True)
class RequestClass:
    reference: str
    profile: str
    memory_mib: int
    slices: int  # per device, on the GPUs that give it the fewest
    devices: int
    gpu_type: str | None
    weight: float


def request_classes(cluster: Cluster) -> list[RequestClass]:
    """Every kind of pod the streams draw, with its probability."""
    gpus = {m: cluster.models.count(m) for m in dict.fromkeys(cluster.models)}
    total = sum(gpus.values())
    families = {m: fam for m, _, fam, _ in MODELS}
    out: list[RequestClass] = []
    for model, count in gpus.items():
        profiles = registered_profiles(model, cluster.config)
        for slice_name, p_weight in PROFILE_MIX:
            profile = next(p for p in profiles if p.name.startswith(f"{slice_name}."))
            for restricted, r_weight in ((True, RESTRICTED_SHARE), (False, 1 - RESTRICTED_SHARE)):
                gpu_type = families.get(model, model) if restricted else None
                size = _fewest_slices(cluster, profile.memory_mb, gpu_type)
                for devices, d_weight in DEVICE_MIX:
                    weight = count / total * p_weight * d_weight * r_weight
                    out.append(
                        RequestClass(
                            model, profile.name, profile.memory_mb, size, devices, gpu_type, weight
                        )
                    )
    return out


def _fewest_slices(cluster: Cluster, memory_mib: int, gpu_type: str | None) -> int:
    """The fewest memory slices one device of ``memory_mib`` takes on any GPU it may use."""
    sizes: list[int] = []
    for model, gi in zip(cluster.models, cluster.node_geom, strict=True):
        if gpu_type is None or gpu_type.upper() in model.upper():
            geom = cluster.geometries[int(gi)]
            rank = geom.lowest.min_rank_for_memory(memory_mib)
            if rank is not None:
                sizes.append(min(pl.size for pl in geom.profiles[rank].placements))
    if not sizes:
        raise ValueError(f"no GPU of the cluster takes {memory_mib} MiB ({gpu_type or 'any'})")
    return min(sizes)


@dataclass(frozen=True)
class Stream:
    seed: int
    rate: float  # arrivals per mean lifetime
    horizon: float
    pods: tuple[Pod, ...]


def make_stream(cluster: Cluster, seed: int, load: float, horizon: float) -> Stream:
    """Poisson arrivals on [0, horizon) at the rate that offers ``load`` x the cluster's slices;
    exponential lifetimes of mean 1."""
    classes = request_classes(cluster)
    weights = np.asarray([c.weight for c in classes])
    weights /= weights.sum()
    mean_slices = float(
        sum(w * c.slices * c.devices for w, c in zip(weights, classes, strict=True))
    )
    rate = load * cluster.total_slices / mean_slices
    rng = np.random.default_rng([seed, 1])
    n = int(rate * horizon + 10 * math.sqrt(rate * horizon) + 10)
    arrivals = np.cumsum(rng.exponential(1 / rate, n))
    while arrivals[-1] < horizon:  # pragma: no cover - 10 sigma
        arrivals = np.concatenate(
            [arrivals, arrivals[-1] + np.cumsum(rng.exponential(1 / rate, n))]
        )
    arrivals = arrivals[arrivals < horizon]
    kinds = rng.choice(len(classes), size=arrivals.size, p=weights)
    lifetimes = rng.exponential(1.0, arrivals.size)
    pods = tuple(
        Pod(
            index=i,
            arrival=float(t),
            departure=float(t + life),
            reference=classes[k].reference,
            profile=classes[k].profile,
            memory_mib=classes[k].memory_mib,
            devices=classes[k].devices,
            gpu_type=classes[k].gpu_type,
            slices=classes[k].slices,
        )
        for i, (t, k, life) in enumerate(zip(arrivals, kinds.tolist(), lifetimes, strict=True))
    )
    return Stream(seed, rate, horizon, pods)


def pod_manifest(pod: Pod, config: DeviceConfig) -> dict[str, Any]:
    """The pod as the API would hand it to the scheduler."""
    annotations = {ann.VGPU_MODE: "mig"}
    if pod.gpu_type is not None:
        annotations[ann.USE_GPUTYPE] = pod.gpu_type
    return {
        "metadata": {
            "name": f"p{pod.index}",
            "namespace": NAMESPACE,
            "uid": f"uid-{pod.index}",
            "annotations": annotations,
        },
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "resources": {
                        "limits": {
                            config.resource_count_name: pod.devices,
                            config.resource_memory_name: pod.memory_mib // config.memory_factor,
                        }
                    },
                }
            ]
        },
    }


# ----- occupancy: the one model every policy's placements are checked and counted on -------------


class Device(NamedTuple):
    row: int  # GPU: node index x GPUs per node + GPU index
    rank: int  # profile rank in its geometry
    start: int


@dataclass(frozen=True)
class Demand:
    """What a pod's container asks of each GPU."""

    min_rank: I64  # per geometry: the smallest acceptable profile's rank, ``none`` if none
    type_ok: B  # per node: allowed by use-gputype


class Occupancy:
    """Slice bitmasks and usage per GPU. ``place`` refuses anything the fit rules forbid."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        gpn = cluster.gpus_per_node
        self.gpu_node = np.repeat(np.arange(cluster.n_nodes, dtype=np.int64), gpn)
        self.gpu_geom = cluster.node_geom[self.gpu_node]
        n = cluster.n_gpus
        self.masks = np.zeros(n, np.int64)
        self.used = np.zeros(n, np.int64)  # instances
        self.used_mem = np.zeros(n, np.int64)  # MiB of their profiles
        self.used_cores = np.zeros(n, np.int64)  # cores of their profiles
        self.devmem = np.asarray(
            [d.devmem for devices in cluster.devices for d in devices], np.int64
        )
        self.numa = np.asarray([d.numa for devices in cluster.devices for d in devices], np.int64)
        geoms = cluster.geometries
        self.none = max(len(g.profiles) for g in geoms)  # the "no profile" rank
        n_masks = max(1 << g.total_slices for g in geoms)
        self._free = np.zeros((len(geoms), n_masks, self.none + 1), np.int64)
        self._sizes = np.zeros((len(geoms), self.none + 1), np.int64)
        self._slices_free = np.zeros((len(geoms), n_masks), np.int64)
        for gi, g in enumerate(geoms):
            self._free[gi, : g.free.shape[0], : g.free.shape[1]] = g.free
            self._sizes[gi, : len(g.profiles)] = [
                min(pl.size for pl in p.placements) for p in g.profiles
            ]
            self._slices_free[gi, : g.slices_free.size] = g.slices_free
        self.occupied = 0  # memory slices held
        self.occupied_by_geom = np.zeros(len(geoms), np.int64)
        self.holders: dict[int, tuple[Device, ...]] = {}
        self._demands: dict[tuple[int, str | None], Demand] = {}

    def demand(self, pod: Pod) -> Demand:
        key = (pod.memory_mib, pod.gpu_type)
        found = self._demands.get(key)
        if found is None:
            ranks = [g.lowest.min_rank_for_memory(pod.memory_mib) for g in self.cluster.geometries]
            min_rank = np.asarray([self.none if r is None else r for r in ranks], np.int64)
            wanted = (pod.gpu_type or "").upper()
            type_ok = np.asarray([wanted in m.upper() for m in self.cluster.models], np.bool_)
            found = self._demands[key] = Demand(min_rank, type_ok)
        return found

    def caps(self, demand: Demand) -> I64:
        """Per GPU: how many devices of this demand it can still take (free placements of the
        smallest acceptable profile; placements of one profile are disjoint here)."""
        minr = demand.min_rank[self.gpu_geom]
        caps: I64 = self._free[self.gpu_geom, self.masks, minr]
        caps *= demand.type_ok[self.gpu_node]
        return caps

    def node_caps(self, caps: I64) -> I64:
        per_node: I64 = caps.reshape(self.cluster.n_nodes, self.cluster.gpus_per_node).sum(axis=1)
        return per_node

    def why_rejected(self, demand: Demand, devices: int, caps: I64) -> str:
        """Why no node fits: ``capacity``, ``fragmentation`` or ``node_split``."""
        if int(caps.sum()) >= devices:
            return "node_split"
        minr = demand.min_rank[self.gpu_geom]
        size = self._sizes[self.gpu_geom, minr]
        raw = np.where(
            size > 0, self._slices_free[self.gpu_geom, self.masks] // np.maximum(size, 1), 0
        )
        raw *= demand.type_ok[self.gpu_node]
        return "fragmentation" if int(raw.sum()) >= devices else "capacity"

    def place(self, pod: Pod, devices: Sequence[Device]) -> None:
        """Count ``pod``'s devices; DoubleAllocationError (nothing counted) when they break the
        fit rules."""
        if pod.index in self.holders:
            raise DoubleAllocationError(f"pod {pod.index} placed twice")
        if len(devices) != pod.devices:
            raise DoubleAllocationError(
                f"pod {pod.index} asks {pod.devices} devices, got {len(devices)}"
            )
        demand = self.demand(pod)
        gpn = self.cluster.gpus_per_node
        nodes = {d.row // gpn for d in devices}
        if len(nodes) != 1:
            raise DoubleAllocationError(f"pod {pod.index}: devices on nodes {sorted(nodes)}")
        [node] = nodes
        if not demand.type_ok[node]:
            raise DoubleAllocationError(
                f"pod {pod.index}: {self.cluster.models[node]} is not {pod.gpu_type}"
            )
        masks: dict[int, int] = {}
        for d in devices:
            geom = self.cluster.geometries[int(self.gpu_geom[d.row])]
            if not 0 <= d.rank < len(geom.profiles):
                raise DoubleAllocationError(f"pod {pod.index}: no profile rank {d.rank}")
            profile = geom.profiles[d.rank]
            if profile.memory_mb < pod.memory_mib:
                raise DoubleAllocationError(
                    f"pod {pod.index}: {profile.name} has less than {pod.memory_mib} MiB"
                )
            pl = geom.placement(d.rank, d.start)
            if pl is None:
                raise DoubleAllocationError(
                    f"pod {pod.index}: {profile.name} has no placement at {d.start}"
                )
            mask = masks.get(d.row, int(self.masks[d.row]))
            if mask & pl.mask:
                raise DoubleAllocationError(
                    f"pod {pod.index}: {profile.name} at {d.start} on GPU row {d.row} overlaps "
                    f"held slices {mask:#b}"
                )
            masks[d.row] = mask | pl.mask
        self._count(devices, +1)
        self.holders[pod.index] = tuple(devices)

    def release(self, pod: Pod) -> None:
        devices = self.holders.pop(pod.index)
        self._count(devices, -1)

    def _count(self, devices: Iterable[Device], sign: int) -> None:
        geoms = self.cluster.geometries
        for d in devices:
            gi = int(self.gpu_geom[d.row])
            profile = geoms[gi].profiles[d.rank]
            pl = geoms[gi].placement(d.rank, d.start)
            assert pl is not None
            if sign > 0:
                self.masks[d.row] |= pl.mask
            else:
                if int(self.masks[d.row]) & pl.mask != pl.mask:
                    raise DoubleAllocationError(f"GPU row {d.row}: freeing slices not held")
                self.masks[d.row] &= ~pl.mask
            self.used[d.row] += sign
            self.used_mem[d.row] += sign * profile.memory_mb
            self.used_cores[d.row] += sign * profile.core
            self.occupied += sign * pl.size
            self.occupied_by_geom[gi] += sign * pl.size


# ----- policies --------------------------------------------------------------------------------


class Arm(Protocol):
    """One placement policy: the devices it gives an arriving pod (None: rejected), and what it
    does when a pod it placed ends. It reads, never changes, the shared occupancy."""

    def admit(self, pod: Pod) -> tuple[Device, ...] | None: ...
    def depart(self, pod: Pod) -> None: ...


def _fill(
    occ: Occupancy,
    pod: Pod,
    rows: Iterable[int],
    caps: I64,
    pick: Callable[[Geometry, int, int], tuple[int, int] | None],
) -> tuple[Device, ...]:
    """Devices on ``rows`` in this order, each row as far as it fits (``caps``), each device
    where ``pick(geometry, mask, min_rank)`` says."""
    demand = occ.demand(pod)
    need = pod.devices
    out: list[Device] = []
    for row in rows:
        if need == 0:
            break
        take = min(need, int(caps[row]))
        if not take:
            continue
        gi = int(occ.gpu_geom[row])
        geom = occ.cluster.geometries[gi]
        mask = int(occ.masks[row])
        minr = int(demand.min_rank[gi])
        for _ in range(take):
            choice = pick(geom, mask, minr)
            if choice is None:
                raise AssertionError(f"GPU row {row} counted room it does not have")
            rank, start = choice
            pl = geom.placement(rank, start)
            assert pl is not None
            mask |= pl.mask
            out.append(Device(row, rank, start))
        need -= take
    if need:
        raise AssertionError(f"pod {pod.index}: the chosen node had no room for all its devices")
    return tuple(out)


def _pick_lowest(geom: Geometry, mask: int, minr: int) -> tuple[int, int] | None:
    return geom.lowest.choose(mask, minr)


def _pick_hami(geom: Geometry, mask: int, minr: int) -> tuple[int, int] | None:
    return geom.hami.choose(mask, minr)


def _pick_2855(geom: Geometry, mask: int, minr: int) -> tuple[int, int] | None:
    for rank in range(minr, len(geom.profiles)):  # the contract's fallback (never fires here)
        start = int(geom.pr2855[mask, rank])
        if start >= 0:
            return rank, start
    return None


class FirstFit:
    def __init__(self, occ: Occupancy) -> None:
        self.occ = occ

    def admit(self, pod: Pod) -> tuple[Device, ...] | None:
        caps = self.occ.caps(self.occ.demand(pod))
        fits = np.flatnonzero(self.occ.node_caps(caps) >= pod.devices)
        if not fits.size:
            return None
        gpn = self.occ.cluster.gpus_per_node
        node = int(fits[0])
        return _fill(self.occ, pod, range(node * gpn, (node + 1) * gpn), caps, _pick_lowest)

    def depart(self, pod: Pod) -> None:
        pass


class Hami:
    """HAMi's node and GPU order (v2.10), with the placement ``pick`` of v2.10 or PR #2855."""

    def __init__(
        self, occ: Occupancy, pick: Callable[[Geometry, int, int], tuple[int, int] | None]
    ) -> None:
        self.occ = occ
        self.pick = pick
        gpn = occ.cluster.gpus_per_node
        n = occ.cluster.n_nodes
        self.node_slots = np.full(n, gpn * SLOTS_PER_GPU, np.float64)
        self.node_cores = np.full(n, gpn * 100, np.float64)
        self.node_mem = occ.devmem.reshape(n, gpn).sum(axis=1).astype(np.float64)

    def node_scores(self) -> F64:
        """The node score, usage before the pod: (slots + cores + memory shares) x 10."""
        occ, shape = self.occ, (self.occ.cluster.n_nodes, self.occ.cluster.gpus_per_node)
        used = occ.used.reshape(shape).sum(axis=1) / self.node_slots
        cores = occ.used_cores.reshape(shape).sum(axis=1) / self.node_cores
        mem = occ.used_mem.reshape(shape).sum(axis=1) / self.node_mem
        scores: F64 = (used + cores + mem) * 10
        return scores

    def gpu_order(self, pod: Pod, node: int) -> list[int]:
        """spread: the lowest GPU score (with the request) first, then the highest NUMA node,
        then the highest index."""
        occ, gpn = self.occ, self.occ.cluster.gpus_per_node
        rows = range(node * gpn, (node + 1) * gpn)

        def key(r: int) -> tuple[float, int, int]:
            score = (
                (1 + int(occ.used[r])) / SLOTS_PER_GPU
                + int(occ.used_cores[r]) / 100
                + (pod.memory_mib + int(occ.used_mem[r])) / int(occ.devmem[r])
            ) * 10
            return score, -int(occ.numa[r]), -r

        return sorted(rows, key=key)

    def admit(self, pod: Pod) -> tuple[Device, ...] | None:
        caps = self.occ.caps(self.occ.demand(pod))
        fits = self.occ.node_caps(caps) >= pod.devices
        if not fits.any():
            return None
        scores = np.where(fits, self.node_scores(), -np.inf)
        node = int(np.argmax(scores >= scores.max() - 1e-9))  # ties: the first name
        return _fill(self.occ, pod, self.gpu_order(pod, node), caps, self.pick)

    def depart(self, pod: Pod) -> None:
        pass


class Tessera:
    """The scheduling core as shipped (default ``DeviceConfig()``)."""

    def __init__(self, occ: Occupancy, config: DeviceConfig | None = None) -> None:
        self.occ = occ
        self.config = config or DeviceConfig()
        self.state = ClusterState(self.config)
        cluster = occ.cluster
        self.rows: dict[str, int] = {}
        for i, (name, devices) in enumerate(zip(cluster.names, cluster.devices, strict=True)):
            self.state.upsert_node(
                name, devices, cpu_milli=NODE_CPU_MILLI, memory_bytes=NODE_MEMORY
            )
            for d in devices:
                self.rows[d.id] = i * cluster.gpus_per_node + d.index
        self.keys: dict[int, str] = {}

    def admit(self, pod: Pod) -> tuple[Device, ...] | None:
        request = parse_request(pod_manifest(pod, self.config), self.config)
        decision = decide(self.state, request)
        node = decision.best_node()
        if node is None:
            return None
        plan = decision.plan_for(node)
        if plan is None:
            raise AssertionError(f"pod {pod.index}: best node {node} has no plan")
        self.state.assume(
            plan.allocation(
                request.cpu_milli, request.memory_bytes, uid=request.uid, priority=request.priority
            )
        )
        self.keys[pod.index] = request.key
        out: list[Device] = []
        for container in plan.containers:
            for d in container:
                if d.mig_profile is None or d.placement is None:
                    raise DoubleAllocationError(f"pod {pod.index}: a shared device on {d.uuid}")
                row = self.rows[d.uuid]
                geom = self.occ.cluster.geometries[int(self.occ.gpu_geom[row])]
                rank = next((i for i, p in enumerate(geom.profiles) if p.name == d.mig_profile), -1)
                pl = geom.placement(rank, d.placement.start) if rank >= 0 else None
                if pl is None or pl != d.placement:
                    raise DoubleAllocationError(
                        f"pod {pod.index}: {d.mig_profile} at {d.placement} is not a legal "
                        f"placement of {geom.label}"
                    )
                out.append(Device(row, rank, d.placement.start))
        return tuple(out)

    def depart(self, pod: Pod) -> None:
        self.state.remove_pod(self.keys.pop(pod.index))


def make_arm(name: str, occ: Occupancy) -> Arm:
    if name == FIRST_FIT:
        return FirstFit(occ)
    if name == HAMI_V2_10:
        return Hami(occ, _pick_hami)
    if name == HAMI_2855:
        return Hami(occ, _pick_2855)
    if name == TESSERA:
        return Tessera(occ)
    raise ValueError(f"unknown policy {name!r}; valid: {', '.join(POLICIES)}")


# ----- replay ----------------------------------------------------------------------------------


class StreamResult(TypedDict):
    offered: int
    accepted: int
    accepted_share: float
    utilisation: float
    utilisation_by_geometry: dict[str, float]
    offered_by_family: dict[str, int]
    accepted_by_family: dict[str, int]
    offered_by_devices: dict[str, int]
    accepted_by_devices: dict[str, int]
    offered_by_profile: dict[str, int]
    accepted_by_profile: dict[str, int]
    unrestricted_devices_by_geometry: dict[str, int]
    rejected: dict[str, int]
    rejected_while_fitting: int
    events: int
    seconds: float


def replay(
    cluster: Cluster, stream: Stream, policy: str, warmup: float
) -> tuple[StreamResult, Occupancy]:
    """Run ``stream`` through ``policy``; counts from ``warmup`` to the stream's horizon."""
    occ = Occupancy(cluster)
    arm = make_arm(policy, occ)
    horizon = stream.horizon
    window = horizon - warmup
    labels = [g.label for g in cluster.geometries]
    geom_slices = np.zeros(len(labels), np.float64)
    for gi in cluster.node_geom.tolist():
        geom_slices[gi] += cluster.geometries[gi].total_slices * cluster.gpus_per_node
    area = 0.0
    area_by_geom = np.zeros(len(labels), np.float64)
    last = 0.0
    departures: list[tuple[float, int]] = []
    pods = stream.pods
    offered = accepted = events = wrong = 0
    offered_fam: dict[str, int] = {}
    accepted_fam: dict[str, int] = {}
    offered_dev: dict[str, int] = {}
    accepted_dev: dict[str, int] = {}
    offered_prof: dict[str, int] = {}
    accepted_prof: dict[str, int] = {}
    unrestricted = dict.fromkeys(labels, 0)
    rejected = dict.fromkeys(REJECTION_KINDS, 0)

    def advance(t: float) -> None:
        nonlocal area, last
        dt = max(0.0, min(t, horizon) - max(last, warmup))
        if dt > 0:
            area += occ.occupied * dt
            area_by_geom[:] += occ.occupied_by_geom * dt
        last = max(last, t)

    started = time.perf_counter()
    for pod in pods:
        while departures and departures[0][0] <= pod.arrival:
            t, index = heapq.heappop(departures)
            advance(t)
            arm.depart(pods[index])
            occ.release(pods[index])
            events += 1
        advance(pod.arrival)
        events += 1
        counted = pod.arrival >= warmup
        demand = occ.demand(pod)
        caps = occ.caps(demand)
        fits = bool((occ.node_caps(caps) >= pod.devices).any())
        devices = arm.admit(pod)
        if counted:
            offered += 1
            offered_fam[pod.family] = offered_fam.get(pod.family, 0) + 1
            offered_dev[str(pod.devices)] = offered_dev.get(str(pod.devices), 0) + 1
            offered_prof[pod.size] = offered_prof.get(pod.size, 0) + 1
        if devices is None:
            if fits:
                wrong += 1
            elif counted:
                rejected[occ.why_rejected(demand, pod.devices, caps)] += 1
            continue
        if not fits:
            raise DoubleAllocationError(
                f"{policy} placed pod {pod.index} where the fit rules find no room"
            )
        occ.place(pod, devices)
        heapq.heappush(departures, (pod.departure, pod.index))
        if counted:
            accepted += 1
            accepted_fam[pod.family] = accepted_fam.get(pod.family, 0) + 1
            accepted_dev[str(pod.devices)] = accepted_dev.get(str(pod.devices), 0) + 1
            accepted_prof[pod.size] = accepted_prof.get(pod.size, 0) + 1
            if pod.gpu_type is None:
                unrestricted[labels[int(occ.gpu_geom[devices[0].row])]] += len(devices)
    while departures and departures[0][0] <= horizon:
        t, index = heapq.heappop(departures)
        advance(t)
        arm.depart(pods[index])
        occ.release(pods[index])
        events += 1
    advance(horizon)
    seconds = time.perf_counter() - started
    slices = cluster.total_slices
    return (
        StreamResult(
            offered=offered,
            accepted=accepted,
            accepted_share=accepted / offered if offered else float("nan"),
            utilisation=area / (slices * window) if window > 0 else float("nan"),
            utilisation_by_geometry={
                label: float(area_by_geom[i] / (geom_slices[i] * window)) if window > 0 else 0.0
                for i, label in enumerate(labels)
            },
            offered_by_family=dict(sorted(offered_fam.items())),
            accepted_by_family=dict(sorted(accepted_fam.items())),
            offered_by_devices=dict(sorted(offered_dev.items())),
            accepted_by_devices=dict(sorted(accepted_dev.items())),
            offered_by_profile=dict(sorted(offered_prof.items())),
            accepted_by_profile=dict(sorted(accepted_prof.items())),
            unrestricted_devices_by_geometry=unrestricted,
            rejected=rejected,
            rejected_while_fitting=wrong,
            events=events,
            seconds=round(seconds, 3),
        ),
        occ,
    )


# ----- report ----------------------------------------------------------------------------------


class PolicySummary(TypedDict):
    offered_mean: float
    accepted_mean: float
    accepted_share: float
    utilisation: float
    accepted_vs_first_fit: float
    accepted_vs_hami_2855: float
    utilisation_vs_first_fit: float
    utilisation_vs_hami_2855: float
    accepted_vs_first_fit_per_stream: list[float]
    utilisation_by_geometry: dict[str, float]
    accepted_share_by_family: dict[str, float]
    accepted_share_by_devices: dict[str, float]
    accepted_share_by_profile: dict[str, float]
    unrestricted_devices_by_geometry: dict[str, float]
    rejected_mean: dict[str, float]
    rejected_while_fitting: int
    seconds: float


class Report(TypedDict):
    benchmark: str
    nodes: int
    gpus: int
    slices: int
    nodes_by_model: dict[str, int]
    streams: int
    seed: int
    load: float
    horizon: float
    warmup: float
    arrivals_per_stream: float
    events_per_stream: float
    request_model: str
    tessera_config: dict[str, str]
    policies: dict[str, PolicySummary]
    per_stream: list[dict[str, StreamResult]]
    target: dict[str, Any]


def _mean(xs: Sequence[float]) -> float:
    return float(np.mean(xs)) if xs else float("nan")


def _ratio(a: float, b: float) -> float:
    return round(a / b, 4) if b else float("nan")


def _shares(rs: Sequence[StreamResult], offered: str, accepted: str) -> dict[str, float]:
    keys = sorted({k for r in rs for k in r[offered]})  # type: ignore[literal-required]
    return {
        k: round(
            sum(r[accepted].get(k, 0) for r in rs)  # type: ignore[literal-required]
            / max(1, sum(r[offered].get(k, 0) for r in rs)),  # type: ignore[literal-required]
            4,
        )
        for k in keys
    }


def _fractions(counts: Sequence[Mapping[str, int]]) -> dict[str, float]:
    total = sum(sum(c.values()) for c in counts)
    keys = sorted({k for c in counts for k in c})
    return {k: round(sum(c.get(k, 0) for c in counts) / max(1, total), 4) for k in keys}


def summarise(per_stream: Sequence[Mapping[str, StreamResult]]) -> dict[str, PolicySummary]:
    names = [p for p in POLICIES if all(p in s for s in per_stream)]
    acc = {p: _mean([s[p]["accepted"] for s in per_stream]) for p in names}
    util = {p: _mean([s[p]["utilisation"] for s in per_stream]) for p in names}
    out: dict[str, PolicySummary] = {}
    for p in names:
        rs = [s[p] for s in per_stream]
        labels = rs[0]["utilisation_by_geometry"].keys()
        out[p] = PolicySummary(
            offered_mean=_mean([r["offered"] for r in rs]),
            accepted_mean=acc[p],
            accepted_share=round(_mean([r["accepted_share"] for r in rs]), 4),
            utilisation=round(util[p], 4),
            accepted_vs_first_fit=_ratio(acc[p], acc.get(FIRST_FIT, 0.0)),
            accepted_vs_hami_2855=_ratio(acc[p], acc.get(HAMI_2855, 0.0)),
            utilisation_vs_first_fit=_ratio(util[p], util.get(FIRST_FIT, 0.0)),
            utilisation_vs_hami_2855=_ratio(util[p], util.get(HAMI_2855, 0.0)),
            accepted_vs_first_fit_per_stream=[
                _ratio(s[p]["accepted"], s[FIRST_FIT]["accepted"]) if FIRST_FIT in s else 0.0
                for s in per_stream
            ],
            utilisation_by_geometry={
                label: round(_mean([r["utilisation_by_geometry"][label] for r in rs]), 4)
                for label in labels
            },
            accepted_share_by_family=_shares(rs, "offered_by_family", "accepted_by_family"),
            accepted_share_by_devices=_shares(rs, "offered_by_devices", "accepted_by_devices"),
            accepted_share_by_profile=_shares(rs, "offered_by_profile", "accepted_by_profile"),
            unrestricted_devices_by_geometry=_fractions(
                [r["unrestricted_devices_by_geometry"] for r in rs]
            ),
            rejected_mean={k: _mean([r["rejected"][k] for r in rs]) for k in REJECTION_KINDS},
            rejected_while_fitting=sum(r["rejected_while_fitting"] for r in rs),
            seconds=round(sum(r["seconds"] for r in rs), 2),
        )
    return out


def run(
    nodes: int = DEFAULT_NODES,
    streams: int = DEFAULT_STREAMS,
    seed: int = DEFAULT_SEED,
    load: float = DEFAULT_LOAD,
    horizon: float = DEFAULT_HORIZON,
    warmup: float = DEFAULT_WARMUP,
    policies: Sequence[str] = POLICIES,
    progress: Callable[[int, str, StreamResult], None] | None = None,
) -> Report:
    _validate(nodes, streams, load, horizon, warmup)
    for p in policies:
        if p not in POLICIES:
            raise ValueError(f"unknown policy {p!r}; valid: {', '.join(POLICIES)}")
    cluster = make_cluster(cluster_models(nodes, seed))
    per_stream: list[dict[str, StreamResult]] = []
    arrivals: list[int] = []
    for k in range(streams):
        stream = make_stream(cluster, seed + 1 + k, load, horizon)
        arrivals.append(len(stream.pods))
        results: dict[str, StreamResult] = {}
        for p in policies:
            results[p], _ = replay(cluster, stream, p, warmup)
            if progress is not None:
                progress(k, p, results[p])
        per_stream.append(results)
    summary = summarise(per_stream)
    config = cluster.config
    tessera, first, pr = (summary.get(p) for p in (TESSERA, FIRST_FIT, HAMI_2855))
    return Report(
        benchmark="mig_churn",
        nodes=nodes,
        gpus=cluster.n_gpus,
        slices=cluster.total_slices,
        nodes_by_model={m: cluster.models.count(m) for m, _, _, _ in MODELS},
        streams=streams,
        seed=seed,
        load=load,
        horizon=horizon,
        warmup=warmup,
        arrivals_per_stream=_mean(arrivals),
        events_per_stream=_mean([_mean([s[p]["events"] for p in s]) for s in per_stream if s]),
        request_model=(
            "one container, 1/2/4 devices (80/15/5%) of the memory of a 1g/2g/3g/7g profile "
            "(40/25/20/15%) of a model drawn by GPU share; 30% restricted to that model's family "
            "by use-gputype; Poisson arrivals, exponential lifetimes (mean 1), rejected when "
            "nothing fits"
        ),
        tessera_config={
            "mig_placement_policy": str(config.mig_placement_policy),
            "node_policy": str(config.default_node_policy),
            "gpu_policy": str(config.default_gpu_policy),
        },
        policies=summary,
        per_stream=per_stream,
        target={
            "tessera_vs_first_fit_min": TARGET_VS_FIRST_FIT,
            "tessera_vs_first_fit": tessera["accepted_vs_first_fit"] if tessera else None,
            "tessera_vs_hami_2855": tessera["accepted_vs_hami_2855"] if tessera else None,
            "met": bool(
                tessera
                and first
                and pr
                and tessera["accepted_vs_first_fit"] >= TARGET_VS_FIRST_FIT
                and tessera["accepted_mean"] > pr["accepted_mean"]
            ),
        },
    )


def format_table(report: Report) -> str:
    r = report
    lines = [
        f"# MIG churn: {r['nodes']} nodes, {r['gpus']} MIG GPUs, {r['slices']} memory slices",
        "",
        f"{r['streams']} streams (seed {r['seed']}), offered load {r['load']}, "
        f"{r['arrivals_per_stream']:.0f} arrivals and {r['events_per_stream']:.0f} events per "
        f"stream; counted from {r['warmup']} to {r['horizon']} mean lifetimes. Nodes: "
        + ", ".join(f"{m} {n}" for m, n in r["nodes_by_model"].items())
        + ". Tessera's defaults: "
        + ", ".join(f"{k} {v}" for k, v in r["tessera_config"].items())
        + ".",
        "",
        "| policy | accepted | share | vs first-fit | vs hami-2855 | slice util | util vs ff "
        "| util vs 2855 | rejected: capacity / fragmentation / node split |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, p in r["policies"].items():
        rej = p["rejected_mean"]
        lines.append(
            f"| {name} | {p['accepted_mean']:.0f} / {p['offered_mean']:.0f} "
            f"| {p['accepted_share']:.3f} | {p['accepted_vs_first_fit']:.3f} "
            f"| {p['accepted_vs_hami_2855']:.3f} | {p['utilisation']:.3f} "
            f"| {p['utilisation_vs_first_fit']:.3f} | {p['utilisation_vs_hami_2855']:.3f} "
            f"| {rej['capacity']:.0f} / {rej['fragmentation']:.0f} / {rej['node_split']:.0f} |"
        )
    if r["policies"]:
        first = next(iter(r["policies"].values()))
        geoms = list(first["utilisation_by_geometry"])
        lines += [
            "",
            "| policy | "
            + " | ".join(f"util {g}" for g in geoms)
            + " | "
            + " | ".join(f"any-type devices on {g}" for g in geoms)
            + " | seconds |",
            "|---|" + "---:|" * (2 * len(geoms) + 1),
        ]
        for name, p in r["policies"].items():
            cells = [f"{p['utilisation_by_geometry'][g]:.3f}" for g in geoms]
            cells += [f"{p['unrestricted_devices_by_geometry'].get(g, 0.0):.3f}" for g in geoms]
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {p['seconds']:.1f} |")
        groups = (
            ("accepted_share_by_family", "{}"),
            ("accepted_share_by_profile", "{}"),
            ("accepted_share_by_devices", "x{}"),
        )
        heads = [(key, fmt, list(first[key])) for key, fmt in groups]  # type: ignore[literal-required]
        n_cols = sum(len(keys) for _, _, keys in heads)
        lines += [
            "",
            "| share accepted | "
            + " | ".join(fmt.format(k) for _, fmt, keys in heads for k in keys)
            + " |",
            "|---|" + "---:|" * n_cols,
        ]
        for name, p in r["policies"].items():
            cells = [
                f"{p[key].get(k, 0.0):.3f}"  # type: ignore[literal-required]
                for key, _, keys in heads
                for k in keys
            ]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    t = r["target"]
    wrong = sum(p["rejected_while_fitting"] for p in r["policies"].values())
    lines += [
        "",
        "accepted: mean over streams of requests accepted / offered in the window; vs: ratios "
        "of the means; slice util: memory slices held x time / all slices x the window; any-type "
        "devices on G: where pods without use-gputype got their devices; share accepted by the "
        "reference model's family, the reference profile and the devices per pod.",
        f"target: tessera >= {t['tessera_vs_first_fit_min']:.2f}x first-fit and above "
        f"hami-2855: {'met' if t['met'] else 'NOT met'} (tessera vs first-fit "
        f"{t['tessera_vs_first_fit']}, vs hami-2855 {t['tessera_vs_hami_2855']}); "
        f"rejected while a node fit: {wrong}.",
    ]
    return "\n".join(lines) + "\n"


# ----- command line ----------------------------------------------------------------------------


def _validate(nodes: int, streams: int, load: float, horizon: float, warmup: float) -> None:
    if nodes < 1:
        raise ValueError(f"--nodes must be at least 1, got {nodes}")
    if streams < 1:
        raise ValueError(f"--streams must be at least 1, got {streams}")
    if not (math.isfinite(load) and load > 0):
        raise ValueError(f"--load must be a positive number, got {load}")
    if not (math.isfinite(horizon) and horizon > 0):
        raise ValueError(f"--horizon must be a positive number of mean lifetimes, got {horizon}")
    if not (math.isfinite(warmup) and 0 <= warmup < horizon):
        raise ValueError(f"--warmup must be >= 0 and below --horizon ({horizon}), got {warmup}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.mig_churn", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--nodes", type=int, default=None, help=f"default {DEFAULT_NODES}")
    parser.add_argument("--streams", type=int, default=None, help=f"default {DEFAULT_STREAMS}")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--load", type=float, default=DEFAULT_LOAD, help="offered/capacity")
    parser.add_argument(
        "--horizon", type=float, default=None, help=f"mean lifetimes, default {DEFAULT_HORIZON}"
    )
    parser.add_argument(
        "--warmup", type=float, default=None, help=f"mean lifetimes, default {DEFAULT_WARMUP}"
    )
    parser.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"comma list of {', '.join(POLICIES)}",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a small run: " + ", ".join(f"--{k} {v}" for k, v in QUICK.items()),
    )
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    base = QUICK if args.quick else {}

    def pick(name: str, default: float) -> Any:
        value = getattr(args, name)
        return value if value is not None else base.get(name, default)

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    try:
        nodes, streams = int(pick("nodes", DEFAULT_NODES)), int(pick("streams", DEFAULT_STREAMS))
        horizon = float(pick("horizon", DEFAULT_HORIZON))
        warmup = float(pick("warmup", DEFAULT_WARMUP))
        _validate(nodes, streams, args.load, horizon, warmup)
        unknown = [p for p in policies if p not in POLICIES]
        if unknown or not policies:
            raise ValueError(
                f"--policies: unknown {', '.join(map(repr, unknown)) or 'empty list'}; "
                f"valid: {', '.join(POLICIES)}"
            )
    except ValueError as e:
        parser.error(str(e))

    def progress(k: int, p: str, r: StreamResult) -> None:
        print(
            f"stream {k}: {p:<11} accepted {r['accepted']:>6} / {r['offered']:<6} "
            f"util {r['utilisation']:.3f}  ({r['seconds']:.1f} s)",
            file=sys.stderr,
            flush=True,
        )

    report = run(nodes, streams, args.seed, args.load, horizon, warmup, policies, progress)
    save_results(args.json, report, format_table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
