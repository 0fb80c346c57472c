"""Prompt sources of inference/measure.py that need no model."""

from __future__ import annotations

import pytest

from specdraft.data.formats import Example
from specdraft.inference.measure import read_prompts


def test_eval_prompts_are_the_part_before_the_loss():
    chat = Example([1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 1, 1])  # prompt, then the answer
    text = Example([7, 8, 9, 10], [1, 1, 1, 1])  # plain text: every token is a target
    prompts = read_prompts("eval", 5, None, [chat, text])  # token ids already: no tokenizer
    assert [p.tolist() for p in prompts] == [[[1, 2, 3]], [[7, 8]]]
    assert len(read_prompts("eval", 1, None, [chat, text])) == 1
    with pytest.raises(ValueError, match="held-out examples"):
        read_prompts("eval", 1, None, [])
    with pytest.raises(ValueError, match="no such file"):
        read_prompts("missing.jsonl", 1, None)


def test_a_prompt_file_is_read_with_the_tokenizer_alone(tmp_path, tiny_target):
    """What scripts/compare.py checks before any model is loaded: a file's prompts, each
    tokenized by the tokenizer given, in order, at most n, on the CPU."""
    (tmp_path / "p.jsonl").write_text('{"prompt": "def f(x):"}\n"import os"\n"x = 1"\n')
    prompts = read_prompts(str(tmp_path / "p.jsonl"), 2, tiny_target.tokenizer)
    tokenize = lambda text: tiny_target.tokenizer(text, return_tensors="pt").input_ids  # noqa: E731
    assert [p.tolist() for p in prompts] == [
        tokenize(t).tolist() for t in ("def f(x):", "import os")
    ]
    assert all(p.device.type == "cpu" for p in prompts)
