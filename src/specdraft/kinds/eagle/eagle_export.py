"""EAGLE heads in the layouts serving engines load, and published heads read back into our loop.

Three formats (`scripts/export.py --format NAME`), each a writer (here), a reader and the checks
the engine's own loader makes (`layout_problems`, run on every export before the folder is
renamed into place and on every import before a module is built; the readers and the formats'
table in eagle_formats.py). All hold the reference
architecture, the only one EagleDrafter has: a Llama decoder layer in the target's shape, which
is what the engines build whatever the target's family.

    speculators  vllm-project/speculators' Eagle3Speculator, which vLLM serves (EAGLE-3 only):
                   config.json   speculators_model_type eagle3, architectures [Eagle3Speculator],
                                 transformer_layer_config (the layer's LlamaConfig as a dict),
                                 draft_vocab_size, norm_before_residual, target_hidden_size,
                                 eagle_aux_hidden_state_layer_ids, speculators_config {algorithm,
                                 proposal_methods [{proposal_type, speculative_tokens}],
                                 default_proposal_method, verifier {name_or_path, architectures}}
                   model.safetensors  fc.weight, layers.0.*, norm.weight, lm_head.weight, and with
                                 a reduced draft vocabulary d2t and t2d
                 (P-EAGLE heads, speculators_model_type peagle: kinds/peagle/peagle_export.py)
    sglang       SGLang's LlamaForCausalLMEagle3, as SpecForge exports it (EAGLE-3 only):
                   config.json   the layer's LlamaConfig, architectures [LlamaForCausalLMEagle3],
                                 draft_vocab_size, tie_word_embeddings false, eagle_config
                                 {eagle_aux_hidden_state_layer_ids, use_aux_hidden_state}
                   model.safetensors  midlayer.*, fc.weight, norm.weight, lm_head.weight, d2t, t2d
    eagle        SafeAILab/EAGLE's EAGLE-1/2 layout (cnets1.py; the yuhuili/EAGLE-* heads), which
                 SGLang's LlamaForCausalLMEagle and vLLM's EagleLlamaForCausalLM read (EAGLE-1):
                   config.json   the layer's LlamaConfig, num_hidden_layers 1, bias (fc's),
                                 architectures [LlamaForCausalLMEagle]
                   model.safetensors  fc.weight (and fc.bias), layers.0.* without input_layernorm

The draft vocabulary: ours is d2t, draft id -> target id. The engines' d2t holds offsets (target
id = i + d2t[i], int64) and t2d is a bool mask over the target vocabulary; both convert exactly,
and sorted(i + d2t[i]) must equal t2d's nonzero positions. A whole vocabulary in another order is
written as an LM head with rows in target order and no maps.

Which target hidden states are fused (EAGLE-3): our id i is the output of decoder layer i (1-based;
HF's hidden_states[i]). vLLM and speculators number them the same way; SGLang's eagle_config
numbers the output of layer k 0-based, so it holds i - 1 (an id 0, the embeddings, cannot be said
there). Our id L is the final *normed* state, which no engine captures (they take the pre-norm
residual stream): a head fusing it is refused.

What the engines' loaders do and do not say (vLLM 0.33 and SGLang 0.5.23 read; speculators 0.9.0
and SafeAILab/EAGLE run by scripts/verify_export.py) and every caveat that follows for a folder,
in docs/serving.md. Every folder holds the target's embedding (reference_state says why) and
the head's decoding settings (`specdraft_decoding`); the eagle layout also `pytorch_model.bin`.
"""

from __future__ import annotations

import torch

from specdraft.core import DecodeConfig
from specdraft.formats.checkpoint import CheckpointError
from specdraft.formats.export_formats import ExportError, integer
from specdraft.kinds.eagle.eagle import EagleDrafter
from specdraft.kinds.eagle.eagle_layers import llama_layer_config
from specdraft.targets.target import Target

