"""Shared pieces of the bad-input suites (``tests/property/test_fuzz_*.py``).

- ``FuzzLedger``: cases tried, accepted, rejected (a clear error) and crashes per input
  surface; the session fixture in ``tests/property/conftest.py`` prints it and writes
  ``benchmarks/results/fuzz.json``. A crash is any exception escaping a case that is not the
  surface's documented error, or a broken invariant (e.g. an unrelated pod's state changed).
- ``fuzz_settings``: hypothesis settings sized for ``make unit`` (every suite together under a
  minute on a 2-core machine); ``TESSERA_FUZZ_EXAMPLES=N`` runs N examples per test instead.
- Strategies of hostile values: arbitrary JSON, strings that break naive decoders, and
  mutations of valid wire values (a subtree replaced, characters edited).
- The worlds hostile inputs land in: a small cluster with running pods as the plugin server
  sees it (``cluster``), and one node as its agent sees it (``agent_node``: simulated GPUs, an
  in-memory API, the real Allocator and MIG manager, a running pod whose state must survive).
"""

from __future__ import annotations

import copy
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from api.hami import keys as ann
from api.hami.config import DeviceConfig, NodeConfig
from api.hami.devices import (
    DeviceAlloc,
    MigAllocation,
    RuntimeIdentity,
    decode_mig_allocations,
    encode_devices,
    encode_mig_allocations,
)
from api.hami.keys import GpuMode
from api.hami.register import GpuDevice, Placement, encode
from node_agent.allocator import Allocator
from node_agent.mig_manager import MigManager
from node_agent.mps import MpsDaemons, SimulatedMps
from node_agent.nvml.simulated import SimulatedGpuSpec, SimulatedNvml
from scheduler_plugins.core.cache import ClusterCache
from tests.builders import gpu, make_pod, mig_gpu
from tests.node_agent_fakes import FakeKube
from tests.node_agent_fakes import make_pod as agent_pod

EXAMPLES_ENV = "TESSERA_FUZZ_EXAMPLES"
RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "fuzz.json"

Outcome = Literal["accepted", "rejected"]
MAX_MESSAGE = 2000


def examples_override() -> int | None:
    """``TESSERA_FUZZ_EXAMPLES`` (examples per test, for long runs), or None when unset."""
    raw = os.environ.get(EXAMPLES_ENV, "")
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{EXAMPLES_ENV}={raw!r}: expected a positive integer")
    return int(raw)


def examples(default: int) -> int:
    """Examples per test: ``default``, or ``TESSERA_FUZZ_EXAMPLES`` when set."""
    return examples_override() or default


def rare(n: int) -> st.SearchStrategy[bool]:
    """True about once in ``n`` draws. (``st.integers(0, n) == 0`` is not rare: hypothesis
    favours the simplest value, 0, so the event would fire far more often.)"""
    return st.integers(1, n).map(lambda i: i == n)


def fuzz_settings(default_examples: int) -> settings:
    return settings(
        max_examples=examples(default_examples),
        deadline=None,
        # The test command is reproducible; TESSERA_FUZZ_RANDOM=1 explores new seeds.
        derandomize=os.environ.get("TESSERA_FUZZ_RANDOM") != "1",
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
            HealthCheck.large_base_example,
        ],
    )


# ----- the ledger --------------------------------------------------------------------------


@dataclass
class SurfaceTally:
    cases: int = 0
    accepted: int = 0
    rejected: int = 0
    crashes: int = 0
    first_crash: str = ""


@dataclass
class Case:
    """One input; the body says how it ended (``accepted`` is the default)."""

    outcome: Outcome = "accepted"
    message: str = ""

    def rejected(self, message: str) -> None:
        """The input was refused with ``message``, which must say what was wrong in a few
        lines, however large the input (a megabyte value is not echoed back)."""
        assert message.strip(), "a rejection must carry a message naming the problem"
        assert len(message) <= MAX_MESSAGE, f"{len(message)}-character message: {message[:300]}"
        self.outcome = "rejected"
        self.message = message


