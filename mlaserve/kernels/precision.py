"""How the Triton kernels' dots multiply: float32 operands in IEEE float32 (`--dtype float32` means float32 on
every device; Triton's own default on the GPU is TF32), 16-bit and FP8 operands as they are."""
from __future__ import annotations

import torch


def dot_precision(dtype: torch.dtype) -> str | None:
    """The `input_precision` constexpr of `tl.dot` for operands of `dtype` (None: Triton's default)."""
    return "ieee" if dtype == torch.float32 else None
