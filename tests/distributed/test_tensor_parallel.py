"""Tensor parallelism on the CPU (gloo, two ranks) against the single process: the model through the Engine API
(V2-Lite, V2 and V3 FP8 shapes), and the scheduler's radix hits, chunked prefill, retraction and aborts."""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

import mlaserve
from mlaserve.config import ServerConfig
from mlaserve.core import SamplingParams
from mlaserve.distributed import spawn_ranks
from mlaserve.ipc.messages import GenerateReqMsg
from parallel_common import (VARIANTS as ALL_VARIANTS, assert_fp8_outputs_close, assert_greedy_equal_before_ties,
                             checkpoint_builder, prompt_logprobs)
from seq_runner import drive_scheduler, eager_pieces

VARIANTS = ALL_VARIANTS          # tests/parallel_common.py: v2-lite, v2, v3, v3-fp8; FP8's bounds are there too


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoint_builder(tmp_path_factory.mktemp("tp"))


def generate(path: str, tp: int, prompts: list[list[int]], **server) -> tuple[list[dict], dict]:
    with mlaserve.Engine(model_path=path, device="cpu", tp_size=tp, log_level="warning", **server) as engine:
        greedy = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 8, "temperature": 0},
                                 return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
        sampled = engine.generate(input_ids=prompts[0], sampling_params={"max_new_tokens": 8, "temperature": 1.0,
                                                                         "top_p": 0.9, "seed": 11})
        return greedy + [sampled], engine.get_server_info()






# case -> (checkpoint, server flags); the FP8 KV cache rounds what it stores to e4m3 as FP8 weights' activations do
CASES = {name: (name, {}) for name in VARIANTS} | {"v3-kv-fp8": ("v3", {"kv_cache_dtype": "fp8_e4m3"})}


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_equals_tp1_through_the_engine(checkpoint, case):
    seed = random.randrange(2**31)
    print(f"seed {seed}")
    rng = random.Random(seed)
    prompts = [[rng.randrange(5, 4000) for _ in range(rng.randint(3, 40))] for _ in range(3)]
    variant, flags = CASES[case]
    path = checkpoint(variant)
    ref, _ = generate(path, 1, prompts, **flags)
    got, info = generate(path, 2, prompts, **flags)
    assert (info["tp_size"], info["dist_timeout"]) == (2, 600.0)
    assert info["max_total_tokens"] > 0 and info["dist_init_addr"].startswith("127.0.0.1:")
    if VARIANTS[variant][2] or "kv_cache_dtype" in flags:
        assert_fp8_outputs_close(ref[:-1], got[:-1])
        return
    diffs = [abs(x - y) for a, b in zip(ref[:-1], got[:-1]) for x, y in zip(prompt_logprobs(a), prompt_logprobs(b))]
    assert max(diffs) <= 1e-4, max(diffs)
    assert [o["output_ids"] for o in ref] == [o["output_ids"] for o in got]   # greedy, and seeded sampling


# --- the scheduler on two ranks (SPMD: the same messages at the same steps) ---------------------------------

def _msg(rid: str, ids: list[int], max_new: int, **params) -> GenerateReqMsg:
    # the top two log-probs of each output token: greedy comparisons stop at a near-tie (parallel_common)
    p = SamplingParams(max_new_tokens=max_new, temperature=params.pop("temperature", 0.0), **params)
    return GenerateReqMsg(rid, ids, p, seed=params.get("seed") or 1234, return_logprob=True, top_logprobs_num=2)


def _scheduler(path: str, group=None, **flags):
    from mlaserve.scheduler.scheduler import Scheduler

    args = dict(model_path=path, device="cpu", dtype="float32", log_level="warning",
                tp_size=group.size if group else 1) | flags
    return Scheduler(ServerConfig.from_flat(**args), path, group=group)


def drive_on_ranks(group, path: str, flags: dict, msgs: list, arrivals: dict, aborts: dict) -> dict:
    """One rank's run: every rank adds the same messages at the same steps (as the leader's broadcast does)."""
    sched = _scheduler(path, group, **flags)
    out = drive_scheduler(sched, msgs, arrivals, aborts)
    kv = sched.kv
    idle = kv.tree.protected_size == 0 and kv.allocator.available + kv.tree.total_size() == kv.num_slots
    return {"results": out, "retracted": sched.num_retracted, "idle": idle,
            "as_decode": sched.runner.extends_as_decode}


