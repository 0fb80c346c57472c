"""What scripts/evaluate.py measures and how it reports it.

An `EvalSpec` says what to measure; `build_runs` lists the methods it asks for (our plain
decoding `ar` first, the reference for speedups; transformers' generate; prompt lookup; each
drafter, with transformers' assisted decoding beside it); `measure` (measuring/measure.py)
decodes the same prompts with each; `make_report` turns them into report.json's rows and
`evaluation_report` into the report measuring/report_writer.py writes: report.json, report.md and
three plots. With several batch sizes (`EvalSpec.batch_sizes`) every method runs at each, one
row per method and batch size, its speedup against plain decoding at the same batch size; the
report adds each method's crossover (`crossover`: the smallest batch size where it is slower
than plain decoding) and a fourth plot, tokens/s and speedup against batch size. Plots name
each run by a
short label (`short_labels`) that report.md and report.json key to its full name; a lossy run
(Medusa's typical acceptance at temperature > 0) has "(lossy)" after its label, a `lossy` flag
and a line of its own in report.md, beside every run's mean log p (the target's log-likelihood
of its output: the drift).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specdraft.config import override
from specdraft.core import DecodeConfig, eos_ids, owner_of
from specdraft.data.benchmarks import Request
from specdraft.drafters.base import kinds_own_settings
from specdraft.formats.reading import (
    fine_tuned_target,
    folder_target_name,
    load_decoding,
    load_drafter,
)
from specdraft.measuring.benchmark_report import breakdown_markdown, category_figure
from specdraft.measuring.measure import (
    Case,
    Run,
    add_prompts_arguments,
    add_threads_argument,
    breakdown,
    case_labels,
    context_bound,
    loop_decoder,
    memory_bound,
    read_requests,
    summarize,
)
from specdraft.measuring.report_writer import (
    Column,
    Report,
    acceptance_figure,
    markdown_table,
    styles,
)
from specdraft.precision import dtype_name, resolve_precision, to_dtype
from specdraft.targets.target import DEFAULT_TARGET, TARGET_HELP

BASELINES = ("ar", "hf_ar", "prompt_lookup", "hf_assisted", "hf_prompt_lookup", "hf_early_exit")
# gamma for transformers' prompt lookup when --gamma is not given: our prompt lookup's default
HF_GAMMA = DecodeConfig().gamma
# A run name up to this long is its own label; a longer one is labelled by its method, numbered.
LABEL_CHARS = 16
# transformers' assisted generation (a draft model, prompt lookup, early exit) decodes one
# sequence at a time ("assisted generate is only supported for batch_size = 1"): these run at
# batch size 1 only, and a batch-size sweep leaves them out of every larger batch size
UNBATCHED = ("hf_assisted", "hf_prompt_lookup", "hf_early_exit")

# --- runs --------------------------------------------------------------------------------------


SHORT_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True)
class EvalSpec:
    """What an evaluation measures: the methods, the prompts and how each decodes them
    (scripts/evaluate.py's options, less the target and the output; scripts/compare.py asks for
    one per pass). ValueError names a bad value."""

    # FOLDER[:KEY=VALUE,...] each: a trained drafter, with decoding settings over its saved ones
    drafters: tuple[str, ...] = ()
    # methods beside the drafters (BASELINES); `ar` runs whatever is asked: the reference
    baselines: tuple[str, ...] = ("ar",)
    prompts: str = "mt-bench"  # a named set, demo, a file, ... (measure.read_requests)
    num_prompts: int = 8  # requests (MT-Bench: one of each category), every turn measured
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    # every drafter's draft depth and tree width; None: each drafter's saved setting
    gamma: int | None = None
    tree_top_k: int | None = None
    seed: int = 0
    # every method is measured at each batch size (prompts decoded together per call)
    batch_sizes: tuple[int, ...] = (1,)

    def __post_init__(self) -> None:
        object.__setattr__(self, "drafters", tuple(self.drafters))
        object.__setattr__(self, "batch_sizes", check_batch_sizes(self.batch_sizes))
        object.__setattr__(self, "baselines", tuple(b for b in self.baselines if b))
        unknown = set(self.baselines) - set(BASELINES)
        if unknown:
            raise ValueError(
                f"unknown baselines {sorted(unknown)}; choose from {','.join(BASELINES)}"
            )
        for flag, value in (("--gamma", self.gamma), ("--tree-top-k", self.tree_top_k)):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.max_new_tokens < 1 or self.num_prompts < 1:
            raise ValueError("--max-new-tokens and --num-prompts must be >= 1")
        self.prompts_measured(self.num_prompts, "--num-prompts")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def prompts_measured(self, available: int, given: str = "--prompts") -> int:
        """How many of `available` prompts are measured: all of them at batch size 1 only; with
        batch sizes, the most that every batch size cuts into whole batches (a multiple of their
        least common multiple), so every batch size decodes the same prompts in full batches.
        ValueError, naming the fix, where that is none."""
        group = math.lcm(*self.batch_sizes)
        if available == 0:
            raise ValueError(f"{given} gives no prompts")
        if available < group:
            sizes = ",".join(map(str, self.batch_sizes))
            why = (
                f"one batch of {group}"
                if group == max(self.batch_sizes)
                else f"whole batches of each size: a multiple of {group}"
            )
            raise ValueError(
                f"--batch-sizes {sizes} needs at least {group} prompts ({why}), and {given} "
                f"gives {available}: raise --num-prompts to {group} (with a prompt file that "
                "holds as many) or drop the larger batch sizes"
            )
        return available - available % group

    def check_prompts(self, target: str) -> None:
        """Before any model is loaded, with the target's tokenizer and config alone: the prompts
        exist, fill whole batches of every batch size (`prompts_measured`) and fit the
        target's context with max_new_tokens more. ValueError names the problem and the fix."""
        from transformers import AutoConfig, AutoTokenizer

        from specdraft.targets.target import target_path, unreachable

        path = target_path(target)
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
            limit = getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", None)
        except OSError as err:
            raise unreachable(target, err) from err
        requests = read_requests(self.prompts, self.num_prompts)
        given = f"--prompts {self.prompts}"
        self.prompts_measured(len(requests), given)
        bounds = [context_bound(tokenizer, r, self.max_new_tokens) for r in requests]
        longest = max(range(len(requests)), key=bounds.__getitem__)
        if limit is not None and bounds[longest] > limit:
            r = requests[longest]
            which = f"request {r.id}" if r.id else f"request {longest + 1}"
            raise ValueError(
                f"{given}: {which} ({len(r.turns)} turn(s)) takes up to {bounds[longest]} "
                f"positions with --max-new-tokens {self.max_new_tokens} per answer, more than "
                f"the target's context ({limit} positions): shorten the prompts or ask for "
                "fewer new tokens"
            )


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    """--batch-sizes "1,2,4,8,16": whole numbers >= 1, each at most once; returned in increasing
    order. ValueError names a bad one."""
    items = [t.strip() for t in text.split(",")]
    if not text.strip() or not all(items):
        raise ValueError(f"{text!r}: give batch sizes separated by commas, e.g. 1,2,4,8,16")
    sizes = []
    for item in items:
        try:
            sizes.append(int(item))
        except ValueError:
            raise ValueError(
                f"{item!r} is not a batch size: give whole numbers >= 1, e.g. 1,2,4,8,16"
            ) from None
    return check_batch_sizes(sizes)


