"""Tessera's admission webhook on a dev cluster: ``tessera webhook serve`` on a free loopback
port, registered with a url-based MutatingWebhookConfiguration (CA bundle, failurePolicy
Fail, kube-system excluded, sideEffects None, 5 s timeout).

The process runs like the stack's others (pid file, log under the cluster's state dir).
Starting returns only once the apiserver actually calls the webhook (a dry-run pod comes back
mutated); stopping deletes the configuration first, so a cluster whose webhook is gone still
admits pods. The dev cluster's admin user is trusted: demos and tests use it to restore pods
that were "placed earlier" (preset nodeName and internal annotations).
"""

from __future__ import annotations

import contextlib
import http.client
import ssl
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import structlog

from api.kube.client import KubeClient
from api.kube.errors import KubeError
from scheduler_plugins.devtools.cluster import processes
from scheduler_plugins.devtools.cluster.certs import ADMIN_USER
from scheduler_plugins.devtools.cluster.errors import ComponentFailedError
from scheduler_plugins.devtools.cluster.layout import LOOPBACK, ClusterSettings
from scheduler_plugins.webhook.certs import ca_bundle, ensure_serving_pki
from scheduler_plugins.webhook.manifest import (
    API_PATH,
    DEFAULT_NAME,
    UrlTarget,
    webhook_configuration,
)

log = structlog.get_logger(__name__)

WEBHOOK: Final = "webhook"
HOSTS: Final = (LOOPBACK, "localhost")
_PROBE_NAMESPACE: Final = "default"


@dataclass(frozen=True)
class WebhookPaths:
    cert_dir: Path
    address_file: Path

    @staticmethod
    def of(s: ClusterSettings) -> WebhookPaths:
        return WebhookPaths(
            cert_dir=s.state_dir / "webhook-pki",
            address_file=s.run_dir / "tessera" / "webhook.addr",
        )


def start_webhook(
    s: ClusterSettings,
    *,
    scheduler_name: str,
    device_config: Path | None = None,
    trusted_users: Sequence[str] = (ADMIN_USER,),
    timeout_s: float = 60.0,
    extra_args: Sequence[str] = (),
) -> str:
    """Start the webhook and register it; returns its URL once the apiserver calls it.
    ``extra_args``: more flags of ``tessera webhook serve`` (e.g. ``--host-only-pods``)."""
    t0 = time.monotonic()
    paths = WebhookPaths.of(s)
    processes.stop(s.pid_file(WEBHOOK))
    paths.address_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    paths.address_file.unlink(missing_ok=True)
    pki = ensure_serving_pki(paths.cert_dir, HOSTS)
    argv = [
        sys.executable,
        "-m",
        "scheduler_plugins.cli",
        "webhook",
        "serve",
        "--listen",
        f"{LOOPBACK}:0",
        "--address-file",
        str(paths.address_file),
        "--cert-dir",
        str(paths.cert_dir),
        *(a for h in HOSTS for a in ("--host", h)),
        "--kubeconfig",
        str(s.kubeconfig),
        "--scheduler-name",
        scheduler_name,
        *(a for u in trusted_users for a in ("--trusted-user", u)),
        *(["--config", str(device_config)] if device_config else []),
        *extra_args,
    ]
    record = processes.spawn(
        WEBHOOK, argv, log_path=s.log_file(WEBHOOK), pid_path=s.pid_file(WEBHOOK)
    )
    try:
        processes.wait_ready(
            record,
            lambda: _probe_ready(paths.address_file, pki.ca_cert),
            log_path=s.log_file(WEBHOOK),
            timeout_s=timeout_s,
        )
        url = f"https://{paths.address_file.read_text().strip()}/mutate"
        config = webhook_configuration(
            UrlTarget(url), ca_bundle(pki.ca_cert), trusted_users=trusted_users
        )
        with KubeClient.from_kubeconfig(s.kubeconfig, timeout_s=10.0) as api:
            api.apply(f"{API_PATH}/{DEFAULT_NAME}", config)
            _wait_effective(api, scheduler_name, s, timeout_s)
    except BaseException:
        stop_webhook(s)
        raise
    log.info("stack.ready", component=WEBHOOK, url=url, seconds=round(time.monotonic() - t0, 2))
    return url


def stop_webhook(s: ClusterSettings) -> bool:
    """Unregister (best effort: the apiserver may be down already) and stop the process;
    True when a process was stopped. A cluster that never ran the webhook is not contacted."""
    if not s.pid_file(WEBHOOK).exists():
        return False
    # NotFoundError (already gone) is a KubeError too.
    with (
        contextlib.suppress(KubeError, OSError),
        KubeClient.from_kubeconfig(s.kubeconfig, timeout_s=5.0) as api,
    ):
        api.delete(f"{API_PATH}/{DEFAULT_NAME}")
    WebhookPaths.of(s).address_file.unlink(missing_ok=True)
    return processes.stop(s.pid_file(WEBHOOK)) is not None


def probe_webhook(s: ClusterSettings) -> str | None:
    """None when the running webhook answers /readyz; else why not (``tessera status``)."""
    paths = WebhookPaths.of(s)
    return _probe_ready(paths.address_file, paths.cert_dir / "ca.crt")


def _probe_ready(address_file: Path, ca_file: Path) -> str | None:
    try:
        host, _, port = address_file.read_text().strip().rpartition(":")
    except OSError:
        return "no address file yet"
    ctx = ssl.create_default_context(cafile=str(ca_file))
    conn = http.client.HTTPSConnection(host, int(port), timeout=2.0, context=ctx)
    try:
        conn.request("GET", "/readyz")
        resp = conn.getresponse()
        body = resp.read().decode(errors="replace").strip()
    except (OSError, http.client.HTTPException) as e:
        return f"GET /readyz: {e!r}"
    finally:
        conn.close()
    return None if resp.status == 200 else f"GET /readyz: {resp.status} {body}"


def _probe_pod() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"generateName": "tessera-webhook-probe-", "namespace": _PROBE_NAMESPACE},
        "spec": {
            "containers": [
                {
                    "name": "probe",
                    "image": "probe",
                    "resources": {"limits": {"nvidia.com/gpumem": "1"}},
                }
            ]
        },
    }


def _wait_effective(
    api: KubeClient, scheduler_name: str, s: ClusterSettings, timeout_s: float
) -> None:
    """The apiserver loads webhook configurations asynchronously: wait until a dry-run pod
    comes back mutated."""
    deadline = time.monotonic() + timeout_s
    why = "not tried yet"
    while time.monotonic() < deadline:
        try:
            pod = api.request(
                "POST",
                f"/api/v1/namespaces/{_PROBE_NAMESPACE}/pods",
                _probe_pod(),
                query={"dryRun": "All"},
            )
        except KubeError as e:
            why = str(e)
        else:
            got = (pod.get("spec") or {}).get("schedulerName")
            if got == scheduler_name:
                return
            why = f"dry-run pod came back with schedulerName {got!r}"
        time.sleep(0.2)
    raise ComponentFailedError(
        f"{WEBHOOK}: the apiserver does not call it after {timeout_s:.0f}s ({why}); last log "
        f"lines of {s.log_file(WEBHOOK)}:\n{processes.tail(s.log_file(WEBHOOK))}"
    )


__all__ = ["WEBHOOK", "WebhookPaths", "probe_webhook", "start_webhook", "stop_webhook"]
