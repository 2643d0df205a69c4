"""Tree drafts (speculative_eagle_topk > 1) against decoding without speculation, in the scheduler on the CPU (fp32):
identical tokens, greedy and sampled, with radix hits, stop ids, stop strings (through the Engine) and
max_new_tokens inside an accepted path, log-probs, retraction, grammars; the trained demo model accepts at least as
many tokens per step as the chain; every slot back after. The tree's own pieces (candidate selection, path
acceptance) against brute force on random scores.
"""
from __future__ import annotations

import random

import pytest
import torch

from mlaserve.engine.spec_tree import accept_path, select
from test_spec import (DEMO, _outputs, accept_length, assert_no_leak, demo_prompts, demo_token_map, make, msg,  # noqa: F401
                       random_v3, run, same, spec)

TREES = [(3, 2, 4), (3, 3, 6), (2, 4, 8), (4, 2, 8)]      # (steps, topk, num_draft_tokens)


@pytest.fixture(scope="module", autouse=True)
def one_thread_module():
    """torch on one thread for the module's fixtures and tests: small ops on a loaded 2-core machine run many
    times faster (as conftest's `one_thread`, which is per test and comes after module fixtures)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tree(path: str, steps: int, topk: int, n: int, **kw):
    return spec(path, steps, speculative_eagle_topk=topk, speculative_num_draft_tokens=n, **kw)


# --- the tree's pieces ------------------------------------------------------------------------------------
def _random_candidates(b: int, steps: int, k: int):
    """Candidates as draft_tree lays them out: K at depth 1, then K * K per step below K frontier nodes; each
    candidate's token is its index."""
    tok, score, par, dep = [], [], [], []
    for _ in range(b):
        t, s, p, d = [], [], [], []
        front = []
        for i in range(steps):
            parents = [-1] if i == 0 else front
            new = []
            for f in parents:
                base = s[f] if f >= 0 else 0.0
                for _ in range(k):
                    t.append(len(t))
                    s.append(base - random.choice([0.0, 0.5, random.random() * 3]))   # ties on purpose
                    p.append(f)
                    d.append(i + 1)
                    new.append(len(t) - 1)
            front = sorted(new, key=lambda c: -s[c])[:k]
        tok.append(t), score.append(s), par.append(p), dep.append(d)
    as_t = lambda x, dt=torch.int64: torch.tensor(x, dtype=dt)          # noqa: E731
    return as_t(tok), as_t(score, torch.float32), as_t(par), as_t(dep)


@pytest.mark.parametrize("steps,topk,n", [(3, 2, 6), (4, 3, 12), (2, 4, 5)])
def test_select_keeps_parents_and_the_best_scores(steps, topk, n):
    tok, score, par, dep = _random_candidates(6, steps, topk)
    root = torch.arange(6)
    t = select(tok, score, par, dep, root, n, steps)
    assert (t.tokens[:, 0] == root).all()
    for b in range(6):
        parents, depth, mask = t.parents[b].tolist(), t.depth[b].tolist(), t.mask[b].tolist()
        cand = t.tokens[b].tolist()                                           # node -> candidate (node 0: root)
        assert parents[0] == 0 and depth[0] == 0 and mask[0] == 1
        for m in range(1, n):
            assert parents[m] < m and depth[m] == depth[parents[m]] + 1        # parents first, closed
            assert par[b, cand[m]].item() == (cand[parents[m]] if parents[m] else -1)
            assert depth[m] == dep[b, cand[m]].item()
            assert mask[m] == mask[parents[m]] | (1 << m)
        chosen = sorted(score[b, cand[1:]].tolist(), reverse=True)
        assert chosen == sorted(score[b].tolist(), reverse=True)[: n - 1]      # the best N - 1 by score


def _brute_accept(tokens, parents, depth, target):
    """The deepest node whose every ancestor-to-child step matches the target at the parent."""
    best, best_d = 0, 0
    for m in range(1, len(tokens)):
        ok, x = True, m
        while x != 0:
            ok &= tokens[x] == target[parents[x]]
            x = parents[x]
        if ok and depth[m] > best_d:
            best, best_d = m, depth[m]
    path, x = [], best
    while True:
        path.append(x)
        if x == 0:
            break
        x = parents[x]
    return best_d, path[::-1]


