"""Scheduler metrics (SPEC §7): what the plugin server serves on ``/metrics``.

- ``StateCollector``: HAMi's per-GPU allocation gauges (``hami_gpu_*``, ``hami_node_gpu_*``),
  ``hami_node_gpu_mig_instance_info`` for every MIG instance with a complete runtime identity,
  HAMi's per-container gauges (``hami_vgpu_*``), every GPU's sharing mode
  (``tessera_gpu_info``), the GPUs that take no new work (``tessera_gpu_unavailable``) and the
  reservations held, all read from the plugin server's
  ``ClusterState`` at scrape time. Nothing is updated per event: one short hold of the
  cache's lock copies the usage columns and the list of pod allocations, and the text is
  rendered outside it, column by column. Label text depends only on the state's layout
  (which nodes and GPUs exist), so it is built once per layout, and a pod's MIG and
  container lines once per allocation: a scrape of 40k GPUs formats values, not labels.
- ``SchedulingMetrics``: decision and per-RPC latency histograms, decisions by outcome and
  the reasons pending pods were rejected for; the servicer records them.
- ``MetricsServer``: a small HTTP server answering ``GET /metrics``.

HAMi's families keep HAMi's names, HELP texts, label names, the constant ``zone="vGPU"``
label, sorted label order and Go's number format (``1``, ``4.294967296e+10``) — what HAMi's
Go client writes — so dashboards built on HAMi's scheduler read Tessera's unchanged.
Tessera's own families are named ``tessera_scheduler_*`` and ``tessera_gpu_*``; those per GPU
use the label names of HAMi's per-GPU families, so they join with them on
``device_uuid``/``node``. Preemptions for GPU pods are ``tessera_preemptions_total{reason}``
(once per need the victims were blocking) and ``tessera_preemption_victims_total``. Gangs
are ``tessera_gangs_total{outcome}`` (admitted, unschedulable, timed_out).
"""

from __future__ import annotations

import enum
import functools
import math
import operator
import socket
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from decimal import Decimal
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from itertools import compress
from typing import Any, Final, Literal
from urllib.parse import urlsplit

import numpy as np
import numpy.typing as npt
import structlog
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from api.errors import InvalidInputError
from api.hami.devices import decode_devices
from api.hami.register import GpuDevice
from api.plugin.v1 import plugin_pb2 as pb
from scheduler_plugins.core.preemptions import NEED_LABELS
from scheduler_plugins.core.requests import PodAllocation
from scheduler_plugins.core.rules import Reason
from scheduler_plugins.core.state import ClusterState

log = structlog.get_logger("tessera.plugin_server.metrics")

F64 = npt.NDArray[np.float64]

ZONE: Final = "vGPU"
MIB: Final = 1 << 20
MIG_INSTANCE_INFO: Final = "hami_node_gpu_mig_instance_info"
RESERVATIONS_HELD: Final = "tessera_scheduler_reservations_held"
VGPU_MEMORY: Final = "hami_vgpu_memory_allocated_bytes"
VGPU_CORES: Final = "hami_vgpu_core_allocated_ratio"
CONTAINER_LABEL_NAMES: Final = (
    "container_index",
    "device_uuid",
    "namespace",
    "node",
    "pod",
    "zone",
)
GPU_UNAVAILABLE: Final = "tessera_gpu_unavailable"
# Why a whole GPU takes no new work (each a ``reason`` label value of GPU_UNAVAILABLE).
UNAVAILABLE_REASONS: Final = ("legacy_mig", "cordoned", "mig_conflict", "unhealthy")
GPU_INFO: Final = "tessera_gpu_info"
# Counters of kube-scheduler's preemptions for GPU pods (exposed with the ``_total`` suffix).
PREEMPTIONS: Final = "tessera_preemptions"
PREEMPTION_VICTIMS: Final = "tessera_preemption_victims"
# Gangs (PodGroups with a gang policy) by what became of them (``tessera_gangs_total``).
GANGS: Final = "tessera_gangs"
GANG_OUTCOMES: Final = ("admitted", "unschedulable", "timed_out")

DECISION_BUCKETS: Final = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# PreBind may wait (bounded by --prebind-wait) for an ambiguous pod on the node.
RPC_BUCKETS: Final = (*DECISION_BUCKETS, 2.5, 5.0, 10.0, 30.0, 60.0)
RPC_METHODS: Final = ("PreFilter", "Reserve", "Unreserve", "PreBind", "Explain", "FilterWhatIf")


class MetricsAddressError(InvalidInputError):
    """The metrics HTTP address cannot be served on; the message says what to change."""


# ----- number and label text, as Prometheus' Go client writes them ----------------------------


_EXACT_INT: Final = float(2**53)  # below it a whole float's digits are its shortest digits


