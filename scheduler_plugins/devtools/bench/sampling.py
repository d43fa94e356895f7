"""Measurements taken at named marks of a phase: CPU time and peak RSS of every process
(/proc), the plugin server's latency histograms (its /metrics), kube-scheduler's own
scheduling-cycle histograms (its /metrics) and the apiserver's request counters
(``apiserver_request_total``)."""

from __future__ import annotations

import ssl
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import structlog

from api.errors import TesseraError
from api.kube.client import KubeClient
from scheduler_plugins.devtools.bench import procstat, promtext

log = structlog.get_logger(__name__)

API_REQUESTS: Final = "apiserver_request_total"
API_REQUEST_LABELS: Final = ("verb", "resource", "subresource")
WATCH_EVENTS: Final = "apiserver_watch_events_total"  # events sent, summed over watchers
WATCH_EVENT_LABELS: Final = ("resource", "kind")  # "kind" before Kubernetes 1.32
# kube-scheduler's own: a pod's attempt (its scheduling cycle and its binding), the cycle's
# algorithm (PreFilter to picking the node), and each extension point.
ATTEMPT: Final = "scheduler_scheduling_attempt_duration_seconds"
ALGORITHM: Final = "scheduler_scheduling_algorithm_duration_seconds"
EXTENSION_POINT: Final = "scheduler_framework_extension_point_duration_seconds"
CYCLE_POINTS: Final = ("PreFilter", "Filter", "PreScore", "Score", "Reserve", "Permit")
CYCLE_CALLS: Final = "tessera_scheduler_cycle_calls_total"

Json = dict[str, Any]


