"""Block-FP8 copy of a bf16 DeepSeek checkpoint, in the DeepSeek-V3 format (e4m3 weights, 128x128 blocks).

Every "linear" tensor of `checkpoint_specs` becomes float8_e4m3fn with its float32 `weight_scale_inv`;
embeddings, norms, router, heads and `eh_proj` stay as they are. Tokenizer files are copied.
Usage: `python -m mlaserve.tools.quantize_fp8 SRC DST`.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from safetensors.torch import save_file

from mlaserve.config import ModelConfig
from mlaserve.kernels.quant import block_quant_fp8_ref
from mlaserve.models.weights import checkpoint_specs, iter_safetensors
from mlaserve.tools.make_checkpoint import FP8_QUANT_CONFIG

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def quantize_checkpoint(src: str | Path, dst: str | Path) -> Path:
    """Write the block-FP8 version of the bf16 checkpoint `src` into `dst` (one safetensors file)."""
    src, dst = Path(src), Path(dst)
    cfg_dict = json.loads((src / "config.json").read_text())
    if cfg_dict.get("quantization_config"):
        raise ValueError(f"{src}: already quantised")
    cfg_dict["quantization_config"] = dict(FP8_QUANT_CONFIG)
    cfg = ModelConfig.from_dict(cfg_dict)
    tensors = dict(iter_safetensors(src)[1])
    out = {}
    for spec in checkpoint_specs(cfg):
        if spec.kind == "scale":
            continue
        t = tensors.pop(spec.name)
        if spec.kind == "linear":
            out[spec.name], out[spec.name + "_scale_inv"] = block_quant_fp8_ref(t, cfg.quant.block)
        else:
            out[spec.name] = t
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg_dict, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copyfile(src / name, dst / name)
    return dst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mlaserve.tools.quantize_fp8", description=__doc__.split("\n")[0])
    ap.add_argument("src", help="bf16 checkpoint directory")
    ap.add_argument("dst", help="output directory")
    args = ap.parse_args(argv)
    quantize_checkpoint(args.src, args.dst)
    print(f"wrote {args.dst}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
