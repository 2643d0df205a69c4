"""L2 prefetch of weights a decode step reads soon, issued by programs of a kernel that leaves HBM idle (Hopper).

At small batches a layer's attention (W_UK, MLA decode and its reduce, W_UV) takes ~20 us and reads a few MB, while
the weights right after it (o_proj, the shared experts: ~40 MB in V2-Lite) wait for it to end. A job of extra
programs in the W_UK launch issues `cp.async.bulk.prefetch.L2.global` over those weights: a hint, no data reaches
the SM and nothing waits on it, so the programs exit at once and the later kernels find the weights in L2.

Each program prefetches one row of a plan's table: (address, bytes) of at most LANES x CHUNK bytes, one
CHUNK-byte prefetch a thread. `MLASERVE_L2_PREFETCH_MB` is the budget per layer (0: off; default DEFAULT_MB),
`MLASERVE_L2_PREFETCH_MAX_TOKENS` the largest decode batch that prefetches (larger batches read enough KV to evict it).
Off on the CPU (the interpreter has no inline PTX) and below compute capability 9.0.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mlaserve.kernels.pdl import active

LANES = 128                # threads of a 4-warp program: one prefetch each
CHUNK = 4096               # bytes per prefetch instruction
ALIGN = 16                 # the bulk prefetch's address and size granularity
DEFAULT_MB = 32            # of the H100 / H200's 50 MB L2
DEFAULT_MAX_TOKENS = 16
_LANES, _CHUNK = tl.constexpr(LANES), tl.constexpr(CHUNK)      # the same, seen from the kernels


class L2Prefetch(NamedTuple):
    table: torch.Tensor                  # [P, 2] int64: (address, bytes) of program p
    keep: tuple[torch.Tensor, ...]       # the regions: referenced so their memory outlives the table
    max_tokens: int                      # decode batches of more tokens do not prefetch

    @property
    def programs(self) -> int:
        return self.table.shape[0]

    def bytes(self) -> int:
        return int(self.table[:, 1].sum())


def budget_bytes() -> int:
    return int(float(os.environ.get("MLASERVE_L2_PREFETCH_MB", DEFAULT_MB)) * 2**20)


def plan_rows(spans: Sequence[tuple[int, int]], budget: int, per_program: int = LANES * CHUNK
              ) -> list[tuple[int, int]]:
    """(address, bytes) spans in the order they are used -> one (address, bytes) row per program: each span cut to
    ALIGN-aligned whole units, taken until `budget` bytes, in pieces of at most `per_program` bytes."""
    rows, left = [], budget
    for addr, nbytes in spans:
        start = -(-addr // ALIGN) * ALIGN
        n = min((addr + nbytes - start) // ALIGN * ALIGN, left // ALIGN * ALIGN)
        for off in range(0, max(n, 0), per_program):
            rows.append((start + off, min(per_program, n - off)))
        left -= max(n, 0)
        if left < ALIGN:
            break
    return rows


def plan(regions: Sequence[torch.Tensor], max_tokens: int | None = None) -> L2Prefetch | None:
    """The prefetch of `regions` (contiguous tensors on one CUDA device, in the order the step reads them) within
    the budget; None where prefetching is off (CPU, before Hopper, budget 0) or nothing is left to prefetch."""
    regions = [r for r in regions if r is not None and r.numel()]
    budget = budget_bytes()
    if not regions or budget <= 0 or not active(regions[0].device):
        return None
    assert all(r.is_contiguous() and r.device == regions[0].device for r in regions), \
        "prefetch regions must be contiguous tensors on one device"
    rows = plan_rows([(r.data_ptr(), r.numel() * r.element_size()) for r in regions], budget)
    if not rows:
        return None
    if max_tokens is None:
        max_tokens = int(os.environ.get("MLASERVE_L2_PREFETCH_MAX_TOKENS", DEFAULT_MAX_TOKENS))
    table = torch.tensor(rows, dtype=torch.int64, device=regions[0].device)
    return L2Prefetch(table, tuple(regions), max_tokens)


def for_tokens(prefetch: L2Prefetch | None, num_tokens: int) -> L2Prefetch | None:
    """The plan a launch of `num_tokens` tokens runs (None above its max_tokens)."""
    return prefetch if prefetch is not None and num_tokens <= prefetch.max_tokens else None


@triton.jit
def l2_prefetch_program(p, Table):
    """Program p of a prefetch job: its table row's bytes, CHUNK at a time, one prefetch per lane (lanes past the
    row's end repeat its first 16 bytes: a prefetch is a hint, a repeated one costs nothing)."""
    base = tl.load(Table + 2 * p)
    nbytes = tl.load(Table + 2 * p + 1)
    off = tl.arange(0, _LANES).to(tl.int64) * _CHUNK
    size = tl.minimum(nbytes - off, _CHUNK)
    ok = size > 0
    addr = tl.where(ok, base + off, base)
    size = tl.where(ok, size, 16).to(tl.int32)
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                              [addr, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _l2_prefetch_kernel(Table):
    l2_prefetch_program(tl.program_id(0), Table)


def l2_prefetch(prefetch: L2Prefetch) -> None:
    """The prefetch job as a launch of its own (benchmarks and tests; the decode step runs it inside W_UK's)."""
    _l2_prefetch_kernel[(prefetch.programs,)](prefetch.table, num_warps=LANES // 32)
