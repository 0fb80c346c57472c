"""Check an export with the engine's own loader: does it draft what our loop drafts?

    python scripts/verify_export.py exports/eagle-demo-vllm --engine speculators
    python scripts/verify_export.py exports/eagle1-demo --engine eagle
    python scripts/verify_export.py exports/medusa-demo --engine medusa
    python scripts/verify_export.py exports/eagle-demo-gguf --engine llama.cpp

The engine's package is installed from the registry into its own virtual environment (created on
first use under SPECDRAFT_ENGINES, default ~/.cache/specdraft/engines, and reused; --setup makes
it only; --python uses an interpreter you have set up instead), since each pins a transformers
other than ours:

    speculators  speculators==0.9.0 (vLLM's format)            EAGLE-3 and P-EAGLE heads, DFlash drafters
    eagle        eagle-llm==1.2.1 (SafeAILab/EAGLE's release)  EAGLE-1 heads
    medusa       medusa-llm==0.1 (FasterDecoding/Medusa)       Medusa-1 heads

On held-out prompts and the target's own greedy continuation of each (what a served drafter sees),
the target's hidden states are computed once, here, and both sides draft from them: our head read
back from the export (load_drafter), and the engine's model loaded by the engine's loader
(tools/verify_export_engine.py, run in the engine's environment). Per drafted step (EAGLE-3:
each training-time-test step, teacher-forced; P-EAGLE: each depth of every anchor's group, from
PEagleDraftModel's training forward; EAGLE-1: the head's step; Medusa: each head) it
prints the top-1 agreement and the largest |logit difference|. Where the engine has a decoding
loop that runs on a CPU (eagenerate, medusa_generate), both decode each prompt greedily as a
chain, and their outputs and accepted lengths per step must be equal.

--engine llama.cpp (a `scripts/export.py --format gguf` folder; llama.cpp built once per machine
from the registry's source, specdraft/llamacpp_build.py) serves the export in llama.cpp's own
server, greedy, at each --lengths draft length (default: the length it was tuned to) and without
the drafter, on the same prompts (first turns; the target's tokenizer renders them), and
compares the outputs: where they part, the two tokens' logit gap in plain decoding is shown, and
a gap within --tie-gap (default: how far llama.cpp's own arithmetic moves such a gap between a
one-token pass and a pass over many tokens, measured on the same prompts) is counted as a
near-tie its batched verification split, apart from a disagreement. It prints llama.cpp's own
counters (drafted, accepted, verification passes). The files are checked first: a drafter made
with another tokenizer, or an EAGLE-3 head for a target of another width, is refused before
llama.cpp runs.

Exit status: 0 when every drafted step agrees on every position's top-1 token (and logits within
--atol + --rtol x the largest |logit|: fp32 sums in another order), and decoded outputs and
accepted lengths are equal; 1 on any mismatch, and when the engine's side fails to load or run
(each problem said); 2 on bad input. --json writes the figures.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specdraft.formats.checkpoint import CheckpointError
from specdraft.formats.export_registry import imported_format
from specdraft.formats.reading import load_drafter
from specdraft.inference import generate
from specdraft.llamacpp_build import engines_dir, ensure_llamacpp
from specdraft.measuring.llamacpp import read_gguf_export, verify_gguf_export
from specdraft.measuring.measure import load_prompts, read_prompts
from specdraft.targets.target import TargetError, load_target, target_path
from specdraft.tools.arguments import add_prompts_arguments

PROG = "scripts/verify_export.py"
LLAMA_CPP = "llama.cpp"
WORKER = Path(__file__).with_name("verify_export_engine.py")


@dataclass(frozen=True)
class Engine:
    formats: tuple[str, ...]  # our FORMATS it reads
    install: tuple[tuple[str, ...], ...]  # pip install argument lists, in order, after torch
    remove: tuple[str, ...] = ()  # packages its install pulls in that break it here
    decodes: bool = False  # it has a decoding loop that runs on a CPU

    @property
    def name(self) -> str:
        return self.install[0][-1].replace("==", "-")


ENGINES = {
    # speculators requires torchvision and torchaudio, imports neither, and the builds pip picks
    # beside a CPU torch break `import transformers`: removed after the install
    "speculators": Engine(
        ("speculators",), (("speculators==0.9.0",),), remove=("torchvision", "torchaudio")
    ),
    # the references pin a 2023 stack (gradio, fschat, openai ...) they do not need to load and
    # decode, and their modeling code needs transformers 4.36 (EAGLE's own pin): what they
    # import, without the rest
    "eagle": Engine(
        ("eagle",), (("--no-deps", "eagle-llm==1.2.1"), ("transformers==4.36.2",)), decodes=True
    ),
    "medusa": Engine(
        ("medusa",), (("--no-deps", "medusa-llm==0.1"), ("transformers==4.36.2",)), decodes=True
    ),
}


class VerifyError(ValueError):
    """Bad input, or an engine environment that cannot be made."""


# --- the engine's environment ---------------------------------------------------------------------


def engine_python(engine: str, log=print) -> Path:
    """The interpreter of `engine`'s virtual environment, made on first use (a marker file says
    it is complete; a half-made one is made again). torch is pinned to ours, which pip takes
    from a local file where there is one, so no other build is downloaded. Safe to call from
    several processes at once: one makes it under a file lock, the others wait and reuse it."""
    spec = ENGINES[engine]
    venv = engines_dir() / spec.name
    python, ready = venv / "bin" / "python", venv / ".specdraft-ready"
    if ready.is_file():
        return python
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{spec.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not ready.is_file():
            _make_engine(engine, spec, venv, python, log)
            ready.write_text(time.strftime("%Y-%m-%d %H:%M:%S\n"))
    return python


def _make_engine(engine: str, spec, venv: Path, python: Path, log) -> None:
    """`engine`'s virtual environment at `venv`, made anew."""
    log(f"[verify] making {venv} ({', '.join(a[-1] for a in spec.install)}), once")
    torch_pin = f"torch=={torch.__version__.split('+')[0]}"
    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text(torch_pin + "\n")
        steps = [[sys.executable, "-m", "venv", "--clear", str(venv)]]
        pip = [str(python), "-m", "pip", "install", "-q", "-c", str(constraints)]
        steps += [[*pip, torch_pin]] + [[*pip, *args] for args in spec.install]
        if spec.remove:
            steps.append([str(python), "-m", "pip", "uninstall", "-q", "-y", *spec.remove])
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True)
            if done.returncode != 0:
                raise VerifyError(
                    f"making the {engine} environment failed at `{' '.join(step[-3:])}`:\n"
                    f"{done.stderr.strip()[-2000:]}\n(needs the package registry; or pass "
                    "--python with an interpreter where it is installed)"
                )


