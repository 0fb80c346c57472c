from __future__ import annotations

import pytest
import tiny_tokenizers
from transformers import PreTrainedTokenizerFast


@pytest.fixture(scope="session")
def chatml_tokenizer() -> PreTrainedTokenizerFast:
    return tiny_tokenizers.chatml_tokenizer()


@pytest.fixture(scope="session")
def llama3_tokenizer() -> PreTrainedTokenizerFast:
    return tiny_tokenizers.llama3_tokenizer()
