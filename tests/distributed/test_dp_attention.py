"""Data-parallel attention on the CPU (gloo, two ranks, tp 2 dp 2: two attention groups, the MoE over both ranks)
against the single process: the model through the Engine API (V2-Lite and V3 shapes), and the groups' schedulers
side by side (one idle while the other decodes, aborts, radix hits, retraction on one group)."""
from __future__ import annotations

import os
import random

import pytest

import mlaserve
from mlaserve.config import ServerConfig
from mlaserve.core import ForwardMode, SamplingParams
from mlaserve.distributed import spawn_ranks
from mlaserve.ipc.messages import GenerateReqMsg
from parallel_common import (VARIANTS as ALL_VARIANTS, assert_fp8_outputs_close, assert_greedy_equal_before_ties,
                             checkpoint_builder, prompt_logprobs)
from seq_runner import drive_scheduler, eager_pieces

DP = dict(tp_size=2, dp_size=2, enable_dp_attention=True)
# name -> (source config, overrides, fp8, widths set after shrinking): V2-Lite (no q_lora, softmax greedy routing,
# first layer dense), V3 (q_lora, sigmoid + noaux_tc, a dense first layer, 16 experts), and V3 in block FP8 with
# widths whose per-rank expert shards are whole 128-blocks
VARIANTS = {k: ALL_VARIANTS[k] for k in ('v2-lite', 'v3', 'v3-fp8')}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoint_builder(tmp_path_factory.mktemp("dp"))


def _seeded() -> random.Random:
    seed = int(os.environ.get("TEST_SEED") or random.randrange(2**31))     # TEST_SEED=N replays a printed seed
    print(f"seed {seed}")
    return random.Random(seed)


# --- the gather and scatter around the MoE alone ------------------------------------------------------------

# counts of the two groups: uneven, equal (the graphs' padded sizes), one idle; the last two rows are too many
# for the peer buffers (1 MiB) at h = 4096: the reduce-scatter takes them with or without the buffers
SCATTER_COUNTS = [(5, 3), (4, 4), (0, 6), (40, 70), (72, 72)]
SCATTER_H = 4096


def _gather_scatter_on_rank(group, seed: int) -> list[dict]:
    import torch

    dp, rows = group.dp, []
    for i, counts in enumerate(SCATTER_COUNTS):
        gen = torch.Generator().manual_seed(seed + i)
        xs = [torch.randn(c, SCATTER_H, generator=gen) for c in counts]                  # each group's rows
        parts = [torch.randn(sum(counts), SCATTER_H, generator=gen) for _ in counts]     # each rank's partials
        gathered = dp.gather(xs[dp.dp_rank].clone(), list(counts))
        y = parts[group.info.rank].clone()
        path = "reduce-scatter" if dp.reduce_scatters(y) else "all-reduce"
        mine = dp.scatter(y, list(counts))
        start = sum(counts[: dp.dp_rank])
        want = (parts[0] + parts[1])[start: start + counts[dp.dp_rank]]
        rows.append({"gather": torch.equal(gathered, torch.cat(xs)), "scatter": torch.equal(mine, want),
                     "shape": tuple(mine.shape) == (counts[dp.dp_rank], SCATTER_H), "path": path})
    return rows


@pytest.mark.parametrize("peer", [False, True], ids=["gloo", "peer-buffers"])
def test_gather_scatter_equal_the_sums_on_every_path(peer):
    """tp 2 dp 2 (groups of one rank): the gather gives every group's rows in DP-rank order, the scatter each rank
    the full sums of its own rows, uneven and idle groups included. Rows the peer buffers take (with them) go by
    one all-reduce, the rest by a reduce-scatter of the padded layout."""
    seed = random.randrange(2**31)
    print(f"seed {seed}")
    ranks = spawn_ranks(_gather_scatter_on_rank, 2, seed, dp_size=2, peer_all_reduce=peer, timeout=600)
    for rank in ranks:
        assert all(r["gather"] and r["scatter"] and r["shape"] for r in rank), rank
    paths = [r["path"] for r in ranks[0]]
    small = ["all-reduce"] * 3 if peer else ["reduce-scatter"] * 3
    assert paths == small + ["reduce-scatter"] * 2, paths


