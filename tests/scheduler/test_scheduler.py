"""The scheduler in-process on the CPU: continuous batching, prefix cache, chunked prefill, retraction, aborts."""
from __future__ import annotations

import random

import pytest
import torch

from mlaserve.config import ServerConfig
from mlaserve.core import FinishReason, ForwardMode, SamplingParams
from mlaserve.ipc.messages import GenerateReqMsg
from mlaserve.scheduler.scheduler import Scheduler
from seq_runner import drive_scheduler as run


def make(ckpt: str, **kw) -> Scheduler:
    args = dict(model_path=ckpt, device="cpu", dtype="float32", max_total_tokens=4096, log_level="warning")
    return Scheduler(ServerConfig.from_flat(**(args | kw)), ckpt)


def msg(rid: str, ids: list[int], max_new: int = 12, **params) -> GenerateReqMsg:
    p = SamplingParams(max_new_tokens=max_new, temperature=params.pop("temperature", 0.0), **params)
    return GenerateReqMsg(rid, ids, p, seed=params.get("seed") or 1234)


def prompts(n: int, lo: int = 5, hi: int = 60, seed: int | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 4000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def assert_no_leak(sched: Scheduler) -> None:
    kv = sched.kv
    assert kv.tree.protected_size == 0 and kv.req_pool.available == sched.max_running + 7   # one row is the CUDA-graph padding row
    assert kv.allocator.available + kv.tree.total_size() == kv.num_slots
    assert kv.flush() and kv.allocator.available == kv.num_slots


@pytest.mark.parametrize("radix,chunk", [(True, -1), (False, -1), (True, 16), (False, 16)])
def test_batched_greedy_equals_one_at_a_time(ckpt, radix, chunk):
    ps = prompts(6)
    ps.append(ps[0][:20] + ps[1][:30])             # shares a prefix with request 0
    ps.append(ps[0] + [7, 8, 9])                  # extends request 0's prompt
    msgs = [msg(f"r{i}", p) for i, p in enumerate(ps)]
    alone = {}
    for x in msgs:
        alone |= run(make(ckpt), [x])
    sched = make(ckpt, disable_radix_cache=not radix, chunked_prefill_size=chunk)
    together = run(sched, msgs, arrivals={f"r{i}": i % 3 for i in range(len(msgs))})
    for rid in alone:
        assert together[rid]["ids"] == alone[rid]["ids"], rid
        assert together[rid]["finished"] == alone[rid]["finished"]
    assert_no_leak(sched)


def test_prefix_cache_hit_is_reported(ckpt):
    sched = make(ckpt)
    shared = prompts(1, 40, 40, seed=1)[0]
    first = run(sched, [msg("a", shared + [11, 12])])
    second = run(sched, [msg("b", shared + [13, 14, 15])])
    assert first["a"]["cached"] == 0 and second["b"]["cached"] >= 40
    nocache = make(ckpt, disable_radix_cache=True)
    run(nocache, [msg("a", shared + [11, 12])])
    assert run(nocache, [msg("b", shared + [13, 14, 15])])["b"]["cached"] == 0


def test_stress_random_arrivals_aborts_and_retraction(ckpt):
    rng = random.Random()
    n = 24
    ps = prompts(n, 4, 90)
    msgs = [msg(f"s{i}", p, max_new=rng.randint(1, 40)) for i, p in enumerate(ps)]
    arrivals = {x.rid: rng.randint(0, 30) for x in msgs}
    aborted = {x.rid: arrivals[x.rid] + rng.randint(0, 20) for x in rng.sample(msgs, 4)}
    big = run(make(ckpt, max_total_tokens=8192), msgs, arrivals)
    # an optimistic admission estimate (ratio 0) over-admits, so decode must retract
    small = make(ckpt, max_total_tokens=300, max_running_requests=16, chunked_prefill_size=64,
                 init_new_token_ratio=0.0, min_new_token_ratio=0.0)
    got = run(small, msgs, arrivals, aborted)
    assert small.num_retracted > 0, "the pool was meant to be small enough to force retraction"
    for x in msgs:
        r = got[x.rid]
        assert r["finished"] is not None
        if x.rid in aborted and r["finished"].kind == "abort":
            assert big[x.rid]["ids"][: len(r["ids"])] == r["ids"]
        else:
            assert r["ids"] == big[x.rid]["ids"], x.rid
    assert_no_leak(small)


def test_too_long_prompt_rejected_not_left_waiting(ckpt):
    sched = make(ckpt, max_total_tokens=64, context_length=128)
    res = run(sched, [msg("long", list(range(2, 100))), msg("ctx", list(range(2, 200))), msg("ok", [5, 6, 7])])
    assert res["long"]["finished"].kind == "abort" and "KV cache" in res["long"]["finished"].message
    assert res["ctx"]["finished"].kind == "abort" and "context length" in res["ctx"]["finished"].message
    assert res["ok"]["finished"].kind == "length"


def test_allow_auto_truncate_keeps_the_prompts_head(ckpt):
    """--allow-auto-truncate: a prompt past the KV pool runs on its first tokens (the same output as that head sent
    as the prompt), and a max_new_tokens past the room is lowered to it."""
    sched = make(ckpt, max_total_tokens=64, context_length=128, allow_auto_truncate=True)
    fits = min(sched.limits.context_len, sched.limits.max_total_tokens)       # the pool's 64 slots
    long = list(range(2, 100))
    res = run(sched, [msg("long", long, max_new=1), msg("many", [5, 6, 7], max_new=500)])
    assert res["long"]["finished"].kind == "length"
    assert res["long"]["ids"] == run(make(ckpt, max_total_tokens=64, context_length=128),
                                     [msg("head", long[: fits - 1], max_new=1)])["head"]["ids"]
    assert res["many"]["finished"] == FinishReason("length", length=fits - 3) and len(res["many"]["ids"]) == fits - 3
    assert_no_leak(sched)


def test_max_queued_requests_ends_the_excess_with_503(ckpt):
    """--max-queued-requests 2: of five requests arriving at once, two wait and run; the other three end at once
    with 503 (the queue is full), nothing of theirs is held."""
    sched = make(ckpt, max_queued_requests=2)
    res = run(sched, [msg(f"r{i}", [3 + i, 4, 5], max_new=4) for i in range(5)])
    full = [r for r in res if res[r]["finished"].kind == "abort"]
    assert [res[r]["finished"].kind for r in sorted(res)] == ["length", "length", "abort", "abort", "abort"]
    assert all(res[r]["finished"].status_code == 503 and "queue is full" in res[r]["finished"].message
               for r in full)
    assert_no_leak(sched)


@pytest.mark.parametrize("overlap", [True, False])
def test_stream_interval_sends_the_first_token_then_every_n(ckpt, overlap):
    """--stream-interval 4: a request's outputs come as its first token, then 4 at a time, then the rest with its
    end; the tokens are those of --stream-interval 1."""
    def chunks(sched) -> tuple[list[int], list[int]]:
        sched.add_request(msg("s", [5, 6, 7, 8], max_new=10))
        sizes, ids = [], []
        while sched.has_work:
            for out in sched.step():
                sizes.append(len(out.new_ids))
                ids += out.new_ids
        return sizes, ids

    sizes, ids = chunks(make(ckpt, stream_interval=4, disable_overlap_schedule=not overlap))
    every, same = chunks(make(ckpt, disable_overlap_schedule=not overlap))
    assert sizes == [1, 4, 4, 1] and every == [1] * 10 and ids == same


def test_batch_lines_at_info_level(ckpt, caplog):
    """A line per prefill batch and one every --decode-log-interval decode steps (SGLang's batch logs), at info
    level only: none at the tests' warning level."""
    import logging

    reqs = [msg("a", [5, 6, 7, 8], max_new=9), msg("b", [9, 10], max_new=9)]
    with caplog.at_level(logging.INFO, logger="mlaserve.scheduler.batch_log"):
        run(make(ckpt, decode_log_interval=4, log_level="info"), reqs)
    lines = [r.getMessage() for r in caplog.records if r.name == "mlaserve.scheduler.batch_log"]
    prefill = [x for x in lines if x.startswith("prefill batch")]
    decode = [x for x in lines if x.startswith("decode batch")]
    assert prefill and prefill[0].startswith("prefill batch: 2 requests, 6 new tokens, 0 tokens from the cache")
    assert len(decode) == 2 and decode[0].startswith("decode batch: 2 running") and "tok/s" in decode[0]  # 8 steps
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        run(make(ckpt, decode_log_interval=4), reqs)
    assert not [r for r in caplog.records if r.getMessage().startswith(("prefill batch", "decode batch"))]


def test_abort_frees_everything(ckpt):
    sched = make(ckpt)
    res = run(sched, [msg("x", prompts(1, 50, 50)[0], max_new=100), msg("y", [3, 4, 5], max_new=3)],
              aborts={"x": 4})
    assert res["x"]["finished"] == FinishReason("abort") and res["y"]["finished"].kind == "length"
    assert_no_leak(sched)


def test_stop_token_ids_min_new_tokens_and_seeded_sampling(ckpt):
    sched = make(ckpt)
    base = run(sched, [msg("g", [9, 10, 11], max_new=10)])["g"]["ids"]
    stop_at = base[4]
    res = run(sched, [msg("s", [9, 10, 11], max_new=10, stop_token_ids=[stop_at])])["s"]
    assert res["ids"] == base[: base.index(stop_at) + 1] and res["finished"].matched == stop_at
    res = run(sched, [msg("m", [9, 10, 11], max_new=10, stop_token_ids=[stop_at], min_new_tokens=8)])["m"]
    assert len(res["ids"]) >= 8
    # a seeded sampled request gives the same tokens alone and inside a busy batch
    seeded = msg("t", [1, 2, 3], max_new=16, temperature=1.0, seed=77)
    alone = run(make(ckpt), [seeded])["t"]["ids"]
    others = [msg(f"o{i}", p, max_new=8, temperature=0.7, seed=i + 1) for i, p in enumerate(prompts(5))]
    seeded2 = msg("t", [1, 2, 3], max_new=16, temperature=1.0, seed=77)
    busy = run(make(ckpt), others + [seeded2], arrivals={"t": 2})["t"]["ids"]
    assert alone == busy


def test_overlap_schedule_gives_identical_outputs(ckpt):
    """Step N + 1 queued before step N is processed: same tokens (greedy and seeded sampling, stop ids,
    penalties, chunked prompts, retraction) as the plain loop."""
    rng = random.Random()
    ps = prompts(16, 4, 80)
    msgs = []
    for i, p in enumerate(ps):
        kw = {"temperature": 0.8, "seed": i + 1, "top_p": 0.9} if i % 2 else {}
        if i % 5 == 0:
            kw |= {"frequency_penalty": 0.5, "min_new_tokens": 3}
        msgs.append(msg(f"o{i}", p, max_new=rng.randint(3, 30), **kw))   # >= min_new_tokens
    arrivals = {x.rid: rng.randint(0, 10) for x in msgs}
    small = dict(max_total_tokens=400, chunked_prefill_size=32, init_new_token_ratio=0.0, min_new_token_ratio=0.0)
    plain = run(make(ckpt, disable_overlap_schedule=True, **small), msgs, arrivals)
    overlapped_sched = make(ckpt, **small)
    overlapped = run(overlapped_sched, msgs, arrivals)
    for x in msgs:
        assert overlapped[x.rid]["ids"] == plain[x.rid]["ids"], x.rid
        assert overlapped[x.rid]["finished"] == plain[x.rid]["finished"], x.rid
    assert_no_leak(overlapped_sched)


@pytest.mark.parametrize("max_new", [1, 2, 5])
def test_flush_right_after_the_last_output_under_overlap(ckpt, max_new):
    """The caller flushes as soon as it has the last output, while a step with that request's discarded token may
    still be in flight: the flush succeeds and empties the pool."""
    sched = make(ckpt)
    sched.add_request(msg("f", [5, 6, 7, 8], max_new=max_new))
    outs = []
    while not any(o.finished for o in outs):
        outs += sched.step()
    assert sum(len(o.new_ids) for o in outs) == max_new
    assert sched.flush_cache() and sched.kv.allocator.available == sched.kv.num_slots and not sched.has_work


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_cache(ckpt, kv_dtype):
    """--kv-cache-dtype fp8: the latent cache stores e4m3 / e5m2; generation runs and frees everything."""
    sched = make(ckpt, kv_cache_dtype=kv_dtype)
    assert sched.runner.pool.buffers[0].dtype == {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv_dtype]
    res = run(sched, [msg(f"f{i}", p, max_new=8) for i, p in enumerate(prompts(4))])
    assert all(r["finished"] is not None and len(r["ids"]) >= 1 for r in res.values())
    assert_no_leak(sched)


# --- hardening: one request's failure stays its own; nothing grows past the pool ---------------------------

def test_failure_while_processing_one_request_ends_only_that_one(ckpt, monkeypatch):
    sched = make(ckpt)
    append = sched._append

    def broken(req, *args):
        if req.rid == "bad":
            raise RuntimeError("boom")
        return append(req, *args)

    monkeypatch.setattr(sched, "_append", broken)
    res = run(sched, [msg("bad", [5, 6, 7], max_new=6), msg("good", [8, 9, 10], max_new=6)])
    bad = res["bad"]["finished"]
    assert (bad.kind, bad.status_code) == ("abort", 500) and "boom" in bad.message
    assert res["good"]["finished"] == FinishReason("length", length=6) and len(res["good"]["ids"]) == 6
    assert_no_leak(sched)


def test_failed_step_fails_requests_in_flight_and_the_loop_goes_on(ckpt, monkeypatch):
    from mlaserve.ipc import messages as m
    from mlaserve.scheduler.process import _handle, _step

    sched = make(ckpt)
    launch, calls = sched.runner.launch, []

    def flaky(batch):
        calls.append(batch)
        if len(calls) == 1:
            raise RuntimeError("device hiccup")
        return launch(batch)

    monkeypatch.setattr(sched.runner, "launch", flaky)
    sched.add_request(msg("a", [5, 6, 7], max_new=4))
    outs, failures = _step(sched, 0)
    assert failures == 1 and [(o.rid, o.finished.status_code) for o in outs] == [("a", 500)]
    # a message that cannot be decoded, and one whose handling raises, do not stop the loop
    assert _handle(sched, b"not a pickle") is None
    _handle(sched, m.encode(m.GenerateReqMsg("odd", ["x"], SamplingParams(), seed=1)))
    assert [(o.rid, o.finished.status_code) for o in sched.step_outbox()] == [("odd", 500)]
    assert run(sched, [msg("b", [5, 6, 7], max_new=4)])["b"]["finished"].kind == "length"
    assert_no_leak(sched)


def test_max_new_tokens_zero_returns_prompt_logprobs_and_no_token(ckpt):
    sched = make(ckpt)
    x = msg("z", [5, 6, 7, 8], max_new=0)
    x.return_logprob, x.logprob_start_len = True, 0
    sched.add_request(x)
    outs = []
    while sched.has_work:
        outs += sched.step()
    outs += sched.step_outbox()
    assert [o.new_ids for o in outs] == [[]] and outs[0].finished == FinishReason("length", length=0)
    assert [t for _, t in outs[0].input_logprobs] == [5, 6, 7, 8] and outs[0].input_logprobs[0][0] is None
    assert_no_leak(sched)


def test_request_that_cannot_fit_the_pool_never_runs_forever(ckpt):
    from mlaserve.core import Req

    sched = make(ckpt, max_total_tokens=64, context_length=512)
    res = run(sched, [msg("big", list(range(2, 22)), max_new=100)])      # 20 + 100 > 64: refused up front
    assert res["big"]["finished"].status_code == 400 and "max_new_tokens=100" in res["big"]["finished"].message
    # past that check (which only the manager and add_request make), a lone request ends with `length` when
    # the pool is full instead of being retracted and re-admitted for ever
    req = Req(**msg("lone", list(range(2, 22)), max_new=100).spec_fields())
    sched.waiting.append(req)
    for _ in range(500):
        if not sched.has_work:
            break
        sched.step()
    room = sched.kv.num_slots - len(req.input_ids)         # KV for the prompt and every output but the last
    assert req.finished is not None and req.finished.kind == "length" and room <= len(req.output_ids) <= room + 1
    assert sched.num_retracted == 0
    assert_no_leak(sched)


@pytest.mark.parametrize("spec", [False, True])
def test_warm_up_runs_a_prompt_then_its_prefix_hit_and_leaves_nothing_behind(ckpt, spec):
    """`Scheduler.warm_up` (run by each scheduler process before it reports ready): a cold prefill, then an extend
    over the cached prefix (the kernels a first cache hit would otherwise compile on a GPU), decodes (speculative
    ones with EAGLE); afterwards the pool is empty, the counters zero and no output is left to send."""
    sched = make(ckpt, **({"speculative_algorithm": "EAGLE"} if spec else {}))
    seen = []
    process = sched.process
    sched.process = lambda batch, out: (seen.append((batch.mode, list(batch.prefix_lens))), process(batch, out))
    assert sched.warm_up() > 0
    extends = [p for mode, p in seen if mode is ForwardMode.EXTEND]
    assert len(extends) == 2 and extends[0] == [0] and extends[1][0] > 0, seen
    assert any(mode is ForwardMode.DECODE for mode, _ in seen)
    assert sched.get_stats()["steps"] == 0 and sched.get_stats()["prompt_tokens"] == 0
    assert sched.kv.used() == 0 and not sched.step_outbox() and not sched.has_work
    if spec:
        assert sched.get_stats()["spec_verify_steps"] == 0


@pytest.mark.parametrize("spec", [False, True])
def test_warm_up_prefills_one_prompt_of_each_length_that_fits(ckpt, spec):
    """On a GPU the warm-up also prefills one prompt per length of WARMUP_PREFILL_LENS (the kernel tables'
    token-count tiles compile before the first user batch): each is one extend of exactly that many tokens (no
    prefix hit on the others), lengths past the chunk size are left out, and nothing stays behind. On the CPU
    the default is none."""
    sched = make(ckpt, chunked_prefill_size=64, **({"speculative_algorithm": "EAGLE"} if spec else {}))
    seen = []
    process = sched.process
    sched.process = lambda batch, out: (seen.append((batch.mode, list(batch.prefix_lens), list(batch.extend_lens))),
                                        process(batch, out))
    assert sched.warm_up(prefill_lens=(40, 9, 64, 65, 500)) > 0
    extends = [(p, n) for mode, p, n in seen if mode is ForwardMode.EXTEND]
    assert extends[2:] == [([0], [9]), ([0], [40]), ([0], [64])], extends       # 65 and 500 exceed the chunk
    assert sched.get_stats()["steps"] == 0 and sched.kv.used() == 0 and not sched.step_outbox()
    seen.clear()
    sched.warm_up()                                                              # the CPU default: the two only
    assert len([1 for mode, _, _ in seen if mode is ForwardMode.EXTEND]) == 2
