"""Reading Kubernetes objects in their plain JSON form (dicts), the way the API serves them.

Untrusted input: every accessor tolerates a missing or mistyped field (an absent value, never
an exception), and quantities are parsed within Kubernetes' own limits.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Any, Final, cast

from api.errors import short_repr


def as_object(v: object) -> dict[str, Any]:
    """A JSON object field, or {} when it is missing or not an object."""
    return cast("dict[str, Any]", v) if isinstance(v, dict) else {}


def pod_key(pod: Mapping[str, Any]) -> str:
    """``namespace/name``."""
    meta = as_object(pod.get("metadata"))
    return f"{meta.get('namespace') or 'default'}/{meta.get('name', '')}"


def annotations_of(obj: Mapping[str, Any]) -> dict[str, str]:
    """The object's annotations; non-string values (never from the API server) are left out."""
    raw = as_object(as_object(obj.get("metadata")).get("annotations"))
    return {k: v for k, v in raw.items() if isinstance(k, str) and isinstance(v, str)}


def all_containers(pod: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The pod's containers in pod order: init containers first."""
    spec = as_object(pod.get("spec"))
    out: list[dict[str, Any]] = []
    for field in ("initContainers", "containers"):
        items = spec.get(field) or []
        if isinstance(items, list):
            out.extend(as_object(c) for c in items)
    return out


def finished(pod: Mapping[str, Any]) -> bool:
    """Succeeded or Failed: its containers are gone for good (a terminating pod's are not)."""
    return as_object(pod.get("status")).get("phase") in ("Succeeded", "Failed")


def pod_priority(pod: Mapping[str, Any]) -> int:
    """``spec.priority`` (admission resolves it from the PriorityClass), 0 when unset, as
    kube-scheduler's ``PodPriority`` reads it; a value that is not a whole number counts as
    unset too."""
    value = as_object(pod.get("spec")).get("priority")
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def nominated_node(pod: Mapping[str, Any]) -> str:
    """``status.nominatedNodeName``: the node kube-scheduler's preemption made room on for a
    pod not bound yet ("" when none)."""
    value = as_object(pod.get("status")).get("nominatedNodeName")
    return value if isinstance(value, str) else ""


PREEMPTION_BY_SCHEDULER: Final = "PreemptionByScheduler"
"""The reason of the ``DisruptionTarget`` condition kube-scheduler sets on a pod it preempts,
just before it deletes the pod."""


def preempted_by_scheduler(pod: Mapping[str, Any]) -> bool:
    """The pod carries kube-scheduler's ``DisruptionTarget`` condition (True, reason
    ``PreemptionByScheduler``): it is being deleted to make room for a higher-priority pod."""
    conditions = as_object(pod.get("status")).get("conditions")
    if not isinstance(conditions, list):
        return False
    return any(
        isinstance(c, dict)
        and c.get("type") == "DisruptionTarget"
        and c.get("status") == "True"
        and c.get("reason") == PREEMPTION_BY_SCHEDULER
        for c in conditions
    )


_QUANTITY_RE: Final = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)([a-zA-Z]{0,2})$")
_SUFFIX: Final = {
    "": Decimal(1),
    "m": Decimal("0.001"),
    "k": Decimal(10**3),
    "M": Decimal(10**6),
    "G": Decimal(10**9),
    "T": Decimal(10**12),
    "P": Decimal(10**15),
    "E": Decimal(10**18),
    "Ki": Decimal(2**10),
    "Mi": Decimal(2**20),
    "Gi": Decimal(2**30),
    "Ti": Decimal(2**40),
    "Pi": Decimal(2**50),
    "Ei": Decimal(2**60),
}


# Kubernetes quantities are int64 in milli-units at most; anything larger (or 1e999999, which
# Decimal would overflow on, and 1e900000, which int() would take seconds to expand) is refused.
_QUANTITY_MAX: Final = Decimal(2**63)
_QUANTITY_MAX_ADJUSTED: Final = 24


def parse_quantity(value: object) -> Decimal:
    """A Kubernetes resource quantity ("2", "500m", "1Gi", 3) as a Decimal in base units.

    ValueError for anything else, including non-finite and out-of-range (>= 2^63) values.
    """
    if isinstance(value, bool):
        raise ValueError(f"invalid quantity {short_repr(value)}")
    if isinstance(value, int | float):
        if isinstance(value, int) and abs(value) >= _QUANTITY_MAX:
            raise ValueError(f"quantity {short_repr(value)} is out of range")
        number, suffix = Decimal(str(value)), ""
    elif isinstance(value, str):
        m = _QUANTITY_RE.match(value.strip())
        if not m or m.group(2) not in _SUFFIX:
            raise ValueError(f"invalid quantity {short_repr(value)}")
        if m.group(2) == "" and m.group(1).lower().endswith("e"):
            raise ValueError(f"invalid quantity {short_repr(value)}")
        try:
            number, suffix = Decimal(m.group(1)), m.group(2)
        except InvalidOperation as e:
            raise ValueError(f"invalid quantity {short_repr(value)}") from e
    else:
        raise ValueError(f"invalid quantity {short_repr(value)}")
    if not number.is_finite():
        raise ValueError(f"invalid quantity {short_repr(value)}")
    if number and number.adjusted() > _QUANTITY_MAX_ADJUSTED:
        raise ValueError(f"quantity {short_repr(value)} is out of range")
    q = number * _SUFFIX[suffix]
    if abs(q) >= _QUANTITY_MAX:
        raise ValueError(f"quantity {short_repr(value)} is out of range")
    return q
