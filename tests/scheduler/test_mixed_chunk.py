"""--enable-mixed-chunk on the CPU: running decodes ride in prefill batches as one-token extends, and every request
gets exactly the tokens it gets without mixing (fp32, greedy; seeded sampling, penalties, stop ids, log-probs),
with chunked prefill, the overlap scheduler on and off, a radix hit and retraction."""
from __future__ import annotations

import json
import random
import re

import pytest
import torch

from mlaserve.config import ServerConfig
from mlaserve.core import SamplingParams
from mlaserve.ipc.messages import GenerateReqMsg
from mlaserve.scheduler.scheduler import Scheduler
from seq_runner import drive_scheduler as run
from test_scheduler import make, msg, prompts


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield




def staggered(n: int = 6, seed: int = 1) -> tuple[list[GenerateReqMsg], dict[str, int]]:
    """n requests, each arriving while the ones before it decode (every 3 steps)."""
    msgs = [msg(f"r{i}", p, max_new=14) for i, p in enumerate(prompts(n, 5, 50, seed))]
    return msgs, {x.rid: 3 * i for i, x in enumerate(msgs)}


def assert_same(got: dict, want: dict) -> None:
    for rid in want:
        assert got[rid]["ids"] == want[rid]["ids"], rid
        assert got[rid]["finished"] == want[rid]["finished"], rid


def assert_no_leak(sched: Scheduler) -> None:
    kv = sched.kv
    assert kv.tree.protected_size == 0 and kv.req_pool.available == sched.max_running + 7
    assert kv.allocator.available + kv.tree.total_size() == kv.num_slots


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("chunk", [-1, 8], ids=["whole", "chunk8"])
def test_mixed_batches_give_the_same_greedy_tokens(ckpt, overlap, chunk):
    """Requests arriving every 3 steps while the earlier ones decode: token for token the plain run's, and no
    request ever waits a step between two of its tokens."""
    msgs, arrivals = staggered()
    kw = dict(chunked_prefill_size=chunk, disable_overlap_schedule=not overlap)
    plain_sched = make(ckpt, **kw)
    plain = drive(plain_sched, msgs, arrivals)
    mixed_sched = make(ckpt, enable_mixed_chunk=True, **kw)
    mixed = drive(mixed_sched, msgs, arrivals)
    assert_same(mixed, plain)
    assert plain_sched.stats["mixed_steps"] == 0
    assert mixed_sched.stats["mixed_steps"] >= (len(msgs) - 1 if chunk < 0 else 10), mixed_sched.stats
    # what a streaming client sees: without mixing a decode pauses a step for each prefill; with it, never
    assert max(max_gap(r["steps"]) for r in plain.values()) >= 2
    assert max(max_gap(r["steps"]) for r in mixed.values()) == 1
    assert mixed_sched.stats["generation_tokens"] == plain_sched.stats["generation_tokens"]
    assert mixed_sched.stats["prompt_tokens"] == plain_sched.stats["prompt_tokens"]
    assert_no_leak(mixed_sched)


def test_radix_hit_while_others_decode(ckpt):
    shared = prompts(1, 40, 40, seed=2)[0]
    first = [msg("a", shared + [11, 12], max_new=10)]
    second = [msg("x", prompts(1, 20, 20, seed=3)[0], max_new=16), msg("b", shared + [13, 14, 15], max_new=10)]
    arrivals = {"x": 0, "b": 4}
    results = {}
    for mixed in (False, True):
        sched = make(ckpt, enable_mixed_chunk=mixed, chunked_prefill_size=16)
        run(sched, first)
        before = sched.stats["mixed_steps"]
        results[mixed] = run(sched, second, arrivals)
        assert results[mixed]["b"]["cached"] >= 40
        if mixed:
            assert sched.stats["mixed_steps"] > before
            assert_no_leak(sched)
    assert_same(results[True], results[False])


def test_sampling_penalties_stop_ids_and_logprobs_stay_per_request(ckpt):
    check_sampling_per_request(prompts(6, 5, 40, seed=4), lambda **kw: make(ckpt, chunked_prefill_size=16, **kw),
                               dict(enable_mixed_chunk=True))


