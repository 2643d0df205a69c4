"""`mlaserve make-checkpoint`: a synthetic DeepSeek checkpoint in the original format (random weights).

Writes config.json, model-0000i-of-0000n.safetensors + model.safetensors.index.json (original tensor names,
per-expert weights, the MTP layer at index num_hidden_layers, optional block-FP8 in the V3 format), and a
tokenizer the project trains itself with the DeepSeek special tokens and chat template. Streams shard by
shard: memory stays around one shard whatever the model size.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from mlaserve.config import ModelConfig
from mlaserve.models.weights import checkpoint_specs, spec_dtype, synthetic_checkpoint

SHRINK = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_attention_heads=4,
              q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
              vocab_size=4096)
TOKENIZER_VOCAB = 4096
FP8_QUANT_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def shrink_config(d: dict) -> dict:
    """Scale every width down to a CPU-sized model; every architectural switch of `d` is kept."""
    d = dict(d)
    for k, v in SHRINK.items():
        if k == "q_lora_rank" and d.get(k) is None:
            continue
        d[k] = v
    d["num_key_value_heads"] = d["num_attention_heads"]
    n_group, topk_group = d.get("n_group") or 1, d.get("topk_group") or 1
    top_k = d.get("num_experts_per_tok") or 1
    # enough experts per kept group to fill top-k, at least 2 per group (noaux_tc ranks groups by top-2)
    per_group = max(2, math.ceil(top_k / topk_group))
    if d.get("n_routed_experts"):
        d["n_routed_experts"] = min(d["n_routed_experts"], max(16, n_group * per_group))
    return d


def parse_size(s: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMG]?)B?", s.strip().upper())
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {s!r} (e.g. 4GB, 500MB)")
    return int(float(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[m.group(2)])


def make_config(src: dict, *, num_layers: int | None, shrink: bool, fp8: bool) -> dict:
    d = shrink_config(src) if shrink else dict(src)
    if num_layers is not None:
        d["num_hidden_layers"] = num_layers
    d.pop("quantization_config", None)
    if fp8:
        d["quantization_config"] = dict(FP8_QUANT_CONFIG)
    # NOTE: token ids follow our own tokenizer (special tokens first: bos 0, eos 1).
    d["bos_token_id"], d["eos_token_id"] = 0, 1
    d["torch_dtype"] = "bfloat16"
    ModelConfig.from_dict(d)    # fail early, with one line, on anything unsupported
    return d


def plan_shards(cfg: ModelConfig, shard_bytes: int) -> list[list[str]]:
    """Group tensor names, in file order, into shards of at most `shard_bytes` (a lone big tensor excepted)."""
    shards: list[list[str]] = [[]]
    size = 0
    for spec in checkpoint_specs(cfg):
        nbytes = spec.numel * torch.empty((), dtype=spec_dtype(spec, cfg)).element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec.name)
        size += nbytes
    return shards


def write_checkpoint(cfg_dict: dict, out: Path, *, seed: int = 0, shard_bytes: int = 4 * 2**30,
                     progress: bool = True, tokenizer: bool = True) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig.from_dict(cfg_dict)
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=2) + "\n")
    shards = plan_shards(cfg, shard_bytes)
    specs = checkpoint_specs(cfg)
    total_bytes = sum(s.numel * torch.empty((), dtype=spec_dtype(s, cfg)).element_size() for s in specs)
    items = synthetic_checkpoint(cfg, seed, specs)
    weight_map: dict[str, str] = {}
    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="writing checkpoint", disable=not progress)
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for _ in names:
            name, t = next(items)
            tensors[name] = t.contiguous()
            weight_map[name] = fname
            bar.update(t.numel() * t.element_size())
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        del tensors
    bar.close()
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    if tokenizer:
        from mlaserve.tools.tokenizer import train_tokenizer

        train_tokenizer(out, vocab_size=min(TOKENIZER_VOCAB, cfg.vocab_size))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mlaserve make-checkpoint", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="an original DeepSeek config.json")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--num-layers", type=int, default=None,
                    help="decoder layers to keep (the first first_k_dense_replace stay dense)")
    ap.add_argument("--shrink", action="store_true", help="scale every width down to a CPU-sized model")
    ap.add_argument("--fp8", action="store_true", help="block-FP8 weights in the DeepSeek-V3 format")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-size", type=parse_size, default=parse_size("4GB"), help="max bytes per shard")
    args = ap.parse_args(argv)
    try:
        d = make_config(read_config(args.config), num_layers=args.num_layers, shrink=args.shrink, fp8=args.fp8)
    except KeyError as e:
        return _fail(f"--config {args.config}: missing key {e}")
    except (ValueError, TypeError) as e:
        return _fail(f"--config {args.config}: {e}")
    write_checkpoint(d, Path(args.out), seed=args.seed, shard_bytes=args.shard_size)
    print(f"wrote {args.out}")
    return 0


def _fail(message: str) -> int:
    print(f"mlaserve make-checkpoint: {message}", file=sys.stderr)
    return 1


def read_config(path: str) -> dict:
    """A config.json file as a dict; ValueError (one line) if it cannot be read or is not a JSON object."""
    try:
        d = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(e.strerror or str(e)) from None
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"expected a JSON object, got {type(d).__name__}")
    return d