@functools.lru_cache(maxsize=1 << 16)  # usage values recur from scrape to scrape
def go_float(value: float) -> str:
    """``value`` as Prometheus' Go client writes a sample: ``strconv.FormatFloat(v, 'g', -1,
    64)``, i.e. the shortest exact digits, in exponent form from 1e+06 up and below 1e-04."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude < _EXACT_INT and value == int(value):  # usage is mostly whole numbers
        digits = str(int(magnitude))
        if len(digits) <= 6:
            return str(int(value))
        minus = "-" if value < 0 else ""
        mantissa = digits.rstrip("0")
        dot = "." if len(mantissa) > 1 else ""
        return f"{minus}{mantissa[0]}{dot}{mantissa[1:]}e+{len(digits) - 1:02d}"
    if 1e-4 <= magnitude < 1e6:
        return repr(value)  # Python's shortest digits, and no exponent in this range either
    d = Decimal(repr(value)).normalize()  # repr: the shortest digits that read back exactly
    sign, digit_tuple, exponent = d.as_tuple()
    assert isinstance(exponent, int)
    digits = "".join(map(str, digit_tuple))
    exp10 = len(digits) - 1 + exponent
    minus = "-" if sign else ""
    if exp10 < -4 or exp10 >= 6:
        mantissa = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
        return f"{minus}{mantissa}e{'-' if exp10 < 0 else '+'}{abs(exp10):02d}"
    return format(d, "f")


def go_floats(values: F64, suffix: bytes = b"") -> list[bytes]:
    """``go_float`` of every value as ASCII, ``suffix`` appended; formats each distinct value
    once."""
    if values.size == 0:
        return []
    distinct, inverse = np.unique(values, return_inverse=True)
    text = np.array([go_float(v).encode() + suffix for v in distinct.tolist()], dtype=object)
    out: list[bytes] = text[inverse.ravel()].tolist()
    return out


def escape_label_value(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


# ----- the state, copied under the lock ------------------------------------------------------


LabelLayout = Literal["gpu", "gpu_cores", "overview", "gpu_untyped", "gpu_mode"]

# Label names per layout, sorted (the order Go's client writes them in).
LABEL_NAMES: Final[dict[LabelLayout, tuple[str, ...]]] = {
    "gpu": ("device_index", "device_type", "device_uuid", "node", "zone"),
    "gpu_cores": ("device_cores", "device_index", "device_type", "device_uuid", "node", "zone"),
    "overview": (
        "device_cores",
        "device_index",
        "device_memory_limit",
        "device_type",
        "device_uuid",
        "node",
        "zone",
    ),
    "gpu_untyped": ("device_index", "device_uuid", "node", "zone"),
    # Tessera's: "gpu" and the GPU's mode
    "gpu_mode": ("device_index", "device_type", "device_uuid", "mode", "node", "zone"),
}

MIG_LABEL_NAMES: Final = (
    "compute_instance_id",
    "device_index",
    "device_uuid",
    "gpu_instance_id",
    "mig_uuid",
    "node",
    "placement_size",
    "placement_start",
    "profile",
    "zone",
)


@dataclass(frozen=True, eq=False)
class LayoutCopy:
    """What the label text of a layout is built from, copied under the lock (the devices
    tuples are immutable) so that building it does not hold the lock."""

    version: int
    nodes: list[tuple[str, int, tuple[GpuDevice, ...]]]  # name, first GPU row, GPUs
    memory_mib: F64  # the state's per-row columns
    cores: F64

    @staticmethod
    def of(state: ClusterState) -> LayoutCopy:
        """Call with the state's lock held."""
        return LayoutCopy(
            state.layout_version,
            [(name, e.start, e.devices) for name, e in state.nodes.items()],
            state.gpus.mem.copy(),
            state.gpus.cores.copy(),
        )


