"""One-shot all-reduce over peer buffers, optionally fused with the residual add and RMSNorm that follow it.

Every rank of a group maps every other rank's staging buffer and signal pad (CUDA IPC between GPUs of one
host; shared memory between CPU processes, where the kernel runs under the Triton interpreter). One launch
per rank, one program per token row:

    1. copy its row of x into its own staging buffer (half `epoch & 1` of it),
    2. raise flag [rank, row] = epoch on every rank's signal pad (release, system scope),
    3. wait until every rank's flag [p, row] on its own pad has reached epoch (acquire),
    4. read the row from every rank's buffer, sum in fp32 in rank order (every rank gets the same bits),
    5. write the sum (in place over x), or with a residual: residual += sum, out = rmsnorm(residual).

Launched with programmatic dependent launch (`kernels/pdl.py`) like the decode path's other Triton kernels: every
program waits for the previous kernel before it reads anything, and releases the next one once its flags are in
(the next kernel's weight loads overlap the sum). Without it a tp decode step drained the GPU around each of its
2 x layers all-reduces (two H200s, V2-Lite tp 2: 2.26 ms a bs-1 graph replay of 2.01 ms of kernels).

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
(`LL_DMAX` values), in two halves by epoch parity as above, with their own epoch counters. A row may go out from
several programs, each pushing a chunk of its columns (one SM's stores cap a 57 KB row of V3's 7168 values: 9.4 us
on two H100s, against 4.6 us for V2-Lite's 2048). Without the norm each program then polls and sums its own
columns; with the norm each polls the whole row (local reads), computes the norm and stores its columns, writing
the new residual to a new tensor (the others still read the old one). The reuse argument above holds whatever the
chunking of consecutive calls: every program of a launch has seen a peer's words of the previous epoch, so that
peer's launch before it has ended.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mlaserve.kernels.kv_store import num_warps_for
from mlaserve.kernels.norm import check_norm_operands, fused_add_rmsnorm_ref
from mlaserve.kernels.pdl import pdl_enter, pdl_meta, pdl_release


@triton.jit
def advance_epoch(counters, first, STOP: tl.constexpr, STEP: tl.constexpr):
    """counters[first] + 1, stored over counters[first:STOP:STEP]: this program's epoch for its next call.

    NOTE: every thread loads the scalar, one thread stores it. Without the barrier between them a warp that loads
    after that store (warps leave the PDL wait at different times) takes epoch + 1: its lanes then write the other
    staging half and wait for a flag the peers raise only in the next call, while the program's other warps go on
    (its barriers then pair up wrongly). Found reading the PTX after V3's [64, 7168] calls (16 warps a program)
    stopped both ranks (benchmarks/results/tp-h200x2.md, seventh run); V2-Lite's 4 warps hit it rarely."""
    e = tl.load(counters + first) + 1
    tl.debug_barrier()
    for j in range(first, STOP, STEP):
        tl.store(counters + j, e)
    return e


@triton.jit
def _start_row(x_ptr, epoch_ptr, D, stride_x, BLOCK: tl.constexpr):
    """This program's row, its epoch (advanced and stored), its lanes and its values of x."""
    row = tl.program_id(0)
    e = advance_epoch(epoch_ptr + row, 0, 1, 1)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=mask, other=0.0)
    return row, e, offs, mask, x


@triton.jit
def _finish_row(acc, like, row, offs, mask, res_ptr, w_ptr, out_ptr, D, eps, stride_res, stride_out,
                NORM: tl.constexpr, pad_ptr=None, c=0, e=0, SPLIT: tl.constexpr = 1):
    """The row's fp32 sum `acc` rounded to the dtype of `like` (x), stored: alone, or with NORM residual += sum
    (in place) and out = rmsnorm(residual) * w. `offs` may be one of SPLIT programs' columns of the row (program c,
    epoch e): the sum of squares is then added up over them through pad_ptr (`_row_total`)."""
    y = acc.to(like.dtype)                               # what the all-reduce alone returns
    if NORM:
        r = tl.load(res_ptr + row.to(tl.int64) * stride_res + offs, mask=mask, other=0.0).to(tl.float32)
        y = (y.to(tl.float32) + r).to(like.dtype)        # residual_out, rounded to x.dtype
        tl.store(res_ptr + row.to(tl.int64) * stride_res + offs, y, mask=mask)
        y32 = y.to(tl.float32)
        if SPLIT > 1:
            var = _row_total(pad_ptr, row, c, e, tl.sum(y32 * y32, axis=0), SPLIT) / D
        else:
            var = tl.sum(y32 * y32, axis=0) / D
        n = (y32 * tl.math.rsqrt(var + eps)).to(like.dtype).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = (w * n).to(like.dtype)
    tl.store(out_ptr + row.to(tl.int64) * stride_out + offs, y, mask=mask)


