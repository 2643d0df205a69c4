"""A prompt found whole in the radix cache leaves one token to compute: the runner runs that extend as a decode step
(absorbed attention over the latent cache, `ModelRunner._decodes_alone`), alone or with --enable-mixed-chunk's
running decodes. Token for token what the same requests get without the radix cache (fp32), and the extend form still
runs where a request wants its prompt's log-probs."""
from __future__ import annotations

import pytest

from seq_runner import drive_scheduler as run
from test_scheduler import assert_no_leak, make, msg, prompts


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


@pytest.mark.parametrize("mixed", [False, True], ids=["plain", "mixed-chunk"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_cached_prompt_decodes_as_without_the_cache(ckpt, mixed, overlap):
    shared, other = prompts(2, 20, 40, seed=5)
    first = [msg("a", shared, max_new=8)]
    # b: the whole prompt again (one token left to compute) while x decodes; c: seeded sampling, cached as well
    second = [msg("x", other, max_new=14), msg("b", shared, max_new=10),
              msg("c", shared, max_new=10, temperature=0.8, seed=77)]
    arrivals = {"x": 0, "b": 4, "c": 6}
    kw = dict(enable_mixed_chunk=mixed, disable_overlap_schedule=not overlap)
    sched = make(ckpt, **kw)
    run(sched, first)
    before = sched.runner.extends_as_decode
    got = run(sched, second, arrivals)
    assert got["b"]["cached"] == got["c"]["cached"] == len(shared) - 1
    assert sched.runner.extends_as_decode >= before + 2, "the cached prompts ran the extend form"
    assert_no_leak(sched)
    want = run(make(ckpt, disable_radix_cache=True, **kw), second, arrivals)
    for rid in want:
        assert got[rid]["ids"] == want[rid]["ids"], rid
        assert got[rid]["finished"] == want[rid]["finished"], rid


def test_prompt_logprobs_keep_the_extend_form(ckpt):
    """The cache match stops before the first wanted prompt log-prob, so such a request extends by more than one
    token and keeps the extend form; its log-probs are the uncached run's."""
    shared = prompts(1, 20, 30, seed=6)[0]
    sched = make(ckpt)
    run(sched, [msg("a", shared, max_new=4)])
    before = sched.runner.extends_as_decode
    b = msg("b", shared, max_new=4)
    b.return_logprob, b.logprob_start_len = True, len(shared) - 2
    got = run(sched, [b])["b"]
    assert sched.runner.extends_as_decode == before
    assert 0 < got["cached"] < len(shared) - 1 and len(got["prompt"]) == 2, got
    want = run(make(ckpt, disable_radix_cache=True), [b])["b"]
    assert got["ids"] == want["ids"]
    assert got["prompt"] == pytest.approx(want["prompt"], abs=1e-4)


def test_short_prefix_hits_are_recomputed(ckpt):
    """A cached prefix shorter than MIN_PREFIX_HIT is not used (the prefix path would cost more than the tokens);
    from MIN_PREFIX_HIT on it is. Either way the tokens are the uncached run's and no slot leaks."""
    from mlaserve.scheduler.cache import MIN_PREFIX_HIT

    base, tail = prompts(2, 40, 40, seed=7)
    short = base[:MIN_PREFIX_HIT - 1] + tail[:10]
    long = base[:MIN_PREFIX_HIT] + tail[10:20]
    sched = make(ckpt)
    run(sched, [msg("a", base, max_new=4)])
    got = run(sched, [msg("s", short, max_new=6), msg("l", long, max_new=6)], {"l": 3})
    assert got["s"]["cached"] == 0 and got["l"]["cached"] == MIN_PREFIX_HIT, got
    # a short prompt seen whole before: its hit leaves one token, which runs as a decode step
    again = run(sched, [msg("t", tail[30:38], max_new=4), msg("t2", tail[30:38], max_new=4)], {"t2": 6})
    assert again["t"]["cached"] == 0 and again["t2"]["cached"] == 7, again
    assert again["t"]["ids"] == again["t2"]["ids"]
    assert_no_leak(sched)
    want = run(make(ckpt, disable_radix_cache=True), [msg("s", short, max_new=6), msg("l", long, max_new=6)], {"l": 3})
    assert got["s"]["ids"] == want["s"]["ids"] and got["l"]["ids"] == want["l"]["ids"]


@pytest.mark.gpu
@pytest.mark.parametrize("mixed", [False, True], ids=["plain", "mixed-chunk"])
def test_cached_prompt_through_the_decode_graph(ckpt, mixed):
    """GPU, CUDA graphs and Triton kernels (fp32): the cached prompt's step replays the decode graph, token for token
    what the same requests get without the radix cache."""
    shared, other = prompts(2, 20, 40, seed=8)
    second = [msg("x", other, max_new=14), msg("b", shared, max_new=10)]
    arrivals = {"x": 0, "b": 4}
    kw = dict(device="cuda", enable_mixed_chunk=mixed)
    sched = make(ckpt, **kw)
    assert sched.runner.graphs is not None
    run(sched, [msg("a", shared, max_new=8)])
    before = sched.runner.extends_as_decode
    got = run(sched, second, arrivals)
    assert got["b"]["cached"] == len(shared) - 1 and sched.runner.extends_as_decode > before
    want = run(make(ckpt, disable_radix_cache=True, **kw), second, arrivals)
    assert got["x"]["ids"] == want["x"]["ids"] and got["b"]["ids"] == want["b"]["ids"]
