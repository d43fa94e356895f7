"""The MIG instance manager: realizes, adopts and reclaims the GI/CI instances of reservations.

It owns the node's map of *managed* MIG instances and is the only code that mutates MIG
hardware. It is pure apart from the injected ``NvmlBackend`` (which must be initialized):
no Kubernetes client and no clock; callers read the API and pass what they read.

Design
------
- Key of a managed instance: ``InstanceKey(gpu_index, profile, start, size)`` — the physical
  GPU (resolved from the reservation's ``gpuUUID``), the profile name and the exact placement.
  ``ManagedInstance(key, owner, identity, adopted)`` records who owns it (``Owner`` = pod key,
  container index, device index), its runtime identity (MIG UUID, GI id, CI id) and whether it
  was taken over rather than created by this manager.
- ``Reservation`` = owning pod key + its ``MigAllocation``. ``DesiredSet`` = the reservations of
  the pods on this node that hold valid reservations, are not deleting and not
  Succeeded/Failed (``node_agent.mig_records`` builds it from pod JSON). ``None`` in its place
  means the allocation state could not be read (API failure, malformed record, partial
  runtime identity): every destructive step is then skipped and the reason logged, because
  destroying on a guess could kill a running workload.
- ``ensure`` (one kubelet Allocate): reconcile first; verify every reserved profile/placement
  is still legal per NVML (before any hardware mutation); take the GPUs' mutation locks; per
  reservation return the instance it already owns (idempotent), take over an unmanaged
  instance at exactly its key (only when the desired set was readable: it alone shows no other
  pod reserves that placement), or create the GI at exactly that placement plus one full-size
  CI. Something else at or across the placement fails the call: the reservation is never
  moved to another placement (that would break the scheduler's topology accounting). On a
  failure, only what this attempt created is destroyed (CI, then GI); adopted and earlier
  instances stay.
- ``reconcile``: destroy (CI, then GI) managed instances whose key is not desired by their
  owner, unless another desired reservation at that key records the instance's exact
  runtime identity: only the agent writes one, so that pod holds it (the record moved there
  from an interchangeable pod, ``node_agent.identities``) and ownership moves instead; adopt
  unmanaged instances that match a desired reservation's complete runtime identity. An
  instance ``protect`` names (handed out among interchangeable pods, its holder not yet
  read from the kubelet) is kept. ``InUse`` (processes still running) is reported and
  retried on the next pass.
- ``adopt_on_start`` (restart adoption): GPUs busy by reservations, NVML processes, the
  desired set's ``held_gpus`` or the caller's ``busy_gpus`` are kept; idle MIG GPUs are
  cleaned to a MIG-ready state (all their CIs and GIs destroyed); each reservation with a
  complete runtime identity is checked against NVML and adopted, a mismatching one is
  reported (neither adopted nor destroyed).

Locking: one ``threading.Lock`` per GPU guards every hardware mutation on that GPU together
with the reads that decide it (never a node-wide lock); a short state lock guards the map.
GPU locks are taken in ascending index order and before the state lock, so two calls cannot
deadlock. A managed instance is only ever destroyed after re-checking in NVML that the GI at
its id still has its placement and its CI still has its MIG UUID; an instance that vanished
or was replaced is forgotten, not destroyed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence, Set
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Final

import structlog

from api.errors import TesseraError
from api.hami.devices import MigAllocation, RuntimeIdentity
from api.hami.register import Placement
from node_agent.nvml.backend import (
    COMPUTE_INSTANCE_PROFILE_SLICES,
    GpuInstance,
    GpuInstanceProfileInfo,
    NvmlBackend,
    describe_placement,
    full_compute_instance_profile,
)
from node_agent.nvml.discovery import resolve_profiles
from node_agent.nvml.errors import InUse, NotFound, NotSupported, NvmlError

log = structlog.get_logger(__name__)

UNREADABLE: Final = "the allocation state could not be read"


@dataclass(frozen=True, order=True)
class InstanceKey:
    gpu_index: int
    profile: str
    start: int
    size: int

    @property
    def placement(self) -> Placement:
        return Placement(self.start, self.size)

    def __str__(self) -> str:
        return f"GPU {self.gpu_index} {self.profile} at [{self.start},{self.start + self.size})"


@dataclass(frozen=True, order=True)
class Owner:
    """One reserved MIG device: the pod and the (container, device) slot in it."""

    pod: str
    container_index: int
    device_index: int


@dataclass(frozen=True)
class Reservation:
    pod: str
    allocation: MigAllocation

    @property
    def owner(self) -> Owner:
        a = self.allocation
        return Owner(self.pod, a.container_index, a.device_index)


@dataclass(frozen=True)
class DesiredSet:
    """The reservations that may own instances on this node (read from the API), and the
    GPUs live pods hold through instances Tessera did not make (``held_gpus``, by UUID: MIG
    slots of HAMi's <= v2.9 layouts), which restart adoption must leave as they are."""

    reservations: tuple[Reservation, ...] = ()
    held_gpus: frozenset[str] = frozenset()

    @classmethod
    def of(cls, reservations: Iterable[Reservation], held_gpus: Iterable[str] = ()) -> DesiredSet:
        return cls(tuple(reservations), frozenset(held_gpus))

    def with_pod(self, pod: str, allocations: Iterable[MigAllocation]) -> DesiredSet:
        """This set plus ``pod``'s ``allocations`` (a pod being allocated is live)."""
        added = [Reservation(pod, a) for a in allocations]
        owners = {r.owner for r in added}
        return DesiredSet(
            tuple(r for r in self.reservations if r.owner not in owners) + tuple(added),
            self.held_gpus,
        )


@dataclass(frozen=True)
class ManagedInstance:
    key: InstanceKey
    owner: Owner
    identity: RuntimeIdentity
    adopted: bool


@dataclass(frozen=True)
class Problem:
    """Something a pass could not do; it is retried or left for an operator."""

    detail: str
    key: InstanceKey | None = None
    owner: Owner | None = None


@dataclass(frozen=True)
class ReconcileReport:
    skipped: bool = False
    reason: str = ""
    destroyed: tuple[InstanceKey, ...] = ()
    adopted: tuple[InstanceKey, ...] = ()
    in_use: tuple[InstanceKey, ...] = ()  # destroy refused (processes); retried next pass
    failed: tuple[Problem, ...] = ()  # other NVML failures; retried next pass
    vanished: tuple[InstanceKey, ...] = ()  # gone or replaced in NVML: forgotten, not destroyed
    mismatched: tuple[Problem, ...] = ()  # recorded identity does not match NVML
    held: tuple[InstanceKey, ...] = ()  # handed out, holder not known yet: kept (``protect``)
    # recorded after the desired set was read (``as_of``): kept, the next pass decides
    newer: tuple[InstanceKey, ...] = ()

    @property
    def settled(self) -> bool:
        """Nothing done and nothing left to retry: run again over the same pods, GPUs and
        records, reconcile would find nothing to do."""
        return not (
            self.skipped
            or self.destroyed
            or self.adopted
            or self.in_use
            or self.failed
            or self.vanished
            or self.mismatched
            or self.held
            or self.newer
        )


@dataclass(frozen=True)
class AdoptReport:
    skipped: bool = False
    reason: str = ""
    kept_gpus: tuple[int, ...] = ()
    cleaned_gpus: tuple[int, ...] = ()
    adopted: tuple[InstanceKey, ...] = ()
    mismatched: tuple[Problem, ...] = ()
    pending: tuple[Owner, ...] = ()  # reservations without a runtime identity yet
    failed: tuple[Problem, ...] = ()


class MigAllocationError(TesseraError):
    """A reservation could not be realized; nothing this attempt created is left behind."""

    def __init__(
        self,
        pod: str,
        gpu: str,
        profile: str,
        placement: Placement,
        detail: str,
        *,
        nvml_error: NvmlError | None = None,
        rollback_failures: tuple[str, ...] = (),
    ) -> None:
        self.pod = pod
        self.gpu = gpu
        self.profile = profile
        self.placement = placement
        self.detail = detail
        self.nvml_error = nvml_error
        self.rollback_failures = rollback_failures
        msg = (
            f"pod {pod}: cannot realize MIG {profile} at {describe_placement(placement)}"
            f" on GPU {gpu}: {detail}"
        )
        if nvml_error is not None:
            msg += f" (NVML: {nvml_error})"
        if rollback_failures:
            msg += "; rollback incomplete, left for reconcile: " + "; ".join(rollback_failures)
        super().__init__(msg)


@dataclass(frozen=True)
class _Plan:
    reservation: Reservation
    key: InstanceKey
    info: GpuInstanceProfileInfo


class _StepFailed(Exception):
    def __init__(self, plan: _Plan, detail: str, nvml_error: NvmlError | None = None) -> None:
        super().__init__(detail)
        self.plan = plan
        self.detail = detail
        self.nvml_error = nvml_error


@dataclass
class _Step:
    """What one attempt did for one reservation, so a rollback undoes exactly that."""

    key: InstanceKey
    gi_id: int
    created_gi: bool
    ci_id: int | None = None  # set only when this attempt created the CI
    recorded: bool = False  # this attempt put the key in the map


@dataclass
class _Tally:
    destroyed: list[InstanceKey] = field(default_factory=list)
    adopted: list[InstanceKey] = field(default_factory=list)
    in_use: list[InstanceKey] = field(default_factory=list)
    failed: list[Problem] = field(default_factory=list)
    vanished: list[InstanceKey] = field(default_factory=list)
    mismatched: list[Problem] = field(default_factory=list)
    pending: list[Owner] = field(default_factory=list)
    held: list[InstanceKey] = field(default_factory=list)
    newer: list[InstanceKey] = field(default_factory=list)


class MigManager:
    """Managed MIG instances of one node; thread-safe."""

    def __init__(self, backend: NvmlBackend, *, node_name: str = "") -> None:
        self._backend = backend
        self._node = node_name
        self._state_lock = threading.Lock()
        self._gpu_locks: dict[int, threading.Lock] = {}
        self._instances: dict[InstanceKey, ManagedInstance] = {}
        self._changes = 0  # how often the records above changed
        self._recorded_at: dict[InstanceKey, int] = {}  # each record's ``_changes`` count
        self._gpu_index_by_uuid: dict[str, int] | None = None
        # Per GPU index, the MIG profiles NVML resolves: fixed while the GPU's MIG mode is
        # (the agent never changes it), so read once, like the UUIDs above. A GPU that
        # resolves none (MIG off, or NVML failing) is asked again next time.
        self._profiles_of: dict[int, dict[str, GpuInstanceProfileInfo]] = {}
        self._protected: Callable[[], Set[str]] = frozenset

    def protect(self, held: Callable[[], Set[str]]) -> None:
        """``held()``: MIG UUIDs of instances that ``reconcile`` must keep whatever the pods
        record: handed out among interchangeable pods whose records are not checked against
        the kubelet yet (``IdentityFixer.protected``), so the pod recorded may not be the one
        running on it."""
        self._protected = held

    @property
    def changes(self) -> int:
        """How often the managed instances' records changed (a count, to tell whether they
        did since an earlier look)."""
        with self._state_lock:
            return self._changes

    def instances(self) -> dict[InstanceKey, ManagedInstance]:
        """A snapshot of the managed instances."""
        with self._state_lock:
            return dict(self._instances)

    # -- Allocate ---------------------------------------------------------------------

    def ensure(
        self,
        pod: str,
        allocations: Sequence[MigAllocation],
        desired: DesiredSet | None,
        *,
        desired_reason: str = UNREADABLE,
        as_of: int | None = None,
    ) -> list[RuntimeIdentity]:
        """Realize ``pod``'s ``allocations``; their identities, in the same order.
        ``as_of``: ``changes`` as it was before ``desired`` was read (see ``reconcile``).

        Raises ``MigAllocationError`` (after rolling back this attempt's creations).
        """
        if not allocations:
            return []
        # What stands in the way on the pod's own GPUs is reclaimed first; the agent's
        # reconcile loop sees to the node's other GPUs.
        self.reconcile(
            None if desired is None else desired.with_pod(pod, allocations),
            reason=desired_reason,
            gpus={a.gpu_uuid for a in allocations},
            as_of=as_of,
        )
        plans = [self._plan(Reservation(pod, a)) for a in allocations]
        steps: list[_Step] = []
        unreadable = desired_reason if desired is None else ""
        with self._gpu_locks_held({p.key.gpu_index for p in plans}):
            try:
                identities = [self._realize(plan, steps, unreadable) for plan in plans]
            except _StepFailed as failure:
                leftovers = self._roll_back(steps)
                a = failure.plan.reservation.allocation
                log.warning(
                    "mig.allocate_failed",
                    pod=pod,
                    node=self._node,
                    gpu=a.gpu_uuid,
                    profile=a.profile,
                    start=a.placement.start,
                    size=a.placement.size,
                    detail=failure.detail,
                    rolled_back=len(steps) - len(leftovers),
                )
                raise MigAllocationError(
                    pod,
                    a.gpu_uuid,
                    a.profile,
                    a.placement,
                    failure.detail,
                    nvml_error=failure.nvml_error,
                    rollback_failures=tuple(leftovers),
                ) from failure.nvml_error
        for plan, identity in zip(plans, identities, strict=True):
            log.info(
                "mig.allocated",
                pod=pod,
                node=self._node,
                gpu=plan.reservation.allocation.gpu_uuid,
                instance=str(plan.key),
                mig_uuid=identity.mig_uuid,
            )
        return identities

    def _plan(self, r: Reservation) -> _Plan:
        """Check the reservation against NVML without mutating anything."""
        a = r.allocation

        def fail(detail: str, e: NvmlError | None = None) -> MigAllocationError:
            return MigAllocationError(
                r.pod, a.gpu_uuid, a.profile, a.placement, detail, nvml_error=e
            )

        try:
            index = self._gpu_indexes().get(a.gpu_uuid)
            if index is None:
                raise fail(
                    "no GPU with that UUID on this node; the reservation is for another node"
                )
            info = self._profiles(index).get(a.profile)
            if info is None:
                raise fail(
                    "NVML does not resolve the profile on this GPU (MIG disabled or profile"
                    " unsupported); the pod must be rescheduled"
                )
            legal = self._backend.gpu_instance_possible_placements(index, info.id)
        except NvmlError as e:
            raise fail("NVML could not check the reservation", e) from e
        if a.placement not in legal:
            starts = ", ".join(f"{p.start}:{p.size}" for p in legal) or "none"
            raise fail(f"the placement is not legal per NVML (legal: {starts}); reschedule the pod")
        key = InstanceKey(index, a.profile, a.placement.start, a.placement.size)
        return _Plan(r, key, info)

    def _realize(self, plan: _Plan, steps: list[_Step], unreadable: str) -> RuntimeIdentity:
        """The identity of the plan's instance (GPU lock held): existing, taken over or new.

        ``unreadable``: why the node's reservations could not be read ("" if they were). Then
        an unmanaged instance is not taken over: only a readable set shows that no other pod
        reserves that placement, and without it a forged or stale record could hand this pod
        another pod's running instance.
        """
        key, owner = plan.key, plan.reservation.owner
        try:
            with self._state_lock:
                current = self._instances.get(key)
            if current is not None:
                if current.owner != owner:
                    raise _StepFailed(
                        plan,
                        f"the placement is held by {current.owner.pod} (container"
                        f" {current.owner.container_index}); it is reclaimed once that pod ends",
                    )
                if self._identity_problem(key, plan.info.id, current.identity) is None:
                    return current.identity
                self._forget(key)  # gone or replaced in NVML behind our back
            gis = self._backend.gpu_instances(key.gpu_index)
            exact = next(
                (g for g in gis if g.placement == key.placement and g.profile_id == plan.info.id),
                None,
            )
            blocking = [g for g in gis if g.placement.mask & key.placement.mask and g != exact]
            if blocking:
                g = blocking[0]
                raise _StepFailed(
                    plan,
                    f"GPU instance {g.id} (profile id {g.profile_id} at"
                    f" {describe_placement(g.placement)}) occupies the placement; the reservation"
                    " is never moved to another placement",
                )
            if exact is not None:
                if unreadable:
                    raise _StepFailed(
                        plan,
                        f"an unmanaged GPU instance {exact.id} holds the placement and the node's"
                        f" reservations cannot be read ({unreadable}); it is not taken over until"
                        " they can",
                    )
                return self._take_over(plan, exact, steps)
            gi = self._backend.create_gpu_instance_with_placement(
                key.gpu_index, plan.info.id, key.placement
            )
            step = _Step(key, gi.id, created_gi=True)
            steps.append(step)
            return self._finish(plan, step, adopted=False)
        except NvmlError as e:
            raise _StepFailed(plan, "an NVML call failed", e) from e

    def _take_over(self, plan: _Plan, gi: GpuInstance, steps: list[_Step]) -> RuntimeIdentity:
        """An unmanaged instance at exactly the plan's key.

        With a recorded identity it must match it. Without one it is what an earlier attempt
        created before the agent stopped and the identity reached the annotation (no other
        reservation can hold this placement): its single full-size CI is taken, or created.
        """
        key, rt = plan.key, plan.reservation.allocation.runtime
        if rt is not None:
            problem = self._identity_problem(key, plan.info.id, rt)
            if problem is not None:
                raise _StepFailed(plan, f"an unmanaged instance holds the placement: {problem}")
            self._record(ManagedInstance(key, plan.reservation.owner, rt, adopted=True))
            return rt
        cis = self._backend.compute_instances(key.gpu_index, gi.id)
        step = _Step(key, gi.id, created_gi=False)
        if not cis:
            steps.append(step)
            return self._finish(plan, step, adopted=True)
        full = [
            c
            for c in cis
            if COMPUTE_INSTANCE_PROFILE_SLICES.get(c.profile_id) == plan.info.slice_count
        ]
        if len(cis) != 1 or not full:
            raise _StepFailed(
                plan,
                f"an unmanaged GPU instance {gi.id} holds the placement with {len(cis)} compute"
                " instance(s) that are not one full-size instance",
            )
        uuid = self._backend.mig_device_uuid(key.gpu_index, gi.id, cis[0].id)
        identity = RuntimeIdentity(uuid, gi.id, cis[0].id)
        self._record(ManagedInstance(key, plan.reservation.owner, identity, adopted=True))
        return identity

    def _finish(self, plan: _Plan, step: _Step, *, adopted: bool) -> RuntimeIdentity:
        """Create the full-size CI in ``step``'s GI and record the instance."""
        key = plan.key
        ci = self._backend.create_compute_instance(
            key.gpu_index, step.gi_id, full_compute_instance_profile(plan.info.slice_count)
        )
        step.ci_id = ci.id
        uuid = self._backend.mig_device_uuid(key.gpu_index, step.gi_id, ci.id)
        identity = RuntimeIdentity(uuid, step.gi_id, ci.id)
        self._record(ManagedInstance(key, plan.reservation.owner, identity, adopted=adopted))
        step.recorded = True
        return identity

    def _roll_back(self, steps: list[_Step]) -> list[str]:
        """Undo this attempt's creations, newest first; what could not be undone."""
        leftovers: list[str] = []
        for step in reversed(steps):
            idx = step.key.gpu_index
            try:
                if step.ci_id is not None:
                    self._backend.destroy_compute_instance(idx, step.gi_id, step.ci_id)
                if step.created_gi:
                    self._backend.destroy_gpu_instance(idx, step.gi_id)
            except NvmlError as e:
                # Still there and still the reservation's: the map keeps it, so a retried
                # Allocate reuses it and reconcile reclaims it if the pod goes away.
                leftovers.append(f"{step.key}: {e}")
                continue
            if step.recorded:
                self._forget(step.key)
        return leftovers

    # -- reconcile --------------------------------------------------------------------

    def reconcile(
        self,
        desired: DesiredSet | None,
        *,
        reason: str = UNREADABLE,
        gpus: Set[str] | None = None,
        as_of: int | None = None,
    ) -> ReconcileReport:
        """Reclaim managed instances nobody desires; adopt desired unmanaged ones; on the GPUs
        whose UUIDs are in ``gpus`` only, if given.

        ``as_of``: ``changes`` as it was before ``desired`` was read. An instance recorded
        since is kept whoever ``desired`` names: an Allocate may have realized it for a pod
        bound after the read, and reclaiming it would leave that pod a MIG device that no
        longer exists. None: ``desired`` is as new as the records (tests)."""
        if desired is None:
            log.warning("mig.reconcile_skipped", node=self._node, reason=reason)
            return ReconcileReport(skipped=True, reason=reason)
        try:
            indexes = self._gpu_indexes()
        except NvmlError as e:
            log.warning("mig.reconcile_skipped", node=self._node, reason=str(e))
            return ReconcileReport(skipped=True, reason=f"cannot list GPUs: {e}")
        wanted: dict[InstanceKey, dict[Owner, RuntimeIdentity | None]] = {}
        by_gpu: dict[int, list[tuple[InstanceKey, Reservation]]] = {}
        reservations = desired.reservations
        if gpus is not None:
            reservations = tuple(r for r in reservations if r.allocation.gpu_uuid in gpus)
        for r in reservations:
            key = self._key_of(r, indexes)
            if key is None:
                continue
            wanted.setdefault(key, {})[r.owner] = r.allocation.runtime
            by_gpu.setdefault(key.gpu_index, []).append((key, r))
        with self._state_lock:
            touched = {k.gpu_index for k in self._instances} | set(by_gpu)
        if gpus is not None:
            touched &= {indexes[u] for u in gpus if u in indexes}
        tally = _Tally()
        protected = self._protected()
        for idx in sorted(touched):
            with self._gpu_locks_held({idx}):
                for m in self._managed_on(idx):
                    claims = wanted.get(m.key, {})
                    if m.owner in claims:
                        continue
                    if as_of is not None and self._recorded_since(m.key, as_of):
                        tally.newer.append(m.key)
                        continue
                    heir = min((o for o, rt in claims.items() if rt == m.identity), default=None)
                    if heir is not None:
                        self._move(m, heir)
                    elif m.identity.mig_uuid in protected:
                        tally.held.append(m.key)
                    else:
                        self._destroy_managed(m, tally)
                self._adopt_recorded(idx, by_gpu.get(idx, []), tally)
        return ReconcileReport(
            destroyed=tuple(tally.destroyed),
            adopted=tuple(tally.adopted),
            in_use=tuple(tally.in_use),
            failed=tuple(tally.failed),
            vanished=tuple(tally.vanished),
            mismatched=tuple(tally.mismatched),
            held=tuple(tally.held),
            newer=tuple(tally.newer),
        )

    def _recorded_since(self, key: InstanceKey, as_of: int) -> bool:
        with self._state_lock:
            return self._recorded_at.get(key, 0) > as_of

    def _move(self, m: ManagedInstance, owner: Owner) -> None:
        """``m`` now belongs to ``owner``, whose reservation records exactly ``m``'s runtime
        identity: the node agent moved the record there (interchangeable pods, where the
        kubelet gave the instance to the other pod; ``node_agent.identities``). Only the
        agent writes a runtime identity, so a record naming it is the instance's holder, and
        destroying it would take it from under a running container."""
        self._record(ManagedInstance(m.key, owner, m.identity, adopted=m.adopted))
        log.info(
            "mig.owner_moved",
            node=self._node,
            gpu=self._uuid_of(m.key.gpu_index),
            instance=str(m.key),
            before=m.owner.pod,
            after=owner.pod,
        )

    def _destroy_managed(self, m: ManagedInstance, tally: _Tally) -> None:
        """Destroy exactly ``m``'s CI and GI (GPU lock held), after re-checking they are ``m``'s."""
        idx, gi_id, ci_id = (
            m.key.gpu_index,
            m.identity.gpu_instance_id,
            m.identity.compute_instance_id,
        )
        try:
            gi = next((g for g in self._backend.gpu_instances(idx) if g.id == gi_id), None)
            if gi is None or gi.placement != m.key.placement:
                self._forget(m.key)
                tally.vanished.append(m.key)
                return
            if any(c.id == ci_id for c in self._backend.compute_instances(idx, gi_id)):
                if self._backend.mig_device_uuid(idx, gi_id, ci_id) != m.identity.mig_uuid:
                    self._forget(m.key)  # someone else's CI now: not ours to destroy
                    tally.vanished.append(m.key)
                    return
                self._backend.destroy_compute_instance(idx, gi_id, ci_id)
            self._backend.destroy_gpu_instance(idx, gi_id)
        except InUse as e:
            log.info(
                "mig.reclaim_deferred",
                pod=m.owner.pod,
                node=self._node,
                gpu=self._uuid_of(idx),
                error=str(e),
            )
            tally.in_use.append(m.key)
            return
        except NvmlError as e:
            log.warning(
                "mig.reclaim_failed",
                pod=m.owner.pod,
                node=self._node,
                gpu=self._uuid_of(idx),
                error=str(e),
            )
            tally.failed.append(Problem(str(e), m.key, m.owner))
            return
        self._forget(m.key)
        tally.destroyed.append(m.key)
        log.info(
            "mig.reclaimed",
            pod=m.owner.pod,
            node=self._node,
            gpu=self._uuid_of(idx),
            instance=str(m.key),
        )

    def _adopt_recorded(
        self, idx: int, reservations: list[tuple[InstanceKey, Reservation]], tally: _Tally
    ) -> None:
        """Adopt unmanaged instances matching a complete recorded identity (GPU lock held)."""
        profiles: dict[str, GpuInstanceProfileInfo] | None = None
        for key, r in reservations:
            rt = r.allocation.runtime
            if rt is None:
                tally.pending.append(r.owner)
                continue
            with self._state_lock:
                if key in self._instances:
                    continue
            try:
                if profiles is None:
                    profiles = self._profiles(idx)
                info = profiles.get(key.profile)
                problem = (
                    f"NVML does not resolve profile {key.profile}"
                    if info is None
                    else self._identity_problem(key, info.id, rt)
                )
            except NvmlError as e:
                tally.failed.append(Problem(str(e), key, r.owner))
                continue
            if problem is not None:
                log.warning(
                    "mig.identity_mismatch",
                    pod=r.pod,
                    node=self._node,
                    gpu=self._uuid_of(idx),
                    detail=problem,
                )
                tally.mismatched.append(Problem(problem, key, r.owner))
                continue
            self._record(ManagedInstance(key, r.owner, rt, adopted=True))
            tally.adopted.append(key)
            log.info(
                "mig.adopted", pod=r.pod, node=self._node, gpu=self._uuid_of(idx), instance=str(key)
            )

    # -- restart adoption -------------------------------------------------------------

    def adopt_on_start(
        self,
        desired: DesiredSet | None,
        busy_gpus: Set[int] = frozenset(),
        *,
        reason: str = UNREADABLE,
    ) -> AdoptReport:
        """Rebuild ownership after a restart; clean idle GPUs (``busy_gpus``: also keep these)."""
        if desired is None:
            log.warning("mig.adoption_skipped", node=self._node, reason=reason)
            return AdoptReport(skipped=True, reason=reason)
        try:
            indexes = self._gpu_indexes()
            count = self._backend.device_count()
        except NvmlError as e:
            log.warning("mig.adoption_skipped", node=self._node, reason=str(e))
            return AdoptReport(skipped=True, reason=f"cannot list GPUs: {e}")
        by_gpu: dict[int, list[tuple[InstanceKey, Reservation]]] = {}
        for r in desired.reservations:
            key = self._key_of(r, indexes)
            if key is not None:
                by_gpu.setdefault(key.gpu_index, []).append((key, r))
        held = {indexes[u] for u in desired.held_gpus if u in indexes}
        tally = _Tally()
        kept: list[int] = []
        cleaned: list[int] = []
        for idx in range(count):
            with self._gpu_locks_held({idx}):
                try:
                    if not self._backend.mig_mode(idx).current:
                        continue
                    busy = idx in busy_gpus or idx in by_gpu
                    busy = busy or idx in held
                    busy = busy or bool(self._backend.running_processes(idx))
                except NotSupported:
                    continue  # not MIG-capable
                except NvmlError as e:  # unknown activity: keep the GPU
                    tally.failed.append(Problem(f"GPU {idx}: {e}"))
                    kept.append(idx)
                    continue
                if busy:
                    kept.append(idx)
                    self._adopt_recorded(idx, by_gpu.get(idx, []), tally)
                elif self._clean(idx, tally):
                    cleaned.append(idx)
        log.info(
            "mig.adoption_done",
            node=self._node,
            kept=kept,
            cleaned=cleaned,
            adopted=len(tally.adopted),
            mismatched=len(tally.mismatched),
        )
        return AdoptReport(
            kept_gpus=tuple(kept),
            cleaned_gpus=tuple(cleaned),
            adopted=tuple(tally.adopted),
            mismatched=tuple(tally.mismatched),
            pending=tuple(tally.pending),
            failed=tuple(tally.failed),
        )

    def _clean(self, idx: int, tally: _Tally) -> bool:
        """Destroy every CI and GI on an idle GPU (GPU lock held); whether it is now clean."""
        clean = True
        try:
            gis = self._backend.gpu_instances(idx)
        except NvmlError as e:
            tally.failed.append(Problem(f"GPU {idx}: {e}"))
            return False
        for gi in gis:
            try:
                for ci in self._backend.compute_instances(idx, gi.id):
                    self._backend.destroy_compute_instance(idx, gi.id, ci.id)
                self._backend.destroy_gpu_instance(idx, gi.id)
            except NvmlError as e:
                clean = False
                tally.failed.append(Problem(f"GPU {idx}: {e}"))
                log.warning(
                    "mig.clean_failed", node=self._node, gpu=self._uuid_of(idx), error=str(e)
                )
        for m in self._managed_on(idx):
            self._forget(m.key)
        if clean:
            log.info("mig.gpu_cleaned", node=self._node, gpu=self._uuid_of(idx), destroyed=len(gis))
        return clean

    # -- helpers ----------------------------------------------------------------------

    def _identity_problem(
        self, key: InstanceKey, profile_id: int, rt: RuntimeIdentity
    ) -> str | None:
        """Why NVML's instance at ``key`` is not ``rt``, or None if it is."""
        idx = key.gpu_index
        gi = next(
            (g for g in self._backend.gpu_instances(idx) if g.placement == key.placement), None
        )
        if gi is None:
            return f"no GPU instance at {describe_placement(key.placement)}"
        if gi.profile_id != profile_id:
            return f"GPU instance {gi.id} has profile id {gi.profile_id}, not {profile_id}"
        if gi.id != rt.gpu_instance_id:
            return f"GPU instance id is {gi.id}, recorded {rt.gpu_instance_id}"
        cis = self._backend.compute_instances(idx, gi.id)
        if not any(c.id == rt.compute_instance_id for c in cis):
            return f"GPU instance {gi.id} has no compute instance {rt.compute_instance_id}"
        try:
            uuid = self._backend.mig_device_uuid(idx, gi.id, rt.compute_instance_id)
        except NotFound:
            return f"compute instance {rt.compute_instance_id} has no MIG device"
        if uuid != rt.mig_uuid:
            return f"MIG device is {uuid}, recorded {rt.mig_uuid}"
        return None

    def _gpu_indexes(self) -> dict[str, int]:
        with self._state_lock:
            cached = self._gpu_index_by_uuid
        if cached is None:
            b = self._backend
            cached = {b.device(i).uuid: i for i in range(b.device_count())}
            with self._state_lock:
                self._gpu_index_by_uuid = cached
        return cached

    def _uuid_of(self, idx: int) -> str:
        """The GPU's UUID for logs (its index while the UUIDs are not known yet)."""
        with self._state_lock:
            known = self._gpu_index_by_uuid or {}
        return next((u for u, i in known.items() if i == idx), str(idx))

    def _profiles(self, idx: int) -> dict[str, GpuInstanceProfileInfo]:
        with self._state_lock:
            cached = self._profiles_of.get(idx)
        if cached is None:
            cached = resolve_profiles(self._backend, self._backend.device(idx))
            if cached:
                with self._state_lock:
                    self._profiles_of[idx] = cached
        return cached

    def _key_of(self, r: Reservation, indexes: dict[str, int]) -> InstanceKey | None:
        a = r.allocation
        idx = indexes.get(a.gpu_uuid)
        if idx is None:
            log.warning("mig.foreign_reservation", pod=r.pod, node=self._node, gpu=a.gpu_uuid)
            return None
        return InstanceKey(idx, a.profile, a.placement.start, a.placement.size)

    def _managed_on(self, idx: int) -> list[ManagedInstance]:
        with self._state_lock:
            return sorted(
                (m for m in self._instances.values() if m.key.gpu_index == idx),
                key=lambda m: m.key,
            )

    def _record(self, m: ManagedInstance) -> None:
        with self._state_lock:
            self._instances[m.key] = m
            self._changes += 1
            self._recorded_at[m.key] = self._changes

    def _forget(self, key: InstanceKey) -> None:
        with self._state_lock:
            if self._instances.pop(key, None) is not None:
                self._recorded_at.pop(key, None)
                self._changes += 1

    @contextmanager
    def _gpu_locks_held(self, indexes: Set[int]) -> Iterator[None]:
        with self._state_lock:
            locks = [self._gpu_locks.setdefault(i, threading.Lock()) for i in sorted(indexes)]
        with ExitStack() as stack:
            for lock in locks:
                stack.enter_context(lock)
            yield
