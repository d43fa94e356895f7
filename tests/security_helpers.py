"""Helpers of the security tests: the TCP sockets a process listens on (read from ``/proc``,
Linux), and minimal doubles to start the plugin server and the device plugin."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from api.kube.errors import NotFoundError
from node_agent.deviceplugin.types import ContainerAllocation

_LISTEN = "0A"


def _socket_inodes(pid: int) -> set[str]:
    inodes: set[str] = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def _address(hex_ip: str) -> str:
    raw = bytes.fromhex(hex_ip)
    # The kernel prints each 32-bit word in host byte order.
    words = struct.unpack(f"<{len(raw) // 4}I", raw)
    packed = struct.pack(f">{len(words)}I", *words)
    family = socket.AF_INET if len(packed) == 4 else socket.AF_INET6
    return str(ipaddress.ip_address(socket.inet_ntop(family, packed)))


def tcp_listeners(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket ``pid`` listens on, IPv4 and IPv6."""
    inodes = _socket_inodes(pid)
    out: list[tuple[str, int]] = []
    for table in ("tcp", "tcp6"):
        lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != _LISTEN or inode not in inodes:
                continue
            hex_ip, hex_port = local.split(":")
            out.append((_address(hex_ip), int(hex_port, 16)))
    return sorted(out)


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback


class IdleWatch:
    """A watch with no events that ends when closed (or after its timeout)."""

    def __init__(self, timeout_s: float) -> None:
        self._closed = threading.Event()
        self._timeout_s = timeout_s

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self._closed.wait(self._timeout_s)
        return iter(())

    def close(self) -> None:
        self._closed.set()


class IdleKube:
    """An empty cluster: enough for the plugin server to start and be ready."""

    def list(self, path: str) -> dict[str, Any]:
        return {"metadata": {"resourceVersion": "1"}, "items": []}

    def watch(
        self, path: str, resource_version: str | None = None, *, timeout_s: int = 60
    ) -> IdleWatch:
        return IdleWatch(timeout_s)

    def get(self, path: str) -> Any:
        # An API server without the alpha PodGroup API (the gang watch stays off).
        raise NotFoundError("GET", path, 404, "NotFound", "the server could not find it")

    def merge_patch(self, path: str, patch: Any, *, resource_version: str | None = None) -> Any:
        return {}

    def post(self, path: str, body: object) -> Any:
        return {}


class NoAllocations:
    def allocate(self, containers: Any) -> list[ContainerAllocation]:
        return []

    def pre_start(self, device_ids: Any) -> None:
        return None
