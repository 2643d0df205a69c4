"""Absorbed-MLA decode's attention chain for one token in one launch (issue 15): W_UK with the rope and cache write,
the split attention over the latent cache, the split merge with W_UV.

Legend as in mla_decode.py and mla_absorb.py: `H` local heads (at most CHAIN_MAX_HEADS), `Dn` nope dim, `R` rope dim,
`L` kv_lora_rank, `Dv` v_head_dim, `S` kv splits.

At one token the four launches this replaces (`rope_head_gemm`, `mla_decode` and its reduce, W_UV's `head_gemm`)
read a few MB and take ~20 us a layer on an H100, nearly all of it latency: each waits for the one before it to end,
then fetches what it needs. Here one grid of P programs, P at most the GPU's SMs so that all are resident at once,
runs three phases, separated by counters in global memory:

    phase A  programs 0 .. H * L / BN_A - 1: one head's BN_A columns of q_lat = q_nope @ w_kc[h];
             the next ROPE programs: the rope and cache write (`rope_kv_apply`)
    phase B  programs 0 .. S - 1: split s of the attention; its cache rows are asked into L2 while phase A runs
    phase C  programs 0 .. H * Dv / BN_C - 1: head h's merge of its S partials, then BN_C columns of W_UV

The w_kc tiles, the step's inputs and the rope's operands are read before the PDL wait, phase B's rows asked into
L2, and the w_vc tiles after phase A. A phase's writers add one to its counter after their stores
(release); its readers spin on it (acquire). The last program to leave resets the counters for the next launch.
Under the interpreter programs run one after another (a spin would never end), so there, and in tests, `phase=1, 2,
3` runs each phase as a launch of its own and the counters are not used.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from mlaserve.env import on_off
from mlaserve.kernels.mla_absorb import head_gemm_ref, rope_head_gemm_ref
from mlaserve.kernels.mla_decode import (LOG2E, _TL_DTYPE, _padded, attend_tiles, choose_num_kv_splits, decode_programs,
                                         mla_decode_ref, pick_config, store_split, tile_slots)
from mlaserve.kernels.pdl import pdl_enter, pdl_meta
from mlaserve.kernels.precision import dot_precision
from mlaserve.kernels.rope import rope_kv_apply, rope_kv_operands, rope_launch_args

CHAIN_MAX_HEADS = 16       # one head block of mla_decode's H = 16 entry serves every head
BN_A = 64                  # q_lat columns per phase-A program: 16 heads x 512 / 64 = 128 programs
BN_C = 32                  # W_UV output columns per phase-C program: 16 heads x 128 / 32 = 64 programs
CHUNK_S = 8                # partials a phase-C program merges per step
NUM_WARPS = 8
CHAIN_BLOCK_N = None       # cached tokens a tile (None: mla_decode's entry for the heads; the probe sweeps it)
STAMPS = tl.constexpr(24)  # int64 values a program writes under TIMING: 12 points x (globaltimer, clock64)


# the longest context (cached tokens + the new one) the decode graphs' bs-1 chain graph replays for; longer steps
# replay the four launches' graph (engine/graph.py). Phase C's programs each merge all of their head's partials, so
# the one launch loses to the four at long contexts. H100 (benchmarks/results/chain-graph-h100.md): at 2048 tokens
# the one launch at this cap's 32 splits took 17.30 us a layer against the four launches' 18.70 at a server graph's
# 128; at 4096 it was about 10% slower (chain-stamps-h100.md). The crossover between the two is not measured
CHAIN_MAX_CONTEXT = 2048


def enabled() -> bool:
    """The decode graphs' second bs-1 graph, the one launch's, replayed for contexts up to CHAIN_MAX_CONTEXT
    (engine/graph.py); on by default, `MLASERVE_MLA_CHAIN=0` turns it off. On an H100 (2026-12-07, tree 1bf557f) it
    took 0.03-0.17 ms off the V2-Lite bs-1 graph replay in five alternated pairs (366-393 tok/s against 357-377;
    benchmarks/results/chain-graph-h100.md)."""
    return on_off("MLASERVE_MLA_CHAIN", True)


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _counters(device: torch.device) -> torch.Tensor:
    # phase A done, phase B done, programs out; zero between launches (the last program out resets them)
    return torch.zeros(4, dtype=torch.int32, device=device)


def chain_programs(heads: int, l: int, dv: int, rope_programs: int, splits: int) -> int:
    """The grid of one fused launch: the largest of the three phases."""
    return max(heads * triton.cdiv(l, BN_A) + rope_programs, splits, heads * triton.cdiv(dv, BN_C))


def chain_fits(q_nope: torch.Tensor, w_vc: torch.Tensor, kv_lora_rank: int, num_kv_splits: int | None) -> bool:
    """Whether `mla_decode_chain` runs this decode as one launch: one token on a CUDA device, at most
    CHAIN_MAX_HEADS heads, the graph's split count known, every program of the grid resident at once (one an SM)."""
    t, h, _ = q_nope.shape
    if not (enabled() and q_nope.is_cuda and t == 1 and h <= CHAIN_MAX_HEADS and num_kv_splits is not None):
        return False
    index = q_nope.device.index if q_nope.device.index is not None else torch.cuda.current_device()
    return chain_programs(h, kv_lora_rank, w_vc.shape[1], 1, num_kv_splits) <= _num_sms(index)


