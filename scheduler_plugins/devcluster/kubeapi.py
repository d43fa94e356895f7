"""A minimal kube-apiserver HTTP client for the dev cluster (bearer token, CA-verified TLS).

Only the few calls the dev cluster and its tests need; thread-safe (one keep-alive
connection per thread) so node creation can fan out over a thread pool.
"""

from __future__ import annotations

import http.client
import json
import ssl
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlencode, urlsplit

import yaml

from scheduler_plugins.devcluster.errors import ApiError, ClusterError, ConflictError, NotFoundError

JSON: Final = "application/json"
MERGE_PATCH: Final = "application/merge-patch+json"
APPLY_PATCH: Final = "application/apply-patch+yaml"
TABLE: Final = "application/json;as=Table;v=v1;g=meta.k8s.io"
FIELD_MANAGER: Final = "tessera-devcluster"

_ERRORS: Final[Mapping[int, type[ApiError]]] = {404: NotFoundError, 409: ConflictError}


class KubeApi:
    """``server`` like ``https://127.0.0.1:6443``; ``ca_file`` verifies its serving cert."""

    def __init__(self, server: str, token: str, ca_file: Path, *, timeout_s: float = 30.0) -> None:
        url = urlsplit(server)
        if url.scheme != "https" or not url.hostname:
            raise ClusterError(f"apiserver URL must be https://HOST:PORT, got {server!r}")
        self.server = server
        self._host = url.hostname
        self._port = url.port or 443
        self._token = token
        self._timeout_s = timeout_s
        try:
            self._ssl = ssl.create_default_context(cafile=str(ca_file))
        except (OSError, ssl.SSLError) as e:
            raise ClusterError(f"cannot load CA {ca_file}: {e}") from e
        self._local = threading.local()
        self._lock = threading.Lock()
        self._conns: list[http.client.HTTPSConnection] = []

    @classmethod
    def from_kubeconfig(cls, path: Path) -> KubeApi:
        """From a kubeconfig written by the dev cluster (token + CA file)."""
        try:
            cfg = yaml.safe_load(path.read_text())
            ctx_name = cfg["current-context"]
            ctx = next(c["context"] for c in cfg["contexts"] if c["name"] == ctx_name)
            cluster = next(c["cluster"] for c in cfg["clusters"] if c["name"] == ctx["cluster"])
            user = next(u["user"] for u in cfg["users"] if u["name"] == ctx["user"])
            return cls(cluster["server"], user["token"], Path(cluster["certificate-authority"]))
        except (OSError, yaml.YAMLError, KeyError, TypeError, StopIteration) as e:
            raise ClusterError(
                f"cannot use kubeconfig {path} ({e!r}): it must be one written by "
                "`tessera cluster up` (token user, certificate-authority file)"
            ) from e

    # ------------------------------------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        body: object | None = None,
        *,
        query: Mapping[str, str] | None = None,
        content_type: str = JSON,
        accept: str = JSON,
    ) -> Any:
        """Send one request; returns the decoded JSON answer (or None for an empty body)."""
        full = path + ("?" + urlencode(query) if query else "")
        headers = {"Authorization": f"Bearer {self._token}", "Accept": accept}
        payload: bytes | None = None
        if body is not None:
            payload = json.dumps(body, separators=(",", ":")).encode()
            headers["Content-Type"] = content_type
        status, data = self._send(method, full, payload, headers)
        text = data.decode(errors="replace")
        if status >= 400:
            reason, message = str(status), text.strip()[:500]
            try:
                st = json.loads(text)
                reason, message = str(st.get("reason", reason)), str(st.get("message", message))
            except ValueError:
                pass
            raise _ERRORS.get(status, ApiError)(method, path, status, reason, message)
        if not data:
            return None
        try:
            return json.loads(text)
        except ValueError as e:
            raise ClusterError(f"{method} {path}: answer is not JSON: {text[:200]!r}") from e

    def get(self, path: str, *, query: Mapping[str, str] | None = None) -> Any:
        return self.request("GET", path, query=query)

    def table(self, path: str, *, query: Mapping[str, str] | None = None) -> list[dict[str, str]]:
        """A list as the server-side table ``kubectl get`` shows: one {column: cell} per row.

        Much lighter than the full objects (no annotations), so cheap to poll.
        """
        answer = self.request(
            "GET", path, query={**(query or {}), "includeObject": "None"}, accept=TABLE
        )
        columns = [str(c["name"]) for c in answer.get("columnDefinitions", [])]
        return [
            dict(zip(columns, (str(c) for c in row.get("cells", [])), strict=False))
            for row in answer.get("rows", [])
        ]

    def post(self, path: str, body: object) -> Any:
        return self.request("POST", path, body)

    def delete(self, path: str) -> Any:
        return self.request("DELETE", path)

    def merge_patch(self, path: str, patch: object) -> Any:
        return self.request("PATCH", path, patch, content_type=MERGE_PATCH)

    def apply(self, path: str, obj: object) -> Any:
        """Server-side apply (idempotent create-or-update) of ``obj`` at its own ``path``."""
        return self.request(
            "PATCH",
            path,
            obj,
            query={"fieldManager": FIELD_MANAGER, "force": "true"},
            content_type=APPLY_PATCH,
        )

    def probe(self, path: str) -> tuple[int, str]:
        """(status, body) of a GET, for health endpoints; never raises on HTTP errors."""
        status, data = self._send(
            "GET", path, None, {"Authorization": f"Bearer {self._token}"}, retry=False
        )
        return status, data.decode(errors="replace")

    def close(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            c.close()

    def __enter__(self) -> KubeApi:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------

    def _conn(self) -> http.client.HTTPSConnection:
        conn: http.client.HTTPSConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = http.client.HTTPSConnection(
                self._host, self._port, timeout=self._timeout_s, context=self._ssl
            )
            self._local.conn = conn
            with self._lock:
                self._conns.append(conn)
        return conn

    def _send(
        self,
        method: str,
        path: str,
        payload: bytes | None,
        headers: dict[str, str],
        *,
        retry: bool = True,
    ) -> tuple[int, bytes]:
        # One retry on a fresh connection: the server may have closed an idle keep-alive one.
        for attempt in (0, 1):
            conn = self._conn()
            try:
                conn.request(method, path, body=payload, headers=headers)
                resp = conn.getresponse()
                return resp.status, resp.read()
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                if attempt == 1 or not retry or isinstance(e, ssl.SSLCertVerificationError):
                    raise ClusterError(
                        f"{method} {self.server}{path} failed: {e!r}; is the cluster up? "
                        "(`tessera cluster status`)"
                    ) from e
        raise AssertionError("unreachable")
