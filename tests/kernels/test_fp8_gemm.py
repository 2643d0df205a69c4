"""fp8_gemm / fp8_linear (Triton; interpreter on CPU) against their references, the in-GEMM activation
quantisation against the separate pass (bit-identical), config lookup, the tuner's search space and the bench
cases' arithmetic."""
from __future__ import annotations

import json
import logging
import random

import pytest
import torch

from mlaserve.bench.kernel_cases import fp8_gemm as gemm_cases
from mlaserve.bench.kernel_cases import quant as quant_cases
from mlaserve.kernels import fp8_gemm as fp8_gemm_mod
from mlaserve.kernels.fp8_gemm import fp8_gemm, fp8_gemm_ref, fp8_linear, fp8_linear_ref, get_fp8_gemm_config
from mlaserve.kernels.quant import block_dequant_ref, block_quant_fp8_ref, per_token_group_quant_fp8_ref
from mlaserve.tools import tune_fp8_gemm

# Tolerances, as max |y - ref| / max |ref|:
#   fp32 output vs the fp32 reference: same fp8 inputs, only the summation order differs -> 1e-5 under the
#   interpreter (exact products, fp32 sums). On CUDA (H100) tiles of 64+ rows run on fp8 wgmma, whose
#   tensor-core accumulator keeps fewer bits than fp32 within each 128-deep K-step (Triton does not promote
#   inside one fp8 tl.dot on sm_90): measured 2.1e-4 and 3.3e-4 at M=64 -> FP32_CUDA_TOL 2e-3;
#   bf16 output: both sides round once to bf16 (2^-8 relative) -> 1e-2.
# Against the unquantised matmul (quantisation error of the activations, e4m3 = 3 mantissa bits),
# as ||y - ref|| / ||ref||: about 0.026 for Gaussian activations -> 0.05.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
FP32_CUDA_TOL = 2e-3
QUANT_TOL = 0.05


def _tol(out_dtype: torch.dtype, device: str) -> float:
    return FP32_CUDA_TOL if out_dtype == torch.float32 and device == "cuda" else TOL[out_dtype]