@dataclass(frozen=True, eq=False)
class GpuRows:
    """Every registered GPU of one state layout, in node-name / GPU-index order, with each
    row's label text split where the label sets of the families differ. Immutable: a scrape
    reads it outside the lock."""

    layout_version: int
    rows: npt.NDArray[np.int64]  # GPU row in the state's columns
    memory_mib: F64  # registered capacity (device memory after scaling), MiB
    cores: F64
    nodes: list[str]
    uuids: list[str]
    indices: list[str]
    types: list[str]
    modes: list[str]
    mig_devices: dict[tuple[str, str], int]  # (node, GPU UUID) -> index, GPUs in MIG mode
    # Label text in UTF-8, the pieces the families' label sets are made of:
    gpu_text: list[bytes]  # index_text + typed_text
    index_text: list[bytes]  # 'device_index="0",'
    typed_text: list[bytes]  # 'device_type="…",device_uuid="…",node="…",zone="vGPU"} '
    untyped_text: list[bytes]  # 'device_uuid="…",node="…",zone="vGPU"} '
    mode_text: list[bytes]  # 'device_type="…",device_uuid="…",mode="…",node="…",zone="vGPU"} '
    cores_text: list[bytes]  # 'device_cores="100",'
    memory_text: list[bytes]  # 'device_memory_limit="40960",'

    @staticmethod
    def of(layout: LayoutCopy) -> GpuRows:
        rows: list[int] = []
        nodes: list[str] = []
        uuids: list[str] = []
        indices: list[str] = []
        types: list[str] = []
        modes: list[str] = []
        mig_devices: dict[tuple[str, str], int] = {}
        for name, start, devices in sorted(layout.nodes):
            for i, d in sorted(enumerate(devices), key=lambda iv: iv[1].index):
                rows.append(start + i)
                nodes.append(name)
                uuids.append(d.id)
                indices.append(str(d.index))
                types.append(d.type)
                modes.append(d.mode)
                if d.mode == "mig":
                    mig_devices[(name, d.id)] = d.index
        row_arr = np.array(rows, np.int64)
        memory_mib = layout.memory_mib[row_arr].astype(np.float64)
        cores = layout.cores[row_arr].astype(np.float64)
        shared: dict[bytes, bytes] = {}  # few distinct values: keep one object of each

        def one(text: bytes) -> bytes:
            return shared.setdefault(text, text)

        e = escape_label_value
        untyped = [
            f'device_uuid="{e(u)}",node="{e(n)}",zone="{ZONE}"}} '.encode()
            for u, n in zip(uuids, nodes, strict=True)
        ]
        index_text = [one(f'device_index="{i}",'.encode()) for i in indices]
        typed_text = [
            f'device_type="{e(t)}",'.encode() + u for t, u in zip(types, untyped, strict=True)
        ]
        mode_text = [
            f'device_type="{e(t)}",device_uuid="{e(u)}",mode="{m}",node="{e(n)}",'
            f'zone="{ZONE}"}} '.encode()
            for t, u, m, n in zip(types, uuids, modes, nodes, strict=True)
        ]
        return GpuRows(
            layout_version=layout.version,
            rows=row_arr,
            memory_mib=memory_mib,
            cores=cores,
            nodes=nodes,
            uuids=uuids,
            indices=indices,
            types=types,
            modes=modes,
            mig_devices=mig_devices,
            gpu_text=[i + t for i, t in zip(index_text, typed_text, strict=True)],
            index_text=index_text,
            typed_text=typed_text,
            untyped_text=untyped,
            mode_text=mode_text,
            cores_text=[one(b'device_cores="%s",' % v) for v in go_floats(cores)],
            memory_text=[one(b'device_memory_limit="%s",' % v) for v in go_floats(memory_mib)],
        )

    def label_columns(self, layout: LabelLayout) -> tuple[list[bytes], ...]:
        """The pieces of each row's label text for ``layout``, in order (the last ends ``} ``;
        fewer pieces make a faster join: the layout of four families is one piece)."""
        if layout == "gpu":
            return (self.gpu_text,)
        if layout == "gpu_cores":
            return (self.cores_text, self.gpu_text)
        if layout == "overview":
            return (self.cores_text, self.index_text, self.memory_text, self.typed_text)
        if layout == "gpu_mode":
            return (self.index_text, self.mode_text)
        return (self.index_text, self.untyped_text)

    def label_values(self, layout: LabelLayout, i: int) -> tuple[str, ...]:
        """Row ``i``'s label values in ``LABEL_NAMES[layout]`` order."""
        index, node, uuid = self.indices[i], self.nodes[i], self.uuids[i]
        cores = go_float(float(self.cores[i]))
        if layout == "gpu":
            return (index, self.types[i], uuid, node, ZONE)
        if layout == "gpu_cores":
            return (cores, index, self.types[i], uuid, node, ZONE)
        if layout == "overview":
            memory = go_float(float(self.memory_mib[i]))
            return (cores, index, memory, self.types[i], uuid, node, ZONE)
        if layout == "gpu_mode":
            return (index, self.types[i], uuid, self.modes[i], node, ZONE)
        return (index, uuid, node, ZONE)


@dataclass(frozen=True)
class MigInstance:
    """A MIG instance the node agent created for a pod (a complete runtime identity)."""

    node: str
    device_index: int
    device_uuid: str
    placement_start: int
    placement_size: int
    profile: str
    mig_uuid: str
    gpu_instance_id: int
    compute_instance_id: int

    def label_values(self) -> tuple[str, ...]:
        """In ``MIG_LABEL_NAMES`` order."""
        return (
            str(self.compute_instance_id),
            str(self.device_index),
            self.device_uuid,
            str(self.gpu_instance_id),
            self.mig_uuid,
            self.node,
            str(self.placement_size),
            str(self.placement_start),
            self.profile,
            ZONE,
        )

    def line(self) -> bytes:
        """The exposition line, labels in ``MIG_LABEL_NAMES`` order."""
        e = escape_label_value
        return (
            f'{MIG_INSTANCE_INFO}{{compute_instance_id="{self.compute_instance_id}",'
            f'device_index="{self.device_index}",device_uuid="{e(self.device_uuid)}",'
            f'gpu_instance_id="{self.gpu_instance_id}",mig_uuid="{e(self.mig_uuid)}",'
            f'node="{e(self.node)}",placement_size="{self.placement_size}",'
            f'placement_start="{self.placement_start}",profile="{e(self.profile)}",'
            f'zone="{ZONE}"}} 1\n'
        ).encode()


def mig_instances(alloc: PodAllocation, gpus: GpuRows) -> tuple[MigInstance, ...]:
    """The pod's MIG instances with a runtime identity on a GPU its node registers in MIG
    mode (a reservation elsewhere is no realized instance HAMi would report either). The
    decoder accepts all three runtime fields or none, so a runtime here is complete."""
    out: list[MigInstance] = []
    for m in alloc.mig:
        rt = m.runtime
        index = gpus.mig_devices.get((alloc.node, m.gpu_uuid))
        if rt is None or index is None:
            continue
        out.append(
            MigInstance(
                alloc.node,
                index,
                m.gpu_uuid,
                m.placement.start,
                m.placement.size,
                m.profile,
                rt.mig_uuid,
                rt.gpu_instance_id,
                rt.compute_instance_id,
            )
        )
    return tuple(out)


