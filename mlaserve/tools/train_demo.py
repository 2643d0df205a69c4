"""`mlaserve train-demo --out DIR`: train the built-in demo model (DeepSeek-V3 architecture) on Python source.

One command on one GPU, in minutes: a byte-level BPE tokenizer on a sample of the corpus (`tools/corpus.py`:
the stdlib and installed packages, pip held out), then the model of `tools/train_model.py` with the
next-token and MTP next-next-token losses, bf16 autocast, AdamW, and aux-loss-free expert balancing. Writes a
checkpoint in the original DeepSeek layout (sharded safetensors, config.json, tokenizer) and `train_log.json`
(settings, loss curves of both heads, held-out figures, greedy completions).
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import tokenizers
from safetensors.torch import save_file

from mlaserve.config import ModelConfig
from mlaserve.tools import corpus
from mlaserve.tools.make_checkpoint import make_config
from mlaserve.tools.train_model import DemoTrainModel, checkpoint_state
from mlaserve.tools.tokenizer import train_tokenizer

# The demo architecture: every DeepSeek-V3 switch, at a size whose bf16 checkpoint stays under 40 MB.
DEMO_ARCH = dict(
    hidden_size=256, intermediate_size=768, moe_intermediate_size=128, num_hidden_layers=5,
    first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128, kv_lora_rank=128,
    qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=16, n_shared_experts=1,
    num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5, num_nextn_predict_layers=1,
    max_position_embeddings=4096, rope_theta=10000,
    rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 1024, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
)
# A CPU-sized variant for the tests of this script.
TINY_ARCH = dict(DEMO_ARCH, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                 q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                 n_routed_experts=8, num_experts_per_tok=2)
MTP_LOSS_WEIGHT = 0.3       # lambda of the MTP loss (DeepSeek-V3 sec. 2.2 uses 0.3, then 0.1)
BIAS_UPDATE_SPEED = 1e-3    # gamma of the aux-loss-free balancing (DeepSeek-V3 sec. 4.2)
SHARD_BYTES = 15 * 2**20
PROBE_FROM, PROBE_TO = 10, 40   # steps timed to turn --train-seconds into a step count


def demo_config(vocab_size: int, tiny: bool = False) -> dict:
    """The demo model's config.json (DeepSeek-V3 keys) for a tokenizer of `vocab_size` ids."""
    src = json.loads((Path(__file__).parent / "configs" / "deepseek-v3.json").read_text())
    d = src | (TINY_ARCH if tiny else DEMO_ARCH) | {"vocab_size": vocab_size}
    return make_config(d, num_layers=None, shrink=False, fp8=False)


# --- data -----------------------------------------------------------------------------------------

def build_tokenizer(texts: list[str], out: Path, vocab_size: int, sample_bytes: int, seed: int,
                    max_len: int) -> tokenizers.Tokenizer:
    sample = corpus.sample_texts(texts, sample_bytes, seed)
    train_tokenizer(out, vocab_size, model_max_length=max_len, corpus=sample)
    return tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))


class Batches:
    """Random windows of `seq_len + 2` tokens from the training stream (on the device), seeded."""

    def __init__(self, stream: np.ndarray, seq_len: int, batch: int, device: torch.device, seed: int):
        self.data = torch.from_numpy(stream.astype(np.int32)).to(device)
        self.span, self.batch = seq_len + 2, batch
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.offsets = torch.arange(self.span, device=device)

    def next(self) -> torch.Tensor:
        starts = torch.randint(0, len(self.data) - self.span, (self.batch, 1), generator=self.gen,
                               device=self.data.device)
        return self.data[starts + self.offsets].long()                        # [B, S + 2]


# --- training -------------------------------------------------------------------------------------

def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def losses(model: DemoTrainModel, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = model(tokens)
    s = out.logits.shape[1]
    main = F.cross_entropy(out.logits.flatten(0, 1).float(), tokens[:, 1:s + 1].flatten())
    mtp = F.cross_entropy(out.mtp_logits.flatten(0, 1).float(), tokens[:, 2:s + 2].flatten())
    return main, mtp


def make_optimizer(model: DemoTrainModel, lr: float, weight_decay: float) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=torch.cuda.is_available())


