"""Data-parallel attention (DESIGN.md sec. 6): D groups of tp / D ranks each run attention (and the dense layers,
embedding and lm_head) on their own requests; every MoE runs over all ranks on the tokens of all groups, gathered
before it and handed back after it.

Legend: `n` this group's tokens, `N` all groups' tokens (sum of `counts`), `P` the padded per-group size
(max of `counts`), `D` groups, `a` ranks per group (attention TP), `W` = D * a ranks, `h` hidden.

    gathered rows:  | group 0: counts[0] rows | group 1: counts[1] rows | ... | group D-1 |
                    ^ 0                       ^ counts[0]                      (offsets: prefix sums)

After the MoE each rank holds partial sums of all N rows. Groups of one rank (a = 1, e.g. tp 8 dp 8) take their
own rows' full sums by a reduce-scatter of the padded layout [D * P, h] (half the bytes of an all-reduce); where
the peer kernel takes the rows (decode sizes, `peer.PEER_CALL_MAX_BYTES`), or groups hold several ranks, one all-reduce
(one launch over the peer buffers, else NCCL / gloo) and each rank keeps its group's rows.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from mlaserve.core import compile_opaque
from mlaserve.distributed.expert import reduce_scatter_rows
from mlaserve.distributed.parallel import TensorParallel


class DPAttention:
    """The gather and scatter around each MoE layer, over all ranks (`world`: also the group the experts' intermediate
    dimension is split across). `counts` (tokens of each DP group this step) is what every rank agreed on before
    the forward; a group with no tokens passes an empty `x` (the IDLE forward) and still takes part."""

    def __init__(self, dp_rank: int, dp_size: int, attn_tp_size: int, world: TensorParallel):
        self.dp_rank, self.dp_size, self.attn_tp_size, self.world = dp_rank, dp_size, attn_tp_size, world

    def __repr__(self) -> str:
        return f"DPAttention(dp_rank={self.dp_rank}, dp_size={self.dp_size}, attn_tp_size={self.attn_tp_size})"

    def gather(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [n, h] of this group -> [N, h], every group's rows in DP-rank order (the same on every rank)."""
        n, pad, h = x.shape[0], max(counts), x.shape[1]
        assert n == counts[self.dp_rank], f"{n} tokens here, {counts[self.dp_rank]} agreed"
        buf = x.contiguous()
        if n < pad:
            buf = x.new_zeros(pad, h)
            buf[:n] = x                                                      # [P, h], padded to the global max
        parts = _all_gather_rows(buf, self.world)                            # [W, P, h]
        groups = parts[:: self.attn_tp_size]                                 # [D, P, h]: one rank per group
        if all(c == pad for c in counts):                                    # equal counts (graphs): no copy
            return groups.reshape(-1, h)
        return torch.cat([groups[d, :c] for d, c in enumerate(counts)])      # [N, h]

    def scatter(self, y: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """y [N, h], this rank's partial sums over every group's rows -> [n, h], the full sums of its own rows."""
        n = counts[self.dp_rank]
        if self.reduce_scatters(y):
            pad = max(counts)
            if y.shape[0] != pad * self.dp_size:
                y = _padded(y, counts, pad)                                  # [D * P, h], as gathered
            return reduce_scatter_rows(y, self.world.size, self.world.group)[:n]        # [P, h] -> [n, h]
        self.world.all_reduce(y)                                             # sum of the intermediate shares
        start = sum(counts[: self.dp_rank])
        return y[start: start + n]

    def reduce_scatters(self, y: torch.Tensor) -> bool:
        """Whether `scatter` takes y by a reduce-scatter (groups of one rank, rows the peer buffers do not take)."""
        return self.attn_tp_size == 1 and self.world.size > 1 and y.shape[0] > 0 and not self.world.fuses_norm(y)


def _padded(y: torch.Tensor, counts: list[int], pad: int) -> torch.Tensor:
    """[N, h] rows in DP-rank order -> [D * P, h], group d's rows at d * P (zeros after them)."""
    out = y.new_zeros(len(counts) * pad, y.shape[1])
    start = 0
    for d, c in enumerate(counts):
        out[d * pad: d * pad + c] = y[start: start + c]
        start += c
    return out


@compile_opaque
def _all_gather_rows(x: torch.Tensor, world: TensorParallel) -> torch.Tensor:
    """[P, h] on every rank -> [W, P, h], rank r's at index r."""
    if world.size == 1:
        return x[None]
    if world.nccl:
        out = torch.empty((world.size,) + tuple(x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x, group=world.group)
        return out
    parts = [torch.empty_like(x) for _ in range(world.size)]
    dist.all_gather(parts, x, group=world.group)
    return torch.stack(parts)
