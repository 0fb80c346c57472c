"""DFlash: the block loss equals a naive loop over anchors (each block run on its own, with only
the context before its anchor), anchors depend on the step and the example alone, greedy output
equals plain greedy (with and without copying), sampled output follows the target (chi-square,
with its power shown), checkpoints round-trip bit for bit, and bad values are named."""

from __future__ import annotations

import pytest
import torch
from testkit import perturb

from specdraft.core import DecodeConfig, DraftContext, DraftTree, SamplingSettings
from specdraft.formats.checkpoint import CheckpointError, save_drafter
from specdraft.formats.reading import load_drafter
from specdraft.inference import generate
from specdraft.kinds.dflash.dflash import DFlashConfig, DFlashDrafter
from specdraft.targets.target import TargetError

# Exactness: CI runs these once more with native bf16 forced off (tests/conftest.py).
pytestmark = pytest.mark.exact


@pytest.fixture(autouse=True, scope="module")
def _single_threaded(one_thread):
    """Tiny models: one thread (tests/conftest.py says why)."""


def batch_of(ids: torch.Tensor, lengths: list[int], prompt: int = 2) -> dict:
    """Right-padded rows of `lengths` real tokens, the first `prompt` of each unscored."""
    attention = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        attention[r, :n] = 1
    loss_mask = attention.clone()
    loss_mask[:, :prompt] = 0
    loss_mask[0, 7] = 0  # a hole: the slot predicting position 7 scores nothing
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}


def train_briefly(target, config: DFlashConfig, steps: int = 40) -> DFlashDrafter:
    """A drafter fitted for a few Adam steps to the target's predictions on random text, so it
    drafts tokens that are sometimes accepted."""
    torch.manual_seed(0)
    drafter = DFlashDrafter.build(config, target)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    V = target.vocab_size
    for step in range(steps):
        ids = torch.randint(3, V, (8, 24))
        batch = batch_of(ids, [24] * 8, prompt=1)
        batch["loss_mask"][0, 7] = 1
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
    return train_briefly(tiny_target, DFlashConfig(block_size=4, anchors=8))


# -- the loss --------------------------------------------------------------------------------


def naive(drafter: DFlashDrafter, batch: dict, out, gamma: int):
    """Each anchor's block alone: the context is the features before the anchor, no mask.
    Returns the weighted KL sum, the scored slots, and per depth (alpha, agree, count) as a
    chain accepts them (depth d counts blocks whose slots before d all agreed)."""
    B = drafter.block_size
    features = drafter.features(out.hidden_states)
    total, tokens = 0.0, 0
    alpha, agree, count = (torch.zeros(gamma) for _ in range(3))
    anchors = drafter.anchors_of(batch)
    for row in range(anchors.shape[0]):
        for a in anchors[row].tolist():
            if a < 0:
                continue
            context = drafter.context_kv(features[row : row + 1, :a], torch.arange(a)[None])
            tokens_in = torch.tensor([[int(batch["input_ids"][row, a])] + [drafter.config.mask_token_id] * (B - 1)])  # fmt: skip
            h = drafter.block_states(tokens_in, (a + torch.arange(B))[None], context)
            reached = True
            for i in range(1, B):
                logits = drafter.draft_logits(h[0, i]).float()
                p_logits = out.logits[row, a + i - 1].float()
                if not batch["loss_mask"][row, a + i]:
                    reached = False  # an unscored slot ends what the chain can be credited
                    continue
                log_q, log_p = logits.log_softmax(-1), p_logits.log_softmax(-1)
                kl = float((log_p.exp() * (log_p - log_q)).sum())
                total += kl * torch.exp(torch.tensor(-(i - 1) / drafter.config.position_decay))
                tokens += 1
                if i <= gamma and reached:
                    alpha[i - 1] += float(torch.minimum(log_p.exp(), log_q.exp()).sum())
                    same = bool(logits.argmax() == p_logits.argmax())
                    agree[i - 1] += same
                    count[i - 1] += 1
                    reached = same
    return total, tokens, alpha, agree, count


