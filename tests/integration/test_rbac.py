"""The chart's RBAC and admission policies, applied for real to the dev cluster's apiserver.

The dev apiserver runs with ``--authorization-mode=RBAC`` (devcluster/cluster.py), so what
is asked here is answered by the same authorizer a production cluster uses:

- SubjectAccessReview, table-driven, per ServiceAccount: it can do what its component calls
  (the verbs below, each pointing at the code that makes the call) and cannot do what it must
  not (delete or create pods, read secrets, patch nodes, escalate RBAC, ...).
- Granted == needed: the rules bound to each account are exactly its table, nothing more;
  the scheduler's are the apiserver's own system:kube-scheduler and system:volume-scheduler
  rules (read live), minus the stock scheduler's named lease, plus its own lease.
- The admission policies, with real tokens: the node agent (pod-bound token naming its node)
  may change only its node and the pods bound to it, only the annotations it owns; the plugin
  server only the scheduling annotations.
- The real components run with nothing but their account's token: tessera-scheduler with the
  chart's KubeSchedulerConfiguration and the plugin server schedule a GPU pod, the webhook
  lists nodes, the node agent registers its node; none of them logs a forbidden call.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import http.client
import json
import os
import signal
import ssl
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from api.hami import keys as ann
from api.kube.client import KubeClient
from api.kube.errors import ApiError, NotFoundError
from scheduler_plugins.devtools.cluster.testing import ClusterClient, free_ports
from scheduler_plugins.server.events import REASON as UNSCHEDULABLE_REASON
from tests.integration.test_chart import (
    Rendered,
    flag_value,
    fullname,
    kubectl_apply,
    remove_namespace,
    render,
)
from tests.waiting import eventually

pytestmark = pytest.mark.integration

NS = "tessera-rbac"
SCHEDULER_NAME = "tessera-rbac-test"  # not hami-scheduler: no other scheduler may take the pods
AGENT_NODE = "rbac-node-a"
OTHER_NODE = "rbac-node-b"
WAIT_S = 90.0
TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
APPLIED_KINDS = frozenset(
    {
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    }
)
VALUES: dict[str, Any] = {
    "scheduler": {"schedulerName": SCHEDULER_NAME, "pluginServer": {"prebindWait": 5}},
    # The agent's node in MIG mode, so it also lists its pods (restart adoption, reconcile).
    "deviceConfig": {"nvidia": {"nodeconfig": [{"name": AGENT_NODE, "operatingmode": "mig"}]}},
}


@dataclass(frozen=True)
class Access:
    """One request: a verb on a resource, optionally in a namespace and by object name."""

    verb: str
    resource: str
    group: str = ""
    subresource: str = ""
    namespace: str = ""  # "": every namespace (or cluster-scoped)
    name: str = ""

    def attributes(self) -> dict[str, str]:
        attrs = {"verb": self.verb, "group": self.group, "resource": self.resource}
        for key in ("subresource", "namespace", "name"):
            if getattr(self, key):
                attrs[key] = getattr(self, key)
        return attrs

    def __str__(self) -> str:
        target = ".".join(p for p in (self.resource, self.group) if p)
        target += f"/{self.subresource}" if self.subresource else ""
        named = f" {self.name}" if self.name else ""
        where = f" in {self.namespace}" if self.namespace else ""
        return f"{self.verb} {target}{named}{where}"


def a(spec: str) -> Access:
    """``"verb resource[.group][/subresource][ name][ in namespace]"`` (kubectl's notation)."""
    words = spec.split()
    namespace = ""
    if len(words) >= 2 and words[-2] == "in":
        namespace, words = words[-1], words[:-2]
    verb, target, *name = words
    target, _, sub = target.partition("/")
    resource, _, group = target.partition(".")
    return Access(verb, resource, group, sub, namespace, name[0] if name else "")


def sar(cluster: ClusterClient, account: str, access: Access) -> bool:
    """Whether ``system:serviceaccount:NS:account`` may do ``access`` (SubjectAccessReview)."""
    body = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": {
            "user": f"system:serviceaccount:{NS}:{account}",
            "groups": [
                "system:serviceaccounts",
                f"system:serviceaccounts:{NS}",
                "system:authenticated",
            ],
            "resourceAttributes": access.attributes(),
        },
    }
    answer = cluster.api.post("/apis/authorization.k8s.io/v1/subjectaccessreviews", body)
    return bool(answer["status"].get("allowed"))


FULL = fullname()
LEASE = f"{FULL}-scheduler"
ACCOUNTS = {
    "scheduler": f"{FULL}-scheduler",
    "plugin-server": f"{FULL}-plugin-server",
    "webhook": f"{FULL}-webhook",
    "node-agent": f"{FULL}-node-agent",
}

