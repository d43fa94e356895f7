"""/proc parsing of the cluster benchmark (CPU time, peak RSS)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from scheduler_plugins.devtools.bench.procstat import (
    ProcFormatError,
    parse_stat,
    parse_status,
    sample,
)

# comm with spaces and parentheses; utime=250, stime=150 ticks (fields 14, 15)
STAT = "4242 (python3 (x) y) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 150 0 0 20 0 9 0 1234 0 0"
STATUS = """Name:\tpython3
VmPeak:\t  900000 kB
VmHWM:\t  524288 kB
VmRSS:\t  262144 kB
Threads:\t9
"""


def test_parse_stat_adds_user_and_system_time() -> None:
    assert parse_stat(STAT, ticks_per_s=100) == pytest.approx(4.0)


@pytest.mark.parametrize("text", ["no parens here", "1 (x) S 1 2 3", "1 (x) S " + "a " * 20])
def test_parse_stat_rejects(text: str) -> None:
    with pytest.raises(ProcFormatError):
        parse_stat(text, ticks_per_s=100)


def test_parse_status() -> None:
    assert parse_status(STATUS) == (262144, 524288, 9)
    with pytest.raises(ProcFormatError, match="VmHWM"):
        parse_status("Name:\tx\nVmRSS:\t1 kB\n")


def test_sample_of_this_process(tmp_path: Path) -> None:
    s = sample(os.getpid())
    assert s is not None
    assert s.pid == os.getpid() and s.cpu_s > 0 and s.hwm_kib >= s.rss_kib > 0
    assert s.threads >= 1


def test_sample_of_a_gone_process(tmp_path: Path) -> None:
    assert sample(4242, proc=tmp_path) is None