@pytest.mark.parametrize("which", ["perturbed", "trained"])
def test_loss_and_acceptance_equal_a_naive_loop_over_anchors(tiny_target, trained, which):
    """Perturbed: far from the target (a large KL, compared relatively); trained: close to it
    (slots agree, so later depths are reached)."""
    drafter = trained
    if which == "perturbed":
        torch.manual_seed(2)
        drafter = DFlashDrafter.build(DFlashConfig(block_size=4, anchors=8), tiny_target)
        perturb(drafter.parameters(), 0.3)
    torch.manual_seed(3)
    ids = torch.randint(3, tiny_target.vocab_size, (3, 22))
    batch = batch_of(ids, [22, 15, 9])
    out = tiny_target.forward(ids, capture_layers=drafter.capture_layers)
    with torch.no_grad():
        loss, metrics = drafter(batch, out)
        a, g, c = drafter.acceptance(batch, out, DecodeConfig(gamma=5))
        total, tokens, alpha, agree, count = naive(drafter, batch, out, gamma=5)
    assert tokens > 20 and float(drafter.loss_tokens(batch)) == tokens
    assert sum(float(n) for _, n in (metrics[f"loss_{i}"] for i in (1, 2, 3))) == tokens
    # a KL of near-equal distributions is a difference of sums of about log(vocab) a token: its
    # rounding is absolute (tests/train/test_loss_token_mean.py)
    assert float(loss) == pytest.approx(float(total), rel=1e-5, abs=1e-6 * tokens)
    assert torch.allclose(a, alpha, atol=1e-4) and torch.equal(g, agree) and torch.equal(c, count)
    assert c[3:].sum() == 0 and c[0] > 0  # depths beyond B - 1 are never drafted
    if which == "perturbed":  # a chain stops at its first disagreement
        assert float(loss) > tokens * 0.1 and c[0] > c[1]
    else:
        assert c[2] > 0


