"""--enable-mixed-chunk with MTP speculative decoding (chains and EAGLE-2 trees) on the CPU, fp32: the running
requests' verify rows (each one's last token and its drafts) ride in the prefill batches' target forward, and every
request gets exactly the tokens it gets with neither (greedy; seeded sampling, penalties, stop ids, log-probs), with
chunked prefill, the overlap scheduler on and off, a radix hit, retraction and aborts (tp 2 and DP attention:
tests/distributed). The trained demo model accepts most drafts; a random-weight V3-shape checkpoint rejects nearly
all of them."""
from __future__ import annotations

import random

import pytest
import torch

from mlaserve.demo import DEMO_DIR
from mlaserve.scheduler.scheduler import Scheduler
from mlaserve.tokenizer import load_tokenizer
from seq_runner import drive_scheduler as run
from test_mixed_chunk import assert_no_leak, check_retraction_and_aborts, check_sampling_per_request, drive, max_gap
from test_scheduler import make, msg, prompts

DEMO = str(DEMO_DIR)
HEADERS = ["def read_config(path):\n", "class Stack:\n    def __init__(self):\n", "import os\n\ndef list_files(root):\n",
           "def fibonacci(n):\n", "    for key, value in sorted(items.items()):\n", "def parse_args(argv=None):\n"]
SPEC = dict(speculative_algorithm="EAGLE", speculative_num_steps=3)
TREE = SPEC | dict(speculative_eagle_topk=2, speculative_num_draft_tokens=4)      # EAGLE-2 tree drafts, (3, 2, 4)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def demo_prompts() -> list[list[int]]:
    tok = load_tokenizer(DEMO)
    return [tok.encode(h) for h in HEADERS]


def demo(**kw) -> Scheduler:
    return make(DEMO, **kw)


def check_mixed_spec(path: str, ps: list[list[int]], max_new: int, spec: dict = SPEC, **kw) -> Scheduler:
    """Requests arriving every 3 steps while the earlier ones decode, with mixing + speculation against neither:
    the same tokens and ends, mixed steps that carried verify rows, and no decode that waited a step."""
    msgs = lambda: [msg(f"r{i}", p, max_new=max_new) for i, p in enumerate(ps)]     # noqa: E731
    arrivals = {f"r{i}": 3 * i for i in range(len(ps))}
    plain = drive(make(path, **kw), msgs(), arrivals)
    sched = make(path, enable_mixed_chunk=True, **spec, **kw)
    got = drive(sched, msgs(), arrivals)
    for rid, want in plain.items():
        assert (got[rid]["ids"], got[rid]["finished"]) == (want["ids"], want["finished"]), rid
    st = sched.stats
    assert st["mixed_steps"] >= len(ps) - 2 and st["spec_verify_steps"] > 0, st
    # a streaming client's view: with mixing a decoding request advances at every step, prefill or not
    assert max(max_gap(r["steps"]) for r in got.values()) == 1
    assert_no_leak(sched)
    return sched


@pytest.mark.parametrize("spec", [SPEC, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("chunk", [-1, 16], ids=["whole", "chunk16"])
def test_demo_model_mixed_spec_gives_the_plain_tokens(demo_prompts, overlap, chunk, spec):
    sched = check_mixed_spec(DEMO, demo_prompts, 20, spec, chunked_prefill_size=chunk,
                             disable_overlap_schedule=not overlap)
    st = sched.stats
    assert st["spec_tokens"] / st["spec_verify_steps"] > 1.5, st        # drafts were accepted inside mixed steps


@pytest.mark.parametrize("spec", [SPEC, TREE], ids=["chain", "tree"])
def test_random_model_rejected_drafts_in_mixed_batches(ckpt, spec):
    """Drafts rejected at nearly every step: the freed slots, the repaired draft KV and the next drafts stay right
    (a tree's accepted path moved to consecutive slots too)."""
    check_mixed_spec(ckpt, prompts(6, 5, 40, seed=21), 14, spec, chunked_prefill_size=48)


def test_radix_hit_while_others_speculate(demo_prompts):
    shared = demo_prompts[2] + demo_prompts[0]
    first = [msg("a", shared + demo_prompts[1][:3], max_new=8)]
    second = [msg("x", demo_prompts[3], max_new=24), msg("b", shared + demo_prompts[4][:4], max_new=10)]
    arrivals = {"x": 0, "b": 3}
    results = {}
    for mixed in (False, True):
        sched = demo(enable_mixed_chunk=mixed, chunked_prefill_size=16, **(SPEC if mixed else {}))
        run(sched, first)
        before = sched.stats["mixed_steps"]
        results[mixed] = run(sched, second, arrivals)
        assert results[mixed]["b"]["cached"] >= len(shared) - 1
        if mixed:
            assert sched.stats["mixed_steps"] > before
            assert_no_leak(sched)
    for rid in results[False]:
        assert results[True][rid]["ids"] == results[False][rid]["ids"], rid


@pytest.mark.parametrize("spec", [SPEC, TREE], ids=["chain", "tree"])
def test_sampling_penalties_stops_and_logprobs_in_mixed_spec(demo_prompts, spec):
    """Seeded sampling, penalties, stop ids and log-probs of requests whose verify rows ride in mixed batches."""
    check_sampling_per_request(demo_prompts, lambda **kw: demo(chunked_prefill_size=32, **kw),
                               dict(enable_mixed_chunk=True, **spec))


@pytest.mark.parametrize("spec", [SPEC, TREE], ids=["chain", "tree"])
def test_retraction_and_aborts_with_mixed_spec(demo_prompts, spec):
    rng = random.Random(17)
    msgs = [msg(f"t{i}", p, max_new=rng.randint(30, 60)) for i, p in enumerate(demo_prompts * 2)]
    arrivals = {x.rid: rng.randint(0, 12) for x in msgs}
    small = demo(enable_mixed_chunk=True, max_total_tokens=260, max_running_requests=10, chunked_prefill_size=48,
                 init_new_token_ratio=0.0, min_new_token_ratio=0.0, **spec)
    check_retraction_and_aborts(demo(), small, msgs, arrivals, rng)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU runs the Triton kernels under the interpreter; on a GPU "
                    "tests/test_combinations.py's mixed-chunk speculation rows cover them")
def test_triton_backend_verifies_mixed_rows(ckpt):
    """--attention-backend triton (TRITON_INTERPRET=1 here): the decodes' verify rows of a mixed batch go through the
    Triton decode kernel with several queries a request under the tree mask (a chain's are the causal case) and the
    splits chosen on the host; the tokens of the same backend with neither mixing nor speculation."""
    msgs = [msg("k0", [5, 6, 7, 8, 9], max_new=4), msg("k1", list(range(20, 28)), max_new=2)]
    arrivals = {"k0": 0, "k1": 2}
    kw = dict(attention_backend="triton", chunked_prefill_size=16)
    plain = run(make(ckpt, **kw), msgs, arrivals)
    sched = make(ckpt, enable_mixed_chunk=True, **TREE, **kw)
    got = run(sched, msgs, arrivals)
    assert {r: o["ids"] for r, o in got.items()} == {r: o["ids"] for r, o in plain.items()}
    assert sched.stats["mixed_steps"] > 0, sched.stats
    assert_no_leak(sched)