# --- the model through the Engine API: tp 2 dp 2 == tp 1 ------------------------------------------------------

def generate(path: str, prompts: list[list[int]], **server) -> tuple[list[dict], dict]:
    with mlaserve.Engine(model_path=path, device="cpu", log_level="warning", **server) as engine:
        greedy = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 8, "temperature": 0},
                                 return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
        info = engine.get_server_info()
        assert engine.flush_cache(), "flush refused with every group idle"
        return greedy, info | {"tree_after_flush": engine.get_server_info()["cached_tokens_in_tree"]}






# case -> (checkpoint, tp, dp): two groups of one rank (the MoE over both), and two groups of two ranks (attention
# split within each group, the MoE over all four; four processes on the CPU: slow)
CASES = {"v2-lite": ("v2-lite", 2, 2), "v3": ("v3", 2, 2), "v3-fp8": ("v3-fp8", 2, 2),
         "v3-tp4-dp2": pytest.param(("v3", 4, 2), marks=pytest.mark.slow)}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_dp_attention_equals_tp1_through_the_engine(checkpoint, case):
    rng = _seeded()
    prompts = [[rng.randrange(5, 4000) for _ in range(rng.randint(3, 40))] for _ in range(4)]
    variant, tp, dp = case
    path = checkpoint(variant)
    ref, _ = generate(path, prompts)
    got, info = generate(path, prompts, tp_size=tp, dp_size=dp, enable_dp_attention=True,
                         load_balance_method="round_robin")
    assert (info["tp_size"], info["dp_size"], info["enable_dp_attention"]) == (tp, dp, True)
    assert [g["dp_rank"] for g in info["dp_groups"]] == list(range(dp))
    assert all(g["prompt_tokens"] > 0 for g in info["dp_groups"]), "round robin left a group without requests"
    assert all(g["cached_tokens_in_tree"] > 0 for g in info["dp_groups"]) and info["tree_after_flush"] == 0
    if VARIANTS[variant][2]:
        # block FP8: the experts' partial sums over two ranks round differently from one GEMM, now and then flipping
        # an e4m3 rounding downstream (tests/parallel_common.py)
        assert_fp8_outputs_close(ref, got)
        return
    diffs = [abs(x - y) for a, b in zip(ref, got) for x, y in zip(prompt_logprobs(a), prompt_logprobs(b))]
    assert max(diffs) <= 1e-4, max(diffs)
    assert [o["output_ids"] for o in ref] == [o["output_ids"] for o in got]


# --- the groups' schedulers side by side (each group its own messages, every rank stepping together) ----------

def _msg(rid: str, ids: list[int], max_new: int, ignore_eos: bool = False) -> GenerateReqMsg:
    # the top two log-probs of each output token: the comparison stops at a near-tie (parallel_common)
    return GenerateReqMsg(rid, ids, SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=ignore_eos),
                          seed=1234, return_logprob=True, top_logprobs_num=2)


def _scheduler(path: str, group=None, **flags):
    from mlaserve.scheduler.scheduler import Scheduler

    dp = DP if group is not None else {}
    args = dict(model_path=path, device="cpu", dtype="float32", log_level="warning") | dp | flags
    return Scheduler(ServerConfig.from_flat(**args), path, group=group)


