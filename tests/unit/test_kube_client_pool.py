"""KubeClient's keep-alive connections: shared by threads, reused, and replaced when the server
has closed them (an apiserver restart, an idle timeout)."""

from __future__ import annotations

import contextlib
import http.server
import json
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from api.kube.client import MAX_IDLE_CONNECTIONS, KubeClient
from tests.local_https import serve_https


@dataclass
class Server:
    url: str
    ca: Path
    connections: list[socket.socket] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    hold: threading.Event = field(default_factory=threading.Event)  # set: answers wait

    def close_all(self) -> None:
        """What a restarted apiserver does to every open connection."""
        with self.lock:
            for s in self.connections:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    box: dict[str, Server] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive

        def setup(self) -> None:
            super().setup()
            with box["s"].lock:
                box["s"].connections.append(self.connection)

        def do_GET(self) -> None:
            while box["s"].hold.is_set():
                threading.Event().wait(0.01)
            body = json.dumps({"path": self.path}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    with serve_https(tmp_path, Handler) as (url, ca):
        box["s"] = Server(url, ca)
        yield box["s"]


def test_sequential_requests_reuse_one_connection(server: Server) -> None:
    with KubeClient(server.url, "t", server.ca) as api:
        for i in range(5):
            assert api.get(f"/x/{i}") == {"path": f"/x/{i}"}
    assert len(server.connections) == 1


def test_threads_share_a_bounded_set_of_connections(server: Server) -> None:
    with KubeClient(server.url, "t", server.ca) as api:
        server.hold.set()  # every request is in flight at once: one connection each
        with ThreadPoolExecutor(12) as pool:
            calls = [pool.submit(api.get, f"/c/{i}") for i in range(12)]
            threading.Event().wait(0.3)
            server.hold.clear()
            assert [c.result() for c in calls] == [{"path": f"/c/{i}"} for i in range(12)]
        opened = len(server.connections)
        assert opened <= 12
        # Afterwards new threads reuse idle ones instead of each opening its own.
        with ThreadPoolExecutor(4) as pool:
            for _ in range(3):
                list(pool.map(lambda i: api.get(f"/again/{i}"), range(4)))
        assert len(server.connections) == opened
        assert len(api._idle) <= MAX_IDLE_CONNECTIONS


def test_connections_the_server_closed_are_replaced(server: Server) -> None:
    with KubeClient(server.url, "t", server.ca) as api:
        with ThreadPoolExecutor(4) as pool:
            server.hold.set()
            calls = [pool.submit(api.get, f"/w/{i}") for i in range(4)]
            threading.Event().wait(0.2)
            server.hold.clear()
            [c.result() for c in calls]
        assert len(api._idle) >= 2  # several idle connections, all about to go stale
        server.close_all()
        assert api.get("/after") == {"path": "/after"}  # one retry, on a fresh connection
        assert api._idle and len(api._idle) == 1