@dataclass
class FuzzLedger:
    surfaces: dict[str, SurfaceTally] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    started_cpu: float = field(default_factory=time.process_time)

    @contextmanager
    def case(self, surface: str) -> Iterator[Case]:
        tally = self.surfaces.setdefault(surface, SurfaceTally())
        tally.cases += 1
        case = Case()
        try:
            yield case
        except Exception as e:
            tally.crashes += 1
            if not tally.first_crash:
                tally.first_crash = f"{type(e).__name__}: {e}"[:500]
            raise
        except BaseException:
            tally.cases -= 1  # hypothesis abandoned the example mid-draw: not a case
            raise
        if case.outcome == "accepted":
            tally.accepted += 1
        else:
            tally.rejected += 1

    def report(self) -> dict[str, Any]:
        return {
            "what": (
                "bad-input suites (tests/property/test_fuzz_*.py): cases tried per input "
                "surface, how many were accepted or cleanly rejected, and crashes (an "
                "unexpected exception or a broken invariant); must be 0"
            ),
            "examples_per_test": examples_override() or "each suite's default",
            # Wall time depends on what else the machine runs; CPU time (this process,
            # hypothesis is single-threaded) is the figure to budget by.
            "seconds": round(time.monotonic() - self.started, 1),
            "cpu_seconds": round(time.process_time() - self.started_cpu, 1),
            "total_cases": sum(t.cases for t in self.surfaces.values()),
            "total_crashes": sum(t.crashes for t in self.surfaces.values()),
            "surfaces": {
                name: {
                    "cases": t.cases,
                    "accepted": t.accepted,
                    "rejected": t.rejected,
                    "crashes": t.crashes,
                    **({"first_crash": t.first_crash} if t.first_crash else {}),
                }
                for name, t in sorted(self.surfaces.items())
            },
        }

    def summary_lines(self) -> list[str]:
        r = self.report()
        lines = [
            f"fuzz: {r['total_cases']} cases, {r['total_crashes']} crashes in {r['seconds']} s "
            f"({r['cpu_seconds']} s CPU; written to {RESULTS.relative_to(RESULTS.parents[2])})"
        ]
        for name, t in r["surfaces"].items():
            lines.append(
                f"  {name:<28} cases {t['cases']:>6}  accepted {t['accepted']:>6}  "
                f"rejected {t['rejected']:>6}  crashes {t['crashes']}"
            )
        return lines

    def write(self, path: Path = RESULTS) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.report(), indent=2) + "\n")
        tmp.replace(path)


# ----- hostile values ----------------------------------------------------------------------

# Strings that break naive decoders: unicode digits int() refuses, ints past int()'s 4300-digit
# limit, exponents Decimal overflows on, trailing newlines '$' lets through, deep nesting,
# separators of the device-list format, BOM, NUL, surrogates of JSON escapes.
NASTY = (
    "\u00b2",
    "\u0663",
    "\n",
    "1" * 5000,
    "[" * 3000,
    "{" * 3000,
    '{"a":' * 2000,
    "1e999999999",
    "1e900000",
    "-1",
    "NaN",
    "Infinity",
    "-0",
    "\ufeff",
    "\x00",
    '"\\ud800"',
    ",",
    ":",
    ";",
    "GPU-",
    "MIG-",
    "null",
    "true",
    "[]",
    "{}",
    "2147483648",
    "9" * 20,
    "x" * 20_000,
)

nasty_text = st.lists(st.sampled_from(NASTY) | st.text(max_size=3), max_size=4).map("".join)


def _containers(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)


json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(-(2**70), 2**70)
    | st.floats()
    | st.text(max_size=12)
    | st.sampled_from(["GPU-0", "MIG-1", "2g.10gb", "hami-core", "mig", "allocating"])
)
json_values = st.recursive(json_scalars, _containers, max_leaves=12)
garbage_text = st.one_of(st.text(max_size=200), nasty_text, json_values.map(json.dumps))


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    elif isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    return out