WEIGHTS = "model.safetensors"
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose loader this layout was read from
SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"
EAGLE1_ARCHITECTURES = ("LlamaForCausalLMEagle", "EagleLlamaForCausalLM")
# The layer config fields that fix the head's maths beyond its weights' shapes; a published head
# must agree with the target's on them (specdraft builds the layer in the target's shape).
LAYER_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "hidden_act", "rms_norm_eps")  # fmt: skip


# What every transformers config holds and no engine reads for a draft layer (left out)
# fmt: off
GENERIC_KEYS = (
    "_attn_implementation", "transformers_version", "dtype", "torch_dtype", "output_hidden_states",
    "return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
    "problem_type", "pretraining_tp", "initializer_range", "use_cache", "_name_or_path",
    "output_attentions",
)
# fmt: on


# --- the head as the engines name it ----------------------------------------------------------


def reference_state(drafter: EagleDrafter, fmt: str) -> dict[str, torch.Tensor]:
    """The head's weights under the reference names (layers.0.* for the layer), plain CPU copies
    in the head's dtype, or ExportError where format `fmt` cannot hold this head."""
    cfg = drafter.config
    version = "EAGLE-3" if cfg.version == "eagle3" else "EAGLE-1"
    wants = "eagle1" if fmt == "eagle" else "eagle3"
    if cfg.version != wants:
        able = "eagle" if cfg.version == "eagle1" else "speculators or sglang"
        raise ExportError(
            f"format {fmt!r} holds {'EAGLE-1/2' if wants == 'eagle1' else 'EAGLE-3'} heads, not "
            f"an {version} one: export it with --format {able}"
        )
    if cfg.version == "eagle3":
        check_captured(
            cfg.feature_layers, drafter.target.num_layers, "head fuses", "feature_layers"
        )
        if fmt == "sglang" and 0 in cfg.feature_layers:
            raise ExportError(
                "this head fuses the target's embeddings (feature layer 0), which SGLang's "
                "eagle_config cannot name (it numbers decoder layer outputs from 0): export with "
                "--format speculators, or retrain with feature layers >= 1"
            )
        variant = [k for k in ("norm_before_fc", "norm_output") if getattr(cfg, k, False)]
        if fmt != "speculators" and variant:
            raise ExportError(
                f"this is an EAGLE-3.1 head ({' and '.join(variant)}), which the {fmt} format's "
                "engine does not compute: export it with --format speculators (vLLM reads both "
                "settings)"
            )
        if fmt == "sglang" and cfg.norm_before_residual:
            raise ExportError(
                "this head was trained with norm_before_residual=true, which SGLang's EAGLE-3 "
                "layer does not compute: export with --format speculators (vLLM), or retrain "
                "with drafter.norm_before_residual=false"
            )

    def plain(t: torch.Tensor) -> torch.Tensor:  # its own storage: safetensors refuses sharing
        return t.detach().to("cpu").contiguous().clone()

    state = {f"layers.0.{k}": plain(v) for k, v in drafter.layer.state_dict().items()}
    # The target's embedding: speculators 0.9.0 drafts on whatever memory held without it (it
    # copies the verifier's only over NaN), SafeAILab/EAGLE's strict loader refuses a file
    # without it; vLLM and SGLang use this copy instead of the target's (V x H more memory).
    embedding = drafter.target.model.get_input_embeddings().weight
    state["embed_tokens.weight"] = plain(embedding).to(state["layers.0.mlp.down_proj.weight"].dtype)
    if cfg.version == "eagle1":
        state["fc.weight"] = plain(drafter.fc.weight)
        if drafter.fc.bias is not None:
            state["fc.bias"] = plain(drafter.fc.bias)
        return state
    H = drafter.target.hidden_size
    state["fc.weight"] = plain(in_layer_order(drafter.fc_fuse.weight, cfg.feature_layers, H))
    if getattr(drafter, "input_norm", None) is not None:  # EAGLE-3.1: its blocks follow fc's
        w = drafter.input_norm.weight
        state["input_norm.weight"] = plain(in_layer_order(w, cfg.feature_layers, H))
    state["norm.weight"] = plain(drafter.final_norm.weight)
    state["lm_head.weight"] = plain(drafter.lm_head.weight)
    return state


