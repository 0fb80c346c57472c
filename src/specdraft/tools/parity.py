"""Does training predict serving? A trained drafter's simulated and served tau side by side.

    python scripts/parity.py runs/eagle-demo/final
    python scripts/parity.py runs/medusa-demo/final --prompts demo --num-prompts 8 \\
        --max-new-tokens 128 --tolerance 0.02
    python scripts/parity.py runs/eagle-demo/final:stop_below=0 --temperature 1 --num-prompts 20

On the target's own greedy continuations of the prompts (simulation/continuations.py, cached),
the drafter's training path simulates the loop (`served.served_drafts`, walked by
metrics.simulate_serving) and the loop decodes the same prompts; at temperature 0 the two agree
exactly when the drafter computes the same thing in both paths. Prints tau and the acceptance
per position of each. Where any step differs, it compares, on the first prompt that does, what
the drafter was given in each path at the same positions (the target layers captured, their
hidden states, then its drafts) and names the first that differs. Parity: tau within
--tolerance (relative; default 1%, since fp32 rounds one forward over a continuation and the
loop's verification forwards differently, which drafting in int8 can turn into another draft).
Exits 1 when tau differs by more, 0 in parity.

At --temperature 1 the loop's outcome is random: for each of --seeds sampling seeds it prints
the tau expected on the continuation sampled with that seed (the walk in expectation over each
draft's chance of acceptance given the tokens emitted, serving_parity.sampled_tau_on) and the tau
served alone (copying off) with that seed, and exits 1 where their means are further apart
than --tolerance (default 10%); 2 where the kind has no such walk for the settings.
FOLDER:KEY=VALUE,... overrides the saved decoding settings, as scripts/evaluate.py reads them.
"""

from __future__ import annotations

import argparse
import sys

from specdraft.config import override
from specdraft.formats.reading import folder_target, load_decoding, load_drafter
from specdraft.measuring.evaluation import split_drafter_spec
from specdraft.measuring.measure import choose_threads, load_prompts
from specdraft.simulation.continuations import served_examples
from specdraft.simulation.serving_parity import (
    first_difference,
    merged,
    sampled_tau_on,
    serve,
    served_sampled_tau,
    simulate,
)
from specdraft.tools.arguments import add_prompts_arguments, add_threads_argument, new_parser


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    folder, items = split_drafter_spec(args.folder)
    try:
        decode = override(load_decoding(folder), items, source=args.folder)  # before any load
        target = folder_target(folder, args.target)
        drafter = load_drafter(folder, target).eval()
        choose_threads(args.threads, target, log=lambda m: print(f"[parity] {m}", file=sys.stderr))
        decode = drafter.decode_settings(decode, gamma=args.gamma)
        prompts = load_prompts(args.prompts, args.num_prompts, target)
    except ValueError as e:  # a bad folder, setting or prompt file
        print(f"scripts/parity.py: error: {e}", file=sys.stderr)
        return 2
    if args.temperature:
        return sampled(args, target, drafter, decode, prompts)
    examples = served_examples(target, prompts, args.max_new_tokens, seed=0)
    simulated = simulate(target, drafter, examples, decode)
    if simulated is None:
        print(f"{args.folder}: this {drafter.kind} drafter has no simulation for {decode}")
        return 2
    served = serve(target, drafter, examples, decode)
    sim, real = merged(simulated), merged(served)
    print(f"{args.folder} ({drafter.kind}, gamma {decode.gamma}), {len(examples)} prompts x "
          f"{args.max_new_tokens} tokens of the target's greedy continuation")  # fmt: skip
    print(f"  tau         simulated {sim.tau:.4f}   served {real.tau:.4f}")
    print("  depth  simulated  served")
    for i, (a, b) in enumerate(
        zip(sim.acceptance_per_position, real.acceptance_per_position, strict=False)
    ):
        print(f"  {i + 1:5d}  {a:9.4f}  {b:6.4f}")
    gap = abs(sim.tau / real.tau - 1)
    exact = [
        a.emitted_per_pass == b.emitted_per_pass for a, b in zip(simulated, served, strict=True)
    ]
    if all(exact):
        print("  in parity: every step alike")
        return 0
    prompt = exact.index(False)  # the first prompt whose steps differ
    where = first_difference(target, drafter, examples[prompt], decode)
    where = where or "the inputs and drafts agree (numerics)"
    tolerance = 0.01 if args.tolerance is None else args.tolerance
    within = gap <= tolerance
    if within:
        print(f"  in parity within {tolerance:.0%}: tau differs by {gap:.2%}")
    else:
        print(f"  NOT in parity: tau differs by {gap:.2%}, over {tolerance:.0%}")
    print(f"  prompt {prompt}: {where}")
    return 0 if within else 1


