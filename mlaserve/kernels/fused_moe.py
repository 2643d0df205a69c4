"""Fused routed-expert MLP (DeepSeek MoE): token/expert sort, grouped GEMMs with SwiGLU, bf16 or block-FP8 w8a8.

Shapes: `T` tokens, `K` hidden, `I` moe intermediate, `E` experts, `k` top-k, `S = T * k` (token, k) slots,
`P` padded slots (each expert's slots padded to BLOCK_SIZE_M). w13 [E, 2I, K] = [gate_proj | up_proj], w2 [E, K, I].
"""
from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from mlaserve.kernels import quant
from mlaserve.kernels.allreduce import LL_DMAX, LL_ROWS, LLGroup, ll_all_reduce_rows
from mlaserve.kernels.norm import check_norm_operands, fused_add_rmsnorm_ref
from mlaserve.kernels.pdl import pdl_enter, pdl_meta, pdl_release
from mlaserve.kernels.precision import dot_precision
from mlaserve.kernels.quant import quant_group_rows
from mlaserve.kernels.reduce import bf16_rne, sum_dim1

logger = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).parent / "configs"
FP8_DTYPE = torch.float8_e4m3fn
# Up to this many tokens (given a `sync` buffer) the second grouped GEMM also combines each token's k rows;
# above it sum_dim1 does (the last program per tile would sum T * k rows alone). benchmarks/gpu_moe_fuse.sh on an
# H100: 1 us faster at one token, 1-2 us slower from 4.
COMBINE_MAX_TOKENS = 1
# Up to this many tokens sum_dim1 does the combine, above it torch.sum. H100, [T, k, hidden] bf16
# (benchmarks/results/tuning/h100-moe-fuse.txt): at hidden 2048 (V2-Lite, k 8) sum_dim1 won 0.3-1.1 us up to 64
# tokens and lost 1.5 us at 256; at 7168 (V3, k 9) it won 0.5-0.7 us up to 4 and lost 2.7-47 us from 16. Hence a
# bound per hidden size: no bound on T x hidden fits both (64 x 2048 won, 16 x 7168 with fewer values lost).
SUM_DIM1_MAX_TOKENS = 64
SUM_DIM1_MAX_TOKENS_WIDE = 4            # hidden above SUM_DIM1_NARROW_HIDDEN
SUM_DIM1_NARROW_HIDDEN = 2048
# From this many tokens sum_dim1's row-blocked kernel does it (rows=True), between the two torch.sum.
# benchmarks/bench_combine.py on an H200 (benchmarks/results/prequant-h200.md), against torch.sum at 1024-8192 tokens:
# 22-36% faster on [T, 6, 2048] (V2-Lite's routed rows at prefill), 5-16% on [T, 8, 2048], 9-24% on V3's [T, 8 or 9,
# 7168]; at 256 tokens equal (V3) or 2 us slower (V2-Lite), at 64 slower.
SUM_ROWS_MIN_TOKENS = 1024
# How the S = T * k slots are aligned (`align_launches`), from benchmarks/bench_moe_align.py on an H100
# (benchmarks/results/decode-host-h100.md, prefill-v3-h100.md): one program (`_moe_align_kernel`) while S x BE (BE:
# the expert bins, a power of two above E) is at most ALIGN_ONE_PROGRAM_MAX_WORK, as its per-chunk work grows with
# both; then a count and a scan-and-scatter, whose every program reads the count's whole partial [chunks, BE], while
# those reads (chunks x chunks x BE values) are at most ALIGN_TWO_LAUNCH_MAX_READS; else count, column scan,
# label-and-scatter. Measured (us, one / two / three launches):
#   V2-Lite (BE 128): 1 token 2.4 / 7.7 / 13.7; 16 tokens 9.1 / 9.7 / 15.3; 1024 tokens (2.1M values read) 224 / 9.9
#                     / 11.1; 2048 tokens (8.4M) 438 / 14.7 / 12.2
#   V3 (BE 512):      1 token 4.1 / 7.1 / 10.3; 64 tokens (0.66M) 46 / 9.5 / 9.8; 256 tokens (10.6M) 124 / 12.9 /
#                     10.9; 4096 tokens 1632 / 867 / 56
# Two launches beat three up to 2.1M values read on every shape, and lost from 8.4M: the bound.
ALIGN_ONE_PROGRAM_MAX_WORK = 16384
# From two tokens, while S = T * k <= EXPERT_SCAN_MAX_SLOTS and the E stacked experts' count bins (E + 2 rounded up
# to a power of two) <= EXPERT_SCAN_MAX_BINS, no align runs (EXPERT_SCAN): each GEMM program works out its row block
# of the sorted layout from the flat ids itself. That costs every program a count over S slots and E bins, so it
# pays only while both are small; with block-FP8 weights it did not pay at all (EXPERT_SCAN_FP8).
# benchmarks/bench_moe_scan.py on an H200 (benchmarks/results/moe-scan-h200.md), whole fused_moe call, us, scan
# against sort, two runs:
#   V2-Lite (66 experts, 128 bins, bf16): T 4 103-106 / 108-111, T 16 213-225 / 220-233, T 32 251-260 / 257-268,
#                                         T 64 (S 512) 291-297 / 287-291
#   V3 (257 experts, 512 bins, FP8):      T 2 236-240 / 224-231, T 16 1141-1257 / 1061-1153, T 64 3201-3322 / 2315-2464
#   V3 as one EP-8 rank (33 local experts, 64 bins, FP8): T 2-16 (S 18-144) 0.5 us faster to 3.9 us slower,
#                                         T 32 1040 / 1009
EXPERT_SCAN_MAX_SLOTS = 256
EXPERT_SCAN_MAX_BINS = 128
EXPERT_SCAN_FP8 = False
# How `_fused_moe_kernel` finds each row block's expert and slots (its ROUTING; `Routing`)
SORTED, SLOT_BLOCKS, EXPERT_SCAN = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
# NOTE: at one token, the shared slots' programs launched first and asked for their weight rows in L2
# (`prefetch.global.L2::evict_last`) before the PDL wait, with the router releasing the MoE at its start, so those
# reads would overlap the router (f150b91). On an H200 the V2-Lite bs-1 graph replay was 2.31 / 2.23 ms with it
# against 2.13 / 2.14 ms without (alternated twice), V3 4 layers FP8 1.54 / 1.50 against 1.54 / 1.50 ms: removed
# (benchmarks/results/merge-moe-h200.md).
# NOTE: at one token, the second GEMM reading its expert id and first weight tile before its PDL wait (the ids are
# the router's, complete before the first GEMM passed its wait), with or without the first GEMM releasing it at its
# start, gained nothing on an H100 (e66bbfe): V2-Lite bs-1 graph replay 2.58 / 2.58 ms (preload), 2.56 / 2.56 (and
# the early release) against 2.50 / 2.59 without, alternated (benchmarks/results/chain-stamps-h100.md). Removed.
ALIGN_CHUNK = 128                   # slots per step of the one-program scatter ([C, C] rank tile)
ALIGN_TWO_LAUNCH_MAX_READS = 128 * 128 * 128


def align_launches(num_slots: int, num_experts: int) -> int:
    """Launches `moe_align_block_size` takes by default for S slots over E experts (1, 2 or 3)."""
    block_e = triton.next_power_of_2(num_experts + 1)                  # + the sentinel run
    if num_slots * block_e <= ALIGN_ONE_PROGRAM_MAX_WORK:
        return 1
    chunks = triton.cdiv(num_slots, _align_chunk(block_e))
    return 2 if chunks * chunks * block_e <= ALIGN_TWO_LAUNCH_MAX_READS else 3