def check_batch_sizes(sizes: Sequence[int]) -> tuple[int, ...]:
    """Batch sizes as a sorted tuple, or ValueError for one below 1, a repeat or none."""
    if not sizes:
        raise ValueError("give at least one batch size, e.g. 1")
    for b in sizes:
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"batch size {b!r}: each must be a whole number >= 1, e.g. 1,2,4")
    if len(set(sizes)) < len(sizes):
        raise ValueError(f"{','.join(map(str, sizes))}: give each batch size once")
    return tuple(sorted(sizes))


def parse_dtypes(text: str | None, device: str | None = None) -> list[torch.dtype | None]:
    """evaluate.py's --dtype: None (the target's saved precision) or comma-separated names
    ("float32,bfloat16"), each at most once. Asking for bf16 on a CPU without native bf16 prints
    one line saying it is emulated."""
    if text is None:
        return [None]
    names = [d.strip() for d in text.split(",") if d.strip()]
    dtypes = [to_dtype(d) for d in names]  # ValueError names an unknown one
    if not names or len(set(dtypes)) < len(dtypes):
        raise ValueError(f"{text!r}: give each precision once, e.g. float32,bfloat16")
    if torch.bfloat16 in dtypes and device in (None, "cpu"):
        resolve_precision("bf16", "cpu", "decoding")
    return dtypes


def runs_per_precision(spec: EvalSpec, targets: Sequence, loaded: dict | None = None) -> list[Run]:
    """`build_runs` for each loaded target (one per precision); with more than one, every run's
    name ends with its precision ("ar@fp32", "eagle@bf16"). `loaded`: as fine_tuned_target
    takes it."""
    runs = []
    for target in targets:
        name = dtype_name(target.dtype)
        suffix = f"@{SHORT_DTYPE.get(name, name)}" if len(targets) > 1 else ""
        runs += build_runs(spec, target, suffix, loaded)
    return runs


def build_runs(spec: EvalSpec, target, suffix: str = "", loaded: dict | None = None) -> list[Run]:
    """The methods `spec` asks for: `ar` first, then the baselines, then each drafter's runs;
    each run's name ends with `suffix` (the precision, "@bf16", when several are measured) and
    carries the target's dtype. Each method once per batch size of `spec.batch_sizes`, smallest
    first, transformers' assisted ones (UNBATCHED) at batch size 1 only."""
    runs = _runs(spec, target, loaded)
    for run in runs:
        run.name += suffix
        run.same_as = None if run.same_as is None else run.same_as + suffix
        run.dtype = dtype_name(target.dtype)
    return at_batch_sizes(runs, spec.batch_sizes)


