"""Small checkpoints written by make-checkpoint from the real configs, shared by the model tests."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import mlaserve

from mlaserve.tools.make_checkpoint import make_config, write_checkpoint

DATA = Path(mlaserve.__file__).parent / "tools" / "configs"

# name -> (source config, overrides, num_layers, fp8)
VARIANTS = {
    # V2-Lite: no q_lora, softmax + greedy routing, 2 shared experts, first layer dense
    "v2-lite": ("deepseek-v2-lite.json", {}, 3, False),
    # V2: q_lora, group-limited greedy routing (n_group 8, topk_group 3), routed scaling 16
    "v2": ("deepseek-v2-lite.json", {"q_lora_rank": 1536, "topk_method": "group_limited_greedy", "n_group": 8,
                                     "topk_group": 3, "routed_scaling_factor": 16.0}, 3, False),
    # V3: q_lora, sigmoid + noaux_tc, norm_topk_prob, 3 dense-first layers, MTP layer
    "v3": ("deepseek-v3.json", {"first_k_dense_replace": 1}, 3, False),
    "v3-fp8": ("deepseek-v3.json", {"first_k_dense_replace": 1}, 3, True),
    # V3 FP8 with q_lora_rank a whole 128-block: q_a_proj and kv_a_proj_with_mqa one GEMM, as in the real V3
    "v3-fp8-q128": ("deepseek-v3.json", {"first_k_dense_replace": 1}, 3, True),
    # V3 with MLA widths the Triton tiles must pad (kv_lora_rank 32, rope dim 8: not powers of two >= 16)
    "v3-odd-dims": ("deepseek-v3.json", {"first_k_dense_replace": 1}, 2, False),
}
# widths set after shrinking (shrink_config sets every width)
AFTER_SHRINK = {"v3-odd-dims": {"kv_lora_rank": 32, "qk_rope_head_dim": 8}, "v3-fp8-q128": {"q_lora_rank": 128}}


def build(tmp_root: Path, name: str, seed: int = 0) -> Path:
    src, overrides, layers, fp8 = VARIANTS[name]
    d = json.loads((DATA / src).read_text()) | overrides
    cfg = make_config(d, num_layers=layers, shrink=True, fp8=fp8) | AFTER_SHRINK.get(name, {})
    return write_checkpoint(cfg, tmp_root / name, seed=seed, progress=False, tokenizer=False)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = build(root, name)
        return cache[name]
    return get