# What each component calls (the "can" table), from the code.
NEEDS: dict[str, list[Access]] = {
    "plugin-server": [
        a("list nodes"),  # server/watch.py: reflector on /api/v1/nodes
        a("watch nodes"),
        a("list pods"),  # server/watch.py: reflector on /api/v1/pods (all namespaces)
        a("watch pods"),
        a("patch pods in default"),  # server/servicer.py: PreBind and Unreserve merge patches
        a("create events in default"),  # server/events.py: TesseraUnschedulable
        a("list podgroups.scheduling.k8s.io"),  # server/gangs.py: reflector on PodGroups
        a("watch podgroups.scheduling.k8s.io"),
    ],
    "webhook": [
        a("list nodes"),  # webhook/app.py: reflector on /api/v1/nodes
        a("watch nodes"),
    ],
    "node-agent": [
        a(f"get nodes {AGENT_NODE}"),  # registration.py: read the register annotation
        a(f"patch nodes {AGENT_NODE}"),  # registration.py: publish it
        a("list pods"),  # allocator.py, agent.py: pods with spec.nodeName=<node>
        a("get pods in default"),  # allocator.py: re-read after a write conflict
        a("patch pods in default"),  # allocator.py: allocation annotations
    ],
    # kube-scheduler's own needs come from the live system roles (test below); these are ours.
    "scheduler": [
        a(f"create leases.coordination.k8s.io in {NS}"),
        a(f"get leases.coordination.k8s.io {LEASE} in {NS}"),
        a(f"update leases.coordination.k8s.io {LEASE} in {NS}"),
        a("get configmaps extension-apiserver-authentication in kube-system"),
        a("create pods/binding in default"),
        a("delete pods in default"),  # preemption
        a("patch pods/status in default"),
        a("create events.events.k8s.io in default"),
    ],
}

# What no component may do, and what each in particular must not.
NEVER = [
    a("create pods in default"),
    a("update pods in default"),
    a("delete nodes"),
    a("update nodes/status"),
    a("get secrets in default"),
    a("list secrets"),
    a(f"get secrets in {NS}"),
    a(f"get secrets {FULL}-webhook-tls in {NS}"),
    a("create pods/exec in default"),
    a("create pods/eviction in default"),
    a("create serviceaccounts/token in default"),
    a(f"create serviceaccounts/token in {NS}"),
    a("impersonate users"),
    a("impersonate serviceaccounts in default"),
    a("escalate clusterroles.rbac.authorization.k8s.io"),
    a("bind clusterroles.rbac.authorization.k8s.io"),
    a("create clusterrolebindings.rbac.authorization.k8s.io"),
    a(f"create rolebindings.rbac.authorization.k8s.io in {NS}"),
    a(f"patch clusterroles.rbac.authorization.k8s.io {FULL}-plugin-server"),
    a("create mutatingwebhookconfigurations.admissionregistration.k8s.io"),
    a(f"delete validatingadmissionpolicies.admissionregistration.k8s.io {FULL}-pod-annotations"),
    a(f"patch deployments.apps {FULL}-scheduler in {NS}"),
    a(f"patch daemonsets.apps {FULL}-node-agent in {NS}"),
    a("get configmaps in kube-system"),
    a("create certificatesigningrequests.certificates.k8s.io"),
]
MUST_NOT: dict[str, list[Access]] = {
    "plugin-server": [
        a("delete pods in default"),
        a("patch nodes"),
        a("create pods/binding in default"),
        a("patch pods/status in default"),
        a("create events.events.k8s.io in default"),
        a("create leases.coordination.k8s.io in kube-system"),
    ],
    "webhook": [
        a("list pods"),
        a("patch pods in default"),
        a("get nodes"),
        a("patch nodes"),
        a("create events in default"),
    ],
    "node-agent": [
        a("delete pods in default"),
        a("create pods/binding in default"),
        a("patch pods/status in default"),
        a("patch nodes/status"),
        a("list nodes"),
        a("watch pods"),
        a("create events in default"),
    ],
    "scheduler": [
        a("patch pods in default"),
        a("patch nodes"),
        a("update leases.coordination.k8s.io kube-scheduler in kube-system"),
        a("create leases.coordination.k8s.io in kube-system"),
        a(f"update leases.coordination.k8s.io other-lease in {NS}"),
        a("get configmaps other in kube-system"),
    ],
}


# Fixtures ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Release:
    rendered: Rendered
    namespace: str


@pytest.fixture(scope="module")
def helm_bin(built_tools: Path) -> Path:
    return built_tools / "helm"


