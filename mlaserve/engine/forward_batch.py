"""Build the ForwardContext of one batch from per-request slot lists (positions, output slots, lengths)."""
from __future__ import annotations

import torch

from mlaserve.core import ForwardContext, ForwardMode
from mlaserve.kvcache.allocator import to_device


def build_context(mode: ForwardMode, *, req_pool_idx: list[int], prefix_lens: list[int],
                  extend_lens: list[int], out_slots: torch.Tensor, req_to_token: torch.Tensor,
                  kv_pool, attn_backend, device: torch.device | str, num_q: int = 1,
                  last_token_logits: bool = True, num_decode: int = 0) -> ForwardContext:
    """Requests' new tokens are laid out back to back; request b's sit at positions
    prefix_lens[b] .. prefix_lens[b] + extend_lens[b] - 1. `out_slots` [T] must already be written
    into `req_to_token` at those positions. With `last_token_logits`, logits are computed only for the
    last new token of each request. `num_decode` (EXTEND only): the last requests are one-token decodes of a
    mixed batch (`ForwardContext.split_mixed`)."""
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    positions = torch.cat([torch.arange(p, s) for p, s in zip(prefix_lens, seq_lens)]) if seq_lens else \
        torch.empty(0, dtype=torch.int64)
    logits_idx = None
    if last_token_logits:
        ends = torch.tensor(extend_lens, dtype=torch.int64).cumsum(0) - 1
        logits_idx = to_device(ends, device)

    def dev(x: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return to_device(torch.tensor(x, dtype=dtype), device)

    ctx = ForwardContext(
        mode=mode, positions=to_device(positions, device), out_slots=to_device(out_slots, device),
        req_pool_idx=dev(req_pool_idx, torch.int64), seq_lens=dev(seq_lens), seq_lens_cpu=seq_lens,
        extend_lens_cpu=list(extend_lens),
        req_to_token=req_to_token, kv_pool=kv_pool, attn_backend=attn_backend, num_q=num_q,
        logits_indices=logits_idx, num_decode=num_decode)
    if num_decode:
        ctx.parts = ctx.split_mixed()
    return ctx
