"""RMSNorm as DeepSeek defines it (normalise in fp32, cast back, scale by the weight), optionally fused with
the residual add that precedes it: one Triton kernel or the PyTorch reference, as the model's `Ops` say."""
from __future__ import annotations

import torch

from mlaserve.layers.ops import Ops


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str, *, ops: Ops):
        super().__init__()
        self.eps, self.ops = eps, ops
        self.weight = torch.nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with `residual`: (norm(x + residual), x + residual) (the Triton kernel updates `residual`
        in place)."""
        if residual is None:
            return self.ops.rmsnorm(x, self.weight, self.eps)
        return self.ops.fused_add_rmsnorm(x, residual, self.weight, self.eps)
