"""The policy values of the contract: ``hami.io/node-scheduler-policy``,
``hami.io/gpu-scheduler-policy`` (a chain of sort keys and filters),
``hami.io/device-scoring-weights``, and the device config's MIG placement strategy. Parsed once
at the edge; an unknown name fails with the list of valid ones."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from api.errors import short_repr


class Policy(StrEnum):
    """Where to put load: binpack takes the highest usage score, spread the lowest (HAMi's
    two); fragmentation (Tessera's) the node and GPU where the pod strands the least capacity
    the workload could use (``scheduler_plugins.core.fragmentation``)."""

    BINPACK = "binpack"
    SPREAD = "spread"
    FRAGMENTATION = "fragmentation"

    @classmethod
    def parse(cls, name: str, *, what: str = "policy") -> Policy:
        try:
            return cls(name)
        except ValueError:
            valid = ", ".join(p.value for p in cls)
            raise ValueError(f"unknown {what} {short_repr(name)}; valid: {valid}") from None

    @property
    def sign(self) -> float:
        """Multiply a usage score by this to get 'higher is better' (fragmentation's score is
        one already)."""
        return -1.0 if self is Policy.SPREAD else 1.0


class PlacementStrategy(StrEnum):
    """How a placement is chosen inside the profile the contract picked."""

    FRAGMENTATION_AWARE = "fragmentation-aware"
    LOWEST_START = "lowest-start"
    # HAMi v2.10's fixed order: 1g and 3g profiles try the highest start first, all others
    # the lowest start first.
    HAMI_V2_10 = "hami-v2.10"

    @classmethod
    def parse(cls, name: str) -> PlacementStrategy:
        """The strategy named ``name``; an unknown name raises ValueError listing valid ones."""
        try:
            return cls(name)
        except ValueError:
            valid = ", ".join(s.value for s in cls)
            raise ValueError(
                f"unknown MIG placement strategy {short_repr(name)}; valid strategies: {valid}"
            ) from None


class GpuSortKey(StrEnum):
    """A sort key of ``hami.io/gpu-scheduler-policy``: which of a node's GPUs a device takes
    first. binpack: the highest GPU score; spread: the lowest; numa: the highest NUMA node."""

    BINPACK = "binpack"
    SPREAD = "spread"
    NUMA = "numa"


MUTEX: Final = "mutex"
TOPOLOGY_AWARE: Final = "topology-aware"
GPU_POLICY_NAMES: Final = (*(k.value for k in GpuSortKey), MUTEX, TOPOLOGY_AWARE)


@dataclass(frozen=True)
class GpuPolicy:
    """A ``hami.io/gpu-scheduler-policy`` value (HAMi v2.10): a comma chain of sort keys,
    applied in the order written, and filters. ``mutex``: only GPUs nothing holds;
    ``topology_aware``: a multi-GPU container takes the best-connected set of the GPUs that
    fit (``hami.io/node-nvidia-score``), a one-GPU container the least connected one."""

    keys: tuple[GpuSortKey, ...] = (GpuSortKey.SPREAD,)
    mutex: bool = False
    topology_aware: bool = False
    # Written as a chain (a comma, or numa alone): HAMi then breaks ties by the keys written
    # and the GPU index only; a single name breaks score ties by NUMA node first.
    chain: bool = False

    @classmethod
    def parse(cls, value: str, *, default: GpuPolicy | None = None) -> GpuPolicy:
        """Names separated by commas, spaces around them allowed, repeats ignored; a chain with
        no sort key sorts by spread (``default``'s keys when the value names no policy at all).
        An unknown name raises ValueError listing the valid ones: HAMi would silently sort
        such a pod by spread."""
        names = [n.strip() for n in value.split(",")]
        if all(n == "" for n in names):
            return default or cls()
        keys: list[GpuSortKey] = []
        mutex = topology = False
        for name in names:
            if name == "":
                continue
            if name == MUTEX:
                mutex = True
            elif name == TOPOLOGY_AWARE:
                topology = True
            elif name in GPU_POLICY_NAMES:
                key = GpuSortKey(name)
                if key not in keys:
                    keys.append(key)
            else:
                valid = ", ".join(GPU_POLICY_NAMES)
                raise ValueError(
                    f"unknown GPU policy {short_repr(name)}; valid (alone or in a comma "
                    f"chain): {valid}"
                )
        chain = "," in value or value.strip() == GpuSortKey.NUMA
        return cls(tuple(keys) or (GpuSortKey.SPREAD,), mutex, topology, chain)

    def numa_first(self) -> GpuPolicy:
        """The chain with numa moved to the front (``nvidia.com/numa-bind``)."""
        rest = tuple(k for k in self.keys if k is not GpuSortKey.NUMA)
        return GpuPolicy((GpuSortKey.NUMA, *rest), self.mutex, self.topology_aware, self.chain)

    @property
    def score_sign(self) -> float:
        """+1 when the first score key is binpack (higher GPU score first), -1 for spread, 0
        when the chain has none (GPUs then go by NUMA node and index only)."""
        for key in self.keys:
            if key is GpuSortKey.BINPACK:
                return 1.0
            if key is GpuSortKey.SPREAD:
                return -1.0
        return 0.0

    @property
    def numa_rank(self) -> int:
        """Where numa sorts: 0 before the GPU score, 1 after it (also for a single name: HAMi
        breaks its score ties by NUMA node), -1 not at all."""
        if GpuSortKey.NUMA not in self.keys:
            return -1 if self.chain else 1
        first_score = next(
            (i for i, k in enumerate(self.keys) if k is not GpuSortKey.NUMA), len(self.keys)
        )
        return 0 if self.keys.index(GpuSortKey.NUMA) < first_score else 1

    @property
    def numa_groups_ascending(self) -> bool:
        """``nvidia.com/numa-bind`` tries NUMA nodes from the lowest: HAMi's order for the
        single name binpack (every other policy tries the highest first)."""
        rest = tuple(k for k in self.keys if k is not GpuSortKey.NUMA)
        return not self.chain and rest == (GpuSortKey.BINPACK,)

    def __str__(self) -> str:
        names = [k.value for k in self.keys]
        names += [MUTEX] if self.mutex else []
        names += [TOPOLOGY_AWARE] if self.topology_aware else []
        return ",".join(names)


_WEIGHT_KEYS: Final = ("slot", "core", "memory")


@dataclass(frozen=True)
class ScoringWeights:
    """``hami.io/device-scoring-weights``: how much each share counts in the GPU score."""

    slot: int = 1
    core: int = 1
    memory: int = 1

    @property
    def default(self) -> bool:
        return self == ScoringWeights()

    @classmethod
    def parse(cls, value: str) -> ScoringWeights:
        """``slot=1,core=1,memory=3``: exactly these three keys, in any order, spaces around
        allowed, whole numbers >= 0, not all 0 (HAMi v2.10's rules). ValueError names the
        problem."""
        parts = value.split(",")
        if len(parts) != len(_WEIGHT_KEYS):
            raise ValueError(
                f"{short_repr(value)}: expected exactly slot=N,core=N,memory=N, got "
                f"{len(parts)} item(s)"
            )
        got: dict[str, int] = {}
        for part in parts:
            key, sep, raw = part.partition("=")
            key, raw = key.strip(), raw.strip()
            if not sep:
                raise ValueError(f"{short_repr(part.strip())}: expected key=N")
            if key in got:
                raise ValueError(f"{short_repr(key)} given twice")
            if key not in _WEIGHT_KEYS:
                raise ValueError(
                    f"unknown weight {short_repr(key)}; the keys are slot, core, memory"
                )
            sign = raw[:1] if raw[:1] in "+-" else ""
            digits = raw[len(sign) :]
            if not digits.isascii() or not digits.isdigit() or len(digits) > 18:
                raise ValueError(f"{key}: {short_repr(raw)} is not a whole number")
            number = int(raw)
            if number < 0:
                raise ValueError(f"{key}: {number} is negative")
            got[key] = number
        if not any(got.values()):
            raise ValueError("slot, core and memory are all 0: nothing would be scored")
        return cls(got["slot"], got["core"], got["memory"])