def at_batch_sizes(runs: Sequence[Run], batch_sizes: Sequence[int]) -> list[Run]:
    """Each run at every batch size, smallest first (sharing its decode: drafters and models
    are loaded once); the UNBATCHED methods at batch size 1 only."""
    return [
        run.at_batch_size(b)
        for b in batch_sizes
        for run in runs
        if b == 1 or run.method not in UNBATCHED
    ]


def _runs(spec: EvalSpec, target, loaded: dict | None) -> list[Run]:
    baselines = spec.baselines
    gamma = spec.gamma if spec.gamma is not None else HF_GAMMA
    runs = [Run("ar", "ar", _ours(target, spec, None))]  # the reference for speedups, always run
    if "hf_ar" in baselines:
        runs.append(Run("hf_ar", "hf_ar", _hf(target, spec)))
    if "prompt_lookup" in baselines:
        runs.append(Run("prompt_lookup", "prompt_lookup", _ours(target, spec, "prompt_lookup")))
    if "hf_prompt_lookup" in baselines:
        lookup = _hf(target, spec, prompt_lookup_num_tokens=gamma)
        runs.append(Run("hf_prompt_lookup", "hf_prompt_lookup", lookup))
    for drafter in spec.drafters:
        # a fine-tuned target's plain decoding (ar[...]) is run once for all its drafters
        names = {run.name for run in runs}
        runs += [
            r
            for r in drafter_runs(drafter, target, spec, loaded)
            if r.method != "ar" or r.name not in names
        ]
    return runs


def _ours(target, spec: EvalSpec, drafter, decode: DecodeConfig | None = None):
    """A decode through our loop. A trained drafter drafts with `decode`; prompt lookup with the
    global --gamma (None: its default); plain decoding (drafter None) takes no settings."""
    settings = {}
    if drafter is not None and decode is None:
        settings = {"gamma": spec.gamma}
    return loop_decoder(
        target, drafter, max_new_tokens=spec.max_new_tokens, seed=spec.seed,
        temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k, decode=decode,
        **settings,
    )  # fmt: skip


def _hf(target, spec: EvalSpec, model_settings: dict | None = None, **options):
    """A decode through transformers' generate, new tokens cut after the first EOS as ours are.
    `model_settings`: generation-config values transformers reads from the model itself rather
    than from the call (an assistant's num_assistant_tokens), set for each call and put back,
    so runs sharing one model each decode with their own."""
    sample = dict(do_sample=spec.temperature > 0)
    if spec.temperature > 0:
        sample.update(temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k)
    eos = eos_ids(target.model)
    config = target.model.generation_config

    pad = target.tokenizer.pad_token_id
    pad = pad if pad is not None else min(eos, default=0)

    def decode(batch):
        torch.manual_seed(spec.seed)  # transformers samples from the global generator
        saved = {k: getattr(config, k, None) for k in model_settings or {}}
        for k, v in (model_settings or {}).items():
            setattr(config, k, v)
        ids, padding = batch[0], {}
        if len(batch) > 1:  # rows of different lengths: padded on the left, masked
            ids, mask = _left_padded(batch, pad)
            padding = dict(attention_mask=mask, pad_token_id=pad)
        try:
            out = target.model.generate(
                ids, max_new_tokens=spec.max_new_tokens, **sample, **padding, **options
            )
        finally:
            for k, v in saved.items():
                setattr(config, k, v)
        return [_until_eos(row[ids.shape[1] :].tolist(), eos) for row in out], None

    return decode


