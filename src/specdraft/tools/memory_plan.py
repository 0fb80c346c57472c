"""Memory per GPU of training an EAGLE head online, from the target's config alone: what the
target, the head's copy of its embedding, the head's weights, gradients and AdamW state and the
activations of one micro-batch take, for the target whole on every GPU or sharded by ZeRO-3
(`target_sharding=zero3`) and the head under DDP or ZeRO-2.

    python scripts/memory_plan.py configs/shapes/llama-3.3-70b --gpus 8
    python scripts/memory_plan.py FOLDER_OR_HUB_ID --gpus 8 --seq 2048 --ttt-steps 7 \\
        --draft-vocab 32000 --activations-gib-per-1k 3.1

Parameter counts are exact: the target and the head are built on the meta device from the
config (no weights read). Activations are not computed: they depend on kernels and allocator,
so they are an input, measured (--activations-gib-per-1k: per 1,024 tokens of a micro-batch,
linear in S because the training-time test's attention builds no S x S mask; BENCHMARKS.md,
"Training-time test memory"); left at 0, each total is what the GPU must hold before any
activation, and the rest of its memory is the room they have.

The loss's working set is measured, not an input: specdraft/losses.py computes every loss over a
chunk of `loss_chunk_tokens` positions at a time (--loss-chunk-tokens, the trainer's default
1,024), so it does not grow with the sequence; BENCHMARKS.md ("Loss memory at a large
vocabulary") measured an EAGLE-3 step's at a 128,256-token vocabulary, 32,000-token draft
vocabulary and a 1,024-position chunk: 1,080 MiB. The plan scales it linearly in the
chunk and in the target's vocabulary (the target's distribution over its whole vocabulary, made
one chunk at a time, is most of it) -- an estimate outside the measured shape.
"""

from __future__ import annotations

import argparse
import json
import sys

from specdraft.config import SHIPPED_CONFIGS
from specdraft.tools.arguments import new_parser

GIB = 2**30
ZERO2_CONFIG = SHIPPED_CONFIGS / "deepspeed" / "zero2.json"
# DeepSpeed's stage3_prefetch_bucket_size and stage3_max_live_parameters (elements), which
# load_sharded_target keeps
ZERO3_PREFETCH = 5e7
ZERO3_MAX_LIVE = 1e9
# The loss's working set measured for an EAGLE-3 step (BENCHMARKS.md, "Loss memory at a large
# vocabulary": the chunked step at 2,048 tokens) and the shape it was measured at.
LOSS_MIB_MEASURED = 1080
LOSS_MEASURED_VOCAB = 128256
LOSS_MEASURED_CHUNK = 1024


class _Vocab:
    """A tokenizer stand-in: the fingerprint hashes a vocabulary, and there is none to read."""

    def __init__(self, n: int) -> None:
        self.vocab = {str(i): i for i in range(n)}

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


