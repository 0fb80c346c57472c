"""Choose a drafter's decoding settings by measured tokens/s on the hardware at hand.

The best draft depth, tree shape, stop rule, draft weights, copying and (LayerSkip) exit layer
depend on the machine as much as on the drafter: how much a wider verification or one more
drafting call costs is a property of the hardware. So they are measured where the drafter will
run. The search goes one setting at a time (SEARCH_ORDER), each round racing the best settings
so far against every candidate value of one setting, with plain decoding in the same round; the
candidates take turns on each prompt, so a machine whose load drifts slows them alike; and
since settings interact, a second pass races a setting again where another one changed. At
temperature 0 a candidate whose output differs from plain decoding's is not kept (unless the
caller allows it: in bf16, near ties can flip a token). scripts/tune.py saves the result into
the checkpoint as its decoding defaults; training scripts tune the tree budget with it.

What pays also depends on the batch: a wider batch makes each target pass cost more, so
drafted tokens that miss cost more too. `tune_batch_schedule` races draft depth (and a tree's
budget) at each batch size, plain decoding included, and returns the winners as the settings'
batch_schedule (DecodeConfig.for_batch).
"""

from __future__ import annotations

import dataclasses
import platform
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdraft.core import DecodeConfig, owner_of
from specdraft.inference.metrics import Stats
from specdraft.measuring.measure import Run, loop_decoder, measure
from specdraft.precision import dtype_name

# The kind's own settings first (LayerSkip's exit decides what its depth is worth), then trees
# (their width and budget decide whether stop_below or int8 apply at all), then the depth, then
# what refines a chain, then copying.
SEARCH_ORDER = (
    "tree_top_k",
    "tree_budget",
    "gamma",
    "stop_below",
    "draft_weights",
    "lookup_ngram",
    "lookup_gamma",
)


def default_space(drafter, target) -> dict[str, list]:
    """The values tried for each setting, for this drafter on this target's device. A value the
    drafter cannot honour (its `ignored_settings` says so) is skipped during the search."""
    cpu = target.device.type == "cpu"
    space: dict[str, list] = {
        "tree_top_k": [1, 2, 4],
        # a CPU's verification cost grows quickly with the tree; a GPU's hardly at all
        "tree_budget": [6, 12, 24] if cpu else [16, 32, 64],
        "gamma": [1, 2, 3, 4, 5, 6, 8],
        "stop_below": [0.0, 0.2, 0.4],
        "draft_weights": ["full", "int8"] if cpu else ["full"],
        "lookup_ngram": [0, 3],
        # 0: copies as long as the drafter's chains; tried only where lookup_ngram copies
        "lookup_gamma": [0, 4, 8, 16],
    }
    space.update(drafter.search_space(target))  # the kind's own settings (LayerSkip's exits)
    return space


def tunable(decode_class: type[DecodeConfig] = DecodeConfig) -> list[str]:
    """The settings a search may race for drafters of `decode_class` (a kind's), in search
    order: the kind's own first, then SEARCH_ORDER."""
    return [*decode_class.own_setting_names(), *SEARCH_ORDER]


def parse_space(
    items: Sequence[str],
    base: Mapping[str, list],
    decode_class: type[DecodeConfig] = DecodeConfig,
) -> dict[str, list]:
    """`base` with KEY=V1,V2,... items replacing the values tried for KEY (a setting of
    `decode_class`, the drafter's kind's); KEY= (nothing) leaves KEY out of the search. Raises
    ValueError naming a bad item."""
    space = dict(base)
    keys = tunable(decode_class)
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip()
        if sep and key not in keys and owner_of(key) is not None:
            raise ValueError(f"--search {item!r}: {decode_class.foreign_setting(key, values)}")
        if not sep or key not in keys:
            raise ValueError(
                f"--search {item!r}: expected KEY=V1,V2,... with KEY one of {', '.join(keys)}"
            )
        if not values.strip():
            space.pop(key, None)
            continue
        kind = type(getattr(decode_class(), key))
        try:
            parsed = [kind(v.strip()) for v in values.split(",")]
        except ValueError:
            raise ValueError(f"--search {item!r}: {key} takes {kind.__name__} values") from None
        for v in parsed:  # the settings' own checks, naming the key
            decode_class(**{key: v})
        space[key] = parsed
    return space


