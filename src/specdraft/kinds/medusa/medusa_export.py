"""Medusa heads in other tools' layouts: written for serving engines, read back into our loop.

Two formats (`scripts/export.py --format NAME`; formats/export_registry.py holds every kind's),
each with its writer and its reader, both through `HeadWeights`, the heads as plain tensors.

    medusa  FasterDecoding/Medusa's layout (medusa/model/medusa_model.py), which TensorRT-LLM's
            Medusa converter (tensorrt_llm/models/medusa/weight.py) and TGI
            (server/text_generation_server/layers/medusa.py) read:
              config.json                 medusa_num_heads, medusa_num_layers,
                                          base_model_name_or_path, hidden_size, vocab_size
              medusa_lm_head.safetensors  per head h, the names of its nn.Sequential(*blocks,
                                          out): {h}.{l}.linear.weight (H, H) and
                                          {h}.{l}.linear.bias (H,) for block l < L, and
                                          {h}.{L}.weight (V, H), the output layer
    vllm    vLLM's MedusaModel (vllm/model_executor/models/medusa.py, its config
            vllm/transformers_utils/configs/medusa.py):
              config.json                 model_type medusa, architectures [MedusaModel],
                                          hidden_size, vocab_size, num_heads, num_hidden_layers,
                                          truncated_vocab_size, medusa_fc_bias, original_lm_head
              model.safetensors           blocks.{h}.layers.{l}.weight (H, H) and .bias (H,),
                                          lm_heads.{h}.weight (Vd, H), and with a reduced draft
                                          vocabulary token_map (Vd,): draft id -> target id, our
                                          d2t (vLLM sets every other token's logit to -inf)

What is exact: all three read the target's final normed hidden state, head k predicting the
token k + 2 places ahead, and compute x + SiLU(W x + b) per block, then the output layer, as
kinds/medusa/medusa.py does. Heads with output=shared are written with a copy of the target's LM
head as each head's output layer. A reduced draft vocabulary is exact in vllm only: the medusa
layout has no token map, so exporting one there is an error. The heads' measured
per-rank accuracies travel as `specdraft_medusa_accuracy`, so a reloaded folder builds the same
tree (a published one without them builds it from an assumed accuracy, with a warning).
The decoding settings travel as `specdraft_decoding` (load_decoding reads them back), and the
medusa layout's `medusa_choices` is the reference's tree for them, sized to the head count.

Two caveats of the reference's own Python model, not of the layout: its from_pretrained loads
only `medusa_lm_head.pt` (a pickle; convert with torch.save if you need it), and it builds a
head's L blocks as one shared module ([ResBlock] * L), so only L = 1 heads run there as trained;
TensorRT-LLM and TGI read the safetensors file and every block's own weights.

Reading (through `load_drafter`) is strict: a missing or an unexpected weight name, a wrong
shape, or sizes other than the target's are a CheckpointError naming them; only safetensors are
read.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from pathlib import Path

import torch

from specdraft.core import DecodeConfig
from specdraft.formats.checkpoint import CONFIG_NAME, CheckpointError
from specdraft.formats.export_formats import (
    ExportError,
    Format,
    check_names_and_shapes,
    check_sizes,
    count,
    folder_weights,
    pickle_message,
    read_weights,
)
from specdraft.kinds.medusa.medusa import MedusaDrafter
from specdraft.kinds.medusa.medusa_config import MedusaConfig
from specdraft.targets.target import Target


@dataclass
class HeadWeights:
    """K Medusa heads as plain tensors: what every format is written from and read into."""

    blocks: list[list[tuple[torch.Tensor, torch.Tensor | None]]]  # [head][block]: (W, b or None)
    out: list[torch.Tensor]  # [head]: (draft vocab, hidden) output layer
    d2t: torch.Tensor | None  # (draft vocab,) draft id -> target id; None: the whole vocabulary
    vocab_size: int  # the target's
    # the measured per-rank accuracies the tree is built from ({"greedy", "sampled"}: (K, R)
    # lists), carried as ACCURACY_KEY in config.json; None: never measured
    accuracy: dict[str, list[list[float]]] | None = None

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    @property
    def num_layers(self) -> int:
        return len(self.blocks[0])

    @property
    def hidden_size(self) -> int:
        return self.out[0].shape[1]


# --- from and to our drafter ---------------------------------------------------------------------


def head_weights(drafter: MedusaDrafter) -> HeadWeights:
    """The heads of `drafter` as tensors in its own dtype; output=shared heads get the target's
    LM head as each head's output layer (the formats have no shared one)."""
    dtype = drafter.heads[0].blocks[0].linear.weight.dtype
    blocks = [[(b.linear.weight, b.linear.bias) for b in head.blocks] for head in drafter.heads]
    if drafter.config.output == "shared":
        lm = drafter.target.model.get_output_embeddings()
        if getattr(lm, "bias", None) is not None:
            raise ExportError(
                f"the target {drafter.target.name!r}'s LM head has a bias, which the Medusa "
                "formats' output layers lack: shared heads cannot be exported exactly; train "
                "with drafter.output=own"
            )
        out = [lm.weight] * len(drafter.heads)
    else:
        out = [head.out.weight for head in drafter.heads]
    d2t = drafter.d2t.detach().cpu()
    if not drafter.reduced_vocab:
        if not torch.equal(d2t, torch.arange(len(d2t))):  # the whole vocabulary, reordered
            out = [o[drafter.t2d] for o in out]  # rows in target order: no map needed
        d2t = None

    def plain(t: torch.Tensor) -> torch.Tensor:  # its own storage: safetensors refuses sharing
        return t.detach().to("cpu", dtype).contiguous().clone()

    measured = {k: drafter.measured_accuracy(k == "greedy") for k in ("greedy", "sampled")}
    accuracy = None
    if all(a is not None for a in measured.values()):
        accuracy = {k: a.tolist() for k, a in measured.items()}
    return HeadWeights(
        blocks=[[(plain(w), plain(b)) for w, b in head] for head in blocks],
        out=[plain(o) for o in out],
        d2t=d2t,
        vocab_size=drafter.target.vocab_size,
        accuracy=accuracy,
    )


