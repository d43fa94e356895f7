"""When the scheduler's Binding of each pod was committed, from the scheduler's own log.

Both schedulers the benchmark runs are kube-scheduler's code (Tessera's shim embeds it):
once the apiserver has accepted a pod's Binding, it logs at ``-v 2``

    I1202 00:43:03.829351   29312 schedule_one.go:481] "Successfully bound pod to node"
        pod="ns/name" node=...   (one line)

The bench's own watch shows the binding later, by as much as the apiserver and its Python
client fall behind on the cluster's pod events; on two shared cores that lag reached 8 s
mid-drain under Tessera, whose pods have one more update each. The queue drain measures
the scheduler, so it times the commits.
"""

from __future__ import annotations

import re
import time
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Final

_BOUND: Final = re.compile(
    r'^I(\d\d)(\d\d) (\d\d):(\d\d):(\d\d)(\.\d+)?\s+\d+ [^\]]*\] "Successfully bound pod to node"'
    r' pod="([^"/]+)/([^"]+)"'
)
_DAY_S: Final = 86400.0


def committed_at(
    lines: Iterable[str], namespace: str, names: Collection[str], *, now: float
) -> dict[str, float]:
    """Wall-clock time (epoch seconds) of each named pod's first logged binding.

    klog writes local time without a year: the year is ``now``'s, or the one before when
    that would put the line more than a day after ``now`` (a log from late December read
    in January).
    """
    year = time.localtime(now).tm_year
    out: dict[str, float] = {}
    for line in lines:
        m = _BOUND.match(line)
        if m is None:
            continue
        month, day, hour, minute, second, frac, ns, name = m.groups()
        if ns != namespace or name not in names or name in out:
            continue
        fields = (int(month), int(day), int(hour), int(minute), int(second))
        at = _local(year, *fields)
        if at - now > _DAY_S:
            at = _local(year - 1, *fields)
        out[name] = at + float(frac or 0.0)
    return out


def committed_in_log(
    path: Path, namespace: str, names: Collection[str], *, now: float
) -> dict[str, float]:
    """``committed_at`` over a log file; empty when there is no file."""
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            return committed_at(f, namespace, names, now=now)
    except FileNotFoundError:
        return {}


def _local(year: int, month: int, day: int, hour: int, minute: int, second: int) -> float:
    return time.mktime((year, month, day, hour, minute, second, 0, 0, -1))