def _padded_graphs(sched, sizes: list[int]) -> None:
    """Decode "graphs" under DP attention on the CPU: the runner replays the agreed padded size (`Batch.graph_bs`)
    through DecodeGraphRunner's (or, speculating, SpecGraphRunner's) own padded functions, run eagerly
    (capture=False: no CUDA here)."""
    from mlaserve.engine.graph import DecodeGraphRunner, SpecGraphRunner

    r = sched.runner
    dummy, context, dp = sched.kv.req_pool.alloc(), min(r.context_len, r.num_slots), r.group.dp.dp_size
    if r.spec is not None:
        r.spec.graphs = SpecGraphRunner(r.spec, sched.kv.req_to_token, dummy, sizes, context, r.device, dp_size=dp,
                                        capture=False)
    else:
        r.graphs = DecodeGraphRunner(r.model, r.pool, r.attn_backend, sched.kv.req_to_token, dummy, sizes, context,
                                     r.device, r.token_buf, dp_size=dp, capture=False)
    sched.dp_sync.graph_sizes = sorted(sizes)


def drive_dp(group, path: str, flags: dict, work: list[tuple[list, dict, dict]],
             graph_sizes: list[int] | None = None, piece_sizes: list[int] | None = None) -> dict:
    """One rank of tp 2 dp 2: its group's scheduler adds work[dp_rank]'s messages at their steps and every rank
    steps every iteration (as the scheduler processes do) until no group has anything left. `graph_sizes`: decode
    steps replay padded "graphs" (`_padded_graphs`) whenever the ranks agree on one; `piece_sizes`: extend steps
    run padded piecewise "graphs" (`seq_runner.eager_pieces`) whenever the ranks agree on a size."""
    sched = _scheduler(path, group, **flags)
    if graph_sizes:
        _padded_graphs(sched, graph_sizes)
    if piece_sizes:
        eager_pieces(sched, piece_sizes)
    msgs, arrivals, aborts = work[group.info.dp_rank]
    results = {x.rid: {"ids": [], "finished": None, "cached": 0, "top": [], "prompt": []} for x in msgs}
    pending = sorted(msgs, key=lambda x: arrivals.get(x.rid, 0))
    modes, idle_steps, retracted_at, graph_steps, piece_steps = [], 0, [], [], []
    for step in range(3000):
        before = sched.num_retracted
        while pending and arrivals.get(pending[0].rid, 0) <= step:
            sched.add_request(pending.pop(0))
        for rid, at in aborts.items():
            if at == step:
                sched.abort(rid)
        for out in sched.step():
            r = results[out.rid]
            r["ids"] += out.new_ids
            r["top"] += out.new_top_logprobs
            r["cached"] = out.cached_tokens
            r["prompt"] += [lp for lp, _ in out.input_logprobs or []]
            if out.finished:
                r["finished"] = out.finished
        modes.append(tuple(sched.dp_sync.modes))
        if sched.num_retracted > before:
            retracted_at.append(len(modes) - 1)
        idle_steps += sched.pending is not None and sched.pending.batch.mode is ForwardMode.IDLE
        if sched.pending is not None:
            b = sched.pending.batch
            graphs = sched.runner.graphs if sched.runner.spec is None else None
            # with a decode graph: the MoE rows its mask leaves out (padding rows, every group's)
            masked = int((~graphs.row_mask[: 2 * b.graph_bs]).sum()) if graphs is not None and b.graph_bs else None
            graph_steps.append((b.mode, b.graph_bs, masked))
            # (mode, agreed piece size, this group's tokens, whether one of them extends a cached prefix or chunk,
            # decodes riding along (--enable-mixed-chunk))
            piece_steps.append((b.mode, b.piece_tokens, sum(b.extend_lens), any(b.prefix_lens), b.num_decode))
        if not any(n for (n,) in group.all_gather_ints([bool(pending) or sched.has_work])):
            break
    kv = sched.kv
    clean = kv.tree.protected_size == 0 and kv.allocator.available + kv.tree.total_size() == kv.num_slots
    return {"results": results, "retracted": retracted_at, "clean": clean, "modes": modes,
            "idle_steps": idle_steps, "dp_rank": sched.get_stats()["dp_rank"], "graph_steps": graph_steps,
            "piece_steps": piece_steps, "piece_runs": sched.runner.pieces.runs if piece_sizes else 0}


