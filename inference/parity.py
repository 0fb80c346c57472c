"""Training predicts serving: the simulation of serving beside the loop itself, on the same
prompts (docs/architecture.md, "Training predicts serving"; scripts/parity.py prints it).

`simulate` runs the drafter's training path (`Drafter.served_drafts`, teacher-forced on the
target's own continuation) and walks it as the loop steps (`metrics.simulate_serving`); `serve`
decodes the same prompts with the loop. At temperature 0 the two agree exactly for a drafter
whose training and serving paths compute the same thing; where they do not, `first_difference`
compares what the drafter saw in each path at the same positions and names the first tensor
that differs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdraft.core import DecodeConfig
from specdraft.data.formats import Example
from specdraft.inference.generate import generate
from specdraft.inference.metrics import Stats, simulate_serving


def example_batch(example: Example, device) -> dict[str, torch.Tensor]:
    """One example as a batch of one (no padding)."""
    ids = torch.tensor([example.input_ids], device=device)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.tensor([example.loss_mask], device=device),
    }


@torch.no_grad()
def simulate(
    target, drafter, examples: Sequence[Example], decode: DecodeConfig
) -> list[Stats] | None:
    """Per example (the target's greedy continuation of a prompt, inference/continuations.py):
    the loop's statistics as the drafter's training path predicts them; None where its kind or
    `decode` has no simulation (Drafter.served_drafts)."""
    decode = drafter.decode_settings(decode)
    out = []
    for example in examples:
        batch = example_batch(example, target.device)
        target_out = target.forward(
            batch["input_ids"], attention_mask=batch["attention_mask"],
            capture_layers=list(drafter.capture_layers),
        )  # fmt: skip
        drafts = drafter.served_drafts(batch, target_out, decode)
        if drafts is None:
            return None
        out += simulate_serving(drafts, batch, decode, drafter.drafts_after_prefill)
    return out


@torch.no_grad()
def serve(target, drafter, examples: Sequence[Example], decode: DecodeConfig) -> list[Stats]:
    """Per example: the loop's statistics decoding its prompt greedily for as many new tokens
    as its continuation holds."""
    out = []
    for example in examples:
        start = example.loss_mask.index(1)
        new = len(example.input_ids) - start
        run = generate(
            target, example.input_ids[:start], drafter, max_new_tokens=new, decode=decode
        )
        out.append(run.stats)
    return out
