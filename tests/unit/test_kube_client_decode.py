"""KubeClient decodes answers and watch events (orjson) and names what is not JSON."""

from __future__ import annotations

import http.server
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from api.kube.client import KubeClient, modified_pod_head
from api.kube.errors import InvalidResponseError
from tests.local_https import serve_https

POD = '{"kind":"Pod","metadata":{"name":"p\\u00e9","annotations":{"a":"\\u2603"}},"n":1.5}'
# path -> (body, chunked watch lines)
ANSWERS: dict[str, tuple[bytes, bool]] = {
    "/pod": (POD.encode(), False),
    "/garbage": (b"{nope", False),
    "/watch-ok": (b'{"type":"ADDED","object":' + POD.encode() + b"}\n", True),
    "/watch-garbage": (b'{"type":"ADDED","object":{}}\n{broken\n', True),
}
EVENT = b'{"type":"MODIFIED","object":' + POD.encode() + b"}"
# path -> the chunks of a watch body, as a server may cut them
CHUNKS: dict[str, list[bytes]] = {
    # an event across three chunks, two in one, a blank line between, the last unended
    "/watch-cut": [
        EVENT[:10],
        EVENT[10:30],
        EVENT[30:] + b"\n" + EVENT + b"\n\n" + EVENT[:5],
        EVENT[5:],
    ],
}


@pytest.fixture
def url(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/user-agent":
                body = json.dumps({"ua": self.headers.get("User-Agent")}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            if path in CHUNKS:
                self.send_response(200)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for chunk in CHUNKS[path]:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                return
            body, chunked = ANSWERS[path]
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            if chunked:
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for line in body.splitlines(keepends=True):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                self.wfile.write(b"0\r\n\r\n")
            else:
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    with serve_https(tmp_path, Handler) as served:
        yield served


def test_answers_and_watch_events_decode_as_the_stdlib_would(url: tuple[str, Path]) -> None:
    with KubeClient(url[0], "t", url[1]) as api:
        pod = api.get("/pod")
        assert pod == {
            "kind": "Pod",
            "metadata": {"name": "pé", "annotations": {"a": "☃"}},
            "n": 1.5,
        }
        with api.watch("/watch-ok") as w:
            assert list(w) == [{"type": "ADDED", "object": pod}]


def test_watch_events_are_whole_lines_however_the_chunks_cut_them(url: tuple[str, Path]) -> None:
    want = {"type": "MODIFIED", "object": json.loads(POD)}
    with KubeClient(url[0], "t", url[1]) as api, api.watch("/watch-cut") as w:
        assert list(w) == [want, want, want]


def test_what_is_not_json_is_named(url: tuple[str, Path]) -> None:
    with KubeClient(url[0], "t", url[1]) as api:
        with pytest.raises(
            InvalidResponseError, match=r"GET /garbage: answer is not JSON: '\{nope'"
        ):
            api.get("/garbage")
        with (
            api.watch("/watch-garbage") as w,
            pytest.raises(
                InvalidResponseError, match=r"watch /watch-garbage: event is not JSON: b'\{broken"
            ),
        ):
            for _ in w:
                pass


def _pod_event(typ: str, meta: str, kind: str = "Pod") -> bytes:
    return (
        f'{{"type":"{typ}","object":{{"kind":"{kind}","apiVersion":"v1","metadata":{{{meta}'
        ',"labels":{"resourceVersion":"1"}},"spec":{}}}'
    ).encode()


_META = '"name":"p-1","namespace":"ns","uid":"u-1","resourceVersion":"42"'


@pytest.mark.parametrize(
    ("line", "want"),
    [
        (_pod_event("MODIFIED", _META), ("ns/p-1", 42)),
        (
            _pod_event(
                "MODIFIED",
                '"name":"w-x","generateName":"w-","namespace":"ns","uid":"u","resourceVersion":"7"',
            ),
            ("ns/w-x", 7),
        ),
        (_pod_event("ADDED", _META), None),  # only a MODIFIED version can be one held already
        (_pod_event("DELETED", _META), None),
        (_pod_event("MODIFIED", _META, kind="Node"), None),
        # a field order the apiserver does not write, and a name with an escape: decoded
        (
            _pod_event("MODIFIED", '"namespace":"ns","name":"p","uid":"u","resourceVersion":"4"'),
            None,
        ),
        (
            _pod_event(
                "MODIFIED", '"name":"p\\"","namespace":"ns","uid":"u","resourceVersion":"4"'
            ),
            None,
        ),
        (
            _pod_event("MODIFIED", '"name":"p","namespace":"ns","uid":"u","resourceVersion":"x4"'),
            None,
        ),
        (b' {"type":"MODIFIED"}', None),
        (b"", None),
    ],
)
def test_a_modified_pod_events_head_is_read_without_decoding(
    line: bytes, want: tuple[str, int] | None
) -> None:
    assert modified_pod_head(line) == want


def test_watch_skips_the_events_its_skip_names_however_the_chunks_cut_them(
    url: tuple[str, Path],
) -> None:
    seen: list[bytes] = []

    def skip(line: bytes) -> bool:
        seen.append(line)
        return len(seen) == 2  # the second event, whole although cut across chunks

    want = {"type": "MODIFIED", "object": json.loads(POD)}
    with KubeClient(url[0], "t", url[1]) as api, api.watch("/watch-cut", skip=skip) as w:
        assert list(w) == [want, want]
        assert w.skipped == 1
    assert seen == [EVENT, EVENT, EVENT]


def test_each_client_names_its_component_in_the_user_agent(url: tuple[str, Path]) -> None:
    with KubeClient(url[0], "t", url[1]) as api:
        assert api.get("/user-agent") == {"ua": "tessera"}
    with KubeClient(url[0], "t", url[1], user_agent="tessera-node-agent") as api:
        assert api.get("/user-agent") == {"ua": "tessera-node-agent"}
