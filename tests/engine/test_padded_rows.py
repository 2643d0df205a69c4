"""Decode graphs pad a batch to the next captured size; the padding rows route to no expert (the graph's row mask,
`ForwardContext.moe_row_mask`): on the CPU the padded forward of the graphs runs eagerly (capture=False), the
tokens equal the unpadded engine's, and every padding row reaches the experts with all its slots -1."""
from __future__ import annotations

import torch

from engine.test_spec import DEMO, HEADERS, make, msg, same
from mlaserve.engine.graph import DecodeGraphRunner
from mlaserve.layers.moe import RoutedExperts
from mlaserve.tokenizer import load_tokenizer
from seq_runner import drive_scheduler as run


def test_padding_rows_route_to_no_expert(monkeypatch):
    tok = load_tokenizer(DEMO)
    msgs = [msg(f"r{i}", tok.encode(h), max_new=n) for i, (h, n) in enumerate(zip(HEADERS[:3], (10, 6, 12)))]
    arrivals = {"r1": 2, "r2": 4}                         # decode batches of 1, 2 and 3 requests
    base = run(make(DEMO), msgs, arrivals)
    sched = make(DEMO)
    r = sched.runner
    r.graphs = DecodeGraphRunner(r.model, r.pool, r.attn_backend, sched.kv.req_to_token, sched.kv.req_pool.alloc(),
                                 [1, 4], min(r.context_len, r.num_slots), r.device, r.token_buf, capture=False)
    seen = []
    forward = RoutedExperts.forward
    monkeypatch.setattr(RoutedExperts, "forward", lambda self, x, w, ids: seen.append(ids) or forward(self, x, w, ids))
    same(base, run(sched, msgs, arrivals))
    padded = [ids for ids in seen if ids.shape[0] == 4]      # 2 or 3 requests in the graph of 4
    assert padded and all((ids[-1] == -1).all() for ids in padded)
    assert all((ids[0] >= 0).all() for ids in padded)          # a request's row routes
    assert any((ids == -1).all(dim=1).sum() == 2 for ids in padded)      # 2 requests: two padding rows