# --- the check --------------------------------------------------------------------------------------


@dataclass
class Report:
    engine: str
    folder: str
    steps: list[dict] = field(default_factory=list)  # per drafted step: positions, agree, max_diff
    decoded: list[dict] = field(default_factory=list)  # per prompt: equal outputs, accepted
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(
    folder: Path,
    engine: str,
    *,
    target_name: str | None = None,
    prompts: str = "demo",
    num_prompts: int = 6,
    max_new_tokens: int = 32,
    steps: int = 3,
    atol: float = 1e-4,
    rtol: float = 1e-3,
    python: Path | None = None,
    log=print,
) -> Report:
    """Run the check (see the module docstring) and return its figures."""
    spec = ENGINES[engine]
    if steps < 1 or num_prompts < 1 or max_new_tokens < 8:
        raise VerifyError(
            f"--steps {steps}, --num-prompts {num_prompts} and --max-new-tokens "
            f"{max_new_tokens} would compare next to nothing: use at least 1, 1 and 8"
        )
    if not (folder / "config.json").is_file():
        raise VerifyError(f"{folder} holds no config.json: pass a folder scripts/export.py wrote")
    fmt = imported_format(folder)
    if fmt not in spec.formats:
        raise VerifyError(
            f"{folder} is {'a ' + fmt + ' export' if fmt else 'no export we know'}; --engine "
            f"{engine} reads {', '.join(spec.formats)} folders (scripts/export.py --format "
            f"{spec.formats[0]})"
        )
    config = json.loads((folder / "config.json").read_text())
    name = target_name or base_model_of(config)
    if not name:
        raise VerifyError(f"{folder} names no target: pass --target")
    base = Path(target_path(name))
    if not (base / "config.json").is_file():
        raise VerifyError(
            f"the target {name!r} is not a local folder: the engine loads it too, offline; pass "
            "--target with the folder of the model the export was made for"
        )
    target = load_target(str(base), dtype=torch.float32)
    drafter = load_drafter(folder, target).float().eval()
    python = python or engine_python(engine, log=log)
    # eagle-llm's chains need 2 nodes; medusa-llm drafts one candidate per head
    chain = (
        (max(steps, 2) if engine == "eagle" else drafter.config.num_heads) if spec.decodes else 0
    )
    inputs, ours = {}, {}
    texts = load_prompts(prompts, num_prompts, target)
    for i, prompt in enumerate(texts):
        # the target's own greedy continuation: what the drafter sees when served
        text = torch.cat(
            [prompt, generate(target, prompt, max_new_tokens=max_new_tokens).tokens], 1
        )
        out = target.forward(text, capture_layers=drafter.capture_layers)
        inputs[f"ids.{i}"], inputs[f"prompt.{i}"] = text, prompt
        inputs[f"features.{i}"] = features(drafter, engine, out.hidden_states)
        ours.update(our_logits(drafter, engine, text, out, steps, i))
    with tempfile.TemporaryDirectory() as tmp:
        request = {
            "engine": engine, "folder": str(folder.resolve()), "base": str(base.resolve()),
            "inputs": f"{tmp}/inputs.safetensors", "outputs": f"{tmp}/outputs.safetensors",
            "steps": steps, "chain": chain, "max_new_tokens": max_new_tokens,
            "rope_theta": rope_theta(target.config),
        }  # fmt: skip
        save_file({k: v.contiguous().cpu() for k, v in inputs.items()}, request["inputs"])
        Path(f"{tmp}/request.json").write_text(json.dumps(request))
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        command = [str(python), str(WORKER), f"{tmp}/request.json"]
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            problem = f"the {engine} loader failed:\n{done.stderr.strip()[-3000:]}"
            return Report(engine, str(folder), problems=[problem])
        try:
            theirs = load_file(request["outputs"])
            notes = json.loads(done.stdout.strip().splitlines()[-1])
        except (OSError, ValueError, IndexError) as e:
            problem = (
                f"the {engine} side wrote no readable result ({e}); its output:\n"
                f"{done.stdout.strip()[-2000:]}\n{done.stderr.strip()[-2000:]}"
            )
            return Report(engine, str(folder), problems=[problem])
    report = compare(engine, folder, ours, theirs, notes, atol, rtol)
    if not report.steps or any(s["positions"] == 0 for s in report.steps):
        report.problems.append("no drafted position was compared")
    # Medusa decodes with the export's medusa_choices: a tree of them gives our greedy output
    # too, but other accepted lengths than our chain (only a chain's are compared)
    tree = engine == "medusa" and notes.get("chain") == 0
    if chain:
        if not tree and notes.get("chain") != chain:
            report.problems.append(f"the {engine} side decoded with {notes.get('chain')}, not a chain of {chain}")  # fmt: skip
        for i in range(len(texts)):
            report.decoded.append(decode_both(target, drafter, inputs[f"prompt.{i}"], theirs, i, engine, chain, max_new_tokens, report, not tree))  # fmt: skip
    return report


