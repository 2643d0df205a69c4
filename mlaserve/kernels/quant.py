"""FP8 quantisation: per-token-group activations (group 128, scale = amax / 448) and 128x128 weight blocks.

Shapes: `M` rows (tokens), `K` channels, `G = ceil(K / group)` groups, `N` weight rows.
"""
from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0
FP8_E5M2_MAX = 57344.0
FP8_MIN_SCALE = 1e-10


def fp8_max(dtype: torch.dtype) -> float:
    return FP8_E5M2_MAX if dtype == torch.float8_e5m2 else FP8_E4M3_MAX


def per_token_group_quant_fp8_ref(x: torch.Tensor, group: int = 128,
                                  dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise activations per token per `group` channels.

    Args:
        x: [M, K] (any float dtype). K need not be a multiple of `group`.
    Returns:
        (x_q [M, K] fp8, scale [M, G] float32) with x ~= x_q * scale per group.
    """
    m, k = x.shape
    g = -(-k // group)
    xp = torch.nn.functional.pad(x.float(), (0, g * group - k)).view(m, g, group)
    amax = xp.abs().amax(dim=-1).clamp_min(FP8_MIN_SCALE)       # [M, G]
    scale = amax / fp8_max(dtype)
    xq = (xp / scale[..., None]).clamp(-fp8_max(dtype), fp8_max(dtype)).to(dtype)
    return xq.view(m, g * group)[:, :k].contiguous(), scale


def block_quant_fp8_ref(w: torch.Tensor, block: tuple[int, int] = (128, 128),
                        dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a weight [N, K] in `block` tiles: returns (w_q [N, K] fp8, scale_inv [ceil(N/bn), ceil(K/bk)] fp32).

    `scale_inv` is the DeepSeek-V3 checkpoint's `weight_scale_inv`: w ~= w_q * scale_inv (per block).
    """
    n, k = w.shape
    bn, bk = block
    gn, gk = -(-n // bn), -(-k // bk)
    wp = torch.nn.functional.pad(w.float(), (0, gk * bk - k, 0, gn * bn - n))
    tiles = wp.view(gn, bn, gk, bk)
    amax = tiles.abs().amax(dim=(1, 3)).clamp_min(FP8_MIN_SCALE)   # [gn, gk]
    scale_inv = amax / fp8_max(dtype)
    wq = (tiles / scale_inv[:, None, :, None]).clamp(-fp8_max(dtype), fp8_max(dtype)).to(dtype)
    return wq.view(gn * bn, gk * bk)[:n, :k].contiguous(), scale_inv


def block_dequant_ref(w_q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
                      dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of `block_quant_fp8_ref`: w [N, K] = w_q * scale_inv expanded over its blocks."""
    n, k = w_q.shape
    bn, bk = block
    s = scale_inv.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return (w_q.float() * s).to(dtype)