@pytest.mark.parametrize("steps,topk,n", [(3, 2, 6), (4, 3, 12)])
def test_accept_path_is_the_longest_matching_path(steps, topk, n):
    tok, score, par, dep = _random_candidates(40, steps, topk)
    t = select(tok % 3, score, par, dep, torch.zeros(40, dtype=torch.int64), n, steps)  # 3 tokens: many matches
    target = torch.randint(0, 3, t.tokens.shape)
    accepted, path = accept_path(t, target, steps)
    for b in range(40):
        want_n, want_path = _brute_accept(t.tokens[b].tolist(), t.parents[b].tolist(), t.depth[b].tolist(),
                                          target[b].tolist())
        assert accepted[b].item() == want_n
        assert path[b, : want_n + 1].tolist() == want_path


# --- end to end, in the scheduler ---------------------------------------------------------------------------
@pytest.mark.parametrize("steps,topk,n,sampled", [(3, 2, 4, False), (3, 3, 6, True), (2, 4, 8, False)])
def test_equal_on_random_weights(random_v3, steps, topk, n, sampled):
    """A random-weight V3-shape checkpoint: drafts rejected at nearly every node, every step."""
    rng = random.Random(topk)
    ps = [[rng.randrange(2, 4000) for _ in range(rng.randint(3, 50))] for _ in range(4)]
    flags = dict(temperature=0.9, top_p=0.95, frequency_penalty=0.3, seed=rng.randrange(1 << 20)) if sampled else {}
    msgs = [msg(f"r{i}", p, max_new=rng.randint(1, 16), **flags) for i, p in enumerate(ps)]
    s = tree(random_v3, steps, topk, n)
    same(run(make(random_v3), msgs), run(s, msgs, arrivals={m.rid: i for i, m in enumerate(msgs)}))
    assert s.get_stats()["spec_verify_steps"] > 0
    assert_no_leak(s)


@pytest.fixture(scope="module")
def demo_base(demo_prompts):
    ps = list(demo_prompts[:4])
    ps[0] = ps[0] + demo_prompts[5]             # at least MIN_PREFIX_HIT tokens: a hit the cache uses
    ps.append(ps[0] + ps[1])                    # a radix hit on request 0's prompt
    msgs = [msg(f"d{i}", p, max_new=24) for i, p in enumerate(ps)]
    arrivals = {m.rid: 0 if i < 4 else 16 for i, m in enumerate(msgs)}
    chain = spec(DEMO)
    base = run(make(DEMO), msgs, arrivals)
    same(base, run(chain, msgs, arrivals))
    return msgs, arrivals, base, accept_length(chain)


@pytest.mark.parametrize("steps,topk,n", TREES)
def test_greedy_equal_on_the_demo_model_with_radix_hits(demo_base, steps, topk, n):
    msgs, arrivals, base, chain = demo_base
    s = tree(DEMO, steps, topk, n)
    same(base, run(s, msgs, arrivals))
    print(f"accept length: tree {steps}/{topk}/{n} {accept_length(s):.3f}, chain 3/1/4 {chain:.3f}")
    assert s.get_stats()["cached_tokens"] > 0
    if (steps, topk, n) == (3, 2, 4):
        assert accept_length(s) >= chain, "the same steps and verified tokens as the chain, with a second branch"
    assert_no_leak(s)


