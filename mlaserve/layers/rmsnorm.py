"""RMSNorm as DeepSeek defines it (normalise in fp32, cast back, scale by the weight), optionally fused with
the residual add that precedes it: one Triton kernel or the PyTorch reference, as the model's `Ops` say."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mlaserve.layers.ops import Ops

if TYPE_CHECKING:
    from mlaserve.kernels.fp8_gemm import QuantPlan
    from mlaserve.layers.linear import Linear


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

    def into(self, linear: Linear, x: torch.Tensor, residual: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(linear(norm(x)), None), or with `residual` (linear(norm(x + residual)), x + residual): the norm's kernel
        quantises its output for an FP8 linear that would otherwise quantise it in a pass of its own."""
        plan = linear.prequant(x)
        if plan is None:
            h = self(x) if residual is None else self(x, residual)
            return (linear(h), None) if residual is None else (linear(h[0]), h[1])
        return self.quantized_into(linear, x, residual, plan)

    def quantized_into(self, linear: Linear, x: torch.Tensor, residual: torch.Tensor | None,
                       plan: QuantPlan) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`into` where linear.prequant(x) gave `plan`."""
        x_q, x_scale = self.ops.rmsnorm_quant(x, self.weight, self.eps, residual, plan)
        return linear.forward_quantized(x_q, x_scale, x.shape[0], plan), residual
