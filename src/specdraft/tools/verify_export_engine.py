"""The engine side of scripts/verify_export.py: run inside the engine's own virtual environment.

    ENGINE_PYTHON tools/verify_export_engine.py REQUEST.json

It imports only torch, safetensors and the engine's package (never specdraft, whose transformers
differs from the engine's), loads the export with the engine's own loader, and writes what it
drafts on the inputs verify_export.py saved:

    speculators  SpeculatorModel.from_pretrained (speculators 0.9.0); the draft logits of each
                 training-time-test step on the given fused target hidden states, teacher-forced
                 (step k at position t reads token t + 1 + k and step k - 1's output); for a
                 DFlash folder, the logits of block slot k + 1 for every anchor the model's own
                 anchor selection takes with every position scored (all that leave room for a
                 block, in order), its block masked as it trains (eager attention)
    eagle        SafeAILab/EAGLE's EaModel.from_pretrained (eagle-llm); the head's logits on the
                 given final hidden states, and eagenerate's greedy output and accepted lengths
                 on a chain
    medusa       FasterDecoding/Medusa's MedusaModel.from_pretrained (medusa-llm); each head's
                 logits on the given final hidden states, and medusa_generate's greedy output
                 and accepted lengths with the export's medusa_choices

REQUEST.json: {"engine", "folder" (the export), "base" (the target's folder), "inputs" (a
safetensors file: ids.{i} (1, n) and features.{i} (1, n, width)), "outputs" (the safetensors
file to write), "steps", "chain" (the chain length to decode, 0: none), "max_new_tokens",
"rope_theta"}. It writes logits.{i}.{k} (1, n', vocab) and, where decoded, tokens.{i} and
accepted.{i}, and prints one JSON line of notes. What each engine needs patched to run on a CPU
from local folders is said where it is done; none of it changes what the engine computes.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import types

import torch
from safetensors.torch import load_file, save_file


def main(request_path: str) -> int:
    with open(request_path) as f:
        request = json.load(f)
    torch.manual_seed(0)
    inputs = load_file(request["inputs"])
    prompts = sorted({int(k.split(".")[1]) for k in inputs if k.startswith("ids.")})
    run = {"speculators": speculators, "eagle": eagle, "medusa": medusa}[request["engine"]]
    outputs, notes = run(request, inputs, prompts)
    save_file({k: v.contiguous() for k, v in outputs.items()}, request["outputs"])
    print(json.dumps(notes))
    return 0


# --- speculators ----------------------------------------------------------------------------------


def speculators(request: dict, inputs: dict, prompts: list[int]):
    from speculators import SpeculatorModel, SpeculatorModelConfig

    config = SpeculatorModelConfig.from_pretrained(request["folder"])
    # the verifier is read at load time (its embedding and LM head, used only where the draft
    # has none): point it at the local target folder instead of the hub id the export names
    config.speculators_config.verifier.name_or_path = request["base"]
    # flex attention needs lengths in multiples of 128 on the CPU; eager computes the same
    config.transformer_layer_config._attn_implementation = "eager"
    model = SpeculatorModel.from_pretrained(request["folder"], config=config, dtype=torch.float32)
    model = model.eval()
    if getattr(config, "speculators_model_type", None) in ("dflash", "dspark"):
        return dflash(model, request, inputs, prompts)
    outputs, caught = {}, []
    model.lm_head.register_forward_hook(lambda m, a, o: caught.append(o.detach()))
    for i in prompts:
        ids, features = inputs[f"ids.{i}"], inputs[f"features.{i}"]
        caught.clear()
        with torch.no_grad():
            if config.speculators_model_type == "peagle":
                outputs.update(peagle(model, ids, features, request["steps"], caught, i))
                continue
            model(
                hidden_states=features[:, :-1],
                input_ids=ids[:, 1:],
                document_ids=torch.zeros_like(ids[:, 1:]),
                ttt_steps=request["steps"],
            )
        for k, logits in enumerate(caught):  # step k: rows t < n - 1 - k are teacher-forced
            outputs[f"logits.{i}.{k}"] = logits[:, : ids.shape[1] - 1 - k].float()
    # what the model builds and the folder does not hold, which speculators lets pass: it fills
    # a missing embedding from the verifier only where its copy is NaN, and under its
    # transformers the copy is whatever memory held (zeros, garbage, by luck the right values)
    optional = {"verifier_lm_head.weight", "verifier_norm.weight"}
    if config.draft_vocab_size == model.embed_tokens.weight.shape[0]:
        optional |= {"d2t", "t2d"}  # the whole vocabulary needs no maps
    if not getattr(config, "norm_before_fc", False):
        optional.add("input_norm.weight")
    return outputs, missing(model, request["folder"], optional)


def missing(model, folder: str, optional: set[str]) -> dict:
    """The notes on what `model` builds that the folder's safetensors files do not hold, beside
    the `optional` names."""
    files = [os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors")]
    held = {k for f in files for k in load_file(f)}
    return {"missing": sorted(set(model.state_dict()) - held - optional), "unexpected": []}


def peagle(model, ids, features, steps: int, caught: list, i: int) -> dict:
    """PEagleDraftModel's training forward with every group kept to depth `steps` and position
    0 out of the loss mask (else it drafts a group anchored before the text): its logits per
    depth k, anchors ascending, as our drafter's depth-k slots. Its COD keeps
    int((valid - d) * max(r^d, floor)) of a pool of valid - d + 1, so even r = 1 drops one at
    random: a floor of 2 keeps the whole pool."""
    from speculators.models.peagle.data import generate_cod_sample_indices

    n = ids.shape[1] - 1
    methods = model.config.speculators_config.proposal_methods
    depths = min(steps, getattr(model.config, "num_depths", None) or methods[0].speculative_tokens)
    loss_mask = torch.ones(1, n)
    loss_mask[0, 0] = 0
    kwargs = dict(num_depths=depths, down_sample_ratio=1.0, down_sample_ratio_min=2.0)
    try:
        model(
            hidden_states=features[:, :-1], input_ids=ids[:, 1:], loss_mask=loss_mask,
            document_ids=torch.zeros_like(ids[:, 1:]),
            verifier_last_hidden_states=features[:, :-1, : model.hidden_size], **kwargs,
        )  # fmt: skip
    except RuntimeError as e:  # its loss, after the logits, needs Triton's fused kernels
        if "Triton" not in str(e):
            raise
    _, depth = generate_cod_sample_indices(n, loss_mask, **kwargs)
    logits = caught[0][0].float()  # (slots, draft vocab), depth-major, anchors ascending
    return {f"logits.{i}.{k}": logits[depth == k][None] for k in range(depths)}


def dflash(model, request: dict, inputs: dict, prompts: list[int]):
    """A DFlash model's block logits: with every position scored and room for as many anchors
    as positions, its anchor selection takes every position that leaves room for a block
    (0 .. n - block_size - 1, ascending): logits.{i}.{k} (1, anchors 1.., vocab) is its k-th
    drafting slot (slot k + 1; a DSpark model sampling from the anchor: slot k), a DSpark
    model's with its Markov head's bias from the block's tokens, as its forward adds it."""
    B = model.block_size
    dspark = model.config.speculators_model_type == "dspark"
    first = 0 if dspark and model.config.sample_from_anchor else 1
    outputs = {}
    for i in prompts:
        ids, features = inputs[f"ids.{i}"], inputs[f"features.{i}"]
        n = ids.shape[1]
        ones = torch.ones_like(ids)
        with torch.no_grad():
            hidden, logits, _, _, anchored = model._backbone_forward(
                features, ids, ones, torch.zeros(*ids.shape, model.config.transformer_layer_config.hidden_size),
                torch.zeros_like(ids), max_anchors=n - B,
            )  # fmt: skip
            blocks = logits.view(n - B, B, -1)  # (anchors, B, vocab)
            if dspark:
                tokens = ids[0, anchored].view(n - B, B)
                previous = tokens if first == 0 else torch.cat([tokens[:, :1], tokens[:, :-1]], 1)
                blocks = blocks + model.markov_head.block_bias(
                    prev_token_ids=previous, hidden_states=hidden.view(n - B, B, -1)
                )
        for k in range(B - first):  # anchor 0 has no context, and is never drafted from: left out
            outputs[f"logits.{i}.{k}"] = blocks[None, 1:, k + first].float()
    # taken from the verifier, as the layout intends (load_verifier_weights)
    shared = {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight",
              "verifier_norm.weight", "d2t", "t2d"}  # fmt: skip
    return outputs, missing(model, request["folder"], shared)