def _align_chunk(block_e: int) -> int:
    """Slots per program of the count and scatter kernels ([BE, C] one-hot tiles of at most 8192 values)."""
    return max(16, min(128, 8192 // block_e))


# ----------------------------------------------------------------------------------------------- align
# Counting sort of the S = T * k slots by expert, each expert padded to BLOCK_M and its blocks labelled.
# At decode sizes (`align_launches`) one program does it all (`_moe_align_kernel`): counts, labels, then scatters
# CHUNK slots at a time from running per-expert bases. Above it a count per chunk and expert, then either one
# scan-and-scatter launch whose programs each sum the counts they need and label a share of the blocks, or (largest
# sizes) an exclusive scan over (expert, chunk) in one program that also labels, and a scatter per chunk. All three
# write the same outputs.
# NOTE: a slot with id -1 (an expert another EP rank holds) sorts as one more expert, index E, after the real
# ones; its blocks are labelled -1, the first GEMM skips them and the second writes zeros for their rows.
#   sorted:      | expert 0 (padded) | ... | expert E-1 (padded) | sentinel slots (padded) | unused |
#   expert_ids:  | 0 ...             | ... | E-1 ...             | -1 ...                  | -1 ... |
@triton.jit
def _chunk_experts(topk_ids_ptr, start, num_slots, num_experts, CHUNK: tl.constexpr):
    # [C] slots start .. start + C - 1 and their experts: id -1 (the sentinel) and lanes past the slots as E
    offs = start + tl.arange(0, CHUNK)
    ids = tl.load(topk_ids_ptr + offs, mask=offs < num_slots, other=-1)
    return offs, tl.where(ids < 0, num_experts, ids)


@triton.jit
def _chunk_onehot(topk_ids_ptr, chunk, num_slots, num_experts, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    offs, e = _chunk_experts(topk_ids_ptr, chunk * CHUNK, num_slots, num_experts, CHUNK)
    hit = (tl.arange(0, BLOCK_E)[:, None] == e[None, :]) & (offs < num_slots)[None, :]
    return offs, hit.to(tl.int32)                                                   # [C], [BE, C]


@triton.jit
def _scatter_chunk(sorted_ids_ptr, offs, onehot, base, num_slots):
    # stable: slot j of expert e in this chunk goes to base[e] + (its rank among e's slots in the chunk)
    rank = tl.cumsum(onehot, axis=1) - 1 + base[:, None]
    tl.store(sorted_ids_ptr + tl.sum(onehot * rank, axis=0), offs, mask=offs < num_slots)


@triton.jit
def _label_blocks(counts, expert_ids_ptr, sorted_ids_ptr, num_post_pad_ptr, num_slots, num_blocks, num_experts,
                  part, parts, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    # counts [BE] slots per expert -> starts [BE] of each expert's padded run; writes the block labels of share
    # `part` of `parts` (CHUNK blocks every parts * CHUNK): each block's expert (-1 for the sentinel run and past the
    # used blocks) and padding sentinels; part 0 also the used length.
    experts = tl.arange(0, BLOCK_E)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    if part == 0:
        tl.store(num_post_pad_ptr, total)
    for b0 in range(part * CHUNK, num_blocks, parts * CHUNK):
        blocks = b0 + tl.arange(0, CHUNK)                                           # [C]
        first = blocks * BLOCK_M
        e = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), axis=1)         # [C] expert of the block
        onehot = e[:, None] == experts[None, :]                                     # [C, BE]
        filled = tl.sum(tl.where(onehot, counts[None, :] + starts[None, :], 0), axis=1) - first
        tl.store(expert_ids_ptr + blocks, tl.where((first < total) & (e < num_experts), e, -1),
                 mask=blocks < num_blocks)
        pos = first[:, None] + tl.arange(0, BLOCK_M)[None, :]                         # [C, BM]
        pad = (tl.arange(0, BLOCK_M)[None, :] >= filled[:, None]) & (blocks < num_blocks)[:, None]
        tl.store(sorted_ids_ptr + pos, tl.zeros([CHUNK, BLOCK_M], tl.int32) + num_slots, mask=pad)
    return starts


@triton.jit(do_not_specialize=["num_slots", "num_blocks"])
def _moe_align_kernel(topk_ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_pad_ptr,
                      num_slots, num_blocks, num_experts, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                      CHUNK: tl.constexpr, LABEL_CHUNK: tl.constexpr, PDL: tl.constexpr):
    # One program: count every chunk, label, then scatter chunk by chunk. A slot's position is its expert's
    # running base (the expert's start plus its slots in earlier chunks) plus its rank among the chunk's slots of
    # that expert ([C, C] compare), so no [BE, C] one-hot: the work per chunk does not grow with E.
    pdl_enter(PDL)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c0 in range(0, num_slots, CHUNK):
        offs, e = _chunk_experts(topk_ids_ptr, c0, num_slots, num_experts, CHUNK)
        counts += tl.histogram(e, BLOCK_E, mask=offs < num_slots)
    base = _label_blocks(counts, expert_ids_ptr, sorted_ids_ptr, num_post_pad_ptr, num_slots, num_blocks,
                         num_experts, 0, 1, BLOCK_M, BLOCK_E, LABEL_CHUNK)          # [BE] starts
    lane = tl.arange(0, CHUNK)
    for c0 in range(0, num_slots, CHUNK):
        offs, e = _chunk_experts(topk_ids_ptr, c0, num_slots, num_experts, CHUNK)
        ok = offs < num_slots
        earlier = (e[:, None] == e[None, :]) & (lane[None, :] < lane[:, None])     # [C, C]: j before i, same e
        rank = tl.sum(earlier.to(tl.int32), axis=1)
        tl.store(sorted_ids_ptr + tl.gather(base, e, 0) + rank, offs, mask=ok)
        base += tl.histogram(e, BLOCK_E, mask=ok)


@triton.jit(do_not_specialize=["num_slots"])
def _moe_count_kernel(topk_ids_ptr, partial_ptr, num_slots, num_experts, BLOCK_E: tl.constexpr,
                      CHUNK: tl.constexpr, PDL: tl.constexpr):
    # partial [chunks, BE]: slots of each expert in this chunk
    pdl_enter(PDL)
    chunk = tl.program_id(0)
    _, onehot = _chunk_onehot(topk_ids_ptr, chunk, num_slots, num_experts, BLOCK_E, CHUNK)
    tl.store(partial_ptr + chunk * BLOCK_E + tl.arange(0, BLOCK_E), tl.sum(onehot, axis=1))


@triton.jit(do_not_specialize=["num_chunks"])
def _moe_colscan_kernel(partial_ptr, totals_ptr, num_chunks, BLOCK_E: tl.constexpr, GROUP_E: tl.constexpr,
                        BLOCK_P: tl.constexpr, PDL: tl.constexpr):
    # One program per GROUP_E experts (columns of the count's partial [chunks, BE]): partial[c, e] := slots of
    # expert e in the chunks before c (in place), totals[e] := all of them.
    pdl_enter(PDL)
    experts = tl.program_id(0) * GROUP_E + tl.arange(0, GROUP_E)
    run = tl.zeros([GROUP_E], dtype=tl.int32)
    for p0 in range(0, num_chunks, BLOCK_P):
        rows = p0 + tl.arange(0, BLOCK_P)
        ptrs = partial_ptr + rows[:, None] * BLOCK_E + experts[None, :]
        ok = (rows < num_chunks)[:, None]
        tile = tl.load(ptrs, mask=ok, other=0)                                        # [BP, GE]
        tl.store(ptrs, tl.cumsum(tile, axis=0) - tile + run[None, :], mask=ok)
        run += tl.sum(tile, axis=0)
    tl.store(totals_ptr + experts, run)


@triton.jit(do_not_specialize=["num_slots", "num_blocks", "num_chunks"])
def _moe_label_scatter_kernel(topk_ids_ptr, partial_ptr, totals_ptr, sorted_ids_ptr, expert_ids_ptr,
                              num_post_pad_ptr, num_slots, num_blocks, num_chunks, num_experts,
                              BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr,
                              LABEL_CHUNK: tl.constexpr, PDL: tl.constexpr):
    # One program per chunk, after the column scan: the experts' padded starts from their totals, this program's
    # share of the block labels, then its chunk scattered from starts + the slots of earlier chunks.
    pdl_enter(PDL)
    chunk = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    starts = _label_blocks(tl.load(totals_ptr + experts), expert_ids_ptr, sorted_ids_ptr, num_post_pad_ptr,
                           num_slots, num_blocks, num_experts, chunk, num_chunks, BLOCK_M, BLOCK_E, LABEL_CHUNK)
    before = tl.load(partial_ptr + chunk * BLOCK_E + experts)
    offs, onehot = _chunk_onehot(topk_ids_ptr, chunk, num_slots, num_experts, BLOCK_E, CHUNK)
    _scatter_chunk(sorted_ids_ptr, offs, onehot, starts + before, num_slots)


@triton.jit(do_not_specialize=["num_slots", "num_blocks", "num_chunks"])
def _moe_scan_scatter_kernel(topk_ids_ptr, partial_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_pad_ptr, num_slots,
                             num_blocks, num_chunks, num_experts, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                             CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, LABEL_CHUNK: tl.constexpr,
                             PDL: tl.constexpr):
    # The scan and the scatter in one launch, one program per chunk (after the count): each program sums the whole
    # partial [chunks, BE] for the expert totals (its padded starts) and the rows before its own (its base), labels
    # its share of the blocks, and scatters its chunk. Label and scatter writes land on disjoint positions.
    pdl_enter(PDL)
    chunk = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    before = tl.zeros([BLOCK_E], dtype=tl.int32)
    for p0 in range(0, num_chunks, BLOCK_P):
        rows = p0 + tl.arange(0, BLOCK_P)
        tile = tl.load(partial_ptr + rows[:, None] * BLOCK_E + experts[None, :], mask=(rows < num_chunks)[:, None],
                       other=0)                                                      # [BP, BE]
        counts += tl.sum(tile, axis=0)
        before += tl.sum(tl.where((rows < chunk)[:, None], tile, 0), axis=0)
    starts = _label_blocks(counts, expert_ids_ptr, sorted_ids_ptr, num_post_pad_ptr, num_slots, num_blocks,
                           num_experts, chunk, num_chunks, BLOCK_M, BLOCK_E, LABEL_CHUNK)
    offs, onehot = _chunk_onehot(topk_ids_ptr, chunk, num_slots, num_experts, BLOCK_E, CHUNK)
    _scatter_chunk(sorted_ids_ptr, offs, onehot, starts + before, num_slots)


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int, *,
                         launches: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the flattened (token, k) slots by expert, padding each expert to a multiple of `block_m`.

    Args:
        topk_ids: [T, k] int, every id in [0, num_experts) or -1 (an expert this rank does not hold).
    Returns:
        sorted_token_ids [P] int32: slot indices t * k + j grouped by expert (ascending within an expert), the
            slots of id -1 last, padding = the sentinel T * k. P is a static bound, a multiple of
            block_m >= S + min(E + 1, S) * (block_m - 1).
        expert_ids [P / block_m] int32: the expert of each block; -1 for the blocks of id -1 slots and past the
            used blocks.
        num_tokens_post_pad [1] int32: used length of sorted_token_ids (stays on device, no host sync).
    `launches` forces the single program (1), count + scan-and-scatter (2) or count / column scan / label-and-scatter
    (3); by default `align_launches` picks. All give the same outputs.
    """
    assert topk_ids.dim() == 2 and not topk_ids.is_floating_point(), \
        f"topk_ids must be [T, k] int, got {tuple(topk_ids.shape)} {topk_ids.dtype}"
    assert block_m > 0 and block_m & (block_m - 1) == 0, f"block_m must be a power of two, got {block_m}"
    assert num_experts > 0, f"num_experts must be positive, got {num_experts}"
    s = topk_ids.numel()
    num_blocks = triton.cdiv(s + min(num_experts + 1, s) * (block_m - 1), block_m)
    dev = topk_ids.device
    pdl = pdl_meta(dev)
    sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    num_post_pad = torch.empty(1, dtype=torch.int32, device=dev)
    ids = topk_ids.reshape(-1).contiguous()
    block_e = triton.next_power_of_2(num_experts + 1)                  # + the sentinel run
    launches = launches or align_launches(s, num_experts)
    assert launches in (1, 2, 3), f"launches must be 1, 2 or 3, got {launches}"
    if launches == 1:
        chunk = max(16, min(ALIGN_CHUNK, triton.next_power_of_2(s)))
        label_chunk = max(16, min(triton.next_power_of_2(num_blocks), 16384 // block_e))   # [LC, BE] label tiles
        _moe_align_kernel[(1,)](ids, sorted_ids, expert_ids, num_post_pad, s, num_blocks, num_experts,
                                BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=chunk, LABEL_CHUNK=label_chunk, **pdl,
                                num_warps=4 if chunk < ALIGN_CHUNK else 8)
        return sorted_ids, expert_ids, num_post_pad
    chunk = _align_chunk(block_e)
    num_chunks = triton.cdiv(s, chunk)
    partial = torch.empty(num_chunks, block_e, dtype=torch.int32, device=dev)       # [chunks, BE]
    _moe_count_kernel[(num_chunks,)](ids, partial, s, num_experts, BLOCK_E=block_e, CHUNK=chunk, **pdl, num_warps=4)
    if launches == 2:
        _moe_scan_scatter_kernel[(num_chunks,)](
            ids, partial, sorted_ids, expert_ids, num_post_pad, s, num_blocks, num_chunks, num_experts, BLOCK_M=block_m,
            BLOCK_E=block_e, CHUNK=chunk, BLOCK_P=min(triton.next_power_of_2(num_chunks), max(1, 8192 // block_e)),
            LABEL_CHUNK=max(16, min(triton.next_power_of_2(triton.cdiv(num_blocks, num_chunks)), 8192 // block_e)),
            **pdl, num_warps=4)
        return sorted_ids, expert_ids, num_post_pad
    group_e = min(block_e, 16)
    totals = torch.empty(block_e, dtype=torch.int32, device=dev)
    _moe_colscan_kernel[(block_e // group_e,)](partial, totals, num_chunks, BLOCK_E=block_e, GROUP_E=group_e,
                                               BLOCK_P=min(triton.next_power_of_2(num_chunks), 256), **pdl,
                                               num_warps=4)
    _moe_label_scatter_kernel[(num_chunks,)](
        ids, partial, totals, sorted_ids, expert_ids, num_post_pad, s, num_blocks, num_chunks, num_experts,
        BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=chunk,
        LABEL_CHUNK=max(16, min(triton.next_power_of_2(triton.cdiv(num_blocks, num_chunks)), 8192 // block_e)),
        **pdl, num_warps=4)
    return sorted_ids, expert_ids, num_post_pad


# ------------------------------------------------------------------------------------------ grouped GEMM
@triton.jit
def _mac(acc, a, a_s, b_ptrs, k_ok, n_ok, bs_ptrs, FP8: tl.constexpr, INTERPRET: tl.constexpr,
         DOT_PREC: tl.constexpr, SCALAR_BS: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
    # acc [BM, TN] += a [BM, BK] @ b [BK, TN] (times a_s [BM] * b_s [TN] in fp8 mode; SCALAR_BS: the tile lies in
    # one 128-row scale block, bs_ptrs is one pointer and the two scales fold into one [BM] factor: one FMA per element)
    if EVEN_K and EVEN_N:
        b = tl.load(b_ptrs)
    else:
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
    if FP8:
        if SCALAR_BS:
            acc += tl.dot(a, b) * (a_s * tl.load(bs_ptrs))[:, None]
        else:
            b_s = tl.load(bs_ptrs, mask=n_ok, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
    elif INTERPRET:
        # NOTE: the interpreter multiplies bf16 dot operands as raw bits; fp32 is exact there.
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
    return acc


@triton.jit
def _tile_coords(pid, num_pid_m, num_pid_n, GROUP_SIZE_M: tl.constexpr):
    # Swizzle: GROUP_SIZE_M consecutive row blocks walk the N tiles together, so B tiles are reused from L2.
    per_group = GROUP_SIZE_M * num_pid_n
    first_m = (pid // per_group) * GROUP_SIZE_M
    rows_in_group = tl.minimum(num_pid_m - first_m, GROUP_SIZE_M)
    return first_m + (pid % per_group) % rows_in_group, (pid % per_group) // rows_in_group


@triton.jit
def _round(v, ty, ROUND_BF16: tl.constexpr):
    # fp32 v rounded to the storage dtype ty, back in fp32 (the interpreter's own bf16 cast truncates)
    if ROUND_BF16:
        return bf16_rne(v)
    return v.to(ty).to(tl.float32)


@triton.jit
def _norm_rows(out_ptr, nres_ptr, nw_ptr, nh_ptr, nro_ptr, eps, num_tokens, N, stride_om, stride_res,
               ROUND_BF16: tl.constexpr, BLOCK_D: tl.constexpr):
    # The next layer's input norm on the combined rows: ro = out + res, h = rmsnorm(ro) (kernels/norm.py's roundings);
    # ro and h have out's row stride.
    offs = tl.arange(0, BLOCK_D)
    ok = offs < N
    ty = out_ptr.dtype.element_ty
    w = tl.load(nw_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    for t in range(0, num_tokens):
        o = tl.load(out_ptr + t * stride_om + offs, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
        r = tl.load(nres_ptr + t * stride_res + offs, mask=ok, other=0.0).to(tl.float32)
        x = _round(o + r, ty, ROUND_BF16)
        tl.store(nro_ptr + t * stride_om + offs, x.to(ty), mask=ok)
        y = _round(x * tl.math.rsqrt(tl.sum(x * x, axis=0) / N + eps), ty, ROUND_BF16)
        tl.store(nh_ptr + t * stride_om + offs, _round(w * y, ty, ROUND_BF16).to(ty), mask=ok)


@triton.jit
def _combine_tile(c_ptr, out_ptr, sync_ptr, used_blocks, pid_n, offs_n, n_ok, num_slots, stride_cm, stride_om,
                  nres_ptr, nw_ptr, nh_ptr, nro_ptr, eps, N, stride_res, ar_ptrs, ar_epochs, ar_rank, ar_half,
                  TOP_K: tl.constexpr, ROUND_BF16: tl.constexpr, BLOCK_T: tl.constexpr, TILE_N: tl.constexpr,
                  NORM_OUT: tl.constexpr, BLOCK_D: tl.constexpr, AR_WORLD: tl.constexpr):
    # The last of N tile pid_n's programs to store its rows of c sums them per token:
    # out[t, tile] = sum_j c[t * TOP_K + j, tile] in fp32, rounded once.
    # NOTE: as in moe_route: a barrier, then one acq_rel count per program; the last one's loads skip L1.
    tl.debug_barrier()
    if tl.atomic_add(sync_ptr + pid_n, 1, sem="acq_rel", scope="gpu") == used_blocks - 1:
        tl.atomic_xchg(sync_ptr + pid_n, 0, sem="relaxed", scope="gpu")           # ready for the next launch
        num_tokens = num_slots // TOP_K
        for t0 in range(0, num_tokens, BLOCK_T):
            tok = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
            mask = (tok < num_tokens)[:, None] & n_ok[None, :]
            acc = tl.zeros([BLOCK_T, TILE_N], dtype=tl.float32)
            for j in tl.static_range(TOP_K):
                rows = c_ptr + (tok * TOP_K + j)[:, None] * stride_cm + offs_n[None, :]
                acc += tl.load(rows, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
            if ROUND_BF16:
                acc = bf16_rne(acc)
            tl.store(out_ptr + tok[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=mask)
        if NORM_OUT:                  # the last tile to finish (a second count, sync[num tiles]) norms whole rows
            num_tiles = tl.cdiv(N, TILE_N)
            tl.debug_barrier()
            if tl.atomic_add(sync_ptr + num_tiles, 1, sem="acq_rel", scope="gpu") == num_tiles - 1:
                tl.atomic_xchg(sync_ptr + num_tiles, 0, sem="relaxed", scope="gpu")
                if AR_WORLD > 1:      # the rows are this rank's share (tensor parallelism): sum them over the ranks
                    ll_all_reduce_rows(out_ptr, stride_om, num_tokens, N, ar_ptrs, ar_epochs, ar_rank, ar_half,
                                       AR_WORLD, BLOCK_D)
                _norm_rows(out_ptr, nres_ptr, nw_ptr, nh_ptr, nro_ptr, eps, num_tokens, N, stride_om, stride_res,
                           ROUND_BF16, BLOCK_D)


@triton.jit(do_not_specialize=["num_slots", "num_padded"])   # one compile for every token count (per BLOCK_S)
def _fused_moe_kernel(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, topk_weights_ptr,
                      sorted_ids_ptr, expert_ids_ptr, num_post_pad_ptr, out_ptr, sync_ptr, N, K, num_slots, num_padded,
                      num_experts,
                      stride_am, stride_be, stride_bn, stride_cm, stride_asm, stride_bse, stride_bsn, stride_om,
                      nres_ptr, nw_ptr, nh_ptr, nro_ptr, eps, stride_res, ar_ptrs, ar_epochs, ar_rank, ar_half,
                      A_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, FP8: tl.constexpr,
                      QUANT_A: tl.constexpr, INTERPRET: tl.constexpr, ROUND_BF16: tl.constexpr,
                      DOT_PREC: tl.constexpr, COMBINE: tl.constexpr, ROUTING: tl.constexpr, BLOCK_S: tl.constexpr,
                      BLOCK_E: tl.constexpr,
                      TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
                      TILE_N: tl.constexpr, BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
                      GROUP_SIZE_M: tl.constexpr, NORM_OUT: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
                      AR_WORLD: tl.constexpr, SCALAR_BS: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
    # c[slot, n] = sum_k a[slot // A_DIV, k] * w[e, n, k]; GATED: c = silu(gate) * up with up rows at N + n.
    # COMBINE (second GEMM): also out[t] = sum of the token's TOP_K rows of c (`_combine_tile`); NORM_OUT: and then
    # the next layer's input norm of out + residual (`_norm_rows`).
    # ROUTING (`Routing`): SORTED: sorted_ids / expert_ids / num_post_pad from `moe_align_block_size`. SLOT_BLOCKS:
    # row block b is slot b alone, its other rows padding, and expert_ids_ptr is the flat topk_ids [S].
    # EXPERT_SCAN: the sorted layout's row blocks, each program working out its own block's expert and slots from
    # the flat topk_ids [S] (expert_ids_ptr) and the num_experts (E) stacked experts, with no align launch.
    # sorted_ids_ptr and num_post_pad_ptr are read by SORTED only.
    pdl_enter(PDL)                        # (the experts' weights to read are the router's output)
    num_pid_m = tl.cdiv(num_padded, BLOCK_SIZE_M)
    pid_m, pid_n = _tile_coords(tl.program_id(0), num_pid_m, tl.cdiv(N, TILE_N), GROUP_SIZE_M)
    offs_n = pid_n * TILE_N + tl.arange(0, TILE_N)
    n_ok = offs_n < N
    if ROUTING == EXPERT_SCAN:
        # the sorted layout's block pid_m, worked out from the ids: per-expert counts (bin E: the slots of id -1,
        # bin E + 1: past S), each expert's blocks, the expert whose blocks hold pid_m, then its slots at that place
        offs_s = tl.arange(0, BLOCK_S)
        ids = tl.load(expert_ids_ptr + offs_s, mask=offs_s < num_slots, other=-2)
        bins = tl.where(ids >= 0, ids, tl.where(ids == -1, num_experts, num_experts + 1))                # [BS]
        offs_e = tl.arange(0, BLOCK_E)
        counts = tl.where(offs_e <= num_experts, tl.histogram(bins, BLOCK_E), 0)                          # [BE]
        blocks = (counts + BLOCK_SIZE_M - 1) // BLOCK_SIZE_M
        ends = tl.cumsum(blocks, axis=0)
        used = tl.sum(blocks, axis=0) * BLOCK_SIZE_M
        if pid_m * BLOCK_SIZE_M >= used:
            return
        e = tl.sum((ends <= pid_m).to(tl.int32), axis=0)
        here = offs_e == e
        first = tl.sum(tl.where(here, ends - blocks, 0), axis=0)
        mine = bins == e
        slots = _scan_slots(mine, tl.cumsum(mine.to(tl.int32), axis=0) - 1, offs_s,
                            (pid_m - first) * BLOCK_SIZE_M, tl.sum(tl.where(here, counts, 0), axis=0), num_slots,
                            BLOCK_SIZE_M)
        _expert_rows(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, topk_weights_ptr, slots,
                     tl.where(e == num_experts, -1, e).to(tl.int64), pid_n * TILE_N, offs_n, n_ok, N, K, num_slots,
                     stride_am, stride_be, stride_bn, stride_cm, stride_asm, stride_bse, stride_bsn, A_DIV, GATED,
                     MUL_WEIGHT, FP8, QUANT_A, INTERPRET, ROUND_BF16, DOT_PREC, GROUP_N, GROUP_K, TILE_N, BLOCK_SIZE_M,
                     BLOCK_SIZE_K, PDL, SCALAR_BS, EVEN_K, EVEN_N)
    else:
        if ROUTING == SLOT_BLOCKS:        # the grid has exactly num_slots row blocks: every one is used
            used = num_slots * BLOCK_SIZE_M
            slots = tl.where(tl.arange(0, BLOCK_SIZE_M) == 0, pid_m, num_slots).to(tl.int64)             # [BM]
        else:
            used = tl.load(num_post_pad_ptr)
            if pid_m * BLOCK_SIZE_M >= used:
                return
            slots = tl.load(sorted_ids_ptr + pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)).to(tl.int64)
        _expert_rows(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, topk_weights_ptr, slots,
                     tl.load(expert_ids_ptr + pid_m).to(tl.int64), pid_n * TILE_N, offs_n, n_ok, N, K, num_slots,
                     stride_am, stride_be, stride_bn, stride_cm, stride_asm, stride_bse, stride_bsn, A_DIV, GATED,
                     MUL_WEIGHT, FP8, QUANT_A, INTERPRET, ROUND_BF16, DOT_PREC, GROUP_N, GROUP_K, TILE_N, BLOCK_SIZE_M,
                     BLOCK_SIZE_K, PDL, SCALAR_BS, EVEN_K, EVEN_N)
    if COMBINE:
        _combine_tile(c_ptr, out_ptr, sync_ptr, used // BLOCK_SIZE_M, pid_n, offs_n, n_ok, num_slots, stride_cm,
                      stride_om, nres_ptr, nw_ptr, nh_ptr, nro_ptr, eps, N, stride_res, ar_ptrs, ar_epochs, ar_rank,
                      ar_half, TOP_K, ROUND_BF16, BLOCK_T, TILE_N, NORM_OUT, BLOCK_D, AR_WORLD)


@triton.jit
def _scan_slots(mine, rank, offs_s, r0, count, num_slots, BLOCK_SIZE_M: tl.constexpr):
    # The slots of places r0 .. r0 + BM - 1 among one expert's (mine [BS], rank [BS]: the place of each of its slots),
    # ascending; the places past count are padding (num_slots).
    want = r0 + tl.arange(0, BLOCK_SIZE_M)                                                             # [BM]
    hit = mine[None, :] & (rank[None, :] == want[:, None])                                             # [BM, BS]
    slots = tl.sum(tl.where(hit, offs_s[None, :], 0), axis=1)
    return tl.where(want < count, slots, num_slots).to(tl.int64)


@triton.jit
def _expert_rows(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, topk_weights_ptr, slots, expert, n0, offs_n, n_ok,
                 N, K, num_slots, stride_am, stride_be, stride_bn, stride_cm, stride_asm, stride_bse, stride_bsn,
                 A_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, FP8: tl.constexpr,
                 QUANT_A: tl.constexpr, INTERPRET: tl.constexpr, ROUND_BF16: tl.constexpr, DOT_PREC: tl.constexpr,
                 GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, TILE_N: tl.constexpr, BLOCK_SIZE_M: tl.constexpr,
                 BLOCK_SIZE_K: tl.constexpr, PDL: tl.constexpr, SCALAR_BS: tl.constexpr, EVEN_K: tl.constexpr,
                 EVEN_N: tl.constexpr):
    # One row block's output tile: c[slots, n0 + offs_n] (rows of slots >= num_slots are padding and not stored).
    valid = slots < num_slots
    c_ptrs = c_ptr + slots[:, None] * stride_cm + offs_n[None, :]
    if expert < 0:                        # slots of id -1 (another rank's expert): they contribute zero
        if not GATED:                     # (their h rows are never read: the second GEMM lands here too)
            tl.store(c_ptrs, tl.zeros([BLOCK_SIZE_M, TILE_N], dtype=c_ptr.dtype.element_ty),
                     mask=valid[:, None] & n_ok[None, :])
    else:
        offs_k = tl.arange(0, BLOCK_SIZE_K)
        rows = slots // A_DIV
        a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
        b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None]   # [BK, TN]
        if SCALAR_BS:                     # the tile's (and its up rows') one scale row
            bs_ptrs = b_scale_ptr + expert * stride_bse + (n0 // GROUP_N) * stride_bsn
            up_bs = b_scale_ptr + expert * stride_bse + ((N + n0) // GROUP_N) * stride_bsn
        else:
            bs_ptrs = b_scale_ptr + expert * stride_bse + (offs_n // GROUP_N) * stride_bsn
            up_bs = b_scale_ptr + expert * stride_bse + ((N + offs_n) // GROUP_N) * stride_bsn
        acc = tl.zeros([BLOCK_SIZE_M, TILE_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_SIZE_M, TILE_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_SIZE_K):
            k_ok = offs_k < K - k0
            # NOTE: padding rows stay masked: pointed at a real row instead, their loads cost 15-30% of the V3
            # GEMMs at 4096-8192 tokens on an H200 (benchmarks/results/moe-prefill-h200.md)
            # NOTE: TMA was tried (3a8f0d9..2502103): the weights through host TMA descriptors (stacked rows or
            # [E, rows, K]), h kept in the sorted layout so the second GEMM read its rows as whole TMA tiles. Equal
            # sums, no gain on an H200 at prefill sizes (benchmarks/results/moe-tma-h200.md): V3 4096 tokens, best
            # gate + up 3497 against 3518 us, down 1792 against 1779 us; V2-Lite down 268 against 284 us, whole call
            # 883 against 877 us; it faulted twice on V3's full expert stack (illegal address, not found). Removed.
            if EVEN_K:
                a = tl.load(a_ptrs + k0, mask=valid[:, None], other=0.0)
            else:
                a = tl.load(a_ptrs + k0, mask=valid[:, None] & k_ok[None, :], other=0.0)
            a_s = tl.zeros([BLOCK_SIZE_M], dtype=tl.float32)
            if QUANT_A:
                a, a_s = quant_group_rows(a.to(tl.float32), INTERPRET)
            elif FP8:
                a_s = tl.load(a_scale_ptr + rows * stride_asm + k0 // GROUP_K, mask=valid, other=0.0)
            k_blk = k0 // GROUP_K
            acc = _mac(acc, a, a_s, b_ptrs + k0, k_ok, n_ok, bs_ptrs + k_blk, FP8, INTERPRET, DOT_PREC, SCALAR_BS,
                       EVEN_K, EVEN_N)
            if GATED:
                acc_up = _mac(acc_up, a, a_s, b_ptrs + N * stride_bn + k0, k_ok, n_ok, up_bs + k_blk, FP8,
                              INTERPRET, DOT_PREC, SCALAR_BS, EVEN_K, EVEN_N)
        pdl_release(PDL)
        if GATED:
            acc = acc * tl.sigmoid(acc) * acc_up                              # silu(gate) * up
        if MUL_WEIGHT:
            acc = acc * tl.load(topk_weights_ptr + slots, mask=valid, other=0.0).to(tl.float32)[:, None]
        if ROUND_BF16:
            acc = bf16_rne(acc)
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


def _quant_act(a: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    if a.is_cuda and hasattr(quant, "per_token_group_quant_fp8"):
        return quant.per_token_group_quant_fp8(a, group)
    return quant.per_token_group_quant_fp8_ref(a, group)


class Routing(NamedTuple):
    """How `_fused_moe_kernel`'s row blocks find their expert and slots (`_route`)."""
    mode: int                             # SORTED, SLOT_BLOCKS or EXPERT_SCAN
    ids: torch.Tensor                     # SORTED: expert_ids [P / BM]; the others: the flat topk_ids [S]
    sorted_ids: torch.Tensor | None = None           # SORTED only: `moe_align_block_size`'s
    num_post_pad: torch.Tensor | None = None


def expert_scan_fits(num_slots: int, num_experts: int, fp8: bool) -> bool:
    """Whether S slots over E stacked experts run without an align (EXPERT_SCAN; from two tokens on)."""
    return (num_slots <= EXPERT_SCAN_MAX_SLOTS and triton.next_power_of_2(num_experts + 2) <= EXPERT_SCAN_MAX_BINS
            and (EXPERT_SCAN_FP8 or not fp8))


def _route(topk_ids: torch.Tensor, block_m: int, num_experts: int, fp8: bool) -> Routing:
    # One token: each slot its own row block (`_slot_blocks`); few slots over few experts: the sorted layout worked
    # out inside the GEMMs (EXPERT_SCAN); else the counting sort's launches.
    if topk_ids.shape[0] == 1:
        return _slot_blocks(topk_ids)
    if expert_scan_fits(topk_ids.numel(), num_experts, fp8):
        return Routing(EXPERT_SCAN.value, topk_ids.reshape(-1).contiguous())
    sorted_ids, expert_ids, num_post_pad = moe_align_block_size(topk_ids, block_m, num_experts)
    return Routing(SORTED.value, expert_ids, sorted_ids, num_post_pad)


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None, c: torch.Tensor,
                  routing: Routing, weights: torch.Tensor | None, cfg: dict, fuse_quant: bool,
                  block_shape: tuple[int, int], a_div: int, gated: bool,
                  combine: tuple[torch.Tensor, torch.Tensor] | None = None,
                  norm: tuple[torch.Tensor, torch.Tensor, float, torch.Tensor, torch.Tensor] | None = None,
                  all_reduce: LLGroup | None = None) -> None:
    # a: [T or S, K] rows, w: [E, N or 2N, K] -> c: [S, N]; combine = (out [T, N], sync): also out = c summed per token
    # norm = (residual, norm weight, eps, h, residual_out), with combine: also the next layer's input norm
    mode, expert_ids = routing.mode, routing.ids
    sorted_ids, num_post_pad = (routing.sorted_ids, routing.num_post_pad) if mode == SORTED.value else \
        (expert_ids, expert_ids)                                              # not read
    num_blocks = expert_ids.numel()
    if mode == EXPERT_SCAN.value:                                             # the sorted layout's static bound
        s = c.shape[0]
        num_blocks = triton.cdiv(s + min(w.shape[0] + 1, s) * (cfg["BLOCK_SIZE_M"] - 1), cfg["BLOCK_SIZE_M"])
    fp8 = w_scale is not None
    a_scale = a
    if fp8 and not fuse_quant:
        a, a_scale = _quant_act(a, block_shape[1])                           # [rows, K] e4m3, [rows, G]
        assert a_scale.stride(1) == 1, "activation scales need a contiguous last dim"
    n_out, k = c.shape[1], a.shape[1]
    tile_n = cfg["BLOCK_SIZE_N"] // 2 if gated else cfg["BLOCK_SIZE_N"]
    even_n = n_out % tile_n == 0                                              # (the up rows' tiles too: N + n)
    grid = (num_blocks * triton.cdiv(n_out, tile_n),)
    bs = w_scale if fp8 else w
    out, sync = combine or (c, sorted_ids)
    if combine:
        assert sync.dtype == torch.int32 and sync.numel() >= triton.cdiv(n_out, tile_n), \
            f"sync must be int32 [>= {triton.cdiv(n_out, tile_n)}]"
    res, nw, eps, nh, nro = norm or (out, out, 0.0, out, out)
    # with all_reduce (and norm): the combined rows are summed over the ranks before the norm
    ar_ptrs, ar_epochs, ar_rank, ar_half = all_reduce.launch_args() if all_reduce else (sync, sync, 0, 0)
    if norm:
        assert combine and sync.numel() > triton.cdiv(n_out, tile_n), "the norm needs the combine and one more count"
        assert nh.stride(0) == nro.stride(0) == out.stride(0), "h and residual_out rows must be strided as out's"
    _fused_moe_kernel[grid](
        a, a_scale, w, bs, c, weights if weights is not None else c, sorted_ids, expert_ids, num_post_pad, out, sync,
        n_out, k, c.shape[0], num_blocks * cfg["BLOCK_SIZE_M"], w.shape[0], a.stride(0), w.stride(0), w.stride(1),
        c.stride(0), a_scale.stride(0), bs.stride(0), bs.stride(1), out.stride(0), res, nw, nh, nro, float(eps),
        res.stride(0), ar_ptrs, ar_epochs, ar_rank, ar_half, A_DIV=a_div, GATED=gated, MUL_WEIGHT=weights is not None, FP8=fp8,
        QUANT_A=fp8 and fuse_quant,
        INTERPRET=not a.is_cuda, ROUND_BF16=not a.is_cuda and c.dtype == torch.bfloat16,
        DOT_PREC=dot_precision(a.dtype), COMBINE=combine is not None, ROUTING=mode,
        BLOCK_S=triton.next_power_of_2(c.shape[0]) if mode == EXPERT_SCAN.value else 16,
        BLOCK_E=triton.next_power_of_2(w.shape[0] + 2) if mode == EXPERT_SCAN.value else 16,
        TOP_K=c.shape[0] // out.shape[0], BLOCK_T=8,
        GROUP_N=block_shape[0], GROUP_K=block_shape[1], TILE_N=tile_n,
        BLOCK_SIZE_M=cfg["BLOCK_SIZE_M"], BLOCK_SIZE_K=cfg["BLOCK_SIZE_K"], GROUP_SIZE_M=cfg["GROUP_SIZE_M"],
        NORM_OUT=norm is not None, BLOCK_D=triton.next_power_of_2(n_out) if norm else 16, **pdl_meta(a.device),
        AR_WORLD=all_reduce.world if all_reduce else 1,
        SCALAR_BS=fp8 and block_shape[0] % tile_n == 0 and even_n, EVEN_K=k % cfg["BLOCK_SIZE_K"] == 0, EVEN_N=even_n,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


# One token: its k slots name distinct experts (moe_topk / moe_route pick each routed expert at most once while the
# kept groups hold >= top_k experts, as in every DeepSeek config; the shared slots are E .. E + n_shared - 1), so the
# sort would group nothing. Each slot is its own row block instead (`_fused_moe_kernel`'s SLOT_BLOCKS: slot b and
# BLOCK_SIZE_M - 1 padding rows, expert ids[b]), with no align launch.
# NOTE: nothing relies on the ids being distinct: a repeated id is one more block reading that expert's weights
# into its own row, and every id -1 (several under EP) is a block of zero rows, as in the sorted layout.
def _slot_blocks(topk_ids: torch.Tensor) -> Routing:
    return Routing(SLOT_BLOCKS.value, topk_ids.reshape(-1).contiguous())       # ids: [S]


def _check_inputs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None,
                  block_shape: tuple[int, int]) -> bool:
    assert x.dim() == 2 and x.stride(1) == 1, f"x must be [T, K] with contiguous rows, got {tuple(x.shape)}"
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), f"x must be bf16/fp16/fp32, got {x.dtype}"
    e, two_i, k = w13.shape
    assert k == x.shape[1] and two_i % 2 == 0, f"w13 must be [E, 2I, {x.shape[1]}], got {tuple(w13.shape)}"
    assert w2.shape == (e, k, two_i // 2), f"w2 must be {(e, k, two_i // 2)}, got {tuple(w2.shape)}"
    assert w13.is_contiguous() and w2.is_contiguous(), "w13 and w2 must be contiguous"
    assert topk_ids.dim() == 2 and topk_ids.shape[0] == x.shape[0] and not topk_ids.is_floating_point(), \
        f"topk_ids must be [{x.shape[0]}, k] int, got {tuple(topk_ids.shape)} {topk_ids.dtype}"
    assert topk_weights.shape == topk_ids.shape, f"topk_weights {tuple(topk_weights.shape)} != topk_ids shape"
    fp8 = w13.dtype == FP8_DTYPE
    if not fp8:
        assert w13.dtype == w2.dtype == x.dtype, f"weights {w13.dtype}/{w2.dtype} must match x {x.dtype} (or be fp8)"
        assert w13_scale is None and w2_scale is None, "scales given for non-fp8 weights"
        return False
    bn, bk = block_shape
    i = two_i // 2
    assert w2.dtype == FP8_DTYPE, f"w2 must be float8_e4m3fn like w13, got {w2.dtype}"
    assert w13_scale is not None and w2_scale is not None, "fp8 weights need w13_scale and w2_scale"
    assert w13_scale.shape == (e, triton.cdiv(two_i, bn), triton.cdiv(k, bk)) and w13_scale.dtype == torch.float32, \
        f"w13_scale must be float32 {(e, triton.cdiv(two_i, bn), triton.cdiv(k, bk))}, got {tuple(w13_scale.shape)}"
    assert w2_scale.shape == (e, triton.cdiv(k, bn), triton.cdiv(i, bk)) and w2_scale.dtype == torch.float32, \
        f"w2_scale must be float32 {(e, triton.cdiv(k, bn), triton.cdiv(i, bk))}, got {tuple(w2_scale.shape)}"
    assert w13_scale.stride(2) == 1 and w2_scale.stride(2) == 1, "scale tensors need a contiguous last dim"
    return True


# keys a config's optional "down" entry may set for the second GEMM (w2); BLOCK_SIZE_M and GROUP_SIZE_M stay
# shared, as both GEMMs walk the same row blocks
DOWN_KEYS = frozenset({"BLOCK_SIZE_N", "BLOCK_SIZE_K", "num_warps", "num_stages"})


def split_config(config: dict) -> tuple[dict, dict]:
    """(first GEMM's config, second GEMM's): the second is the first with its "down" entry's keys replaced."""
    cfg = dict(config)
    down = cfg.pop("down", None) or {}
    if not set(down) <= DOWN_KEYS:
        raise ValueError(f"fused_moe config: 'down' may set only {sorted(DOWN_KEYS)}, got {sorted(down)}")
    return cfg, {**cfg, **down}


def _check_config(cfg: dict, fp8: bool, fuse_quant: bool, block_k: int) -> None:
    bm, bn, bk = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"], cfg["BLOCK_SIZE_K"]
    assert bm >= 16 and bn >= 32 and bk >= 16, f"tiles must be BM>=16, BN>=32, BK>=16, got {cfg}"
    if fp8:
        assert block_k % bk == 0, f"fp8 needs BLOCK_SIZE_K dividing the scale block {block_k}, got {bk}"
        assert not fuse_quant or bk == block_k, f"fused activation quant needs BLOCK_SIZE_K == {block_k}, got {bk}"


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              block_shape: tuple[int, int] = (128, 128), config: dict | None = None,
              num_routed_experts: int | None = None, out: torch.Tensor | None = None,
              sync: torch.Tensor | None = None) -> torch.Tensor:
    """Routed experts: out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]).

    Args:
        x: [T, K] bf16/fp16/fp32. w13: [E, 2I, K], w2: [E, K, I], both x.dtype or both float8_e4m3fn with
            w13_scale [E, ceil(2I/bn), ceil(K/bk)] and w2_scale [E, ceil(K/bn), ceil(I/bk)] (`weight_scale_inv`).
        topk_weights / topk_ids: [T, k] from `moe_topk`; ids in [0, E), or -1 for an expert this rank does not
            hold (expert parallelism): such a slot adds nothing to out.
        config: tile config (see `get_moe_config`; optional key FUSE_QUANT: quantise fp8 activations in the GEMM,
            default off; optional key "down": a dict of DOWN_KEYS that the second GEMM takes instead).
        num_routed_experts: the E the tuned tables are keyed by (default: all E stacked experts). A model that
            stacks its shared experts after its routed ones passes its routed count (see `get_moe_config`).
        sync: int32 zeros [>= ceil(K / 32)], owned by the caller and left zero (one launch at a time per buffer).
            With it, up to COMBINE_MAX_TOKENS tokens, the second GEMM also sums each token's k rows (the last
            program of each output tile); otherwise one more launch does (`sum_dim1` or torch.sum: SUM_DIM1_MAX_TOKENS).
    One token runs no sort: each of its k slots is a row block of its own (`_slot_blocks`), any ids. Few slots over
    few bf16 experts run none either: each GEMM program works out its block of the sorted layout (EXPERT_SCAN).
    Returns:
        out [T, K] in x.dtype. No host sync: capturable in a CUDA graph for a fixed T.
    """
    return _fused_moe(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block_shape, config,
                      num_routed_experts, out, sync, None)


