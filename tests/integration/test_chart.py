"""The Helm chart ``charts/tessera``: ``helm lint``, ``helm template``, and the real apiserver.

Rendering tests need only the ``helm`` binary (built from Go modules by hack/build-tools.sh);
they check what the chart must agree on with the code: the device config is the code's
built-in default, the scheduler profile is examples/scheduler-config.yaml's, every command
line parses with the real CLI, the socket is where both containers look, the webhook
certificate verifies. The apiserver tests send every variant's manifests through server-side
dry-run (``kubectl apply --dry-run=server``), so schema, defaulting and validation are the
real kube-apiserver's. RBAC is tested for real in test_rbac.py.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime
import io
import json
import re
import subprocess
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.serialization import Encoding, load_pem_private_key
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from api.hami.config import (
    DEFAULT_ALLOWLIST,
    DeviceConfig,
    convert_known_geometries,
    load_config,
)
from node_agent.mps import DEFAULT_ROOT, ControlDaemons, SimulatedMps, mps_backend_from_env
from scheduler_plugins.cli import build_parser
from scheduler_plugins.devtools.cluster.layout import repo_root
from scheduler_plugins.devtools.cluster.testing import ClusterClient
from scheduler_plugins.webhook.manifest import match_condition

pytestmark = pytest.mark.integration

CHART = repo_root() / "charts" / "tessera"
RELEASE = "tessera"
NAMESPACE = "gpu-system"
HELM_TIMEOUT_S = 60

# A HAMi v2.9-style device config, as `tessera config convert` takes it.
HAMI_CONFIG = """\
nvidia:
  resourceCountName: nvidia.com/gpu
  resourceMemoryName: nvidia.com/gpumem
  resourceMemoryPercentageName: nvidia.com/gpumem-percentage
  resourceCoreName: nvidia.com/gpucores
  deviceSplitCount: 10
  deviceMemoryScaling: 1
  defaultMemory: 0
  knownMigGeometries:
    - models: [A100-SXM4-40GB, A100-40GB-PCIe, A100-PCIE-40GB]
      allowedGeometries:
        - - {name: 1g.5gb, memory: 5120, count: 7}
        - - {name: 2g.10gb, memory: 10240, count: 3}
          - {name: 1g.5gb, memory: 5120, count: 1}
  nodeconfig:
    - {name: gpu-7, operatingmode: mig}
"""


def kube_version() -> str:
    """The Kubernetes version hack/build-tools.sh builds (and the chart is tested against)."""
    for line in (repo_root() / "hack" / "tools" / "kube" / "go.mod").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "k8s.io/kubernetes" and parts[1].startswith("v"):
            return parts[1]
    raise AssertionError("hack/tools/kube/go.mod does not require k8s.io/kubernetes")


@dataclass(frozen=True)
class Rendered:
    """The objects ``helm template`` printed."""

    objects: tuple[dict[str, Any], ...]
    text: str

    def kinds(self) -> Counter[str]:
        return Counter(o["kind"] for o in self.objects)

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, name: str) -> dict[str, Any]:
        found = [o for o in self.of_kind(kind) if o["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
        return found[0]

    def container(self, workload: str, name: str) -> dict[str, Any]:
        kind = "DaemonSet" if workload.endswith("node-agent") else "Deployment"
        spec = self.one(kind, workload)["spec"]["template"]["spec"]
        found = [c for c in spec["containers"] if c["name"] == name]
        assert len(found) == 1, f"{workload} has no container {name}"
        return found[0]

    def pod_spec(self, workload: str) -> dict[str, Any]:
        kind = "DaemonSet" if workload.endswith("node-agent") else "Deployment"
        spec: dict[str, Any] = self.one(kind, workload)["spec"]["template"]["spec"]
        return spec

    def config_map(self, name: str, key: str) -> str:
        text: str = self.one("ConfigMap", name)["data"][key]
        return text


class HelmError(AssertionError):
    """helm exited non-zero; the message holds its stderr."""


def helm(helm_bin: Path, *args: str, values: Mapping[str, Any] | None = None) -> str:
    """Run helm with ``values`` on stdin (``-f -``); the output, or HelmError with stderr."""
    argv = [str(helm_bin), *args]
    if values is not None:
        argv += ["-f", "-"]
    proc = subprocess.run(
        argv,
        input=json.dumps(values or {}),
        capture_output=True,
        text=True,
        timeout=HELM_TIMEOUT_S,
        check=False,
    )
    if proc.returncode != 0:
        raise HelmError(f"{' '.join(args[:2])} failed: {proc.stderr.strip()}")
    return proc.stdout


def render(
    helm_bin: Path,
    values: Mapping[str, Any] | None = None,
    *,
    namespace: str = NAMESPACE,
    release: str = RELEASE,
    kubeconfig: Path | None = None,
) -> Rendered:
    """``helm template``; with ``kubeconfig``, against that cluster (``lookup`` sees it)."""
    where = ["--kube-version", kube_version()]
    if kubeconfig:
        where += ["--dry-run=server", "--kubeconfig", str(kubeconfig)]
    text = helm(
        helm_bin,
        "template",
        release,
        str(CHART),
        "--namespace",
        namespace,
        *where,
        values=values or {},
    )
    objects = tuple(o for o in yaml.safe_load_all(text) if o)
    return Rendered(objects, text)


def fullname(release: str = RELEASE) -> str:
    """The chart's name prefix for a release (templates/_helpers.tpl, tessera.fullname)."""
    return release if "tessera" in release else f"{release}-tessera"


