"""`mlaserve export-nextn`: a checkpoint's MTP (NextN) layer alone, in SGLang's NextN format, for
`--speculative-draft-model-path`.

Writes config.json (the source's, with num_hidden_layers 1 and architectures [DeepseekV3ForCausalLMNextN]), the MTP
layer's tensors renamed model.layers.{num_hidden_layers}.* -> model.layers.0.* (FP8 scales included) in one
safetensors file with its index, and a copy of every other top-level file that is not safetensors (tokenizer,
generation config). The layer's copies of the embedding and output head are left out unless --keep-embed-and-head
(a server then uses the target's model.embed_tokens and lm_head). Reads the layer one tensor at a time and holds it
in memory to write it (about 11 GiB for DeepSeek-V3 in FP8, without the two copies).

    mlaserve export-nextn --input-dir DeepSeek-V3 --output-dir DeepSeek-V3-NextN
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mlaserve.config import ModelConfig
from mlaserve.draft_checkpoint import NEXTN_ARCH
from mlaserve.models.weights import checkpoint_specs
from mlaserve.tools.make_checkpoint import read_config

SHARD = "nextn_layer_parameters.safetensors"
INDEX = "model.safetensors.index.json"
SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")   # of model.embed_tokens / lm_head's role
NEXTN_PREFIX = "model.layers.0."


class ExportError(ValueError):
    """The source directory cannot be exported (one line naming the file, key or tensor)."""


def mtp_names(cfg: ModelConfig, keep_embed_and_head: bool) -> list[str]:
    """The MTP layer's tensor names in the source checkpoint (FP8 scales after their weights)."""
    prefix = f"model.layers.{cfg.num_hidden_layers}."
    names = [s.name for s in checkpoint_specs(cfg) if s.name.startswith(prefix)]
    return names if keep_embed_and_head else [n for n in names if n[len(prefix):] not in SHARED_COPIES]


def weight_map(src: Path) -> dict[str, str]:
    """Tensor name -> file of a checkpoint directory."""
    if (src / INDEX).exists():
        return json.loads((src / INDEX).read_text())["weight_map"]
    if (src / "model.safetensors").exists():
        with safe_open(str(src / "model.safetensors"), framework="pt") as f:
            return {name: "model.safetensors" for name in f.keys()}
    raise ExportError(f"--input-dir {src}: no {INDEX} or model.safetensors")


def source_config(src: Path) -> tuple[dict, ModelConfig]:
    if not (src / "config.json").is_file():
        raise ExportError(f"--input-dir {src}: no config.json (not a checkpoint directory)")
    try:
        d = read_config(str(src / "config.json"))
        cfg = ModelConfig.from_dict(d)
    except KeyError as e:
        raise ExportError(f"--input-dir {src}: config.json has no key {e}") from None
    except (ValueError, TypeError) as e:
        raise ExportError(f"--input-dir {src}: config.json: {e}") from None
    if cfg.num_nextn_predict_layers < 1:
        raise ExportError(f"--input-dir {src}: no MTP (NextN) layer to export (num_nextn_predict_layers is 0 in its "
                          "config.json)")
    return d, cfg


def export_nextn(src: Path, dst: Path, keep_embed_and_head: bool = False) -> list[str]:
    """Write the NextN checkpoint of `src`'s MTP layer to `dst` (new or empty); returns the names written."""
    d, cfg = source_config(src)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ExportError(f"--output-dir {dst}: exists and is not an empty directory")
    names, files = mtp_names(cfg, keep_embed_and_head), weight_map(src)
    missing = [n for n in names if n not in files]
    if missing:
        raise ExportError(f"--input-dir {src}: missing tensor {missing[0]!r} of the MTP layer"
                          + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    prefix = f"model.layers.{cfg.num_hidden_layers}."
    tensors: dict[str, torch.Tensor] = {}
    for file in dict.fromkeys(files[n] for n in names):          # each source file opened once
        with safe_open(str(src / file), framework="pt") as f:
            for n in names:
                if files[n] == file:
                    tensors[NEXTN_PREFIX + n[len(prefix):]] = f.get_tensor(n)
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / SHARD), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": {name: SHARD for name in tensors}}
    (dst / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    config = d | {"num_hidden_layers": 1, "architectures": [NEXTN_ARCH]}
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in sorted(src.iterdir()):
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", INDEX):
            shutil.copy2(f, dst / f.name)
    return list(tensors)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mlaserve export-nextn", description=__doc__.split("\n")[0])
    ap.add_argument("--input-dir", required=True, help="a checkpoint with an MTP layer (config.json + safetensors)")
    ap.add_argument("--output-dir", required=True, help="where the NextN checkpoint goes (a new or empty directory)")
    ap.add_argument("--keep-embed-and-head", action="store_true",
                    help="also write the layer's copies of the embedding and output head (default: left out; the "
                         "target's model.embed_tokens and lm_head serve)")
    args = ap.parse_args(argv)
    try:
        names = export_nextn(Path(args.input_dir), Path(args.output_dir), args.keep_embed_and_head)
    except ExportError as e:
        print(f"mlaserve export-nextn: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.output_dir}: {len(names)} tensors of the MTP layer as {NEXTN_PREFIX}*", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
