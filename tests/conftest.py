"""Shared by the end-to-end tests: the `figures` fixture collects measured figures (tolerances,
differences from a reference, negative controls), and `pytest_terminal_summary` prints them at
the end of every run, with or without `-s`, so a test log always carries what was measured."""

import pytest

FIGURES: list[str] = []


@pytest.fixture(scope="session")
def figures() -> list[str]:
    return FIGURES


def pytest_terminal_summary(terminalreporter):
    if FIGURES:
        terminalreporter.section("measured figures")
        for line in FIGURES:
            terminalreporter.write_line(line)
