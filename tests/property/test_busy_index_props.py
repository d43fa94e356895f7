"""The plugin server's busy-node index (kept incrementally as reservations, bind claims and
watched pods change) always says what a full recount of the in-flight pods says."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from api.errors import InvalidInputError
from api.hami import keys as ann
from api.hami.config import DeviceConfig
from api.hami.matching import to_allocate
from scheduler_plugins.core.cache import ClusterCache
from scheduler_plugins.core.requests import PodAllocation
from tests.builders import make_pod

NODES = ("n1", "n2", "n3")
PODS = ("a", "b", "c", "d")
WANTED = (frozenset({1}), frozenset({2}), frozenset({1, 3}), frozenset({4}))
# Layouts' node names busy_per_node is asked about: all, some, a node never busy, none.
LAYOUTS = (NODES, ("n3", "n1"), ("n2", "gpu-less-n9"), ())


def _entry(counts: list[int]) -> str:
    """A to-allocate annotation whose containers ask ``counts`` devices (0: done)."""
    return "".join("".join("GPU-0,NVIDIA,1000,0:" for _ in range(n)) + ";" for n in counts)


def _remaining(raw: str) -> frozenset[int] | None:
    try:
        return frozenset(len(c) for c in to_allocate({ann.DEVICES_TO_ALLOCATE: raw}) if c)
    except InvalidInputError:
        return None


def _recount(cache: ClusterCache, wanted: frozenset[int]) -> Counter[str]:
    """Every in-flight pod looked at, as busy_nodes did before it kept an index."""

    def clash(counts: frozenset[int] | None) -> bool:
        return counts is None or not counts.isdisjoint(wanted)

    busy: Counter[str] = Counter()
    claims = cache._claims
    for claim in claims.values():
        counts = _remaining(claim.annotations.get(ann.DEVICES_TO_ALLOCATE, ""))
        if counts != frozenset() and clash(counts):
            busy[claim.node] += len(wanted & counts) if counts is not None else 1
    for node, pods in cache._allocating.items():
        for key, written in pods.items():
            if key in claims:
                continue
            counts = _remaining(written.get(ann.DEVICES_TO_ALLOCATE, ""))
            if counts != frozenset() and clash(counts):
                busy[node] += len(wanted & counts) if counts is not None else 1
    for key, assumed in cache._assumed.items():
        if key in claims or key in cache._allocating_node:
            continue
        if assumed.counts != frozenset() and clash(assumed.counts):
            busy[assumed.node] += len(wanted & assumed.counts) if assumed.counts is not None else 1
    return busy


counts_lists = st.lists(st.integers(0, 4), min_size=1, max_size=3)
to_allocate_raw = counts_lists.map(_entry) | st.just("garbage")
ops = st.one_of(
    st.tuples(st.just("assume"), st.sampled_from(PODS), st.sampled_from(NODES), counts_lists),
    st.tuples(st.just("claim"), st.sampled_from(PODS), st.sampled_from(NODES), to_allocate_raw),
    st.tuples(st.just("release"), st.sampled_from(PODS)),
    st.tuples(st.just("forget"), st.sampled_from(PODS)),
    st.tuples(
        st.just("watch"),
        st.sampled_from(PODS),
        st.sampled_from(NODES),
        st.sampled_from(["allocating", "success"]),
        to_allocate_raw,
        st.booleans(),  # bound
    ),
    st.tuples(st.just("gone"), st.sampled_from(PODS)),
)


def _pod(name: str, node: str, phase: str, raw: str, bound: bool) -> dict[str, Any]:
    pod = make_pod(name).gpu(1)
    if bound:
        pod.on(node, "Pending")
    pod.annotate(ann.VGPU_NODE, node)
    pod.annotate(ann.BIND_PHASE, phase)
    pod.annotate(ann.DEVICES_TO_ALLOCATE, raw)
    return pod.build()


@settings(max_examples=300, deadline=None)
@given(st.lists(ops, max_size=30))
def test_index_equals_a_recount_after_every_change(sequence: list[tuple[Any, ...]]) -> None:
    cache = ClusterCache(DeviceConfig(), clock=time.monotonic)
    for op in sequence:
        kind, key = op[0], f"default/{op[1]}"
        if kind == "assume":
            _, _, node, counts = op
            cache.assume(PodAllocation(key, node, (), ()), frozenset(c for c in counts if c))
        elif kind == "claim":
            _, _, node, raw = op
            cache.claim(key, node, {ann.DEVICES_TO_ALLOCATE: raw, ann.BIND_PHASE: "allocating"})
        elif kind == "release":
            cache.release_claim(key)
        elif kind == "forget":
            cache.forget(key)
        elif kind == "watch":
            _, name, node, phase, raw, bound = op
            cache.apply_pod(_pod(name, node, phase, raw, bound))
        else:
            cache.forget_pod(key)
        for wanted in WANTED:
            recount = _recount(cache, wanted)
            assert cache.busy_nodes(wanted) == recount, (op, wanted)
            for names in LAYOUTS:
                per_node = cache.busy_per_node(wanted, names)
                got = {} if per_node is None else dict(zip(names, per_node.tolist(), strict=True))
                assert {n: c for n, c in got.items() if c} == {
                    n: c for n, c in recount.items() if n in names and c
                }, (op, wanted, names)


def test_busy_arrays_grow_past_their_first_size_and_follow_new_layouts() -> None:
    cache = ClusterCache(DeviceConfig(), clock=time.monotonic)
    nodes = tuple(f"n{i:03d}" for i in range(300))
    for i, node in enumerate(nodes):
        cache.assume(PodAllocation(f"default/p{i}", node, (), ()), frozenset({1 + i % 2}))
    per_node = cache.busy_per_node(frozenset({1}), nodes)
    assert per_node is not None and per_node.tolist() == [1 - i % 2 for i in range(300)]
    later = (*nodes[::-1], "n-new")
    per_node = cache.busy_per_node(frozenset({1, 2}), later)
    assert per_node is not None and per_node.tolist() == [1] * 300 + [0]
    cache.forget("default/p0")
    per_node = cache.busy_per_node(frozenset({1}), later)
    assert per_node is not None and per_node[-2:].tolist() == [0, 0]  # n000's pod is gone
    # A layout whose new names outgrow the arrays (512 slots) in the very call asking.
    grown = (*nodes, *(f"late-{i}" for i in range(300)))
    per_node = cache.busy_per_node(frozenset({2}), grown)
    assert per_node is not None and per_node.tolist() == [i % 2 for i in range(300)] + [0] * 300
