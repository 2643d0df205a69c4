"""Absorbed-MLA decode attention over the paged latent KV cache (DeepSeek-V2 sec. 2.1, weight absorption).

Legend: `T` query tokens (= B * num_q), `B` requests, `H` local heads, `D` = L + R = 576, `L` kv_lora_rank (512),
`R` qk_rope_head_dim (64), `S` kv splits, `N` cached tokens of one request. One latent KV head: K = all D, V = K[:L].
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mlaserve.kernels.pdl import pdl_enter, pdl_meta, pdl_release
from mlaserve.kernels.precision import dot_precision

LOG2E = 1.4426950408889634
NUM_SMS = 132              # H100 SXM; the split heuristic aims for ~WAVES programs per SM
WAVES = 1                  # on the H100 sweep a second wave only added reduce work
MIN_SPLIT_TOKENS = 64      # shorter splits cost more in the reduce than they gain (sweep_mla_short.py, H100)
MAX_SPLITS = 128
REDUCE_TILE = 8192         # fp32 values of [S, BLOCK_L] one reduce program holds
# NOTE: one split writes the output directly (no reduce launch). Merging several splits in the decode kernel's
# last-arriving program instead of a second launch (tried: benchmarks/probe_mla_latency.py at its commit, results in
# benchmarks/results/decode-fold-h100.md) was slower at every size on an H100: +2.8 us at 16 heads x 4 splits, up
# to +400 us at 128 heads x 66 splits; one program's serial merge costs more than a launch.
# NOTE: reading each split's first cache tile before the PDL wait (this step's rows re-read after it) was slower on an
# H200: V2-Lite graph replay 2.50 against 2.15 ms at bs 1, 9.8 against 9.25 ms at bs 64, alternated in one call
# (benchmarks/results/gemv1-h200.md). Tried at aa75bf9 and removed.
# NOTE: merging the splits inside W_UV's head GEMM instead of the reduce launch (each GEMM program summed its rows'
# used splits a K block at a time, lse then partial, before its dot) took 27 launches a step away and was slower on
# an H200: V2-Lite graph replay 2.43 / 2.44 against 2.23 / 2.23 ms at bs 1, 10.0 / 10.1 against 9.45 / 9.62 ms at
# bs 64, alternated in one call (benchmarks/results/merge-moe-h200.md): its split loop is a chain of dependent L2
# reads in every program. Tried at dcf9a7e and removed.
# NOTE: one request in 32-token tiles (4 warps) was 0.3-0.8 us a call faster than the H=16 entry below in
# benchmarks/probe_mla_rows.py on an H200 (27 calls back to back in one graph; 7.6 -> 6.9 us at bs 1, 256 tokens),
# but in the decode graph, together with the entry's 8 warps, equal to 4 warps within the spread (V2-Lite bs 1 graph
# replay 2.16-2.20 against 2.14-2.21 ms; benchmarks/results/mla-short-h200.md). Tried at 74c751e and removed. A
# one-head-a-program variant with its dot products on CUDA cores was 1.4x (bs 1, 256 tokens) to 25x (bs 64, 4096
# tokens) slower (same file).

_FLOAT = (torch.float16, torch.bfloat16, torch.float32)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


class MLADecodeConfig(NamedTuple):
    block_h: int      # query rows (token x head pairs of one request) per program; each cache tile serves them all
    block_n: int      # cached tokens per tile
    num_warps: int
    num_stages: int


# Keyed by query rows per request (num_q * H), smallest key >= rows wins; larger row counts use the last
# entry with several head blocks. H=16 (V2-Lite) is bandwidth-bound; H=128 (V3, ~241 FLOP/byte) compute-bound.
# Chosen by benchmarks/sweep_mla_decode.py on an H100 (benchmarks/results/tuning/h100-mla-decode-sweep.txt); H=16
# tiles of 64 tokens by benchmarks/sweep_mla_short.py (decode-graph split counts: 1-3 us faster up to 4k tokens,
# equal at 16k, 7% slower at 64 x 2048). Their 8 warps: on an H100 1.2-5.4 us a call faster alone
# (benchmarks/sweep_mla_batch.py, tuning/h100-mla-decode-batch-sweep.txt), V2-Lite decode graph equal within the
# spread at 256 tokens (results/decode-host-h100.md); on an H200 1-25 us a call faster at bs 1-64 and 256-4096
# tokens (benchmarks/probe_mla_rows.py), in the V2-Lite decode graph equal within the spread at 256 tokens and at
# bs 64 x 4096 tokens (12.22-12.51 against 12.36-12.51 ms alternated; benchmarks/results/mla-short-h200.md,
# l2-prefetch-h200.md).
CONFIGS: dict[int, MLADecodeConfig] = {
    16: MLADecodeConfig(block_h=16, block_n=64, num_warps=8, num_stages=2),
    32: MLADecodeConfig(block_h=32, block_n=128, num_warps=8, num_stages=2),
    64: MLADecodeConfig(block_h=64, block_n=64, num_warps=8, num_stages=3),
}


def pick_config(rows: int) -> MLADecodeConfig:
    for key in sorted(CONFIGS):
        if rows <= key:
            return CONFIGS[key]
    return CONFIGS[max(CONFIGS)]


def decode_programs(batch: int, rows: int) -> int:
    """Stage-1 programs per split for `batch` requests of `rows` query rows (num_q * H) each."""
    return batch * triton.cdiv(rows, pick_config(rows).block_h)


def choose_num_kv_splits(programs: int, max_len: int, num_sms: int = NUM_SMS) -> int:
    """Splits per request so `programs` (requests x head blocks) x splits fills at most WAVES waves of the GPU
    (a partial extra wave costs a whole one) without splits shorter than MIN_SPLIT_TOKENS."""
    want = max(1, WAVES * num_sms // max(programs, 1))
    most = triton.cdiv(max(max_len, 1), MIN_SPLIT_TOKENS)
    return max(1, min(want, most, MAX_SPLITS))


@triton.jit
def _load_cols(ptrs, rows_ok, offs, D: tl.constexpr, BLOCK_D: tl.constexpr):
    # [rows, BLOCK_D] tile of D real columns; the padding columns (BLOCK_D > D) read as 0
    if D == BLOCK_D:
        x = tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
    else:
        x = tl.load(ptrs, mask=rows_ok[:, None] & (offs < D)[None, :], other=0.0)
    return x


@triton.jit
def _store_cols(ptrs, x, rows_ok, offs, D: tl.constexpr, BLOCK_D: tl.constexpr):
    # the D real columns of a [rows, BLOCK_D] tile
    if D == BLOCK_D:
        tl.store(ptrs, x, mask=rows_ok[:, None])
    else:
        tl.store(ptrs, x, mask=rows_ok[:, None] & (offs < D)[None, :])


@triton.jit
def split_bounds(SeqLens, ReqPoolIdx, num_splits, BLOCK_N: tl.constexpr):
    """This program's request b (grid axis 0) and split (axis 2) -> (b, split, seq_len, the request's pool row, the
    split's first and end cache positions): num_splits equal runs of whole BLOCK_N tiles, the last ones empty
    (start >= seq_len) when they do not divide."""
    b = tl.program_id(0)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    pool_row = tl.load(ReqPoolIdx + b).to(tl.int64)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    return b, split, seq_len, pool_row, start, tl.minimum(start + split_len, seq_len)


@triton.jit
def tile_slots(ReqToToken, pool_row, stride_rtt, n0, end, BLOCK_N: tl.constexpr):
    """The cache slots of positions n0 .. n0 + BLOCK_N - 1 of one request (0 at and past end), int64."""
    pos = n0 + tl.arange(0, BLOCK_N)
    return tl.load(ReqToToken + pool_row * stride_rtt + pos, mask=pos < end, other=0).to(tl.int64)


@triton.jit
def attend_tiles(q_nope, q_pe, KV, ReqToToken, pool_row, start, end, limit, tree_bits, seq_len, num_q, qk_scale,
                 stride_kv, stride_rtt, TreeMask, L: tl.constexpr, R: tl.constexpr, BLOCK_L: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr,
                 DOT_PREC: tl.constexpr, first_slots=None):
    """Online softmax of query rows q_nope [BLOCK_H, BL] / q_pe [BLOCK_H, BR] over cache positions [start, end) of
    one request (its pool row), row r seeing positions < limit[r] (and its tree bits with a TreeMask):
    (acc [BLOCK_H, BL] unnormalised output, m_i running max, l_i running sum), all fp32, log2 domain.
    first_slots: the first tile's cache slots [BLOCK_N] (`tile_slots`), read by the caller already."""
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pos_ok = pos < end
        if first_slots is None:
            slot = tile_slots(ReqToToken, pool_row, stride_rtt, n0, end, BLOCK_N)
        elif n0 == start:
            slot = first_slots
        else:
            slot = tile_slots(ReqToToken, pool_row, stride_rtt, n0, end, BLOCK_N)
        kv_row = KV + slot * stride_kv
        kv_nope = _load_cols(kv_row[:, None] + offs_l[None, :], pos_ok, offs_l, L, BLOCK_L)     # [BLOCK_N, BL]
        kv_pe = _load_cols(kv_row[:, None] + L + offs_r[None, :], pos_ok, offs_r, R, BLOCK_R)   # [BLOCK_N, BR]
        kv_nope = kv_nope.to(DOT_DTYPE)
        # s: [BLOCK_H, BLOCK_N] = q . K^T, the 576-wide dot split as 512 latent + 64 rope
        s = tl.dot(q_nope, tl.trans(kv_nope), input_precision=DOT_PREC)
        s += tl.dot(q_pe, tl.trans(kv_pe.to(DOT_DTYPE)), input_precision=DOT_PREC)
        visible = (pos[None, :] < limit[:, None]) & pos_ok[None, :]
        if TreeMask is not None:
            rel = pos - (seq_len - num_q)            # [BLOCK_N] index among the last num_q positions (< 0: prefix)
            bit = (tree_bits[:, None] >> tl.maximum(rel, 0).to(tl.int64)[None, :]) & 1
            visible = visible & ((rel < 0)[None, :] | (bit != 0))
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # NOTE: a row may see nothing in this tile or split; a finite pivot keeps exp2 free of (-inf) - (-inf).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), kv_nope, input_precision=DOT_PREC)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def store_split(acc, m_i, l_i, Out, MidO, MidLse, t, h, row_ok, split, start, seq_len, v_scale, stride_ot, stride_oh,
                H, num_splits, L: tl.constexpr, BLOCK_L: tl.constexpr):
    """A split's rows (tokens t, heads h [BLOCK_H]) from `attend_tiles`: normalised, to Out when MidO is None (one
    split), else to MidO [T*H*S, L] with their log2-sum-exp to MidLse [T*H*S]."""
    offs_l = tl.arange(0, BLOCK_L)
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    o = acc / l_safe[:, None] * v_scale
    out_ptrs = Out + t[:, None] * stride_ot + h[:, None] * stride_oh + offs_l[None, :]     # [BLOCK_H, BL]
    if MidO is None:
        _store_cols(out_ptrs, o.to(Out.dtype.element_ty), row_ok, offs_l, L, BLOCK_L)
    else:
        lse = tl.where(seen, m_i + tl.log2(l_safe), float("-inf"))
        th = t * H + h
        mid = th * num_splits + split                # [BLOCK_H] row of MidO [T*H*S, L] / MidLse [T*H*S]
        # NOTE: a split past the end (short contexts under a graph's fixed split count) writes only its -inf lse;
        # the reduce skips its MidO rows, so empty splits cost no memory traffic.
        _store_cols(MidO + mid[:, None] * L + offs_l[None, :], o, row_ok & (h * 0 + start < seq_len), offs_l,
                    L, BLOCK_L)
        tl.store(MidLse + mid, lse, mask=row_ok)


