"""What DSpark's two heads buy, by training's simulation of greedy serving (fp32, the drafter
alone): the simulated τ of a trained DSpark folder at several chain lengths, with its Markov
head as trained and with its bias switched off (W2 zeroed), and with the confidence head's stop.

    python benchmarks/bench_dspark_heads.py runs/dspark-demo/final --prompts mt-bench \
        --num-prompts 16 --max-new-tokens 64

The simulation walks the target's own greedy continuations of the prompts (cached), as
`scripts/parity.py` does; at T = 0 it gives the loop's τ exactly (tests/simulation/test_parity.py).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from specdraft.formats.reading import load_decoding, load_drafter
from specdraft.measuring.measure import load_prompts
from specdraft.simulation.serving_parity import simulated_tau_on
from specdraft.targets.target import load_target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="a trained DSpark folder (RUN/final)")
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--prompts", default="mt-bench")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gammas", default="8,4,2")
    parser.add_argument("--stops", default="0.3,0.1")
    args = parser.parse_args(argv)
    target = load_target(args.target)
    prompts = load_prompts(args.prompts, args.num_prompts, target)
    drafter = load_drafter(args.folder, target).eval()
    if drafter.kind != "dspark":
        parser.error(f"{args.folder} holds a {drafter.kind} drafter, not a DSpark one")
    base = dataclasses.replace(load_decoding(args.folder), lookup_ngram=0, stop_below=0.0)
    gammas = [int(g) for g in args.gammas.split(",")]

    def tau(**changes) -> float:
        decode = dataclasses.replace(base, **changes)
        return simulated_tau_on(target, drafter, prompts, args.max_new_tokens, decode)

    for gamma in gammas:
        print(f"gamma {gamma}: tau {tau(gamma=gamma):.3f}", flush=True)
    for stop in (float(s) for s in args.stops.split(",") if s):
        print(f"gamma {gammas[0]}, stop_below {stop}: tau {tau(gamma=gammas[0], stop_below=stop):.3f}")  # fmt: skip
    with torch.no_grad():
        drafter.markov_head.markov_w2.weight.zero_()
    for gamma in gammas:
        print(f"gamma {gamma}, the Markov head off: tau {tau(gamma=gamma):.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