@dataclass(frozen=True)
class _MigLines:
    """One pod's MIG instances and their exposition lines, for the allocation object they
    came from (allocations are immutable: the same object means the same lines)."""

    alloc: PodAllocation
    instances: tuple[MigInstance, ...]
    lines: tuple[bytes, ...]


@dataclass(frozen=True)
class _ContainerLines:
    """One pod's per-container device lines (memory, cores), for the allocation object they
    came from."""

    alloc: PodAllocation
    memory: bytes  # the pod's lines of each family, joined
    cores: bytes

    @staticmethod
    def of(alloc: PodAllocation) -> _ContainerLines:
        """HAMi's per-container series: one per device of each container entry (a container
        holding two MIG instances of one GPU gives one series, their sum)."""
        namespace, _, pod = alloc.key.partition("/")
        e = escape_label_value
        tail = f'namespace="{e(namespace)}",node="{e(alloc.node)}",pod="{e(pod)}",zone="{ZONE}"}} '
        sums: dict[str, list[int]] = {}
        containers = decode_devices(alloc.devices_written)  # read once already: it decodes
        for ci, d in ((ci, d) for ci, devices in enumerate(containers) for d in devices):
            if not d.uuid:
                continue
            labels = f'container_index="{ci}",device_uuid="{e(d.written_uuid)}",{tail}'
            acc = sums.setdefault(labels, [0, 0])
            acc[0] += d.mem
            acc[1] += d.cores
        memory = "".join(
            f"{VGPU_MEMORY}{{{k}{go_float(float(m * MIB))}\n" for k, (m, _) in sums.items()
        )
        cores = "".join(f"{VGPU_CORES}{{{k}{go_float(float(c))}\n" for k, (_, c) in sums.items())
        return _ContainerLines(alloc, memory.encode(), cores.encode())


class ReservationTracker:
    """Which reservations are still held, without looking at every pod.

    The state flags a Reserve's allocation ``assumed`` until the API shows the pod carrying
    it (or Unreserve drops it). Every such reservation comes through ``reserved``, so
    counting the ones still flagged among those seen since the last count is exact, and
    costs the reservations made in between, not the cluster's pods. Callers hold the state's
    lock (the servicer reserves under it; the scrape counts under it).
    """

    _PRUNE_AT: Final = 1024

    def __init__(self, state: ClusterState) -> None:
        self._state = state
        self._keys: set[str] = set()
        self._prune_at = self._PRUNE_AT

    def reserved(self, key: str) -> None:
        self._keys.add(key)
        if len(self._keys) >= self._prune_at:  # never scraped: stay bounded, amortized O(1)
            self._prune()
            self._prune_at = max(self._PRUNE_AT, 2 * len(self._keys))

    def held(self) -> int:
        self._prune()
        return len(self._keys)

    def _prune(self) -> None:
        assumed = self._state.is_assumed
        self._keys = {k for k in self._keys if assumed(k)}


@dataclass(frozen=True, eq=False)
class StateSnapshot:
    """What one scrape reads from the state."""

    gpus: GpuRows
    used_slots: F64
    used_memory_mib: F64
    used_cores: F64
    mig_pods: tuple[_MigLines, ...]
    mig_lines: tuple[bytes, ...]  # every pod's, each once
    reservations_held: int | None
    # Per GPU row: devices HAMi <= v2.9 placed on MIG, cordoned, inconsistent MIG records,
    # registered healthy (an MPS GPU is not while its MPS control daemon is down).
    legacy: npt.NDArray[np.int32]
    cordoned: npt.NDArray[np.bool_]
    conflict: npt.NDArray[np.int32]
    healthy: npt.NDArray[np.bool_]
    containers: tuple[_ContainerLines, ...] = ()

    def mig_instances(self) -> tuple[MigInstance, ...]:
        """The instances of ``mig_lines``, in the same order."""
        by_line = {
            line: m
            for pod in self.mig_pods
            for line, m in zip(pod.lines, pod.instances, strict=True)
        }
        return tuple(by_line[line] for line in self.mig_lines)


# ----- families -------------------------------------------------------------------------------


class RenderedGauge(Metric):
    """A gauge family given as columns: ``text()`` renders it in one pass; ``samples`` (what
    ``prometheus_client``'s own exposition reads) is built only if something asks for it."""

    def __init__(
        self,
        name: str,
        documentation: str,
        render: Callable[[], bytes],
        make_samples: Callable[[], list[Sample]],
    ) -> None:
        self._samples: list[Sample] | None = None
        super().__init__(name, documentation, "gauge")
        self._render = render
        self._make_samples = make_samples

    @property
    def samples(self) -> list[Sample]:
        if self._samples is None:
            self._samples = self._make_samples()
        return self._samples

    @samples.setter
    def samples(self, value: list[Sample]) -> None:
        self._samples = value or None  # Metric.__init__ assigns [] first

    def text(self) -> bytes:
        """The family in the text format, HELP and TYPE lines first."""
        head = f"# HELP {self.name} {self.documentation}\n# TYPE {self.name} gauge\n"
        return head.encode() + self._render()