A2A = dict(ep_size=2, moe_dispatch="all_to_all")


@pytest.mark.parametrize("graphs,extra", [(False, {}), (True, {}), (False, A2A), (True, A2A)],
                         ids=["eager", "padded-graphs", "eager-ep2-all-to-all", "padded-graphs-ep2-all-to-all"])
def test_groups_schedule_independently_idle_abort_radix_retraction(checkpoint, graphs, extra):
    """Group 0: one long request decoding alone, a shared-prefix pair (radix hit) and an abort; group 1: a burst
    that retracts in its small pool, with the same kind of shared-prefix pair. Each group's outputs equal the same
    requests run by one process; the group without work runs IDLE steps (no hang). With decode graphs (sizes
    1 2 4 8, their padded forward run eagerly on the CPU): every rank replays the size agreed for the step, an
    idle group padding rows only; steps with a prefill anywhere, or more than 8 requests in a group, run eagerly.
    With ep 2 and the all-to-all dispatch every step's rows travel to their experts' ranks (the padded "graphs"
    run eagerly here, so they take it too; an idle group sends none and still takes part)."""
    rng = _seeded()
    tok = lambda n: [rng.randrange(5, 4000) for _ in range(n)]   # noqa: E731
    shared0, shared1 = tok(40), tok(40)
    g0 = [_msg("a-long", tok(12), 60, ignore_eos=True), _msg("a-pre", shared0 + tok(5), 1), _msg("a-hit", shared0 + tok(7), 6),
          _msg("a-abort", tok(20), 40)]
    g1 = [_msg("b-pre", shared1 + tok(3), 1), _msg("b-hit", shared1 + tok(9), 5)]
    g1 += [_msg(f"b{i}", tok(rng.randint(20, 60)), rng.randint(20, 30)) for i in range(8)]
    # group 1 starts late (group 0 decodes alone, group 1 idles), its burst arrives together after its radix hit
    arr0 = {"a-long": 0, "a-pre": 2, "a-hit": 6, "a-abort": 6}
    arr1 = {"b-pre": 12, "b-hit": 16} | {f"b{i}": 17 for i in range(8)}
    ab0 = {"a-abort": 10}
    work = [(g0, arr0, ab0), (g1, arr1, {})]
    small = dict(max_total_tokens=220, max_running_requests=16, chunked_prefill_size=64,
                 init_new_token_ratio=0.0, min_new_token_ratio=0.0)
    path = checkpoint("v3")
    ranks = spawn_ranks(drive_dp, 2, path, small | extra, work, [1, 2, 4, 8] if graphs else None, timeout=300,
                        dp_size=2)
    alone = [drive_scheduler(_scheduler(path, **small), m, a, ab) for m, a, ab in work]
    assert [r["dp_rank"] for r in ranks] == [0, 1]
    sizes = [bs for _, bs, _ in ranks[0]["graph_steps"]]
    assert sizes == [bs for _, bs, _ in ranks[1]["graph_steps"]], "the ranks disagree on a step's graph"
    if graphs:
        on = [(a, b) for (a, bs, _), (b, _, _) in zip(ranks[0]["graph_steps"], ranks[1]["graph_steps"])
              if bs is not None]
        assert len(on) > 10 and 1 in sizes and max(bs or 0 for bs in sizes) > 1, sizes
        assert (ForwardMode.DECODE, ForwardMode.IDLE) in on, "an idle group replayed padding rows"
        if not extra:              # the gathered MoE: an idle group's rows (all padding) route to no expert
            idle = [(bs, m) for (a, bs, m), (b, _, _) in zip(ranks[0]["graph_steps"], ranks[1]["graph_steps"])
                    if bs is not None and b is ForwardMode.IDLE]
            assert idle and all(m >= bs for bs, m in idle), idle
        assert all(ForwardMode.EXTEND not in (a, b) for a, b in on)
        assert None in sizes, "the steps with a prefill or more than 8 requests ran eagerly"
    else:
        assert set(sizes) == {None}
    assert ranks[0]["modes"] == ranks[1]["modes"], "the ranks disagree on the steps"
    # group 0 decoded alone while group 1 ran IDLE forwards (its ranks took part in every MoE)
    assert (ForwardMode.DECODE, None) in ranks[0]["modes"] and ranks[1]["idle_steps"] > 0
    assert ranks[1]["retracted"] and not ranks[0]["retracted"], "retraction was meant for group 1 only"
    assert any(ranks[0]["modes"][i][0] is not None for i in ranks[1]["retracted"]), "group 0 idled at every retraction"
    assert all(r["clean"] for r in ranks)
    assert ranks[0]["results"]["a-hit"]["cached"] >= 40 and ranks[1]["results"]["b-hit"]["cached"] >= 40
    assert ranks[0]["results"]["a-abort"]["finished"].kind == "abort"
    for rank, ref in zip(ranks, alone):
        for rid, want in ref.items():
            assert_greedy_equal_before_ties(want, rank["results"][rid], rid)


