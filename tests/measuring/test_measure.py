"""measuring/measure.py without a model: prompt sources, and how a batch-size sweep takes
turns; the sweep's crossover and batch sizes (measuring/evaluation.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from specdraft.data.benchmarks import Request
from specdraft.data.formats import Example
from specdraft.inference.metrics import Stats
from specdraft.measuring.evaluation import EvalSpec, at_batch_sizes, parse_batch_sizes
from specdraft.measuring.evaluation_report import crossover
from specdraft.measuring.measure import (
    Case,
    Run,
    breakdown,
    group_figures,
    loop_decoder,
    measure,
    measure_requests,
    read_prompts,
    request_ids,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py says why


def test_eval_prompts_are_the_part_before_the_loss():
    chat = Example([1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 1, 1])  # prompt, then the answer
    text = Example([7, 8, 9, 10], [1, 1, 1, 1])  # plain text: every token is a target
    prompts = read_prompts("eval", 5, None, [chat, text])  # token ids already: no tokenizer
    assert [p.tolist() for p in prompts] == [[[1, 2, 3]], [[7, 8]]]
    assert len(read_prompts("eval", 1, None, [chat, text])) == 1
    with pytest.raises(ValueError, match="held-out examples"):
        read_prompts("eval", 1, None, [])
    with pytest.raises(ValueError, match="no such file"):
        read_prompts("missing.jsonl", 1, None)


def test_a_prompt_file_is_read_with_the_tokenizer_alone(tmp_path, tiny_target):
    """What scripts/compare.py checks before any model is loaded: a file's prompts, each
    tokenized by the tokenizer given, in order, at most n, on the CPU."""
    (tmp_path / "p.jsonl").write_text('{"prompt": "def f(x):"}\n"import os"\n"x = 1"\n')
    prompts = read_prompts(str(tmp_path / "p.jsonl"), 2, tiny_target.tokenizer)
    tokenize = lambda text: tiny_target.tokenizer(text, return_tensors="pt").input_ids  # noqa: E731
    assert [p.tolist() for p in prompts] == [
        tokenize(t).tolist() for t in ("def f(x):", "import os")
    ]
    assert all(p.device.type == "cpu" for p in prompts)


def test_conversation_rows_are_rendered_through_the_chat_template(tmp_path, tiny_target):
    """A {"messages": [...]} prompt file (what chat benchmarks ship) is the chat prompt up to the
    last user turn, the assistant's turn opened, BOS once; a row of no known shape is named."""
    tok = tiny_target.tokenizer
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def f():"},
            {"role": "assistant", "content": "pass"}]  # fmt: skip
    rows = [{"messages": chat}, {"prompt": "x = 1"}, "y = 2"]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = read_prompts(str(tmp_path / "p.jsonl"), 3, tok)
    expected = tok.apply_chat_template(chat[:2], add_generation_prompt=True, return_dict=True)
    assert prompts[0][0].tolist() == expected["input_ids"]
    assert prompts[1][0].tolist() == tok("x = 1").input_ids
    (tmp_path / "bad.jsonl").write_text(json.dumps({"question": "?"}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl, row 1: no prompt in this row .*messages"):
        read_prompts(str(tmp_path / "bad.jsonl"), 1, tok)
    (tmp_path / "nouser.jsonl").write_text(json.dumps({"messages": chat[:1]}) + "\n")
    with pytest.raises(ValueError, match="must start with the user's turn"):
        read_prompts(str(tmp_path / "nouser.jsonl"), 1, tok)
    requests = read_prompts("stdlib-requests", 2, tok)
    assert len(requests) == 2 and requests[0][0, 0] == tok.bos_token_id != requests[0][0, 1]


def test_batch_sizes_take_turns_on_the_same_prompts_in_whole_batches():
    """measure with runs at batch sizes 1 and 2: each run decodes every prompt once, in order, b
    at a time; the runs of one batch size take turns on each batch, the batch sizes on each
    group of lcm prompts; outputs stay one per prompt. Fake runs: no model, nothing timed."""
    calls: list[tuple[str, list[int]]] = []

    def fake(name):
        def decode(batch):  # each prompt's "new tokens": its first id, twice
            calls.append((name, [p[0, 0].item() for p in batch]))
            return [[p[0, 0].item()] * 2 for p in batch], None

        return decode

    runs = [
        Run("a", "ar", fake("a")), Run("b", "x", fake("b")),
        Run("a", "ar", fake("a2"), batch_size=2), Run("b", "x", fake("b2"), batch_size=2),
    ]  # fmt: skip
    prompts = [torch.tensor([[i, 7, 7]]) for i in range(4)]
    measure(runs, prompts, SimpleNamespace(device=torch.device("cpu")))
    warm_up, measured = calls[:4], calls[4:]
    assert warm_up == [("a", [0]), ("b", [0]), ("a2", [0, 1]), ("b2", [0, 1])]
    assert measured == [
        ("a", [0]), ("b", [0]), ("a", [1]), ("b", [1]), ("a2", [0, 1]), ("b2", [0, 1]),
        ("a", [2]), ("b", [2]), ("a", [3]), ("b", [3]), ("a2", [2, 3]), ("b2", [2, 3]),
    ]  # fmt: skip
    for run in runs:
        assert run.outputs == [[i, i] for i in range(4)] and run.stats.new_tokens == 8
        assert run.has_stats is False  # a decode outside our loop reports no stats
    with pytest.raises(ValueError, match="give a multiple of 2"):
        measure(runs, prompts[:3], SimpleNamespace(device=torch.device("cpu")))


def test_a_sweep_repeats_every_method_but_transformers_assisted_ones():
    runs = [Run("ar", "ar", None), Run("hf_ar", "hf_ar", None),
            Run("hf_assisted[d]", "hf_assisted", None), Run("d", "distill", None)]  # fmt: skip
    runs[3].outputs.append([1])  # measured already: the copies start empty
    swept = at_batch_sizes(runs, (1, 4))
    assert [(r.name, r.batch_size) for r in swept] == [
        ("ar", 1), ("hf_ar", 1), ("hf_assisted[d]", 1), ("d", 1), ("ar", 4), ("hf_ar", 4),
        ("d", 4),
    ]  # fmt: skip
    assert all(r.outputs == [] for r in swept)


@pytest.mark.parametrize(
    ("speedups", "expected"),
    [
        ({1: 1.8, 2: 1.4, 4: 1.05, 8: 0.9, 16: 0.6}, 8),
        ({16: 0.7, 1: 2.0, 8: 0.95, 4: 1.2}, 8),  # in any order
        ({1: 1.5, 2: 0.98, 4: 1.1, 8: 0.9}, 2),  # the first below 1, even if it recovers
        ({1: 0.8, 2: 0.9}, 1),  # slower than plain decoding from the start
        ({1: 1.3, 2: 1.0, 4: 1.01}, None),  # exactly 1 is not below it
        ({1: 1.3}, None),
    ],
)
def test_crossover_is_the_smallest_batch_size_below_plain_decoding(speedups, expected):
    assert crossover(speedups) == expected


def test_batch_sizes_are_read_sorted_or_refused_by_name():
    assert parse_batch_sizes("1,2,4,8,16") == (1, 2, 4, 8, 16)
    assert parse_batch_sizes(" 4, 1 ") == (1, 4)
    bad = {
        "0": "batch size 0: each must be a whole number >= 1",
        "-1": "batch size -1: each must be a whole number >= 1",
        "abc": "'abc' is not a batch size",
        "2.5": "'2.5' is not a batch size",
        "": "give batch sizes separated by commas",
        "1,,2": "give batch sizes separated by commas",
        "2,2": "give each batch size once",
    }
    for text, message in bad.items():
        with pytest.raises(ValueError, match=message):
            parse_batch_sizes(text)


def test_every_batch_size_measures_the_same_prompts_in_whole_batches():
    sweep = EvalSpec(num_prompts=20, batch_sizes=(1, 2, 4, 8, 16))
    assert sweep.prompts_measured(20) == 16 and sweep.prompts_measured(33) == 32
    assert EvalSpec(num_prompts=20).prompts_measured(7) == 7  # batch size 1: every prompt
    assert EvalSpec(num_prompts=12, batch_sizes=(3, 4)).prompts_measured(20) == 12
    with pytest.raises(
        ValueError, match=r"needs at least 16 prompts \(one batch of 16\).* gives 4"
    ):
        EvalSpec(num_prompts=4, batch_sizes=(1, 16))
    with pytest.raises(ValueError, match=r"raise --num-prompts to 12 .* or drop the larger"):
        EvalSpec(num_prompts=8, batch_sizes=(3, 4))
    with pytest.raises(ValueError, match=r"--prompts p\.txt gives 3"):
        sweep.prompts_measured(3, "--prompts p.txt")


def test_threads_are_as_asked_or_the_fastest_measured_now(tiny_target):
    from specdraft.measuring.measure import choose_threads, usable_cores

    before = torch.get_num_threads()
    try:
        assert choose_threads(1, tiny_target) == 1 == torch.get_num_threads()
        said = []
        chosen = choose_threads(0, tiny_target, log=said.append)
        assert 1 <= chosen <= usable_cores() and chosen == torch.get_num_threads()
        assert said and said[0].startswith(
            f"threads: {chosen} (a one-token decoding step of the target with 1: "
        )
        with pytest.raises(ValueError, match="--threads must be >= 0"):
            choose_threads(-1, tiny_target)
    finally:
        torch.set_num_threads(before)


def test_a_step_reads_every_weight_once_and_one_row_of_an_untied_embedding(tiny_target):
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdraft.measuring.measure import weight_bytes_per_token
    from specdraft.targets.target import Target

    tied = weight_bytes_per_token(tiny_target)  # the demo target ties its LM head
    assert tied == sum(p.numel() * 4 for p in tiny_target.model.parameters())  # shared once
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, tie_word_embeddings=False)  # fmt: skip
    untied = Target(LlamaForCausalLM(config), tiny_target.tokenizer)
    everything = sum(p.numel() * 4 for p in untied.model.parameters())
    assert weight_bytes_per_token(untied) == everything - 64 * 16 * 4
    assert weight_bytes_per_token(Target(untied.model.bfloat16(), tiny_target.tokenizer)) * 2 == (
        everything - 64 * 16 * 4
    )


def test_tau_of_a_group_is_pooled_over_its_target_passes_not_a_mean_of_prompts():
    """As vLLM and SGLang count acceptance length: every token emitted over every target pass of
    the group's prompts. Prompt 0 emits 10 tokens in 2 passes (tau 5), prompt 1 3 in 3 (tau 1):
    pooled 13 / 5 = 2.6, where the mean of the two would say 3."""
    run, plain = Run("d", "x", None), Run("ar", "ar", None)
    run.calls = [(0, Stats(new_tokens=10, target_passes=2), 1.0),
                 (1, Stats(new_tokens=3, target_passes=3), 1.0)]  # fmt: skip
    plain.calls = [(0, Stats(new_tokens=10, target_passes=10), 4.0),
                   (1, Stats(new_tokens=3, target_passes=3), 2.0)]  # fmt: skip
    run.outputs = plain.outputs = [[0] * 10, [0] * 3]
    both = group_figures(run, plain, [0, 1])
    mean_of_prompts = (10 / 2 + 3 / 3) / 2
    assert both["tau"] == pytest.approx(13 / 5) and abs(both["tau"] - mean_of_prompts) > 0.3
    assert both["speedup_vs_ar"] == pytest.approx((13 / 2) / (13 / 6))
    assert group_figures(run, plain, [1])["tau"] == 1.0
    cases = [Case(0, 1, "math", None), Case(1, 2, "code", None)]
    split = breakdown(run, plain, cases)
    assert split["by_category"]["math"]["tau"] == 5.0 and split["by_turn"]["2"]["tau"] == 1.0


def test_a_later_turn_follows_the_targets_own_answer_for_every_method(tiny_target):
    """measure_requests: first turns of every request, then second turns, each rendered through
    the chat template after the earlier turn and plain decoding's answer to it; every run
    decodes the same prompts, and the cases say which request, turn and category each was."""
    tok = tiny_target.tokenizer
    requests = [
        Request(("def add(a, b):", "Now subtract."), category="code", id="1"),
        Request(("import os",), category="other", id="2"),
    ]
    decode = loop_decoder(tiny_target, None, max_new_tokens=4)
    ar, other = Run("ar", "ar", decode), Run("again", "x", decode)
    cases = measure_requests([ar, other], requests, tiny_target)
    assert [(c.request, c.turn, c.category) for c in cases] == [
        (0, 1, "code"), (1, 1, "other"), (0, 2, "code")
    ]  # fmt: skip
    assert len(ar.outputs) == len(other.outputs) == 3 and ar.outputs == other.outputs
    answer = tok.decode(ar.outputs[0], skip_special_tokens=True)
    chat = [{"role": "user", "content": "def add(a, b):"},
            {"role": "assistant", "content": answer}, {"role": "user", "content": "Now subtract."}]  # fmt: skip
    expected = tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)
    assert cases[2].prompt[0].tolist() == expected["input_ids"]
    split = breakdown(other, ar, cases)
    assert set(split["by_category"]) == {"code", "other"} and set(split["by_turn"]) == {"1", "2"}
    assert split["by_turn"]["2"]["prompts"] == 1 and split["by_category"]["code"]["prompts"] == 2


def test_a_base_model_gets_the_turns_and_answers_as_plain_text(tiny_target):
    """A tokenizer without a chat template (Gemma-3-270M base): turn 2 is turn 1, the answer and
    turn 2, blank-line separated; a HumanEval request gives the bare code to continue."""
    import copy

    tok = copy.deepcopy(tiny_target.tokenizer)
    tok.chat_template = None
    two = Request(("def add(a, b):", "Now subtract."), category="code")
    got = request_ids(tok, two, ["    return a + b"])
    assert got[0].tolist() == tok("def add(a, b):\n\n    return a + b\n\nNow subtract.").input_ids
    code = Request(("Complete this:\n```python\ndef f():```",), completion="def f():")
    assert request_ids(tok, code, [])[0].tolist() == tok("def f():").input_ids
