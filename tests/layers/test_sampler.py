"""Sampler: greedy, support of each filter, distribution, batch invariance, penalties, min_new_tokens, logprobs."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from mlaserve.core import SamplingParams
from mlaserve.layers.sampler import (
    Sampler, SamplingBatch, apply_penalties, logprobs_of, top_logprobs,
)

# A fixed distribution over 8 tokens whose kept tokens all have p >= 0.02: in 2000 draws each is seen.
PROBS = [0.30, 0.22, 0.16, 0.12, 0.09, 0.06, 0.03, 0.02]


def _batch(params: list[SamplingParams], v: int, *, seeds: list[int] | None = None, steps: list[int] | None = None,
           prompt: list[list[int]] | None = None, output: list[list[int]] | None = None,
           eos: list[int] | None = None, device: str = "cpu") -> SamplingBatch:
    b = len(params)
    fresh = torch.randint(0, 2**62, (b,)).tolist()
    seeds = seeds if seeds is not None else [p.seed if p.seed is not None else s for p, s in zip(params, fresh)]
    output = output if output is not None else [[] for _ in range(b)]
    steps = steps if steps is not None else [len(o) for o in output]
    prompt = prompt if prompt is not None else [[] for _ in range(b)]
    return SamplingBatch.build(params, seeds, steps, prompt, output, v, eos or [], device)


def _expected_probs(logits: list[float], p: SamplingParams) -> list[float]:
    """Naive spec: softmax(logits / T), keep top-k, then the top-p prefix of the renormalised top-k, then min-p."""
    w = [math.exp(x / p.temperature) for x in logits]
    probs = [x / sum(w) for x in w]
    keep = sorted(range(len(probs)), key=lambda i: -probs[i])[: p.top_k if p.top_k > 0 else None]
    if p.top_p < 1:
        mass, acc, nucleus = sum(probs[i] for i in keep), 0.0, []
        for i in keep:
            if acc >= p.top_p:
                break
            nucleus.append(i)
            acc += probs[i] / mass
        keep = nucleus
    keep = [i for i in keep if probs[i] >= p.min_p * probs[keep[0]]]
    z = sum(probs[i] for i in keep)
    return [probs[i] / z if i in keep else 0.0 for i in range(len(probs))]


def _draw(logits_row: torch.Tensor, p: SamplingParams, n: int, **kw) -> torch.Tensor:
    """n draws of one request's params from n fresh seeds."""
    batch = _batch([p] * n, logits_row.numel(), **kw)
    return Sampler()(logits_row.expand(n, -1).contiguous(), batch).next_ids


def test_greedy_is_argmax_with_lowest_id_on_ties(device: str) -> None:
    v = 50
    logits = torch.randn(6, v, device=device)
    logits[2, 7] = logits[2, 30] = logits[2].max() + 1                  # tie: id 7 wins
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1, temperature=1.5),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(top_k=1), SamplingParams(temperature=0.7, top_p=0.5)]
    out = Sampler()(logits, _batch(params, v, device=device))
    greedy_rows = [0, 1, 2, 4]
    assert torch.equal(out.next_ids[greedy_rows], logits[greedy_rows].argmax(-1))
    assert out.next_ids[2].item() == 7
    all_greedy = _batch([SamplingParams(temperature=0.0)] * 6, v, device=device)
    assert all_greedy.all_greedy
    assert torch.equal(Sampler()(logits, all_greedy).next_ids, logits.argmax(-1))


@pytest.mark.parametrize("params, kept", [
    (SamplingParams(top_k=3), 3),
    (SamplingParams(top_p=0.7), 4),                      # exclusive mass 0, .30, .52, .68 < .7, .80
    (SamplingParams(min_p=0.35), 4),                     # p >= 0.105
    (SamplingParams(temperature=0.5, top_p=0.7), 2),     # temperature first: sharper, smaller nucleus
    (SamplingParams(top_k=5, top_p=0.78), 4),
    (SamplingParams(temperature=2.0), 8),
])
def test_filters_restrict_support(params: SamplingParams, kept: int) -> None:
    logits = torch.tensor(PROBS).log()[torch.randperm(8)]               # shuffled so ids are not ranks
    expected = _expected_probs(logits.tolist(), params)
    support = {i for i, q in enumerate(expected) if q > 0}
    assert len(support) == kept                                         # the naive spec agrees with the table
    drawn = set(_draw(logits, params, 2000).tolist())
    assert drawn == support, f"drawn {sorted(drawn)}, allowed {sorted(support)}"


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_k=6, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=1.7, top_p=0.95),
])
def test_distribution_matches_filtered_softmax(params: SamplingParams) -> None:
    # 4000 draws over 8 tokens: sampling noise in TV is ~0.02, a wrong distribution is well above 0.05.
    logits = torch.randn(8) * 1.5
    expected = torch.tensor(_expected_probs(logits.tolist(), params), dtype=torch.float64)
    ids = _draw(logits, params, 4000)
    emp = torch.bincount(ids, minlength=8).double() / ids.numel()
    assert 0.5 * (emp - expected).abs().sum().item() < 0.05


