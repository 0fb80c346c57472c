"""Helpers for the inference tests: tiny seeded models (targets with varied greedy output, drafts
that agree with them always, sometimes, or never) and the chi-square test."""

from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdraft.drafters.target import Target


def tiny_llama(vocab: int, seed: int, hidden: int = 32, layers: int = 2, init: float = 0.3):
    """A random Llama; a wide init makes its distributions peaked, so greedy text varies."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=2 * hidden,
        max_position_embeddings=256,
        initializer_range=init,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


class IdTokenizer:
    """Just enough tokenizer for `Target` (its fingerprint hashes the vocabulary)."""

    def __init__(self, vocab: int) -> None:
        self.vocab = {str(i): i for i in range(vocab)}

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


def make_target(model) -> Target:
    return Target(model, IdTokenizer(model.config.vocab_size), name="random-llama")


def perturbed(model, scale: float, seed: int):
    """A copy of `model` with Gaussian noise on every weight: agrees with it only sometimes."""
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std().clamp(min=1e-3))
    return other


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Upper-tail p-value of Pearson's chi-square; cells the target never emits must be empty.

    Cells expected fewer than 5 times are pooled, smallest first, until the pool is expected 5
    times (the textbook condition for the chi-square approximation; a pool that cannot reach it
    joins the smallest other cell): a single count in a cell expected 0.01 times would otherwise
    add ~100 to the statistic and fail a correct sampler.
    """
    assert counts[probs == 0].sum() == 0, "emitted a token the target gives probability 0"
    keep = probs > 0
    counts, probs = counts[keep].double(), probs[keep].double()
    expected = probs * counts.sum()
    order = expected.argsort()
    counts, expected = counts[order], expected[order]  # smallest expectation first
    small = int((expected.cumsum(0) < 5).sum())  # cells pooled until the pool reaches 5
    if small:
        cut = min(small + 1, len(expected))
        counts = torch.cat([counts[:cut].sum()[None], counts[cut:]])
        expected = torch.cat([expected[:cut].sum()[None], expected[cut:]])
    assert len(expected) >= 2, "too few samples for a chi-square test: every cell was pooled"
    stat = ((counts - expected) ** 2 / expected).sum()
    df = torch.tensor(float(counts.numel() - 1))
    return float(torch.special.gammaincc(df / 2, stat / 2))
