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

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather(self.linear(hidden, self.weight).float())   # [T, Vl] -> [T, V]