# NOTE: ReqPoolIdx / SeqLens are not specialized on 16-byte alignment: a mixed batch passes its decodes' part as a
# slice at any offset, and each alignment would be one more compile on first use (a 1.5 s serving stall)
@triton.jit(do_not_specialize=["num_splits", "ReqPoolIdx", "SeqLens"])
def _mla_decode_kernel(Q, QPe, KV, ReqToToken, ReqPoolIdx, SeqLens, TreeMask, MidO, MidLse, Out,
                       qk_scale, v_scale, stride_qt, stride_qh, stride_pt, stride_ph, stride_kv, stride_rtt,
                       stride_ot, stride_oh, H, num_q, num_splits,
                       L: tl.constexpr, R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr,
                       DOT_PREC: tl.constexpr, PDL: tl.constexpr):
    """Stage 1: one (request, head block, split) -> normalised partial output and its log2-sum-exp.
    L / R that are not powers of two >= 16 run padded to BLOCK_L / BLOCK_R (zero columns add nothing).

        MidO None (one split)  | the partial is the output: written to Out
        MidO given             | partials to MidO / MidLse, merged by _mla_decode_reduce_kernel
    """
    pdl_enter(PDL)
    hb = tl.program_id(1)
    b, split, seq_len, pool_row, start, end = split_bounds(SeqLens, ReqPoolIdx, num_splits, BLOCK_N)

    # rows = (query token j, head h) pairs of request b, j-major: one cache tile is read once for all of them.
    rows = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = rows < num_q * H
    j = rows // H
    h = rows % H
    t = (b * num_q + j).to(tl.int64)
    limit = seq_len - num_q + j + 1                  # [BLOCK_H] row sees cache positions < limit (causal)
    tree_bits = t                                    # (read only with a tree mask)
    if TreeMask is not None:                         # bit i: row sees position seq_len - num_q + i (i <= j)
        tree_bits = tl.load(TreeMask + t, mask=row_ok, other=0).to(tl.int64)

    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    q_row = Q + t * stride_qt + h * stride_qh
    pe_row = QPe + t * stride_pt + h * stride_ph
    q_nope = _load_cols(q_row[:, None] + offs_l[None, :], row_ok, offs_l, L, BLOCK_L)      # [BLOCK_H, BL]
    q_pe = _load_cols(pe_row[:, None] + offs_r[None, :], row_ok, offs_r, R, BLOCK_R)       # [BLOCK_H, BR]

    acc, m_i, l_i = attend_tiles(q_nope, q_pe, KV, ReqToToken, pool_row, start, end, limit, tree_bits, seq_len, num_q,
                                 qk_scale, stride_kv, stride_rtt, TreeMask, L, R, BLOCK_L, BLOCK_R, BLOCK_H, BLOCK_N,
                                 DOT_DTYPE, DOT_PREC)

    pdl_release(PDL)
    store_split(acc, m_i, l_i, Out, MidO, MidLse, t, h, row_ok, split, start, seq_len, v_scale, stride_ot,
                stride_oh, H, num_splits, L, BLOCK_L)