def seeded_prompts(shared_len: int, with_prefix: tuple[int, int], alone: tuple[int, int, int]):
    """(rng, prompts) with a fresh, printed seed: with_prefix = (count, most extra tokens) prompts of one shared
    prefix of shared_len tokens, then alone = (count, fewest, most tokens) prompts of their own."""
    seed = int(os.environ.get("TEST_SEED") or random.randrange(2**31))     # TEST_SEED=N replays a printed seed
    print(f"seed {seed}")
    rng = random.Random(seed)
    shared = [rng.randrange(5, 4000) for _ in range(shared_len)]
    prompts = [shared + [rng.randrange(5, 4000) for _ in range(rng.randint(1, with_prefix[1]))]
               for _ in range(with_prefix[0])]
    prompts += [[rng.randrange(5, 4000) for _ in range(rng.randint(alone[1], alone[2]))] for _ in range(alone[0])]
    return rng, prompts


def test_cached_prompt_as_a_decode_step_under_tp2(checkpoint):
    """A prompt cached whole runs its last token as a decode step on both ranks (with mixed chunk's decodes beside
    it), token for token what one process gives."""
    _, prompts = seeded_prompts(24, (1, 6), (1, 10, 30))
    msgs = [_msg("a", prompts[0], 4), _msg("x", prompts[1], 16), _msg("b", prompts[0], 8)]
    arrivals = {"a": 0, "x": 0, "b": 8}                      # b: after a finished, while x decodes
    path, flags = checkpoint("v3"), dict(enable_mixed_chunk=True)
    one = drive_on_ranks(None, path, flags, msgs, arrivals, {})
    ranks = spawn_ranks(drive_on_ranks, 2, path, flags, msgs, arrivals, {}, timeout=300)
    assert ranks[0] == ranks[1], "the two ranks disagree"
    two = ranks[0]
    assert two["results"]["b"]["cached"] == len(prompts[0]) - 1 and two["as_decode"] > 0 and two["idle"], two
    cold = drive_on_ranks(None, path, flags | dict(disable_radix_cache=True), msgs, arrivals, {})
    assert cold["as_decode"] == 0
    for m in msgs:
        assert_greedy_equal_before_ties(one["results"][m.rid], two["results"][m.rid], m.rid)
        assert_greedy_equal_before_ties(cold["results"][m.rid], two["results"][m.rid], m.rid)


def _dense_whole_on_ranks(group, path: str, msgs: list) -> dict:
    sched = _scheduler(path, group, moe_dense_tp_size=1)
    layers = sched.runner.model.model.layers
    shapes = {"dense down_proj": tuple(layers[0].mlp.down_proj.weight.shape),
              "o_proj": tuple(layers[0].self_attn.o_proj.weight.shape)}
    return {"results": drive_scheduler(sched, msgs), "shapes": shapes}