@triton.jit
def _peer_all_reduce_kernel(x_ptr, res_ptr, w_ptr, out_ptr, buf_ptrs, sig_ptrs, epoch_ptr, rank, D, half, eps,
                            stride_x, stride_res, stride_out,
                            WORLD: tl.constexpr, MAX_ROWS: tl.constexpr, BLOCK: tl.constexpr,
                            NORM: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)                                       # x, the epoch, the buffers: all the previous kernel's
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
    pdl_release(PDL)                                     # the next kernel may load its weights while we sum
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for p in tl.static_range(WORLD):                     # rank order: the same sum on every rank
        src = tl.load(buf_ptrs + p).to(tl.pointer_type(x.dtype))
        acc += tl.load(src + slot + offs, mask=mask, other=0.0, cache_modifier=".cv").to(tl.float32)
    _finish_row(acc, x, row, offs, mask, res_ptr, w_ptr, out_ptr, D, eps, stride_res, stride_out, NORM)


LL_ROWS = 16            # rows of one push call (receive slots per source rank)
LL_DMAX = 8192          # values of one row's slot: DeepSeek's hidden sizes (2048, 5120, 7168) fit
LL_MAX_SPLIT = 8        # programs one row's columns may be pushed from (one epoch counter each)
_ROWS, _DMAX, _MAX_SPLIT = tl.constexpr(LL_ROWS), tl.constexpr(LL_DMAX), tl.constexpr(LL_MAX_SPLIT)