@triton.jit(do_not_specialize=["num_splits"])
def _mla_decode_reduce_kernel(MidO, MidLse, Out, stride_ot, stride_oh, H, num_splits,
                              L: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_L: tl.constexpr, PDL: tl.constexpr):
    """Stage 2: merge the S partial outputs of one (token, head) by their log-sum-exp, one L chunk each
    (L need not be a multiple of BLOCK_L: the last chunk is masked)."""
    pdl_enter(PDL)
    th = tl.program_id(0).to(tl.int64)               # t * H + h
    offs_l = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    l_ok = offs_l < L
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < num_splits
    lse = tl.load(MidLse + th * num_splits + offs_s, mask=s_ok, other=float("-inf"))     # [BLOCK_S]
    w = tl.exp2(lse - tl.max(lse, axis=0))           # empty splits weigh 0
    mid = (th * num_splits + offs_s)[:, None] * L + offs_l[None, :]
    full = s_ok & (lse > float("-inf"))              # empty splits' MidO rows are never written: not read either
    o = tl.load(MidO + mid, mask=full[:, None] & l_ok[None, :], other=0.0)             # [BLOCK_S, BLOCK_L]
    res = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
    out = Out + (th // H) * stride_ot + (th % H) * stride_oh + offs_l
    tl.store(out, res.to(Out.dtype.element_ty), mask=l_ok)


def _padded(n: int) -> int:
    """Columns a tile of n values takes: tl.arange and tl.dot need a power of two >= 16."""
    return max(16, triton.next_power_of_2(n))


def _split_q(q: torch.Tensor, q_pe: torch.Tensor | None, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(latent query [T, H, >= L], rope query [T, H, R]) from q [T, H, L + R] or the pair (q [T, H, L], q_pe)."""
    assert q.dim() == 3, f"q must be [T, H, D], got {tuple(q.shape)}"
    if q_pe is None:
        assert 0 < kv_lora_rank < q.shape[2], f"kv_lora_rank ({kv_lora_rank}) must be in (0, D={q.shape[2]})"
        return q, q[..., kv_lora_rank:]
    assert q_pe.dim() == 3 and q_pe.shape[:2] == q.shape[:2] and q.shape[2] == kv_lora_rank, \
        f"q [T, H, L={kv_lora_rank}] and q_pe [T, H, R] expected, got {tuple(q.shape)} and {tuple(q_pe.shape)}"
    assert q_pe.dtype == q.dtype and q_pe.stride(2) == 1 and q_pe.device == q.device, \
        "q_pe must share q's dtype and device, contiguous in its last dim"
    return q, q_pe


def _check_args(q: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, req_to_token: torch.Tensor,
                req_pool_idx: torch.Tensor, seq_lens: torch.Tensor, kv_lora_rank: int, num_q: int,
                num_kv_splits: int | None, out: torch.Tensor | None, tree_mask: torch.Tensor | None = None) -> None:
    t, h, _ = q.shape
    d = kv_lora_rank + q_pe.shape[2]
    assert q.dtype in _FLOAT, f"q dtype must be fp16/bf16/fp32, got {q.dtype}"
    assert q.stride(2) == 1, "q must be contiguous in its last dim"
    assert kv_cache.dim() == 2 and kv_cache.shape[1] == d, \
        f"kv_cache must be [num_slots, {d}], got {tuple(kv_cache.shape)}"
    assert kv_cache.dtype in _FLOAT + _FP8, f"kv_cache dtype must be fp16/bf16/fp32/fp8, got {kv_cache.dtype}"
    assert kv_cache.stride(1) == 1, "kv_cache rows must be contiguous"
    assert req_to_token.dim() == 2 and req_to_token.dtype == torch.int32 and req_to_token.stride(1) == 1, \
        "req_to_token must be a row-contiguous int32 [max_reqs, max_context] tensor"
    b = seq_lens.shape[0]
    assert seq_lens.shape == (b,) and seq_lens.dtype in (torch.int32, torch.int64), "seq_lens must be int32 [B]"
    assert req_pool_idx.shape == (b,) and req_pool_idx.dtype in (torch.int32, torch.int64), \
        f"req_pool_idx must be int32/int64 [B={b}], got {req_pool_idx.dtype} {tuple(req_pool_idx.shape)}"
    assert num_q >= 1 and t == b * num_q, f"q has T={t} tokens but B={b} requests x num_q={num_q}"
    assert num_kv_splits is None or num_kv_splits >= 1, f"num_kv_splits must be >= 1, got {num_kv_splits}"
    devs = {x.device for x in (q, kv_cache, req_to_token, req_pool_idx, seq_lens)}
    assert len(devs) == 1, f"all tensors must be on one device, got {devs}"
    if tree_mask is not None:
        assert tree_mask.shape == (t,) and tree_mask.dtype == torch.int64 and tree_mask.device == q.device, \
            f"tree_mask must be int64 [T={t}] on {q.device}, got {tree_mask.dtype} {tuple(tree_mask.shape)}"
        assert num_q <= 64, f"a tree mask covers at most 64 query tokens per request, got num_q={num_q}"
    if out is not None:
        assert out.shape == (t, h, kv_lora_rank) and out.dtype == q.dtype and out.stride(2) == 1, \
            f"out must be [{t}, {h}, {kv_lora_rank}] {q.dtype}, last dim contiguous"


def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, req_to_token: torch.Tensor, req_pool_idx: torch.Tensor,
               seq_lens: torch.Tensor, sm_scale: float, *, kv_lora_rank: int = 512, num_q: int = 1,
               kv_scale: float | None = None, num_kv_splits: int | None = None,
               out: torch.Tensor | None = None, q_pe: torch.Tensor | None = None,
               tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Absorbed-MLA decode: out[t, h] = softmax(q[t, h] . K^T * sm_scale) @ V over the request's cached tokens.

    Args:
        q: [T, H, D] absorbed latent query (L) + roped query (R); T = B * num_q, request b owns rows b*num_q ...
            Or, with `q_pe` [T, H, R], q is the latent part alone [T, H, L] (any strides with the last dim
            contiguous: no concatenation needed).
        kv_cache: [num_slots, D] one layer's latent pool; fp8 values are `stored * kv_scale`.
        req_to_token: [max_reqs, max_context] int32, position -> slot. req_pool_idx: [B] its row per request.
        seq_lens: [B] cached tokens per request including the num_q new ones; query token j of request b sits
            at position seq_lens[b] - num_q + j and sees positions 0 .. that one (needs seq_lens[b] >= num_q).
        num_kv_splits: splits of each request's tokens; None picks one from B and max(seq_lens) (a host sync:
            pass it explicitly under CUDA-graph capture).
        tree_mask: [T] int64, speculative tree verification: bit i of row b*num_q + j lets query j of request b see
            position seq_lens[b] - num_q + i, for i <= j (bits above j are ignored: a tree lists parents first);
            the prefix stays visible. None: causal (every bit i <= j set).
        One split writes `out` directly; more write fp32 partials that a second launch merges.
    Returns:
        [T, H, L] in q.dtype (written into `out` when given).
    """
    q, q_pe = _split_q(q, q_pe, kv_lora_rank)
    _check_args(q, q_pe, kv_cache, req_to_token, req_pool_idx, seq_lens, kv_lora_rank, num_q, num_kv_splits, out,
                tree_mask)
    t, h = q.shape[:2]
    d = kv_lora_rank + q_pe.shape[2]
    big_l = kv_lora_rank
    out = q.new_empty((t, h, big_l)) if out is None else out
    if t == 0:
        return out
    b = seq_lens.shape[0]
    cfg = pick_config(num_q * h)
    head_blocks = triton.cdiv(num_q * h, cfg.block_h)
    splits = num_kv_splits or choose_num_kv_splits(decode_programs(b, num_q * h), int(seq_lens.max()))
    mid_o = mid_lse = None
    if splits > 1:
        mid_o = torch.empty((t, h, splits, big_l), dtype=torch.float32, device=q.device)   # [T, H, S, L]
        mid_lse = torch.empty((t, h, splits), dtype=torch.float32, device=q.device)        # [T, H, S]
    scale = 1.0 if kv_scale is None else float(kv_scale)
    _mla_decode_kernel[(b, head_blocks, splits)](
        q, q_pe, kv_cache, req_to_token, req_pool_idx, seq_lens, tree_mask, mid_o, mid_lse, out, sm_scale * scale * LOG2E, scale, q.stride(0), q.stride(1), q_pe.stride(0),
        q_pe.stride(1), kv_cache.stride(0), req_to_token.stride(0), out.stride(0), out.stride(1),
        h, num_q, splits, L=big_l, R=d - big_l, BLOCK_L=_padded(big_l), BLOCK_R=_padded(d - big_l),
        BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n,
        DOT_DTYPE=_TL_DTYPE[q.dtype], DOT_PREC=dot_precision(q.dtype), **pdl_meta(q.device),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if splits > 1:
        _reduce(mid_o, mid_lse, out, splits)
    return out


def _reduce(mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor, splits: int) -> None:
    # mid_o: [T, H, S, L], mid_lse: [T, H, S] -> out: [T, H, L], the second launch
    t, h, _, big_l = mid_o.shape
    block_s = triton.next_power_of_2(splits)
    block_l = max(16, min(_padded(big_l), REDUCE_TILE // block_s))
    _mla_decode_reduce_kernel[(t * h, triton.cdiv(big_l, block_l))](
        mid_o, mid_lse, out, out.stride(0), out.stride(1), h, splits,
        L=big_l, BLOCK_S=block_s, BLOCK_L=block_l, **pdl_meta(out.device), num_warps=4)


def tree_visible(bits: torch.Tensor, num_q: int) -> torch.Tensor:
    """[num_q] int64 tree-mask rows -> [num_q, num_q] bool: query j sees new token i (bit i set, i <= j)."""
    i = torch.arange(num_q, device=bits.device)
    return ((bits[:, None] >> i[None, :]) & 1).bool() & (i[None, :] <= i[:, None])


def mla_decode_ref(q: torch.Tensor, kv_cache: torch.Tensor, req_to_token: torch.Tensor,
                   req_pool_idx: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float, *, kv_lora_rank: int = 512,
                   num_q: int = 1, kv_scale: float | None = None, num_kv_splits: int | None = None,
                   out: torch.Tensor | None = None, q_pe: torch.Tensor | None = None,
                   tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Reference (the spec of `mla_decode`), one request at a time in fp32. `num_kv_splits` does not change
    the math and is ignored."""
    if q_pe is not None:
        q = torch.cat([q[..., :kv_lora_rank], q_pe], dim=-1)
    t, h, _ = q.shape
    res = torch.empty((t, h, kv_lora_rank), dtype=torch.float32, device=q.device)
    scale = 1.0 if kv_scale is None else kv_scale
    for b, (row, n) in enumerate(zip(req_pool_idx.tolist(), seq_lens.tolist())):
        kv = kv_cache[req_to_token[row, :n].long()].float() * scale           # [N, D]
        q_b = q[b * num_q:(b + 1) * num_q].float()                            # [num_q, H, D]
        s = torch.einsum("jhd,nd->jhn", q_b, kv) * sm_scale                   # [num_q, H, N]
        last = n - num_q + torch.arange(num_q, device=q.device)               # [num_q] position of query j
        hidden = torch.arange(n, device=q.device)[None, :] > last[:, None]    # [num_q, N] causal mask
        if tree_mask is not None:                                             # ancestors only among the new ones
            hidden[:, n - num_q:] |= ~tree_visible(tree_mask[b * num_q:(b + 1) * num_q], num_q)
        s = s.masked_fill(hidden[:, None, :], float("-inf"))
        res[b * num_q:(b + 1) * num_q] = torch.softmax(s, dim=-1) @ kv[:, :kv_lora_rank]
    if out is None:
        return res.to(q.dtype)
    return out.copy_(res)