def check_space(drafter, space: Mapping[str, Sequence]) -> None:
    """Raise ValueError naming a value this drafter can never decode with (another kind's
    setting, or one out of the drafter's range, as `Drafter.check_decode` says)."""
    for key, values in space.items():
        for value in values:
            try:
                drafter.check_decode(drafter.decode_settings({key: value}))
            except ValueError as e:
                raise ValueError(f"--search {key}: {e}; leave it out of --search") from None


@dataclass
class Trial:
    """One setting's decodes in a race (decode None: plain decoding)."""

    decode: DecodeConfig | None
    seconds: float = 0.0
    stats: Stats = field(default_factory=Stats)
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.stats.new_tokens / max(self.seconds, 1e-9)


def race(
    target,
    drafter,
    prompts: Sequence[torch.Tensor],
    decodes: Sequence[DecodeConfig],
    *,
    max_new_tokens: int,
    batch_size: int = 1,
    **options,
) -> list[Trial]:
    """Plain decoding, then each of `decodes`, on every prompt, timed by the one harness
    (measuring/measure.py `measure`: a warm-up of each, then turns per batch of `batch_size`
    prompts, decoded together: `filled` makes any prompts whole batches). options: generate's
    sampling options (temperature, seed, ...)."""
    plain = loop_decoder(target, None, max_new_tokens=max_new_tokens, **options)
    runs = [Run("plain", "ar", plain, batch_size=batch_size)]
    for i, d in enumerate(decodes):
        decode = loop_decoder(target, drafter, max_new_tokens=max_new_tokens, decode=d, **options)
        runs.append(Run(f"candidate {i}", "ours", decode, batch_size=batch_size))
    measure(runs, prompts, target)
    return [
        Trial(d, run.seconds, run.stats, run.outputs)
        for d, run in zip([None, *decodes], runs, strict=True)
    ]


def search_decode(
    target,
    drafter,
    prompts: Sequence[torch.Tensor],
    space: Mapping[str, Sequence],
    *,
    max_new_tokens: int,
    start: DecodeConfig | None = None,
    require_equal: bool = True,
    passes: int = 2,
    log: Callable[[str], None] | None = None,
    **options,
) -> tuple[DecodeConfig, list[dict]]:
    """The drafter's decoding settings after a search over `space` (setting -> values, searched
    in `tunable`'s order, starting from `start`: the settings it is served with now,
    reading.load_decoding's; None: the kind's defaults), and one row per candidate measured:
    {"pass", "round": key, key: value, "tokens_per_s", "speedup" (vs plain decoding in the same
    round), "tau", "matches_plain" (None when sampling), "kept"}.

    Settings interact (LayerSkip's best depth depends on its exit layer: a shallow exit drafts
    cheaply and wrongly, so it wants short chains), and one pass tunes each setting only at the
    values the earlier rounds left. So the search passes over the settings again, `passes` times
    at most, racing a setting again only where another one changed since its last round.

    `start`'s batch_schedule plays no part in the races (its entries would override what they
    race) and is kept on the result as it was: `tune_batch_schedule` tunes one.
    """
    if passes < 1:
        raise ValueError(f"passes must be at least 1; got {passes}")
    greedy = options.get("temperature", 0.0) == 0
    # a placeholder for the drafter's own choice (LayerSkip's exit 0) named, so it races once
    schedule = start.batch_schedule if start is not None else []
    best = drafter.resolved_decode(drafter.decode_settings(start)).replace(batch_schedule=[])
    rows: list[dict] = []
    defaults = drafter.decode_settings()
    others = lambda d, key: d.replace(**{key: getattr(defaults, key)})  # noqa: E731
    # per setting, the other settings as its last round left them (a round's winner may have
    # reset some, `_fit`): it races again only once another round has moved one of them
    raced_with: dict[str, DecodeConfig] = {}
    order = tunable(drafter.decode_class)
    rounds = [(p, key) for p in range(1, passes + 1) for key in order if key in space]
    for number, key in rounds:
        if raced_with.get(key) == others(best, key) or (key == "tree_budget" and best.chain):
            continue
        candidates = [best]
        for value in space[key]:
            for variant in _variants(best, key, value, space):
                _add_new(candidates, _fit(drafter, variant, key, best))
        if len(candidates) == 1:
            raced_with[key] = others(best, key)
            continue
        trials = race(
            target, drafter, prompts, candidates, max_new_tokens=max_new_tokens, **options
        )
        plain, measured = trials[0], trials[1:]
        round_rows = []
        for trial in measured:
            copies = {"lookup_gamma": trial.decode.lookup_gamma} if key == "lookup_ngram" else {}
            round_rows.append({
                "pass": number, "round": key, key: getattr(trial.decode, key), **copies,
                **_figures(trial, plain, greedy), "kept": False,
            })  # fmt: skip
        eligible = [
            (t, r)
            for t, r in zip(measured, round_rows, strict=True)
            if r["matches_plain"] is not False or not require_equal
        ]
        if eligible:
            winner, row = max(eligible, key=lambda tr: tr[0].tokens_per_s)
            best, row["kept"] = winner.decode, True
        raced_with[key] = others(best, key)
        rows.extend(round_rows)
        if log is not None:
            said = [
                f"{r[key]}" + (f" (copies of {r['lookup_gamma']})" if r.get("lookup_gamma") else "")
                for r in round_rows
            ]
            again = f"pass {number}, " if number > 1 else ""
            log(f"{again}{key}: {_said_race(said, round_rows)} -> {getattr(best, key)}")
    return best.replace(batch_schedule=schedule), rows


