"""The MutatingWebhookConfiguration that sends pods to Tessera's webhook.

Every pod CREATE is sent (the webhook fills in and checks what Tessera needs). Of pod and
pod status UPDATEs (PATCH included), the apiserver itself sends only those that add, change
or remove an internal annotation (``hami.io/vgpu-*``, ``hami.io/bind-*``) and come from
someone other than the trusted users (``match_condition``): the webhook refuses them. Tessera's
plugin server and node agent, which write those annotations, must be among the trusted
users, so their writes never wait on the webhook and kubelet status updates never reach it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal
from urllib.parse import urlsplit

from api.hami.keys import INTERNAL_PREFIXES
from scheduler_plugins.webhook.errors import WebhookSetupError

DEFAULT_NAME: Final = "tessera-webhook"
WEBHOOK_NAME: Final = "pods.tessera.dev"
MUTATE_PATH: Final = "/mutate"
API_PATH: Final = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
FailurePolicy = Literal["Fail", "Ignore"]


@dataclass(frozen=True)
class UrlTarget:
    url: str

    def client_config(self) -> dict[str, Any]:
        return {"url": self.url}


@dataclass(frozen=True)
class ServiceTarget:
    namespace: str
    name: str
    port: int = 443
    path: str = MUTATE_PATH

    def client_config(self) -> dict[str, Any]:
        return {
            "service": {
                "namespace": self.namespace,
                "name": self.name,
                "port": self.port,
                "path": self.path,
            }
        }


def url_target(url: str) -> UrlTarget:
    parts = urlsplit(url)
    if parts.scheme != "https" or not parts.hostname:
        raise WebhookSetupError(f"--url must be https://HOST[:PORT]/PATH, got {url!r}")
    if parts.query or parts.fragment or "@" in parts.netloc:
        raise WebhookSetupError(f"--url must not have a query, fragment or user: {url!r}")
    return UrlTarget(url)


def service_target(ref: str, path: str = MUTATE_PATH) -> ServiceTarget:
    """``NAMESPACE/NAME[:PORT]``."""
    ns, sep, rest = ref.partition("/")
    name, _, port = rest.partition(":")
    if not sep or not ns or not name or (port and not port.isdigit()):
        raise WebhookSetupError(f"--service must be NAMESPACE/NAME[:PORT], got {ref!r}")
    number = int(port) if port else 443
    if not 1 <= number <= 65535:
        raise WebhookSetupError(f"--service port {number} is out of range 1-65535")
    if not path.startswith("/"):
        raise WebhookSetupError(f"--path must start with '/', got {path!r}")
    return ServiceTarget(ns, name, number, path)


def _cel_string(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def match_condition(trusted_users: Sequence[str]) -> str:
    """CEL: a CREATE, or an UPDATE by an untrusted user that alters an internal annotation."""
    new = "object.metadata.?annotations.orValue({})"
    old = "oldObject.metadata.?annotations.orValue({})"
    internal = " || ".join(f"k.startsWith({_cel_string(p)})" for p in INTERNAL_PREFIXES)
    users = ", ".join(_cel_string(u) for u in dict.fromkeys(trusted_users))
    return (
        "request.operation == 'CREATE' || ("
        f"!(request.userInfo.username in [{users}]) && ("
        f"{new}.exists(k, ({internal}) && (!(k in {old}) || {old}[k] != {new}[k])) || "
        f"{old}.exists(k, ({internal}) && !(k in {new}))))"
    )


def webhook_configuration(
    target: UrlTarget | ServiceTarget,
    ca_bundle: str,
    *,
    name: str = DEFAULT_NAME,
    failure_policy: FailurePolicy = "Fail",
    timeout_s: int = 5,
    excluded_namespaces: Sequence[str] = ("kube-system",),
    trusted_users: Sequence[str] = (),
) -> dict[str, Any]:
    if not 1 <= timeout_s <= 30:
        raise WebhookSetupError(f"--timeout must be 1-30 seconds, got {timeout_s}")
    webhook: dict[str, Any] = {
        "name": WEBHOOK_NAME,
        "admissionReviewVersions": ["v1"],
        "clientConfig": {**target.client_config(), "caBundle": ca_bundle},
        "rules": [
            {
                "operations": ["CREATE", "UPDATE"],
                "apiGroups": [""],
                "apiVersions": ["v1"],
                "resources": ["pods", "pods/status"],
                "scope": "Namespaced",
            }
        ],
        "matchConditions": [
            {
                "name": "create-or-internal-annotations-altered",
                "expression": match_condition(trusted_users),
            }
        ],
        "failurePolicy": failure_policy,
        "matchPolicy": "Equivalent",
        "sideEffects": "None",
        "timeoutSeconds": timeout_s,
        "reinvocationPolicy": "Never",
    }
    if excluded_namespaces:
        webhook["namespaceSelector"] = {
            "matchExpressions": [
                {
                    # Set by the apiserver on every namespace.
                    "key": "kubernetes.io/metadata.name",
                    "operator": "NotIn",
                    "values": sorted(set(excluded_namespaces)),
                }
            ]
        }
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "tessera-webhook"}},
        "webhooks": [webhook],
    }
