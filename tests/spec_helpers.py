"""Helpers for the inference tests: tiny seeded models (targets with varied greedy output, drafts
that agree with them always, sometimes, or never) and the chi-square test."""

from __future__ import annotations

import copy

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from specdraft.core import SamplingSettings
from specdraft.inference import generate
from specdraft.kinds.dflash.dflash import DFlashConfig, DFlashDrafter
from specdraft.kinds.distill.distill import DistillDrafter
from specdraft.kinds.dspark.dspark import DSparkConfig, DSparkDrafter
from specdraft.kinds.eagle.eagle import EagleConfig, EagleDrafter
from specdraft.kinds.layerskip.layerskip import LayerSkipConfig, LayerSkipDrafter
from specdraft.kinds.medusa.medusa import MedusaDrafter
from specdraft.kinds.medusa.medusa_config import MedusaConfig
from specdraft.kinds.peagle.peagle import PEagleConfig, PEagleDrafter
from specdraft.targets.target import Target


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


def first_two_joint(target, prompt, settings) -> torch.Tensor:
    """(V, V) the target's probability of each first two tokens after `prompt` (a list of ids),
    under the SamplingSettings `settings`: what a sampler of the first two tokens must follow.
    V is the target's whole vocabulary, so keep it tiny."""
    from specdraft.drafting import process_logits

    vocab = target.vocab_size
    with torch.no_grad():
        first = process_logits(target.model(torch.tensor([prompt])).logits[0, -1], settings)
        nxt = torch.stack(
            [target.model(torch.tensor([[*prompt, y]])).logits[0, -1] for y in range(vocab)]
        )
    return first[:, None] * process_logits(nxt, settings)


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


MEDUSA_PROMPTS = [[5, 17, 42, 17, 5, 9], [100, 3, 250, 7], [33, 33, 8, 301, 12, 6, 90]]


def fitted_medusa_heads(
    target, config: dict, d2t=None, *, prompts=MEDUSA_PROMPTS, steps: int = 60, measure=True
) -> MedusaDrafter:
    """Medusa heads (self-distillation, MedusaConfig keys `config`) fitted for a few Adam steps to
    the target's own greedy text after `prompts`: they predict it often but not always, so
    drafts there are both accepted and rejected. measure: their per-rank accuracies measured on
    that text (the tree's input); else left unmeasured."""
    torch.manual_seed(0)
    heads = MedusaDrafter.build(MedusaConfig(loss="kl", **config), target, d2t)
    rows = [p + generate(target, p, max_new_tokens=40).tokens[0].tolist() for p in prompts]
    ids = torch.tensor([row[: min(map(len, rows))] for row in rows])
    ones = torch.ones_like(ids)
    batch = {"input_ids": ids, "attention_mask": ones, "loss_mask": ones}
    out = target.forward(ids, capture_layers=[target.num_layers])
    optimizer = torch.optim.Adam(heads.parameters(), lr=3e-3)
    for _ in range(steps):
        loss, _ = heads(batch, out)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    heads.eval()
    if measure:
        # as load_drafter gives a checkpoint's
        heads.checkpoint = heads.checkpoint.with_heldout(
            heads.heldout_summary(heads.eval_statistics(batch, out))
        )
    return heads


WINDOW = 8  # sliding_model's default window


