"""The one Kubernetes API client: raw JSON over HTTPS, no model deserialization.

Owns the wire and where its credentials come from. Credentials are what kubectl would use:
a kubeconfig's current context or the pod's service account, read by the official
``kubernetes`` package's loaders (tokens, tokenFile, client certificates as files or inline
data, exec plugins, auth providers). KubeClient keeps only what they yield: the server URL,
one TLS context (CA, client certificate, insecure flag) and the Authorization header, which
it re-checks at most every ``REFRESH_S`` (an exec plugin runs again only near its token's
expiry; a service-account token file is re-read) and reloads once when the apiserver
answers 401. Loader failures, including the ones the loaders only log (an exec plugin's
error output), become ``KubeConfigError`` naming the kubeconfig, context and user.

The wire: CA-verified TLS, error mapping to ``api.kube.errors``, list with field/label
selectors, watch streams and merge patches with an optional resourceVersion precondition.
Thread-safe: keep-alive connections shared by all threads for ordinary calls (``wire``'s,
a fraction of the stdlib client's CPU per call), one dedicated connection per watch.
"""

from __future__ import annotations

import builtins
import contextlib
import copy
import http.client
import json
import logging
import os
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlencode, urlsplit

import orjson
import structlog
import yaml

from api.kube.errors import (
    ApiError,
    ConflictError,
    GoneError,
    InvalidResponseError,
    KubeConfigError,
    NotFoundError,
    ServerError,
    UnreachableError,
)
from api.kube.wire import Connection

JSON: Final = "application/json"
MERGE_PATCH: Final = "application/merge-patch+json"
APPLY_PATCH: Final = "application/apply-patch+yaml"
TABLE: Final = "application/json;as=Table;v=v1;g=meta.k8s.io"
FIELD_MANAGER: Final = "tessera"
MAX_IDLE_CONNECTIONS: Final = 64  # kept open between requests, shared by all threads

SERVICE_ACCOUNT_DIR: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# How stale a loaded Authorization header may get before the loader is asked again (cheap:
# an exec plugin runs again only near its token's expiry).
REFRESH_S: Final = 30.0
# Each component names itself (``tessera-plugin-server``, ``tessera-node-agent``, ...): the
# apiserver's audit log tells clients apart by it.
DEFAULT_USER_AGENT: Final = "tessera"

log = structlog.get_logger("tessera.kube.client")

_ERRORS: Final[Mapping[int, type[ApiError]]] = {
    404: NotFoundError,
    409: ConflictError,
    410: GoneError,
    429: ServerError,
}

Obj = dict[str, Any]
Clock = Callable[[], float]
Renewal = Callable[[], str | None]  # loads again; the Authorization header it yields


def _error_for(method: str, path: str, status: int, text: str) -> ApiError:
    reason, message = str(status), text.strip()[:500]
    try:
        st = json.loads(text)
        reason, message = str(st.get("reason", reason)), str(st.get("message", message))
    except (ValueError, AttributeError):
        pass
    cls = _ERRORS.get(status) or (ServerError if status >= 500 else ApiError)
    return cls(method, path, status, reason, message)


class Credentials:
    """A client's Authorization header and how it is kept current.

    ``renew`` (the loader's own check: cheap unless the token is near expiry) runs at most
    every ``refresh_s`` of ``clock``; ``reload`` (loading from scratch: an exec plugin runs
    again, a token file is read again) runs when the apiserver refused the header. Without
    them the header is static. A failed renewal keeps the old header and logs why: the
    apiserver's answer to it then tells the caller.
    """

    def __init__(
        self,
        header: str | None,
        *,
        renew: Renewal | None = None,
        reload: Renewal | None = None,
        refresh_s: float = REFRESH_S,
        clock: Clock = time.monotonic,
    ) -> None:
        self._header = header
        self._renew = renew
        self._reload = reload
        self._refresh_s = refresh_s
        self._clock = clock
        self._due = clock() + refresh_s
        self._lock = threading.Lock()  # one renewal at a time: the loaders are not thread-safe

    @classmethod
    def static(cls, token: str | None) -> Credentials:
        return cls(f"Bearer {token}" if token else None)

    def header(self) -> str | None:
        """The header for a request about to be sent; renewed first when due."""
        # Every request comes here: one clock read, no lock, no loader until due.
        if self._renew is None or self._clock() < self._due:
            return self._header
        with self._lock:
            if self._clock() >= self._due:  # no other thread renewed it while we waited
                self._header = self._attempt(self._renew)
                self._due = self._clock() + self._refresh_s
            return self._header

    def unauthorized(self, used: str | None) -> bool:
        """The apiserver answered 401 to ``used``: reload; whether one retry may help."""
        if self._reload is None:
            return False
        with self._lock:
            # Requests refused together reload once: the later ones find a new header.
            if self._header == used:
                self._header = self._attempt(self._reload)
                self._due = self._clock() + self._refresh_s
        return True

    def _attempt(self, renewal: Renewal) -> str | None:
        try:
            return renewal() or self._header
        except KubeConfigError as e:
            log.warning("kube.credentials_not_renewed", error=str(e))
            return self._header