@pytest.fixture(scope="module")
def release(
    dev_cluster: ClusterClient, helm_bin: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Release]:
    """The chart's accounts, RBAC and admission policies, applied for real into ``NS``."""
    api = dev_cluster.api
    rendered = render(helm_bin, VALUES, namespace=NS)
    applied = Rendered(
        tuple(o for o in rendered.objects if o["kind"] in APPLIED_KINDS),
        yaml.safe_dump_all([o for o in rendered.objects if o["kind"] in APPLIED_KINDS]),
    )
    api.post(
        "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}
    )
    for node in (AGENT_NODE, OTHER_NODE):
        api.post("/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}})
    work = tmp_path_factory.mktemp("rbac")
    try:
        kubectl_apply(dev_cluster, applied, work, dry_run=False)
        _wait_authorizer_has(dev_cluster, applied.objects)
        yield Release(rendered, NS)
    finally:
        (work / "manifest.yaml").write_text(applied.text)
        dev_cluster.kubectl(
            "delete", "--ignore-not-found", "--wait=false", "-f", str(work / "manifest.yaml")
        )
        for path in (f"/api/v1/nodes/{AGENT_NODE}", f"/api/v1/nodes/{OTHER_NODE}"):
            with contextlib.suppress(NotFoundError):
                api.delete(path)
        _delete_pods(api, NS)
        remove_namespace(dev_cluster, NS)


def _first_grant(api: KubeClient, binding: dict[str, Any]) -> Access:
    """One access the role that ``binding`` refers to grants (its first resource rule's first
    verb on its first resource), where the binding grants it. The role may be the release's
    or one the apiserver ships (``system:kube-scheduler``)."""
    ref, meta = binding["roleRef"], binding["metadata"]
    where = meta.get("namespace", "") if binding["kind"] == "RoleBinding" else ""
    rbac = "/apis/rbac.authorization.k8s.io/v1"
    path = (
        f"{rbac}/namespaces/{where}/roles/{ref['name']}"
        if ref["kind"] == "Role"
        else f"{rbac}/clusterroles/{ref['name']}"
    )
    rule = next(r for r in api.get(path)["rules"] if r.get("resources"))
    resource, _, sub = rule["resources"][0].partition("/")
    names = rule.get("resourceNames") or [""]
    return Access(rule["verbs"][0], resource, rule["apiGroups"][0], sub, where, names[0])


def _wait_authorizer_has(cluster: ClusterClient, objects: tuple[dict[str, Any], ...]) -> None:
    """Return once the RBAC authorizer, which reads roles and bindings from its informer
    cache, allows what every applied binding grants: right after the apply it may not yet."""
    grants = [
        (subject["name"], _first_grant(cluster.api, binding), binding["metadata"]["name"])
        for binding in objects
        if binding["kind"] in ("RoleBinding", "ClusterRoleBinding")
        for subject in binding["subjects"]
        if subject["kind"] == "ServiceAccount" and subject["namespace"] == NS
    ]
    assert grants, "the release binds none of its accounts"
    for account, access, binding in grants:
        eventually(
            functools.partial(sar, cluster, account, access),
            timeout_s=WAIT_S,
            what=f"{binding} lets {account} {access}",
        )


def _delete_pods(api: KubeClient, namespace: str) -> None:
    for pod in api.list(f"/api/v1/namespaces/{namespace}/pods")["items"]:
        with contextlib.suppress(NotFoundError):
            api.request(
                "DELETE",
                f"/api/v1/namespaces/{namespace}/pods/{pod['metadata']['name']}",
                {"gracePeriodSeconds": 0},
            )


# SubjectAccessReview tables ---------------------------------------------------------------


def _cases(table: dict[str, list[Access]]) -> list[tuple[str, Access]]:
    return [(component, access) for component, accesses in table.items() for access in accesses]


@pytest.mark.parametrize(("component", "access"), _cases(NEEDS), ids=str)
def test_account_can_do_what_its_component_calls(
    dev_cluster: ClusterClient, release: Release, component: str, access: Access
) -> None:
    assert sar(dev_cluster, ACCOUNTS[component], access), f"{component} cannot {access}"


NOT_CASES = _cases({c: [*NEVER, *extra] for c, extra in MUST_NOT.items()})


@pytest.mark.parametrize(("component", "access"), NOT_CASES, ids=str)
def test_account_cannot_do_what_it_must_not(
    dev_cluster: ClusterClient, release: Release, component: str, access: Access
) -> None:
    assert not sar(dev_cluster, ACCOUNTS[component], access), f"{component} can {access}"


def _upstream_scheduler_rules(cluster: ClusterClient) -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = []
    for role in ("system:kube-scheduler", "system:volume-scheduler"):
        got = cluster.api.get(f"/apis/rbac.authorization.k8s.io/v1/clusterroles/{role}")
        rules.extend(got["rules"])
    return rules


def _expand(rules: Sequence[dict[str, Any]]) -> set[tuple[str, str, str, str]]:
    """(group, resource, verb, resourceName or "*") for every combination a rule grants."""
    out: set[tuple[str, str, str, str]] = set()
    for r in rules:
        for g in r.get("apiGroups", []):
            for res in r["resources"]:
                for v in r["verbs"]:
                    for n in r.get("resourceNames") or ["*"]:
                        out.add((g, res, v, n))
    return out


def test_scheduler_can_do_everything_kube_scheduler_can(
    dev_cluster: ClusterClient, release: Release
) -> None:
    """tessera-scheduler is kube-scheduler 1.36: every rule the apiserver's own roles give
    kube-scheduler holds for its account, except the stock scheduler's named lock objects
    (ours is the lease in the release namespace, checked in NEEDS)."""
    checked = 0
    for group, resource, verb, name in sorted(_expand(_upstream_scheduler_rules(dev_cluster))):
        if name != "*":
            continue  # the lease/endpoints named kube-scheduler: not ours to touch
        namespace = NS if group == "coordination.k8s.io" else ""
        res, _, sub = resource.partition("/")
        access = Access(verb, res, group, sub, namespace)
        assert sar(dev_cluster, ACCOUNTS["scheduler"], access), f"scheduler cannot {access}"
        checked += 1
    assert checked > 50


def _bound_rules(rendered: Rendered, account: str) -> dict[str, list[dict[str, Any]]]:
    """The rules bound to ``account`` by the chart, by where they apply (namespace or "")."""
    roles = {
        (o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]): o
        for o in rendered.objects
    }
    out: dict[str, list[dict[str, Any]]] = {}
    for binding in rendered.objects:
        if binding["kind"] not in ("ClusterRoleBinding", "RoleBinding"):
            continue
        if not any(s["name"] == account for s in binding["subjects"]):
            continue
        ref = binding["roleRef"]
        scope = binding["metadata"].get("namespace", "")
        role = roles.get((ref["kind"], scope if ref["kind"] == "Role" else "", ref["name"]))
        if role is None:  # a built-in role (kube-system's authentication reader)
            out.setdefault(f"{scope}:{ref['name']}", [])
            continue
        out.setdefault(scope, []).extend(role["rules"])
    return out


