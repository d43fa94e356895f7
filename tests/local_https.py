"""A loopback HTTPS server with a throwaway CA, for tests of Kubernetes API clients."""

from __future__ import annotations

import contextlib
import http.server
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

from scheduler_plugins.webhook.certs import ensure_serving_pki


@contextlib.contextmanager
def serve_https(
    directory: Path, handler: type[http.server.BaseHTTPRequestHandler]
) -> Iterator[tuple[str, Path]]:
    """Serve ``handler`` on 127.0.0.1 (a thread per connection): its URL and the CA file a
    client verifies it with (made under ``directory``)."""
    pki = ensure_serving_pki(directory / "pki", ["127.0.0.1"])
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(pki.cert), str(pki.key))
    httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"https://127.0.0.1:{httpd.server_address[1]}", pki.ca_cert
    finally:
        httpd.shutdown()
        httpd.server_close()
