"""DSpark: the loss equals a naive loop over anchors (each block alone, the Markov bias from the
data's token before each drafted one, the confidence head's cross-entropy against each slot's
alpha), the anchor's slot drafts, the session's chain reads each slot's own previous draw,
greedy output equals plain greedy (chains, the confidence head's stop, copying, batches), and
bad values are named; sampling is tests/kinds/test_dspark_sampling.py."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from testkit import perturb

from specdraft.core import DecodeConfig, DraftContext, SamplingSettings
from specdraft.formats.checkpoint import CheckpointError, save_drafter
from specdraft.formats.reading import load_drafter
from specdraft.inference import generate
from specdraft.kinds.dspark.dspark import DSparkConfig, DSparkDrafter

# Exactness: CI runs these once more with native bf16 forced off (tests/conftest.py).
pytestmark = pytest.mark.exact

PROMPTS = [[5, 9, 13, 7, 21], [3, 4, 5, 6, 7, 8, 9], [40, 41, 12]]


@pytest.fixture(autouse=True, scope="module")
def _single_threaded(one_thread):
    """Tiny models: one thread (tests/conftest.py says why)."""


def batch_of(ids: torch.Tensor, prompt: int = 1) -> dict:
    attention = torch.ones_like(ids)
    loss_mask = attention.clone()
    loss_mask[:, :prompt] = 0
    loss_mask[0, 7] = 0  # a hole: the slot predicting position 7 scores nothing
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}


def train_briefly(target, config: DSparkConfig, steps: int = 40) -> DSparkDrafter:
    """Fitted for a few Adam steps to the target's predictions on random text."""
    torch.manual_seed(0)
    drafter = DSparkDrafter.build(config, target)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    V = target.vocab_size
    for step in range(steps):
        ids = torch.randint(3, V, (8, 24))
        batch = batch_of(ids)
        batch["example_index"] = torch.arange(8) + 8 * step
        batch = drafter.prepare_batch(batch, target, None, torch.Generator().manual_seed(step))
        out = target.forward(ids, capture_layers=drafter.capture_layers)
        loss, _ = drafter(batch, out)
        opt.zero_grad()
        (loss / drafter.loss_tokens(batch)).backward()
        opt.step()
    return drafter.eval()


@pytest.fixture(scope="module")
def trained(tiny_target):
    return train_briefly(tiny_target, DSparkConfig(block_size=4, anchors=8, markov_rank=8))


def plain(target, prompt, n):
    return generate(target, prompt, None, max_new_tokens=n).tokens[0].tolist()


# -- the loss --------------------------------------------------------------------------------


@pytest.mark.parametrize("from_anchor", [True, False])
def test_loss_equals_a_naive_loop_over_anchors(tiny_target, from_anchor):
    """Each anchor's block run alone on the context before it; slot k (from 0, or from 1 without
    sample_from_anchor) drafts the token j = k - first + 1 after the anchor, its logits the
    backbone's plus W2 W1[the data's token before it], its loss KL weighted exp(-(j - 1) / 4),
    plus the cross-entropy of its confidence against its alpha."""
    torch.manual_seed(3)
    cfg = DSparkConfig(block_size=4, anchors=3, markov_rank=5, sample_from_anchor=from_anchor)
    drafter = DSparkDrafter.build(cfg, tiny_target)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ids = torch.randint(3, tiny_target.vocab_size, (2, 16))
    batch = drafter.prepare_batch(
        {**batch_of(ids), "example_index": torch.arange(2)}, tiny_target, None,
        torch.Generator().manual_seed(1),
    )  # fmt: skip
    out = tiny_target.forward(ids, capture_layers=drafter.capture_layers)
    with torch.no_grad():
        total, metrics = drafter.loss(batch, out)
    B, first = cfg.block_size, drafter.first_slot
    with torch.no_grad():
        want, scored = naive_loss(drafter, batch, ids, out)
    assert scored > 6 and int(drafter.loss_tokens(batch)) == scored
    assert abs(float(total) - want) < 1e-4 * max(1.0, want)
    assert set(metrics) >= {"loss_1", "top1_1", "confidence_bce", "confidence_error"}
    assert f"loss_{B - first}" in metrics and f"loss_{B - first + 1}" not in metrics