@dataclass
class Sampler:
    """At named marks: CPU/RSS of processes, the plugin server's histograms and the
    apiserver's request counters."""

    pids: Callable[[], dict[str, int]]  # looked up at every mark: processes get restarted
    metrics_url: str | None
    api: KubeClient | None = None
    # kube-scheduler's /metrics; a scrape that fails (the scheduler is paused) is left out
    scheduler_metrics_url: str | None = None
    scheduler_scrapes: dict[str, list[promtext.Histogram]] = field(default_factory=dict)
    marks: dict[str, dict[str, procstat.ProcSample]] = field(default_factory=dict)
    scrapes: dict[str, list[promtext.Histogram]] = field(default_factory=dict)
    requests: dict[str, dict[promtext.Labels, float]] = field(default_factory=dict)
    watch_events: dict[str, dict[promtext.Labels, float]] = field(default_factory=dict)
    # the plugin server's Cycle calls by whether another call's message carried them
    cycle_calls: dict[str, dict[promtext.Labels, float]] = field(default_factory=dict)
    metrics_error: str | None = None

    def mark(self, name: str, *, procs: bool = True, scrapes: bool = True) -> None:
        """Record mark ``name``: the processes' CPU/RSS (``procs``) and the plugin server's
        histograms and apiserver counters (``scrapes``), each part alone when asked, so a
        phase can scrape before it starts a process and sample the process after."""
        if procs:
            self.marks[name] = {
                c: s for c, pid in self.pids().items() if (s := procstat.sample(pid)) is not None
            }
        if scrapes:
            self._scrape(name)

    def _scrape(self, name: str) -> None:
        if self.scheduler_metrics_url is not None:
            try:
                text = _http_text(self.scheduler_metrics_url, insecure=True)
                self.scheduler_scrapes[name] = [
                    h
                    for h in promtext.histograms(promtext.parse(text))
                    if h.name in (ATTEMPT, ALGORITHM, EXTENSION_POINT)
                ]
            except (OSError, TesseraError) as e:
                log.debug("bench.scheduler_metrics_failed", mark=name, error=str(e))
        if self.metrics_url is not None:
            try:
                samples = promtext.parse(_http_text(self.metrics_url))
                self.scrapes[name] = promtext.histograms(samples)
                self.cycle_calls[name] = promtext.counter_totals(samples, CYCLE_CALLS, ("carried",))
            except (OSError, TesseraError) as e:
                self.metrics_error = f"{self.metrics_url}: {e}"
        if self.api is not None:
            for attempt in (1, 2):  # probe() does not retry a keep-alive the server closed
                try:
                    status, text = self.api.probe("/metrics")
                except TesseraError as e:
                    if attempt == 2:
                        log.warning("bench.apiserver_metrics_failed", error=str(e))
                    continue
                if status == 200:
                    samples = list(promtext.parse(text))
                    self.requests[name] = promtext.counter_totals(
                        samples, API_REQUESTS, API_REQUEST_LABELS
                    )
                    self.watch_events[name] = promtext.counter_totals(
                        samples, WATCH_EVENTS, WATCH_EVENT_LABELS
                    )
                break

    def requests_json(self, a: str, b: str, per: int) -> list[Json]:
        """Apiserver requests between two marks by verb and resource, most first."""
        if a not in self.requests or b not in self.requests:
            return []
        before, after = self.requests[a], self.requests[b]
        rows = []
        for labels, total in after.items():
            n = total - before.get(labels, 0.0)
            if n >= 1:
                row: Json = dict(labels)
                row["count"] = int(n)
                row["per_pod"] = round(n / per, 2) if per else None
                rows.append(row)
        return sorted(rows, key=lambda r: -int(r["count"]))

    def watch_events_json(self, a: str, b: str, per: int) -> dict[str, float]:
        """Watch events the apiserver sent (every watcher's copy) between two marks, per
        ``per`` pods, by resource."""
        if a not in self.watch_events or b not in self.watch_events or not per:
            return {}
        before, after = self.watch_events[a], self.watch_events[b]
        out: dict[str, float] = {}
        for labels, total in after.items():
            n = total - before.get(labels, 0.0)
            resource = next((v for _, v in labels if v), "")
            if n >= 1 and resource:
                out[resource] = round(out.get(resource, 0.0) + n / per, 2)
        return dict(sorted(((r, v) for r, v in out.items() if v > 0), key=lambda kv: -kv[1]))

    def cpu_between(self, a: str, b: str) -> dict[str, float]:
        """CPU seconds each process used between two marks (the same process at both)."""
        later = self.marks.get(b, {})
        return {
            c: round(later[c].cpu_s - s.cpu_s, 2)
            for c, s in self.marks.get(a, {}).items()
            if c in later and later[c].pid == s.pid
        }

    def components_json(self, first: str, last: str, main: tuple[str, str] | None) -> Json:
        """Each process at ``last``: CPU since ``first`` (or since the first mark it was
        seen at, when it was restarted in between), in ``main``, and its peak RSS."""
        out: Json = {}
        cpu_main = self.cpu_between(*main) if main else {}
        names = list(self.marks)
        since = names[names.index(first) :] if first in names else names
        for c, s in self.marks.get(last, {}).items():
            start = next((m for m in since if (p := self.marks[m].get(c)) and p.pid == s.pid), last)
            out[c] = {
                "pid": s.pid,
                "cpu_s": self.cpu_between(start, last).get(c),
                "cpu_since": start,
                "cpu_s_main": cpu_main.get(c),
                "rss_mib": round(s.rss_kib / 1024, 1),
                "peak_rss_mib": round(s.hwm_kib / 1024, 1),
                "threads": s.threads,
            }
        return out

    def cycle_messages_json(self, a: str, b: str) -> Json:
        """The plugin server's Cycle stream between two marks: the messages (a call each),
        and the calls they carried besides (the shim's Reserves sent with the next
        PreFilter); {} without both scrapes."""
        if a not in self.cycle_calls or b not in self.cycle_calls:
            return {}
        before, after = self.cycle_calls[a], self.cycle_calls[b]

        def delta(carried: str) -> int:
            key = (("carried", carried),)
            return int(after.get(key, 0.0) - before.get(key, 0.0))

        return {"messages": delta("false"), "carried": delta("true")}

    def histograms_json(self, a: str, b: str) -> list[Json]:
        if a not in self.scrapes or b not in self.scrapes:
            return []
        out: list[Json] = []
        for h in self.scrapes[b]:
            d = h.minus(promtext.find(self.scrapes[a], h.name, h.labels))
            if d.count <= 0:
                continue
            scale = 1000.0 if h.name.endswith("_seconds") else 1.0
            qs = {f"p{int(q * 100)}": d.quantile(q) for q in (0.5, 0.9, 0.99)}
            mean = d.mean()
            out.append(
                {
                    "name": h.name,
                    "labels": dict(h.labels),
                    "count": int(d.count),
                    "unit": "ms" if scale != 1.0 else "",
                    "mean": round(mean * scale, 3) if mean is not None else None,
                    **{k: (round(v * scale, 3) if v is not None else None) for k, v in qs.items()},
                }
            )
        return out

    def cycle_json(self, a: str, b: str) -> Json:
        """kube-scheduler's scheduling cycles between two marks (all since the scheduler
        started when it was not serving at ``a``), in ms: attempts that scheduled a pod
        (binding included), the algorithm, each extension point's successful runs, and the
        serial cycle's mean (algorithm + Reserve + Permit: what one cycle holds the next
        pod back; binding runs beside it)."""
        if b not in self.scheduler_scrapes:
            return {}
        before = self.scheduler_scrapes.get(a, [])

        def summary(h: promtext.Histogram) -> Json:
            d = h.minus(promtext.find(before, h.name, h.labels))
            out: Json = {"count": int(d.count)}
            for key, v in (("mean", d.mean()), ("p50", d.quantile(0.5)), ("p99", d.quantile(0.99))):
                out[key] = round(v * 1000.0, 3) if v is not None else None
            return out

        out: Json = {}
        points: Json = {}
        for h in self.scheduler_scrapes[b]:
            if h.name == ALGORITHM:
                out["algorithm"] = summary(h)
            elif h.name == ATTEMPT and h.label("result") == "scheduled":
                attempt = summary(h)
                if attempt["count"] > out.get("attempt", {}).get("count", 0):
                    out["attempt"] = attempt  # the profile that scheduled the pods
            elif h.name == EXTENSION_POINT and h.label("status") == "Success":
                point = h.label("extension_point")
                if point in CYCLE_POINTS:
                    s = summary(h)
                    if s["count"] > points.get(point, {}).get("count", 0):
                        points[point] = s
        if points:
            out["extension_points"] = {p: points[p] for p in CYCLE_POINTS if p in points}
        means = [
            (out.get("algorithm") or {}).get("mean"),
            *((points.get(p) or {}).get("mean") for p in ("Reserve", "Permit")),
        ]
        if all(m is not None for m in means):
            out["serial_mean"] = round(sum(m for m in means if m is not None), 3)
        return out


def _http_text(url: str, *, insecure: bool = False) -> str:
    """``url``'s body; ``insecure``: HTTPS with a self-signed certificate (loopback only)."""
    context = None
    if insecure:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    with urllib.request.urlopen(url, timeout=10, context=context) as resp:  # loopback only
        return str(resp.read().decode())
