"""The built-in demo model: a DeepSeek-V3-architecture checkpoint trained on Python source by `mlaserve
train-demo`, shipped as package data beside this file (config.json, safetensors shards, tokenizer).

Light on purpose (no torch, no server): the HTTP process and the benchmarks both find the model here.
"""
from __future__ import annotations

import os
import zlib
from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent


def cache_root() -> Path:
    """`MLASERVE_CACHE`, default ~/.cache/mlaserve: where derived models (the FP8 copy) are written."""
    return Path(os.environ.get("MLASERVE_CACHE", Path.home() / ".cache" / "mlaserve"))


def version() -> str:
    """A checksum of the shipped weights: a retrained demo model gets a fresh FP8 copy."""
    crc = 0
    for f in sorted(DEMO_DIR.glob("*.safetensors")):
        crc = zlib.crc32(f.read_bytes(), crc)
    return f"{crc:08x}"


def fp8_dir() -> Path:
    """Where the block-FP8 copy of the demo model lives (made by `build_fp8`)."""
    return cache_root() / f"demo-fp8-{version()}"


def has_fp8() -> bool:
    return (fp8_dir() / "model.safetensors").exists()


def build_fp8() -> Path:
    """Quantise the demo model to block FP8 (128x128) into `fp8_dir()`, atomically (imports the model stack)."""
    from mlaserve.tools.quantize_fp8 import quantize_checkpoint

    path = fp8_dir()
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    quantize_checkpoint(DEMO_DIR, tmp)
    tmp.rename(path)
    return path
