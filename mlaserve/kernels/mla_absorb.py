"""Per-head GEMMs of absorbed-MLA decode: W_UK folded into the query, W_UV applied to the latent output.

Legend: `T` tokens, `H` local heads, `K` reduced dim, `N` output dim per head. `out[t, h] = a[t, h] @ W[h]` with
W[h] a [K, N] matrix read through arbitrary strides, so both absorbed weights are used as stored:
    q_lat = head_gemm(q_nope, w_kc)             q_nope [T, H, Dn] (a strided view of q), w_kc [H, Dn, L]
    o     = head_gemm(o_lat, w_vc, trans=True)  o_lat [T, H, L], w_vc [H, Dv, L] read as [H, L, Dv]
At decode batch sizes this is a batched GEMV: the cost is reading W once (H * K * N values), so the programs
split N finely enough to fill the GPU; cuBLAS's batched kernels reached a third of the copy bandwidth here.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mlaserve.kernels.pdl import pdl_enter, pdl_meta, pdl_release
from mlaserve.kernels.precision import dot_precision
from mlaserve.kernels.rope import mla_rope_kv_store_ref, rope_kv_store_program, rope_launch_args

TARGET_PROGRAMS = 264      # ~2 per SM of an H100: one wave of programs streaming the weight
BLOCK_K = 64
# NOTE: extra programs in the W_UK launch issuing L2 prefetches (cp.async.bulk.prefetch.L2) of the weights after the
# attention (o_proj, the gate, the shared experts: up to 32 MB a layer) gained nothing in the V2-Lite bs-1 step on an
# H200: graph replay 2.25-2.33 against 2.16-2.19 ms, alternated. The launch took 0.7 us longer at 8 MB and 4.7 us at
# 32 MB, the o_proj (its weights already loaded before the PDL wait) 0.4 us shorter, the fused MoE no shorter with a
# third of its bytes in L2 (benchmarks/results/l2-prefetch-h200.md). Tried at cae3d2b and removed.

_TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit(do_not_specialize=["T"])
def _head_gemm_kernel(A, W, Out, T, stride_at, stride_ah, stride_wh, stride_wk, stride_wn, stride_ot, stride_oh,
                      K: tl.constexpr, N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr):
    """One (head, N block, T block): out[t, h, n] = sum_k a[t, h, k] * W[h, k, n], fp32 accumulation."""
    _head_gemm_program(tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2), A, W, Out, T, stride_at,
                       stride_ah, stride_wh, stride_wk, stride_wn, stride_ot, stride_oh, K, N, BLOCK_T, BLOCK_N,
                       BLOCK_K, DOT_DTYPE, DOT_PREC, PDL)


@triton.jit
def _head_gemm_program(h, nb, tb, A, W, Out, T, stride_at, stride_ah, stride_wh, stride_wk, stride_wn, stride_ot,
                       stride_oh, K: tl.constexpr, N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr):
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok, n_ok = offs_t < T, offs_n < N
    a_rows = A + offs_t.to(tl.int64)[:, None] * stride_at + h * stride_ah
    w_base = W + h * stride_wh + offs_n[None, :] * stride_wn
    # the first K block of W is read before the wait for the previous kernel (PDL: W is no kernel's output)
    offs_k = tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    w = tl.load(w_base + offs_k[:, None] * stride_wk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BK, BN]
    pdl_enter(PDL)
    a = tl.load(a_rows + offs_k[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)              # [BT, BK]
    acc = tl.dot(a.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=DOT_PREC, out_dtype=tl.float32)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_rows + offs_k[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)      # [BT, BK]
        w = tl.load(w_base + offs_k[:, None] * stride_wk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BK, BN]
        acc += tl.dot(a.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=DOT_PREC)
    pdl_release(PDL)
    out = Out + offs_t.to(tl.int64)[:, None] * stride_ot + h * stride_oh + offs_n[None, :]
    tl.store(out, acc.to(Out.dtype.element_ty), mask=t_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["T", "gemm_nb", "gemm_tb", "gemm_programs", "rope_hb"])
def _rope_head_gemm_kernel(A, W, Out, T, stride_at, stride_ah, stride_wh, stride_wk, stride_wn, stride_ot, stride_oh,
                           q_ptr, k_ptr, kvc_ptr, pos_ptr, cs_ptr, cache_ptr, slot_ptr, scale_ptr, nw_ptr, eps, H, L,
                           stride_qt, stride_qh, stride_kt, stride_ct, stride_pos, stride_cache, stride_slot,
                           gemm_nb, gemm_tb, gemm_programs, rope_hb, K: tl.constexpr, N: tl.constexpr, BLOCK_T: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
                           DOT_PREC: tl.constexpr, R_HALF: tl.constexpr, BLOCK_RH: tl.constexpr,
                           BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr, NORM: tl.constexpr, HAS_SCALE: tl.constexpr,
                           IS_FP8: tl.constexpr, FP8_MAX: tl.constexpr, MANT_BITS: tl.constexpr,
                           MIN_EXP: tl.constexpr, SOFT_ROUND: tl.constexpr, PDL: tl.constexpr):
    # The first gemm_programs programs are head_gemm's (h, N block, T block), the rest rope_kv_store's (t, head
    # block): two independent launches' work in one (the GEMM reads q's nope part, the rope rewrites its rope part).
    pid = tl.program_id(0)
    if pid < gemm_programs:
        _head_gemm_program((pid // (gemm_nb * gemm_tb)).to(tl.int64), (pid // gemm_tb) % gemm_nb, pid % gemm_tb, A, W,
                           Out, T, stride_at, stride_ah, stride_wh, stride_wk, stride_wn, stride_ot, stride_oh, K, N,
                           BLOCK_T, BLOCK_N, BLOCK_K, DOT_DTYPE, DOT_PREC, PDL)
    else:
        pdl_enter(PDL)
        r = pid - gemm_programs
        rope_kv_store_program((r // rope_hb).to(tl.int64), r % rope_hb, q_ptr, k_ptr, kvc_ptr, pos_ptr, cs_ptr,
                              cache_ptr, slot_ptr, scale_ptr, nw_ptr, eps, H, L, stride_qt, stride_qh, stride_kt,
                              stride_ct, stride_pos, stride_cache, stride_slot, R_HALF, BLOCK_RH, BLOCK_H, BLOCK_L,
                              NORM, HAS_SCALE, IS_FP8, FP8_MAX, MANT_BITS, MIN_EXP, SOFT_ROUND)


def _blocks(t: int, h: int, n: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_N): all of a small T in one block, N cut until H x N-blocks x T-blocks fills a wave."""
    block_t = min(64, max(16, triton.next_power_of_2(t)))
    tiles = h * triton.cdiv(t, block_t)
    block_n = min(128, max(16, triton.next_power_of_2(n)))
    while block_n > 16 and tiles * triton.cdiv(n, block_n) < TARGET_PROGRAMS:
        block_n //= 2
    return block_t, block_n