def make_ca_pem() -> bytes:
    """A CA certificate in PEM, for values that need a caBundle."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test-ca")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(Encoding.PEM)


# Values variants: each must lint, render and pass the apiserver's dry-run.
VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "shared-identity": {"scheduler": {"separateIdentities": False}},
    "existing-tls-secret": {
        "webhook": {
            "tls": {
                "existingSecret": "my-webhook-tls",
                "caBundle": base64.b64encode(make_ca_pem()).decode(),
            }
        }
    },
    "cert-manager": {
        "webhook": {
            "tls": {"existingSecret": "my-webhook-tls"},
            "annotations": {"cert-manager.io/inject-ca-from": f"{NAMESPACE}/tessera-webhook"},
        }
    },
    "simulated-gpus": {
        "nodeAgent": {"nvml": {"backend": "simulated", "simulatedGpus": "A100-PCIE-40GB,H100 80GB"}}
    },
    "host-driver-no-mig": {
        "nodeAgent": {
            "runtimeClassName": "",
            "privileged": False,
            "nvml": {"driverLibraryDir": "/usr/lib/x86_64-linux-gnu"},
        }
    },
    "scheduler-only": {
        "webhook": {"enabled": False},
        "nodeAgent": {"enabled": False},
        "admissionPolicies": {"enabled": False},
    },
    "ha-clusterip-no-leader-election": {
        "scheduler": {"replicas": 3, "leaderElection": {"enabled": False}},
        "metrics": {"service": {"type": "ClusterIP"}},
    },
    "converted-hami-config": {"deviceConfigYaml": convert_known_geometries(HAMI_CONFIG)},
    "mps-node": {
        "deviceConfig": {"nvidia": {"nodeconfig": [{"name": "gpu-8", "operatingmode": "mps"}]}},
        "nodeAgent": {"mps": {"root": "/srv/mps", "checkIntervalSeconds": 2, "hostIPC": True}},
    },
    "host-only-pods": {
        "webhook": {"hostOnlyPods": {"enabled": True, "excludeNamespaces": ["monitoring"]}}
    },
}


@pytest.fixture(scope="module")
def helm_bin(built_tools: Path) -> Path:
    path = built_tools / "helm"
    assert path.is_file(), f"{path} is missing; hack/build-tools.sh builds it"
    return path


@pytest.fixture(scope="module")
def variants(helm_bin: Path) -> dict[str, Rendered]:
    """Every variant rendered once (``helm template`` costs seconds on a busy machine)."""
    return {name: render(helm_bin, values) for name, values in VARIANTS.items()}


@pytest.fixture(scope="module")
def default(variants: dict[str, Rendered]) -> Rendered:
    return variants["defaults"]


# helm lint / template ---------------------------------------------------------------------


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_helm_lint_is_clean(helm_bin: Path, variant: str) -> None:
    out = helm(
        helm_bin,
        "lint",
        str(CHART),
        "--strict",
        "--namespace",
        NAMESPACE,
        "--kube-version",
        kube_version(),
        values=VARIANTS[variant],
    )
    assert "1 chart(s) linted, 0 chart(s) failed" in out
    problems = [line for line in out.splitlines() if "[WARNING]" in line or "[ERROR]" in line]
    assert not problems, problems


# Which objects each variant makes: a table of kind -> count.
OBJECTS: dict[str, dict[str, int]] = {
    "defaults": {
        "ServiceAccount": 4,  # scheduler, plugin-server, webhook, node-agent
        "Secret": 3,  # two service account tokens + the webhook's TLS
        "ConfigMap": 2,
        "ClusterRole": 4,
        "ClusterRoleBinding": 4,
        "Role": 1,  # leader election
        "RoleBinding": 2,  # leader election + kube-system authentication reader
        "Service": 1,
        "Deployment": 1,
        "DaemonSet": 1,
        "MutatingWebhookConfiguration": 1,
        "ValidatingAdmissionPolicy": 2,
        "ValidatingAdmissionPolicyBinding": 2,
    },
    "shared-identity": {
        "ServiceAccount": 2,  # scheduler (all three containers), node-agent
        "Secret": 1,
        "ConfigMap": 2,
        "ClusterRole": 4,
        "ClusterRoleBinding": 4,
        "Role": 1,
        "RoleBinding": 2,
        "Service": 1,
        "Deployment": 1,
        "DaemonSet": 1,
        "MutatingWebhookConfiguration": 1,
        "ValidatingAdmissionPolicy": 2,
        "ValidatingAdmissionPolicyBinding": 2,
    },
    "scheduler-only": {
        "ServiceAccount": 2,
        "Secret": 1,  # the plugin server's token
        "ConfigMap": 2,
        "ClusterRole": 2,
        "ClusterRoleBinding": 2,
        "Role": 1,
        "RoleBinding": 2,
        "Service": 1,
        "Deployment": 1,
    },
    "cert-manager": {
        "ServiceAccount": 4,
        "Secret": 2,  # no generated TLS Secret: cert-manager writes it
        "ConfigMap": 2,
        "ClusterRole": 4,
        "ClusterRoleBinding": 4,
        "Role": 1,
        "RoleBinding": 2,
        "Service": 1,
        "Deployment": 1,
        "DaemonSet": 1,
        "MutatingWebhookConfiguration": 1,
        "ValidatingAdmissionPolicy": 2,
        "ValidatingAdmissionPolicyBinding": 2,
    },
}


@pytest.mark.parametrize("variant", sorted(OBJECTS))
def test_variant_renders_exactly_its_objects(variants: dict[str, Rendered], variant: str) -> None:
    assert dict(variants[variant].kinds()) == OBJECTS[variant]


def test_device_config_is_the_codes_built_in_default(default: Rendered) -> None:
    text = default.config_map(f"{fullname()}-device-config", "device-config.yaml")
    config = load_config(text)
    assert config.mig_profile_allowlist == DEFAULT_ALLOWLIST
    built_in = DeviceConfig()
    differing = [
        f.name for f in fields(config) if getattr(config, f.name) != getattr(built_in, f.name)
    ]
    assert not differing, f"chart values differ from DeviceConfig() in {differing}"


def test_converted_hami_config_reaches_the_config_map(variants: dict[str, Rendered]) -> None:
    rendered = variants["converted-hami-config"]
    text = rendered.config_map(f"{fullname()}-device-config", "device-config.yaml")
    config = load_config(text)
    assert [(e.models, e.profiles) for e in config.mig_profile_allowlist] == [
        (("A100-SXM4-40GB", "A100-40GB-PCIe", "A100-PCIE-40GB"), ("1g.5gb", "2g.10gb"))
    ]
    assert config.node("gpu-7").operating_mode == "mig"


def _scheduler_config(rendered: Rendered) -> dict[str, Any]:
    text = rendered.config_map(f"{fullname()}-scheduler-config", "config.yaml")
    loaded: dict[str, Any] = yaml.safe_load(text)
    return loaded


def test_scheduler_profile_is_the_examples_with_the_pods_socket(default: Rendered) -> None:
    chart = _scheduler_config(default)
    example = yaml.safe_load((repo_root() / "examples" / "scheduler-config.yaml").read_text())
    socket = chart["profiles"][0]["pluginConfig"][1]["args"]["socket"]
    example["profiles"][0]["pluginConfig"][1]["args"]["socket"] = socket
    assert chart["profiles"] == example["profiles"]
    assert chart["clientConnection"] == {**example["clientConnection"], "kubeconfig": ""}
    assert chart["leaderElection"] == {
        "leaderElect": True,
        "resourceLock": "leases",
        "resourceName": f"{fullname()}-scheduler",
        "resourceNamespace": NAMESPACE,
        "leaseDuration": "15s",
        "renewDeadline": "10s",
        "retryPeriod": "2s",
    }


def test_gangs_turn_on_the_scheduler_feature_gates(helm_bin: Path, default: Rendered) -> None:
    gates = "--feature-gates=GenericWorkload=true,GangScheduling=true"
    assert gates not in default.container(f"{fullname()}-scheduler", "scheduler")["command"]
    rendered = render(helm_bin, {"scheduler": {"gangs": True}})
    assert gates in rendered.container(f"{fullname()}-scheduler", "scheduler")["command"]


def test_custom_resource_names_reach_the_scheduler_profile(helm_bin: Path) -> None:
    config = (
        "nvidia:\n  resourceCountName: example.com/vgpu\n  resourceCoreName: example.com/cores\n"
    )
    rendered = render(helm_bin, {"deviceConfigYaml": config})
    args = _scheduler_config(rendered)["profiles"][0]["pluginConfig"]
    assert args[0]["args"]["ignoredResources"] == [
        "nvidia.com/gpumem",
        "nvidia.com/gpumem-percentage",
        "example.com/cores",
    ]
    assert args[1]["args"]["resourceCountName"] == "example.com/vgpu"


def flag_value(command: list[str], name: str) -> str:
    values = [c.split("=", 1)[1] for c in command if c.startswith(f"{name}=")]
    assert len(values) == 1, f"{name} given {len(values)} times in {command}"
    return values[0]


def _mount(container: dict[str, Any], volume: str) -> str:
    paths = [m["mountPath"] for m in container.get("volumeMounts", []) if m["name"] == volume]
    assert len(paths) == 1, f"{container['name']} mounts {volume} {len(paths)} times"
    path: str = paths[0]
    return path


def test_plugin_socket_is_shared_and_private(default: Rendered) -> None:
    workload = f"{fullname()}-scheduler"
    shim = default.container(workload, "scheduler")
    server = default.container(workload, "plugin-server")
    socket = flag_value(server["command"], "--socket")
    assert _scheduler_config(default)["profiles"][0]["pluginConfig"][1]["args"]["socket"] == socket
    # Both mount the same emptyDir; the socket sits in a directory below the mount, which the
    # plugin server creates with mode 0700 (the emptyDir itself is world-writable).
    shared = _mount(shim, "plugin-socket")
    assert _mount(server, "plugin-socket") == shared
    assert Path(socket).parent != Path(shared) and Path(socket).is_relative_to(shared)
    volumes = {v["name"]: v for v in default.pod_spec(workload)["volumes"]}
    assert "emptyDir" in volumes["plugin-socket"]
    # One non-root UID for every container (the 0700 directory and 0600 socket are its).
    pod = default.pod_spec(workload)
    pod_ctx = pod["securityContext"]
    uids = {
        c.get("securityContext", {}).get("runAsUser", pod_ctx.get("runAsUser"))
        for c in pod["containers"]
    }
    assert len(uids) == 1 and None not in uids and 0 not in uids, uids
    assert pod_ctx["runAsNonRoot"] is True


def _tessera_containers(rendered: Rendered) -> list[dict[str, Any]]:
    return [
        c
        for kind in ("Deployment", "DaemonSet")
        for workload in rendered.of_kind(kind)
        for c in workload["spec"]["template"]["spec"]["containers"]
        if c["command"][0] == "tessera"
    ]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_tessera_command_line_parses_with_the_real_cli(
    variants: dict[str, Rendered], variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    containers = _tessera_containers(variants[variant])
    assert containers
    for container in containers:
        command = container["command"]
        # The container's environment as the kubelet sets it (field refs get a stand-in).
        for env in container.get("env", []):
            monkeypatch.setenv(env["name"], env.get("value", f"<{env['name']}>"))
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            try:
                args = build_parser().parse_args(command[1:])
            except SystemExit:
                pytest.fail(f"{' '.join(command)}: {stderr.getvalue().strip()}")
        assert isinstance(args, argparse.Namespace) and callable(args.func)


def test_mounted_paths_are_the_ones_the_commands_read(default: Rendered) -> None:
    workload = f"{fullname()}-scheduler"
    shim = default.container(workload, "scheduler")
    assert flag_value(shim["command"], "--config").startswith(
        _mount(shim, "scheduler-config") + "/"
    )
    for workload, name in (
        (f"{fullname()}-scheduler", "plugin-server"),
        (f"{fullname()}-scheduler", "webhook"),
        (f"{fullname()}-node-agent", "node-agent"),
    ):
        c = default.container(workload, name)
        assert flag_value(c["command"], "--config").startswith(_mount(c, "device-config") + "/")
    webhook = default.container(f"{fullname()}-scheduler", "webhook")
    tls_dir = _mount(webhook, "webhook-tls")
    assert flag_value(webhook["command"], "--tls-cert-file") == f"{tls_dir}/tls.crt"
    assert flag_value(webhook["command"], "--tls-key-file") == f"{tls_dir}/tls.key"
    agent = default.container(f"{fullname()}-node-agent", "node-agent")
    assert flag_value(agent["command"], "--plugin-dir") == _mount(agent, "device-plugins")


# MPS: the root is a host path, mounted where the agent names it -----------------------------

AGENT = f"{fullname()}-node-agent"


def _env(container: dict[str, Any]) -> dict[str, str]:
    """The container's literal environment (field references left out)."""
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def _mps_root(rendered: Rendered) -> str:
    """The agent's ``--mps-root``, checked to be the hostPath mounted at that same path: the
    agent hands the kubelet ``<root>/<uuid>/pipe`` as a host path."""
    pod = rendered.pod_spec(AGENT)
    agent = rendered.container(AGENT, "node-agent")
    root = flag_value(agent["command"], "--mps-root")
    (volume,) = [v for v in pod["volumes"] if v["name"] == "mps-root"]
    assert volume["hostPath"] == {"path": root, "type": "DirectoryOrCreate"}
    (mount,) = [m for m in agent["volumeMounts"] if m["name"] == "mps-root"]
    assert mount == {"name": "mps-root", "mountPath": root}  # writable, no subPath
    return root