def test_rules_granted_are_exactly_the_ones_needed(
    dev_cluster: ClusterClient, release: Release
) -> None:
    rendered = release.rendered
    need_cluster = {
        "plugin-server": [
            {"apiGroups": [""], "resources": ["nodes"], "verbs": ["list", "watch"]},
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch", "patch"]},
            {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
            {
                "apiGroups": ["scheduling.k8s.io"],
                "resources": ["podgroups"],
                "verbs": ["list", "watch"],
            },
        ],
        "webhook": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["list", "watch"]}],
        "node-agent": [
            {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]},
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "patch"]},
        ],
    }
    for component, rules in need_cluster.items():
        bound = _bound_rules(rendered, ACCOUNTS[component])
        assert set(bound) == {""}, f"{component} is bound outside the cluster scope: {set(bound)}"
        assert _expand(bound[""]) == _expand(rules), component
    # The scheduler: kube-scheduler's cluster-wide rules, without the lease and lease candidate
    # rules, which apply in the release namespace only, plus the authentication reader.
    upstream = {
        r
        for r in _expand(_upstream_scheduler_rules(dev_cluster))
        if r[3] == "*" and r[0] != "coordination.k8s.io"
    }
    bound = _bound_rules(rendered, ACCOUNTS["scheduler"])
    assert set(bound) == {"", NS, "kube-system:extension-apiserver-authentication-reader"}
    assert _expand(bound[""]) == upstream
    assert {r[0] for r in _expand(bound[NS])} == {"coordination.k8s.io"}
    assert {(r[1], r[3]) for r in _expand(bound[NS]) if r[2] in ("get", "update")} == {
        ("leases", LEASE),
        ("leasecandidates", "*"),
    }


def test_shared_identity_gives_the_scheduler_account_all_three_roles(helm_bin: Path) -> None:
    """scheduler.separateIdentities=false: one account for the whole scheduler pod, holding
    the shim's, the plugin server's and the webhook's rules, and no token Secrets."""
    rendered = render(helm_bin, {"scheduler": {"separateIdentities": False}}, namespace=NS)
    bound = _bound_rules(rendered, ACCOUNTS["scheduler"])
    roles = {
        o["metadata"]["name"]: o["rules"] for o in rendered.objects if o["kind"] == "ClusterRole"
    }
    expected = [
        *roles[f"{FULL}-scheduler"],
        *roles[f"{FULL}-plugin-server"],
        *roles[f"{FULL}-webhook"],
    ]
    assert _expand(bound[""]) == _expand(expected)
    assert not [o for o in rendered.of_kind("Secret") if o["type"].endswith("token")]
    accounts = {o["metadata"]["name"] for o in rendered.of_kind("ServiceAccount")}
    assert accounts == {ACCOUNTS["scheduler"], ACCOUNTS["node-agent"]}
    pod = rendered.pod_spec(f"{FULL}-scheduler")
    assert pod["automountServiceAccountToken"] is True
    mounts = [
        m for c in pod["containers"] for m in c["volumeMounts"] if m["mountPath"] == TOKEN_DIR
    ]
    assert mounts == []  # the kubelet mounts the pod's own token in every container


