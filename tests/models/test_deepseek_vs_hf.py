"""Our DeepSeek model against Hugging Face transformers on checkpoints written by make-checkpoint."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from parallel_common import first_tie
from seq_runner import SeqRunner

from mlaserve.config import ModelConfig
from mlaserve.kernels.quant import block_dequant_ref
from mlaserve.models.deepseek import DeepseekForCausalLM
from mlaserve.models.weights import load_weights

transformers = pytest.importorskip("transformers")

# Tolerances on per-token prompt log-probs, measured on CPU (2026-11-21), 4 fresh random 40-token prompts each:
# - fp32: max |d| ~2e-5 (tolerance 1e-4, as the issue asks).
# - bf16 (ours bf16 vs HF bf16): mean |d| 0.02 (v2-lite) .. 0.09 (v3), p90 0.04 .. 0.2; max 0.06 .. 1.1, the
#   large ones at single positions where bf16 rounding flips a routed-expert choice (a discontinuity that
#   no bf16 implementation avoids); over 30 prompts on v3 the worst mean was 0.13 and the worst p90 0.23.
#   Asserted: mean <= 0.2 and p90 <= 0.35.
# - FP8 path (e4m3 weights, activations quantised per token per 128 channels) vs HF on the dequantised
#   weights in fp32: mean 0.37 .. 0.50, p90 0.74 .. 0.92, max up to 2.8 (activation quantisation error
#   through 3 layers of random weights with logits of std 4). Asserted: mean <= 0.7 and p90 <= 1.3; the
#   same checkpoint with dequantised weights (no activation quantisation) matches HF to 1e-4.
FP32_TOL = 1e-4
# bf16: positions a flipped routed-expert choice may move by several nats (see the test). Measured over 40 seeds of
# 120 positions on the CPU: v2-lite none, v3 at most 1, v2 a mean of 1.0 (13 seeds 0, 21 seeds 1, 5 seeds 2, one 3);
# about Poisson(1): more than 6 in about 1 run in 12,000 (more than 2, the bound before, in 1 in 12: CI saw 3)
FLIPS = 6


def assert_close_stats(d: torch.Tensor, mean: float, p90: float, what: str) -> None:
    d = d.abs().float()
    assert torch.isfinite(d).all(), what
    assert d.mean() <= mean and d.quantile(0.9) <= p90, \
        f"{what}: mean |dlogprob| {d.mean():.3f}, p90 {d.quantile(0.9):.3f}, max {d.max():.3f}"


def ours(path: Path, dtype: torch.dtype, **kw) -> tuple[DeepseekForCausalLM, ModelConfig]:
    cfg = ModelConfig.from_hf(path)
    model = DeepseekForCausalLM(cfg, dtype=dtype, **kw)
    load_weights(model, cfg, path, dequant_fp8=kw.get("dequant_fp8", False), progress=False)
    return model, cfg


def hf(path: Path, dtype: torch.dtype):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.generation_config.eos_token_id = None
    return model.eval()


def prompt_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """logits [S, V] -> log p(ids[i + 1] | ids[: i + 1]) [S - 1]."""
    return logits[:-1].float().log_softmax(-1).gather(-1, ids[1:, None])[:, 0]


def ours_prompt_logprobs(model, cfg, ids: torch.Tensor) -> torch.Tensor:
    out = SeqRunner(model, cfg).extend({0: ids.tolist()}, all_logits=True)
    return prompt_logprobs(out.logits, ids)


def hf_prompt_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return prompt_logprobs(model(ids[None]).logits[0], ids)


def random_prompt(cfg: ModelConfig, n: int) -> torch.Tensor:
    return torch.randint(2, cfg.vocab_size, (n,))


@pytest.mark.parametrize("variant", ["v2-lite", "v2", "v3", "v3-odd-dims"])
def test_prompt_logprobs_fp32(checkpoints, variant):
    path = checkpoints(variant)
    model, cfg = ours(path, torch.float32)
    ids = random_prompt(cfg, 40)
    diff = (ours_prompt_logprobs(model, cfg, ids) - hf_prompt_logprobs(hf(path, torch.float32), ids)).abs().max()
    assert diff <= FP32_TOL, f"{variant}: max |dlogprob| {diff:.2e}"


# the interpreter is slow: one variant on the CPU, every variant on the GPU
@pytest.mark.parametrize("variant", [pytest.param(v, marks=pytest.mark.gpu) for v in ("v2-lite", "v2", "v3")]
                         + ["v3-odd-dims"])
def test_triton_kernels_fp32_match_hf(checkpoints, variant, device):
    """The whole model on the Triton kernels (the GPU, or the CPU interpreter), float32: prompt log-probs within
    1e-4 of HF's float32 through a chunked prompt (prefix read back from the cache), then decode steps equal to
    the torch-reference kernels. v3-odd-dims has kv_lora_rank 32 and rope dim 8 (padded Triton tiles)."""
    path = checkpoints(variant)
    cfg = ModelConfig.from_hf(path)
    ids = random_prompt(cfg, 24)
    want = hf_prompt_logprobs(hf(path, torch.float32), ids)
    logits, steps = {}, {}
    for kernels in ("triton", "torch"):
        model, _ = ours(path, torch.float32, device=device, kernels=kernels)
        runner = SeqRunner(model, cfg, backend=kernels, device=device)
        logits[kernels] = torch.cat([runner.extend({0: ids[:15].tolist()}, all_logits=True).logits,
                                     runner.extend({0: ids[15:].tolist()}, all_logits=True).logits]).cpu()
        steps[kernels] = torch.stack([runner.decode({0: int(t)}).logits[0].cpu() for t in ids[:3]])
    diff = (prompt_logprobs(logits["triton"], ids) - want).abs().max()
    assert diff <= FP32_TOL, f"{variant}: triton kernels vs HF float32: max |dlogprob| {diff:.2e}"
    assert (steps["triton"] - steps["torch"]).abs().max() <= FP32_TOL * steps["torch"].abs().max()


@pytest.mark.parametrize("variant", ["v2-lite", "v2", "v3"])
def test_prompt_logprobs_bf16(checkpoints, variant):
    path = checkpoints(variant)
    model, cfg = ours(path, torch.bfloat16)
    seed = random.randrange(2**31)
    print(f"seed {seed}")
    torch.manual_seed(seed)
    # NOTE: a bf16 rounding that flips one routed expert moves that position by up to ~10 nats (seen in CI: over 40
    # positions a mean of 0.28 from two such positions; over 120 a mean of 0.26 from one of 9.8, p90 0.17). At most
    # FLIPS such positions (> 2 nats) are allowed; the statistics are over the others
    ids = random_prompt(cfg, 120)
    a, b = ours_prompt_logprobs(model, cfg, ids), hf_prompt_logprobs(hf(path, torch.bfloat16), ids)
    d = (a - b).abs().float()
    assert (d > 2.0).sum() <= FLIPS, f"bf16 {variant}: {(d > 2.0).sum()} positions off by > 2 nats: {d.max():.3f}"
    assert_close_stats(d[d <= 2.0], 0.2, 0.35, f"bf16 {variant} (positions > 2 nats left out)")


# greedy decoding: a step whose two best logits are closer than this (in either model) may pick either in fp32
# (the two sum in different orders; ~1e-5 apart): tokens are compared up to the first such step
TIE = 1e-3


def top2(steps: list[torch.Tensor]) -> list[list[tuple[float, int]]]:
    """Each step's two best (logit, id), best first: `parallel_common.first_tie`'s pairs (a difference of logits
    is that of log-probs)."""
    return [[(float(v), int(i)) for v, i in zip(*x.topk(2))] for x in steps]


@pytest.mark.parametrize("variant", ["v2-lite", "v2", "v3"])
def test_greedy_decode_matches_hf_generate(checkpoints, variant):
    """Two prompts prefilled together, then 32 tokens of batched absorbed decode through the KV cache: the tokens
    of HF's generate up to the first near-tie of either model, and at it a token among HF's two best."""
    seed = random.randrange(2**31)
    print(f"seed {seed}")
    torch.manual_seed(seed)
    path = checkpoints(variant)
    model, cfg = ours(path, torch.float32)
    ref_model = hf(path, torch.float32)
    prompts = [random_prompt(cfg, 11), random_prompt(cfg, 17)]
    runner = SeqRunner(model, cfg)
    logits = runner.extend({i: p.tolist() for i, p in enumerate(prompts)}).logits
    steps: list[list[torch.Tensor]] = [[x] for x in logits]
    generated = [[int(t)] for t in logits.argmax(-1)]
    for _ in range(31):
        logits = runner.decode({i: g[-1] for i, g in enumerate(generated)}).logits
        for g, s, x in zip(generated, steps, logits):
            g.append(int(x.argmax()))
            s.append(x)
    for p, g, s in zip(prompts, generated, steps):
        out = ref_model.generate(p[None], max_new_tokens=32, do_sample=False, pad_token_id=0, output_scores=True,
                                 return_dict_in_generate=True)
        want, ref_steps = out.sequences[0, len(p):].tolist(), [x[0] for x in out.scores]
        n = min(first_tie(top2(s), TIE), first_tie(top2(ref_steps), TIE))
        assert g[:n] == want[:n], f"tokens differ before the first near-tie (step {n})"
        if n < len(want):
            assert g[n] in ref_steps[n].topk(2).indices.tolist(), f"step {n}: not among HF's two best"


def test_absorbed_and_non_absorbed_agree(checkpoints):
    path = checkpoints("v3")
    outs = []
    ids = None
    for absorb in (True, False):
        model, cfg = ours(path, torch.float32, absorb=absorb)
        ids = random_prompt(cfg, 9) if ids is None else ids
        runner = SeqRunner(model, cfg)
        runner.extend({0: ids[:5].tolist()})
        outs.append(torch.stack([runner.decode({0: int(t)}).logits[0] for t in ids[5:]]))
    assert (outs[0] - outs[1]).abs().max() <= 1e-4


def dequantised_copy(src: Path, dst: Path) -> Path:
    """The FP8 checkpoint with every weight dequantised to float32 (what HF is compared on)."""
    dst.mkdir(exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = {}
    for f in src.glob("*.safetensors"):
        tensors |= load_file(f)
    out = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        scale = tensors.get(name + "_scale_inv")
        out[name] = block_dequant_ref(t, scale, (128, 128), torch.float32) if scale is not None else t.float()
    save_file(out, str(dst / "model.safetensors"))
    return dst


def test_fp8_checkpoint_vs_hf_on_dequantised_weights(checkpoints, tmp_path):
    path = checkpoints("v3-fp8")
    ref = hf(dequantised_copy(path, tmp_path / "deq"), torch.float32)
    fp8_model, cfg = ours(path, torch.float32)
    assert fp8_model.model.layers[0].self_attn.kv_b_proj.weight.dtype == torch.float8_e4m3fn
    # NOTE: four prompts (124 scored positions): over one 32-token prompt the p90 was noisy (1.37 and 1.52 seen in CI);
    # over four, six draws measured mean 0.36-0.42 and p90 0.70-0.83 (2026-11-24, CPU)
    prompts = [random_prompt(cfg, 32) for _ in range(4)]
    want = [hf_prompt_logprobs(ref, ids) for ids in prompts]
    got = [ours_prompt_logprobs(fp8_model, cfg, ids) for ids in prompts]
    assert_close_stats(torch.cat(got) - torch.cat(want), 0.7, 1.3, "FP8 path")
    deq_model, _ = ours(path, torch.float32, dequant_fp8=True)
    exact = ours_prompt_logprobs(deq_model, cfg, prompts[0])
    assert (exact - want[0]).abs().max() <= FP32_TOL


def test_mtp_draft_logits_match_definition(checkpoints):
    """NextN: head(norm(layer(eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)])))) recomputed with HF's own
    DeepseekV3DecoderLayer loaded from the checkpoint's MTP weights."""
    path = checkpoints("v3")
    model, cfg = ours(path, torch.float32, load_mtp=True)
    ids = random_prompt(cfg, 12)
    runner = SeqRunner(model, cfg)
    main = runner.extend({0: ids.tolist()}, all_logits=True)
    next_ids = torch.cat([ids[1:], main.logits[-1:].argmax(-1)])
    draft = runner.mtp_logits(next_ids, main.hidden)

    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m3
    hf_cfg = transformers.AutoConfig.from_pretrained(path)
    hf_cfg.num_hidden_layers = cfg.num_hidden_layers + 1
    n = cfg.num_hidden_layers
    layer = m3.DeepseekV3DecoderLayer(hf_cfg, n).float().eval()
    rotary = m3.DeepseekV3RotaryEmbedding(hf_cfg)
    w = {}
    for f in path.glob("*.safetensors"):
        w |= {k: v.float() for k, v in load_file(f).items() if k.startswith(f"model.layers.{n}.")}
    p = f"model.layers.{n}."
    state = {k[len(p):]: v for k, v in w.items()
             if not k[len(p):].startswith(("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens", "mlp.experts."))}
    e = cfg.n_routed_experts
    state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([w[f"{p}mlp.experts.{j}.gate_proj.weight"],
                                                                w[f"{p}mlp.experts.{j}.up_proj.weight"]]) for j in range(e)])
    state["mlp.experts.down_proj"] = torch.stack([w[f"{p}mlp.experts.{j}.down_proj.weight"] for j in range(e)])
    layer.load_state_dict(state, strict=True)

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps))

    emb = w[f"{p}embed_tokens.weight"][next_ids]
    x = torch.cat([rms(emb, w[f"{p}enorm.weight"]), rms(main.hidden, w[f"{p}hnorm.weight"])], -1)
    x = x @ w[f"{p}eh_proj.weight"].t()
    pos = torch.arange(len(ids))[None]
    mask = torch.full((len(ids), len(ids)), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        x = layer(x[None], attention_mask=mask, position_ids=pos, position_embeddings=rotary(x[None], pos))[0]
    want = rms(x, w[f"{p}shared_head.norm.weight"]) @ w[f"{p}shared_head.head.weight"].t()
    assert (draft - want).abs().max() <= 1e-3 * want.abs().max()


def test_fp8_quantising_norms_change_no_bit(checkpoints, device, monkeypatch):
    """The FP8 checkpoint on the Triton kernels: the norms and the SwiGLU activation that quantise their outputs
    for the next FP8 GEMM (where it would run a quantisation pass of its own) give the logits of the unfused
    kernels bit for bit, through a prompt of more rows than the GEMM quantises inside: in fp32 under the
    interpreter, in bf16 (the serving dtype) on the GPU.

    NOTE: not in fp32 on the GPU. The norm kernel compiled with and without its quantising epilogue may sum a
    row's squares in another order, and fp32 keeps that 1-ulp difference where bf16's rounding of the norm's
    output hides it. Measured on an H200 (benchmarks/results/prequant-h200.md): fp32 prompt log-probs within
    3.8e-6 over 24 tokens and 4.4e-2 over 200 (an fp8 code one step off), bf16 equal over both."""
    from mlaserve.layers import ops as ops_mod
    from mlaserve.models import deepseek
    path = checkpoints("v3-fp8-q128")
    cfg = ModelConfig.from_hf(path)
    ids = random_prompt(cfg, 24)
    calls = []
    base = ops_mod.get_ops("triton")
    counted = base._replace(
        rmsnorm_quant=lambda *a: calls.append("norm") or base.rmsnorm_quant(*a),
        silu_and_mul_quant=lambda *a: calls.append("act") or base.silu_and_mul_quant(*a))
    logits = {}
    for name, ops in (("fused", counted), ("unfused", base._replace(fp8_quant_plan=lambda m, x, w_q: None))):
        monkeypatch.setattr(deepseek, "get_ops", lambda kernels, ops=ops: ops)
        model, _ = ours(path, torch.bfloat16 if device == "cuda" else torch.float32, device=device, kernels="triton")
        logits[name] = SeqRunner(model, cfg, backend="triton", device=device).extend(
            {0: ids.tolist()}, all_logits=True).logits.cpu()
    # every layer: the input norm for qkv_a and q_a's norm for q_b; the dense layer: its post-attention norm for
    # gate_up and the activation for down_proj (and the shared experts' where they run apart from the routed ones)
    assert all(layer.self_attn.qkv_a_proj is not None for layer in model.model.layers)
    assert calls.count("norm") == 2 * cfg.num_hidden_layers + cfg.first_k_dense_replace and "act" in calls
    assert torch.equal(logits["fused"], logits["unfused"])
