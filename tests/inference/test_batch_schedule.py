"""Decoding settings by batch size (DecodeConfig.batch_schedule): a bad schedule is an error
that names its entry and the fix, one that is written as text (a config file, a command line,
a saved JSON) reads back to the same typed entries, `for_batch` picks the last entry at or
below the batch size, and the loop decodes a batch with its entry: plainly and exactly where
the entry is off, saying so in its stats."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch

from specdraft.config import ConfigError, override
from specdraft.core import DecodeConfig
from specdraft.inference import generate
from specdraft.kinds.distill.distill import DistillDecode
from specdraft.kinds.layerskip.layerskip import LayerSkipDecode

pytestmark = pytest.mark.exact

PROMPT = [5, 17, 42, 99, 7, 230]
SCHEDULE = [
    {"batch_size": 1, "gamma": 3},
    {"batch_size": 4, "gamma": 2, "tree_budget": 6},
    {"batch_size": 16, "off": True},
]


def test_for_batch_picks_the_last_entry_at_or_below_the_batch_size():
    decode = DecodeConfig(gamma=5, tree_top_k=2, batch_schedule=SCHEDULE)
    picked = {b: decode.for_batch(b) for b in (1, 3, 4, 15, 16, 64)}
    assert picked[1] == DecodeConfig(gamma=3, tree_top_k=2)  # the schedule itself is gone
    assert picked[3] == picked[1]
    assert picked[4] == picked[15] == DecodeConfig(gamma=2, tree_top_k=2, tree_budget=6)
    assert picked[16] is None and picked[64] is None  # off: plain decoding
    # below the first entry, and without a schedule, the settings as they are
    later = DecodeConfig(gamma=5, batch_schedule=[{"batch_size": 4, "off": True}])
    assert later.for_batch(3) == DecodeConfig(gamma=5) and later.for_batch(4) is None
    assert DecodeConfig(gamma=4).for_batch(8) == DecodeConfig(gamma=4)
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1; got 0"):
        decode.for_batch(0)


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        (
            [{"batch_size": 4, "gamma": 2}, {"batch_size": 2, "gamma": 3}],
            "entry 2: batch_size 2 follows batch_size 4; list the entries by increasing "
            "batch_size, each batch size once",
        ),
        ([{"batch_size": 4}, {"batch_size": 4, "off": True}], "batch_size 4 follows batch_size 4"),
        ([{"batch_size": 0, "gamma": 2}], "entry 1: batch_size must be an integer >= 1; got 0"),
        ([{"gamma": 2}], "entry 1 is {'gamma': 2}: write each entry as a mapping with its batch_size"),
        ([{"batch_size": 2, "gamma": 0}], "entry 1 (batch_size 2): gamma must be an integer >= 1; got 0"),
        ([{"batch_size": 2, "gamma": "three"}], "gamma must be an integer >= 1; got 'three'"),
        ([{"batch_size": 2, "depth": 3}], "entry 1 (batch_size 2): unknown decoding setting depth"),
        (
            [{"batch_size": 2, "exit_layer": 1}],
            "entry 1 (batch_size 2): exit_layer=1 is a LayerSkip drafter's decoding setting, "
            "which this drafter does not take: drop exit_layer, or use a LayerSkip drafter",
        ),
        ([{"batch_size": 8, "off": True, "gamma": 2}], "off turns drafting off, so gamma would do nothing"),
        ([{"batch_size": 8, "off": "maybe"}], "off must be true or false; got 'maybe'"),
        ("1:off", "batch_schedule must be a list of entries"),
    ],
)  # fmt: skip
def test_a_bad_schedule_names_the_entry_and_the_fix(schedule, message):
    with pytest.raises(ValueError) as error:
        DecodeConfig(batch_schedule=schedule)
    assert message in str(error.value)


def test_a_kinds_own_setting_in_an_entry_is_its_kinds_only():
    decode = LayerSkipDecode(gamma=4, batch_schedule=[{"batch_size": 2, "exit_layer": "1"}])
    assert decode.for_batch(2) == LayerSkipDecode(gamma=4, exit_layer=1)  # typed from text
    with pytest.raises(ValueError, match="exit_layer=1 is a LayerSkip drafter's decoding setting"):
        DistillDecode.of(decode)  # the schedule moves with the settings, and is checked there


def test_a_schedule_written_as_text_reads_back_typed():
    """A config file's or command line's values are text, a saved JSON's sizes may be too: all
    read as the typed entries, and a saved schedule loads back equal."""
    given = override(
        DistillDecode(),
        [
            "batch_schedule=[{batch_size: 1, dynamic_gamma: true, stop_below: 0}, "
            "{batch_size: 16, off: true}]"
        ],
    )
    assert given.batch_schedule == [
        {"batch_size": 1, "dynamic_gamma": True, "stop_below": 0.0},
        {"batch_size": 16, "off": True},
    ]
    saved = json.loads(json.dumps(dataclasses.asdict(given)))
    assert DistillDecode(**saved) == given
    assert override(given, ["batch_schedule=[]"]).batch_schedule == []
    with pytest.raises(ConfigError, match=r"command line \(batch_schedule=.*entry 2: batch_size 2"):
        override(given, ["batch_schedule=[{batch_size: 4}, {batch_size: 2}]"])


def test_an_entry_that_is_off_decodes_plainly_and_says_so(random_target, drafts):
    plain = generate(random_target, PROMPT, None, max_new_tokens=16)
    off = DecodeConfig(gamma=4, batch_schedule=[{"batch_size": 1, "off": True}])
    out = generate(random_target, PROMPT, drafts["partial"], max_new_tokens=16, decode=off)
    assert torch.equal(out.tokens, plain.tokens)
    assert out.stats.drafter_off and out.stats.drafted == 0
    assert out.stats.target_passes == 16 and out.stats.drafter_params == 0
    assert not plain.stats.drafter_off
    # an entry that drafts: the drafter runs, with the entry's settings, as exactly
    on = DecodeConfig(gamma=4, batch_schedule=[{"batch_size": 1, "gamma": 2}])
    out = generate(random_target, PROMPT, drafts["partial"], max_new_tokens=16, decode=on)
    assert torch.equal(out.tokens, plain.tokens) and not out.stats.drafter_off
    assert out.stats.drafted > 0 and out.stats.accepted > 0
    assert len(out.stats.reached_at) <= 2  # drafts of gamma 2, not 4


def test_a_call_setting_an_entry_overrides_is_named(random_target, drafts):
    on = DecodeConfig(batch_schedule=[{"batch_size": 1, "gamma": 2}])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = generate(
            random_target, PROMPT, drafts["partial"], max_new_tokens=8, decode=on, gamma=6
        )
    assert len(out.stats.reached_at) <= 2
    said = [str(w.message) for w in caught]
    assert any("gamma=6 is overridden at batch size 1" in m for m in said)
    # batch_schedule=[] for the call: the call's gamma, no schedule
    out = generate(
        random_target, PROMPT, drafts["partial"], max_new_tokens=8, decode=on, gamma=6,
        batch_schedule=[],
    )  # fmt: skip
    assert len(out.stats.reached_at) > 2


def test_a_batch_decodes_with_its_own_entry(random_target, drafts):
    """One folder's settings, three batches: alone a prompt drafts deep, two together are off
    (decoded plainly, exactly, and the stats say so), three together draft shallow."""
    prompts = [PROMPT, [3, 1, 4, 1, 5, 9, 2, 6, 5], [8, 8, 8, 2]]
    decode = DecodeConfig(
        gamma=4,
        batch_schedule=[{"batch_size": 2, "off": True}, {"batch_size": 3, "gamma": 2}],
    )
    alone = [generate(random_target, p, None, max_new_tokens=12).tokens[0] for p in prompts]
    first = generate(random_target, prompts[0], drafts["partial"], max_new_tokens=12, decode=decode)
    assert torch.equal(first.tokens[0], alone[0]) and len(first.stats.reached_at) > 2
    two = generate(random_target, prompts[:2], drafts["partial"], max_new_tokens=12, decode=decode)
    assert two.stats.batch_size == 2 and two.stats.drafter_off
    assert two.stats.drafted == 0 and all(s.drafter_off for s in two.row_stats)
    assert two.rows() == [a.tolist() for a in alone[:2]]
    three = generate(random_target, prompts, drafts["partial"], max_new_tokens=12, decode=decode)
    assert three.rows() == [a.tolist() for a in alone] and not three.stats.drafter_off
    assert three.stats.drafted > 0 and three.stats.accepted > 0
    assert len(three.stats.reached_at) <= 2  # the entry's gamma 2
