"""The benchmark scripts' tests (benchmarks/ is outside the package). Each is marked
`benchmark`, which the README's test command leaves out (pyproject's addopts) and `.ci/run`
runs as a step of its own: `pytest -m benchmark`."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.benchmark)