def test_node_agent_mounts_the_mps_root_at_its_host_path(default: Rendered) -> None:
    assert _mps_root(default) == str(DEFAULT_ROOT)
    command = default.container(AGENT, "node-agent")["command"]
    assert float(flag_value(command, "--mps-check-interval")) == 5.0
    pod = default.pod_spec(AGENT)
    assert "hostIPC" not in pod  # least privilege unless nodeAgent.mps.hostIPC
    # The pause container reaps the daemons the agent starts (they daemonize).
    assert pod["shareProcessNamespace"] is True


def test_mps_values_reach_the_node_agent(variants: dict[str, Rendered], tmp_path: Path) -> None:
    rendered = variants["mps-node"]
    assert _mps_root(rendered) == "/srv/mps"
    command = rendered.container(AGENT, "node-agent")["command"]
    assert flag_value(command, "--mps-check-interval") == "2"
    assert rendered.pod_spec(AGENT)["hostIPC"] is True
    # The node's operating mode passes `tessera config check` (the real command).
    text = rendered.config_map(f"{fullname()}-device-config", "device-config.yaml")
    path = tmp_path / "device-config.yaml"
    path.write_text(text)
    args = build_parser().parse_args(["config", "check", str(path)])
    with contextlib.redirect_stdout(io.StringIO()):
        assert args.func(args) == 0
    assert load_config(text).node("gpu-8").operating_mode == "mps"