def _left_padded(batch: Sequence[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, L_i) prompts as one (B, max L) tensor padded on the left with `pad`, and its mask."""
    width = max(p.shape[1] for p in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long, device=batch[0].device)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(batch):
        ids[i, width - p.shape[1] :] = p[0]
        mask[i, width - p.shape[1] :] = 1
    return ids, mask


def _until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


# --- one --drafter FOLDER[:KEY=VALUE,...] ------------------------------------------------------


def drafter_runs(
    drafter_spec: str, target, spec: EvalSpec, loaded: dict | None = None
) -> list[Run]:
    """The runs of one drafter FOLDER[:KEY=VALUE,...]: the drafter in our loop with its saved
    decoding defaults, then `spec`'s gamma / tree_top_k, then the KEY=VALUE decoding settings
    (specdraft.core.DecodeConfig keys, read by the config engine as training reads them); then
    transformers' assisted decoding doing what it does, where it has one and `spec` asks for
    it. Raises ValueError (a ConfigError) naming `drafter_spec` and the key for a bad setting."""
    path, items = split_drafter_spec(drafter_spec)
    runs: list[Run] = []
    tuned = fine_tuned_target(path, target, loaded)
    if tuned is not None:
        # Heads trained with the target fine-tuned (Medusa-2), and LayerSkip (the fine-tuned
        # target itself), decode with that target: its own plain decoding is the output they
        # must equal; speedups stay against `ar`, since it costs what the base does per step.
        target = tuned
        # named by the adapter: best/, final/ and each checkpoint of one run hold different ones
        plain = Run(f"ar[adapter {tuned.fingerprint['adapter']}]", "ar", _ours(target, spec, None))
        runs.append(plain)
    drafter = load_drafter(path, target)
    decode = load_decoding(path).replace(gamma=spec.gamma, tree_top_k=spec.tree_top_k)
    for item in items:  # another kind's setting: named with its owner, as everywhere
        key, _, value = item.partition("=")
        if key.strip() not in decode.setting_names() and owner_of(key.strip()) is not None:
            raise ValueError(
                f"--drafter {drafter_spec}: "
                + drafter.decode_class.foreign_setting(
                    key.strip(), value, f"this {drafter.kind} drafter"
                )
            )
    decode = override(decode, items, source=f"--drafter {drafter_spec}")
    name = Path(path).name if Path(path).name not in ("final", "best") else str(path)
    if items:
        name += ":" + ",".join(items)
    params = drafter.num_extra_parameters(target)
    decoding = _ours(target, spec, drafter, decode)
    runs.append(Run(name, drafter.kind, decoding, params, settings=dataclasses.asdict(decode)))
    # transformers' assisted generation doing what this drafter does, where it can
    baseline = drafter.transformers_baseline(decode)
    if baseline is not None and baseline[0] in spec.baselines:
        method, settings, options = baseline
        assisted = _hf(target, spec, settings, **options)
        runs.append(Run(f"{method}[{name}]", method, assisted, params))
    if tuned is not None:  # every method on the fine-tuned target must give its plain output
        for run in runs[1:]:
            run.same_as = runs[0].name
    return runs


def default_target(drafters: Sequence[str]) -> str:
    """The target to measure when none is named: the first drafter folder's own (its run's
    train_config.yaml), else the embedded default. ValueError where that folder does not say;
    a folder that does not exist is left to the drafter's own error, later."""
    first = split_drafter_spec(drafters[0])[0] if drafters else None
    return folder_target_name(first) if first and Path(first).is_dir() else DEFAULT_TARGET


def split_drafter_spec(spec: str) -> tuple[str, list[str]]:
    """ "FOLDER[:k=v,k=v]" -> (folder, ["k=v", "k=v"]); a folder name may itself hold a colon."""
    path, sep, tail = spec.rpartition(":")
    if not sep or "=" not in tail:
        return spec, []
    return path, [item.strip() for item in tail.split(",")]


