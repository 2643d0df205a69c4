"""Extend (prefill) attention in the non-absorbed MLA form: varlen flash attention over the new tokens,
plus the cached prefix expanded from the latent cache chunk by chunk and merged by log-sum-exp.

Shapes: `T` new tokens, `B` requests, `H` heads, `Dn` qk_nope_head_dim, `R` qk_rope_head_dim,
`Dv` v_head_dim, `L` kv_lora_rank, `S` cache slots, `n` prefix tokens of one chunk.
"""
from __future__ import annotations

import bisect
import functools
import itertools
from typing import Callable, NamedTuple, Sequence

import torch
import triton
import triton.language as tl

from mlaserve.kernels.precision import dot_precision

ExpandKV = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
LOG2E = 1.4426950408889634
# (BLOCK_M, BLOCK_N, num_warps, num_stages) of the flash kernel on the GPU (benchmarks/sweep_mla_prefill.py)
FLASH_CONFIG = (128, 64, 8, 3)


@triton.jit
def _load_tile(ptrs, n_ok, offs_d, D: tl.constexpr, BLOCK_D: tl.constexpr, MASK_ROWS: tl.constexpr):
    # [BLOCK_N, BLOCK_D] tile; masks only where a row may be past the keys or BLOCK_D pads D
    if MASK_ROWS:
        if D == BLOCK_D:
            x = tl.load(ptrs, mask=n_ok[:, None], other=0.0)
        else:
            x = tl.load(ptrs, mask=n_ok[:, None] & (offs_d < D)[None, :], other=0.0)
    else:
        if D == BLOCK_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=(offs_d < D)[None, :], other=0.0)
    return x


