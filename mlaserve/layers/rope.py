"""Rotary embedding for MLA's decoupled rope dims, with YaRN (DeepSeek-V2 sec. 2.1; YaRN paper).

Legend: `T` tokens, `H` heads, `R` qk_rope_head_dim. The checkpoint's rope dims are interleaved pairs;
`kernels/rope.py` returns them de-interleaved (evens then odds, each rotated), the same for q and k, so q.k
is unchanged and the latent KV cache stores k_pe in that layout.
"""
from __future__ import annotations

import math

import torch

from mlaserve.config import ModelConfig, yarn_mscale


def yarn_inv_freq(dim: int, base: float, factor: float, original_max: int,
                  beta_fast: float, beta_slow: float) -> torch.Tensor:
    """Per-pair inverse frequencies [R/2], blending interpolation and extrapolation by a linear ramp."""
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extra, inter = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extra_weight = 1 - ramp
    return inter * (1 - extra_weight) + extra * extra_weight


def build_cos_sin_cache(cfg: ModelConfig, max_pos: int) -> torch.Tensor:
    """[max_pos, R] float32: cos in the first R/2 columns, sin in the last, YaRN mscale folded in."""
    dim, rs = cfg.qk_rope_head_dim, cfg.rope_scaling
    if rs is None or rs.factor <= 1:
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        mscale = 1.0
    else:
        inv_freq = yarn_inv_freq(dim, cfg.rope_theta, rs.factor, rs.original_max_position_embeddings,
                                 rs.beta_fast, rs.beta_slow)
        mscale = (yarn_mscale(rs.factor, rs.mscale) / yarn_mscale(rs.factor, rs.mscale_all_dim)
                  if rs.mscale and rs.mscale_all_dim else yarn_mscale(rs.factor))
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]   # [P, R/2]
    return torch.cat([freqs.cos() * mscale, freqs.sin() * mscale], dim=-1)


class RotaryEmbedding(torch.nn.Module):
    """Holds the cos/sin table [max_pos, R] the model's `ops.mla_rope_kv_store` rotates q_pe and k_pe with."""

    def __init__(self, cfg: ModelConfig, max_pos: int | None = None, device: torch.device | str = "cpu"):
        super().__init__()
        max_pos = max_pos or cfg.max_position_embeddings
        self.register_buffer("cos_sin_cache", build_cos_sin_cache(cfg, max_pos).to(device), persistent=False)
