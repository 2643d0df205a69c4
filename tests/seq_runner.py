"""A minimal driver for model tests: sequential slot allocation, prefill then token-by-token decode."""
from __future__ import annotations

import torch

from mlaserve.attention import create_attn_backend
from mlaserve.config import ModelConfig
from mlaserve.core import ForwardMode
from mlaserve.engine.forward_batch import build_context
from mlaserve.kvcache.pool import MLAKVPool
from mlaserve.models.deepseek import DeepseekForCausalLM


class SeqRunner:
    def __init__(self, model: DeepseekForCausalLM, cfg: ModelConfig, *, size: int = 4096, max_reqs: int = 16,
                 max_ctx: int = 1024, kv_dtype: torch.dtype | None = None, kv_scale: float = 1.0,
                 backend: str = "torch"):
        self.model, self.cfg = model, cfg
        dtype = kv_dtype or model.dtype
        self.pool = MLAKVPool(size, model.num_kv_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim, dtype,
                              kv_scale=kv_scale)
        self.req_to_token = torch.zeros(max_reqs, max_ctx, dtype=torch.int32)
        self.backend = create_attn_backend(backend, cfg.softmax_scale, cfg.kv_lora_rank, cfg.qk_rope_head_dim)
        self.next_slot = 1
        self.lens: dict[int, int] = {}

    def _ctx(self, mode: ForwardMode, rids: list[int], news: list[int], all_logits: bool):
        slots = []
        for rid, n in zip(rids, news):
            start = self.lens.get(rid, 0)
            s = torch.arange(self.next_slot, self.next_slot + n)
            self.next_slot += n
            self.req_to_token[rid, start:start + n] = s.int()
            slots.append(s)
        prefix = [self.lens.get(r, 0) for r in rids]
        for rid, n in zip(rids, news):
            self.lens[rid] = self.lens.get(rid, 0) + n
        return build_context(mode, req_pool_idx=rids, prefix_lens=prefix, extend_lens=news,
                             out_slots=torch.cat(slots), req_to_token=self.req_to_token, kv_pool=self.pool,
                             attn_backend=self.backend, device="cpu", last_token_logits=not all_logits)

    def extend(self, batch: dict[int, list[int]], all_logits: bool = False):
        rids = list(batch)
        ctx = self._ctx(ForwardMode.EXTEND, rids, [len(batch[r]) for r in rids], all_logits)
        ids = torch.tensor([t for r in rids for t in batch[r]])
        return self.model(ids, ctx.positions, ctx)

    def decode(self, batch: dict[int, int]):
        rids = list(batch)
        ctx = self._ctx(ForwardMode.DECODE, rids, [1] * len(rids), False)
        return self.model(torch.tensor([batch[r] for r in rids]), ctx.positions, ctx)