def parse_evaluate_args(
    description: str, argv: list[str] | None
) -> tuple[argparse.Namespace, EvalSpec]:
    """scripts/evaluate.py's options (`description`: its help text), and what to measure as an
    EvalSpec; the precisions asked for in args.dtypes (parse_dtypes)."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--target",
        default=None,
        help=f"{TARGET_HELP} (default: the first --drafter folder's own, else {DEFAULT_TARGET})",
    )
    parser.add_argument(
        "--drafter",
        action="append",
        default=[],
        metavar="FOLDER[:KEY=VALUE,...]",
        help="a trained drafter (repeat; the same folder may come back with other settings): "
        "after a colon, decoding settings for this drafter only, over its saved defaults "
        "(every kind's: "
        + ", ".join(DecodeConfig.setting_names())
        + "; a kind's own: "
        + ", ".join(kinds_own_settings())
        + "; Medusa's acceptance=typical is lossy at temperature > 0 and marked so)",
    )
    parser.add_argument("--baselines", default=",".join(BASELINES))
    add_prompts_arguments(parser, EvalSpec.prompts, EvalSpec.num_prompts)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument(
        "--gamma",
        type=int,
        default=None,
        help="draft depth (chain length, tree depth) for every method; default: each drafter's "
        f"saved setting ({HF_GAMMA} for prompt lookup)",
    )
    parser.add_argument(
        "--tree-top-k",
        "--topk",  # its old name, beside --top-k (sampling): still read
        dest="tree_top_k",
        type=int,
        default=None,
        help="tree_top_k of every trained drafter: 1 drafts a chain, k > 1 a tree (EAGLE-2's "
        "dynamic tree expanding k nodes per level into k children each; Medusa, P-EAGLE and "
        "DFlash: the best paths through each position's k best candidates); default: each "
        "drafter's own",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--batch-sizes",
        default="1",
        help="measure every method at each of these batch sizes (comma-separated, e.g. "
        "1,2,4,8,16), each against plain decoding at the same batch size (default: 1)",
    )
    parser.add_argument("--device", default=None)
    parser.add_argument(
        "--dtype",
        default=None,
        help="float32, bfloat16, float16 or several (float32,bfloat16), for the target and "
        "drafters (default: as saved); bf16 on a CPU without native bf16 is emulated and slow",
    )
    add_threads_argument(parser)
    parser.add_argument("--output", required=True, help="folder for report.json/.md and plots")
    parser.add_argument("--wandb", default=None, metavar="PROJECT", help="also log to W&B")
    args = parser.parse_args(argv)
    try:
        batch_sizes = parse_batch_sizes(args.batch_sizes)
    except ValueError as e:
        parser.error(f"--batch-sizes: {e}")
    try:
        spec = EvalSpec(
            drafters=args.drafter, baselines=args.baselines.split(","), prompts=args.prompts,
            num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, gamma=args.gamma,
            tree_top_k=args.tree_top_k, seed=args.seed, batch_sizes=batch_sizes,
        )  # fmt: skip
    except ValueError as e:
        parser.error(str(e))
    try:
        args.dtypes = parse_dtypes(args.dtype, args.device)
    except ValueError as e:
        parser.error(f"--dtype: {e}")
    try:
        args.target = args.target or default_target(args.drafter)
    except ValueError as e:  # the drafter's folder does not say: --target
        parser.error(str(e))
    return args, spec


# --- report ------------------------------------------------------------------------------------


def make_report(
    spec: EvalSpec,
    targets,
    runs: Sequence[Run],
    bandwidth: float | None = None,
    cases: Sequence[Case] | None = None,
    requests: Sequence[Request] | None = None,
) -> dict:
    """report.json's content: the target, the settings, one row of figures per run (a method at
    one batch size), each with the short `label` the plots name it by (the same at every batch
    size), and each method's `crossover` batch size. `targets`: the target, or one per precision
    measured (runs carry their dtype; each precision's `ar` comes first among its runs).

    Speedups are honest across precisions: `speedup_vs_ar` is against the *fastest* plain
    decoding measured at the run's batch size, whatever its precision, so a bf16 method is
    never flattered by a slow bf16 baseline; `speedup_vs_ar_same_dtype` is against plain
    decoding in the run's own precision and batch size. Greedy output is checked (`matches_ar`)
    against the plain decoding of the run's own precision and batch size (or its `same_as`): in
    bf16 a multi-token pass can round a near tie differently from a one-token step, and the
    report says so as measured. `bandwidth`: the machine's measured read bandwidth
    (measure.read_bandwidth), against which each precision's plain decoding at batch size 1 is
    set as a fraction of its memory bound (`memory_bound`). `cases` (what measure_requests
    decoded, in order) of `requests`: report.json's `outputs` holds each prompt's text and what
    every run decoded from it at the smallest batch size, so a reader sees what was produced,
    not only how fast; at batch size 1 each row has its figures per category and per turn
    (`breakdown`, against the fastest plain decoding) and report["benchmark"] says what the
    requests were."""
    targets = list(targets) if isinstance(targets, (list, tuple)) else [targets]
    of_dtype = {dtype_name(t.dtype): t for t in targets}
    greedy = spec.greedy
    by_name = {(run.name, run.batch_size): run for run in runs}
    plain = {}  # (dtype, batch size) -> that precision's plain decoding at that batch size
    for run in runs:
        if run.method == "ar" and run.same_as is None:
            plain.setdefault((run.dtype, run.batch_size), run)
    fastest = {}  # batch size -> the fastest plain decoding at it, whatever its precision
    for (_, b), run in plain.items():
        if b not in fastest or _tokens_per_s(run) > _tokens_per_s(fastest[b]):
            fastest[b] = run
    rows = []
    for run in runs:
        b = run.batch_size
        own = plain[run.dtype, b]
        target = of_dtype.get(run.dtype, targets[0])
        same_as = by_name.get((run.same_as, b), own)
        row = summarize(run, fastest[b], target, greedy, same_as=same_as)
        row["dtype"] = run.dtype
        row["speedup_vs_ar_same_dtype"] = _tokens_per_s(run) / _tokens_per_s(own)
        if cases is not None:
            row.update(breakdown(run, fastest[b], cases))
        rows.append(row)
    # one label per method, the same at every batch size: its lines in the sweep's plot
    first: dict[str, dict] = {}
    for row in rows:
        first.setdefault(row["name"], row)
    label_of = dict(zip(first, short_labels(list(first.values())), strict=True))
    for row in rows:
        # a lossy run's speedup is not comparable to the exact ones': every plot says so too
        label = label_of[row["name"]]
        row["label"] = f"{label} (lossy)" if row["lossy"] else label
    keys = (
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "gamma",
        "tree_top_k",
        "seed",
        "prompts",
    )
    settings = {k: getattr(spec, k) for k in keys}
    sizes = sorted(fastest)
    settings.update(
        device=str(targets[0].device),
        dtype=", ".join(of_dtype),
        fastest_plain=fastest[sizes[0]].name,
        torch_threads=torch.get_num_threads(),
        batch_sizes=sizes,
        num_prompts=len(runs[0].outputs),
    )
    speedups: dict[str, dict[int, float]] = {}  # method -> batch size -> speedup
    for row in rows:
        if row["method"] != "ar":  # plain decoding, of the base or a fine-tuned target
            speedups.setdefault(row["name"], {})[row["batch_size"]] = row["speedup_vs_ar"]
    if bandwidth is not None:
        settings["memory_bound"] = {
            dtype: memory_bound(of_dtype.get(dtype, targets[0]), _tokens_per_s(run), bandwidth)
            for (dtype, b), run in plain.items()
            if b == 1
        }
    report = {
        "target": {"name": targets[0].name, **targets[0].fingerprint},
        "settings": settings,
        "runs": rows,
        "crossover": {name: crossover(by_size) for name, by_size in speedups.items()},
    }
    if cases is not None and requests is not None:
        tokenizer = targets[0].tokenizer
        report["benchmark"] = {
            "prompts": spec.prompts,
            "requests": len(requests),
            "turns": max(c.turn for c in cases),
            "categories": list(dict.fromkeys(c.category for c in cases if c.category)),
            # a base model has no chat template: it was given the turns as plain text
            "chat_template": bool(tokenizer.chat_template),
        }
        report["outputs"] = decoded_texts(tokenizer, cases, requests, runs, label_of)
    return report


def decoded_texts(
    tokenizer, cases: Sequence[Case], requests, runs: Sequence[Run], label_of: Mapping[str, str]
) -> list:
    """Per prompt decoded, what names it (request id, category, turn), its text and each
    method's decoded text (by its short label) at the smallest batch size measured."""
    smallest = min(run.batch_size for run in runs)
    shown = [run for run in runs if run.batch_size == smallest]
    return [
        {
            **case_labels(case, requests),
            "prompt": tokenizer.decode(case.prompt[0].tolist()),
            "outputs": {label_of[run.name]: tokenizer.decode(run.outputs[i]) for run in shown},
        }
        for i, case in enumerate(cases)
    ]


def crossover(speedups: Mapping[int, float]) -> int | None:
    """The smallest batch size at which a method's speedup (batch size -> its speedup over plain
    decoding at that batch size) is below 1: where batching has made plain decoding the faster.
    None where it is at least 1 at every batch size measured."""
    return min((b for b, s in speedups.items() if s < 1), default=None)


def _tokens_per_s(run: Run) -> float:
    return run.stats.new_tokens / run.seconds


def short_labels(rows: Sequence[dict]) -> list[str]:
    """A label per run (rows with `name` and `method`) short enough for a legend or under a bar,
    all different: the name itself when it has at most LABEL_CHARS characters, else the method
    numbered in order (eagle#1, eagle#2, ...); transformers' assisted decoding with a drafter is
    hf[that drafter's label]."""
    labels: list[str] = []
    of_name: dict[str, str] = {}
    for r in rows:
        name, method = r["name"], r["method"]
        drafter = name.removeprefix("hf_assisted[").removesuffix("]")
        if method == "hf_assisted" and drafter in of_name:
            label = f"hf[{of_name[drafter]}]"
        else:
            label = name if len(name) <= LABEL_CHARS else None
        if label is None or label in labels:  # a long name, or the same drafter again
            stem, k = (method, 1) if label is None else (label, 2)
            while f"{stem}#{k}" in labels:
                k += 1
            label = f"{stem}#{k}"
        labels.append(label)
        of_name.setdefault(name, label)
    return labels


# report.md's table: one row per run, named by its label
RUN_COLUMNS = (
    Column("label", "label"),
    Column("name", "run"),
    Column("batch_size", "batch"),
    Column("dtype", "dtype"),
    Column("tau", "tau", "{:.2f}"),
    Column("tokens_per_s", "tokens/s", "{:.1f}"),
    Column("speedup_vs_ar", "speedup", "{:.2f}x"),
    Column("speedup_vs_ar_same_dtype", "same dtype", "{:.2f}x"),
    Column("overhead", "overhead", "{:.2f}"),
    Column("draft_time_frac", "draft time", "{:.0%}"),
    Column("copied_share", "copied", "{:.0%}"),
    Column("extra_params", "extra params", "{:,}"),
    Column("matches_ar", "matches ar"),
    Column("mean_log_p", "mean log p", "{:.3f}"),
    Column("lossy", "lossy", lambda lossy: "yes" if lossy else "no"),
)
# the W&B run's table: these keys of every run
WANDB_KEYS = ("label", "name", "method", "batch_size", "tau", "tokens_per_s", "speedup_vs_ar",
              "overhead", "mean_log_p", "lossy")  # fmt: skip


def evaluation_report(report: dict, runs: Sequence[Run]) -> Report:
    """What scripts/evaluate.py writes (measuring/report_writer.py's write_report): `report` as
    report.json, its markdown, and three plots of the runs at the smallest batch size measured:
    acceptance per position and the tau distribution of the runs that drafted, and every run's
    speedup with its draft/verify split; with several batch sizes a fourth, batch_sizes.png:
    every method's tokens/s and speedup against batch size."""
    smallest = report["settings"]["batch_sizes"][0]
    # the runs that drafted: each in the same place of report.styles in both plots that show them
    drafted = [
        (r, run)
        for r, run in zip(report["runs"], runs, strict=True)
        if r["acceptance_per_position"] and r["batch_size"] == smallest
    ]
    figures = {
        "acceptance_per_position": acceptance_figure([r for r, _ in drafted]),
        "tau_distribution": lambda plt: _tau_distribution(plt, drafted, styles(len(drafted), plt)),
        "speedup": lambda plt: _speedup(
            plt, [r for r in report["runs"] if r["batch_size"] == smallest]
        ),
    }
    if len(report["settings"]["batch_sizes"]) > 1:
        figures["batch_sizes"] = lambda plt: batch_size_figure(plt, report)
    if any("by_category" in r for r in report["runs"]):
        figures["categories"] = lambda plt: category_figure(plt, report)
    return Report(
        report, markdown(report), figures, job_type="evaluate", config=report["settings"],
        table_name="runs", table_keys=WANDB_KEYS, rows=report["runs"],
    )  # fmt: skip


def markdown(report: dict) -> str:
    s = report["settings"]
    lines = [
        f"# Evaluation: {report['target']['name']}",
        "",
        f"{s['max_new_tokens']} new tokens, temperature {s['temperature']}, gamma "
        f"{s['gamma'] if s['gamma'] is not None else 'per drafter'}, "
        f"{s['device']} {s['dtype']}. Speedup: tokens/s over our fastest plain decoding "
        f"(`{s.get('fastest_plain', 'ar')}`), same process, whatever its precision; 'same dtype': "
        "over plain decoding in the run's own precision, which 'matches ar' compares with too; "
        "overhead = tau / speedup - 1; copied = share of target passes whose draft "
        "was copied from the context (lookup_ngram) rather than drafted by the model; mean log "
        "p = the target's mean log-likelihood of the emitted tokens (temperature > 0), which "
        "lossless runs share with `ar` up to noise. The plots name each run by its label.",
        "",
        *runs_markdown(report["runs"]),
        *breakdown_markdown(report),
        *sweep_markdown(report),
        *memory_markdown(s.get("memory_bound", {})),
    ]
    return "\n".join(lines) + "\n"


def memory_markdown(bounds: Mapping[str, dict]) -> list[str]:
    """Plain decoding against the memory limit, per precision: nothing when not measured."""
    if not bounds:
        return []
    lines = [
        "",
        "## Plain decoding against the memory limit",
        "",
        "Weight bytes a step reads over the time a token takes (new tokens over the whole "
        "decode, the prompt's prefill included), against this machine's read bandwidth "
        "measured in the same process (batch size 1; KV-cache reads left out).",
        "",
        "| precision | weight MB per token | read GB/s | bound tokens/s | plain tokens/s | of bound |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for dtype, m in bounds.items():
        lines.append(
            f"| {dtype} | {m['weight_bytes_per_token'] / 1e6:.0f} | "
            f"{m['read_bandwidth_gb_s']:.1f} | {m['bound_tokens_per_s']:.1f} | "
            f"{m['tokens_per_s']:.1f} | {m['fraction_of_bound']:.0%} |"
        )
    return lines


def sweep_markdown(report: dict) -> list[str]:
    """With several batch sizes: each method's speedup and tau at each (speedup over plain
    decoding at the same batch size), plain decoding's tokens/s, and each method's crossover.
    Nothing otherwise."""
    sizes = report["settings"]["batch_sizes"]
    if len(sizes) < 2:
        return []
    rows = report["runs"]
    at = {(r["name"], r["batch_size"]): r for r in rows}
    names = list(dict.fromkeys(r["name"] for r in rows))
    lines = [
        "",
        "## Speedup against batch size",
        "",
        f"The same {report['settings']['num_prompts']} prompts at every batch size, decoded "
        "b at a time (each call one batch); speedup over plain decoding (`ar`) at the same "
        "batch size, with tau in brackets; tokens/s counts the whole batch's new tokens. Crossover: the smallest "
        "batch size measured at which the method is slower than plain decoding."
        + (
            " Transformers' assisted generation decodes one sequence at a time: measured at "
            "batch size 1 only."
            if any(r["method"] in UNBATCHED for r in rows)
            else ""
        ),
        "",
        "| label | " + " | ".join(f"b={b}" for b in sizes) + " | crossover |",
        "| --- | " + " | ".join("---:" for _ in sizes) + " | ---: |",
    ]
    for name in names:
        plain = name not in report["crossover"]
        cells = []
        for b in sizes:
            r = at.get((name, b))
            if r is None:
                cells.append("-")
            elif plain:
                cells.append(f"{r['tokens_per_s']:.1f} tok/s")
            else:  # tau where the run reports one (transformers' generate does not)
                tau = f" (tau {r['tau']:.2f})" if r["tau"] is not None else ""
                cells.append(f"{r['speedup_vs_ar']:.2f}x{tau}")
        label = next(r["label"] for r in rows if r["name"] == name)
        cross = ""  # plain decoding has none
        if not plain:
            at_b = report["crossover"][name]
            cross = "none" if at_b is None else f"b={at_b}"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {cross} |")
    return lines


def runs_markdown(rows: Sequence[dict]) -> list[str]:
    """The lines of report.md that show `rows` (make_report's runs): their table, which of them
    are lossy, and each drafter's acceptance per position."""
    lines = markdown_table(RUN_COLUMNS, rows)
    lossy = [r["label"] for r in rows if r["lossy"]]
    if lossy:
        lines += [
            "",
            f"**Lossy** (typical acceptance): {', '.join(lossy)}. Their output does not follow "
            "the target's distribution: they trade fidelity (mean log p drifts from the lossless "
            "runs') for speed, so their speedup is not comparable to the exact runs'.",
        ]
    lines += ["", "Acceptance per position (alpha_i):", ""]
    sweep = len({r["batch_size"] for r in rows}) > 1
    for r in rows:
        if r["acceptance_per_position"]:
            alphas = ", ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
            at = f" (b={r['batch_size']})" if sweep else ""
            lines.append(f"- {r['label']}{at}: {alphas}")
    return lines


# --- plots -------------------------------------------------------------------------------------


def _tau_distribution(plt, drafted, styles):
    """One small panel per run that drafted: a dozen overlaid histograms cannot be told
    apart."""
    from matplotlib.ticker import MaxNLocator

    n = max(len(drafted), 1)
    ncols = min(n, 3)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(max(3.2 * ncols, 5), 2.2 * nrows + 0.8), sharex=True, sharey=True,
        squeeze=False,
    )  # fmt: skip
    if not drafted:
        axes[0, 0].text(0.5, 0.5, "no run drafted", ha="center", transform=axes[0, 0].transAxes)
    for i in range(n, nrows * ncols):  # no run: no panel, its x axis on the one above
        axes.flat[i].set_visible(False)
        axes.flat[i - ncols].tick_params(labelbottom=True)
    for ax, (r, run), style in zip(axes.flat, drafted, styles, strict=False):
        counts = torch.bincount(torch.tensor(run.stats.emitted_per_pass, dtype=torch.long))[1:]
        share = (counts / counts.sum()).tolist()  # a pass emits at least one token
        ax.bar(range(1, len(share) + 1), share, color=style["color"], width=0.8)
        ax.axvline(r["tau"], color="black", lw=1, ls="--")
        ax.set_title(f"{r['label']}: tau {r['tau']:.2f}", fontsize=10)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("tau distribution (dashed: mean)")
    fig.supxlabel("tokens emitted per target pass")
    fig.supylabel("share of passes")
    fig.tight_layout()
    return fig


def batch_size_figure(plt, report: dict):
    """Tokens/s (plain decoding included) and speedup against batch size, one line per method
    in its place of report.styles; the speedup panel marks 1 (plain decoding) and each
    crossover."""
    rows = report["runs"]
    names = list(dict.fromkeys(r["name"] for r in rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, style in zip(names, styles(len(names), plt), strict=True):
        mine = sorted((r for r in rows if r["name"] == name), key=lambda r: r["batch_size"])
        sizes = [r["batch_size"] for r in mine]
        label = mine[0]["label"]
        plain = name not in report["crossover"]
        left.plot(sizes, [r["tokens_per_s"] for r in mine], label=label, alpha=0.85,
                  ls="--" if plain else "-", **style)  # fmt: skip
        if not plain:
            right.plot(sizes, [r["speedup_vs_ar"] for r in mine], label=label, alpha=0.85,
                       **style)  # fmt: skip
            cross = report["crossover"][name]
            if cross is not None:
                at = next(r["speedup_vs_ar"] for r in mine if r["batch_size"] == cross)
                right.scatter([cross], [at], s=160, facecolors="none", edgecolors=style["color"])
    right.axhline(1.0, color="black", lw=0.8)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(report["settings"]["batch_sizes"])
        ax.set_xticklabels([str(b) for b in report["settings"]["batch_sizes"]])
        ax.set_xlabel("batch size")
        ax.grid(alpha=0.3)
    left.set(ylabel="tokens/s (whole batch)", title="Throughput (dashed: plain decoding)")
    right.set(ylabel="speedup vs plain decoding (same batch size)",
              title="Speedup (circled: crossover below 1)")  # fmt: skip
    fig.tight_layout()
    # beside both panels: the saved figure widens for it
    fig.legend(*left.get_legend_handles_labels(), loc="upper left", bbox_to_anchor=(1.0, 0.95),
               frameon=False)  # fmt: skip
    return fig


def _speedup(plt, rows):
    labels = [r["label"] for r in rows]
    speed = [r["speedup_vs_ar"] for r in rows]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * len(rows) + 2), 4))
    # split by draft time share; transformers' generate reports no split: one grey bar
    draft = [s * (r["draft_time_frac"] or 0.0) for s, r in zip(speed, rows, strict=True)]
    split = [r["draft_time_frac"] is not None for r in rows]
    verify = [s - d if ok else 0 for s, d, ok in zip(speed, draft, split, strict=True)]
    ax.bar(labels, verify, label="verify share", color="tab:blue")
    ax.bar(labels, draft, bottom=verify, label="draft share", color="tab:orange")
    if not all(split):
        whole = [0 if ok else s for s, ok in zip(speed, split, strict=True)]
        ax.bar(labels, whole, label="no split (transformers)", color="tab:gray")
    for i, s in enumerate(speed):
        ax.annotate(f"{s:.2f}x", (i, s), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 2), textcoords="offset points")  # fmt: skip
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_ylim(0, max(*speed, 1.0) * 1.12)  # room for the figures above the bars
    ax.set(ylabel="speedup vs our plain decoding", title="Speedup (bar split: draft / verify)")
    if max(map(len, labels)) > 6:
        plt.setp(ax.get_xticklabels(), rotation=30, ha="right", rotation_mode="anchor")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1), frameon=False)
    return fig
