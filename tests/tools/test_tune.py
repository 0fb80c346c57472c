"""scripts/tune.py: decoding settings chosen by measured tokens/s, kept only with plain decoding's
greedy output, and saved into the drafter folder with where they were measured."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from specdraft.core import DecodeConfig
from specdraft.formats.reading import load_decoding
from specdraft.inference.metrics import Stats
from specdraft.kinds.layerskip.layerskip import LayerSkipDecode
from specdraft.measuring import tuning
from specdraft.tools.tune import main
from specdraft.train.entry import main as train_main

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (tests/conftest.py)


@pytest.fixture(scope="module")
def trained_layerskip(tiny_target_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("tune") / "run"
    assert train_main("layerskip", [
        f"target={tiny_target_path}", f"output_dir={out}", "max_steps=2", "micro_batch_size=4",
        "eval_every=0", "save_every=0", "data.max_samples=20", "data.max_length=32",
        "eval_loop.enabled=false", "drafter.exit_layer=1", "decode.gamma=4",
    ]) == 0  # fmt: skip
    return out / "final"


@pytest.fixture
def layerskip_folder(trained_layerskip, tmp_path):
    """A fresh copy per test: tuning writes into the folder, and no test may see another's."""
    return Path(shutil.copytree(trained_layerskip, tmp_path / "final"))


def test_tune_saves_the_fastest_settings_with_equal_output(layerskip_folder, tmp_path, capsys):
    report = tmp_path / "tune.json"
    code = main([
        str(layerskip_folder), "--num-prompts", "2", "--max-new-tokens", "12",
        "--search", "gamma=1,2", "stop_below=", "lookup_ngram=0,2", "lookup_gamma=",
        "--output", str(report),
    ])  # fmt: skip
    assert code == 0
    result = json.loads(report.read_text())
    rows = result["search"]
    # LayerSkip drafts chains: no tree round; each round raced the settings so far with its values
    first = [r for r in rows if r["pass"] == 1]
    assert [r["round"] for r in first] == ["gamma"] * 3 + ["lookup_ngram"] * 2
    assert sorted(r["gamma"] for r in first if r["round"] == "gamma") == [1, 2, 4]
    for key in ("gamma", "lookup_ngram"):  # the key's last round decided it
        last = max(r["pass"] for r in rows if r["round"] == key)
        raced = [r for r in rows if r["round"] == key and r["pass"] == last]
        kept = [r for r in raced if r["kept"]]
        assert len(kept) == 1 and kept[0]["matches_plain"] is True
        fastest = max(raced, key=lambda r: r["tokens_per_s"])
        assert kept[0] is fastest or fastest["matches_plain"] is False
        if result["measured"]["kept_saved"]:  # the saved settings won the last race: kept
            assert result["decode"] == result["measured"]["before"]["decode"]
        else:
            assert result["decode"][key] == kept[0][key]
    # saved into the folder: what evaluate.py and the loop now decode with, and where measured
    saved = json.loads((layerskip_folder / "config.json").read_text())["specdraft"]
    assert saved["decode"] == result["decode"]
    measured = saved["decode_measured"]
    assert measured["dtype"] == "float32" and "thread" in measured["hardware"]
    assert measured["before"]["decode"]["gamma"] == 4  # the hand-picked settings, raced again
    assert measured["speedup"] > 0 and measured["tau"] >= 1
    assert load_decoding(layerskip_folder) == LayerSkipDecode(**result["decode"])
    assert "now decodes with these settings" in capsys.readouterr().out


def test_dry_run_leaves_the_folder(layerskip_folder):
    before = (layerskip_folder / "config.json").read_bytes()
    args = [str(layerskip_folder), "--num-prompts", "1", "--max-new-tokens", "6", "--dry-run"]
    assert main([*args, "--search", "gamma=1", "stop_below=", "lookup_ngram="]) == 0
    assert (layerskip_folder / "config.json").read_bytes() == before


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{missing}"], "has no config.json"),
        (["{folder}", "--search", "depth=3"], "KEY one of exit_layer"),
        (["{folder}", "--search", "gamma=0"], "gamma must be an integer >= 1"),
        (["{folder}", "--search", "gamma=two"], "gamma takes int values"),
        (["{folder}", "--search", "exit_layer=5"], "exit_layer=5 is not in 1..1"),
        (["{plain}"], "pass --target"),
    ],
)
def test_bad_input_is_named_and_changes_nothing(
    layerskip_folder, tiny_target, tmp_path, capsys, args, message
):
    plain = tmp_path / "plain"
    tiny_target.model.save_pretrained(plain)
    before = (layerskip_folder / "config.json").read_bytes()
    paths = {"missing": tmp_path / "nope", "folder": layerskip_folder, "plain": plain}
    code = main([a.format(**paths) for a in args] + ["--num-prompts", "1", "--max-new-tokens", "4"])
    assert code == 2
    assert message in capsys.readouterr().err
    assert (layerskip_folder / "config.json").read_bytes() == before


