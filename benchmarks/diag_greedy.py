"""GPU diagnosis: greedy sequences through the scheduler, torch vs triton, batch 1 vs 12, graphs on/off."""
import json, random, sys, torch
from pathlib import Path
sys.path.insert(0, "tests")
from seq_runner import SeqRunner, drive_scheduler
from mlaserve.config import ModelConfig, ServerConfig
from mlaserve.core import SamplingParams
from mlaserve.ipc.messages import GenerateReqMsg
from mlaserve.models.deepseek import DeepseekForCausalLM
from mlaserve.models.weights import load_weights
from mlaserve.scheduler.scheduler import Scheduler
from mlaserve.tools.make_checkpoint import make_config, write_checkpoint

d = json.loads(Path("mlaserve/tools/configs/deepseek-v3.json").read_text()) | {"first_k_dense_replace": 1}
path = Path("/tmp/diag_g")
write_checkpoint(make_config(d, num_layers=3, shrink=True, fp8=False), path, progress=False, tokenizer=False)
rng = random.Random(0)
prompts = [[rng.randrange(2, 4000) for _ in range(rng.randint(5, 120))] for _ in range(12)]

def sched_run(backend, graphs, ps, device="cuda", dtype="bfloat16"):
    s = Scheduler(ServerConfig.from_flat(model_path=str(path), device=device, dtype=dtype, max_total_tokens=8192,
                  attention_backend=backend, disable_cuda_graph=not graphs, cuda_graph_max_bs=16, log_level="warning"), str(path))
    msgs = [GenerateReqMsg(f"r{i}", p, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True), seed=i) for i, p in enumerate(ps)]
    return [v["ids"] for v in drive_scheduler(s, msgs).values()]

def first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)

ref1 = [sched_run("torch", False, [p], device="cpu", dtype="float32")[0] for p in prompts[:4]]
for backend, graphs in [("torch", False), ("triton", False), ("triton", True)]:
    b1 = [sched_run(backend, graphs, [p])[0] for p in prompts[:4]]
    b12 = sched_run(backend, graphs, prompts)[:4]
    print(backend, "graphs" if graphs else "eager", "B=1 vs cpu-fp32:", [first_diff(a, b) for a, b in zip(b1, ref1)],
          "B=12 vs cpu-fp32:", [first_diff(a, b) for a, b in zip(b12, ref1)])