def check_sampling_per_request(ps: list[list[int]], sched_of, mixing: dict) -> None:
    """Seeded sampling, penalties, min_new_tokens, stop ids and log-probs of requests (arriving every 2 steps) that
    decode inside mixed batches: the tokens of a run without `mixing` (the flags given to `sched_of`, which makes a
    scheduler), and the same log-probs (fp32, up to summation order)."""
    alone = run(sched_of(), [msg("probe", ps[2], max_new=16)])["probe"]["ids"]
    kws = [{"temperature": 0.8, "seed": 5, "top_p": 0.9}, {"frequency_penalty": 0.7, "min_new_tokens": 4},
           {"stop_token_ids": [alone[6]]}, {"temperature": 1.0, "seed": 9, "repetition_penalty": 1.3},
           {"presence_penalty": 0.5}, {}]

    def msgs() -> list[GenerateReqMsg]:
        out = []
        for i, (p, kw) in enumerate(zip(ps, kws)):
            x = msg(f"s{i}", p, max_new=16, **kw)
            x.return_logprob, x.top_logprobs_num = True, 2
            out.append(x)
        return out

    arrivals = {f"s{i}": 2 * i for i in range(len(ps))}
    got = {}
    for mixed in (False, True):
        sched = sched_of(**(mixing if mixed else {}))
        got[mixed] = drive(sched, msgs(), arrivals)
        assert (sched.stats["mixed_steps"] > 0) == mixed
    for rid, want in got[False].items():
        have = got[True][rid]
        assert have["ids"] == want["ids"] and have["finished"] == want["finished"], rid
        assert [t for _, t in have["lp"]] == [t for _, t in want["lp"]]
        assert [lp for lp, _ in have["lp"]] == pytest.approx([lp for lp, _ in want["lp"]], abs=1e-4), rid
        assert [[t for _, t in top] for top in have["top"]] == [[t for _, t in top] for top in want["top"]]
    assert got[True]["s2"]["finished"].kind == "stop"


def drive(sched: Scheduler, msgs: list, arrivals: dict[str, int]) -> dict:
    """Like `seq_runner.drive_scheduler`, also keeping log-probs and the step each output token came out at."""
    res = {x.rid: {"ids": [], "lp": [], "top": [], "steps": [], "finished": None} for x in msgs}
    pending = sorted(msgs, key=lambda x: arrivals[x.rid])
    for step in range(2000):
        while pending and arrivals[pending[0].rid] <= step:
            sched.add_request(pending.pop(0))
        for out in sched.step():
            r = res[out.rid]
            r["ids"] += out.new_ids
            r["steps"] += [step] * len(out.new_ids)
            r["lp"] += out.new_logprobs
            r["top"] += out.new_top_logprobs
            r["finished"] = out.finished or r["finished"]
        if not pending and not sched.has_work:
            return res
    raise AssertionError("scheduler did not finish")


def max_gap(steps: list[int]) -> int:
    return max((b - a for a, b in zip(steps, steps[1:])), default=1)


def test_retraction_and_aborts_with_mixed_batches(ckpt):
    """A pool small enough that decode must retract, and aborts at random steps: mixed batches give the tokens of a
    roomy plain run (an aborted request a prefix of them), and free everything."""
    rng = random.Random(7)
    msgs = [msg(f"t{i}", p, max_new=rng.randint(4, 30)) for i, p in enumerate(prompts(14, 4, 70, seed=7))]
    arrivals = {x.rid: rng.randint(0, 25) for x in msgs}
    small = make(ckpt, enable_mixed_chunk=True, max_total_tokens=260, max_running_requests=12,
                 chunked_prefill_size=32, init_new_token_ratio=0.0, min_new_token_ratio=0.0)
    check_retraction_and_aborts(make(ckpt), small, msgs, arrivals, rng)


def check_retraction_and_aborts(big: Scheduler, small: Scheduler, msgs: list, arrivals: dict,
                                rng: random.Random) -> None:
    """`small` (a pool that must retract, mixed batches) with aborts at random steps against `big` (roomy, plain):
    the same tokens (an aborted request's a prefix of them), retraction and mixed steps seen, every slot back."""
    aborts = {x.rid: arrivals[x.rid] + rng.randint(0, 12) for x in rng.sample(msgs, 3)}
    want = run(big, msgs, arrivals)
    got = run(small, msgs, arrivals, aborts)
    assert small.num_retracted > 0 and small.stats["mixed_steps"] > 0, (small.num_retracted, small.stats)
    for x in msgs:
        r = got[x.rid]
        if x.rid in aborts and r["finished"].kind == "abort":
            assert want[x.rid]["ids"][: len(r["ids"])] == r["ids"], x.rid
        else:
            assert (r["ids"], r["finished"]) == (want[x.rid]["ids"], want[x.rid]["finished"]), x.rid
    assert_no_leak(small)


