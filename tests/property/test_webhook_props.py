"""Fuzzing the admission webhook: whatever arrives, the answer is an HTTP 400 naming the
problem or a well-formed AdmissionReview response, never an exception; and its patches
apply, and are stable (a patched pod needs no further patch). Its cluster checks never refuse
a pod the scheduler would place (on random clusters of hami-core, MIG and MPS GPUs).

Each test counts the cases it tried and prints the count (``pytest -s`` shows it).
"""

from __future__ import annotations

import base64
import http.client
import itertools
import json
import ssl
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.hami import keys as ann
from api.hami.register import MigProfile, Placement
from scheduler_plugins.core.decide import decide
from scheduler_plugins.core.state import ClusterState
from scheduler_plugins.webhook.app import WebhookApp
from scheduler_plugins.webhook.certs import ensure_serving_pki
from scheduler_plugins.webhook.facts import (
    UNKNOWN,
    ClusterFacts,
    max_disjoint_placements,
    node_capacity,
)
from scheduler_plugins.webhook.review import Answer, answer
from scheduler_plugins.webhook.rules import Settings, _impossible, asks_tessera
from tests.builders import gpu, mig_gpu
from tests.jsonpatch import apply_patch
from tests.property.test_decide_props import CFG, clusters, requests

TRUSTED = "ops"
SETTINGS = Settings(trusted_users=frozenset({TRUSTED}))
FACTS = [
    UNKNOWN,
    ClusterFacts.of([node_capacity("a", [gpu("G0", mem=16384), gpu("G1", index=1)])]),
    ClusterFacts.of([node_capacity("m", [mig_gpu("M0")]), node_capacity("c", [gpu("G0")])]),
]
RESOURCES = [
    "nvidia.com/gpu",
    "nvidia.com/gpumem",
    "nvidia.com/gpumem-percentage",
    "nvidia.com/gpucores",
    "cpu",
    "memory",
]

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


def sometimes(bits: int) -> st.SearchStrategy[bool]:
    """True about once in 2**bits draws (hypothesis draws sampled_from and integers with a
    bias towards both ends, so they cannot weigh choices; fair coins can)."""
    return st.lists(st.booleans(), min_size=bits, max_size=bits).map(all)


def mostly(
    sensible: st.SearchStrategy[Any], bits: int = 3, rare: st.SearchStrategy[Any] | None = None
) -> st.SearchStrategy[Any]:
    """``sensible`` values, and about once in 2**bits draws ``rare`` ones (default: anything
    at all), so that every rule is reached and so is every corner of the input space."""
    other = json_values if rare is None else rare
    return sometimes(bits).flatmap(lambda r: other if r else sensible)


