"""The L2 prefetch job (kernels/prefetch.py): its plan on any machine; on a Hopper GPU, that running it inside W_UK's
launch changes no result."""
from __future__ import annotations

import pytest
import torch

from mlaserve.kernels import prefetch
from mlaserve.kernels.mla_absorb import rope_head_gemm
from mlaserve.kernels.pdl import active


def test_rows_cover_the_spans_aligned_in_order_within_the_budget() -> None:
    per = 1000 * prefetch.ALIGN
    spans = [(4096 + 8, 3 * per + 40), (10**9, 5 * per)]            # a misaligned start; a second region
    rows = prefetch.plan_rows(spans, budget=6 * per, per_program=per)
    assert rows[0][0] == 4096 + prefetch.ALIGN                        # rounded up to the granularity
    assert all(a % prefetch.ALIGN == 0 and 0 < n <= per and n % prefetch.ALIGN == 0 for a, n in rows)
    first = [r for r in rows if r[0] < 10**9]
    assert sum(n for _, n in first) == (3 * per + 40 - 8) // prefetch.ALIGN * prefetch.ALIGN   # the span's whole units
    assert [a for a, _ in first] == sorted(a for a, _ in first)       # in order, no overlap
    assert sum(n for _, n in rows) == 6 * per                         # the second region cut at the budget
    assert rows[-1][0] + rows[-1][1] <= 10**9 + 5 * per
    assert prefetch.plan_rows(spans, budget=0) == []


def test_no_plan_where_the_kernels_cannot_prefetch(monkeypatch) -> None:
    w = torch.empty(64, 64)
    assert prefetch.plan([w]) is None                                 # CPU: the interpreter has no PTX
    if torch.cuda.is_available():
        monkeypatch.setenv("MLASERVE_L2_PREFETCH_MB", "0")
        assert prefetch.plan([w.cuda()]) is None
    assert prefetch.for_tokens(None, 1) is None


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 16])
def test_rope_head_gemm_with_a_prefetch_job_gives_the_same_bits(monkeypatch, t: int) -> None:
    if not active(torch.device("cuda")):
        pytest.skip("the prefetch job needs compute capability 9.0 (and MLASERVE_PDL not 0)")
    seed = torch.seed()
    print("seed", seed)
    monkeypatch.setenv("MLASERVE_L2_PREFETCH_MB", "12")
    h, dn, r, big_l, slots, dev = 16, 128, 64, 512, 64, "cuda"
    weights = [torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16), torch.randn(333, 77, device=dev)]
    before = [w.clone() for w in weights]
    plan = prefetch.plan(weights)
    assert plan is not None and plan.bytes() == 8 * 2**20 + (333 * 77 * 4) // 16 * 16
    q = torch.randn(t, h, dn + r, device=dev, dtype=torch.bfloat16)
    w_kc = (torch.randn(h, dn, big_l, device=dev) / dn ** 0.5).to(torch.bfloat16)
    latent = torch.randn(t, big_l + r, device=dev, dtype=torch.bfloat16)
    ang = torch.arange(64, device=dev)[:, None].float() * torch.rand(r // 2, device=dev)[None, :]
    cos_sin = torch.cat([ang.cos(), ang.sin()], dim=1).contiguous()
    positions = torch.randint(0, 64, (t,), device=dev)
    out_slots = torch.randperm(slots, device=dev)[:t]
    norm_w = torch.rand(big_l, device=dev).to(torch.bfloat16) + 0.5

    def run(job):
        qq, lat = q.clone(), latent.clone()
        kv = torch.zeros(slots, big_l + r, device=dev, dtype=torch.bfloat16)
        out = rope_head_gemm(qq[..., :dn], w_kc, qq[..., dn:], lat[:, big_l:], lat[:, :big_l], positions, cos_sin, kv,
                             out_slots, norm_weight=norm_w, eps=1e-6, prefetch=job)
        return out, qq, lat, kv
    for a, b in zip(run(plan), run(None)):
        assert torch.equal(a, b)
    prefetch.l2_prefetch(plan)
    torch.cuda.synchronize()
    assert all(torch.equal(w, b) for w, b in zip(weights, before))      # a prefetch writes nothing
