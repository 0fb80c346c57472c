"""Fixtures for the inference tests: a random target with varied greedy output, and drafts."""

from __future__ import annotations

import copy

import pytest
import torch
from spec_helpers import make_target, perturbed, tiny_llama

from specdraft.drafters.target import Target


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and on a shared machine a thread pool waiting for
    busy cores makes each small op ten times slower; restored for other tests."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
