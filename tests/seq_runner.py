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
                 backend: str = "torch", device: str = "cpu"):
        self.model, self.cfg = model, cfg
        dtype = kv_dtype or model.dtype
        self.device = device
        self.pool = MLAKVPool(size, model.num_kv_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim, dtype,
                              device=device, kv_scale=kv_scale)
        self.req_to_token = torch.zeros(max_reqs, max_ctx, dtype=torch.int32, device=device)
        self.backend = create_attn_backend(backend, cfg.softmax_scale, cfg.kv_lora_rank, cfg.qk_rope_head_dim)
        self.next_slot = 1
        self.lens: dict[int, int] = {}

    def _ctx(self, mode: ForwardMode, rids: list[int], news: list[int], all_logits: bool):
        slots = []
        for rid, n in zip(rids, news):
            start = self.lens.get(rid, 0)
            s = torch.arange(self.next_slot, self.next_slot + n, device=self.device)
            self.next_slot += n
            self.req_to_token[rid, start:start + n] = s.int()
            slots.append(s)
        prefix = [self.lens.get(r, 0) for r in rids]
        for rid, n in zip(rids, news):
            self.lens[rid] = self.lens.get(rid, 0) + n
        return build_context(mode, req_pool_idx=rids, prefix_lens=prefix, extend_lens=news,
                             out_slots=torch.cat(slots), req_to_token=self.req_to_token, kv_pool=self.pool,
                             attn_backend=self.backend, device=self.device, last_token_logits=not all_logits)

    def extend(self, batch: dict[int, list[int]], all_logits: bool = False):
        rids = list(batch)
        ctx = self._ctx(ForwardMode.EXTEND, rids, [len(batch[r]) for r in rids], all_logits)
        ids = torch.tensor([t for r in rids for t in batch[r]], device=self.device)
        return self.model(ids, ctx.positions, ctx)

    def mtp_logits(self, next_ids: torch.Tensor, hidden: torch.Tensor, rid: int = 0) -> torch.Tensor:
        """The NextN layer over request `rid`'s extended positions (its own KV-cache layer): all draft logits."""
        n = len(next_ids)
        slots = self.req_to_token[rid, :n].long()
        ctx = build_context(ForwardMode.EXTEND, req_pool_idx=[rid], prefix_lens=[0], extend_lens=[n], out_slots=slots,
                            req_to_token=self.req_to_token, kv_pool=self.pool, attn_backend=self.backend,
                            device=self.device, last_token_logits=False)
        with torch.no_grad():
            return self.model.mtp(next_ids, hidden, ctx.positions, ctx).logits

    def decode(self, batch: dict[int, int]):
        rids = list(batch)
        ctx = self._ctx(ForwardMode.DECODE, rids, [1] * len(rids), False)
        return self.model(torch.tensor([batch[r] for r in rids], device=self.device), ctx.positions, ctx)


def drive_scheduler(sched, msgs: list, arrivals: dict[str, int] | None = None,
        aborts: dict[str, int] | None = None, max_steps: int = 5000) -> dict[str, dict]:
    """Drive the loop; a message joins at step arrivals[rid] (default 0); returns rid -> {ids, finished, cached,
    top (each output token's top log-probs, if the message asked for them)}."""
    arrivals, aborts = arrivals or {}, aborts or {}
    results = {x.rid: {"ids": [], "finished": None, "cached": 0, "top": [], "prompt": []} for x in msgs}
    pending = sorted(msgs, key=lambda x: arrivals.get(x.rid, 0))
    for step in range(max_steps):
        while pending and arrivals.get(pending[0].rid, 0) <= step:
            sched.add_request(pending.pop(0))
        for rid, at in aborts.items():
            if at == step:
                sched.abort(rid)
        for out in sched.step():
            r = results[out.rid]
            r["ids"] += out.new_ids
            r["top"] += out.new_top_logprobs              # (log p, id) pairs where the request asked for them
            r["cached"] = out.cached_tokens
            r["prompt"] += [lp for lp, _ in out.input_logprobs or []]    # where the request asked for them
            if out.finished:
                r["finished"] = out.finished
        if not pending and not sched.has_work:
            return results
    raise AssertionError("scheduler did not finish")


def eager_pieces(sched, sizes: list[int]):
    """Piecewise "graphs" on the scheduler's runner at these token counts: the padded forward, split at every
    attention call, run eagerly (capture=False: the layout the GPU captures; no CUDA here). Under DP attention
    the ranks then agree each step on the count to run (`Batch.piece_tokens`). Returns the runner."""
    from mlaserve.engine.piecewise import PiecewiseGraphRunner

    r = sched.runner
    r.pieces = PiecewiseGraphRunner(r.model, r.pool, r.attn_backend, sched.kv.req_to_token, 0, sizes, r.device,
                                    capture=False, dp_size=r.dp_size)
    if sched.dp_sync is not None:
        sched.dp_sync.piece_sizes = sorted(sizes)
    return r.pieces