def join_lines(head: bytes, columns: Sequence[Sequence[bytes]], ends: Sequence[bytes]) -> bytes:
    """``head + columns[0][i] + … + ends[i]`` for every row, joined: one slice assignment per
    column instead of one format per line."""
    n = len(ends)
    width = len(columns) + 2
    parts = [head] * (n * width)
    for j, column in enumerate(columns, start=1):
        parts[j::width] = column
    parts[width - 1 :: width] = ends
    return b"".join(parts)


@dataclass(frozen=True)
class GpuGauge:
    """One of HAMi's per-GPU families: its label layout and its value per GPU."""

    name: str
    documentation: str
    labels: LabelLayout
    value: Callable[[StateSnapshot], F64]
    only_where: Callable[[StateSnapshot], npt.NDArray[np.bool_]] | None = None


# HAMi's cmd/scheduler/metrics.go, in its order; memory is accounted in MiB, exported in bytes.
GPU_GAUGES: Final = (
    GpuGauge(
        "hami_gpu_memory_limit_bytes",
        "Device memory limit for a certain GPU",
        "gpu",
        lambda s: s.gpus.memory_mib * MIB,
    ),
    GpuGauge(
        "hami_gpu_core_limit_ratio",
        "Device core limit for a certain GPU",
        "gpu",
        lambda s: s.gpus.cores,
    ),
    GpuGauge(
        "hami_gpu_memory_allocated_bytes",
        "Device memory allocated for a certain GPU",
        "gpu_cores",
        lambda s: s.used_memory_mib * MIB,
    ),
    GpuGauge(
        "hami_gpu_shared_count",
        "Number of containers sharing this GPU",
        "gpu",
        lambda s: s.used_slots,
    ),
    GpuGauge(
        "hami_gpu_core_allocated_ratio",
        "Device core allocated for a certain GPU",
        "gpu",
        lambda s: s.used_cores,
    ),
    GpuGauge(
        "hami_node_gpu_overview",
        "GPU overview on a certain node",
        "overview",
        lambda s: s.used_memory_mib * MIB,
    ),
    GpuGauge(
        "hami_node_gpu_memory_allocated_ratio",
        "GPU Memory Allocated Percentage on a certain GPU",
        "gpu_untyped",
        lambda s: s.used_memory_mib / np.where(s.gpus.memory_mib > 0, s.gpus.memory_mib, 1.0),
        lambda s: s.gpus.memory_mib > 0,
    ),
)

# Tessera's: which sharing method each registered GPU is in (HAMi's families do not say).
GPU_INFO_GAUGE: Final = GpuGauge(
    GPU_INFO,
    "1 for every registered GPU, by its mode: hami-core, mig or mps",
    "gpu_mode",
    lambda s: np.ones(len(s.gpus.rows)),
)


def _gpu_family(gauge: GpuGauge, snap: StateSnapshot) -> RenderedGauge | None:
    rows = snap.gpus
    values = gauge.value(snap)
    keep = None if gauge.only_where is None else gauge.only_where(snap)
    if keep is not None and keep.all():
        keep = None
    if not values.size or (keep is not None and not keep.any()):
        return None

    def render() -> bytes:
        columns: Sequence[Sequence[bytes]] = rows.label_columns(gauge.labels)
        kept = values
        if keep is not None:
            flags = keep.tolist()
            columns = [list(compress(c, flags)) for c in columns]
            kept = values[keep]
        return join_lines(gauge.name.encode() + b"{", columns, go_floats(kept, b"\n"))

    def make_samples() -> list[Sample]:
        names = LABEL_NAMES[gauge.labels]
        return [
            Sample(gauge.name, dict(zip(names, rows.label_values(gauge.labels, i), strict=True)), v)
            for i, v in enumerate(values.tolist())
            if keep is None or keep[i]
        ]

    return RenderedGauge(gauge.name, gauge.documentation, render, make_samples)


def _mig_family(snap: StateSnapshot) -> RenderedGauge | None:
    if not snap.mig_lines:
        return None

    def render() -> bytes:
        return b"".join(snap.mig_lines)

    def make_samples() -> list[Sample]:
        return [
            Sample(
                MIG_INSTANCE_INFO, dict(zip(MIG_LABEL_NAMES, m.label_values(), strict=True)), 1.0
            )
            for m in snap.mig_instances()
        ]

    return RenderedGauge(
        MIG_INSTANCE_INFO,
        "Realized MIG instance identity and scheduler placement",
        render,
        make_samples,
    )


def _container_families(snap: StateSnapshot) -> list[RenderedGauge]:
    """HAMi's per-container families, ``hami_vgpu_*`` (what each container of a placed pod was
    given on each GPU)."""
    if not snap.containers:
        return []
    out = []
    for name, doc, pick in (
        (VGPU_MEMORY, "vGPU memory allocated from a container", operator.attrgetter("memory")),
        (VGPU_CORES, "vGPU core allocated from a container", operator.attrgetter("cores")),
    ):

        def render(pick: Callable[[_ContainerLines], bytes] = pick) -> bytes:
            return b"".join(map(pick, snap.containers))

        def make_samples(name: str = name, render: Callable[[], bytes] = render) -> list[Sample]:
            return [
                sample
                for f in text_string_to_metric_families(render().decode())
                for sample in f.samples
                if sample.name == name
            ]

        out.append(RenderedGauge(name, doc, render, make_samples))
    return out