# Admission policies with real tokens --------------------------------------------------------


def token(cluster: ClusterClient, account: str, *, bound_pod: dict[str, Any] | None = None) -> str:
    """A TokenRequest token of ``account`` (bound to a pod: the token names its node)."""
    spec: dict[str, Any] = {"expirationSeconds": 1200}
    if bound_pod is not None:
        meta = bound_pod["metadata"]
        spec["boundObjectRef"] = {
            "kind": "Pod",
            "apiVersion": "v1",
            "name": meta["name"],
            "uid": meta["uid"],
        }
    answer = cluster.api.post(
        f"/api/v1/namespaces/{NS}/serviceaccounts/{account}/token",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
    )
    value: str = answer["status"]["token"]
    return value


def pod(
    name: str,
    *,
    node: str | None = None,
    account: str | None = None,
    gpu_mem: int | None = None,
    scheduler: str | None = None,
) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "main", "image": "registry.invalid/cuda:latest"}
    if gpu_mem is not None:
        container["resources"] = {
            "limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": str(gpu_mem)}
        }
    spec: dict[str, Any] = {"containers": [container], "terminationGracePeriodSeconds": 0}
    if node:
        spec["nodeName"] = node
    if account:
        spec["serviceAccountName"] = account
        spec["automountServiceAccountToken"] = False
    if scheduler:
        spec["schedulerName"] = scheduler
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS},
        "spec": spec,
    }


@pytest.fixture(scope="module")
def agent_client(dev_cluster: ClusterClient, release: Release) -> Iterator[KubeClient]:
    """The node agent's API client with a token bound to its pod on AGENT_NODE."""
    agent_pod = dev_cluster.api.post(
        f"/api/v1/namespaces/{NS}/pods",
        pod("agent", node=AGENT_NODE, account=ACCOUNTS["node-agent"]),
    )
    with KubeClient(
        dev_cluster.server,
        token(dev_cluster, ACCOUNTS["node-agent"], bound_pod=agent_pod),
        dev_cluster.ca_file,
    ) as client:
        # The apiserver enforces a new admission policy once its informer has it: on a busy
        # machine the first writes could pass before. Wait on a write it must deny that is
        # harmless if it passes (a probe annotation on the other test node).
        def enforced() -> bool:
            try:
                client.merge_patch(f"/api/v1/nodes/{OTHER_NODE}", _annotate(PROBE, "x"))
            except ApiError as e:
                return e.status == 403 and "ValidatingAdmissionPolicy" in str(e)
            return False

        eventually(enforced, timeout_s=60, interval_s=0.5, what="admission policies enforced")
        yield client


@pytest.fixture(scope="module")
def workloads(dev_cluster: ClusterClient, release: Release) -> dict[str, str]:
    """One pod bound to each test node: {node: pod name}."""
    out = {}
    for node in (AGENT_NODE, OTHER_NODE):
        name = f"work-on-{node}"
        dev_cluster.api.post(f"/api/v1/namespaces/{NS}/pods", pod(name, node=node))
        out[node] = name
    return out


PROBE = "tessera.test/policy-probe"


def _annotate(key: str, value: str | None) -> dict[str, Any]:
    return {"metadata": {"annotations": {key: value}}}


def _label(key: str, value: str | None) -> dict[str, Any]:
    return {"metadata": {"labels": {key: value}}}


# (what, object path template, patch, allowed?). {pod_here}/{pod_there}: pods on the agent's
# node and on another one.
AGENT_WRITES: list[tuple[str, str, dict[str, Any], bool]] = [
    (
        "own node: register annotation",
        f"/api/v1/nodes/{AGENT_NODE}",
        _annotate(ann.NODE_REGISTER, "[]"),
        True,
    ),
    (
        "own node: handshake",
        f"/api/v1/nodes/{AGENT_NODE}",
        _annotate("hami.io/node-handshake", "Reported now"),
        True,
    ),
    (
        "other node: register annotation",
        f"/api/v1/nodes/{OTHER_NODE}",
        _annotate(ann.NODE_REGISTER, "[]"),
        False,
    ),
    (
        "own node: another annotation",
        f"/api/v1/nodes/{AGENT_NODE}",
        _annotate("example.com/x", "1"),
        False,
    ),
    (
        "own node: a label",
        f"/api/v1/nodes/{AGENT_NODE}",
        {"metadata": {"labels": {"gpu": "on"}}},
        False,
    ),
    (
        "own node: unschedulable",
        f"/api/v1/nodes/{AGENT_NODE}",
        {"spec": {"unschedulable": True}},
        False,
    ),
    ("pod on own node: bind phase", "{pod_here}", _annotate(ann.BIND_PHASE, "success"), True),
    ("pod on own node: to-allocate", "{pod_here}", _annotate(ann.DEVICES_TO_ALLOCATE, ";"), True),
    ("pod on own node: MIG record", "{pod_here}", _annotate(ann.MIG_ALLOCATIONS, "[]"), True),
    ("pod on own node: remove bind phase", "{pod_here}", _annotate(ann.BIND_PHASE, None), True),
    ("pod on own node: chosen node", "{pod_here}", _annotate(ann.VGPU_NODE, OTHER_NODE), False),
    ("pod on own node: user policy", "{pod_here}", _annotate(ann.NODE_POLICY, "spread"), False),
    ("pod on own node: a label", "{pod_here}", {"metadata": {"labels": {"x": "y"}}}, False),
    ("pod on own node: node label", "{pod_here}", _label(ann.VGPU_NODE_LABEL, AGENT_NODE), True),
    ("pod on own node: remove node label", "{pod_here}", _label(ann.VGPU_NODE_LABEL, None), True),
    (
        "pod on own node: node label naming another node",
        "{pod_here}",
        _label(ann.VGPU_NODE_LABEL, OTHER_NODE),
        False,
    ),
    ("pod on another node: bind phase", "{pod_there}", _annotate(ann.BIND_PHASE, "success"), False),
]


