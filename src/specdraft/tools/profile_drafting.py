"""Where drafting time goes: each drafter's proposals timed and profiled in our loop.

    python scripts/profile_drafting.py runs/compare/eagle/final:lookup_ngram=0 \\
        runs/compare/peagle/final:lookup_ngram=0 runs/compare/dflash/final:lookup_ngram=0

Each FOLDER[:KEY=VALUE,...] is a trained drafter with decoding settings over its saved ones, as
`scripts/evaluate.py --drafter` takes it; all decode with the first folder's target (--target
overrides it; Medusa-2 and LayerSkip decode with their own fine-tuned one). Every drafter
decodes the same prompts greedily in this one process, after a warm-up. A proposal is one call of the drafting session's `propose`: a chain of gamma head
passes for EAGLE, one forward for P-EAGLE's block of K or DFlash's block. Copying
(`lookup_ngram`) drafts without a proposal: turn it off (`lookup_ngram=0`) to time the drafter
alone.

Printed per drafter: proposals, tokens drafted per proposal, milliseconds per proposal and per
drafted token (timed without the profiler, on every prompt), the proposal's cost in one-token
steps of plain decoding of the same target (timed on the same prompts), and the operations that
took the most of the proposals' time under torch.profiler (self CPU time, within `propose`
only, on the first --profile-prompts prompts), so that a drafter's cost can be read as the
operations it is made of. --output writes it all as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from specdraft.config import override
from specdraft.formats.reading import (
    fine_tuned_target,
    folder_target,
    load_decoding,
    load_drafter,
)
from specdraft.inference.generate import generate
from specdraft.measuring.evaluation import split_drafter_spec
from specdraft.measuring.measure import choose_threads, load_prompts
from specdraft.tools.arguments import add_prompts_arguments, add_threads_argument, new_parser

PROPOSE = "specdraft.propose"  # the profiler's label around each proposal


class _Timed:
    """A drafting session whose proposals are timed (and labelled for the profiler)."""

    def __init__(self, session, record: dict) -> None:
        self._session, self._record = session, record

    def __getattr__(self, name):
        return getattr(self._session, name)

    def propose(self, context):
        with record_function(PROPOSE):
            start = time.perf_counter()
            tree = self._session.propose(context)
            self._record["seconds"] += time.perf_counter() - start
        self._record["proposals"] += 1
        self._record["drafted"] += len(tree)
        return tree


def new_record() -> dict:
    return {"seconds": 0.0, "proposals": 0, "drafted": 0}


def decode_all(target, drafter, prompts, decode, max_new_tokens: int, record: dict) -> None:
    """Decode every prompt greedily, the drafter's sessions timed into `record`."""
    make = drafter.new_session

    def timed(*args, **kwargs):
        return _Timed(make(*args, **kwargs), record)

    drafter.new_session = timed  # an instance attribute, removed below
    try:
        for prompt in prompts:
            generate(target, prompt, drafter, max_new_tokens=max_new_tokens, decode=decode)
    finally:
        del drafter.new_session


def plain_step_ms(target, prompts, max_new_tokens: int) -> float:
    """Milliseconds per token of plain greedy decoding of these prompts (one target step)."""
    generate(target, prompts[0], None, max_new_tokens=8)  # warm-up
    start, tokens = time.perf_counter(), 0
    for prompt in prompts:
        out = generate(target, prompt, None, max_new_tokens=max_new_tokens)
        tokens += out.stats.new_tokens
    return 1000 * (time.perf_counter() - start) / max(tokens, 1)


def top_operations(prof, top: int) -> list[dict]:
    """The operations with the most self CPU time inside the proposals, largest first, each
    with its share of the proposals' whole time (the operations' and the Python between
    them)."""
    self_us: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.name == PROPOSE:  # its own time: Python between the operations
            self_us["(Python between operations)"] += event.self_cpu_time_total
            continue
        parent = event.cpu_parent
        while parent is not None and parent.name != PROPOSE:
            parent = parent.cpu_parent
        if parent is not None:
            self_us[event.name] += event.self_cpu_time_total
    total = sum(self_us.values()) or 1.0
    ranked = sorted(self_us.items(), key=lambda kv: -kv[1])[:top]
    return [{"op": name, "share": us / total, "ms": us / 1000} for name, us in ranked]


