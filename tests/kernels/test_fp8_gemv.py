"""fp8_gemv (the decode-size block-FP8 linear; Triton, CPU interpreter here) against fp8_linear_ref, fp8_linear's
routing to it, its split-K rule and determinism."""
from __future__ import annotations

import random

import pytest
import torch

from mlaserve.kernels import fp8_gemm as fp8_gemm_mod
from mlaserve.kernels.fp8_gemm import fp8_linear, fp8_linear_ref
from mlaserve.kernels.fp8_gemv import FP8_GEMV_MAX_M, Fp8GemvConfig, fp8_gemv, fp8_gemv_config
from mlaserve.kernels.quant import block_quant_fp8_ref

# max |y - ref| / max |ref|. fp32 output: the same fp8 codes and scales as the reference (quantised in the kernel,
# bit-identical to per_token_group_quant_fp8), exact products, only the fp32 summation order differs: 1e-5 (one
# activation code off by one step would cost ~1e-3 at these K). CUDA: mma.sync sums each 16-deep chunk in its own
# order -> 1e-4. bf16 / fp16 output: one rounding on each side -> 1e-2 / 2e-3.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
FP32_CUDA_TOL = 1e-4

# (N, K, config): ragged last N block; the default split (every 128-channel group its own program here); one
# split with a ragged N tile of 64 rows; three splits of 3 / 3 / 2 groups.
CASES = [(200, 384, None), (130, 256, Fp8GemvConfig(64, 1)), (96, 1024, Fp8GemvConfig(128, 3))]


def _tol(dtype: torch.dtype, device: str) -> float:
    return FP32_CUDA_TOL if dtype == torch.float32 and device == "cuda" else TOL[dtype]


def _seed() -> None:
    seed = random.randrange(2**31)
    print(f"seed {seed}")
    torch.manual_seed(seed)


def _rel_max(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, device: str):
    x = (torch.randn(m, k, device=device) * torch.rand(m, 1, device=device) * 4).to(dtype)
    x[0, :128] = 0.0                                                     # an all-zero group: scale = MIN_SCALE
    w_q, w_s = block_quant_fp8_ref(torch.randn(n, k, device=device) * 0.05)
    return x, w_q, w_s, torch.randn(n, device=device).to(dtype)


@pytest.mark.parametrize("m", range(1, FP8_GEMV_MAX_M + 1))
@pytest.mark.parametrize("n,k,cfg", CASES)
def test_fp8_gemv_matches_ref(device: str, m: int, n: int, k: int, cfg: Fp8GemvConfig | None) -> None:
    _seed()
    x, w_q, w_s, bias = _inputs(m, n, k, torch.float16, device)
    y = fp8_gemv(x, w_q, w_s, config=cfg, out_dtype=torch.float32)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert _rel_max(y, fp8_linear_ref(x, w_q, w_s, out_dtype=torch.float32)) <= _tol(torch.float32, device)
    y = fp8_gemv(x, w_q, w_s, bias, config=cfg)
    assert y.dtype == torch.float16
    assert _rel_max(y, fp8_linear_ref(x, w_q, w_s, bias)) <= TOL[torch.float16]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_gemv_activation_dtypes(device: str, dtype: torch.dtype) -> None:
    _seed()
    x, w_q, w_s, bias = _inputs(FP8_GEMV_MAX_M, 200, 384, dtype, device)
    x = torch.cat([x, x], dim=1)[:, :384]                               # rows 768 apart
    y = fp8_gemv(x, w_q, w_s, bias)
    assert y.dtype == dtype and _rel_max(y, fp8_linear_ref(x, w_q, w_s, bias)) <= _tol(dtype, device)


def test_fp8_gemv_is_deterministic(device: str) -> None:
    _seed()
    x, w_q, w_s, bias = _inputs(3, 96, 1024, torch.float16, device)
    cfg = Fp8GemvConfig(128, 3)
    first = fp8_gemv(x, w_q, w_s, bias, out_dtype=torch.float32, config=cfg)
    assert all(torch.equal(first, fp8_gemv(x, w_q, w_s, bias, out_dtype=torch.float32, config=cfg))
               for _ in range(2))


def test_fp8_linear_routes_small_m_to_gemv(monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    _seed()
    x, w_q, w_s, bias = _inputs(FP8_GEMV_MAX_M + 1, 200, 384, torch.float16, device)
    gemm_path = fp8_gemm_mod._launch
    monkeypatch.setattr(fp8_gemm_mod, "_launch", None)                  # the GEMM path must not be reached
    monkeypatch.setattr(fp8_gemm_mod, "fp8_gemm", None)
    y = fp8_linear(x[:2].view(1, 2, 384), w_q, w_s, bias)
    assert y.shape == (1, 2, 200) and _rel_max(y, fp8_linear_ref(x[:2], w_q, w_s, bias)) <= TOL[torch.float16]
    monkeypatch.setattr(fp8_gemm_mod, "_launch", gemm_path)
    monkeypatch.setattr(fp8_gemm_mod, "fp8_gemv", None)                 # and now the gemv must not be
    fp8_linear(x, w_q, w_s, bias)                                        # M = FP8_GEMV_MAX_M + 1
    fp8_linear(x[:1], w_q, w_s, bias, gemv=False)


def test_fp8_linear_gemv_needs_whole_groups(monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    x, w_q, w_s, _ = _inputs(1, 64, 300, torch.float16, device)
    monkeypatch.setattr(fp8_gemm_mod, "fp8_gemv", None)
    assert _rel_max(fp8_linear(x, w_q, w_s), fp8_linear_ref(x, w_q, w_s)) <= TOL[torch.float16]
    with pytest.raises(AssertionError, match="multiple of 128"):
        fp8_gemv(x, w_q, w_s)
    with pytest.raises(AssertionError, match="at most"):
        fp8_gemv(torch.zeros(FP8_GEMV_MAX_M + 1, 256, device=device), w_q[:, :256], w_s[:, :2])


def test_split_k_rule_fills_the_sms() -> None:
    v3 = [(2112, 7168), (24576, 1536), (7168, 16384), (36864, 7168), (7168, 18432), (4096, 7168), (7168, 2048)]
    for n, k in v3:
        cfg = fp8_gemv_config(n, k, num_sms=132)
        tiles, groups = -(-n // cfg.block_n), k // 128
        per_split = -(-groups // cfg.split_k)
        assert -(-groups // per_split) == cfg.split_k, (n, k, cfg)     # no empty split
        assert tiles * cfg.split_k >= 132, (n, k, cfg)
        assert cfg.split_k == 1 or tiles * cfg.split_k <= 3 * 132, (n, k, cfg)
        assert (cfg.split_k == 1) == (tiles >= 132), (n, k, cfg)