def test_a_faster_setting_that_changes_greedy_output_is_not_kept(monkeypatch):
    """The race's selection: the fastest candidate whose output differs from plain decoding's
    loses to the fastest equal one, unless mismatches are allowed."""

    def fake_race(target, drafter, prompts, decodes, **_):
        trials = [tuning.Trial(None, 1.0, Stats(new_tokens=10), [[1, 2, 3]])]
        for d in decodes:  # gamma 3 is the fastest, and wrong
            wrong = d.gamma == 3
            out = [[1, 2, 4]] if wrong else [[1, 2, 3]]
            trials.append(tuning.Trial(d, 1.0 / d.gamma, Stats(new_tokens=10), out))
        return trials

    class Drafter(_Fake):
        def ignored_settings(self, decode):
            return []

    monkeypatch.setattr(tuning, "race", fake_race)
    best, rows = tuning.search_decode(
        None,
        Drafter(),
        [],
        {"gamma": [2, 3]},
        max_new_tokens=4,
        start=DecodeConfig(gamma=1),
        temperature=0.0,
    )
    assert best.gamma == 2 and [r["matches_plain"] for r in rows] == [True, True, False]
    best, _ = tuning.search_decode(
        None,
        Drafter(),
        [],
        {"gamma": [2, 3]},
        max_new_tokens=4,
        start=DecodeConfig(gamma=1),
        require_equal=False,
    )
    assert best.gamma == 3


# The settings the fake races below start from.
_START = LayerSkipDecode(gamma=4, exit_layer=2)


class _Fake:
    """What the search asks of a drafter beyond ignored_settings, as Drafter does it."""

    decode_class = DecodeConfig

    def decode_settings(self, settings=None):
        return self.decode_class.of(settings)

    def resolved_decode(self, decode):
        return decode

    def drafts_batches_together(self, decode):
        return True  # as a kind with a batch session (the loop's figures here are fakes)


class _Chains(_Fake):
    """A chain drafter with an exit layer whose decode settings the fake races below price."""

    decode_class = LayerSkipDecode

    def ignored_settings(self, decode):
        return []


def _priced_race(seconds):
    """A race whose candidates take seconds(decode) each, all with plain decoding's output."""

    def fake_race(target, drafter, prompts, decodes, **_):
        trials = [tuning.Trial(None, 1.0, Stats(new_tokens=10), [[1]])]
        trials += [tuning.Trial(d, seconds(d), Stats(new_tokens=10), [[1]]) for d in decodes]
        return trials

    return fake_race


def test_a_second_pass_finds_settings_that_only_pay_together(monkeypatch):
    """Exit 1 is slow at the trained depth 4 and fastest at depth 2: one pass (exit, then
    depth) stops at exit 2; the second pass, at depth 2, moves to exit 1 and stops there."""
    table = {(1, 4): 0.9, (2, 4): 0.8, (1, 2): 0.5, (2, 2): 0.7, (1, 1): 0.6, (2, 1): 0.75}
    monkeypatch.setattr(tuning, "race", _priced_race(lambda d: table[d.exit_layer, d.gamma]))
    space = {"exit_layer": [1, 2], "gamma": [1, 2, 4]}
    one, _ = tuning.search_decode(
        None, _Chains(), [], space, max_new_tokens=4, start=_START, passes=1
    )
    assert (one.exit_layer, one.gamma) == (2, 2)
    best, rows = tuning.search_decode(None, _Chains(), [], space, max_new_tokens=4, start=_START)
    assert (best.exit_layer, best.gamma) == (1, 2)
    kept = [(r["pass"], r["round"]) for r in rows if r["kept"]]
    assert kept == [(1, "exit_layer"), (1, "gamma"), (2, "exit_layer"), (2, "gamma")]
    with pytest.raises(ValueError, match="passes must be at least 1"):
        tuning.search_decode(None, _Chains(), [], space, max_new_tokens=4, start=_START, passes=0)


