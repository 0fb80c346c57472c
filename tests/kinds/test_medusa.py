"""Medusa heads: the module (own weights per block, identity at the start), the Medusa-1 loss
against a naive per-head loop, the tree from measured accuracy, the checkpoint round trip, and
greedy output through the loop equal to plain greedy decoding for chains and trees of every
layout."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from spec_helpers import MEDUSA_PROMPTS, fitted_medusa_heads
from testkit import assert_chunking_exact, perturb

from specdraft.core import DecodeConfig, DraftTree, SamplingSettings, TargetOutput
from specdraft.formats.checkpoint import save_drafter
from specdraft.formats.reading import load_decoding, load_drafter
from specdraft.inference import generate
from specdraft.kinds.medusa.medusa import MedusaDrafter, MedusaSession, expected_length, tree_paths
from specdraft.kinds.medusa.medusa_config import MedusaConfig, MedusaDecode

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py says why


def noisy_heads(target, seed: int = 0, scale: float = 0.3, **config) -> MedusaDrafter:
    """Heads with random block weights: they draft varied tokens, sometimes accepted."""
    torch.manual_seed(seed)
    heads = MedusaDrafter.build(MedusaConfig(**config), target).eval()
    perturb((p for name, p in heads.named_parameters() if "blocks" in name), scale)
    return heads


def batch_and_target_out(target, B: int = 2, T: int = 12, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (B, T), generator=gen)
    loss_mask = (torch.rand(B, T, generator=gen) > 0.2).long()
    loss_mask[:, 0] = 0
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}
    out = target.forward(ids, capture_layers=[target.num_layers])
    return batch, out


def test_every_block_of_every_head_has_its_own_weights(random_target):
    heads = MedusaDrafter.build(MedusaConfig(num_heads=3, num_layers=2), random_target)
    before = {k: v.clone() for k, v in heads.state_dict().items()}
    with torch.no_grad():
        heads.heads[1].blocks[0].linear.weight.add_(1.0)
    changed = [
        k
        for k, v in heads.state_dict().items()
        if not torch.allclose(v, before[k], rtol=0, atol=0, equal_nan=True)
    ]
    assert changed == ["heads.1.blocks.0.linear.weight"]
    ptrs = [p.data_ptr() for p in heads.parameters()]
    assert len(ptrs) == len(set(ptrs))  # no parameter is stored twice


@pytest.mark.parametrize("output", ["own", "shared"])
def test_fresh_heads_are_the_target_lm_head(random_target, output):
    """Zero-initialised blocks are the identity and the output layers start as the LM head, so
    every fresh head predicts what the target's next-token head does."""
    heads = MedusaDrafter.build(MedusaConfig(num_heads=2, output=output), random_target)
    h = torch.randn(3, random_target.hidden_size)
    expected = random_target.lm_head(h)
    for logits in heads.logits(h):
        torch.testing.assert_close(logits, expected)


def naive_loss(heads: MedusaDrafter, batch, out) -> torch.Tensor:
    """Medusa-1 written out position by position, head by head: the sum over scored tokens."""
    cfg = heads.config
    ids, mask = batch["input_ids"], batch["loss_mask"]
    B, T = ids.shape
    h = out.hidden_states[heads.capture_layers[0]]
    total = torch.zeros(())
    for k in range(cfg.num_heads):
        terms = []
        for b, t in itertools.product(range(B), range(T - 2 - k)):
            if not mask[b, t + 2 + k]:
                continue
            x = h[b, t]
            for block in heads.heads[k].blocks:
                x = x + F.silu(block.linear.weight @ x + block.linear.bias)
            log_q = F.log_softmax(heads.heads[k].out.weight @ x, -1)  # over the draft vocab
            if cfg.loss == "ce":
                label = int(heads.t2d[ids[b, t + 2 + k]])
                if label < 0:
                    continue
                terms.append(-log_q[label])
            else:
                p_full = out.logits[b, t + 1 + k]
                if int(heads.t2d[p_full.argmax()]) < 0:
                    continue
                log_p = F.log_softmax(p_full[heads.d2t], -1)
                terms.append((log_p.exp() * (log_p - log_q)).sum())
        if terms:
            total = total + cfg.loss_decay**k * torch.stack(terms).sum()
    return total


