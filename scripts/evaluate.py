"""Measure drafters in specdraft's loop beside plain decoding and transformers' own methods.

    python scripts/evaluate.py --target demo --drafter runs/distill-demo/final \\
        --baselines ar,hf_ar,prompt_lookup,hf_assisted,hf_prompt_lookup \\
        --prompts demo --num-prompts 20 --max-new-tokens 128 --temperature 0 --gamma 5 \\
        --output eval/demo

Every method decodes the same prompts in this one process, after a warm-up, and new tokens are
counted the same way for all (up to and including the first EOS). Speedups are ratios to our own
plain decoding (`ar`, always run). Writes DIR/report.json, DIR/report.md and PNG plots
(acceptance per position, tau distribution, speedup with its draft/verify split).

Methods: `ar` (our loop, no drafter), `hf_ar` (transformers' generate), `prompt_lookup` (our
loop), `hf_prompt_lookup` (transformers' prompt lookup), each --drafter in our loop, and
`hf_assisted` (transformers' generate(assistant_model=...) with a constant gamma) for each
two-model drafter.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from specdraft.drafters import load_drafter, load_target
from specdraft.inference.measure import Run, load_prompts, loop_decoder, measure, summarize
from specdraft.train.config import check_choices

BASELINES = ("ar", "hf_ar", "prompt_lookup", "hf_assisted", "hf_prompt_lookup")
# gamma for transformers' prompt lookup and assisted decoding when --gamma is not given: the
# loop's own default for two-model drafters and prompt lookup
HF_GAMMA = 5


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    target = load_target(args.target, dtype=args.dtype, device=args.device)
    try:
        prompts = load_prompts(args.prompts, args.num_prompts, target)
    except ValueError as e:
        raise SystemExit(f"--prompts: {e}") from None
    runs = build_runs(args, target)
    measure(runs, prompts, target, log=lambda m: print(f"[evaluate] {m}", file=sys.stderr))

    report = make_report(args, target, runs)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(markdown(report))
    plot(report, runs, out)
    if args.wandb:
        log_wandb(report, out, args.wandb)
    print(markdown(report))
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default="demo", help="demo, a model folder or a hub id")
    parser.add_argument(
        "--drafter",
        action="append",
        default=[],
        metavar="FOLDER[:KEY=VALUE,...]",
        help="a trained drafter (repeat; the same folder may come back with other settings): "
        "after a colon, decoding settings of its config (e.g. eagle's tree_top_k, tree_budget, "
        "draft_weights, stop_below, lookup_ngram) and the loop's gamma/topk, for this drafter only",
    )
    parser.add_argument("--baselines", default=",".join(BASELINES))
    parser.add_argument("--prompts", default="demo", help="demo, or a .txt/.json/.jsonl file")
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument(
        "--gamma",
        type=int,
        default=None,
        help="draft depth for every method (an EAGLE tree's depth); default: each drafter's own "
        f"(its trained config; {HF_GAMMA} for prompt lookup and two-model drafters)",
    )
    parser.add_argument(
        "--topk",
        type=int,
        default=None,
        help="tree width of trained drafters: top-k per expanded node for EAGLE, nodes per depth "
        "for two-model drafters; 1 drafts a chain; default: each drafter's own",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None, help="float32, bfloat16, ... (default: as saved)")
    parser.add_argument("--output", required=True, help="folder for report.json/.md and plots")
    parser.add_argument("--wandb", default=None, metavar="PROJECT", help="also log to W&B")
    args = parser.parse_args(argv)
    unknown = set(args.baselines.split(",")) - set(BASELINES) - {""}
    if unknown:
        parser.error(f"unknown baselines {sorted(unknown)}; choose from {','.join(BASELINES)}")
    if args.max_new_tokens < 1 or args.num_prompts < 1:
        parser.error("--max-new-tokens and --num-prompts must be >= 1")
    return args


def build_runs(args: argparse.Namespace, target) -> list[Run]:
    baselines = [b for b in args.baselines.split(",") if b]
    sample = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    eos = _eos(target)

    gamma = args.gamma if args.gamma is not None else HF_GAMMA

    def ours(drafter, gamma=args.gamma, **options):
        return loop_decoder(
            target, drafter, max_new_tokens=args.max_new_tokens, seed=args.seed,
            gamma=gamma, **sample, **options,
        )  # fmt: skip

    def hf(**options):
        hf_sample = dict(do_sample=args.temperature > 0)
        if args.temperature > 0:
            hf_sample.update(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)

        def decode(ids):
            torch.manual_seed(args.seed)  # transformers samples from the global generator
            out = target.model.generate(
                ids, max_new_tokens=args.max_new_tokens, **hf_sample, **options
            )
            return _until_eos(out[0, ids.shape[1] :].tolist(), eos), None

        return decode

    runs = [Run("ar", "ar", ours(None))]  # the reference for speedups, always run
    if "hf_ar" in baselines:
        runs.append(Run("hf_ar", "hf_ar", hf()))
    if "prompt_lookup" in baselines:
        runs.append(Run("prompt_lookup", "prompt_lookup", ours("prompt_lookup")))
    if "hf_prompt_lookup" in baselines:
        runs.append(Run("hf_prompt_lookup", "hf_prompt_lookup", hf(prompt_lookup_num_tokens=gamma)))
    for spec in args.drafter:
        path, overrides = split_drafter_spec(spec)
        drafter = load_drafter(path, target)
        loop = {"gamma": args.gamma, "topk": args.topk}
        # a depth or width this drafter's settings name replaces the global --gamma / --topk
        for key, loop_key in (("tree_depth", "gamma"), ("tree_top_k", "topk")):
            if key in overrides:
                loop[loop_key] = None
        loop.update(apply_overrides(drafter, overrides, spec))
        name = Path(path).name if Path(path).name not in ("final", "best") else str(path)
        if overrides:
            name += ":" + ",".join(f"{k}={v}" for k, v in overrides.items())
        params = drafter.num_extra_parameters(target)
        runs.append(Run(name, drafter.kind, ours(drafter, **loop), params))
        hf_model = getattr(drafter, "hf_model", None)
        if "hf_assisted" in baselines and hf_model is not None:
            # transformers reads gamma and its schedule from the assistant's own generation
            # config; a zero confidence threshold turns off its early stop, so gamma is constant
            hf_model.generation_config.num_assistant_tokens = gamma
            hf_model.generation_config.num_assistant_tokens_schedule = "constant"
            hf_model.generation_config.assistant_confidence_threshold = 0.0
            assisted = hf(assistant_model=hf_model)
            runs.append(Run(f"hf_assisted[{name}]", "hf_assisted", assisted, params))
    return runs


def split_drafter_spec(spec: str) -> tuple[str, dict[str, object]]:
    """ "FOLDER[:k=v,k=v]" -> (folder, {k: v}); values are read as int, float or text."""
    path, sep, tail = spec.rpartition(":")
    if not sep or "=" not in tail:
        return spec, {}
    overrides: dict[str, object] = {}
    for item in tail.split(","):
        key, eq, text = item.partition("=")
        if not eq or not key.strip():
            raise SystemExit(f"--drafter {spec}: {item!r} is not KEY=VALUE")
        overrides[key.strip()] = _value(text.strip())
    return path, overrides


def _value(text: str) -> object:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _typed(key: str, value: object, current: object, spec: str) -> object:
    """`value` as the type of the config's `current` value (an int also reads as a float)."""
    if isinstance(current, bool) or isinstance(value, bool):
        ok = isinstance(current, bool) and isinstance(value, bool)
    elif isinstance(current, float):
        ok = isinstance(value, (int, float))
        value = float(value) if ok else value
    else:  # int, str, or an optional field: the same type, or anything for None
        ok = current is None or isinstance(value, type(current))
    if not ok:
        raise SystemExit(
            f"--drafter {spec}: {key}={value!r} is not of type {type(current).__name__}, like the "
            f"config's {key}={current!r}"
        )
    return value


