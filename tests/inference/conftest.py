"""Fixtures for the inference tests: a random target with varied greedy output, and drafts."""

from __future__ import annotations

import copy

import pytest
import torch
from spec_helpers import NEW, PROMPTS, build, make_target, perturbed, tiny_llama

from specdraft.simulation.continuations import served_examples
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


@pytest.fixture(scope="session")
def examples(random_target, tmp_path_factory):
    """random_target's own greedy continuations of PROMPTS (what drafters are fitted to)."""
    prompts = [torch.tensor([p]) for p in PROMPTS]
    return served_examples(random_target, prompts, NEW, cache_dir=tmp_path_factory.mktemp("c"))


@pytest.fixture(scope="session")
def kind_drafter(random_target, examples):
    """kind -> a drafter of that kind for random_target (spec_helpers.build), built once per
    session and shared by the modules that only decode with it."""
    built = {}

    def get(kind: str):
        if kind not in built:
            built[kind] = build(kind, random_target, examples)
        return built[kind]

    return get
