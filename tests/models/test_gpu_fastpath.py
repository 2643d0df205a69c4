"""GPU: the fast path (Triton attention + fused MoE + FP8 GEMMs + CUDA graphs) against the torch reference path
on the same GPU. Skipped on CPU (marked `gpu`)."""
from __future__ import annotations

import random

import pytest
import torch
from seq_runner import SeqRunner, drive_scheduler

from mlaserve.config import ModelConfig, ServerConfig
from mlaserve.core import SamplingParams
from mlaserve.ipc.messages import GenerateReqMsg
from mlaserve.models.deepseek import DeepseekForCausalLM
from mlaserve.models.weights import load_weights
from mlaserve.scheduler.scheduler import Scheduler

pytestmark = pytest.mark.gpu

# bf16 tolerances (fast path vs torch reference path, both bf16 on the GPU), per-token prompt log-probs:
# different summation orders (split-KV attention, grouped GEMMs) plus rare routed-expert flips.
BF16_MEAN, BF16_P90 = 0.15, 0.3


def scheduler(path, backend: str, graphs: bool, dtype: str = "bfloat16", **kw) -> Scheduler:
    server = ServerConfig.from_flat(model_path=str(path), device="cuda", dtype=dtype, max_total_tokens=8192,
                                    attention_backend=backend, disable_cuda_graph=not graphs, cuda_graph_max_bs=16,
                                    log_level="warning", **kw)
    return Scheduler(server, str(path))


def greedy_outputs(sched: Scheduler, prompts: list[list[int]], n: int = 32) -> dict:
    msgs = [GenerateReqMsg(f"r{i}", p, SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True), seed=i)
            for i, p in enumerate(prompts)]
    return {k: v["ids"] for k, v in drive_scheduler(sched, msgs).items()}


def prompt_logprobs(path, backend: str, ids: torch.Tensor, **kw) -> torch.Tensor:
    cfg = ModelConfig.from_hf(path)
    model = DeepseekForCausalLM(cfg, dtype=torch.bfloat16, device="cuda", **kw)
    load_weights(model, cfg, path, progress=False, **({"dequant_fp8": True} if kw.get("dequant_fp8") else {}))
    runner = SeqRunner(model, cfg, backend=backend, device="cuda")
    logits = runner.extend({0: ids.tolist()}, all_logits=True).logits
    return logits[:-1].log_softmax(-1).gather(-1, ids[1:, None].cuda())[:, 0].float().cpu()


def close_stats(d: torch.Tensor, mean: float, p90: float, what: str) -> None:
    d = d.abs()
    assert torch.isfinite(d).all() and d.mean() <= mean and d.quantile(0.9) <= p90, \
        f"{what}: mean {d.mean():.3f} p90 {d.quantile(0.9):.3f} max {d.max():.3f}"


@pytest.mark.parametrize("variant", ["v2-lite", "v2", "v3"])
def test_fast_path_prompt_logprobs_match_reference(checkpoints, variant):
    path = checkpoints(variant)
    ids = torch.randint(2, 4000, (200,))
    fast, ref = prompt_logprobs(path, "triton", ids), prompt_logprobs(path, "torch", ids)
    close_stats(fast - ref, BF16_MEAN, BF16_P90, f"{variant} triton vs torch")


@pytest.mark.parametrize("variant", ["v2-lite", "v2", "v3"])
def test_fast_path_greedy_equals_reference(checkpoints, variant):
    """32 greedy tokens for 12 prompts, fast path (Triton + graphs) vs the torch reference path, in float32:
    in bf16 both paths leave an fp32 reference at the first near-tie (measured: after 3-9 tokens for half the
    prompts on this random model), so token equality is only meaningful in fp32 (Triton dots use TF32 there).
    FP8 checkpoints are compared by log-prob statistics instead (test_fp8_fast_path_vs_dequantised_bf16):
    per-token activation quantisation turns the attention backends' last-bit differences into whole e4m3
    steps, so even fp32 runs of the two paths part after a few tokens (measured on an H100, 2026-11-21)."""
    path = checkpoints(variant)
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 4000) for _ in range(rng.randint(5, 120))] for _ in range(12)]
    ref = greedy_outputs(scheduler(path, "torch", graphs=False, dtype="float32"), prompts)
    fast = greedy_outputs(scheduler(path, "triton", graphs=True, dtype="float32"), prompts)
    same = sum(ref[k] == fast[k] for k in ref)
    assert same >= len(ref) - 1, {k: (ref[k], fast[k]) for k in ref if ref[k] != fast[k]}


def test_fp8_fast_path_vs_dequantised_bf16(checkpoints):
    path = checkpoints("v3-fp8")
    ids = torch.randint(2, 4000, (200,))
    fp8 = prompt_logprobs(path, "triton", ids)
    deq = prompt_logprobs(path, "triton", ids, dequant_fp8=True)
    close_stats(fp8 - deq, 0.7, 1.3, "FP8 path vs dequantised bf16")


def test_cuda_graph_batches_pad_correctly(checkpoints):
    """Batch sizes between captured sizes (padding rows) give the same tokens as eager decode."""
    path = checkpoints("v3")
    rng = random.Random(1)
    prompts = [[rng.randrange(2, 4000) for _ in range(rng.randint(5, 60))] for _ in range(11)]
    eager = greedy_outputs(scheduler(path, "triton", graphs=False, dtype="float32"), prompts, 16)
    graph = greedy_outputs(scheduler(path, "triton", graphs=True, cuda_graph_bs=[1, 4, 16], dtype="float32"), prompts, 16)
    assert sum(eager[k] == graph[k] for k in eager) >= len(eager) - 1


def test_torch_compile_with_graphs_equals_reference(checkpoints):
    path = checkpoints("v3")
    rng = random.Random(2)
    prompts = [[rng.randrange(2, 4000) for _ in range(rng.randint(5, 60))] for _ in range(6)]
    ref = greedy_outputs(scheduler(path, "torch", graphs=False, dtype="float32"), prompts, 16)
    fast = greedy_outputs(scheduler(path, "triton", graphs=True, dtype="float32", enable_torch_compile=True,
                                    cuda_graph_bs=[1, 2, 4, 8], torch_compile_max_bs=8), prompts, 16)
    assert sum(ref[k] == fast[k] for k in ref) >= len(ref) - 1