def _prompt_msg(rid: str, ids: list[int], max_new: int, ignore_eos: bool = False) -> GenerateReqMsg:
    m = _msg(rid, ids, max_new, ignore_eos)
    m.logprob_start_len = 0                      # every prompt position's log-prob
    return m


def assert_prompt_logprobs_close(want: dict, got: dict, rid: str) -> None:
    """fp32: every prompt log-prob of `got` within 1e-4 of the reference's (the first position has none)."""
    assert len(want["prompt"]) == len(got["prompt"]) > 1, rid
    assert all(a is None and b is None or abs(a - b) <= 1e-4 for a, b in zip(want["prompt"], got["prompt"])), \
        (rid, want["prompt"], got["prompt"])


@pytest.mark.parametrize("mixed", [False, True], ids=["plain", "mixed-chunk"])
def test_piecewise_extends_under_dp_attention_equal_one_process(checkpoint, mixed):
    """Piecewise "graphs" (sizes 8 24 48, their padded split forward run eagerly on the CPU) under tp 2 dp 2: every
    rank runs the pieces of the size agreed for the step, each group padding its rows to it, so each MoE gathers
    [Tb] * 2 rows. Steps covered: group 0 extending while group 1 runs the pieces on padding rows only; both
    extending with token counts of different sizes (group 0's 5 or so tokens: 8, group 1's 20: 24; both run 24, and
    a rank choosing its own size would misalign the gather); the second chunk of a chunked prompt (attention over
    the cached first chunk); a 64-token chunk, more than the largest size, eager on both ranks; a group decoding
    beside an extend, eager. With --enable-mixed-chunk a group's running decodes ride in its extends, through the
    pieces too. Greedy tokens and prompt log-probs equal one process without pieces."""
    rng = _seeded()
    tok = lambda n: [rng.randrange(5, 4000) for _ in range(n)]   # noqa: E731
    # EOS ignored: a0 still decodes at a1's second chunk (a mixed batch through the pieces with mixed chunks), a2
    # while group 1's 54-token batch extends (a decode beside an extend)
    g0 = [_prompt_msg("a0", tok(30), 6, True), _prompt_msg("a1", tok(100), 6), _prompt_msg("a2", tok(5), 8, True)]
    g1 = [_prompt_msg("b0", tok(20), 6)] + [_prompt_msg(f"b{i}", tok(18), 4) for i in (1, 2, 3)]
    work = [(g0, {"a0": 0, "a1": 4, "a2": 10}, {}), (g1, {"b0": 10, "b1": 14, "b2": 14, "b3": 14}, {})]
    flags = dict(max_total_tokens=1024, chunked_prefill_size=64, enable_mixed_chunk=mixed)
    sizes = [8, 24, 48]
    path = checkpoint("v3")
    alone = [drive_scheduler(_scheduler(path, **flags), m, a, ab) for m, a, ab in work]
    ranks = spawn_ranks(drive_dp, 2, path, flags, work, None, sizes, timeout=300, dp_size=2)
    assert ranks[0]["modes"] == ranks[1]["modes"], "the ranks disagree on the steps"
    steps = list(zip(ranks[0]["piece_steps"], ranks[1]["piece_steps"]))
    assert all(a[1] == b[1] for a, b in steps), "the ranks disagree on a step's pieces"
    on = [(a[0], b[0]) for a, b in steps if a[1] is not None]
    assert (ForwardMode.EXTEND, ForwardMode.IDLE) in on, "group 1 ran the pieces on padding rows"
    size = lambda n: next(s for s in sizes if s >= n)   # noqa: E731
    assert any(a[1] == 24 and a[2] and b[2] and size(a[2]) != size(b[2]) for a, b in steps), steps
    assert any(a[1] == 48 and a[3] for a, b in steps), "a prompt's second chunk went through the pieces"
    assert any(a[1] is None and a[2] > 48 and b[0] is not ForwardMode.DECODE for a, b in steps), \
        "the 64-token chunk ran eagerly"
    assert any(a[1] is None and ForwardMode.DECODE in (a[0], b[0]) and ForwardMode.EXTEND in (a[0], b[0])
               for a, b in steps), "a decode beside an extend ran eagerly"
    assert all(m is not ForwardMode.DECODE for pair in on for m in pair)
    assert ranks[0]["piece_runs"] == sum(a[0] is ForwardMode.EXTEND for a, _ in steps if a[1] is not None)
    assert not mixed or any(a[1] is not None and a[4] for a, _ in steps), "a mixed batch went through the pieces"
    for rank, ref in zip(ranks, alone):
        for rid, want in ref.items():
            assert_greedy_equal_before_ties(want, rank["results"][rid], rid)
            assert_prompt_logprobs_close(want, rank["results"][rid], rid)