@pytest.mark.parametrize(
    "config",
    [
        dict(num_heads=3, num_layers=2, loss="ce"),
        dict(num_heads=2, loss="kl", loss_decay=1.0),
        dict(num_heads=3, loss="ce", draft_vocab_size=200),
        dict(num_heads=2, loss="kl", draft_vocab_size=100),
    ],
    ids=["ce", "kl-plain-sum", "ce-draft-vocab", "kl-draft-vocab"],
)
def test_the_loss_equals_a_naive_per_head_loop(random_target, config):
    d2t = None
    if config.get("draft_vocab_size"):
        d2t = torch.randperm(random_target.vocab_size)[: config["draft_vocab_size"]].sort().values
    heads = MedusaDrafter.build(MedusaConfig(**config), random_target, d2t)
    perturb(heads.parameters(), 0.1)
    batch, out = batch_and_target_out(random_target)
    loss, metrics = heads(batch, out)
    torch.testing.assert_close(loss, naive_loss(heads, batch, out), rtol=1e-4, atol=1e-4)
    # head 0 predicts token t + 2 from position t: the loss tokens from the third on
    assert heads.loss_tokens(batch).item() == batch["loss_mask"][:, 2:].sum().item()
    assert set(metrics) == {
        f"{m}_{k}" for m in ("loss", "top1", "top5") for k in range(config["num_heads"])
    }
    assert all(
        0 <= float(metrics[f"top1_{k}"][0]) <= float(metrics[f"top5_{k}"][0])
        <= float(metrics[f"top5_{k}"][1])
        for k in range(config["num_heads"])
    )  # fmt: skip
    loss.backward()  # every head's blocks are trained
    assert all(b.linear.weight.grad is not None for head in heads.heads for b in head.blocks)


@pytest.mark.parametrize(
    "config",
    [
        dict(num_heads=3, num_layers=2, loss="ce", draft_vocab_size=200),
        dict(num_heads=2, loss="kl", draft_vocab_size=100),
        dict(num_heads=2, loss="kl"),
        dict(num_heads=2, loss="ce", output="shared"),
    ],
    ids=["ce-draft-vocab", "kl-draft-vocab", "kl", "ce-shared"],
)
def test_the_chunked_loss_and_its_gradients_equal_the_naive_ones(one_thread, random_target, config):
    """Chunks of every size give the unchunked loss and gradients (heads and the target's final
    states), masked positions and tokens outside the draft vocabulary included."""
    d2t = None
    if config.get("draft_vocab_size"):
        d2t = torch.randperm(random_target.vocab_size)[: config["draft_vocab_size"]].sort().values
    heads = MedusaDrafter.build(MedusaConfig(**config), random_target, d2t)
    perturb(heads.parameters(), 0.1)
    batch, out = batch_and_target_out(random_target)
    L = random_target.num_layers
    h = out.hidden_states[L].clone().requires_grad_()
    out = TargetOutput(logits=out.logits[:, -1:], hidden_states={L: h})  # as the trainer's
    assert_chunking_exact(heads, lambda: heads(batch, out)[0], [h])


def test_acceptance_and_accuracy_statistics_agree(random_target):
    """Depth d of the simulated chain is head d - 1's top-1 agreement with the target's argmax,
    which is also rank 0 of the accuracy the tree is built from."""
    heads = noisy_heads(random_target, num_heads=3)
    batch, out = batch_and_target_out(random_target)
    # deeper than the heads: 3 depths
    alpha, greedy, count = heads.acceptance(batch, out, DecodeConfig(gamma=5))
    assert alpha.shape == greedy.shape == count.shape == (3,)
    sums = heads.eval_statistics(batch, out)
    torch.testing.assert_close(sums["greedy"][:, 0], greedy)
    torch.testing.assert_close(sums["count"][:, 0], count)
    assert torch.all(sums["greedy"].sum(1) <= count) and torch.all(alpha <= count)
    summary = heads.heldout_summary(sums)
    torch.testing.assert_close(torch.tensor(summary["accuracy_greedy"])[:, 0], greedy / count)
    assert not torch.isnan(torch.tensor(summary["accuracy_sampled"])).any()


def test_the_tree_is_the_best_under_the_budget():
    """The chosen nodes are the `budget` most probable rank paths of all (a child never beats its
    parent, so they form a tree), and no other tree of that size expects more accepted tokens."""
    acc = torch.tensor([[0.5, 0.2, 0.1], [0.4, 0.15, 0.05], [0.3, 0.1, 0.02]])
    every = [p for d in (1, 2, 3) for p in itertools.product(range(2), repeat=d)]  # top_k 2
    for budget in (1, 4, 9, len(every)):
        paths = tree_paths(acc, budget=budget, depth=3, top_k=2)
        assert len(paths) == min(budget, len(every)) and len(set(paths)) == len(paths)
        assert all(p[:-1] in paths for p in paths if len(p) > 1)  # closed under parents
        assert all(r < 2 for p in paths for r in p)
        prob = {p: math.prod(acc[i, r].item() for i, r in enumerate(p)) for p in every}
        best = sorted(prob.values(), reverse=True)[: len(paths)]
        assert expected_length(acc, paths) == pytest.approx(sum(best))
    assert tree_paths(acc, budget=4, depth=1, top_k=3) == [(0,), (1,), (2,)]


