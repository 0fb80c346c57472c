"""Prompt sources of inference/measure.py that need no model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specdraft.data.formats import Example
from specdraft.inference.measure import load_prompts

TARGET = SimpleNamespace(device=torch.device("cpu"))


def test_eval_prompts_are_the_part_before_the_loss():
    chat = Example([1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 1, 1])  # prompt, then the answer
    text = Example([7, 8, 9, 10], [1, 1, 1, 1])  # plain text: every token is a target
    prompts = load_prompts("eval", 5, TARGET, [chat, text])
    assert [p.tolist() for p in prompts] == [[[1, 2, 3]], [[7, 8]]]
    assert len(load_prompts("eval", 1, TARGET, [chat, text])) == 1
    with pytest.raises(ValueError, match="held-out examples"):
        load_prompts("eval", 1, TARGET, [])
    with pytest.raises(ValueError, match="no such file"):
        load_prompts("missing.jsonl", 1, TARGET)