# --- speculative decoding under DP attention (every group runs every forward of the step: drafts, target, draft
# layer; IDLE where it has none) --------------------------------------------------------------------------------

def _demo_prompts() -> list[list[int]]:
    from mlaserve.demo import DEMO_DIR
    from mlaserve.tokenizer import load_tokenizer

    tok = load_tokenizer(str(DEMO_DIR))
    return [tok.encode(h) for h in ("def read_config(path):\n", "class Stack:\n    def __init__(self):\n",
                                    "import os\n\ndef list_files(root):\n", "def fibonacci(n):\n")]


@pytest.mark.parametrize("dispatch", ["gather", "all_to_all"])
def test_speculative_decoding_under_dp_attention_and_ep_equals_one_process(dispatch):
    from mlaserve.demo import DEMO_DIR

    path, prompts = str(DEMO_DIR), _demo_prompts()
    ref, _ = generate(path, prompts, dtype="float32")
    got, info = generate(path, prompts, dtype="float32", speculative_algorithm="EAGLE", load_balance_method="round_robin",
                         ep_size=2, moe_dispatch=dispatch, **DP)  # and the experts split over the two ranks
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in ref]
    diffs = [abs(x - y) for a, b in zip(ref, got) for x, y in zip(prompt_logprobs(a), prompt_logprobs(b))]
    assert max(diffs) <= 1e-4
    assert all(g["spec_verify_steps"] > 0 for g in info["dp_groups"]), "both groups were meant to decode"
    assert info["avg_spec_accept_length"] > 1.5


