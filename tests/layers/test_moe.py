"""The MoE layer's own fused-MoE calls read the shipped tuned tables (DeepSeek-V2-Lite and V3, TP 1 and the TP-8
rank shape) on the GPUs they were tuned on; the tuner and `bench kernels` use the same key; a GPU without a
table gets one WARNING per shape.

The layer runs at the real sizes on meta tensors (no memory, no GPU), built with the Triton kernel set: its
forward and the fused-MoE launcher's table lookup run for real, only the Triton launches are stubbed.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch

import mlaserve
from mlaserve.bench.kernel_cases import fused_moe as bench_case
from mlaserve.config import ModelConfig
from mlaserve.kernels import fused_moe as fm
from mlaserve.layers import moe as moe_layer
from mlaserve.layers.ops import Ops, get_ops
from mlaserve.tools import tune_fused_moe as tuner

CONFIGS = Path(mlaserve.__file__).parent / "tools" / "configs"
SHIPPED_GPUS = ("NVIDIA_H100_80GB_HBM3", "NVIDIA_H200")
# (model config, TP size): the per-rank shapes the tables were tuned for
SHAPES = [("deepseek-v2-lite", 1), ("deepseek-v3", 1), ("deepseek-v3", 8)]
TOKENS = (1, 64, 256, 1024)      # decode (shared slots fused into the call) and prefill (shared as dense GEMMs)


class OnGPU(torch.Tensor):
    """A meta tensor that answers `is_cuda` with True (and so do the tensors computed from it)."""

    @property
    def is_cuda(self) -> bool:
        return True


def gpu_input(t: int, hidden: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(t, hidden, dtype=dtype, device="meta").as_subclass(OnGPU)


def rank_config(name: str, tp: int) -> ModelConfig:
    """The model's config with one TP rank's expert width (TP splits each expert's intermediate size)."""
    cfg = ModelConfig.from_hf(CONFIGS / f"{name}.json")
    return dataclasses.replace(cfg, moe_intermediate_size=cfg.moe_intermediate_size // tp)


def stub_launches(monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], Ops]:
    """Replace every Triton launch on the MoE path by a shape-only stand-in; returns the table files looked up
    and the kernel set to build the layer with (the real `fused_moe` launcher, the other ops stubbed)."""
    looked_up: list[str] = []
    real_load = fm._load_configs

    def load(path: Path):
        looked_up.append(path.name)
        return real_load(path)

    def topk(logits: torch.Tensor, k: int, n_shared: int = 0, **_: object):
        t, k = logits.shape[0], k + n_shared
        return logits.new_empty(t, k, dtype=torch.float32), logits.new_empty(t, k, dtype=torch.int32)

    monkeypatch.setattr(fm, "_load_configs", load)
    monkeypatch.setattr(fm, "moe_align_block_size", lambda ids, bm, e: (None, None, None))
    monkeypatch.setattr(fm, "_grouped_gemm", lambda *args: None)
    monkeypatch.setattr(fm, "sum_dim1", lambda y, out, rows=False: out)
    ops = get_ops("triton")._replace(
        moe_topk=topk, moe_route=lambda x, w, k, **kw: topk(x, k, **kw), fused_moe=fm.fused_moe, silu_and_mul=lambda gu: gu[:, : gu.shape[1] // 2],
        fp8_linear=lambda x, w, s: x.new_empty(x.shape[0], w.shape[0]), fp8_quant_plan=lambda m, x, w: None)
    return looked_up, ops


def small_config(name: str, moe_intermediate_size: int) -> tuple[ModelConfig, str]:
    """The model's config scaled down (hidden 64, 16 routed experts), the device to run on; seeds torch (printed)."""
    seed = int(torch.randint(0, 2**31, ()).item())
    print(f"seed {seed}")
    torch.manual_seed(seed)
    cfg = dataclasses.replace(ModelConfig.from_hf(CONFIGS / f"{name}.json"), hidden_size=64,
                              moe_intermediate_size=moe_intermediate_size, n_routed_experts=16)
    return cfg, "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("gpu", SHIPPED_GPUS)
@pytest.mark.parametrize("name,tp", SHAPES)
def test_model_moe_calls_read_a_shipped_table(name: str, tp: int, gpu: str, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    cfg = rank_config(name, tp)
    looked_up, ops = stub_launches(monkeypatch)
    monkeypatch.setattr(fm, "gpu_name", lambda: gpu)
    layer = moe_layer.MoE(cfg, quant=cfg.quant, dtype=torch.bfloat16, device="meta", ops=ops)
    assert layer.experts.w13.shape[0] == cfg.n_routed_experts + cfg.n_shared_experts   # shared slots stacked
    with caplog.at_level(logging.WARNING, logger=fm.__name__):
        for t in TOKENS:
            layer(gpu_input(t, cfg.hidden_size))
    dtype = "fp8_w8a8" if cfg.quant else "bf16"
    want = f"E={cfg.n_routed_experts},N={cfg.moe_intermediate_size},device_name={gpu},dtype={dtype}"
    assert looked_up and all(n.startswith(want) for n in looked_up), looked_up
    assert all((fm.CONFIG_DIR / n).is_file() for n in looked_up), f"not shipped: {sorted(set(looked_up))}"
    assert not [r for r in caplog.records if "no tuned table" in r.getMessage()]


@pytest.mark.parametrize("name,tp", SHAPES)
def test_tuner_and_bench_write_and_read_the_models_key(name: str, tp: int, tmp_path: Path) -> None:
    cfg = rank_config(name, tp)
    dtype = "fp8_w8a8" if cfg.quant else "bf16"
    model_key = fm.config_file_name(cfg.n_routed_experts, cfg.moe_intermediate_size, dtype, "GPU")
    shape = tuner.shape_from_hf_config(CONFIGS / f"{name}.json", tp, dtype)
    assert tuner.write_configs({"1": {}}, shape, dtype, tmp_path, device_name="GPU").name == model_key
    bench = next(s for s in bench_case.MODELS if s.name == name)      # the bench calls with its routed experts
    assert fm.config_file_name(bench.num_experts, bench.moe_intermediate_size,
                               "fp8_w8a8" if bench.fp8 else "bf16", "GPU") == \
        fm.config_file_name(cfg.n_routed_experts, cfg.moe_intermediate_size * tp, dtype, "GPU")


def test_gpu_without_a_table_warns_once_per_shape(monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    cfg = rank_config("deepseek-v2-lite", 1)
    _, ops = stub_launches(monkeypatch)
    monkeypatch.setattr(fm, "gpu_name", lambda: "Untuned_GPU")
    fm._warn_untuned.cache_clear()
    layer = moe_layer.MoE(cfg, quant=None, dtype=torch.bfloat16, device="meta", ops=ops)
    with caplog.at_level(logging.WARNING, logger=fm.__name__):
        for t in (1, 2, 64, 1024):                                           # one shape, many token counts
            layer(gpu_input(t, cfg.hidden_size))
        layer.float()(gpu_input(1, cfg.hidden_size, torch.float32))        # a second shape (fp32 experts)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("\n" not in w and "Untuned_GPU" in w for w in warnings), warnings
    assert "dtype=bf16" in warnings[0] and "dtype=fp32" in warnings[1]


def test_shipped_tables_parse() -> None:
    for path in fm.CONFIG_DIR.glob("E=*.json"):
        table = json.loads(path.read_text())
        assert table and all({"BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K"} <= set(c) for c in table.values())


@pytest.mark.parametrize("name", ["deepseek-v2-lite", "deepseek-v3"])
@pytest.mark.parametrize("tokens", [3, moe_layer.ROUTE_FUSED_MAX_TOKENS + 4])   # one-launch router; cuBLAS + top-k
def test_moe_layer_triton_matches_torch_kernels(name: str, tokens: int, one_thread) -> None:
    """A scaled-down MoE layer (shared experts fused into the call) on the Triton kernels (CPU: interpreter, fp32)
    equals the torch kernel set; both router paths."""
    cfg, device = small_config(name, 32)
    layers = [moe_layer.MoE(cfg, quant=None, dtype=torch.float32, device=device, ops=get_ops(k))
              for k in ("triton", "torch")]
    for p, q in zip(layers[0].parameters(), layers[1].parameters()):
        q.data.copy_(p.data.normal_(0, 0.2))
    x = torch.randn(tokens, cfg.hidden_size, device=device)
    got, want = (layer(x) for layer in layers)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    assert not layers[0].gate.route_sync.any()


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("shared", ["fused", "dense"])
def test_masked_rows_route_to_no_expert(kernels: str, shared: str, one_thread, monkeypatch) -> None:
    """`MoE.forward(x, row_mask)` (DP attention's padding rows under decode graphs): masked rows reach the
    experts with every slot -1 (no expert's weights read for them) and give zero, or only the shared experts where
    those run as dense GEMMs (past FUSE_SHARED_MAX_TOKENS rows, lowered here to 8: 12 rows instead of 260, which
    took 23 s interpreted); every other row is exactly the unmasked layer's."""
    tokens = 4
    if shared == "dense":
        monkeypatch.setattr(moe_layer, "FUSE_SHARED_MAX_TOKENS", 8)
        tokens = 12
    seed = int(torch.randint(0, 2**31, ()).item())
    print(f"seed {seed}")
    torch.manual_seed(seed)
    cfg = dataclasses.replace(ModelConfig.from_hf(CONFIGS / "deepseek-v3.json"), hidden_size=64,
                              moe_intermediate_size=32, n_routed_experts=16)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layer = moe_layer.MoE(cfg, quant=None, dtype=torch.float32, device=device, ops=get_ops(kernels))
    for p in layer.parameters():
        p.data.normal_(0, 0.2)
    x = torch.randn(tokens, cfg.hidden_size, device=device)
    mask = torch.rand(tokens, device=device) < 0.5
    mask[0], mask[-1] = True, False
    seen = []
    experts = layer.experts.forward
    monkeypatch.setattr(layer.experts, "forward", lambda x, w, ids: seen.append(ids) or experts(x, w, ids))
    want, got = layer(x), layer(x, mask)
    assert (seen[1][~mask] == -1).all() and (seen[1][mask] == seen[0][mask]).all()
    torch.testing.assert_close(got[mask], want[mask], rtol=1e-5, atol=1e-5)   # fp32: GEMMs over fewer rows
    shared_dense = tokens > moe_layer.FUSE_SHARED_MAX_TOKENS
    pad = layer.experts.shared_forward(x[~mask]) if shared_dense else torch.zeros_like(got[~mask])
    torch.testing.assert_close(got[~mask], pad)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("padded", [False, True])
def test_shared_experts_side_by_side_equal_one_pair_each(kernels: str, padded: bool, one_thread, monkeypatch) -> None:
    """V2-Lite's two shared experts as dense GEMMs (prefill sizes): one gate / up GEMM over both, one SwiGLU, and
    the second down GEMM adding into the first, equal the sum of one GEMM pair per expert (fp32 on the CPU, bf16
    within rounding on a GPU); also with the rows padded to cublas_linear's bucket (`padded`: as on the GPU, forced
    on the CPU)."""
    seed = int(torch.randint(0, 2**31, ()).item())
    print(f"seed {seed}")
    torch.manual_seed(seed)
    cfg = dataclasses.replace(ModelConfig.from_hf(CONFIGS / "deepseek-v2-lite.json"), hidden_size=64,
                              moe_intermediate_size=32, n_routed_experts=8)
    assert cfg.n_shared_experts == 2
    gpu = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    monkeypatch.setattr(moe_layer, "pads_rows", lambda x: padded)
    layer = moe_layer.MoE(cfg, quant=None, dtype=dtype, device=device, ops=get_ops(kernels))
    for p in layer.parameters():
        p.data.normal_(0, 0.2)
    ex = layer.experts
    x = torch.randn(70, cfg.hidden_size, device=device, dtype=dtype)     # 70 rows: bucket_rows pads them to 80
    shared = range(ex.n_routed, ex.n_routed + ex.n_shared)
    want = sum(ex.dense_forward(x, range(s, s + 1)) for s in shared)     # one expert at a time: the loop
    got = ex.shared_forward(x)
    assert got.shape == want.shape
    tol = 2e-2 if gpu else 1e-5                 # bf16: the loop rounds each expert's sum before adding them
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("name", ["deepseek-v2-lite", "deepseek-v3"])      # 2 shared experts; 1 (bf16 here)
def test_shared_experts_in_the_router_equal_the_fused_call(name: str, one_thread, monkeypatch) -> None:
    """One token with the next layer's norm (the decode step's MoE): the shared slots' gate / up in the router's
    launch, then the fused MoE over the routed slots and the down GEMM over all, equal the fused call of every slot
    (Triton kernels; CPU: interpreter, fp32), and the router's launch is the one that took them."""
    from mlaserve.layers.rmsnorm import RMSNorm

    cfg, device = small_config(name, 48)
    ops = get_ops("triton")
    calls: list[bool] = []
    route_norm = ops.moe_route_norm
    ops = ops._replace(moe_route_norm=lambda *a, **kw: calls.append("shared" in kw) or route_norm(*a, **kw))
    layer = moe_layer.MoE(cfg, quant=None, dtype=torch.float32, device=device, ops=ops)
    for p in layer.parameters():
        p.data.normal_(0, 0.2)
    norms = [RMSNorm(cfg.hidden_size, 1e-6, dtype=torch.float32, device=device, ops=ops) for _ in range(2)]
    for n in norms:
        n.weight.data.uniform_(0.5, 1.5)
    x, residual = torch.randn(2, 1, cfg.hidden_size, device=device)
    outs = []
    for on in (True, False):
        layer.shared_in_router_on = on
        outs.append(layer.forward_normed(x, residual, norms[0], next_norm=norms[1]))
    assert calls == [True, False]
    for got, want in zip(*outs):
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    assert not layer.gate.route_sync.any() and not layer.experts.combine_sync.any()


def test_shared_in_router_switch(monkeypatch) -> None:
    monkeypatch.setenv("MLASERVE_SHARED_IN_ROUTER", "0")
    assert not moe_layer.shared_in_router_enabled()
    monkeypatch.setenv("MLASERVE_SHARED_IN_ROUTER", "yes")
    with pytest.raises(ValueError, match="MLASERVE_SHARED_IN_ROUTER='yes': expected 0 or 1"):
        moe_layer.shared_in_router_enabled()
