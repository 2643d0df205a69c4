"""One-shot all-reduce over peer buffers, optionally fused with the residual add and RMSNorm that follow it.

Every rank of a group maps every other rank's staging buffer and signal pad (CUDA IPC between GPUs of one
host; shared memory between CPU processes, where the kernel runs under the Triton interpreter). One launch
per rank, one program per token row:

    1. copy its row of x into its own staging buffer (half `epoch & 1` of it),
    2. raise flag [rank, row] = epoch on every rank's signal pad (release, system scope),
    3. wait until every rank's flag [p, row] on its own pad has reached epoch (acquire),
    4. read the row from every rank's buffer, sum in fp32 in rank order (every rank gets the same bits),
    5. write the sum (in place over x), or with a residual: residual += sum, out = rmsnorm(residual).

`epoch` is a per-row counter kept on the device and advanced by the program itself, so a CUDA graph replays
the launch as it is. All ranks issue the same sequence of launches with the same row counts (SPMD), so their
counters agree. Two staging halves make reuse safe: a rank writes a half again two epochs later, by which time
it has seen every peer's flag for the epoch in between, and a peer raises that flag only in a launch that
starts after its read of the half has finished. Flags only grow (compared with wrap-around arithmetic), so a
fast peer's next flag cannot be mistaken for a missing one.

Shapes: `T` rows (<= max_rows), `D` hidden size; each half of a staging buffer holds T x D elements.

The push variant (`peer_all_reduce_ll`, NCCL's "LL" idea: each 8-byte store carries 4 bytes of data and a 4-byte
flag, so data and flag arrive together): one program per row converts its row to fp32 and writes it, each value
packed with the epoch, straight into every peer's receive slot [source rank, row]; each rank then polls its own
slots (local memory) until every word of every peer carries this epoch, and sums in rank order, its own row from
x. No staging copy, no fence, no remote read: one NVLink write latency instead of a flag round trip and a read.
Each value travels as 8 bytes (4x bf16's), so it is for a few rows. Receive slots are fixed per (source, row)
(`LL_DMAX` values), in two halves by epoch parity as above, with their own epoch counters.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mlaserve.kernels.kv_store import num_warps_for
from mlaserve.kernels.norm import check_norm_operands, fused_add_rmsnorm_ref


@triton.jit
def _start_row(x_ptr, epoch_ptr, D, stride_x, BLOCK: tl.constexpr):
    """This program's row, its epoch (advanced and stored), its lanes and its values of x."""
    row = tl.program_id(0)
    e = tl.load(epoch_ptr + row) + 1
    tl.store(epoch_ptr + row, e)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=mask, other=0.0)
    return row, e, offs, mask, x


@triton.jit
def _finish_row(acc, like, row, offs, mask, res_ptr, w_ptr, out_ptr, D, eps, stride_res, stride_out,
                NORM: tl.constexpr):
    """The row's fp32 sum `acc` rounded to the dtype of `like` (x), stored: alone, or with NORM residual += sum
    (in place) and out = rmsnorm(residual) * w."""
    y = acc.to(like.dtype)                               # what the all-reduce alone returns
    if NORM:
        r = tl.load(res_ptr + row.to(tl.int64) * stride_res + offs, mask=mask, other=0.0).to(tl.float32)
        y = (y.to(tl.float32) + r).to(like.dtype)        # residual_out, rounded to x.dtype
        tl.store(res_ptr + row.to(tl.int64) * stride_res + offs, y, mask=mask)
        y32 = y.to(tl.float32)
        var = tl.sum(y32 * y32, axis=0) / D
        n = (y32 * tl.math.rsqrt(var + eps)).to(like.dtype).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = (w * n).to(like.dtype)
    tl.store(out_ptr + row.to(tl.int64) * stride_out + offs, y, mask=mask)


