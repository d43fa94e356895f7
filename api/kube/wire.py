"""One keep-alive HTTP/1.1 connection over TLS, for ``KubeClient``'s request/answer calls.

What the apiserver speaks, no more: a request with a body of known length; an answer with
a ``Content-Length``, chunked, or read to the connection's end. The stdlib's client spends
most of its time per call parsing headers as e-mail and building them one call each (97
against 29 us of CPU per call on loopback); the kwok node agent makes a call per pod.
Watches keep the stdlib's client (one per stream, read as it comes).

A malformed or cut-short answer raises ``AnswerError``, an ``OSError`` like a broken
connection: the caller drops the connection, as it does one the server closed.
"""

from __future__ import annotations

import re
import socket
import ssl
from typing import BinaryIO, Final

MAX_LINE: Final = 65536  # the longest status, header or chunk-size line accepted
MAX_HEADERS: Final = 100
_NO_BODY: Final = frozenset({204, 304})
_HEX: Final = re.compile(rb"[0-9A-Fa-f]{1,16}\Z")


class AnswerError(OSError):
    """The server's answer is not HTTP/1.1 as expected, or ended early."""


class Connection:
    """Opened at the first ``exchange``; not thread-safe (one caller at a time)."""

    def __init__(self, host: str, port: int, *, timeout_s: float, context: ssl.SSLContext) -> None:
        self._host = host
        self._port = port
        self._timeout_s = timeout_s
        self._context = context
        name = f"[{host}]" if ":" in host else host
        self._host_header = name if port == 443 else f"{name}:{port}"
        self._sock: ssl.SSLSocket | None = None
        self._rfile: BinaryIO | None = None

    def exchange(
        self, method: str, target: str, payload: bytes | None, headers: dict[str, str]
    ) -> tuple[int, bytes, bool]:
        """Send one request; its answer's status, body, and whether the server closes the
        connection after it. Raises OSError (``AnswerError`` among them) or ValueError (a
        header with a line break)."""
        sock, rfile = self._open()
        lines = [f"{method} {target} HTTP/1.1", f"Host: {self._host_header}"]
        for name, value in headers.items():
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
                raise ValueError(f"header {name!r} holds a line break")
            lines.append(f"{name}: {value}")
        if payload is not None or method in ("POST", "PUT", "PATCH"):
            lines.append(f"Content-Length: {len(payload or b'')}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        sock.sendall(head + payload if payload else head)
        return read_answer(rfile, method=method)

    def close(self) -> None:
        sock, self._sock, self._rfile = self._sock, None, None
        if sock is not None:
            sock.close()

    def _open(self) -> tuple[ssl.SSLSocket, BinaryIO]:
        if self._sock is None or self._rfile is None:
            raw = socket.create_connection((self._host, self._port), timeout=self._timeout_s)
            try:
                raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._sock = self._context.wrap_socket(raw, server_hostname=self._host)
            except BaseException:
                raw.close()
                raise
            self._rfile = self._sock.makefile("rb")
        return self._sock, self._rfile


def read_answer(rfile: BinaryIO, *, method: str = "GET") -> tuple[int, bytes, bool]:
    """Read one HTTP/1.x answer from ``rfile``: (status, body, the connection closes after
    it). Interim 1xx answers are skipped."""
    while True:
        status, version = _status_line(_line(rfile, "status line"))
        length, chunked, close = _headers(rfile, version)
        if 100 <= status < 200:
            continue
        if method == "HEAD" or status in _NO_BODY:
            return status, b"", close
        if chunked:
            return status, _chunked_body(rfile), close
        if length is not None:
            return status, _exactly(rfile, length, "body"), close
        return status, rfile.read(), True  # delimited by the connection's end


def _line(rfile: BinaryIO, what: str) -> bytes:
    line = rfile.readline(MAX_LINE + 1)
    if not line:
        raise AnswerError(f"connection closed before the {what}")
    if len(line) > MAX_LINE:
        raise AnswerError(f"{what} longer than {MAX_LINE} bytes")
    if not line.endswith(b"\n"):
        raise AnswerError(f"connection closed inside the {what}")
    return line


def _status_line(line: bytes) -> tuple[int, bytes]:
    parts = line.split(None, 2)
    if len(parts) < 2 or parts[0] not in (b"HTTP/1.1", b"HTTP/1.0"):
        raise AnswerError(f"not an HTTP/1.x status line: {line[:100]!r}")
    code = parts[1]
    if len(code) != 3 or not code.isdigit():
        raise AnswerError(f"status code {code[:20]!r} is not three digits")
    return int(code), parts[0]


def _headers(rfile: BinaryIO, version: bytes) -> tuple[int | None, bool, bool]:
    """(Content-Length, chunked, connection closes) from the header lines."""
    length: int | None = None
    chunked = False
    close = version == b"HTTP/1.0"
    for _ in range(MAX_HEADERS + 1):
        line = _line(rfile, "header")
        if line in (b"\r\n", b"\n"):
            return length, chunked, close
        name, sep, value = line.partition(b":")
        if not sep:
            raise AnswerError(f"header line without a colon: {line[:100]!r}")
        key = name.strip().lower()
        if key == b"content-length":
            text = value.strip()
            if not text.isdigit():
                raise AnswerError(f"Content-Length {text[:40]!r} is not a number")
            if length is not None and int(text) != length:
                raise AnswerError("two different Content-Length headers")
            length = int(text)
        elif key == b"transfer-encoding":
            codings = [c.strip() for c in value.lower().split(b",")]
            if codings[-1] != b"chunked":
                raise AnswerError(f"transfer coding {value.strip()[:40]!r} is not chunked")
            chunked = True
        elif key == b"connection":
            tokens = {t.strip() for t in value.lower().split(b",")}
            if b"close" in tokens:
                close = True
            elif b"keep-alive" in tokens:
                close = False
    raise AnswerError(f"more than {MAX_HEADERS} headers")


def _chunked_body(rfile: BinaryIO) -> bytes:
    parts: list[bytes] = []
    while True:
        line = _line(rfile, "chunk size")
        size_text = line.split(b";", 1)[0].strip()  # chunk extensions are ignored
        if not _HEX.match(size_text):
            raise AnswerError(f"chunk size {size_text[:20]!r} is not hexadecimal")
        size = int(size_text, 16)
        if size == 0:
            for _ in range(MAX_HEADERS + 1):  # trailers, then the blank line
                if _line(rfile, "trailer") in (b"\r\n", b"\n"):
                    return b"".join(parts)
            raise AnswerError(f"more than {MAX_HEADERS} trailers")
        parts.append(_exactly(rfile, size, "chunk"))
        if _exactly(rfile, 2, "chunk end") != b"\r\n":
            raise AnswerError("chunk not followed by CRLF")


def _exactly(rfile: BinaryIO, n: int, what: str) -> bytes:
    data = rfile.read(n)
    if len(data) != n:
        raise AnswerError(f"connection closed inside the {what} ({len(data)} of {n} bytes)")
    return data