def fused_moe_norm(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, *,
                   sync: torch.Tensor, w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                   block_shape: tuple[int, int] = (128, 128), config: dict | None = None,
                   num_routed_experts: int | None = None, all_reduce: LLGroup | None = None,
                   h: torch.Tensor | None = None, h_ready: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`fused_moe` followed by the next layer's input norm, in the same two launches (up to COMBINE_MAX_TOKENS
    tokens, where the second GEMM combines): returns (rmsnorm(out + residual), out + residual), new tensors in
    x.dtype; `residual` [T, K] (rows contiguous) is not modified. The last output tile to be combined norms the
    whole rows: `sync` needs one more entry than fused_moe's (int32 zeros [>= ceil(K / 32) + 1]).

    `all_reduce` (tensor parallelism: out is this rank's share): out is first summed over the ranks, in that same
    last program, by the push all-reduce's protocol and bits (`peer_all_reduce_ll`): the result of
    `peer_all_reduce_ll(fused_moe(...), residual, norm_weight, eps)` in two launches instead of three. Every rank
    must make the same call.

    `h` [k, I] in x.dtype with its last `h_ready` rows already silu(gate) * up of their slots (the shared experts,
    computed in the router's launch: `moe_route_norm(shared=...)`): the first GEMM runs the other slots only, into
    h's first rows, and the second reads them all."""
    t = x.shape[0]
    assert t <= COMBINE_MAX_TOKENS, f"fused_moe_norm takes at most {COMBINE_MAX_TOKENS} tokens, got {t}"
    check_norm_operands(x, norm_weight, residual)
    if all_reduce is not None:
        assert all_reduce.ll.fits(x), f"x {tuple(x.shape)} exceeds the push buffers ({LL_ROWS} rows of {LL_DMAX})"
    normed, res_out = torch.empty_like(x), torch.empty_like(x)
    _fused_moe(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block_shape, config, num_routed_experts,
               None, sync, (residual, norm_weight, eps, normed, res_out), all_reduce, h, h_ready)
    return normed, res_out


def _fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
               topk_ids: torch.Tensor, w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None,
               block_shape: tuple[int, int], config: dict | None, num_routed_experts: int | None,
               out: torch.Tensor | None, sync: torch.Tensor | None, norm: tuple | None,
               all_reduce: LLGroup | None = None, h: torch.Tensor | None = None, h_ready: int = 0) -> torch.Tensor:
    fp8 = _check_inputs(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block_shape)
    t, k = x.shape
    e, i, top_k = w13.shape[0], w13.shape[1] // 2, topk_ids.shape[1]
    out = torch.empty_like(x) if out is None else out
    assert out.shape == x.shape and out.dtype == x.dtype, f"out must be {tuple(x.shape)} {x.dtype}"
    if t == 0:
        return out
    if config is None:
        config = get_moe_config(num_routed_experts or e, i, table_dtype(w13.dtype, x.dtype), t)
    cfg, cfg2 = split_config(config)
    # NOTE: quantising the activations inside the GEMM (FUSE_QUANT) was the default up to 128 tokens; every tuned
    # table (H100, H200) picked the separate pass at every size, and on an H200 the fused one took 3-4x as long at
    # V3's shape, 1-64 tokens (benchmarks/results/moe-prefill-h200.md): a config without the key now runs separate
    fuse_quant = bool(cfg.pop("FUSE_QUANT", False))
    cfg2.pop("FUSE_QUANT", None)
    _check_config(cfg, fp8, fuse_quant, block_shape[1])
    _check_config(cfg2, fp8, fuse_quant, block_shape[1])
    routing = _route(topk_ids, cfg["BLOCK_SIZE_M"], e, fp8)
    if h is None:
        assert h_ready == 0, "h_ready needs h"
        h = torch.empty(t * top_k, i, dtype=x.dtype, device=x.device)         # h: [S, I] = silu(gate) * up
    else:
        assert t == 1 and 0 <= h_ready <= top_k and h.shape == (top_k, i) and h.dtype == x.dtype \
            and h.is_contiguous(), f"h must be [{top_k}, {i}] {x.dtype} for one token, got {tuple(h.shape)} {h.dtype}"
    if h_ready < top_k:            # (one token: the slots' row blocks are its first top_k - h_ready ids)
        first = routing if h_ready == 0 else _slot_blocks(topk_ids[:, :top_k - h_ready])
        _grouped_gemm(x, w13, w13_scale, h[:t * top_k - h_ready], first, None, cfg, fuse_quant, block_shape, top_k,
                      True)
    y = torch.empty(t * top_k, k, dtype=x.dtype, device=x.device)             # y: [S, K], weighted
    combine = (out, sync) if sync is not None and t <= COMBINE_MAX_TOKENS else None
    assert all_reduce is None or (combine and norm), "the all-reduce runs in the norm's program"
    _grouped_gemm(h, w2, w2_scale, y, routing, topk_weights.reshape(-1).contiguous(), cfg2, fuse_quant,
                  block_shape, 1, False, combine, norm, all_reduce)
    if combine:
        return out
    y = y.view(t, top_k, k)                                                   # [T, k, K] -> [T, K]
    if t >= SUM_ROWS_MIN_TOKENS:
        return sum_dim1(y, out=out, rows=True)
    if t <= (SUM_DIM1_MAX_TOKENS if k <= SUM_DIM1_NARROW_HIDDEN else SUM_DIM1_MAX_TOKENS_WIDE):
        return sum_dim1(y, out=out)
    return torch.sum(y, dim=1, out=out)


# ------------------------------------------------------------------------------------------- reference
def _expert_linear(a: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None,
                   block_shape: tuple[int, int]) -> torch.Tensor:
    # a: [n, K_in] @ w: [N, K_in]^T -> [n, N] fp32; fp8: quantise a per token-group, dequantise w per block
    if scale is None:
        return a.float() @ w.float().t()
    a_q, a_s = quant.per_token_group_quant_fp8_ref(a, block_shape[1])
    a_deq = a_q.float() * a_s.repeat_interleave(block_shape[1], dim=1)[:, :a.shape[1]]
    return a_deq @ quant.block_dequant_ref(w, scale, block_shape, torch.float32).t()


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, *, w13_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None, block_shape: tuple[int, int] = (128, 128),
                  num_routed_experts: int | None = None, sync: torch.Tensor | None = None) -> torch.Tensor:
    """The spec of `fused_moe`: per expert in fp32, with the kernel's roundings (fp8 activation quantisation,
    h = silu(gate) * up stored in x.dtype). Returns [T, K] in x.dtype; ids -1 add nothing. `num_routed_experts` is the launcher's
    tile-table key and `sync` its workspace; the reference takes them for a common signature only."""
    i = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in topk_ids.unique().tolist():
        if e < 0:                                  # an expert another rank holds: contributes nothing
            continue
        tok, j = (topk_ids == e).nonzero(as_tuple=True)
        gate_up = _expert_linear(x[tok], w13[e], None if w13_scale is None else w13_scale[e], block_shape)
        h = (F.silu(gate_up[:, :i]) * gate_up[:, i:]).to(x.dtype)              # h: [n, I]
        y = _expert_linear(h, w2[e], None if w2_scale is None else w2_scale[e], block_shape)
        out.index_add_(0, tok, y * topk_weights[tok, j, None].float())
    return out.to(x.dtype)


