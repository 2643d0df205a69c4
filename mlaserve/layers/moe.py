"""DeepSeek feed-forward: dense SwiGLU MLP (dense-first layers, shared experts) and the routed MoE.

Legend: `T` tokens, `h` hidden, `I` moe_intermediate_size / tp (this rank's share), `E` routed experts,
`K` experts per token. Routed experts are stacked at load time: w13 [E, 2I, h] (gate rows then up rows),
w2 [E, h, I]. Under tensor parallelism every expert (shared ones too) and the dense MLP are split along the
intermediate dimension: gate/up rows and down columns; the caller all-reduces the partial outputs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mlaserve.config import ModelConfig, QuantConfig
from mlaserve.distributed import TensorParallel
from mlaserve.layers.linear import SINGLE, Linear, MergedLinear, ShapeError, cdiv, copy_checked, shard
from mlaserve.layers.ops import Ops

# Up to this many tokens the shared experts run inside the fused-MoE call (decode: fewer, fuller launches);
# above it, as dense GEMMs (prefill: the grouped GEMM is slower than a plain one for an expert every token uses).
FUSE_SHARED_MAX_TOKENS = 256


class DenseMLP(torch.nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up as one stacked GEMM (checkpoint gate_proj / up_proj)."""

    def __init__(self, hidden: int, intermediate: int, *, quant: QuantConfig | None,
                 dtype: torch.dtype, device: torch.device | str, ops: Ops, tp: TensorParallel = SINGLE):
        super().__init__()
        kw = dict(quant=quant, dtype=dtype, device=device, ops=ops, tp=tp)
        self.gate_up_proj = MergedLinear(hidden, [intermediate, intermediate], tp_dim=0, **kw)
        self.down_proj = Linear(intermediate, hidden, tp_dim=1, **kw)               # partial sums
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj(x)                                                 # [T, 2I]
        return self.down_proj(self.ops.silu_and_mul(gu))