@pytest.mark.parametrize("variant,dispatch", [("v3", "gather"), ("v3", "all_to_all"), ("v2-lite", "all_to_all")])
def test_dp_attention_with_expert_parallelism_equals_tp1(checkpoint, variant, dispatch):
    """tp 2 dp 2 ep 2: each rank holds half of the routed experts whole. gather: they run on every group's gathered
    tokens and the scatter sums the two halves; all_to_all: each group routes its own tokens and sends each to the
    ranks holding its experts (V3: one shared expert, V2-Lite: two, run whole on each rank's own rows)."""
    rng = _seeded()
    prompts = [[rng.randrange(5, 4000) for _ in range(rng.randint(3, 40))] for _ in range(4)]
    path = checkpoint(variant)
    ref, _ = generate(path, prompts)
    got, info = generate(path, prompts, ep_size=2, load_balance_method="round_robin", moe_dispatch=dispatch, **DP)
    assert (info["ep_size"], info["moe_dispatch"]) == (2, dispatch)
    diffs = [abs(x - y) for a, b in zip(ref, got) for x, y in zip(prompt_logprobs(a), prompt_logprobs(b))]
    assert max(diffs) <= 1e-4
    assert [o["output_ids"] for o in ref] == [o["output_ids"] for o in got]


# NOTE: tree drafts run eagerly in their padded-graph case too (every step with a prefill), so no separate eager case
@pytest.mark.parametrize("tree,graphs", [({}, False), ({}, True),
                                        ({"speculative_eagle_topk": 3, "speculative_num_draft_tokens": 6}, True)],
                         ids=["chain", "chain-padded-graphs-pieces", "tree-padded-graphs"])
def test_speculative_groups_in_different_modes_equal_one_process(tree, graphs):
    """Group 0 decodes (drafts, verify, repair) while group 1 idles, then prefills (its target and draft-layer
    extends beside group 0's decode forwards), then both decode: outputs equal one process without speculation.
    Tree drafts: each draft step's forward has K i tokens per request, the verify N, the repair S. With graphs
    (sizes 1 2 4, their padded functions run eagerly on the CPU) the decode-only steps replay the agreed size on
    every rank, the idle group with padding rows only; with chain drafts the extends also run piecewise "graphs"
    (sizes 8 24 48, eagerly) where no group decodes: the target's forward through the pieces of the agreed size
    (an idle group's padding rows only), the draft layer's eagerly."""
    from mlaserve.demo import DEMO_DIR

    path, ps = str(DEMO_DIR), _demo_prompts()
    g0 = [_msg("a0", ps[0], 40), _msg("a1", ps[1] + ps[0], 24)]
    g1 = [_msg("b0", ps[2], 30), _msg("b1", ps[3], 12)]
    work = [(g0, {"a0": 0, "a1": 9}, {}), (g1, {"b0": 5, "b1": 7}, {})]
    flags = dict(speculative_algorithm="EAGLE", max_total_tokens=2048, **tree)
    alone = [drive_scheduler(_scheduler(path, max_total_tokens=2048), m, a, ab) for m, a, ab in work]
    pieces = [8, 24, 48] if graphs and not tree else None
    ranks = spawn_ranks(drive_dp, 2, path, flags, work, [1, 2, 4] if graphs else None, pieces, timeout=300,
                        dp_size=2)
    assert ranks[0]["modes"] == ranks[1]["modes"], "the ranks disagree on the steps"
    sizes = [bs for _, bs, _ in ranks[0]["graph_steps"]]
    assert sizes == [bs for _, bs, _ in ranks[1]["graph_steps"]], "the ranks disagree on a step's graph"
    if graphs:
        on = [(a, b) for (a, bs, _), (b, _, _) in zip(ranks[0]["graph_steps"], ranks[1]["graph_steps"])
              if bs is not None]
        assert len(on) > 5 and (ForwardMode.DECODE, ForwardMode.IDLE) in on and (ForwardMode.DECODE,) * 2 in on, on
        assert None in sizes, "the steps with a prefill ran eagerly"
    else:
        assert set(sizes) == {None}
    steps = list(zip(ranks[0]["piece_steps"], ranks[1]["piece_steps"]))
    assert all(a[1] == b[1] for a, b in steps), "the ranks disagree on a step's pieces"
    on = [(a[0], b[0]) for a, b in steps if a[1] is not None]
    if pieces:
        assert (ForwardMode.EXTEND, ForwardMode.IDLE) in on, "group 1 ran the target's pieces on padding rows"
        assert ranks[0]["piece_runs"] > 0                     # (group 1 prefills beside group 0's decodes: eager)
        assert all(ForwardMode.DECODE not in pair for pair in on), on
    else:
        assert not on
    modes = set(ranks[0]["modes"])
    assert (ForwardMode.DECODE, None) in modes and (ForwardMode.DECODE, ForwardMode.EXTEND) in modes, modes
    assert all(r["clean"] for r in ranks)
    for rank, ref in zip(ranks, alone):
        for rid, want in ref.items():
            assert_greedy_equal_before_ties(want, rank["results"][rid], rid)