def base_model_of(config: dict) -> str | None:
    verifier = (config.get("speculators_config") or {}).get("verifier") or {}
    return verifier.get("name_or_path") or config.get("base_model_name_or_path")


def rope_theta(config) -> float:
    rope = getattr(config, "rope_parameters", None) or {}
    return float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def features(drafter, engine: str, hidden_states) -> torch.Tensor:
    """What the engine's model reads from the target: EAGLE-3 the three fused layers' outputs,
    ascending as the engines capture them; EAGLE-1 and Medusa the final normed state."""
    layers = sorted(drafter.capture_layers) if engine == "speculators" else drafter.capture_layers
    return torch.cat([hidden_states[i].float() for i in layers], -1)


@torch.no_grad()
def our_logits(drafter, engine: str, text, out, steps: int, i: int) -> dict[str, torch.Tensor]:
    """Our head's logits for what the engine computes, keyed as the worker writes them."""
    if engine == "medusa":
        logits = drafter.logits(out.hidden_states[drafter.capture_layers[0]])
        full = torch.full((*logits.shape[:-1], drafter.target.vocab_size), float("-inf"))
        full[..., drafter.d2t] = logits.float()  # the export writes rows in target order
        return {f"logits.{i}.{k}": full[k] for k in range(len(full))}
    if drafter.kind in ("dflash", "dspark"):  # every anchor with context and room for a block
        ones = torch.ones_like(text)
        B, n = drafter.block_size, text.shape[1]
        anchors = torch.arange(1, n - B)[None]
        batch = {"input_ids": text, "attention_mask": ones, "loss_mask": ones, "anchors": anchors}
        logits = drafter.slots(batch, out)["logits"]  # (1, anchors, drafting slots, vocab)
        return {f"logits.{i}.{k}": logits[:, :, k].float() for k in range(logits.shape[2])}
    batch = {"input_ids": text, "loss_mask": torch.ones_like(text)}
    n = text.shape[1]
    if drafter.kind == "peagle":  # step k: depth k of every anchor's group, from one pass
        depths = min(steps, drafter.config.num_depths)
        keep = torch.ones(1, depths, n - 1, dtype=torch.bool)
        s = drafter.slots(batch, out, keep)
        per_depth = s["logits"].float().unflatten(1, (depths, n - 1))  # (1, depths, n - 1, V)
        return {f"logits.{i}.{k}": per_depth[:, k, : n - 1 - k] for k in range(depths)}
    unrolled = drafter.unroll(batch, out, steps if engine == "speculators" else 1)
    return {f"logits.{i}.{k}": s["logits"][:, : n - 1 - k].float() for k, s in enumerate(unrolled)}


