"""RMSNorm as DeepSeek defines it (normalise in fp32, cast back, scale by the weight), optionally fused with
the residual add that precedes it: one Triton kernel on the GPU, the PyTorch reference on the CPU."""
from __future__ import annotations

import torch

from mlaserve.kernels import norm as norm_kernels

# NOTE: Triton launchers stay opaque to torch.compile (it compiles the torch code between them)
_rmsnorm = torch.compiler.disable(norm_kernels.rmsnorm)
_fused_add_rmsnorm = torch.compiler.disable(norm_kernels.fused_add_rmsnorm)


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu"):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with `residual`: (norm(x + residual), x + residual) (on the GPU `residual` is updated in place)."""
        if residual is None:
            fn = _rmsnorm if x.is_cuda else norm_kernels.rmsnorm_ref
            return fn(x, self.weight, self.eps)
        fn = _fused_add_rmsnorm if x.is_cuda else norm_kernels.fused_add_rmsnorm_ref
        return fn(x, residual, self.weight, self.eps)
