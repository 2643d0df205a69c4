"""mla_decode_chain (W_UK + rope + cache write, split attention, merge + W_UV for one token) against its reference:
phase by phase under the CPU interpreter, as one launch on a GPU."""
from __future__ import annotations

import pytest
import torch

from mlaserve.kernels import mla_chain
from mlaserve.kernels.mla_chain import chain_fits, mla_decode_chain, mla_decode_chain_ref

# (H, Dn, R, L, Dv): a small shape with padded tiles, V2-Lite's (and V3's at tp 8) shape
SHAPES = {"small": (5, 24, 8, 32, 40), "v2-lite": (16, 128, 64, 512, 128)}
TOL = {torch.float32: 2e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def _case(device: str, shape: str, dtype: torch.dtype, seq_len: int, kv_dtype: torch.dtype | None = None):
    h, dn, r, big_l, dv = SHAPES[shape]
    slots, width = 2 * seq_len + 8, seq_len + 4
    q = torch.randn(1, h, dn + r, device=device).to(dtype)
    w_kc = (torch.randn(h, dn, big_l, device=device) / dn ** 0.5).to(dtype)
    w_vc = (torch.randn(h, dv, big_l, device=device) / big_l ** 0.5).to(dtype)
    latent = torch.randn(1, big_l + r, device=device).to(dtype)
    ang = torch.arange(seq_len + 1, device=device)[:, None].float() * torch.rand(r // 2, device=device)[None, :]
    cos_sin = torch.cat([ang.cos(), ang.sin()], dim=1).contiguous()
    cache = torch.randn(slots, big_l + r, device=device).to(dtype)
    kv_scale = None
    if kv_dtype is not None:
        kv_scale = 0.5
        cache = (cache.float() / kv_scale).to(kv_dtype)
    req_to_token = torch.zeros(3, width, dtype=torch.int32, device=device)
    req_to_token[1, :seq_len] = torch.randperm(slots, device=device)[:seq_len].int()
    positions = torch.tensor([seq_len - 1], device=device)
    out_slots = req_to_token[1, seq_len - 1:seq_len].long()
    norm_w = (torch.rand(big_l, device=device) + 0.5).to(dtype)
    pool_idx = torch.tensor([1], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([seq_len], dtype=torch.int32, device=device)

    def run(fn, **kw):
        qq, lat, kv = q.clone(), latent.clone(), cache.clone()
        o = fn(qq[..., :dn], w_kc, w_vc, qq[..., dn:], lat[:, big_l:], lat[:, :big_l], positions, cos_sin, kv,
               out_slots, req_to_token, pool_idx, seq_lens, 0.1, norm_weight=norm_w, eps=1e-6, kv_scale=kv_scale, **kw)
        return o, qq, lat, kv
    return run


def _check(got, want, dtype: torch.dtype) -> None:
    assert got[0].shape == want[0].shape and got[0].dtype == want[0].dtype
    err = (got[0].float() - want[0].float()).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, want[0].float().abs().max().item()), err
    for a, b in zip(got[1:], want[1:]):                          # q (rope part roped), latent, cache
        torch.testing.assert_close(a.float(), b.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("shape,seq_len,splits", [("small", 1, 1), ("small", 70, 3), ("small", 300, 7),
                                                  ("v2-lite", 130, 4), ("v2-lite", 40, 9)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_chain_phases_equal_the_four_references(device: str, shape: str, seq_len: int, splits: int,
                                                dtype: torch.dtype) -> None:
    """The three phases as launches of their own (the interpreter's way): the output and every in-place effect
    of the rope as the references give them; splits past the context's end (9 splits of 40 tokens) and one."""
    seed = torch.seed()
    print("seed", seed)
    run = _case(device, shape, dtype, seq_len)
    _check(run(mla_decode_chain, num_kv_splits=splits, phase=1), run(mla_decode_chain_ref), dtype)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn])
def test_chain_phases_with_an_fp8_cache(device: str, kv_dtype: torch.dtype) -> None:
    seed = torch.seed()
    print("seed", seed)
    run = _case(device, "small", torch.float16, 90, kv_dtype)
    _check(run(mla_decode_chain, num_kv_splits=2, phase=1), run(mla_decode_chain_ref), torch.float16)


def test_chain_fits_only_one_token_of_few_heads_on_a_gpu(device: str, monkeypatch) -> None:
    q = torch.zeros(1, 16, 128, device=device)
    w_vc = torch.zeros(16, 128, 512, device=device)
    monkeypatch.setenv("MLASERVE_MLA_CHAIN", "yes")
    with pytest.raises(ValueError, match="MLASERVE_MLA_CHAIN='yes': expected 0 or 1"):
        chain_fits(q, w_vc, 512, 64)
    monkeypatch.setenv("MLASERVE_MLA_CHAIN", "1")
    if device == "cpu":
        assert not chain_fits(q, w_vc, 512, 64)                      # one launch needs a GPU
        return
    assert chain_fits(q, w_vc, 512, 64)
    assert not chain_fits(torch.zeros(2, 16, 128, device=device), w_vc, 512, 64)    # two tokens
    assert not chain_fits(torch.zeros(1, 32, 128, device=device), w_vc, 512, 64)    # two head blocks
    assert not chain_fits(q, w_vc, 512, None)                        # no fixed split count (a host sync)
    assert not chain_fits(q, w_vc, 512, 4096)                        # more programs than SMs
    monkeypatch.setenv("MLASERVE_MLA_CHAIN", "0")
    assert not chain_fits(q, w_vc, 512, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("seq_len,splits", [(1, 1), (256, 64), (300, 5), (4096, 64), (16384, 128)])
def test_chain_one_launch_equals_the_references(seq_len: int, splits: int) -> None:
    """One launch, its phases waiting on each other through the counters, in bf16 at V2-Lite's shape, twice in a
    row (the counters reset), and beside its three-launch form."""
    seed = torch.seed()
    print("seed", seed)
    run = _case("cuda", "v2-lite", torch.bfloat16, seq_len)
    want = run(mla_decode_chain_ref)
    for _ in range(2):
        _check(run(mla_decode_chain, num_kv_splits=splits), want, torch.bfloat16)
    assert not mla_chain._counters(torch.device("cuda", torch.cuda.current_device())).any()
    three = run(mla_decode_chain, num_kv_splits=splits, phase=1)
    torch.testing.assert_close(run(mla_decode_chain, num_kv_splits=splits)[0], three[0], atol=2e-2, rtol=2e-2)
