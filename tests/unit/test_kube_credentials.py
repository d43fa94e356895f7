"""Where KubeClient's credentials come from: kubeconfigs as kind and cloud providers write
them (inline certificate data, tokenFile, exec plugins), the in-cluster service account, and
how the Authorization header is renewed (on a schedule, and once after a 401).

A loopback HTTPS server answers every GET with the Authorization header and the client
certificate's CN it got, so each test sees what the client sent.
"""

from __future__ import annotations

import datetime as dt
import http.server
import json
import shutil
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from api.kube.client import REFRESH_S, Credentials, KubeClient
from api.kube.errors import ApiError, KubeConfigError
from scheduler_plugins.devtools.cluster.certs import ADMIN_USER, Pki, ensure_pki
from tests.kube_exec import (
    USER,
    b64,
    exec_plugin,
    failing_exec_plugin,
    write_kubeconfig,
)


@dataclass
class Server:
    url: str
    port: int
    pki: Pki
    refused: set[str] = field(default_factory=set)  # Authorization values answered 401
    seen: list[str | None] = field(default_factory=list)  # every request's, in order


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    pki = ensure_pki(tmp_path / "pki", dns_names=["localhost"], ips=["127.0.0.1"])
    box: dict[str, Server] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            auth = self.headers.get("Authorization")
            box["s"].seen.append(auth)
            if auth in box["s"].refused:
                self._answer(401, {"kind": "Status", "reason": "Unauthorized", "message": "no"})
                return
            peer = self.connection.getpeercert()
            names = dict(rdn[0] for rdn in peer["subject"]) if peer else {}
            seen = {"auth": auth, "cn": names.get("commonName")}
            if "watch=1" in self.path:
                self._answer(200, {"type": "ADDED", "object": seen})
            else:
                self._answer(200, seen)

        def _answer(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode() + b"\n"
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(pki.serving_cert), str(pki.serving_key))
    # Client certs are asked for, not required: token tests connect without one.
    ctx.load_verify_locations(str(pki.ca_cert))
    ctx.verify_mode = ssl.CERT_OPTIONAL
    httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    port = httpd.server_address[1]
    try:
        box["s"] = Server(f"https://127.0.0.1:{port}", port, pki)
        yield box["s"]
    finally:
        httpd.shutdown()
        httpd.server_close()


def kubeconfig(server: Server, directory: Path, user: dict[str, Any]) -> Path:
    return write_kubeconfig(directory / "kubeconfig", server.url, user, ca_file=server.pki.ca_cert)


def seen_by_server(api: KubeClient) -> dict[str, Any]:
    answer: dict[str, Any] = api.get("/api")
    return answer


# Kubeconfig users ---------------------------------------------------------------------------


def test_inline_ca_data_and_a_token(server: Server, tmp_path: Path) -> None:
    with KubeClient.from_kubeconfig(kubeconfig(server, tmp_path, {"token": "tok-a"})) as api:
        assert seen_by_server(api) == {"auth": "Bearer tok-a", "cn": None}


def test_inline_client_certificate_data(server: Server, tmp_path: Path) -> None:
    user = {
        "client-certificate-data": b64(server.pki.admin_cert),
        "client-key-data": b64(server.pki.admin_key),
    }
    with KubeClient.from_kubeconfig(kubeconfig(server, tmp_path, user)) as api:
        assert seen_by_server(api) == {"auth": None, "cn": ADMIN_USER}


