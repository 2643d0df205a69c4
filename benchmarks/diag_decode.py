"""GPU diagnosis: where the Triton decode path departs from the torch reference (small shrunk model)."""
import json, sys, torch
from pathlib import Path
sys.path.insert(0, "tests")
from seq_runner import SeqRunner
from mlaserve.config import ModelConfig
from mlaserve.kernels.mla_decode import mla_decode, mla_decode_ref
from mlaserve.models.deepseek import DeepseekForCausalLM
from mlaserve.models.weights import load_weights
from mlaserve.tools.make_checkpoint import make_config, write_checkpoint

def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()

for L, R, H in [(64, 16, 4), (512, 64, 16), (128, 32, 8)]:
    for dtype in (torch.bfloat16, torch.float16):
        n = 300
        kv = torch.randn(n + 1, L + R, device="cuda", dtype=dtype)
        rtt = torch.zeros(4, 512, dtype=torch.int32, device="cuda")
        lens = [37, 120, 5]
        for i, s in enumerate(lens):
            rtt[i, :s] = torch.randperm(n, device="cuda")[:s].int() + 1
        q = torch.randn(3, H, L + R, device="cuda", dtype=dtype)
        args = (q, kv, rtt, torch.arange(3, device="cuda"), torch.tensor(lens, device="cuda", dtype=torch.int32), 0.1)
        print(f"mla_decode L={L} R={R} H={H} {dtype}: rel err {rel(mla_decode(*args, kv_lora_rank=L), mla_decode_ref(*args, kv_lora_rank=L)):.2e}")

d = json.loads(Path("mlaserve/tools/configs/deepseek-v3.json").read_text()) | {"first_k_dense_replace": 1}
path = Path("/tmp/diag_v3")
write_checkpoint(make_config(d, num_layers=3, shrink=True, fp8=False), path, progress=False, tokenizer=False)
cfg = ModelConfig.from_hf(path)
model = DeepseekForCausalLM(cfg, dtype=torch.bfloat16, device="cuda")
load_weights(model, cfg, path, progress=False)
ids = torch.randint(2, 4000, (40,)).tolist()
outs = {}
for backend in ("torch", "triton"):
    r = SeqRunner(model, cfg, backend=backend, device="cuda")
    pre = r.extend({0: ids[:30]}).logits
    dec = [r.decode({0: t}).logits for t in ids[30:]]
    outs[backend] = (pre, torch.cat(dec))
print("extend last-token logits rel diff:", rel(outs["triton"][0], outs["torch"][0]))
print("decode logits rel diff per step:", [round(rel(a, b), 4) for a, b in zip(outs["triton"][1], outs["torch"][1])])
# mixed: extend with torch, decode with triton on the same cache
r = SeqRunner(model, cfg, backend="torch", device="cuda")
r.extend({0: ids[:30]})
from mlaserve.attention import create_attn_backend
r.backend = create_attn_backend("triton", cfg.softmax_scale, cfg.kv_lora_rank, cfg.qk_rope_head_dim)
mixed = torch.cat([r.decode({0: t}).logits for t in ids[30:]])
print("torch-extend + triton-decode vs torch:", [round(rel(a, b), 4) for a, b in zip(mixed, outs["torch"][1])])
