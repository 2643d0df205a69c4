"""Expert parallelism (--ep-size = --tp-size 2) on the CPU (gloo) against one process: the model through the Engine
API on V2 and V3-FP8 shapes (16 routed experts), the MoE layer's two EP halves summing to the whole (PyTorch and
Triton-interpreter kernels), each rank reading and holding only its experts, and the flag's one-line errors."""
from __future__ import annotations

import dataclasses
import json
import os
import random
from pathlib import Path

import pytest
import torch

import mlaserve
from mlaserve.config import ConfigError, ModelConfig, ServerConfig
from mlaserve.config_resolve import DeviceInfo, resolve_config
from mlaserve.distributed import TensorParallel
from mlaserve.distributed.expert import ExpertParallel
from mlaserve.layers import moe as moe_layer
from mlaserve.layers.ops import get_ops
from mlaserve.models import weights as weights_mod
from mlaserve.models.deepseek import DeepseekForCausalLM
from mlaserve.tools.make_checkpoint import make_config
from parallel_common import (VARIANTS as ALL_VARIANTS, assert_fp8_logprobs_close, assert_fp8_outputs_close,
                             checkpoint_builder)
from seq_runner import SeqRunner

CONFIGS = Path(mlaserve.__file__).parent / "tools" / "configs"
# name -> (source config, overrides, fp8, widths set after shrinking); 16 routed experts each (8 per rank)
VARIANTS = {k: ALL_VARIANTS[k] for k in ('v2', 'v3-fp8')}
# Block FP8 re-quantises every linear's input (e4m3, 3 mantissa bits): the last-bit differences of TP attention's
# all-reduce now and then flip one rounding and move what follows (tests/parallel_common.py has the tp 2
# measurement; here max 0.13, median 1e-4 in one run). Run as FP8, the V3 checkpoint is held to FP8's bounds
# there; dequantised to fp32 (--dequant-fp8: the same experts and partition, no re-quantisation), like V2, to 1e-4;
# that run also decodes speculatively (its MTP layer's experts are partitioned too; greedy outputs must not change).
# case -> (checkpoint, Engine flags beside --tp-size 2 --ep-size 2)
CASES = {"v2": ("v2", {}), "v3-fp8": ("v3-fp8", {}),
         "v3-fp8-dequant-spec": ("v3-fp8", {"dequant_fp8": True, "speculative_algorithm": "EAGLE"})}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoint_builder(tmp_path_factory.mktemp("ep"))


def engine_run(path: str, prompts: list[list[int]], **server) -> tuple[list[dict], dict]:
    with mlaserve.Engine(model_path=path, device="cpu", log_level="warning", **server) as engine:
        # ignore_eos: the reference below decodes MAX_NEW tokens whatever they are (a random prompt now and then
        # makes the checkpoint's eos the greedy choice)
        outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0,
                                                                   "ignore_eos": True},
                               return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
        return outs, engine.get_server_info()


def one_process(path: str, prompts: list[list[int]],
                dequant_fp8: bool = False) -> list[tuple[list[float], list[int], list[float]]]:
    """The single process (tp 1, fp32, in this process: no Engine start): per prompt, its prompt log-probs, the
    greedy tokens and each greedy choice's margin over the runner-up."""
    cfg = ModelConfig.from_hf(path)
    model = DeepseekForCausalLM(cfg, dtype=torch.float32, device="cpu", kernels="torch", dequant_fp8=dequant_fp8)
    weights_mod.load_weights(model, cfg, path, progress=False, dequant_fp8=dequant_fp8)
    runner, out = SeqRunner(model, cfg), []
    for rid, p in enumerate(prompts):
        lp = runner.extend({rid: p}, all_logits=True).logits.log_softmax(-1)               # [len(p), V]
        prompt_lp = [lp[q, p[q + 1]].item() for q in range(len(p) - 1)]
        ids, margins = [], []
        for _ in range(MAX_NEW):
            top = lp[-1].topk(2).values
            ids.append(int(lp[-1].argmax()))
            margins.append((top[0] - top[1]).item())
            lp = runner.decode({rid: ids[-1]}).logits.log_softmax(-1)
        out.append((prompt_lp, ids, margins))
    return out


MAX_NEW = 8


