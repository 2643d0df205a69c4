"""MoE routing: router logits -> (top-k weights, expert ids) with DeepSeek V2/V3 grouped selection.

Shapes: `T` tokens, `E` routed experts, `G` n_group groups of `E / G` experts, `k` top_k.
Methods (as Hugging Face's DeepseekV2/V3 TopkRouter): "greedy"; "group_limited_greedy" (group score = max);
"noaux_tc" (choice = score + e_score_correction_bias, group score = sum of its top-2 choices, weights unbiased).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from mlaserve.kernels.allreduce import LLGroup, ll_epoch, ll_next_epoch, ll_own, ll_push, ll_sum
from mlaserve.kernels.norm import check_norm_operands, fused_add_rmsnorm_ref
from mlaserve.kernels.pdl import pdl_enter, pdl_meta

METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING = ("softmax", "sigmoid")
# Weights (gate and up together) one shared-expert program of `moe_route_norm(shared=...)` holds: 32 KB of bf16,
# 64 values a thread at 8 warps, as gemv1's tile (8192 and 32768 were within 1% of it in the decode step:
# benchmarks/results/issue15-h100-2026-12-07.md).
SHARED_ROWS_VALUES = 16384
SHARED_NUM_WARPS = 8        # the launch's warps with the shared programs (at least; the routing's own may be more)


@triton.jit
def _first_max(s, idx, BIG: tl.constexpr):
    # s, idx: [BG, BPG] -> (max value, smallest flat index holding it)
    best = tl.max(tl.max(s, axis=1), axis=0)
    return best, tl.min(tl.min(tl.where(s == best, idx, BIG), axis=1), axis=0)


@triton.jit
def _scores(logits, ok, SIGMOID: tl.constexpr):
    # logits [BG, BPG] fp32 -> scores (softmax over all experts, or sigmoid); -inf outside the E experts
    logits = tl.where(ok, logits, float("-inf"))
    if SIGMOID:
        scores = tl.sigmoid(logits)
    else:
        p = tl.exp(logits - tl.max(tl.max(logits, axis=1), axis=0))            # masked: exp(-inf) = 0
        scores = p / tl.sum(tl.sum(p, axis=1), axis=0)
    return tl.where(ok, scores, float("-inf"))


@triton.jit
def _kept_groups(choice, g, j, n_group, METHOD: tl.constexpr, TOPK_GROUP: tl.constexpr, BLOCK_PG: tl.constexpr):
    # [BG] mask of the TOPK_GROUP best groups; group score = max (group-limited) or sum of the top-2 (noaux_tc)
    top1 = tl.max(choice, axis=1)
    gscore = top1
    if METHOD == 2:
        first = tl.min(tl.where(choice == top1[:, None], j[None, :], BLOCK_PG), axis=1)
        gscore = top1 + tl.max(tl.where(j[None, :] == first[:, None], float("-inf"), choice), axis=1)
    gscore = tl.where(g < n_group, gscore, float("-inf"))
    keep = g < 0
    for _ in tl.static_range(TOPK_GROUP):
        pick = tl.min(tl.where(gscore == tl.max(gscore, axis=0), g, g.shape[0]), axis=0)
        keep = keep | (g == pick)
        gscore = tl.where(g == pick, float("-inf"), gscore)
    return keep


@triton.jit
def _expert_grid(per_group, n_group, BLOCK_G: tl.constexpr, BLOCK_PG: tl.constexpr):
    # experts laid out [group, expert in group]: (group g [BG], j [BPG], in-range mask and expert id [BG, BPG])
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_PG)
    ok = (g < n_group)[:, None] & (j < per_group)[None, :]
    idx = tl.where(ok, g[:, None] * per_group + j[None, :], BLOCK_G * BLOCK_PG)
    return g, j, ok, idx


@triton.jit
def _select_row(logits, bias_ptr, weights_ptr, ids_ptr, mask_ptr, row, per_group, n_group, routed_scaling_factor,
                TOP_K: tl.constexpr, TOPK_GROUP: tl.constexpr, METHOD: tl.constexpr, SIGMOID: tl.constexpr,
                NORM: tl.constexpr, HAS_BIAS: tl.constexpr, N_SHARED: tl.constexpr,
                BLOCK_G: tl.constexpr, BLOCK_PG: tl.constexpr, BLOCK_K: tl.constexpr, HAS_MASK: tl.constexpr):
    # One token: logits [BG, BPG] fp32 -> its K + N_SHARED output slots (weights_ptr / ids_ptr point at its row).
    # METHOD indexes METHODS; shared slot s is expert E + s with weight 1.0. HAS_MASK: a row whose byte at
    # mask_ptr + row is 0 (padding) gets every id -1 (no expert).
    g, j, ok, idx = _expert_grid(per_group, n_group, BLOCK_G, BLOCK_PG)
    big = BLOCK_G * BLOCK_PG
    scores = _scores(logits, ok, SIGMOID)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + idx, mask=ok, other=0.0).to(tl.float32)
    if METHOD != 0:
        keep = _kept_groups(choice, g, j, n_group, METHOD, TOPK_GROUP, BLOCK_PG)[:, None]
        # NOTE: as HF, dropped groups read 0.0 for softmax scores (group-limited), -inf for noaux_tc choices.
        if METHOD == 1:
            choice = tl.where(keep | ~ok, choice, 0.0)
        else:
            choice = tl.where(keep, choice, float("-inf"))
    slot = tl.arange(0, BLOCK_K)
    w_out = tl.zeros([BLOCK_K], dtype=tl.float32)
    id_out = slot - TOP_K + per_group * n_group                                # shared slots: E + s
    for i in tl.static_range(TOP_K):
        best, pick = _first_max(choice, idx, big)
        w = tl.sum(tl.sum(tl.where(idx == pick, scores, 0.0), axis=1), axis=0)
        if METHOD == 1:
            w = best                                                           # a dropped expert weighs 0.0
        w_out = tl.where(slot == i, w, w_out)
        id_out = tl.where(slot == i, pick, id_out)
        choice = tl.where(idx == pick, float("-inf"), choice)
    if NORM:
        w_out = w_out / (tl.sum(w_out, axis=0) + 1e-20)
    w_out = tl.where(slot < TOP_K, w_out * routed_scaling_factor, 1.0)
    if HAS_MASK:
        id_out = tl.where(tl.load(mask_ptr + row) != 0, id_out, -1)
    tl.store(weights_ptr + slot, w_out, mask=slot < TOP_K + N_SHARED)
    tl.store(ids_ptr + slot, id_out, mask=slot < TOP_K + N_SHARED)


@triton.jit
def _moe_topk_kernel(logits_ptr, stride_l, bias_ptr, weights_ptr, ids_ptr, mask_ptr, per_group, n_group,
                     routed_scaling_factor, TOP_K: tl.constexpr, TOPK_GROUP: tl.constexpr,
                     METHOD: tl.constexpr, SIGMOID: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
                     N_SHARED: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_PG: tl.constexpr, BLOCK_K: tl.constexpr,
                     HAS_MASK: tl.constexpr, PDL: tl.constexpr):
    # One program per token.
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    _, _, ok, idx = _expert_grid(per_group, n_group, BLOCK_G, BLOCK_PG)
    logits = tl.load(logits_ptr + row * stride_l + idx, mask=ok, other=float("-inf")).to(tl.float32)
    out = row * (TOP_K + N_SHARED)
    _select_row(logits, bias_ptr, weights_ptr + out, ids_ptr + out, mask_ptr, row, per_group, n_group,
                routed_scaling_factor, TOP_K, TOPK_GROUP, METHOD, SIGMOID, NORM, HAS_BIAS, N_SHARED, BLOCK_G,
                BLOCK_PG, BLOCK_K, HAS_MASK)


def _check(router_logits: torch.Tensor, top_k: int, topk_method: str, scoring_func: str, n_group: int,
           topk_group: int, e_score_correction_bias: torch.Tensor | None) -> None:
    assert router_logits.dim() == 2, f"router_logits must be [T, E], got {tuple(router_logits.shape)}"
    e = router_logits.shape[1]
    assert topk_method in METHODS, f"topk_method must be one of {METHODS}, got {topk_method!r}"
    assert scoring_func in SCORING, f"scoring_func must be one of {SCORING}, got {scoring_func!r}"
    assert 0 < top_k <= e, f"top_k={top_k} must be in [1, E={e}]"
    if topk_method != "greedy":
        assert n_group > 0 and e % n_group == 0, f"E={e} must divide into n_group={n_group} groups"
        assert 0 < topk_group <= n_group, f"topk_group={topk_group} must be in [1, n_group={n_group}]"
        assert topk_group * (e // n_group) >= top_k, \
            f"topk_group={topk_group} groups of {e // n_group} experts hold fewer than top_k={top_k}"
    if e_score_correction_bias is not None:
        assert e_score_correction_bias.shape == (e,), f"e_score_correction_bias must be [{e}]"


def _launch_select(kernel, grid: tuple[int, ...], args: tuple, t: int, e: int, top_k: int, topk_method: str,
                   scoring_func: str, n_group: int, topk_group: int, norm_topk_prob: bool,
                   routed_scaling_factor: float, e_score_correction_bias: torch.Tensor | None, n_shared: int,
                   device: torch.device, row_mask: torch.Tensor | None = None,
                   **meta) -> tuple[torch.Tensor, torch.Tensor]:
    # outputs [T, K + n_shared]; `args` are the kernel's leading pointer / size arguments
    weights = torch.empty(t, top_k + n_shared, dtype=torch.float32, device=device)
    ids = torch.empty(t, top_k + n_shared, dtype=torch.int32, device=device)
    if t == 0:
        return weights, ids
    groups = 1 if topk_method == "greedy" else n_group
    method = METHODS.index(topk_method)
    bias = e_score_correction_bias.contiguous() if method == 2 and e_score_correction_bias is not None else None
    if row_mask is not None:
        assert row_mask.dtype == torch.bool and row_mask.shape == (t,), f"row_mask must be bool [{t}]"
    mask = row_mask.view(torch.uint8) if row_mask is not None else ids
    kernel[grid](*args, weights if bias is None else bias, weights, ids, mask, e // groups, groups,
                 float(routed_scaling_factor), TOP_K=top_k, TOPK_GROUP=topk_group if method else 1, METHOD=method,
                 SIGMOID=scoring_func == "sigmoid", NORM=bool(norm_topk_prob), HAS_BIAS=bias is not None,
                 N_SHARED=n_shared, HAS_MASK=row_mask is not None, BLOCK_G=triton.next_power_of_2(groups),
                 BLOCK_PG=triton.next_power_of_2(e // groups), BLOCK_K=triton.next_power_of_2(top_k + n_shared),
                 **pdl_meta(device), **meta)
    return weights, ids


def moe_topk(router_logits: torch.Tensor, top_k: int, *, topk_method: str, scoring_func: str, n_group: int = 1,
             topk_group: int = 1, norm_topk_prob: bool = False, routed_scaling_factor: float = 1.0,
             e_score_correction_bias: torch.Tensor | None = None, n_shared: int = 0,
             row_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Select each token's experts (Triton, one program per token, E up to a few hundred).

    Args:
        router_logits: [T, E] float32 (`gate` linear output). e_score_correction_bias: [E], noaux_tc only.
        n_shared: shared-expert slots appended to each row: ids E .. E + n_shared - 1, weight 1.0.
        row_mask: [T] bool or None: a row where it is False (a padding row) gets every id -1 (no expert).
    Returns:
        (topk_weights [T, k + n_shared] float32, topk_ids [T, k + n_shared] int32); routed ids are in selection
        order (best first), ties go to the lower expert id.
    """
    _check(router_logits, top_k, topk_method, scoring_func, n_group, topk_group, e_score_correction_bias)
    t, e = router_logits.shape
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    return _launch_select(_moe_topk_kernel, (t,), (logits, logits.stride(0)), t, e, top_k, topk_method,
                          scoring_func, n_group, topk_group, norm_topk_prob, routed_scaling_factor,
                          e_score_correction_bias, n_shared, logits.device, row_mask, num_warps=4 if e > 128 else 2)


