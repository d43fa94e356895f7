"""The webhook's HTTPS server: TLS only, ``POST /mutate``, ``GET /healthz`` and ``/readyz``.

A thin adapter: it reads the body and hands it to a function (``review.answer`` bound to
the current cluster facts), then writes what that returns. One thread per connection; the
TLS handshake runs in that thread, so a slow client holds up nobody else. Connections are
kept alive (the apiserver reuses them) and closed when idle or on ``stop()``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import ssl
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Final
from urllib.parse import urlsplit

import structlog

from scheduler_plugins.webhook.errors import WebhookSetupError
from scheduler_plugins.webhook.review import Answer, bad_request

log = structlog.get_logger("tessera.webhook.server")

IDLE_TIMEOUT_S: Final = 30.0
MAX_BODY: Final = 8 * 1024 * 1024  # etcd's object limit is 1.5 MiB; reviews carry two objects
Handle = Callable[[bytes], Answer]


def parse_listen(address: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT``; port 0 lets the OS pick one."""
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise WebhookSetupError(
            f"--listen must be HOST:PORT (e.g. 127.0.0.1:9443), got {address!r}"
        )
    return host, int(port)


def server_ssl_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as e:
        raise WebhookSetupError(
            f"cannot load TLS certificate {cert_file} / key {key_file}: {e}"
        ) from e
    return ctx


class _Server(ThreadingHTTPServer):
    daemon_threads = False  # socketserver joins only non-daemon threads at server_close

    def __init__(self, address: tuple[str, int], family: socket.AddressFamily) -> None:
        self.address_family = family
        self.open: set[socket.socket] = set()
        self.open_lock = threading.Lock()
        self.handle_body: Handle = lambda body: Answer(500, {})
        self.ready: Callable[[], bool] = lambda: True
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.open_lock:
            self.open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self.open_lock:
            self.open.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A failed handshake (plain HTTP, untrusted client cert, port scan) or a dropped
        # connection: one line, no traceback on stderr.
        err = sys.exc_info()[1]
        log.info("connection.failed", client=str(client_address), error=repr(err))

    def close_connections(self) -> None:
        with self.open_lock:
            conns = list(self.open)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = IDLE_TIMEOUT_S  # idle keep-alive connections close after this
    server: _Server

    def setup(self) -> None:
        conn = self.request
        conn.settimeout(self.timeout)  # the handshake too: a silent client must not hang here
        # Headers and body go out in two writes; without this, Nagle's algorithm holds the
        # body until the client's delayed ACK (~40 ms per review).
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if isinstance(conn, ssl.SSLSocket):
            conn.do_handshake()
        super().setup()

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        if path == "/healthz":
            self._send(200, b"ok\n", "text/plain")
        elif path == "/readyz":
            ready = self.server.ready()
            self._send(200 if ready else 503, b"ok\n" if ready else b"not ready\n", "text/plain")
        else:
            self._send(404, b"not found: GET /healthz, GET /readyz, POST /mutate\n", "text/plain")

    def do_POST(self) -> None:
        if urlsplit(self.path).path != "/mutate":
            self._send(404, b"not found: POST /mutate\n", "text/plain")
            return
        length_raw = self.headers.get("Content-Length")
        if length_raw is None or not length_raw.strip().isdigit():
            self.close_connection = True
            self._json(Answer(411, bad_request("a Content-Length header is required")))
            return
        length = int(length_raw)
        if length > MAX_BODY:
            self.close_connection = True
            self._json(Answer(413, bad_request(f"body of {length} bytes is over {MAX_BODY}")))
            return
        body = self.rfile.read(length)
        if len(body) != length:
            self.close_connection = True
            return
        try:
            answer = self.server.handle_body(body)
        except Exception as e:  # the core is pure and fuzzed; this is the last line of defence
            log.exception("admission.failed", error=repr(e))
            answer = Answer(500, {"kind": "Status", "code": 500, "message": f"internal: {e!r}"})
        if answer.status == 400:
            log.warning("admission.malformed", client=self.client_address[0], **answer.fields)
        elif answer.fields:
            log.info("admission", **answer.fields)
        self._json(answer)

    def _json(self, answer: Answer) -> None:
        self._send(answer.status, answer.payload(), "application/json")

    def _send(self, status: int, data: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("http", client=self.client_address[0], message=format % args)

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        pass  # each review is logged with its pod instead


class WebhookServer:
    """Serve ``handle`` over TLS on ``host:port`` until ``stop()``."""

    def __init__(
        self,
        handle: Handle,
        ssl_context: ssl.SSLContext,
        host: str = "127.0.0.1",
        port: int = 9443,
        *,
        ready: Callable[[], bool] = lambda: True,
    ) -> None:
        family = socket.AF_INET
        with contextlib.suppress(ValueError):
            if ipaddress.ip_address(host).version == 6:
                family = socket.AF_INET6
        try:
            self._server = _Server((host, port), family)
        except OSError as e:
            raise WebhookSetupError(f"cannot listen on {host}:{port}: {e.strerror}") from e
        self._server.handle_body = handle
        self._server.ready = ready
        self._server.socket = ssl_context.wrap_socket(
            self._server.socket, server_side=True, do_handshake_on_connect=False
        )
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def url(self, path: str = "/mutate") -> str:
        host, port = self.address
        return f"https://{f'[{host}]' if ':' in host else host}:{port}{path}"

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.1},  # how long stop() waits for the accept loop
            name="webhook-https",
            daemon=True,
        )
        self._thread.start()
        log.info("listening", url=self.url())

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
            self._thread = None
        self._server.close_connections()
        self._server.server_close()  # joins the connection threads
        log.info("stopped")

    def __enter__(self) -> WebhookServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