def seeded_prompts(n: int) -> list[list[int]]:
    seed = int(os.environ.get("TEST_SEED") or random.randrange(2**31))     # TEST_SEED=N replays a printed seed
    print(f"seed {seed}")
    rng = random.Random(seed)
    return [[rng.randrange(5, 4000) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def logprob_diffs(ref: list, got: list[dict]) -> list[float]:
    """|d log p| at every prompt position between `one_process` and the Engine's outputs."""
    return [abs(x - y) for (lps, _, _), o in zip(ref, got)
            for x, y in zip(lps, [lp for lp, *_ in o["meta_info"]["input_token_logprobs"][1:]], strict=True)]


@pytest.mark.parametrize("case", list(CASES))
def test_ep2_equals_tp1_through_the_engine(checkpoint, case, one_thread):
    prompts = seeded_prompts(3)
    variant, flags = CASES[case]
    dequant = flags.get("dequant_fp8", False)
    path = checkpoint(variant)
    got, info = engine_run(path, prompts, tp_size=2, ep_size=2, **flags)
    assert (info["tp_size"], info["ep_size"]) == (2, 2)
    if "speculative_algorithm" in flags:
        assert info["speculative_num_steps"] == 3 and all(o["meta_info"]["spec_verify_ct"] >= 1 for o in got)
    ref = one_process(path, prompts, dequant)
    diffs = sorted(logprob_diffs(ref, got))
    print(f"|d log p| over {len(diffs)} positions: max {diffs[-1]:.2e}, median {diffs[len(diffs) // 2]:.2e}")
    if dequant or not VARIANTS[variant][2]:
        assert diffs[-1] <= 1e-4, diffs[-1]
        assert [ids for _, ids, _ in ref] == [o["output_ids"] for o in got]
        return
    assert_fp8_logprobs_close(diffs)
    # NOTE: greedy tokens against the single-process Engine on the same batch (as the tp 2 test does): against the
    # reference above, which decodes each prompt alone, a batch's last-bit differences flipped one e4m3 rounding or
    # routing choice and a greedy token with a 2.2 margin (seed 752050335); the Engine at tp 1, tp 2 and tp 2 ep 2
    # gave the same tokens there
    one, _ = engine_run(path, prompts, tp_size=1, **flags)
    assert_fp8_outputs_close(one, got)


# case -> (checkpoint, Engine flags): four ranks in two expert sets of two, each set splitting its 8 experts'
# intermediate dimension over its two ranks; plain tensor parallel, and four DP-attention groups of one rank whose
# rows reach both ranks of their experts' set by all-to-all
SETS = {"tp4-ep2": ("v3", dict(tp_size=4, ep_size=2)),
        "tp4-dp4-ep2-all-to-all": ("v2", dict(tp_size=4, dp_size=4, enable_dp_attention=True, ep_size=2,
                                              moe_dispatch="all_to_all", load_balance_method="round_robin"))}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SETS))
def test_expert_sets_of_two_ranks_equal_tp1(checkpoint, case, one_thread):
    prompts = seeded_prompts(4)
    variant, flags = SETS[case]
    path = checkpoint(variant)
    got, info = engine_run(path, prompts, **flags)
    assert (info["tp_size"], info["ep_size"]) == (4, 2)
    ref = one_process(path, prompts)
    diffs = logprob_diffs(ref, got)
    assert max(diffs) <= 1e-4, max(diffs)
    assert [ids for _, ids, _ in ref] == [o["output_ids"] for o in got]


TWO_GPU_LAYOUTS = {
    "tp2-ep2": dict(tp_size=2, ep_size=2),
    "tp2-dp2": dict(tp_size=2, dp_size=2, enable_dp_attention=True),
    "tp2-dp2-ep2": dict(tp_size=2, dp_size=2, enable_dp_attention=True, ep_size=2),
    "tp2-dp2-ep2-a2a": dict(tp_size=2, dp_size=2, enable_dp_attention=True, ep_size=2, moe_dispatch="all_to_all"),
}


