"""The inference tests run on one thread (tests/conftest.py says why); their targets and drafts
are the suite's shared fixtures (tests/conftest.py, built from tests/spec_helpers.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="module")
def _single_threaded(one_thread):
    """Every inference test runs on one thread."""