def test_a_fractional_mps_check_interval_reaches_the_cli(helm_bin: Path) -> None:
    rendered = render(helm_bin, {"nodeAgent": {"mps": {"checkIntervalSeconds": 0.5}}})
    command = rendered.container(AGENT, "node-agent")["command"]
    assert flag_value(command, "--mps-check-interval") == "0.5"
    args = build_parser().parse_args([*command[1:], "--node-name=gpu-0"])
    assert args.mps_check_interval == 0.5


@pytest.mark.parametrize(
    ("variant", "kind", "backend"),
    [("defaults", "real", ControlDaemons), ("simulated-gpus", "simulated", SimulatedMps)],
)
def test_mps_backend_follows_the_nvml_backend(
    variants: dict[str, Rendered], tmp_path: Path, variant: str, kind: str, backend: type
) -> None:
    env = _env(variants[variant].container(AGENT, "node-agent"))
    assert env["TESSERA_MPS"] == env["TESSERA_NVML"] == kind
    # What the agent builds from that environment (nothing is started).
    assert isinstance(mps_backend_from_env(env, root=tmp_path / "mps"), backend)


def test_real_mps_daemons_get_the_cuda_driver(default: Rendered) -> None:
    """nvidia-cuda-mps-control/-server and libcuda come with the toolkit's compute capability."""
    env = _env(default.container(AGENT, "node-agent"))
    assert set(env["NVIDIA_DRIVER_CAPABILITIES"].split(",")) >= {"compute", "utility"}


