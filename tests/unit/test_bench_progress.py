"""The benchmark's stderr progress bar."""

from __future__ import annotations

import io

from scheduler_plugins.devtools.progress import Progress, render


def test_render() -> None:
    assert render("x", 5, 10, "fast", width=10) == "x [#####.....]  5/10 fast"
    assert render("x", 0, 0, width=4) == "x [####] 0/0"
    assert render("x", 12, 10, width=4) == "x [####] 12/10"


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_log_mode_writes_a_line_every_few_seconds() -> None:
    out, clock = io.StringIO(), _Clock()
    bar = Progress("p", 100, stream=out, clock=clock)
    for i in range(10):
        clock.t = i  # one update per second
        bar.update(i)
    bar.close(100, "done")
    lines = out.getvalue().splitlines()
    assert [line.split("]")[1].split("/")[0].strip() for line in lines] == ["0", "5", "100"]
    assert lines[-1].endswith("done")


def test_disabled_writes_nothing() -> None:
    out = io.StringIO()
    bar = Progress("p", 3, stream=out, enabled=False)
    bar.update(1, force=True)
    bar.close(3)
    assert out.getvalue() == ""