def naive_loss(drafter: DSparkDrafter, batch: dict, ids: torch.Tensor, out) -> tuple[float, int]:
    B, first, cfg = drafter.block_size, drafter.first_slot, drafter.config
    features = drafter.features(out.hidden_states)
    want, scored = 0.0, 0
    for row in range(2):
        for a in batch["anchors"][row].tolist():
            if a < 0:
                continue
            context = drafter.context_kv(features[row : row + 1, :a], torch.arange(a)[None])
            block = torch.tensor([[int(ids[row, a])] + [cfg.mask_token_id] * (B - 1)])
            h = drafter.block_states(block, (a + torch.arange(B))[None], context)
            for k in range(first, B):
                j = k - first + 1  # drafts the token at a + j
                if a + j >= 16 or not batch["loss_mask"][row, a + j]:
                    continue
                w1 = drafter.markov_head.markov_w1.weight[ids[row, a + j - 1]]
                logits = drafter.draft_logits(h[0, k]) + drafter.markov_head.markov_w2.weight @ w1
                log_q = logits.float().log_softmax(-1)
                log_p = out.logits[row, a + j - 1].float().log_softmax(-1)
                kl = float((log_p.exp() * (log_p - log_q)).sum())
                alpha = torch.minimum(log_p.exp(), log_q.exp()).sum()
                c = drafter.confidence_head.proj(torch.cat([h[0, k], w1]))[0]
                bce = float(F.binary_cross_entropy_with_logits(c, alpha))
                want += (kl + bce) * float(torch.exp(torch.tensor(-(j - 1) / 4.0)))
                scored += 1
    return want, scored


def test_gradients_reach_both_heads(tiny_target):
    drafter = DSparkDrafter.build(DSparkConfig(block_size=3, anchors=4, markov_rank=4), tiny_target)
    ids = torch.randint(3, tiny_target.vocab_size, (2, 14))
    batch = drafter.prepare_batch(
        {**batch_of(ids), "example_index": torch.arange(2)}, tiny_target, None,
        torch.Generator().manual_seed(0),
    )  # fmt: skip
    out = tiny_target.forward(ids, capture_layers=drafter.capture_layers)
    loss, _ = drafter.loss(batch, out)
    loss.backward()
    for name in ("markov_head.markov_w2.weight", "confidence_head.proj.weight", "fc.weight"):
        assert dict(drafter.named_parameters())[name].grad.abs().sum() > 0, name
    assert all(p.grad is None for p in tiny_target.model.parameters())


# -- decoding --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [dict(gamma=4), dict(gamma=4, stop_below=0.3), dict(gamma=3, lookup_ngram=2)],
    ids=["chain", "confidence-stop", "copying"],
)
def test_greedy_output_equals_plain_greedy(tiny_target, trained, options):
    drafted = accepted = 0
    for prompt in [*PROMPTS, PROMPTS[0] * 3]:
        out = generate(tiny_target, prompt, trained, max_new_tokens=24, **options)
        assert out.tokens[0].tolist() == plain(tiny_target, prompt, 24)
        drafted, accepted = drafted + out.stats.drafted, accepted + out.stats.accepted
        assert len(out.stats.acceptance_per_position) <= 4  # the whole block of 4 drafts
    assert drafted > 0 and accepted > 0


def test_a_batch_drafts_what_each_row_drafts_alone(tiny_target, trained):
    for options in (dict(gamma=4), dict(gamma=4, stop_below=0.3)):
        together = generate(tiny_target, PROMPTS, trained, max_new_tokens=16, **options)
        alone = [generate(tiny_target, p, trained, max_new_tokens=16, **options) for p in PROMPTS]
        assert together.rows() == [a.tokens[0].tolist() for a in alone]
        assert [s.drafted for s in together.row_stats] == [a.stats.drafted for a in alone]


def test_each_slot_reads_the_token_drafted_before_it(tiny_target, trained):
    """The chain's slot j draws from the backbone's logits plus W2 W1[slot j - 1's draw]: with
    W1's row of the first draft made to add a huge bias to token 7, the second draft becomes 7
    and the first (whose previous token is the anchor) stays."""
    drafter = copy.deepcopy(trained)
    session = drafter.new_session(
        tiny_target, sampling=SamplingSettings(temperature=0.0), decode=DecodeConfig(gamma=4)
    )
    ids = torch.tensor([PROMPTS[1]])
    out = tiny_target.forward(ids, capture_layers=session.capture_layers)
    session.accept(session.propose(DraftContext(ids, max_depth=8)), [], out.hidden_states)
    for anchor in range(3, 40):  # any token may follow the verified context
        context = DraftContext(torch.cat([ids, torch.tensor([[anchor]])], dim=1), max_depth=8)
        tree = session.propose(context)
        assert len(tree) == 4 and tree.is_chain  # sample_from_anchor: the anchor's slot drafts
        first = int(tree.tokens[0, 0])
        if first != anchor and int(tree.tokens[0, 1]) != 7:
            break
    else:
        pytest.fail("no anchor whose first draft differs from it")
    with torch.no_grad():
        w1, w2 = drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight
        w1[first] = 0
        w1[first, 0] = 1e3
        w2[:, 0] = 0
        w2[7, 0] = 1.0
    again = session.propose(context)
    assert int(again.tokens[0, 0]) == first and int(again.tokens[0, 1]) == 7