@triton.jit
def _prefetch_rows(addr, nbytes):
    # a hint: the bytes at each address are fetched into L2; nothing waits on it (sm_90 bulk prefetch)
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                              [addr, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _stamp(Times, pid, k: tl.constexpr, TIMING: tl.constexpr):
    # TIMING (benchmarks/probe_mla_chain.py --stamps): point k of program pid, as (%globaltimer ns, %clock64)
    _stamp_after(Times, pid, k, pid.to(tl.float32), TIMING)


@triton.jit
def _stamp_after(Times, pid, k: tl.constexpr, dep, TIMING: tl.constexpr):
    # `_stamp` once the fp32 scalar dep is computed (a load's arrival: a reduction of what it loaded)
    if TIMING:
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,f", [dep], dtype=tl.int64, is_pure=False,
                                        pack=1)
        clock = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,f", [dep], dtype=tl.int64, is_pure=False,
                                          pack=1)
        tl.store(Times + pid * STAMPS + 2 * k, now)
        tl.store(Times + pid * STAMPS + 2 * k + 1, clock)


@triton.jit
def _arrive(counter):
    tl.debug_barrier()                               # every thread's stores before the release
    tl.atomic_add(counter, 1, sem="release", scope="gpu")


@triton.jit
def _wait_for(counter, target):
    n = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    while n < target:
        n = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit(do_not_specialize=["num_splits"])
