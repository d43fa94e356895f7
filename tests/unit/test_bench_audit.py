"""The bench's API requests by client, read from kube-apiserver audit events."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import pytest

from scheduler_plugins.devtools.bench import audit

T0 = datetime(2026, 12, 5, 6, 0, 0, tzinfo=UTC).timestamp()


def event(
    stage: str,
    verb: str,
    agent: str | None,
    *,
    at: float = T0 + 1,
    resource: str | None = "pods",
    sub: str | None = None,
    uri: str = "/api/v1/namespaces/d/pods/p",
) -> bytes:
    e: dict[str, Any] = {
        "kind": "Event",
        "apiVersion": "audit.k8s.io/v1",
        "level": "Metadata",
        "stage": stage,
        "verb": verb,
        "requestURI": uri,
        "requestReceivedTimestamp": datetime.fromtimestamp(at, UTC).isoformat(),
    }
    if agent is not None:
        e["userAgent"] = agent
    if resource is not None:
        e["objectRef"] = {"resource": resource, "namespace": "d", "name": "p"}
        if sub is not None:
            e["objectRef"]["subresource"] = sub
    return orjson.dumps(e)


@pytest.mark.parametrize(
    ("agent", "client"),
    [
        ("kube-scheduler/v1.36.0 (linux/amd64) kubernetes/abc", "kube-scheduler"),
        ("tessera-node-agent", "tessera-node-agent"),
        ("kwok/v0.7.0 (linux/amd64)", "kwok"),
        ("Go-http-client/2.0", "Go-http-client"),
        ("python client", "python"),
        ("", audit.NO_AGENT),
        (None, audit.NO_AGENT),
        (7, audit.NO_AGENT),
    ],
)
def test_a_client_is_the_product_its_user_agent_names(agent: object, client: str) -> None:
    assert audit.client_of(agent) == client


def test_each_request_counts_once_in_its_window_by_client_verb_and_resource() -> None:
    lines = [
        event("ResponseComplete", "patch", "tessera-node-agent"),
        event("ResponseComplete", "patch", "tessera-node-agent", at=T0 + 2),
        event("ResponseStarted", "patch", "tessera-node-agent"),  # not a watch: at its end
        event("ResponseComplete", "create", "kube-scheduler/v1", sub="binding"),
        event("ResponseStarted", "watch", "tessera-plugin-server"),  # a watch: at its start
        event("ResponseComplete", "watch", "tessera-plugin-server"),
        event("ResponseComplete", "get", None, resource=None, uri="/metrics?x=1"),
        event("ResponseComplete", "patch", "kwok/v0.7", at=T0 - 1),  # before the window
        event("ResponseComplete", "patch", "kwok/v0.7", at=T0 + 11),  # after it
        b"",
    ]
    got = audit.count_lines(lines, T0, T0 + 10)
    assert got.unreadable == 0
    assert got.rows(2) == [
        {
            "client": "tessera-node-agent",
            "verb": "patch",
            "resource": "pods",
            "count": 2,
            "per_pod": 1.0,
        },
        {
            "client": "kube-scheduler",
            "verb": "create",
            "resource": "pods/binding",
            "count": 1,
            "per_pod": 0.5,
        },
        {
            "client": "tessera-plugin-server",
            "verb": "watch",
            "resource": "pods",
            "count": 1,
            "per_pod": 0.5,
        },
        {
            "client": audit.NO_AGENT,
            "verb": "get",
            "resource": "/metrics",
            "count": 1,
            "per_pod": 0.5,
        },
    ]


def test_lines_that_are_not_audit_events_are_counted_and_skipped() -> None:
    good = event("ResponseComplete", "patch", "kwok")
    no_time = orjson.loads(good)
    del no_time["requestReceivedTimestamp"]
    bad_time = {**orjson.loads(good), "requestReceivedTimestamp": "yesterday"}
    lines = [
        good,
        b'{"kind":"Event","stage":"Respo',  # a half-written last line
        b"[1, 2]",
        b'{"kind":"Pod"}',
        orjson.dumps(no_time),
        orjson.dumps(bad_time),
    ]
    got = audit.count_lines(lines, T0, T0 + 10)
    assert got.unreadable == 5
    assert got.counts == {("kwok", "patch", "pods"): 1}
    assert got.rows(0)[0]["per_pod"] is None


def test_the_log_is_read_from_the_log_dir_and_its_absence_means_audit_off(tmp_path: Path) -> None:
    assert audit.requests_by_client(tmp_path, T0, T0 + 10) is None
    (tmp_path / audit.LOG_FILE).write_bytes(event("ResponseComplete", "get", "kwok") + b"\n")
    got = audit.requests_by_client(tmp_path, T0, T0 + 10)
    assert got is not None and got.counts == {("kwok", "get", "pods"): 1}


def test_the_apiserver_flags_write_the_policy_they_name(tmp_path: Path) -> None:
    flags = audit.apiserver_flags(tmp_path, tmp_path / "logs")
    assert f"--audit-policy-file={tmp_path / audit.POLICY_FILE}" in flags
    assert f"--audit-log-path={tmp_path / 'logs' / audit.LOG_FILE}" in flags
    assert (tmp_path / audit.POLICY_FILE).read_text() == audit.AUDIT_POLICY
