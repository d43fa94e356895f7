"""The ``admission.k8s.io/v1`` AdmissionReview envelope: body bytes in, HTTP answer out.

``answer`` is the whole webhook as a pure function of (body, cluster facts, settings): a
malformed body gets HTTP 400 with a message naming the problem; a well-formed review always
gets HTTP 200 with an AdmissionReview response carrying the request's ``uid``. Pod CREATE
is judged by ``rules.review_pod``, pod (and pod status) UPDATE by ``rules.review_pod_update``;
every other kind, subresource or operation is allowed unchanged.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, cast

from scheduler_plugins.webhook.errors import MalformedReviewError
from scheduler_plugins.webhook.facts import ClusterFacts
from scheduler_plugins.webhook.rules import PodVerdict, Settings, review_pod, review_pod_update

API_VERSION: Final = "admission.k8s.io/v1"
KIND: Final = "AdmissionReview"
_REASONS: Final = {400: "BadRequest", 403: "Forbidden"}


@dataclass(frozen=True)
class AdmissionRequest:
    """The fields of ``request`` the webhook reads."""

    uid: str
    group: str  # of request.resource
    version: str
    resource: str
    sub_resource: str
    operation: str
    namespace: str
    name: str
    user: str
    obj: Mapping[str, Any] | None  # request.object
    old: Mapping[str, Any] | None = None  # request.oldObject (UPDATE)

    @property
    def is_pod_create(self) -> bool:
        return (self.group, self.version, self.resource, self.sub_resource) == (
            "",
            "v1",
            "pods",
            "",
        ) and self.operation == "CREATE"

    @property
    def is_pod_update(self) -> bool:
        return (
            (self.group, self.version, self.resource) == ("", "v1", "pods")
            and self.sub_resource in ("", "status")
            and self.operation == "UPDATE"
        )

    def pod_key(self) -> str:
        """``namespace/name`` for logs; a pod created with ``generateName`` has no name yet."""
        meta = self.obj.get("metadata") if self.obj is not None else None
        meta = meta if isinstance(meta, dict) else {}
        name = self.name or meta.get("name") or f"{meta.get('generateName') or ''}<generated>"
        return f"{self.namespace or meta.get('namespace') or ''}/{name}"


@dataclass(frozen=True)
class Answer:
    """What the HTTP adapter sends (status and JSON body) and logs (``fields``)."""

    status: int
    body: dict[str, Any]
    fields: dict[str, Any] = field(default_factory=dict)

    def payload(self) -> bytes:
        return json.dumps(self.body, separators=(",", ":")).encode()


def _str(m: Mapping[str, Any], key: str, where: str, *, required: bool = False) -> str:
    v = m.get(key)
    if v is None and not required:
        return ""
    if not isinstance(v, str) or (required and not v):
        raise MalformedReviewError(f"{where}.{key} must be a non-empty string, got {v!r}")
    return v


def _map(m: Mapping[str, Any], key: str, where: str, *, required: bool = True) -> dict[str, Any]:
    v = m.get(key)
    if v is None and not required:
        return {}
    if not isinstance(v, dict):
        raise MalformedReviewError(f"{where}.{key} must be an object, got {type(v).__name__}")
    return cast("dict[str, Any]", v)


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not a JSON number")


def parse_review(body: bytes) -> AdmissionRequest:
    """The request of an AdmissionReview; MalformedReviewError says what is wrong."""
    try:
        raw = json.loads(body, parse_constant=_not_json)
    except (ValueError, RecursionError) as e:  # ValueError covers bad UTF-8 and huge ints
        raise MalformedReviewError(f"the body is not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise MalformedReviewError(
            f"the body must be an AdmissionReview object, got a JSON {type(raw).__name__}"
        )
    review = cast("dict[str, Any]", raw)
    if review.get("apiVersion") != API_VERSION or review.get("kind") != KIND:
        raise MalformedReviewError(
            f"expected apiVersion {API_VERSION} kind {KIND}, got apiVersion "
            f"{review.get('apiVersion')!r} kind {review.get('kind')!r} (the webhook "
            "configuration must list admissionReviewVersions: [v1])"
        )
    req = _map(review, "request", "AdmissionReview")
    where = "request"
    resource = _map(req, "resource", where)
    user_info = _map(req, "userInfo", where, required=False)
    obj = req.get("object")
    if obj is not None and not isinstance(obj, dict):
        raise MalformedReviewError(f"request.object must be an object, got {type(obj).__name__}")
    old = req.get("oldObject")
    if old is not None and not isinstance(old, dict):
        raise MalformedReviewError(f"request.oldObject must be an object, got {type(old).__name__}")
    parsed = AdmissionRequest(
        uid=_str(req, "uid", where, required=True),
        group=_str(resource, "group", "request.resource"),
        version=_str(resource, "version", "request.resource", required=True),
        resource=_str(resource, "resource", "request.resource", required=True),
        sub_resource=_str(req, "subResource", where),
        operation=_str(req, "operation", where, required=True),
        namespace=_str(req, "namespace", where),
        name=_str(req, "name", where),
        user=_str(user_info, "username", "request.userInfo"),
        obj=cast("dict[str, Any] | None", obj),
        old=cast("dict[str, Any] | None", old),
    )
    if parsed.is_pod_create and parsed.obj is None:
        raise MalformedReviewError("request.object (the Pod) is missing from a pod CREATE")
    if parsed.is_pod_update and (parsed.obj is None or parsed.old is None):
        raise MalformedReviewError(
            "request.object and request.oldObject (the Pod after and before) are required "
            "for a pod UPDATE"
        )
    return parsed


def response(uid: str, verdict: PodVerdict) -> dict[str, Any]:
    """The AdmissionReview answering ``uid`` with ``verdict``."""
    out: dict[str, Any] = {"uid": uid, "allowed": verdict.allowed}
    if not verdict.allowed:
        out["status"] = {
            "status": "Failure",
            "code": verdict.code,
            "reason": _REASONS[verdict.code],
            "message": verdict.message,
        }
    elif verdict.patch:
        ops = [op.to_json() for op in verdict.patch]
        out["patchType"] = "JSONPatch"
        out["patch"] = base64.b64encode(json.dumps(ops, separators=(",", ":")).encode()).decode()
    return {"apiVersion": API_VERSION, "kind": KIND, "response": out}


def bad_request(message: str) -> dict[str, Any]:
    """The body of an HTTP 400: a ``meta/v1`` Status, as the apiserver itself answers."""
    return {
        "apiVersion": "v1",
        "kind": "Status",
        "status": "Failure",
        "code": 400,
        "reason": "BadRequest",
        "message": f"malformed AdmissionReview: {message}",
    }


def answer(body: bytes, facts: ClusterFacts, settings: Settings) -> Answer:
    """The webhook: judge one AdmissionReview body."""
    try:
        req = parse_review(body)
    except MalformedReviewError as e:
        return Answer(400, bad_request(str(e)), {"error": str(e)})
    fields: dict[str, Any] = {
        "uid": req.uid,
        "operation": req.operation,
        "resource": req.resource,
        "user": req.user,
    }
    if req.is_pod_update and req.obj is not None and req.old is not None:
        verdict = review_pod_update(req.old, req.obj, user=req.user, settings=settings)
    elif req.is_pod_create and req.obj is not None:
        verdict = review_pod(
            req.obj, user=req.user, facts=facts, settings=settings, namespace=req.namespace
        )
    else:
        return Answer(200, response(req.uid, PodVerdict()), {**fields, "judged": False})
    fields.update(
        pod=req.pod_key(),
        judged=True,
        allowed=verdict.allowed,
        facts_known=facts.known,
    )
    if verdict.allowed:
        fields["patch"] = [op.path for op in verdict.patch]
    else:
        fields.update(code=verdict.code, message=verdict.message)
    return Answer(200, response(req.uid, verdict), fields)