# The config.json key under which our Medusa exports carry the heads' measured accuracies
ACCURACY_KEY = "specdraft_medusa_accuracy"


def read_accuracy(config: dict, num_heads: int, folder: Path) -> dict | None:
    """The measured accuracies a folder carries (ACCURACY_KEY), checked; None where it has none
    (a published head: its tree is then built from an assumed accuracy, with a warning)."""
    accuracy = config.get(ACCURACY_KEY)
    if accuracy is None:
        return None
    try:
        shapes = {torch.tensor(accuracy[k], dtype=torch.float).shape for k in ("greedy", "sampled")}
    except (KeyError, TypeError, ValueError):
        shapes = set()
    if len(shapes) != 1 or len(next(iter(shapes))) != 2 or next(iter(shapes))[0] != num_heads:
        raise CheckpointError(
            f"{folder / CONFIG_NAME}: {ACCURACY_KEY} must hold 'greedy' and 'sampled', each a "
            f"list of {num_heads} equal-length lists of numbers (one per head); delete the key to "
            "build the tree from an assumed accuracy"
        )
    return accuracy


def drafter_from(weights: HeadWeights, target: Target) -> MedusaDrafter:
    """Heads with their own output layers (output=own) holding `weights`, for `target`; block
    biases a format leaves out are zero."""
    ranks = {"accuracy_ranks": len(weights.accuracy["greedy"][0])} if weights.accuracy else {}
    config = MedusaConfig(
        num_heads=weights.num_heads,
        num_layers=weights.num_layers,
        output="own",
        draft_vocab_size=0 if weights.d2t is None else len(weights.d2t),
        **ranks,
    )
    drafter = MedusaDrafter(config, target, d2t=weights.d2t)
    if weights.accuracy:  # the tree the heads were measured to draw, not an assumed one
        accuracy = {f"accuracy_{k}": weights.accuracy[k] for k in ("greedy", "sampled")}
        drafter.checkpoint = drafter.checkpoint.with_heldout(accuracy)
    with torch.no_grad():
        for head, blocks, out in zip(drafter.heads, weights.blocks, weights.out, strict=True):
            for block, (w, b) in zip(head.blocks, blocks, strict=True):
                block.linear.weight.copy_(w)
                if b is not None:
                    block.linear.bias.copy_(b)
            head.out.weight.copy_(out)
    return drafter


# --- medusa: FasterDecoding/Medusa's layout ---------------------------------------------------------

MEDUSA_WEIGHTS = "medusa_lm_head.safetensors"
MEDUSA_PICKLE = "medusa_lm_head.pt"