def _figures(trial: Trial, plain: Trial, greedy: bool | None = None) -> dict:
    """A trial's tokens/s, speedup and tau (1 for plain decoding itself) in a race beside plain
    decoding's; given `greedy`, also whether its output is plain decoding's (None when
    sampling)."""
    figures = {
        "tokens_per_s": trial.tokens_per_s,
        "speedup": trial.tokens_per_s / plain.tokens_per_s,
        "tau": trial.stats.tau if trial.decode is not None else 1.0,
    }
    if greedy is not None:
        figures["matches_plain"] = trial.outputs == plain.outputs if greedy else None
    return figures


def _said_race(names: Sequence[str], rows: Sequence[dict]) -> str:
    """A race's rows in a log line, each after its name: tokens/s, speedup, a differing output."""
    return ", ".join(
        f"{name} {r['tokens_per_s']:.1f} tok/s ({r['speedup']:.2f}x"
        + (", differs from plain)" if r["matches_plain"] is False else ")")
        for name, r in zip(names, rows, strict=True)
    )


def _add_new(candidates: list[DecodeConfig], decode: DecodeConfig | None) -> None:
    """Append `decode` to the candidates unless it is None or decodes as one of them does."""
    if decode is not None and _behaviour(decode) not in map(_behaviour, candidates):
        candidates.append(decode)


def _variants(best: DecodeConfig, key: str, value, space: Mapping[str, Sequence]):
    """The candidates a round tries for `value` of `key`: best with it, and where the value turns
    copying on while the copies' length is also searched, one per length: copying that only
    pays in long copies must not be dropped for losing in copies of gamma."""
    if key == "lookup_ngram" and value and not best.lookup_ngram and space.get("lookup_gamma"):
        return [best.replace(lookup_ngram=value, lookup_gamma=g) for g in space["lookup_gamma"]]
    return [best.replace(**{key: value})]


def _behaviour(decode: DecodeConfig) -> DecodeConfig:
    """`decode` with copies' length spelled out (0 means gamma): two settings that decode alike
    are raced once."""
    return decode.replace(lookup_gamma=decode.lookup_gamma or decode.gamma)


