"""The policy names of the contract: ``hami.io/node-scheduler-policy`` and
``hami.io/gpu-scheduler-policy`` values, and the device config's MIG placement strategy.
Parsed once at the edge; an unknown name fails with the list of valid ones."""

from __future__ import annotations

from enum import StrEnum

from api.errors import short_repr


class Policy(StrEnum):
    """Where to put load: binpack takes the highest usage score, spread the lowest."""

    BINPACK = "binpack"
    SPREAD = "spread"

    @classmethod
    def parse(cls, name: str, *, what: str = "policy") -> Policy:
        try:
            return cls(name)
        except ValueError:
            valid = ", ".join(p.value for p in cls)
            raise ValueError(f"unknown {what} {short_repr(name)}; valid: {valid}") from None

    @property
    def sign(self) -> float:
        """Multiply a usage score by this to get 'higher is better'."""
        return 1.0 if self is Policy.BINPACK else -1.0


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
