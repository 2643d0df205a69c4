"""moe_topk and the fused gate + top-k moe_route (Triton) vs their references vs Hugging Face's DeepseekV2/V3
TopkRouter on small configs."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from mlaserve.kernels.moe_topk import (moe_route, moe_route_norm, moe_route_norm_ref, moe_route_ref, moe_topk,
                                       moe_topk_ref)

# weights: fp32 scores; exp / sigmoid / normalisation may differ by a few ulps between Triton and torch, and
# moe_route's logits are sums in another order than F.linear's (seed 607421245: 1.4e-6 on a weight of 0.26)
TOL = 1e-5

V2_GREEDY = dict(top_k=6, topk_method="greedy", scoring_func="softmax")
V2_GROUPED = dict(top_k=6, topk_method="group_limited_greedy", scoring_func="softmax", n_group=4, topk_group=2,
                  routed_scaling_factor=16.0)
V3_NOAUX = dict(top_k=8, topk_method="noaux_tc", scoring_func="sigmoid", n_group=8, topk_group=4,
                norm_topk_prob=True, routed_scaling_factor=2.5)


def by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort each row by expert id so selections compare regardless of order."""
    ids, order = ids.long().sort(dim=-1)
    return weights.gather(1, order), ids


def assert_same_routing(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor],
                        ties: torch.Tensor | None = None) -> None:
    """Same experts and weights per row; rows where `ties` ([T] bool, `near_ties`) is set are left out."""
    gw, gi = by_id(*got)
    ww, wi = by_id(*want)
    if ties is not None and ties.any():
        print(f"rows {ties.nonzero().flatten().tolist()}: a near-tie at the selection's edge, not compared")
        assert len(ties) == 1 or ties.float().mean() <= 0.5, f"near-ties in {int(ties.sum())} of {len(ties)} rows"
        gw, gi, ww, wi = (t[~ties] for t in (gw, gi, ww, wi))
    assert torch.equal(gi, wi), f"different experts chosen:\n{gi}\n{wi}"
    torch.testing.assert_close(gw.float(), ww.float(), rtol=TOL, atol=TOL)


