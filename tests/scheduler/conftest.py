"""The scheduler tests' small checkpoint: a 2-layer V3-shape model (one dense layer, then MoE), bf16 weights."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import mlaserve
from mlaserve.tools.make_checkpoint import make_config, write_checkpoint

CONFIGS = Path(mlaserve.__file__).parent / "tools" / "configs"


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory) -> str:
    d = json.loads((CONFIGS / "deepseek-v3.json").read_text()) | {"first_k_dense_replace": 1}
    cfg = make_config(d, num_layers=2, shrink=True, fp8=False)
    return str(write_checkpoint(cfg, tmp_path_factory.mktemp("sched") / "m", progress=False, tokenizer=False))