@pytest.mark.multi_gpu
@pytest.mark.parametrize("layout", list(TWO_GPU_LAYOUTS))
def test_two_gpus_equal_one_gpu(checkpoint, layout):
    """NCCL, peer buffers, the Triton fused-MoE with sentinel ids and CUDA graphs, in float32: == tp 1."""
    prompts = seeded_prompts(4)
    path = checkpoint("v2")
    flags = dict(device="cuda", dtype="float32", max_total_tokens=4096)
    runs = []
    for par in (dict(tp_size=1), TWO_GPU_LAYOUTS[layout]):
        with mlaserve.Engine(model_path=path, log_level="warning", **flags, **par) as engine:
            runs.append(engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 16, "temperature": 0},
                                        return_logprob=True, logprob_start_len=0))
            assert not engine.get_server_info()["disable_cuda_graph"]
    ref, got = runs
    assert [o["output_ids"] for o in ref] == [o["output_ids"] for o in got]
    diff = max(abs(x[0] - y[0]) for a, b in zip(ref, got)
               for x, y in zip(a["meta_info"]["input_token_logprobs"][1:], b["meta_info"]["input_token_logprobs"][1:]))
    assert diff <= 1e-4, diff


# --- the MoE layer: two EP ranks' partial outputs sum to one process's ---------------------------------------

def small_moe_config(n_shared: int) -> ModelConfig:
    d = json.loads((CONFIGS / "deepseek-v3.json").read_text())
    d = make_config(d, num_layers=2, shrink=True, fp8=False)
    cfg = ModelConfig.from_dict(d)
    return dataclasses.replace(cfg, hidden_size=64, moe_intermediate_size=32, n_shared_experts=n_shared)


def _fill(layer: moe_layer.MoE, src: moe_layer.MoE, rank: int, size: int) -> None:
    """Give an EP rank's layer the weights of the single-process layer `src` (the checkpoint's values)."""
    ex, n, i = layer.experts, layer.experts.n_routed, src.experts.i
    lo = rank * n
    layer.gate.weight.data.copy_(src.gate.weight)
    if src.gate.e_score_correction_bias is not None:
        layer.gate.e_score_correction_bias.data.copy_(src.gate.e_score_correction_bias)
    ex.w13.data.copy_(src.experts.w13[lo:lo + n])
    ex.w2.data.copy_(src.experts.w2[lo:lo + n])
    if ex.n_shared:                     # shared slots of size I, TP-split: gate / up rows and down columns
        part = i // size
        w13 = src.experts.w13[src.experts.n_routed:]                          # [n_shared, 2I, h]
        gate, up = w13[:, :i], w13[:, i:]
        ex.shared.w13.data.copy_(torch.cat([gate[:, rank * part:(rank + 1) * part],
                                            up[:, rank * part:(rank + 1) * part]], dim=1))
        ex.shared.w2.data.copy_(src.experts.w2[src.experts.n_routed:, :, rank * part:(rank + 1) * part])