class KubeClient:
    """``server`` like ``https://127.0.0.1:6443``; ``ca_file``/``ca_data`` verify its cert."""

    def __init__(
        self,
        server: str,
        token: str | None = None,
        ca_file: Path | None = None,
        *,
        ca_data: str | None = None,
        client_cert: tuple[Path, Path] | None = None,
        insecure: bool = False,
        timeout_s: float = 30.0,
        credentials: Credentials | None = None,
        user_agent: str = DEFAULT_USER_AGENT,
    ) -> None:
        """``token``: a static one; ``credentials`` (from the loaders) replace it.
        ``user_agent``: the component, as the apiserver's audit log and metrics name it."""
        self.server = server
        self._user_agent = user_agent
        self._host, self._port = _https_host_port(server)
        self._auth = credentials if credentials is not None else Credentials.static(token)
        self._timeout_s = timeout_s
        try:
            if insecure:
                self._ssl = ssl.create_default_context()
                self._ssl.check_hostname = False
                self._ssl.verify_mode = ssl.CERT_NONE
            else:
                self._ssl = ssl.create_default_context(
                    cafile=str(ca_file) if ca_file else None, cadata=ca_data
                )
            if client_cert is not None:
                self._ssl.load_cert_chain(str(client_cert[0]), str(client_cert[1]))
        except (OSError, ssl.SSLError) as e:
            where = ca_file or "inline CA"
            raise KubeConfigError(f"cannot load TLS material ({where}): {e}") from e
        # Keep-alive connections shared by all threads: a request takes an idle one (or
        # opens one) and gives it back, so handshakes follow concurrency, not thread count.
        self._lock = threading.Lock()
        self._idle: list[Connection] = []
        self._conns: set[Connection] = set()  # every open one, for close()

    # Construction --------------------------------------------------------------------------

    @classmethod
    def from_kubeconfig(
        cls,
        path: Path,
        *,
        timeout_s: float = 30.0,
        refresh_s: float = REFRESH_S,
        clock: Clock = time.monotonic,
        user_agent: str = DEFAULT_USER_AGENT,
    ) -> KubeClient:
        """From a kubeconfig's current context, with the credentials kubectl would use there."""
        from kubernetes.client import Configuration
        from kubernetes.config.kube_config import KubeConfigLoader

        doc = _kubeconfig_doc(path)
        context, user = _context_and_user(doc)
        where = f"kubeconfig {path} (context {context!r}, user {user!r})"
        config = Configuration()
        with _loading(where) as logged:
            # Paths in it (tokenFile, certificates, an exec command) are relative to the
            # kubeconfig, as for kubectl.
            loader = KubeConfigLoader(doc, config_base_path=str(path.absolute().parent))
            loader.load_and_set(config)
        server = str(getattr(loader, "host", ""))  # unset when the cluster names no server
        try:
            _https_host_port(server)
        except KubeConfigError as e:
            raise KubeConfigError(f"{where}: {e}") from e
        header = _header_of(config)
        if header is None and not config.cert_file:
            raise KubeConfigError(
                f"{where}: user {user!r} has neither a token nor a client certificate"
                + _logged_cause(logged)
            )
        if logged:
            log.warning("kube.kubeconfig_loader_warned", where=where, messages=logged)
        # A client certificate only: nothing to renew (one an exec plugin printed is used
        # until the process restarts: the TLS context is made once).
        credentials = Credentials(header)
        if header is not None:
            credentials = Credentials(
                header,
                renew=_renewal(where, lambda: _run_refresh_hook(config), config),
                reload=_renewal(where, lambda: loader.load_and_set(config), config),
                refresh_s=refresh_s,
                clock=clock,
            )
        return cls._configured(server, config, credentials, where, timeout_s, user_agent)

    @classmethod
    def in_cluster(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        sa_dir: Path = SERVICE_ACCOUNT_DIR,
        timeout_s: float = 30.0,
        refresh_s: float = REFRESH_S,
        clock: Clock = time.monotonic,
        user_agent: str = DEFAULT_USER_AGENT,
    ) -> KubeClient:
        """From the pod's service account (KUBERNETES_SERVICE_HOST/PORT + mounted token, CA).

        The token file is read again every ``refresh_s``: the kubelet rotates projected tokens.
        """
        from kubernetes.client import Configuration
        from kubernetes.config.incluster_config import InClusterConfigLoader

        env = os.environ if env is None else env
        host = env.get("KUBERNETES_SERVICE_HOST", "")
        if not host:
            raise KubeConfigError(
                "not running in a cluster: KUBERNETES_SERVICE_HOST is unset (pass --kubeconfig)"
            )
        where = f"service account token and CA in {sa_dir}"
        loader = InClusterConfigLoader(
            token_filename=str(sa_dir / "token"),
            cert_filename=str(sa_dir / "ca.crt"),
            # Its hook re-reads the token by the wall clock once a minute; reloading on
            # Credentials' schedule instead is one small file read, and keeps one clock.
            try_refresh_token=False,
            environ={
                "KUBERNETES_SERVICE_HOST": host,
                "KUBERNETES_SERVICE_PORT": env.get("KUBERNETES_SERVICE_PORT") or "443",
            },
        )
        config = Configuration()
        with _loading(where):
            loader.load_and_set(config)
        reload = _renewal(where, lambda: loader.load_and_set(config), config)
        credentials = Credentials(
            _header_of(config), renew=reload, reload=reload, refresh_s=refresh_s, clock=clock
        )
        return cls._configured(str(config.host), config, credentials, where, timeout_s, user_agent)

    @classmethod
    def _configured(
        cls,
        server: str,
        config: Any,
        credentials: Credentials,
        where: str,
        timeout_s: float,
        user_agent: str,
    ) -> KubeClient:
        """A client with the TLS material a loaded ``kubernetes.client.Configuration`` names
        (inline data the loader wrote to temp files)."""
        cert = None
        if config.cert_file and config.key_file:
            cert = (Path(config.cert_file), Path(config.key_file))
        try:
            return cls(
                server,
                None,
                Path(config.ssl_ca_cert) if config.ssl_ca_cert else None,
                client_cert=cert,
                insecure=not config.verify_ssl,
                timeout_s=timeout_s,
                credentials=credentials,
                user_agent=user_agent,
            )
        except KubeConfigError as e:
            raise KubeConfigError(f"{where}: {e}") from e

    # Calls ---------------------------------------------------------------------------------

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
        headers = self._headers(accept)
        payload: bytes | None = None
        if body is not None:
            payload = orjson.dumps(body)  # compact; a tenth of the stdlib's time
            headers["Content-Type"] = content_type
        status, data = self._send_authorized(method, full, payload, headers)
        if status >= 400:
            raise _error_for(method, path, status, data.decode(errors="replace"))
        if not data:
            return None
        try:
            return orjson.loads(data)  # a third of the stdlib's time on pod lists
        except orjson.JSONDecodeError as e:
            text = data[:200].decode(errors="replace")
            raise InvalidResponseError(f"{method} {path}: answer is not JSON: {text!r}") from e

    def get(self, path: str, *, query: Mapping[str, str] | None = None) -> Any:
        return self.request("GET", path, query=query)

    def list(
        self,
        path: str,
        *,
        field_selector: str | None = None,
        label_selector: str | None = None,
        resource_version: str | None = None,
        limit: int | None = None,
    ) -> Obj:
        """A collection as the raw list object (``items``, ``metadata.resourceVersion``).

        Follows ``continue`` tokens when ``limit`` pages it, so ``items`` is always complete.
        """
        query: dict[str, str] = {}
        if field_selector:
            query["fieldSelector"] = field_selector
        if label_selector:
            query["labelSelector"] = label_selector
        if resource_version is not None:
            query["resourceVersion"] = resource_version
        if limit is not None:
            query["limit"] = str(limit)
        first: Obj = self.get(path, query=query)
        items: builtins.list[Obj] = [*(first.get("items") or [])]
        token = (first.get("metadata") or {}).get("continue")
        while token:
            page: Obj = self.get(path, query={**query, "continue": token})
            items.extend(page.get("items") or [])
            first["metadata"] = page.get("metadata") or {}
            token = first["metadata"].get("continue")
        first["items"] = items
        return first

    def table(
        self, path: str, *, query: Mapping[str, str] | None = None
    ) -> builtins.list[dict[str, str]]:
        """A list as the server-side table ``kubectl get`` shows: one {column: cell} per row."""
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

    def merge_patch(
        self, path: str, patch: Mapping[str, Any], *, resource_version: str | None = None
    ) -> Any:
        """JSON merge patch; with ``resource_version`` the server refuses (ConflictError) if
        the object changed since that version."""
        body: dict[str, Any] = dict(patch)
        if resource_version is not None:
            body = copy.deepcopy(body)
            meta = body.setdefault("metadata", {})
            if not isinstance(meta, dict):
                raise TypeError("patch metadata must be a mapping")
            meta["resourceVersion"] = resource_version
        return self.request("PATCH", path, body, content_type=MERGE_PATCH)

    def apply(self, path: str, obj: object, *, field_manager: str = FIELD_MANAGER) -> Any:
        """Server-side apply (idempotent create-or-update) of ``obj`` at its own ``path``."""
        return self.request(
            "PATCH",
            path,
            obj,
            query={"fieldManager": field_manager, "force": "true"},
            content_type=APPLY_PATCH,
        )

    def watch(
        self,
        path: str,
        resource_version: str | None = None,
        *,
        field_selector: str | None = None,
        label_selector: str | None = None,
        timeout_s: int = 60,
        bookmarks: bool = True,
        skip: Callable[[bytes], bool] | None = None,
    ) -> Watch:
        """Open a watch stream; iterate it for events, close it (or leave its ``with``).
        ``skip``: events whose raw line it is true of are neither decoded nor yielded."""
        query: dict[str, str] = {"watch": "1", "timeoutSeconds": str(int(timeout_s))}
        if resource_version is not None:
            query["resourceVersion"] = resource_version
        if field_selector:
            query["fieldSelector"] = field_selector
        if label_selector:
            query["labelSelector"] = label_selector
        if bookmarks:
            query["allowWatchBookmarks"] = "true"
        full = f"{path}?{urlencode(query)}"
        headers = self._headers(JSON)
        conn, resp = self._open_watch(path, full, headers, timeout_s)
        if resp.status == 401 and self._auth.unauthorized(headers.get("Authorization")):
            resp.read()
            conn.close()
            conn, resp = self._open_watch(path, full, self._reauthorized(headers), timeout_s)
        if resp.status >= 400:
            text = resp.read().decode(errors="replace")
            conn.close()
            raise _error_for("GET", path, resp.status, text)
        return Watch(path, conn, resp, skip)

    def probe(self, path: str) -> tuple[int, str]:
        """(status, body) of a GET, for health endpoints; never raises on HTTP errors."""
        status, data = self._send_authorized("GET", path, None, self._headers(None), retry=False)
        return status, data.decode(errors="replace")

    def close(self) -> None:
        with self._lock:
            conns, self._conns, self._idle = self._conns, set(), []
        for c in conns:
            c.close()

    def __enter__(self) -> KubeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Wire ----------------------------------------------------------------------------------

    def _headers(self, accept: str | None) -> dict[str, str]:
        headers: dict[str, str] = {"User-Agent": self._user_agent}
        authorization = self._auth.header()
        if authorization:
            headers["Authorization"] = authorization
        if accept:
            headers["Accept"] = accept
        return headers

    def _reauthorized(self, headers: Mapping[str, str]) -> dict[str, str]:
        """``headers`` with the current Authorization (after a reload)."""
        fresh = {k: v for k, v in headers.items() if k != "Authorization"}
        authorization = self._auth.header()
        if authorization:
            fresh["Authorization"] = authorization
        return fresh

    def _open_watch(
        self, path: str, full: str, headers: Mapping[str, str], timeout_s: int
    ) -> tuple[http.client.HTTPSConnection, http.client.HTTPResponse]:
        # Socket timeout above the server's own so the server ends the stream first.
        conn = http.client.HTTPSConnection(
            self._host, self._port, timeout=timeout_s + 15, context=self._ssl
        )
        try:
            conn.request("GET", full, headers=dict(headers))
            return conn, conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise UnreachableError(f"GET {self.server}{path} (watch) failed: {e!r}") from e

    def _send_authorized(
        self,
        method: str,
        path: str,
        payload: bytes | None,
        headers: dict[str, str],
        *,
        retry: bool = True,
    ) -> tuple[int, bytes]:
        """``_send``, once more after reloading the credentials when the apiserver answers
        401 (a token expired early or was revoked, a token file rotated)."""
        status, data = self._send(method, path, payload, headers, retry=retry)
        if status == 401 and self._auth.unauthorized(headers.get("Authorization")):
            headers = self._reauthorized(headers)
            status, data = self._send(method, path, payload, headers, retry=retry)
        return status, data

    def _checkout(self, *, fresh: bool = False) -> Connection:
        """An idle keep-alive connection, or (none idle, or ``fresh``) a new one."""
        with self._lock:
            if self._idle and not fresh:
                return self._idle.pop()
        conn = Connection(self._host, self._port, timeout_s=self._timeout_s, context=self._ssl)
        with self._lock:
            self._conns.add(conn)
        return conn

    def _checkin(self, conn: Connection) -> None:
        with self._lock:
            if conn in self._conns and len(self._idle) < MAX_IDLE_CONNECTIONS:
                self._idle.append(conn)
                return
            self._conns.discard(conn)
        conn.close()

    def _drop_idle(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
            self._conns.difference_update(idle)
        for c in idle:
            c.close()

    def _discard(self, conn: Connection) -> None:
        with self._lock:
            self._conns.discard(conn)
        conn.close()

    def _send(
        self,
        method: str,
        path: str,
        payload: bytes | None,
        headers: dict[str, str],
        *,
        retry: bool = True,
    ) -> tuple[int, bytes]:
        # One retry on a fresh connection: the server may have closed an idle keep-alive one
        # (and then likely the other idle ones too).
        for attempt in (0, 1):
            conn = self._checkout(fresh=attempt > 0)
            try:
                status, data, closes = conn.exchange(method, path, payload, headers)
            except OSError as e:
                self._discard(conn)
                self._drop_idle()  # the server went away or closed them: all are suspect
                if attempt == 1 or not retry or isinstance(e, ssl.SSLCertVerificationError):
                    raise UnreachableError(
                        f"{method} {self.server}{path} failed: {e!r}; is the apiserver up?"
                    ) from e
                continue
            if closes:
                self._discard(conn)
            else:
                self._checkin(conn)
            return status, data
        raise AssertionError("unreachable")


_WATCH_READ: Final = 1 << 16
# The head of a pod's MODIFIED watch event as the apiserver writes it: the event's type,
# the object's kind and apiVersion, then ObjectMeta in its field order (name, generateName
# when set, namespace, uid, resourceVersion). Inside a JSON string a quote is escaped, so
# the captured values cannot run past their own strings; names with escapes do not match.
_MODIFIED_POD_HEAD: Final = re.compile(
    rb'\{"type":"MODIFIED","object":\{"kind":"Pod","apiVersion":"v1","metadata":\{'
    rb'"name":"([^"\\]+)",(?:"generateName":"[^"\\]*",)?"namespace":"([^"\\]+)",'
    rb'"uid":"[^"\\]+","resourceVersion":"(\d+)"'
)


def modified_pod_head(line: bytes) -> tuple[str, int] | None:
    """``("namespace/name", resourceVersion)`` of a pod's MODIFIED watch event, read from
    its raw line without decoding it; None for any other event or a line not in the
    apiserver's own shape (such a line is decoded as usual)."""
    m = _MODIFIED_POD_HEAD.match(line)
    if m is None:
        return None
    return f"{m.group(2).decode()}/{m.group(1).decode()}", int(m.group(3))


class Watch:
    """One watch stream: iterate for ``{"type": …, "object": {…}}`` events.

    Ends when the server closes the stream (its timeoutSeconds) or on ``close()``, which
    may be called from another thread to unblock a reader. An ERROR event with code 410
    raises GoneError; other ERROR events raise ApiError.
    """

    def __init__(
        self,
        path: str,
        conn: http.client.HTTPSConnection,
        resp: http.client.HTTPResponse,
        skip: Callable[[bytes], bool] | None = None,
    ) -> None:
        self.path = path
        self._conn = conn
        self._resp = resp
        self._skip = skip
        self.skipped = 0  # events ``skip`` kept from being decoded
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._reading = False

    def __iter__(self) -> Iterator[Obj]:
        with self._lock:
            if self._reading:
                raise RuntimeError(f"watch {self.path} is already being read")
            self._reading = True
        try:
            rest = b""  # the start of a line whose end has not arrived
            while not self._closed.is_set():
                try:
                    # What has arrived, at most a chunk (the apiserver sends an event per
                    # chunk): a readline of a chunked body costs several Python-level
                    # peeks and reads per event.
                    data = self._resp.read1(_WATCH_READ)
                except (OSError, http.client.HTTPException, ValueError, AttributeError) as e:
                    # After close() from another thread the read fails in one of these ways.
                    if self._closed.is_set():
                        return
                    raise UnreachableError(f"watch {self.path} broke: {e!r}") from e
                if not data:
                    if self._wanted(rest):
                        yield self._event(rest)
                    return
                lines = (rest + data).split(b"\n") if rest else data.split(b"\n")
                rest = lines.pop()
                for line in lines:
                    if self._wanted(line):
                        yield self._event(line)
        finally:
            self._closed.set()
            with self._lock:
                self._reading = False
            self._conn.close()

    def _wanted(self, line: bytes) -> bool:
        """Whether ``line`` is an event to decode: not blank, not one ``skip`` names
        (counted in ``skipped``)."""
        if not line.strip():
            return False
        if self._skip is not None and self._skip(line):
            self.skipped += 1
            return False
        return True

    def _event(self, line: bytes) -> Obj:
        try:
            # Every watcher decodes every pod event: orjson takes a third of the stdlib's
            # time (9 vs 25 us for a 2.8 KB pod).
            event = orjson.loads(line)
        except orjson.JSONDecodeError as e:
            raise InvalidResponseError(
                f"watch {self.path}: event is not JSON: {line[:200]!r}"
            ) from e
        if not isinstance(event, dict) or "type" not in event:
            raise InvalidResponseError(f"watch {self.path}: not an event: {line[:200]!r}")
        if event["type"] == "ERROR":
            status = event.get("object") or {}
            code = int(status.get("code", 500))
            raise _error_for("WATCH", self.path, code, json.dumps(status))
        return event

    def close(self) -> None:
        """End the stream; safe from any thread and more than once.

        While another thread reads, only the socket is shut down (that unblocks it) and
        the reader closes the connection itself: closing it here would race its read.
        """
        self._closed.set()
        with self._lock:
            reading = self._reading
        sock = self._conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if not reading:
            self._conn.close()

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read(path: Path, what: str) -> str:
    try:
        return path.read_text()
    except OSError as e:
        raise KubeConfigError(f"cannot read {what} {path}: {e.strerror}") from e


def _https_host_port(server: str) -> tuple[str, int]:
    url = urlsplit(server)
    if url.scheme != "https" or not url.hostname:
        raise KubeConfigError(f"apiserver URL must be https://HOST:PORT, got {server!r}")
    return url.hostname, url.port or 443


# Loading credentials with the kubernetes package -------------------------------------------


def _kubeconfig_doc(path: Path) -> dict[str, Any]:
    try:
        doc = yaml.safe_load(_read(path, "kubeconfig"))
    except yaml.YAMLError as e:
        raise KubeConfigError(f"kubeconfig {path} is not YAML: {e}") from e
    if not isinstance(doc, dict):
        raise KubeConfigError(
            f"kubeconfig {path} is not a mapping of current-context, contexts, clusters, users"
        )
    return doc


def _context_and_user(doc: Mapping[str, Any]) -> tuple[str, str]:
    """Names of the current context and its user, best effort: for messages only."""
    context = str(doc.get("current-context") or "")
    for entry in doc.get("contexts") or []:
        if isinstance(entry, dict) and entry.get("name") == context:
            body = entry.get("context")
            if isinstance(body, dict):
                return context, str(body.get("user") or "")
    return context, ""


def _header_of(config: Any) -> str | None:
    """The Authorization value a loaded ``Configuration`` holds, read without running its
    refresh hook (``get_api_key_with_prefix`` would: Credentials runs it on its schedule)."""
    for name in ("BearerToken", "authorization"):
        key = config.api_key.get(name)
        if key:
            prefix = config.api_key_prefix.get(name)
            return _authorization(f"{prefix} {key}" if prefix else str(key))
    return None


def _authorization(value: str) -> str:
    """``value`` as a header: trimmed (a token file's final newline) and with the scheme
    spelled ``Bearer`` (the in-cluster loader writes ``bearer``)."""
    scheme, _, rest = value.strip().partition(" ")
    return f"Bearer {rest.strip()}" if scheme.lower() == "bearer" else value.strip()


def _run_refresh_hook(config: Any) -> None:
    """The loader's own renewal: runs an exec plugin (or auth provider) again when its token
    expires within five minutes, else keeps what it loaded (a rotated tokenFile is read
    again by the reload after a 401)."""
    hook = config.refresh_api_key_hook
    if hook is not None:
        hook(config)


def _renewal(where: str, step: Callable[[], object], config: Any) -> Renewal:
    """A Credentials renewal: run the loader ``step``, then read the header it left."""

    def renew() -> str | None:
        with _loading(where) as logged:
            step()
        if logged:
            # The loader keeps the old token when a plugin failed: say why it may be stale.
            log.warning("kube.credentials_renewal_failed", where=where, messages=logged)
        return _header_of(config)

    return renew


@contextlib.contextmanager
def _loading(where: str) -> Iterator[list[str]]:
    """Run a kubernetes loader in the ``with`` body: what it raises becomes a KubeConfigError
    naming ``where``; yields the messages it logged meanwhile (some failures, an exec
    plugin's exit status and error output, it only logs)."""
    from kubernetes.config.config_exception import ConfigException

    with _captured_log() as logged:
        try:
            yield logged
        # Malformed kubeconfigs fail inside the loader in any of these ways.
        except (ConfigException, OSError, ValueError, TypeError, KeyError, AttributeError) as e:
            raise KubeConfigError(f"{where}: {type(e).__name__}: {e}{_logged_cause(logged)}") from e


def _logged_cause(messages: builtins.list[str]) -> str:
    return f"; the loader reported: {'; '.join(messages)}" if messages else ""


class _Collect(logging.Handler):
    """Keeps the messages one thread logs through the root or a ``kubernetes`` logger."""

    def __init__(self, thread: int, into: builtins.list[str]) -> None:
        super().__init__(logging.WARNING)
        self._thread = thread
        self._into = into

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread == self._thread and (
            record.name == "root" or record.name.startswith("kubernetes")
        ):
            self._into.append(record.getMessage())


@contextlib.contextmanager
def _captured_log() -> Iterator[builtins.list[str]]:
    """The messages this thread logs meanwhile. The kubernetes loaders report an exec
    plugin's failure with ``logging.error`` on the root logger; with this handler there, that
    call also no longer installs a stderr handler (``logging.basicConfig``) as a side effect."""
    messages: builtins.list[str] = []
    handler = _Collect(threading.get_ident(), messages)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield messages
    finally:
        root.removeHandler(handler)
