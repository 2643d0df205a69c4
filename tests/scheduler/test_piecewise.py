"""Piecewise extend graphs (`engine/piecewise.py`) on the CPU: the padded forward split at every attention call, run
eagerly (capture=False, the layout the GPU captures), gives every request the tokens and prompt log-probs of the
plain forward, with chunked prefill, radix hits, mixed batches and speculative decoding."""
from __future__ import annotations

import random

import pytest
import torch

from mlaserve.engine.piecewise import default_token_sizes
from parallel_common import assert_greedy_equal_before_ties
from seq_runner import drive_scheduler as run, eager_pieces
from test_scheduler import assert_no_leak, make, msg, prompts


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def test_default_sizes_cover_every_count_with_little_padding():
    """At most 15 rows or 25% of padding, whichever is more (`bucket_rows`)."""
    for most in (1, 16, 100, 4096, 5000):
        sizes = default_token_sizes(most)
        assert sizes[-1] == most and sizes == sorted(set(sizes)) and sizes[0] == min(16, most)
        for t in range(1, most + 1):
            tb = next(s for s in sizes if s >= t)
            assert tb <= max(t + 15, 1.25 * t), (most, t, tb)
    assert len(default_token_sizes(4096)) == 28


def attach(sched, sizes: list[int]) -> list[tuple[int, int]]:
    """Piecewise "graphs" (run eagerly) on the scheduler's runner; returns the (tokens, padded size) of each run."""
    pieces = eager_pieces(sched, sizes)
    runs, inner = [], pieces.run

    def counted(ids, ctx):
        runs.append((ids.shape[0], pieces._size(ids.shape[0])))
        return inner(ids, ctx)

    pieces.run = counted
    return runs


def workload(seed: int) -> tuple[list, dict]:
    """Staggered arrivals, a shared prefix (radix hits), greedy with top-2 log-probs and prompt log-probs."""
    rng = random.Random(seed)
    ps = prompts(6, 5, 45, seed)
    ps[0] += prompts(1, 30, 30, seed + 1)[0]          # so that its first 30 tokens exist: a hit the cache uses
    ps += [ps[0][:30] + ps[1][:9], ps[2][:12] + [rng.randrange(2, 4000) for _ in range(20)]]
    msgs = [msg(f"r{i}", p, max_new=10) for i, p in enumerate(ps)]
    for i, x in enumerate(msgs):         # prompt log-probs for the first six (the last two may hit the cache)
        x.return_logprob, x.top_logprobs_num, x.logprob_start_len = True, 2, 0 if i < 6 else -1
    return msgs, {x.rid: 2 * i if i < 6 else 40 + i for i, x in enumerate(msgs)}   # the last two after r0 .. r2 end


def assert_same(plain: dict, got: dict) -> None:
    for rid in plain:
        assert_greedy_equal_before_ties(plain[rid], got[rid], rid)


@pytest.mark.parametrize("flags", [dict(chunked_prefill_size=16), dict(enable_mixed_chunk=True, chunked_prefill_size=16),
                                   dict(chunked_prefill_size=-1, disable_overlap_schedule=True)],
                         ids=["chunk16", "mixed-chunk16", "whole-no-overlap"])
def test_piecewise_extends_give_the_plain_tokens(ckpt, flags):
    seed = random.randrange(2**31)
    print(f"seed {seed}")
    msgs, arrivals = workload(seed)
    plain = run(make(ckpt, **flags), msgs, arrivals)
    sched = make(ckpt, **flags)
    runs = attach(sched, [4, 12, 24])
    got = run(sched, msgs, arrivals)
    assert_same(plain, got)
    assert any(tb > t for t, tb in runs), runs                 # padded runs happened
    if flags["chunked_prefill_size"] < 0:                      # and prompts too long for them ran eagerly
        assert sched.stats["prompt_tokens"] > sum(t for t, _ in runs)
    if flags.get("enable_mixed_chunk"):
        assert sched.stats["mixed_steps"] > 0
    assert any(r["cached"] for r in got.values())              # a radix hit went through a prefix attention
    assert_no_leak(sched)


def test_prompt_logprobs_match_the_plain_forward(ckpt):
    """One request's whole prompt in one padded run: every prompt log-prob within fp32 noise of the plain one."""
    ids = prompts(1, 37, 37, seed=5)[0]
    outs = {}
    for piecewise in (False, True):
        sched = make(ckpt, chunked_prefill_size=-1)
        runs = attach(sched, [40]) if piecewise else []
        m = msg("p", ids, max_new=2)
        m.return_logprob, m.logprob_start_len = True, 0
        sched.add_request(m)
        while sched.has_work:
            for o in sched.step():
                if o.input_logprobs is not None:
                    outs[piecewise] = [lp for lp, _ in o.input_logprobs[1:]]
        assert not piecewise or runs == [(37, 40)]
    assert torch.allclose(torch.tensor(outs[True]), torch.tensor(outs[False]), atol=1e-4), outs


@pytest.mark.parametrize("mixed, topk", [(False, 1), (True, 1), (True, 2)], ids=["spec", "spec-mixed", "tree-mixed"])
def test_speculative_extends_run_through_the_pieces(ckpt, mixed, topk):
    """Under speculation the target's extends (with --enable-mixed-chunk, the running requests' verify rows among
    them: chains, or trees under their mask) run through the pieces: the tokens of the same flags without them."""
    msgs, arrivals = workload(7)
    flags = dict(speculative_algorithm="EAGLE", chunked_prefill_size=32 if mixed else 16, enable_mixed_chunk=mixed,
                 speculative_eagle_topk=topk, speculative_num_draft_tokens=4)
    plain = run(make(ckpt, **flags), msgs, arrivals)
    sched = make(ckpt, **flags)
    runs = attach(sched, [16, 32, 64])
    got = run(sched, msgs, arrivals)
    assert_same(plain, got)
    assert runs
    assert (sched.stats["mixed_steps"] > 0) == mixed, sched.stats
    assert_no_leak(sched)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU runs the Triton kernels under the interpreter; on a GPU "
                    "tests/test_combinations.py's piecewise rows cover them")
def test_triton_backend_takes_the_new_keys_from_the_pieces(ckpt):
    """--attention-backend triton (TRITON_INTERPRET=1 here): kv_b_proj runs in the piece before the attention, which
    gets the new tokens' k_nope / v (`takes_new_kv`), in plain and mixed batches; the plain run's tokens."""
    msgs = [msg("k0", [5, 6, 7, 8, 9], max_new=4), msg("k1", list(range(20, 33)), max_new=3)]
    arrivals = {"k0": 0, "k1": 1}
    kw = dict(attention_backend="triton", chunked_prefill_size=8, enable_mixed_chunk=True)
    plain = run(make(ckpt, **kw), msgs, arrivals)
    sched = make(ckpt, **kw)
    runs = attach(sched, [4, 12])
    got = run(sched, msgs, arrivals)
    assert {r: o["ids"] for r, o in got.items()} == {r: o["ids"] for r, o in plain.items()}
    assert runs and sched.stats["mixed_steps"] > 0, (runs, sched.stats)
