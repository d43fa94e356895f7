"""The bad-input suites' ledger: one per session, printed at the end and written to
``benchmarks/results/fuzz.json`` (see ``tests/fuzzing.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fuzzing import FuzzLedger

_LEDGER = pytest.StashKey[FuzzLedger]()


@pytest.fixture(scope="session")
def fuzz_ledger(request: pytest.FixtureRequest) -> Iterator[FuzzLedger]:
    ledger = FuzzLedger()
    request.config.stash[_LEDGER] = ledger
    yield ledger
    ledger.write()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    ledger = terminalreporter.config.stash.get(_LEDGER, None)
    if ledger is not None:
        terminalreporter.section("bad-input suites")
        for line in ledger.summary_lines():
            terminalreporter.write_line(line)
