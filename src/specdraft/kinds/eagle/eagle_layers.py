"""The EAGLE head's layers: the training-time test's attention (`ttt_attention`, registered with
transformers as TTT_ATTENTION) and the reference architecture's layers the engines compute
(`head_layer_config`, `Eagle3Layer`, EAGLE-1's `eagle1_reference_layer`); the head is
kinds/eagle/eagle.py."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import AttentionInterface, DynamicCache, LlamaConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    LlamaRMSNorm,
)

# --- the training-time test's attention ------------------------------------------------------


def ttt_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of unrolled step k (EagleDrafter.unroll) without its (S, (k + 1) S) mask.

    Given no mask and keys of (k + 1) S positions for S queries (step 0's keys, then one block
    per later step), query t attends to step 0's keys 0..t and to key t of every later block:
    a causal attention plus k keys per query; with `documents` (batch, S), the document ids of
    packed rows (data.pack), step 0's keys are only those of the query's document. Scores are
    computed a block of queries at a time
    (recomputed in the backward pass when training), so memory grows as S x block, not as the
    dense mask's and scores' S x (k + 1) S. With a mask (drafting through the modules), or a
    layout it does not know (sliding windows, soft-capping), it is transformers' SDPA attention.
    query (batch, heads, S, head_dim); key, value (batch, kv_heads, keys, head_dim).
    """
    S, n_keys = query.shape[2], key.shape[2]
    documents = kwargs.pop("documents", None)
    plain = attention_mask is not None or n_keys % S or kwargs.get("sliding_window")
    if plain or kwargs.get("softcap") or getattr(module, "is_causal", True) is False:
        if attention_mask is None and documents is not None:
            raise ValueError("ttt_attention's fallback takes packed rows as a mask, not documents")
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    H = query.shape[1]
    G = H // key.shape[1]  # query heads per key/value head: grouped, never repeated in memory
    q = query.unflatten(1, (key.shape[1], G))  # (B, KVH, G, S, D)
    later = n_keys // S - 1
    k0, v0 = key[:, :, :S], value[:, :, :S]  # step 0: causal
    kd = key[:, :, S:].unflatten(2, (later, S))  # (B, KVH, k, S, D): block j, position t
    vd = value[:, :, S:].unflatten(2, (later, S))
    diag = torch.einsum("bngsd,bnjsd->bngsj", q, kd) * scale  # (B, KVH, G, S, k)
    p_drop = dropout if module.training else 0.0
    outs = []
    for start in range(0, S, TTT_BLOCK):
        end = min(S, start + TTT_BLOCK)
        other = None  # (B, 1, 1, C, end): keys of another document than the query's
        if documents is not None:
            other = (documents[:, start:end, None] != documents[:, None, :end])[:, None, None]
        args = (q[:, :, :, start:end], k0[:, :, :end], v0[:, :, :end],
                diag[:, :, :, start:end], vd[:, :, :, start:end], start, scale, p_drop, other)  # fmt: skip
        if torch.is_grad_enabled() and query.requires_grad:
            outs.append(checkpoint(_ttt_block, *args, use_reentrant=False))
        else:
            outs.append(_ttt_block(*args))
    out = torch.cat(outs, dim=3).flatten(1, 2)  # (B, H, S, D)
    return out.transpose(1, 2).contiguous(), None


def _ttt_block(
    q, k0, v0, diag, vd, start: int, scale: float, p_drop: float, other=None
) -> torch.Tensor:
    """Queries start .. start + C of every head group: causal scores over step 0's keys 0..end
    (less those of `other` documents, packed rows) and their k keys of the later blocks, one
    softmax over both, in float32.
    q (B, KVH, G, C, D); k0, v0 (B, KVH, end, D); diag (B, KVH, G, C, k); vd (B, KVH, k, C, D)."""
    C, end = q.shape[3], k0.shape[2]
    scores = (q @ k0[:, :, None].transpose(-1, -2)).float() * scale  # (B, KVH, G, C, end)
    rows = start + torch.arange(C, device=q.device)
    future = torch.arange(end, device=q.device)[None, :] > rows[:, None]  # (C, end)
    if other is not None:
        future = future | other  # hidden alike: (B, 1, 1, C, end)
    scores = scores.masked_fill(future, float("-inf"))
    p = torch.cat([scores, diag.float()], dim=-1).softmax(-1)
    if p_drop > 0:
        p = F.dropout(p, p_drop)
    p = p.to(q.dtype)
    return p[..., :end] @ v0[:, :, None] + torch.einsum("bngcj,bnjcd->bngcd", p[..., end:], vd)


