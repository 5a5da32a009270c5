"""The drafter's building blocks: RMSNorm, the rotary tables, attention (K/V of the context and of the
block, Q of the block), a decoder layer, and the reference block attention over a `KVCache`.

Boundary: per-layer math only; the drafter as a model (its weights' layout, checkpoint format, context
injection and block drafting, modeling/drafter.py) composes these. The Triton kernels
(kernels/inject.py, attention.py) are checked against this code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trt.config import DrafterConfig
from dflash_trt.modeling.cache import KVCache
from dflash_trt.modeling.target import apply_rope, cached_attention


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for one absolute position axis (context and block share it)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.attention_scaling = 1.0
        if cfg.rope_scaling:
            # deferred: transformers takes ~0.6 s to import, and `dflash-trt --help` imports this module
            from transformers import Qwen3Config
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            rp = {"rope_theta": cfg.rope_theta, **cfg.rope_scaling}
            rope_type = rp.get("rope_type", rp.get("type"))
            hf_cfg = Qwen3Config(
                hidden_size=cfg.hidden_size,
                num_attention_heads=cfg.num_attention_heads,
                head_dim=cfg.head_dim,
                max_position_embeddings=cfg.max_position_embeddings,
                rope_parameters={**rp, "rope_type": rope_type},
            )
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, None)
        else:
            d = cfg.head_dim
            inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq  # [R, n, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        d, D = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, D
        self.q_proj = nn.Linear(d, self.num_heads * D, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * D, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * D, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * D, d, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.scale = D**-0.5

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (normed, rotated) and V of x [R, n, d] -> each [R, H_kv, n, D]."""
        R, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(R, n, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(R, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        R, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(R, n, self.num_heads, self.head_dim)).transpose(1, 2)
        return apply_rope(q, cos, sin)


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.self_attn = DrafterAttention(cfg)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.mlp = nn.ModuleDict(
            {
                "gate_proj": nn.Linear(d, f, bias=False),
                "up_proj": nn.Linear(d, f, bias=False),
                "down_proj": nn.Linear(f, d, bias=False),
            }
        )
        self.attention_conv = self.mlp_conv = None  # a family's convolutions around each (families/dflash2.py)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        m = self.mlp
        return m["down_proj"](F.silu(m["gate_proj"](x)) * m["up_proj"](x))


def cached_block_attention(cache: KVCache, positions: torch.Tensor, cfg: DrafterConfig):
    """The reference block attention: write the block's K/V into the scratch slots past the
    context, then attend over slots [0, ctx_len + B) of the row: no mask in a plain layer; a
    causal layer sees slots <= its own position, a sliding one slots within the window (both
    sides when not causal). Slot == absolute position, as the reference's key index is."""
    R, B = positions.shape
    upto = int(positions.max()) + 1
    slots = torch.arange(upto, device=positions.device)[None, None, :]  # [1, 1, S]
    limit = cache.lengths + B  # context + whole block
    plain = (slots < limit[:, None, None]).expand(R, B, upto)  # [R, B, S]
    masks: dict[tuple[bool, int | None], torch.Tensor] = {(False, None): plain}

    def visible(i: int) -> torch.Tensor:
        causal, window = key = cfg.layer_attention(i)
        if key not in masks:
            q = positions[:, :, None]  # [R, B, 1]
            m = plain & (slots <= q) if causal else plain
            if window is not None:
                m = m & (q - slots < window)
                if not causal:
                    m = m & (slots - q < window)
            masks[key] = m
        return masks[key]

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache.write(i, k, v, positions)
        k_all, v_all = cache.view(i, upto)
        return cached_attention(q, k_all, v_all, visible(i), q.shape[-1] ** -0.5)

    return attend
