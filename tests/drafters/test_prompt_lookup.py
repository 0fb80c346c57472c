"""Prompt lookup proposes what followed an earlier occurrence of the trailing n-gram."""

from __future__ import annotations

import pytest
import torch

from specdraft.core import DecodeConfig, DraftContext
from specdraft.drafters.prompt_lookup import PromptLookupDrafter

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py says why


def propose(tokens: list[int], gamma: int = 3, max_depth: int = 10) -> list[int]:
    session = PromptLookupDrafter().new_session(None, decode=DecodeConfig(gamma=gamma))
    tree = session.propose(DraftContext(torch.tensor([tokens]), max_depth=max_depth))
    assert tree.is_chain and tree.q is None  # deterministic: point masses
    return tree.tokens[0].tolist()


def test_continues_the_latest_full_match_of_the_longest_ngram():
    # trailing 3-gram (1, 2, 3) occurs at 0 and 5; the latest with 3 tokens after it is at 5
    assert propose([1, 2, 3, 7, 8, 1, 2, 3, 9, 9, 4, 1, 2, 3]) == [9, 9, 4]
    # only the 1-gram (5) matches
    assert propose([5, 6, 7, 8, 1, 5]) == [6, 7, 8]


def test_inside_a_repeating_run_takes_the_earliest_match():
    assert propose([4, 4, 4, 4, 4], gamma=3) == [4, 4]  # earliest hit: only 2 tokens follow it
    assert propose([4] * 8, gamma=3) == [4, 4, 4]


def test_no_match_or_no_room_gives_an_empty_draft():
    assert propose([1, 2, 3]) == []
    assert propose([9]) == []
    assert propose([1, 2, 3, 1, 2, 3], max_depth=1) == [1]