def head_gemm(a: torch.Tensor, w: torch.Tensor, *, trans: bool = False, out: torch.Tensor | None = None
              ) -> torch.Tensor:
    """a [T, H, K] (last dim contiguous, any other strides) x w [H, K, N] (or [H, N, K] with `trans`) ->
    [T, H, N] in a.dtype (into `out` when given: any strides with the last dim contiguous)."""
    assert a.dim() == 3 and w.dim() == 3 and a.stride(2) == 1, f"a [T, H, K] expected, got {tuple(a.shape)}"
    t, h, k = a.shape
    n = w.shape[1] if trans else w.shape[2]
    assert w.shape[0] == h and (w.shape[2] if trans else w.shape[1]) == k, \
        f"w {tuple(w.shape)} does not match a {tuple(a.shape)} (trans={trans})"
    assert a.dtype == w.dtype and a.dtype in _TL_DTYPE and a.device == w.device, \
        f"a and w must share a float dtype and device, got {a.dtype} / {w.dtype}"
    out = a.new_empty((t, h, n)) if out is None else out
    assert out.shape == (t, h, n) and out.dtype == a.dtype and out.stride(2) == 1, \
        f"out must be [{t}, {h}, {n}] {a.dtype} with a contiguous last dim"
    if t == 0:
        return out
    args, meta, grid = _gemm_launch_args(a, w, out, trans)
    _head_gemm_kernel[grid](*args, **meta, **pdl_meta(a.device), num_warps=4)
    return out


