"""What the parallel tests (tensor, expert, data-parallel attention) share: the small checkpoints with the real
architecture switches, and reading an Engine output's prompt log-probs and its first near-tie."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import mlaserve
from mlaserve.tools.make_checkpoint import make_config, write_checkpoint

CONFIGS = Path(mlaserve.__file__).parent / "tools" / "configs"
# name -> (source config, overrides, fp8, widths set after shrinking); 16 routed experts each
VARIANTS = {
    # V2-Lite: no q_lora, softmax + greedy routing, 2 shared experts, first layer dense
    "v2-lite": ("deepseek-v2-lite.json", {}, False, {}),
    # V2: q_lora, group-limited greedy routing
    "v2": ("deepseek-v2-lite.json", {"q_lora_rank": 1536, "topk_method": "group_limited_greedy", "n_group": 8,
                                     "topk_group": 3, "routed_scaling_factor": 16.0}, False, {}),
    # V3: q_lora, sigmoid + noaux_tc, MTP layer present
    "v3": ("deepseek-v3.json", {"first_k_dense_replace": 1}, False, {}),
    # V3 in block FP8, widths whose per-rank shards are whole 128-blocks
    "v3-fp8": ("deepseek-v3.json", {"first_k_dense_replace": 1}, True,
               {"qk_nope_head_dim": 64, "qk_rope_head_dim": 64, "v_head_dim": 64, "moe_intermediate_size": 256,
                "intermediate_size": 512}),
}


def checkpoint_builder(root: Path) -> Callable[[str], str]:
    """name -> the path of that VARIANTS checkpoint (3 layers, shrunk), written under `root` on first use."""
    built: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in built:
            src, overrides, fp8, after = VARIANTS[name]
            cfg = make_config(json.loads((CONFIGS / src).read_text()) | overrides, num_layers=3, shrink=True,
                              fp8=fp8) | after
            built[name] = str(write_checkpoint(cfg, root / name, progress=False))
        return built[name]
    return get


def prompt_logprobs(out: dict) -> list[float]:
    return [lp for lp, _tok, *_ in out["meta_info"]["input_token_logprobs"][1:]]


def clear_prefix(out: dict, margin: float) -> int:
    """Output tokens before the first greedy choice within `margin` nats of the runner-up."""
    for i, (first, second) in enumerate(out["meta_info"]["output_top_logprobs"]):
        if first[0] - second[0] < margin:
            return i
    return len(out["output_ids"])
