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

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specdraft.config import override
from specdraft.core import DecodeConfig, eos_ids, owner_of
from specdraft.formats.reading import (
    fine_tuned_target,
    folder_target_name,
    load_decoding,
    load_drafter,
)
from specdraft.measuring.measure import Run, context_bound, loop_decoder, read_requests
from specdraft.precision import dtype_name, resolve_precision, to_dtype
from specdraft.targets.target import DEFAULT_TARGET

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