# --- SafeAILab/EAGLE ------------------------------------------------------------------------------


def patch_rope(theta: float, classes) -> None:
    """The references build every rotary embedding with base 10000 whatever the config says:
    give their constructors the target's base instead."""
    for cls in classes:
        defaults = list(cls.__init__.__defaults__)
        defaults[1] = theta  # (max_position_embeddings, base, device)
        cls.__init__.__defaults__ = tuple(defaults)


def no_tokenizer(module) -> None:
    """The references load the base's tokenizer only for its EOS id (and to decode what they
    yield): a stand-in that never stops early and yields token ids, so the check needs no
    tokenizer an older transformers can read."""
    stand_in = types.SimpleNamespace(eos_token_id=-1, decode=lambda t, **kw: t.tolist())
    module.AutoTokenizer = types.SimpleNamespace(from_pretrained=lambda *a, **k: stand_in)


def recorded(module, name: str, into: list[int]) -> None:
    """Wrap module.name (the reference's evaluate_posterior) to record each step's accepted
    length (its second result, the bonus token not counted)."""
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        into.append(int(result[1]))
        return result

    setattr(module, name, wrapper)


def eagle(request: dict, inputs: dict, prompts: list[int]):
    import eagle.model.cnets as cnets
    import eagle.model.ea_model as ea_model
    import eagle.model.modeling_llama_kv as kv
    from eagle.model.utils import reset_tree_mode
    from eagle.model.utils_c import generate_tree_buffers

    patch_rope(request["rope_theta"], (kv.LlamaRotaryEmbedding, cnets.LlamaRotaryEmbedding))
    no_tokenizer(ea_model)
    model = ea_model.EaModel.from_pretrained(
        base_model_path=request["base"], ea_model_path=request["folder"], torch_dtype=torch.float32
    ).eval()
    accepted: list[int] = []
    recorded(ea_model, "evaluate_posterior", accepted)
    outputs = {}
    chain = max(request["chain"], 2) if request["chain"] else 0  # its chains need 2 nodes
    tree = [[0] * d for d in range(1, chain + 1)]
    for i in prompts:
        ids, features = inputs[f"ids.{i}"], inputs[f"features.{i}"]
        reset_tree_mode(model)
        model.ea_layer.reset()
        with torch.no_grad():
            h = model.ea_layer(features[:, :-1], input_ids=ids[:, 1:])
            outputs[f"logits.{i}.0"] = model.base_model.lm_head(h).float()
        if not chain:
            continue
        # Model.init_tree drafts mc_sim_7b_63 whatever eagenerate verifies: draft the chain
        model.ea_layer.tree = tree
        model.ea_layer.tree_buffer = generate_tree_buffers(tree, ids.device)
        accepted.clear()
        prompt = inputs[f"prompt.{i}"]
        with torch.no_grad():
            out = model.eagenerate(
                prompt, temperature=0.0, max_new_tokens=request["max_new_tokens"], tree_choices=tree
            )
        outputs[f"tokens.{i}"] = out[0, prompt.shape[1] :].long()
        outputs[f"accepted.{i}"] = torch.tensor(accepted, dtype=torch.long)
    return outputs, {"chain": chain}


