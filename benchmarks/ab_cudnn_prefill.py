"""The prefill's new-token attention on cuDNN (`mla_prefill.CUDNN_SELF_ATTN`) against the Triton kernel, alternated in
one runner (dummy weights, eager, batch 1): the wall time from an idle GPU to the sampled token, the GPU time between
CUDA events, and the logits of the two paths against each other (max |diff| / max |logit|, and the greedy tokens)."""
import argparse
import statistics

import torch
from ab_prefill_host import timed_prefill      # this script's folder is on sys.path

from mlaserve.bench.one_batch import eager_prefill
from mlaserve.kernels import mla_prefill as mp

ap = argparse.ArgumentParser()
ap.add_argument("--model-config", default="mlaserve/tools/configs/deepseek-v2-lite.json")
ap.add_argument("--len", type=int, default=4096)
ap.add_argument("--repeats", type=int, default=10)
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--fp32-ref", action="store_true",
                help="also the prefill with its new tokens' attention in fp32 (torch, a few heads at a time), and "
                     "both paths' logits against it")
a = ap.parse_args()
runner, batch = eager_prefill(a.model_config, a.len)


def prefills(on: bool) -> tuple[float, float, torch.Tensor]:
    mp.CUDNN_SELF_ATTN = on
    for _ in range(3):
        runner.forward(batch)
    walls, gpu = [], []
    for _ in range(a.repeats):
        wall, _, g, fwd = timed_prefill(runner, batch)
        walls.append(wall)
        gpu.append(g)
    return statistics.median(walls), statistics.median(gpu), fwd.logits.float()


name = a.model_config.split("/")[-1]
print("| model | tokens | attention | wall ms | GPU ms |")
print("|---|---|---|---|---|")
logits = {}
for _ in range(a.rounds):
    for on in (False, True):
        wall, gpu, logits[on] = prefills(on)
        print(f"| {name} | {a.len} | {'cuDNN' if on else 'Triton'} | {wall * 1e3:.2f} | {gpu * 1e3:.2f} |")
# the noise floor of that comparison: the Triton kernel at other tiles (another summation order, the same maths)
shipped = mp.FLASH_CONFIG
mp.FLASH_CONFIG = (64, 64, 4, 3)
logits["tiles"] = prefills(False)[2]
mp.FLASH_CONFIG = shipped



def fp32_self_attn(q, k_nope, k_pe, v, lens, sm_scale, need_lse, heads=8):
    # the reference for both kernels: the causal attention of each request's new tokens in fp32 (no TF32), `heads`
    # heads at a time ([heads, n, n] scores), rounded to q.dtype once at the end
    k = torch.cat([k_nope, k_pe.expand(-1, k_nope.shape[1], -1)], dim=-1)
    out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    q0 = 0
    for n in lens:
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        for h0 in range(0, q.shape[1], heads):
            qh, kh, vh = (t[q0:q0 + n, h0:h0 + heads].float().transpose(0, 1) for t in (q, k, v))   # [h, n, d]
            s = (qh @ kh.transpose(1, 2)) * sm_scale
            s.masked_fill_(~mask, float("-inf"))
            lse[q0:q0 + n, h0:h0 + heads] = torch.logsumexp(s, dim=-1).transpose(0, 1)
            out[q0:q0 + n, h0:h0 + heads] = (torch.softmax(s, dim=-1) @ vh).transpose(0, 1).to(q.dtype)
            del s
        q0 += n
    return out, (lse if need_lse else None)


if a.fp32_ref:
    cudnn = mp._cudnn_self_attn
    mp._cudnn_self_attn = fp32_self_attn              # the cuDNN rule's path, with the fp32 attention behind it
    mp.CUDNN_SELF_ATTN = True
    for _ in range(2):
        runner.forward(batch)
    logits["fp32"] = timed_prefill(runner, batch)[3].logits.float()
    mp._cudnn_self_attn, mp.CUDNN_SELF_ATTN = cudnn, False


def compare(a: torch.Tensor, b: torch.Tensor) -> str:
    diff = ((a - b).abs().max() / b.abs().max()).item()
    return f"max |diff| / max |logit| = {diff:.2e}; greedy tokens equal: {torch.equal(a.argmax(-1), b.argmax(-1))}"


print(f"logits cuDNN vs Triton: {compare(logits[True], logits[False])}")
print(f"logits Triton at tiles (64, 64, 4, 3) vs shipped {shipped}: {compare(logits['tiles'], logits[False])}")
if a.fp32_ref:
    print(f"logits Triton vs fp32 attention: {compare(logits[False], logits['fp32'])}")
    print(f"logits cuDNN vs fp32 attention: {compare(logits[True], logits['fp32'])}")
    print(f"logits Triton at other tiles vs fp32 attention: {compare(logits['tiles'], logits['fp32'])}")