def _unavailable_family(snap: StateSnapshot) -> GaugeMetricFamily | None:
    """One sample per GPU that takes no new work and why (few rows: built plainly)."""
    if not len(snap.legacy):
        return None  # no GPUs: no families at all
    family = GaugeMetricFamily(
        GPU_UNAVAILABLE,
        "1 for a GPU that takes no new work, by reason: legacy_mig (it holds MIG devices HAMi "
        "<= v2.9 placed, whose placement is unknown), cordoned (hami.io/device-cordon), "
        "mig_conflict (its MIG records overlap or are inconsistent), unhealthy (its node "
        "registers it unhealthy; an MPS GPU while its MPS control daemon is down)",
        labels=(*LABEL_NAMES["gpu"], "reason"),
    )
    rows = snap.gpus
    for reason, flags in zip(
        UNAVAILABLE_REASONS,
        (snap.legacy > 0, snap.cordoned, snap.conflict > 0, ~snap.healthy),
        strict=True,
    ):
        for i in np.flatnonzero(flags).tolist():
            family.add_metric([*rows.label_values("gpu", i), reason], 1.0)
    return family


_has_mig: Final = operator.attrgetter("mig")


class StateCollector(Collector):
    """HAMi's GPU families and the reservations held, read from ``state`` at scrape time.

    Under ``lock`` (the lock every writer of the state holds) it only copies: the usage
    columns, the list of pod allocations (immutable objects), the held count, and after a
    layout change the node list. Label text, MIG identities and the exposition are made after
    the lock is released; a pod's MIG lines are kept while its allocation object (and the
    layout) stays the same.
    """

    def __init__(
        self,
        state: ClusterState,
        lock: AbstractContextManager[Any],
        reservations: ReservationTracker | None = None,
    ) -> None:
        self._state = state
        self._lock = lock
        self._reservations = reservations
        self._rows: GpuRows | None = None
        # Replaced (never mutated) by each scrape, so concurrent scrapes need no lock for it.
        self._mig_lines: tuple[int, dict[str, _MigLines]] = (-1, {})
        self._container_lines: dict[str, _ContainerLines] = {}

    def snapshot(self) -> StateSnapshot:
        state = self._state
        rows = self._rows
        layout: LayoutCopy | None = None
        with self._lock:
            if rows is None or rows.layout_version != state.layout_version:
                layout = LayoutCopy.of(state)
            g = state.gpus
            used = (g.used_slots.copy(), g.used_mem.copy(), g.used_cores.copy())
            blocked = (g.legacy.copy(), g.cordoned.copy(), g.conflict.copy(), g.healthy.copy())
            allocations = list(state.allocations())
            held = self._reservations.held() if self._reservations is not None else None
        if layout is not None:
            rows = self._rows = GpuRows.of(layout)  # concurrent scrapes: same value, either wins
        assert rows is not None
        used_slots, used_mem, used_cores = (column[rows.rows] for column in used)
        mig_pods = self._mig(allocations, rows)
        # Two pods claiming one instance would be an inconsistent state; export it once.
        lines = tuple(dict.fromkeys(line for pod in mig_pods for line in pod.lines))
        legacy, cordoned, conflict, healthy = blocked
        containers = self._containers(allocations)
        return StateSnapshot(
            rows,
            used_slots,
            used_mem,
            used_cores,
            mig_pods,
            lines,
            held,
            legacy[rows.rows],
            cordoned[rows.rows],
            conflict[rows.rows],
            healthy[rows.rows],
            containers,
        )

    def _containers(self, allocations: list[PodAllocation]) -> tuple[_ContainerLines, ...]:
        before = self._container_lines
        now: dict[str, _ContainerLines] = {}
        for alloc in allocations:
            if not alloc.devices_written:
                continue
            kept = before.get(alloc.key)
            if kept is None or kept.alloc is not alloc:
                kept = _ContainerLines.of(alloc)
            now[alloc.key] = kept
        self._container_lines = now
        return tuple(now.values())

    def _mig(self, allocations: list[PodAllocation], rows: GpuRows) -> tuple[_MigLines, ...]:
        version, before = self._mig_lines
        relayout = version != rows.layout_version  # a GPU may have gone or changed index
        now: dict[str, _MigLines] = {}
        for alloc in filter(_has_mig, allocations):
            kept = before.get(alloc.key)
            if kept is None or kept.alloc is not alloc:
                kept = None
            instances = mig_instances(alloc, rows) if kept is None or relayout else None
            if kept is None or (instances is not None and instances != kept.instances):
                assert instances is not None
                kept = _MigLines(alloc, instances, tuple(m.line() for m in instances))
            now[alloc.key] = kept
        self._mig_lines = (rows.layout_version, now)
        return tuple(now.values())

    def describe(self) -> Iterable[Metric]:
        names = [g.name for g in GPU_GAUGES]
        names += [MIG_INSTANCE_INFO, VGPU_MEMORY, VGPU_CORES, GPU_INFO, GPU_UNAVAILABLE]
        if self._reservations is not None:
            names.append(RESERVATIONS_HELD)
        return [GaugeMetricFamily(n, "") for n in names]

    def collect(self) -> Iterable[Metric]:
        snap = self.snapshot()
        families: list[Metric | None] = [_gpu_family(g, snap) for g in GPU_GAUGES]
        families.append(_mig_family(snap))
        families.extend(_container_families(snap))
        families.append(_gpu_family(GPU_INFO_GAUGE, snap))
        families.append(_unavailable_family(snap))
        if snap.reservations_held is not None:
            families.append(
                GaugeMetricFamily(
                    RESERVATIONS_HELD,
                    "Reservations made (Reserve) that the API does not show on their pods yet",
                    value=snap.reservations_held,
                )
            )
        return [f for f in families if f is not None]