def test_token_file_is_relative_to_the_kubeconfig(
    server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf = tmp_path / "conf"
    (conf / "secrets").mkdir(parents=True)
    (conf / "secrets" / "token").write_text("from-file\n")
    monkeypatch.chdir(tmp_path)  # not the kubeconfig's dir
    cfg = kubeconfig(server, conf, {"tokenFile": "secrets/token"})
    with KubeClient.from_kubeconfig(cfg) as api:
        assert seen_by_server(api)["auth"] == "Bearer from-file"


def test_exec_plugin_token_is_the_header(server: Server, tmp_path: Path) -> None:
    plugin = exec_plugin(tmp_path, ["exec-1"], expires_in=dt.timedelta(hours=1))
    with KubeClient.from_kubeconfig(kubeconfig(server, tmp_path, plugin.user)) as api:
        assert seen_by_server(api)["auth"] == "Bearer exec-1"
        assert seen_by_server(api)["auth"] == "Bearer exec-1"
    assert plugin.runs == 1  # not once per request


@pytest.mark.parametrize(
    ("expires_in", "runs", "header"),
    [
        (dt.timedelta(minutes=1), 2, "Bearer exec-2"),  # within the loader's 5-min skew
        (dt.timedelta(hours=1), 1, "Bearer exec-1"),
    ],
)
def test_exec_plugin_runs_again_only_near_expiry(
    server: Server, tmp_path: Path, expires_in: dt.timedelta, runs: int, header: str
) -> None:
    plugin = exec_plugin(tmp_path, ["exec-1", "exec-2"], expires_in=expires_in)
    clock = FakeClock()
    cfg = kubeconfig(server, tmp_path, plugin.user)
    with KubeClient.from_kubeconfig(cfg, clock=clock) as api:
        assert seen_by_server(api)["auth"] == "Bearer exec-1"
        clock.now += REFRESH_S - 1
        assert seen_by_server(api)["auth"] == "Bearer exec-1"
        assert plugin.runs == 1  # not checked again before the interval
        clock.now += 1
        assert seen_by_server(api)["auth"] == header
    assert plugin.runs == runs


def test_failing_exec_plugin_names_the_user_and_its_error_output(tmp_path: Path) -> None:
    user = failing_exec_plugin(tmp_path, "sso session expired: run login")
    cfg = write_kubeconfig(tmp_path / "kubeconfig", "https://127.0.0.1:6443", user)
    with pytest.raises(KubeConfigError) as err:
        KubeClient.from_kubeconfig(cfg)
    message = str(err.value)
    assert str(cfg) in message and f"user {USER!r}" in message
    assert "sso session expired: run login" in message


def test_user_without_credentials_is_named(tmp_path: Path) -> None:
    cfg = write_kubeconfig(tmp_path / "kubeconfig", "https://127.0.0.1:6443", {})
    with pytest.raises(KubeConfigError, match=f"user {USER!r} has neither a token"):
        KubeClient.from_kubeconfig(cfg)


def test_plain_http_server_in_a_kubeconfig_is_rejected(tmp_path: Path) -> None:
    cfg = write_kubeconfig(tmp_path / "kubeconfig", "http://127.0.0.1:8080", {"token": "t"})
    with pytest.raises(KubeConfigError, match="must be https"):
        KubeClient.from_kubeconfig(cfg)


def test_unknown_context_is_a_config_error(tmp_path: Path) -> None:
    cfg = write_kubeconfig(tmp_path / "kubeconfig", "https://127.0.0.1:6443", {"token": "t"})
    cfg.write_text(cfg.read_text().replace("current-context: ctx", "current-context: gone"))
    with pytest.raises(KubeConfigError, match="context 'gone'"):
        KubeClient.from_kubeconfig(cfg)


# In cluster ---------------------------------------------------------------------------------


def test_in_cluster_token_is_read_again_after_the_refresh_interval(
    server: Server, tmp_path: Path
) -> None:
    sa = tmp_path / "sa"
    sa.mkdir()
    shutil.copy(server.pki.ca_cert, sa / "ca.crt")
    (sa / "token").write_text("sa-1\n")
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(server.port)}
    clock = FakeClock()
    with KubeClient.in_cluster(env, sa_dir=sa, clock=clock) as api:
        assert seen_by_server(api)["auth"] == "Bearer sa-1"
        (sa / "token").write_text("sa-2")  # the kubelet rotated it
        assert seen_by_server(api)["auth"] == "Bearer sa-1"
        clock.now += REFRESH_S
        with api.watch("/api/v1/pods") as watch:  # a watch opens with the current header
            assert [e["object"]["auth"] for e in watch] == ["Bearer sa-2"]
        assert seen_by_server(api)["auth"] == "Bearer sa-2"


