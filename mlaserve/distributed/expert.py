"""Expert parallelism: which routed experts a rank holds, the collectives between the ranks of the EP group, and
the dispatch / combine of token rows to the ranks holding their experts (DESIGN.md sec. 6).

Legend: `n` ranks in the MoE's group, `m` = moe_tp ranks per expert set (n / --ep-size), `T` this rank's tokens,
`M` the largest T over the group (the padded size), `h` hidden, `K` top-k, `E` routed experts, `E_r = E / (n / m)`
per expert set. Experts are partitioned in contiguous ranges over the n / m expert sets of m consecutive ranks,
which split each of their experts' intermediate dimension m ways (m = 1 when --ep-size equals --tp-size):

    ep rank (rank // m):  0                      1                          n / m - 1
    experts:            | 0 .. E_r - 1         | E_r .. 2 E_r - 1        | ... | E - E_r .. E - 1 |
    local id:           | 0 .. E_r - 1         | 0 .. E_r - 1            | ... | 0 .. E_r - 1     |

A global id maps to `id - ep_rank * E_r` on its holders and to -1 (the fused-MoE sentinel: contributes nothing)
everywhere else. Without data-parallel attention every rank has every token and the layer's existing all-reduce
sums the ranks' partial outputs, so no dispatch is needed; with it, each rank has its own tokens and a
`BaseDispatcher` moves rows to the experts and back.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import torch
import torch.distributed as dist

from mlaserve.core import compile_opaque
from mlaserve.distributed.parallel import TensorParallel


class ExpertParallel:
    """This rank's place among the MoE's `size` ranks (`group`: the collectives), which form size / moe_tp expert
    sets of moe_tp consecutive ranks. `ExpertParallel()` is one process (every expert local, every collective the
    identity)."""

    def __init__(self, rank: int = 0, size: int = 1, group: "dist.ProcessGroup | None" = None, moe_tp: int = 1):
        assert size % moe_tp == 0, f"{size} ranks do not form expert sets of {moe_tp}"
        self.rank, self.size, self.group, self.moe_tp = rank, size, group, moe_tp

    def __repr__(self) -> str:
        return f"ExpertParallel(rank={self.rank}, size={self.size}, moe_tp={self.moe_tp})"

    @property
    def ep_rank(self) -> int:
        return self.rank // self.moe_tp

    @property
    def ep_size(self) -> int:
        """Expert sets (--ep-size): 1 is no expert parallelism."""
        return self.size // self.moe_tp

    @property
    def inter(self) -> TensorParallel:
        """This rank's share of its experts' intermediate dimension (for slicing checkpoint tensors only)."""
        return TensorParallel(self.rank % self.moe_tp, self.moe_tp)

    def split(self, n_experts: int) -> int:
        """E_r = n_experts / ep_size (ValueError naming --ep-size when it does not divide)."""
        if n_experts % self.ep_size:
            raise ValueError(f"n_routed_experts ({n_experts}) cannot be split across --ep-size {self.ep_size}")
        return n_experts // self.ep_size

    def first(self, n_experts: int) -> int:
        """Global id of this rank's local expert 0."""
        return self.ep_rank * self.split(n_experts)

    def holds(self, expert: int, n_experts: int) -> bool:
        return 0 <= expert - self.first(n_experts) < self.split(n_experts)

    def to_local(self, ids: torch.Tensor, n_experts: int) -> torch.Tensor:
        """Global expert ids [..] -> local ids on this rank, -1 for experts it does not hold (and for ids -1)."""
        if self.ep_size == 1:
            return ids
        local = ids - self.first(n_experts)
        return torch.where((local >= 0) & (local < self.split(n_experts)), local, -1).to(torch.int32)

    # --- collectives over the EP group (rows along dim 0) ---------------------------------------------------
    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[M, ...] on every rank -> [n * M, ...], rank r's rows at r * M .. (r + 1) * M - 1."""
        if self.size == 1:
            return x
        return _all_gather_rows(x, self.size, self.group)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """[n * M, ...] on every rank -> [M, ...]: rank r gets the sum over ranks of rows r * M .. (r + 1) * M - 1."""
        if self.size == 1:
            return x
        return reduce_scatter_rows(x, self.size, self.group)

    def all_to_all(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """Rows x[sum(send[:d]) : sum(send[:d + 1])] go to rank d; returns the rows received, rank by rank
        (recv[s] from rank s; sizes known on both sides)."""
        if self.size == 1:
            return x
        return _all_to_all_rows(x, send, recv, self.group)

    def all_to_all_counts(self, send: torch.Tensor) -> list[int]:
        """send [n] int64 (rows this rank sends to each rank) -> rows it receives from each rank (a host sync)."""
        if self.size == 1:
            return send.tolist()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send.contiguous(), group=self.group)
        return recv.tolist()