def test_token_map_with_tree_drafts(demo_base, tmp_path, monkeypatch):
    """--speculative-token-map with tree drafts: the tree's candidates are the map's tokens (each expansion's
    top-k over the kept rows), outputs unchanged."""
    import mlaserve.engine.spec_tree as spec_tree

    msgs, arrivals, base, _ = demo_base
    path, ids = demo_token_map(tmp_path, 1024)
    s = tree(DEMO, 3, 2, 6, speculative_token_map=path)
    candidates, select_ = [], spec_tree.select

    def spy(tokens, *a, **kw):
        candidates.append(tokens.flatten())
        return select_(tokens, *a, **kw)
    monkeypatch.setattr(spec_tree, "select", spy)
    same(base, run(s, msgs, arrivals))
    assert candidates and torch.isin(torch.cat(candidates), ids).all()
    print(f"accept length with a 1024-token map: {accept_length(s):.3f}")
    assert accept_length(s) > 1.5
    assert_no_leak(s)


def test_stop_ids_and_max_new_tokens_inside_accepted_paths(demo_prompts):
    prompt = demo_prompts[0]
    want = run(make(DEMO), [msg("a", prompt, max_new=30)])["a"]["ids"]
    s = tree(DEMO, 3, 3, 6)
    for n in range(1, 9):                        # every cut: inside, at the start and at the end of a path
        got = run(s, [msg(f"m{n}", prompt, max_new=n)])[f"m{n}"]
        assert got["ids"] == want[:n] and got["finished"].kind == "length", n
    for j in (2, 5, 7):                          # a stop id first produced at output position j
        if want[j] in want[:j]:
            continue
        got = run(s, [msg(f"s{j}", prompt, max_new=30, stop_token_ids=[want[j]])])[f"s{j}"]
        assert got["ids"] == want[:j + 1] and got["finished"].matched == want[j], j
    assert accept_length(s) > 1.5
    assert_no_leak(s)


def test_sampled_outputs_identical(demo_prompts):
    """The target's token at each node is drawn with the request's key (seed, token index of the node's depth)
    and the drafts on its path as output history, so sampled outputs are the tokens of decoding without it."""
    seed = random.Random().randrange(1 << 30)
    print("seed", seed)
    variants = [dict(temperature=0.8), dict(temperature=1.0, top_p=0.9), dict(temperature=0.7, top_k=20),
                dict(temperature=0.9, frequency_penalty=0.5, presence_penalty=0.3),
                dict(temperature=0.6, repetition_penalty=1.3, min_p=0.05)]
    msgs = [msg(f"x{i}", demo_prompts[i % len(demo_prompts)], max_new=24, seed=seed + i, **v)
            for i, v in enumerate(variants)]
    s = tree(DEMO, 3, 4, 8)
    same(run(make(DEMO), msgs), run(s, msgs))
    assert s.get_stats()["spec_tokens"] > s.get_stats()["spec_verify_steps"], "some drafts must be accepted"
    assert_no_leak(s)


def test_logprobs_equal(demo_prompts):
    def with_lp(rid, p):
        m = msg(rid, p, max_new=16)
        m.return_logprob, m.top_logprobs_num = True, 3
        return m
    msgs = [with_lp(f"l{i}", p) for i, p in enumerate(demo_prompts[:3])]
    s = tree(DEMO, 3, 2, 5)
    base, got = _outputs(make(DEMO), msgs), _outputs(s, msgs)
    for rid in base:
        a = [lp for o in base[rid] for lp in o.new_logprobs]
        b = [lp for o in got[rid] for lp in o.new_logprobs]
        assert [t for _, t in a] == [t for _, t in b]
        assert max(abs(x - y) for (x, _), (y, _) in zip(a, b)) <= 1e-4
        ta = [t for o in base[rid] for t in o.new_top_logprobs]
        tb = [t for o in got[rid] for t in o.new_top_logprobs]
        assert [[i for _, i in t] for t in ta] == [[i for _, i in t] for t in tb]
    assert_no_leak(s)


def test_retraction_under_tree_drafts(demo_prompts):
    msgs = [msg(f"r{i}", p, max_new=50) for i, p in enumerate(demo_prompts)]
    base = run(make(DEMO), msgs)
    s = tree(DEMO, 3, 4, 8, max_total_tokens=260, init_new_token_ratio=0.0, min_new_token_ratio=0.0)
    same(base, run(s, msgs))
    assert s.num_retracted > 0, "the pool was meant to be small enough to force retraction"
    assert_no_leak(s)