def test_a_setting_is_raced_again_only_where_another_changed(monkeypatch):
    monkeypatch.setattr(tuning, "race", _priced_race(lambda d: d.gamma + d.exit_layer))
    space = {"exit_layer": [1, 2], "gamma": [4, 6]}
    drafter = _Chains()
    start = LayerSkipDecode(gamma=4, exit_layer=1)  # already the cheapest
    best, rows = tuning.search_decode(
        None, drafter, [], space, max_new_tokens=4, start=start, passes=3
    )
    assert best == start and {r["pass"] for r in rows} == {1}
    # gamma moves in pass 1, so pass 2 races the exit again at the new gamma; gamma itself is
    # not raced again (the exit stayed), and pass 3 has nothing left to race
    start = LayerSkipDecode(gamma=6, exit_layer=1)
    best, rows = tuning.search_decode(
        None, drafter, [], space, max_new_tokens=4, start=start, passes=3
    )
    assert (best.exit_layer, best.gamma) == (1, 4)
    rounds = [(r["pass"], r["round"]) for r in rows]
    assert rounds == [(1, "exit_layer")] * 2 + [(1, "gamma")] * 2 + [(2, "exit_layer")] * 2


def test_a_setting_reset_by_another_rounds_winner_is_not_raced_again(monkeypatch):
    """A tree drops stop_below (which ends chains) when it wins: that reset is the tree round's
    own outcome, not a change under it, so neither round runs again."""

    class Trees(_Fake):
        def ignored_settings(self, decode):
            return ["stop_below ends chains"] if not decode.chain and decode.stop_below else []

    monkeypatch.setattr(tuning, "race", _priced_race(lambda d: 0.5 if d.tree_top_k == 2 else 1.0))
    space = {"tree_top_k": [1, 2], "stop_below": [0.0, 0.2]}
    start = DecodeConfig(tree_top_k=1, stop_below=0.2)
    best, rows = tuning.search_decode(None, Trees(), [], space, max_new_tokens=4, start=start)
    assert (best.tree_top_k, best.stop_below) == (2, 0.0)
    assert {r["pass"] for r in rows} == {1}


def test_the_saved_settings_stay_when_they_win_the_final_race(layerskip_folder, monkeypatch):
    """The search's pick must beat the saved settings once more, side by side, to replace them:
    a pick that only won a noisy round is not written."""
    saved = json.loads((layerskip_folder / "config.json").read_text())["specdraft"]["decode"]
    pick = LayerSkipDecode(**{**saved, "gamma": saved["gamma"] + 1})
    monkeypatch.setattr(tuning, "search_decode", lambda *a, **k: (pick, [{"kept": True}]))

    def final_race(target, drafter, prompts, decodes, **_):
        plain = tuning.Trial(None, 1.0, Stats(new_tokens=10))
        before, after = (
            tuning.Trial(d, s, Stats(new_tokens=10)) for d, s in zip(decodes, [1, 2], strict=True)
        )
        return [plain, before, after]  # the saved settings twice as fast as the pick

    monkeypatch.setattr(tuning, "race", final_race)
    assert main([str(layerskip_folder), "--num-prompts", "1", "--max-new-tokens", "4"]) == 0
    written = json.loads((layerskip_folder / "config.json").read_text())["specdraft"]
    assert written["decode"] == saved and written["decode_measured"]["kept_saved"] is True


def test_a_tree_is_raced_with_the_chain_only_settings_reset():
    """A chain with stop_below set still gets its tree candidates: racing tree_top_k > 1 drops
    stop_below (which trees ignore) rather than skipping the tree."""

    start = DecodeConfig(gamma=4, stop_below=0.3)

    class Drafter(_Fake):
        def ignored_settings(self, decode):
            return ["stop_below"] if decode.tree_top_k > 1 and decode.stop_below > 0 else []

    fit = tuning._fit(Drafter(), start.replace(tree_top_k=4), "tree_top_k", start)
    assert fit == DecodeConfig(gamma=4, tree_top_k=4, stop_below=0.0)

    # a value the drafter can never honour stays out
    class Chains(Drafter):
        def ignored_settings(self, decode):
            return ["trees"] if decode.tree_top_k > 1 else []

    assert tuning._fit(Chains(), start.replace(tree_top_k=4), "tree_top_k", start) is None