@triton.jit
def _poll_sum(acc, src, offs, mask, e):
    """acc + the fp32 values of the words at src + offs once every one carries epoch e. The loop carries a scalar
    only (Triton 3.6's layout pass fails on a tensor carried through it); the words are then read once more: they
    stay until epoch e + 2."""
    late = 1
    while late > 0:
        v = tl.load(src + offs, mask=mask, other=0, volatile=True)
        late = tl.max(tl.where(mask, (v >> 32).to(tl.int32) != e, 0).to(tl.int32), axis=0)
    v = tl.load(src + offs, mask=mask, other=0, volatile=True)
    return acc + (v & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def ll_next_epoch(epoch_ptr, row, c=0):
    """The epoch of `row`'s next call (counter c of the row; a call leaves them all equal)."""
    return tl.load(epoch_ptr + row * _MAX_SPLIT + c) + 1


@triton.jit
def ll_epoch(epoch_ptr, row, c, SPLIT: tl.constexpr):
    """Program c of SPLIT on `row`: its epoch, every counter of the row advanced to it (SPLIT may change)."""
    return advance_epoch(epoch_ptr + row * _MAX_SPLIT, c, _MAX_SPLIT, SPLIT)


@triton.jit
def ll_own(ll_ptrs, rank, e, half):
    """(This rank's receive buffer, the offset of epoch e's half in every rank's)."""
    return tl.load(ll_ptrs + rank).to(tl.pointer_type(tl.int64)), (e & 1).to(tl.int64) * half


@triton.jit
def ll_push(ll_ptrs, rank, row, e, half, cols, cmask, xc, WORLD: tl.constexpr):
    """Write the values xc (columns `cols` of `row`), each packed with epoch e, into every peer's slot of this rank;
    returns `ll_own`."""
    packed = (e.to(tl.int64) << 32) | (xc.to(tl.float32).to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF)
    own, parity = ll_own(ll_ptrs, rank, e, half)
    mine = parity + (row + rank * _ROWS).to(tl.int64) * _DMAX            # my slot on every peer
    for p in tl.static_range(WORLD):
        if p != rank:
            dst = tl.load(ll_ptrs + p).to(tl.pointer_type(tl.int64))
            tl.store(dst + mine + cols, packed, mask=cmask)
    return own, parity


@triton.jit
def ll_sum(acc, xc, own, parity, rank, row, cols, cmask, e, WORLD: tl.constexpr):
    """acc + the columns `cols` of `row` summed over the ranks in rank order (this rank's own from xc)."""
    for p in tl.static_range(WORLD):                     # rank order: the same sum on every rank
        if p == rank:
            acc += xc.to(tl.float32)
        else:
            acc = _poll_sum(acc, own + parity + (row + p * _ROWS).to(tl.int64) * _DMAX, cols, cmask, e)
    return acc


@triton.jit
def ll_all_reduce_rows(x_ptr, stride_x, num_rows, D, ll_ptrs, epoch_ptr, rank, half, WORLD: tl.constexpr,
                       BLOCK: tl.constexpr):
    """From inside another kernel, in one program: rows [0, num_rows) of x summed over the ranks by the push
    protocol (the same buffers, epochs and bits as `peer_all_reduce_ll`), in place. Every rank's program must get
    here for the same rows (the callers' launches are SPMD)."""
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    for r in range(0, num_rows):
        row = r + tl.zeros([], dtype=tl.int32)           # a tensor under the interpreter too (it indexes slots)
        e = ll_epoch(epoch_ptr, row, 0, 1)
        xrow = x_ptr + row.to(tl.int64) * stride_x
        x = tl.load(xrow + offs, mask=mask, other=0.0, cache_modifier=".cg")
        own, parity = ll_push(ll_ptrs, rank, row, e, half, offs, mask, x, WORLD)
        acc = ll_sum(tl.zeros([BLOCK], dtype=tl.float32), x, own, parity, rank, row, offs, mask, e, WORLD)
        tl.store(xrow + offs, acc.to(x.dtype), mask=mask)


@triton.jit
def _peer_all_reduce_ll_kernel(x_ptr, res_ptr, w_ptr, out_ptr, pad_ptr, ll_ptrs, epoch_ptr, rank, D, half, eps,
                               stride_x, stride_res, stride_out, WORLD: tl.constexpr,
                               SPLIT: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr):
    # program (row, c) pushes columns [c * CHUNK, (c + 1) * CHUNK) of its row to every peer, then polls and sums
    # those columns only; with NORM (SPLIT > 1) the row's programs add their parts of the sum of squares through the
    # row's local slots of norm_pad (`_row_total`)
    row, c = tl.program_id(0), tl.program_id(1)
    e = ll_epoch(epoch_ptr, row, c, SPLIT)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    cmask = cols < D
    xrow = x_ptr + row.to(tl.int64) * stride_x
    xc = tl.load(xrow + cols, mask=cmask, other=0.0)
    own, parity = ll_push(ll_ptrs, rank, row, e, half, cols, cmask, xc, WORLD)
    acc = ll_sum(tl.zeros([CHUNK], dtype=tl.float32), xc, own, parity, rank, row, cols, cmask, e, WORLD)
    _finish_row(acc, xc, row, cols, cmask, res_ptr, w_ptr, out_ptr, D, eps, stride_res, stride_out, NORM,
                pad_ptr, c, e, SPLIT)


@triton.jit
def _row_total(pad_ptr, row, c, e, part, SPLIT: tl.constexpr):
    """The sum over the SPLIT programs of `row` of their fp32 `part`, added in program order (the same bits in every
    program and on every rank). Each program stores its part packed with epoch e into the row's slot c of this
    GPU's pad (half e & 1), then polls the row's slots until every one carries e: the programs of a row must run at
    the same time (on GPUs; under the interpreter, one program at a time, the first would wait forever)."""
    base = pad_ptr + ((e & 1) * _ROWS + row).to(tl.int64) * _MAX_SPLIT
    packed = (e.to(tl.int64) << 32) | (part.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF)
    tl.atomic_xchg(base + c, packed, sem="relaxed", scope="gpu")
    offs = tl.arange(0, _MAX_SPLIT)
    mask = offs < SPLIT
    late = 1
    while late > 0:
        v = tl.load(base + offs, mask=mask, other=0, volatile=True)
        late = tl.max(tl.where(mask, (v >> 32).to(tl.int32) != e, 0).to(tl.int32), axis=0)
    v = tl.load(base + offs, mask=mask, other=0, volatile=True)
    return tl.sum(tl.where(mask, (v & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True), 0.0), axis=0)


class LLPointers(NamedTuple):
    """The push variant's receive buffers: every rank's address (in this process) and this rank's epoch counters
    [LL_ROWS * LL_MAX_SPLIT] (one per row and column chunk; a call advances all of a row's to the same value);
    `norm_pad`: this GPU's int64 [2 * LL_ROWS * LL_MAX_SPLIT] slots where a split row's programs add up its norm."""

    ll_ptrs: torch.Tensor
    epochs: torch.Tensor
    norm_pad: torch.Tensor

    @staticmethod
    def new(ll_ptrs: torch.Tensor) -> LLPointers:
        """Around the receive buffers' addresses: fresh counters and pad on their device."""
        dev = ll_ptrs.device
        return LLPointers(ll_ptrs, torch.zeros(LL_ROWS * LL_MAX_SPLIT, dtype=torch.int32, device=dev),
                          torch.zeros(2 * LL_ROWS * LL_MAX_SPLIT, dtype=torch.int64, device=dev))

    @staticmethod
    def fits(x: torch.Tensor) -> bool:
        t, d = x.shape
        return 0 < t <= LL_ROWS and d <= LL_DMAX


class LLGroup(NamedTuple):
    """What a kernel that sums rows over the ranks from inside itself needs (`ll_all_reduce_rows`)."""

    ll: LLPointers
    rank: int
    world: int

    def launch_args(self) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """(ll_ptrs, epochs, rank, half) as the kernels take them."""
        return self.ll.ll_ptrs, self.ll.epochs, self.rank, self.world * LL_ROWS * LL_DMAX


def ll_chunk(d: int, programs: int) -> int:
    """The `chunk` (columns per program, a power of two) that pushes a row of d values from about `programs`."""
    return triton.next_power_of_2(triton.cdiv(d, min(programs, LL_MAX_SPLIT)))


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
        WORLD=peers.world, MAX_ROWS=peers.max_rows, BLOCK=block, NORM=norm, **pdl_meta(x.device),
        num_warps=num_warps_for(block))
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


