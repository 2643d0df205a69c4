"""MoE routing: router logits -> (top-k weights, expert ids) with DeepSeek V2/V3 grouped selection.

Shapes: `T` tokens, `E` routed experts, `G` n_group groups of `E / G` experts, `k` top_k.
Methods (as Hugging Face's DeepseekV2/V3 TopkRouter): "greedy"; "group_limited_greedy" (group score = max);
"noaux_tc" (choice = score + e_score_correction_bias, group score = sum of its top-2 choices, weights unbiased).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING = ("softmax", "sigmoid")


@triton.jit
def _first_max(s, idx, BIG: tl.constexpr):
    # s, idx: [BG, BPG] -> (max value, smallest flat index holding it)
    best = tl.max(tl.max(s, axis=1), axis=0)
    return best, tl.min(tl.min(tl.where(s == best, idx, BIG), axis=1), axis=0)


@triton.jit
def _scores(logits_ptr, idx, ok, SIGMOID: tl.constexpr):
    # [BG, BPG] fp32 scores (softmax over all experts, or sigmoid); -inf outside the E experts
    logits = tl.load(logits_ptr + idx, mask=ok, other=float("-inf")).to(tl.float32)
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
def _moe_topk_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, per_group, n_group, stride_l,
                     routed_scaling_factor, TOP_K: tl.constexpr, TOPK_GROUP: tl.constexpr,
                     METHOD: tl.constexpr, SIGMOID: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_G: tl.constexpr, BLOCK_PG: tl.constexpr, BLOCK_K: tl.constexpr):
    # One program per token, experts laid out [group, expert in group]; METHOD indexes METHODS.
    row = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_PG)
    ok = (g < n_group)[:, None] & (j < per_group)[None, :]
    big = BLOCK_G * BLOCK_PG
    idx = tl.where(ok, g[:, None] * per_group + j[None, :], big)               # [BG, BPG] expert ids
    scores = _scores(logits_ptr + row * stride_l, idx, ok, SIGMOID)
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
    id_out = tl.zeros([BLOCK_K], dtype=tl.int32)
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
    tl.store(weights_ptr + row * TOP_K + slot, w_out * routed_scaling_factor, mask=slot < TOP_K)
    tl.store(ids_ptr + row * TOP_K + slot, id_out, mask=slot < TOP_K)


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
    if e_score_correction_bias is not None:
        assert e_score_correction_bias.shape == (e,), f"e_score_correction_bias must be [{e}]"


def moe_topk(router_logits: torch.Tensor, top_k: int, *, topk_method: str, scoring_func: str, n_group: int = 1,
             topk_group: int = 1, norm_topk_prob: bool = False, routed_scaling_factor: float = 1.0,
             e_score_correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Select each token's experts (Triton, one program per token, E up to a few hundred).

    Args:
        router_logits: [T, E] float32 (`gate` linear output). e_score_correction_bias: [E], noaux_tc only.
    Returns:
        (topk_weights [T, k] float32, topk_ids [T, k] int32); ids are in selection order (best first), ties
        go to the lower expert id.
    """
    _check(router_logits, top_k, topk_method, scoring_func, n_group, topk_group, e_score_correction_bias)
    t, e = router_logits.shape
    groups = 1 if topk_method == "greedy" else n_group
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    if t == 0:
        return weights, ids
    method = METHODS.index(topk_method)
    bias = e_score_correction_bias if method == 2 else None
    block_pg = triton.next_power_of_2(e // groups)
    _moe_topk_kernel[(t,)](
        logits, bias.contiguous() if bias is not None else logits, weights, ids, e // groups, groups,
        logits.stride(0), float(routed_scaling_factor), TOP_K=top_k, TOPK_GROUP=topk_group if method else 1,
        METHOD=method, SIGMOID=scoring_func == "sigmoid", NORM=bool(norm_topk_prob), HAS_BIAS=bias is not None,
        BLOCK_G=triton.next_power_of_2(groups), BLOCK_PG=block_pg, BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=4 if e > 128 else 2)
    return weights, ids


def moe_topk_ref(router_logits: torch.Tensor, top_k: int, *, topk_method: str, scoring_func: str,
                 n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = False,
                 routed_scaling_factor: float = 1.0,
                 e_score_correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
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
    return weights * routed_scaling_factor, ids.to(torch.int32)


def _mask_groups(scores: torch.Tensor, group_scores: torch.Tensor, topk_group: int, fill: float) -> torch.Tensor:
    # keep the experts of the `topk_group` best groups; scores: [T, E], group_scores: [T, G]
    t, n_group = group_scores.shape
    kept = torch.zeros_like(group_scores, dtype=torch.bool)
    kept.scatter_(1, torch.topk(group_scores, topk_group, dim=-1).indices, True)
    return scores.masked_fill(~kept.repeat_interleave(scores.shape[1] // n_group, dim=1), fill)