@pytest.mark.parametrize(
    ("what", "path", "patch", "allowed"), AGENT_WRITES, ids=[w[0] for w in AGENT_WRITES]
)
def test_node_agent_writes_only_its_node_and_annotations(
    agent_client: KubeClient,
    workloads: dict[str, str],
    what: str,
    path: str,
    patch: dict[str, Any],
    allowed: bool,
) -> None:
    path = path.format(
        pod_here=f"/api/v1/namespaces/{NS}/pods/{workloads[AGENT_NODE]}",
        pod_there=f"/api/v1/namespaces/{NS}/pods/{workloads[OTHER_NODE]}",
    )
    if allowed:
        agent_client.merge_patch(path, patch)
        return
    with pytest.raises(ApiError) as denied:
        agent_client.merge_patch(path, patch)
    assert denied.value.status == 403
    assert "ValidatingAdmissionPolicy" in str(denied.value), str(denied.value)


def test_node_agent_needs_a_token_that_names_its_node(
    dev_cluster: ClusterClient, workloads: dict[str, str]
) -> None:
    with (
        KubeClient(
            dev_cluster.server, token(dev_cluster, ACCOUNTS["node-agent"]), dev_cluster.ca_file
        ) as client,
        pytest.raises(ApiError) as denied,
    ):
        client.merge_patch(f"/api/v1/nodes/{AGENT_NODE}", _annotate("hami.io/node-handshake", "x"))
    assert denied.value.status == 403
    assert "names the node it runs on" in str(denied.value)


PLUGIN_WRITES: list[tuple[str, dict[str, Any], bool]] = [
    (
        "bind annotations",
        {
            "metadata": {
                "annotations": {
                    ann.VGPU_NODE: AGENT_NODE,
                    ann.BIND_PHASE: "allocating",
                    ann.BIND_TIME: "1",
                    ann.DEVICES_ALLOCATED: ";",
                    ann.DEVICES_TO_ALLOCATE: ";",
                    ann.MIG_ALLOCATIONS: "[]",
                },
                "labels": {ann.VGPU_NODE_LABEL: AGENT_NODE},
            }
        },
        True,
    ),
    (
        "unreserve removes them",
        {
            "metadata": {
                "annotations": dict.fromkeys(
                    (
                        ann.VGPU_NODE,
                        ann.BIND_PHASE,
                        ann.BIND_TIME,
                        ann.DEVICES_ALLOCATED,
                        ann.DEVICES_TO_ALLOCATE,
                        ann.MIG_ALLOCATIONS,
                    )
                ),
                "labels": {ann.VGPU_NODE_LABEL: None},
            }
        },
        True,
    ),
    ("the node label naming another node", _label(ann.VGPU_NODE_LABEL, "elsewhere"), False),
    ("a user annotation", _annotate(ann.GPU_POLICY, "binpack"), False),
    ("a label", {"metadata": {"labels": {"x": "y"}}}, False),
    (
        "the image",
        {"spec": {"containers": [{"name": "main", "image": "registry.invalid/other"}]}},
        False,
    ),
]


@pytest.mark.parametrize(
    ("what", "patch", "allowed"), PLUGIN_WRITES, ids=[w[0] for w in PLUGIN_WRITES]
)
def test_plugin_server_writes_only_scheduling_annotations(
    dev_cluster: ClusterClient,
    workloads: dict[str, str],
    what: str,
    patch: dict[str, Any],
    allowed: bool,
) -> None:
    path = f"/api/v1/namespaces/{NS}/pods/{workloads[OTHER_NODE]}"
    with KubeClient(
        dev_cluster.server, token(dev_cluster, ACCOUNTS["plugin-server"]), dev_cluster.ca_file
    ) as client:
        if allowed:
            client.merge_patch(path, patch)
            return
        with pytest.raises(ApiError) as denied:
            client.merge_patch(path, patch)
    assert denied.value.status == 403
    assert "ValidatingAdmissionPolicy" in str(denied.value), str(denied.value)