def fused_moe_norm_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec of `fused_moe_norm`: `fused_moe_ref`, then the fused add + norm's reference (`h` / `h_ready` are
    the kernel's: the reference computes every slot)."""
    kw.pop("h", None)
    kw.pop("h_ready", None)
    return fused_add_rmsnorm_ref(fused_moe_ref(x, w13, w2, topk_weights, topk_ids, **kw), residual, norm_weight, eps)


# --------------------------------------------------------------------------------------------- configs
# Key of a tuned table: (E routed experts, N = moe_intermediate_size per TP rank, dtype, GPU name). DeepSeek's
# shared experts run in the same call as n_shared extra expert slots (`layers/moe.py`, every token routed to
# them with weight 1): the model passes E = its routed count, so V3 (257 stacked experts) reads the E=256 table
# that `tune fused-moe` (n_routed_experts of the config.json) and `bench kernels` (routed experts only) use.
# NOTE: the tables were timed without the shared slots; with them a decode step also streams n_shared more
# experts' weights and gives each of those T rows. The entry is still chosen by the token count M.
@functools.lru_cache(maxsize=1)
def gpu_name() -> str:
    """This process's GPU as the table files name it (`torch.cuda.get_device_name()`, spaces as `_`)."""
    return torch.cuda.get_device_name().replace(" ", "_") if torch.cuda.is_available() else "cpu"