@triton.jit
def _attn_tiles(acc, l_i, m_i, q_nope, q_pe, k_ptr, pe_ptr, v_ptr, stride_kt, stride_pt, stride_vt,
                lo, hi, offs_m, len_k, diag, qk_scale,
                D_NOPE: tl.constexpr, D_ROPE: tl.constexpr, D_V: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_DN: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_DV: tl.constexpr,
                HAS_ROPE: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr):
    # online softmax over key blocks [lo, hi); scores kept in log2 units (exp2)
    offs_n = tl.arange(0, BLOCK_N)
    offs_dn, offs_dr, offs_dv = tl.arange(0, BLOCK_DN), tl.arange(0, BLOCK_DR), tl.arange(0, BLOCK_DV)
    # NOTE: k_ptr / pe_ptr / v_ptr point at key `lo` and advance as 64-bit scalars; tile offsets stay int32.
    k_offs = offs_n[:, None] * stride_kt + offs_dn[None, :]                # [BN, DN]
    pe_offs = offs_n[:, None] * stride_pt + offs_dr[None, :]               # [BN, DR]
    v_offs = offs_n[:, None] * stride_vt + offs_dv[None, :]                # [BN, DV]
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n                                            # key index in the request
        n_ok = cols < len_k
        k = _load_tile(k_ptr + k_offs, n_ok, offs_dn, D_NOPE, BLOCK_DN, MASKED)
        qk = tl.dot(q_nope, tl.trans(k), input_precision=DOT_PREC)          # [BM, BN] fp32
        if HAS_ROPE:
            kp = _load_tile(pe_ptr + pe_offs, n_ok, offs_dr, D_ROPE, BLOCK_DR, MASKED)
            qk = tl.dot(q_pe, tl.trans(kp), qk, input_precision=DOT_PREC)
        qk = qk * qk_scale
        if MASKED:
            ok = n_ok[None, :]
            if CAUSAL:
                ok = ok & (cols[None, :] <= offs_m[:, None] + diag)
            qk = tl.where(ok, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # NOTE: a row with no visible key yet keeps m = -inf; shift by 0 so exp2 gives 0, never NaN.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        v = _load_tile(v_ptr + v_offs, n_ok, offs_dv, D_V, BLOCK_DV, MASKED)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
        m_i = m_new
        k_ptr += BLOCK_N * stride_kt
        pe_ptr += BLOCK_N * stride_pt
        v_ptr += BLOCK_N * stride_vt
    return acc, l_i, m_i


@triton.jit
def _flash_attn_varlen_kernel(Q, K, KPE, V, Out, Lse, CuQ, CuK, Table, qk_scale,
                              stride_qt, stride_qh, stride_kt, stride_kh, stride_pt, stride_ph,
                              stride_vt, stride_vh, stride_ot, stride_oh, stride_lt, stride_lh,
                              D_NOPE: tl.constexpr, D_ROPE: tl.constexpr, D_V: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DN: tl.constexpr,
                              BLOCK_DR: tl.constexpr, BLOCK_DV: tl.constexpr,
                              HAS_ROPE: tl.constexpr, CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr):
    # one program = BLOCK_M queries of one request x one head; Table[pid] = (request, q block)
    pid, h = tl.program_id(0), tl.program_id(1)
    req, m_start = tl.load(Table + 2 * pid), tl.load(Table + 2 * pid + 1) * BLOCK_M
    q_beg, k_beg = tl.load(CuQ + req), tl.load(CuK + req)
    len_q, len_k = tl.load(CuQ + req + 1) - q_beg, tl.load(CuK + req + 1) - k_beg
    diag = len_k - len_q                      # causal (bottom-right): query i sees keys j <= i + diag
    offs_m = m_start + tl.arange(0, BLOCK_M)
    m_ok = offs_m < len_q
    q_rows = (q_beg + offs_m).to(tl.int64)
    offs_dn, offs_dr, offs_dv = tl.arange(0, BLOCK_DN), tl.arange(0, BLOCK_DR), tl.arange(0, BLOCK_DV)
    q_ptr = Q + q_rows[:, None] * stride_qt + h * stride_qh
    q_nope = tl.load(q_ptr + offs_dn[None, :], mask=m_ok[:, None] & (offs_dn < D_NOPE)[None, :], other=0.0)
    q_pe = q_nope
    if HAS_ROPE:
        q_pe = tl.load(q_ptr + D_NOPE + offs_dr[None, :], mask=m_ok[:, None] & (offs_dr < D_ROPE)[None, :],
                       other=0.0)
    if CAUSAL:
        hi = tl.minimum(len_k, m_start + BLOCK_M + diag)      # last key any row of the block sees, + 1
        full = tl.minimum(len_k, m_start + diag + 1)          # keys every row of the block sees
    else:
        hi = len_k
        full = len_k
    hi = tl.maximum(hi, 0)
    full = tl.maximum(full, 0) // BLOCK_N * BLOCK_N
    k_ptr = K + k_beg.to(tl.int64) * stride_kt + h * stride_kh
    pe_ptr = KPE + k_beg.to(tl.int64) * stride_pt + h * stride_ph
    v_ptr = V + k_beg.to(tl.int64) * stride_vt + h * stride_vh
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    acc, l_i, m_i = _attn_tiles(acc, l_i, m_i, q_nope, q_pe, k_ptr, pe_ptr, v_ptr, stride_kt, stride_pt,
                                stride_vt, 0, full, offs_m, len_k, diag, qk_scale, D_NOPE, D_ROPE, D_V,
                                BLOCK_N, BLOCK_DN, BLOCK_DR, BLOCK_DV, HAS_ROPE, False, CAUSAL, DOT_PREC)
    skip = full.to(tl.int64)
    acc, l_i, m_i = _attn_tiles(acc, l_i, m_i, q_nope, q_pe, k_ptr + skip * stride_kt, pe_ptr + skip * stride_pt,
                                v_ptr + skip * stride_vt, stride_kt, stride_pt, stride_vt, full, hi, offs_m,
                                len_k, diag, qk_scale, D_NOPE, D_ROPE, D_V,
                                BLOCK_N, BLOCK_DN, BLOCK_DR, BLOCK_DV, HAS_ROPE, True, CAUSAL, DOT_PREC)
    l_ok = l_i > 0.0                                           # False only for a query with no keys
    l_safe = tl.where(l_ok, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(l_ok, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))   # log2 -> ln
    tl.store(Out + q_rows[:, None] * stride_ot + h * stride_oh + offs_dv[None, :],
             out.to(Out.dtype.element_ty), mask=m_ok[:, None] & (offs_dv < D_V)[None, :])
    tl.store(Lse + q_rows * stride_lt + h * stride_lh, lse, mask=m_ok)


class _Plan(NamedTuple):
    table: torch.Tensor   # [NB, 2] int32 (request, q block), heaviest block first
    cu_q: torch.Tensor    # [B + 1] int32 on the device
    cu_k: torch.Tensor    # [B + 1] int32 on the device


@functools.lru_cache(maxsize=128)
def _plan(lens_q: tuple[int, ...], lens_k: tuple[int, ...], block_m: int, causal: bool,
          device: torch.device) -> _Plan:
    # NOTE: cached, so every layer of one batch reuses the same device metadata (no per-layer uploads). Plain
    # Python, not torch ops: CPU torch.repeat_interleave with tensor repeats costs 1-10 ms a call (measured).
    req = [b for b, q in enumerate(lens_q) for _ in range((q + block_m - 1) // block_m)]        # [NB]
    blk = [i for q in lens_q for i in range((q + block_m - 1) // block_m)]                      # [NB]
    work = [lens_k[b] + min((i + 1) * block_m - lens_q[b], 0) if causal else lens_k[b] for b, i in zip(req, blk)]
    order = sorted(range(len(req)), key=lambda j: -work[j])     # longest first (load balance); ties keep order
    table = torch.tensor([(req[j], blk[j]) for j in order], dtype=torch.int32).reshape(-1, 2)
    return _Plan(table.to(device), _cu(lens_q).to(device), _cu(lens_k).to(device))


def _cu(lens: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)


def _lens(cu_seqlens: torch.Tensor) -> tuple[int, ...]:
    cu = cu_seqlens.tolist()
    assert cu and cu[0] == 0 and all(a <= b for a, b in zip(cu[:-1], cu[1:])), "cu_seqlens must rise from 0"
    return tuple(b - a for a, b in zip(cu[:-1], cu[1:]))


def _check_attn(q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor) -> None:
    assert q.dim() == 3 and k_nope.dim() == 3 and k_pe.dim() == 3 and v.dim() == 3, "q/k/v must be [tokens, H, D]"
    h, tk = q.shape[1], k_nope.shape[0]
    assert k_nope.shape[:2] == (tk, h) and k_pe.shape[:2] == (tk, h) and v.shape[:2] == (tk, h), \
        f"k/v must be [Tk, H={h}, D]: got {tuple(k_nope.shape)}, {tuple(k_pe.shape)}, {tuple(v.shape)}"
    assert q.shape[2] == k_nope.shape[2] + k_pe.shape[2], "q dim must equal k dim (nope + rope)"
    assert q.dtype == k_nope.dtype == k_pe.dtype == v.dtype, "q, k and v must share one dtype"
    for name, t in (("q", q), ("k", k_nope), ("k_pe", k_pe), ("v", v)):
        assert t.shape[2] == 0 or t.stride(2) == 1, f"{name} must be contiguous in its last dim"
        assert t.device == q.device, f"{name} must be on {q.device}"


def _flash_attn(q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor,
                lens_q: tuple[int, ...], lens_k: tuple[int, ...], sm_scale: float, causal: bool,
                out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # q: [Tq, H, Dn + R], k_nope: [Tk, H, Dn], k_pe: [Tk, H, R] (head stride may be 0), v: [Tk, H, Dv]
    _check_attn(q, k_nope, k_pe, v)
    assert sum(lens_q) == q.shape[0] and sum(lens_k) <= k_nope.shape[0], "cu_seqlens do not match q / k"
    tq, h, d_nope, d_rope, d_v = q.shape[0], q.shape[1], k_nope.shape[2], k_pe.shape[2], v.shape[2]
    out = torch.empty(tq, h, d_v, dtype=out_dtype, device=q.device)                     # [Tq, H, Dv]
    lse = torch.empty(tq, h, dtype=torch.float32, device=q.device)                      # [Tq, H]
    block_m, block_n, warps, stages = FLASH_CONFIG if q.is_cuda else (32, 16, 4, 1)
    plan = _plan(tuple(lens_q), tuple(lens_k), block_m, causal, q.device)
    if plan.table.shape[0] == 0:
        return out, lse
    pe = k_pe if d_rope > 0 else k_nope
    _flash_attn_varlen_kernel[(plan.table.shape[0], h)](
        q, k_nope, pe, v, out, lse, plan.cu_q, plan.cu_k, plan.table, sm_scale * LOG2E,
        q.stride(0), q.stride(1), k_nope.stride(0), k_nope.stride(1), pe.stride(0), pe.stride(1),
        v.stride(0), v.stride(1), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        D_NOPE=d_nope, D_ROPE=d_rope, D_V=d_v, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_DN=max(triton.next_power_of_2(d_nope), 16), BLOCK_DR=max(triton.next_power_of_2(d_rope), 16),
        BLOCK_DV=max(triton.next_power_of_2(d_v), 16), HAS_ROPE=d_rope > 0, CAUSAL=causal,
        DOT_PREC=dot_precision(q.dtype), num_warps=warps, num_stages=stages)
    return out, lse


# With CUDNN_SELF_ATTN, the new tokens' causal self-attention of a prefill runs on torch's cuDNN attention where
# `cudnn_self_attn_ok` holds; everything else (fp32, short or many requests, the prefix chunks, other GPUs) on the
# Triton kernel above. On an H100 (benchmarks/results/cudnn-prefill-h100.md): cuDNN's kernel is 1.18-1.35x ours
# alone at 1-16k tokens and as accurate against fp32 (2.1-2.4e-3); in the model, V3 4L 1 x 16384 prefills were
# 6-8% faster in every pair, 8192 faster, 4096 +-3% either way (so the threshold), and both paths' logits were as
# close to a prefill with fp32 attention (2.0e-1 / 2.1e-1 at 4096, 5.3e-2 / 5.5e-2 at 16384).
CUDNN_SELF_ATTN = True
CUDNN_MIN_TOKENS = 8192     # every request's new tokens
CUDNN_MAX_REQS = 8          # one cuDNN call per request


@functools.lru_cache(maxsize=None)
def cudnn_attn_available(device_index: int) -> bool:
    """cuDNN's fused attention with q/k and v head dims apart (192 / 128): cuDNN >= 9.0 on compute capability 9.0."""
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return (version is not None and version >= 90000
            and hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention")
            and torch.cuda.get_device_capability(device_index) == (9, 0))


def cudnn_self_attn_ok(q: torch.Tensor, lens: Sequence[int]) -> bool:
    """Whether the causal self-attention of requests of `lens` new tokens (q [T, H, D]) goes to cuDNN."""
    return _cudnn_rule(q.is_cuda, q.dtype, lens) and cudnn_attn_available(q.device.index or 0)


def _cudnn_rule(on_gpu: bool, dtype: torch.dtype, lens: Sequence[int]) -> bool:
    return (CUDNN_SELF_ATTN and on_gpu and dtype in (torch.bfloat16, torch.float16)
            and 0 < len(lens) <= CUDNN_MAX_REQS and min(lens) >= CUDNN_MIN_TOKENS)


@triton.jit
def _join_k_kernel(KN, KPE, K, H, stride_nt, stride_nh, stride_pt, stride_ph, stride_kt, stride_kh,
                   D_NOPE: tl.constexpr, D_ROPE: tl.constexpr, BLOCK_H: tl.constexpr):
    # one token, BLOCK_H heads: K[t, h] = [KN[t, h], KPE[t, h]] (KPE's head stride may be 0)
    t, hb = tl.program_id(0), tl.program_id(1)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h[:, None] < H
    offs_n, offs_r = tl.arange(0, D_NOPE), tl.arange(0, D_ROPE)
    nope = tl.load(KN + t * stride_nt + offs_h[:, None] * stride_nh + offs_n[None, :], mask=h_ok)
    rope = tl.load(KPE + t * stride_pt + offs_h[:, None] * stride_ph + offs_r[None, :], mask=h_ok)
    row = K + t * stride_kt + offs_h[:, None] * stride_kh
    tl.store(row + offs_n[None, :], nope, mask=h_ok)
    tl.store(row + D_NOPE + offs_r[None, :], rope, mask=h_ok)


def join_k(k_nope: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """k [T, H, Dn + R] = torch.cat([k_nope, k_pe], -1) in one pass (k_pe may be a stride-0 view over heads;
    Dn and R powers of two). torch.cat of the model's views took 90 us at T = 1024, H = 128 on an H100
    (benchmarks/probe_sdpa_prefill.py), three times the bytes' time."""
    t, h, d_nope = k_nope.shape
    d_rope = k_pe.shape[2]
    assert k_pe.shape[:2] == (t, h) and k_nope.stride(2) == 1 and k_pe.stride(2) == 1, "k_nope / k_pe: [T, H, D]"
    assert d_nope & (d_nope - 1) == 0 and d_rope & (d_rope - 1) == 0, f"dims {d_nope} / {d_rope}: powers of two"
    k = torch.empty(t, h, d_nope + d_rope, dtype=k_nope.dtype, device=k_nope.device)
    if t:
        block_h = min(triton.next_power_of_2(h), 8)
        _join_k_kernel[(t, triton.cdiv(h, block_h))](
            k_nope, k_pe, k, h, k_nope.stride(0), k_nope.stride(1), k_pe.stride(0), k_pe.stride(1), k.stride(0),
            k.stride(1), D_NOPE=d_nope, D_ROPE=d_rope, BLOCK_H=block_h)
    return k


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.unsqueeze(0).transpose(1, 2)                                   # [T, H, D] -> [1, H, T, D], a view


def _cudnn_self_attn(q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor,
                     lens: Sequence[int], sm_scale: float, need_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    # q: [T, H, Dn + R], k_nope: [T, H, Dn], k_pe: [T, H, R] (may be a stride-0 view), v: [T, H, Dv]; each request
    # attends causally to its own new tokens (square, so top-left and bottom-right alignment agree).
    # -> out [T, H, Dv] in q.dtype, lse [T, H] fp32 (natural log) or None
    k = join_k(k_nope, k_pe)                                                # [T, H, Dn + R]: cuDNN wants one k
    outs, lses, q0 = [], [], 0
    for n in lens:
        o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            _bhsd(q[q0:q0 + n]), _bhsd(k[q0:q0 + n]), _bhsd(v[q0:q0 + n]), None, need_lse, 0.0, True, False,
            scale=sm_scale)[:2]
        outs.append(o[0].transpose(0, 1))                                   # [n, H, Dv]
        lses.append(lse.reshape(-1, n).transpose(0, 1) if need_lse else None)   # [1, H, n(, 1)] -> [n, H]
        q0 += n
    if len(lens) == 1:
        return outs[0], lses[0]
    return torch.cat(outs), torch.cat(lses) if need_lse else None


def flash_attn_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_k: torch.Tensor, sm_scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each request's queries over its own keys (ragged batch, fp32 online softmax).

    Args:
        q: [Tq, H, Dqk], k: [Tk, H, Dqk], v: [Tk, H, Dv] (one float dtype, last dim contiguous).
        cu_seqlens_q / cu_seqlens_k: [B + 1] int offsets of each request (CPU tensors avoid a sync).
        causal: query i of a request sees key j iff j <= i + len_k - len_q (ends aligned, bottom-right).
    Returns:
        out [Tq, H, Dv] in q.dtype and lse [Tq, H] fp32 = logsumexp_j(sm_scale * q.k_j);
        a query with no visible key gets out 0 and lse -inf.
    """
    d = q.shape[-1]
    assert k.dim() == 3 and k.shape[-1] == d, f"k must be [Tk, H, {d}], got {tuple(k.shape)}"
    assert cu_seqlens_q.numel() == cu_seqlens_k.numel(), "cu_seqlens_q and cu_seqlens_k must both be [B + 1]"
    d_nope = d if d & (d - 1) == 0 else 1 << (d.bit_length() - 1)         # 192 -> 128 + 64
    return _flash_attn(q, k[..., :d_nope], k[..., d_nope:], v, _lens(cu_seqlens_q), _lens(cu_seqlens_k),
                       sm_scale, causal, q.dtype)


def flash_attn_varlen_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                          cu_seqlens_k: torch.Tensor, sm_scale: float,
                          causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of `flash_attn_varlen`: one request at a time, fp32 scores and softmax."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for q0, q1, k0, k1 in zip(cq[:-1], cq[1:], ck[:-1], ck[1:]):
        s = torch.einsum("ihd,jhd->hij", q[q0:q1].float(), k[k0:k1].float()) * sm_scale   # [H, lq, lk]
        if causal:
            i, j = torch.arange(q1 - q0)[:, None], torch.arange(k1 - k0)[None, :]
            s = s.masked_fill((j > i + (k1 - k0) - (q1 - q0)).to(s.device), float("-inf"))
        lse_b = torch.logsumexp(s, dim=-1)                                                # [H, lq]
        p = torch.exp(s - torch.where(lse_b.isinf(), 0.0, lse_b)[..., None])
        out[q0:q1] = torch.einsum("hij,jhd->ihd", p, v[k0:k1].float())
        lse[q0:q1] = lse_b.t()
    return out.to(q.dtype), lse


@triton.jit
def _merge_attn_states_kernel(OA, LA, OB, LB, Out, LseOut, H,
                              stride_at, stride_ah, stride_bt, stride_bh, stride_ot, stride_oh,
                              stride_lat, stride_lah, stride_lbt, stride_lbh, stride_lot, stride_loh,
                              D_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr):
    # one program = one token x BLOCK_H heads; out = (oa e^la + ob e^lb) / (e^la + e^lb)
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_DV)
    h_ok = offs_h < H
    mask = h_ok[:, None] & (offs_d < D_V)[None, :]
    la = tl.load(LA + t * stride_lat + offs_h * stride_lah, mask=h_ok, other=float("-inf"))
    lb = tl.load(LB + t * stride_lbt + offs_h * stride_lbh, mask=h_ok, other=float("-inf"))
    m = tl.maximum(la, lb)
    m = tl.where(m == float("-inf"), 0.0, m)                  # both empty: weights 0, no NaN
    wa, wb = tl.exp(la - m), tl.exp(lb - m)
    s = wa + wb
    inv = 1.0 / tl.where(s > 0.0, s, 1.0)
    oa = tl.load(OA + t * stride_at + offs_h[:, None] * stride_ah + offs_d[None, :], mask=mask, other=0.0)
    ob = tl.load(OB + t * stride_bt + offs_h[:, None] * stride_bh + offs_d[None, :], mask=mask, other=0.0)
    out = oa.to(tl.float32) * (wa * inv)[:, None] + ob.to(tl.float32) * (wb * inv)[:, None]
    tl.store(Out + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=mask)
    lse = tl.where(s > 0.0, m + tl.log(tl.where(s > 0.0, s, 1.0)), float("-inf"))
    tl.store(LseOut + t * stride_lot + offs_h * stride_loh, lse, mask=h_ok)


def _merge(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor,
           out: torch.Tensor, lse_out: torch.Tensor) -> None:
    # out / lse_out may alias o_a / lse_a (each element is read before it is written by one program)
    t, h, d_v = o_a.shape
    for name, x in (("o_b", o_b), ("out", out)):
        assert x.shape == o_a.shape, f"{name} must be {tuple(o_a.shape)}, got {tuple(x.shape)}"
    for name, x in (("lse_a", lse_a), ("lse_b", lse_b), ("lse_out", lse_out)):
        assert x.shape == (t, h) and x.dtype == torch.float32, f"{name} must be fp32 [{t}, {h}]"
    for name, x in (("o_a", o_a), ("o_b", o_b), ("out", out)):
        assert x.stride(2) == 1, f"{name} must be contiguous in its last dim"
    if t == 0:
        return
    block_h = min(triton.next_power_of_2(h), 16)
    _merge_attn_states_kernel[(t, triton.cdiv(h, block_h))](
        o_a, lse_a, o_b, lse_b, out, lse_out, h, o_a.stride(0), o_a.stride(1), o_b.stride(0), o_b.stride(1),
        out.stride(0), out.stride(1), lse_a.stride(0), lse_a.stride(1), lse_b.stride(0), lse_b.stride(1),
        lse_out.stride(0), lse_out.stride(1), D_V=d_v, BLOCK_H=block_h, BLOCK_DV=triton.next_power_of_2(d_v))


def merge_attn_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                      lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attentions of the same queries over disjoint key sets.

    o_*: [T, H, Dv], lse_*: [T, H] fp32 (natural log). Returns (out [T, H, Dv] in o_a.dtype, lse [T, H] fp32),
    equal to attention over the union of the key sets; -inf on both sides gives out 0, lse -inf.
    """
    out, lse = torch.empty_like(o_a), torch.empty_like(lse_a)
    _merge(o_a, lse_a, o_b, lse_b, out, lse)
    return out, lse


def merge_attn_states_ref(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of `merge_attn_states` in fp32."""
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(m == float("-inf"), 0.0, m)
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)                     # [T, H]
    s = wa + wb
    s_safe = torch.where(s > 0, s, 1.0)
    out = (o_a.float() * wa[..., None] + o_b.float() * wb[..., None]) / s_safe[..., None]
    lse = torch.where(s > 0, m + torch.log(s_safe), float("-inf"))
    return out.to(o_a.dtype), lse


class _Chunk(NamedTuple):
    start: int                  # flat prefix tokens [start, end) of the whole batch
    end: int
    b0: int                     # requests b0 .. b1-1 own keys in this chunk
    b1: int
    lens_k: tuple[int, ...]     # keys of each of those requests in this chunk


@functools.lru_cache(maxsize=64)
def _prefix_chunks(prefix_lens: tuple[int, ...], chunk: int) -> tuple[_Chunk, ...]:
    # The prefixes of all requests, laid end to end, cut every `chunk` tokens:
    #   flat index:  0 ........ cu[1] ........ cu[2] ... cu[B]
    #   request:     |--- 0 ----|----- 1 ------|  ...  |
    #   chunks:      [0, chunk) [chunk, 2 chunk) ...    (a chunk may span several requests)
    cu = [0, *itertools.accumulate(prefix_lens)]
    chunks = []
    for s in range(0, cu[-1], chunk):
        e = min(s + chunk, cu[-1])
        b0, b1 = bisect.bisect_right(cu, s) - 1, bisect.bisect_left(cu, e)
        lens_k = tuple(max(min(cu[b + 1], e) - max(cu[b], s), 0) for b in range(b0, b1))
        chunks.append(_Chunk(s, e, b0, b1, lens_k))
    return tuple(chunks)


def prefix_chunk_slots(prefix_lens: Sequence[int], req_to_token: torch.Tensor, req_pool_idx: torch.Tensor,
                       prefix_chunk: int = 4096) -> tuple[torch.Tensor, ...]:
    """The cache slots of each chunk of the batch's prefixes laid end to end (`_prefix_chunks`): [n] each, on
    req_to_token's device. One upload of the layout and a few gathers, no sync; the same for every layer."""
    chunks = _prefix_chunks(tuple(int(p) for p in prefix_lens), prefix_chunk)
    if not chunks:
        return ()
    dev = req_to_token.device
    pool_idx = req_pool_idx.to(dev, torch.int64)
    cu_pre = torch.tensor([0, *itertools.accumulate(prefix_lens)], dtype=torch.int64).to(dev)
    g = torch.arange(chunks[-1].end, dtype=torch.int64, device=dev)                      # flat prefix index
    req = torch.searchsorted(cu_pre, g, right=True) - 1                                 # -> (request,
    slots = req_to_token[pool_idx[req], g - cu_pre[req]]                                 #     position) -> slot
    return tuple(slots[c.start: c.end] for c in chunks)


def _dequant_rows(rows: torch.Tensor, kv_scale: float | torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if rows.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return (rows.float() * (1.0 if kv_scale is None else kv_scale)).to(dtype)
    return rows.to(dtype)


def _expand_prefix(rows: torch.Tensor, expand_kv: ExpandKV, kv_lora_rank: int,
                   heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # rows: [n, L + R] -> k_nope [n, H, Dn], k_pe [n, H, R] (a stride-0 view over heads), v [n, H, Dv]
    k_nope, v = expand_kv(rows[:, :kv_lora_rank])
    n = rows.shape[0]
    assert k_nope.dim() == 3 and k_nope.shape[:2] == (n, heads) and v.shape[:2] == (n, heads), \
        f"expand_kv must return k_nope / v of shape [{n}, {heads}, D]: got {tuple(k_nope.shape)}, {tuple(v.shape)}"
    k_pe = rows[:, None, kv_lora_rank:].expand(n, heads, rows.shape[1] - kv_lora_rank)
    return k_nope if k_nope.stride(2) == 1 else k_nope.contiguous(), k_pe, v if v.stride(2) == 1 else v.contiguous()


def _check_mla(q: torch.Tensor, v_new: torch.Tensor, ext: list[int], pre: list[int],
               kv_cache: torch.Tensor, req_to_token: torch.Tensor, kv_lora_rank: int) -> None:
    assert q.dim() == 3, f"q must be [T, H, Dn + R], got {tuple(q.shape)}"
    assert v_new.dim() == 3 and v_new.shape[:2] == q.shape[:2], f"v_new must be [T, H, Dv], got {tuple(v_new.shape)}"
    assert len(ext) == len(pre), "extend_lens and prefix_lens must both be [B]"
    assert sum(ext) == q.shape[0], f"sum(extend_lens) = {sum(ext)} but q has {q.shape[0]} tokens"
    assert kv_cache.dim() == 2 and kv_cache.shape[1] > kv_lora_rank, "kv_cache must be [num_slots, L + R]"
    assert q.shape[2] > kv_cache.shape[1] - kv_lora_rank, "q dim must be qk_nope_head_dim + qk_rope_head_dim"
    assert req_to_token.dim() == 2 and max(pre, default=0) <= req_to_token.shape[1], "req_to_token too short"


def _ints(x: torch.Tensor | Sequence[int]) -> list[int]:
    return [int(v) for v in (x.tolist() if isinstance(x, torch.Tensor) else x)]


def mla_prefill(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, extend_lens: torch.Tensor | Sequence[int],
                prefix_lens: torch.Tensor | Sequence[int], kv_cache: torch.Tensor, req_to_token: torch.Tensor,
                req_pool_idx: torch.Tensor, expand_kv: ExpandKV, sm_scale: float, *, kv_lora_rank: int = 512,
                kv_scale: float | torch.Tensor | None = None, prefix_chunk: int = 4096,
                k_pe_new: torch.Tensor | None = None,
                prefix_slots: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """Non-absorbed MLA attention of the new tokens of a ragged batch (DeepSeek-V2 sec. 2.1).

    Args:
        q, k_new: [T, H, Dn + R] (new tokens, roped); v_new: [T, H, Dv]; T = sum(extend_lens). Or, with
            `k_pe_new` [T, H, R] (the shared rope key, e.g. a stride-0 view over heads), k_new is k_nope alone
            [T, H, Dn]: no concatenation.
        extend_lens, prefix_lens: [B] ints, lists or tensors (CPU tensors avoid a sync). New token i of request b
            sits at position prefix_lens[b] + i and sees the request's prefix and new tokens 0..i.
        kv_cache: [S, L + R] latent rows (normalised c_kv, roped k_pe); FP8 rows mean stored * kv_scale.
        req_to_token: [pool, max_ctx] slot of each position; req_pool_idx: [B] row of each request.
        expand_kv: latent [n, L] (q.dtype) -> (k_nope [n, H, Dn], v [n, H, Dv]), i.e. kv_b_proj.
        prefix_chunk: prefix tokens (over the whole batch) expanded at a time; bounds the extra memory.
        prefix_slots: `prefix_chunk_slots(prefix_lens, ...)` with the same arguments, when the caller made it (once
            per batch: every layer reads the same slots); None computes it here.
    Returns:
        out [T, H, Dv] in q.dtype.
    """
    ext, pre = _ints(extend_lens), _ints(prefix_lens)
    d_nope = q.shape[2] - (kv_cache.shape[1] - kv_lora_rank)
    _check_mla(q, v_new, ext, pre, kv_cache, req_to_token, kv_lora_rank)
    if k_pe_new is None:
        assert k_new.shape == q.shape, f"q / k_new must be [T, H, Dn + R]: got {tuple(q.shape)}, {tuple(k_new.shape)}"
        k_nope_new, k_pe_new = k_new[..., :d_nope], k_new[..., d_nope:]
    else:
        assert k_new.shape == (*q.shape[:2], d_nope) and k_pe_new.shape == (*q.shape[:2], q.shape[2] - d_nope), \
            f"k_new [T, H, {d_nope}] and k_pe_new [T, H, R] expected, got {tuple(k_new.shape)}, {tuple(k_pe_new.shape)}"
        k_nope_new = k_new
    assert prefix_chunk > 0, "prefix_chunk must be positive"
    acc_dtype = torch.float32 if sum(pre) > 0 else q.dtype      # running state stays fp32 across merges
    cu_q = [0, *itertools.accumulate(ext)]
    chunks = _prefix_chunks(tuple(pre), prefix_chunk)
    if cudnn_self_attn_ok(q, ext):
        out, lse = _cudnn_self_attn(q, k_nope_new, k_pe_new, v_new, ext, sm_scale, bool(chunks))
        if chunks:                                              # merged in place below: fp32, [T, H] contiguous
            out, lse = out.to(acc_dtype), lse.contiguous()
    else:
        out, lse = _flash_attn(q, k_nope_new, k_pe_new, v_new, tuple(ext), tuple(ext),
                               sm_scale, True, acc_dtype)              # out: [T, H, Dv], lse: [T, H]
    if chunks and prefix_slots is None:
        prefix_slots = prefix_chunk_slots(pre, req_to_token, req_pool_idx, prefix_chunk)
    for c, slots in zip(chunks, prefix_slots or ()):
        q0, q1 = cu_q[c.b0], cu_q[c.b1]
        if q0 == q1:
            continue
        rows = _dequant_rows(kv_cache.index_select(0, slots), kv_scale, q.dtype)         # [n, L + R]
        k_nope, k_pe, v = _expand_prefix(rows, expand_kv, kv_lora_rank, q.shape[1])
        o_c, lse_c = _flash_attn(q[q0:q1], k_nope, k_pe, v, tuple(ext[c.b0:c.b1]), c.lens_k, sm_scale,
                                 False, torch.float32)
        _merge(out[q0:q1], lse[q0:q1], o_c, lse_c, out[q0:q1], lse[q0:q1])
    return out.to(q.dtype)


def mla_prefill_ref(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, extend_lens: torch.Tensor,
                    prefix_lens: torch.Tensor, kv_cache: torch.Tensor, req_to_token: torch.Tensor,
                    req_pool_idx: torch.Tensor, expand_kv: ExpandKV, sm_scale: float, *, kv_lora_rank: int = 512,
                    kv_scale: float | torch.Tensor | None = None, prefix_chunk: int = 4096,
                    k_pe_new: torch.Tensor | None = None) -> torch.Tensor:
    """Reference of `mla_prefill`: per request, the whole prefix at once, fp32 softmax (`prefix_chunk` unused)."""
    ext, pre = [int(x) for x in extend_lens.tolist()], [int(x) for x in prefix_lens.tolist()]
    if k_pe_new is not None:
        k_new = torch.cat([k_new, k_pe_new], dim=-1)
    _check_mla(q, v_new, ext, pre, kv_cache, req_to_token, kv_lora_rank)
    assert k_new.shape == q.shape, f"q / k_new must be [T, H, Dn + R]: got {tuple(q.shape)}, {tuple(k_new.shape)}"
    heads, outs, t0 = q.shape[1], [], 0
    for b, (e, p) in enumerate(zip(ext, pre)):
        k, v = k_new[t0:t0 + e].float(), v_new[t0:t0 + e].float()                       # [e, H, Dn + R], [e, H, Dv]
        if p > 0:
            slots = req_to_token[int(req_pool_idx[b]), :p]                               # [p]
            rows = _dequant_rows(kv_cache[slots.to(kv_cache.device)], kv_scale, q.dtype)  # [p, L + R]
            k_nope, v_pre = expand_kv(rows[:, :kv_lora_rank])                            # [p, H, Dn], [p, H, Dv]
            k_pre = torch.cat([k_nope, rows[:, None, kv_lora_rank:].expand(-1, heads, -1)], dim=-1)
            k, v = torch.cat([k_pre.float(), k]), torch.cat([v_pre.float(), v])          # keys in position order
        s = torch.einsum("ihd,jhd->hij", q[t0:t0 + e].float(), k) * sm_scale            # [H, e, p + e]
        i, j = torch.arange(e, device=q.device)[:, None], torch.arange(p + e, device=q.device)[None, :]
        s = s.masked_fill(j > p + i, float("-inf"))                                     # causal over positions
        outs.append(torch.einsum("hij,jhd->ihd", torch.softmax(s, dim=-1), v))
        t0 += e
    out = torch.cat(outs) if outs else q.new_zeros(0, heads, v_new.shape[2], dtype=torch.float32)
    return out.to(q.dtype)
