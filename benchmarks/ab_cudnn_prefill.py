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


def compare(a: torch.Tensor, b: torch.Tensor) -> str:
    diff = ((a - b).abs().max() / b.abs().max()).item()
    return f"max |diff| / max |logit| = {diff:.2e}; greedy tokens equal: {torch.equal(a.argmax(-1), b.argmax(-1))}"


print(f"logits cuDNN vs Triton: {compare(logits[True], logits[False])}")
print(f"logits Triton at tiles (64, 64, 4, 3) vs shipped {shipped}: {compare(logits['tiles'], logits[False])}")