def apply_overrides(drafter, overrides: dict[str, object], spec: str) -> dict[str, object]:
    """Set the drafter's decoding settings named in `overrides` (its config's DECODING_KEYS,
    checked as its config checks them); return the loop's own keys (gamma, topk) among them."""
    loop = {k: overrides[k] for k in ("gamma", "topk") if k in overrides}
    for key, value in loop.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SystemExit(f"--drafter {spec}: {key}={value!r} must be an integer >= 1")
    rest = {k: v for k, v in overrides.items() if k not in loop}
    if rest:
        config = getattr(drafter, "config", None)
        keys = set(getattr(type(config), "DECODING_KEYS", ()))
        unknown = sorted(set(rest) - keys)
        if unknown:
            raise SystemExit(
                f"--drafter {spec}: {', '.join(unknown)}: not a decoding setting of this "
                f"{drafter.kind} drafter; choose from {', '.join(['gamma', 'topk', *sorted(keys)])}"
            )
        for key, value in rest.items():  # a value of the type the config holds
            rest[key] = _typed(key, value, getattr(config, key), spec)
        try:
            config = dataclasses.replace(drafter.config, **rest)
            check_choices(config, prefix="")  # as a config file's values are checked
        except (TypeError, ValueError) as e:
            raise SystemExit(f"--drafter {spec}: {e}") from None
        drafter.config = config
    return loop


