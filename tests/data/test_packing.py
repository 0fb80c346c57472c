"""Plain-text packing: documents joined by EOS, cut into equal blocks, loss on every token, and the
documented remainder rule. Conversation packing (data.pack): rows of whole conversations, the
same conversations as without it, and the errors for what it cannot pack."""

from __future__ import annotations

import json

import pytest
from tiny_tokenizers import WORD_VOCAB

from specdraft.data import DataConfig, build_datasets
from specdraft.data.formats import Example
from specdraft.data.packing import pack_documents, pack_texts
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


# --- conversations packed into rows (data.pack) ---------------------------------------------------


def _docs(lengths: list[int]) -> list[Example]:
    return [
        Example(list(range(100 * i, 100 * i + n)), [0] + [1] * (n - 1), f"c{i}")
        for i, n in enumerate(lengths)
    ]


def test_rows_hold_every_conversation_whole_once_best_fit():
    docs = _docs([7, 3, 10, 2, 5, 9, 1])
    rows = pack_documents(docs, 10)
    # longest first, each into the row with the least room that holds it
    assert [r.document_lengths for r in rows] == [[10], [9, 1], [7, 3], [5, 2]]
    seen = []
    for row in rows:
        assert len(row.input_ids) <= 10 and sum(row.document_lengths) == len(row.input_ids)
        start = 0
        for n in row.document_lengths:
            doc = next(d for d in docs if d.input_ids == row.input_ids[start : start + n])
            assert row.loss_mask[start : start + n] == doc.loss_mask
            seen.append(doc.source)
            start += n
    assert sorted(seen) == sorted(d.source for d in docs)
    assert pack_documents(docs, 10) == rows  # deterministic


def test_a_conversation_longer_than_a_row_is_an_error_not_a_split():
    with pytest.raises(ValueError, match="do not fit a row of 4"):
        pack_documents(_docs([5]), 4)


def _conversations(tmp_path, answers: list[str]) -> str:
    rows = [
        {"messages": [{"role": "user", "content": "say"}, {"role": "assistant", "content": a}]}
        for a in answers
    ]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_packed_data_holds_the_padded_datas_conversations(tmp_path, chatml_tokenizer):
    """The same conversations, cut alike, regrouped: ragged lengths, one over max_length (cut to
    max_length as without packing, so it fills a row of its own) and the summary's counts."""
    answers = ["the cat sat on the mat " * k for k in (1, 6, 2, 9, 1, 3, 40)]
    path = _conversations(tmp_path, answers)
    plain, _, _ = build_datasets(
        DataConfig(path=path, max_length=64, eval_fraction=0), chatml_tokenizer
    )
    cfg = DataConfig(path=path, max_length=64, eval_fraction=0, pack=True)
    rows, _, summary = build_datasets(cfg, chatml_tokenizer)

    docs = []
    for row in rows:
        start = 0
        for n in row.document_lengths:
            docs.append((row.input_ids[start : start + n], row.loss_mask[start : start + n]))
            start += n
    assert sorted(docs) == sorted((e.input_ids, e.loss_mask) for e in plain)
    assert len(rows) < len(plain) and all(len(r.input_ids) <= 64 for r in rows)
    cut = next(e for e in plain if e.truncated)
    assert len(cut.input_ids) == 64
    assert any(r.document_lengths == [64] and r.truncated for r in rows)
    assert (summary.packed_conversations, summary.packed_rows) == (len(plain), len(rows))
    assert "conversations packed into" in summary.format()


def test_one_conversation_is_one_row_of_one_document(tmp_path, chatml_tokenizer):
    cfg = DataConfig(path=_conversations(tmp_path, ["the cat"]), max_length=64, eval_fraction=0)
    (plain,), _, _ = build_datasets(cfg, chatml_tokenizer)
    cfg.pack = True
    (row,), _, _ = build_datasets(cfg, chatml_tokenizer)
    assert row.input_ids == plain.input_ids and row.document_lengths == [len(plain.input_ids)]


@pytest.mark.parametrize("change", [{"path": "demo"}, {"format": "text"}])
def test_packing_plain_text_is_an_error_naming_the_key(tmp_path, chatml_tokenizer, change):
    cfg = DataConfig(**{"path": _conversations(tmp_path, ["x"]), "pack": True, **change})
    with pytest.raises(DataError, match=r"data\.pack packs conversations.*set data\.pack=false"):
        build_datasets(cfg, chatml_tokenizer)
