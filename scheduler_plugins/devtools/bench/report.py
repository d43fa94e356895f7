"""The benchmark's results on disk: ``<name>.json`` (everything measured), ``<name>.md`` (the
tables a reader wants) and ``<name>-*.png`` plots (matplotlib, Agg backend).

Works on the JSON dict the runner builds, so a saved JSON can be rendered again
(``write_report(json.load(...), ...)``).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

Json = Mapping[str, Any]

TESSERA: Final = "tessera"
STOCK: Final = "stock"
MIB_PER_GIB: Final = 1024
DECISION_METRIC: Final = "tessera_scheduler_decision_duration_seconds"
DECISION_CPU_METRIC: Final = "tessera_scheduler_decision_cpu_seconds"
RPC_SERIES: Final = "tessera_scheduler_rpc_duration_seconds"
COLORS: Final = {TESSERA: "C0", STOCK: "C1"}


@dataclass(frozen=True)
class Target:
    what: str
    measured: float | None
    limit: float
    higher_is_better: bool

    @property
    def met(self) -> bool | None:
        if self.measured is None:
            return None
        return self.measured >= self.limit if self.higher_is_better else self.measured <= self.limit

    def to_json(self) -> dict[str, Any]:
        return {"what": self.what, "measured": self.measured, "limit": self.limit, "met": self.met}


def _run(result: Json, nodes: int) -> Json | None:
    runs: list[Json] = result.get("runs", [])
    return next((r for r in runs if r.get("nodes") == nodes), None)


def decision_series(phase: Json) -> Json | None:
    """The plugin server's decision latency histogram (one ``decide`` per PreFilter), else
    its PreFilter RPC histogram, if scraped."""
    series: list[Json] = phase.get("plugin_rpc") or []
    for h in series:
        if h.get("name") == DECISION_METRIC:
            return h
    for h in series:
        if (h.get("labels") or {}).get("method") == "PreFilter" and (h.get("labels") or {}).get(
            "code", "OK"
        ) in ("OK", "ok"):
            return h
    return None


def targets(result: Json) -> list[Target]:
    """The benchmark's goals, evaluated on the node counts this run covered."""
    out: list[Target] = []
    for nodes, limit in ((1000, 0.8), (5000, 0.6)):
        run = _run(result, nodes)
        ratio = (run or {}).get("ratio") or {}
        if ratio:
            drained = ratio.get("drain_throughput") is not None
            out.append(
                Target(
                    f"Tessera throughput ≥ {limit}× stock at {nodes} nodes "
                    f"({'queue drain' if drained else 'streamed workload'})",
                    ratio.get("drain_throughput") if drained else ratio.get("throughput"),
                    limit,
                    True,
                )
            )
    big = _run(result, 5000)
    tessera = (big or {}).get("phases", {}).get(TESSERA)
    if tessera:
        series = decision_series(tessera)
        out.append(
            Target(
                "p99 plugin decision (PreFilter) ≤ 10 ms at 5000 nodes",
                series.get("p99") if series else None,
                10.0,
                False,
            )
        )
        cpu = next(
            (h for h in tessera.get("plugin_rpc") or [] if h.get("name") == DECISION_CPU_METRIC),
            None,
        )
        if cpu is not None:
            out.append(
                Target(
                    "p99 plugin decision CPU time ≤ 10 ms at 5000 nodes (the deciding thread's; "
                    "the wall-clock row includes waiting for a CPU on a saturated machine)",
                    cpu.get("p99"),
                    10.0,
                    False,
                )
            )
        server = (tessera.get("components") or {}).get("plugin-server") or {}
        out.append(
            Target(
                f"plugin server peak RSS ≤ 1 GiB at 5000 nodes / {big['pods'] if big else 0} pods",
                server.get("peak_rss_mib"),
                1.0 * MIB_PER_GIB,
                False,
            )
        )
    return out


# Markdown -------------------------------------------------------------------------------------


def _fmt(v: object) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.1f}" if abs(v) >= 10 else f"{v:.3g}"  # ratios and small ms keep digits
    return str(v)