def profile_one(spec: str, target, prompts, args, loaded: dict) -> dict:
    path, items = split_drafter_spec(spec)
    target = fine_tuned_target(path, target, loaded) or target  # Medusa-2, LayerSkip: their own
    drafter = load_drafter(path, target).eval()
    decode = override(load_decoding(path), items, source=spec)
    decode_all(target, drafter, prompts[:1], decode, 16, new_record())  # warm-up
    record = new_record()
    decode_all(target, drafter, prompts, decode, args.max_new_tokens, record)
    # a second pass, on fewer prompts: the profiler has its own overhead, and keeps every event
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        profiled = prompts[: args.profile_prompts]
        decode_all(target, drafter, profiled, decode, args.max_new_tokens, new_record())
    n = max(record["proposals"], 1)
    return {
        "drafter": spec,
        "kind": drafter.kind,
        "gamma": decode.gamma,
        "proposals": record["proposals"],
        "drafted_per_proposal": record["drafted"] / n,
        "ms_per_proposal": 1000 * record["seconds"] / n,
        "ms_per_drafted_token": 1000 * record["seconds"] / max(record["drafted"], 1),
        "top_operations": top_operations(prof, args.top),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    try:
        target = folder_target(split_drafter_spec(args.drafters[0])[0], args.target)
        choose_threads(args.threads, target, log=lambda m: print(f"[profile] {m}", file=sys.stderr))
        prompts = load_prompts(args.prompts, args.num_prompts, target)
        for spec in args.drafters:  # every folder and setting checked before any is timed
            path, items = split_drafter_spec(spec)
            override(load_decoding(path), items, source=spec)
        loaded: dict = {}
        rows = [profile_one(spec, target, prompts, args, loaded) for spec in args.drafters]
    except ValueError as e:  # a bad folder, setting or prompt source
        print(f"scripts/profile_drafting.py: error: {e}", file=sys.stderr)
        return 2
    step = plain_step_ms(target, prompts, args.max_new_tokens)
    print(f"plain decoding: {step:.2f} ms a token (one target step); {len(prompts)} prompts x "
          f"{args.max_new_tokens} new tokens, greedy")  # fmt: skip
    for row in rows:
        row["proposal_in_target_steps"] = row["ms_per_proposal"] / step
        print(
            f"\n{row['drafter']} ({row['kind']}, gamma {row['gamma']}): {row['proposals']} "
            f"proposals, {row['drafted_per_proposal']:.2f} tokens each; "
            f"{row['ms_per_proposal']:.2f} ms a proposal "
            f"({row['proposal_in_target_steps']:.2f} target steps), "
            f"{row['ms_per_drafted_token']:.2f} ms a drafted token"
        )
        for op in row["top_operations"]:
            print(f"  {op['share']:6.1%}  {op['ms']:9.1f} ms  {op['op']}")
    if args.output:
        out = {"plain_ms_per_token": step, "drafters": rows}
        Path(args.output).write_text(json.dumps(out, indent=2) + "\n")
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = new_parser(__doc__.split("\n\n")[0], prog="scripts/profile_drafting.py")
    p.add_argument(
        "drafters", nargs="+", metavar="FOLDER[:KEY=VALUE,...]",
        help="trained drafters, each with decoding settings over its saved ones",
    )  # fmt: skip
    p.add_argument("--target", default=None, help="default: the first folder's own target")
    add_prompts_arguments(p, "mt-bench", 4, first_turns=True)
    add_threads_argument(p)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--top", type=int, default=8, help="operations listed per drafter")
    p.add_argument(
        "--profile-prompts", type=int, default=2,
        help="prompts decoded again under the profiler (it keeps every event: gigabytes)",
    )  # fmt: skip
    p.add_argument("--output", default=None, help="write the figures to this JSON file")
    args = p.parse_args(argv)
    if min(args.num_prompts, args.max_new_tokens, args.top, args.profile_prompts) < 1:
        p.error("--num-prompts, --max-new-tokens, --top and --profile-prompts must be >= 1")
    if args.output and not Path(args.output).resolve().parent.is_dir():
        p.error(f"--output {args.output}: its folder does not exist; create it first")
    return args


if __name__ == "__main__":
    sys.exit(main())
