"""The AdmissionReview envelope: every malformed body is a 400 naming the problem; every
well-formed review gets a response with its uid."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from api.hami import keys as ann
from scheduler_plugins.webhook.facts import UNKNOWN
from scheduler_plugins.webhook.review import answer
from scheduler_plugins.webhook.rules import Settings
from tests.builders import make_pod

SETTINGS = Settings()


def review(
    obj: Any = None,
    *,
    operation: str = "CREATE",
    resource: str = "pods",
    group: str = "",
    sub: str | None = None,
    user: str = "alice",
) -> dict[str, Any]:
    req: dict[str, Any] = {
        "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
        "kind": {"group": group, "version": "v1", "kind": "Pod"},
        "resource": {"group": group, "version": "v1", "resource": resource},
        "requestKind": {"group": group, "version": "v1", "kind": "Pod"},
        "name": "",
        "namespace": "team-a",
        "operation": operation,
        "userInfo": {"username": user, "groups": ["system:authenticated"]},
        "object": obj if obj is not None else make_pod("p", "team-a").build(),
        "oldObject": None,
        "dryRun": False,
    }
    if sub is not None:
        req["subResource"] = sub
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": req}


def body(doc: Any) -> bytes:
    return json.dumps(doc).encode()


def _minus(key: str) -> dict[str, Any]:
    doc = review()
    del doc["request"][key]
    return doc


def _set(key: str, value: Any) -> dict[str, Any]:
    doc = review()
    doc["request"][key] = value
    return doc


BAD = [
    ("empty body", b"", "not JSON"),
    ("not JSON", b"{nope", "not JSON"),
    ("not UTF-8", b"\xff\xfe{}", "not JSON"),
    ("deeply nested", b"[" * 100_000 + b"]" * 100_000, "not JSON"),
    ("NaN is not JSON", b'{"a": NaN}', "NaN is not a JSON number"),
    ("Infinity is not JSON", b'{"a": -Infinity}', "-Infinity is not a JSON number"),
    ("a JSON list", b"[]", "got a JSON list"),
    ("a JSON string", b'"x"', "got a JSON str"),
    ("v1beta1", body({**review(), "apiVersion": "admission.k8s.io/v1beta1"}), "v1beta1"),
    ("wrong kind", body({**review(), "kind": "Pod"}), "kind 'Pod'"),
    (
        "no request",
        body({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}),
        "request",
    ),
    ("request not an object", body({**review(), "request": [1]}), "request must be an object"),
    ("no uid", body(_minus("uid")), "request.uid"),
    ("empty uid", body(_set("uid", "")), "request.uid"),
    ("uid not a string", body(_set("uid", 7)), "request.uid"),
    ("no resource", body(_minus("resource")), "request.resource"),
    ("no operation", body(_minus("operation")), "request.operation"),
    ("userInfo not an object", body(_set("userInfo", "bob")), "request.userInfo"),
    ("object not an object", body(_set("object", "pod")), "request.object"),
    ("pod CREATE without the pod", body(_set("object", None)), "request.object (the Pod)"),
    ("oldObject not an object", body(_set("oldObject", [])), "request.oldObject must be"),
    (
        "pod UPDATE without the old pod",
        body({**review(operation="UPDATE")}),
        "request.object and request.oldObject",
    ),
]


@pytest.mark.parametrize(("raw", "problem"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_malformed_body_is_http_400_naming_the_problem(raw: bytes, problem: str) -> None:
    a = answer(raw, UNKNOWN, SETTINGS)
    assert a.status == 400
    assert a.body["kind"] == "Status" and a.body["code"] == 400
    assert problem in a.body["message"]
    json.loads(a.payload())


def _response(doc: dict[str, Any]) -> dict[str, Any]:
    a = answer(body(doc), UNKNOWN, SETTINGS)
    assert a.status == 200
    assert a.body["apiVersion"] == "admission.k8s.io/v1"
    assert a.body["kind"] == "AdmissionReview"
    resp: dict[str, Any] = a.body["response"]
    assert resp["uid"] == doc["request"]["uid"]
    return resp


PASS_THROUGH = [
    ("pod DELETE", review(operation="DELETE")),
    ("unknown operation", review(operation="EXPLODE")),
    ("pods/binding (the scheduler binding)", review(sub="binding")),
    ("pods/ephemeralcontainers", review(sub="ephemeralcontainers", operation="UPDATE")),
    ("another resource", review({"kind": "ConfigMap"}, resource="configmaps")),
    ("another group's pods", review(group="example.com")),
]


@pytest.mark.parametrize("doc", [p[1] for p in PASS_THROUGH], ids=[p[0] for p in PASS_THROUGH])
def test_other_kinds_and_operations_pass_unchanged(doc: dict[str, Any]) -> None:
    # Even with an internal annotation: only pod CREATE and UPDATE are judged.
    doc["request"]["object"] = make_pod("p").gpu(None, mem=1).annotate(ann.BIND_PHASE, "x").build()
    assert _response(doc) == {"uid": doc["request"]["uid"], "allowed": True}


def _update(old: dict[str, Any], new: dict[str, Any], **kw: Any) -> dict[str, Any]:
    doc = review(new, operation="UPDATE", **kw)
    doc["request"]["oldObject"] = old
    return doc


@pytest.mark.parametrize("sub", [None, "status"], ids=["pod", "pods/status"])
def test_update_altering_an_internal_annotation_is_forbidden(sub: str | None) -> None:
    old = make_pod("p").gpu(1).annotate(ann.DEVICES_ALLOCATED, "GPU-0,NVIDIA,1000,0:;").build()
    new = make_pod("p").gpu(1).annotate(ann.DEVICES_ALLOCATED, "GPU-0,NVIDIA,1,0:;").build()
    resp = _response(_update(old, new, sub=sub))
    assert resp["allowed"] is False and resp["status"]["code"] == 403
    assert "alice may not change it" in resp["status"]["message"]
    assert "patch" not in resp


def test_update_of_other_fields_is_allowed_without_a_patch() -> None:
    old = make_pod("p").gpu(1).annotate(ann.BIND_PHASE, "success").build()
    new = make_pod("p").gpu(1).annotate(ann.BIND_PHASE, "success").annotate("team", "x").build()
    assert _response(_update(old, new)) == {"uid": review()["request"]["uid"], "allowed": True}


def test_mutation_is_a_base64_json_patch() -> None:
    resp = _response(review(make_pod("p").gpu(None, mem=1000).build()))
    assert resp["allowed"] is True
    assert resp["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(resp["patch"]))
    assert ops[0] == {"op": "add", "path": "/spec/schedulerName", "value": "hami-scheduler"}


def test_nothing_to_change_sends_no_patch() -> None:
    resp = _response(review(make_pod("p").container("c", cpu="1").build()))
    assert resp == {"uid": resp["uid"], "allowed": True}


def test_rejection_carries_code_reason_and_message() -> None:
    resp = _response(review(make_pod("p").gpu(1, cores=101).build()))
    assert resp["allowed"] is False
    assert "patch" not in resp
    status = resp["status"]
    assert (status["code"], status["reason"], status["status"]) == (400, "BadRequest", "Failure")
    assert "nvidia.com/gpucores = 101" in status["message"]
    forbidden = _response(review(make_pod("p").annotate(ann.VGPU_NODE, "n").build()))
    assert (forbidden["status"]["code"], forbidden["status"]["reason"]) == (403, "Forbidden")


def test_trusted_user_is_read_from_user_info() -> None:
    doc = review(make_pod("p").annotate(ann.VGPU_NODE, "n").build(), user="ops")
    a = answer(body(doc), UNKNOWN, Settings(trusted_users=frozenset({"ops"})))
    assert a.body["response"]["allowed"] is True


def test_log_fields_name_the_pod() -> None:
    pod = make_pod("", "team-a").gpu(1).build()
    pod["metadata"]["generateName"] = "job-"
    a = answer(body(review(pod)), UNKNOWN, SETTINGS)
    assert a.fields["pod"] == "team-a/job-<generated>"
    assert a.fields["allowed"] is True and a.fields["patch"] == ["/spec/schedulerName"]


def test_the_reviews_namespace_decides_where_pods_without_a_gpu_may_be_routed() -> None:
    routing = Settings(host_only_pods=True, host_only_exclude=frozenset({"team-a"}))
    cpu_pod = make_pod("p").container("c", cpu="1").build()
    del cpu_pod["metadata"]["namespace"]  # as kubectl sends it: the review names it
    excluded = answer(body(review(cpu_pod)), UNKNOWN, routing).body["response"]
    assert "patch" not in excluded
    doc = review(cpu_pod)
    doc["request"]["namespace"] = "team-b"
    routed = answer(body(doc), UNKNOWN, routing).body["response"]
    ops = json.loads(base64.b64decode(routed["patch"]))
    assert ops == [{"op": "add", "path": "/spec/schedulerName", "value": "hami-scheduler"}]