def write_medusa(
    drafter: MedusaDrafter, base_model: str, decode: DecodeConfig
) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, the weights file's tensors) of `drafter` in the medusa layout."""
    weights = head_weights(drafter)
    if weights.d2t is not None:
        raise ExportError(
            f"these heads draft over {len(weights.d2t)} of the target's {weights.vocab_size} "
            "tokens, and the medusa layout has no token map to say which: export with --format "
            "vllm (its token_map is exact), or train with drafter.draft_vocab_size=0"
        )
    L = weights.num_layers
    tensors = {}
    for h, (blocks, out) in enumerate(zip(weights.blocks, weights.out, strict=True)):
        for i, (w, b) in enumerate(blocks):
            tensors[f"{h}.{i}.linear.weight"] = w
            tensors[f"{h}.{i}.linear.bias"] = b
        tensors[f"{h}.{L}.weight"] = out  # the reference's nn.Sequential(*blocks, out): index L
    config = {
        "medusa_num_heads": weights.num_heads,
        "medusa_num_layers": L,
        "base_model_name_or_path": base_model,
        "hidden_size": weights.hidden_size,
        "vocab_size": weights.vocab_size,
        "medusa_choices": medusa_choices(weights.num_heads, decode),
    }
    if weights.accuracy:
        config[ACCURACY_KEY] = weights.accuracy
    return config, tensors


def medusa_choices(num_heads: int, decode: DecodeConfig) -> list[int]:
    """The reference's medusa_choices for these heads: [1, k_1, ..., k_K], the top k_h candidates
    of head h in a cartesian tree (its medusa_generate indexes one entry per head, so its default
    [1, 7, 6], made for two heads, raises IndexError with more). tree_top_k per head from the
    first while the tree's nodes (k_1 + k_1 k_2 + ...) stay within tree_budget, then 1: a chain
    at tree_top_k 1. Its depth is the head count (the form cannot stop sooner; gamma cannot be
    said). The reference reads no choices from config.json: pass
    medusa_choices=config["medusa_choices"] to medusa_generate."""
    ks: list[int] = []
    for _ in range(num_heads):
        k = decode.tree_top_k
        # the tree's nodes if this head takes k and every later one 1
        widths = list(itertools.accumulate([*ks, k], operator.mul))
        nodes = sum(widths) + widths[-1] * (num_heads - len(widths))
        ks.append(k if k > 1 and nodes <= decode.tree_budget else 1)
    return [1, *ks]


def read_medusa(
    folder: Path, config: dict, target: Target, *, strict: bool = True
) -> MedusaDrafter:
    """The heads of a medusa-layout folder, checked against `target` before anything is built."""
    file = folder / MEDUSA_WEIGHTS
    if not file.is_file():
        if (folder / MEDUSA_PICKLE).is_file():
            raise CheckpointError(pickle_message(folder / MEDUSA_PICKLE, MEDUSA_WEIGHTS))
        raise CheckpointError(
            f"{folder} has a Medusa config.json but no {MEDUSA_WEIGHTS}: download the heads' "
            "weights too (a folder holding a whole fine-tuned model with its heads is not read)"
        )
    K = count(config, "medusa_num_heads", folder)
    L = count(config, "medusa_num_layers", folder)
    check_sizes(config, target, folder)
    H, V = target.hidden_size, target.vocab_size
    expected: dict[str, tuple[int, ...]] = {}
    for h in range(K):
        for i in range(L):
            expected[f"{h}.{i}.linear.weight"] = (H, H)
            expected[f"{h}.{i}.linear.bias"] = (H,)
        expected[f"{h}.{L}.weight"] = (V, H)
    state = read_weights([file])
    check_names_and_shapes(state, expected, file, target, config)
    blocks = [
        [(state[f"{h}.{i}.linear.weight"], state[f"{h}.{i}.linear.bias"]) for i in range(L)]
        for h in range(K)
    ]
    out = [state[f"{h}.{L}.weight"] for h in range(K)]
    accuracy = read_accuracy(config, K, folder)
    return drafter_from(HeadWeights(blocks, out, d2t=None, vocab_size=V, accuracy=accuracy), target)


# --- vllm: vLLM's MedusaModel -------------------------------------------------------------------------

VLLM_WEIGHTS = "model.safetensors"