def test_structured_output_equal_with_tree_drafts(demo_prompts):
    """Grammars: each node samples under the grammar's mask after the drafts on its path (the matcher walks
    each path and rolls back)."""
    schema = '{"type": "object", "properties": {"name": {"type": "string"}, "size": {"type": "integer"}}, ' \
             '"required": ["name", "size"]}'
    msgs = [msg("re", demo_prompts[0], max_new=30, regex=r"def [a-z_]+\(self(, [a-z]+)*\):"),
            msg("js", demo_prompts[1], max_new=30, json_schema=schema),
            msg("free", demo_prompts[3], max_new=20)]
    base = run(make(DEMO, max_running_requests=8), msgs)
    s = tree(DEMO, 3, 3, 6, max_running_requests=8)
    got = run(s, msgs)
    same(base, got)
    assert got["re"]["finished"].kind == "stop"
    assert not s.grammar.states and not s.grammar.waiting
    assert_no_leak(s)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("graphs", ["eager", "graphs", "graphs+compile"])
def test_gpu_triton_kernels_and_graphs_equal_no_speculation(demo_prompts, graphs):
    """On the GPU in fp32: the tree-masked Triton decode (draft queries, verify), the tree's draft + verify and
    accept + repair CUDA graphs and torch.compile inside them give the tokens of decoding without speculation."""
    flags = dict(device="cuda", dtype="float32", disable_cuda_graph=graphs == "eager", max_running_requests=8,
                 enable_torch_compile=graphs == "graphs+compile")
    msgs = [msg(f"g{i}", p, max_new=40) for i, p in enumerate(demo_prompts)]
    base = run(make(DEMO, **flags), msgs)
    s = tree(DEMO, 3, 4, 8, **flags)
    assert (s.runner.spec.graphs is not None) == (graphs != "eager")
    same(base, run(s, msgs, arrivals={m.rid: 2 * i for i, m in enumerate(msgs)}))
    assert accept_length(s) > 2.5
    assert_no_leak(s)


def test_stop_strings_inside_accepted_paths_through_the_engine():
    """Stop strings are matched by the tokenizer manager on the streamed text; a step of tree drafts delivers
    several tokens at once, and the text must still end where decoding without speculation ends it."""
    import mlaserve

    prompts = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n"]
    flags = dict(model_path=DEMO, device="cpu", dtype="float32", max_total_tokens=4096, log_level="warning")
    params = {"max_new_tokens": 40, "temperature": 0}
    with mlaserve.Engine(**flags) as engine:
        plain = [r["text"] for r in engine.generate(prompts, params)]
        stops = [[t[n:n + 3]] for t, n in zip(plain, (9, 14)) if len(t) > n + 3]
        want = [engine.generate(p, params | {"stop": s}) for p, s in zip(prompts, stops)]
    with mlaserve.Engine(**flags, speculative_algorithm="EAGLE", speculative_eagle_topk=3,
                         speculative_num_draft_tokens=6) as engine:
        got = [engine.generate(p, params | {"stop": s}) for p, s in zip(prompts, stops)]
        assert engine.get_server_info()["avg_spec_accept_length"] > 1.5
    assert stops and [r["text"] for r in got] == [r["text"] for r in want]
    assert [r["meta_info"]["finish_reason"] for r in got] == [r["meta_info"]["finish_reason"] for r in want]
    for r in got:
        assert r["meta_info"]["finish_reason"]["type"] == "stop", r["meta_info"]


def test_fp8_kv_cache(demo_prompts):
    """An e4m3 KV cache: the accepted path's rows are copied as stored (no requantisation)."""
    msgs = [msg(f"f{i}", p, max_new=24) for i, p in enumerate(demo_prompts[:3])]
    s = tree(DEMO, 3, 3, 6, kv_cache_dtype="fp8_e4m3")
    same(run(make(DEMO, kv_cache_dtype="fp8_e4m3"), msgs), run(s, msgs))
    assert accept_length(s) > 2.0
    assert_no_leak(s)