@pytest.mark.parametrize("kernels,n_shared,tokens", [("torch", 2, 300), ("triton", 1, 5)])
def test_moe_layer_ep_halves_sum_to_the_whole(kernels: str, n_shared: int, tokens: int, one_thread) -> None:
    """300 tokens: shared experts as dense GEMMs in both; 5 tokens: fused into the single process's MoE call."""
    seed = random.randrange(2**31)
    print(f"seed {seed}")
    torch.manual_seed(seed)
    cfg, ops = small_moe_config(n_shared), get_ops(kernels)
    whole = moe_layer.MoE(cfg, quant=None, dtype=torch.float32, device="cpu", ops=ops)
    for p in whole.parameters():
        p.data.normal_(0, 0.2)
    whole.gate.post_load()
    x = torch.randn(tokens, cfg.hidden_size)
    parts = []
    for rank in range(2):
        layer = moe_layer.MoE(cfg, quant=None, dtype=torch.float32, device="cpu", ops=ops,
                              tp=TensorParallel(rank, 2), ep=ExpertParallel(rank, 2))
        assert layer.experts.w13.shape[:2] == (cfg.n_routed_experts // 2, 2 * cfg.moe_intermediate_size)
        _fill(layer, whole, rank, 2)
        layer.gate.post_load()
        parts.append(layer(x))
    want = whole(x)
    err = ((parts[0] + parts[1] - want).abs().max() / want.abs().max()).item()
    assert err < 1e-5, err


# --- loading: each rank reads and holds only its experts ------------------------------------------------------

def routed_bytes(model: torch.nn.Module) -> int:
    total = 0
    for mod in model.modules():
        if isinstance(mod, moe_layer.RoutedExperts):
            n = mod.n_routed
            total += sum(p[:n].numel() * p.element_size() for p in (mod.w13, mod.w2, mod.w13_scale, mod.w2_scale)
                         if p is not None)
    return total


def test_each_rank_reads_and_holds_only_its_experts(checkpoint, monkeypatch) -> None:
    path = checkpoint("v3-fp8")
    cfg = ModelConfig.from_hf(path)
    read: list[str] = []
    real = weights_mod.iter_safetensors

    def spy(p, skip=None):
        n, items = real(p, skip)
        return n, ((read.append(name), (name, t))[1] for name, t in items)
    monkeypatch.setattr(weights_mod, "iter_safetensors", spy)
    kw = dict(dtype=torch.float32, device="cpu", kernels="torch")
    one = DeepseekForCausalLM(cfg, **kw)
    weights_mod.load_weights(one, cfg, path, progress=False)
    everything = set(read)
    n_half = cfg.n_routed_experts // 2
    for rank in range(2):
        read.clear()
        model = DeepseekForCausalLM(cfg, tp=TensorParallel(rank, 2), ep=ExpertParallel(rank, 2), **kw)
        weights_mod.load_weights(model, cfg, path, progress=False)
        experts = [int(n.split(".experts.")[1].split(".")[0]) for n in read if ".mlp.experts." in n]
        assert experts and all(rank * n_half <= e < (rank + 1) * n_half for e in experts)
        skipped = {n for n in everything - set(read)}
        assert skipped and all(".mlp.experts." in n for n in skipped)        # nothing else left unread
        assert 2 * routed_bytes(model) == routed_bytes(one)                   # half the routed experts' bytes
        for layer in (1, 2):
            mine, full = model.model.layers[layer].mlp.experts, one.model.layers[layer].mlp.experts
            lo = rank * n_half
            for name in ("w13", "w2", "w13_scale", "w2_scale"):
                got, want = getattr(mine, name), getattr(full, name)[lo:lo + n_half]
                assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                                   want.view(torch.uint8) if want.dtype == torch.float8_e4m3fn else want), name


def test_memory_per_rank_halves_for_routed_experts_at_full_v3_size() -> None:
    """DeepSeek-V3's real expert shapes (meta tensors): --ep-size 2 holds 128 whole routed experts per rank."""
    cfg = ModelConfig.from_hf(CONFIGS / "deepseek-v3.json")
    one = moe_layer.RoutedExperts(cfg, quant=cfg.quant, dtype=torch.bfloat16, device="meta", ops=get_ops("torch"))
    half = moe_layer.RoutedExperts(cfg, quant=cfg.quant, dtype=torch.bfloat16, device="meta", ops=get_ops("torch"),
                                   tp=TensorParallel(1, 2), ep=ExpertParallel(1, 2))
    assert (half.n_routed, half.w13.shape[1], half.shared.w13.shape[1]) == (128, 2 * 2048, 2048)
    routed = lambda m: sum(p[:m.n_routed].numel() * p.element_size()                      # noqa: E731
                           for p in (m.w13, m.w2, m.w13_scale, m.w2_scale))
    assert 2 * routed(half) == routed(one)
    assert [half.holds(e) for e in (127, 128, 255)] == [False, True, True]
    # --tp-size 4 --ep-size 2: rank 3 is the second rank of expert set 1: experts 128 .. 255, half their columns
    sets = moe_layer.RoutedExperts(cfg, quant=cfg.quant, dtype=torch.bfloat16, device="meta", ops=get_ops("torch"),
                                   tp=TensorParallel(3, 4), ep=ExpertParallel(3, 4, moe_tp=2))
    assert (sets.n_routed, sets.w13.shape[1], sets.w2.shape[2], sets.shared.w13.shape[1]) == (128, 2 * 1024, 1024, 1024)
    assert [sets.holds(e) for e in (127, 128, 255)] == [False, True, True]
    assert 2 * routed(sets) == routed(half)


# --- flags ------------------------------------------------------------------------------------------------------

V2_LITE = ModelConfig.from_hf(CONFIGS / "deepseek-v2-lite.json")
V3 = ModelConfig.from_hf(CONFIGS / "deepseek-v3.json")
CPU = DeviceInfo("cpu", triton=False)
H100 = DeviceInfo("cuda", 0, "NVIDIA H100 80GB HBM3", 80 * 2**30, (9, 0), triton=True)