def mutate_json(value: Any, data: st.DataObject) -> Any:
    """Replace or delete the value at one random path of a JSON document (in place)."""
    path = data.draw(st.sampled_from(_paths(value)), label="path")
    new = data.draw(json_values | nasty_text, label="new value")
    if not path:
        return new
    parent = value
    for p in path[:-1]:
        parent = parent[p]
    if isinstance(parent, dict) and data.draw(st.booleans(), label="delete"):
        del parent[path[-1]]
    else:
        parent[path[-1]] = new
    return value


def mutate_text(text: str, data: st.DataObject) -> str:
    """A few random edits (insert, delete, replace up to 4 characters)."""
    for _ in range(data.draw(st.integers(1, 4), label="edits")):
        i = data.draw(st.integers(0, len(text)), label="at")
        j = data.draw(st.integers(i, min(len(text), i + 4)), label="to")
        text = text[:i] + data.draw(st.text(max_size=4) | st.sampled_from(NASTY)) + text[j:]
    return text


def hostile_variant(canonical: str, data: st.DataObject, *, is_json: bool) -> str:
    """``canonical`` itself, a mutation of it, or unrelated garbage."""
    how = data.draw(st.sampled_from(["keep", "text", "json", "garbage"]), label="variant")
    if how == "keep":
        return canonical
    if how == "garbage":
        return data.draw(garbage_text, label="garbage")
    if how == "json" and is_json:
        return json.dumps(mutate_json(json.loads(canonical), data))
    return mutate_text(canonical, data)


# ----- a small cluster with running pods, as the plugin server sees it ---------------------

CONFIG = DeviceConfig()
GA0, GA1, GB0, GC0 = "GPU-a0", "GPU-a1", "GPU-b0", "GPU-c0"
NODES: dict[str, tuple[GpuDevice, ...]] = {
    "node-a": (gpu(GA0, mem=32768), gpu(GA1, index=1, mem=32768)),
    "node-b": (mig_gpu(GB0),),
    "node-c": (gpu(GC0, mem=16384),),
}
MIG_RESERVATION = MigAllocation(
    0, 0, GB0, "2g.10gb", Placement(0, 2), RuntimeIdentity("MIG-victim", 3, 0)
)


def node_obj(name: str, register: str | None = None) -> dict[str, Any]:
    value = register if register is not None else encode(NODES.get(name, ()))
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "annotations": {ann.NODE_REGISTER: value}},
        "status": {"allocatable": {"cpu": "16", "memory": "64Gi"}},
    }


def bound_pod(
    name: str, node: str, devices: tuple[tuple[DeviceAlloc, ...], ...], **extra: str
) -> dict[str, Any]:
    pod = make_pod(name)
    for container in devices:
        pod.gpu(len(container))
    pod.on(node)
    pod.annotate(ann.VGPU_NODE, node)
    pod.annotate(ann.BIND_PHASE, "success")
    pod.annotate(ann.BIND_TIME, "1700000000")
    pod.annotate(ann.DEVICES_ALLOCATED, encode_devices(devices))
    pod.annotate(ann.DEVICES_TO_ALLOCATE, ";" * len(devices))
    for k, v in extra.items():
        pod.annotate(k, v)
    return pod.build()


VICTIMS = {
    "victim-a": bound_pod("victim-a", "node-a", ((DeviceAlloc(GA0, 4000, 30),),)),
    "victim-b": bound_pod(
        "victim-b",
        "node-b",
        ((DeviceAlloc(GB0, 9984, 0),),),
        **{ann.MIG_ALLOCATIONS: encode_mig_allocations([MIG_RESERVATION])},
    ),
    "victim-c": bound_pod("victim-c", "node-c", ((DeviceAlloc(GC0, 2000, 10),),)),
}
VICTIM_KEYS = tuple(f"default/{n}" for n in VICTIMS)


def cluster() -> ClusterCache:
    cache = ClusterCache(CONFIG, clock=time.monotonic)
    for name in NODES:
        cache.apply_node(node_obj(name))
    for pod in VICTIMS.values():
        cache.apply_pod(copy.deepcopy(pod))
    return cache


# ----- one node as its agent sees it: simulated GPUs, the API's pods, a running pod ------------