# ----- scheduling --------------------------------------------------------------------------


class Outcome(enum.Enum):
    """What a PreFilter answered, by the response code the shim acts on."""

    SCHEDULABLE = "schedulable"
    UNSCHEDULABLE = "unschedulable"
    SKIPPED = "skipped"
    INVALID = "invalid"


PREFILTER_OUTCOMES: Final[dict[int, Outcome]] = {
    pb.PreFilterResponse.OK: Outcome.SCHEDULABLE,
    pb.PreFilterResponse.UNSCHEDULABLE: Outcome.UNSCHEDULABLE,
    pb.PreFilterResponse.SKIP: Outcome.SKIPPED,
    pb.PreFilterResponse.INVALID: Outcome.INVALID,
}


def reason_label(reason: Reason) -> str:
    """The ``reason`` label of a rejection kind: its name in snake case (``mig_fragmentation``)."""
    return str(reason.name).lower()


class SchedulingMetrics:
    """Latencies and counts the servicer records (its own registry when none is given)."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        reservations: ReservationTracker | None = None,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._reservations = reservations
        self.decision_seconds = Histogram(
            "tessera_scheduler_decision_duration_seconds",
            "Time PreFilter takes to decide one pod over every node (under the state lock)",
            buckets=DECISION_BUCKETS,
            registry=self.registry,
        )
        self.decision_cpu_seconds = Histogram(
            "tessera_scheduler_decision_cpu_seconds",
            "CPU time of the deciding thread for one PreFilter decision (without the waits for "
            "a CPU or the interpreter lock that the wall-clock duration includes)",
            buckets=DECISION_BUCKETS,
            registry=self.registry,
        )
        self.rpc_seconds = Histogram(
            "tessera_scheduler_rpc_duration_seconds",
            "Time the plugin server takes to answer one RPC of the shim, by method and status",
            ["method", "code"],
            buckets=RPC_BUCKETS,
            registry=self.registry,
        )
        self.decisions = Counter(
            "tessera_scheduler_decisions",
            "PreFilter answers by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self.pending_reasons = Counter(
            "tessera_scheduler_pending_reasons",
            "Unschedulable decisions, once per reason that rejected at least one node",
            ["reason"],
            registry=self.registry,
        )
        self.preemptions = Counter(
            PREEMPTIONS,
            "Preemptions kube-scheduler made for GPU pods (seen by the watch), once per need of "
            "the preemptor its victims were blocking (other: none Tessera counts)",
            ["reason"],
            registry=self.registry,
        )
        self.preemption_victims = Counter(
            PREEMPTION_VICTIMS,
            "Pods holding GPUs that kube-scheduler preempted for GPU pods (seen by the watch)",
            registry=self.registry,
        )
        self.gangs = Counter(
            GANGS,
            "Gangs by outcome: admitted (kube-scheduler placed minCount members at once), "
            "unschedulable (it could not, and the gang holds nothing), timed_out (an admitted "
            "gang let a member go before it was bound: its Permit wait ran out)",
            ["outcome"],
            registry=self.registry,
        )
        self.cycle_calls = Counter(
            "tessera_scheduler_cycle_calls",
            "Calls the Cycle stream answered, by whether they came carried in another call's "
            "message (before: the shim's Reserve sent with the next PreFilter) or in their own",
            ["carried"],
            registry=self.registry,
        )
        # Known label values start at 0, so rates and absent-alerts work from the first scrape.
        for carried in ("false", "true"):
            self.cycle_calls.labels(carried)
        for gang_outcome in GANG_OUTCOMES:
            self.gangs.labels(gang_outcome)
        for outcome in Outcome:
            self.decisions.labels(outcome.value)
        for reason in Reason:
            self.pending_reasons.labels(reason_label(reason))
        for need in NEED_LABELS:
            self.preemptions.labels(need)
        for method in RPC_METHODS:
            self.rpc_seconds.labels(method, "OK")

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        self.rpc_seconds.labels(method, code).observe(seconds)

    def observe_decision(
        self, seconds: float, pending: int = 0, *, cpu_seconds: float | None = None
    ) -> None:
        """One decision; ``pending``: its ``rejection_reasons`` when no node fits, else 0;
        ``cpu_seconds``: the deciding thread's CPU time for it."""
        self.decision_seconds.observe(seconds)
        if cpu_seconds is not None:
            self.decision_cpu_seconds.observe(cpu_seconds)
        if not pending:  # a node fits: the common case
            return
        for reason in Reason:
            if pending & reason:
                self.pending_reasons.labels(reason_label(reason)).inc()

    def count_preemption(self, needs: Sequence[str], victims: int) -> None:
        """One preemption for a GPU pod: its ``needs`` (``Preemption.needs``) and how many
        pods holding GPUs it preempted."""
        for need in needs:
            self.preemptions.labels(need).inc()
        self.preemption_victims.inc(victims)

    def count_cycle_message(self, carried: int) -> None:
        """One Cycle request: its own call and the ``carried`` calls of its ``before``."""
        self.cycle_calls.labels("false").inc()
        if carried:
            self.cycle_calls.labels("true").inc(carried)

    def count_gang(self, outcome: str) -> None:
        """One gang outcome, one of ``GANG_OUTCOMES``."""
        self.gangs.labels(outcome).inc()

    def reserved(self, key: str) -> None:
        """Reserve counted pod ``key``'s allocation (the caller holds the state's lock)."""
        if self._reservations is not None:
            self._reservations.reserved(key)

    def count_answer(self, code: int) -> None:
        """One PreFilter answer, by its ``PreFilterResponse`` code."""
        outcome = PREFILTER_OUTCOMES.get(code)
        if outcome is None:  # a metric never fails an answer; the unit tests cover every code
            log.warning("PreFilter answer code has no outcome label", code=code)
            return
        self.decisions.labels(outcome.value).inc()


