"""Plain-text packing: documents joined by EOS, cut into equal blocks, loss on every token, and the
documented remainder rule."""

from __future__ import annotations

import pytest
from tiny_tokenizers import WORD_VOCAB

from specdraft.data.packing import pack_texts
from specdraft.data.sources import DataError


def test_blocks_are_the_eos_joined_stream_and_the_tail_is_dropped(chatml_tokenizer):
    v = {token: i for i, token in enumerate(WORD_VOCAB)}
    eos = chatml_tokenizer.eos_token_id
    texts = ["the cat sat", "on the mat."]
    stream = [v["the"], v[" "], v["cat"], v[" "], v["sat"], eos,
              v["on"], v[" "], v["the"], v[" "], v["mat"], v["."], eos]  # fmt: skip

    blocks, dropped = pack_texts(texts, chatml_tokenizer, block_length=4)

    assert [b.input_ids for b in blocks] == [stream[0:4], stream[4:8], stream[8:12]]
    assert all(b.loss_mask == [1, 1, 1, 1] for b in blocks)
    assert dropped == 1


def test_corpus_shorter_than_a_block_is_one_short_block(chatml_tokenizer):
    blocks, dropped = pack_texts(["the cat"], chatml_tokenizer, block_length=64)
    assert len(blocks) == 1 and dropped == 0
    assert blocks[0].input_ids[-1] == chatml_tokenizer.eos_token_id
    assert blocks[0].loss_mask == [1] * len(blocks[0].input_ids)


def test_special_token_text_in_a_document_is_not_a_boundary(chatml_tokenizer):
    (block,), _ = pack_texts(["cat<|endoftext|>"], chatml_tokenizer, block_length=64)
    eos = chatml_tokenizer.eos_token_id
    assert block.input_ids.count(eos) == 1 and block.input_ids[-1] == eos


def test_tokenizer_without_eos_is_a_clear_error(chatml_tokenizer):
    tokenizer = chatml_tokenizer.__class__(tokenizer_object=chatml_tokenizer.backend_tokenizer)
    with pytest.raises(DataError, match="no EOS token"):
        pack_texts(["the cat"], tokenizer, block_length=4)
