"""DFlash's decoder layers: attention whose queries are a block's slots and whose keys are the
target's features of the context and the block itself (kinds/dflash/dflash.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    rotate_half,
)

# --- the layers --------------------------------------------------------------------------------


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (batch, heads, n, dim) with cos/sin (batch, n, dim)."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + rotate_half(x) * sin


class DFlashAttention(nn.Module):
    """Queries from the block; keys and values from the context's features and the block, both
    through this layer's k_proj/v_proj and per-head k_norm, rotated at their positions."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        H, D = config.hidden_size, config.head_dim
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = D
        self.q_proj = nn.Linear(H, self.heads * D, bias=False)
        self.k_proj = nn.Linear(H, self.kv_heads * D, bias=False)
        self.v_proj = nn.Linear(H, self.kv_heads * D, bias=False)
        self.o_proj = nn.Linear(self.heads * D, H, bias=False)
        self.q_norm = Qwen3RMSNorm(D, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(D, eps=config.rms_norm_eps)

    def keys_values(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch, n, hidden) -> keys, values (batch, kv_heads, n, head_dim), keys rotated."""
        B, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, n, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, n, self.kv_heads, self.head_dim).transpose(1, 2)
        return rotate(k, cos, sin), v

    def forward(self, x, context: tuple[torch.Tensor, torch.Tensor], cos, sin, mask):
        """x (batch, n, hidden) the block's normed states; context: this layer's keys/values of
        the context; mask None (all visible) or bool (batch, 1, n, context + n)."""
        B, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, n, self.heads, self.head_dim)).transpose(1, 2)
        q = rotate(q, cos, sin)
        k, v = self.keys_values(x, cos, sin)
        k = torch.cat([context[0].to(k.dtype), k], dim=2)  # (batch, kv_heads, context + n, dim)
        v = torch.cat([context[1].to(v.dtype), v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, n, -1))


class DFlashLayer(nn.Module):
    """A Qwen3 decoder layer whose attention also reads the context's keys and values."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = DFlashAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(H, eps=eps)
        self.post_attention_layernorm = Qwen3RMSNorm(H, eps=eps)

    def forward(self, x, context, cos, sin, mask) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), context, cos, sin, mask)
        return h + self.mlp(self.post_attention_layernorm(h))
