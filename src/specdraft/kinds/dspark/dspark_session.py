"""DSpark's session: DFlash's (kinds/dflash/dflash_session.py: the context's keys and values,
one block pass for every drafting row), drafting each chain slot by slot through the Markov head
and cutting it where the confidence head says; the drafter is kinds/dspark/dspark.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specdraft.core import DecodeConfig, DraftTree, SamplingSettings
from specdraft.drafting import draft_chains
from specdraft.kinds.dflash.dflash_session import DFlashSession

if TYPE_CHECKING:
    from specdraft.kinds.dspark.dspark import DSparkDrafter


def dspark_chains(
    drafter: DSparkDrafter,
    h: torch.Tensor,
    anchors: torch.Tensor,
    depths: list[int],
    *,
    sampling: SamplingSettings,
    decode: DecodeConfig,
    generator: torch.Generator | None,
) -> list[DraftTree]:
    """Each row's chain from (rows, deepest, hidden) states of its block's drafting slots and
    (rows,) its anchor: slot j draws from the backbone's logits plus the Markov bias of the
    token before it (the anchor, then slot j - 1's draw; q recorded when sampling). With
    stop_below > 0 and a confidence head, a row's chain ends after the first slot where the
    product of the predicted acceptances so far is below stop_below (that slot still verified);
    without a confidence head stop_below is DFlash's rule (the draw's top probability)."""
    d = drafter
    base = d.draft_logits(h)  # (rows, deepest, vocab)
    anchors = anchors.to(h.device)
    confidence = d.confidence_head is not None and decode.stop_below > 0
    chains = draft_chains(
        base[:, 0] + d.markov_bias(anchors, h.dtype),
        lambda token, i: base[:, i + 1] + d.markov_bias(token[:, 0], h.dtype),
        depths=depths,
        sampling=sampling,
        generator=generator,
        stop_below=0.0 if confidence else decode.stop_below,
    )
    if not confidence:
        return chains
    cut = []
    for r, chain in enumerate(chains):
        n = chain.tokens.shape[1]
        if n == 0:
            cut.append(chain)
            continue
        drafted = chain.tokens[0].to(h.device)
        previous = torch.cat([anchors[r : r + 1], drafted[:-1]])
        x = d.head_inputs(h[r, :n], previous)
        sure = d.confidence_logit(x).float().sigmoid().cumprod(0) >= decode.stop_below
        keep = min(n, int(sure.long().cumprod(0).sum()) + 1)
        q = None if chain.q is None else chain.q[:, :keep]
        cut.append(DraftTree.chain(chain.tokens[:, :keep], q) if keep < n else chain)
    return cut


class DSparkSession(DFlashSession):
    """DFlashSession drafting every row's chain through DSpark's heads at once."""

    drafter: DSparkDrafter

    def draft_rows(
        self, h: torch.Tensor, anchors: torch.Tensor, depths: list[int]
    ) -> list[DraftTree]:
        return dspark_chains(
            self.drafter, h, anchors, depths,
            sampling=self.sampling, decode=self.decode, generator=self.generator,
        )  # fmt: skip
