"""Strategy tables: binpack/spread as table entries, parsed once at the edge."""

from __future__ import annotations

from enum import StrEnum

from scheduler_plugins.errors import short_repr


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