def test_chunked_loss_from_the_final_state_equals_the_whole_one(tiny_target):
    """Training's way (the target's final state captured, its logits made inside the loss a
    few slots at a time) gives the loss and gradients of the whole-vocabulary loss on the
    forward's logits."""
    torch.manual_seed(5)
    drafter = DFlashDrafter.build(DFlashConfig(block_size=4, anchors=8), tiny_target)
    perturb(drafter.parameters(), 0.3)
    ids = torch.randint(3, tiny_target.vocab_size, (3, 22))
    batch = batch_of(ids, [22, 15, 9])
    layers = [*drafter.capture_layers, tiny_target.num_layers]
    results = []
    for chunk, keep in ((0, 0), (5, 1)):  # whole, from the logits; chunks of 5, from the state
        drafter.loss_chunk_tokens = chunk
        out = tiny_target.forward(ids, capture_layers=layers, logits_to_keep=keep)
        if keep:
            assert out.logits.shape[1] == 1  # no (batch, seq, vocab) logits of the target
        else:
            out.hidden_states.pop(tiny_target.num_layers)
        drafter.zero_grad()
        loss, _ = drafter(batch, out)
        loss.backward()
        results.append((float(loss.detach()), [p.grad.clone() for p in drafter.parameters()]))
    (whole, g_whole), (chunked, g_chunked) = results
    assert chunked == pytest.approx(whole, rel=1e-5)
    for a, b in zip(g_whole, g_chunked, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_anchors_depend_on_the_step_and_the_example_alone(tiny_target, trained):
    """prepare_batch draws each row's anchors from its example index and the step's shared
    seed: the same in any batch, padded or not; blocks fit inside the row."""
    torch.manual_seed(4)
    ids = torch.randint(3, tiny_target.vocab_size, (2, 30))
    together = batch_of(ids, [30, 12]) | {"example_index": torch.tensor([5, 9])}
    alone = batch_of(ids[1:, :12], [12]) | {"example_index": torch.tensor([9])}
    alone["loss_mask"][0, 7] = together["loss_mask"][1, 7]
    step = torch.Generator().manual_seed(11)
    a = trained.prepare_batch(together, None, None, step)["anchors"]
    b = trained.prepare_batch(alone, None, None, step)["anchors"]
    assert torch.equal(a[1], b[0]) and (a[1] >= 0).sum() == 12 - 4  # a in 1..n - B
    other = trained.prepare_batch(dict(together), None, None, torch.Generator().manual_seed(12))
    assert not torch.equal(other["anchors"][0], a[0])
    assert ((a[a >= 0] + trained.block_size - 1) < 30).all()


def test_gradients_reach_the_drafter_only(tiny_target):
    drafter = DFlashDrafter.build(DFlashConfig(block_size=3, anchors=4), tiny_target)
    ids = torch.randint(3, tiny_target.vocab_size, (2, 16))
    batch = batch_of(ids, [16, 16])
    loss, _ = drafter(batch, tiny_target.forward(ids, capture_layers=drafter.capture_layers))
    loss.backward()
    assert all(p.grad is not None for p in drafter.parameters())
    assert all(p.grad is None for p in tiny_target.model.parameters())
    assert "embed_tokens" not in " ".join(drafter.state_dict())


# -- decoding --------------------------------------------------------------------------------

PROMPTS = [[5, 17, 42, 99, 7, 250], [300, 12, 12, 64]]


def plain(target, prompt, n):
    return generate(target, prompt, None, max_new_tokens=n).tokens[0].tolist()


@pytest.mark.parametrize(
    "options",
    [
        dict(gamma=3),
        dict(gamma=2, stop_below=0.2),
        dict(gamma=3, lookup_ngram=2),
        dict(gamma=3, tree_top_k=3, tree_budget=8),
    ],
    ids=["chain", "stopping-chain", "copying", "tree"],
)
def test_greedy_output_equals_plain_greedy(tiny_target, trained, options):
    drafted = accepted = copied = 0
    for prompt in [*PROMPTS, PROMPTS[0] * 3]:
        out = generate(tiny_target, prompt, trained, max_new_tokens=24, **options)
        assert out.tokens[0].tolist() == plain(tiny_target, prompt, 24)
        s = out.stats
        drafted, accepted, copied = drafted + s.drafted, accepted + s.accepted, copied + s.copied_passes  # fmt: skip
        assert s.drafter_kv_bytes > 0 and len(s.acceptance_per_position) <= 3  # B - 1 at most
    assert drafted > 0 and accepted > 0
    assert (copied > 0) == ("lookup_ngram" in options)


def test_settings_it_cannot_honour_are_named_and_output_stays_exact(tiny_target, trained):
    ref = plain(tiny_target, PROMPTS[0], 12)
    for setting, message in [
        (dict(gamma=6), "gamma=6 is capped at 3"),
        (dict(tree_top_k=3, stop_below=0.2), "stop_below is ignored by DFlash trees"),
        (dict(draft_weights="int8"), "draft_weights=int8 is ignored by DFlash"),
    ]:
        with pytest.warns(UserWarning, match=message):
            out = generate(tiny_target, PROMPTS[0], trained, max_new_tokens=12, **setting)
        assert out.tokens[0].tolist() == ref and out.stats.drafted > 0


def test_a_one_token_prompt_drafts_once_there_is_context(tiny_target, trained):
    out = generate(tiny_target, [5], trained, max_new_tokens=16, gamma=3)
    assert out.tokens[0].tolist() == plain(tiny_target, [5], 16) and out.stats.drafted > 0


def test_sampled_drafts_record_each_slots_q(tiny_target, trained):
    session = trained.new_session(
        tiny_target, sampling=SamplingSettings(temperature=1.0), decode=DecodeConfig(gamma=3),
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    prompt = torch.tensor([PROMPTS[0]])
    out = tiny_target.forward(prompt, capture_layers=session.capture_layers)
    first = session.propose(DraftContext(prompt, max_depth=8))
    assert len(first) == 0  # no features before the prompt's forward
    session.accept(first, [], out.hidden_states)
    bonus = out.logits[:, -1:].argmax(-1)  # the token the loop emits after the prompt
    tree = session.propose(DraftContext(torch.cat([prompt, bonus], dim=1), max_depth=8))
    assert len(tree) == 3 and tree.q.shape == (1, 3, tiny_target.vocab_size)
    assert torch.allclose(tree.q.sum(-1), torch.ones(1, 3))
    assert (tree.q[0].gather(-1, tree.tokens[0][:, None]) > 0).all()


def test_accept_without_the_verified_features_is_named(tiny_target, trained):
    session = trained.new_session(
        tiny_target, sampling=SamplingSettings(temperature=0.0), decode=DecodeConfig(gamma=3)
    )
    prompt = torch.tensor([PROMPTS[0]])
    first = session.propose(DraftContext(prompt, max_depth=8))
    with pytest.raises(ValueError, match=r"DFlashSession.accept needs hidden_states"):
        session.accept(first, [], None)
    tree = DraftTree.chain(torch.tensor([[7, 8]]))  # two drafted nodes, no pending token
    states = {layer: torch.zeros(1, 2, tiny_target.hidden_size) for layer in trained.capture_layers}
    with pytest.raises(ValueError, match=r"hidden states for 2 positions; expected the pending"):
        session.accept(tree, [0], states)


# -- checkpoint and config -------------------------------------------------------------------


def test_checkpoint_round_trip_bit_for_bit(tiny_target, trained, tmp_path):
    folder = save_drafter(trained, tmp_path / "final", target_fingerprint=tiny_target.fingerprint)
    loaded = load_drafter(folder, tiny_target)
    assert isinstance(loaded, DFlashDrafter) and loaded.config == trained.config
    assert loaded.config.mask_token_id is not None and loaded.config.aux_layers
    mine, theirs = trained.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    a = generate(
        tiny_target, PROMPTS[0], trained, max_new_tokens=16, temperature=1.0, seed=3, gamma=3
    )
    b = generate(
        tiny_target, PROMPTS[0], loaded, max_new_tokens=16, temperature=1.0, seed=3, gamma=3
    )
    assert a.tokens.tolist() == b.tokens.tolist() and a.stats.accepted == b.stats.accepted


def test_init_from_the_target_copies_its_top_layers(tiny_target):
    drafter = DFlashDrafter.build(DFlashConfig(init="target"), tiny_target)
    top = tiny_target.layers[-1]
    assert torch.equal(drafter.layers[0].self_attn.q_proj.weight, top.self_attn.q_proj.weight)
    assert torch.equal(drafter.layers[0].mlp.down_proj.weight, top.mlp.down_proj.weight)
    assert torch.equal(drafter.norm.weight, tiny_target.norm.weight)


def test_bad_values_are_named(tiny_target):
    with pytest.raises(ValueError, match="block_size must be an integer >= 2"):
        DFlashConfig(block_size=1)
    with pytest.raises(ValueError, match="anchors must be an integer >= 1"):
        DFlashConfig(anchors=0)
    with pytest.raises(ValueError, match="position_decay must be >= 0"):
        DFlashConfig(position_decay=-1.0)
    with pytest.raises(ValueError, match=r"mask_token_id=384 is outside .* vocabulary \(0..383\)"):
        DFlashDrafter.build(DFlashConfig(mask_token_id=384), tiny_target)
    with pytest.raises(TargetError, match="layer id 7 is out of range"):
        DFlashDrafter.build(DFlashConfig(aux_layers=[1, 7]), tiny_target)


def test_the_mask_token_defaults_to_one_the_tokenizer_has(tiny_target):
    drafter = DFlashDrafter.build(DFlashConfig(), tiny_target)
    tok = tiny_target.tokenizer
    expected = next(
        i for i in (getattr(tok, "mask_token_id", None), tok.pad_token_id, tok.unk_token_id)
        if i is not None
    )  # fmt: skip
    assert drafter.config.mask_token_id == expected


def test_slot_weights_decay_from_slot_one(tiny_target):
    def weights(decay: float) -> torch.Tensor:
        config = DFlashConfig(block_size=4, position_decay=decay)
        return DFlashDrafter.build(config, tiny_target).slot_weights("cpu")

    assert torch.allclose(weights(2.0), torch.exp(-torch.arange(3) / 2.0))
    assert torch.equal(weights(0.0), torch.ones(3))


# -- export ----------------------------------------------------------------------------------


def test_speculators_export_reads_back_with_identical_drafts(tiny_target, tmp_path):
    """The speculators layout (speculators' own weight names, embedding and LM head left to the
    verifier, fc's feature blocks in ascending layer order) loads back through load_drafter as
    the same drafter: the same drafts and decoding settings, key for key."""
    import json

    from safetensors.torch import load_file

    from specdraft.formats.export_formats import ExportError
    from specdraft.formats.export_registry import export_drafter
    from specdraft.formats.reading import load_decoding

    torch.manual_seed(1)
    drafter = DFlashDrafter.build(DFlashConfig(block_size=4, aux_layers=[1, 0]), tiny_target)
    perturb(drafter.parameters(), 0.05)
    drafter.eval()
    decode = DecodeConfig(gamma=3, lookup_ngram=2)
    out = export_drafter(drafter, tmp_path / "spec", "speculators",
                         base_model_name_or_path=tiny_target.name, decode=decode)  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["block_size"] == 4
    assert config["aux_hidden_state_layer_ids"] == [0, 1] and config["sample_from_anchor"] is False
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert config["transformer_layer_config"]["num_hidden_layers"] == 1
    names = set(load_file(out / "model.safetensors"))
    assert names == set(drafter.state_dict()) and "embed_tokens.weight" not in names
    back = load_drafter(out, tiny_target)
    assert isinstance(back, DFlashDrafter) and back.config.aux_layers == [0, 1]
    assert load_decoding(out) == decode
    for temperature in (0.0, 1.0):
        a = generate(tiny_target, PROMPTS[0], drafter, max_new_tokens=16, temperature=temperature, seed=2, gamma=3)  # fmt: skip
        b = generate(tiny_target, PROMPTS[0], back, max_new_tokens=16, temperature=temperature, seed=2, gamma=3)  # fmt: skip
        assert a.tokens.tolist() == b.tokens.tolist() and a.stats.drafted > 0
        assert (a.stats.drafted, a.stats.accepted) == (b.stats.drafted, b.stats.accepted)
    # a drafter reading one layer twice cannot be served: the engines capture each once
    twice = DFlashDrafter.build(DFlashConfig(block_size=4, aux_layers=[1, 1]), tiny_target)
    with pytest.raises(ExportError, match="a layer twice"):
        export_drafter(twice, tmp_path / "bad", "speculators", base_model_name_or_path="x")
    # a damaged folder is named, not misread
    config["block_size"] = 1
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="block_size must be an integer >= 2"):
        load_drafter(out, tiny_target)
