"""MLA attention through the Triton kernels (`--attention-backend triton`, the GPU default)."""
from __future__ import annotations

import torch

from mlaserve.attention.base import BaseAttnBackend, ExpandKV, KVNew
from mlaserve.core import ForwardContext
from mlaserve.kernels.mla_chain import chain_fits, mla_decode_chain
from mlaserve.kernels.mla_decode import mla_decode
from mlaserve.kernels.mla_prefill import mla_prefill, prefix_chunk_slots


class TritonMLABackend(BaseAttnBackend):
    takes_new_kv = True

    def extend(self, layer: int, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
               ctx: ForwardContext, expand_kv: ExpandKV, kv_new: KVNew | None = None) -> torch.Tensor:
        k_nope, v = expand_kv(kv_c) if kv_new is None else kv_new            # [T, H, Dn], [T, H, Dv]
        k_pe = k_pe[:, None, :].expand(-1, k_nope.shape[1], -1)               # [T, H, R], one row per token
        pre = ctx.prefix_lens_cpu
        # NOTE: the prefixes' slots once per batch, not per layer: per layer, their upload and gathers cost ~12 ms
        # of time to first token over V2-Lite's 27 layers when the attention runs eagerly between piecewise graphs
        # (a prompt whose BOS alone was cached: benchmarks/results/pdl-h100.md)
        slots = ctx.attn_cache.get("prefix_slots")
        if slots is None and any(pre):
            slots = ctx.attn_cache["prefix_slots"] = prefix_chunk_slots(pre, ctx.req_to_token, ctx.req_pool_idx)
        return mla_prefill(q, k_nope, v, ctx.extend_lens_cpu, pre,
                           ctx.kv_pool.kv_buffer(layer), ctx.req_to_token, ctx.req_pool_idx, expand_kv,
                           self.sm_scale, kv_lora_rank=self.kv_lora_rank, kv_scale=ctx.kv_pool.kv_scale,
                           k_pe_new=k_pe, prefix_slots=slots)

    def decode(self, layer: int, q: torch.Tensor, q_pe: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return mla_decode(q, ctx.kv_pool.kv_buffer(layer), ctx.req_to_token, ctx.req_pool_idx, ctx.seq_lens,
                          self.sm_scale, kv_lora_rank=self.kv_lora_rank, num_q=ctx.num_q,
                          kv_scale=ctx.kv_pool.kv_scale, num_kv_splits=ctx.num_kv_splits, q_pe=q_pe,
                          tree_mask=ctx.tree_mask)

    def decode_chain(self, layer: int, q_nope: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor, rope: tuple,
                     rope_kw: dict, ctx: ForwardContext) -> torch.Tensor | None:
        # one token of at most 16 heads in the decode graphs' short-context graph (ctx.chain): kernels/mla_chain.py
        if not ctx.chain or ctx.num_q != 1 or ctx.tree_mask is not None or not rope[5].is_contiguous() \
                or not chain_fits(q_nope, w_vc, self.kv_lora_rank, ctx.num_kv_splits):
            return None
        ctx.attn_cache["chain_ran"] = True             # (the graph runner keeps its chain graph only if it did)
        return mla_decode_chain(q_nope, w_kc, w_vc, *rope, ctx.req_to_token, ctx.req_pool_idx, ctx.seq_lens,
                                self.sm_scale, num_kv_splits=ctx.num_kv_splits, **rope_kw)