def test_dense_layers_whole_on_every_rank_under_tp2(checkpoint):
    """--moe-dense-tp-size 1 at tp 2 (V2 shape, one dense first layer): the dense MLP is whole on both ranks (no
    all-reduce after it) while attention stays split, and the tokens equal one process's."""
    _, prompts = seeded_prompts(8, (2, 10), (2, 5, 30))
    msgs = [_msg(f"r{i}", p, 8) for i, p in enumerate(prompts)]
    path = checkpoint("v2")
    one = drive_on_ranks(None, path, {}, msgs, {}, {})
    ranks = spawn_ranks(_dense_whole_on_ranks, 2, path, msgs, timeout=300)
    assert ranks[0] == ranks[1], "the two ranks disagree"
    cfg = json.loads((Path(path) / "config.json").read_text())
    h, inter, heads = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    assert ranks[0]["shapes"] == {"dense down_proj": (h, inter), "o_proj": (h, heads // 2 * cfg["v_head_dim"])}
    for m in msgs:
        assert_greedy_equal_before_ties(one["results"][m.rid], ranks[0]["results"][m.rid], m.rid)


def test_radix_chunked_prefill_retraction_and_aborts_under_tp2(checkpoint):
    rng, prompts = seeded_prompts(48, (5, 30), (8, 4, 90))
    path = checkpoint("v3")
    small = dict(max_total_tokens=160, max_running_requests=16, chunked_prefill_size=64,
                 init_new_token_ratio=0.0, min_new_token_ratio=0.0)
    # NOTE: now and then (seed 969082443; none of 30 others) the drawn lengths, arrivals and aborts fit the pool
    # without a retraction: draw them again from the same stream until one process retracts
    for _ in range(10):
        msgs = [_msg(f"s{i}", p, 1 if i == 0 else rng.randint(1, 30) if i < 5 else rng.randint(15, 30))
                for i, p in enumerate(prompts)]
        # s0 finishes first and leaves the shared prefix in the radix tree; s1..s4 arrive together right after it
        # (a hit before anything else can evict it), the others while those run; three of the others are aborted
        arrivals = {m.rid: 0 if i == 0 else 4 if i < 5 else rng.randint(5, 8) for i, m in enumerate(msgs)}
        aborts = {m.rid: arrivals[m.rid] + rng.randint(0, 12) for m in rng.sample(msgs[5:], 3)}
        one = drive_on_ranks(None, path, small, msgs, arrivals, aborts)
        if one["retracted"]:
            break
    big = drive_scheduler(_scheduler(path, max_total_tokens=8192), msgs, arrivals)
    ranks = spawn_ranks(drive_on_ranks, 2, path, small, msgs, arrivals, aborts, timeout=300)
    assert ranks[0] == ranks[1], "the two ranks disagree"
    two = ranks[0]
    assert two["retracted"] > 0 and two["idle"], "the small pool was meant to force retraction"
    assert any(r["cached"] >= 48 for r in two["results"].values()), "no radix hit on the shared prefix"
    for m in msgs:
        got, alone = two["results"][m.rid], one["results"][m.rid]
        assert_greedy_equal_before_ties(alone, got, m.rid)
        if m.rid not in aborts:
            assert_greedy_equal_before_ties(big[m.rid], got, m.rid, finished=False)


def _pieces_on_ranks(group, path: str, flags: dict, msgs: list, arrivals: dict) -> dict:
    """drive_on_ranks with piecewise "graphs" (`seq_runner.eager_pieces`) on the rank."""
    sched = _scheduler(path, group, **flags)
    pieces = eager_pieces(sched, [8, 24, 48])
    out = drive_scheduler(sched, msgs, arrivals)
    return {"results": out, "runs": pieces.runs, "mixed": sched.stats["mixed_steps"]}


def test_piecewise_extends_under_tp2_equal_one_process(checkpoint):
    """The pieces' padded rows go through the all-reduces (and the MoE) with the real ones: the same greedy tokens
    as one process without pieces (V3 shape, mixed chunks, a radix hit)."""
    rng, prompts = seeded_prompts(20, (3, 20), (3, 4, 40))
    msgs = [_msg(f"p{i}", p, rng.randint(4, 12)) for i, p in enumerate(prompts)]
    arrivals = {m.rid: 0 if i == 0 else 14 + 2 * i for i, m in enumerate(msgs)}
    path = checkpoint("v3")
    flags = dict(max_total_tokens=1024, chunked_prefill_size=16, enable_mixed_chunk=True)
    one = drive_scheduler(_scheduler(path, **flags), msgs, arrivals)
    ranks = spawn_ranks(_pieces_on_ranks, 2, path, flags, msgs, arrivals, timeout=300)
    assert ranks[0] == ranks[1], "the two ranks disagree"
    assert ranks[0]["runs"] > 0 and ranks[0]["mixed"] > 0, ranks[0]
    assert any(r["cached"] for r in ranks[0]["results"].values()), "no radix hit"
    for m in msgs:
        assert_greedy_equal_before_ties(one[m.rid], ranks[0]["results"][m.rid], m.rid)


def test_speculative_decoding_under_tp2_equals_one_process_without_it(tmp_path):
    """The demo model (its MTP head drafts well) through the Engine at tp 2 with speculation and a draft token
    map (the 2048 most frequent tokens of some held-out text: the two vocabulary shards hold different numbers of
    them, so the shorter one pads): the greedy and seeded-sampled tokens of one process without it; accept lengths
    reported per request and by the server. (Speculation at tp 2 without a map: tests/test_combinations.py.)"""
    from mlaserve.demo import DEMO_DIR
    from mlaserve.tokenizer import load_tokenizer
    from mlaserve.tools.corpus import heldout_files, read_sources
    from mlaserve.tools.token_map import count_tokens, top_ids, write

    path = str(DEMO_DIR)
    tok = load_tokenizer(path)
    prompts = [tok.encode(h) for h in ("def read_config(path):\n", "class Stack:\n    def __init__(self):\n",
                                       "import os\n\ndef list_files(root):\n")]
    ids = top_ids(count_tokens(tok.backend, read_sources(sorted(heldout_files())[:40]), 8192), 2048)
    assert (ids < 4096).sum() != (ids >= 4096).sum()
    write(ids, tmp_path / "map.pt")
    ref, _ = generate(path, 1, prompts, dtype="float32")
    got, info = generate(path, 2, prompts, dtype="float32", speculative_algorithm="EAGLE",
                         speculative_token_map=str(tmp_path / "map.pt"))
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in ref]
    diffs = [abs(x - y) for a, b in zip(ref[:-1], got[:-1]) for x, y in zip(prompt_logprobs(a), prompt_logprobs(b))]
    assert max(diffs) <= 1e-4
    assert info["speculative_num_steps"] == 3 and info["avg_spec_accept_length"] > 1.5
    assert all(o["meta_info"]["spec_verify_ct"] >= 1 for o in got)
    assert any(o["meta_info"]["spec_accept_length"] > 1.5 for o in got)


def _mixed_spec_on_ranks(group, path: str, flags: dict, msgs: list, arrivals: dict) -> dict:
    sched = _scheduler(path, group, **flags)
    out = drive_scheduler(sched, msgs, arrivals)
    kv = sched.kv
    return {"results": out, "mixed": sched.stats["mixed_steps"], "verify": sched.stats["spec_verify_steps"],
            "idle": kv.tree.protected_size == 0 and kv.allocator.available + kv.tree.total_size() == kv.num_slots}


def test_mixed_chunk_with_speculation_under_tp2_equals_one_process_without_either():
    """--enable-mixed-chunk with MTP drafts at tp 2 (the demo model): the decodes' drafts, their verify rows in the
    prefill batches and their accepts run on both ranks alike, and give one plain process's tokens."""
    from mlaserve.demo import DEMO_DIR
    from mlaserve.tokenizer import load_tokenizer

    path = str(DEMO_DIR)
    tok = load_tokenizer(path)
    heads = ("def read_config(path):\n", "class Stack:\n    def __init__(self):\n",
             "import os\n\ndef list_files(root):\n", "def fibonacci(n):\n")
    msgs = [_msg(f"m{i}", tok.encode(h), 16) for i, h in enumerate(heads)]
    arrivals = {m.rid: 3 * i for i, m in enumerate(msgs)}
    one = drive_scheduler(_scheduler(path), msgs, arrivals)
    flags = dict(enable_mixed_chunk=True, speculative_algorithm="EAGLE", chunked_prefill_size=16)
    ranks = spawn_ranks(_mixed_spec_on_ranks, 2, path, flags, msgs, arrivals, timeout=300)
    assert ranks[0] == ranks[1], "the two ranks disagree"
    assert ranks[0]["mixed"] > 0 and ranks[0]["verify"] > 0 and ranks[0]["idle"], ranks[0]
    for m in msgs:
        assert_greedy_equal_before_ties(one[m.rid], ranks[0]["results"][m.rid], m.rid)


@pytest.mark.multi_gpu
@pytest.mark.parametrize("variant", ["v2", "v3"])
def test_tp2_on_two_gpus_equals_one_gpu(checkpoint, variant):
    """NCCL, Triton kernels and CUDA graphs capturing the all-reduces, in float32: tp 2 == tp 1."""
    seed = random.randrange(2**31)
    print(f"seed {seed}")
    rng = random.Random(seed)
    prompts = [[rng.randrange(5, 4000) for _ in range(rng.randint(3, 40))] for _ in range(4)]
    path = checkpoint(variant)
    flags = dict(device="cuda", dtype="float32", max_total_tokens=4096)
    with mlaserve.Engine(model_path=path, tp_size=1, log_level="warning", **flags) as engine:
        ref = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 16, "temperature": 0},
                              return_logprob=True, logprob_start_len=0)
    with mlaserve.Engine(model_path=path, tp_size=2, log_level="warning", **flags) as engine:
        got = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 16, "temperature": 0},
                              return_logprob=True, logprob_start_len=0)
        assert not engine.get_server_info()["disable_cuda_graph"]
    assert [o["output_ids"] for o in ref] == [o["output_ids"] for o in got]
    diff = max(abs(x - y) for a, b in zip(ref, got) for x, y in zip(prompt_logprobs(a), prompt_logprobs(b)))
    assert diff <= 1e-4, diff
