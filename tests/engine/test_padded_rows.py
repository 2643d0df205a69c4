"""Decode graphs pad a batch to the next captured size; the padding rows route to no expert (the graph's row mask,
`ForwardContext.moe_row_mask`): on the CPU the padded forward of the graphs runs eagerly (capture=False), the
tokens equal the unpadded engine's, and every padding row reaches the experts with all its slots -1."""
from __future__ import annotations

import pytest

from mlaserve.engine.graph import DecodeGraphRunner
from mlaserve.layers.moe import RoutedExperts
from mlaserve.tokenizer import load_tokenizer
from seq_runner import drive_scheduler as run
from test_spec import DEMO, HEADERS, make, msg, same


@pytest.mark.parametrize("mask", ["1", "0"])
def test_padding_rows_route_to_no_expert(mask, monkeypatch):
    """MLASERVE_PAD_MASK=0 (the A/B switch): the padding rows route as before, the tokens are the same."""
    monkeypatch.setenv("MLASERVE_PAD_MASK", mask)
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
    if mask == "0":
        assert padded and all((ids >= 0).all() for ids in padded)
        return
    assert padded and all((ids[-1] == -1).all() for ids in padded)
    assert all((ids[0] >= 0).all() for ids in padded)          # a request's row routes
    assert any((ids == -1).all(dim=1).sum() == 2 for ids in padded)      # 2 requests: two padding rows


def test_speculative_padding_rows_route_to_no_expert(monkeypatch):
    """The draft + verify and accept + repair graphs pad the batch with the dummy request: its rows (one to four per
    request and forward) route to no expert; the tokens equal decoding without speculation."""
    from engine.test_spec import spec
    from mlaserve.engine.graph import SpecGraphRunner
    from mlaserve.layers.moe import Router

    tok = load_tokenizer(DEMO)
    msgs = [msg(f"s{i}", tok.encode(h), max_new=n) for i, (h, n) in enumerate(zip(HEADERS[:3], (14, 8, 16)))]
    arrivals = {"s1": 2, "s2": 4}
    base = run(make(DEMO), msgs, arrivals)
    sched = spec(DEMO)
    r = sched.runner
    r.spec.graphs = SpecGraphRunner(r.spec, sched.kv.req_to_token, sched.kv.req_pool.alloc(), [1, 4],
                                    min(r.context_len, r.num_slots), r.device, capture=False)
    seen = []                                                # (row mask, ids) of every routing with a mask
    for name in ("forward", "route_normed"):
        method = getattr(Router, name)

        def record(self, *a, _m=method, row_mask=None, **k):
            out = _m(self, *a, row_mask=row_mask, **k)
            if row_mask is not None:
                seen.append((row_mask.clone(), out[1]))
            return out
        monkeypatch.setattr(Router, name, record)
    same(base, run(sched, msgs, arrivals))
    padded = [(m, ids) for m, ids in seen if not m.all()]
    assert padded and {m.shape[0] for m, _ in padded} >= {4, 12, 16}    # drafts, repair, verify rows of 4 requests
    for m, ids in padded:
        q = m.shape[0] // 4
        assert not m[-q:].any() and m[:q].all()              # request 3 of the graph of 4 is always padding
        assert (ids[~m] == -1).all() and (ids[m] >= 0).all()
