"""Reference MLA attention in plain PyTorch (CPU default, `--attention-backend torch`): one request at a time."""
from __future__ import annotations

import torch

from mlaserve.attention.base import BaseAttnBackend, ExpandKV, KVNew
from mlaserve.core import ForwardContext
from mlaserve.kernels.mla_decode import tree_visible


class TorchMLABackend(BaseAttnBackend):
    host_seq_lens = True

    def _request_rows(self, layer: int, ctx: ForwardContext, b: int, dtype: torch.dtype) -> torch.Tensor:
        slots = ctx.req_to_token[ctx.req_pool_idx[b], : ctx.seq_lens_cpu[b]].long()
        return ctx.kv_pool.load(layer, slots, dtype)                       # [S, L + R]

    def _spans(self, ctx: ForwardContext):
        start = 0
        for b, n in enumerate(ctx.extend_lens_cpu):
            yield b, start, n
            start += n

    def extend(self, layer: int, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
               ctx: ForwardContext, expand_kv: ExpandKV, kv_new: KVNew | None = None) -> torch.Tensor:
        assert kv_new is None, "the reference expands every row it reads from the cache (takes_new_kv is False)"
        outs = []
        for b, start, n in self._spans(ctx):
            rows = self._request_rows(layer, ctx, b, q.dtype)               # [S, L + R]
            k_nope, v = expand_kv(rows[:, : self.kv_lora_rank])             # [S, H, Dn], [S, H, Dv]
            k_rope = rows[:, None, self.kv_lora_rank:].expand(-1, k_nope.shape[1], -1)
            k = torch.cat([k_nope, k_rope], dim=-1)                         # [S, H, Dn + R]
            outs.append(_causal_attention(q[start:start + n], k, v, self.sm_scale))
        return torch.cat(outs, dim=0) if outs else q.new_empty(0, q.shape[1], 0)

    def decode(self, layer: int, q: torch.Tensor, q_pe: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        q = torch.cat([q, q_pe], dim=-1)                                   # [T, H, L + R]
        outs = []
        n = ctx.num_q
        for b in range(ctx.batch_size):
            rows = self._request_rows(layer, ctx, b, q.dtype)               # [S, L + R]
            k = rows[:, None, :].expand(-1, q.shape[1], -1)                 # one latent head shared by H
            v = k[..., : self.kv_lora_rank]
            tree = None if ctx.tree_mask is None else tree_visible(ctx.tree_mask[b * n:(b + 1) * n], n)
            outs.append(_causal_attention(q[b * n:(b + 1) * n], k, v, self.sm_scale, tree))
        return torch.cat(outs, dim=0) if outs else q.new_empty(0, q.shape[1], self.kv_lora_rank)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      tree: torch.Tensor | None = None) -> torch.Tensor:
    """q: [n, H, D], k: [S, H, D], v: [S, H, Dv]; query i sits at position S - n + i. fp32 softmax. `tree`
    [n, n] bool: which of the n new tokens each query sees (None: causal)."""
    n, s = q.shape[0], k.shape[0]
    scores = torch.einsum("nhd,shd->hns", q.float(), k.float()) * scale    # [H, n, S]
    q_pos = torch.arange(s - n, s, device=q.device)[:, None]
    mask = torch.arange(s, device=q.device)[None, :] > q_pos               # [n, S]
    if tree is not None:
        mask[:, s - n:] |= ~tree
    scores.masked_fill_(mask, float("-inf"))
    p = scores.softmax(dim=-1)
    return torch.einsum("hns,shd->nhd", p, v.float()).to(q.dtype)
