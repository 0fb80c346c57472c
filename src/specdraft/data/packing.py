"""Packing: plain text into fixed-length blocks, and conversations into rows of whole documents.

Plain text -> fixed-length blocks for language-model training, loss on every token.

Documents are tokenized without special tokens, each followed by the EOS token (so the model sees
where one ends and the next begins), concatenated in order and cut into blocks of `block_length`.

The remainder rule: the tokens after the last full block are dropped, so every block has the same
length, unless the documents do not fill even one block; then they form one shorter block, so a
tiny corpus (or a small eval split) still gives an example.

Conversations (data.pack) -> rows of at most `row_length` tokens, each holding whole
conversations end to end (`pack_documents`). Unlike text blocks, a conversation in a row stays
on its own: the row records its documents' lengths (`Example.document_lengths`), from which the
batch gets document masks and position ids that restart at each document (specdraft/attention.py,
"Packed rows"), so every token is trained exactly as in a row of its own. A conversation is at
most max_length tokens when it is encoded (cut or dropped, data.overlong), so one always fits.
"""

from __future__ import annotations

import bisect

from specdraft.data.formats import Example
from specdraft.data.sources import DataError

_TOKENIZE_BATCH = 256  # documents per tokenizer call: fast batched encoding, bounded memory


def pack_texts(texts: list[str], tokenizer, block_length: int) -> tuple[list[Example], int]:
    """Blocks of `block_length` tokens from `texts`, and how many tail tokens were dropped."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError(
            f"the tokenizer {type(tokenizer).__name__} has no EOS token, which plain-text packing "
            "puts between documents. Set tokenizer.eos_token (the token that ends a text)."
        )
    stream: list[int] = []  # (total tokens,) every document's ids, then EOS
    for begin in range(0, len(texts), _TOKENIZE_BATCH):
        # split_special_tokens: a document that quotes "<|endoftext|>" is text, not a boundary.
        batch = tokenizer(
            texts[begin : begin + _TOKENIZE_BATCH],
            add_special_tokens=False,
            split_special_tokens=True,
        )["input_ids"]
        for ids in batch:
            stream.extend(ids)
            stream.append(eos)

    if 0 < len(stream) < block_length:
        return [Example(stream, [1] * len(stream), "packed text block 0")], 0
    full_blocks = len(stream) // block_length
    examples = [
        Example(
            stream[k * block_length : (k + 1) * block_length],
            [1] * block_length,
            f"packed text block {k}",
        )
        for k in range(full_blocks)
    ]
    return examples, len(stream) - full_blocks * block_length


def pack_documents(examples: list[Example], row_length: int) -> list[Example]:
    """Rows of at most `row_length` tokens holding `examples` whole, end to end.

    Best fit decreasing: the examples longest first (ties in their given order), each into the
    row with the least room that still holds it, else a new row. Deterministic; rows come out in
    the order they were opened (the caller shuffles them). A row's documents keep their own
    loss masks; `document_lengths` says where each ends, `document_indices` which of
    `examples` each is.
    """
    order = sorted(range(len(examples)), key=lambda i: (-len(examples[i].input_ids), i))
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free tokens, row), ascending: bisect finds the best fit
    for i in order:
        n = len(examples[i].input_ids)
        if n > row_length:
            raise ValueError(
                f"{examples[i].source}: {n} tokens do not fit a row of {row_length} "
                "(conversations are cut to data.max_length before packing)"
            )
        at = bisect.bisect_left(room, (n, -1))
        if at < len(room):
            free, row = room.pop(at)
        else:
            free, row = row_length, len(rows)
            rows.append([])
        rows[row].append(i)
        if free > n:
            bisect.insort(room, (free - n, row))
    packed = []
    for r, members in enumerate(rows):
        docs = [examples[i] for i in members]
        packed.append(
            Example(
                [t for d in docs for t in d.input_ids],
                [m for d in docs for m in d.loss_mask],
                f"packed row {r}: " + ", ".join(d.source for d in docs),
                any(d.truncated for d in docs),
                [len(d.input_ids) for d in docs],
                list(members),
            )
        )
    return packed