# The real components, each with only its account's token ------------------------------------


def kubeconfig(cluster: ClusterClient, path: Path, bearer: str) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "c",
                        "cluster": {
                            "server": cluster.server,
                            "certificate-authority": str(cluster.ca_file),
                        },
                    }
                ],
                "users": [{"name": "u", "user": {"token": bearer}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    return path


@contextlib.contextmanager
def running(
    argv: Sequence[str], log: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """``argv`` in the background, output to ``log``; stopped (SIGTERM, then SIGKILL) on exit."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            list(argv), stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)


def _replace_flags(command: Sequence[str], **values: str) -> list[str]:
    """The chart's command with ``--flag=value`` replaced for the local run."""
    out = []
    for c in command:
        flag = c.split("=", 1)[0]
        key = flag.removeprefix("--").replace("-", "_")
        out.append(f"{flag}={values.pop(key)}" if key in values else c)
    assert not values, f"flags not in the chart's command: {sorted(values)}"
    return out


def _tessera(command: Sequence[str]) -> list[str]:
    assert command[0] == "tessera"
    return [sys.executable, "-m", "scheduler_plugins.cli", *command[1:]]


def wait(check: Callable[[], Any], what: str, *logs: Path) -> Any:
    """``eventually`` with the components' log tails in the failure message."""
    try:
        return eventually(check, timeout_s=WAIT_S, what=what)
    except AssertionError as e:
        tails = "".join(
            f"\n--- {log.name} ---\n{log.read_text(errors='replace')[-3000:]}"
            for log in logs
            if log.exists()
        )
        raise AssertionError(f"{e}{tails}") from None


def _forbidden_lines(log: Path) -> list[str]:
    return [
        line for line in log.read_text(errors="replace").splitlines() if "forbidden" in line.lower()
    ]


def _device_config(release: Release, work: Path) -> Path:
    path = work / "device-config.yaml"
    path.write_text(release.rendered.config_map(f"{FULL}-device-config", "device-config.yaml"))
    return path


def test_scheduler_and_plugin_server_schedule_with_their_own_accounts(
    dev_cluster: ClusterClient, release: Release, built_tools: Path, tmp_path: Path
) -> None:
    api = dev_cluster.api
    work = tmp_path
    assert len(str(work / "sock" / "plugin.sock")) < 100  # a Unix socket path's limit is 107
    workload = f"{FULL}-scheduler"
    metrics_port, secure_port = free_ports(2)
    socket = work / "sock" / "plugin.sock"
    chart_cmd = release.rendered.container(workload, "plugin-server")["command"]
    metrics_host = flag_value(chart_cmd, "--metrics-address").rpartition(":")[0]
    server_cmd = _replace_flags(
        chart_cmd,
        kubeconfig=str(
            kubeconfig(
                dev_cluster, work / "ps.kubeconfig", token(dev_cluster, ACCOUNTS["plugin-server"])
            )
        ),
        socket=str(socket),
        config=str(_device_config(release, work)),
        metrics_address=f"{metrics_host}:{metrics_port}",  # the chart's host: all addresses
    )
    sched_config = yaml.safe_load(
        release.rendered.config_map(f"{FULL}-scheduler-config", "config.yaml")
    )
    sched_config["clientConnection"]["kubeconfig"] = str(
        kubeconfig(dev_cluster, work / "s.kubeconfig", token(dev_cluster, ACCOUNTS["scheduler"]))
    )
    sched_config["profiles"][0]["pluginConfig"][1]["args"]["socket"] = str(socket)
    (work / "scheduler.yaml").write_text(yaml.safe_dump(sched_config))
    shim_cmd = release.rendered.container(workload, "scheduler")["command"]
    assert shim_cmd[0] == "tessera-scheduler"
    shim_cmd = [
        str(built_tools / "tessera-scheduler"),
        *_replace_flags(
            shim_cmd[1:], config=str(work / "scheduler.yaml"), secure_port=str(secure_port)
        ),
    ]
    server_log, shim_log = work / "plugin-server.log", work / "scheduler.log"
    with running(_tessera(server_cmd), server_log), running(shim_cmd, shim_log):
        lease = wait(lambda: _holder(api), f"lease {NS}/{LEASE} taken", shim_log)
        assert lease
        api.post(
            f"/api/v1/namespaces/{NS}/pods", pod("gpu-fits", gpu_mem=1000, scheduler=SCHEDULER_NAME)
        )
        api.post(
            f"/api/v1/namespaces/{NS}/pods",
            pod("gpu-too-big", gpu_mem=10_000_000, scheduler=SCHEDULER_NAME),
        )
        bound = wait(lambda: _bound(api, "gpu-fits"), "gpu-fits bound", server_log, shim_log)
        annotations = bound["metadata"]["annotations"]
        assert annotations[ann.VGPU_NODE] == bound["spec"]["nodeName"]
        assert annotations[ann.BIND_PHASE] == "allocating"
        # Once its state was built the server froze it (full GCs walk only what is new).
        wait(
            lambda: "state built" in server_log.read_text(errors="replace"),
            "the plugin server's gc.frozen line",
            server_log,
        )
        wait(
            lambda: _unschedulable_event(api, "gpu-too-big"),
            f"a {UNSCHEDULABLE_REASON} event for gpu-too-big",
            server_log,
            shim_log,
        )
        # The metrics port the Service targets answers.
        conn = http.client.HTTPConnection("127.0.0.1", metrics_port, timeout=10)
        conn.request("GET", "/metrics")
        assert conn.getresponse().status == 200
        conn.close()
    assert _forbidden_lines(server_log) == []
    assert _forbidden_lines(shim_log) == []


def _holder(api: KubeClient) -> str:
    try:
        lease = api.get(f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/{LEASE}")
    except NotFoundError:
        return ""
    holder: str = lease["spec"].get("holderIdentity") or ""
    return holder


def _bound(api: KubeClient, name: str) -> dict[str, Any] | None:
    obj: dict[str, Any] = api.get(f"/api/v1/namespaces/{NS}/pods/{name}")
    return obj if obj["spec"].get("nodeName") else None


def _unschedulable_event(api: KubeClient, name: str) -> bool:
    events = api.list(
        f"/api/v1/namespaces/{NS}/events", field_selector=f"involvedObject.name={name}"
    )
    return any(e.get("reason") == UNSCHEDULABLE_REASON for e in events["items"])


def test_webhook_lists_nodes_with_its_own_account(
    dev_cluster: ClusterClient, release: Release, tmp_path: Path
) -> None:
    work = tmp_path
    secret = release.rendered.one("Secret", f"{FULL}-webhook-tls")
    for key in ("tls.crt", "tls.key", "ca.crt"):
        (work / key).write_bytes(base64.b64decode(secret["data"][key]))
    (port,) = free_ports(1)
    cmd = _replace_flags(
        release.rendered.container(f"{FULL}-scheduler", "webhook")["command"],
        listen=f"127.0.0.1:{port}",
        tls_cert_file=str(work / "tls.crt"),
        tls_key_file=str(work / "tls.key"),
        kubeconfig=str(
            kubeconfig(dev_cluster, work / "wh.kubeconfig", token(dev_cluster, ACCOUNTS["webhook"]))
        ),
        config=str(_device_config(release, work)),
    )
    log = work / "webhook.log"
    context = ssl.create_default_context(cafile=str(work / "ca.crt"))
    context.check_hostname = False  # the certificate names the Service, not 127.0.0.1

    def ready() -> bool:
        try:
            conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=5, context=context)
            conn.request("GET", "/readyz")
            status = conn.getresponse().status
            conn.close()
        except OSError:
            return False
        return status == 200

    with running(_tessera(cmd), log):
        wait(ready, "webhook /readyz answers 200 (its node list is in)", log)
    assert _forbidden_lines(log) == []


def test_node_agent_registers_its_node_with_its_own_account(
    dev_cluster: ClusterClient, release: Release, tmp_path: Path
) -> None:
    api = dev_cluster.api
    work = tmp_path
    agent_pod = api.post(
        f"/api/v1/namespaces/{NS}/pods",
        pod("agent-run", node=AGENT_NODE, account=ACCOUNTS["node-agent"]),
    )
    cmd = _replace_flags(
        release.rendered.container(f"{FULL}-node-agent", "node-agent")["command"],
        config=str(_device_config(release, work)),
        plugin_dir=str(work / "plugins"),
    )
    (work / "plugins").mkdir()
    cmd += [
        "--node-name",
        AGENT_NODE,
        "--kubeconfig",
        str(
            kubeconfig(
                dev_cluster,
                work / "na.kubeconfig",
                token(dev_cluster, ACCOUNTS["node-agent"], bound_pod=agent_pod),
            )
        ),
    ]
    env = {"TESSERA_NVML": "simulated", "TESSERA_SIM_GPUS": "A100-PCIE-40GB"}
    log = work / "node-agent.log"

    def registered() -> bool:
        node = api.get(f"/api/v1/nodes/{AGENT_NODE}")
        value = (node["metadata"].get("annotations") or {}).get(ann.NODE_REGISTER, "")
        return "A100-PCIE-40GB" in value

    with running(_tessera(cmd), log, env):
        wait(registered, f"{AGENT_NODE} registered by the node agent", log)
    assert _forbidden_lines(log) == [], json.dumps(_forbidden_lines(log))