class Router(torch.nn.Module):
    """`mlp.gate`: fp32 logits over E experts; softmax or sigmoid (+ e_score_correction_bias) routing."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str, *, ops: Ops):
        super().__init__()
        self.cfg, self.ops = cfg, ops
        e, h = cfg.n_routed_experts, cfg.hidden_size
        self.weight = torch.nn.Parameter(torch.empty(e, h, dtype=dtype, device=device), requires_grad=False)
        self.weight.weight_loader = lambda name, p, t: copy_checked(name, p, t)
        self.e_score_correction_bias = None
        if cfg.topk_method == "noaux_tc":
            self.e_score_correction_bias = torch.nn.Parameter(
                torch.zeros(e, dtype=torch.float32, device=device), requires_grad=False)
            self.e_score_correction_bias.weight_loader = lambda name, p, t: copy_checked(name, p, t)

    def post_load(self) -> None:
        self.weight_f32 = self.weight.float()        # routing runs in fp32; convert once, not every step

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = getattr(self, "weight_f32", None)
        logits = F.linear(x.float(), self.weight.float() if w is None else w)  # [T, E]
        c = self.cfg
        return self.ops.moe_topk(logits, c.num_experts_per_tok, topk_method=c.topk_method, scoring_func=c.scoring_func,
                    n_group=c.n_group, topk_group=c.topk_group, norm_topk_prob=c.norm_topk_prob,
                    routed_scaling_factor=c.routed_scaling_factor,
                    e_score_correction_bias=self.e_score_correction_bias)  # weights [T, K] f32, ids [T, K]


class RoutedExperts(torch.nn.Module):
    """E SwiGLU experts as two stacked tensors, bf16 or block-FP8 (per-expert `weight_scale_inv`).

    The shared experts ride along as slots E .. E + n_shared - 1: a shared MLP of intermediate size
    n_shared * I is n_shared experts of size I side by side (SwiGLU is elementwise over the intermediate
    dimension), so one fused-MoE call computes routed and shared experts (every token routed to the
    shared slots with weight 1).
    """

    def __init__(self, cfg: ModelConfig, *, quant: QuantConfig | None, dtype: torch.dtype,
                 device: torch.device | str, ops: Ops, tp: TensorParallel = SINGLE):
        super().__init__()
        h, i = cfg.hidden_size, tp.split(cfg.moe_intermediate_size, "moe_intermediate_size")
        self.n_routed, self.n_shared = cfg.n_routed_experts, cfg.n_shared_experts
        e = self.n_routed + self.n_shared
        self.i, self.quant, self.ops, self.tp = i, quant, ops, tp
        wdtype = torch.float8_e4m3fn if quant else dtype
        self.w13 = torch.nn.Parameter(torch.empty(e, 2 * i, h, dtype=wdtype, device=device), requires_grad=False)
        self.w2 = torch.nn.Parameter(torch.empty(e, h, i, dtype=wdtype, device=device), requires_grad=False)
        self.w13_scale = self.w2_scale = None
        if quant:
            bn, bk = quant.block
            if i % bn:
                raise ShapeError(f"block-FP8 experts need moe_intermediate_size ({i}) divisible by {bn}")
            self.w13_scale = torch.nn.Parameter(torch.empty(e, 2 * i // bn, cdiv(h, bk), device=device),
                                                requires_grad=False)
            self.w2_scale = torch.nn.Parameter(torch.empty(e, cdiv(h, bn), i // bk, device=device),
                                               requires_grad=False)

    def load_expert(self, name: str, expert: int, proj: str, loaded: torch.Tensor, scale: bool) -> None:
        """Copy this rank's share of checkpoint tensor `mlp.experts.{expert}.{proj}.weight[_scale_inv]` into its
        stack (gate / up: rows of the intermediate dimension, down: its columns)."""
        down = proj == "down_proj"
        stack = (self.w2_scale if down else self.w13_scale) if scale else (self.w2 if down else self.w13)
        rows = stack.shape[1] // 2
        dst = stack[expert]
        if proj == "gate_proj":
            dst = dst[:rows]
        elif proj == "up_proj":
            dst = dst[rows:]
        copy_checked(name, dst, shard(name, loaded, 1 if down else 0, self.tp))

    def load_shared(self, name: str, proj: str, loaded: torch.Tensor, scale: bool) -> None:
        """Split `mlp.shared_experts.{proj}.weight[_scale_inv]` into the n_shared expert slots after the routed ones."""
        parts = loaded.chunk(self.n_shared, dim=1 if proj == "down_proj" else 0)
        for s, part in enumerate(parts):
            self.load_expert(name, self.n_routed + s, proj, part, scale)

    def shared_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The shared experts as dense GEMMs over their slots (large batches: better than the grouped GEMM)."""
        out = None
        for s in range(self.n_routed, self.n_routed + self.n_shared):
            gu = self._linear(x, self.w13[s], None if self.w13_scale is None else self.w13_scale[s])    # [T, 2I]
            h = self.ops.silu_and_mul(gu)                                                                # [T, I]
            y = self._linear(h, self.w2[s], None if self.w2_scale is None else self.w2_scale[s])         # [T, h]
            out = y if out is None else out + y
        return out

    def _linear(self, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, w) if scale is None else self.ops.fp8_linear(x, w, scale)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        # tuned tiles are keyed by the routed experts; the shared slots ride along
        return self.ops.fused_moe(x, self.w13, self.w2, weights, ids, w13_scale=self.w13_scale,
                                  w2_scale=self.w2_scale, num_routed_experts=self.n_routed)


class MoE(torch.nn.Module):
    """Router (replicated) + routed and shared experts; returns this rank's partial sum under TP."""

    def __init__(self, cfg: ModelConfig, *, quant: QuantConfig | None, dtype: torch.dtype,
                 device: torch.device | str, ops: Ops, tp: TensorParallel = SINGLE):
        super().__init__()
        self.gate = Router(cfg, dtype, device, ops=ops)
        self.experts = RoutedExperts(cfg, quant=quant, dtype=dtype, device=device, ops=ops, tp=tp)
        e, ns = cfg.n_routed_experts, cfg.n_shared_experts
        self.register_buffer("shared_ids", torch.arange(e, e + ns, dtype=torch.int32, device=device)[None], persistent=False)
        self.register_buffer("shared_weights", torch.ones(1, ns, dtype=torch.float32, device=device), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)                                           # [T, K] f32, [T, K] int32
        t = x.shape[0]
        if not self.shared_ids.shape[1]:
            return self.experts(x, weights, ids)
        if t <= FUSE_SHARED_MAX_TOKENS:                                       # + the shared slots, weight 1
            ids = torch.cat([ids.to(torch.int32), self.shared_ids.expand(t, -1)], dim=1)
            weights = torch.cat([weights, self.shared_weights.expand(t, -1)], dim=1)
            return self.experts(x, weights, ids)
        return self.experts(x, weights, ids) + self.experts.shared_forward(x)