def check_captured(layers: list[int], num_layers: int, reads: str, setting: str) -> None:
    """ExportError unless the engines capture every target layer in `layers` (what the drafter
    `reads`, under drafter.`setting`): each once, and none the final normed state (our id
    `num_layers`), which they never take."""
    if num_layers in layers:
        raise ExportError(
            f"this {reads} target hidden state {num_layers}, the final normed state, which the "
            "engines never capture (they take the pre-norm outputs of decoder layers): retrain "
            f"with drafter.{setting} below {num_layers} to serve it"
        )
    if len(set(layers)) < len(layers):
        raise ExportError(
            f"this {reads} target layers {layers}, a layer twice; the engines capture each layer "
            "once (sorted, duplicates dropped), so fc would get fewer features than it reads: "
            f"retrain with distinct drafter.{setting}"
        )


def in_layer_order(t: torch.Tensor, layers: list[int], width: int) -> torch.Tensor:
    """`t`'s last dimension, one block of `width` per fused target layer (fc's columns), with the
    blocks reordered to the layers ascending: the order the engines capture them in."""
    order = sorted(range(len(layers)), key=lambda j: layers[j])
    return torch.cat([t[..., j * width : (j + 1) * width] for j in order], dim=-1)


def engine_maps(d2t: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Our d2t (draft id -> target id) as the engines' (d2t offsets int64, t2d bool mask)."""
    d2t = d2t.long().cpu()
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[d2t] = True
    return d2t - torch.arange(len(d2t)), t2d


def our_d2t(
    offsets: torch.Tensor, t2d: torch.Tensor | None, vocab_size: int, where
) -> torch.Tensor:
    """The engines' d2t offsets (and t2d, when given) as our d2t, checking that they describe
    distinct target tokens and agree with each other."""
    if offsets.is_floating_point() or offsets.dim() != 1:
        raise CheckpointError(f"{where}: d2t must be a 1-D integer tensor; the file is corrupt")
    d2t = offsets.long() + torch.arange(len(offsets))
    if len(d2t) and (d2t.min() < 0 or d2t.max() >= vocab_size or len(d2t.unique()) < len(d2t)):
        raise CheckpointError(
            f"{where}: d2t does not map the draft vocabulary to distinct target tokens in "
            f"0..{vocab_size - 1} (target id = i + d2t[i]); the file is corrupt or belongs to "
            "another target"
        )
    if t2d is not None:
        if t2d.dtype != torch.bool or t2d.shape != (vocab_size,):
            raise CheckpointError(
                f"{where}: t2d must be a bool mask over the target's {vocab_size} tokens; got "
                f"{t2d.dtype} {tuple(t2d.shape)}"
            )
        if not torch.equal(d2t.sort().values, t2d.nonzero().flatten()):
            raise CheckpointError(
                f"{where}: t2d marks {int(t2d.sum())} target tokens but d2t maps "
                f"{len(d2t)} others (sorted(i + d2t[i]) must equal t2d's nonzero positions); "
                "the file is corrupt"
            )
    return d2t


def draft_vocabulary(drafter: EagleDrafter, state: dict[str, torch.Tensor], fmt: str) -> int:
    """Add the engines' maps to `state` as `fmt` wants them; the draft vocabulary's size."""
    V = drafter.target.vocab_size
    d2t = drafter.d2t.detach().cpu()
    reduced = len(d2t) < V
    if not reduced and not torch.equal(d2t, torch.arange(V)):  # the whole vocabulary, reordered
        state["lm_head.weight"] = state["lm_head.weight"][drafter.t2d.cpu()].contiguous()
        d2t = torch.arange(V)
    if reduced or fmt == "sglang":  # vLLM refuses maps for the whole vocabulary
        state["d2t"], state["t2d"] = engine_maps(d2t, V)
    return len(d2t)


def layer_config_dict(target: Target) -> dict:
    """The head layer's LlamaConfig as config.json holds it, with the rotary base also under the
    keys older engines read (rope_theta, rope_scaling)."""
    config = engine_layer_dict(llama_layer_config(target.config).to_dict())
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = dict(rope)
    config["architectures"] = ["LlamaForCausalLM"]
    return config


def engine_layer_dict(config: dict) -> dict:
    """A draft layer's config dict without GENERIC_KEYS, its rotary base also under rope_theta,
    where older readers of the layer config look for it."""
    for key in GENERIC_KEYS:
        config.pop(key, None)
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    return config


def speculators_config(algorithm: str, tokens: int, base_model: str, target: Target) -> dict:
    """speculators' `speculators_config`: one greedy proposal of `tokens` drafted tokens, verified
    by `base_model` (the target's architectures)."""
    method = {"proposal_type": "greedy", "speculative_tokens": tokens, "verifier_accept_k": 1,
              "accept_tolerance": 0.0}  # fmt: skip
    return {
        "algorithm": algorithm,
        "proposal_methods": [method],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": base_model, "architectures": target_architectures(target)},
    }


def speculative_tokens(config: dict):
    """The default proposal's speculative_tokens of a speculators config.json, or None."""
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    return methods[0].get("speculative_tokens")


# --- writers -------------------------------------------------------------------------------------


def write_speculators(
    drafter: EagleDrafter, base_model: str, decode: DecodeConfig
) -> tuple[dict, dict]:
    """(config.json, the weights) of an EAGLE-3 head in speculators' layout, proposing
    `decode.gamma` tokens."""
    state = reference_state(drafter, "speculators")
    draft_vocab = draft_vocabulary(drafter, state, "speculators")
    target = drafter.target
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer_config_dict(target),
        "draft_vocab_size": draft_vocab,
        "norm_before_residual": drafter.config.norm_before_residual,
        "norm_before_fc": getattr(drafter.config, "norm_before_fc", False),
        "norm_output": getattr(drafter.config, "norm_output", False),
        "target_hidden_size": target.hidden_size,
        "eagle_aux_hidden_state_layer_ids": sorted(drafter.config.feature_layers),
        "speculators_config": speculators_config("eagle3", decode.gamma, base_model, target),
    }
    return config, state