def test_settings_it_cannot_honour_are_named(tiny_target, trained):
    """Said once, and decoding goes on, alone and in a batch (chains for tree_top_k)."""
    refs = [plain(tiny_target, p, 12) for p in PROMPTS]
    for setting, message in [
        (dict(gamma=6), "gamma=6 is capped at 4"),
        (dict(tree_top_k=3), "tree_top_k=3 is ignored by DSpark"),
    ]:
        with pytest.warns(UserWarning, match=message):
            out = generate(tiny_target, PROMPTS[0], trained, max_new_tokens=12, **setting)
        assert out.tokens[0].tolist() == refs[0] and out.stats.drafted > 0
        batch = generate(tiny_target, PROMPTS, trained, max_new_tokens=12, **setting)
        assert batch.rows() == refs and batch.stats.drafted > 0


def test_the_confidence_stop_cuts_chains(tiny_target, trained):
    """A stop_below above every predicted acceptance leaves one-token chains; none keeps the
    whole block."""
    out = generate(tiny_target, PROMPTS[1], trained, max_new_tokens=16, gamma=4, stop_below=0.999)
    assert out.stats.drafted > 0 and len(out.stats.acceptance_per_position) <= 1
    full = generate(tiny_target, PROMPTS[1], trained, max_new_tokens=16, gamma=4)
    assert out.stats.drafted < full.stats.drafted


def test_checkpoint_round_trip(tiny_target, trained, tmp_path):
    folder = save_drafter(trained, tmp_path / "ckpt", target_fingerprint=tiny_target.fingerprint)
    back = load_drafter(folder, tiny_target)
    assert isinstance(back, DSparkDrafter) and back.config == trained.config
    for name, tensor in trained.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


def test_bad_values_are_named(tiny_target):
    with pytest.raises(ValueError, match="markov_rank must be an integer >= 1"):
        DSparkConfig(markov_rank=0)
    with pytest.raises(ValueError, match="confidence_head_alpha must be >= 0"):
        DSparkConfig(confidence_head_alpha=-1.0)
    with pytest.raises(ValueError, match="block_size must be an integer >= 2"):
        DSparkConfig(block_size=1)


# -- export ----------------------------------------------------------------------------------


@pytest.mark.parametrize("from_anchor", [True, False])
def test_speculators_export_reads_back_with_identical_drafts(
    tiny_target, trained, tmp_path, from_anchor
):
    """speculators' dspark layout (its config fields and weight names, the heads beside DFlash's
    backbone) loads back through load_drafter as the same drafter; a damaged one is named."""
    import json

    from safetensors.torch import load_file

    from specdraft.formats.export_registry import export_drafter
    from specdraft.formats.reading import load_decoding

    torch.manual_seed(2)
    cfg = DSparkConfig(block_size=4, aux_layers=[1, 0], markov_rank=3,
                       sample_from_anchor=from_anchor, enable_confidence_head=from_anchor)  # fmt: skip
    drafter = DSparkDrafter.build(cfg, tiny_target)
    perturb(drafter.parameters(), 0.05)
    drafter.eval()
    decode = DecodeConfig(gamma=4 if from_anchor else 3, stop_below=0.2 if from_anchor else 0.0)
    out = export_drafter(drafter, tmp_path / "spec", "speculators",
                         base_model_name_or_path=tiny_target.name, decode=decode)  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark"
    assert config["architectures"] == ["DSparkSpeculator"]
    assert config["sample_from_anchor"] is from_anchor
    assert config["markov_head_type"] == "vanilla"
    assert config["enable_confidence_head"] is from_anchor
    tokens = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    assert tokens == (4 if from_anchor else 3)
    names = set(load_file(out / "model.safetensors"))
    assert names == set(drafter.state_dict())
    assert ("confidence_head.proj.bias" in names) is from_anchor
    back = load_drafter(out, tiny_target)
    assert isinstance(back, DSparkDrafter) and back.config.aux_layers == [0, 1]  # ascending
    assert dataclasses.replace(back.config, aux_layers=[1, 0]) == drafter.config
    assert load_decoding(out) == decode
    for temperature in (0.0, 1.0):
        a = generate(tiny_target, PROMPTS[0], drafter, max_new_tokens=16, temperature=temperature, seed=2, gamma=4)  # fmt: skip
        b = generate(tiny_target, PROMPTS[0], back, max_new_tokens=16, temperature=temperature, seed=2, gamma=4)  # fmt: skip
        assert a.tokens.tolist() == b.tokens.tolist() and a.stats.drafted > 0
        assert (a.stats.drafted, a.stats.accepted) == (b.stats.drafted, b.stats.accepted)
    for change, message in [
        ({"markov_head_type": "gated"}, "markov_head_type 'gated' is a variant"),
        ({"markov_rank": 0}, "markov_rank must be an integer >= 1"),
        ({"sample_from_anchor": "yes"}, "sample_from_anchor must be true or false"),
    ]:
        (out / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(CheckpointError, match=message):
            load_drafter(out, tiny_target)