AGENT_NODE = "node-a"
HC0, HC1 = "GPU-hc000000-0000-0000-0000-000000000000", "GPU-hc111111-1111-1111-1111-111111111111"
MG0, MG1 = "GPU-mg000000-0000-0000-0000-000000000000", "GPU-mg111111-1111-1111-1111-111111111111"
MP0, MP1 = "GPU-mp000000-0000-0000-0000-000000000000", "GPU-mp111111-1111-1111-1111-111111111111"
V100, A100 = "Tesla V100-PCIE-32GB", "A100-PCIE-40GB"


@dataclass
class AgentNode:
    """A node agent's world: GPUs, the API (an in-memory double), its Allocator, and a
    pod already running there (``victim``) whose state no other pod's input may change."""

    mode: GpuMode
    backend: SimulatedNvml
    kube: FakeKube
    allocator: Allocator
    mig: MigManager
    gpus: tuple[str, str]
    victim_path: str
    victim_annotations: dict[str, str]
    victim_identity: RuntimeIdentity | None

    def victim_instance_intact(self) -> bool:
        """The running pod's MIG instance is still in NVML exactly as recorded."""
        rt = self.victim_identity
        if rt is None:
            return True
        gis = {g.id: g for g in self.backend.gpu_instances(0)}
        if rt.gpu_instance_id not in gis or gis[rt.gpu_instance_id].placement != Placement(0, 2):
            return False
        cis = self.backend.compute_instances(0, rt.gpu_instance_id)
        if not any(c.id == rt.compute_instance_id for c in cis):
            return False
        uuid = self.backend.mig_device_uuid(0, rt.gpu_instance_id, rt.compute_instance_id)
        return uuid == rt.mig_uuid

    def instances_all_managed(self) -> bool:
        """Every GPU instance in NVML is one the MIG manager owns: nothing leaked."""
        if self.mode != "mig":
            return True
        in_nvml = {
            (i, g.placement.start, g.placement.size)
            for i in range(self.backend.device_count())
            for g in self.backend.gpu_instances(i)
        }
        managed = {(k.gpu_index, k.start, k.size) for k in self.mig.instances()}
        return in_nvml == managed


def agent_node(mode: GpuMode) -> AgentNode:
    """A hami-core or MPS node (two V100s; MPS with its simulated daemons up) or a MIG node
    (two A100-40GB) with one running pod: 4000 MiB of GPU 0, or a 2g.10gb instance at slices
    [0,2) of GPU 0 created by the agent."""
    gpus = {"hami-core": (HC0, HC1), "mig": (MG0, MG1), "mps": (MP0, MP1)}[mode]
    model = A100 if mode == "mig" else V100
    backend = SimulatedNvml([SimulatedGpuSpec(model, uuid=u) for u in gpus], None)
    backend.init()
    kube = FakeKube()
    config = DeviceConfig(nodeconfig=(NodeConfig(AGENT_NODE, mode),))
    mig = MigManager(backend, node_name=AGENT_NODE)
    mps = None
    if mode == "mps":
        mps = MpsDaemons(SimulatedMps(node_name=AGENT_NODE), node_name=AGENT_NODE)
        mps.sync(gpus)
    allocator = Allocator(
        AGENT_NODE, kube, backend, mig, config, cache_name=lambda: "fuzz", mps=mps
    )
    if mode != "mig":
        victim = agent_pod("victim", devices=[[(gpus[0], 4000, 30)]])
    else:
        victim = agent_pod(
            "victim",
            devices=[[(gpus[0], 9984, 0)]],
            mig=[MigAllocation(0, 0, gpus[0], "2g.10gb", Placement(0, 2))],
        )
    path = kube.add_pod(victim)
    allocator.allocate_next("default", "victim")
    annotations = kube.annotations(path)
    assert annotations[ann.BIND_PHASE] == "success"
    identity = None
    if mode == "mig":
        [record] = decode_mig_allocations(annotations[ann.MIG_ALLOCATIONS])
        identity = record.runtime
    kube.patches.clear()
    return AgentNode(
        mode, backend, kube, allocator, mig, gpus, path, annotations, identity
    )  # fmt: skip
