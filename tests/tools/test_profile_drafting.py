"""scripts/profile_drafting.py on the tiny demo target: every drafter's proposals counted and
timed, the profile restricted to them, and a bad folder or setting named.

Broken, it shows: proposals not counted or their tokens miscounted (a draft that is always
right drafts up to gamma tokens a proposal, more with a longer chain), the profile taking operations
from outside the proposals (plain decoding's steps would add the target's LM head at a share of
its own), settings after the colon ignored."""

from __future__ import annotations

import itertools
import json

import pytest

from specdraft.tools import profile_drafting

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (tests/conftest.py)


def test_proposals_timed_and_profiled(tiny_target_path, draft_folder, tmp_path, capsys):
    out = tmp_path / "profile.json"
    argv = [f"{draft_folder}:gamma=2", f"{draft_folder}:gamma=4", "--target", tiny_target_path,
            "--num-prompts", "2", "--max-new-tokens", "12", "--top", "5", "--output", str(out)]  # fmt: skip
    assert profile_drafting.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["plain_ms_per_token"] > 0
    two, four = report["drafters"]
    for row, gamma in ((two, 2), (four, 4)):
        assert row["gamma"] == gamma and row["proposals"] > 0
        assert 1 < row["drafted_per_proposal"] <= gamma  # fewer only where the budget ends
        assert row["ms_per_proposal"] > 0 and row["proposal_in_target_steps"] > 0
        ops = row["top_operations"]
        assert 0 < len(ops) <= 5 and sum(op["share"] for op in ops) <= 1 + 1e-9
        assert all(a["ms"] >= b["ms"] for a, b in itertools.pairwise(ops))
    # always right: fewer, longer proposals with a longer chain
    assert four["proposals"] < two["proposals"]
    assert four["drafted_per_proposal"] > two["drafted_per_proposal"]
    printed = capsys.readouterr().out
    assert "plain decoding:" in printed and printed.count("proposals,") == 2


@pytest.mark.parametrize(
    ("spec", "message"),
    [("{folder}:gamma=0", "gamma"), ("{missing}", "nowhere")],
)
def test_bad_input_is_named(tiny_target_path, draft_folder, tmp_path, capsys, spec, message):
    spec = spec.format(folder=draft_folder, missing=tmp_path / "nowhere")
    assert profile_drafting.main([spec, "--target", tiny_target_path]) == 2
    err = capsys.readouterr().err
    assert "scripts/profile_drafting.py: error:" in err and message in err
