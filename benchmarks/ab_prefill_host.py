"""One prompt's prefill, timed from the host: what the host does before and while the GPU runs (issue 15).

Runs with whichever tree is on PYTHONPATH (the A/B of a host-side change: the same script from two trees; the tree
needs `bench.one_batch.eager_prefill`, from this session's commits on). Per prefill of `--len` tokens (batch 1, dummy weights, eager): the wall time from an idle GPU
to the result on the host, the host time until `launch_forward` returned (everything queued), and the GPU time
between CUDA events around the forward. Prints the median and the minimum over `--repeats` prefills after warm-up."""
import argparse
import statistics
import time

import torch

from mlaserve.bench.one_batch import eager_prefill

def timed_prefill(runner, batch) -> tuple[float, float, float, object]:
    """One prefill from an idle GPU: (wall s to the sampled token on the host, host s until `launch_forward`
    returned, GPU s between CUDA events around it, its ForwardStep)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    fwd = runner.launch_forward(batch)
    t1 = time.perf_counter()
    out = runner.resolve(runner.launch_sample(fwd))
    end.record()
    end.synchronize()
    assert out.next_ids[0] is not None
    return time.perf_counter() - t0, t1 - t0, start.elapsed_time(end) / 1e3, fwd


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-config", default="mlaserve/tools/configs/deepseek-v2-lite.json")
    ap.add_argument("--len", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    runner, batch = eager_prefill(a.model_config, a.len)
    for _ in range(3):
        runner.forward(batch)
    walls, queued, gpu = [], [], []
    for _ in range(a.repeats):
        wall, host, g, _ = timed_prefill(runner, batch)
        walls.append(wall)
        queued.append(host)
        gpu.append(g)
    ms = lambda xs: f"{statistics.median(xs) * 1e3:7.2f} (min {min(xs) * 1e3:6.2f})"  # noqa: E731
    print(f"{a.tag:8s} {a.model_config.split('/')[-1]:24s} 1 x {a.len}: wall {ms(walls)} ms, host queued in "
          f"{ms(queued)} ms, GPU events {ms(gpu)} ms, {a.repeats} prefills")


if __name__ == "__main__":
    main()
