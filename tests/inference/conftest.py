"""Fixtures for the inference tests: a random target with varied greedy output, and drafts."""

from __future__ import annotations

import copy

import pytest
from spec_helpers import make_target, perturbed, tiny_llama

from specdraft.targets.target import Target


@pytest.fixture(autouse=True, scope="module")
def _single_threaded(one_thread):
    """Every inference test runs on one thread (tests/conftest.py says why)."""


@pytest.fixture(scope="session")
def random_target() -> Target:
    """vocab 384 (the tiny demo target's), random weights, no EOS."""
    return make_target(tiny_llama(384, seed=0))


@pytest.fixture(scope="session")
def drafts(random_target) -> dict:
    """Draft models for `random_target`: identical, partly agreeing, unrelated."""
    return {
        "copy": copy.deepcopy(random_target.model),
        "partial": perturbed(random_target.model, scale=0.05, seed=1),
        "random": tiny_llama(384, seed=2, hidden=16, layers=1),
    }
