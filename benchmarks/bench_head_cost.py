"""What one EAGLE-3 head pass costs, as a fraction of one target decoding step, by target shape.

    python benchmarks/bench_head_cost.py                         # the shapes in BENCHMARKS.md
    python benchmarks/bench_head_cost.py --shape 512x4x1408 --shape 256x12x704

Random weights (cost does not depend on their values): each shape gets a Llama target with the
demo tokenizer and an untrained EAGLE-3 head (full vocabulary, chain of 5); both decode the same
prompt through our loop, after a warm-up, in this one process. A head pass that costs c target
steps caps a chain of gamma at roughly tau / (verify + gamma * c) target steps per pass, so
c decides whether a trained head can pay for itself on a given target.

Each shape is measured three ways, by how the head runs while drafting: `modules` (the HF decoder
layer and the head's modules, as training runs them), `lean` (drafters/lean.py: fused products,
in-place KV cache) and `lean-int8` (the same with int8 weights, draft_weights=int8).

`--verify 1,4,8,16` also times one target forward over that many new tokens after a 200-token
cache (what verifying a draft of n - 1 tokens costs), as a multiple of a one-token forward.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdraft.data.stdlib_corpus import build_demo_tokenizer, demo_corpus_texts
from specdraft.inference import generate
from specdraft.kinds.eagle.eagle import EagleConfig, EagleDrafter
from specdraft.kinds.eagle.eagle_session import EagleModuleWeights
from specdraft.targets.target import Target

SHAPES = ["512x4x1408", "384x8x1024", "256x12x704", "384x12x1024"]  # hidden x layers x mlp


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", action="append", help="HIDDENxLAYERSxMLP (repeat)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--verify", help="comma-separated token counts to time a forward over")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.verify.split(",")] if args.verify else []
    torch.manual_seed(0)
    tok = build_demo_tokenizer(demo_corpus_texts()[:30], 4096)
    ids = tok("def f(x):\n    return x\n" * 6, return_tensors="pt").input_ids
    for shape in args.shape or SHAPES:
        m = measure_shape(shape, tok, ids, args.new_tokens)
        passes = [
            f"{mode} {m['pass_ms'][mode]:.2f} ms = {m['pass_steps'][mode]:.2f}" for mode in MODES
        ]
        print(
            f"{shape}: target {m['target_params'] / 1e6:.1f}M, step {m['step_ms']:.2f} ms | head "
            f"{m['head_params'] / 1e6:.2f}M ({m['head_params'] / m['target_params']:.0%}), pass: "
            + ", ".join(passes) + " of a target step",
            flush=True,
        )  # fmt: skip
        if counts:
            one = _forward_ms(m["target"], 1)
            costs = [f"{n}: {_forward_ms(m['target'], n):.2f} ms" for n in counts]
            print(
                f"  forward over n new tokens (1 = {one:.2f} ms): " + ", ".join(costs), flush=True
            )


def measure_shape(shape: str, tok, ids: torch.Tensor, new_tokens: int) -> dict:
    """One shape's figures: the plain step and each mode's head pass (ms, and as a fraction of
    the step), the passes drafted per mode, parameter counts, and the target itself."""
    hidden, layers, mlp = (int(v) for v in shape.split("x"))
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers,
        intermediate_size=mlp, num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64, tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
    )  # fmt: skip
    target = Target(LlamaForCausalLM(config).eval(), tok)
    head = EagleDrafter.build(EagleConfig(version="eagle3", draft_vocab_size=0), target).eval()
    stats = {}
    for name in ("ar", *MODES):
        drafter, decode = None, {}
        if name != "ar":
            weights = "int8" if name == "lean-int8" else "full"
            drafter, decode = head, dict(gamma=5, draft_weights=weights)
        with _modules_only(name == "modules"):
            generate(target, ids, drafter, max_new_tokens=16, **decode)  # warm-up
            stats[name] = generate(target, ids, drafter, max_new_tokens=new_tokens, **decode).stats
    step = stats["ar"].total_seconds / stats["ar"].target_passes
    drafted = {mode: stats[mode].drafted for mode in MODES}
    if not all(drafted.values()):  # a pass cost over no pass is no figure
        raise RuntimeError(f"{shape}: the head drafted nothing in some mode ({drafted})")
    pass_s = {mode: stats[mode].draft_seconds / drafted[mode] for mode in MODES}
    return {
        "target": target,
        "step_ms": step * 1e3,
        "pass_ms": {mode: s * 1e3 for mode, s in pass_s.items()},
        "pass_steps": {mode: s / step for mode, s in pass_s.items()},
        "drafted": drafted,
        "target_params": sum(p.numel() for p in target.model.parameters()),
        "head_params": head.num_extra_parameters(target),
    }


@torch.no_grad()
def _forward_ms(target: Target, n: int, past: int = 200, repeats: int = 200) -> float:
    """Milliseconds of one target forward over n new tokens after `past` cached ones."""
    from transformers import DynamicCache

    cache = DynamicCache(config=target.config)
    target.forward(torch.randint(10, target.vocab_size, (1, past)), cache=cache, use_cache=True)
    new = torch.randint(10, target.vocab_size, (1, n))
    for i in range(repeats + 10):
        if i == 10:  # after a warm-up
            start = time.perf_counter()
        target.forward(new, cache=cache, use_cache=True, logits_to_keep=n)
        cache.crop(-n)
    return (time.perf_counter() - start) / repeats * 1e3


MODES = ("modules", "lean", "lean-int8")


@contextlib.contextmanager
def _modules_only(on: bool):
    """Sessions run the head's HF modules (no drafting weights) while on."""
    original = EagleDrafter.drafting_weights
    if on:
        EagleDrafter.drafting_weights = lambda self, int8: EagleModuleWeights(self)
    try:
        yield
    finally:
        EagleDrafter.drafting_weights = original


if __name__ == "__main__":
    main()