def _mla_chain_kernel(Q, WKC, QLat, WVC, Out, MidO, MidLse, Sync, Times,
                      q_pe_ptr, k_ptr, kvc_ptr, pos_ptr, cs_ptr, cache_ptr, slot_ptr, scale_ptr, nw_ptr, eps, H,
                      L_rt, stride_qpt, stride_qph, stride_kt, stride_ct, stride_pos, stride_cache, stride_slot,
                      ReqToToken, ReqPoolIdx, SeqLens, kv_addr, qk_scale, v_scale,
                      stride_qh, stride_wkh, stride_wkd, stride_wvh, stride_wvd, stride_oh, stride_rtt,
                      num_splits, num_programs,
                      DN: tl.constexpr, L: tl.constexpr, R: tl.constexpr, DV: tl.constexpr, BLOCK_DN: tl.constexpr,
                      BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_S: tl.constexpr, BN_A: tl.constexpr, BN_C: tl.constexpr, CHUNK_S: tl.constexpr,
                      ROW_BYTES: tl.constexpr, A_PROGRAMS: tl.constexpr, ROPE_PROGRAMS: tl.constexpr,
                      C_PROGRAMS: tl.constexpr, R_HALF: tl.constexpr, BLOCK_RH: tl.constexpr,
                      ROPE_BLOCK_H: tl.constexpr, NORM: tl.constexpr, HAS_SCALE: tl.constexpr,
                      IS_FP8: tl.constexpr, FP8_MAX: tl.constexpr, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr,
                      SOFT_ROUND: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
                      PHASE: tl.constexpr, PREFETCH: tl.constexpr, TIMING: tl.constexpr, PDL: tl.constexpr):
    # PHASE 0: all three phases in this launch, counters between them; 1 / 2 / 3: that phase alone.
    # TIMING: each program stamps points 0-7 (start, waited, A done, B may start, B done, C may start, C done, out)
    # and 8-11 (A's q arrived, B's q arrived, B's tiles attended, C's partials merged).
    pid = tl.program_id(0)
    _stamp(Times, pid, 0, TIMING)
    NB_A: tl.constexpr = (L + BN_A - 1) // BN_A
    NB_C: tl.constexpr = (DV + BN_C - 1) // BN_C
    DO_A: tl.constexpr = PHASE == 0 or PHASE == 1
    DO_B: tl.constexpr = PHASE == 0 or PHASE == 2
    DO_C: tl.constexpr = PHASE == 0 or PHASE == 3
    in_a = pid < A_PROGRAMS + ROPE_PROGRAMS
    in_b = pid < num_splits
    in_c = pid < C_PROGRAMS

    # before the wait: phase A's w_kc [H, Dn, L] columns, and what no kernel of this step writes (its inputs: the
    # sequence length, pool row, req_to_token, position and slot; the cache rows of earlier steps): phase B's
    # bounds, with its rows asked into L2, and the rope's cos / sin and slot. (The kernel before this one is the q /
    # kv_a projection, and each PDL kernel completes after the one before it: kernels/pdl.py.)
    offs_d = tl.arange(0, BLOCK_DN)
    offs_l = tl.arange(0, BLOCK_L)
    ha = pid // NB_A
    cols_a = (pid % NB_A) * BN_A + tl.arange(0, BN_A)
    w_a = tl.load(WKC + ha * stride_wkh + offs_d[:, None] * stride_wkd + cols_a[None, :],
                  mask=(DO_A & (pid < A_PROGRAMS)) & (offs_d < DN)[:, None] & (cols_a < L)[None, :],
                  other=0.0)                                                                         # [BDN, BN_A]
    is_rope = DO_A & (pid >= A_PROGRAMS) & in_a
    cos, sin, slot = rope_kv_operands((pid * 0).to(tl.int64), is_rope, pid == A_PROGRAMS, pos_ptr, cs_ptr, slot_ptr,
                                      stride_pos, stride_slot, R_HALF, BLOCK_RH)
    # split pid's cache positions [start, end): num_splits equal runs of whole BLOCK_N tiles (as mla_decode's)
    seq_len = tl.load(SeqLens)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = pid * split_len
    end = tl.minimum(start + split_len, seq_len)
    pool_row = tl.load(ReqPoolIdx).to(tl.int64)
    first_slots = tile_slots(ReqToToken, pool_row, stride_rtt, start, tl.where(DO_B & in_b, end, start), BLOCK_N)
    if DO_B and PREFETCH:            # (this step's new row is written in phase A: asking for it early is harmless)
        if in_b:
            if start < end:
                _prefetch_rows(kv_addr + first_slots * ROW_BYTES, tl.full([BLOCK_N], ROW_BYTES, tl.int32))
            for n0 in range(start + BLOCK_N, end, BLOCK_N):
                _prefetch_rows(kv_addr + tile_slots(ReqToToken, pool_row, stride_rtt, n0, end, BLOCK_N) * ROW_BYTES,
                               tl.full([BLOCK_N], ROW_BYTES, tl.int32))
    pdl_enter(PDL)
    _stamp(Times, pid, 1, TIMING)

    # ---- phase A: W_UK, and the rope + cache write
    if DO_A and in_a:
        if pid < A_PROGRAMS:
            a = tl.load(Q + ha * stride_qh + offs_d, mask=offs_d < DN, other=0.0).to(tl.float32)           # [BDN]
            if TIMING:
                _stamp_after(Times, pid, 8, tl.max(a, axis=0), TIMING)
            q_lat = tl.sum(a[:, None] * w_a.to(tl.float32), axis=0)                                      # [BN_A]
            tl.store(QLat + ha * L + cols_a, q_lat.to(QLat.dtype.element_ty), mask=cols_a < L)
        else:
            rope_kv_apply((pid * 0).to(tl.int64), pid - A_PROGRAMS, cos, sin, slot, q_pe_ptr, k_ptr, kvc_ptr,
                          cache_ptr, scale_ptr, nw_ptr, eps, H, L_rt, stride_qpt, stride_qph, stride_kt, stride_ct,
                          stride_cache, R_HALF, BLOCK_RH, ROPE_BLOCK_H, BLOCK_L, NORM, HAS_SCALE, IS_FP8, FP8_MAX,
                          MANT_BITS, MIN_EXP, SOFT_ROUND)
        if PHASE == 0:
            _arrive(Sync)
        _stamp(Times, pid, 2, TIMING)

    # phase C's w_vc [H, Dv, L] rows (as [L, BN_C]), asked for after phase A's reads: needed after phase B
    hc = pid // NB_C
    cols_c = (pid % NB_C) * BN_C + tl.arange(0, BN_C)
    w_c = tl.load(WVC + hc * stride_wvh + cols_c[None, :] * stride_wvd + offs_l[:, None],
                  mask=(DO_C & in_c) & (offs_l < L)[:, None] & (cols_c < DV)[None, :], other=0.0)    # [BL, BN_C]

    # ---- phase B: split `pid` of the attention over the cache, rows = heads
    if DO_B and in_b:
        if PHASE == 0:
            _wait_for(Sync, A_PROGRAMS + ROPE_PROGRAMS)
        _stamp(Times, pid, 3, TIMING)
        h = tl.arange(0, BLOCK_H)
        h_ok = h < H
        offs_r = tl.arange(0, BLOCK_R)
        q_nope = tl.load(QLat + h[:, None] * L + offs_l[None, :], mask=h_ok[:, None] & (offs_l < L)[None, :],
                         other=0.0)                                                                  # [BH, BL]
        q_pe = tl.load(q_pe_ptr + h[:, None] * stride_qph + offs_r[None, :],
                       mask=h_ok[:, None] & (offs_r < R)[None, :], other=0.0)                        # [BH, BR]
        if TIMING:
            _stamp_after(Times, pid, 9, tl.max(tl.max(q_nope.to(tl.float32), axis=1), axis=0), TIMING)
        t = tl.zeros([BLOCK_H], tl.int64)
        limit = t + seq_len
        acc, m_i, l_i = attend_tiles(q_nope, q_pe, cache_ptr, ReqToToken, pool_row, start, end, limit, t, seq_len, 1,
                                     qk_scale, stride_cache, stride_rtt, None, L, R, BLOCK_L, BLOCK_R, BLOCK_H,
                                     BLOCK_N, DOT_DTYPE, DOT_PREC, first_slots)
        if TIMING:
            _stamp_after(Times, pid, 10, tl.max(tl.max(acc, axis=1), axis=0) + tl.max(l_i, axis=0), TIMING)
        store_split(acc, m_i, l_i, Out, MidO, MidLse, t, h, h_ok, pid, start, seq_len, v_scale, 0, 0, H,
                    num_splits, L, BLOCK_L)
        if PHASE == 0:
            _arrive(Sync + 1)
        _stamp(Times, pid, 4, TIMING)

    # ---- phase C: head hc's partials merged (rounded as the reduce stores them), then W_UV's BN_C columns
    if DO_C and in_c:
        if PHASE == 0:
            _wait_for(Sync + 1, num_splits)
        _stamp(Times, pid, 5, TIMING)
        used = tl.cdiv(seq_len, split_len)                                     # the splits that saw tokens
        # the first CHUNK_S partials are asked for with the log-sum-exps: one round trip to L2 where there is one
        # chunk, not two
        # (names of their own: the loop's s, s_ok and rows are not carried from here, whatever used's int type)
        first = tl.arange(0, CHUNK_S)
        first_ok = first < used
        first_rows = tl.load(MidO + (hc * num_splits + first)[:, None] * L + offs_l[None, :],
                             mask=first_ok[:, None] & (offs_l < L)[None, :], other=0.0)             # [CS, BL]
        lse_first = tl.load(MidLse + hc * num_splits + first, mask=first_ok, other=float("-inf"))   # [CS]
        offs_s = tl.arange(0, BLOCK_S)
        lse = tl.load(MidLse + hc * num_splits + offs_s, mask=offs_s < used, other=float("-inf"))
        top = tl.max(lse, axis=0)
        den = tl.sum(tl.exp2(lse - top), axis=0)
        o = tl.sum(first_rows * tl.exp2(lse_first - top)[:, None], axis=0)
        for s0 in range(CHUNK_S, used, CHUNK_S):
            s = s0 + tl.arange(0, CHUNK_S)
            s_ok = s < used
            w = tl.exp2(tl.load(MidLse + hc * num_splits + s, mask=s_ok, other=float("-inf")) - top)      # [CS]
            rows = tl.load(MidO + (hc * num_splits + s)[:, None] * L + offs_l[None, :],
                           mask=s_ok[:, None] & (offs_l < L)[None, :], other=0.0)                   # [CS, BL]
            o += tl.sum(rows * w[:, None], axis=0)
        o = (o / den).to(Out.dtype.element_ty).to(tl.float32)
        if TIMING:
            _stamp_after(Times, pid, 11, tl.max(o, axis=0), TIMING)
        res = tl.sum(o[:, None] * w_c.to(tl.float32), axis=0)                                         # [BN_C]
        tl.store(Out + hc * stride_oh + cols_c, res.to(Out.dtype.element_ty), mask=cols_c < DV)
        _stamp(Times, pid, 6, TIMING)

    if PHASE == 0:
        tl.debug_barrier()
        if tl.atomic_add(Sync + 2, 1, sem="acq_rel", scope="gpu") == num_programs - 1:
            tl.atomic_xchg(Sync, 0, sem="relaxed", scope="gpu")              # ready for the next launch
            tl.atomic_xchg(Sync + 1, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(Sync + 2, 0, sem="relaxed", scope="gpu")
    _stamp(Times, pid, 7, TIMING)


def mla_decode_chain(q_nope: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor, q_pe: torch.Tensor,
                     k_pe: torch.Tensor, kv_c: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                     kv_cache: torch.Tensor, out_slots: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_idx: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float, *,
                     num_kv_splits: int | None = None, kv_scale: float | torch.Tensor | None = None,
                     norm_weight: torch.Tensor | None = None, eps: float = 0.0, phase: int = 0,
                     times: torch.Tensor | None = None) -> torch.Tensor:
    """`rope_head_gemm(q_nope, w_kc, q_pe, k_pe, kv_c, positions, cos_sin_cache, kv_cache, out_slots, ...)`, then
    `mla_decode(q_lat, kv_cache, ...)` with q_pe, then `head_gemm(o_lat, w_vc, trans=True)`, for one token (same
    in-place effects on q_pe, k_pe, kv_c and the cache). Returns o [1, H, Dv] in q's dtype.

    phase: 0 one launch (a CUDA device: `chain_fits`); 1, 2, 3 each phase as its own launch, in order (the
    interpreter, tests). times: int64 [>= programs, STAMPS], each program's timer stamps (the probe's --stamps)."""
    t, h, dn = q_nope.shape
    l, dv = w_kc.shape[2], w_vc.shape[1]
    assert t == 1 and h <= CHAIN_MAX_HEADS, f"the chain decodes one token of <= {CHAIN_MAX_HEADS} heads, got {t} x {h}"
    assert w_kc.shape == (h, dn, l) and w_vc.shape == (h, dv, l) and w_kc.stride(2) == 1 and w_vc.stride(2) == 1, \
        f"w_kc [H, Dn, L] / w_vc [H, Dv, L] (last dim contiguous) expected, got {tuple(w_kc.shape)} {tuple(w_vc.shape)}"
    assert q_nope.stride(2) == 1 and q_nope.dtype == w_kc.dtype == w_vc.dtype == q_pe.dtype, \
        "q_nope (last dim contiguous), w_kc, w_vc and q_pe must share a dtype"
    assert kv_cache.shape[1] == l + q_pe.shape[2] and kv_cache.is_contiguous(), \
        f"kv_cache [slots, {l + q_pe.shape[2]}] contiguous expected, got {tuple(kv_cache.shape)}"
    rope_args, rope_meta, (_, rope_programs) = rope_launch_args(q_pe, k_pe, kv_c, positions, cos_sin_cache, kv_cache,
                                                                out_slots, kv_scale=kv_scale, norm_weight=norm_weight,
                                                                eps=eps)
    cfg = pick_config(h)
    block_n = CHAIN_BLOCK_N or cfg.block_n
    splits = num_kv_splits or choose_num_kv_splits(decode_programs(1, h), int(seq_lens.max()))
    programs = chain_programs(h, l, dv, rope_programs, splits)
    q_lat = q_nope.new_empty((h, l))
    mid_o = torch.empty((h, splits, l), dtype=torch.float32, device=q_nope.device)
    mid_lse = torch.empty((h, splits), dtype=torch.float32, device=q_nope.device)
    out = q_nope.new_empty((1, h, dv))
    scale = 1.0 if kv_scale is None else float(kv_scale)
    if times is not None:
        assert times.dtype == torch.int64 and times.is_contiguous() and times.numel() >= programs * STAMPS.value, \
            f"times must be contiguous int64 [>= {programs}, {STAMPS.value}]"
    sync = _counters(q_nope.device)
    args = (q_nope, w_kc, q_lat, w_vc, out, mid_o, mid_lse, sync, sync if times is None else times, *rope_args,
            req_to_token, req_pool_idx, seq_lens, kv_cache.data_ptr(), sm_scale * scale * LOG2E, scale,
            q_nope.stride(1), w_kc.stride(0), w_kc.stride(1), w_vc.stride(0), w_vc.stride(1), out.stride(1),
            req_to_token.stride(0), splits, programs)
    meta = dict(DN=dn, L=l, R=q_pe.shape[2], DV=dv, BLOCK_DN=_padded(dn), BLOCK_L=_padded(l),
                BLOCK_R=_padded(q_pe.shape[2]), BLOCK_H=cfg.block_h, BLOCK_N=block_n,
                BLOCK_S=triton.next_power_of_2(splits), BN_A=BN_A, BN_C=BN_C, CHUNK_S=CHUNK_S,
                ROW_BYTES=kv_cache.stride(0) * kv_cache.element_size(), A_PROGRAMS=h * triton.cdiv(l, BN_A),
                ROPE_PROGRAMS=rope_programs, C_PROGRAMS=h * triton.cdiv(dv, BN_C),
                R_HALF=rope_meta["R_HALF"], BLOCK_RH=rope_meta["BLOCK_RH"], ROPE_BLOCK_H=rope_meta["BLOCK_H"],
                NORM=rope_meta["NORM"], HAS_SCALE=rope_meta["HAS_SCALE"],
                **{k: rope_meta[k] for k in ("IS_FP8", "FP8_MAX", "MANT_BITS", "MIN_EXP", "SOFT_ROUND")},
                DOT_DTYPE=_TL_DTYPE[q_nope.dtype], DOT_PREC=dot_precision(q_nope.dtype), num_warps=NUM_WARPS,
                num_stages=cfg.num_stages)
    assert rope_meta["BLOCK_L"] == meta["BLOCK_L"], "the rope's latent tile must be the attention's"
    if phase == 0:
        assert q_nope.is_cuda, "one launch needs a GPU (its phases wait on each other): phase=1, 2, 3 elsewhere"
        # the bulk prefetch wants 16-byte aligned rows of whole 16-byte units
        prefetch = kv_cache.data_ptr() % 16 == 0 and meta["ROW_BYTES"] % 16 == 0
        _mla_chain_kernel[(programs,)](*args, **meta, PHASE=0, PREFETCH=prefetch,
                                       TIMING=times is not None, **pdl_meta(q_nope.device))
        return out
    assert phase in (1, 2, 3), f"phase must be 0, 1, 2 or 3, got {phase}"
    for p in (1, 2, 3) if phase == 1 else (phase,):
        _mla_chain_kernel[(programs,)](*args, **meta, PHASE=p, PREFETCH=False, TIMING=False, PDL=False,
                                       launch_pdl=False)
    return out


def mla_decode_chain_ref(q_nope: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor, q_pe: torch.Tensor,
                         k_pe: torch.Tensor, kv_c: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                         kv_cache: torch.Tensor, out_slots: torch.Tensor, req_to_token: torch.Tensor,
                         req_pool_idx: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float, *,
                         num_kv_splits: int | None = None, kv_scale: float | torch.Tensor | None = None,
                         norm_weight: torch.Tensor | None = None, eps: float = 0.0, phase: int = 0) -> torch.Tensor:
    """Reference for `mla_decode_chain` (its spec): the three references in turn."""
    q_lat = rope_head_gemm_ref(q_nope, w_kc, q_pe, k_pe, kv_c, positions, cos_sin_cache, kv_cache, out_slots,
                               kv_scale=kv_scale, norm_weight=norm_weight, eps=eps)
    o_lat = mla_decode_ref(q_lat, kv_cache, req_to_token, req_pool_idx, seq_lens, sm_scale,
                           kv_lora_rank=w_kc.shape[2], kv_scale=kv_scale, q_pe=q_pe)
    return head_gemm_ref(o_lat, w_vc, trans=True)
