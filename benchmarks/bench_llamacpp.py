"""What our drafters buy in llama.cpp, the CPU user's serving engine: its tokens/s decoding plainly,
with its own n-gram speculation, and with each exported drafter at each draft length, on the same
prompts (MT-Bench by default, every turn; the second after llama.cpp's own plain answer to the
first), greedy.

    python benchmarks/bench_llamacpp.py --target smollm2-135m \\
        --export exports/eagle-demo-gguf --export exports/distill-gguf \\
        --lengths 1,2,3,4 --prompts mt-bench --num-prompts 8 --max-new-tokens 128 \\
        --output runs/llamacpp-smollm2

llama.cpp is built once per machine (specdraft/llamacpp_build.py); each method runs in its own
`llama-server` on --threads threads (default 2), the prompts sent one at a time with no prompt
cache. Tokens/s is llama.cpp's own decode time (`timings.predicted_ms`, the prompt's processing
apart), summed over every turn; speedups are ratios to plain decoding in the same run. Each
method's outputs are compared with plain decoding's: equal, parting at a near-tie (the two
tokens' logits within --tie-gap where they part, by default how far llama.cpp's own arithmetic
moves such a gap between a one-token and a many-token pass, measured here: see
scripts/verify_export.py --engine llama.cpp), or a disagreement, listed in report.json. Below the table, what a target pass over a
block of k tokens costs here against one token's, measured in llama.cpp: the ceiling a draft of
k - 1 tokens can reach. Writes OUTPUT/report.json and OUTPUT/report.md.

Methods: `plain`; each --ngram type at llama.cpp's defaults (ngram-simple, ngram-mod,
ngram-cache, ngram-map-k); each --export (its kind's --spec-type) at each --lengths; with
--with-ngram, each export also behind ngram-simple (llama.cpp tries the n-gram lookup first and
the drafter where it finds nothing: our loop's "with copying"). The target is --target-gguf, else
the first export's target.gguf, else the packaged target's own GGUF file.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from specdraft.formats.gguf_export import gguf_problems, target_original
from specdraft.llamacpp_build import LlamaCppError, cpu_name, ensure_llamacpp
from specdraft.measuring.llamacpp import (
    Drafting,
    LlamaServer,
    agreement,
    arithmetic_noise,
    block_costs,
    counters,
    drafting_ms,
    read_gguf_export,
)
from specdraft.measuring.measure import read_requests, request_ids
from specdraft.targets.target import TargetError, target_path
from specdraft.tools.arguments import add_prompts_arguments

PROG = "benchmarks/bench_llamacpp.py"
NGRAMS = ("ngram-simple", "ngram-mod", "ngram-cache", "ngram-map-k")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.output)
    try:
        out.mkdir(parents=True, exist_ok=True)  # before the minutes of measuring
        report = bench(args)
    except (LlamaCppError, TargetError, OSError, ValueError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.md").write_text(markdown(report))
    print(markdown(report))
    return 0


def bench(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    exports = [read_gguf_export(Path(f).expanduser(), args.target_gguf) for f in args.export]
    name = args.target or (exports[0].target_name if exports else "smollm2-135m")
    folder = Path(target_path(name))
    target = Path(args.target_gguf) if args.target_gguf else None
    target = target or (exports[0].target if exports else target_original(folder))
    if target is None:
        raise LlamaCppError(f"{name} has no GGUF file of its own: pass --target-gguf")
    engine = ensure_llamacpp()
    for export in exports:  # before anything runs
        problems = gguf_problems(
            target, export.draft, export.spec_type, export.fingerprint, engine.source
        )
        if problems:
            raise LlamaCppError(f"{export.folder}: " + "; ".join(problems))
    lengths = [int(n) for n in args.lengths.split(",")] if args.lengths else []
    ngrams = [t for t in args.ngram.split(",") if t] if args.ngram else []
    unknown = sorted(set(ngrams) - set(NGRAMS))
    if unknown:
        raise LlamaCppError(f"--ngram {unknown}: choose from {', '.join(NGRAMS)}")
    flags = tuple(args.flags.split()) if args.flags else ()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    requests = read_requests(args.prompts, args.num_prompts)

    def serve(drafting: Drafting | None, contexts: list[list[int]]):
        trace = drafting is not None  # its drafting time is in llama.cpp's trace log
        with LlamaServer(
            engine, target, drafting, threads=args.threads, trace=trace, flags=flags
        ) as server:
            server.complete(contexts[0], 8)  # warm-up
            warm = drafting_ms(server)
            outs = [server.complete(ids, args.max_new_tokens) for ids in contexts]
            return outs, drafting_ms(server) - warm

    # plain decoding turn by turn: its answers are every later turn's context
    start = time.time()
    contexts: list[list[int]] = []
    turns: list[int] = []
    plain = []
    answers: list[list[str]] = [[] for _ in requests]
    for turn in range(max(len(r.turns) for r in requests)):
        asked = [i for i, r in enumerate(requests) if len(r.turns) > turn]
        ids = [request_ids(tokenizer, requests[i], answers[i])[0].tolist() for i in asked]
        outs, _ = serve(None, ids)
        for i, out in zip(asked, outs, strict=True):
            answers[i].append(tokenizer.decode(out.tokens, skip_special_tokens=True))
        contexts += ids
        turns += [turn + 1] * len(ids)
        plain += outs
    methods: list[tuple[str, Drafting | None]] = [("plain", None)]
    methods += [(t, Drafting(t)) for t in ngrams]
    for export in exports:
        label = f"{export.folder.name} ({export.kind}, {export.draft_type})"
        for n in lengths or [export.gamma]:
            methods.append((label, Drafting(export.spec_type, export.draft, n)))
            if args.with_ngram:
                both = f"ngram-simple,{export.spec_type}"
                methods.append((f"{label} + ngram-simple", Drafting(both, export.draft, n)))
    full = (*flags, "--swa-full")  # a sliding-window model's whole cache: a prefix is reused
    with LlamaServer(engine, target, None, threads=args.threads, flags=full) as server:
        text = [t for ids, out in zip(contexts, plain, strict=True) for t in ids + out.tokens]
        costs = block_costs(server, list(range(1, max([*lengths, 7]) + 2)), text)
    runs, outputs = [], []
    for label, drafting in methods:
        outs, draft_ms = (plain, 0.0) if drafting is None else serve(drafting, contexts)
        run = {"method": label, "spec_type": drafting and drafting.spec_type}
        run["length"] = drafting.length if drafting else None
        run.update(counters(outs))
        run["drafting_ms"] = round(draft_ms, 1)
        passes = max(sum(o.passes for o in outs), 1)
        run["pass_ms"] = round(run["decode_seconds"] * 1000 / passes, 2)
        run["drafting_ms_per_pass"] = round(draft_ms / passes, 2)
        run["by_turn"] = {
            str(t): counters([o for o, k in zip(outs, turns, strict=True) if k == t])
            for t in sorted(set(turns))
        }
        run["equal_outputs"] = sum(a.tokens == b.tokens for a, b in zip(outs, plain, strict=True))
        runs.append(run)
        outputs.append(outs)
        print(
            f"[bench] {label} n={run['length']}: {run['tokens_per_second']} tokens/s, "
            f"equal {run['equal_outputs']}/{len(outs)}",
            flush=True,
        )
    # where an output parts from plain decoding's: a near-tie llama.cpp's batched arithmetic
    # split, or a disagreement (scripts/verify_export.py --engine llama.cpp)
    with LlamaServer(engine, target, None, threads=args.threads, flags=flags) as server:
        noise = arithmetic_noise(server, contexts, plain)
        tie_gap = noise if args.tie_gap is None else args.tie_gap
        for run, outs in zip(runs, outputs, strict=True):
            agreed = agreement(server, contexts, plain, outs, tie_gap)
            run["near_ties"] = sum(a.near_tie for a in agreed)
            run["disagreements"] = [a.__dict__ for a in agreed if a.disagrees]
    base = runs[0]["tokens_per_second"]
    for run in runs:
        run["speedup"] = round(run["tokens_per_second"] / base, 3) if base else None
    return {
        "target": str(target),
        "target_name": name,
        "prompts": args.prompts,
        "requests": len(requests),
        "turns": len(contexts),
        "max_new_tokens": args.max_new_tokens,
        "threads": args.threads,
        "flags": list(flags),
        "cpu": cpu_name(),
        "llama_cpp": engine.build_info.get("commit"),
        "date": time.strftime("%Y-%m-%d"),
        "seconds": round(time.time() - start),
        "block_costs": costs,
        "arithmetic_noise": noise,
        "tie_gap": tie_gap,
        "runs": runs,
    }


def markdown(report: dict) -> str:
    lines = [
        f"# llama.cpp {report['llama_cpp']} on {Path(report['target']).name}",
        "",
        f"{report['prompts']}: {report['requests']} requests, {report['turns']} turns, up to "
        f"{report['max_new_tokens']} new tokens each, greedy, {report['threads']} threads, "
        f"{report['cpu']}, {report['date']}. Tokens/s is llama.cpp's decode time; tau the tokens "
        "a target pass yields; mean length llama.cpp's own (1 + accepted / verification passes). "
        f"Near-ties: outputs parting where the two tokens' logits are within "
        f"{report['tie_gap']} (llama.cpp's own arithmetic moves such a gap by up to "
        f"{report['arithmetic_noise']} between a one-token and a many-token pass here).",
        "",
        "| method | draft length | tokens/s | speedup | tau | acceptance | mean length "
        "| ms per pass | drafting ms per pass | equal outputs (near-ties) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    n = report["turns"]
    for r in report["runs"]:
        cells = [
            r["method"], r["length"] or "", r["tokens_per_second"], f"{r['speedup']:.2f}x",
            r["tau"], r["acceptance_rate"] or "", r["mean_accepted_length"] or "",
            r["pass_ms"], r["drafting_ms_per_pass"] or "",
            f"{r['equal_outputs']}/{n}" + (f" ({r['near_ties']})" if r["near_ties"] else ""),
        ]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    costs = report["block_costs"]
    sizes = sorted(int(k) for k in costs if k.isdigit())
    lines += [
        "",
        f"What a target pass over k new tokens costs against one token's "
        f"({costs['one_token_ms']} ms), measured in llama.cpp here (a prompt's pass: logits "
        "for its last token only, so a lower bound on a verification's); with a draft of k - 1 "
        "tokens the best speedup (every draft accepted, drafting free) is at most k / cost, and "
        "tau must exceed the cost to break even:",
        "",
        "| k | " + " | ".join(str(k) for k in sizes) + " |",
        "| --- |" + " ---: |" * len(sizes),
        "| cost | " + " | ".join(f"{costs[str(k)]:.2f}" for k in sizes) + " |",
        "| best speedup, at most | "
        + " | ".join(f"{k / costs[str(k)]:.2f}x" for k in sizes)
        + " |",
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default=None, help="whose tokenizer renders the prompts")
    parser.add_argument("--target-gguf", default=None, help="the target's GGUF file")
    parser.add_argument(
        "--export", action="append", default=[], help="a scripts/export.py --format gguf folder"
    )
    parser.add_argument("--lengths", default=None, help="draft lengths (default: each's gamma)")
    parser.add_argument(
        "--ngram", default="ngram-simple,ngram-mod", help=f"of {', '.join(NGRAMS)}; '' for none"
    )
    parser.add_argument("--with-ngram", action="store_true", help="each export behind ngram-simple")
    add_prompts_arguments(parser, "mt-bench", 8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--tie-gap", type=float, default=None,
        help="a logit gap up to this is a near-tie (default: llama.cpp's own arithmetic noise)",
    )  # fmt: skip
    parser.add_argument("--flags", default=None, help="more llama-server flags for every method")
    parser.add_argument("--output", required=True)
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
