"""The API client's HTTP/1.1 wire: answers read as the apiserver sends them (a length,
chunked, or to the connection's end), and every malformed or cut-short one refused by name."""

from __future__ import annotations

import http.server
import io
import json
import ssl
from pathlib import Path

import pytest

from api.kube.wire import MAX_HEADERS, MAX_LINE, AnswerError, Connection, read_answer
from tests.local_https import serve_https

OK = b"HTTP/1.1 200 OK\r\n"


@pytest.mark.parametrize(
    ("raw", "method", "status", "body", "closes"),
    [
        (OK + b"Content-Length: 5\r\n\r\nhello", "GET", 200, b"hello", False),
        (OK + b"content-length:  5 \r\nX: y\r\n\r\nhelloEXTRA", "GET", 200, b"hello", False),
        (
            OK + b"Transfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\n"
            b"Trailer: t\r\n\r\n",
            "PATCH",
            200,
            b"hello world",
            False,
        ),
        # chunked wins over a length (RFC 9112 6.3)
        (
            OK + b"Content-Length: 99\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
            "GET",
            200,
            b"ok",
            False,
        ),
        (b"HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\n\r\n{}", "GET", 404, b"{}", False),
        (b"HTTP/1.1 204 No Content\r\n\r\n", "DELETE", 204, b"", False),
        (OK + b"Content-Length: 5\r\n\r\n", "HEAD", 200, b"", False),
        (
            b"HTTP/1.1 100 Continue\r\n\r\n" + OK + b"Content-Length: 1\r\n\r\nx",
            "PUT",
            200,
            b"x",
            False,
        ),
        (OK + b"Connection: close\r\nContent-Length: 1\r\n\r\nx", "GET", 200, b"x", True),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\nx", "GET", 200, b"x", True),
        (
            b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 1\r\n\r\nx",
            "GET",
            200,
            b"x",
            False,
        ),
        (OK + b"\r\nto the end", "GET", 200, b"to the end", True),  # no length: until closed
    ],
)
def test_answers_are_read_as_sent(
    raw: bytes, method: str, status: int, body: bytes, closes: bool
) -> None:
    assert read_answer(io.BytesIO(raw), method=method) == (status, body, closes)


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"", "closed before the status line"),
        (b"HTTP/1.1 200", "closed inside the status line"),
        (b"SPDY/3 200 OK\r\n\r\n", "not an HTTP/1.x status line"),
        (b"HTTP/1.1 2OO OK\r\n\r\n", "is not three digits"),
        (OK + b"Content-Length: 5\r\n", "closed before the header"),
        (OK + b"no colon here\r\n\r\n", "header line without a colon"),
        (OK + b"Content-Length: -1\r\n\r\n", "is not a number"),
        (OK + b"Content-Length: 1\r\nContent-Length: 2\r\n\r\nxx", "two different Content-Length"),
        (OK + b"Content-Length: 5\r\n\r\nhel", "inside the body (3 of 5 bytes)"),
        (OK + b"Transfer-Encoding: gzip\r\n\r\n", "is not chunked"),
        (OK + b"Transfer-Encoding: chunked\r\n\r\n0x5\r\nhello\r\n0\r\n\r\n", "not hexadecimal"),
        (OK + b"Transfer-Encoding: chunked\r\n\r\n-5\r\n", "not hexadecimal"),
        (OK + b"Transfer-Encoding: chunked\r\n\r\n\r\n", "not hexadecimal"),
        (OK + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhel", "inside the chunk"),
        (OK + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhelloXX0\r\n\r\n", "not followed by CRLF"),
        (OK + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n", "before the chunk size"),
        (OK + b"Transfer-Encoding: chunked\r\n\r\n0\r\n", "before the trailer"),
        (OK + b"X: " + b"a" * MAX_LINE + b"\r\n\r\n", f"longer than {MAX_LINE} bytes"),
        (OK + b"X: y\r\n" * (MAX_HEADERS + 1) + b"\r\n", f"more than {MAX_HEADERS} headers"),
    ],
)
def test_malformed_or_cut_short_answers_are_refused_by_name(raw: bytes, says: str) -> None:
    with pytest.raises(AnswerError, match=says.replace("(", r"\(").replace(")", r"\)")):
        read_answer(io.BytesIO(raw))


def test_an_answer_error_is_a_broken_connection_to_the_caller() -> None:
    assert issubclass(AnswerError, OSError)


class _Echo(http.server.BaseHTTPRequestHandler):
    """Answers with what it received, chunked (as the apiserver sends large objects)."""

    protocol_version = "HTTP/1.1"

    def do_PATCH(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        seen = {
            "method": self.command,
            "path": self.path,
            "host": self.headers.get("Host"),
            "type": self.headers.get("Content-Type"),
            "length": self.headers.get("Content-Length"),
            "body": self.rfile.read(length).decode(),
        }
        data = json.dumps(seen).encode()
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for part in (data[:7], data[7:]):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
        self.wfile.write(b"0\r\n\r\n")

    do_GET = do_PATCH

    def log_message(self, *args: object) -> None:
        pass


def test_a_connection_sends_the_request_and_stays_open_between_calls(tmp_path: Path) -> None:
    with serve_https(tmp_path, _Echo) as (url, ca):
        port = int(url.rsplit(":", 1)[1])
        conn = Connection(
            "127.0.0.1", port, timeout_s=5, context=ssl.create_default_context(cafile=str(ca))
        )
        try:
            for i in range(3):
                status, body, closes = conn.exchange(
                    "PATCH", f"/p/{i}?x=1", b'{"a":1}', {"Content-Type": "application/json"}
                )
                assert (status, closes) == (200, False)
                assert json.loads(body) == {
                    "method": "PATCH",
                    "path": f"/p/{i}?x=1",
                    "host": f"127.0.0.1:{port}",
                    "type": "application/json",
                    "length": "7",
                    "body": '{"a":1}',
                }
            status, body, _ = conn.exchange("GET", "/g", None, {})
            assert json.loads(body)["length"] is None  # no body, no length
            with pytest.raises(ValueError, match="line break"):
                conn.exchange("GET", "/g", None, {"Authorization": "Bearer x\r\nEvil: 1"})
        finally:
            conn.close()
