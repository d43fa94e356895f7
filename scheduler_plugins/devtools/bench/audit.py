"""API requests by client, from the bench cluster's kube-apiserver audit log.

``apiserver_request_total`` counts requests by verb and resource, every client together. The
apiserver's audit log names the client of each request too (its ``userAgent``: each Tessera
component sends its own, ``tessera-plugin-server``, ``tessera-node-agent``, ``tessera-bench``;
Go components send ``<binary>/<version> …``). The bench cluster's apiserver writes one
``Metadata``-level event per request stage (``AUDIT_POLICY``); ``requests_by_client`` counts
each request once: a watch when its response starts (it may outlive the window), any other
request when it completes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Final

import orjson

Json = dict[str, Any]

# Metadata only (no bodies): who asked what, when. RequestReceived is the same request again.
AUDIT_POLICY: Final = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
- level: Metadata
"""
POLICY_FILE: Final = "audit-policy.yaml"
LOG_FILE: Final = "audit.log"
NO_AGENT: Final = "(no user agent)"


def apiserver_flags(state_dir: Path, log_dir: Path) -> list[str]:
    """kube-apiserver flags writing the audit log to ``log_dir`` (the policy file is written
    to ``state_dir``). Blocking mode: an event is in the file before its response is sent,
    so the log read after a window holds every request of it."""
    policy = state_dir / POLICY_FILE
    policy.write_text(AUDIT_POLICY)
    return [
        f"--audit-policy-file={policy}",
        f"--audit-log-path={log_dir / LOG_FILE}",
        "--audit-log-format=json",
        "--audit-log-mode=blocking",
    ]


def client_of(user_agent: object) -> str:
    """The product a user agent names (``kube-scheduler/v1.36.0 (linux/amd64) …`` →
    ``kube-scheduler``)."""
    if not isinstance(user_agent, str) or not user_agent.strip():
        return NO_AGENT
    return user_agent.strip().split("/", 1)[0].split(" ", 1)[0]


@dataclass(frozen=True)
class ByClient:
    """Requests counted by (client, verb, what), and the log lines that were not audit
    events (counted, not fatal: a half-written last line, say)."""

    counts: Counter[tuple[str, str, str]]
    unreadable: int

    def rows(self, per: int) -> list[Json]:
        """Most first; ``per_pod`` divides by ``per`` bound pods."""
        return [
            {
                "client": client,
                "verb": verb,
                "resource": what,
                "count": n,
                "per_pod": round(n / per, 2) if per else None,
            }
            for (client, verb, what), n in sorted(self.counts.items(), key=lambda kv: -kv[1])
        ]


def _what(event: Json) -> str:
    """``resource[/subresource]``, or the path of a non-resource request."""
    ref = event.get("objectRef")
    if isinstance(ref, dict) and ref.get("resource"):
        sub = ref.get("subresource")
        return f"{ref['resource']}/{sub}" if sub else str(ref["resource"])
    uri = event.get("requestURI")
    return str(uri).split("?", 1)[0] if isinstance(uri, str) else "?"


def _counted(event: Json) -> bool:
    stage, verb = event.get("stage"), event.get("verb")
    return stage == ("ResponseStarted" if verb == "watch" else "ResponseComplete")


def _when(event: Json) -> float | None:
    stamp = event.get("requestReceivedTimestamp")
    if not isinstance(stamp, str):
        return None
    try:
        return datetime.fromisoformat(stamp).timestamp()
    except ValueError:
        return None


def count_lines(lines: Iterable[bytes], start: float, end: float) -> ByClient:
    """Requests received in [``start``, ``end``] (wall clock, seconds) by client, verb and
    resource, from audit log lines."""
    counts: Counter[tuple[str, str, str]] = Counter()
    unreadable = 0
    for line in lines:
        if not line.strip():
            continue
        try:
            event = orjson.loads(line)
        except orjson.JSONDecodeError:
            unreadable += 1
            continue
        if not isinstance(event, dict) or event.get("kind") != "Event":
            unreadable += 1
            continue
        if not _counted(event):
            continue
        when = _when(event)
        if when is None:
            unreadable += 1
            continue
        if start <= when <= end:
            verb = str(event.get("verb") or "?")
            counts[(client_of(event.get("userAgent")), verb, _what(event))] += 1
    return ByClient(counts, unreadable)


def requests_by_client(log_dir: Path, start: float, end: float) -> ByClient | None:
    """``count_lines`` of the audit log in ``log_dir``; None when there is none (audit off)."""
    path = log_dir / LOG_FILE
    if not path.is_file():
        return None
    with path.open("rb") as f:
        return count_lines(f, start, end)