def expert_parallel(tp: TensorParallel, ep_size: int) -> ExpertParallel:
    """Expert parallelism over the MoE's ranks `tp`: --ep-size 1 is none (every rank every expert, split along the
    intermediate dimension); else ep_size expert sets of tp.size / ep_size consecutive ranks."""
    if ep_size == 1:
        return ExpertParallel()
    if tp.size % ep_size:
        raise ValueError(f"--ep-size {ep_size}: must divide --tp-size {tp.size}")
    return ExpertParallel(tp.rank, tp.size, tp.group, moe_tp=tp.size // ep_size)


# NOTE: gloo (torch 2.13) implements all_gather_into_tensor, reduce_scatter_tensor and all_to_all_single on the
# CPU, so the same calls run on NCCL and in CI; torch >= 2.13 names the first two *_single.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@compile_opaque
def _all_gather_rows(x: torch.Tensor, size: int, group) -> torch.Tensor:
    out = torch.empty((size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x.contiguous(), group=group)
    return out


@compile_opaque
def reduce_scatter_rows(x: torch.Tensor, size: int, group) -> torch.Tensor:
    assert x.shape[0] % size == 0, f"reduce_scatter: {x.shape[0]} rows do not split over {size} ranks"
    out = torch.empty((x.shape[0] // size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, x.contiguous(), group=group)
    return out


@compile_opaque
def _all_to_all_rows(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    assert sum(send) == x.shape[0], f"all_to_all: send counts {send} do not sum to {x.shape[0]} rows"
    out = torch.empty((sum(recv),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


# --- dispatch / combine (data-parallel attention + EP) ---------------------------------------------------------

class Dispatched(NamedTuple):
    """Rows this rank's experts compute, and what `combine` needs to bring their outputs home."""

    x: torch.Tensor          # [N, h] token rows (from every rank)
    weights: torch.Tensor    # [N, K] float32 routing weights
    ids: torch.Tensor        # [N, K] int32 local expert ids, -1 for experts other ranks hold (and padding)
    state: tuple             # dispatcher-specific


class BaseDispatcher(ABC):
    """Moves each rank's token rows to the ranks holding their routed experts, and the experts' weighted outputs
    back. Every rank calls `dispatch` and `combine` at the same step (a rank without tokens passes T = 0).

    Usage: d = disp.dispatch(x, w, ids); y = experts(d.x, d.weights, d.ids)  # [N, h], weighted, summed over
    the local experts; out = disp.combine(y, d)  # [T, h]: the sum over all routed experts of this rank's rows.
    """

    def __init__(self, ep: ExpertParallel, n_experts: int):
        self.ep, self.n_experts = ep, n_experts
        ep.split(n_experts)

    @abstractmethod
    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> Dispatched:
        """x [T, h], weights [T, K] float32, ids [T, K] global expert ids (this rank's tokens)."""

    @abstractmethod
    def combine(self, y: torch.Tensor, d: Dispatched) -> torch.Tensor:
        """y [N, h] the local experts' output for d.x -> [T, h] this rank's rows, summed over every expert."""


class GatherDispatcher(BaseDispatcher):
    """All-gather every rank's rows padded to `padded` (M), local experts over all n * M rows, reduce-scatter the
    partial outputs back. Fixed shapes for a given (T, M), no host sync: capturable in a CUDA graph. The caller
    gives M >= every rank's T, agreed by all ranks (the scheduler's padded size)."""

    def __init__(self, ep: ExpertParallel, n_experts: int, padded: int):
        super().__init__(ep, n_experts)
        self.padded = padded

    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> Dispatched:
        t, m = x.shape[0], self.padded
        assert t <= m, f"{t} tokens exceed the padded size {m}"
        packed = _pack(x, weights, ids, pad_to=m)                                # [M, bytes]
        everyone = self.ep.all_gather(packed)                                    # [n * M, bytes]
        xs, ws, gids = _unpack(everyone, x, weights.shape[1])
        return Dispatched(xs, ws, self.ep.to_local(gids, self.n_experts), (t,))

    def combine(self, y: torch.Tensor, d: Dispatched) -> torch.Tensor:
        (t,) = d.state
        return self.ep.reduce_scatter(y)[:t]                                    # [M, h] -> [T, h]


class AllToAllDispatcher(BaseDispatcher):
    """Each token row goes once to every rank holding (a share of) at least one of its experts (with its whole
    routing row), and the partial outputs come back the same way. Sends only what is used, but its sizes are data-dependent:
    one host sync per dispatch (the counts), so it runs eagerly."""

    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> Dispatched:
        n, per_set = self.ep.size, self.ep.split(self.n_experts)
        owner = torch.where(ids >= 0, ids // per_set, -1)                        # [T, K] expert set of each expert
        sets = torch.arange(n, device=x.device) // self.ep.moe_tp                # [n] expert set of each rank
        wanted = (owner[:, None, :] == sets[None, :, None]).any(-1)              # [T, n] token t -> rank d
        dest, tok = wanted.t().nonzero(as_tuple=True)                            # grouped by destination rank
        send = torch.bincount(dest, minlength=n)                                 # [n]
        recv = self.ep.all_to_all_counts(send)
        send_list = send.tolist()
        packed = _pack(x[tok], weights[tok], ids[tok])                           # [S, bytes]
        got = self.ep.all_to_all(packed, send_list, recv)                        # [R, bytes]
        xs, ws, gids = _unpack(got, x, weights.shape[1])
        return Dispatched(xs, ws, self.ep.to_local(gids, self.n_experts), (tok, send_list, recv, x.shape[0]))

    def combine(self, y: torch.Tensor, d: Dispatched) -> torch.Tensor:
        tok, send, recv, t = d.state
        back = self.ep.all_to_all(y, recv, send)                                 # [S, h], in send order
        out = torch.zeros(t, y.shape[1], dtype=torch.float32, device=y.device)
        return out.index_add_(0, tok, back.float()).to(y.dtype)                 # sum of the ranks' partials


DISPATCHERS = {"gather": GatherDispatcher, "all_to_all": AllToAllDispatcher}


def create_dispatcher(name: str, ep: ExpertParallel, n_experts: int, **kw) -> BaseDispatcher:
    """`gather` (kw: padded) or `all_to_all`."""
    if name not in DISPATCHERS:
        raise ValueError(f"unknown EP dispatcher {name!r}; choices: {', '.join(DISPATCHERS)}")
    return DISPATCHERS[name](ep, n_experts, **kw)


def _pack(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, pad_to: int | None = None) -> torch.Tensor:
    # one byte buffer per row, [x | weights | ids], so one collective moves all three; padding rows: ids -1
    t, k = ids.shape
    rows = t if pad_to is None else pad_to
    hb = x.shape[1] * x.element_size()
    buf = torch.zeros(rows, hb + 8 * k, dtype=torch.uint8, device=x.device)
    buf[:t, :hb] = x.contiguous().view(torch.uint8)
    buf[:t, hb:hb + 4 * k] = weights.float().contiguous().view(torch.uint8)
    buf[:, hb + 4 * k:] = torch.full((rows, k), -1, dtype=torch.int32, device=x.device).view(torch.uint8)
    buf[:t, hb + 4 * k:] = ids.to(torch.int32).contiguous().view(torch.uint8)
    return buf


def _unpack(buf: torch.Tensor, like: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hb = like.shape[1] * like.element_size()
    x = buf[:, :hb].contiguous().view(like.dtype)                               # [N, h]
    weights = buf[:, hb:hb + 4 * k].contiguous().view(torch.float32)            # [N, K]
    ids = buf[:, hb + 4 * k:].contiguous().view(torch.int32)                    # [N, K]
    return x, weights, ids
