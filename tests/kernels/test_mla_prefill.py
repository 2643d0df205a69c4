"""mla_prefill kernels (varlen flash attention, LSE merge, chunked-prefix MLA extend) vs their PyTorch specs."""
from __future__ import annotations

import math
import random

import pytest
import torch

from mlaserve.bench.kernel_cases import mla_prefill as bench_case
from mlaserve.kernels import mla_prefill as mp
from mlaserve.kernels.mla_prefill import (flash_attn_varlen, flash_attn_varlen_ref, merge_attn_states,
                                          merge_attn_states_ref, mla_prefill, mla_prefill_ref)
from mlaserve.kernels.mla_prefill import _cudnn_self_attn

# Tolerances (abs and rel) vs fp32 references:
#   fp32: 1e-4 on every device (summation order only): the kernels' fp32 dots run in IEEE fp32 on the GPU too
#     (input_precision "ieee"; Triton's TF32 default moved out and lse by ~1e-3 there);
#   fp16: 3e-3 (P is rounded to fp16 before the PV product, outputs stored as fp16); its lse keeps 1e-4
#     (fp16 operands multiply exactly into the fp32 accumulator on every device).
TOL = {torch.float32: 1e-4, torch.float16: 3e-3}
LSE_TOL = 1e-4
# Scaled-down MLA dims for speed under the interpreter: Dn 32 + R 16 (split 32 + 16 like 128 + 64), Dv 32, L 32.
SMALL = dict(heads=2, d_nope=32, d_rope=16, d_v=32, kv_lora_rank=32)
DEEPSEEK = dict(heads=2, d_nope=128, d_rope=64, d_v=128, kv_lora_rank=512)


def _cu(lens: list[int]) -> torch.Tensor:
    # cu_seqlens stay on the CPU (the launcher reads them on the host; no device sync)
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _tols(dtype: torch.dtype, device: str) -> tuple[float, float]:
    """(out, lse) tolerances of an attention kernel (tl.dot) run in `dtype` (the same on every device)."""
    return TOL[dtype], LSE_TOL


