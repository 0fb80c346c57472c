"""A new drafter kind moves in with one file: this one. A bigram drafter (a table of next-token
logits per token) is defined here and nowhere in the library, registers itself by its `kind`,
trains two steps through the one trainer, saves and loads through the one checkpoint writer and
reader, decodes exactly in the one loop, and is tuned and evaluated by the same scripts as the
real kinds. If any of those needed a line of library code naming the kind, this test could not
be written."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specdraft.core import DecodeConfig, DraftContext, DraftTree, SamplingSettings
from specdraft.data.formats import Example
from specdraft.drafters.base import Drafter, Metrics, sum_and_count
from specdraft.drafters.sessions import DraftSession
from specdraft.drafting import draft_chain
from specdraft.formats.reading import load_decoding, load_drafter
from specdraft.inference.generate import generate
from specdraft.measuring.measure import load_prompts
from specdraft.tools import evaluate
from specdraft.tools import tune as tune_script
from specdraft.train.train_config import TrainConfig
from specdraft.train.trainer import train

pytestmark = pytest.mark.exact


@dataclass
class BigramConfig:
    # The table's logits start at zero (a uniform draft) unless a scale is given.
    init_scale: float = 0.0


class BigramDrafter(Drafter):
    """Drafts the next token from the current one alone."""

    kind = "bigram_test"
    config_class = BigramConfig

    def __init__(self, config: BigramConfig, vocab_size: int) -> None:
        super().__init__()
        self.config = config
        self.table = nn.Embedding(vocab_size, vocab_size)  # (vocab, vocab) next-token logits
        nn.init.normal_(self.table.weight, std=config.init_scale)

    @classmethod
    def from_checkpoint(cls, config: BigramConfig, target, hf_model) -> BigramDrafter:
        return cls(config, target.vocab_size)

    def loss(self, batch: Mapping[str, torch.Tensor], target_out) -> tuple[torch.Tensor, Metrics]:
        logits = self.table(batch["input_ids"][:, :-1]).float()  # (batch, seq - 1, vocab)
        keep = batch["loss_mask"][:, 1:].bool()
        ce = F.cross_entropy(logits.transpose(1, 2), batch["input_ids"][:, 1:], reduction="none")
        return ce.where(keep, 0).sum(), {"ce": sum_and_count(ce, keep)}

    @torch.no_grad()
    def acceptance(self, batch, target_out, decode: DecodeConfig):
        keep = batch["loss_mask"][:, 1:].bool()
        q = self.table(batch["input_ids"][:, :-1])[keep].float().softmax(-1)  # (n, vocab)
        p = target_out.logits[:, :-1][keep].float().softmax(-1)
        alpha = torch.minimum(p, q).sum()
        agree = (q.argmax(-1) == p.argmax(-1)).sum().float()
        count = keep.sum().float()
        return alpha.repeat(decode.gamma), agree.repeat(decode.gamma), count.repeat(decode.gamma)

    def new_session(self, target, *, sampling, decode, generator=None) -> BigramSession:
        return BigramSession(self.table.weight, sampling, decode, generator)


class BigramSession(DraftSession):
    def __init__(self, table: torch.Tensor, sampling: SamplingSettings, decode, generator):
        self.table, self.sampling, self.decode, self.generator = table, sampling, decode, generator

    @torch.no_grad()
    def propose(self, context: DraftContext) -> DraftTree:
        last = context.tokens[:, -1]  # (batch,)
        return draft_chain(
            self.table[last], lambda token, i: self.table[token[:, 0]],
            depth=min(self.decode.gamma, context.max_depth), sampling=self.sampling,
            generator=self.generator,
        )  # fmt: skip


@dataclass
class BigramTrainConfig(TrainConfig):
    kind: ClassVar[str] = "bigram_test"
    drafter: BigramConfig = field(default_factory=BigramConfig)


@pytest.fixture(scope="module")
def trained(tiny_target, tiny_target_path, tmp_path_factory):
    """Two steps of the one trainer on the target's own greedy continuations of demo prompts."""
    prompts = load_prompts("demo", 4, tiny_target)
    examples = []
    for ids in prompts:
        out = generate(tiny_target, ids, None, max_new_tokens=32).tokens
        seq = torch.cat([ids.view(1, -1), out], dim=1)[0].tolist()
        examples.append(Example(input_ids=seq, loss_mask=[1] * len(seq)))
    out = tmp_path_factory.mktemp("bigram") / "run"
    cfg = BigramTrainConfig(
        target=tiny_target_path, output_dir=str(out), max_steps=2, micro_batch_size=2,
        lr=0.5, warmup_steps=0, eval_every=2, eval_batches=1, save_every=0, seed=0,
        mixed_precision="no", decode=DecodeConfig(gamma=3),
    )  # fmt: skip
    torch.manual_seed(0)
    result = train(
        cfg, BigramDrafter(cfg.drafter, tiny_target.vocab_size), tiny_target, examples,
        examples[:2], tokenizer=tiny_target.tokenizer,
    )  # fmt: skip
    return out, result, prompts


