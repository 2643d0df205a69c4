"""GPU diagnosis: run each kernel right after filling the allocator's free memory with 0xFF (NaN for floats,
-1 for ints); an output that then differs from its reference reads memory nothing wrote."""
import torch
from mlaserve.kernels.fused_moe import fused_moe, fused_moe_ref
from mlaserve.kernels.moe_topk import moe_topk, moe_topk_ref
from mlaserve.kernels.quant import block_quant_fp8_ref

def poison():
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda"); x.fill_(0xFF); del x

def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()

E, K, I = 16, 256, 128
for fp8 in (False, True):
    w13 = torch.randn(E, 2 * I, K, device="cuda") / K ** 0.5
    w2 = torch.randn(E, K, I, device="cuda") / I ** 0.5
    kw = {}
    if fp8:
        q = [block_quant_fp8_ref(w) for w in w13]; w13 = torch.stack([a for a, _ in q]); kw["w13_scale"] = torch.stack([b for _, b in q])
        q = [block_quant_fp8_ref(w) for w in w2]; w2 = torch.stack([a for a, _ in q]); kw["w2_scale"] = torch.stack([b for _, b in q])
    else:
        w13, w2 = w13.bfloat16(), w2.bfloat16()
    for m in (1, 3, 12, 24, 41, 200):
        x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(m, E, device="cuda")
        poison()
        wts, ids = moe_topk(logits, 6, topk_method="greedy", scoring_func="softmax")
        rw, rid = moe_topk_ref(logits, 6, topk_method="greedy", scoring_func="softmax")
        ok_ids = torch.equal(ids.sort(-1).values.long(), rid.sort(-1).values.long())
        poison()
        out = fused_moe(x, w13, w2, rw, rid, **kw)
        ref = fused_moe_ref(x, w13, w2, rw, rid, **kw)
        print(f"fp8={fp8} M={m}: topk ids equal {ok_ids}, fused_moe rel err {rel(out, ref):.2e}, nan {out.isnan().any().item()}")
