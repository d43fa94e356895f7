"""``tessera webhook certs|manifest|serve`` and the MutatingWebhookConfiguration they make."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
import yaml

from api.hami.config import DeviceConfig
from scheduler_plugins.cli import build_parser, main
from scheduler_plugins.devtools.cluster.certs import Pki
from scheduler_plugins.devtools.cluster.cluster import Cluster
from scheduler_plugins.devtools.cluster.layout import ClusterSettings
from scheduler_plugins.webhook.cli import serve_settings
from scheduler_plugins.webhook.errors import WebhookSetupError
from scheduler_plugins.webhook.manifest import (
    ServiceTarget,
    UrlTarget,
    match_condition,
    service_target,
    url_target,
    webhook_configuration,
)


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """``serve`` configures JSON logs for its process; don't leave that to other tests."""
    was = structlog.is_configured()
    yield
    if not was:
        structlog.reset_defaults()


def test_configuration_registers_pod_create_and_update() -> None:
    obj = webhook_configuration(
        UrlTarget("https://127.0.0.1:9443/mutate"), "Q0E=", trusted_users=["sa:plugin", "o'k"]
    )
    (hook,) = obj["webhooks"]
    assert obj["kind"] == "MutatingWebhookConfiguration"
    assert hook["clientConfig"] == {"url": "https://127.0.0.1:9443/mutate", "caBundle": "Q0E="}
    assert hook["rules"] == [
        {
            "operations": ["CREATE", "UPDATE"],
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "resources": ["pods", "pods/status"],
            "scope": "Namespaced",
        }
    ]
    (cond,) = hook["matchConditions"]
    assert cond["expression"] == match_condition(["sa:plugin", "o'k"])
    assert "['sa:plugin', 'o\\'k']" in cond["expression"]
    assert "k.startsWith('hami.io/vgpu-') || k.startsWith('hami.io/bind-')" in cond["expression"]
    assert (hook["failurePolicy"], hook["sideEffects"], hook["timeoutSeconds"]) == (
        "Fail",
        "None",
        5,
    )
    assert hook["admissionReviewVersions"] == ["v1"]
    assert hook["namespaceSelector"]["matchExpressions"] == [
        {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system"]}
    ]


def test_service_target() -> None:
    assert service_target("tessera/webhook:8443") == ServiceTarget("tessera", "webhook", 8443)
    cfg = webhook_configuration(service_target("tessera/webhook"), "x")["webhooks"][0]
    assert cfg["clientConfig"]["service"] == {
        "namespace": "tessera",
        "name": "webhook",
        "port": 443,
        "path": "/mutate",
    }


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: url_target("http://127.0.0.1/mutate"), "https://"),
        (lambda: url_target("https://u@host/mutate"), "user"),
        (lambda: url_target("https://host/mutate?x=1"), "query"),
        (lambda: service_target("webhook"), "NAMESPACE/NAME"),
        (lambda: service_target("ns/webhook:https"), "NAMESPACE/NAME"),
        (lambda: service_target("ns/webhook:0"), "out of range"),
        (lambda: service_target("ns/webhook", "mutate"), "start with '/'"),
        (lambda: webhook_configuration(UrlTarget("https://h/m"), "x", timeout_s=31), "1-30"),
    ],
)
def test_bad_manifest_inputs(call: object, message: str) -> None:
    with pytest.raises(WebhookSetupError, match=message):
        call()  # type: ignore[operator]


