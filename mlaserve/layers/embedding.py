"""Token embedding and LM head (bf16 in every checkpoint, FP8 ones included)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mlaserve.layers.linear import copy_checked


class VocabEmbedding(torch.nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu"):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype, device=device),
                                         requires_grad=False)
        self.weight.weight_loader = lambda name, p, t: copy_checked(name, p, t)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(VocabEmbedding):
    """Projects final hidden states [T, h] to fp32 logits [T, V]."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight).float()