def _rel_max(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _rel_norm(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def _operands(m: int, n: int, k: int, device: str):
    x_q, x_s = per_token_group_quant_fp8_ref(torch.randn(m, k, device=device))
    w_q, w_s = block_quant_fp8_ref(torch.randn(n, k, device=device) * 0.05)
    return x_q, x_s, w_q, w_s


@pytest.mark.parametrize("m", [1, 7, 64])
@pytest.mark.parametrize("n,k", [(200, 384), (256, 300)])             # N, then K, not multiples of 128
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_fp8_gemm_matches_ref(device: str, m: int, n: int, k: int, out_dtype: torch.dtype) -> None:
    x_q, x_s, w_q, w_s = _operands(m, n, k, device)
    y = fp8_gemm(x_q, x_s, w_q, w_s, out_dtype=out_dtype)
    assert y.shape == (m, n) and y.dtype == out_dtype
    assert _rel_max(y, fp8_gemm_ref(x_q, x_s, w_q, w_s, out_dtype=torch.float32)) <= _tol(out_dtype, device)


@pytest.mark.parametrize("cfg", [
    dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=1, SPLIT_K=3),      # split-K, two K-steps per scale
    dict(BLOCK_M=32, BLOCK_N=256, BLOCK_K=128, GROUP_M=2, SPLIT_K=1),    # tile spans two weight-scale rows
])
def test_fp8_gemm_tile_configs(device: str, cfg: dict) -> None:
    x_q, x_s, w_q, w_s = _operands(70, 300, 520, device)
    y = fp8_gemm(x_q, x_s, w_q, w_s, out_dtype=torch.float32, config=cfg)
    assert _rel_max(y, fp8_gemm_ref(x_q, x_s, w_q, w_s, out_dtype=torch.float32)) <= _tol(torch.float32, device)


def test_fp8_gemm_rejects_bad_scales(device: str) -> None:
    x_q, x_s, w_q, w_s = _operands(4, 200, 300, device)
    with pytest.raises(AssertionError, match="w_scale_inv"):
        fp8_gemm(x_q, x_s, w_q, w_s.t().contiguous())
    with pytest.raises(AssertionError, match="float8_e4m3fn"):
        fp8_gemm(x_q.float(), x_s, w_q, w_s)


def test_fp8_linear(device: str) -> None:
    x = torch.randn(2, 3, 300, device=device, dtype=torch.bfloat16)
    w_q, w_s = block_quant_fp8_ref(torch.randn(200, 300, device=device) * 0.05)
    bias = torch.randn(200, device=device, dtype=torch.bfloat16)
    y = fp8_linear(x, w_q, w_s, bias)
    assert y.shape == (2, 3, 200) and y.dtype == torch.bfloat16
    assert _rel_max(y, fp8_linear_ref(x, w_q, w_s, bias)) <= TOL[torch.bfloat16]
    dense = x.float() @ block_dequant_ref(w_q, w_s, dtype=torch.float32).t() + bias.float()
    assert _rel_norm(fp8_linear(x, w_q, w_s, out_dtype=torch.float32), dense - bias.float()) <= QUANT_TOL
    assert _rel_norm(y, dense) <= QUANT_TOL


def test_fp8_linear_uses_ref_on_plain_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(fp8_gemm_mod, "fp8_gemm", None)                  # must not be reached
    x = torch.randn(5, 256)
    w_q, w_s = block_quant_fp8_ref(torch.randn(130, 256))
    assert torch.equal(fp8_linear(x, w_q, w_s), fp8_linear_ref(x, w_q, w_s))


def test_config_lookup_nearest_m(tmp_path, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    monkeypatch.setattr(fp8_gemm_mod, "CONFIG_DIR", tmp_path)
    table = {m: dict(BLOCK_M=bm, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, SPLIT_K=s, num_warps=4, num_stages=3)
             for m, bm, s in [(1, 16, 2), (64, 64, 1), (2048, 128, 1)]}
    (tmp_path / fp8_gemm_mod.config_file_name(200, 384, "dev")).write_text(json.dumps(table))
    assert get_fp8_gemm_config(200, 384, 3, "dev") == table[1]
    assert get_fp8_gemm_config(200, 384, 40, "dev") == table[64]
    assert get_fp8_gemm_config(200, 384, 9000, "dev") == table[2048]
    with caplog.at_level(logging.WARNING, logger=fp8_gemm_mod.__name__):
        cfg = get_fp8_gemm_config(7168, 2048, 1, "dev")
        assert get_fp8_gemm_config(7168, 2048, 4096, "dev")["BLOCK_M"] == 128
    assert cfg["BLOCK_K"] == 128 and cfg["BLOCK_M"] == 16 and cfg["SPLIT_K"] > 1
    assert len(caplog.records) == 1                                      # one line per missing file


def test_tuned_config_drives_kernel(tmp_path, monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    monkeypatch.setattr(fp8_gemm_mod, "CONFIG_DIR", tmp_path)
    path = tmp_path / fp8_gemm_mod.config_file_name(96, 384, fp8_gemm_mod.current_device_name())
    x_q, x_s, w_q, w_s = _operands(5, 96, 384, device)
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=96, GROUP_M=1, SPLIT_K=2, num_warps=4, num_stages=3)
    path.write_text(json.dumps({"4": cfg}))                              # BLOCK_K must divide 128
    with pytest.raises(AssertionError, match="BLOCK_K"):
        fp8_gemm(x_q, x_s, w_q, w_s)
    fp8_gemm_mod._load_configs.cache_clear()
    path.write_text(json.dumps({"4": dict(cfg, BLOCK_K=128)}))
    y = fp8_gemm(x_q, x_s, w_q, w_s, out_dtype=torch.float32)
    assert _rel_max(y, fp8_gemm_ref(x_q, x_s, w_q, w_s, out_dtype=torch.float32)) <= _tol(torch.float32, device)


def test_tuner_search_space_and_cpu_exit() -> None:
    for m in (1, 16, 48, 4096):
        space = tune_fp8_gemm.search_space(m, 7168, 2048)
        assert space and all(128 % c["BLOCK_K"] == 0 for c in space)
        assert all(c["SPLIT_K"] == 1 for c in space) or m <= 64
    assert {c["BLOCK_M"] for c in tune_fp8_gemm.search_space(1, 7168, 2048)} == {16}
    assert tune_fp8_gemm.parse_shape("2112,7168") == (2112, 7168)
    if not torch.cuda.is_available():
        assert tune_fp8_gemm.main([]) == 1


def test_bench_case_arithmetic() -> None:
    assert gemm_cases.weight_bytes(7168, 2048) == 7168 * 2048 + 56 * 16 * 4
    assert gemm_cases.weight_bytes(2112, 7168) == 2112 * 7168 + 17 * 56 * 4
    assert gemm_cases.gemm_flops(4096, 7168, 16384) == 2 * 4096 * 7168 * 16384
    assert len(gemm_cases.shape_grid(quick=False)) == 24
    assert quant_cases.quant_bytes(4096, 7168) == 4096 * 7168 * 3 + 4096 * 56 * 4


@pytest.mark.parametrize("m,n,k", [(1, 200, 384), (5, 256, 300), (64, 96, 1000), (70, 130, 256)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_linear_fused_quant_is_bit_identical(m: int, n: int, k: int, dtype: torch.dtype, device: str) -> None:
    """Activations quantised inside the GEMM give the same bits as the separate per_token_group_quant_fp8 pass
    (same codes, same scales, same tiles), with and without split-K, K not a multiple of 128."""
    seed = random.randrange(2**31)
    print(f"seed {seed}")
    torch.manual_seed(seed)
    x = (torch.randn(m, k, device=device) * torch.rand(m, 1, device=device) * 4).to(dtype)
    x[0, : min(k, 128)] = 0.0                                            # an all-zero group: scale = MIN_SCALE
    w_q, w_s = block_quant_fp8_ref(torch.randn(n, k, device=device) * 0.05)
    cfg = get_fp8_gemm_config(n, k, m)
    fused = fp8_linear(x, w_q, w_s, fuse_quant=True, gemv=False)
    two_pass = fp8_linear(x, w_q, w_s, fuse_quant=False, gemv=False)
    assert torch.equal(fused, two_pass), (cfg, (fused.float() - two_pass.float()).abs().max().item())
    assert _rel_max(fused, fp8_linear_ref(x, w_q, w_s)) <= TOL[torch.bfloat16]


def test_fp8_linear_fuses_quant_for_small_m(monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    calls = []
    monkeypatch.setattr(fp8_gemm_mod, "per_token_group_quant_fp8",
                        lambda x, g, **kw: calls.append(x.shape[0]) or per_token_group_quant_fp8_ref(x, g))
    w_q, w_s = block_quant_fp8_ref(torch.randn(64, 256, device=device))
    for m in (1, fp8_gemm_mod.FUSE_QUANT_MAX_M, fp8_gemm_mod.FUSE_QUANT_MAX_M + 1):
        fp8_linear(torch.randn(m, 256, device=device), w_q, w_s, gemv=False)
    assert calls == [fp8_gemm_mod.FUSE_QUANT_MAX_M + 1]


def test_fp8_linear_cublas_rule(device: str) -> None:
    """cuBLAS's block-FP8 matmul is chosen only for CUDA activations of CUBLAS_BLOCK_FP8_MIN_M+ rows, K in whole groups
    of 4 x 128 channels, N a multiple of 16, on a GPU that has it; everything else stays on the Triton GEMM."""
    m = fp8_gemm_mod.CUBLAS_BLOCK_FP8_MIN_M
    w_q, _ = block_quant_fp8_ref(torch.randn(64, 512))
    assert not fp8_gemm_mod.cublas_block_fp8_ok(torch.randn(m, 512), w_q)            # CPU tensors
    if device != "cuda" or not fp8_gemm_mod.cublas_block_fp8_available(torch.cuda.current_device()):
        return
    w_q = w_q.cuda()
    assert fp8_gemm_mod.cublas_block_fp8_ok(torch.randn(m, 512, device="cuda"), w_q)
    assert not fp8_gemm_mod.cublas_block_fp8_ok(torch.randn(m - 1, 512, device="cuda"), w_q)
    w_q384, _ = block_quant_fp8_ref(torch.randn(64, 384, device="cuda"))
    assert not fp8_gemm_mod.cublas_block_fp8_ok(torch.randn(m, 384, device="cuda"), w_q384)


def test_cublas_rows() -> None:
    assert [fp8_gemm_mod.cublas_rows(m) for m in (128, 129, 515, 4096)] == [128, 132, 516, 4096]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLAS block-FP8 needs a GPU")
@pytest.mark.parametrize("m", [512, 515, 1000])
@pytest.mark.parametrize("n,k", [(2112, 1024), (512, 512)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_fp8_linear_cublas_matches_triton(m: int, n: int, k: int, out_dtype: torch.dtype) -> None:
    """cuBLAS's path against the reference and the Triton GEMM, M not a multiple of 4 and N not of 128 included."""
    if not fp8_gemm_mod.cublas_block_fp8_available(torch.cuda.current_device()):
        pytest.skip("this GPU / torch lacks cuBLAS block-scaled FP8 (CUDA >= 12.9, compute capability 9.0)")
    seed = random.randrange(2**31)
    print(f"seed {seed}")
    torch.manual_seed(seed)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w_q, w_s = block_quant_fp8_ref(torch.randn(n, k, device="cuda") * 0.05)
    bias = torch.randn(n, device="cuda", dtype=out_dtype)
    ref = fp8_linear_ref(x, w_q, w_s, bias, out_dtype=torch.float32)
    y = fp8_linear(x, w_q, w_s, bias, out_dtype=out_dtype, cublas=True)
    assert y.dtype == out_dtype and y.shape == (m, n)
    assert _rel_max(y, ref) <= _tol(out_dtype, "cuda")
    assert _rel_max(y, fp8_linear(x, w_q, w_s, bias, out_dtype=out_dtype, cublas=False)) <= _tol(out_dtype, "cuda")


def test_quant_plan_follows_fp8_linear_dispatch(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A producer quantises ahead exactly where fp8_linear would run its own quantisation pass: not for the gemv's
    rows nor the GEMM that quantises inside (up to FUSE_QUANT_MAX_M), row-major scales for the Triton GEMM, M-major
    over cuBLAS's padded rows where that path is taken."""
    w_q, _ = block_quant_fp8_ref(torch.randn(64, 512, device=device))
    x = torch.empty(0, device=device)
    small = fp8_gemm_mod.FUSE_QUANT_MAX_M
    assert fp8_gemm_mod.quant_plan(1, x, w_q) is None and fp8_gemm_mod.quant_plan(small, x, w_q) is None
    assert fp8_gemm_mod.quant_plan(small + 1, x, w_q) == fp8_gemm_mod.QuantPlan(False, small + 1)
    m = fp8_gemm_mod.CUBLAS_BLOCK_FP8_MIN_M + 1
    want = fp8_gemm_mod.QuantPlan(True, fp8_gemm_mod.cublas_rows(m)) \
        if fp8_gemm_mod.cublas_block_fp8_ok(torch.empty(m, 512, device=device), w_q) else fp8_gemm_mod.QuantPlan(False, m)
    assert fp8_gemm_mod.quant_plan(m, x, w_q) == want
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert fp8_gemm_mod.quant_plan(m, torch.empty(0), w_q.cpu()) is None       # plain CPU runs the reference


@pytest.mark.parametrize("m", [fp8_gemm_mod.FUSE_QUANT_MAX_M + 1, fp8_gemm_mod.CUBLAS_BLOCK_FP8_MIN_M + 3])
def test_fp8_linear_quantized_is_fp8_linear(m: int, device: str) -> None:
    """The GEMM of an input quantised ahead in quant_plan's layout is fp8_linear's, bit for bit (bias included)."""
    from mlaserve.kernels.quant import per_token_group_quant_fp8
    seed = random.randrange(2**31)
    print(f"seed {seed}")
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x = torch.randn(m, 512, device=device, dtype=dtype)
    w_q, w_s = block_quant_fp8_ref(torch.randn(96, 512, device=device) * 0.05)
    bias = torch.randn(96, device=device, dtype=dtype)
    plan = fp8_gemm_mod.quant_plan(m, x, w_q)
    assert plan is not None
    x_q, x_s = per_token_group_quant_fp8(x, 128, scale_m_major=plan.scale_m_major, out_rows=plan.rows)
    y = fp8_gemm_mod.fp8_linear_quantized(x_q, x_s, m, plan, w_q, w_s, bias, dtype)
    assert y.shape == (m, 96) and torch.equal(y, fp8_linear(x, w_q, w_s, bias))
