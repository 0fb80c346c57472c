"""The held-out text a drafter is evaluated on when it is evaluated on what it serves: the
target's own continuations of held-out prompts (docs/architecture.md, "Training predicts
serving").

A drafter is served on the target's continuations, not on corpus text, so its acceptance there
is what the loop measures. At temperature 0 the continuation is the target's greedy one, and
the simulation of serving on it (`served.served_drafts`, `metrics.simulate_serving`) gives the
served tau exactly; at T > 0 it is sampled at that temperature.

Each set is generated once per (target fingerprint and precision, prompts, length, temperature,
seed) and kept as JSON under SPECDRAFT_HOME/continuations/, so later runs, the checkpoint
selection of best/ and scripts/parity.py read it instead of decoding again.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from specdraft.cache import specdraft_home
from specdraft.core import eos_ids
from specdraft.data.formats import Example
from specdraft.inference.generate import generate

# Which text held-out evaluation ran on: the target's continuations, greedy or sampled, or the
# corpus's held-out split. Reports print these names.
SERVED_GREEDY, SERVED_SAMPLED, CORPUS = "served-greedy", "served-sampled", "corpus"


def served_examples(
    target,
    prompts: Sequence[torch.Tensor],
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    cache_dir: Path | None = None,
) -> list[Example]:
    """One example per prompt: the prompt, then max_new_tokens of the target's continuation
    (decoded through an EOS, which a draft may still match), with loss_mask 1 on the tokens the
    loop emits (through the first EOS) and 0 elsewhere. Read from the cache where this set was
    generated before; the cache defaults to SPECDRAFT_HOME/continuations."""
    ids = [p.reshape(-1).tolist() for p in prompts]
    key = {
        "target": target.fingerprint,
        "dtype": str(target.dtype),
        "prompts": ids,
        "max_new_tokens": max_new_tokens,
        "temperature": float(temperature),
        "seed": seed,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    path = (cache_dir or specdraft_home() / "continuations") / f"{digest}.json"
    if path.is_file():
        rows = json.loads(path.read_text())["continuations"]
    else:
        rows = [
            generate(
                target, prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                seed=seed, stop_at_eos=False,
            ).tokens[0].tolist()
            for prompt in prompts
        ]  # fmt: skip
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "continuations": rows}) + "\n")
        tmp.replace(path)  # atomic: a reader never sees half a file
    eos = eos_ids(target.model)
    examples = []
    for prompt, tokens in zip(ids, rows, strict=True):
        served = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
        mask = [0] * len(prompt) + [1] * served + [0] * (len(tokens) - served)
        examples.append(Example(prompt + tokens, mask, source=f"target continuation ({digest})"))
    return examples