def train_step(model: DemoTrainModel, opt: torch.optim.Optimizer, tokens: torch.Tensor, lr: float,
               amp: bool) -> tuple[torch.Tensor, torch.Tensor]:
    for g in opt.param_groups:
        g["lr"] = lr
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=amp):
        main, mtp = losses(model, tokens)
    (main + MTP_LOSS_WEIGHT * mtp).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    for gate in model.gates():
        gate.update_bias(BIAS_UPDATE_SPEED)
    return main.detach(), mtp.detach()


def train(model: DemoTrainModel, batches: Batches, args: argparse.Namespace, log: dict) -> None:
    """Train for `args.steps` steps, or as many as fit `args.train_seconds` (measured on the first steps)."""
    opt = make_optimizer(model, args.lr, args.weight_decay)
    amp = batches.data.device.type == "cuda"
    total, curve = args.steps or 10**9, log["curve"]
    t0 = time.monotonic()
    step, t_probe = 0, None
    while step < total:
        main, mtp = train_step(model, opt, batches.next(), lr_at(step, total, args.lr, args.warmup), amp)
        step += 1
        if not args.steps and step in (PROBE_FROM, PROBE_TO):                # fix the schedule's length
            _sync(batches.data.device)
            now = time.monotonic()
            if step == PROBE_FROM:
                t_probe = now
            else:
                rate = (PROBE_TO - PROBE_FROM) / (now - t_probe)
                total = step + max(20, int((args.train_seconds - (now - t0)) * rate))
                log["steps"] = total
        if step % args.log_every == 0 or step == total:
            point = {"step": step, "s": round(time.monotonic() - t0, 1), "loss": round(main.item(), 4),
                     "mtp_loss": round(mtp.item(), 4), "lr": lr_at(step - 1, total, args.lr, args.warmup)}
            curve.append(point)
            print(json.dumps(point), flush=True)
    _sync(batches.data.device)
    log["steps"], log["train_seconds"] = step, round(time.monotonic() - t0, 1)
    log["tokens_seen"] = step * batches.batch * (batches.span - 2)
    log["router_bias"] = [[round(x, 3) for x in (g.e_score_correction_bias.min().item(),
                                                  g.e_score_correction_bias.max().item())] for g in model.gates()]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# --- evaluation -----------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(model: DemoTrainModel, wins: np.ndarray, tok_bytes: np.ndarray, device: torch.device,
             batch: int = 16) -> dict:
    """Held-out figures of the training model: bits per byte, next-token top-1 accuracy, and the MTP head's
    agreement with the main model's greedy token-after-next (teacher-forced: MTP at i against argmax at i+1)."""
    model.eval()
    nbytes = torch.from_numpy(tok_bytes).to(device)
    bits = total_bytes = hits = n = agree = n_agree = 0.0
    for i in range(0, len(wins), batch):
        tokens = torch.from_numpy(wins[i:i + batch].astype(np.int64)).to(device)     # [b, S + 2]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model(tokens)
        s = out.logits.shape[1]
        target = tokens[:, 1:s + 1]
        w = nbytes[target]                                                    # [b, S] bytes; 0 = special
        nll = F.cross_entropy(out.logits.float().transpose(1, 2), target, reduction="none")
        scored = w > 0
        bits += (nll[scored].sum() / math.log(2)).item()
        total_bytes += w.sum().item()
        greedy = out.logits.argmax(-1)                                        # [b, S]
        hits += (greedy == target)[scored].sum().item()
        n += scored.sum().item()
        agree += (out.mtp_logits[:, :-1].argmax(-1) == greedy[:, 1:]).sum().item()
        n_agree += greedy[:, 1:].numel()
    model.train()
    return {"bits_per_byte": bits / total_bytes, "top1": hits / n, "mtp_agreement": agree / n_agree,
            "tokens": int(n), "bytes": int(total_bytes)}


@torch.no_grad()
def complete(model: DemoTrainModel, tok: tokenizers.Tokenizer, prompt: str, n: int, device: torch.device) -> str:
    """Greedy continuation of `prompt` by the main head (whole-sequence forwards: a check, not a server)."""
    model.eval()
    ids = [0] + tok.encode(prompt, add_special_tokens=False).ids              # BOS = id 0
    for _ in range(n):
        x = torch.tensor([ids + [0, 0]], device=device)                       # 2 pad ids feed the MTP head
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            nxt = int(model(x).logits[0, -1].argmax())
        if nxt == 1:                                                          # EOS
            break
        ids.append(nxt)
    model.train()
    return tok.decode(ids[1:])