def peer_all_reduce_ll(x: torch.Tensor, group: LLGroup, residual: torch.Tensor | None = None,
                       weight: torch.Tensor | None = None, eps: float = 0.0,
                       chunk: int | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`peer_all_reduce` by the push variant (rows <= LL_ROWS, D <= LL_DMAX): the same results, bit for bit (the
    norm of a split row: the same sum and residual, the sum of squares added in another order).

    Returns the sum (over x), or with `residual`: (rmsnorm(sum + residual) * weight, sum + residual), the residual
    updated in place. `chunk` (a power of two): each row's columns go out from D / chunk programs (<= LL_MAX_SPLIT),
    not one (GPUs only with a residual).
    """
    assert group.ll.fits(x), f"x {tuple(x.shape)} exceeds the push buffers ({LL_ROWS} rows of {LL_DMAX})"
    norm, out = _operands(x, residual, weight)
    t, d = x.shape
    block = triton.next_power_of_2(d)
    chunk = block if chunk is None else min(chunk, block)
    split = triton.cdiv(d, chunk)
    assert chunk & (chunk - 1) == 0 and split <= LL_MAX_SPLIT, \
        f"chunk {chunk}: a power of two giving <= {LL_MAX_SPLIT} programs per row of {d}"
    # NOTE: with the norm the programs of a row wait for each other (`_row_total`): under the interpreter (one
    # program at a time) that never ends
    assert not (norm and split > 1 and x.device.type == "cpu"), "a split row with the norm needs concurrent programs"
    ll_ptrs, epochs, rank, half = group.launch_args()
    _peer_all_reduce_ll_kernel[(t, split)](
        x, residual if norm else x, weight if norm else x, out, group.ll.norm_pad, ll_ptrs, epochs, rank, d, half,
        float(eps), x.stride(0), residual.stride(0) if norm else 0, out.stride(0), WORLD=group.world,
        SPLIT=split, CHUNK=chunk, BLOCK=block, NORM=norm, num_warps=num_warps_for(chunk))
    return (out, residual) if norm else out


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