TTT_ATTENTION = "specdraft_ttt"
TTT_BLOCK = 256  # queries per block of ttt_attention
AttentionInterface.register(TTT_ATTENTION, ttt_attention)


# --- the reference architecture's layers ----------------------------------------------------------


def head_layer_config(config_class, target_config, num_layers: int = 1, **extra):
    """A `config_class` (LlamaConfig, Qwen3Config) of `num_layers` layers in the target's shape:
    the reference heads are such layers whatever the target's family (SpecForge and speculators
    train LlamaForCausalLMEagle3 heads for Qwen targets too), with the target's sizes,
    activation, norm epsilon and rotary."""
    c = target_config
    heads = c.num_attention_heads
    return config_class(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
        hidden_act=getattr(c, "hidden_act", "silu"),
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6),
        rope_parameters=head_rope(c),
        attention_bias=False,
        tie_word_embeddings=False,
        bos_token_id=getattr(c, "bos_token_id", None),
        eos_token_id=getattr(c, "eos_token_id", None),
        pad_token_id=getattr(c, "pad_token_id", None),
        **extra,
    )


def llama_layer_config(target_config, attn_implementation: str = TTT_ATTENTION) -> LlamaConfig:
    """The EAGLE head's one Llama layer (`head_layer_config`)."""
    config = head_layer_config(LlamaConfig, target_config, mlp_bias=False)
    config._attn_implementation = attn_implementation
    return config


def head_rope(target_config) -> dict | None:
    """The target's rope parameters for the head's one layer. A target with a rope per layer
    type (Gemma-3: local layers at theta 10k, global ones at 1M) gives its full-attention
    layers' rope: the head attends over the whole context, as those layers do."""
    rope = copy.deepcopy(getattr(target_config, "rope_parameters", None))
    if isinstance(rope, dict) and isinstance(rope.get("full_attention"), dict):
        return rope["full_attention"]
    return rope


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer as SafeAILab/EAGLE (cnets.py), SpecForge and vLLM/SGLang's
    Eagle3 Llama models compute it. Its input is cat(embedding, feature), 2H wide:

        f = hidden_norm(feature);  x = cat(input_layernorm(embedding), f)
        h = (f if norm_before_residual else feature) + attention(x)   # q/k/v read 2H
        out = h + mlp(post_attention_layernorm(h))

    The attention and MLP are Llama's, the attention's q/k/v widened to 2H inputs; the output is
    the pre-norm state, fed back as the next feature and normed before the LM head."""

    lean_family = "llama"  # drafters/lean.py runs it (LeanLayer splits the two inputs)
    two_inputs = True

    def __init__(self, config: LlamaConfig, norm_before_residual: bool = False) -> None:
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.norm_before_residual = norm_before_residual
        self.self_attn = LlamaAttention(config, layer_idx=0)
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(self.self_attn, name)
            setattr(self.self_attn, name, nn.Linear(2 * H, old.out_features, bias=False))
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(H, eps=eps)
        self.hidden_norm = LlamaRMSNorm(H, eps=eps)
        self.post_attention_layernorm = LlamaRMSNorm(H, eps=eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: DynamicCache | None = None,
        use_cache: bool = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """(batch, n, 2H) cat(embedding, feature) -> (batch, n, H); the arguments are a
        decoder layer's, so drafting drives it like any layer (drafters/lean.py ModuleLayer)."""
        H = hidden_states.shape[-1] // 2
        emb, feature = hidden_states[..., :H], hidden_states[..., H:]
        normed = self.hidden_norm(feature)
        x = torch.cat([self.input_layernorm(emb), normed], dim=-1)
        attn, _ = self.self_attn(
            hidden_states=x, attention_mask=attention_mask, position_ids=position_ids,
            cache=cache, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs,
        )  # fmt: skip
        h = (normed if self.norm_before_residual else feature) + attn
        return h + self.mlp(self.post_attention_layernorm(h))


def eagle1_reference_layer(config: LlamaConfig) -> LlamaDecoderLayer:
    """The reference EAGLE-1/2 layer (SafeAILab/EAGLE cnets1.py; vLLM's and SGLang's EAGLE Llama
    models): a Llama decoder layer whose input norm is dropped (fc's output goes straight in)."""
    layer = LlamaDecoderLayer(config, layer_idx=0)
    layer.input_layernorm = nn.Identity()
    return layer