def write_sglang(drafter: EagleDrafter, base_model: str, decode: DecodeConfig) -> tuple[dict, dict]:
    """(config.json, the weights) of an EAGLE-3 head in SGLang's (SpecForge's) layout."""
    state = reference_state(drafter, "sglang")
    draft_vocab = draft_vocabulary(drafter, state, "sglang")
    state = {_sglang_name(k): v for k, v in state.items()}
    config = layer_config_dict(drafter.target)
    config.update({
        "architectures": [SGLANG_ARCHITECTURE],
        "draft_vocab_size": draft_vocab,
        "tie_word_embeddings": False,
        "target_hidden_size": drafter.target.hidden_size,
        # SGLang numbers the output of decoder layer k from 0: our id i (HF hidden_states[i])
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in sorted(drafter.config.feature_layers)],
            "use_aux_hidden_state": True,
        },
        "base_model_name_or_path": base_model,
    })  # fmt: skip
    return config, state


def write_eagle(drafter: EagleDrafter, base_model: str, decode: DecodeConfig) -> tuple[dict, dict]:
    """(config.json, the weights) of an EAGLE-1 head in SafeAILab/EAGLE's layout."""
    state = reference_state(drafter, "eagle")
    config = layer_config_dict(drafter.target)
    config.update({
        "architectures": [EAGLE1_ARCHITECTURES[0]],
        "bias": drafter.fc.bias is not None,  # SafeAILab/EAGLE: fc = Linear(2H, H, bias=bias)
        "base_model_name_or_path": base_model,
    })  # fmt: skip
    return config, state


def _sglang_name(name: str) -> str:
    return "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name


# --- the layouts' rules --------------------------------------------------------------------------