def function_headers(texts: list[str], k: int) -> list[str]:
    """The first top-level `def` line of each held-out file, up to `k` of them, as completion prompts.

    NOTE: no trailing newline: the tokenizer joins a newline with the indentation after it, so a prompt ending
    in a bare newline reads as column 0 (a new top-level statement)."""
    out = []
    for text in texts:
        for line in text.splitlines():
            if line.startswith("def ") and line.rstrip().endswith(":") and len(line) < 80:
                out.append(line.rstrip())
                break
        if len(out) == k:
            break
    return out


# --- writing --------------------------------------------------------------------------------------

def save_checkpoint(model: DemoTrainModel, cfg_dict: dict, out: Path) -> int:
    """config.json, model-0000i-of-0000n.safetensors (<= SHARD_BYTES each) and the index; returns bytes written."""
    state = checkpoint_state(model)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nb = t.numel() * t.element_size()
        if shards[-1] and size + nb > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nb
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, fname)
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=2) + "\n")
    return total


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="mlaserve train-demo", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output checkpoint directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--tokenizer-sample-mb", type=float, default=32.0, help="corpus sample the tokenizer learns from")
    ap.add_argument("--max-corpus-mb", type=float, default=None, help="use only this much of the corpus (tests)")
    ap.add_argument("--train-seconds", type=float, default=300.0,
                    help="training time: sets the step count from the speed of steps 10-40, so it varies by machine")
    ap.add_argument("--steps", type=int, default=None,
                    help="a fixed step count instead of --train-seconds (reproducible; the shipped model: 1863)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--eval-windows", type=int, default=None, help="held-out windows to score (default all)")
    ap.add_argument("--tiny", action="store_true", help="a CPU-sized model (tests of this script)")
    return ap.parse_args(argv)


def load_corpus(args: argparse.Namespace, log: dict) -> list[str]:
    files = corpus.training_files()
    if args.max_corpus_mb is None:
        texts = corpus.read_sources(files)
    else:                                   # a seeded sample of whole files
        texts = corpus.read_sources(corpus.shuffled(files, args.seed), int(args.max_corpus_mb * 2**20))
    log["corpus"] = {"files": len(files), "documents": len(texts), "bytes": sum(len(t.encode()) for t in texts),
                     "heldout_dir": str(corpus.heldout_dir())}
    return texts


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    torch.manual_seed(args.seed)
    out, device = Path(args.out), torch.device(args.device)
    out.mkdir(parents=True, exist_ok=True)
    log: dict = {"args": vars(args), "curve": [], "env": _env(device)}
    texts = load_corpus(args, log)
    tok = build_tokenizer(texts, out, args.vocab_size, int(args.tokenizer_sample_mb * 2**20), args.seed,
                          max_len=DEMO_ARCH["max_position_embeddings"])
    cfg_dict = demo_config(tok.get_vocab_size(), tiny=args.tiny)
    stream = corpus.token_stream(tok, texts)
    log["corpus"]["tokens"] = int(len(stream))
    log["prep_seconds"] = round(time.monotonic() - t_start, 1)
    print(json.dumps({"corpus": log["corpus"], "prep_seconds": log["prep_seconds"]}), flush=True)
    del texts
    cfg = ModelConfig.from_dict(cfg_dict)
    model = DemoTrainModel(cfg, cfg.max_position_embeddings).to(device)
    log["params"] = sum(p.numel() for p in model.parameters())
    train(model, Batches(stream, args.seq_len, args.batch_size, device, args.seed), args, log)
    wins = corpus.heldout_windows(tok, args.seq_len + 2, args.eval_windows)
    log["heldout"] = evaluate(model, wins, corpus.token_bytes(tok), device)
    print(json.dumps({"heldout": log["heldout"]}), flush=True)
    heldout_texts = corpus.read_sources(corpus.heldout_files(), max_bytes=2**20)
    log["completions"] = {p: complete(model, tok, p, 48, device) for p in function_headers(heldout_texts, 6)}
    log["checkpoint_bytes"] = save_checkpoint(model, cfg_dict, out)
    log["wall_seconds"] = round(time.monotonic() - t_start, 1)
    (out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    print(json.dumps({k: log[k] for k in ("params", "steps", "train_seconds", "checkpoint_bytes", "wall_seconds")}))
    return 0


def _env(device: torch.device) -> dict:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {"python": platform.python_version(), "torch": torch.__version__, "tokenizers": tokenizers.__version__,
            "gpu": gpu, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


if __name__ == "__main__":
    raise SystemExit(main())
