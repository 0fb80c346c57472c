"""The speculative inference loop: `generate(target, input_ids, drafter=...)`."""

from specdraft.inference.generate import GenerateOutput, generate
from specdraft.inference.metrics import Stats

__all__ = ["GenerateOutput", "Stats", "generate"]