def expected_shapes(fmt: str, config: dict, vocab_size: int, *, embedding=True) -> dict[str, tuple]:
    """The exact weight names and shapes of a `fmt` folder with this config.json (the target's
    vocabulary size for the maps and the embedding, which our exports hold and published heads
    may leave out: `embedding`); names as the format writes them."""
    layer = config["transformer_layer_config"] if fmt == "speculators" else config
    H = layer["hidden_size"]
    # EAGLE-3's q/k/v read cat(embedding, feature); EAGLE-1's layer has no input_layernorm
    shapes = layer_shapes(layer, width=H if fmt == "eagle" else 2 * H)
    if fmt == "eagle":
        del shapes["input_layernorm.weight"]
    else:
        shapes["hidden_norm.weight"] = (H,)
    prefix = "midlayer." if fmt == "sglang" else "layers.0."
    expected = {prefix + k: v for k, v in shapes.items()}
    if embedding:
        expected["embed_tokens.weight"] = (vocab_size, H)
    if fmt == "eagle":
        expected["fc.weight"] = (H, 2 * H)
        if config.get("bias", True):  # SafeAILab/EAGLE's default when the key is absent
            expected["fc.bias"] = (H,)
        return expected
    target_h = config.get("target_hidden_size") or H
    draft_vocab = config["draft_vocab_size"]
    expected.update({
        "fc.weight": (H, 3 * target_h),
        "norm.weight": (H,),
        "lm_head.weight": (draft_vocab, H),
    })  # fmt: skip
    if config.get("norm_before_fc"):  # EAGLE-3.1
        expected["input_norm.weight"] = (3 * target_h,)
    if config.get("speculators_model_type") == "peagle":  # kinds/peagle/peagle_export.py
        expected["mask_hidden"] = (1, 1, 3 * target_h)
    if fmt == "sglang" or draft_vocab < vocab_size:
        expected["d2t"] = (draft_vocab,)
        expected["t2d"] = (vocab_size,)
    return expected


def layer_shapes(layer: dict, width: int, qk_norm: bool = False) -> dict[str, tuple[int, ...]]:
    """A decoder layer's weight names and shapes, from its config dict: q/k/v read `width`
    features; with `qk_norm`, Qwen3's per-head q_norm and k_norm."""
    H, inter = layer["hidden_size"], layer["intermediate_size"]
    heads = layer["num_attention_heads"]
    kv = layer.get("num_key_value_heads") or heads
    D = layer.get("head_dim") or H // heads
    shapes = {
        "self_attn.q_proj.weight": (heads * D, width),
        "self_attn.k_proj.weight": (kv * D, width),
        "self_attn.v_proj.weight": (kv * D, width),
        "self_attn.o_proj.weight": (H, heads * D),
        "mlp.gate_proj.weight": (inter, H),
        "mlp.up_proj.weight": (inter, H),
        "mlp.down_proj.weight": (H, inter),
        "post_attention_layernorm.weight": (H,),
        "input_layernorm.weight": (H,),
    }
    if qk_norm:
        shapes["self_attn.q_norm.weight"] = shapes["self_attn.k_norm.weight"] = (D,)
    return shapes


