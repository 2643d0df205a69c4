"""TritonMLABackend against the PyTorch reference backend (decode; extend over cached prefixes), through the engine's
ForwardContext."""
from __future__ import annotations

import random

import pytest
import torch

from mlaserve.attention import create_attn_backend
from mlaserve.core import ForwardMode
from mlaserve.engine.forward_batch import build_context
from mlaserve.kvcache.pool import MLAKVPool

L, R, HEADS = 64, 16, 4


@pytest.mark.parametrize("splits", [None, 1, 6])
def test_decode_matches_the_torch_backend(device: str, splits: int | None) -> None:
    """Two layers, ragged requests, split counts chosen by the engine, one, or six: the torch backend's output."""
    seed = random.randrange(2**31)
    print(f"seed {seed}")
    torch.manual_seed(seed)
    pool = MLAKVPool(400, 2, L, R, torch.float32, device)
    for buf in pool.buffers:
        buf.copy_(torch.randn_like(buf))
    lens = [1, random.randint(2, 50), random.randint(100, 300)]
    req_to_token = torch.zeros(4, 320, dtype=torch.int32, device=device)
    slots = torch.randperm(400, device=device)[:sum(lens)].int() + 1
    for row, (start, n) in enumerate(zip([0, lens[0], lens[0] + lens[1]], lens)):
        req_to_token[row, :n] = slots[start:start + n]
    triton_backend = create_attn_backend("triton", 0.1, L, R)
    torch_backend = create_attn_backend("torch", 0.1, L, R)
    last = torch.tensor([n - 1 for n in lens], device=device)
    ctx = build_context(ForwardMode.DECODE, req_pool_idx=[0, 1, 2], prefix_lens=last.tolist(), extend_lens=[1, 1, 1],
                        out_slots=req_to_token[torch.arange(3, device=device), last].long(),
                        req_to_token=req_to_token, kv_pool=pool, attn_backend=triton_backend, device=device)
    ctx.num_kv_splits = splits
    for layer in (0, 1):
        q, q_pe = torch.randn(3, HEADS, L, device=device), torch.randn(3, HEADS, R, device=device)
        got = triton_backend.decode(layer, q, q_pe, ctx)
        want = torch_backend.decode(layer, q, q_pe, ctx)
        assert (got - want).abs().max().item() <= 1e-4


def test_extend_with_prefixes_matches_the_torch_backend_and_finds_the_prefix_slots_once(
        device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ragged extends over cached prefixes (none, short, long), two layers, then a second batch: the torch backend's
    output each time, with the prefixes' slots computed once per batch (ForwardContext.attn_cache), not per layer."""
    import mlaserve.attention.triton as triton_attn

    seed = random.randrange(2**31)
    print(f"seed {seed}")
    torch.manual_seed(seed)
    dn, dv = 16, 16
    pool = MLAKVPool(400, 2, L, R, torch.float32, device)
    for buf in pool.buffers:
        buf.copy_(torch.randn_like(buf))
    w_kv = torch.randn(HEADS * (dn + dv), L, device=device) / L ** 0.5

    def expand_kv(latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kv = (latent @ w_kv.t()).view(-1, HEADS, dn + dv)
        return kv[..., :dn], kv[..., dn:]

    calls = []
    real = triton_attn.prefix_chunk_slots
    monkeypatch.setattr(triton_attn, "prefix_chunk_slots", lambda *a, **k: calls.append(1) or real(*a, **k))
    triton_backend = create_attn_backend("triton", 0.1, L, R)
    torch_backend = create_attn_backend("torch", 0.1, L, R)
    slots = torch.randperm(399, device=device).int() + 1
    for batch, (prefixes, news) in enumerate([([0, 5, 40], [7, 3, 12]), ([9, 1], [4, 20])]):
        req_to_token = torch.zeros(4, 64, dtype=torch.int32, device=device)
        start = 0
        for row, n in enumerate(p + e for p, e in zip(prefixes, news)):
            req_to_token[row, :n] = slots[start:start + n]
            start += n
        rows = torch.arange(len(news), device=device)
        new_slots = torch.cat([req_to_token[r, p:p + e] for r, p, e in zip(rows, prefixes, news)]).long()
        ctx = build_context(ForwardMode.EXTEND, req_pool_idx=rows.tolist(), prefix_lens=prefixes, extend_lens=news,
                            out_slots=new_slots, req_to_token=req_to_token, kv_pool=pool,
                            attn_backend=triton_backend, device=device)
        for layer in (0, 1):
            cache = pool.kv_buffer(layer)[new_slots]                       # the new tokens' rows, already cached
            q = torch.randn(len(new_slots), HEADS, dn + R, device=device)
            got = triton_backend.extend(layer, q, cache[:, :L], cache[:, L:], ctx, expand_kv)
            want = torch_backend.extend(layer, q, cache[:, :L], cache[:, L:], ctx, expand_kv)
            assert (got - want).abs().max().item() <= 1e-4, (batch, layer)
        assert len(calls) == batch + 1, f"prefix slots computed {len(calls)} times over {batch + 1} batches"