# ----- exposition and HTTP ---------------------------------------------------------------------


class _Families(Collector):
    def __init__(self, families: Sequence[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


def exposition_chunks(registry: CollectorRegistry) -> list[bytes]:
    """The registry in the Prometheus text format 0.0.4, in pieces to send one after another
    (a body of 40k GPUs is ~50 MB: not copied once more to join it): rendered families as
    they are, the rest through ``prometheus_client``."""
    plain: list[Metric] = []
    rendered: list[bytes] = []
    for family in registry.collect():
        if isinstance(family, RenderedGauge):
            rendered.append(family.text())
        else:
            plain.append(family)
    return [generate_latest(_Families(plain)), *rendered]


def exposition(registry: CollectorRegistry) -> bytes:
    """``exposition_chunks`` joined."""
    return b"".join(exposition_chunks(registry))


_GZIP_WBITS: Final = 16 + zlib.MAX_WBITS  # zlib writes the gzip format


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = False  # server_close() joins the request threads: none outlives stop()
    block_on_close = True

    def __init__(
        self, address: tuple[str, int], registry: CollectorRegistry, family: socket.AddressFamily
    ) -> None:
        self.address_family = family
        self.registry = registry
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    timeout = 30  # a client that stops reading must not hold a thread (and stop()) forever

    def do_GET(self) -> None:
        if urlsplit(self.path).path != "/metrics":
            self.send_error(HTTPStatus.NOT_FOUND, "only /metrics is served here")
            return
        t0 = time.perf_counter()
        try:
            chunks = exposition_chunks(self.server.registry)
        except Exception as e:
            log.exception("metrics exposition failed", error=repr(e))
            self.send_error(HTTPStatus.INTERNAL_SERVER_ERROR, "metrics exposition failed")
            return
        size = sum(map(len, chunks))
        gzipped = "gzip" in self.headers.get("Accept-Encoding", "")
        if gzipped:
            z = zlib.compressobj(1, zlib.DEFLATED, _GZIP_WBITS)  # speed over ratio
            chunks = [*(z.compress(c) for c in chunks), z.flush()]
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", CONTENT_TYPE_PLAIN_0_0_4)
        self.send_header("Content-Length", str(sum(map(len, chunks))))
        if gzipped:
            self.send_header("Content-Encoding", "gzip")
        self.end_headers()
        for chunk in chunks:
            self.wfile.write(chunk)
        log.debug(
            "metrics scraped",
            client=self.client_address[0],
            bytes=size,
            gzip=gzipped,
            seconds=round(time.perf_counter() - t0, 4),
        )

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("metrics http", client=self.client_address[0], message=format % args)


class MetricsServer:
    """Serves ``exposition(registry)`` at ``http://HOST:PORT/metrics`` (port 0 picks one;
    ``address`` is the bound one after ``start``). The caller decides which hosts are
    acceptable; this only listens."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        if not 0 <= port <= 65535:
            raise MetricsAddressError(f"metrics port {port} is out of range 0-65535")
        self._registry = registry
        self._host = host.strip("[]")
        self._port = port
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.address = ""

    def start(self) -> None:
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        try:
            httpd = _HTTPServer((self._host, self._port), self._registry, family)
        except OSError as e:
            raise MetricsAddressError(
                f"cannot listen on {self._host}:{self._port} for metrics: {e.strerror or e}; "
                "choose another --metrics-address (or '' to serve no metrics)"
            ) from e
        self._httpd = httpd
        port = int(httpd.server_address[1])
        self.address = (
            f"[{self._host}]:{port}" if family == socket.AF_INET6 else f"{self._host}:{port}"
        )
        self._thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.2}, name="metrics-http"
        )
        self._thread.start()
        log.info("metrics listening", url=f"http://{self.address}/metrics")

    def stop(self) -> None:
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> MetricsServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def server_metrics(
    state: ClusterState, lock: AbstractContextManager[Any]
) -> tuple[CollectorRegistry, SchedulingMetrics]:
    """The plugin server's registry (its own, not ``prometheus_client``'s global one): the
    state's GPU families, the scheduling metrics (returned for the servicer to record) and
    the process' CPU and memory."""
    registry = CollectorRegistry()
    reservations = ReservationTracker(state)
    scheduling = SchedulingMetrics(registry, reservations)
    registry.register(StateCollector(state, lock, reservations))
    ProcessCollector(registry=registry)
    return registry, scheduling