@pytest.mark.parametrize("tree,graphs", [({}, False), ({}, True),
                                        ({"speculative_eagle_topk": 2, "speculative_num_draft_tokens": 4}, False)],
                         ids=["chain", "chain-padded-graphs", "tree"])
def test_mixed_chunk_with_speculation_under_dp_attention_equals_one_process(tree, graphs):
    """--enable-mixed-chunk under speculation at tp 2 dp 2: each group's later request arrives while its first one
    decodes, so the group runs mixed batches (the decodes' drafts, their verify rows in the prompt's target forward,
    their repair after its draft-layer extend) while the other group decodes, prefills, mixes or idles; every group
    runs every agreed forward. Outputs equal one process without speculation or mixing."""
    from mlaserve.demo import DEMO_DIR

    path, ps = str(DEMO_DIR), _demo_prompts()
    g0 = [_msg("a0", ps[0], 40), _msg("a1", ps[1] + ps[0], 24)]
    g1 = [_msg("b0", ps[2], 30), _msg("b1", ps[3], 12)]
    work = [(g0, {"a0": 0, "a1": 9}, {}), (g1, {"b0": 5, "b1": 7}, {})]
    flags = dict(speculative_algorithm="EAGLE", max_total_tokens=2048, enable_mixed_chunk=True,
                 chunked_prefill_size=32, **tree)
    alone = [drive_scheduler(_scheduler(path, max_total_tokens=2048), m, a, ab) for m, a, ab in work]
    ranks = spawn_ranks(drive_dp, 2, path, flags, work, [1, 2, 4] if graphs else None, None, timeout=300,
                        dp_size=2)
    assert ranks[0]["modes"] == ranks[1]["modes"], "the ranks disagree on the steps"
    for rank in ranks:                                    # (mode, pieces, tokens, prefix, decodes riding along)
        assert any(n for *_, n in rank["piece_steps"]), f"group {rank['dp_rank']} ran no mixed batch"
    assert all(r["clean"] for r in ranks)
    for rank, ref in zip(ranks, alone):
        for rid, want in ref.items():
            assert_greedy_equal_before_ties(want, rank["results"][rid], rid)


def _warm_up_on_rank(group, path: str, flags: dict) -> dict:
    sched = _scheduler(path, group, **flags)
    seen = []
    process = sched.process
    sched.process = lambda batch, out: (seen.append((batch.mode, list(batch.extend_lens))), process(batch, out))
    sched.warm_up(prefill_lens=(30, 50, 500))
    return {"extends": [n for mode, n in seen if mode is ForwardMode.EXTEND],
            "clean": sched.kv.used() == 0 and not sched.has_work and not sched.dp_sync.busy}


def test_warm_up_prefills_line_up_under_dp_attention(checkpoint):
    """The warm-up's prefills of each length (GPU default; here asked for) run in every DP group at the same steps
    (their MoE gathers line up: no hang), the one past the chunk size left out, and leave every group clean."""
    ranks = spawn_ranks(_warm_up_on_rank, 2, checkpoint("v3"), dict(chunked_prefill_size=64), timeout=300, dp_size=2)
    for r in ranks:
        assert r["extends"][2:] == [[30], [50]] and r["clean"], r
