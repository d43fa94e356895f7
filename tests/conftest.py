"""Fixtures the node-agent tests share: a short temp dir for the kubelet's sockets, the fake
kubelet in it, and a check that a test leaves no thread behind."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fake_kubelet import FakeKubelet


@pytest.fixture
def plugin_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="na-"))  # short: Unix socket paths max 107 bytes
    yield d
    shutil.rmtree(d)


@pytest.fixture
def kubelet(plugin_dir: Path) -> Iterator[FakeKubelet]:
    k = FakeKubelet(plugin_dir)
    yield k
    k.stop()


@pytest.fixture
def no_leaked_threads() -> Iterator[None]:
    """Every thread a test started has ended (``pytestmark = usefixtures(...)``)."""
    before = set(threading.enumerate())
    yield
    # grpc sets a server's shutdown event a moment before its own helper threads return
    # (``_serve``, ``cancel_all_calls_after_grace``): allow finishing, not lingering.
    deadline = time.monotonic() + 3.0
    for t in set(threading.enumerate()) - before:
        t.join(max(0.0, deadline - time.monotonic()))
    leaked = [t.name for t in threading.enumerate() if t not in before]
    assert leaked == []
