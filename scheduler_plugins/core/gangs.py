"""Gangs as the plugin server sees them: what PreFilter last found for each member of each
gang, so that an unschedulable gang can say which members could not be placed and why.

kube-scheduler 1.36 schedules a gang (a PodGroup with a gang policy) in one cycle: each
member in turn runs PreFilter (seeing the trial reservations of the members before it),
Reserve and Permit, and the whole cycle is reverted unless ``minCount`` members fit. So a
gang that does not fit holds no GPU after its cycle, and the members' last PreFilter answers
are exactly the gang's story. ``GangBook`` keeps them (bounded: the least recently offered
gangs go first) and tells once per admission when an admitted gang lost a member before it
was bound (its Permit wait ran out, or it was rejected).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from api.kube.objects import as_object

PODGROUP_API: Final = "scheduling.k8s.io/v1alpha2"  # kube-scheduler 1.36's PodGroups (alpha)
DEFAULT_MAX_GANGS: Final = 4096
_MAX_NAMED: Final = 5  # members named in a summary; the rest are counted


def pod_gang(pod: Mapping[str, Any]) -> str | None:
    """The gang a pod belongs to, ``namespace/podGroupName`` (``spec.schedulingGroup``), or
    None when it names none."""
    group = as_object(as_object(pod.get("spec")).get("schedulingGroup")).get("podGroupName")
    if not isinstance(group, str) or not group:
        return None
    namespace = as_object(pod.get("metadata")).get("namespace") or "default"
    return f"{namespace}/{group}"


@dataclass
class _Gang:
    # member pod key -> None when its GPU request fit, else why not (insertion: offer order)
    members: OrderedDict[str, str | None] = field(default_factory=OrderedDict)
    admitted: bool = False  # since kube-scheduler admitted it, no member was let go


class GangBook:
    """The members of each gang and what PreFilter last found for each (not thread-safe:
    the caller serializes)."""

    def __init__(self, max_gangs: int = DEFAULT_MAX_GANGS) -> None:
        self._gangs: OrderedDict[str, _Gang] = OrderedDict()
        self._gang_of: dict[str, str] = {}
        self._max = max_gangs

    def offered(self, gang: str, pod: str, why_not: str | None) -> None:
        """PreFilter decided member ``pod`` of ``gang``: its GPU request fits (``why_not``
        None) or not, and why."""
        g = self._gangs.get(gang)
        if g is None:
            g = self._gangs[gang] = _Gang()
            while len(self._gangs) > self._max:
                _, old = self._gangs.popitem(last=False)
                for member in old.members:
                    self._gang_of.pop(member, None)
        self._gangs.move_to_end(gang)
        g.members[pod] = why_not
        self._gang_of[pod] = gang

    def gang_of(self, pod: str) -> str | None:
        return self._gang_of.get(pod)

    def admitted(self, gang: str) -> None:
        """kube-scheduler admitted ``gang`` (its members go on to bind)."""
        g = self._gangs.get(gang)
        if g is not None:
            g.admitted = True

    def released(self, pod: str) -> str | None:
        """Member ``pod`` of an admitted gang was let go before it was bound: its gang, the
        first time this happens since the gang was admitted; else None."""
        gang = self._gang_of.get(pod)
        g = self._gangs.get(gang) if gang is not None else None
        if g is None or not g.admitted:
            return None
        g.admitted = False
        return gang

    def forget(self, gang: str) -> None:
        g = self._gangs.pop(gang, None)
        if g is not None:
            for member in g.members:
                self._gang_of.pop(member, None)

    def summary(self, gang: str, min_count: int | None) -> str:
        """Which members fit their GPU requests and which did not, and why."""
        g = self._gangs.get(gang)
        members = g.members if g is not None else OrderedDict[str, str | None]()
        failed = [(pod, why) for pod, why in members.items() if why is not None]
        fit = len(members) - len(failed)
        name = f"gang {gang}" + (f" (minCount {min_count})" if min_count is not None else "")
        if not members:
            return f"{name}: Tessera has not seen a member yet"
        if not failed:
            return (
                f"{name}: all {fit} members fit their GPU requests; kube-scheduler's other "
                "plugins (CPU, memory, affinity, ...) rejected the rest"
            )
        named = "; ".join(f"{pod}: {why}" for pod, why in failed[:_MAX_NAMED])
        more = f"; and {len(failed) - _MAX_NAMED} more" if len(failed) > _MAX_NAMED else ""
        return (
            f"{name}: {fit} of {len(members)} members fit their GPU requests, each seeing "
            f"the ones before it placed; not placed: {named}{more}"
        )


def gang_policy(podgroup: Mapping[str, Any]) -> int | None:
    """A PodGroup's gang ``minCount``; None when its policy is not a gang or is malformed."""
    policy = as_object(as_object(podgroup.get("spec")).get("schedulingPolicy"))
    count = as_object(policy.get("gang")).get("minCount")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        return None
    return count


def scheduled_condition(podgroup: Mapping[str, Any]) -> tuple[str, str] | None:
    """kube-scheduler's ``PodGroupScheduled`` condition of a PodGroup: (status, reason), or
    None when it has none yet."""
    conditions = as_object(podgroup.get("status")).get("conditions")
    if not isinstance(conditions, list):
        return None
    for c in conditions:
        c = as_object(c)
        if c.get("type") == "PodGroupScheduled":
            return str(c.get("status", "")), str(c.get("reason", ""))
    return None
