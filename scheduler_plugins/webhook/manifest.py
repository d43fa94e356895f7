"""The MutatingWebhookConfiguration that sends pod CREATEs to Tessera's webhook.

Only CREATE is registered. Tessera's scheduler and node agent write the internal annotations
of bound pods with UPDATE/PATCH, and the webhook does not sit on that path; who may change
an existing pod's annotations is RBAC's call (grant pods update/patch only to whom you
trust), not this webhook's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal
from urllib.parse import urlsplit

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


def webhook_configuration(
    target: UrlTarget | ServiceTarget,
    ca_bundle: str,
    *,
    name: str = DEFAULT_NAME,
    failure_policy: FailurePolicy = "Fail",
    timeout_s: int = 5,
    excluded_namespaces: Sequence[str] = ("kube-system",),
) -> dict[str, Any]:
    if not 1 <= timeout_s <= 30:
        raise WebhookSetupError(f"--timeout must be 1-30 seconds, got {timeout_s}")
    webhook: dict[str, Any] = {
        "name": WEBHOOK_NAME,
        "admissionReviewVersions": ["v1"],
        "clientConfig": {**target.client_config(), "caBundle": ca_bundle},
        "rules": [
            {
                "operations": ["CREATE"],
                "apiGroups": [""],
                "apiVersions": ["v1"],
                "resources": ["pods"],
                "scope": "Namespaced",
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
