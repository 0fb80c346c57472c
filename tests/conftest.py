"""Shared test setup: offline, deterministic, and nothing written outside pytest's temp folders."""

from __future__ import annotations

import os

# No hub is reachable on the machines this runs on, and tests must not try.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The trainers' default configs (configs/KIND/demo.yaml) train on a real target fetched from
# the package registry; the suite's (tests/configs/KIND/demo.yaml) are the tiny target on the demo
# corpus, which every test shrinks further. Set here, before any test module imports a trainer,
# and inherited by the processes tests start.
os.environ["SPECDRAFT_CONFIGS"] = os.path.join(os.path.dirname(__file__), "configs")
# "auto" precision (the trainer's mixed_precision, the demo build) resolves as on the machine the
# suite runs on: bf16 where the CPU has it natively, else fp32. A test that compares with an fp32
# reference, or asserts an exact or tight figure, pins its precision (mixed_precision=no, an fp32
# dtype) or states the tolerance of the precision it runs in. CI runs the tests marked `exact`
# once more with SPECDRAFT_NO_BF16=1, so both branches of "auto" are covered wherever it runs.

import copy

import pytest
import torch
from spec_helpers import NEW, PROMPTS, build, make_target, perturbed, tiny_llama

from specdraft.simulation.continuations import served_examples
from specdraft.targets.target import Target

# The README's command runs the suite in two worker processes (pytest-xdist, `-n 2`), one per
# core: each keeps to one thread, and so do the processes it starts (OMP_NUM_THREADS, read by
# torch in a child and by the trainer's cpu_threads), or two pools of threads would wait on
# each other's cores. Run without workers, a test has the machine's threads as before.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def specdraft_home(tmp_path_factory: pytest.TempPathFactory):
    """Every test session gets its own SPECDRAFT_HOME, so the demo-target cache of a user's
    machine is never read or written by tests."""
    home = tmp_path_factory.mktemp("specdraft_home")
    old = os.environ.get("SPECDRAFT_HOME")
    os.environ["SPECDRAFT_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("SPECDRAFT_HOME", None)
    else:
        os.environ["SPECDRAFT_HOME"] = old


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """accelerate keeps one AcceleratorState per process, fixed by the first Accelerator's
    mixed_precision: each test starts with none, so a test pinned to fp32 can follow one that
    trained in bf16 (the process group, in PartialState, is kept)."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    yield
    AcceleratorState._reset_state()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and on a shared machine a thread pool waiting for
    busy cores makes each small op ten times slower; restored after the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_target_path(specdraft_home) -> str:
    """The tiny demo target, built once per test session (about a second)."""
    from specdraft.targets.demo_target import ensure_demo_target

    return str(ensure_demo_target(variant="tiny"))


@pytest.fixture(scope="session")
def tiny_target(tiny_target_path):
    from specdraft.targets.target import load_target

    torch.manual_seed(0)
    return load_target(tiny_target_path)


# --- a random target with varied greedy output, and drafts (tests/spec_helpers.py) ---------


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