def _close(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert not out.isnan().any(), "NaN in output"
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


# lens_k < lens_q in the last request: with causal (bottom-right) its first queries see no key at all.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("d_qk,d_v", [(48, 32), (64, 64), (40, 24)])   # 40 = 32 + 8: padded tiles
def test_flash_attn_varlen_matches_ref(dtype: torch.dtype, causal: bool, d_qk: int, d_v: int, device: str) -> None:
    lens_q, lens_k = [5, 40, 1, 0, 33], [5, 70, 1, 3, 10]
    q = torch.randn(sum(lens_q), 2, d_qk, dtype=dtype, device=device)
    k = torch.randn(sum(lens_k), 2, d_qk, dtype=dtype, device=device)
    v = torch.randn(sum(lens_k), 2, d_v, dtype=dtype, device=device)
    args = (q, k, v, _cu(lens_q), _cu(lens_k), d_qk**-0.5, causal)
    out, lse = flash_attn_varlen(*args)
    ref, ref_lse = flash_attn_varlen_ref(*args)
    tol, lse_tol = _tols(dtype, device)
    _close(out, ref, tol)
    assert torch.equal(lse.isinf(), ref_lse.isinf())
    torch.testing.assert_close(lse.nan_to_num(neginf=0.0), ref_lse.nan_to_num(neginf=0.0), atol=lse_tol, rtol=lse_tol)
    if causal:                                      # request 4: queries 0..22 see no key -> out 0, lse -inf
        rows = slice(sum(lens_q[:4]), sum(lens_q[:4]) + 23)
        assert (out[rows] == 0).all() and (lse[rows] == float("-inf")).all()


def test_flash_attn_varlen_deepseek_dims(device: str) -> None:
    lens = [33, 17]
    q, k = (torch.randn(50, 2, 192, dtype=torch.float16, device=device) for _ in range(2))
    v = torch.randn(50, 2, 128, dtype=torch.float16, device=device)
    args = (q, k, v, _cu(lens), _cu(lens), 192**-0.5, True)
    _close(flash_attn_varlen(*args)[0], flash_attn_varlen_ref(*args)[0], TOL[torch.float16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_merge_matches_ref(dtype: torch.dtype, device: str) -> None:
    t, h, d = 9, 5, 24
    o_a, o_b = (torch.randn(t, h, d, dtype=dtype, device=device) for _ in range(2))
    lse_a, lse_b = torch.randn(t, h, device=device) * 3, torch.randn(t, h, device=device) * 3
    lse_a[0], lse_b[1], lse_a[2], lse_b[2] = float("-inf"), float("-inf"), float("-inf"), float("-inf")
    o_a[2], o_b[2] = 0, 0                            # token 2: both sides empty
    out, lse = merge_attn_states(o_a, lse_a, o_b, lse_b)
    ref, ref_lse = merge_attn_states_ref(o_a, lse_a, o_b, lse_b)
    _close(out, ref, TOL[dtype])                     # elementwise only
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[0].float(), o_b[0].float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert (out[2] == 0).all() and (lse[2] == float("-inf")).all()


def test_merge_equals_attention_over_union(device: str) -> None:
    # attention over keys [0, 30) == merge(attention over [0, 12), attention over [12, 30))
    q, k = torch.randn(7, 3, 48, device=device), torch.randn(30, 3, 48, device=device)
    v = torch.randn(30, 3, 32, device=device)
    cq = _cu([7])
    full, full_lse = flash_attn_varlen(q, k, v, cq, _cu([30]), 0.2, False)
    o_a, lse_a = flash_attn_varlen(q, k[:12], v[:12], cq, _cu([12]), 0.2, False)
    o_b, lse_b = flash_attn_varlen(q, k[12:], v[12:], cq, _cu([18]), 0.2, False)
    out, lse = merge_attn_states(o_a, lse_a, o_b, lse_b)
    tol, lse_tol = _tols(torch.float32, device)
    _close(out, full, tol)
    torch.testing.assert_close(lse, full_lse, atol=lse_tol, rtol=lse_tol)


def _mla_inputs(ext: list[int], pre: list[int], dtype: torch.dtype, device: str, heads: int, d_nope: int,
                d_rope: int, d_v: int, kv_lora_rank: int, cache_dtype: torch.dtype | None = None) -> dict:
    # scattered slots (a random permutation) and shuffled req_to_token rows, as after cache churn.
    # Tensors live on `device` like the engine's; extend_lens / prefix_lens stay on the CPU (read on the host).
    b, ctx = len(ext), [p + e for p, e in zip(pre, ext)]
    num_slots = sum(ctx) + 7
    slots = torch.randperm(num_slots)
    pool_idx = torch.randperm(b + 2)[:b]
    req_to_token = torch.full((b + 2, max(ctx) + 3), -1, dtype=torch.int32)
    start = 0
    for i, n in enumerate(ctx):
        req_to_token[pool_idx[i], :n] = slots[start:start + n].to(torch.int32)
        start += n
    kv_cache = torch.randn(num_slots, kv_lora_rank + d_rope, device=device).to(cache_dtype or dtype)
    w = torch.randn(heads * (d_nope + d_v), kv_lora_rank, device=device) / math.sqrt(kv_lora_rank)    # kv_b_proj

    def expand_kv(latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kv = (latent.float() @ w.t()).to(latent.dtype).view(latent.shape[0], heads, d_nope + d_v)
        return kv[..., :d_nope], kv[..., d_nope:]

    t = sum(ext)
    return dict(q=torch.randn(t, heads, d_nope + d_rope, dtype=dtype, device=device),
                k_new=torch.randn(t, heads, d_nope + d_rope, dtype=dtype, device=device),
                v_new=torch.randn(t, heads, d_v, dtype=dtype, device=device), extend_lens=torch.tensor(ext),
                prefix_lens=torch.tensor(pre), kv_cache=kv_cache, req_to_token=req_to_token.to(device),
                req_pool_idx=pool_idx.to(device), expand_kv=expand_kv, sm_scale=(d_nope + d_rope) ** -0.5,
                kv_lora_rank=kv_lora_rank)


# prefix_chunk 16 over prefixes 37 + 0 + 5 + 20: chunks straddle requests and 16 divides nothing.
@pytest.mark.parametrize("ext,pre,chunk", [
    ([7, 20, 1, 13], [0, 0, 0, 0], 16),              # plain prefill
    ([7, 20, 1, 13], [9, 0, 3, 12], 4096),           # prefix in one chunk
    ([7, 20, 0, 13], [37, 0, 5, 20], 16),            # several chunks, one request with no new tokens
    ([0, 9], [40, 3], 16),                           # chunks whose requests have no queries are skipped
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mla_prefill_matches_ref(ext: list[int], pre: list[int], chunk: int, dtype: torch.dtype,
                                 device: str) -> None:
    x = _mla_inputs(ext, pre, dtype, device, **SMALL)
    _close(mla_prefill(**x, prefix_chunk=chunk), mla_prefill_ref(**x), _tols(dtype, device)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mla_prefill_small_test_config_dims(dtype: torch.dtype, device: str) -> None:
    # the small V3 test config: kv_lora_rank 32, rope 8 (not a power of two >= 16: padded tiles)
    x = _mla_inputs([5, 12], [9, 20], dtype, device, heads=3, d_nope=16, d_rope=8, d_v=16, kv_lora_rank=32)
    _close(mla_prefill(**x, prefix_chunk=8), mla_prefill_ref(**x), _tols(dtype, device)[0])


def test_mla_prefill_deepseek_dims(device: str) -> None:
    x = _mla_inputs([9, 24], [20, 7], torch.float16, device, **DEEPSEEK)
    _close(mla_prefill(**x, prefix_chunk=16), mla_prefill_ref(**x), TOL[torch.float16])


def test_mla_prefill_fp8_cache(device: str) -> None:
    # stored e4m3 rows * kv_scale must equal running on the explicitly dequantised cache
    x = _mla_inputs([6, 11], [21, 9], torch.float32, device, **SMALL, cache_dtype=torch.float8_e4m3fn)
    kv_scale, tol = 0.37, _tols(torch.float32, device)[0]
    out = mla_prefill(**x, kv_scale=kv_scale, prefix_chunk=8)
    _close(out, mla_prefill_ref(**x, kv_scale=kv_scale), tol)
    x["kv_cache"] = x["kv_cache"].float() * kv_scale
    _close(out, mla_prefill_ref(**x), tol)


def test_mla_prefill_ref_matches_naive_full_attention(device: str) -> None:
    # independent spec: expand every cache slot, one softmax over [all slots ++ all new tokens] with a mask
    ext, pre = [5, 12, 3], [8, 0, 14]
    x = _mla_inputs(ext, pre, torch.float32, device, **SMALL)
    cache, r2t, heads, lr = x["kv_cache"], x["req_to_token"], x["q"].shape[1], x["kv_lora_rank"]
    k_nope, v_cache = x["expand_kv"](cache[:, :lr])                                       # [S, H, Dn], [S, H, Dv]
    k_all = torch.cat([torch.cat([k_nope, cache[:, None, lr:].expand(-1, heads, -1)], -1), x["k_new"]])
    v_all = torch.cat([v_cache, x["v_new"]])
    req = torch.repeat_interleave(torch.arange(len(ext)), torch.tensor(ext))             # [T]
    idx = torch.cat([torch.arange(e) for e in ext])                                       # [T] index among new
    allowed = torch.zeros(len(req), cache.shape[0] + len(req), dtype=torch.bool)          # built on the CPU
    for t in range(len(req)):
        b = int(req[t])
        allowed[t, r2t[x["req_pool_idx"][b], :pre[b]].long().cpu()] = True                 # the whole prefix
        allowed[t, cache.shape[0]:][(req == b) & (idx <= idx[t])] = True                   # causal new tokens
    s = torch.einsum("thd,jhd->htj", x["q"], k_all) * x["sm_scale"]
    p = torch.softmax(s.masked_fill(~allowed.to(device), float("-inf")), dim=-1)
    naive = torch.einsum("htj,jhd->thd", p, v_all)
    _close(mla_prefill_ref(**x), naive, TOL[torch.float32])                             # torch only


def test_bench_case_arithmetic() -> None:
    # V2-Lite 1x4096, H16: causal attention FLOPs = 2 * 4096^2 / 2 * 16 * (192 + 128)
    assert bench_case.attn_flops([4096], [0], 16) == 2 * 4096 * 4096 / 2 * 16 * 320
    assert bench_case.attn_flops([2, 3], [10, 0], 1, d_qk=1, d_v=1) == 2 * 2 * (2 + 20 + 4.5)
    assert bench_case.expand_flops([100, 28], 16) == 2 * 128 * 512 * 16 * 256
    assert bench_case.min_bytes([1], [1], 1) == 2 * ((2 * 192 + 2 * 128) + 576 + 256 * 512)
    assert [s[0] for s in bench_case.SHAPES] and all(s[1] in (16, 128) for s in bench_case.SHAPES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mla_prefill_separate_rope_key(dtype: torch.dtype, device: str) -> None:
    # the extend path passes k_nope and the shared rope key as a stride-0 view over heads (no concatenation)
    x = _mla_inputs([7, 13], [9, 0], dtype, device, **SMALL)
    k_new = x.pop("k_new")
    d_r = x["kv_cache"].shape[1] - x["kv_lora_rank"]
    k_pe = k_new[:, :1, -d_r:].expand(-1, k_new.shape[1], -1)               # one rope key per token, all heads
    k_nope = k_new[..., :-d_r].contiguous()
    want = mla_prefill_ref(**x, k_new=torch.cat([k_nope, k_pe], dim=-1))
    _close(mla_prefill(**x, k_new=k_nope, k_pe_new=k_pe, prefix_chunk=8), want, _tols(dtype, device)[0])
    _close(mla_prefill_ref(**x, k_new=k_nope, k_pe_new=k_pe), want, 0.0)


def test_cudnn_self_attn_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Which prefills' new-token attention goes to cuDNN: half-precision CUDA tensors, at most CUDNN_MAX_REQS
    requests of at least CUDNN_MIN_TOKENS new tokens each; the switch off sends everything to Triton."""
    monkeypatch.setattr(mp, "CUDNN_SELF_ATTN", True)
    n, most = mp.CUDNN_MIN_TOKENS, mp.CUDNN_MAX_REQS
    assert mp._cudnn_rule(True, torch.bfloat16, [n]) and mp._cudnn_rule(True, torch.float16, [n + 1] * most)
    assert not mp._cudnn_rule(True, torch.bfloat16, [n - 1])
    assert not mp._cudnn_rule(True, torch.bfloat16, [n, n - 1])
    assert not mp._cudnn_rule(True, torch.bfloat16, [n] * (most + 1))
    assert not mp._cudnn_rule(True, torch.float32, [n]) and not mp._cudnn_rule(False, torch.bfloat16, [n])
    assert not mp._cudnn_rule(True, torch.bfloat16, [])
    assert not mp.cudnn_self_attn_ok(torch.empty(n, 2, 192, dtype=torch.bfloat16), [n])      # a CPU tensor
    monkeypatch.setattr(mp, "CUDNN_SELF_ATTN", False)
    assert not mp._cudnn_rule(True, torch.bfloat16, [n])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuDNN attention runs on a GPU")
@pytest.mark.parametrize("ext,pre,chunk", [
    ([600], [0], 4096),                              # one prompt
    ([512, 777], [0, 0], 4096),                      # two, concatenated outputs
    ([520, 600], [300, 0], 128),                     # a cached prefix in three chunks, merged into cuDNN's output
])
def test_mla_prefill_cudnn_matches_ref_and_triton(ext: list[int], pre: list[int], chunk: int,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 at DeepSeek's dims with the model's stride-0 rope key: the cuDNN path (taken: counted) against the
    fp32 reference and against the Triton kernel on the same inputs."""
    if not mp.cudnn_attn_available(torch.cuda.current_device()):
        pytest.skip("this GPU / torch lacks cuDNN attention with q/k and v head dims apart (cuDNN 9, sm90)")
    seed = random.randrange(2**31)
    print(f"seed {seed}")
    torch.manual_seed(seed)
    x = _mla_inputs(ext, pre, torch.bfloat16, "cuda", **(DEEPSEEK | dict(heads=16)))
    k_new = x.pop("k_new")
    k_pe = k_new[:, :1, 128:].expand(-1, k_new.shape[1], -1)
    k_nope = k_new[..., :128]
    calls = []
    monkeypatch.setattr(mp, "CUDNN_SELF_ATTN", True)
    monkeypatch.setattr(mp, "CUDNN_MIN_TOKENS", 512)                     # (short prompts here: a fast test)
    monkeypatch.setattr(mp, "_cudnn_self_attn", lambda *a: calls.append(a[4]) or _cudnn_self_attn(*a))
    out = mla_prefill(**x, k_new=k_nope, k_pe_new=k_pe, prefix_chunk=chunk)
    assert calls == [ext], "the cuDNN path was not taken"
    want = mla_prefill_ref(**x, k_new=torch.cat([k_nope, k_pe], dim=-1))
    _close(out, want, 2e-2)
    monkeypatch.setattr(mp, "CUDNN_SELF_ATTN", False)
    _close(out, mla_prefill(**x, k_new=k_nope, k_pe_new=k_pe, prefix_chunk=chunk), 2e-2)
    assert calls == [ext]


@pytest.mark.parametrize("t,h", [(5, 3), (2, 16), (0, 4)])
def test_join_k_is_cat(t: int, h: int, device: str) -> None:
    """join_k equals torch.cat of k_nope and the shared rope key (a stride-0 view over heads), bit for bit."""
    k_nope = torch.randn(t, h, 2 * 32, device=device)[..., :32]                # strided like kv_b_proj's output
    k_pe = torch.randn(t, 16, device=device)[:, None, :].expand(-1, h, -1)
    assert torch.equal(mp.join_k(k_nope, k_pe), torch.cat([k_nope, k_pe], dim=-1))
