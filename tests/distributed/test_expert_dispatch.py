"""Expert-parallel collectives and dispatch / combine on two gloo ranks against one process: all-gather,
reduce-scatter and all-to-all of rows, and both dispatchers (gather + reduce-scatter, all-to-all) around the
local experts, with uneven token counts and an idle rank."""
from __future__ import annotations

import random
import time

import pytest
import torch

from mlaserve.distributed import spawn_ranks
from mlaserve.distributed.expert import ExpertParallel, create_dispatcher, expert_parallel
from mlaserve.kernels.fused_moe import fused_moe_ref

E, K, H, I = 8, 3, 32, 24          # routed experts, top-k, hidden, intermediate


def _collectives(group) -> dict:
    ep = expert_parallel(group.tp, 2)
    r = ep.rank
    x = torch.arange(6, dtype=torch.float32).view(3, 2) + 100 * r                 # [3, 2]
    rows = torch.arange(4 * 3, dtype=torch.float32).view(4, 3) * (r + 1)          # [n * M, 3], M = 2
    send = [1, 2] if r == 0 else [3, 0]                                            # rows to rank 0, rank 1
    src = torch.arange(sum(send), dtype=torch.int64) + 10 * r
    recv = ep.all_to_all_counts(torch.tensor(send))
    return {"gather": ep.all_gather(x).tolist(), "scatter": ep.reduce_scatter(rows).tolist(), "recv": recv,
            "a2a": ep.all_to_all(src, send, recv).tolist()}


def _dispatch_combine(ep: ExpertParallel, name: str, tokens: dict, weights: dict) -> list[list]:
    x, tw, ids = tokens[ep.rank]
    lo, n = ep.first(E), ep.split(E)
    local = {k: v[lo:lo + n].contiguous() for k, v in weights.items()}
    kw = {"padded": max(t[0].shape[0] for t in tokens.values())} if name == "gather" else {}
    disp = create_dispatcher(name, ep, E, **kw)
    outs = []
    for _ in range(2):                                       # twice: no state left from one step to the next
        d = disp.dispatch(x, tw, ids)
        assert d.ids.dtype == torch.int32 and ((d.ids >= -1) & (d.ids < n)).all()
        y = fused_moe_ref(d.x, **local, topk_weights=d.weights, topk_ids=d.ids)       # [N, H] local experts
        outs.append(disp.combine(y, d).tolist())
    return outs


def _all_cases(group, cases: dict, weights: dict) -> dict:
    ep = expert_parallel(group.tp, 2)
    cases, weights = _tensors(cases), _tensors(weights)
    out = {"collectives": _collectives(group)}
    for key, tokens in cases.items():
        out[key] = _dispatch_combine(ep, key[0], tokens, weights)
    return out


COUNTS = [(5, 3), (0, 4)]            # uneven; rank 0 idle


# NOTE: these cases cross the process boundary as nested lists (written when a tensor a rank returned was still
# sent as a shared-memory handle; spawn_ranks now returns results by value, see test_spawned_ranks_return_tensors)
def _lists(obj):
    if isinstance(obj, torch.Tensor):
        return ("tensor", obj.tolist(), str(obj.dtype), tuple(obj.shape))
    if isinstance(obj, dict):
        return {k: _lists(v) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(_lists(v) for v in obj)
    return obj


def _tensors(obj):
    if isinstance(obj, tuple) and len(obj) == 4 and obj[0] == "tensor":
        return torch.tensor(obj[1], dtype=getattr(torch, obj[2].split(".")[1])).reshape(obj[3])
    if isinstance(obj, dict):
        return {k: _tensors(v) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(_tensors(v) for v in obj)
    return obj


@pytest.fixture(scope="module")
def two_ranks():
    """One spawn of two ranks runs every case (starting ranks costs seconds each)."""
    seed = random.randrange(2**31)
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    weights = {"w13": torch.randn(E, 2 * I, H, generator=gen) * H ** -0.5,
               "w2": torch.randn(E, H, I, generator=gen) * I ** -0.5}
    cases = {}
    for counts in COUNTS:
        tokens = {}
        for r, t in enumerate(counts):
            logits = torch.randn(t, E, generator=gen)
            tw, ids = logits.softmax(-1).topk(K, dim=-1)
            tokens[r] = (torch.randn(t, H, generator=gen), tw, ids.to(torch.int32))
        for name in ("gather", "all_to_all"):
            cases[(name, counts)] = tokens
    return cases, weights, spawn_ranks(_all_cases, 2, _lists(cases), _lists(weights), timeout=120)


def test_row_collectives_on_two_ranks(two_ranks) -> None:
    out = [r["collectives"] for r in two_ranks[2]]
    x0 = torch.arange(6, dtype=torch.float32).view(3, 2)
    for r in range(2):
        assert out[r]["gather"] == torch.cat([x0, x0 + 100]).tolist()
        rows = torch.arange(12, dtype=torch.float32).view(4, 3) * 3                # sum of (r + 1) * rows
        assert out[r]["scatter"] == rows[2 * r: 2 * r + 2].tolist()
    assert out[0]["recv"] == [1, 3] and out[1]["recv"] == [2, 0]
    assert out[0]["a2a"] == [0, 10, 11, 12] and out[1]["a2a"] == [1, 2]


@pytest.mark.parametrize("name", ["gather", "all_to_all"])
@pytest.mark.parametrize("counts", COUNTS)
def test_dispatch_combine_equals_one_process(two_ranks, name: str, counts: tuple[int, int]) -> None:
    cases, weights, ranks = two_ranks
    tokens = cases[(name, counts)]
    for r in range(2):
        x, tw, ids = tokens[r]
        want = fused_moe_ref(x, **weights, topk_weights=tw, topk_ids=ids)
        for out in ranks[r][(name, counts)]:
            out = torch.tensor(out).reshape(-1, H)
            assert out.shape == want.shape and torch.allclose(out, want, atol=1e-5, rtol=1e-5), r


def test_single_process_ep_is_the_identity() -> None:
    ep = ExpertParallel()
    ids = torch.tensor([[3, 0], [7, 5]], dtype=torch.int32)
    assert ep.to_local(ids, E) is ids and ep.split(E) == E and ep.holds(7, E)
    two = ExpertParallel(1, 2)
    assert two.to_local(ids, E).tolist() == [[-1, -1], [3, 1]] and not two.holds(3, E) and two.first(E) == 4
    with pytest.raises(ValueError, match="--ep-size 3"):
        ExpertParallel(0, 3).split(E)


def _return_tensor(group) -> torch.Tensor:
    if group.info.rank == 0:
        time.sleep(3)                 # rank 1 sends its result and exits before the caller reads it
    return torch.full((3,), float(group.info.rank))


def test_spawned_ranks_return_tensors() -> None:
    """A rank's tensor result comes back by value: rank 1's is read after rank 1 has exited."""
    out = spawn_ranks(_return_tensor, 2, timeout=120)
    assert [t.tolist() for t in out] == [[0.0] * 3, [1.0] * 3]