@triton.jit
def _peer_all_reduce_kernel(x_ptr, res_ptr, w_ptr, out_ptr, buf_ptrs, sig_ptrs, epoch_ptr, rank, D, half, eps,
                            stride_x, stride_res, stride_out,
                            WORLD: tl.constexpr, MAX_ROWS: tl.constexpr, BLOCK: tl.constexpr,
                            NORM: tl.constexpr):
    row, e, offs, mask, x = _start_row(x_ptr, epoch_ptr, D, stride_x, BLOCK)
    slot = (e & 1).to(tl.int64) * half + row.to(tl.int64) * D
    mine = tl.load(buf_ptrs + rank).to(tl.pointer_type(x.dtype))
    tl.store(mine + slot + offs, x, mask=mask)
    tl.debug_barrier()                                   # every thread's store before the flag
    for p in tl.static_range(WORLD):
        pad = tl.load(sig_ptrs + p).to(tl.pointer_type(tl.int32))
        tl.atomic_xchg(pad + rank * MAX_ROWS + row, e, sem="release", scope="sys")
    own = tl.load(sig_ptrs + rank).to(tl.pointer_type(tl.int32))
    for p in tl.static_range(WORLD):
        seen = tl.atomic_add(own + p * MAX_ROWS + row, 0, sem="acquire", scope="sys")
        while seen - e < 0:                              # wrap-around safe "seen < e"
            seen = tl.atomic_add(own + p * MAX_ROWS + row, 0, sem="acquire", scope="sys")
    tl.debug_barrier()
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for p in tl.static_range(WORLD):                     # rank order: the same sum on every rank
        src = tl.load(buf_ptrs + p).to(tl.pointer_type(x.dtype))
        acc += tl.load(src + slot + offs, mask=mask, other=0.0, cache_modifier=".cv").to(tl.float32)
    _finish_row(acc, x, row, offs, mask, res_ptr, w_ptr, out_ptr, D, eps, stride_res, stride_out, NORM)


