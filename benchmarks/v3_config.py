"""DeepSeek-V3's config.json for the GPU scripts: the real one with `--layers` decoder layers (its MTP layer kept), or
with `--tiny` a small V3-shape config (the CPU dry runs of those scripts: their plumbing, not their figures).

    python3 benchmarks/v3_config.py --layers 12 --out /tmp/v3/config.json
    python3 benchmarks/v3_config.py --layers 2 --tiny --out /tmp/v3/config.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlaserve

V3 = Path(mlaserve.__file__).parent / "tools" / "configs" / "deepseek-v3.json"
TINY = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, n_routed_experts=16,
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128, kv_lora_rank=128, vocab_size=8192,
            n_group=4, topk_group=2, first_k_dense_replace=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, required=True, help="num_hidden_layers (61: the whole model)")
    ap.add_argument("--tiny", action="store_true", help="small widths, bf16 (no block-FP8 quantization_config)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cfg = json.loads(V3.read_text()) | {"num_hidden_layers": args.layers}
    if args.tiny:
        cfg |= TINY
        cfg.pop("quantization_config", None)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(cfg, indent=2))


if __name__ == "__main__":
    main()