def test_certs_then_manifest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    certs = tmp_path / "certs"
    assert (
        main(["webhook", "certs", "--cert-dir", str(certs), "--host", "webhook.tessera.svc"]) == 0
    )
    # The bundle is the last line (a process-wide logger configured elsewhere may print too).
    bundle = capsys.readouterr().out.strip().splitlines()[-1]
    assert base64.b64decode(bundle) == (certs / "ca.crt").read_bytes()
    args = ["webhook", "manifest", "--service", "tessera/webhook", "--cert-dir", str(certs)]
    assert (
        main([*args, "--exclude-namespace", "kube-system", "--exclude-namespace", "tessera"]) == 0
    )
    obj = yaml.safe_load(capsys.readouterr().out)
    (hook,) = obj["webhooks"]
    assert hook["clientConfig"]["caBundle"] == bundle
    assert hook["namespaceSelector"]["matchExpressions"][0]["values"] == ["kube-system", "tessera"]
    assert main([*args, "--output", "json", "--failure-policy", "Ignore"]) == 0
    assert json.loads(capsys.readouterr().out)["webhooks"][0]["failurePolicy"] == "Ignore"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["webhook", "manifest", "--url", "https://h/m", "--ca-file", "/nonexistent"],
            "cannot read",
        ),
        (["webhook", "serve", "--listen", "nowhere"], "HOST:PORT"),
        (["webhook", "serve", "--tls-cert-file", "c.pem"], "--tls-key-file"),
        (
            ["webhook", "serve", "--tls-cert-file", "/none.crt", "--tls-key-file", "/none.key"],
            "cannot load TLS certificate",
        ),
    ],
)
def test_cli_errors_exit_2_with_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("tessera: ")


def test_dev_apiserver_keeps_mutating_admission_webhooks(tmp_path: Path) -> None:
    cluster = Cluster(ClusterSettings(name="t", state_dir_override=tmp_path))
    names = ("ca", "crt", "key", "sa", "admin.crt", "admin.key")
    argv = cluster._apiserver_argv(Pki(*(tmp_path / n for n in names)))
    disabled = [a.split("=", 1)[1].split(",") for a in argv if a.startswith("--disable-admission")]
    enabled = [a.split("=", 1)[1].split(",") for a in argv if a.startswith("--enable-admission")]
    assert not any("MutatingAdmissionWebhook" in d for d in disabled)
    # Enabled by default; an explicit list would have to name it.
    assert all("MutatingAdmissionWebhook" in e for e in enabled)
    assert not any(a.startswith("--admission-control=") for a in argv)


@pytest.mark.parametrize("name", ["Team_A", "", "a-", "-a", "ops.team", "a" * 64])
def test_a_bad_excluded_namespace_is_refused_by_name(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        main(["webhook", "serve", "--host-only-pods", f"--host-only-exclude-namespace={name}"])
    assert e.value.code == 2
    assert f"{name!r} is not a namespace name" in capsys.readouterr().err


# `webhook serve` flags -> (host_only_pods, host_only_exclude) of the rules' settings.
HOST_ONLY_FLAGS: list[tuple[str, list[str], bool, frozenset[str]]] = [
    ("off by default", [], False, frozenset({"kube-system"})),
    ("on", ["--host-only-pods"], True, frozenset({"kube-system"})),
    (
        "excluded namespaces add to kube-system",
        [
            "--host-only-pods",
            "--host-only-exclude-namespace",
            "gpu-system",
            "--host-only-exclude-namespace=ops-2",
            "--host-only-exclude-namespace=kube-system",
        ],
        True,
        frozenset({"kube-system", "gpu-system", "ops-2"}),
    ),
]


@pytest.mark.parametrize(
    ("flags", "routes", "excluded"),
    [c[1:] for c in HOST_ONLY_FLAGS],
    ids=[c[0] for c in HOST_ONLY_FLAGS],
)
def test_host_only_flags_reach_the_rules_settings(
    flags: list[str], routes: bool, excluded: frozenset[str]
) -> None:
    args = build_parser().parse_args(["webhook", "serve", "--trusted-user", "sa:ops", *flags])
    settings = serve_settings(args, DeviceConfig())
    assert (settings.host_only_pods, settings.host_only_exclude) == (routes, excluded)
    assert settings.trusted_users == frozenset({"sa:ops"})
    assert settings.scheduler_name == "hami-scheduler"