def table_dtype(weight_dtype: torch.dtype, act_dtype: torch.dtype) -> str:
    """The dtype part of a table's name: fp8_w8a8 for block-FP8 weights, else the activations' dtype."""
    if weight_dtype == FP8_DTYPE:
        return "fp8_w8a8"
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[act_dtype]


def config_file_name(E: int, N: int, dtype: str | None, device_name: str | None = None) -> str:
    dtype = dtype or "bf16"
    name = device_name or gpu_name()
    return f"E={E},N={N},device_name={name},dtype={dtype},block_shape=[128, 128].json"


@functools.lru_cache(maxsize=64)
def _load_configs(path: Path) -> dict[int, dict] | None:
    if not path.is_file():
        return None
    return {int(m): cfg for m, cfg in json.loads(path.read_text()).items()}


@functools.lru_cache(maxsize=64)
def _warn_untuned(name: str) -> None:
    # once per shape and process
    logger.warning("fused_moe: no tuned table %s in %s; running untuned default tiles (tune with `mlaserve tune "
                   "fused-moe`)", name, CONFIG_DIR)


def default_moe_config(M: int, dtype: str | None) -> dict:
    """Untuned tiles by token count: small M is weight-bandwidth bound (thin rows), large M compute bound."""
    bk = 128 if dtype == "fp8_w8a8" else 64
    if M <= 64:       # narrow N tiles: enough programs to keep every SM streaming weights
        return dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4, num_stages=4)
    if M <= 512:
        return dict(BLOCK_SIZE_M=32, BLOCK_SIZE_N=128, BLOCK_SIZE_K=bk, GROUP_SIZE_M=8, num_warps=4, num_stages=3)
    return dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, BLOCK_SIZE_K=bk, GROUP_SIZE_M=16, num_warps=4, num_stages=3)


