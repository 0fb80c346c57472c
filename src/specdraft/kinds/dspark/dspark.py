"""DSpark: DFlash's block drafter with a Markov head that lets each slot read the token drafted
before it, and a confidence head that predicts each slot's acceptance.

DSpark (DeepSeek/PKU, arXiv 2607.05147; as vllm-project/speculators 0.9.0 trains it, vLLM serves
it as `dspark` and llama.cpp as `draft-dspark`): the backbone is DFlash's (kinds/dflash/dflash.py:
the target's features at `aux_layers` fused into the context's keys and values, one non-causal
pass over a block of B positions that holds the anchor, then the mask token). Two small heads
sit on top of it:

- the Markov head, a low-rank bias B = W1 W2 over the vocabulary: the slot that drafts the token
  at position t adds W2(W1[token at t - 1]) to the logits the backbone gives it. The backbone's
  pass still drafts every slot at once; the heads run slot by slot after it (a (rank,) lookup
  and a (rank x vocab) product each), so slot j sees the token drafted at slot j - 1 (the anchor
  for the first slot), and a chain no longer draws its slots independently;
- the confidence head, a linear map of [the slot's final state; W1[token before]] to one logit:
  sigmoid of it predicts alpha = sum_x min(p(x), q(x)), the chance the slot's draw is accepted
  given the slots before it were. Decoding with stop_below > 0 ends a chain after the first slot
  where the product of the predicted acceptances so far (the chance the chain gets that far)
  falls below stop_below.

With `sample_from_anchor` (the default, DeepSpec's and speculators'), slot 0, which holds the
anchor, drafts too: a block drafts B tokens, not B - 1.

Training (teacher-forced, as speculators trains it): slot j of the block after anchor a drafts
the token at a + 1 + j from the data's token at a + j; its loss is DFlash's divergence to the
target's distribution at a + j, weighted exp(-j / position_decay), plus confidence_head_alpha
times the binary cross-entropy of the confidence logit against that slot's alpha (detached),
with the same weights. Weight names are speculators' (kinds/dspark/dspark_export.py); the
sessions are kinds/dspark/dspark_session.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdraft.core import DecodeConfig
from specdraft.drafters.base import Metrics, sum_and_count
from specdraft.kinds.dflash.dflash import DFlashConfig, DFlashDrafter
from specdraft.kinds.dspark.dspark_session import DSparkSession

# --- config ------------------------------------------------------------------------------------


@dataclass
class DSparkConfig(DFlashConfig):
    # Slot 0 (the anchor's) drafts the token after the anchor too: a block drafts block_size
    # tokens (DeepSpec's and speculators' default); False: block_size - 1, as DFlash.
    sample_from_anchor: bool = True
    # Rank r of the Markov head's bias W1 (vocab x r) W2 (r x vocab): 2 r vocab parameters.
    markov_rank: int = 256
    # The per-slot acceptance predictor, which stop_below reads when decoding.
    enable_confidence_head: bool = True
    # Weight of the confidence head's loss beside the drafting loss.
    confidence_head_alpha: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        rank = self.markov_rank
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(
                f"drafter.markov_rank must be an integer >= 1 (the Markov head is what DSpark "
                f"adds to DFlash; train kind dflash for none); got {rank!r}"
            )
        if not self.confidence_head_alpha >= 0:
            raise ValueError(
                f"drafter.confidence_head_alpha must be >= 0; got {self.confidence_head_alpha}"
            )


# --- the heads ---------------------------------------------------------------------------------


class MarkovHead(nn.Module):
    """The low-rank bias W2(W1[previous token]) over the vocabulary."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        nn.init.normal_(self.markov_w1.weight, std=0.01)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def forward(self, previous: torch.Tensor) -> torch.Tensor:
        """(...) previous token ids -> (..., rank) their rows of W1."""
        return self.markov_w1(previous)


