"""Linear layers: bf16/fp32 or DeepSeek block-FP8 (e4m3 weight + float32 `weight_scale_inv` per 128x128 block).

Tensor parallel: `tp_dim=0` shards the output rows (column parallel), `tp_dim=1` the input columns (row
parallel: the caller all-reduces the partial outputs); each parameter carries a `weight_loader` that slices the
full checkpoint tensor (block-FP8 scales on the same 128-block boundaries).
"""
from __future__ import annotations

import torch

from mlaserve.config import QuantConfig
from mlaserve.distributed import TensorParallel
from mlaserve.kernels.fp8_gemm import QuantPlan
from mlaserve.layers.ops import Ops

SINGLE = TensorParallel()


class ShapeError(ValueError):
    """A checkpoint tensor does not have the shape the model expects (message names both)."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def copy_checked(name: str, param: torch.Tensor, loaded: torch.Tensor) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ShapeError(f"{name}: checkpoint shape {list(loaded.shape)}, expected {list(param.shape)}")
    param.data.copy_(loaded.to(param.dtype))


def shard(name: str, t: torch.Tensor, dim: int | None, tp: TensorParallel) -> torch.Tensor:
    """Part `tp.rank` of `t` cut along `dim` into `tp.size` equal parts (ShapeError naming `name` otherwise)."""
    if dim is None or tp.size == 1:
        return t
    n = t.shape[dim]
    if n % tp.size:
        raise ShapeError(f"{name}: dimension {dim} of shape {list(t.shape)} does not split into --tp-size {tp.size} "
                         "equal parts")
    part = n // tp.size
    return t.narrow(dim, tp.rank * part, part)


class Linear(torch.nn.Module):
    """y = x @ W^T (+ b). With `quant`, W is block-FP8 and activations are quantised per token per 128
    (`ops.fp8_linear`)."""

    def __init__(self, in_features: int, out_features: int, *, ops: Ops, bias: bool = False,
                 quant: QuantConfig | None = None, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu", tp: TensorParallel = SINGLE, tp_dim: int | None = None):
        super().__init__()
        self.ops = ops
        self.tp, self.tp_dim = tp, tp_dim
        out_local = tp.split(out_features, "output features") if tp_dim == 0 else out_features
        in_local = tp.split(in_features, "input features") if tp_dim == 1 else in_features
        self.in_features, self.out_features = in_local, out_local
        self.quant, self.dtype = quant, dtype
        wdtype = torch.float8_e4m3fn if quant else dtype
        self.weight = torch.nn.Parameter(torch.empty(out_local, in_local, dtype=wdtype, device=device),
                                         requires_grad=False)
        self.weight.weight_loader = self._load_weight
        if quant:
            bn, bk = quant.block
            self.weight_scale_inv = torch.nn.Parameter(
                torch.empty(cdiv(out_local, bn), cdiv(in_local, bk), dtype=torch.float32, device=device),
                requires_grad=False)
            self.weight_scale_inv.weight_loader = self._load_scale
        self.bias = None
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(out_local, dtype=dtype, device=device), requires_grad=False)
            self.bias.weight_loader = self._load_bias

    def _load_weight(self, name: str, param: torch.Tensor, loaded: torch.Tensor) -> None:
        copy_checked(name, param, shard(name, loaded, self.tp_dim, self.tp))

    _load_scale = _load_weight           # [ceil(N/128), ceil(K/128)]: cut along the same dimension

    def _load_bias(self, name: str, param: torch.Tensor, loaded: torch.Tensor) -> None:
        if self.tp_dim == 1 and self.tp.rank:
            loaded = torch.zeros_like(loaded)      # row parallel: the bias is added once, by rank 0, before the sum
        copy_checked(name, param, shard(name, loaded, 0 if self.tp_dim == 0 else None, self.tp))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is None:
            return self.ops.linear(x, self.weight, self.bias)
        y = self.ops.fp8_linear(x, self.weight, self.weight_scale_inv)
        return y if self.bias is None else y + self.bias

    def prequant(self, x: torch.Tensor) -> QuantPlan | None:
        """The layout in which a producer of this linear's input x [T, K] (or a tensor of its shape and device:
        its unnormed input) may quantise it in its own kernel, for `forward_quantized`; None where the linear
        quantises inside its kernel or has 16-bit weights (call it on the 16-bit input instead)."""
        return None if self.quant is None else self.ops.fp8_quant_plan(x.shape[0], x, self.weight)

    def forward_quantized(self, x_q: torch.Tensor, x_scale: torch.Tensor, m: int, plan: QuantPlan) -> torch.Tensor:
        """forward() of the m rows that x_q / x_scale hold quantised as `plan` (`prequant`) says."""
        return self.ops.fp8_linear_quantized(x_q, x_scale, m, plan, self.weight, self.weight_scale_inv, self.bias,
                                             self.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fp8={self.quant is not None}"


class MergedLinear(Linear):
    """Linears sharing their input, stacked along the output (gate_proj + up_proj -> gate_up_proj): one GEMM.

    `load_part(name, i, tensor, scale)` copies checkpoint tensor part i (its weight or its FP8 scale_inv) into
    its rows; with FP8 each part must start on a 128-row block. `sharded[i]` says whether part i is
    column-parallel (cut by the TP rank) or replicated; default: every part as `tp_dim` says.
    """

    def __init__(self, in_features: int, out_parts: list[int], *, sharded: list[bool] | None = None, **kw):
        tp, tp_dim = kw.get("tp", SINGLE), kw.pop("tp_dim", None)
        self.sharded = [tp_dim == 0] * len(out_parts) if sharded is None else list(sharded)
        local = [tp.split(n, "output features") if s else n for n, s in zip(out_parts, self.sharded)]
        super().__init__(in_features, sum(local), **kw)
        self.tp_dim, self.out_parts = tp_dim, local
        if self.quant is not None and any(n % self.quant.block[0] for n in self.out_parts[:-1]):
            raise ShapeError(f"block-FP8 parts {self.out_parts} must be multiples of {self.quant.block[0]}")

    @staticmethod
    def can_merge(parts: list[int], quant: QuantConfig | None) -> bool:
        """Whether local output parts of these sizes can be one MergedLinear (FP8: blocks must not straddle)."""
        return quant is None or all(n % quant.block[0] == 0 for n in parts[:-1])

    def load_part(self, name: str, part: int, loaded: torch.Tensor, scale: bool) -> None:
        start, n = sum(self.out_parts[:part]), self.out_parts[part]
        if scale:
            bn = self.quant.block[0]
            dst = self.weight_scale_inv.narrow(0, start // bn, cdiv(n, bn))
        else:
            dst = self.weight.narrow(0, start, n)
        copy_checked(name, dst, shard(name, loaded, 0 if self.sharded[part] else None, self.tp))
