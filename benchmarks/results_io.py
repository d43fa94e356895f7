"""Where a benchmark leaves its figures: the report as JSON and its markdown table beside it."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def save_results(path: Path, report: Any, table: str) -> None:
    """Write ``report`` to ``path`` (JSON), ``table`` beside it (``.md``), and print the table."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    path.with_suffix(".md").write_text(table)
    sys.stdout.write(table)