def _gemm_launch_args(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, trans: bool
                      ) -> tuple[tuple, dict, tuple[int, int, int]]:
    (t, h, k), n = a.shape, out.shape[2]
    stride_wk, stride_wn = (w.stride(2), w.stride(1)) if trans else (w.stride(1), w.stride(2))
    block_t, block_n = _blocks(t, h, n)
    args = (a, w, out, t, a.stride(0), a.stride(1), w.stride(0), stride_wk, stride_wn, out.stride(0), out.stride(1))
    meta = dict(K=k, N=n, BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=min(BLOCK_K, max(16, triton.next_power_of_2(k))),
                DOT_DTYPE=_TL_DTYPE[a.dtype], DOT_PREC=dot_precision(a.dtype))
    return args, meta, (h, triton.cdiv(n, block_n), triton.cdiv(t, block_t))


def rope_head_gemm(q_nope: torch.Tensor, w_kc: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor,
                   kv_c: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor,
                   out_slots: torch.Tensor, **rope_kw) -> torch.Tensor:
    """`head_gemm(q_nope, w_kc)` and `rope.mla_rope_kv_store(q_pe, ..., **rope_kw)` (same arguments, same in-place
    effects) in one launch: absorbed decode's W_UK GEMM beside the rope and cache write it does not depend on.
    q_nope and q_pe are the two parts of one q (disjoint columns). Returns q_lat [T, H, L]."""
    out = head_gemm_out(q_nope, w_kc)
    t = q_nope.shape[0]
    rope_args, rope_meta, (_, rope_hb) = rope_launch_args(q_pe, k_pe, kv_c, positions, cos_sin_cache, kv_cache,
                                                          out_slots, **rope_kw)
    if t == 0:
        return out
    args, meta, (gh, gnb, gtb) = _gemm_launch_args(q_nope, w_kc, out, False)
    gemm_programs = gh * gnb * gtb
    _rope_head_gemm_kernel[(gemm_programs + t * rope_hb,)](
        *args, *rope_args, gnb, gtb, gemm_programs, rope_hb, **meta, **rope_meta, **pdl_meta(q_nope.device),
        num_warps=4)
    return out


def head_gemm_out(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """head_gemm's checks (trans=False) and its new output [T, H, N]."""
    assert a.dim() == 3 and w.dim() == 3 and a.stride(2) == 1, f"a [T, H, K] expected, got {tuple(a.shape)}"
    t, h, k = a.shape
    assert w.shape[0] == h and w.shape[1] == k, f"w {tuple(w.shape)} does not match a {tuple(a.shape)}"
    assert a.dtype == w.dtype and a.dtype in _TL_DTYPE and a.device == w.device, \
        f"a and w must share a float dtype and device, got {a.dtype} / {w.dtype}"
    return a.new_empty((t, h, w.shape[2]))


def head_gemm_ref(a: torch.Tensor, w: torch.Tensor, *, trans: bool = False, out: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """Reference for `head_gemm` (the spec): one batched matmul over heads in a.dtype."""
    res = torch.einsum("thk,hnk->thn" if trans else "thk,hkn->thn", a, w)
    return res if out is None else out.copy_(res)


def rope_head_gemm_ref(q_nope: torch.Tensor, w_kc: torch.Tensor, *rope_args, **rope_kw) -> torch.Tensor:
    """Reference for `rope_head_gemm`: the rope's reference (its in-place effects), then `head_gemm_ref`."""
    mla_rope_kv_store_ref(*rope_args, **rope_kw)
    return head_gemm_ref(q_nope, w_kc)