def test_the_new_kind_trains_saves_loads_and_decodes_exactly(trained, tiny_target):
    out, result, prompts = trained
    assert result.step == 2 and result.losses[1] < result.losses[0]
    assert result.evals[-1]["tau_greedy"] > 1.0  # the trainer's evaluation used its hooks
    drafter = load_drafter(out / "final", tiny_target)
    decode = load_decoding(out / "final")  # the settings it was trained to be served with
    assert isinstance(drafter, BigramDrafter) and decode == DecodeConfig(gamma=3)
    drafted = accepted = 0
    for ids in prompts:
        plain = generate(tiny_target, ids, None, max_new_tokens=24).tokens
        ours = generate(tiny_target, ids, drafter, max_new_tokens=24, decode=decode)
        assert ours.tokens.tolist() == plain.tolist()
        drafted, accepted = drafted + ours.stats.drafted, accepted + ours.stats.accepted
    assert drafted > 0 and accepted > 0
    # another kind's setting is refused by the shared rules, naming its owner
    with pytest.raises(
        ValueError,
        match=r"exit_layer=1 is a LayerSkip .* which this bigram_test drafter does not take",
    ):
        generate(tiny_target, prompts[0], drafter, max_new_tokens=4, exit_layer=1)


def test_the_new_kind_is_tuned_and_evaluated_by_the_same_scripts(
    trained, tiny_target_path, tmp_path
):
    out, _, _ = trained
    report = tmp_path / "tune.json"
    # only gamma searched: every other key of the default space left out (KEY=)
    leave_out = ["tree_top_k=", "tree_budget=", "stop_below=", "draft_weights=", "lookup_ngram="]
    assert tune_script.main([
        str(out / "final"), "--target", tiny_target_path, "--num-prompts", "2",
        "--max-new-tokens", "12", "--search", "gamma=1,3", *leave_out, "lookup_gamma=",
        "--output", str(report),
    ]) == 0  # fmt: skip
    rows = json.loads(report.read_text())["search"]
    assert {r["round"] for r in rows} == {"gamma"} and {r["gamma"] for r in rows} == {1, 3}
    assert all(r["matches_plain"] for r in rows)

    eval_out = tmp_path / "eval"
    evaluate.main([
        "--target", tiny_target_path, "--drafter", str(out / "final"), "--baselines", "ar",
        "--num-prompts", "2", "--max-new-tokens", "16", "--output", str(eval_out),
    ])  # fmt: skip
    runs = {r["method"]: r for r in json.loads((eval_out / "report.json").read_text())["runs"]}
    ours = runs["bigram_test"]
    assert ours["matches_ar"] is True and ours["drafted"] > 0 and ours["accepted"] > 0