@pytest.mark.parametrize("model,flags,words", [
    (V2_LITE, dict(tp_size=2, ep_size=4), "--ep-size 4: must divide --tp-size 2"),
    (V2_LITE, dict(tp_size=4, ep_size=3), "--ep-size 3: must divide --tp-size 4"),
    (V3, dict(tp_size=32, ep_size=32, moe_dense_tp_size=1),
     "--tp-size 32 --ep-size 32: model.layers.3.mlp.shared_experts.down_proj.weight has 2048 columns per shared"),
    (V3, dict(tp_size=64, ep_size=2, moe_dense_tp_size=1),
     "--tp-size 64 --ep-size 2: model.layers.3.mlp.experts.0.down_proj.weight has 2048 columns"),
    (V2_LITE, dict(ep_size=0), "--ep-size 0: must be >= 1"),
    (dataclasses.replace(V2_LITE, n_routed_experts=66), dict(tp_size=4, ep_size=4),
     "--ep-size 4: n_routed_experts (66) does not split into 4 equal parts"),
    (dataclasses.replace(V2_LITE, n_routed_experts=0), dict(tp_size=2, ep_size=2),
     "--ep-size 2: this model has no routed experts"),
])
def test_bad_ep_flags_fail_in_one_line(model, flags, words) -> None:
    with pytest.raises(ConfigError) as e:
        resolve_config(ServerConfig.from_flat(**flags), model, H100 if model is V3 else CPU)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_ep_flags_resolve() -> None:
    r = resolve_config(ServerConfig.from_flat(tp_size=2, ep_size=2), V2_LITE, CPU)
    assert (r.parallel.tp_size, r.parallel.ep_size) == (2, 2)
    assert resolve_config(r, V2_LITE, CPU) == r                                        # idempotent
    assert ServerConfig.from_flat().parallel.ep_size == 1
    # expert sets of several ranks: 4 sets of 2 ranks, each splitting its 64 experts' 2048 columns in two
    assert resolve_config(ServerConfig.from_flat(tp_size=8, ep_size=4), V3, H100).parallel.ep_size == 4
    assert resolve_config(ServerConfig.from_flat(tp_size=16, ep_size=16), V3, H100).parallel.ep_size == 16


def test_tuned_tables_are_looked_up_by_the_local_expert_count(monkeypatch) -> None:
    """V3 at --tp-size 2 --ep-size 2 (meta tensors, Triton launches stubbed): the fused-MoE call reads the table of
    128 local experts at the full intermediate size 2048, not 256 experts at 1024."""
    from mlaserve.kernels import fused_moe as fm

    cfg = ModelConfig.from_hf(CONFIGS / "deepseek-v3.json")
    looked_up: list[str] = []
    monkeypatch.setattr(fm, "_load_configs", lambda path: looked_up.append(path.name))
    monkeypatch.setattr(fm, "moe_align_block_size", lambda ids, bm, e: (None, None, None))
    monkeypatch.setattr(fm, "_grouped_gemm", lambda *args: None)
    monkeypatch.setattr(fm, "sum_dim1", lambda y, out, rows=False: out)
    monkeypatch.setattr(fm, "gpu_name", lambda: "NVIDIA_H200")
    ops = get_ops("triton")._replace(
        fused_moe=fm.fused_moe, silu_and_mul=lambda gu: gu[:, : gu.shape[1] // 2],
        moe_topk=lambda logits, k, **_: (logits.new_empty(logits.shape[0], k),
                                         logits.new_empty(logits.shape[0], k, dtype=torch.int32)),
        moe_route=lambda x, w, k, **_: (x.new_empty(x.shape[0], k, dtype=torch.float32),
                                        x.new_empty(x.shape[0], k, dtype=torch.int32)),
        fp8_linear=lambda x, w, s: x.new_empty(x.shape[0], w.shape[0]), fp8_quant_plan=lambda m, x, w: None)
    layer = moe_layer.MoE(cfg, quant=cfg.quant, dtype=torch.bfloat16, device="meta", ops=ops,
                          tp=TensorParallel(1, 2), ep=ExpertParallel(1, 2))
    for t in (1, 64, 1024):
        assert layer(torch.empty(t, cfg.hidden_size, dtype=torch.bfloat16, device="meta")).shape == (t, cfg.hidden_size)
    assert looked_up and all(n.startswith("E=128,N=2048,device_name=NVIDIA_H200,dtype=fp8_w8a8") for n in looked_up)