def _rate(rate: object) -> str:
    return f"at most {rate} pods/s" if rate else "as fast as they can"


def _table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]
    return [*lines, ""]


def _phases(result: Json) -> Iterable[tuple[Json, str, Json]]:
    for run in result.get("runs", []):
        for name, phase in (run.get("phases") or {}).items():
            yield run, name, phase


def markdown(result: Json, plots: Sequence[str]) -> str:
    opts = result.get("options") or {}
    host = result.get("host") or {}
    lines = [
        "# Tessera cluster benchmark: Tessera vs. the stock kube-scheduler on kwok nodes",
        "",
        f"Run {result.get('started', '?')} – {result.get('finished', 'unfinished')} on "
        f"{host.get('cpus', '?')} CPUs (load average before {host.get('load_before')}, after "
        f"{host.get('load_after')}). Seed {opts.get('seed')}, mix {opts.get('mix')}"
        f"{_replicas(opts.get('replicas'))}, "
        f"{opts.get('create_workers')} client threads creating pods "
        f"({_rate(opts.get('rate'))}); Tessera's node policy: "
        f"{opts.get('node_policy') or 'cluster default (binpack)'}; admission webhook: "
        f"{'on' if opts.get('webhook') else 'off'}.",
        "",
        "Latency is client-side: from sending a pod's create to the watch showing it bound.",
        "Throughput is bound pods ÷ (last binding − first create); *steady* is the mean rate",
        "over the middle 80% of the busy seconds. The stock scheduler places the same pods",
        "asking plain resources only (cpu, memory, a `nvidia.com/gpu` slot count).",
        "",
        "## Main workload",
        "",
    ]
    rows = []
    for run, name, ph in _phases(result):
        m = ph.get("main") or {}
        lat = m.get("latency_ms") or {}
        alloc = m.get("allocation_ms") or {}
        rows.append(
            [
                run["nodes"],
                run["pods"],
                name,
                m.get("bound"),
                m.get("pending"),
                m.get("throughput_pods_per_s"),
                m.get("steady_pods_per_s"),
                m.get("create_rate_pods_per_s"),
                lat.get("p50_ms"),
                lat.get("p90_ms"),
                lat.get("p99_ms"),
                alloc.get("p50_ms"),
                alloc.get("p99_ms"),
            ]
        )
    lines += _table(
        [
            "nodes",
            "pods",
            "scheduler",
            "bound",
            "pending",
            "pods/s",
            "steady pods/s",
            "create/s",
            "p50 ms",
            "p90 ms",
            "p99 ms",
            "agent p50 ms",
            "agent p99 ms",
        ],
        rows,
    )
    lines += ["*agent*: binding → node agent's `bind-phase: success` (Tessera only).", ""]
    lines += _drain_section(result)
    ratio_rows = [
        [
            run["nodes"],
            (run.get("ratio") or {}).get("drain_throughput"),
            (run.get("ratio") or {}).get("throughput"),
            (run.get("ratio") or {}).get("steady_throughput"),
            (run.get("ratio") or {}).get("latency_p50_ms"),
            (run.get("ratio") or {}).get("latency_p99_ms"),
        ]
        for run in result.get("runs", [])
        if run.get("ratio")
    ]
    if ratio_rows:
        lines += ["## Tessera ÷ stock", ""]
        lines += _table(
            [
                "nodes",
                "drain throughput",
                "streamed throughput",
                "streamed steady",
                "p50 latency",
                "p99 latency",
            ],
            ratio_rows,
        )
    goals = targets(result)
    if goals:
        lines += ["## Targets", ""]
        lines += _table(["target", "measured", "met"], [[t.what, t.measured, t.met] for t in goals])
    errors = [
        f"- {run['nodes']} nodes, {name}: {ph['error']}"
        for run, name, ph in _phases(result)
        if ph.get("error")
    ]
    if errors:
        lines += ["## Errors", "", "These phases stopped early; what they measured is kept.", ""]
        lines += [*errors, ""]
    lines += _plugin_section(result)
    lines += _components_section(result)
    lines += _requests_section(result)
    lines += _clients_section(result)
    lines += _concurrency_section(result)
    lines += _churn_section(result)
    lines += _check_section(result)
    lines += _pending_section(result)
    if plots:
        lines += ["## Plots", ""]
        lines += [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
        lines.append("")
    return "\n".join(lines)


def _drain_section(result: Json) -> list[str]:
    rows = []
    for run, name, ph in _phases(result):
        d = ph.get("drain")
        if not d:
            continue
        cpu = d.get("cpu_ms_per_pod") or {}
        top = sorted(cpu.items(), key=lambda kv: -kv[1])[:4]
        rows.append(
            [
                run["nodes"],
                name,
                d["pods"],
                d["bound"],
                d.get("first_bound_s"),
                d.get("drain_s"),
                d.get("drain_pods_per_s"),
                d.get("steady_pods_per_s"),
                d.get("bound_times", "watch"),
                d.get("watched_pods_per_s"),
                d.get("watch_lag_last_s"),
                ", ".join(f"{c} {v:.1f}" for c, v in top),
            ]
        )
    if not rows:
        return []
    return [
        "## Queue drain (scheduler throughput)",
        "",
        "Pods created while the scheduler was stopped, then the scheduler started: pods/s is",
        "bound pods ÷ (last − first binding), with no client creating pods at the same time.",
        "A binding's time is when the scheduler logged it committed (*scheduler log*; both",
        "schedulers are kube-scheduler's code at `-v 2`), else when the bench's watch showed",
        "it. *watched pods/s*: the same from the watch, which trails the commits by as much",
        "as the cluster's pod event stream is behind (*watch lag*: at the last binding).",
        "*CPU ms per pod*, and the API requests below, count from the scheduler's start until",
        "every bound pod runs (kwok writes a pod's status after its binding) and, for",
        "Tessera, its node agent answered: what the pods cost the cluster, not only the part",
        "done before the last binding.",
        "",
        *_table(
            [
                "nodes",
                "scheduler",
                "pods",
                "bound",
                "first bound s",
                "drained s",
                "pods/s",
                "steady pods/s",
                "bound times",
                "watched pods/s",
                "watch lag s",
                "CPU ms per pod (top processes)",
            ],
            rows,
        ),
        *_waits_table(result),
        *_cycle_table(result),
        *_cycle_messages(result),
    ]


def _cycle_messages(result: Json) -> list[str]:
    """Per drain: the messages of Tessera's Cycle stream and the Reserves they carried."""
    lines = []
    for run, name, ph in _phases(result):
        m = (ph.get("drain") or {}).get("cycle_messages")
        if not m:
            continue
        calls = m["messages"] + m["carried"]
        share = f" ({100 * m['carried'] / calls:.0f} % of the calls)" if calls else ""
        lines.append(
            f"- {run['nodes']} nodes, {name}: {m['messages']} messages on the plugin "
            f"server's Cycle stream carried {calls} calls; {m['carried']} of them{share} "
            "came in another's message (a Reserve sent with the next PreFilter)."
        )
    return ["", *lines] if lines else []


def _waits_table(result: Json) -> list[str]:
    """Per drain: GPU nodes used next to the core's offline placement of the same pods, and
    Tessera's PreBind waits (pods handed their annotations at Reserve never call PreBind)."""
    rows = []
    for run, name, ph in _phases(result):
        d = ph.get("drain")
        if not d or "nodes_used" not in d:
            continue
        waited: Json = {}
        not_yet = 0
        for h in d.get("plugin_rpc") or []:
            labels = h.get("labels") or {}
            if h.get("name") != RPC_SERIES or labels.get("method") != "PreBind":
                continue
            if labels.get("code") == "OK":
                waited = h
            elif labels.get("code") == "RESOURCE_EXHAUSTED":
                not_yet += int(h.get("count") or 0)
        bound = d.get("bound") or 0
        tessera = name == TESSERA
        rows.append(
            [
                run["nodes"],
                name,
                d["nodes_used"],
                run.get("offline_nodes_used", "–"),
                waited.get("count", 0) if tessera else "–",
                _ms_as_s(waited.get("p50")) if tessera else "–",
                _ms_as_s(waited.get("p99")) if tessera else "–",
                round(not_yet / bound, 3) if tessera and bound else "–",
            ]
        )
    if not rows:
        return []
    return [
        "",
        "*GPU nodes*: nodes holding the drain's GPU pods; *offline*: the same pods placed one",
        "after another by Tessera's core on an empty cluster (the cluster default policy).",
        "*waited*: PreBinds that waited for an ambiguous pod on their node (a pod handed its",
        "annotations at Reserve never calls PreBind); *not yet*: PreBind answers telling the",
        "shim to ask again, per bound pod.",
        "",
        *_table(
            [
                "nodes",
                "scheduler",
                "GPU nodes",
                "offline",
                "waited",
                "wait p50 s",
                "wait p99 s",
                "not yet per pod",
            ],
            rows,
        ),
    ]


CYCLE_POINTS: Final = ("PreFilter", "Filter", "Score", "Reserve", "Permit")


def _cycle_table(result: Json) -> list[str]:
    """Per drain: kube-scheduler's own histograms of its serial scheduling cycle, with
    Tessera's over stock's in the same run."""
    rows = []
    for (run, name, ph), workload in itertools.product(_phases(result), ("drain", "main")):
        cycle = (ph.get(workload) or {}).get("scheduling_cycle") or {}
        if not cycle.get("attempt"):
            continue
        points = cycle.get("extension_points") or {}
        stock_phase = ((run.get("phases") or {}).get(STOCK) or {}).get(workload) or {}
        stock = stock_phase.get("scheduling_cycle") or {}
        ratio = "–"
        if name == TESSERA and cycle.get("serial_mean") and stock.get("serial_mean"):
            ratio = f"{cycle['serial_mean'] / stock['serial_mean']:.2f}×"
        rows.append(
            [
                run["nodes"],
                name,
                workload,
                cycle["attempt"].get("count"),
                cycle.get("serial_mean", "–"),
                ratio,
                (cycle.get("algorithm") or {}).get("p50", "–"),
                *((points.get(p) or {}).get("p50", "–") for p in CYCLE_POINTS),
                cycle["attempt"].get("p50"),
            ]
        )
    if not rows:
        return []
    return [
        "",
        "*Scheduling cycle*: kube-scheduler's own histograms over the queue drain and over the",
        "streamed workload (*main*, whose cores are not all busy at a low rate; both schedulers",
        "serve their /metrics), in ms. *serial mean*: the part of a cycle that holds the next",
        "pod back, the mean of `scheduler_scheduling_algorithm_duration_seconds` (PreFilter to",
        "picking the node) plus Reserve's and Permit's (binding runs beside it); *vs stock*:",
        "Tessera's over stock's in the same run. p50s are bucket-interpolated; *attempt*:",
        "`scheduler_scheduling_attempt_duration_seconds` of scheduled pods, which includes",
        "the binding (the API write, queued behind the saturated apiserver).",
        "",
        *_table(
            [
                "nodes",
                "scheduler",
                "workload",
                "cycles",
                "serial mean ms",
                "vs stock",
                "algorithm p50 ms",
                *(f"{p} p50 ms" for p in CYCLE_POINTS),
                "attempt p50 ms",
            ],
            rows,
        ),
    ]


def _ms_as_s(ms: object) -> object:
    return round(float(ms) / 1000.0, 2) if isinstance(ms, (int, float)) else "–"


def _plugin_section(result: Json) -> list[str]:
    rows = []
    notes = []
    for run, name, ph in _phases(result):
        if name != TESSERA:
            continue
        drained = (ph.get("drain") or {}).get("plugin_rpc") or []
        for workload, series in (("drain", drained), ("main", ph.get("plugin_rpc") or [])):
            for h in series:
                labels = sorted((h.get("labels") or {}).items())
                label = ",".join(f"{k}={v}" for k, v in labels)
                rows.append(
                    [
                        run["nodes"],
                        workload,
                        f"{h['name']}{{{label}}}",
                        h["count"],
                        h.get("mean"),
                        h.get("p50"),
                        h.get("p90"),
                        h.get("p99"),
                    ]
                )
        if not ph.get("plugin_rpc"):
            why = ph.get("metrics_error") or (
                "the plugin server served no /metrics in this run"
                if not ph.get("metrics_url")
                else "no histogram observations"
            )
            notes.append(f"- {run['nodes']} nodes: no RPC histograms ({why}).")
    out = ["## Plugin server RPCs", ""]
    if rows:
        out += [
            "Per workload: the queue drain (a PreBind told to ask again counts once per",
            "call) and the streamed main workload.",
            "",
        ]
        out += _table(["nodes", "workload", "series", "count", "mean", "p50", "p90", "p99"], rows)
        out += ["Units: ms for `*_seconds` histograms.", ""]
    out += notes
    return [*out, ""] if notes else out


def _components_section(result: Json) -> list[str]:
    rows = []
    for run, name, ph in _phases(result):
        bound = (ph.get("main") or {}).get("bound") or 0
        for comp, c in sorted((ph.get("components") or {}).items()):
            main_cpu = c.get("cpu_s_main")
            per_pod = main_cpu * 1000.0 / bound if main_cpu is not None and bound else None
            rows.append(
                [run["nodes"], name, comp, c.get("cpu_s"), main_cpu, per_pod, c.get("peak_rss_mib")]
            )
    if not rows:
        return []
    return [
        "## CPU and memory by process",
        "",
        *_table(
            [
                "nodes",
                "scheduler",
                "process",
                "CPU s (phase)",
                "CPU s (main)",
                "CPU ms / bound pod",
                "peak RSS MiB",
            ],
            rows,
        ),
    ]


def _requests_section(result: Json, top: int = 8) -> list[str]:
    rows = []
    for run, name, ph in _phases(result):
        drained = (ph.get("drain") or {}).get("api_requests")
        for r in (drained or ph.get("api_requests") or [])[:top]:
            what = f"{r.get('verb')} {r.get('resource')}"
            if r.get("subresource"):
                what += f"/{r['subresource']}"
            rows.append([run["nodes"], name, what, r["count"], r.get("per_pod")])
        for resource, per_pod in (
            (ph.get("drain") or {}).get("watch_events_per_pod") or {}
        ).items():
            rows.append([run["nodes"], name, f"watch events sent: {resource}", "–", per_pod])
    if not rows:
        return []
    return [
        "## API requests per bound pod",
        "",
        "From the apiserver's `apiserver_request_total`, every client together (scheduler,",
        "plugin server, node agent, kwok), during the queue drain until every pod runs (no",
        "creates in it; the streamed workload when there was no drain). *Watch events sent*:",
        "its `apiserver_watch_events_total`, every watcher's copy counted (drain only).",
        "",
        *_table(["nodes", "scheduler", "request", "count", "per bound pod"], rows),
    ]


def _clients_section(result: Json, top: int = 12) -> list[str]:
    rows = []
    for run, name, ph in _phases(result):
        for r in ((ph.get("drain") or {}).get("api_requests_by_client") or [])[:top]:
            rows.append(
                [
                    run["nodes"],
                    name,
                    r["client"],
                    f"{r['verb']} {r['resource']}",
                    r["count"],
                    r.get("per_pod"),
                ]
            )
    if not rows:
        return []
    return [
        "## API requests per bound pod by client",
        "",
        "From the apiserver's audit log (one event per request, its `userAgent` naming the",
        "client), over the same window as the table above; the bench's own watch and reads",
        "are *tessera-bench*. Off with `--no-audit`.",
        "",
        *_table(["nodes", "scheduler", "client", "request", "count", "per bound pod"], rows),
    ]


def _concurrency_section(result: Json) -> list[str]:
    rows = []
    for run, name, ph in _phases(result):
        for b in ph.get("node_concurrency") or []:
            offsets = b.get("bound_offsets_s") or []
            rows.append(
                [
                    run["nodes"],
                    name,
                    b["what"],
                    f"{b['bound']}/{b['pods']}",
                    b.get("all_bound_s"),
                    b.get("all_allocated_s"),
                    " ".join(f"{t:.2f}" for t in offsets),
                ]
            )
    if not rows:
        return []
    return [
        "## Node concurrency",
        "",
        "Pods created at once, all aimed at one node (and GPU). Pods whose next containers ask",
        "the same device count and are not interchangeable (unequal shares, MIG of two profiles)",
        "are ambiguous to the node agent, so Tessera binds them one after another's allocation;",
        "equal shares and MIG pods of one profile (replicas) and pods asking distinct counts",
        "bind without waiting.",
        "",
        *_table(
            [
                "nodes",
                "scheduler",
                "burst",
                "bound",
                "all bound s",
                "all allocated s",
                "bound at s",
            ],
            rows,
        ),
    ]


def _churn_section(result: Json) -> list[str]:
    rows = []
    for run, name, ph in _phases(result):
        c = ph.get("churn")
        if not c:
            continue
        lat = c.get("latency_ms") or {}
        rows.append(
            [
                run["nodes"],
                name,
                c.get("deleted"),
                c.get("succeeded"),
                c.get("deleted_instead"),
                c.get("revived_by_kwok"),
                c.get("end_s"),
                c.get("pods"),
                c.get("bound"),
                c.get("throughput_pods_per_s"),
                lat.get("p50_ms"),
                lat.get("p99_ms"),
            ]
        )
    if not rows:
        return []
    return [
        "## Churn",
        "",
        "While a share of the bound pods is deleted (grace 0) or marked Succeeded, as many new",
        "pods arrive; the invariant check below runs after it. A pod is marked Succeeded only",
        "once kwok has made it Running (else kwok would set it back to Running); one that is",
        "not Running within a minute is deleted instead. *Revived*: pods marked Succeeded that",
        "kwok later set back to Running (under load it can apply its start stage to a stale",
        "copy; no kubelet revives a terminated pod, whose devices have gone to others by then);",
        "they are deleted before the invariant check.",
        "",
        *_table(
            [
                "nodes",
                "scheduler",
                "deleted",
                "succeeded",
                "deleted instead",
                "revived",
                "ending s",
                "new pods",
                "bound",
                "pods/s",
                "p50 ms",
                "p99 ms",
            ],
            rows,
        ),
    ]


def _check_section(result: Json) -> list[str]:
    rows = []
    details: list[str] = []
    for run, name, ph in _phases(result):
        c = ph.get("check")
        if c is None:
            continue
        rows.append([run["nodes"], name, c["ok"], c["attempts"], c["summary"]])
        details += [f"- {run['nodes']} nodes: {v}" for v in c.get("violations") or []]
    if not rows:
        return []
    return [
        "## Invariant check (`tessera check` after the last scenario)",
        "",
        *_table(["nodes", "scheduler", "ok", "snapshots", "summary"], rows),
        *details,
        "",
    ]


def _pending_section(result: Json) -> list[str]:
    lines: list[str] = []
    for run, name, ph in _phases(result):
        for scenario in ("main", "churn"):
            reasons = (ph.get(scenario) or {}).get("pending_reasons") or {}
            for message, n in reasons.items():
                lines.append(f"- {run['nodes']} nodes, {name}, {scenario}: {n}× {message}")
    return ["## Pending pods (most common reasons)", "", *lines, ""] if lines else []


# Plots ----------------------------------------------------------------------------------------


def plots(result: Json, out_dir: Path, name: str) -> list[Path]:
    """The PNGs this result has data for."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []
    runs = [r for r in result.get("runs", []) if r.get("phases")]
    if not runs:
        return written

    def save(fig: Any, suffix: str) -> None:
        path = out_dir / f"{name}-{suffix}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    def each_run(draw: Callable[[Any, Json], None], suffix: str) -> None:
        fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 4), squeeze=False)
        for ax, run in zip(axes[0], runs, strict=True):
            draw(ax, run)
        save(fig, suffix)

    def bound_curve(ax: Any, run: Json) -> None:
        for sched, ph in run["phases"].items():
            for scenario, style in (("drain", "--"), ("main", "-")):
                series = (ph.get(scenario) or {}).get("rate_series") or []
                total, ys = 0, []
                for n in series:
                    total += n
                    ys.append(total)
                if ys:
                    what = "queue drain" if scenario == "drain" else "streamed"
                    ax.plot(
                        range(1, len(ys) + 1),
                        ys,
                        style,
                        color=COLORS.get(sched),
                        label=f"{sched}, {what}",
                    )
        ax.set_title(f"{run['nodes']} nodes, {run['pods']} pods")
        ax.set_xlabel("seconds since scheduler start (drain) / first create (streamed)")
        ax.set_ylabel("pods bound")
        ax.legend()

    def latency_cdf(ax: Any, run: Json) -> None:
        for sched, ph in run["phases"].items():
            cdf = (ph.get("main") or {}).get("latency_cdf_ms") or []
            if cdf:
                ax.plot(cdf, range(len(cdf)), color=COLORS.get(sched), label=sched)
        ax.set_xscale("log")
        ax.set_title(f"{run['nodes']} nodes: create → bound")
        ax.set_xlabel("latency (ms)")
        ax.set_ylabel("percentile")
        ax.legend()

    each_run(bound_curve, "throughput")
    each_run(latency_cdf, "latency")

    if len(runs) > 1:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
        for sched in (TESSERA, STOCK):
            xs = [r["nodes"] for r in runs if sched in r["phases"]]
            main = [r["phases"][sched].get("main") or {} for r in runs if sched in r["phases"]]
            if not xs:
                continue
            a1.plot(xs, [m.get("throughput_pods_per_s") or 0 for m in main], "o-", label=sched)
            a2.plot(
                xs,
                [(m.get("latency_ms") or {}).get("p99_ms") or 0 for m in main],
                "o-",
                label=sched,
            )
        for ax, what in ((a1, "pods/s"), (a2, "p99 create → bound (ms)")):
            ax.set_xscale("log")
            ax.set_xlabel("nodes")
            ax.set_ylabel(what)
            ax.legend()
        a1.set_title("throughput vs. cluster size")
        a2.set_title("p99 latency vs. cluster size")
        save(fig, "scaling")

    first = runs[0]
    bursts = {
        (sched, b["label"]): b.get("all_bound_s")
        for sched, ph in first["phases"].items()
        for b in ph.get("node_concurrency") or []
    }
    if bursts:
        labels = sorted({label for _, label in bursts})
        scheds = list(first["phases"])
        fig, ax = plt.subplots(figsize=(7, 4))
        width = 0.8 / max(1, len(scheds))
        for i, sched in enumerate(scheds):
            ax.bar(
                [j + i * width for j in range(len(labels))],
                [bursts.get((sched, lab)) or 0 for lab in labels],
                width,
                label=sched,
            )
        ax.set_xticks([j + width * (len(scheds) - 1) / 2 for j in range(len(labels))], labels)
        ax.set_ylabel("seconds until all bound")
        ax.set_title(f"pods aimed at one node ({first['nodes']}-node cluster)")
        ax.legend()
        save(fig, "concurrency")
    return written


# Writing --------------------------------------------------------------------------------------


def write_report(result: Json, out_dir: Path, name: str, *, with_plots: bool = True) -> list[Path]:
    """``<name>.json``, ``<name>.md`` and the plots under ``out_dir``; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    full = {**result, "targets": [t.to_json() for t in targets(result)]}
    json_path = out_dir / f"{name}.json"
    json_path.write_text(json.dumps(full, indent=1, sort_keys=False) + "\n")
    pngs = plots(result, out_dir, name) if with_plots else []
    md_path = out_dir / f"{name}.md"
    md_path.write_text(markdown(result, [str(p) for p in pngs]))
    return [json_path, md_path, *pngs]


def _replicas(n: object) -> str:
    return f" (fractional pods: replicas of {n} templates)" if isinstance(n, int) and n else ""
