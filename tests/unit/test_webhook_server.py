"""The webhook's HTTPS adapter over real TLS sockets on loopback."""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from scheduler_plugins.webhook.app import WebhookApp
from scheduler_plugins.webhook.certs import ServingPki, ensure_serving_pki
from scheduler_plugins.webhook.errors import WebhookSetupError
from scheduler_plugins.webhook.review import Answer
from scheduler_plugins.webhook.rules import Settings
from scheduler_plugins.webhook.server import (
    WebhookServer,
    parse_listen,
    server_ssl_context,
)
from tests.builders import make_pod
from tests.unit.test_webhook_review import review


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> ServingPki:
    return ensure_serving_pki(tmp_path_factory.mktemp("pki"), ["localhost", "127.0.0.1"])


@pytest.fixture
def app(pki: ServingPki) -> Iterator[WebhookApp]:
    threads = set(threading.enumerate())
    webhook = WebhookApp(
        Settings(), server_ssl_context(str(pki.cert), str(pki.key)), host="127.0.0.1", port=0
    )
    with webhook:
        yield webhook
    assert set(threading.enumerate()) <= threads, "the server left threads behind"


def client(
    pki: ServingPki, app: WebhookApp, host: str = "localhost"
) -> http.client.HTTPSConnection:
    ctx = ssl.create_default_context(cafile=str(pki.ca_cert))
    return http.client.HTTPSConnection(host, app.server.address[1], context=ctx, timeout=5)


def post(
    conn: http.client.HTTPSConnection, body: bytes, path: str = "/mutate"
) -> tuple[int, dict[str, Any]]:
    conn.request("POST", path, body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read())


def test_review_round_trip_on_a_kept_alive_connection(pki: ServingPki, app: WebhookApp) -> None:
    conn = client(pki, app)
    doc = review(make_pod("p").gpu(None, mem=100).build())
    for _ in range(2):
        status, out = post(conn, json.dumps(doc).encode())
        assert status == 200
        assert out["response"]["uid"] == doc["request"]["uid"]
        assert out["response"]["patchType"] == "JSONPatch"
    conn.close()


def test_ip_san_verifies_too(pki: ServingPki, app: WebhookApp) -> None:
    conn = client(pki, app, host="127.0.0.1")
    conn.request("GET", "/healthz")
    assert conn.getresponse().read() == b"ok\n"
    conn.close()


def test_malformed_body_is_400_and_the_connection_still_serves(
    pki: ServingPki, app: WebhookApp
) -> None:
    conn = client(pki, app)
    status, out = post(conn, b"\x00garbage")
    assert status == 400 and "not JSON" in out["message"]
    status, _ = post(conn, json.dumps(review()).encode())
    assert status == 200
    conn.close()


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/healthz", 200),
        ("GET", "/readyz", 200),
        ("GET", "/mutate", 404),
        ("POST", "/other", 404),
        ("PUT", "/mutate", 501),
    ],
)
def test_routes(pki: ServingPki, app: WebhookApp, method: str, path: str, status: int) -> None:
    conn = client(pki, app)
    conn.request(method, path, b"{}" if method != "GET" else None)
    assert conn.getresponse().status == status
    conn.close()


def _raw_tls(pki: ServingPki, app: WebhookApp) -> ssl.SSLSocket:
    ctx = ssl.create_default_context(cafile=str(pki.ca_cert))
    sock = socket.create_connection(("127.0.0.1", app.server.address[1]), timeout=5)
    return ctx.wrap_socket(sock, server_hostname="localhost")


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ("Transfer-Encoding: chunked\r\n", 411),
        ("Content-Length: 99999999999\r\n", 413),
        ("Content-Length: -1\r\n", 411),
    ],
)
def test_body_length_limits(pki: ServingPki, app: WebhookApp, headers: str, status: int) -> None:
    with _raw_tls(pki, app) as s:
        s.sendall(f"POST /mutate HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode())
        head = s.recv(4096).decode()
    assert head.startswith(f"HTTP/1.1 {status} ")
    assert "Connection: close" in head


def test_plain_http_and_silence_do_not_hurt_the_server(pki: ServingPki) -> None:
    threads = set(threading.enumerate())
    app = WebhookApp(
        Settings(), server_ssl_context(str(pki.cert), str(pki.key)), host="127.0.0.1", port=0
    )
    app.start()
    port = app.server.address[1]
    with socket.create_connection(("127.0.0.1", port), timeout=5) as plain:
        plain.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert not plain.recv(100).startswith(b"HTTP")  # the TLS handshake failed: closed
    with socket.create_connection(("127.0.0.1", port), timeout=5):  # never says hello
        conn = client(pki, app)
        conn.request("GET", "/healthz")
        assert conn.getresponse().status == 200
        conn.close()
        t0 = time.monotonic()
        app.stop()  # closes the silent connection instead of waiting out its timeout
        assert time.monotonic() - t0 < 3
    assert set(threading.enumerate()) <= threads


def test_handler_exception_is_500(pki: ServingPki) -> None:
    def broken(body: bytes) -> Answer:
        raise RuntimeError("bug")

    server = WebhookServer(broken, server_ssl_context(str(pki.cert), str(pki.key)), port=0)
    with server:
        conn = http.client.HTTPSConnection(
            "localhost",
            server.address[1],
            context=ssl.create_default_context(cafile=str(pki.ca_cert)),
            timeout=5,
        )
        status, out = post(conn, b"{}")
        conn.close()
    assert status == 500 and "bug" in out["message"]


def test_readyz_waits_for_the_node_list(pki: ServingPki) -> None:
    class NoKube:
        def list(self, path: str) -> dict[str, Any]:
            raise AssertionError("not started")

        def watch(self, *a: object, **k: object) -> object:
            raise AssertionError("not started")

    app = WebhookApp(
        Settings(),
        server_ssl_context(str(pki.cert), str(pki.key)),
        host="127.0.0.1",
        port=0,
        kube=NoKube(),
    )
    try:
        assert not app.ready()
        app.nodes.replace([])
        assert app.ready()
    finally:
        app.stop()  # never started: only closes the listening socket


@pytest.mark.parametrize(
    ("address", "parsed"),
    [
        ("127.0.0.1:9443", ("127.0.0.1", 9443)),
        ("[::1]:0", ("::1", 0)),
        ("0.0.0.0:1", ("0.0.0.0", 1)),
    ],
)
def test_parse_listen(address: str, parsed: tuple[str, int]) -> None:
    assert parse_listen(address) == parsed


@pytest.mark.parametrize("address", ["9443", ":9443", "host:", "host:http", "h:70000"])
def test_parse_listen_refuses(address: str) -> None:
    with pytest.raises(WebhookSetupError, match="HOST:PORT"):
        parse_listen(address)


def test_setup_errors_name_the_file_and_address(pki: ServingPki, tmp_path: Path) -> None:
    with pytest.raises(WebhookSetupError, match="cannot load TLS certificate"):
        server_ssl_context(str(tmp_path / "none.crt"), str(pki.key))
    ctx = server_ssl_context(str(pki.cert), str(pki.key))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(WebhookSetupError, match=r"cannot listen on 127\.0\.0\.1"):
            WebhookServer(lambda b: Answer(200, {}), ctx, "127.0.0.1", taken.getsockname()[1])