def test_each_scheduler_container_reads_its_own_service_account(default: Rendered) -> None:
    workload = f"{fullname()}-scheduler"
    pod = default.pod_spec(workload)
    assert pod["automountServiceAccountToken"] is False
    assert pod["serviceAccountName"] == f"{fullname()}-scheduler"
    volumes = {v["name"]: v for v in pod["volumes"]}
    token_dir = "/var/run/secrets/kubernetes.io/serviceaccount"
    expected = {
        "scheduler": ("scheduler-token", None),
        "plugin-server": ("plugin-server-token", f"{fullname()}-plugin-server-token"),
        "webhook": ("webhook-token", f"{fullname()}-webhook-token"),
    }
    for container, (volume, secret) in expected.items():
        mounts = [
            m["name"]
            for m in default.container(workload, container)["volumeMounts"]
            if m["mountPath"] == token_dir
        ]
        assert mounts == [volume], (container, mounts)
        if secret is None:
            sources = volumes[volume]["projected"]["sources"]
            assert any("serviceAccountToken" in s for s in sources)
        else:
            assert volumes[volume]["secret"]["secretName"] == secret
            token = default.one("Secret", secret)
            assert token["type"] == "kubernetes.io/service-account-token"
            account = token["metadata"]["annotations"]["kubernetes.io/service-account.name"]
            assert account == secret.removesuffix("-token")


def test_service_exposes_metrics_and_webhook(default: Rendered) -> None:
    svc = default.one("Service", f"{fullname()}-scheduler")
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert svc["spec"]["type"] == "NodePort"
    assert (ports["metrics"]["port"], ports["metrics"]["nodePort"]) == (9395, 31993)
    assert (ports["webhook"]["port"], ports["webhook"]["targetPort"]) == (443, "webhook")
    server = default.container(f"{fullname()}-scheduler", "plugin-server")
    assert flag_value(server["command"], "--metrics-address") == "0.0.0.0:9395"
    webhook = default.container(f"{fullname()}-scheduler", "webhook")
    assert webhook["ports"] == [{"name": "webhook", "containerPort": 9443}]
    assert flag_value(webhook["command"], "--listen") == "0.0.0.0:9443"


