"""The plugin server's full-GC pause on a large state, without and with ``OldObjectsFrozen``.

Builds the plugin server's ``ClusterCache`` for N nodes and P bound pods as
``tessera bench --state-only`` does (``bench.statemem``), then, in the same process:

- *baseline*: the time of a full collection (``gc.collect(2)``) of that state, what the
  interpreter does on its own every so often with the GIL held, every RPC waiting;
- *frozen*: ``OldObjectsFrozen`` ticks once (the state is built: collect, freeze), then
  ``--new-pods`` more pods arrive (decoded, applied to the cache as the watch does) and a
  full collection runs again: it walks only what arrived since.

Reports both (median of ``--repeat``) and their ratio; the objects a full collection walks
come beside (``gc.get_objects()``: every generation but the frozen one).

Run: ``python -m benchmarks.gc_pause [--nodes 5000] [--pods 10000] [--new-pods 2000]
[--json PATH]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any

from api.hami.config import DeviceConfig
from scheduler_plugins.core.cache import ClusterCache, Obj
from scheduler_plugins.devtools.bench import statemem
from scheduler_plugins.server.gcpolicy import OldObjectsFrozen

DEFAULT_JSON = Path(__file__).parent / "results" / "gc_pause.json"


def _full_ms(repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        gc.collect(2)
        times.append((time.perf_counter() - started) * 1000.0)
    return statistics.median(times)


def measure(nodes: int, pods: int, new_pods: int, repeat: int) -> dict[str, Any]:
    applied: list[dict[str, Any]] = []

    class Recording(ClusterCache):
        def apply_pod(self, pod: Obj) -> None:
            applied.append(dict(pod))
            super().apply_pod(pod)

    cache = Recording(DeviceConfig(), clock=time.monotonic)
    statemem.measure(nodes, pods + new_pods, seed=1, decisions=1, cache=cache)
    # The last new_pods pods are the ones that arrive after the freeze.
    arriving = applied[-new_pods:] if new_pods else []
    for pod in arriving:
        cache.delete_pod(pod)
    gc.collect(2)
    walked_baseline = len(gc.get_objects())
    baseline_ms = _full_ms(repeat)
    policy = OldObjectsFrozen(lambda: True)
    policy.tick()
    frozen = gc.get_freeze_count()
    for pod in arriving:
        cache.apply_pod(json.loads(json.dumps(pod)))  # decoded anew, as from the watch
    walked_frozen = len(gc.get_objects())
    frozen_ms = _full_ms(repeat)
    gc.unfreeze()
    return {
        "nodes": nodes,
        "pods": pods,
        "new_pods": len(arriving),
        "frozen_objects": frozen,
        "walked_objects": {"baseline": walked_baseline, "frozen": walked_frozen},
        "full_collection_ms": {"baseline": round(baseline_ms, 2), "frozen": round(frozen_ms, 2)},
        "ratio_frozen_to_baseline": round(frozen_ms / baseline_ms, 4) if baseline_ms else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--nodes", type=int, default=5000)
    p.add_argument("--pods", type=int, default=10000)
    p.add_argument("--new-pods", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = p.parse_args(argv)
    out = measure(args.nodes, args.pods, args.new_pods, args.repeat)
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
