"""The reservation lifecycle (``core.reservations``) called directly, as the servicer calls it:
no gRPC, the cluster fed as the watch would, the API and the scheduler's call faked."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from api.hami import keys as ann
from api.hami.config import DeviceConfig
from scheduler_plugins.core.cache import ClusterCache
from scheduler_plugins.core.requests import PodRequest, parse_request
from scheduler_plugins.core.reservations import (
    Handed,
    NoDecision,
    Reservations,
    ScheduleAgain,
    WaitYourTurn,
    WrongPod,
)
from tests.builders import gpu, make_pod
from tests.unit.test_plugin_server import FakeKube, node_obj

BIND_TIME = 1_700_000_000


class FakeCall:
    def __init__(self, remaining: float | None = None) -> None:
        self.remaining = remaining
        self.ended: list[Callable[[], None]] = []

    def is_active(self) -> bool:
        return True

    def time_remaining(self) -> float | None:
        return self.remaining

    def on_end(self, callback: Callable[[], None]) -> None:
        self.ended.append(callback)


def _lifecycle() -> tuple[Reservations, ClusterCache, FakeKube]:
    cache = ClusterCache(DeviceConfig(), clock=time.monotonic)
    cache.apply_node(node_obj("n", gpu("GPU-1"), gpu("GPU-2", index=1)))
    kube = FakeKube()
    lifecycle = Reservations(
        cache,
        kube,
        wall_clock=lambda: BIND_TIME,
        clock=time.monotonic,
        cpu_clock=time.thread_time,
        prebind_wait_s=5.0,
    )
    return lifecycle, cache, kube


def _request(name: str) -> PodRequest:
    pod = make_pod(name).gpu(1, mem=1000).build()
    pod["metadata"]["uid"] = f"uid-{name}"
    return parse_request(pod, DeviceConfig())


def _offer_and_reserve(lifecycle: Reservations, name: str) -> Handed | None:
    req = _request(name)
    offer = lifecycle.offer(req, {}, {}, limit=0)
    assert offer.nodes == ["n"]
    return lifecycle.reserve(req.uid, req.key, "n", offer.decision_id, hand_over=True)


def test_reserve_hands_the_bind_annotations_over_when_nothing_blocks() -> None:
    lifecycle, cache, _ = _lifecycle()
    handed = _offer_and_reserve(lifecycle, "p")
    assert handed is not None
    assert handed.annotations[ann.VGPU_NODE] == "n"
    assert handed.annotations[ann.BIND_TIME] == str(BIND_TIME)
    assert handed.labels == {ann.VGPU_NODE_LABEL: "n"}  # as HAMi labels its pods
    assert cache.state.is_assumed("default/p")
    assert lifecycle.held == 1


def test_prebind_waits_its_turn_behind_an_indistinguishable_pod_then_gives_up() -> None:
    lifecycle, cache, kube = _lifecycle()
    assert _offer_and_reserve(lifecycle, "q") is not None  # q claims the node
    assert _offer_and_reserve(lifecycle, "p") is None  # p would have to wait
    call = FakeCall(remaining=0.5)
    started = time.monotonic()
    with pytest.raises(WaitYourTurn, match="default/q"):
        lifecycle.prebind("uid-p", "default/p", "n", "uid-p", call, hand_over=False)
    assert time.monotonic() - started < 2.0  # the call's deadline, not the 5 s wait
    assert call.ended  # a cancelled call would have woken the waiter
    assert kube.patches == []  # nothing written
    assert cache.state.is_assumed("default/p")  # the reservation stands


def test_the_lifecycles_refusals_say_what_to_do() -> None:
    lifecycle, _, _ = _lifecycle()
    with pytest.raises(NoDecision):
        lifecycle.reserve("uid-x", "default/x", "n", 1, hand_over=False)
    _offer_and_reserve(lifecycle, "p")
    with pytest.raises(WrongPod):
        lifecycle.unreserve("uid-p", "default/other", "n")
    with pytest.raises(ScheduleAgain, match="reserved on node n, not m"):
        lifecycle.prebind("uid-p", "default/p", "m", "uid-p", FakeCall(), hand_over=True)
    lifecycle.unreserve("uid-p", "default/p", "n")
    lifecycle.unreserve("uid-p", "default/p", "n")  # idempotent
    with pytest.raises(ScheduleAgain, match="no reservation"):
        lifecycle.prebind("uid-p", "default/p", "n", "uid-p", FakeCall(), hand_over=True)