def _mixed_requests(v: int) -> tuple[list[SamplingParams], list[list[int]], list[list[int]]]:
    params = [SamplingParams(temperature=0.9, seed=11), SamplingParams(top_p=0.8, top_k=20, seed=5),
              SamplingParams(min_p=0.1, repetition_penalty=1.3, frequency_penalty=0.5, seed=2**40),
              SamplingParams(temperature=0.0, presence_penalty=1.0), SamplingParams(min_new_tokens=4, seed=-3)]
    prompt = [torch.randint(0, v, (n,)).tolist() for n in (5, 1, 7, 3, 2)]
    output = [torch.randint(0, v, (n,)).tolist() for n in (2, 0, 4, 1, 3)]
    return params, prompt, output


@pytest.mark.parametrize("use_triton", [False, True])
def test_same_seed_same_token_whatever_the_batch(use_triton: bool, device: str) -> None:
    v = 64
    params, prompt, output = _mixed_requests(v)
    logits = torch.randn(5, v, device=device) * 2
    sampler = Sampler(use_triton=use_triton)
    alone = sampler(logits, _batch(params, v, prompt=prompt, output=output, eos=[0], device=device)).next_ids
    # Permute and pad with 4 other requests (greedy, filtered, penalised): every original row keeps its token.
    pad_params = [SamplingParams(temperature=0.0), SamplingParams(top_k=3), SamplingParams(temperature=0.3),
                  SamplingParams(frequency_penalty=-1.0)]
    perm = torch.randperm(9).tolist()
    all_params, all_prompt = params + pad_params, prompt + [[1, 2]] * 4
    all_output, all_logits = output + [[3]] * 4, torch.cat([logits, torch.randn(4, v, device=device)])
    big = _batch([all_params[i] for i in perm], v, prompt=[all_prompt[i] for i in perm],
                 output=[all_output[i] for i in perm], eos=[0], device=device)
    mixed = sampler(all_logits[perm].contiguous(), big).next_ids
    for row, i in enumerate(perm):
        if i < 5:
            assert mixed[row].item() == alone[i].item(), f"request {i} changed its token in a bigger batch"
    if use_triton:                                                      # kernel and reference: the same draws
        ref = Sampler(use_triton=False)(logits, _batch(params, v, prompt=prompt, output=output, eos=[0], device=device))
        assert torch.equal(alone, ref.next_ids)


def test_penalties_match_naive_loop(device: str) -> None:
    v = 20
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(repetition_penalty=0.8, frequency_penalty=0.7),
              SamplingParams(presence_penalty=-1.5, frequency_penalty=-0.4), SamplingParams()]
    prompt = [torch.randint(0, v, (6,)).tolist() for _ in params]
    output = [torch.randint(0, v, (5,)).tolist() * 2 for _ in params]   # every output token twice: counts > 1
    logits = torch.randn(4, v, device=device) * 3
    got = apply_penalties(logits, _batch(params, v, prompt=prompt, output=output, device=device))
    want = logits.clone()
    for b, p in enumerate(params):
        for t in set(prompt[b] + output[b]):
            x = want[b, t].item()
            want[b, t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for t, c in Counter(output[b]).items():
            want[b, t] -= p.frequency_penalty * c + p.presence_penalty
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)         # fp32 rounding of the same formula


def test_repetition_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5]])
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    out = Sampler()(logits, _batch([p], 4, prompt=[[1]])).next_ids     # 3.0 / 2 = 1.5 < 2.0
    assert out.item() == 2


