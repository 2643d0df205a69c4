"""gumbel_argmax (Triton; interpreter on CPU) against gumbel_argmax_ref, and the quality of the seeded noise."""
from __future__ import annotations

import math

import pytest
import torch

from mlaserve.kernels import sampling
from mlaserve.kernels.sampling import argmax_rows, greedy_ids, gumbel_argmax, gumbel_argmax_ref, gumbel_noise_ref

EULER_GAMMA = 0.5772156649
GUMBEL_STD = math.pi / math.sqrt(6)


def _random_inputs(b: int, v: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logits = torch.randn(b, v, device=device) * 3
    logits[torch.rand(b, v, device=device) < 0.3] = float("-inf")      # filtered tokens
    logits[0, :] = float("-inf")                                        # nothing left: both give id 0
    logits[1, :] = float("-inf")
    logits[1, v - 1] = 0.0                                              # one survivor: the last id
    seeds = torch.randint(-2**63, 2**63 - 1, (b,), device=device)      # negative and > 2^32 seeds
    steps = torch.randint(0, 2**40, (b,), device=device)               # counters past 2^32
    return logits, seeds, steps


@pytest.mark.parametrize("v", [1, 37, 300])                             # V not a power of two, V = 1
@pytest.mark.parametrize("block_v", [None, 32])                         # one chunk / a loop over chunks
def test_kernel_matches_ref(device: str, v: int, block_v: int | None) -> None:
    logits, seeds, steps = _random_inputs(6, v, device)
    # Integer hash: bit-exact; fp32 log() may differ by an ulp across libm's, which only matters on exact ties.
    got = gumbel_argmax(logits, seeds, steps, block_v=block_v)
    assert got.dtype == torch.int64 and got.shape == (6,)
    assert torch.equal(got, gumbel_argmax_ref(logits, seeds, steps))
    assert got[0] == 0 and got[1] == v - 1
    chosen = logits.gather(1, got[:, None]).squeeze(1)
    assert torch.isfinite(chosen[torch.isfinite(logits).any(dim=1)]).all(), "a filtered (-inf) token was drawn"


def test_kernel_row_stride_and_batch_order(device: str) -> None:
    wide = torch.randn(7, 260, device=device)
    logits = wide[:, :250]                                              # row stride 260, unit column stride
    seeds = torch.randint(0, 2**31, (7,), device=device)
    steps = torch.randint(0, 1000, (7,), device=device)
    got = gumbel_argmax(logits, seeds, steps, block_v=64)
    assert torch.equal(got, gumbel_argmax_ref(logits, seeds, steps))
    perm = torch.randperm(7, device=device)
    assert torch.equal(gumbel_argmax(logits[perm], seeds[perm], steps[perm], block_v=64), got[perm])
    one = gumbel_argmax(logits[3:4], seeds[3:4], steps[3:4], block_v=64)
    assert one.item() == got[3].item()                                  # alone or in a batch: the same draw


def test_noise_is_standard_gumbel() -> None:
    # 64 consecutive seeds x 1000 tokens: moments and CDF of Gumbel(0, 1).
    start = int(torch.randint(0, 2**40, ()).item())
    seeds = torch.arange(start, start + 64)
    g = gumbel_noise_ref(seeds, torch.zeros(64, dtype=torch.int64), 1000).flatten().double()
    # n = 64000: standard error of the mean ~ 0.005, of the std ~ 0.006; tolerances are ~6 sigma.
    assert abs(g.mean().item() - EULER_GAMMA) < 0.03
    assert abs(g.std().item() - GUMBEL_STD) < 0.04
    # Kolmogorov-Smirnov distance at a few points: 99.9% critical value 1.95 / sqrt(n) ~ 0.0077.
    for x in (-1.0, 0.0, 0.5, 1.5, 3.0):
        emp = (g <= x).double().mean().item()
        assert abs(emp - math.exp(-math.exp(-x))) < 0.01, f"CDF off at {x}"


def _tv(ids: torch.Tensor, probs: torch.Tensor) -> float:
    emp = torch.bincount(ids, minlength=probs.numel()).double() / ids.numel()
    return 0.5 * (emp - probs.double()).abs().sum().item()


def test_draws_follow_softmax_over_seeds_and_steps() -> None:
    # TV noise for n = 4000 draws over 8 tokens is ~0.02; a biased or correlated hash shows up well above 0.05.
    n, v = 4000, 8
    logits = torch.randn(v) * 1.5
    probs = torch.softmax(logits, dim=-1)
    rows = logits.expand(n, v).contiguous()
    start = int(torch.randint(0, 2**40, ()).item())
    consecutive = torch.arange(start, start + n)
    by_seed = gumbel_argmax_ref(rows, consecutive, torch.zeros(n, dtype=torch.int64))
    by_step = gumbel_argmax_ref(rows, torch.full((n,), start), consecutive - start)   # one request, n steps
    assert _tv(by_seed, probs) < 0.05
    assert _tv(by_step, probs) < 0.05


def test_consecutive_steps_are_independent() -> None:
    # Pairs (token at step s, token at step s + 1) of 4096 requests over 4 equally likely tokens: chi-square
    # with 15 degrees of freedom has mean 15, sd 5.5; 60 is far in the tail (p < 1e-6) for independent draws.
    n, v = 4096, 4
    start = int(torch.randint(0, 2**40, ()).item())
    seeds = torch.arange(start, start + n)
    step0 = torch.randint(0, 10_000, (n,))
    rows = torch.zeros(n, v)
    a = gumbel_argmax_ref(rows, seeds, step0)
    b = gumbel_argmax_ref(rows, seeds, step0 + 1)
    counts = torch.bincount(a * v + b, minlength=v * v).double()
    expected = n / (v * v)
    assert ((counts - expected) ** 2 / expected).sum().item() < 60


# one chunk, or several with V not a multiple of the chunk
@pytest.mark.parametrize("v,chunk", [(1, 4096), (300, 4096), (1000, 64), (4099, 1024)])
def test_argmax_rows_is_torch_argmax(device: str, v: int, chunk: int, monkeypatch) -> None:
    monkeypatch.setattr(sampling, "ARGMAX_CHUNK", chunk)
    seed = torch.seed()
    print("seed", seed)
    wide = torch.randn(7, v + 5, device=device) * 3
    x = wide[:, 2:v + 2]                                                # a row stride that is not V
    x[0] = float("-inf")                                                # all -inf: id 0, as torch
    if v > 1:
        x[1, :] = 1.0                                                   # all equal: the lowest id
        x[2, v // 2:] = 50.0                                            # ties across chunks: the first of them
        x[3, v - 1] = 60.0                                              # the last id
        x[4, torch.rand(v, device=device) < 0.5] = float("-inf")
    got = argmax_rows(x)
    assert got.dtype == torch.int64 and got.shape == (7,)
    assert torch.equal(got, x.argmax(dim=-1))
    assert torch.equal(argmax_rows(x.half()), x.half().argmax(dim=-1))


def test_argmax_rows_nan_counts_as_largest(device: str) -> None:
    x = torch.zeros(2, 50, device=device)
    x[0, 7] = float("nan")
    x[1, 3], x[1, 9] = float("inf"), float("nan")                       # both: the first (torch takes the NaN)
    assert argmax_rows(x).tolist() == [7, 3]
    assert argmax_rows(torch.empty(0, 5, device=device)).shape == (0,)


def test_greedy_ids_equal_torch_on_every_device(device: str) -> None:
    x = torch.randn(3, 100, device=device)
    assert torch.equal(greedy_ids(x), x.argmax(dim=-1))
