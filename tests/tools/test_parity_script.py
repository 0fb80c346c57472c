"""scripts/parity.py on the tiny demo target with a draft that is the target itself: greedy, its
simulation and the loop agree step for step; at T = 1 every draft is accepted, so the tau
expected on each seed's continuation is the tau served with that seed; bad input is named.
Broken, it shows: a verdict other than parity for a drafter that cannot differ, an expected
tau other than the served one for a drafter that accepts everything, settings after the
colon ignored."""

from __future__ import annotations

import pytest

from specdraft.tools import parity

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (tests/conftest.py)


def test_greedy_parity_and_the_sampled_estimate(tiny_target_path, draft_folder, capsys):
    common = ["--target", tiny_target_path, "--num-prompts", "2", "--max-new-tokens", "24"]
    assert parity.main([f"{draft_folder}:gamma=3", *common]) == 0
    out = capsys.readouterr().out
    assert "(distill, gamma 3)" in out and "in parity: every step alike" in out
    code = parity.main([f"{draft_folder}:gamma=3", *common, "--temperature", "1", "--seeds", "2"])
    out = capsys.readouterr().out
    assert code == 0 and "seeds 0-1" in out and "0.00%" in out.split("within 10%: expected")[1]
    expected = out.split("tau  expected ")[1].split(" (mean")[0]
    served = out.split("served   ")[1].split(" (mean")[0]
    assert expected == served  # seed by seed
    assert all(3 < float(t) <= 4 for t in served.split(", "))  # shorter only at the end


@pytest.mark.parametrize(
    ("extra", "message"),
    [(["--temperature", "0.5"], "--temperature must be 0 or 1"),
     (["--seeds", "0"], "must be >= 1")],
)  # fmt: skip
def test_bad_options_are_named(tiny_target_path, draft_folder, capsys, extra, message):
    with pytest.raises(SystemExit):
        parity.main([str(draft_folder), "--target", tiny_target_path, *extra])
    assert message in capsys.readouterr().err


def test_a_bad_setting_is_named(tiny_target_path, draft_folder, capsys):
    assert parity.main([f"{draft_folder}:gamma=0", "--target", tiny_target_path]) == 2
    err = capsys.readouterr().err
    assert "scripts/parity.py: error:" in err and "gamma must be an integer >= 1" in err
