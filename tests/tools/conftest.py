"""Setup the scripts' tests share."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaForCausalLM

from specdraft.targets.target import load_target


@pytest.fixture(scope="module")
def draft_folder(tiny_target, tmp_path_factory):
    """A plain HF folder holding a copy of the target: a two-model drafter that is always right."""
    folder = tmp_path_factory.mktemp("draft") / "copy"
    copy.deepcopy(tiny_target.model).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def target(tiny_target, tmp_path_factory):
    """(folder, Target): a random 6-layer Llama with the tiny demo target's tokenizer, saved as
    a model folder the engines load too."""
    config = tiny_target.config.__class__(**{**tiny_target.config.to_dict(), "num_hidden_layers": 6})  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("verify") / "target"
    LlamaForCausalLM(config).save_pretrained(path)
    tiny_target.tokenizer.save_pretrained(path)
    return path, load_target(str(path), dtype=torch.float32)
