"""PriorityClasses for tests that run against a real kube-apiserver.

The apiserver's Priority admission plugin resolves ``priorityClassName`` from its informer
cache, not from etcd: right after a PriorityClass is created, a pod naming it can be refused
("no PriorityClass with name ... was found") until that cache has seen it. Tests create the
class and wait, with dry-run pod creates, until admission resolves it.
"""

from __future__ import annotations

from api.kube.client import KubeClient
from api.kube.errors import ApiError
from tests.waiting import eventually

PRIORITY_CLASSES = "/apis/scheduling.k8s.io/v1/priorityclasses"
_PODS = "/api/v1/namespaces/default/pods"


def priority_class(name: str, value: int) -> dict[str, object]:
    return {
        "apiVersion": "scheduling.k8s.io/v1",
        "kind": "PriorityClass",
        "metadata": {"name": name},
        "value": value,
    }


def admitted_priority(api: KubeClient, name: str) -> int | None:
    """The priority admission gives a pod naming ``name`` now; None while it does not know
    the class yet. A dry run: nothing is stored."""
    probe = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"priority-probe-{name}"},
        "spec": {"priorityClassName": name, "containers": [{"name": "c", "image": "probe"}]},
    }
    try:
        pod = api.request("POST", _PODS, probe, query={"dryRun": "All"})
    except ApiError as e:
        if e.status == 403 and "PriorityClass" in e.message:
            return None
        raise
    return int(pod["spec"]["priority"])


def wait_admitted(api: KubeClient, name: str, value: int, *, timeout_s: float = 30.0) -> None:
    """Return once admission gives pods naming ``name`` the priority ``value``."""
    eventually(
        lambda: admitted_priority(api, name) == value,
        timeout_s=timeout_s,
        what=f"admission to resolve PriorityClass {name}",
    )
