"""Shared by the policy tests: a tally of property-test cases and scenario classes.

The property tests add to `TALLY` (through the `scenario_tally` fixture) and assert their own
minimum counts; `pytest_terminal_summary` prints the tally, so every run (with or without `-s`)
shows how many generated cases ran and which scenarios they covered.
"""

import collections

import pytest

TALLY: dict[str, collections.Counter] = {}


@pytest.fixture(scope="session")
def scenario_tally() -> dict[str, collections.Counter]:
    return TALLY


def pytest_terminal_summary(terminalreporter):
    if not TALLY:
        return
    terminalreporter.section("policy property tests: generated cases and scenario classes")
    for name, counter in TALLY.items():
        classes = ", ".join(f"{k}={v}" for k, v in sorted(counter.items()) if k != "cases")
        terminalreporter.write_line(f"{name}: {counter['cases']} cases; {classes}")
    total = sum(counter["cases"] for counter in TALLY.values())
    terminalreporter.write_line(f"total generated cases: {total}")
