"""Plain text -> fixed-length blocks for language-model training, loss on every token.

Documents are tokenized without special tokens, each followed by the EOS token (so the model sees
where one ends and the next begins), concatenated in order and cut into blocks of `block_length`.

The remainder rule: the tokens after the last full block are dropped, so every block has the same
length, unless the documents do not fill even one block; then they form one shorter block, so a
tiny corpus (or a small eval split) still gives an example.
"""

from __future__ import annotations

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