def test_min_new_tokens_masks_eos_and_stop_ids() -> None:
    v, eos, stop = 10, 3, 7
    logits = torch.zeros(1, v)
    logits[0, eos], logits[0, stop] = 20.0, 19.0                        # both dominate when allowed
    p = SamplingParams(min_new_tokens=2, stop_token_ids=[stop])
    for greedy in (True, False):
        q = SamplingParams(min_new_tokens=2, stop_token_ids=[stop], temperature=0.0 if greedy else 1.0)
        ids = _draw(logits[0], q, 500, steps=[0] * 500, eos=[eos])
        assert not ({eos, stop} & set(ids.tolist())), "eos / stop id drawn before min_new_tokens"
    sampler = Sampler()
    assert sampler(logits, _batch([p], v, steps=[1], eos=[eos])).next_ids.item() not in (eos, stop)   # 1 < 2
    batch = _batch([p], v, steps=[2], eos=[eos])                        # step 2: eos / stop allowed again
    assert batch.min_tokens_mask is None or not batch.min_tokens_mask.any()
    assert sampler(logits, batch).next_ids.item() in (eos, stop)
    done = SamplingParams(min_new_tokens=2, temperature=0.0)
    assert sampler(logits, _batch([done], v, steps=[2], eos=[eos])).next_ids.item() == eos
    ignore = SamplingParams(min_new_tokens=5, stop_token_ids=[stop], ignore_eos=True, temperature=0.0)
    assert Sampler()(logits, _batch([ignore], v, steps=[0], eos=[eos])).next_ids.item() == eos


def test_logprobs_of_and_top_logprobs(device: str) -> None:
    logits = torch.randn(5, 33, device=device) * 4
    ids = torch.randint(0, 33, (5,), device=device)
    ref = torch.log_softmax(logits.double(), dim=-1)                    # fp64 reference; fp32 error ~1e-6
    torch.testing.assert_close(logprobs_of(logits, ids), ref.gather(1, ids[:, None]).squeeze(1).float(),
                               rtol=1e-5, atol=1e-5)
    values, top_ids = top_logprobs(logits, 4)
    assert values.shape == top_ids.shape == (5, 4)
    assert (values[:, :-1] >= values[:, 1:]).all(), "top log-probs must be sorted descending"
    torch.testing.assert_close(values, ref.topk(4, dim=-1).values.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(values, ref.gather(1, top_ids).float(), rtol=1e-5, atol=1e-5)


def test_sampler_returns_raw_logprobs() -> None:
    # Penalties, temperature and filters change the draw, not the reported log-probs (HF-comparable).
    v = 40
    params = [SamplingParams(temperature=0.5, top_k=5, repetition_penalty=1.5),
              SamplingParams(temperature=0.0, frequency_penalty=1.0)]
    logits = torch.randn(2, v) * 3
    out = Sampler()(logits, _batch(params, v, prompt=[[0, 1], [2]], output=[[3], [4, 4]]),
                    return_logprob=True, top_logprobs_num=3)
    raw = torch.log_softmax(logits.double(), dim=-1)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.next_ids[:, None]).squeeze(1).float(),
                               rtol=1e-5, atol=1e-5)
    values, ids = out.top_logprobs
    assert torch.equal(ids, raw.topk(3, dim=-1).indices)
    assert Sampler()(logits, _batch(params, v)).logprobs is None


def test_logit_bias_moves_greedy_and_sampled_rows(device: str) -> None:
    v = 40
    logits = torch.randn(4, v, device=device)
    top = logits.argmax(-1).tolist()
    pick = [(t + 7) % v for t in top]
    params = [SamplingParams(temperature=0.0, logit_bias={pick[0]: 100}),          # forced
              SamplingParams(temperature=0.0, logit_bias={top[1]: -100}),          # banned
              SamplingParams(temperature=1.0, logit_bias={pick[2]: 100}),          # sampled, forced
              SamplingParams(temperature=0.0)]                                     # untouched row
    out = Sampler()(logits, _batch(params, v, device=device), return_logprob=True).next_ids.tolist()
    second = logits[1].clone()
    second[top[1]] = float("-inf")
    assert out == [pick[0], second.argmax().item(), pick[2], top[3]]
    # the reported log-probs stay those of the raw model distribution
    lp = Sampler()(logits, _batch(params, v, device=device), return_logprob=True).logprobs
    assert torch.allclose(lp, logprobs_of(logits, torch.tensor(out, device=device)))