# Strategies are built once, here: building them inside a draw makes hypothesis recompute
# their properties on every example (most of the run time).
ONE_IN_4, ONE_IN_8, ONE_IN_16, ONE_IN_32 = (sometimes(b) for b in (2, 3, 4, 5))
quantities = mostly(
    st.sampled_from([1, 2, 3, 8, 50, 100, 3000, "1", "2", "30", "4000", "8Gi", "500m"]),
    bits=2,
    rare=st.sampled_from(["0", "-1", "1.5", "2k", "1e3", "1e999999", "abc", "", "7E", "101", 65])
    | st.integers(-(2**80), 2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | json_values,
)
resource_lists = st.dictionaries(st.sampled_from(RESOURCES), quantities, min_size=1, max_size=3)
ANNOTATION_VALUES = {
    ann.DEVICES_ALLOCATED: mostly(st.just("GPU-0,NVIDIA,1000,0:;")),
    ann.BIND_PHASE: mostly(st.just("success")),
    ann.VGPU_NODE: mostly(st.just("node-0")),
    ann.VGPU_MODE: mostly(st.sampled_from(["mig", "hami-core", "fast"])),
    ann.NODE_POLICY: mostly(st.sampled_from(["spread", "binpack", "pack"])),
    ann.USE_GPUTYPE: mostly(st.just("A100")),
    "example.com/other": st.text(max_size=4),
}
annotation_keys = st.lists(st.sampled_from(sorted(ANNOTATION_VALUES)), max_size=2, unique=True)
scheduler_names = mostly(st.sampled_from(["default-scheduler", "hami-scheduler", "other", ""]))
node_names = mostly(st.sampled_from(["node-0", ""]))
short_text = st.text(max_size=6)


@st.composite
def container(draw: st.DrawFn) -> Any:
    if draw(ONE_IN_16):
        return draw(json_values)  # anything at all where a container should be
    resources = {
        section: draw(resource_lists) for section in ("limits", "requests") if draw(st.booleans())
    }
    c: dict[str, Any] = {"name": draw(short_text)}
    if resources or draw(st.booleans()):
        c["resources"] = draw(json_values) if draw(ONE_IN_16) else resources
    return c


containers = st.lists(container(), min_size=1, max_size=3)
init_containers = st.lists(container(), max_size=2)


@st.composite
def pod(draw: st.DrawFn) -> Any:
    if draw(ONE_IN_16):
        return draw(json_values)
    annotations = {k: draw(ANNOTATION_VALUES[k]) for k in draw(annotation_keys)}
    spec: dict[str, Any] = {"containers": draw(containers)}
    if draw(ONE_IN_4):
        spec["initContainers"] = draw(init_containers)
    if draw(st.booleans()):
        spec["schedulerName"] = draw(scheduler_names)
    if draw(ONE_IN_8):
        spec["nodeName"] = draw(node_names)
    meta: dict[str, Any] = {"name": draw(short_text), "annotations": annotations}
    if draw(ONE_IN_16):
        meta["annotations"] = draw(json_values)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


pods = pod()
uids = st.uuids().map(lambda u: u.hex)
sub_resources = mostly(st.none(), rare=st.sampled_from(["", "binding", "status"]))
operations = st.sampled_from(["CREATE", "CREATE", "UPDATE", "X"])
users = mostly(st.just("alice"), 2, st.just(TRUSTED))


@st.composite
def review(draw: st.DrawFn) -> dict[str, Any]:
    def maybe(valid: Any) -> Any:
        return draw(json_values) if draw(ONE_IN_32) else valid

    req = {
        "uid": maybe(draw(uids)),
        "kind": maybe({"group": "", "version": "v1", "kind": "Pod"}),
        "resource": maybe({"group": "", "version": "v1", "resource": "pods"}),
        "subResource": maybe(draw(sub_resources)),
        "namespace": maybe("ns"),
        "operation": maybe(draw(operations)),
        "userInfo": maybe({"username": draw(users)}),
        "object": draw(pods),
        "oldObject": draw(st.none() | pods),
    }
    if draw(ONE_IN_16):
        del req[draw(st.sampled_from(sorted(req)))]
    return {
        "apiVersion": maybe("admission.k8s.io/v1"),
        "kind": maybe("AdmissionReview"),
        "request": maybe(req),
    }


reviews = review()


def check_answer(a: Answer, stats: Counter[str]) -> None:
    """The answer is a 400 Status, or a 200 AdmissionReview; tally which."""
    json.loads(a.payload())
    if a.status == 400:
        assert a.body["kind"] == "Status" and a.body["code"] == 400
        assert a.body["message"].startswith("malformed AdmissionReview: ")
        stats["http 400"] += 1
        return
    assert a.status == 200
    assert set(a.body) == {"apiVersion", "kind", "response"}
    resp = a.body["response"]
    assert isinstance(resp["uid"], str) and resp["uid"]
    assert isinstance(resp["allowed"], bool)
    if resp["allowed"]:
        assert "status" not in resp
        if "patch" in resp:
            assert resp["patchType"] == "JSONPatch"
            assert isinstance(json.loads(base64.b64decode(resp["patch"])), list)
            stats["patched"] += 1
        else:
            stats["allowed unchanged"] += 1
    else:
        assert resp["status"]["code"] in (400, 403) and resp["status"]["message"]
        assert "patch" not in resp
        stats[f"denied {resp['status']['code']}"] += 1


def _internal(pod: Any) -> dict[str, Any]:
    meta = pod.get("metadata") if isinstance(pod, dict) else None
    annotations = meta.get("annotations") if isinstance(meta, dict) else None
    if not isinstance(annotations, dict):
        return {}
    return {str(k): v for k, v in annotations.items() if str(k).startswith(ann.INTERNAL_PREFIXES)}


def _report(name: str, stats: Counter[str]) -> None:
    print(f"\n{name}: {sum(stats.values())} cases tried: {dict(sorted(stats.items()))}")


def test_random_bytes() -> None:
    stats: Counter[str] = Counter()

    @settings(max_examples=300, deadline=None)
    @given(st.binary(max_size=512) | st.text(max_size=200).map(str.encode))
    def run(raw: bytes) -> None:
        check_answer(answer(raw, UNKNOWN, SETTINGS), stats)

    run()
    _report("random bytes", stats)
    assert sum(stats.values()) >= 250


def test_random_json() -> None:
    stats: Counter[str] = Counter()

    @settings(max_examples=300, deadline=None)
    @given(json_values)
    def run(doc: Any) -> None:
        check_answer(answer(json.dumps(doc).encode(), UNKNOWN, SETTINGS), stats)

    run()
    _report("random JSON", stats)
    assert sum(stats.values()) >= 250


def test_random_reviews_and_pods() -> None:
    stats: Counter[str] = Counter()

    @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(reviews, st.sampled_from(FACTS))
    def run(doc: dict[str, Any], facts: ClusterFacts) -> None:
        a = answer(json.dumps(doc).encode(), facts, SETTINGS)
        check_answer(a, stats)
        if a.status != 200:
            return
        resp = a.body["response"]
        req = doc["request"]
        assert resp["uid"] == req["uid"]
        if not a.fields.get("judged"):  # not a pod CREATE or UPDATE: passed unchanged
            assert resp == {"uid": req["uid"], "allowed": True}
            return
        pod, user = req["object"], (req.get("userInfo") or {}).get("username")
        if req["operation"] == "UPDATE":
            assert "patch" not in resp, "an update is never mutated"
            if resp["allowed"] and user != TRUSTED:
                assert _internal(req["oldObject"]) == _internal(pod), "internal annotation altered"
            if not resp["allowed"]:
                assert resp["status"]["code"] == 403 and user != TRUSTED
            stats["judged update"] += 1
            return
        meta = pod.get("metadata")
        annotations = meta.get("annotations") if isinstance(meta, dict) else None
        presets = isinstance(annotations, dict) and any(
            str(k).startswith(ann.INTERNAL_PREFIXES) for k in annotations
        )
        if resp["allowed"] and user != TRUSTED:
            assert not presets, "an internal annotation got through"
        if not resp["allowed"] and resp["status"]["code"] == 403:
            assert user != TRUSTED
        if "patch" in resp:
            ops = json.loads(base64.b64decode(resp["patch"]))
            patched = apply_patch(pod, ops)  # raises if a path does not exist
            assert patched["spec"]["schedulerName"] == SETTINGS.scheduler_name
            assert asks_tessera(patched, SETTINGS.config)
            doc["request"]["object"] = patched
            again = answer(json.dumps(doc).encode(), facts, SETTINGS).body["response"]
            assert again["allowed"] and "patch" not in again, "the patch is not stable"

    run()
    _report("random reviews", stats)
    assert sum(stats.values()) >= 350
    # The generator reaches every outcome, so the invariants above were all exercised.
    assert {"http 400", "patched", "allowed unchanged", "denied 400", "denied 403"} <= set(stats)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from scheduler_plugins.webhook.server import server_ssl_context

    pki = ensure_serving_pki(tmp_path_factory.mktemp("pki"), ["localhost"])
    app = WebhookApp(
        SETTINGS, server_ssl_context(str(pki.cert), str(pki.key)), host="127.0.0.1", port=0
    )
    with app:
        yield app, pki.ca_cert


def test_random_bodies_over_https(served: tuple[WebhookApp, Path]) -> None:
    app, ca = served
    stats: Counter[str] = Counter()
    ctx = ssl.create_default_context(cafile=str(ca))
    conn = http.client.HTTPSConnection("localhost", app.server.address[1], context=ctx, timeout=5)

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.binary(max_size=256) | reviews.map(lambda d: json.dumps(d).encode()))
    def run(raw: bytes) -> None:
        conn.request("POST", "/mutate", raw, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        body = json.loads(resp.read())
        assert resp.status in (200, 400)
        check_answer(Answer(resp.status, body), stats)

    try:
        run()
    finally:
        conn.close()
    _report("over HTTPS", stats)
    assert sum(stats.values()) >= 50


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 7), st.integers(1, 4)).map(lambda t: Placement(*t)),
        min_size=1,
        max_size=7,
        unique=True,
    )
)
def test_max_disjoint_placements_is_optimal(placements: list[Placement]) -> None:
    def brute_force() -> int:
        for k in range(len(placements), 0, -1):
            for combo in itertools.combinations(placements, k):
                if all(not (a.mask & b.mask) for a, b in itertools.combinations(combo, 2)):
                    return k
        return 0

    profile = MigProfile("p", 1000, 10, 1, tuple(placements))
    assert max_disjoint_placements(profile) == brute_force()


@settings(max_examples=150, deadline=None)
@given(clusters(), st.data())
def test_the_cluster_checks_never_refuse_what_the_scheduler_places(
    state: ClusterState, data: st.DataObject
) -> None:
    """The facts are upper bounds: a pod some node fits passes, whatever modes it names."""
    facts = ClusterFacts.of(
        node_capacity(name, entry.devices) for name, entry in state.nodes.items() if entry.devices
    )
    for i in range(3):
        request = data.draw(requests(i), label=f"pod {i}")
        if decide(state, request).feasible_count():
            assert _impossible(request, facts, CFG) == [], request