def test_copy_length_is_raced_only_while_copying(monkeypatch):
    """lookup_gamma means nothing without lookup_ngram (every kind says so): the search does not
    race it there, and a round that turns copying off drops it with the copying."""
    from specdraft.drafters.base import Drafter

    drafter, start = Drafter(), DecodeConfig(gamma=2, lookup_ngram=3)
    assert drafter.ignored_settings(DecodeConfig(lookup_gamma=8)) == [
        "lookup_gamma=8 is ignored without copying: it caps copied drafts, and lookup_ngram=0 "
        "copies nothing (set lookup_ngram, e.g. 3)"
    ]
    assert drafter.ignored_settings(DecodeConfig(lookup_ngram=3, lookup_gamma=8)) == []
    off = DecodeConfig(gamma=2)
    assert tuning._fit(drafter, off.replace(lookup_gamma=8), "lookup_gamma", off) is None
    long = DecodeConfig(gamma=2, lookup_ngram=3, lookup_gamma=8)
    assert tuning._fit(drafter, long.replace(lookup_ngram=0), "lookup_ngram", long) == off
    # copies of 8 are fastest, and only while copying: both rounds keep theirs
    price = lambda d: 0.5 if d.lookup_ngram and d.lookup_gamma == 8 else 1.0  # noqa: E731
    monkeypatch.setattr(tuning, "race", _priced_race(price))
    space = {"lookup_ngram": [0, 3], "lookup_gamma": [0, 8, 16]}
    best, rows = tuning.search_decode(None, drafter, [], space, max_new_tokens=4, start=start)
    assert best == long
    # copies of 2 spelled as 0 or as gamma decode alike: raced once
    raced = [(r["round"], r["lookup_gamma"]) for r in rows if r["round"] == "lookup_gamma"]
    assert sorted(raced) == [("lookup_gamma", 0), ("lookup_gamma", 8), ("lookup_gamma", 16)]
    space["lookup_gamma"] = [0, 2, 8]
    _, rows = tuning.search_decode(None, drafter, [], space, max_new_tokens=4, start=start)
    assert sorted(r["lookup_gamma"] for r in rows if r["round"] == "lookup_gamma") == [0, 8]


def test_copying_that_pays_only_in_long_copies_is_found(monkeypatch):
    """Copying off at first, copies of gamma slower than no copying, copies of 8 fastest: the
    copying round races turning it on at each copy length, so it is not dropped for losing in
    copies of gamma (after which the length round would have nothing to race)."""
    from specdraft.drafters.base import Drafter

    class Copying(Drafter):
        pass

    def price(d):
        if not d.lookup_ngram:
            return 1.0
        return 0.5 if d.lookup_gamma == 8 else 1.2

    monkeypatch.setattr(tuning, "race", _priced_race(price))
    space = {"lookup_ngram": [0, 3], "lookup_gamma": [0, 8]}
    start = DecodeConfig(gamma=2)
    best, rows = tuning.search_decode(None, Copying(), [], space, max_new_tokens=4, start=start)
    assert (best.lookup_ngram, best.lookup_gamma) == (3, 8)
    first = [r for r in rows if r["round"] == "lookup_ngram"]
    assert sorted((r["lookup_ngram"], r["lookup_gamma"]) for r in first) == [(0, 0), (3, 0), (3, 8)]

    # an incumbent that already names an ignored setting keeps it; turning copying off drops
    # the copies' length, not that setting
    class Int8(Copying):
        def ignored_settings(self, decode):
            fixed = ["draft_weights=int8 is ignored"] if decode.draft_weights == "int8" else []
            return super().ignored_settings(decode) + fixed

    long = DecodeConfig(gamma=2, draft_weights="int8", lookup_ngram=3, lookup_gamma=8)
    fit = tuning._fit(Int8(), long.replace(lookup_ngram=0), "lookup_ngram", long)
    assert fit == DecodeConfig(gamma=2, draft_weights="int8")