def compare(engine, folder, ours, theirs, notes, atol, rtol) -> Report:
    report = Report(engine, str(folder))
    if notes.get("missing") or notes.get("unexpected"):
        report.problems.append(
            f"the folder does not hold what the engine's model builds: missing "
            f"{notes.get('missing')}, unexpected {notes.get('unexpected')} (its loader lets that "
            "pass without a word, and the model drafts with whatever those weights then hold)"
        )
    for k in sorted({int(key.split(".")[2]) for key in ours}):
        agree = total = 0
        worst, scale = 0.0, 0.0
        for key in (key for key in ours if key.endswith(f".{k}")):
            if key not in theirs:
                report.problems.append(f"the engine drafted no step {k} ({key})")
                continue
            a, b = ours[key], theirs[key]
            if a.shape != b.shape:
                report.problems.append(f"{key}: shape {tuple(b.shape)}, ours {tuple(a.shape)}")
                continue
            agree += int((a.argmax(-1) == b.argmax(-1)).sum())
            total += a.shape[:-1].numel()
            finite = torch.isfinite(a)
            if not torch.equal(finite, torch.isfinite(b)):
                worst = float("inf")
            elif finite.any():
                worst = max(worst, float((a[finite] - b[finite]).abs().max()))
                scale = max(scale, float(a[finite].abs().max()))
        allowed = atol + rtol * scale  # fp32 drift grows with the logits' size and the steps
        report.steps.append({"step": k, "positions": total, "agree": agree, "max_diff": worst,
                             "max_logit": scale})  # fmt: skip
        if agree < total or worst > allowed:
            report.problems.append(
                f"drafted step {k + 1}: top-1 agreement {agree}/{total}, max |logit diff| "
                f"{worst:.3g} (allowed {allowed:.3g} for logits up to {scale:.3g})"
            )
    return report


