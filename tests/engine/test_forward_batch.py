"""build_context's one-copy upload of a batch's host inputs (`upload_ints`), against the values it stands for."""
import random

import numpy as np
import pytest
import torch

from mlaserve.core import ForwardMode
from mlaserve.engine.forward_batch import build_context, upload_ints

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_upload_ints_pieces(device):
    seed = random.randrange(1 << 30)
    print("seed", seed)
    g = torch.Generator().manual_seed(seed)
    big = torch.randint(0, 1 << 40, (4096,), generator=g)
    pieces = [big.tolist(), [], np.arange(3, 9), torch.tensor([7, -1], dtype=torch.int32), big[:5]]
    out = upload_ints(pieces, device)
    assert [t.device.type for t in out] == [device] * 5 and all(t.dtype == torch.int64 for t in out)
    for got, want in zip(out, pieces):
        assert got.cpu().tolist() == (want.tolist() if hasattr(want, "tolist") else list(want))
    assert upload_ints([], device) == []


@pytest.mark.parametrize("device", DEVICES)
def test_build_context_uploads(device):
    prefix, ext = [0, 2, 5], [4, 3, 1]
    slots = torch.arange(100, 108)
    table = torch.zeros(4, 16, dtype=torch.int32, device=device)
    ctx = build_context(ForwardMode.EXTEND, req_pool_idx=[2, 0, 3], prefix_lens=prefix, extend_lens=ext,
                        out_slots=slots, req_to_token=table, kv_pool=None, attn_backend=None, device=device,
                        last_token_logits=False, logits_rows=[3, 7], input_ids=list(range(50, 58)), num_decode=1)
    assert ctx.positions.tolist() == [0, 1, 2, 3, 2, 3, 4, 5]
    assert ctx.out_slots.tolist() == slots.tolist() and ctx.req_pool_idx.tolist() == [2, 0, 3]
    assert ctx.seq_lens.tolist() == [4, 5, 6] and ctx.seq_lens_cpu == [4, 5, 6]
    assert ctx.logits_indices.tolist() == [3, 7] and ctx.input_ids.tolist() == list(range(50, 58))
    assert ctx.parts[0].positions.tolist() == [0, 1, 2, 3, 2, 3, 4] and ctx.parts[1].positions.tolist() == [5]
    assert ctx.parts[0].input_ids is None
    last = build_context(ForwardMode.EXTEND, req_pool_idx=[1, 2], prefix_lens=[0, 0], extend_lens=[3, 2],
                         out_slots=slots[:5].to(device), req_to_token=table, kv_pool=None, attn_backend=None,
                         device=device)                         # the slots already on the device, the last rows
    assert last.logits_indices.tolist() == [2, 4] and last.out_slots.tolist() == slots[:5].tolist()
    assert last.input_ids is None