def moe_topk_ref(router_logits: torch.Tensor, top_k: int, *, topk_method: str, scoring_func: str,
                 n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = False,
                 routed_scaling_factor: float = 1.0, e_score_correction_bias: torch.Tensor | None = None,
                 n_shared: int = 0, row_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec of `moe_topk` in plain PyTorch (fp32)."""
    _check(router_logits, top_k, topk_method, scoring_func, n_group, topk_group, e_score_correction_bias)
    t, e = router_logits.shape
    logits = router_logits.float()
    scores = logits.sigmoid() if scoring_func == "sigmoid" else logits.softmax(dim=-1)  # [T, E]
    if topk_method == "greedy":
        weights, ids = torch.topk(scores, top_k, dim=-1)
    elif topk_method == "group_limited_greedy":
        group_scores = scores.view(t, n_group, e // n_group).amax(dim=-1)             # [T, G]
        weights, ids = torch.topk(_mask_groups(scores, group_scores, topk_group, 0.0), top_k, dim=-1)
    else:
        bias = e_score_correction_bias if e_score_correction_bias is not None else torch.zeros(e, device=logits.device)
        choice = scores + bias.to(scores)
        group_scores = choice.view(t, n_group, e // n_group).topk(2, dim=-1).values.sum(dim=-1)
        ids = torch.topk(_mask_groups(choice, group_scores, topk_group, float("-inf")), top_k, dim=-1).indices
        weights = scores.gather(1, ids)                                               # unbiased scores
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights, ids = weights * routed_scaling_factor, ids.to(torch.int32)
    if n_shared:                                                                      # + the shared slots
        shared = torch.arange(e, e + n_shared, dtype=torch.int32, device=ids.device).expand(t, -1)
        weights = torch.cat([weights, torch.ones(t, n_shared, device=weights.device)], dim=1)
        ids = torch.cat([ids, shared], dim=1)
    if row_mask is not None:
        ids = ids.masked_fill(~row_mask[:, None], -1)
    return weights, ids


# --------------------------------------------------------------------------------------------- gate + top-k
# Small T (decode): one launch computes the gate GEMV and selects. The E experts are cut into slices of
# BLOCK_E rows of the gate weight; program (slice, t) writes logits[t, slice] to a scratch row, then counts
# itself done in sync[t]; the last of token t's programs (the only one to see count S - 1) resets the count
# and selects from the complete row.
@triton.jit
def _route_rows(x_ptr, res_ptr, nw_ptr, t, h0, offs_h, h_ok, stride_x, stride_res, rstd, NORM_IN: tl.constexpr):
    # x[t, h0 + offs_h] in fp32; NORM_IN: rmsnorm(x + res) with DeepSeek's roundings (as kernels/norm.py)
    x = tl.load(x_ptr + t * stride_x + h0 + offs_h, mask=h_ok, other=0.0)
    if NORM_IN:
        ty = x.dtype
        r = tl.load(res_ptr + t * stride_res + h0 + offs_h, mask=h_ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(ty)
        y = (x.to(tl.float32) * rstd).to(ty).to(tl.float32)
        x = (tl.load(nw_ptr + h0 + offs_h, mask=h_ok, other=0.0).to(tl.float32) * y).to(ty)
    return x.to(tl.float32)


@triton.jit
def _sum_over_ranks(x, t, offs_h, h_ok, ar_ptrs, ar_epochs, ar_rank, ar_half, AR_WORLD: tl.constexpr):
    """Token t's row x summed over the ranks by the push all-reduce's protocol and bits (`peer_all_reduce_ll`):
    the slice-0 program pushes it, every program polls the peers' rows. The row's epoch counters are advanced by
    the last program of the row to finish (after every program has read them)."""
    row = t.to(tl.int32)
    e = ll_next_epoch(ar_epochs, row)
    if tl.program_id(0) == 0:
        own, parity = ll_push(ar_ptrs, ar_rank, row, e, ar_half, offs_h, h_ok, x, AR_WORLD)
    else:
        own, parity = ll_own(ar_ptrs, ar_rank, e, ar_half)
    acc = ll_sum(tl.zeros([x.shape[0]], dtype=tl.float32), x, own, parity, ar_rank, row, offs_h, h_ok, e, AR_WORLD)
    return acc.to(x.dtype)


@triton.jit
def _add_rmsnorm_row(x, res_ptr, nw_ptr, offs_h, h_ok, hidden, eps):
    # one row in one tile: (x + res rounded to x's dtype, its rmsnorm with DeepSeek's roundings, as kernels/norm.py)
    ty = x.dtype
    r = tl.load(res_ptr + offs_h, mask=h_ok, other=0.0)
    x = (x.to(tl.float32) + r.to(tl.float32)).to(ty)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    y = (xf * rstd).to(ty).to(tl.float32)
    nw = tl.load(nw_ptr + offs_h, mask=h_ok, other=0.0).to(tl.float32)
    return x, (nw * y).to(ty)


@triton.jit
def _shared_gate_up(x_ptr, res_ptr, nw_ptr, eps, hidden, sw_ptr, sh_ptr, shared_i, stride_swe, stride_swn, stride_sh,
                    j, SH_ROWS: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    # One token's shared experts inside the router's launch: program j owns SH_ROWS intermediate rows r of one shared
    # expert s and writes h[s, r] = silu(gate[r] . n) * (up[r] . n), n = rmsnorm(x + res) rounded as the routing
    # programs round it. Its whole [SH_ROWS, hidden] slices of gate and up are read before the PDL wait (as gemv1),
    # so they stream while the routing programs wait on their inputs and select.
    tiles = tl.cdiv(shared_i, SH_ROWS)
    s = j // tiles
    rows = (j % tiles) * SH_ROWS + tl.arange(0, SH_ROWS)
    offs_h = tl.arange(0, BLOCK_H)
    r_ok, h_ok = rows < shared_i, offs_h < hidden
    w_ptrs = sw_ptr + s.to(tl.int64) * stride_swe + rows.to(tl.int64)[:, None] * stride_swn + offs_h[None, :]
    w_ok = r_ok[:, None] & h_ok[None, :]
    wg = tl.load(w_ptrs, mask=w_ok, other=0.0)                                       # [SR, BH] gate rows
    wu = tl.load(w_ptrs + shared_i * stride_swn, mask=w_ok, other=0.0)               # [SR, BH] up rows
    pdl_enter(PDL)
    _, n = _add_rmsnorm_row(tl.load(x_ptr + offs_h, mask=h_ok, other=0.0), res_ptr, nw_ptr, offs_h, h_ok, hidden,
                            eps)
    n = n.to(tl.float32)
    g = tl.sum(wg.to(tl.float32) * n[None, :], axis=1)                               # [SR] exact products, fp32 sums
    u = tl.sum(wu.to(tl.float32) * n[None, :], axis=1)
    tl.store(sh_ptr + s * stride_sh + rows, (g * tl.sigmoid(g) * u).to(sh_ptr.dtype.element_ty), mask=r_ok)


@triton.jit
def _moe_route_kernel(x_ptr, w_ptr, logits_ptr, sync_ptr, n_experts, hidden, stride_x, stride_w,
                      res_ptr, nw_ptr, normed_ptr, res_out_ptr, eps, stride_res, stride_normed, stride_res_out,
                      ar_ptrs, ar_epochs, ar_rank, ar_half, n_route, sw_ptr, sh_ptr, shared_i, stride_swe,
                      stride_swn, stride_sh,
                      bias_ptr, weights_ptr, ids_ptr, mask_ptr, per_group, n_group, routed_scaling_factor,
                      TOP_K: tl.constexpr, TOPK_GROUP: tl.constexpr, METHOD: tl.constexpr, SIGMOID: tl.constexpr,
                      NORM: tl.constexpr, HAS_BIAS: tl.constexpr, N_SHARED: tl.constexpr, BLOCK_G: tl.constexpr,
                      BLOCK_PG: tl.constexpr, BLOCK_K: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_E: tl.constexpr,
                      BLOCK_H: tl.constexpr, NORM_IN: tl.constexpr, ONE_TILE: tl.constexpr, PDL: tl.constexpr,
                      AR_WORLD: tl.constexpr, SH_ROWS: tl.constexpr):
    # ONE_TILE: hidden <= BLOCK_H. NORM_IN: the gate reads rmsnorm(x + res) (weight nw); the slice-0 program of each token also writes that
    # normed row (the experts' input) and x + res (the residual stream) to their own buffers.
    # SH_ROWS > 0 (one token, ONE_TILE and NORM_IN): programs n_route .. of axis 0 are the shared experts' gate / up
    # instead (`_shared_gate_up`); the first n_route programs route.
    if SH_ROWS > 0:
        if tl.program_id(0) >= n_route:
            _shared_gate_up(x_ptr, res_ptr, nw_ptr, eps, hidden, sw_ptr, sh_ptr, shared_i, stride_swe, stride_swn,
                            stride_sh, tl.program_id(0) - n_route, SH_ROWS, BLOCK_H, PDL)
            return
    t = tl.program_id(1).to(tl.int64)
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_h = tl.arange(0, BLOCK_H)
    if ONE_TILE:                # the row is one tile: the gate slice's load first (HBM), then the row's
        h_ok = offs_h < hidden
        w = tl.load(w_ptr + e[:, None].to(tl.int64) * stride_w + offs_h[None, :],
                    mask=(e < n_experts)[:, None] & h_ok[None, :], other=0.0)                      # [BE, BH]
        pdl_enter(PDL)                                # (PDL: the gate slice is read before the wait)
        x = tl.load(x_ptr + t * stride_x + offs_h, mask=h_ok, other=0.0)
        if AR_WORLD > 1:        # x is this rank's share (tensor parallelism): the row summed over the ranks
            x = _sum_over_ranks(x, t, offs_h, h_ok, ar_ptrs, ar_epochs, ar_rank, ar_half, AR_WORLD)
        if NORM_IN:             # x: residual_out, rounded
            x, normed = _add_rmsnorm_row(x, res_ptr + t * stride_res, nw_ptr, offs_h, h_ok, hidden, eps)
            if tl.program_id(0) == 0:
                tl.store(res_out_ptr + t * stride_res_out + offs_h, x, mask=h_ok)
                tl.store(normed_ptr + t * stride_normed + offs_h, normed.to(normed_ptr.dtype.element_ty), mask=h_ok)
            x = normed
        acc = w.to(tl.float32) * x.to(tl.float32)[None, :]
    else:
        pdl_enter(PDL)
        rstd = 0.0
        if NORM_IN:             # every program reads the token's row once more for its mean square
            ss = tl.zeros([BLOCK_H], dtype=tl.float32)
            for h0 in range(0, hidden, BLOCK_H):
                h_ok = offs_h < hidden - h0
                x = tl.load(x_ptr + t * stride_x + h0 + offs_h, mask=h_ok, other=0.0)
                r = tl.load(res_ptr + t * stride_res + h0 + offs_h, mask=h_ok, other=0.0)
                x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
                if tl.program_id(0) == 0:
                    tl.store(res_out_ptr + t * stride_res_out + h0 + offs_h, x, mask=h_ok)
                x = x.to(tl.float32)
                ss += x * x
            rstd = tl.math.rsqrt(tl.sum(ss, axis=0) / hidden + eps)
        acc = tl.zeros([BLOCK_E, BLOCK_H], dtype=tl.float32)
        for h0 in range(0, hidden, BLOCK_H):                                # fp32 products of exact upcasts
            h_ok = offs_h < hidden - h0
            x = _route_rows(x_ptr, res_ptr, nw_ptr, t, h0, offs_h, h_ok, stride_x, stride_res, rstd, NORM_IN)
            if NORM_IN:
                if tl.program_id(0) == 0:
                    tl.store(normed_ptr + t * stride_normed + h0 + offs_h, x.to(normed_ptr.dtype.element_ty),
                             mask=h_ok)
            w = tl.load(w_ptr + e[:, None].to(tl.int64) * stride_w + h0 + offs_h[None, :],
                        mask=(e < n_experts)[:, None] & h_ok[None, :], other=0.0).to(tl.float32)   # [BE, BH]
            acc += w * x[None, :]
    tl.store(logits_ptr + t * n_experts + e, tl.sum(acc, axis=1), mask=e < n_experts)
    # NOTE: the barrier orders every thread's logits store before the (release) count; the last program's
    # acquire then sees all of token t's row. Its loads skip L1 (.cg), which is not coherent across SMs.
    tl.debug_barrier()
    if tl.atomic_add(sync_ptr + t, 1, sem="acq_rel", scope="gpu") == n_route - 1:
        tl.atomic_xchg(sync_ptr + t, 0, sem="relaxed", scope="gpu")           # ready for the next launch
        if AR_WORLD > 1:        # every program of the row has read its epoch: the last one advances it
            ll_epoch(ar_epochs, t, 0, 1)
        _, _, ok, idx = _expert_grid(per_group, n_group, BLOCK_G, BLOCK_PG)
        logits = tl.load(logits_ptr + t * n_experts + idx, mask=ok, other=float("-inf"), cache_modifier=".cg")
        out = t * (TOP_K + N_SHARED)
        _select_row(logits, bias_ptr, weights_ptr + out, ids_ptr + out, mask_ptr, t, per_group, n_group,
                    routed_scaling_factor, TOP_K, TOPK_GROUP, METHOD, SIGMOID, NORM, HAS_BIAS, N_SHARED, BLOCK_G,
                    BLOCK_PG, BLOCK_K, HAS_MASK)


def route_config(e: int, hidden: int) -> dict:
    """Gate-GEMV tiles: whole rows of up to 8192 channels, ~4K weights per program (V2-Lite: 32 programs per
    token, V3: 256)."""
    block_h = min(triton.next_power_of_2(hidden), 8192)
    block_e = min(triton.next_power_of_2(e), max(1, 4096 // block_h))
    return dict(BLOCK_E=block_e, BLOCK_H=block_h, num_warps=8 if block_e * block_h >= 8192 else 4)


def moe_route(x: torch.Tensor, weight: torch.Tensor, top_k: int, *, topk_method: str, scoring_func: str,
              n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = False, routed_scaling_factor: float = 1.0,
              e_score_correction_bias: torch.Tensor | None = None, n_shared: int = 0,
              sync: torch.Tensor | None = None, config: dict | None = None,
              row_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits x @ weight^T in fp32 and `moe_topk` on them, in one launch (small T: decode).

    Args:
        x: [T, h] any float dtype, rows contiguous. weight: [E, h] (`mlp.gate.weight`, any float dtype; both are
            upcast exactly, products and sums in fp32). Routing arguments, n_shared and row_mask: as `moe_topk`.
        sync: int32 [>= T] zeros, owned by the caller and left zero (the kernel's arrival counts; one launch at a
            time per buffer); default a fresh one. config: BLOCK_E, BLOCK_H, num_warps (`route_config`).
    Returns:
        as `moe_topk`: (weights [T, k + n_shared] float32, ids [T, k + n_shared] int32).
    """
    return _route(x, None, weight, top_k, sync, config, topk_method=topk_method, scoring_func=scoring_func,
                  n_group=n_group, topk_group=topk_group, norm_topk_prob=norm_topk_prob,
                  routed_scaling_factor=routed_scaling_factor, e_score_correction_bias=e_score_correction_bias,
                  n_shared=n_shared, row_mask=row_mask)[:2]


def moe_route_norm(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                   weight: torch.Tensor, top_k: int, *, topk_method: str, scoring_func: str, n_group: int = 1,
                   topk_group: int = 1, norm_topk_prob: bool = False, routed_scaling_factor: float = 1.0,
                   e_score_correction_bias: torch.Tensor | None = None, n_shared: int = 0,
                   sync: torch.Tensor | None = None, config: dict | None = None, all_reduce: LLGroup | None = None,
                   row_mask: torch.Tensor | None = None,
                   shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
    """`moe_route` of h = rmsnorm(x + residual) (the layer's post-attention norm folded into the router's launch).

    x, residual: [T, h], one dtype, rows contiguous; norm_weight [h]. Returns (weights, ids, h [T, h] in x.dtype,
    x + residual [T, h] in x.dtype): the last two are new tensors (residual is not modified). `all_reduce` (tensor
    parallelism: x is this rank's share of the attention output): x is first summed over the ranks in the same
    launch, with `peer_all_reduce_ll`'s bits. Every rank must make the same call.

    `shared` = (w13 [n, 2I, h], out [n, I]) (one token, no all_reduce, h <= the config's BLOCK_H, w13 in x.dtype):
    the same launch also computes the n shared experts' first half on h, out[s] = silu(gate_s . h) * (up_s . h)
    (w13[s] = gate rows then up rows, as `fused_moe`'s), in more programs beside the routing ones
    (`SHARED_ROWS_VALUES` weights each), so their weights stream while the routing waits and selects."""
    check_norm_operands(x, norm_weight, residual)
    return _route(x, (residual, norm_weight, eps), weight, top_k, sync, config, topk_method=topk_method,
                  scoring_func=scoring_func, n_group=n_group, topk_group=topk_group, norm_topk_prob=norm_topk_prob,
                  routed_scaling_factor=routed_scaling_factor, e_score_correction_bias=e_score_correction_bias,
                  n_shared=n_shared, all_reduce=all_reduce, row_mask=row_mask, shared=shared)


def _route(x: torch.Tensor, norm: tuple[torch.Tensor, torch.Tensor, float] | None, weight: torch.Tensor,
           top_k: int, sync: torch.Tensor | None, config: dict | None, *, topk_method: str, scoring_func: str,
           n_group: int, topk_group: int, norm_topk_prob: bool, routed_scaling_factor: float,
           e_score_correction_bias: torch.Tensor | None, n_shared: int,
           all_reduce: LLGroup | None = None, row_mask: torch.Tensor | None = None,
           shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
    t, h = x.shape
    e = weight.shape[0]
    assert weight.dim() == 2 and weight.shape[1] == h, f"weight must be [E, {h}], got {tuple(weight.shape)}"
    assert x.stride(1) == 1 and weight.stride(1) == 1, "x and weight need contiguous rows"
    _check(x.new_empty(0, e, device="meta"), top_k, topk_method, scoring_func, n_group, topk_group,
           e_score_correction_bias)
    if sync is None:
        sync = torch.zeros(t, dtype=torch.int32, device=x.device)
    assert sync.dtype == torch.int32 and sync.numel() >= t, f"sync must be int32 [>= {t}]"
    cfg = dict(config or route_config(e, h))
    block_e, block_h = cfg.pop("BLOCK_E"), cfg.pop("BLOCK_H")
    logits = torch.empty(t, e, dtype=torch.float32, device=x.device)                 # scratch: [T, E]
    res, nw, eps = norm or (x, x, 0.0)
    normed, res_out = (torch.empty_like(x), torch.empty_like(x)) if norm else (x, x)
    if all_reduce is not None:
        assert h <= block_h and all_reduce.ll.fits(x), \
            f"x {tuple(x.shape)}: summing over the ranks in the router needs one tile and the push buffers"
    ar = all_reduce.launch_args() if all_reduce is not None else (sync, sync, 0, 0)
    n_route = triton.cdiv(e, block_e)
    sw, sh, sh_rows, n_sh_programs = x, x, 0, 0
    if shared is not None:
        sw, sh = shared
        n_sh, two_i, sh_h = sw.shape
        assert norm is not None and all_reduce is None and t == 1 and h <= block_h, \
            "the shared experts ride in the router's launch for one token, with the norm, without all_reduce"
        assert sh_h == h and two_i % 2 == 0 and sw.dtype == x.dtype and sw.stride(2) == 1, \
            f"shared w13 must be [n, 2I, {h}] in {x.dtype} with contiguous rows, got {tuple(sw.shape)} {sw.dtype}"
        assert sh.shape == (n_sh, two_i // 2) and sh.dtype == x.dtype and sh.stride(1) == 1, \
            f"shared out must be [{n_sh}, {two_i // 2}] in {x.dtype}, got {tuple(sh.shape)} {sh.dtype}"
        sh_rows = max(1, min(SHARED_ROWS_VALUES // (2 * block_h), triton.next_power_of_2(two_i // 2)))
        n_sh_programs = n_sh * triton.cdiv(two_i // 2, sh_rows)
        cfg["num_warps"] = max(cfg["num_warps"], SHARED_NUM_WARPS)
    args = (x, weight, logits, sync, e, h, x.stride(0), weight.stride(0), res, nw, normed, res_out, float(eps),
            res.stride(0), normed.stride(0), res_out.stride(0), *ar, n_route, sw, sh, sw.shape[1] // 2,
            sw.stride(0), sw.stride(1), sh.stride(0))
    weights, ids = _launch_select(_moe_route_kernel, (n_route + n_sh_programs, t), args, t, e, top_k, topk_method,
                                  scoring_func, n_group, topk_group, norm_topk_prob, routed_scaling_factor,
                                  e_score_correction_bias, n_shared, x.device, row_mask, BLOCK_E=block_e,
                                  BLOCK_H=block_h,
                                  NORM_IN=norm is not None, ONE_TILE=h <= block_h,
                                  AR_WORLD=all_reduce.world if all_reduce is not None else 1, SH_ROWS=sh_rows,
                                  **cfg)
    return weights, ids, normed, res_out


def moe_route_ref(x: torch.Tensor, weight: torch.Tensor, top_k: int, *, sync: torch.Tensor | None = None,
                  config: dict | None = None, **routing) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec of `moe_route`: fp32 logits, then `moe_topk_ref` (`sync` / `config` are the kernel's own)."""
    return moe_topk_ref(F.linear(x.float(), weight.float()), top_k, **routing)          # logits [T, E]


def moe_route_norm_ref(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       weight: torch.Tensor, top_k: int, *, sync: torch.Tensor | None = None,
                       config: dict | None = None, shared: tuple[torch.Tensor, torch.Tensor] | None = None,
                       **routing) -> tuple[torch.Tensor, ...]:
    """The spec of `moe_route_norm`: the fused add + norm's reference, then `moe_route_ref` (and with `shared`,
    its out rows in fp32 from h)."""
    h, res_out = fused_add_rmsnorm_ref(x, residual, norm_weight, eps)
    if shared is not None:
        w13, out = shared
        i = w13.shape[1] // 2
        gu = torch.einsum("k,sik->si", h[0].float(), w13.float())                      # [n, 2I]
        out.copy_(F.silu(gu[:, :i]) * gu[:, i:])
    return (*moe_route_ref(h, weight, top_k, **routing), h, res_out)


def _mask_groups(scores: torch.Tensor, group_scores: torch.Tensor, topk_group: int, fill: float) -> torch.Tensor:
    # keep the experts of the `topk_group` best groups; scores: [T, E], group_scores: [T, G]
    t, n_group = group_scores.shape
    kept = torch.zeros_like(group_scores, dtype=torch.bool)
    kept.scatter_(1, torch.topk(group_scores, topk_group, dim=-1).indices, True)
    return scores.masked_fill(~kept.repeat_interleave(scores.shape[1] // n_group, dim=1), fill)