# --- FasterDecoding/Medusa ------------------------------------------------------------------------


def medusa(request: dict, inputs: dict, prompts: list[int]):
    import medusa.model.medusa_model as medusa_model
    import medusa.model.modeling_llama_kv as kv
    from medusa.model.kv_cache import KVCache
    from medusa.model.utils import reset_medusa_mode

    patch_rope(request["rope_theta"], (kv.LlamaRotaryEmbedding,))
    no_tokenizer(medusa_model)

    def past_key_values(model):
        # medusa 0.1 allocates num_attention_heads slots per layer (kv_cache.py), which a
        # grouped-query target (fewer key/value heads) cannot fill: allocate its kv heads
        c = model.config
        kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        data = torch.zeros(
            c.num_hidden_layers * 2, 1, kv_heads, c.max_position_embeddings,
            c.hidden_size // c.num_attention_heads, device=model.device, dtype=model.dtype,
        )  # fmt: skip
        length = torch.zeros(c.num_hidden_layers * 2, dtype=torch.long, device="cpu")
        caches = [
            [KVCache(data[2 * i + j], length[2 * i + j]) for j in range(2)]
            for i in range(c.num_hidden_layers)
        ]
        return caches, data, length

    medusa_model.initialize_past_key_values = past_key_values
    # its from_pretrained loads the base named in config.json: the local target folder here
    with tempfile.TemporaryDirectory() as head:
        with open(os.path.join(request["folder"], "config.json")) as f:
            config = json.load(f)
        config["base_model_name_or_path"] = request["base"]
        with open(os.path.join(head, "config.json"), "w") as f:
            json.dump(config, f)
        shutil.copy(os.path.join(request["folder"], "medusa_lm_head.pt"), head)
        model = medusa_model.MedusaModel.from_pretrained(head, torch_dtype=torch.float32).eval()
        # it loads with strict=False and drops the result: check the names ourselves
        saved = torch.load(os.path.join(head, "medusa_lm_head.pt"), weights_only=True)
    wanted = set(model.medusa_head.state_dict())
    notes = {
        "missing": sorted(wanted - set(saved)),
        "unexpected": sorted(set(saved) - wanted),
        "heads": model.medusa,
    }
    accepted: list[int] = []
    recorded(medusa_model, "evaluate_posterior", accepted)
    outputs = {}
    # the tree the export says (one entry per head); a chain where it says none
    choices = config.get("medusa_choices") or [1] * (model.medusa + 1)
    for i in prompts:
        features = inputs[f"features.{i}"]
        with torch.no_grad():
            for k, head_k in enumerate(model.medusa_head):
                outputs[f"logits.{i}.{k}"] = head_k(features).float()
        if not request["chain"]:
            continue
        reset_medusa_mode(model)
        accepted.clear()
        last = None
        prompt = inputs[f"prompt.{i}"]
        with torch.no_grad():
            for last in model.medusa_generate(
                prompt, temperature=0.0, max_steps=request["max_new_tokens"], medusa_choices=choices
            ):
                if len(last["text"]) >= request["max_new_tokens"]:
                    break
        outputs[f"tokens.{i}"] = torch.tensor(last["text"] if last else [], dtype=torch.long)
        outputs[f"accepted.{i}"] = torch.tensor(accepted, dtype=torch.long)
    notes["choices"] = choices
    notes["chain"] = model.medusa if choices == [1] * (model.medusa + 1) else 0
    return outputs, notes


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
