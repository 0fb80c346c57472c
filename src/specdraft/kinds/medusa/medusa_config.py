"""Medusa's settings: how its heads are trained (MedusaConfig: heads, blocks, output layer, Medusa-1
or Medusa-2 with LoRA) and how they draft (MedusaDecode: the tree, typical acceptance).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdraft.config import choice
from specdraft.core import DecodeConfig
from specdraft.drafters.base import LoraConfig


@dataclass(frozen=True)
class MedusaDecode(DecodeConfig, owner="Medusa"):
    """Medusa's decoding settings: every kind's, and how drafts are accepted at temperature > 0."""

    # exact: lossless rejection sampling, output follows the target's distribution. typical:
    # Medusa's typical acceptance: a draft token is kept when the target gives it more than
    # min(typical_epsilon, typical_delta * exp(-entropy)); more tokens per pass, but output
    # drifts from the target's distribution (lossy; evaluate.py marks such runs). At
    # temperature 0 both are greedy.
    acceptance: str = choice("exact", "typical")
    # acceptance=typical: epsilon, the threshold's cap (the Medusa reference's
    # posterior_threshold), which applies where the target is confident; raise it to accept less.
    typical_epsilon: float = 0.09
    # acceptance=typical: delta, the scale of the entropy-adapted threshold delta * exp(-H(p))
    # (the reference's posterior_alpha, suggested sqrt(typical_epsilon)), which lowers the
    # threshold where the target is unsure (high entropy H); raise it to accept less there.
    typical_delta: float = 0.3

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("typical_epsilon", "typical_delta"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ValueError(
                    f"{key} must be a number in (0, 1]; got {value!r} (the Medusa reference "
                    "uses typical_epsilon=0.09, typical_delta=0.3)"
                )

    @property
    def lossless(self) -> bool:
        return self.acceptance != "typical"


@dataclass
class MedusaConfig:
    # K: heads, head k predicting the token k + 2 places after the last verified one.
    num_heads: int = 4
    # Residual blocks x + SiLU(W x + b) per head, each with its own weights.
    num_layers: int = 1
    # own: each head has its own output layer, initialised from the target's LM head (the
    # reference layout, K x hidden x vocab more parameters) | shared: every head uses the
    # target's LM head (few extra parameters; the blocks must do all the work).
    output: str = choice("own", "shared")
    # output=own: the heads' output layers cover only the most frequent target tokens of the
    # training data (EOS always in), as EAGLE-3's draft vocabulary; 0: the whole vocabulary.
    draft_vocab_size: int = 0
    # ce: cross-entropy against the data's tokens (the reference trainer) | kl: self-distillation,
    # head k at t learns the target's own distribution at t + 1 + k (for data the target
    # regenerated, scripts/regenerate.py; the trainer's target pass computes it anyway). With a
    # reduced draft vocabulary, positions whose token (ce) or target argmax (kl) is outside it
    # are left out.
    loss: str = choice("ce", "kl")
    # Head k's loss is weighted loss_decay ** k (the paper's 0.8; 1.0 is the reference trainer's
    # plain sum).
    loss_decay: float = 0.8
    # Ranks per head whose accuracy evaluation measures (the tree is built from them): the tree
    # never uses a head's candidate below this rank.
    accuracy_ranks: int = 10
    # The heads' learning rate as a multiple of lr (with lora.rank > 0 the adapters train at lr;
    # the Medusa-2 recipes train the heads several times faster).
    heads_lr_multiplier: float = 1.0
    # Medusa-2: LoRA adapters (peft) co-trained on the target with the heads; rank 0 is
    # Medusa-1, the target frozen. The heads then belong to the fine-tuned target.
    lora: LoraConfig = field(default_factory=LoraConfig)
    # Medusa-2: the loss is target_loss + heads_weight * (the heads' loss above), the paper's
    # lambda.
    heads_weight: float = 0.2
    # Medusa-2: the target's own term. lm: next-token cross-entropy on the data | kl: KL from the
    # frozen base's distribution (the adapters switched off for that pass, no second copy of the
    # weights), which keeps the fine-tuned target close to what it was.
    target_loss: str = choice("lm", "kl")
    # Medusa-2: optimizer steps that train the heads alone before the adapters join (the
    # paper's warm-up: untrained heads would otherwise pull the target towards their noise).
    heads_warmup_steps: int = 0

    def __post_init__(self) -> None:
        for key, low in (
            ("num_heads", 1), ("num_layers", 1), ("draft_vocab_size", 0), ("accuracy_ranks", 1),
        ):  # fmt: skip
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"drafter.{key} must be an integer >= {low}; got {value!r}")
        if not self.heads_lr_multiplier > 0 or not self.heads_weight > 0:
            raise ValueError(
                "drafter.heads_lr_multiplier and drafter.heads_weight must be > 0; got "
                f"{self.heads_lr_multiplier} and {self.heads_weight}"
            )
        if self.heads_warmup_steps < 0:
            raise ValueError(
                f"drafter.heads_warmup_steps must be >= 0; got {self.heads_warmup_steps}"
            )
        if not 0 < self.loss_decay <= 1:
            raise ValueError(f"drafter.loss_decay must be in (0, 1]; got {self.loss_decay}")
        if self.output == "shared" and self.draft_vocab_size:
            raise ValueError(
                "drafter.draft_vocab_size needs output=own: shared heads draft through the "
                "target's LM head over its whole vocabulary (set draft_vocab_size=0)"
            )