def decode_both(
    target, drafter, prompt, theirs, i, engine, chain, max_new_tokens, report, accepted_too=True
) -> dict:
    """Our loop and the engine's on one prompt, greedy, the same chain: outputs and accepted
    lengths per step over the tokens both produced (the engines overshoot max_new_tokens)."""
    settings = dict(gamma=chain, lookup_ngram=0, tree_top_k=1, tree_budget=max(chain, 1),
                    stop_below=0.0, draft_weights="full")  # fmt: skip
    out = generate(target, prompt, drafter, max_new_tokens=max_new_tokens, **settings)
    mine = out.tokens[0].tolist()
    # our first pass is the prefill, where a drafter fed by the target's states has nothing to
    # draft from yet; the engines draft from their prefill's states in their first step
    accepted = [e - 1 for e in out.stats.emitted_per_pass[1:]]
    tokens, their_accepted = theirs[f"tokens.{i}"].tolist(), theirs[f"accepted.{i}"].tolist()
    if len(tokens) < len(mine):  # the engines stop at max_new_tokens or past it, not before
        report.problems.append(
            f"prompt {i}: the {engine} loop produced {len(tokens)} tokens, ours {len(mine)}"
        )
    n = min(len(mine), len(tokens))
    steps_in = len(_within(accepted, n, chain))
    both = min(steps_in, len(their_accepted))  # steps whose accepted lengths agree, from the first
    common = next((j for j in range(both) if accepted[j] != their_accepted[j]), both)
    row = {
        "prompt": i, "tokens": n, "equal": mine[:n] == tokens[:n], "steps": steps_in,
        "accepted_equal": common == steps_in, "ours": accepted[:steps_in],
        "theirs": their_accepted[:steps_in], "drafted": out.stats.drafted,
        "accepted": out.stats.accepted,
    }  # fmt: skip
    if not row["equal"]:
        first = next(j for j in range(n) if mine[j] != tokens[j])
        report.problems.append(f"prompt {i}: the {engine} loop's greedy output differs from ours at token {first}")  # fmt: skip
    if not accepted_too:  # the engine decoded a tree: its greedy output is what must agree
        row["accepted_equal"] = None
        return row
    if steps_in == 0:
        report.problems.append(f"prompt {i}: no decoding step to compare within {n} tokens")
    if not row["accepted_equal"]:
        report.problems.append(
            f"prompt {i}: accepted lengths differ from step {common + 1} (ours "
            f"{accepted[:steps_in]}, {engine}'s {their_accepted[:steps_in]})"
        )
    return row


def _within(accepted: list[int], n: int, chain: int) -> list[int]:
    """The steps that drafted a whole chain (ours stops drafting short of max_new_tokens, the
    engines overshoot it) and whose tokens lie within the first n."""
    emitted, steps = 1, []  # the prefill's token first
    for a in accepted:
        if emitted + chain + 1 > n:
            break
        emitted += a + 1
        steps.append(a)
    return steps


