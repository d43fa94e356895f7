"""Kubeconfigs for tests of credential loading: exec credential plugins (small Python scripts
that count their runs) and kubeconfig files with inline CA data."""

from __future__ import annotations

import base64
import datetime as dt
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

EXEC_API = "client.authentication.k8s.io/v1beta1"
USER = "alice"
CONTEXT = "ctx"

# argv: count file, expirationTimestamp ("-": none), the tokens of runs 1, 2, … (the last
# one for every later run).
_PLUGIN = f"""
import json, pathlib, sys
count_path, expiry, *tokens = sys.argv[1:]
count = pathlib.Path(count_path)
runs = (int(count.read_text()) if count.exists() else 0) + 1
count.write_text(str(runs))
status = {{"token": tokens[min(runs, len(tokens)) - 1]}}
if expiry != "-":
    status["expirationTimestamp"] = expiry
print(json.dumps({{"apiVersion": "{EXEC_API}", "kind": "ExecCredential", "status": status}}))
"""

_FAILING = """
import sys
sys.stderr.write(sys.argv[1] + "\\n")
sys.exit(1)
"""


@dataclass(frozen=True)
class ExecPlugin:
    user: dict[str, Any]  # the kubeconfig's user entry that runs it
    count_file: Path

    @property
    def runs(self) -> int:
        return int(self.count_file.read_text()) if self.count_file.exists() else 0


def rfc3339(at: dt.datetime) -> str:
    return at.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def exec_plugin(
    directory: Path, tokens: list[str], *, expires_in: dt.timedelta | None = None
) -> ExecPlugin:
    """A plugin printing ``tokens[run - 1]``, expiring ``expires_in`` after each run's start
    (the tests' runs are seconds apart: the loader re-runs it within 5 min of expiry)."""
    script = directory / "exec_plugin.py"
    script.write_text(_PLUGIN)
    count = directory / "exec_runs"
    expiry = "-" if expires_in is None else rfc3339(dt.datetime.now(dt.UTC) + expires_in)
    return ExecPlugin(_exec_user([str(script), str(count), expiry, *tokens]), count)


def failing_exec_plugin(directory: Path, stderr: str) -> dict[str, Any]:
    """The user entry of a plugin that exits 1 after writing ``stderr``."""
    script = directory / "failing_plugin.py"
    script.write_text(_FAILING)
    return _exec_user([str(script), stderr])


def _exec_user(args: list[str]) -> dict[str, Any]:
    return {
        "exec": {
            "apiVersion": EXEC_API,
            "command": sys.executable,
            "args": args,
            "interactiveMode": "Never",
        }
    }


def b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def write_kubeconfig(
    path: Path, server: str, user: dict[str, Any], *, ca_file: Path | None = None
) -> Path:
    """A one-context kubeconfig (context CONTEXT, user USER) with the CA inline."""
    cluster: dict[str, Any] = {"server": server}
    if ca_file is not None:
        cluster["certificate-authority-data"] = b64(ca_file)
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": CONTEXT,
        "contexts": [{"name": CONTEXT, "context": {"cluster": "k", "user": USER}}],
        "clusters": [{"name": "k", "cluster": cluster}],
        "users": [{"name": USER, "user": user}],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc))
    return path