def test_grammar_masks_in_mixed_batches(tmp_path_factory, monkeypatch):
    """Structured output (the demo model, sampled at temperature 1): constrained requests decoding inside mixed
    batches get their own grammar's mask, the same tokens as without mixing, and outputs that match."""
    from mlaserve.server.launch import demo_model_path
    from mlaserve.tokenizer import load_tokenizer

    monkeypatch.setenv("MLASERVE_CACHE", str(tmp_path_factory.mktemp("mlaserve-cache")))
    demo = str(demo_model_path())
    tok = load_tokenizer(demo)
    regex = r"(yes|no)-[0-9]{2,4}"
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"]}
    prompts = [tok.encode(t) for t in ("Answer:", "def f(x):\n    return", "Give me JSON:", "import os\n")]
    kinds = [{"regex": regex}, {}, {"json_schema": json.dumps(schema)}, {"regex": regex}]

    def msgs() -> list[GenerateReqMsg]:
        return [GenerateReqMsg(f"g{i}", p, SamplingParams(max_new_tokens=40, seed=i + 1, **kw), seed=i + 1)
                for i, (p, kw) in enumerate(zip(prompts, kinds))]

    arrivals = {f"g{i}": 3 * i for i in range(len(prompts))}
    got = {}
    for mixed in (False, True):
        sched = Scheduler(ServerConfig.from_flat(model_path=demo, device="cpu", dtype="float32", log_level="warning",
                                                 max_total_tokens=4096, chunked_prefill_size=4,
                                                 enable_mixed_chunk=mixed), demo)
        riding = []                    # constrained requests that decoded inside a mixed batch
        bitmask = sched.grammar.bitmask

        def spy(batch, _inner=bitmask, _sched=sched):
            riding.extend(r.rid for i, r in enumerate(batch.reqs)
                          if batch.num_decode and batch.is_decode(i) and r.rid in _sched.grammar.states)
            return _inner(batch)

        monkeypatch.setattr(sched.grammar, "bitmask", spy)
        got[mixed] = run(sched, msgs(), arrivals)
        assert (sched.stats["mixed_steps"] > 0) == mixed and bool(riding) == mixed, riding
        assert not sched.grammar.states
    assert_same(got[True], got[False])
    for i, kw in enumerate(kinds):
        text = tok.decode(got[True][f"g{i}"]["ids"])
        if "regex" in kw:
            assert re.fullmatch(regex, text), text
        elif "json_schema" in kw:
            assert 0 <= json.loads(text)["n"] <= 99, text


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU runs the Triton kernels under the interpreter; "
                    "on a GPU tests/test_combinations.py's graphs-mixed-chunk row covers them")
def test_triton_kernels_in_mixed_batches(ckpt):
    """--attention-backend triton (TRITON_INTERPRET=1 here): mla_prefill over the prompts' part, mla_decode with
    its split count chosen on the host over the decodes' part; the same tokens as without mixing."""
    msgs = [msg("k0", [5, 6, 7], max_new=4), msg("k1", [8, 9, 10, 11, 12, 13], max_new=2)]
    arrivals = {"k0": 0, "k1": 1}
    kw = dict(attention_backend="triton", chunked_prefill_size=4)
    plain = run(make(ckpt, **kw), msgs, arrivals)
    sched = make(ckpt, enable_mixed_chunk=True, **kw)
    assert_same(run(sched, msgs, arrivals), plain)
    assert sched.stats["mixed_steps"] >= 2


def test_non_absorbed_decode_in_mixed_batches(ckpt):
    """--disable-mla: the decodes of a mixed batch run the extend form like everything else; same tokens."""
    msgs, arrivals = staggered(4, seed=8)
    plain = run(make(ckpt, disable_mla=True), msgs, arrivals)
    sched = make(ckpt, disable_mla=True, enable_mixed_chunk=True, chunked_prefill_size=8)
    assert_same(run(sched, msgs, arrivals), plain)
    assert sched.stats["mixed_steps"] > 0


def test_mixed_decode_warm_up_runs_every_count_and_changes_nothing(ckpt):
    """`ModelRunner.warm_mixed_decode` (run at GPU startup with --enable-mixed-chunk): every decode count up to the
    running limit and its split counts, on the padding row; the tokens served afterwards are the plain ones."""
    msgs, arrivals = staggered(4, seed=3)
    kw = dict(enable_mixed_chunk=True, chunked_prefill_size=8, max_running_requests=6)
    plain = run(make(ckpt, **kw), msgs, arrivals)
    sched = make(ckpt, **kw)
    calls, inner = [], sched.runner.attn_backend.decode

    def counted(layer, q, q_pe, ctx):
        calls.append((q.shape[0], ctx.num_kv_splits))
        return inner(layer, q, q_pe, ctx)

    sched.runner.attn_backend.decode = counted
    sched.runner.warm_mixed_decode(sched.kv.req_to_token, sched.kv.req_pool.alloc())
    sched.runner.attn_backend.decode = inner
    assert sorted({n for n, _ in calls}) == list(range(1, 7)) and (1, 1) in calls and (1, 2) in calls, calls
    assert_same(run(sched, msgs, arrivals), plain)
