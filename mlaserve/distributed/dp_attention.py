"""Data-parallel attention (DESIGN.md sec. 6): D groups of tp / D ranks each run attention (and the dense layers,
embedding and lm_head) on their own requests; every MoE runs over all ranks on the tokens of all groups, gathered
before it and handed back after it.

Legend: `n` this group's tokens, `N` all groups' tokens (sum of `counts`), `P` the padded per-group size
(max of `counts`), `D` groups, `a` ranks per group (attention TP), `W` = D * a ranks, `h` hidden.

    gathered rows:  | group 0: counts[0] rows | group 1: counts[1] rows | ... | group D-1 |
                    ^ 0                       ^ counts[0]                      (offsets: prefix sums)
"""
from __future__ import annotations

import torch
import torch.distributed as dist

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
        n, pad = x.shape[0], max(counts)
        assert n == counts[self.dp_rank], f"{n} tokens here, {counts[self.dp_rank]} agreed"
        buf = x.new_zeros(pad, x.shape[1])
        buf[:n] = x                                                          # [P, h], padded to the global max
        parts = _all_gather_rows(buf, self.world)                            # [W, P, h]
        groups = parts[:: self.attn_tp_size]                                 # [D, P, h]: one rank per group
        return torch.cat([groups[d, :c] for d, c in enumerate(counts)])      # [N, h]

    def scatter(self, y: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """y [N, h], this rank's partial sums over every group's rows -> [n, h], the full sums of its own rows."""
        self.world.all_reduce(y)                                             # sum of the intermediate shares
        start = sum(counts[: self.dp_rank])
        return y[start: start + counts[self.dp_rank]]


@torch.compiler.disable
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
