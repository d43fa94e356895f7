"""The dev cluster: etcd, kube-apiserver and the kwok controller on loopback, up and down.

Start order etcd → apiserver (→ RBAC bootstrap) → kwok, each waited on until healthy; stop in
reverse. ``up`` on a half-running cluster (one part crashed) tears the rest down first, so it
always starts from a clean slate; ``down`` works from pid files and, for processes whose pid
file is gone, from the state dir on their command line.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import json
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import structlog
import yaml

from api.kube.errors import KubeError
from scheduler_plugins.devtools.cluster import processes
from scheduler_plugins.devtools.cluster.certs import Pki, Tokens, ensure_pki, ensure_tokens
from scheduler_plugins.devtools.cluster.errors import (
    ClusterError,
    PortInUseError,
    ToolsMissingError,
)
from scheduler_plugins.devtools.cluster.kubeapi import KubeApi
from scheduler_plugins.devtools.cluster.layout import (
    GANG_API,
    GANG_FEATURE_GATES,
    LOOPBACK,
    SERVICE_CIDR,
    SERVICE_IP,
    ClusterSettings,
    is_private_dir,
    repo_root,
)
from scheduler_plugins.devtools.cluster.stack import stop_stack

log = structlog.get_logger(__name__)

ETCD: Final = "etcd"
APISERVER: Final = "kube-apiserver"
KWOK: Final = "kwok"
COMPONENTS: Final = (ETCD, APISERVER, KWOK)  # start order
KWOK_NODE_ANNOTATION: Final = "kwok.x-k8s.io/node"
PROFILING_ENV: Final = "TESSERA_APISERVER_PROFILING"  # 1: serve /debug/pprof (diagnostics)
KWOK_STAGES: Final = (
    "node-initialize.yaml",
    "node-heartbeat-with-lease.yaml",
    "pod-ready.yaml",
    "pod-complete.yaml",
    "pod-delete.yaml",
)
_SA_ISSUER: Final = "https://kubernetes.default.svc.cluster.local"


@dataclass(frozen=True)
class ClusterInfo:
    """How to reach a running cluster."""

    name: str
    server: str
    token: str
    ca_file: Path
    kubeconfig: Path
    state_dir: Path

    def api(self) -> KubeApi:
        return KubeApi(self.server, self.token, self.ca_file)


@dataclass(frozen=True)
class ComponentStatus:
    component: str
    pid: int | None
    running: bool
    healthy: bool
    detail: str

    def line(self, width: int) -> str:
        """One row of ``status``: ``  NAME  healthy|running|stopped  pid=N  detail``."""
        pid = str(self.pid) if self.pid else "-"
        state = "healthy" if self.healthy else "running" if self.running else "stopped"
        return f"  {self.component:<{width}} {state:<8} pid={pid:<8} {self.detail}"


def component_status(
    settings: ClusterSettings, component: str, probe: Callable[[], str | None]
) -> ComponentStatus:
    """A component's state from its pid file and, while it runs, ``probe`` (None: healthy;
    else why not)."""
    record = processes.read_record(settings.pid_file(component))
    running = record is not None and processes.is_running(record)
    why_not = probe() if running else "not running"
    detail = "ok" if why_not is None else why_not
    if record is not None and not running:
        detail = f"crashed or killed (stale pid file); log: {settings.log_file(component)}"
    return ComponentStatus(
        component=component,
        pid=record.pid if record else None,
        running=running,
        healthy=running and why_not is None,
        detail=detail,
    )


class Cluster:
    """One dev cluster, addressed by its settings (name, ports, dirs)."""

    def __init__(self, settings: ClusterSettings) -> None:
        self.settings = settings

    @property
    def _hack(self) -> Path:
        """Config shipped in the checkout (kwok stages, RBAC); only ``up`` needs it."""
        return repo_root() / "hack"

    # Public ------------------------------------------------------------------------------

    def up(self, *, timeout_s: float = 120.0) -> ClusterInfo:
        """Start the cluster and wait until every part is healthy; idempotent when healthy."""
        s = self.settings
        self._check_binaries()
        states = self.status()
        if all(st.running and st.healthy for st in states):
            log.info("cluster.already_up", cluster=s.name)
            return self.info()
        if any(st.running for st in states) or any(s.pid_file(c).exists() for c in COMPONENTS):
            log.warning(
                "cluster.partial",
                cluster=s.name,
                running=[st.component for st in states if st.running],
            )
            self.down()
        self._check_ports()
        for d in (s.state_dir, s.run_dir, s.log_dir, s.etcd_data_dir):
            d.mkdir(parents=True, exist_ok=True)
        pki = ensure_pki(s.pki_dir, dns_names=_DNS_NAMES, ips=(LOOPBACK, SERVICE_IP))
        tokens = ensure_tokens(s.token_file)
        _write_kubeconfig(s.kubeconfig, s, pki, tokens.admin, "tessera-admin")
        _write_kubeconfig(s.kwok_kubeconfig, s, pki, tokens.kwok, "kwok-controller")
        s.save()
        started = time.monotonic()
        try:
            self._start(ETCD, self._etcd_argv(), self._probe_etcd, timeout_s)
            with KubeApi(s.apiserver_url, tokens.admin, pki.ca_cert) as api:
                self._start(APISERVER, self._apiserver_argv(pki), _readyz_probe(api), timeout_s)
                self._bootstrap(api, timeout_s)
            self._start(KWOK, self._kwok_argv(), self._probe_kwok, timeout_s)
        except BaseException:
            self.down()
            raise
        log.info(
            "cluster.up",
            cluster=s.name,
            server=s.apiserver_url,
            kubeconfig=str(s.kubeconfig),
            seconds=round(time.monotonic() - started, 2),
        )
        return self.info(tokens, pki)

    def down(self, *, purge: bool = False) -> list[str]:
        """Stop every part (also after a crash, from stale pid files); returns what was stopped."""
        s = self.settings
        stopped: list[str] = stop_stack(s)  # Tessera's own processes first
        for component in reversed(COMPONENTS):
            record = processes.stop(s.pid_file(component))
            if record is not None:
                stopped.append(component)
        if s.state_dir.is_dir():
            strays = processes.find_strays(str(s.state_dir) + os.sep, s.bin_dir)
            if strays:
                log.warning("cluster.strays", cluster=s.name, pids=strays)
                processes.kill_pids(strays)
                stopped.extend(f"stray pid {p}" for p in strays)
        if purge and s.state_dir.is_dir():
            shutil.rmtree(s.state_dir)
        if purge and is_private_dir(s.memory_dir):  # only what ``private_dir`` made
            shutil.rmtree(s.memory_dir)
        log.info("cluster.down", cluster=s.name, stopped=stopped, purged=purge)
        return stopped

    def restart(self, component: str, *, timeout_s: float = 120.0) -> None:
        """Stop one component (a stale pid file is fine) and start it again with the command
        line of ``up``, waiting until it is healthy; everything else keeps running."""
        s = self.settings
        if component not in COMPONENTS:
            raise ClusterError(
                f"unknown cluster component {component!r}; one of {', '.join(COMPONENTS)}"
            )
        before = processes.read_record(s.pid_file(component))
        processes.stop(s.pid_file(component))
        if before is not None and not processes.wait_released(before):
            log.warning("component.not_released", component=component, pid=before.pid)
        if component == ETCD:
            self._start(ETCD, self._etcd_argv(), self._probe_etcd, timeout_s)
        elif component == APISERVER:
            pki = ensure_pki(s.pki_dir, dns_names=_DNS_NAMES, ips=(LOOPBACK, SERVICE_IP))
            self._start(APISERVER, self._apiserver_argv(pki), self._probe_apiserver, timeout_s)
        else:
            self._start(KWOK, self._kwok_argv(), self._probe_kwok, timeout_s)

    def status(self) -> list[ComponentStatus]:
        s = self.settings
        probes: dict[str, Callable[[], str | None]] = {
            ETCD: self._probe_etcd,
            APISERVER: self._probe_apiserver,
            KWOK: self._probe_kwok,
        }
        return [component_status(s, c, probes[c]) for c in COMPONENTS]

    def info(self, tokens: Tokens | None = None, pki: Pki | None = None) -> ClusterInfo:
        s = self.settings
        if tokens is None:
            if not s.token_file.is_file():
                raise ClusterError(f"cluster {s.name} has no tokens at {s.token_file}: is it up?")
            tokens = ensure_tokens(s.token_file)
        return ClusterInfo(
            name=s.name,
            server=s.apiserver_url,
            token=tokens.admin,
            ca_file=pki.ca_cert if pki else s.pki_dir / "ca.crt",
            kubeconfig=s.kubeconfig,
            state_dir=s.state_dir,
        )

    def running_pids(self) -> list[int]:
        """Pids of this cluster's live processes (pid files and strays), for leak checks."""
        s = self.settings
        pids = []
        for component in COMPONENTS:
            record = processes.read_record(s.pid_file(component))
            if record is not None and processes.is_running(record):
                pids.append(record.pid)
        if s.state_dir.is_dir():
            pids.extend(processes.find_strays(str(s.state_dir) + os.sep, s.bin_dir))
        return sorted(set(pids))

    # Steps -------------------------------------------------------------------------------

    def _check_binaries(self) -> None:
        missing = [
            str(self.settings.binary(c))
            for c in COMPONENTS
            if not _executable(self.settings.binary(c))
        ]
        if missing:
            raise ToolsMissingError(
                f"missing {', '.join(missing)}: build them with `make tools` "
                f"(hack/build-tools.sh; TESSERA_CACHE={self.settings.cache_dir})"
            )

    def _check_ports(self) -> None:
        s = self.settings
        flags = {
            s.etcd_port: "--etcd-port",
            s.etcd_peer_port: "--etcd-peer-port",
            s.apiserver_port: "--apiserver-port",
            s.kwok_port: "--kwok-port",
        }
        for port, flag in flags.items():
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind((LOOPBACK, port))
                except OSError as e:
                    if e.errno != errno.EADDRINUSE:
                        raise
                    raise PortInUseError(
                        f"port {LOOPBACK}:{port} is in use (another cluster?); stop it with "
                        f"`tessera cluster down --name …` or choose another {flag}"
                    ) from e

    def _start(
        self,
        component: str,
        argv: list[str],
        probe: Callable[[], str | None],
        timeout_s: float,
    ) -> None:
        s = self.settings
        t0 = time.monotonic()
        record = processes.spawn(
            component, argv, log_path=s.log_file(component), pid_path=s.pid_file(component)
        )
        processes.wait_ready(record, probe, log_path=s.log_file(component), timeout_s=timeout_s)
        log.info("component.ready", component=component, seconds=round(time.monotonic() - t0, 2))

    def _bootstrap(self, api: KubeApi, timeout_s: float) -> None:
        """RBAC for kwok, and the objects a controller-manager would otherwise make."""
        for obj in _load_yaml_docs(self._hack / "kwok" / "rbac.yaml"):
            api.apply(_rbac_path(obj), obj)
        # The apiserver's own controller creates `default`; wait for it rather than race it.
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                api.get("/api/v1/namespaces/default")
                break
            except (ClusterError, KubeError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        api.apply(
            "/api/v1/namespaces/default/serviceaccounts/default",
            {
                "apiVersion": "v1",
                "kind": "ServiceAccount",
                "metadata": {"name": "default", "namespace": "default"},
            },
        )

    # Command lines -----------------------------------------------------------------------

    def _etcd_argv(self) -> list[str]:
        s = self.settings
        argv = [
            str(s.binary(ETCD)),
            f"--name={s.name}",
            f"--data-dir={s.etcd_data_dir}",
            f"--listen-client-urls={s.etcd_url}",
            f"--advertise-client-urls={s.etcd_url}",
            f"--listen-peer-urls={s.etcd_peer_url}",
            f"--initial-advertise-peer-urls={s.etcd_peer_url}",
            f"--initial-cluster={s.name}={s.etcd_peer_url}",
            f"--initial-cluster-token=tessera-{s.name}",
            "--quota-backend-bytes=4294967296",
            "--log-level=warn",
        ]
        if not s.etcd_fsync:
            argv.append("--unsafe-no-fsync")
        return argv

    def _apiserver_argv(self, pki: Pki) -> list[str]:
        s = self.settings
        return [
            str(s.binary(APISERVER)),
            f"--etcd-servers={s.etcd_url}",
            f"--bind-address={LOOPBACK}",
            f"--advertise-address={LOOPBACK}",
            f"--secure-port={s.apiserver_port}",
            f"--tls-cert-file={pki.serving_cert}",
            f"--tls-private-key-file={pki.serving_key}",
            f"--token-auth-file={s.token_file}",
            # Client certs signed by the dev CA authenticate too (pki.admin_cert): kubeconfigs
            # with inline client-certificate-data work against the dev cluster.
            f"--client-ca-file={pki.ca_cert}",
            "--authorization-mode=RBAC",
            "--anonymous-auth=false",  # every client (probes too) uses a token
            f"--service-account-issuer={_SA_ISSUER}",
            f"--service-account-key-file={pki.sa_key}",
            f"--service-account-signing-key-file={pki.sa_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            # No controller-manager: nothing would make ServiceAccount tokens, nor lift the
            # not-ready taint that TaintNodesByCondition puts on every new node.
            "--disable-admission-plugins=ServiceAccount,TaintNodesByCondition",
            "--allow-privileged=true",
            # Gangs: kube-scheduler 1.36's PodGroup API (scheduling.k8s.io/v1alpha2, alpha) and
            # the pod's spec.schedulingGroup (README "Gangs").
            f"--feature-gates={GANG_FEATURE_GATES}",
            f"--runtime-config={GANG_API}=true",
            # /debug/pprof only when asked (diagnosing apiserver load, e.g. in benchmarks).
            f"--profiling={'true' if os.environ.get(PROFILING_ENV) == '1' else 'false'}",
        ]

    def _kwok_argv(self) -> list[str]:
        s = self.settings
        stages = self._hack / "kwok" / "stages"
        argv = [
            str(s.binary(KWOK)),
            f"--kubeconfig={s.kwok_kubeconfig}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
            f"--server-address={LOOPBACK}:{s.kwok_port}",
            # No --node-lease-duration-seconds: without a controller-manager nothing reads
            # node leases, and renewing a thousand of them costs the 2-core box real CPU.
        ]
        for path in (self._hack / "kwok" / "kwok.yaml", *(stages / n for n in KWOK_STAGES)):
            if not path.is_file():
                raise ClusterError(f"kwok config file {path} is missing from the checkout")
            argv.append(f"--config={path}")
        return argv

    # Probes: None when healthy, else why not ----------------------------------------------

    def _probe_etcd(self) -> str | None:
        status, body = _http_get(LOOPBACK, self.settings.etcd_port, "/health")
        if status != 200:
            return f"etcd /health: {status} {body[:200]}"
        try:
            healthy = json.loads(body).get("health") == "true"
        except ValueError:
            healthy = False
        return None if healthy else f"etcd /health: {body[:200]}"

    def _probe_kwok(self) -> str | None:
        status, body = _http_get(LOOPBACK, self.settings.kwok_port, "/healthz")
        return None if status == 200 else f"kwok /healthz: {status} {body[:200]}"

    def _probe_apiserver(self) -> str | None:
        s = self.settings
        ca = s.pki_dir / "ca.crt"
        if not ca.is_file():
            return f"no CA at {ca}"
        tokens = ensure_tokens(s.token_file) if s.token_file.is_file() else None
        if tokens is None:
            return f"no token file at {s.token_file}"
        with KubeApi(s.apiserver_url, tokens.admin, ca) as api:
            return _readyz_probe(api)()


_DNS_NAMES: Final = (
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)


def _readyz_probe(api: KubeApi) -> Callable[[], str | None]:
    def probe() -> str | None:
        try:
            status, body = api.probe("/readyz")
        except (ClusterError, KubeError) as e:
            return str(e.__cause__ or e)
        return None if status == 200 else f"/readyz: {status} {body.strip()[-300:]}"

    return probe


def _http_get(host: str, port: int, path: str) -> tuple[int, str]:
    """Plain-HTTP GET straight to loopback (no proxy env); (0, error) when unreachable."""
    conn = http.client.HTTPConnection(host, port, timeout=5)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    except (OSError, http.client.HTTPException) as e:
        return 0, repr(e)
    finally:
        conn.close()


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _load_yaml_docs(path: Path) -> Iterator[dict[str, Any]]:
    try:
        docs = list(yaml.safe_load_all(path.read_text()))
    except (OSError, yaml.YAMLError) as e:
        raise ClusterError(f"cannot load {path}: {e}") from e
    for doc in docs:
        if isinstance(doc, dict):
            yield doc


def _rbac_path(obj: dict[str, Any]) -> str:
    kinds = {"ClusterRole": "clusterroles", "ClusterRoleBinding": "clusterrolebindings"}
    kind = obj.get("kind")
    if kind not in kinds:
        raise ClusterError(f"hack/kwok/rbac.yaml: unsupported kind {kind!r}; expected {kinds}")
    return f"/apis/rbac.authorization.k8s.io/v1/{kinds[kind]}/{obj['metadata']['name']}"


def _write_kubeconfig(path: Path, s: ClusterSettings, pki: Pki, token: str, user: str) -> None:
    context = f"tessera-{s.name}"
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": context,
                "cluster": {"server": s.apiserver_url, "certificate-authority": str(pki.ca_cert)},
            }
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": context, "context": {"cluster": context, "user": user}}],
        "current-context": context,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(cfg, f, sort_keys=False)
    os.replace(tmp, path)


@contextlib.contextmanager
def running_cluster(
    settings: ClusterSettings, *, timeout_s: float = 120.0
) -> Iterator[ClusterInfo]:
    """``up`` on entry, ``down`` on exit (whatever happened in between)."""
    cluster = Cluster(settings)
    try:
        yield cluster.up(timeout_s=timeout_s)
    finally:
        cluster.down()