def near_ties(logits: torch.Tensor, top_k: int, *, topk_method: str, scoring_func: str, n_group: int = 1,
              topk_group: int = 1, e_score_correction_bias: torch.Tensor | None = None, gap: float = 1e-5,
              **_) -> torch.Tensor:
    """[T] bool: rows whose selection could flip when the fp32 logits move by sum-order rounding (~1e-6 relative):
    the last kept group and the first dropped one, or the last chosen expert and the first one left out, score
    within `gap` of the row's largest value (moe_route's gate GEMV sums in another order than F.linear; seed
    421102229 flipped two groups)."""
    t, e = logits.shape
    # what the selection orders by: the logits themselves where the scoring keeps their order (softmax, sigmoid),
    # sigmoid + bias for noaux_tc; gaps relative to the values' size
    scores = logits.float()
    edge = torch.full((t,), float("inf"), device=logits.device)
    if topk_method == "noaux_tc":
        bias = e_score_correction_bias if e_score_correction_bias is not None else torch.zeros(e, device=logits.device)
        scores = scores.sigmoid() + bias.to(scores)
    size = scores.abs().amax(dim=-1).clamp(min=1.0)                                     # [T]
    if topk_method != "greedy":
        per = scores.view(t, n_group, e // n_group)
        groups = per.topk(2, dim=-1).values.sum(-1) if topk_method == "noaux_tc" else per.amax(-1)   # [T, G]
        if topk_group < n_group:
            g = groups.sort(dim=-1, descending=True).values
            edge = torch.minimum(edge, g[:, topk_group - 1] - g[:, topk_group])
        kept = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, groups.topk(topk_group, dim=-1).indices, True)
        scores = scores.masked_fill(~kept.repeat_interleave(e // n_group, dim=1), float("-inf"))
    s = scores.sort(dim=-1, descending=True).values
    if top_k < e:
        edge = torch.minimum(edge, s[:, top_k - 1] - s[:, top_k])
    return edge < gap * size


@pytest.mark.parametrize("kw,num_experts", [(V2_GREEDY, 24), (V2_GROUPED, 64), (V3_NOAUX, 64),
                                            (dict(V2_GROUPED, n_group=8, topk_group=3), 160),
                                            (dict(V3_NOAUX, n_group=8, topk_group=4), 24)])
@pytest.mark.parametrize("tokens", [1, 37])
def test_moe_topk_matches_ref(kw: dict, num_experts: int, tokens: int, device: str) -> None:
    logits = torch.randn(tokens, num_experts, device=device)
    bias = torch.randn(num_experts, device=device) * 0.1 if kw["topk_method"] == "noaux_tc" else None
    got = moe_topk(logits, e_score_correction_bias=bias, **kw)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.int32
    assert got[0].shape == got[1].shape == (tokens, kw["top_k"])
    assert_same_routing(got, moe_topk_ref(logits, e_score_correction_bias=bias, **kw))
    if kw.get("norm_topk_prob"):
        # normalised weights sum to routed_scaling_factor
        torch.testing.assert_close(got[0].sum(-1), torch.full((tokens,), kw["routed_scaling_factor"], device=device))


def _hf_router(kw: dict, num_experts: int, hidden: int, device: str) -> torch.nn.Module:
    """HF's router on `device` (its logits then feed the Triton kernel there) with random weight / bias."""
    common = dict(hidden_size=hidden, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=num_experts,
                  num_experts_per_tok=kw["top_k"], n_group=kw.get("n_group", 1), topk_group=kw.get("topk_group", 1),
                  routed_scaling_factor=kw.get("routed_scaling_factor", 1.0))
    if kw["topk_method"] == "noaux_tc":
        router = DeepseekV3TopkRouter(DeepseekV3Config(norm_topk_prob=kw["norm_topk_prob"], **common)).to(device)
        router.e_score_correction_bias.copy_(torch.randn(num_experts, device=device) * 0.1)
    else:
        router = DeepseekV2TopkRouter(DeepseekV2Config(topk_method=kw["topk_method"], **common)).to(device)
    with torch.no_grad():
        router.weight.copy_(torch.randn(num_experts, hidden, device=device))
    return router


@pytest.mark.parametrize("kw", [V2_GREEDY, V2_GROUPED, V3_NOAUX], ids=["greedy", "group_limited", "noaux_tc"])
def test_moe_topk_ref_matches_hf_router(kw: dict, device: str) -> None:
    num_experts, hidden, tokens = 32, 16, 40
    router = _hf_router(kw, num_experts, hidden, device)
    x = torch.randn(tokens, hidden, device=device)
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(x)
    bias = getattr(router, "e_score_correction_bias", None)
    ref = moe_topk_ref(logits, e_score_correction_bias=bias, **kw)
    assert_same_routing(ref, (hf_weights, hf_ids))
    assert_same_routing(moe_topk(logits, e_score_correction_bias=bias, **kw), (hf_weights, hf_ids))


def test_group_limited_greedy_stays_in_kept_groups(device: str) -> None:
    # One group holds the 6 largest logits but only topk_group=1 group is kept: the best group's experts win.
    logits = torch.randn(3, 32, device=device)
    logits[:, 8:16] += 10.0
    w, ids = moe_topk(logits, **dict(V2_GROUPED, topk_group=1))
    assert ((ids >= 8) & (ids < 16)).all(), ids


def test_noaux_tc_bias_chooses_but_does_not_weigh(device: str) -> None:
    # A large bias on expert 5 forces its choice; its weight is still its unbiased sigmoid score.
    logits = torch.randn(4, 64, device=device)
    bias = torch.zeros(64, device=device)
    bias[5] = 100.0
    kw = dict(V3_NOAUX, norm_topk_prob=False, routed_scaling_factor=1.0)
    w, ids = moe_topk(logits, e_score_correction_bias=bias, **kw)
    pos = (ids == 5).long().argmax(dim=-1)
    assert (ids == 5).any(dim=-1).all()
    torch.testing.assert_close(w.gather(1, pos[:, None])[:, 0], logits[:, 5].sigmoid(), rtol=TOL, atol=TOL)


def _seed() -> None:
    seed = random.randrange(2**31)
    print(f"seed {seed}")
    torch.manual_seed(seed)


def test_moe_topk_appends_shared_slots(device: str) -> None:
    _seed()
    logits = torch.randn(5, 64, device=device)
    bias = torch.randn(64, device=device) * 0.1
    w, ids = moe_topk(logits, e_score_correction_bias=bias, n_shared=2, **V3_NOAUX)
    assert w.shape == ids.shape == (5, 10)
    assert_same_routing((w[:, :8], ids[:, :8]), moe_topk(logits, e_score_correction_bias=bias, **V3_NOAUX))
    assert (ids[:, 8:] == torch.tensor([64, 65], device=device)).all() and (w[:, 8:] == 1.0).all()
    assert_same_routing((w, ids), moe_topk_ref(logits, e_score_correction_bias=bias, n_shared=2, **V3_NOAUX))


# (routing, E, hidden): V2-Lite (h 2048) / V3 (h 7168) scaled down; hidden not a power of two; V3 at its real
# E and h once (its gate GEMV loops over h in 8192-wide tiles only past 8192, so this is one tile per row).
ROUTE_CASES = [(V2_GREEDY, 64, 200), (V2_GROUPED, 64, 128), (V3_NOAUX, 64, 300),
               (dict(V3_NOAUX, n_group=8, topk_group=4), 256, 7168)]


@pytest.mark.parametrize("kw,num_experts,hidden", ROUTE_CASES)
@pytest.mark.parametrize("tokens,n_shared", [(1, 2), (5, 0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moe_route_matches_ref(kw: dict, num_experts: int, hidden: int, tokens: int, n_shared: int,
                               dtype: torch.dtype, device: str) -> None:
    """Same experts as gate-in-fp32 + moe_topk_ref, weights within fp32 rounding; the sync counts left zero."""
    _seed()
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    weight = (torch.randn(num_experts, hidden, device=device) * hidden ** -0.5).to(dtype)
    bias = torch.randn(num_experts, device=device) * 0.1 if kw["topk_method"] == "noaux_tc" else None
    sync = torch.zeros(8, dtype=torch.int32, device=device)
    for _ in range(2 if hidden < 7168 else 1):     # the second launch reuses the counts (V3's size: once, CI time)
        got = moe_route(x, weight, e_score_correction_bias=bias, n_shared=n_shared, sync=sync, **kw)
        assert got[0].shape == got[1].shape == (tokens, kw["top_k"] + n_shared) and got[1].dtype == torch.int32
        assert not sync.any()
        ties = near_ties(F.linear(x.float(), weight.float()), e_score_correction_bias=bias, **kw)
        assert_same_routing(got, moe_route_ref(x, weight, e_score_correction_bias=bias, n_shared=n_shared, **kw), ties)


@pytest.mark.parametrize("config", [dict(BLOCK_E=1, BLOCK_H=64, num_warps=1), dict(BLOCK_E=32, BLOCK_H=32, num_warps=4)])
def test_moe_route_tile_configs(config: dict, device: str) -> None:
    # one expert per program (S = E) and all experts in one program (S = 1), h in several tiles
    _seed()
    x = torch.randn(3, 100, device=device)
    weight = torch.randn(32, 100, device=device)
    got = moe_route(x, weight, config=config, **V2_GREEDY)
    assert_same_routing(got, moe_route_ref(x, weight, **V2_GREEDY), near_ties(F.linear(x, weight), **V2_GREEDY))


@pytest.mark.gpu
def test_moe_route_cuda_graph_replays() -> None:
    """V3 routing at its real size, captured once and replayed on new inputs (the counts reset themselves)."""
    _seed()
    kw = V3_NOAUX
    x = torch.randn(16, 7168, device="cuda", dtype=torch.bfloat16)          # 16 x 256 programs race per replay
    weight = (torch.randn(256, 7168, device="cuda") * 0.02).to(torch.bfloat16)
    bias = torch.randn(256, device="cuda") * 0.1
    sync = torch.zeros(16, dtype=torch.int32, device="cuda")
    moe_route(x, weight, e_score_correction_bias=bias, n_shared=1, sync=sync, **kw)          # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_route(x, weight, e_score_correction_bias=bias, n_shared=1, sync=sync, **kw)
    for _ in range(20):
        x.copy_(torch.randn_like(x))
        graph.replay()
        ties = near_ties(F.linear(x.float(), weight.float()), e_score_correction_bias=bias, **kw)
        assert_same_routing(out, moe_route_ref(x, weight, e_score_correction_bias=bias, n_shared=1, **kw), ties)
    assert not sync.any()


@pytest.mark.parametrize("kw,num_experts,hidden", ROUTE_CASES[:3])
@pytest.mark.parametrize("tokens,config", [(1, None), (5, None), (3, dict(BLOCK_E=8, BLOCK_H=64, num_warps=4))])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_moe_route_norm_matches_ref(kw: dict, num_experts: int, hidden: int, tokens: int, config: dict | None,
                                    dtype: torch.dtype, device: str) -> None:
    """The post-attention add + norm folded into the router: same experts, the normed rows and x + residual as
    the unfused references; the residual input untouched, the sync counts left zero. The row in one tile (the
    default tiles) or in several (config: 64-wide tiles)."""
    _seed()
    x, res = (torch.randn(tokens, hidden, device=device, dtype=dtype) for _ in range(2))
    norm_w = (torch.rand(hidden, device=device) + 0.5).to(dtype)
    weight = (torch.randn(num_experts, hidden, device=device) * hidden ** -0.5).to(dtype)
    bias = torch.randn(num_experts, device=device) * 0.1 if kw["topk_method"] == "noaux_tc" else None
    sync, res_before = torch.zeros(8, dtype=torch.int32, device=device), res.clone()
    want = moe_route_norm_ref(x, res, norm_w, 1e-6, weight, e_score_correction_bias=bias, n_shared=2, **kw)
    for _ in range(2):
        got = moe_route_norm(x, res, norm_w, 1e-6, weight, e_score_correction_bias=bias, n_shared=2, sync=sync,
                             config=config, **kw)
        assert not sync.any() and torch.equal(res, res_before)
        tol = 2e-3 if dtype == torch.float16 else 1e-5
        torch.testing.assert_close(got[2], want[2], atol=tol, rtol=tol)
        assert torch.equal(got[3], want[3])                                   # x + residual, rounded once
        # NOTE: the routing of the kernel's own normed rows: a last-bit difference of the norm (its sum order)
        # can flip a near-tie between experts, as any two norm kernels would
        ties = near_ties(F.linear(got[2].float(), weight.float()), e_score_correction_bias=bias, **kw)
        assert_same_routing(got[:2], moe_route_ref(got[2], weight, e_score_correction_bias=bias, n_shared=2, **kw),
                            ties)


@pytest.mark.parametrize("fn", ["topk", "route", "route_norm"])
@pytest.mark.parametrize("n_shared", [0, 1])
def test_row_mask_gives_padding_rows_no_expert(fn: str, n_shared: int, device: str) -> None:
    """`row_mask` (decode graphs' padding rows): a masked row gets every id -1, shared slots too; every other row
    the experts and weights it gets without a mask; the three launchers and their references agree."""
    _seed()
    kw, e, h, t = dict(V3_NOAUX), 64, 300, 6
    bias = torch.randn(e, device=device) * 0.1
    x, res = (torch.randn(t, h, device=device) for _ in range(2))
    weight = torch.randn(e, h, device=device) * 0.05
    norm_w = torch.rand(h, device=device) + 0.5
    mask = torch.tensor([True, False, True, True, False, False], device=device)
    args = dict(kw, e_score_correction_bias=bias, n_shared=n_shared)
    run = {"topk": lambda f, **m: f(x @ weight.T, **args, **m),
           "route": lambda f, **m: f(x, weight, **args, **m),
           "route_norm": lambda f, **m: f(x, res, norm_w, 1e-6, weight, **args, **m)[:2]}[fn]
    kernel, ref = {"topk": (moe_topk, moe_topk_ref), "route": (moe_route, moe_route_ref),
                   "route_norm": (moe_route_norm, moe_route_norm_ref)}[fn]
    plain = run(kernel)
    for got in (run(kernel, row_mask=mask), run(ref, row_mask=mask)):
        assert (got[1][~mask] == -1).all()
        assert_same_routing((got[0][mask], got[1][mask]), (plain[0][mask], plain[1][mask]))


@pytest.mark.parametrize("rows_values", [None, 512])      # the shipped tile (one program an expert here), or 4 rows
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_moe_route_norm_runs_the_shared_experts_gate_up(rows_values: int | None, dtype: torch.dtype, device: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`shared=`: the same launch writes silu(gate . h) * (up . h) of each shared expert on the normed row h, and
    its h and x + residual are those of the launch without it (x + residual the same bits, h within a last bit:
    with the shared programs the launch runs 8 warps, whose sums may go in another order), routed as the reference
    routes that h. I = 48 is no multiple of the programs' rows (masked tails)."""
    import mlaserve.kernels.moe_topk as mt

    if rows_values is not None:
        monkeypatch.setattr(mt, "SHARED_ROWS_VALUES", rows_values)
    _seed()
    hidden, inter, n_shared, kw = 64, 48, 2, V2_GROUPED
    x, res = (torch.randn(1, hidden, device=device, dtype=dtype) for _ in range(2))
    norm_w = (torch.rand(hidden, device=device) + 0.5).to(dtype)
    weight = (torch.randn(16, hidden, device=device) * hidden ** -0.5).to(dtype)
    w13 = (torch.randn(n_shared, 2 * inter, hidden, device=device) * hidden ** -0.5).to(dtype)
    sync = torch.zeros(8, dtype=torch.int32, device=device)
    plain = moe_route_norm(x, res, norm_w, 1e-6, weight, n_shared=n_shared, sync=sync, **kw)
    out = torch.full((n_shared, inter), float("nan"), device=device, dtype=dtype)
    got = moe_route_norm(x, res, norm_w, 1e-6, weight, n_shared=n_shared, sync=sync, shared=(w13, out), **kw)
    assert not sync.any()
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    assert torch.equal(got[3], plain[3])
    torch.testing.assert_close(got[2], plain[2], atol=tol, rtol=tol)
    ties = near_ties(F.linear(got[2].float(), weight.float()), **kw)           # the routing of its own h
    assert_same_routing(got[:2], moe_route_ref(got[2], weight, n_shared=n_shared, **kw), ties)
    gu = got[2][0].float() @ w13.float().transpose(1, 2)                      # [n, 2I] from the kernel's own h
    want = F.silu(gu[:, :inter]) * gu[:, inter:]
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)
    ref_out = torch.empty_like(out)
    moe_route_norm_ref(x, res, norm_w, 1e-6, weight, n_shared=n_shared, shared=(w13, ref_out), **kw)
    torch.testing.assert_close(ref_out, out, atol=tol * 4, rtol=tol * 4)
