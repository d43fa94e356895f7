"""cProfile for every thread of Tessera's Python processes during a benchmark
(``tessera bench --profile-python``).

``cProfile`` only follows the thread that enables it; the plugin server and the node agent
do their work on gRPC and watch threads. ``install`` gives every thread started afterwards its
own profiler and, at exit, merges them into ``<dir>/<process>-<pid>.pstats`` plus a text
summary. The child processes pick it up through a ``sitecustomize`` module on
``PYTHONPATH`` (``environment``), so nothing in the servers knows about it.
"""

from __future__ import annotations

import atexit
import cProfile
import io
import os
import pstats
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Final

ENV_DIR: Final = "TESSERA_PROFILE_DIR"
_SITECUSTOMIZE: Final = """\
import os
if os.environ.get("{env}"):
    from scheduler_plugins.devtools.bench import pyprofile
    pyprofile.install(os.environ["{env}"])
"""


def install(out_dir: str) -> None:
    """Profile this process's main thread and every thread started from now on."""
    profiles: list[cProfile.Profile] = []
    lock = threading.Lock()
    original: Callable[[threading.Thread], None] = threading.Thread.run

    def run(self: threading.Thread) -> None:
        prof = cProfile.Profile()
        with lock:
            profiles.append(prof)
        prof.enable()
        try:
            original(self)
        finally:
            prof.disable()

    threading.Thread.run = run  # type: ignore[method-assign]
    main = cProfile.Profile()
    profiles.append(main)
    main.enable()

    def dump() -> None:
        main.disable()
        with lock:
            taken = list(profiles)
        stats: pstats.Stats | None = None
        for prof in taken:
            try:
                stats = pstats.Stats(prof) if stats is None else stats.add(prof)
            except TypeError:  # a profiler that never saw a call
                continue
        if stats is None:
            return
        name = _process_name()
        path = Path(out_dir) / f"{name}-{os.getpid()}"
        path.parent.mkdir(parents=True, exist_ok=True)
        stats.dump_stats(str(path.with_suffix(".pstats")))
        path.with_suffix(".txt").write_text(summary(stats))

    atexit.register(dump)


def summary(stats: pstats.Stats, top: int = 40) -> str:
    """Top functions by own time and by cumulative time."""
    out = io.StringIO()
    stats.stream = out  # type: ignore[attr-defined]
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def environment(work_dir: Path, out_dir: Path) -> dict[str, str]:
    """Environment variables that make child Python processes profile themselves."""
    site = work_dir / "pyprofile-site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(env=ENV_DIR))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = os.environ.get("PYTHONPATH", "")
    return {
        ENV_DIR: str(out_dir),
        "PYTHONPATH": f"{site}{os.pathsep}{path}" if path else str(site),
    }


def _process_name() -> str:
    """The tessera subcommand (``plugin-server``, ``node-agent``), else the script's name."""
    if len(sys.argv) > 1 and not sys.argv[1].startswith("-"):
        return sys.argv[1]
    return Path(sys.argv[0]).stem or "python"