class ConfidenceHead(nn.Module):
    """One logit per slot from [its state; W1 of the token before it]."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).squeeze(-1)


# --- module ------------------------------------------------------------------------------------


class DSparkDrafter(DFlashDrafter):
    """DFlash's drafter with a Markov head and a confidence head (`markov_head`,
    `confidence_head`, named as speculators names them)."""

    kind = "dspark"
    title = "DSpark"
    config_class = DSparkConfig
    # tree_top_k > 1 is ignored, said once: the Markov head makes each slot depend on the
    # token drafted before it, so it drafts one chain
    drafts_trees = False
    batch_drafts = "all"  # every row's block in one pass (it drafts chains only)
    # DFlash's sessions, drafting through the heads slot by slot
    session_class = DSparkSession

    def __init__(self, config: DSparkConfig, target, *, init: bool = True) -> None:
        super().__init__(config, target, init=init)
        rank, H = config.markov_rank, target.hidden_size
        self.markov_head = MarkovHead(target.vocab_size, rank)
        self.confidence_head = ConfidenceHead(H + rank) if config.enable_confidence_head else None

    @property
    def first_slot(self) -> int:
        return 0 if self.config.sample_from_anchor else 1

    # What the heads add to DFlash's pieces.

    def head_inputs(self, h: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """(..., hidden) slot states and (...) the tokens before their drafted ones -> (...,
        hidden + rank): what the logits and the confidence are made from."""
        return torch.cat([h, self.markov_head(previous).to(h.dtype)], dim=-1)

    def logits_of(self, x: torch.Tensor) -> torch.Tensor:
        """(..., hidden + rank) head inputs -> (..., vocab): the backbone's logits (through the
        target's LM head) plus the Markov bias."""
        H = self.target.hidden_size
        return self.draft_logits(x[..., :H]) + self._bias(x[..., H:])

    def markov_bias(self, previous: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(...) tokens before the drafted ones -> (..., vocab) the Markov bias, as `logits_of`
        adds it to the backbone's logits (of dtype `dtype`)."""
        return self._bias(self.markov_head(previous).to(dtype))

    def _bias(self, rows: torch.Tensor) -> torch.Tensor:
        w2 = self.markov_head.markov_w2
        return w2(rows.to(w2.weight.dtype)).to(rows.dtype)

    def confidence_logit(self, x: torch.Tensor) -> torch.Tensor:
        """(..., hidden + rank) head inputs -> (...) the confidence logits."""
        return self.confidence_head(x.to(self.confidence_head.proj.weight.dtype))

    # --- training -------------------------------------------------------------------------------

    def loss(self, batch: Mapping[str, torch.Tensor], target_out) -> tuple[torch.Tensor, Metrics]:
        """DFlash's weighted divergence over every anchor's scored slots, from the Markov-biased
        logits (its slots' teacher-forced `head_inputs`), plus confidence_head_alpha x the
        weighted binary cross-entropy of each slot's confidence logit against its alpha =
        sum_x min(p(x), q(x)) (no gradient through alpha); over `loss_tokens(batch)` slots."""
        confidence = self.confidence_head is not None
        total, metrics, scored, x, weight = self.slot_losses(batch, target_out, confidence)
        if confidence:
            logit = self.confidence_logit(x).float()
            bce = F.binary_cross_entropy_with_logits(logit, scored.overlap, reduction="none")
            total = total + self.config.confidence_head_alpha * (bce * weight).sum()
            metrics["confidence_bce"] = sum_and_count(bce)
            error = (logit.detach().sigmoid() - scored.overlap).abs()
            metrics["confidence_error"] = sum_and_count(error)
        return total, metrics

    # --- serving simulation ---------------------------------------------------------------------

    def chain_confidence(
        self,
        batch: Mapping[str, torch.Tensor],
        target_out,
        logits: torch.Tensor,
        decode: DecodeConfig,
    ) -> torch.Tensor:
        """With a confidence head, the session's rule on `served_logits`' chains: a chain goes
        on after slot j while the product of the predicted acceptances of slots 0..j is at least
        stop_below (teacher-forced, as served_logits is); without one, DFlash's."""
        if self.confidence_head is None or decode.stop_below <= 0:
            return super().chain_confidence(batch, target_out, logits, decode)
        ids = batch["input_ids"]
        B, T = ids.shape
        anchors = torch.arange(T, device=ids.device)[None].expand(B, T)
        x = self.slots({**batch, "anchors": anchors}, target_out, logits=False)["x"]
        predicted = self.confidence_logit(x[:, :, : logits.shape[2]]).float().sigmoid()
        return predicted.cumprod(-1) >= decode.stop_below