def sampled(args, target, drafter, decode, prompts) -> int:
    """--temperature 1: the expected tau beside the tau served alone, seed by seed."""
    decode = decode.replace(lookup_ngram=0, lookup_gamma=0)  # the estimate has no copying
    tolerance = 0.10 if args.tolerance is None else args.tolerance
    n = args.max_new_tokens
    seeds = range(args.seeds)
    first = sampled_tau_on(target, drafter, prompts, n, decode, 0)
    if first is None:
        print(f"{args.folder}: {drafter.kind} has no walk at temperature 1 for these settings "
              "(EAGLE-2's dynamic tree, the two-model tree, a dynamic gamma, Medusa's typical "
              "acceptance): FOLDER:tree_top_k=1 walks a tree's chain, "
              "FOLDER:acceptance=exact Medusa's lossless sampling")  # fmt: skip
        return 2
    expected = [first] + [sampled_tau_on(target, drafter, prompts, n, decode, s) for s in seeds[1:]]
    served = [served_sampled_tau(target, drafter, prompts, n, decode, seed) for seed in seeds]
    mean, served_mean = sum(expected) / len(expected), sum(served) / len(served)
    gap = mean / served_mean - 1
    print(f"{args.folder} ({drafter.kind}, gamma {decode.gamma}, alone), {len(prompts)} prompts "
          f"x {n} tokens at temperature 1, seeds 0-{args.seeds - 1}")  # fmt: skip
    print(f"  tau  expected {', '.join(f'{t:.4f}' for t in expected)} (mean {mean:.4f})")
    print(f"       served   {', '.join(f'{t:.4f}' for t in served)} (mean {served_mean:.4f})")
    within = abs(gap) <= tolerance
    print(f"  {'within' if within else 'NOT within'} {tolerance:.0%}: expected {gap:+.2%}")
    return 0 if within else 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = new_parser(__doc__.split("\n\n")[0], prog="scripts/parity.py")
    p.add_argument(
        "folder", help="a trained drafter folder, FOLDER[:KEY=VALUE,...] (runs/eagle-demo/final)"
    )
    p.add_argument("--target", default=None, help="the target; default: the folder's own")
    add_prompts_arguments(p, "mt-bench", 8, first_turns=True)
    add_threads_argument(p)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--gamma", type=int, default=None, help="default: the folder's decoding")
    p.add_argument(
        "--tolerance", type=float, default=None,
        help="relative tau gap called parity (default 1%%: the two paths round differently; "
        "10%% at --temperature 1)",
    )  # fmt: skip
    p.add_argument("--temperature", type=float, default=0.0, help="0 (exact) or 1 (an estimate)")
    p.add_argument("--seeds", type=int, default=3, help="at --temperature 1: sampling seeds")
    args = p.parse_args(argv)
    if args.temperature not in (0.0, 1.0):
        p.error(f"--temperature must be 0 or 1, got {args.temperature:g}")
    if args.seeds < 1 or args.num_prompts < 1 or args.max_new_tokens < 1:
        p.error("--seeds, --num-prompts and --max-new-tokens must be >= 1")
    return args


if __name__ == "__main__":
    sys.exit(main())
