"""DeepSeek feed-forward: dense SwiGLU MLP (dense-first layers, shared experts) and the routed MoE.

Legend: `T` tokens, `h` hidden, `I` moe_intermediate_size / tp (this rank's share), `E` routed experts,
`K` experts per token. Routed experts are stacked at load time: w13 [E, 2I, h] (gate rows then up rows),
w2 [E, h, I]. Under tensor parallelism every expert (shared ones too) and the dense MLP are split along the
intermediate dimension: gate/up rows and down columns; the caller all-reduces the partial outputs. Under expert
parallelism (--ep-size) each expert set of tp / ep ranks holds E / ep routed experts, split over its ranks (whole at
ep = tp; shared ones stay split over all ranks).
"""
from __future__ import annotations

import torch

from mlaserve.config import ModelConfig, QuantConfig
from mlaserve.core import compile_opaque
from mlaserve.distributed import TensorParallel
from mlaserve.distributed.expert import AllToAllDispatcher, ExpertParallel
from mlaserve.env import on_off
from mlaserve.kernels.allreduce import LLGroup
from mlaserve.kernels.fused_moe import COMBINE_MAX_TOKENS
from mlaserve.kernels.gemv import bucket_rows, cublas_linear, pads_rows
from mlaserve.kernels.moe_topk import route_config
from mlaserve.layers.linear import SINGLE, Linear, MergedLinear, ShapeError, cdiv, copy_checked, shard
from mlaserve.layers.ops import Ops
from mlaserve.layers.rmsnorm import RMSNorm

# Up to this many tokens the shared experts run inside the fused-MoE call (decode: fewer, fuller launches);
# above it, as dense GEMMs (prefill: the grouped GEMM is slower than a plain one for an expert every token uses).
FUSE_SHARED_MAX_TOKENS = 256
# Up to this many tokens the router is one launch (`moe_route`: gate GEMV + top-k); above it a cuBLAS fp32 GEMM
# and `moe_topk`. Measured by benchmarks/gpu_moe_fuse.sh (route part) on an H100: it won up to 128 tokens for
# V2-Lite's 64 x 2048 gate (8-18 us vs 18-24), up to 16 for V3's 256 x 7168 (it re-reads the gate per token).
ROUTE_FUSED_MAX_TOKENS = 128
ROUTE_FUSED_MAX_TOKENS_LARGE = 16           # gates of more than ROUTE_SMALL_GATE values
ROUTE_SMALL_GATE = 64 * 2048
# Up to this many tokens the post-attention RMSNorm (and its residual add) runs inside the router's launch
# (`moe_route_norm`: every program re-reads its token's row for the mean square). benchmarks/bench_decode_fold.py
# on an H100 (benchmarks/results/decode-fold-h100.md): 0.8-1.0 us faster than norm + router for V2-Lite's gate at
# 1-16 tokens; for V3's 256 x 7168 gate 1.2 us faster at one token, 3.6 us slower at 4 and 24 us at 16.
NORM_FOLD_MAX_TOKENS = 16
NORM_FOLD_MAX_TOKENS_LARGE = 1