def interpreter_moe_config(M: int) -> dict:
    """Tiles for the Triton interpreter (no GPU: CPU tests and debugging). It runs the programs one after another at
    a cost per program, not per value: output tiles as wide as the shrunk models' (256 columns) and deep K steps.
    The kernel tests pin their own tiles, the GPU's among them."""
    return dict(BLOCK_SIZE_M=16 if M <= 64 else 64, BLOCK_SIZE_N=256, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4,
                num_stages=1)


def get_moe_config(E: int, N: int, dtype: str | None, M: int, device_name: str | None = None) -> dict:
    """Tile config for `fused_moe` with T = M tokens, E routed experts and intermediate size N (per TP rank).

    Read from CONFIG_DIR/`config_file_name(...)` (JSON {"M": config}, nearest M key wins), else
    `default_moe_config` and one WARNING per shape; without a GPU `interpreter_moe_config`. Keys: BLOCK_SIZE_M/N/K,
    GROUP_SIZE_M, num_warps, num_stages; BLOCK_SIZE_N is the output tile width of both GEMMs (gate_up: half gate,
    half up columns), unless an optional "down" entry gives the second GEMM its own BLOCK_SIZE_N / BLOCK_SIZE_K /
    num_warps / num_stages.
    `device_name` defaults to this process's GPU (`gpu_name()`).
    """
    gpu = device_name or gpu_name()
    if gpu == "cpu":
        return interpreter_moe_config(M)
    name = config_file_name(E, N, dtype, gpu)
    table = _load_configs(CONFIG_DIR / name)
    if not table:
        _warn_untuned(name)
        return default_moe_config(M, dtype)
    return dict(table[min(table, key=lambda m: (abs(m - M), m))])
