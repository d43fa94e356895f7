"""Which pod a kubelet Allocate call is for, found without a node-wide lock.

The kubelet's PreferredAllocationRequest and AllocateRequest carry device ids only
(``<gpu uuid>-<slot>``, ids this agent advertised), never the pod, and the kubelet takes
the ids of an Allocate from what GetPreferredAllocation answered (or picks its own when
the answer is short). HAMi serializes every bind on a node behind a node annotation lock to
know the pod; Tessera instead identifies the pod by the one thing the request does carry
that the scheduler decided: the number of devices the container asks.

The rule (one container request at a time) is the contract's (``api.hami.matching``): the
candidates are this node's allocating pods, each with its *next container*, and a candidate
matches a request of ``n`` device ids when its next container asks ``n`` devices. The GPU
UUIDs of the ids do not decide anything: they are only right when GetPreferredAllocation
steered the kubelet to them, which it can only do for the same unique candidate (below), so
matching on them would add no certainty. Applied here:

- Exactly one match: that pod. Several that are all interchangeable (the contract's rule 4:
  one GPU container each, entries equal but for their GPUs, same selectors, resources and
  HAMi-core switch; for MIG, one profile per device and nothing realized yet): the one
  whose GPUs the request's ids name (else the first), its
  ``siblings`` naming the others, for the correction from the kubelet's PodResources
  (``node_agent.identities``). Otherwise several, or a candidate whose annotations cannot
  be read (it might be the one): the request is ambiguous and Allocate fails with
  ``AmbiguousPodError`` instead of guessing. Pods are reported in kubelet admission order
  (``hami.io/bind-time``, then creation time).
- GetPreferredAllocation (``preferred_gpus``) applies the same rule to its
  ``allocation_size``: when exactly one candidate's next container asks that many devices,
  the preferred ids are slots of the GPUs that container reserved (with multiplicity), so
  the kubelet's slot accounting follows the scheduler's; otherwise the agent falls back to
  spreading over GPUs (``ids.prefer_spread``).

Whatever pod is matched, the devices and limits handed out come from *that pod's* own
to-allocate entry, never from the request's ids or from another pod.

What it cannot tell apart: two allocating pods on one node whose next containers ask the
same device count, whatever their GPUs (e.g. both ``nvidia.com/gpu: 1``, one on GPU-A and
one on GPU-B), unless they are interchangeable. Pods whose next containers ask different
device counts are told apart and bind concurrently on one node, and so do interchangeable
ones (replicas of one workload). ``api.hami.matching.ambiguous`` says whether two pods could
ever be in that situation (any of their remaining containers asks the same count and they
are not interchangeable), so the scheduler keeps exactly such pairs from being allocating on
one node at the same time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from api.errors import TemporaryError
from api.hami.keys import BIND_PHASE
from api.hami.matching import Match, asking, choose
from node_agent.deviceplugin.ids import gpu_of


class PodMatchError(TemporaryError):
    """No single pod can be named for an Allocate request; the kubelet should retry."""


class NoMatchingPodError(PodMatchError):
    """No allocating pod on this node waits for exactly these GPUs."""


class AmbiguousPodError(PodMatchError):
    """Several allocating pods wait for exactly these GPUs; refusing to guess."""


def requested_gpus(device_ids: Iterable[str]) -> Counter[str]:
    """GPU UUIDs of the request's device ids, with multiplicity (InvalidDeviceIdError)."""
    return Counter(gpu_of(d)[0] for d in device_ids)


def match_pod(
    pods: Iterable[Mapping[str, Any]], node_name: str, device_ids: Sequence[str]
) -> Match:
    """The pod and container one container request of an Allocate call is for."""
    wanted = requested_gpus(device_ids)  # validates the ids
    size = len(device_ids)
    if not size:
        raise NoMatchingPodError("the Allocate request names no devices")
    matches, unreadable = asking(pods, node_name, size)
    if len(matches) == 1 and not unreadable:
        return matches[0]
    picked = None if unreadable else choose(matches, wanted)
    if picked is not None:
        return picked
    if not matches:
        extra = (
            f"; skipped pods with unreadable annotations: {'; '.join(unreadable)}"
            if unreadable
            else ""
        )
        raise NoMatchingPodError(
            f"no pod on node {node_name} with {BIND_PHASE}=allocating has a next GPU "
            f"container asking {size} device(s) (request: {_describe(wanted)[:300]}){extra[:600]}"
        )
    who = ", ".join(m.key for m in matches)
    extra = f"; pods with unreadable annotations: {'; '.join(unreadable)}" if unreadable else ""
    raise AmbiguousPodError(
        f"pods {who} on node {node_name} all wait to allocate a container asking {size} "
        f"device(s){extra}; refusing to guess (the scheduler serializes such pods)"
    )


def preferred_gpus(
    pods: Iterable[Mapping[str, Any]], node_name: str, size: int
) -> Counter[str] | None:
    """GPU UUIDs (with multiplicity) GetPreferredAllocation should steer ``size`` ids to.

    Those of the next container of the unique candidate whose next container asks ``size``
    devices, or of the first of several interchangeable ones; None when there is no such
    candidate (or a candidate is unreadable).
    """
    if size <= 0:
        return None
    matches, unreadable = asking(pods, node_name, size)
    if unreadable or not matches:
        return None
    picked = matches[0] if len(matches) == 1 else choose(matches)
    if picked is None:
        return None
    return Counter(d.uuid for d in picked.devices)


def _describe(wanted: Counter[str]) -> str:
    return ", ".join(f"{uuid}×{n}" if n > 1 else uuid for uuid, n in sorted(wanted.items()))