def shared_in_router_enabled() -> bool:
    """One token's shared experts run their gate / up inside the router's launch, beside the routing programs
    (`moe_route_norm(shared=...)`), so their weights stream while the routing waits and selects.
    MLASERVE_SHARED_IN_ROUTER=0: in the fused-MoE call instead (A/B runs)."""
    return on_off("MLASERVE_SHARED_IN_ROUTER", True)


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
        return self._down(self.gate_up_proj(x))

    def forward_norm(self, x: torch.Tensor, residual: torch.Tensor,
                     norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(forward(norm(x + residual)), x + residual), the norm quantising for an FP8 gate_up_proj (`RMSNorm.into`)."""
        gu, residual = norm.into(self.gate_up_proj, x, residual)
        return self._down(gu), residual

    def _down(self, gu: torch.Tensor) -> torch.Tensor:
        # gu: [T, 2I] -> down_proj(silu(gate) * up) [T, h]
        d = self.down_proj
        if d.quant is None:
            return d(self.ops.silu_and_mul(gu))
        return swiglu_fp8(self.ops, gu, d.weight, d.weight_scale_inv, d.bias)


def swiglu_fp8(ops: Ops, gu: torch.Tensor, w_q: torch.Tensor, w_scale_inv: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp8_linear(silu_and_mul(gu), w_q, w_scale_inv) + bias for gu [T, 2I]: the activation's kernel quantises its
    output where the linear would run a quantisation pass of its own (`fp8_gemm.quant_plan`)."""
    plan = ops.fp8_quant_plan(gu.shape[0], gu, w_q)
    if plan is None:
        y = ops.fp8_linear(ops.silu_and_mul(gu), w_q, w_scale_inv)
        return y if bias is None else y + bias
    y_q, y_scale = ops.silu_and_mul_quant(gu, plan)
    return ops.fp8_linear_quantized(y_q, y_scale, gu.shape[0], plan, w_q, w_scale_inv, bias, gu.dtype)


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
        small = e * h <= ROUTE_SMALL_GATE
        self.route_max_tokens = ROUTE_FUSED_MAX_TOKENS if small else ROUTE_FUSED_MAX_TOKENS_LARGE
        self.norm_fold_max_tokens = NORM_FOLD_MAX_TOKENS if small else NORM_FOLD_MAX_TOKENS_LARGE
        self.norm_tile = route_config(e, h)["BLOCK_H"]          # moe_route_norm's row tile (shared= needs h within)
        # NOTE: `moe_route`'s arrival counts, zero between launches; one per layer, as layers run one at a time
        self.register_buffer("route_sync", torch.zeros(self.route_max_tokens, dtype=torch.int32, device=device),
                             persistent=False)

    def post_load(self) -> None:
        self.weight_f32 = self.weight.float()        # routing runs in fp32; convert once, not every step

    def forward(self, x: torch.Tensor, n_shared: int = 0,
                row_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, h] -> (weights [T, K + n_shared] f32, global ids [T, K + n_shared] int32); the n_shared shared
        slots (ids E .., weight 1) come last. `row_mask` [T] bool: rows where it is False get every id -1."""
        c, kw = self.cfg, self._routing(n_shared, row_mask)
        if x.shape[0] <= self.route_max_tokens:    # the gate weight as stored: upcasting it is exact
            return self.ops.moe_route(x, self.weight, c.num_experts_per_tok, sync=self.route_sync, **kw)
        # NOTE: not under torch.compile (decode batches up to its max bs): mm's out_dtype overload is left to eager
        if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and self.weight.dtype == x.dtype \
                and not torch.compiler.is_compiling():
            logits = cublas_linear(x, self.weight, out_dtype=torch.float32)          # [T, E]: exact products, fp32 sums
        else:
            w = getattr(self, "weight_f32", None)
            logits = cublas_linear(x.float(), self.weight.float() if w is None else w)  # [T, E]
        return self.ops.moe_topk(logits, c.num_experts_per_tok, **kw)

    def route_normed(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, n_shared: int = 0,
                     all_reduce: LLGroup | None = None, row_mask: torch.Tensor | None = None,
                     shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
        """forward(norm(x + residual)) in one launch, up to `route_max_tokens` tokens; returns (weights, ids,
        norm(x + residual), x + residual). `all_reduce`: x is this rank's share, summed over the ranks first in the
        same launch (the Triton kernel)."""
        assert x.shape[0] <= self.route_max_tokens, f"route_normed takes at most {self.route_max_tokens} tokens"
        kw = {} if all_reduce is None else {"all_reduce": all_reduce}       # (the torch reference takes none)
        if shared is not None:
            kw["shared"] = shared
        return self.ops.moe_route_norm(x, residual, norm.weight, norm.eps, self.weight, self.cfg.num_experts_per_tok,
                                       sync=self.route_sync, **self._routing(n_shared, row_mask), **kw)

    def _routing(self, n_shared: int, row_mask: torch.Tensor | None = None) -> dict:
        c = self.cfg
        return dict(row_mask=row_mask, topk_method=c.topk_method, scoring_func=c.scoring_func, n_group=c.n_group,
                    topk_group=c.topk_group, norm_topk_prob=c.norm_topk_prob,
                    routed_scaling_factor=c.routed_scaling_factor,
                    e_score_correction_bias=self.e_score_correction_bias, n_shared=n_shared)


class ExpertStack(torch.nn.Module):
    """n SwiGLU experts of intermediate size i stacked: w13 [n, 2i, h] (gate rows then up rows), w2 [n, h, i],
    bf16 or block-FP8 (per-expert `weight_scale_inv`)."""

    def __init__(self, n: int, h: int, i: int, *, quant: QuantConfig | None, dtype: torch.dtype,
                 device: torch.device | str, ops: Ops):
        super().__init__()
        self.i, self.quant, self.ops = i, quant, ops
        wdtype = torch.float8_e4m3fn if quant else dtype
        self.w13 = torch.nn.Parameter(torch.empty(n, 2 * i, h, dtype=wdtype, device=device), requires_grad=False)
        self.w2 = torch.nn.Parameter(torch.empty(n, h, i, dtype=wdtype, device=device), requires_grad=False)
        self.w13_scale = self.w2_scale = None
        if quant:
            bn, bk = quant.block
            if i % bn:
                raise ShapeError(f"block-FP8 experts need moe_intermediate_size ({i}) divisible by {bn}")
            self.w13_scale = torch.nn.Parameter(torch.empty(n, 2 * i // bn, cdiv(h, bk), device=device),
                                                requires_grad=False)
            self.w2_scale = torch.nn.Parameter(torch.empty(n, cdiv(h, bn), i // bk, device=device),
                                               requires_grad=False)

    def load_slot(self, name: str, slot: int, proj: str, loaded: torch.Tensor, scale: bool,
                  tp: TensorParallel) -> None:
        """Copy `tp`'s share of checkpoint tensor `...{proj}.weight[_scale_inv]` into slot `slot` (gate / up: rows
        of the intermediate dimension, down: its columns)."""
        down = proj == "down_proj"
        stack = (self.w2_scale if down else self.w13_scale) if scale else (self.w2 if down else self.w13)
        rows = stack.shape[1] // 2
        dst = stack[slot]
        if proj == "gate_proj":
            dst = dst[:rows]
        elif proj == "up_proj":
            dst = dst[rows:]
        copy_checked(name, dst, shard(name, loaded, 1 if down else 0, tp))

    def dense_forward(self, x: torch.Tensor, slots: range) -> torch.Tensor:
        """Sum of the experts in `slots` over every token, as dense GEMMs (no routing)."""
        if self.w2_scale is None and len(slots) > 1 and x.shape[0]:
            return self._dense_side_by_side(x, slots)
        out = None
        for s in slots:
            gu = self._linear(x, self.w13[s], None if self.w13_scale is None else self.w13_scale[s])    # [T, 2I]
            if self.w2_scale is None:
                y = cublas_linear(self.ops.silu_and_mul(gu), self.w2[s])                                 # [T, h]
            else:
                y = swiglu_fp8(self.ops, gu, self.w2[s], self.w2_scale[s])
            out = y if out is None else out + y
        return out

    def _dense_side_by_side(self, x: torch.Tensor, slots: range) -> torch.Tensor:
        # bf16 experts (V2 / V2-Lite's two shared ones): their stacked gate / up rows [n * 2I, h] are one GEMM's
        # weight (a view); SwiGLU over its [T * n, 2I] view gives [T, n * I], each expert's I columns side by side;
        # the first down GEMM writes the sum and the others add into it in cuBLAS (beta = 1). The rows go through at
        # cublas_linear's bucket size once (not padded per GEMM). Six launches a layer fewer than a GEMM pair, a
        # SwiGLU and an add per expert (benchmarks/results/extend-staging-h200.md).
        assert slots.step == 1, f"expert slots must be consecutive, got {slots}"
        m, n, i = x.shape[0], len(slots), self.w2.shape[2]
        mp = bucket_rows(m) if pads_rows(x) else m
        xp = torch.nn.functional.pad(x, (0, 0, 0, mp - m)) if mp != m else x
        w13 = self.w13[slots.start:slots.stop].reshape(n * 2 * i, x.shape[1])               # a view
        act = self.ops.silu_and_mul(cublas_linear(xp, w13, pad=False).view(mp * n, 2 * i)).reshape(mp, n * i)
        y = cublas_linear(act[:, :i], self.w2[slots.start], pad=False)                      # [mp, h]
        for j in range(1, n):
            y.addmm_(act[:, j * i:(j + 1) * i], self.w2[slots.start + j].t())
        return y[:m]

    def _linear(self, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        return cublas_linear(x, w) if scale is None else self.ops.fp8_linear(x, w, scale)


class RoutedExperts(ExpertStack):
    """This rank's routed experts as one stack (`ExpertStack`), and the shared experts.

    Tensor parallel (ep 1): every expert split along the intermediate dimension, and the shared experts ride
    along as slots E .. E + n_shared - 1: a shared MLP of intermediate size n_shared * I is n_shared experts of
    size I side by side (SwiGLU is elementwise over the intermediate dimension), so one fused-MoE call computes
    routed and shared experts (every token routed to the shared slots with weight 1).
    Expert parallel (`ep`, over the TP ranks): the stack holds E / ep experts (`ExpertParallel` says which), whole or
    split over the ranks of this rank's expert set;
    the shared experts stay TP-split in their own stack `shared` (a different width), computed as dense GEMMs.
    `whole_shared` (the all-to-all dispatch) adds `shared_whole`: the shared experts whole, for a rank's own rows.
    """

    def __init__(self, cfg: ModelConfig, *, quant: QuantConfig | None, dtype: torch.dtype,
                 device: torch.device | str, ops: Ops, tp: TensorParallel = SINGLE, ep: ExpertParallel | None = None,
                 whole_shared: bool = False):
        ep = ep or ExpertParallel()
        h, n_shared, n_local = cfg.hidden_size, cfg.n_shared_experts, ep.split(cfg.n_routed_experts)
        fused = ep.ep_size == 1
        # under EP each expert set's moe_tp ranks split its experts' intermediate dimension (whole at ep = tp)
        i = (tp if fused else ep.inter).split(cfg.moe_intermediate_size, "moe_intermediate_size")
        kw = dict(quant=quant, dtype=dtype, device=device, ops=ops)
        super().__init__(n_local + (n_shared if fused else 0), h, i, **kw)
        self.n_total, self.n_routed, self.n_shared, self.tp, self.ep = cfg.n_routed_experts, n_local, n_shared, tp, ep
        # NOTE: fused_moe's per-tile arrival counts (its in-GEMM combine), zero between launches
        self.register_buffer("combine_sync", torch.zeros(cdiv(h, 16), dtype=torch.int32, device=device),
                             persistent=False)
        self.shared = self.shared_whole = None
        if not fused and n_shared:
            self.shared = ExpertStack(n_shared, h, tp.split(cfg.moe_intermediate_size, "moe_intermediate_size"),
                                      **kw)
        if whole_shared and n_shared:
            self.shared_whole = ExpertStack(n_shared, h, cfg.moe_intermediate_size, **kw)

    def holds(self, expert: int) -> bool:
        """Whether global routed expert `expert` lives on this rank (the loader reads no other)."""
        return self.ep.holds(expert, self.n_total)

    def load_expert(self, name: str, expert: int, proj: str, loaded: torch.Tensor, scale: bool) -> None:
        """Copy checkpoint tensor `mlp.experts.{expert}.{proj}.weight[_scale_inv]` into its slot (this rank's TP
        share under tensor parallelism, whole under expert parallelism)."""
        if not self.holds(expert):
            raise ValueError(f"{name}: expert {expert} is not held by EP rank {self.ep.ep_rank} of {self.ep.ep_size}")
        share = self.ep.inter if self.ep.ep_size > 1 else self.tp
        self.load_slot(name, expert - self.ep.first(self.n_total), proj, loaded, scale, share)

    def load_shared(self, name: str, proj: str, loaded: torch.Tensor, scale: bool) -> None:
        """Split `mlp.shared_experts.{proj}.weight[_scale_inv]` into n_shared expert slots (after the routed ones,
        or in `shared`), each TP-split."""
        parts = loaded.chunk(self.n_shared, dim=1 if proj == "down_proj" else 0)
        stack, first = (self, self.n_routed) if self.shared is None else (self.shared, 0)
        for s, part in enumerate(parts):
            stack.load_slot(name, first + s, proj, part, scale, self.tp)
            if self.shared_whole is not None:
                self.shared_whole.load_slot(name, s, proj, part, scale, SINGLE)

    def shared_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The shared experts as dense GEMMs (large batches: better than the grouped GEMM; always under EP)."""
        if self.shared is not None:
            return self.shared.dense_forward(x, range(self.n_shared))
        return self.dense_forward(x, range(self.n_routed, self.n_routed + self.n_shared))

    def forward_norm(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, residual: torch.Tensor,
                     norm: RMSNorm, all_reduce: LLGroup | None = None, h: torch.Tensor | None = None,
                     h_ready: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """forward, then the next layer's input norm inside the combine (`fused_moe_norm`, one token): returns
        (norm(out + residual), out + residual); with `all_reduce`, out summed over the ranks first. `h`, `h_ready`:
        as `fused_moe_norm`'s (the shared slots' first half done in the router's launch)."""
        kw = {} if all_reduce is None else {"all_reduce": all_reduce}       # (the torch reference takes none)
        return self.ops.fused_moe_norm(x, self.w13, self.w2, weights, ids, residual, norm.weight, norm.eps,
                                       sync=self.combine_sync, w13_scale=self.w13_scale, w2_scale=self.w2_scale,
                                       num_routed_experts=self.n_routed, h=h, h_ready=h_ready, **kw)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """ids: local slots ([0, n_routed), the shared slots, or -1 for another rank's expert)."""
        # tuned tiles are keyed by this rank's routed experts; the shared slots ride along
        return self.ops.fused_moe(x, self.w13, self.w2, weights, ids, w13_scale=self.w13_scale,
                                  w2_scale=self.w2_scale, num_routed_experts=self.n_routed, sync=self.combine_sync)


class MoE(torch.nn.Module):
    """Router (replicated) + routed and shared experts; returns this rank's partial sum under TP / EP (the caller
    all-reduces): under EP the experts of other ranks contribute zero here and their own share there.

    `all_to_all` (DP attention + EP, --moe-dispatch all_to_all): `forward_all_to_all` routes this rank's own rows
    and sends each to the ranks holding its experts (`AllToAllDispatcher`); while `all_to_all_on` (eager forwards:
    the model turns it off while CUDA graphs are captured) the decoder layer takes that path instead of the gather.
    """

    def __init__(self, cfg: ModelConfig, *, quant: QuantConfig | None, dtype: torch.dtype,
                 device: torch.device | str, ops: Ops, tp: TensorParallel = SINGLE, ep: ExpertParallel | None = None,
                 all_to_all: bool = False):
        super().__init__()
        self.gate = Router(cfg, dtype, device, ops=ops)
        self.experts = RoutedExperts(cfg, quant=quant, dtype=dtype, device=device, ops=ops, tp=tp, ep=ep,
                                     whole_shared=all_to_all)
        ex = self.experts
        self.shared_in_router_on = shared_in_router_enabled()
        self.dispatcher = AllToAllDispatcher(ex.ep, ex.n_total) if all_to_all else None
        self.all_to_all_on = all_to_all

    def takes_norm(self, num_tokens: int) -> bool:
        """Whether `forward_normed` folds the post-attention norm into the router's launch (decode sizes)."""
        return num_tokens <= self.gate.norm_fold_max_tokens

    def takes_next_norm(self, num_tokens: int) -> bool:
        """Whether `forward_normed` can also run the next layer's input norm inside the experts' combine (one
        token, experts not split by EP; under tensor parallelism with the sum over the ranks in that combine too:
        `forward_normed`'s all_reduce)."""
        return num_tokens <= COMBINE_MAX_TOKENS and num_tokens <= FUSE_SHARED_MAX_TOKENS and self.experts.ep.ep_size == 1

    def shared_in_router(self, x: torch.Tensor, sum_in: LLGroup | None, n_shared: int) -> bool:
        """Whether one token's shared experts (fused as slots) run their gate / up inside the router's launch
        (`moe_route_norm(shared=...)`; MLASERVE_SHARED_IN_ROUTER=0 turns it off): bf16 / fp16 / fp32 weights, the
        Triton kernels, no sum over the ranks in the router."""
        ex = self.experts
        return (self.shared_in_router_on and n_shared > 0 and x.shape[0] == 1 and sum_in is None and ex.quant is None
                and ex.ops.name == "triton" and x.shape[1] <= self.gate.norm_tile)

    def sums_in_kernels(self) -> bool:
        """Whether the router and the experts' combine can run the all-reduce themselves (the Triton kernels:
        `moe_route_norm`, `fused_moe_norm`)."""
        return self.experts.ops.name == "triton"

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm,
                       next_norm: RMSNorm | None = None, all_reduce: LLGroup | None = None,
                       sum_in: LLGroup | None = None,
                       row_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """forward(norm(x + residual)) with the add and norm inside the router's launch (`takes_norm`); returns
        (output, x + residual). With `next_norm` (`takes_next_norm`): (next_norm(output + x + residual),
        output + x + residual), the next layer's input norm done in the experts' combine; with `all_reduce` too
        (`sums_in_kernels`), output summed over the tensor-parallel ranks there first. `sum_in`: x is this rank's
        share, summed over the ranks in the router's launch. `row_mask`: as `forward`'s."""
        return self._forward(x, (residual, norm), next_norm, all_reduce, sum_in, row_mask)

    def forward(self, x: torch.Tensor, row_mask: torch.Tensor | None = None) -> torch.Tensor:
        """`row_mask` [T] bool: the rows to route (the others, padding, route to no expert: their output is zero
        and no expert's weights are read for them); None: every row."""
        return self._forward(x, None, row_mask=row_mask)[0]

    # NOTE: the row counts come to the host (a sync): never inside a CUDA graph or a torch.compile trace
    @compile_opaque
    def forward_all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, h] this rank's rows (n may be 0: an IDLE forward) -> [n, h] their whole MoE output: the routed
        experts on the ranks holding them (rows sent there and back), the shared experts here, whole."""
        ex, k = self.experts, self.gate.cfg.num_experts_per_tok
        if x.shape[0]:
            weights, ids = self.gate(x)                                      # [n, K] f32, [n, K] global ids
        else:
            weights = torch.empty(0, k, dtype=torch.float32, device=x.device)
            ids = torch.empty(0, k, dtype=torch.int32, device=x.device)
        d = self.dispatcher.dispatch(x, weights, ids)                        # [R, h] rows from every rank
        y = ex(d.x, d.weights, d.ids) if d.x.shape[0] else d.x               # [R, h] this rank's experts' sum
        out = self.dispatcher.combine(y, d)                                  # [n, h] summed over every expert
        if ex.shared_whole is not None and x.shape[0]:
            out = out + ex.shared_whole.dense_forward(x, range(ex.n_shared))
        return out

    def _forward(self, x: torch.Tensor, norm: tuple[torch.Tensor, RMSNorm] | None,
                 next_norm: RMSNorm | None = None, all_reduce: LLGroup | None = None,
                 sum_in: LLGroup | None = None,
                 row_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        # norm = (residual, RMSNorm): x is the un-normed attention output; returns (output, x + residual or None),
        # or with next_norm (and norm) the next layer's normed input and residual stream
        ex = self.experts
        ep = ex.ep.ep_size > 1
        fuse_shared = not ep and x.shape[0] <= FUSE_SHARED_MAX_TOKENS
        # [T, K (+ n_shared)]: the shared slots E .. E + n_shared - 1 (weight 1) ride along in the fused call
        n_shared = ex.n_shared if fuse_shared else 0
        residual = None
        # one token: the shared slots' gate / up in the router's launch (`moe_route_norm(shared=...)`), into h
        fold = next_norm is not None and norm is not None and self.shared_in_router(x, sum_in, n_shared)
        h = torch.empty(self.gate.cfg.num_experts_per_tok + n_shared, ex.i, dtype=x.dtype, device=x.device) \
            if fold else None
        # row_mask: padding rows get every slot -1 (in the router's launch)
        if norm is None:
            weights, ids = self.gate(x, n_shared=n_shared, row_mask=row_mask)  # [T, K] f32, [T, K] int32 global
        else:
            shared = (ex.w13[ex.n_routed:ex.n_routed + n_shared], h[h.shape[0] - n_shared:]) if fold else None
            weights, ids, x, residual = self.gate.route_normed(x, *norm, n_shared=n_shared, all_reduce=sum_in,
                                                               row_mask=row_mask, shared=shared)
        if next_norm is not None:
            return ex.forward_norm(x, weights, ids, residual, next_norm, all_reduce, h=h,
                                   h_ready=n_shared if fold else 0)
        if ep:                                                                # EP: local ids, -1 elsewhere
            out = ex(x, weights, ex.ep.to_local(ids, ex.n_total))
            return (out + ex.shared_forward(x) if ex.n_shared else out), residual
        out = ex(x, weights, ids)
        return (out if fuse_shared or not ex.n_shared else out + ex.shared_forward(x)), residual