# --- the command line ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.setup:
            where = ensure_llamacpp().root if args.engine == LLAMA_CPP else None
            print(f"[verify] {args.engine}: {where or engine_python(args.engine)}")
            return 0
        if args.folder is None:
            raise VerifyError("FOLDER is required (or --setup to make the environment only)")
        if args.engine == LLAMA_CPP:
            return verify_llamacpp(args)
        report = verify(
            Path(args.folder).expanduser(), args.engine, target_name=args.target,
            prompts=args.prompts, num_prompts=args.num_prompts,
            max_new_tokens=args.max_new_tokens, steps=args.steps, atol=args.atol, rtol=args.rtol,
            python=Path(args.python) if args.python else None,
        )  # fmt: skip
    except (VerifyError, CheckpointError, TargetError, OSError, ValueError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2  # LlamaCppError is a ValueError too
    print_report(report)
    return verdict(report.problems, report.__dict__ | {"ok": report.ok}, args.json)


def verify_llamacpp(args: argparse.Namespace) -> int:
    """--engine llama.cpp: the export served in llama.cpp against its plain decoding."""
    from transformers import AutoTokenizer

    export = read_gguf_export(Path(args.folder).expanduser(), args.target_gguf)
    name = args.target or export.target_name
    if not name:
        raise VerifyError(f"{export.folder} names no target: pass --target")
    tokenizer = AutoTokenizer.from_pretrained(target_path(name))
    prompts = [p[0].tolist() for p in read_prompts(args.prompts, args.num_prompts, tokenizer)]
    lengths = [int(n) for n in args.lengths.split(",")] if args.lengths else [export.gamma]
    report = verify_gguf_export(
        ensure_llamacpp(), export, prompts, args.max_new_tokens, lengths, args.tie_gap,
        args.threads,
    )  # fmt: skip
    p = report["plain"]
    print(f"[verify] {export.folder} in llama.cpp ({export.spec_type}), {len(prompts)} prompts")
    print(f"  plain: {p['tokens']} tokens, {p['tokens_per_second']} tokens/s")
    print(
        f"  llama.cpp's arithmetic moves a logit gap by up to {report['arithmetic_noise']} "
        f"between a one-token and a many-token pass here; near-tie gap {report['tie_gap']}"
    )
    for r in report["runs"]:
        print(
            f"  n={r['length']}: outputs equal {r['equal']}/{len(prompts)}, near-ties "
            f"{len(r['near_ties'])}, disagreements {len(r['disagreements'])}; drafted "
            f"{r['drafted']}, accepted {r['accepted']} ({r['acceptance_rate']}), verification "
            f"passes {r['verifications']}, mean accepted length {r['mean_accepted_length']}, "
            f"{r['tokens_per_second']} tokens/s"
        )
        for d in r["near_ties"]:
            print(
                f"    near-tie: prompt {d['prompt']} parts at token {d['first_difference']}, "
                f"logit gap {d['gap']:.4f}"
            )
    return verdict(report["problems"], report, args.json)


def print_report(report: Report) -> None:
    print(f"[verify] {report.folder} with {report.engine}'s own loader")
    for s in report.steps:
        print(
            f"  drafted step {s['step'] + 1}: top-1 agreement {s['agree']}/{s['positions']}, "
            f"max |logit diff| {s['max_diff']:.2g}"
        )
    for d in report.decoded:
        print(
            f"  prompt {d['prompt']}: {d['tokens']} tokens {'equal' if d['equal'] else 'DIFFER'}, "
            + (
                "the engine decoded a tree (accepted lengths not compared)"
                if d["accepted_equal"] is None
                else f"accepted lengths over {d['steps']} steps "
                f"{'equal' if d['accepted_equal'] else 'DIFFER'} {d['ours']}"
            )
        )


def verdict(problems: list[str], figures: dict, json_path: str | None) -> int:
    """Print each problem and the verdict, write the figures to --json; the exit status."""
    for problem in problems:
        print(f"  MISMATCH: {problem}")
    print(f"[verify] {'in agreement' if figures['ok'] else 'NOT in agreement'}")
    if json_path:
        Path(json_path).write_text(json.dumps(figures, indent=2) + "\n")
    return 0 if figures["ok"] else 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folder", metavar="FOLDER", nargs="?", help="a scripts/export.py folder")
    parser.add_argument("--setup", action="store_true", help="make the environment, check nothing")
    parser.add_argument("--engine", required=True, choices=sorted([*ENGINES, LLAMA_CPP]))
    parser.add_argument("--target", default=None, help="default: the target the export names")
    add_prompts_arguments(parser, "demo", 6, first_turns=True)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument(
        "--steps", type=int, default=3,
        help="EAGLE-3: teacher-forced steps compared; EAGLE-1: the chain decoded (at least 2)",
    )  # fmt: skip
    parser.add_argument("--atol", type=float, default=1e-4, help="|logit diff| allowed, plus")
    parser.add_argument(
        "--rtol", type=float, default=1e-3, help="... this times the largest |logit|"
    )
    parser.add_argument("--python", default=None, help="an interpreter with the engine installed")
    parser.add_argument("--lengths", default=None, help="llama.cpp: draft lengths, as 1,3,5")
    parser.add_argument(
        "--tie-gap", type=float, default=None,
        help="llama.cpp: a logit gap up to this where outputs part is a near-tie (default: "
        "llama.cpp's own arithmetic noise, measured on the prompts)",
    )  # fmt: skip
    parser.add_argument("--target-gguf", default=None, help="llama.cpp: instead of target.gguf")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    parser.add_argument("--json", default=None, help="write the figures here")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