def test_each_batch_size_gets_the_fastest_of_its_race(monkeypatch):
    """Deep drafts pay at batch 1, shallow ones at 4, none at 16 (plain decoding wins there, and
    keeps its entry against a win smaller than min_gain):
    the schedule holds each race's winner, a tree's budget raced with its depth, and above
    batch 1 each candidate drafting row by row too (here faster at 4, slower at 16); a faster
    candidate whose greedy output differs from plain decoding's never wins."""
    speed = {  # (batch size, gamma, tree_budget) -> seconds; plain decoding takes 1.0
        1: {(4, 12): 0.5, (2, 12): 0.7, (4, 6): 0.6, (2, 6): 0.8},
        4: {(4, 12): 0.9, (2, 12): 0.8, (4, 6): 0.85, (2, 6): 0.6},
        16: {(4, 12): 1.3, (2, 12): 1.2, (4, 6): 1.1, (2, 6): 0.9},
    }
    wrong = {(16, 2, 6)}  # faster than plain at 16 only where its output differs: ignored
    rows = {4: 0.8, 16: 1.5}  # drafting row by row: its time over the batch session's

    def fake_race(target, drafter, prompts, decodes, *, batch_size, **_):
        size = batch_size
        assert len(prompts) % size == 0  # whole batches: `filled`
        trials = [tuning.Trial(None, 1.0, Stats(new_tokens=10), [[1]])]
        for d in decodes:
            seconds = speed[size][d.gamma, d.tree_budget]
            seconds *= rows[size] if d.batch_drafting == "rows" else 1.0
            out = [[2]] if (size, d.gamma, d.tree_budget) in wrong else [[1]]
            trials.append(tuning.Trial(d, seconds, Stats(new_tokens=10), out))
        return trials

    class Trees(_Fake):
        def ignored_settings(self, decode):
            return []

    monkeypatch.setattr(tuning, "race", fake_race)
    prompts = [torch.tensor([[1, 2, 3]]), torch.tensor([[4, 5]])]
    base = DecodeConfig(gamma=4, tree_top_k=2, tree_budget=12)
    space = {"gamma": [2, 4], "tree_budget": [6, 12], "stop_below": [0.2]}
    result = tuning.tune_batch_schedule(
        None, Trees(), prompts, space, base=base, batch_sizes=[1, 4, 16], max_new_tokens=4
    )
    assert result.decode.batch_schedule == [
        {"batch_size": 1},  # the base settings won
        {"batch_size": 4, "gamma": 2, "tree_budget": 6, "batch_drafting": "rows"},
        {"batch_size": 16, "off": True},
    ]
    assert result.decode.for_batch(1) == base and result.decode.for_batch(32) is None
    for size in (1, 4, 16):  # plain decoding and the four (gamma, budget) pairs raced, and
        # above batch 1 the four drafting row by row
        raced = [r for r in result.rows if r["batch_size"] == size]
        assert len(raced) == (5 if size == 1 else 9) and sum(r["chosen"] for r in raced) == 1
        exact = [r for r in raced if r["matches_plain"]]
        chosen = next(r for r in raced if r["chosen"])
        assert chosen is max(exact, key=lambda r: r["tokens_per_s"])
    fastest_at_4 = {"gamma": 2, "tree_budget": 6, "batch_drafting": "rows"}
    assert [m["settings"] for m in result.measured] == [{}, fastest_at_4, "off"]
    assert result.measured[2]["speedup"] == 1.0
    # a chain races its depth only
    chain = tuning.tune_batch_schedule(
        None, Trees(), prompts, {"gamma": [2, 4], "tree_budget": [6]}, base=base.replace(
            tree_top_k=1), batch_sizes=[4], max_new_tokens=4,
    )  # fmt: skip
    assert len(chain.rows) == 5
    assert chain.decode.batch_schedule == [{"batch_size": 4, "gamma": 2, "batch_drafting": "rows"}]
    # a win within min_gain of plain decoding is no entry: 0.98 s against plain decoding's 1.0
    # is 2% faster, below the default 3%; a gain of 1% asked for, it is the entry
    speed[16][4, 12] = 0.98
    close = {"gamma": [4], "tree_budget": [12]}
    for gain, entry in ((tuning.MIN_GAIN, {"batch_size": 16, "off": True}),
                        (0.01, {"batch_size": 16})):  # fmt: skip
        near = tuning.tune_batch_schedule(
            None, Trees(), prompts, close, base=base, batch_sizes=[16], max_new_tokens=4,
            min_gain=gain,
        )  # fmt: skip
        assert near.decode.batch_schedule == [entry]
    with pytest.raises(ValueError, match="batch sizes must increase"):
        tuning.tune_batch_schedule(
            None, Trees(), prompts, space, base=base, batch_sizes=[4, 1], max_new_tokens=4
        )


