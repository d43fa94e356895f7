"""What the scheduler writes on a pod at bind, from its plan: the annotations and the label."""

from __future__ import annotations

from api.hami import keys as ann
from api.hami.devices import (
    encode_bind_time,
    encode_devices,
    encode_mig_allocations,
)
from scheduler_plugins.core.decide import PodPlan


def bind_annotations(plan: PodPlan, *, bind_time: int | None = None) -> dict[str, str]:
    """Everything written in the PreBind patch; time-dependent keys only with ``bind_time``."""
    devices = encode_devices(plan.device_allocs())
    out = {
        ann.VGPU_NODE: plan.node,
        ann.DEVICES_ALLOCATED: devices,
        ann.DEVICES_TO_ALLOCATE: devices,
    }
    mig = plan.allocation().mig
    if mig:
        out[ann.MIG_ALLOCATIONS] = encode_mig_allocations(mig)
    if bind_time is not None:
        out[ann.BIND_TIME] = encode_bind_time(bind_time)
        out[ann.BIND_PHASE] = "allocating"
    return out


def bind_labels(plan: PodPlan) -> dict[str, str]:
    """The pod labels written with the annotations: ``hami.io/vgpu-node``, as HAMi writes it
    (its monitor lists a node's GPU pods by it), where the node's name can be a label value."""
    return ann.vgpu_node_labels(plan.node)
