"""LMHead.restrict (`--speculative-token-map`): the kept rows' logits equal the full head's columns, in one process
and across two gloo ranks whose shards hold different numbers of the kept ids."""
from __future__ import annotations

import random

import torch

from mlaserve.distributed import spawn_ranks
from mlaserve.layers.embedding import LMHead

V, H = 64, 16


def full_head(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, H, generator=g), torch.randn(5, H, generator=g)


def restricted_logits(group, seed: int, ids: list[int]):
    weight, hidden = full_head(seed)
    head = LMHead(V, H, torch.float32, "cpu", tp=group.tp)
    head.weight.weight_loader("lm_head.weight", head.weight, weight)
    vocab_map = head.restrict(torch.tensor(ids))
    return head(hidden), vocab_map


def test_restrict_single_process():
    seed = random.randrange(1 << 30)
    print("seed", seed)
    weight, hidden = full_head(seed)
    ids = sorted(random.Random(seed).sample(range(V), 20))
    head = LMHead(V, H, torch.float32, "cpu")
    head.weight.data.copy_(weight)
    vocab_map = head.restrict(torch.tensor(ids))
    assert vocab_map.tolist() == ids and head.weight.shape == (20, H) and head.pad_mask is None
    torch.testing.assert_close(head(hidden), hidden @ weight[ids].T)


def test_restrict_under_tp2_pads_the_shorter_shard():
    seed = random.randrange(1 << 30)
    print("seed", seed)
    weight, hidden = full_head(seed)
    ids = [1, 5, 9, 30, 31, 40]                    # rank 0 holds 0..31 (5 ids), rank 1 32..63 (1 id)
    outs = spawn_ranks(restricted_logits, 2, seed, ids)
    (logits0, map0), (logits1, map1) = outs
    assert torch.equal(logits0, logits1) and torch.equal(map0, map1)
    assert map0.tolist() == [1, 5, 9, 30, 31, 40, 0, 0, 0, 0]
    ref = hidden @ weight.T
    torch.testing.assert_close(logits0[:, :6], ref[:, ids])
    assert torch.isinf(logits0[:, 6:]).all() and (logits0[:, 6:] < 0).all()
    assert map0[logits0.argmax(-1)].tolist() == [ids[i] for i in ref[:, ids].argmax(-1).tolist()]