# After a 401 --------------------------------------------------------------------------------


def _rotating_token_client(server: Server, tmp_path: Path) -> tuple[KubeClient, Path]:
    token = tmp_path / "token"
    token.write_text("old")
    api = KubeClient.from_kubeconfig(kubeconfig(server, tmp_path, {"tokenFile": str(token)}))
    return api, token


def test_a_401_reloads_the_credentials_and_retries_once(server: Server, tmp_path: Path) -> None:
    api, token = _rotating_token_client(server, tmp_path)
    with api:
        server.refused.add("Bearer old")
        token.write_text("new")
        assert seen_by_server(api)["auth"] == "Bearer new"
    assert server.seen == ["Bearer old", "Bearer new"]


def test_a_watch_refused_with_401_reopens_with_reloaded_credentials(
    server: Server, tmp_path: Path
) -> None:
    api, token = _rotating_token_client(server, tmp_path)
    with api:
        server.refused.add("Bearer old")
        token.write_text("new")
        with api.watch("/api/v1/pods") as watch:
            assert [e["object"]["auth"] for e in watch] == ["Bearer new"]
    assert server.seen == ["Bearer old", "Bearer new"]


def test_a_401_after_the_reload_is_the_error(server: Server, tmp_path: Path) -> None:
    api, _ = _rotating_token_client(server, tmp_path)
    server.refused.add("Bearer old")
    with api, pytest.raises(ApiError) as err:
        api.get("/api")
    assert err.value.status == 401
    assert server.seen == ["Bearer old", "Bearer old"]  # one retry, no more


def test_a_static_token_is_not_retried(server: Server) -> None:
    server.refused.add("Bearer fixed")
    with KubeClient(server.url, "fixed", server.pki.ca_cert) as api, pytest.raises(ApiError):
        api.get("/api")
    assert server.seen == ["Bearer fixed"]


# Credentials --------------------------------------------------------------------------------


def test_due_renewal_runs_once_for_concurrent_requests() -> None:
    calls: list[int] = []

    def renew() -> str:
        calls.append(1)
        return f"Bearer t{len(calls)}"

    clock = FakeClock()
    creds = Credentials("Bearer t0", renew=renew, reload=renew, clock=clock)
    clock.now += REFRESH_S
    with ThreadPoolExecutor(8) as pool:
        headers = list(pool.map(lambda _: creds.header(), range(32)))
    assert len(calls) == 1
    assert set(headers) == {"Bearer t1"}


def test_requests_refused_together_reload_once() -> None:
    calls: list[int] = []

    def reload() -> str:
        calls.append(1)
        return "Bearer new"

    creds = Credentials("Bearer old", renew=reload, reload=reload, clock=FakeClock())
    assert creds.unauthorized("Bearer old")
    assert creds.unauthorized("Bearer old")  # a second request that used the old one
    assert len(calls) == 1
    assert creds.header() == "Bearer new"


def test_a_failed_renewal_keeps_the_header() -> None:
    def broken() -> str:
        raise KubeConfigError("plugin gone")

    clock = FakeClock()
    creds = Credentials("Bearer kept", renew=broken, reload=broken, clock=clock)
    clock.now += REFRESH_S
    assert creds.header() == "Bearer kept"
    assert creds.unauthorized("Bearer kept")
    assert creds.header() == "Bearer kept"


def test_importing_the_client_does_not_load_the_kubernetes_package() -> None:
    code = "import sys, api.kube; sys.exit('kubernetes' in sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