def sliding_model(name: str, vocab: int = 64, window: int = WINDOW, layers: int = 4):
    """A tiny random model of `name` whose layers (some or all) slide over `window` keys."""
    torch.manual_seed(0)
    common = dict(
        vocab_size=vocab, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=64, max_position_embeddings=256,
        initializer_range=0.3, head_dim=16, sliding_window=window,
    )  # fmt: skip
    if name == "mistral":
        model = MistralForCausalLM(MistralConfig(**common))
    elif name == "gemma2":
        model = Gemma2ForCausalLM(
            Gemma2Config(**common, final_logit_softcapping=5.0, attn_logit_softcapping=10.0)
        )
    elif name == "gemma3":
        model = Gemma3ForCausalLM(Gemma3TextConfig(**common, sliding_window_pattern=2))
    else:
        model = Qwen2ForCausalLM(
            Qwen2Config(**common, use_sliding_window=True, max_window_layers=layers // 2)
        )
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


# --- a drafter of every kind, fitted to the target's own continuations -----------------------

PROMPTS = [[5, 17, 42, 99, 7, 230], [100, 3, 250, 7], [33, 33, 8, 301, 12, 6, 90]]
NEW = 24


def fitted(drafter, target, examples, steps: int = 25):
    """`drafter` fitted for a few Adam steps to the target's own continuations, so that its drafts
    are accepted often but not always."""
    torch.manual_seed(0)
    n = min(len(e.input_ids) for e in examples)
    ids = torch.tensor([e.input_ids[:n] for e in examples])
    ones = torch.ones_like(ids)
    batch = {"input_ids": ids, "attention_mask": ones, "loss_mask": ones}
    out = target.forward(ids, capture_layers=drafter.capture_layers)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    for step in range(steps):
        b = dict(batch, example_index=torch.arange(len(ids)))
        b = drafter.prepare_batch(b, target, None, torch.Generator().manual_seed(step))
        loss, _ = drafter(b, out)
        opt.zero_grad()
        (loss / drafter.loss_tokens(b).clamp(min=1)).backward()
        opt.step()
    return drafter.eval()


def build(kind: str, target, examples):
    torch.manual_seed(0)
    if kind == "distill":
        return DistillDrafter(perturbed(target.model, scale=0.05, seed=1))
    if kind == "layerskip":
        return LayerSkipDrafter(LayerSkipConfig(exit_layer=1), target.model).eval()
    if kind == "medusa":
        return fitted_medusa_heads(target, dict(num_heads=3), prompts=PROMPTS)
    if kind in ("eagle3", "eagle1"):
        cfg = EagleConfig(version=kind, ttt_steps=2)
        return fitted(EagleDrafter.build(cfg, target), target, examples)
    if kind == "eagle31":  # EAGLE-3.1: the fused features normed, each step fed normed output
        cfg = EagleConfig(version="eagle3", ttt_steps=2, norm_before_fc=True, norm_output=True)
        return fitted(EagleDrafter.build(cfg, target), target, examples)
    if kind == "dspark":
        cfg = DSparkConfig(block_size=4, anchors=8, markov_rank=8)
        return fitted(DSparkDrafter.build(cfg, target), target, examples)
    if kind == "peagle":
        cfg = PEagleConfig(num_depths=3, down_sample_ratio=1.0)
        return fitted(PEagleDrafter.build(cfg, target), target, examples)
    return fitted(
        DFlashDrafter.build(DFlashConfig(block_size=4, anchors=8), target), target, examples
    )


KINDS = [
    "distill",
    "layerskip",
    "medusa",
    "eagle3",
    "eagle1",
    "eagle31",
    "peagle",
    "dflash",
    "dspark",
]


def ragged(examples, n: int) -> list[list[int]]:
    """n prompts of different lengths (1 to 17 tokens): prefixes of the target's own
    continuations, which the fitted drafters have seen, so their drafts are often accepted."""
    rows = [list(e.input_ids) for e in examples]
    return [rows[i % len(rows)][: 1 + (5 * i + 2) % 17] for i in range(n)]


V = 6  # the vocabulary of the targets the sampled-rows test runs on
BATCH_SAMPLES = 300  # batches; 5 rows of each are pooled


def sampled_rows_follow_the_target(target, drafter, **options) -> None:
    """The chi-square test through batched rows: the joint of the first two tokens of five rows
    with one prompt, batched with a row of another length (so every step pads), pooled over
    BATCH_SAMPLES seeds at temperature 1.3, against the target's exact joint; drafting must have
    happened and been accepted. options: generate's (top_p, gamma, a kind's settings...)."""
    prompt = [1, 2, 3]
    counts = torch.zeros(V, V)
    drafted = accepted = 0
    options = dict(max_new_tokens=3, temperature=1.3, gamma=2) | options
    for seed in range(BATCH_SAMPLES):
        out = generate(target, [prompt, [4], prompt, prompt, prompt, prompt], drafter,
                       seed=seed, **options)  # fmt: skip
        for row in (0, 2, 3, 4, 5):
            y1, y2 = out.tokens[row, :2].tolist()
            counts[y1, y2] += 1
        drafted, accepted = drafted + out.stats.drafted, accepted + out.stats.accepted
    assert drafted > 0 and accepted > 0
    settings = SamplingSettings(temperature=1.3, top_p=options.get("top_p", 1.0))
    exact = first_two_joint(target, prompt, settings)
    assert chi_square_p_value(counts.flatten(), exact.flatten()) > 1e-3