def _fit(drafter, decode: DecodeConfig, key: str, best: DecodeConfig) -> DecodeConfig | None:
    """`decode` (best with one setting, `key`, changed) made consistent: the other settings the
    change leaves meaningless back at their defaults (a tree drops stop_below, which ends
    chains). None when the drafter still cannot honour something in it. What best already
    could not honour is allowed; only what the change adds must go."""
    allowed = set(drafter.ignored_settings(best))
    new = lambda d: set(drafter.ignored_settings(d)) - allowed  # noqa: E731
    defaults = drafter.decode_settings()
    for f in dataclasses.fields(defaults):
        if not new(decode):
            break
        reset = decode.replace(**{f.name: getattr(defaults, f.name)})
        if f.name != key and len(new(reset)) < len(new(decode)):
            decode = reset
    return None if new(decode) else decode


def hardware(device: torch.device) -> str:
    """A short name of the machine a measurement ran on (CPU model and threads, or the GPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return f"{name}, {torch.get_num_threads()} thread(s)"


def changed(before: DecodeConfig, after: DecodeConfig) -> dict:
    """The settings `after` changes, {key: (old, new)}."""
    old, new = dataclasses.asdict(before), dataclasses.asdict(after)
    return {k: (old[k], new[k]) for k in old if old[k] != new[k]}


@dataclass
class Tuned:
    """What `tune_against_saved` chose: the settings, each round's rows, and `measured` (the
    machine, dtype and figures of the final race, saved beside the settings as
    decode_measured)."""

    decode: DecodeConfig
    rows: list[dict]
    measured: dict
    kept_saved: bool


class NoExactSetting(ValueError):
    """At temperature 0, no setting raced gave plain decoding's greedy output."""


def tune_against_saved(
    target,
    drafter,
    prompts: Sequence[torch.Tensor],
    space: Mapping[str, Sequence],
    *,
    saved: DecodeConfig,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    passes: int = 2,
    require_equal: bool = True,
    log: Callable[[str], None] | None = None,
    source: str = "",
) -> Tuned:
    """search_decode from the `saved` settings, then the saved settings against its pick once
    more in one race: the pick replaces them only if it wins that race too (a pick that only
    won a noisy round is not kept). Raises NoExactSetting when, greedy and `require_equal`, no
    candidate decoded as plain decoding does (near ties flip under low precision). `source`
    names the prompts in the record. `saved`'s batch_schedule plays no part: the settings are
    raced at batch size 1 without it (`tune_batch_schedule` tunes one)."""
    saved = saved.replace(batch_schedule=[])
    sampling = {"temperature": temperature, "seed": seed}
    best, rows = search_decode(
        target, drafter, prompts, space, max_new_tokens=max_new_tokens, start=saved,
        require_equal=require_equal, passes=passes, log=log, **sampling,
    )  # fmt: skip
    if temperature == 0 and require_equal and rows and not any(r["kept"] for r in rows):
        raise NoExactSetting(
            f"no setting gave plain decoding's greedy output in {dtype_name(target.dtype)} "
            "(near ties between tokens flip under low precision)"
        )
    plain, before, after = race(
        target, drafter, prompts, [saved, best], max_new_tokens=max_new_tokens, **sampling
    )
    kept_saved = before.tokens_per_s >= after.tokens_per_s and best != saved
    if kept_saved:  # the search's pick lost the final race: noise, or a drifting machine
        best, after = saved, before
    measured = {
        "hardware": hardware(target.device),
        "dtype": dtype_name(target.dtype),
        "temperature": temperature,
        "prompts": f"{source} x {len(prompts)}, {max_new_tokens} new tokens".lstrip(),
        "tokens_per_s": after.tokens_per_s,
        "plain_tokens_per_s": plain.tokens_per_s,
        **_figures(after, plain),
        "kept_saved": kept_saved,
        "before": {"decode": dataclasses.asdict(saved), **_figures(before, plain)},
    }
    return Tuned(best, rows, measured, kept_saved)


# --- by batch size --------------------------------------------------------------------------


