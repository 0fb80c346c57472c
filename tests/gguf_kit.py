"""GGUF files and model wheels for the tests of real targets (targets/packaged.py): a Llama
written with the gguf package's writer as llama.cpp's converter lays one out, and wheels that carry
a file as the registry's model packages do."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
from safetensors.torch import load_file


def rope_order(weight: np.ndarray, heads: int) -> np.ndarray:
    """A q or k projection's rows reordered from Hugging Face's rotary layout (each head's first
    half rotated with its second half) to the interleaved pairs llama.cpp's GGUF files hold;
    transformers' GGUF reader undoes it."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_llama_gguf(
    folder: Path, out: Path, *, tensor_type: str = "F32", architecture: str = "llama"
) -> Path:
    """The Llama in `folder` (a Hugging Face folder with a byte-level BPE tokenizer) as a GGUF
    file: config keys, tokenizer and every weight, the matrices stored as `tensor_type`."""
    from gguf import GGMLQuantizationType, GGUFWriter, quantize

    config = json.loads((folder / "config.json").read_text())
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    weights = {k: v.float().numpy() for k, v in load_file(folder / "model.safetensors").items()}
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = GGUFWriter(str(out), architecture)
    writer.add_name("tiny demo")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_vocab_size(config["vocab_size"])
    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["content"] for t in tokenizer["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([3 if token in special else 1 for token, _ in vocab])
    writer.add_token_merges([" ".join(pair) for pair in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])
    names = {
        "embed_tokens": "token_embd", "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    }  # fmt: skip
    kind = GGMLQuantizationType[tensor_type]
    for name, value in weights.items():
        if name == "lm_head.weight":
            continue  # tied
        if name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            gguf_name = f"blk.{layer}.{names[rest.removesuffix('.weight')]}.weight"
        if name.endswith("q_proj.weight"):
            value = rope_order(value, heads)
        elif name.endswith("k_proj.weight"):
            value = rope_order(value, kv_heads)
        if value.ndim == 2 and kind != GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, quantize(value, kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def make_wheel(folder: Path, distribution: str, files: dict[str, bytes]) -> Path:
    """A wheel of `distribution` 1.0 holding `files` (path -> bytes), as pip downloads it."""
    module = distribution.replace("-", "_")
    path = folder / f"{module}-1.0-py3-none-any.whl"
    info = f"{module}-1.0.dist-info"
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
        archive.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {distribution}\n"
                         "Version: 1.0\n")  # fmt: skip
        archive.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: "
                         "py3-none-any\n")  # fmt: skip
        archive.writestr(f"{info}/RECORD", "")
    return path
