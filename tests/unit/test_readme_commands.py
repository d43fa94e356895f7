"""Every command in the README's shell blocks exists as written: ``make`` targets are in the
Makefile and ``tessera`` command lines parse. (The "Try your own pods" block is also run as
written, end to end, by tests/e2e/test_local_tessera.py.)"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Final

import pytest

from scheduler_plugins.cli import build_parser

ROOT: Final = Path(__file__).resolve().parents[2]
OTHER_TOOLS: Final = ("kubectl ", "helm ", "curl ", "eval ", "--set ", "export ")


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    lines: list[str] = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        for raw in block.splitlines():
            line = re.split(r"\s+#\s", raw.strip(), maxsplit=1)[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-z][a-z0-9-]*):", text, re.M))


def test_the_readme_has_commands() -> None:
    commands = readme_commands()
    assert "make demo" in commands and "make test" in commands


@pytest.mark.parametrize("line", readme_commands())
def test_readme_command_exists(line: str) -> None:
    if line.startswith(OTHER_TOOLS):
        return  # another program's command line: run where it matters (e2e), not here
    words = shlex.split(line)
    if words[0] == "make":
        targets = [w for w in words[1:] if "=" not in w]
        assert targets, line
        missing = set(targets) - make_targets()
        assert not missing, f"README runs make {sorted(missing)}, which the Makefile lacks"
        return
    assert words[0] in ("tessera", ".venv/bin/tessera"), f"unknown README command: {line!r}"
    # Optional groups ([--config FILE]) and alternatives (json|table) as a user would type them.
    plain = re.sub(r"\[([^\]]*)\]", r"\1", line)
    plain = re.sub(r"(\w+)\|[\w|]+", r"\1", plain)
    args = shlex.split(plain)[1:]
    try:
        build_parser().parse_args(args)
    except SystemExit as e:
        pytest.fail(f"README command does not parse (exit {e.code}): {line!r}")