def build_on_meta(target: str, draft_vocab: int, ttt_steps: int):
    """(the target, the EAGLE-3 head) built on the meta device from `target`'s config."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdraft.kinds.eagle.eagle import EagleConfig, EagleDrafter, resolve_config
    from specdraft.targets.target import Target, target_path

    config = AutoConfig.from_pretrained(target_path(target))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    wrapped = Target(model, _Vocab(2), name=target)
    cfg = resolve_config(
        EagleConfig(version="eagle3", ttt_steps=ttt_steps, draft_vocab_size=draft_vocab), wrapped
    )
    d2t = torch.arange(draft_vocab) if 0 < draft_vocab < wrapped.vocab_size else None
    with init_empty_weights(include_buffers=False):  # weights on meta; rotary buffers real
        head = EagleDrafter.build(cfg, wrapped, d2t)
    return wrapped, head


def plan(
    target: str,
    *,
    gpus: int,
    draft_vocab: int,
    ttt_steps: int,
    seq: int,
    micro_batch: int,
    activations_gib_per_1k: float,
    loss_chunk_tokens: int = 1024,
    bytes_per_weight: int = 2,
) -> dict:
    """Each term in GiB per GPU, with the counts it was computed from."""
    wrapped, head = build_on_meta(target, draft_vocab, ttt_steps)
    model = wrapped.model
    target_params = sum(p.numel() for p in model.parameters())
    # ZeRO-3 gathers a module's own weights for its forward (not a decoder layer's at once): the
    # largest is the embedding or the LM head, both gathered in every forward
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    # the sharded run's head keeps a copy of the embedding; the LM head's it releases once built
    embeddings = model.get_input_embeddings().weight.numel()
    trained = sum(p.numel() for p in head.parameters() if p.requires_grad)
    b = bytes_per_weight
    zero2 = json.loads(ZERO2_CONFIG.read_text())["zero_optimization"]
    activations = activations_gib_per_1k * GIB * seq * micro_batch / 1024
    # one chunk of positions at a time (0: the whole micro-batch at once)
    chunk = min(loss_chunk_tokens or seq * micro_batch, seq * micro_batch)
    loss = (
        LOSS_MIB_MEASURED * 2**20 * (chunk / LOSS_MEASURED_CHUNK)
        * (wrapped.vocab_size / LOSS_MEASURED_VOCAB)
    )  # fmt: skip
    terms = {
        "target_whole": target_params * b,
        # its share, plus what ZeRO-3 keeps gathered: up to stage3_max_live_parameters, but a
        # module is gathered whole (the largest may be more), never more than the target; plus
        # the prefetch bucket
        "target_zero3": target_params * b / gpus
        + (min(target_params, max(largest, ZERO3_MAX_LIVE)) + ZERO3_PREFETCH) * b,
        # the sharded run's head reads a copy of the embedding (the whole target serves itself)
        "head_embedding_copy": embeddings * b,
        # bf16 mixed precision: fp32 weights (4 bytes), fp32 gradients (4), AdamW's two fp32
        # moments (8); DDP also keeps its gradient buckets (4), all on every GPU. ZeRO-2: bf16
        # weights (2) on every GPU, fp32 weights, gradients and moments (16) split over the
        # GPUs, and two reduce buckets of configs/deepspeed/zero2.json's size.
        "head_ddp": trained * 20,
        "head_zero2": trained * 2 + trained * 16 / gpus + 2 * zero2["reduce_bucket_size"] * b,
        "activations": activations,
        "loss": loss,
    }
    result = {k: v / GIB for k, v in terms.items()}
    result.update({
        "target_parameters": target_params, "largest_module_parameters": largest,
        "embedding_parameters": embeddings, "head_trained_parameters": trained,
        "gpus": gpus, "seq": seq, "micro_batch": micro_batch, "ttt_steps": head.config.ttt_steps,
        "draft_vocab": head.draft_vocab_size, "loss_chunk_tokens": chunk,
        "target_vocab": wrapped.vocab_size,
    })  # fmt: skip
    act = result["activations"] + result["loss"]
    result["whole target, DDP head"] = result["target_whole"] + result["head_ddp"] + act
    result["whole target, ZeRO-2 head"] = result["target_whole"] + result["head_zero2"] + act
    result["ZeRO-3 target, ZeRO-2 head"] = (
        result["target_zero3"] + result["head_embedding_copy"] + result["head_zero2"] + act
    )
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = plan(
            args.target, gpus=args.gpus, draft_vocab=args.draft_vocab, ttt_steps=args.ttt_steps,
            seq=args.seq, micro_batch=args.micro_batch,
            activations_gib_per_1k=args.activations_gib_per_1k,
            loss_chunk_tokens=args.loss_chunk_tokens,
        )  # fmt: skip
    except (OSError, ValueError) as err:
        print(f"memory_plan.py: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1))
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = new_parser(__doc__)
    parser.add_argument("target", help="a model folder or hub id (only its config is read)")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--activations-gib-per-1k", type=float, default=0.0,
                        help="measured activations per 1,024 tokens of a micro-batch (0: left out)")  # fmt: skip
    parser.add_argument("--loss-chunk-tokens", type=int, default=1024,
                        help="the trainer's loss_chunk_tokens (0: the whole micro-batch at once)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.gpus < 1 or args.seq < 1 or args.micro_batch < 1:
        parser.error("--gpus, --seq and --micro-batch must be at least 1")
    if args.loss_chunk_tokens < 0:
        parser.error("--loss-chunk-tokens must be >= 0 (0: the whole micro-batch at once)")
    return args


if __name__ == "__main__":
    sys.exit(main())