def write_vllm(
    drafter: MedusaDrafter, base_model: str, decode: DecodeConfig
) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, the weights file's tensors) of `drafter` in vLLM's layout."""
    weights = head_weights(drafter)
    tensors = {}
    for h, (blocks, out) in enumerate(zip(weights.blocks, weights.out, strict=True)):
        for i, (w, b) in enumerate(blocks):
            tensors[f"blocks.{h}.layers.{i}.weight"] = w
            tensors[f"blocks.{h}.layers.{i}.bias"] = b
        tensors[f"lm_heads.{h}.weight"] = out
    draft_vocab = weights.vocab_size
    if weights.d2t is not None:
        # vLLM reads token_map only when truncated_vocab_size < vocab_size, and then scatters
        # each head's logits to these target ids (-inf elsewhere): our d2t exactly
        tensors["token_map"] = weights.d2t.long().contiguous().clone()
        draft_vocab = len(weights.d2t)
    config = {
        # vLLM's MedusaConfig renames every key holding "num" and "heads" to num_heads (and
        # "num" and "layers" to num_hidden_layers): no other key may hold those words
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": weights.hidden_size,
        "vocab_size": weights.vocab_size,
        "num_heads": weights.num_heads,
        "num_hidden_layers": weights.num_layers,
        "truncated_vocab_size": draft_vocab,
        "medusa_fc_bias": True,  # default False: the blocks would be built without bias
        "original_lm_head": False,  # each head its own lm_heads.{h}
        "base_model_name_or_path": base_model,
    }
    if weights.accuracy:
        config[ACCURACY_KEY] = weights.accuracy
    return config, tensors


def read_vllm(folder: Path, config: dict, target: Target, *, strict: bool = True) -> MedusaDrafter:
    """The heads of a vLLM Medusa folder, read as vLLM reads them (any *.safetensors file there,
    names without a `medusa_heads.` prefix, one LM head for all with original_lm_head), checked
    against `target` before anything is built."""
    K = count(config, "num_heads", folder, also="medusa_num_heads")
    L = count(config, "num_hidden_layers", folder, also="medusa_num_layers")
    check_sizes(config, target, folder)
    H, V = target.hidden_size, target.vocab_size
    Vd = config.get("truncated_vocab_size") or V
    if not isinstance(Vd, int) or not 0 < Vd <= V:
        raise CheckpointError(
            f"{folder / CONFIG_NAME}: truncated_vocab_size={Vd!r} must be an integer in 1..{V} "
            "(the target's vocabulary)"
        )
    bias = bool(config.get("medusa_fc_bias", False))
    shared = bool(config.get("original_lm_head", False))
    # read once the config fits the target (K heads of V x H can be large): as vLLM, every file
    state, where = folder_weights(folder, "vLLM Medusa", VLLM_WEIGHTS)
    # vLLM strips this prefix from every name
    state = {k.removeprefix("medusa_heads."): v for k, v in state.items()}
    if shared and "lm_head.weight" in state:  # vLLM takes either name for the one LM head
        state["lm_heads.0.weight"] = state.pop("lm_head.weight")
    expected: dict[str, tuple[int, ...]] = {}
    for h in range(K):
        for i in range(L):
            expected[f"blocks.{h}.layers.{i}.weight"] = (H, H)
            if bias:
                expected[f"blocks.{h}.layers.{i}.bias"] = (H,)
    lm_names = ["lm_heads.0.weight"] if shared else [f"lm_heads.{h}.weight" for h in range(K)]
    for name in lm_names:
        # vLLM keeps the token_map rows of a head written over the whole vocabulary
        rows = V if Vd < V and name in state and state[name].shape[0] == V else Vd
        expected[name] = (rows, H)
    if Vd < V:
        expected["token_map"] = (Vd,)
    check_names_and_shapes(state, expected, where, target, config)
    d2t = None
    if Vd < V:
        d2t = state["token_map"]
        if d2t.is_floating_point() or d2t.min() < 0 or d2t.max() >= V or len(d2t.unique()) < Vd:
            raise CheckpointError(
                f"{where}: token_map must hold {Vd} distinct target token ids in "
                f"0..{V - 1}; the file is corrupt"
            )
        d2t = d2t.long()
    lm = [state[name] for name in lm_names] * (K if shared else 1)
    blocks = [
        [
            (state[f"blocks.{h}.layers.{i}.weight"], state.get(f"blocks.{h}.layers.{i}.bias"))
            for i in range(L)
        ]
        for h in range(K)
    ]
    out = [o[d2t] if d2t is not None and o.shape[0] == V else o for o in lm]
    accuracy = read_accuracy(config, K, folder)
    return drafter_from(HeadWeights(blocks, out, d2t=d2t, vocab_size=V, accuracy=accuracy), target)


# --- the formats -------------------------------------------------------------------------------


MEDUSA_FORMATS: dict[str, Format] = {
    "medusa": Format(
        help="FasterDecoding/Medusa's config.json + medusa_lm_head.safetensors and .pt (the reference, TensorRT-LLM, TGI)",
        kinds=("medusa",),
        weights_file=MEDUSA_WEIGHTS,
        write=write_medusa,
        read=read_medusa,
        detect=lambda c: "medusa_num_heads" in c and c.get("model_type") != "medusa",
        pickle_copy=MEDUSA_PICKLE,
    ),
    "vllm": Format(
        help="vLLM's Medusa config.json (model_type medusa) + model.safetensors",
        kinds=("medusa",),
        weights_file=VLLM_WEIGHTS,
        write=write_vllm,
        read=read_vllm,
        detect=lambda c: c.get("model_type") == "medusa",
    ),
}