def make_report(args, target, runs: list[Run]) -> dict:
    greedy = args.temperature == 0
    rows = [summarize(run, runs[0], target, greedy) for run in runs]
    settings = {
        k: getattr(args, k)
        for k in (
            "max_new_tokens",
            "temperature",
            "top_p",
            "top_k",
            "gamma",
            "topk",
            "seed",
            "prompts",
        )
    }
    settings.update(
        device=str(target.device),
        dtype=str(target.dtype).removeprefix("torch."),
        torch_threads=torch.get_num_threads(),
    )
    return {
        "target": {"name": target.name, **target.fingerprint},
        "settings": settings,
        "runs": rows,
    }


def markdown(report: dict) -> str:
    s = report["settings"]
    lines = [
        f"# Evaluation: {report['target']['name']}",
        "",
        f"{s['max_new_tokens']} new tokens, temperature {s['temperature']}, gamma "
        f"{s['gamma'] if s['gamma'] is not None else 'per drafter'}, "
        f"{s['device']} {s['dtype']}. Speedup: tokens/s over our plain decoding (`ar`), same "
        "process; overhead = tau / speedup - 1; copied = share of target passes whose draft "
        "was copied from the context (lookup_ngram) rather than drafted by the model.",
        "",
        "| run | tau | tokens/s | speedup | overhead | draft time | copied | extra params "
        "| matches ar |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    fmt = lambda v, f="{:.2f}": "-" if v is None else f.format(v)  # noqa: E731
    for r in report["runs"]:
        lines.append(
            f"| {r['name']} | {fmt(r['tau'])} | {r['tokens_per_s']:.1f} | "
            f"{r['speedup_vs_ar']:.2f}x | {fmt(r['overhead'])} | "
            f"{fmt(r['draft_time_frac'], '{:.0%}')} | {fmt(r.get('copied_share'), '{:.0%}')} | "
            f"{r['extra_params']:,} | "
            f"{fmt(r['matches_ar'], '{}')} |"
        )
    lines += ["", "Acceptance per position (alpha_i):", ""]
    for r in report["runs"]:
        if r["acceptance_per_position"]:
            alphas = ", ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
            lines.append(f"- {r['name']}: {alphas}")
    return "\n".join(lines) + "\n"


def plot(report: dict, runs: list[Run], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drafted = [
        (r, run)
        for r, run in zip(report["runs"], runs, strict=True)
        if r["acceptance_per_position"]
    ]
    fig, ax = plt.subplots(figsize=(6, 4))
    for r, _ in drafted:
        alphas = r["acceptance_per_position"]
        ax.plot(range(1, len(alphas) + 1), alphas, marker="o", label=r["name"])
    ax.set(
        xlabel="draft position i",
        ylabel="acceptance alpha_i",
        ylim=(0, 1.05),
        title="Acceptance per position",
    )
    if drafted:
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "acceptance_per_position.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for r, run in drafted:
        counts = run.stats.emitted_per_pass
        bins = torch.arange(0.5, max(counts) + 1.5).tolist()
        ax.hist(counts, bins=bins, alpha=0.5, label=f"{r['name']} (tau {r['tau']:.2f})")
    ax.set(xlabel="tokens emitted per target pass", ylabel="passes", title="tau distribution")
    if drafted:
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "tau_distribution.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    names = [r["name"] for r in report["runs"]]
    speed = [r["speedup_vs_ar"] for r in report["runs"]]
    draft = [s * (r["draft_time_frac"] or 0.0) for s, r in zip(speed, report["runs"], strict=True)]
    ax.bar(names, [s - d for s, d in zip(speed, draft, strict=True)], label="verify share")
    ax.bar(
        names, draft, bottom=[s - d for s, d in zip(speed, draft, strict=True)], label="draft share"
    )
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(ylabel="speedup vs our plain decoding", title="Speedup (bar split: draft / verify)")
    ax.tick_params(axis="x", rotation=30)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=120)
    plt.close(fig)


def log_wandb(report: dict, out: Path, project: str) -> None:
    import wandb

    run = wandb.init(project=project, config=report["settings"], job_type="evaluate")
    columns = ["name", "method", "tau", "tokens_per_s", "speedup_vs_ar", "overhead"]
    table = wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in report["runs"]])
    images = {p.stem: wandb.Image(str(p)) for p in out.glob("*.png")}
    run.log({"runs": table, **images})
    run.finish()


def _eos(target) -> set[int]:
    eos = target.model.generation_config.eos_token_id
    return set() if eos is None else set(eos if isinstance(eos, list) else [eos])


def _until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


if __name__ == "__main__":
    sys.exit(main())
