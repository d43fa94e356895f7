"""CPU time and memory of a process, from ``/proc/<pid>/stat`` and ``/proc/<pid>/status``.

``parse_stat`` and ``parse_status`` are pure (tests feed them text); ``sample`` reads a live
process. CPU time is user + system of every thread of the process (not its children).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from api.errors import InvalidInputError

CLOCK_TICKS: Final = os.sysconf("SC_CLK_TCK")


class ProcFormatError(InvalidInputError):
    """A /proc file does not look like one."""


@dataclass(frozen=True)
class ProcSample:
    """One reading of a process."""

    pid: int
    cpu_s: float  # user + system, all threads
    rss_kib: int  # VmRSS
    hwm_kib: int  # VmHWM: peak resident set size so far
    threads: int


def parse_stat(text: str, *, ticks_per_s: int = CLOCK_TICKS) -> float:
    """User + system CPU seconds (fields 14 and 15) of a ``/proc/<pid>/stat`` line."""
    # Field 2 (comm) may hold spaces and parentheses: split after the last ')'.
    close = text.rfind(")")
    if close < 0:
        raise ProcFormatError(f"not a /proc/PID/stat line: {text[:80]!r}")
    rest = text[close + 2 :].split()
    if len(rest) < 13:
        raise ProcFormatError(f"/proc/PID/stat line too short: {text[:80]!r}")
    try:
        utime, stime = int(rest[11]), int(rest[12])
    except ValueError:
        raise ProcFormatError(f"/proc/PID/stat utime/stime not integers: {text[:80]!r}") from None
    return (utime + stime) / ticks_per_s


def parse_status(text: str) -> tuple[int, int, int]:
    """(VmRSS KiB, VmHWM KiB, Threads) of a ``/proc/<pid>/status`` text."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    try:
        rss = int(fields["VmRSS"].split()[0])
        hwm = int(fields["VmHWM"].split()[0])
        threads = int(fields["Threads"])
    except (KeyError, IndexError, ValueError) as e:
        raise ProcFormatError(f"/proc/PID/status lacks VmRSS/VmHWM/Threads ({e!r})") from None
    return rss, hwm, threads


def sample(pid: int, *, proc: Path = Path("/proc")) -> ProcSample | None:
    """The process's CPU time and memory now; None when it is gone."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
        status = (proc / str(pid) / "status").read_text()
    except OSError:
        return None
    rss, hwm, threads = parse_status(status)
    return ProcSample(pid=pid, cpu_s=parse_stat(stat), rss_kib=rss, hwm_kib=hwm, threads=threads)


def load_average() -> tuple[float, float, float]:
    one, five, fifteen = os.getloadavg()
    return one, five, fifteen