def layout_problems(fmt: str, config: dict, names: set[str] | None = None) -> list[str]:
    """What the engine's loader would refuse or misread in a `fmt` folder's config.json (and, when
    given, its weight names), each said in a sentence; [] when it loads. Pure Python: each rule
    says which loader it mirrors."""
    problems: list[str] = []

    def need(cond: bool, message: str) -> None:
        if not cond:
            problems.append(message)

    if fmt == "speculators":
        problems += speculators_problems(config, names)
        # vllm/transformers_utils/configs/speculators/base.py and algos.py (update_eagle3)
        need(
            config.get("speculators_model_type") in ("eagle3", "peagle"),
            "speculators_model_type != eagle3",
        )
        layer = config.get("transformer_layer_config")
        need(
            isinstance(layer, dict) and layer.get("model_type") in ("llama", "qwen3"),
            "transformer_layer_config must be a dict with model_type llama (vLLM builds "
            "Eagle3LlamaForCausalLM from it)",
        )
        need(
            integer(speculative_tokens(config)),
            "speculators_config.proposal_methods[0].speculative_tokens must be an integer >= 1",
        )
        # vLLM defaults a missing norm_before_residual to True, speculators to False
        need(
            isinstance(config.get("norm_before_residual"), bool),
            "norm_before_residual must be written (vLLM and speculators default it differently)",
        )
        hidden = config.get("target_hidden_size")  # null: the layer's (vLLM's default)
        need(hidden is None or integer(hidden), "target_hidden_size must be an integer")
        ids = config.get("eagle_aux_hidden_state_layer_ids")  # null: vLLM's default layers
        need(ids is None or _three_ids(ids), "eagle_aux_hidden_state_layer_ids must list 3 layers")
        for key in ("norm_before_fc", "norm_output"):  # EAGLE-3.1's, which vLLM and we compute
            if config.get("speculators_model_type") == "eagle3":
                need(isinstance(config.get(key, False), bool), f"{key} must be true or false")
            else:  # P-EAGLE's head does not
                need(
                    not config.get(key),
                    f"{key}=true is a variant specdraft's head does not compute",
                )
        need(not config.get("fc_norm"), "fc_norm is a variant specdraft's head does not compute")
    else:
        # sglang/srt/models/llama_eagle3.py, llama_eagle.py pick the model by architectures
        archs = config.get("architectures") or []
        if fmt == "sglang":
            need(archs == [SGLANG_ARCHITECTURE], f"architectures must be [{SGLANG_ARCHITECTURE}]")
            need(config.get("tie_word_embeddings") is False, "tie_word_embeddings must be false")
            eagle = config.get("eagle_config") or {}  # absent: SGLang's default layers
            ids = eagle.get("eagle_aux_hidden_state_layer_ids")
            need(
                ids is None or _three_ids(ids),
                "eagle_config.eagle_aux_hidden_state_layer_ids must list 3 layers",
            )
            # SGLang's layer has no norm_before_residual: it computes False
            need(
                not config.get("norm_before_residual"),
                "SGLang does not compute norm_before_residual=true",
            )
        need(config.get("num_hidden_layers") == 1, "num_hidden_layers must be 1")
        need(config.get("model_type", "llama") == "llama", "model_type must be llama")
    layer = config.get("transformer_layer_config") if fmt == "speculators" else config
    if isinstance(layer, dict):
        for key in ("hidden_size", "intermediate_size", "num_attention_heads"):
            need(integer(layer.get(key)), f"{key} must be an integer >= 1")
    if fmt != "eagle":
        need(integer(config.get("draft_vocab_size")), "draft_vocab_size must be an integer >= 1")
    return problems


def speculators_problems(config: dict, names: set[str] | None = None) -> list[str]:
    """What vLLM refuses or misreads in any speculators folder, whatever its kind."""
    problems = []
    # vllm/transformers_utils/config.py: a config with speculators_config and no model_type is a
    # speculators checkpoint
    if "model_type" in config:
        problems.append("a top-level model_type hides it from vLLM's detection")
    verifier = (config.get("speculators_config") or {}).get("verifier") or {}
    if not isinstance(verifier.get("name_or_path"), str) or verifier["name_or_path"] == "":
        problems.append("speculators_config.verifier.name_or_path must name the target")
    # vLLM's llama_eagle3.py load_weights prefixes every name but d2t and lm_head with model.
    if names is not None and any(n.startswith("model.") for n in names):
        problems.append("weight names must not start with model. (vLLM adds it)")
    return problems


def _three_ids(ids) -> bool:
    return isinstance(ids, list) and len(ids) == 3 and all(type(i) is int for i in ids)


def target_architectures(target: Target) -> list[str]:
    """The target's architectures as its config.json says them (its class for a model built in
    memory, whose config names none)."""
    return list(target.config.architectures or [type(target.model).__name__])
