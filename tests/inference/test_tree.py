"""Tree attention and KV compaction against the plain model: one forward over a tree gives each
node the logits its root-to-leaf path gets when decoded alone, and compaction leaves exactly the
cache that decoding the accepted path alone builds."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from specdraft.core import DraftTree, ancestors, compact, path_to
from specdraft.inference.tree import tree_attention

# Exactness: CI runs these once more with native bf16 forced off (tests/conftest.py).
pytestmark = pytest.mark.exact

#        root
#       /    \
#      0      1
#     / \      \
#    2   3      4
#    |
#    5
PARENTS = [-1, -1, 0, 0, 1, 2]
DEPTHS = [1, 1, 2, 2, 2, 3]
TOKENS = [11, 12, 21, 22, 23, 31]


def tree() -> DraftTree:
    t = DraftTree(torch.tensor([TOKENS]), PARENTS, DEPTHS)
    t.check()
    return t


def test_ancestors_and_paths():
    anc = ancestors(PARENTS)
    assert anc[5].nonzero().flatten().tolist() == [0, 2, 5]
    assert anc[4].nonzero().flatten().tolist() == [1, 4]
    assert path_to(5, PARENTS) == [0, 2, 5] and path_to(-1, PARENTS) == []


def test_chain_needs_no_mask():
    chain = DraftTree.chain(torch.tensor([[1, 2, 3]]))
    assert chain.is_chain and not tree().is_chain
    assert tree_attention(chain, 5, 1, torch.float32, torch.device("cpu")) == (None, None)


def test_bad_tree_is_caught():
    with pytest.raises(ValueError, match="topological"):
        DraftTree(torch.tensor([[1, 2]]), [1, -1], [2, 1]).check()


def _decode_alone(model, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids])).logits[0]  # (len, vocab)


@pytest.mark.parametrize("past", [0, 3])
def test_tree_forward_equals_each_path_alone(random_target, past):
    """Pending tokens (prefill when past = 0) and the tree in one forward, over a warm cache."""
    model = random_target.model
    context = [5, 17, 42, 99, 7]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        if past:
            model(input_ids=torch.tensor([context[:past]]), cache=cache, use_cache=True)
        pending = len(context) - past
        mask, pos = tree_attention(tree(), past, pending, torch.float32, torch.device("cpu"))
        assert mask.shape == (1, 1, pending + 6, len(context) + 6)
        inputs = torch.tensor([context[past:] + TOKENS])
        logits = model(
            input_ids=inputs, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True
        ).logits[0]
        for node in range(6):
            path = path_to(node, PARENTS)
            alone = _decode_alone(model, context + [TOKENS[i] for i in path])
            torch.testing.assert_close(logits[pending + node], alone[-1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits[pending - 1], alone[len(context) - 1])

        # compaction keeps exactly the cache of context + accepted path decoded alone
        accepted = path_to(5, PARENTS)
        compact(cache, len(context), accepted)
        direct = DynamicCache(config=model.config)
        model(
            input_ids=torch.tensor([context + [TOKENS[i] for i in accepted]]),
            cache=direct,
            use_cache=True,
        )
    assert cache.get_seq_length() == len(context) + 3
    for mine, ref in zip(cache.layers, direct.layers, strict=True):
        torch.testing.assert_close(mine.keys, ref.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine.values, ref.values, atol=1e-5, rtol=1e-5)


def test_compact_of_a_prefix_is_a_crop():
    cache = DynamicCache()
    kv = torch.arange(10.0).view(1, 1, 10, 1)
    cache.update(kv.clone(), kv.clone(), 0)
    compact(cache, 4, [0, 1])
    assert cache.layers[0].keys.flatten().tolist() == [0, 1, 2, 3, 4, 5]
    cache = DynamicCache()
    cache.update(kv.clone(), kv.clone(), 0)
    compact(cache, 4, [1, 4])
    assert cache.layers[0].values.flatten().tolist() == [0, 1, 2, 3, 5, 8]
