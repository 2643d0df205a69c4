"""GPU diagnosis: torch vs triton decode, each run twice, against an fp32 CPU reference of the same weights."""
import json, sys, torch
from pathlib import Path
sys.path.insert(0, "tests")
from seq_runner import SeqRunner
from mlaserve.config import ModelConfig
from mlaserve.models.deepseek import DeepseekForCausalLM
from mlaserve.models.weights import load_weights
from mlaserve.tools.make_checkpoint import make_config, write_checkpoint

def rel(a, b):
    return ((a.float().cpu() - b.float().cpu()).abs().max() / b.float().abs().max()).item()

for name, src, extra in [("v3", "deepseek-v3.json", {"first_k_dense_replace": 1}), ("v2lite-dense", "deepseek-v2-lite.json", {"first_k_dense_replace": 3})]:
    d = json.loads(Path(f"mlaserve/tools/configs/{src}").read_text()) | extra
    path = Path(f"/tmp/diag_{name}")
    write_checkpoint(make_config(d, num_layers=3, shrink=True, fp8=False), path, progress=False, tokenizer=False)
    cfg = ModelConfig.from_hf(path)
    ids = torch.randint(2, 4000, (40,)).tolist()
    def run(device, dtype, backend):
        model = DeepseekForCausalLM(cfg, dtype=dtype, device=device)
        load_weights(model, cfg, path, progress=False)
        r = SeqRunner(model, cfg, backend=backend, device=device)
        pre = r.extend({0: ids[:30]}).logits
        return [pre] + [r.decode({0: t}).logits for t in ids[30:36]]
    ref = run("cpu", torch.float32, "torch")
    for backend in ("torch", "triton", "torch", "triton"):
        got = run("cuda", torch.bfloat16, backend)
        print(name, backend, "vs cpu fp32 (extend, decode steps):", [round(rel(a, b), 3) for a, b in zip(got, ref)])
    got = run("cuda", torch.float32, "torch")
    print(name, "torch fp32 cuda vs cpu fp32:", [round(rel(a, b), 5) for a, b in zip(got, ref)])