def _load_cert(b64: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate(base64.b64decode(b64))


def test_generated_webhook_certificate_is_signed_for_the_service(default: Rendered) -> None:
    secret = default.one("Secret", f"{fullname()}-webhook-tls")
    assert secret["type"] == "kubernetes.io/tls"
    ca = _load_cert(secret["data"]["ca.crt"])
    cert = _load_cert(secret["data"]["tls.crt"])
    mwc = default.one("MutatingWebhookConfiguration", f"{fullname()}-webhook")
    hook = mwc["webhooks"][0]
    assert hook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
    # The serving certificate verifies against the CA and names the Service.
    cert.verify_directly_issued_by(ca)
    service = hook["clientConfig"]["service"]
    assert (service["name"], service["namespace"], service["path"]) == (
        f"{fullname()}-scheduler",
        NAMESPACE,
        "/mutate",
    )
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    host = f"{service['name']}.{service['namespace']}.svc"
    assert host in names.get_values_for_type(x509.DNSName)
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in usage
    # The key in the Secret is the certificate's.
    key = load_pem_private_key(base64.b64decode(secret["data"]["tls.key"]), password=None)
    assert isinstance(key, rsa.RSAPrivateKey)
    signature = key.sign(b"probe", padding.PKCS1v15(), hashes.SHA256())
    public = cert.public_key()
    assert isinstance(public, rsa.RSAPublicKey)
    public.verify(signature, b"probe", padding.PKCS1v15(), hashes.SHA256())


def test_webhook_sees_creates_and_untrusted_updates_of_internal_annotations(
    default: Rendered, helm_bin: Path
) -> None:
    hook = default.one("MutatingWebhookConfiguration", f"{fullname()}-webhook")["webhooks"][0]
    (rule,) = hook["rules"]
    assert (rule["operations"], rule["resources"]) == (
        ["CREATE", "UPDATE"],
        ["pods", "pods/status"],
    )
    components = [
        f"system:serviceaccount:{NAMESPACE}:{fullname()}-plugin-server",
        f"system:serviceaccount:{NAMESPACE}:{fullname()}-node-agent",
    ]
    (cond,) = hook["matchConditions"]
    # The chart says exactly what `tessera webhook manifest --trusted-user ...` says.
    assert cond["expression"] == match_condition(components)
    serve = default.container(f"{fullname()}-scheduler", "webhook")["command"]
    assert [a for a in serve if a.startswith("--trusted-user=")] == [
        f"--trusted-user={u}" for u in components
    ]
    restore = "system:serviceaccount:backup:restore"
    more = render(helm_bin, {"webhook": {"trustedUsers": [restore]}})
    hook = more.one("MutatingWebhookConfiguration", f"{fullname()}-webhook")["webhooks"][0]
    assert hook["matchConditions"][0]["expression"] == match_condition([*components, restore])


def test_webhook_never_sees_its_own_namespace_or_opted_out_pods(default: Rendered) -> None:
    hook = default.one("MutatingWebhookConfiguration", f"{fullname()}-webhook")["webhooks"][0]
    names = [
        e
        for e in hook["namespaceSelector"]["matchExpressions"]
        if e["key"] == "kubernetes.io/metadata.name"
    ]
    assert names == [
        {
            "key": "kubernetes.io/metadata.name",
            "operator": "NotIn",
            "values": ["kube-system", NAMESPACE],
        }
    ]
    opt_out = {"key": "hami.io/webhook", "operator": "NotIn", "values": ["ignore"]}
    assert opt_out in hook["namespaceSelector"]["matchExpressions"]
    assert hook["objectSelector"]["matchExpressions"] == [opt_out]
    for workload in (f"{fullname()}-scheduler", f"{fullname()}-node-agent"):
        kind = "DaemonSet" if workload.endswith("node-agent") else "Deployment"
        labels = default.one(kind, workload)["spec"]["template"]["metadata"]["labels"]
        assert labels["hami.io/webhook"] == "ignore"


def test_host_only_pods_turn_on_the_webhook_routing_and_the_plugin_asking(
    helm_bin: Path, default: Rendered
) -> None:
    """Off by default; on, the webhook routes pods without a GPU (never from the namespaces
    it skips, those only routing skips, or the release namespace) and the scheduler plugin
    asks the server about them."""

    def state(r: Rendered) -> tuple[list[str], object]:
        command = r.container(f"{fullname()}-scheduler", "webhook")["command"]
        return [a for a in command if a.startswith("--host-only")], _plugin_host_only(r)

    assert state(default) == ([], False)
    on = render(
        helm_bin,
        {
            "webhook": {
                "hostOnlyPods": {"enabled": True, "excludeNamespaces": ["monitoring", "ops"]},
                "excludeNamespaces": ["kube-system", "ops"],
            }
        },
    )
    assert state(on) == (
        [
            "--host-only-pods",
            "--host-only-exclude-namespace=kube-system",
            "--host-only-exclude-namespace=ops",
            "--host-only-exclude-namespace=monitoring",
            f"--host-only-exclude-namespace={NAMESPACE}",
        ],
        True,
    )
    # The webhook still judges the GPU pods of a namespace that only routing skips.
    hook = on.one("MutatingWebhookConfiguration", f"{fullname()}-webhook")["webhooks"][0]
    selector = hook["namespaceSelector"]["matchExpressions"]
    skipped = {"key": "kubernetes.io/metadata.name", "operator": "NotIn"}
    assert {**skipped, "values": ["kube-system", "ops", NAMESPACE]} in selector
    # Without the webhook nothing routes them, so the plugin is not told to expect them.
    alone = render(helm_bin, {"webhook": {"enabled": False, "hostOnlyPods": {"enabled": True}}})
    assert _plugin_host_only(alone) is False


def _plugin_host_only(rendered: Rendered) -> object:
    args = _scheduler_config(rendered)["profiles"][0]["pluginConfig"][1]["args"]
    return args["hostOnlyPods"]


# Values that must stop the render, and the message that says what to change.
BAD_VALUES: list[tuple[str, dict[str, Any], str]] = [
    (
        "existing secret without a CA",
        {"webhook": {"tls": {"existingSecret": "mine"}}},
        "also set webhook.tls.caBundle",
    ),
    (
        "unknown NVML backend",
        {"nodeAgent": {"nvml": {"backend": "fake"}}},
        'nodeAgent.nvml.backend must be "real" or "simulated", got "fake"',
    ),
    (
        "simulated without GPUs",
        {"nodeAgent": {"nvml": {"backend": "simulated"}}},
        "set nodeAgent.nvml.simulatedGpus",
    ),
    (
        "too few plugin server RPC workers",
        {"scheduler": {"pluginServer": {"rpcWorkers": 8}}},
        "scheduler.pluginServer.rpcWorkers must be a whole number of at least 32, got 8",
    ),
    (
        "plugin server RPC workers that are not a number",
        {"scheduler": {"pluginServer": {"rpcWorkers": "lots"}}},
        "scheduler.pluginServer.rpcWorkers must be a whole number of at least 32, got lots",
    ),
    (
        "device config that is not YAML",
        {"deviceConfigYaml": "nvidia: [unclosed"},
        "deviceConfigYaml is not valid YAML",
    ),
    (
        "relative MPS root",
        {"nodeAgent": {"mps": {"root": "var/lib/mps"}}},
        'nodeAgent.mps.root must be an absolute host path (clean, not /), got "var/lib/mps"',
    ),
    (
        "MPS root that is not clean",
        {"nodeAgent": {"mps": {"root": "/var/lib/../mps/"}}},
        'nodeAgent.mps.root must be an absolute host path (clean, not /), got "/var/lib/../mps/"',
    ),
    (
        "MPS root /",
        {"nodeAgent": {"mps": {"root": "/"}}},
        'nodeAgent.mps.root must be an absolute host path (clean, not /), got "/"',
    ),
    (
        "zero MPS check interval",
        {"nodeAgent": {"mps": {"checkIntervalSeconds": 0}}},
        "nodeAgent.mps.checkIntervalSeconds must be a number of seconds in (0, 3600], got 0",
    ),
    (
        "MPS check interval with a unit",
        {"nodeAgent": {"mps": {"checkIntervalSeconds": "5s"}}},
        "nodeAgent.mps.checkIntervalSeconds must be a number of seconds in (0, 3600], got 5s",
    ),
    (
        "MPS hostIPC that is not a boolean",
        {"nodeAgent": {"mps": {"hostIPC": "yes"}}},
        "nodeAgent.mps.hostIPC must be true or false, got yes",
    ),
    (
        # A string would be true in the templates, whatever it says.
        "hostOnlyPods.enabled that is not a boolean",
        {"webhook": {"hostOnlyPods": {"enabled": "false"}}},
        "webhook.hostOnlyPods.enabled must be true or false, got false",
    ),
    (
        "hostOnlyPods.excludeNamespaces that is not a list",
        {"webhook": {"hostOnlyPods": {"excludeNamespaces": "monitoring"}}},
        "webhook.hostOnlyPods.excludeNamespaces must be a list of namespace names, got monitoring",
    ),
    (
        "hostOnlyPods.excludeNamespaces naming no namespace",
        {"webhook": {"hostOnlyPods": {"excludeNamespaces": ["kube-system", "Team_A"]}}},
        'webhook.hostOnlyPods.excludeNamespaces: "Team_A" is not a namespace name',
    ),
]


@pytest.mark.parametrize(
    ("values", "message"), [(v, m) for _, v, m in BAD_VALUES], ids=[c for c, _, _ in BAD_VALUES]
)
def test_bad_values_fail_with_a_clear_message(
    helm_bin: Path, values: dict[str, Any], message: str
) -> None:
    with pytest.raises(HelmError, match=re.escape(message)):
        render(helm_bin, values)


def _undocumented_values(text: str) -> list[str]:
    """Dotted paths of values.yaml keys with no comment directly above them or any ancestor."""
    key_re = re.compile(r"^(\s*)([A-Za-z][\w.-]*):(\s|$)")
    stack: list[tuple[int, str, bool]] = []  # (indent, key, documented here or above)
    missing: list[str] = []
    previous = ""
    for line in text.splitlines():
        m = key_re.match(line)
        if m:
            indent, key = len(m.group(1)), m.group(2)
            while stack and stack[-1][0] >= indent:
                stack.pop()
            commented = previous.lstrip().startswith("#")
            documented = commented or any(doc for _, _, doc in stack)
            path = ".".join([*(k for _, k, _ in stack), key])
            value = line[m.end() :].split("#", 1)[0].strip()
            is_leaf = value != ""
            if is_leaf and not documented:
                missing.append(path)
            stack.append((indent, key, documented))
        if line.strip():
            previous = line
    return missing


def test_every_value_is_documented() -> None:
    assert _undocumented_values((CHART / "values.yaml").read_text()) == []


def test_the_documentation_check_finds_an_undocumented_value() -> None:
    text = (
        "image:\n  # -- documented\n  tag: x\n  pullPolicy: Always\n"
        "scheduler:\n  # -- the whole block\n  a:\n    b: 1\n"
    )
    assert _undocumented_values(text) == ["image.pullPolicy"]


# The real apiserver -------------------------------------------------------------------------


def remove_namespace(cluster: ClusterClient, name: str) -> None:
    """Delete a namespace the way the (absent) namespace controller would finish it."""
    with contextlib.suppress(Exception):
        cluster.api.delete(f"/api/v1/namespaces/{name}")
    # No kube-controller-manager here: drop the finalizer ourselves once it is Terminating.
    ns = cluster.api.get(f"/api/v1/namespaces/{name}")
    ns["spec"]["finalizers"] = []
    cluster.api.request("PUT", f"/api/v1/namespaces/{name}/finalize", ns)


def kubectl_apply(
    cluster: ClusterClient, rendered: Rendered, tmp_path: Path, *, dry_run: bool
) -> list[str]:
    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(rendered.text)
    args = ["apply", "-f", str(manifest)]
    if dry_run:
        args.insert(1, "--dry-run=server")
    proc = cluster.kubectl(*args)
    assert proc.returncode == 0, f"kubectl apply failed:\n{proc.stderr}"
    return [line for line in proc.stdout.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def release_namespace(dev_cluster: ClusterClient) -> Iterator[str]:
    """The namespace every variant is rendered for; dry-run needs it to exist."""
    dev_cluster.api.post(
        "/api/v1/namespaces",
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
    )
    try:
        yield NAMESPACE
    finally:
        remove_namespace(dev_cluster, NAMESPACE)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_apiserver_accepts_every_object_in_dry_run(
    variants: dict[str, Rendered],
    dev_cluster: ClusterClient,
    release_namespace: str,
    tmp_path: Path,
    variant: str,
) -> None:
    rendered = variants[variant]
    lines = kubectl_apply(dev_cluster, rendered, tmp_path, dry_run=True)
    assert len(lines) == len(rendered.objects), lines
    assert all(line.endswith("(server dry run)") for line in lines), lines


def test_upgrade_keeps_the_generated_webhook_certificate(
    helm_bin: Path, dev_cluster: ClusterClient, release_namespace: str, default: Rendered
) -> None:
    """An upgrade renders against the cluster: the Secret of the first install is read back
    (``lookup``), so the serving certificate and the webhook's caBundle do not change."""
    name = f"{fullname()}-webhook-tls"
    first = default.one("Secret", name)
    dev_cluster.api.post(f"/api/v1/namespaces/{release_namespace}/secrets", first)
    try:
        upgrade = render(helm_bin, namespace=release_namespace, kubeconfig=dev_cluster.kubeconfig)
    finally:
        dev_cluster.api.delete(f"/api/v1/namespaces/{release_namespace}/secrets/{name}")
    assert upgrade.one("Secret", name)["data"] == first["data"]
    hook = upgrade.one("MutatingWebhookConfiguration", f"{fullname()}-webhook")["webhooks"][0]
    assert hook["clientConfig"]["caBundle"] == first["data"]["ca.crt"]
    # Without the Secret, a fresh CA: the lookup is what kept it.
    fresh = render(helm_bin, namespace=release_namespace, kubeconfig=dev_cluster.kubeconfig)
    assert fresh.one("Secret", name)["data"]["ca.crt"] != first["data"]["ca.crt"]
