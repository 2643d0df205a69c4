"""Token embedding and LM head (bf16 in every checkpoint, FP8 ones included), vocab-parallel under TP.

Legend: `T` tokens, `h` hidden, `V` vocab, `Vl` = V / tp rows held by this rank (rows tp_rank * Vl ..).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mlaserve.distributed import TensorParallel
from mlaserve.layers.linear import SINGLE, copy_checked, shard
from mlaserve.layers.ops import Ops


class VocabEmbedding(torch.nn.Module):
    """Rows of the vocabulary split across the ranks: each looks up the ids it holds, zeros elsewhere, and the
    all-reduce assembles the rows."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu", tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        rows = tp.split(vocab_size, "vocab_size")
        self.start = tp.rank * rows
        self.weight = torch.nn.Parameter(torch.empty(rows, hidden_size, dtype=dtype, device=device),
                                         requires_grad=False)
        self.weight.weight_loader = lambda name, p, t: copy_checked(name, p, shard(name, t, 0, tp))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start                                       # [T]
        mine = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * mine[:, None].to(self.weight.dtype)
        return self.tp.all_reduce(x)                                         # [T, h]


class LMHead(VocabEmbedding):
    """Projects final hidden states [T, h] to fp32 logits [T, V] (each rank its Vl columns, then all-gathered),
    through `ops.linear` when given (the decode-size GEMM on the GPU)."""

    def __init__(self, *args, ops: Ops | None = None, **kw):
        super().__init__(*args, **kw)
        self.linear = F.linear if ops is None else ops.linear
        self.pad_mask: torch.Tensor | None = None   # set by restrict(): -inf on the padding rows of a short rank

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.linear(hidden, self.weight).float()                     # [T, Vl]
        if self.pad_mask is not None:
            logits = logits + self.pad_mask
        return self.tp.all_gather(logits)                                     # [T, Vl] -> [T, V]

    def restrict(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Keep only the rows of `token_ids` (sorted, unique, global ids; `--speculative-token-map`): logits are
        then over those tokens, and the returned map [V'] turns a logits column back into its token id.

        Under TP each rank keeps the listed ids of its own shard, padded to the largest rank's count (so the
        all-gather stays equal-sized) with row 0 and a -inf logit; the map holds 0 there, never picked."""
        rows = self.weight.shape[0]
        per_rank = [token_ids[(token_ids >= r * rows) & (token_ids < (r + 1) * rows)] for r in range(self.tp.size)]
        width = max(len(ids) for ids in per_rank)
        assert width > 0
        mine = per_rank[self.tp.rank] - self.start
        pad = width - len(mine)
        local = torch.cat([mine, torch.zeros(pad, dtype=mine.dtype)]).to(self.weight.device)
        self.weight = torch.nn.Parameter(self.weight.index_select(0, local).contiguous(), requires_grad=False)
        if pad:
            mask = torch.zeros(width, dtype=torch.float32, device=self.weight.device)
            mask[len(mine):] = float("-inf")
            self.pad_mask = mask
        return torch.cat([torch.cat([ids, torch.zeros(width - len(ids), dtype=ids.dtype)]) for ids in per_rank])
