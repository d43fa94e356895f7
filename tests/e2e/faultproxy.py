"""A loopback TLS proxy in front of the kube-apiserver that breaks watches on demand.

The fault tests point the plugin server and the node agent at it (a kubeconfig naming the
proxy; it serves the apiserver's own certificate, so clients verify it as usual). It relays
HTTP/1.1 requests one by one and, on demand:

- ``drop()``: aborts every open connection, both sides, as a network failure would: open
  watches break, requests in flight fail.
- ``expire_watches(seconds)``: ends every open watch stream cleanly (the terminating chunk, as
  when the server's timeout ends it) and, for that long, rewrites the ``resourceVersion`` of
  every new watch request to ``1``. The apiserver itself then answers 410 Gone (too old
  resource version) as long as its watch cache starts later than that, which holds once the
  apiserver has been restarted on a non-empty etcd; the clients must list again.

It runs an asyncio loop on a thread (TLS in asyncio is single-threaded per connection, so
reads and writes of one connection never race).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import ssl
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeVar

import yaml

T = TypeVar("T")

LOOPBACK: Final = "127.0.0.1"
_RV: Final = re.compile(rb"([?&]resourceVersion=)[^&\s]*")
_CHUNK: Final = 65536


@dataclass
class ProxyStats:
    connections: int = 0
    dropped: int = 0  # connections aborted by drop()
    watches: int = 0
    watches_ended: int = 0  # watch streams ended cleanly by expire_watches()
    watches_expired: int = 0  # watch requests sent on with resourceVersion=1


@dataclass(eq=False)  # by identity: kept in a set
class _Conn:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter
    watch_stream: asyncio.Task[None] | None = None
    ending: bool = False  # expire_watches() ends this connection's watch cleanly
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


class FaultProxy:
    def __init__(self, upstream_port: int, *, ca_file: Path, cert_file: Path, key_file: Path):
        self._upstream_port = upstream_port
        self._server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._server_ctx.load_cert_chain(str(cert_file), str(key_file))
        self._server_ctx.set_alpn_protocols(["http/1.1"])
        self._client_ctx = ssl.create_default_context(cafile=str(ca_file))
        self._client_ctx.set_alpn_protocols(["http/1.1"])
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy")
        self._server: asyncio.Server | None = None
        self._conns: set[_Conn] = set()  # loop thread only
        self._expire_until = 0.0
        self.stats = ProxyStats()
        self.port = 0

    # Control (any thread) ------------------------------------------------------------------

    def start(self) -> FaultProxy:
        self._thread.start()
        self._server = self._call(self._listen())
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._call(self._shutdown())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10.0)
        self._loop.close()

    @property
    def url(self) -> str:
        return f"https://{LOOPBACK}:{self.port}"

    def drop(self) -> int:
        """Abort every open connection; how many there were."""
        return self._call(self._drop())

    def expire_watches(self, seconds: float) -> int:
        """End the open watch streams and answer new watches 410 for ``seconds``; how many
        streams were ended."""
        self._expire_until = time.monotonic() + seconds
        return self._call(self._end_watches())

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30.0)

    # Loop thread ---------------------------------------------------------------------------

    async def _listen(self) -> asyncio.Server:
        return await asyncio.start_server(self._serve, LOOPBACK, 0, ssl=self._server_ctx)

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._drop(count=False)
        if self._server is not None:
            await self._server.wait_closed()

    async def _drop(self, *, count: bool = True) -> int:
        conns = list(self._conns)
        for c in conns:
            for t in c.tasks:
                t.cancel()
            c.client.transport.abort()
            c.upstream.transport.abort()
        if count:
            self.stats.dropped += len(conns)
        await asyncio.sleep(0)
        return len(conns)

    async def _end_watches(self) -> int:
        ended = 0
        for c in list(self._conns):
            if c.watch_stream is not None and not c.watch_stream.done():
                c.ending = True
                c.watch_stream.cancel()
                ended += 1
        self.stats.watches_ended += ended
        await asyncio.sleep(0)
        return ended

    async def _serve(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        self.stats.connections += 1
        try:
            ureader, uwriter = await asyncio.open_connection(
                LOOPBACK, self._upstream_port, ssl=self._client_ctx, server_hostname=LOOPBACK
            )
        except OSError:
            cwriter.transport.abort()  # apiserver down: the client sees a failed connection
            return
        conn = _Conn(cwriter, uwriter)
        self._conns.add(conn)
        up = asyncio.create_task(self._requests(conn, creader, uwriter, ureader))
        conn.tasks.append(up)
        clean = False
        try:
            await up
            clean = True
        except (asyncio.CancelledError, OSError, asyncio.IncompleteReadError, ssl.SSLError):
            pass  # dropped, or a side closed: the connection ends
        finally:
            self._conns.discard(conn)
            for t in conn.tasks:
                t.cancel()
            uwriter.transport.abort()
            if clean:  # a watch ended by expire_watches(): let the terminating chunk out
                cwriter.close()
                with contextlib.suppress(OSError, ssl.SSLError):
                    await asyncio.wait_for(cwriter.wait_closed(), 5.0)
            cwriter.transport.abort()

    async def _requests(
        self,
        conn: _Conn,
        creader: asyncio.StreamReader,
        uwriter: asyncio.StreamWriter,
        ureader: asyncio.StreamReader,
    ) -> None:
        """Relay requests in order; each one's response is relayed before the next is read."""
        while True:
            head = await creader.readuntil(b"\r\n\r\n")
            line, _, rest = head.partition(b"\r\n")
            length = 0
            for h in rest.split(b"\r\n"):
                name, _, value = h.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value.strip())
            body = await creader.readexactly(length) if length else b""
            watch = line.startswith(b"GET ") and (b"?watch=1" in line or b"&watch=1" in line)
            if watch:
                self.stats.watches += 1
                if time.monotonic() < self._expire_until and _RV.search(line):
                    line = _RV.sub(rb"\g<1>1", line)
                    self.stats.watches_expired += 1
            uwriter.write(line + b"\r\n" + rest + body)
            await uwriter.drain()
            relay = asyncio.create_task(self._response(ureader, conn.client))
            conn.tasks.append(relay)
            if watch:
                conn.watch_stream = relay
            try:
                await relay
            except asyncio.CancelledError:
                if not (watch and conn.ending):
                    raise
                # Ended by expire_watches(): close the stream as the server would, at a
                # chunk boundary (only whole chunks are relayed).
                conn.client.write(b"0\r\n\r\n")
                await conn.client.drain()
                return
            finally:
                conn.tasks.remove(relay)

    @staticmethod
    async def _response(ureader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        head = await ureader.readuntil(b"\r\n\r\n")
        cwriter.write(head)
        headers = {
            n.strip().lower(): v.strip()
            for n, _, v in (h.partition(b":") for h in head.split(b"\r\n")[1:] if h)
        }
        if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            while True:
                size_line = await ureader.readuntil(b"\r\n")
                size = int(size_line.split(b";")[0].strip(), 16)
                data = await ureader.readexactly(size + 2)  # the chunk and its CRLF
                cwriter.write(size_line + data)
                await cwriter.drain()
                if size == 0:
                    return
        length = int(headers.get(b"content-length", b"0"))
        remaining = length
        while remaining:
            data = await ureader.read(min(remaining, _CHUNK))
            if not data:
                raise asyncio.IncompleteReadError(b"", remaining)
            cwriter.write(data)
            remaining -= len(data)
        await cwriter.drain()


def proxied_kubeconfig(kubeconfig: Path, proxy_url: str, out: Path) -> Path:
    """A copy of ``kubeconfig`` whose clusters name ``proxy_url`` as their server."""
    cfg = yaml.safe_load(kubeconfig.read_text())
    for c in cfg["clusters"]:
        c["cluster"]["server"] = proxy_url
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    with contextlib.suppress(OSError):
        out.chmod(0o600)
    return out