@triton.jit
def _peer_all_reduce_ll_kernel(x_ptr, res_ptr, w_ptr, out_ptr, ll_ptrs, epoch_ptr, rank, D, half, eps,
                               stride_x, stride_res, stride_out,
                               WORLD: tl.constexpr, ROWS: tl.constexpr, DMAX: tl.constexpr, BLOCK: tl.constexpr,
                               NORM: tl.constexpr):
    row, e, offs, mask, x = _start_row(x_ptr, epoch_ptr, D, stride_x, BLOCK)
    xf = x.to(tl.float32)
    packed = (e.to(tl.int64) << 32) | (xf.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF)
    parity = (e & 1).to(tl.int64) * half
    mine = parity + (rank * ROWS + row).to(tl.int64) * DMAX              # my slot on every peer
    for p in tl.static_range(WORLD):
        if p != rank:
            dst = tl.load(ll_ptrs + p).to(tl.pointer_type(tl.int64))
            tl.store(dst + mine + offs, packed, mask=mask)
    own = tl.load(ll_ptrs + rank).to(tl.pointer_type(tl.int64))
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for p in tl.static_range(WORLD):                     # rank order: the same sum on every rank
        if p == rank:
            acc += xf
        else:
            src = own + parity + (p * ROWS + row).to(tl.int64) * DMAX
            # poll until every word carries epoch e; the loop carries a scalar only (Triton 3.6's layout pass
            # fails on a tensor carried through it), then read the words once more: they stay until epoch e + 2
            late = 1
            while late > 0:
                v = tl.load(src + offs, mask=mask, other=0, volatile=True)
                late = tl.max(tl.where(mask, (v >> 32).to(tl.int32) != e, 0).to(tl.int32), axis=0)
            v = tl.load(src + offs, mask=mask, other=0, volatile=True)
            acc += (v & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
    _finish_row(acc, x, row, offs, mask, res_ptr, w_ptr, out_ptr, D, eps, stride_res, stride_out, NORM)


LL_ROWS = 16            # rows of one push call (receive slots per source rank)
LL_DMAX = 8192          # values of one row's slot: DeepSeek's hidden sizes (2048, 5120, 7168) fit


class LLPointers(NamedTuple):
    """The push variant's receive buffers: every rank's address (in this process) and this rank's epochs [LL_ROWS]."""

    ll_ptrs: torch.Tensor
    epochs: torch.Tensor

    @staticmethod
    def fits(x: torch.Tensor) -> bool:
        t, d = x.shape
        return 0 < t <= LL_ROWS and d <= LL_DMAX


def ll_buffer_bytes(world: int) -> int:
    """Bytes of one rank's receive buffer: two halves of [world sources, LL_ROWS rows, LL_DMAX] int64 words."""
    return 2 * world * LL_ROWS * LL_DMAX * 8


class PeerPointers:
    """Device tensors a rank passes to the kernel: the int64 addresses (in this process) of every rank's staging
    buffer and signal pad, this rank's epoch counters, and the sizes they were allocated for."""

    def __init__(self, rank: int, world: int, buf_ptrs: torch.Tensor, sig_ptrs: torch.Tensor,
                 epochs: torch.Tensor, max_rows: int, half_bytes: int):
        assert buf_ptrs.shape == (world,) and sig_ptrs.shape == (world,), "one buffer and one pad per rank"
        assert buf_ptrs.dtype == sig_ptrs.dtype == torch.int64 and epochs.dtype == torch.int32
        assert epochs.shape == (max_rows,), f"epochs must be [{max_rows}], got {tuple(epochs.shape)}"
        self.rank, self.world, self.max_rows, self.half_bytes = rank, world, max_rows, half_bytes
        self.buf_ptrs, self.sig_ptrs, self.epochs = buf_ptrs, sig_ptrs, epochs

    def fits(self, x: torch.Tensor) -> bool:
        """Whether [T, D] x fits one half of the staging buffers and the flag rows."""
        t, d = x.shape
        return 0 < t <= self.max_rows and t * d * x.element_size() <= self.half_bytes


def buffer_bytes(half_bytes: int) -> int:
    """Bytes of one rank's staging buffer: two halves."""
    return 2 * half_bytes


def sig_pad_ints(world: int, max_rows: int) -> int:
    """int32 flags in one rank's signal pad: one per (source rank, row)."""
    return world * max_rows


def peer_all_reduce(x: torch.Tensor, peers: PeerPointers, residual: torch.Tensor | None = None,
                    weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """Sum of x [T, D] over the ranks (every rank calls it with the same shape, in the same order).

    Without `residual`: the sum, written over x (returned). With `residual` and `weight`: residual += sum (in
    place) and returns rmsnorm(residual) * weight as a new tensor, x left as is.
    """
    assert peers.fits(x), f"x {tuple(x.shape)} {x.dtype} exceeds the peer buffers ({peers.max_rows} rows, " \
                          f"{peers.half_bytes} bytes)"
    norm, out = _operands(x, residual, weight)
    t, d = x.shape
    block = triton.next_power_of_2(d)
    half = peers.half_bytes // x.element_size()
    _peer_all_reduce_kernel[(t,)](
        x, residual if norm else x, weight if norm else x, out, peers.buf_ptrs, peers.sig_ptrs, peers.epochs,
        peers.rank, d, half, float(eps), x.stride(0), residual.stride(0) if norm else 0, out.stride(0),
        WORLD=peers.world, MAX_ROWS=peers.max_rows, BLOCK=block, NORM=norm, num_warps=num_warps_for(block))
    return out


def _operands(x: torch.Tensor, residual: torch.Tensor | None,
              weight: torch.Tensor | None) -> tuple[bool, torch.Tensor]:
    """Checks x [T, D] (and the norm's operands); returns (whether the norm runs, the output: x, or a new tensor)."""
    assert x.dim() == 2 and x.stride(1) == 1, f"x must be [T, D] with contiguous rows, got {tuple(x.shape)}"
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), f"x must be bf16/fp16/fp32, got {x.dtype}"
    if residual is None:
        return False, x
    assert weight is not None, "a residual needs the norm weight"
    check_norm_operands(x, weight, residual)
    return True, torch.empty_like(x)


def peer_all_reduce_ll(x: torch.Tensor, peers: PeerPointers, ll: LLPointers, residual: torch.Tensor | None = None,
                       weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """`peer_all_reduce` by the push variant (rows <= LL_ROWS, D <= LL_DMAX): the same results, bit for bit."""
    assert ll.fits(x), f"x {tuple(x.shape)} exceeds the push buffers ({LL_ROWS} rows of {LL_DMAX})"
    norm, out = _operands(x, residual, weight)
    t, d = x.shape
    block = triton.next_power_of_2(d)
    _peer_all_reduce_ll_kernel[(t,)](
        x, residual if norm else x, weight if norm else x, out, ll.ll_ptrs, ll.epochs, peers.rank, d,
        peers.world * LL_ROWS * LL_DMAX, float(eps), x.stride(0), residual.stride(0) if norm else 0, out.stride(0),
        WORLD=peers.world, ROWS=LL_ROWS, DMAX=LL_DMAX, BLOCK=block, NORM=norm, num_warps=num_warps_for(block))
    return out


def peer_all_reduce_ref(parts: list[torch.Tensor], residual: torch.Tensor | None = None,
                        weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor | tuple:
    """Reference: the ranks' parts summed in fp32 in rank order, rounded to their dtype; with `residual`, returns
    (rmsnorm(sum + residual) * weight, sum + residual) as new tensors."""
    total = parts[0].float()
    for p in parts[1:]:
        total = total + p.float()
    total = total.to(parts[0].dtype)
    if residual is None:
        return total
    return fused_add_rmsnorm_ref(total, residual, weight, eps)