def test_checkpoint_round_trip_keeps_weights_accuracy_and_decoding(random_target, tmp_path):
    heads = noisy_heads(random_target, num_heads=3, num_layers=2)
    batch, out = batch_and_target_out(random_target)
    heldout = heads.heldout_summary(heads.eval_statistics(batch, out))
    decode = MedusaDecode(gamma=3, tree_top_k=3, tree_budget=7)
    fingerprint = random_target.fingerprint
    save_drafter(
        heads, tmp_path / "heads", target_fingerprint=fingerprint, decode=decode, heldout=heldout
    )
    loaded = load_drafter(tmp_path / "heads", random_target)
    assert isinstance(loaded, MedusaDrafter) and load_decoding(tmp_path / "heads") == decode
    assert loaded.config == heads.config  # its nested lora settings as LoraConfig too
    # the checkpoint's, not the module's; and a loaded drafter still copies as any module does
    assert loaded.checkpoint.heldout == heldout and heads.checkpoint.heldout == {}
    assert copy.deepcopy(loaded).checkpoint == loaded.checkpoint
    for (k, a), (k2, b) in zip(
        heads.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert k == k2 and torch.equal(a, b)


GREEDY_CASES = {
    "chain": (dict(num_heads=4), dict(gamma=4, tree_top_k=1)),
    "chain-stop-below": (dict(num_heads=3), dict(gamma=3, tree_top_k=1, stop_below=0.3)),
    "tree": (dict(num_heads=4), dict(gamma=4, tree_top_k=3, tree_budget=10)),
    "tree-two-blocks": (dict(num_heads=3, num_layers=2), dict(gamma=3, tree_top_k=4, tree_budget=16)),
    "tree-shared-output": (dict(num_heads=3, output="shared"), dict(gamma=3, tree_top_k=3, tree_budget=8)),
    "tree-draft-vocab": (dict(num_heads=3, draft_vocab_size=150), dict(gamma=3, tree_top_k=3, tree_budget=8)),
    "tree-int8": (dict(num_heads=3), dict(gamma=3, tree_top_k=3, tree_budget=8, draft_weights="int8")),
    "copying-tree": (dict(num_heads=3), dict(gamma=3, tree_top_k=2, tree_budget=6, lookup_ngram=2)),
}  # fmt: skip


PROMPTS = MEDUSA_PROMPTS


@pytest.mark.parametrize("case", GREEDY_CASES)
def test_greedy_output_equals_plain_greedy_decoding(random_target, case, monkeypatch):
    config, decoding = GREEDY_CASES[case]
    d2t = None
    if config.get("draft_vocab_size"):  # every other token: some of the target's are missing
        d2t = torch.arange(0, random_target.vocab_size, 2)[: config["draft_vocab_size"]]
    heads = fitted_medusa_heads(random_target, config, d2t)
    sizes = []
    propose = MedusaSession.propose
    monkeypatch.setattr(
        MedusaSession, "propose", lambda s, ctxs: sizes.extend(map(len, t := propose(s, ctxs))) or t
    )
    accepted = drafted = 0
    for prompt in PROMPTS:
        plain = generate(random_target, prompt, max_new_tokens=48)
        spec = generate(random_target, prompt, heads, max_new_tokens=48, **decoding)
        assert spec.tokens.tolist() == plain.tokens.tolist()
        accepted, drafted = accepted + spec.stats.accepted, drafted + spec.stats.drafted
    # not vacuous: drafts were accepted, and rejected
    assert 0 < accepted < drafted
    if decoding["tree_top_k"] > 1 and not decoding.get("lookup_ngram"):
        assert max(sizes) > decoding["gamma"]  # trees, not chains


def test_bad_settings_are_clear_errors(random_target):
    for bad, message in [
        (dict(num_heads=0), "num_heads must be an integer >= 1"),
        (dict(num_layers=0), "num_layers must be an integer >= 1"),
        (dict(loss_decay=0.0), "loss_decay must be in"),
        (dict(output="shared", draft_vocab_size=10), "needs output=own"),
    ]:
        with pytest.raises(ValueError, match=message):
            MedusaConfig(**bad)
    with pytest.raises(ValueError, match="larger than the target"):
        MedusaDrafter.build(MedusaConfig(draft_vocab_size=10_000), random_target)
    with pytest.raises(ValueError, match="tree_budget must be an integer >= 1"):
        DecodeConfig(tree_budget=0)
    heads = noisy_heads(random_target, num_heads=2)
    session = heads.new_session(random_target, sampling=SamplingSettings(), decode=DecodeConfig())
    with pytest.raises(ValueError, match="needs hidden_states"):
        session.accept(DraftTree.empty(), [], None)
    short = {"input_ids": torch.zeros(1, 2, dtype=torch.long)}
    short |= {"attention_mask": torch.ones(1, 2), "loss_mask": torch.ones(1, 2)}
    out = TargetOutput(torch.zeros(1, 2, random_target.vocab_size),
                       {random_target.num_layers: torch.zeros(1, 2, random_target.hidden_size)})  # fmt: skip
    with pytest.raises(ValueError, match="too short for any Medusa head"):
        heads(short, out)
    # a batch long enough for head 0 only still reports every head's figures, as (0, 0) for
    # the others: processes whose batches differ in length reduce the same keys
    three = {k: torch.ones(1, 3, dtype=v.dtype) for k, v in short.items()}
    out = TargetOutput(torch.zeros(1, 3, random_target.vocab_size),
                       {random_target.num_layers: torch.zeros(1, 3, random_target.hidden_size)})  # fmt: skip
    _, metrics = heads(three, out)
    assert set(metrics) == {f"{m}_{k}" for m in ("loss", "top1", "top5") for k in range(2)}
    assert metrics["loss_1"][1].item() == 0 and metrics["loss_0"][1].item() == 1


def test_an_adapter_of_another_model_is_a_clear_error(tmp_path):
    """A LoRA adapter trained on a model of another shape does not merge into the target: the
    error names the adapter folder and the fix."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from spec_helpers import tiny_llama

    from specdraft.targets.target import TargetError, merge_adapter

    other = get_peft_model(
        tiny_llama(384, seed=0, hidden=48), PeftLoraConfig(r=4, target_modules=["q_proj"])
    )
    other.save_pretrained(str(tmp_path))
    with pytest.raises(TargetError, match=r"does not fit this target.*load the base model"):
        merge_adapter(tiny_llama(384, seed=1, hidden=32), tmp_path)


def test_medusa2_evaluation_reuses_one_target_pass(monkeypatch):
    """Given the fine-tuned target's output (evaluation), Medusa-2's loss is computed from it, as
    the acceptance and statistics are, instead of running the target again; without it
    (training) the loss runs the target itself, with gradients into the adapters."""
    from spec_helpers import make_target, tiny_llama

    from specdraft.drafters.base import LoraConfig
    from specdraft.targets.target import Target

    target = make_target(tiny_llama(384, seed=5))
    config = MedusaConfig(num_heads=2, lora=LoraConfig(rank=2, dropout=0.0), target_loss="lm")
    heads = MedusaDrafter.build(config, target).eval()
    batch, out = batch_and_target_out(target)
    trained = heads(batch, None)[0]  # runs the target itself
    calls = []
    monkeypatch.setattr(Target, "forward_with_grad", lambda *a, **k: calls.append(1))
    with torch.no_grad():
        given = heads(batch, out)[0]
    assert calls == []
    torch.testing.assert_close(given, trained.detach())


@pytest.mark.parametrize("target_loss", ["lm", "kl"])
def test_medusa2_chunked_loss_and_gradients_equal_the_naive_ones(one_thread, target_loss):
    """Medusa-2's whole loss, its target term (the fine-tuned target's cross-entropy, or its KL
    from the base with the adapters off) included, computed a chunk of positions at a time:
    the unchunked loss and gradients, the adapters' and the heads'."""
    from spec_helpers import make_target, tiny_llama

    from specdraft.drafters.base import LoraConfig

    target = make_target(tiny_llama(384, seed=5))
    config = MedusaConfig(
        num_heads=2, lora=LoraConfig(rank=2, dropout=0.0), target_loss=target_loss
    )
    torch.manual_seed(0)
    heads = MedusaDrafter.build(config, target).train()
    perturb(heads.parameters(), 0.1)  # the adapters' B starts at 0: let them matter
    batch, _ = batch_and_target_out(target)
    assert any(n.startswith("lora.") for n, p in heads.named_parameters() if p.requires_grad)
    assert_chunking_exact(heads, lambda: heads(batch, None)[0])