# The fewest batches a batch race times per candidate: a race at 16 rows of 16 prompts would
# otherwise time one batch each, and one timing on a shared machine decided 16 rows wrongly
# (BENCHMARKS.md, "Tuning").
MIN_BATCHES = 4
# How much faster than plain decoding a candidate must be in its batch race to get an entry: a
# smaller gain is within one race's noise (at 16 rows on the demo target a 2% win in the race
# measured 4% below plain decoding in a longer run), and drafting there costs memory for none.
MIN_GAIN = 0.03


def filled(
    prompts: Sequence[torch.Tensor], batch_size: int, min_batches: int = MIN_BATCHES
) -> list[torch.Tensor]:
    """`prompts` ((1, L) each) as whole batches of `batch_size`: every prompt once, in at least
    `min_batches` batches, prompts reused in turn to fill them, so each batch size decodes about
    the same prompts and is timed more than once."""
    batches = max(-(-len(prompts) // batch_size), min_batches)  # ceil, or the fewest timed
    return [prompts[i % len(prompts)] for i in range(batches * batch_size)]


@dataclass
class Schedule:
    """What `tune_batch_schedule` chose: `decode` (the settings with the batch_schedule), one row
    per candidate raced at each batch size, and per batch size the winner's figures (saved
    beside the settings in decode_measured)."""

    decode: DecodeConfig
    rows: list[dict]
    measured: list[dict]


def tune_batch_schedule(
    target,
    drafter,
    prompts: Sequence[torch.Tensor],
    space: Mapping[str, Sequence],
    *,
    base: DecodeConfig,
    batch_sizes: Sequence[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    require_equal: bool = True,
    min_gain: float = MIN_GAIN,
    log: Callable[[str], None] | None = None,
) -> Schedule:
    """`base` with a batch_schedule: an entry per batch size in `batch_sizes` holding what won
    the race there. Each race decodes batches of the prompts (`filled`) with plain decoding and
    with `base` at every gamma of space["gamma"] (and, for a tree, every tree_budget of
    space["tree_budget"]), above batch size 1 each also drafting row by row
    (batch_drafting=rows); the fastest wins if it beats plain decoding by more than `min_gain`
    (a fraction), else plain decoding does (the entry is then off).
    Greedy and `require_equal`, a candidate whose output differs from plain decoding's cannot
    win. Rows: {"batch_size", "settings" ("off", or what the entry changes from base),
    "tokens_per_s", "speedup" (vs plain decoding in the same race), "tau", "matches_plain"
    (None when sampling), "chosen"}."""
    sizes = list(batch_sizes)
    if not sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes):
        raise ValueError(f"batch sizes must be integers >= 1; got {sizes}")
    if sizes != sorted(set(sizes)):
        raise ValueError(f"batch sizes must increase, each given once; got {sizes}")
    base = drafter.resolved_decode(drafter.decode_settings(base)).replace(batch_schedule=[])
    greedy = temperature == 0
    candidates = _schedule_candidates(drafter, base, space)
    entries, rows, measured = [], [], []
    for size in sizes:
        raced_here = candidates if size == 1 else _with_row_drafting(drafter, candidates)
        trials = race(
            target, drafter, filled(prompts, size), raced_here, max_new_tokens=max_new_tokens,
            batch_size=size, temperature=temperature, seed=seed,
        )  # fmt: skip
        plain = trials[0]
        raced = []
        for trial in trials:
            settings = "off" if trial.decode is None else _changes(base, trial.decode)
            figures = _figures(trial, plain, greedy)
            raced.append({"batch_size": size, "settings": settings, **figures, "chosen": False})
        # plain decoding always may win: it is what the entry falls back to, and it keeps the
        # entry unless a candidate beats it by more than min_gain
        eligible = [
            r
            for r in raced
            if r["settings"] == "off"
            or (
                (r["matches_plain"] is not False or not require_equal)
                and r["speedup"] > 1 + min_gain
            )
        ]
        winner = max(eligible, key=lambda r: r["tokens_per_s"])
        winner["chosen"] = True
        off = winner["settings"] == "off"
        entries.append({"batch_size": size, **({"off": True} if off else winner["settings"])})
        with_plain = winner | {"plain_tokens_per_s": plain.tokens_per_s}
        shown = ("batch_size", "settings", "tokens_per_s", "plain_tokens_per_s", "speedup", "tau")
        measured.append({k: with_plain[k] for k in shown})
        rows.extend(raced)
        if log is not None:
            said = [_said(r["settings"]) for r in raced]
            log(f"batch size {size}: {_said_race(said, raced)} -> {_said(winner['settings'])}")
    return Schedule(base.replace(batch_schedule=entries), rows, measured)


def _schedule_candidates(drafter, base: DecodeConfig, space: Mapping[str, Sequence]) -> list:
    """`base` and, where the drafter can honour them (`_fit`), base at every gamma of the space
    and, for a tree, at every pair of gamma and tree_budget; each way of decoding once."""
    candidates = [base]
    budgets = space.get("tree_budget", []) if not base.chain else []
    for gamma in space.get("gamma", []):
        deep = _fit(drafter, base.replace(gamma=gamma), "gamma", base)
        if deep is None:
            continue
        _add_new(candidates, deep)
        for budget in budgets:
            wide = deep.replace(tree_budget=budget)
            _add_new(candidates, _fit(drafter, wide, "tree_budget", deep))
    return candidates


def _with_row_drafting(drafter, candidates: list) -> list:
    """The candidates, and each the kind drafts a batch of together also drafting row by row
    (batch_drafting=rows): whether one pass for the batch beats one pass per row
    (drafters/lean.py's fused and int8 paths among them) depends on the batch size and the
    machine, so a batch race races both."""
    rows = [
        c.replace(batch_drafting="rows")
        for c in candidates
        if c.batch_drafting != "rows" and drafter.drafts_batches_together(c)
    ]
    return [*candidates, *rows]


def _changes(base: DecodeConfig, decode: DecodeConfig) -> dict:
    """The settings `decode` changes from `base`, {key: new value}: a schedule entry's."""
    return {k: new for k, (_, new) in changed(base, decode).items()}


def _said(settings: dict | str) -> str:
    """A schedule entry's settings in a log line."""
    if settings == "off":
        return "off"
    return ", ".join(f"{k}={v}" for k, v in settings.items()) or "these settings"


def summary(saved: DecodeConfig, best: DecodeConfig, tuned: Tuned, retuned: bool) -> list[str]:
    """What a tuning chose, in lines for a person: the saved settings' and the result's speed in
    the final race, what changed, each batch schedule entry, and whether the schedule saved
    before still applies (`retuned`: the schedule was raced again)."""
    measured, before = tuned.measured, tuned.measured["before"]
    diff = changed(saved, best)
    diff.pop("batch_schedule", None)  # said entry by entry below
    lines = []
    if tuned.kept_saved:
        lines.append("the saved settings were as fast as the search's pick in the final race: kept")
    lines.append(
        f"saved settings: {before['tokens_per_s']:.1f} tok/s ({before['speedup']:.2f}x plain, "
        f"tau {before['tau']:.2f}); tuned: {measured['tokens_per_s']:.1f} tok/s "
        f"({measured['speedup']:.2f}x, tau {measured['tau']:.2f}); plain decoding "
        f"{measured['plain_tokens_per_s']:.1f} tok/s; on {measured['hardware']}, "
        f"{measured['dtype']}"
    )
    lines.append(
        "changes: " + (", ".join(f"{k} {old} -> {new}" for k, (old, new) in diff.items()) or "none")
    )
    for row in measured.get("batch_schedule", []):
        entry = "off (plain decoding)" if row["settings"] == "off" else _said(row["settings"])
        lines.append(
            f"batch size {row['batch_size']}: {entry}, {row['tokens_per_s']:.1f} tok/s "
            f"({row['speedup']:.2f}x plain)"
        )
    if best.batch_schedule and not retuned:
        lines.append(
            "the saved batch_schedule is kept as it was, and its entries still change these "
            "settings at their batch sizes: --batch-sizes tunes it again"
        )
    return lines