def test_prompts_are_reused_to_fill_a_batch():
    prompts = [torch.tensor([[1, 2, 3]]), torch.tensor([[4, 5]]), torch.tensor([[6]])]
    as_lists = lambda size, least: [p.tolist() for p in tuning.filled(prompts, size, least)]  # noqa: E731
    assert as_lists(1, 1) == [[[1, 2, 3]], [[4, 5]], [[6]]]
    # every prompt once, the first again to fill the last batch
    assert as_lists(2, 1) == [[[1, 2, 3]], [[4, 5]], [[6]], [[1, 2, 3]]]
    assert as_lists(4, 1) == [[[1, 2, 3]], [[4, 5]], [[6]], [[1, 2, 3]]]
    # and at least min_batches batches, the prompts in turn: more than one timing a candidate
    assert as_lists(2, 3) == [[[1, 2, 3]], [[4, 5]], [[6]], [[1, 2, 3]], [[4, 5]], [[6]]]
    assert len(tuning.filled(prompts * 6, 16)) == 16 * tuning.MIN_BATCHES


def test_batch_sizes_save_a_schedule_of_each_races_fastest(layerskip_folder, tmp_path, capsys):
    """--batch-sizes races gamma and plain decoding at each batch size on real batches and
    saves the winners as the folder's batch_schedule: each entry is its race's fastest exact
    candidate by the race's own figures (with --min-gain 0: any win), and the folder decodes a
    batch with it."""
    report = tmp_path / "tune.json"
    code = main([
        str(layerskip_folder), "--num-prompts", "2", "--max-new-tokens", "8",
        "--search", "gamma=1,2", "stop_below=", "lookup_ngram=", "lookup_gamma=", "exit_layer=",
        "draft_weights=", "--batch-sizes", "1,3", "--passes", "1", "--min-gain", "0",
        "--output", str(report),
    ])  # fmt: skip
    assert code == 0
    result = json.loads(report.read_text())
    schedule = result["decode"]["batch_schedule"]
    assert [e["batch_size"] for e in schedule] == [1, 3]
    for entry, measured in zip(schedule, result["measured"]["batch_schedule"], strict=True):
        raced = [r for r in result["batch_search"] if r["batch_size"] == entry["batch_size"]]
        # plain decoding, the tuned settings, and them at gamma 1 and 2 (once each)
        gammas = {1, 2, result["decode"]["gamma"]}
        assert [r["settings"] for r in raced[:2]] == ["off", {}] and len(raced) == 1 + len(gammas)
        assert {r["settings"].get("gamma") for r in raced[2:]} == gammas - {
            result["decode"]["gamma"]
        }
        assert all(r["matches_plain"] for r in raced)  # float32: every candidate exact
        chosen = [r for r in raced if r["chosen"]]
        assert chosen == [max(raced, key=lambda r: r["tokens_per_s"])]
        settings = chosen[0]["settings"]
        assert entry == {"batch_size": entry["batch_size"], **({"off": True} if settings == "off" else settings)}  # fmt: skip
        assert measured["tokens_per_s"] == chosen[0]["tokens_per_s"]
    saved = load_decoding(layerskip_folder)
    assert saved.batch_schedule == schedule
    assert "batch size 3: " in capsys.readouterr().out


def test_a_search_races_without_the_schedule_and_keeps_it(monkeypatch):
    """An entry for batch size 1 would override the very setting a round races: the search
    races the settings without their schedule, and hands the schedule back on its pick."""
    raced = []

    def price(d):
        raced.append(d.batch_schedule)
        return d.gamma

    monkeypatch.setattr(tuning, "race", _priced_race(price))
    schedule = [{"batch_size": 1, "gamma": 4}, {"batch_size": 8, "off": True}]
    start = DecodeConfig(gamma=3, batch_schedule=schedule)
    best, _ = tuning.search_decode(
        None, _Chains(), [], {"gamma": [1, 3, 4]}, max_new_tokens=4, start=start
    )
    assert best.gamma == 1 and best.batch_schedule == schedule
    assert raced and all(s == [] for s in raced)
