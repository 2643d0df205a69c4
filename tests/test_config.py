from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlaserve.config import ConfigError, ModelConfig

import mlaserve

# the real config.json files of DeepSeek-V2-Lite and V3, shipped with the package
CONFIGS = Path(mlaserve.__file__).parent / "tools" / "configs"


def load(name: str) -> dict:
    return json.loads((CONFIGS / name).read_text())


def test_v2_lite_parses_unchanged():
    cfg = ModelConfig.from_dict(load("deepseek-v2-lite.json"))
    assert cfg.q_lora_rank is None and cfg.topk_method == "greedy" and cfg.scoring_func == "softmax"
    assert cfg.kv_cache_dim == 576 and cfg.qk_head_dim == 192 and not cfg.is_fp8
    assert not cfg.is_moe_layer(0) and cfg.is_moe_layer(1) and cfg.is_moe_layer(26)
    # YaRN: 1/sqrt(192) * (0.1 * 0.707 * ln 40 + 1)^2
    assert cfg.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * 0.707 * 3.6888794541139363 + 1) ** 2)


def test_v3_parses_unchanged():
    cfg = ModelConfig.from_dict(load("deepseek-v3.json"))
    assert cfg.q_lora_rank == 1536 and cfg.topk_method == "noaux_tc" and cfg.scoring_func == "sigmoid"
    assert (cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok) == (8, 4, 8)
    assert cfg.norm_topk_prob and cfg.routed_scaling_factor == 2.5
    assert cfg.quant is not None and cfg.quant.block == (128, 128) and cfg.quant.fmt == "e4m3"
    assert cfg.num_nextn_predict_layers == 1 and cfg.first_k_dense_replace == 3
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 40


def test_moe_layer_freq():
    d = load("deepseek-v2-lite.json") | {"moe_layer_freq": 2, "first_k_dense_replace": 1}
    cfg = ModelConfig.from_dict(d)
    assert [cfg.is_moe_layer(i) for i in range(5)] == [False, False, True, False, True]


@pytest.mark.parametrize("key,value,words", [
    ("topk_method", "random", "topk_method='random'"),
    ("scoring_func", "relu", "scoring_func='relu'"),
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("num_key_value_heads", 8, "num_key_value_heads=8"),
    ("architectures", ["LlamaForCausalLM"], "architectures=['LlamaForCausalLM']"),
    ("quantization_config", {"quant_method": "awq"}, "quantization_config.quant_method='awq'"),
    ("quantization_config", {"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]},
     "quantization_config.fmt='e5m2'"),
    ("quantization_config", {"quant_method": "fp8", "weight_block_size": [64, 64]},
     "quantization_config.weight_block_size=[64, 64]"),
    ("rope_scaling", {"type": "linear", "factor": 2}, "rope_scaling.type='linear'"),
])
def test_unsupported_values_fail_with_one_line(key, value, words):
    d = load("deepseek-v3.json") | {key: value}
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(d)
    msg = str(e.value)
    assert words in msg and "\n" not in msg


def test_groups_must_hold_the_top_k():
    """Grouped routing picks top_k experts from the topk_group best groups: fewer experts there than top_k would
    pick one expert twice."""
    with pytest.raises(ConfigError, match="its 32 experts are fewer than num_experts_per_tok") as e:
        ModelConfig.from_dict(load("deepseek-v3.json") | {"n_group": 8, "topk_group": 1, "num_experts_per_tok": 40})
    assert "\n" not in str(e.value)


def test_noaux_needs_sigmoid():
    with pytest.raises(ConfigError, match="scoring_func='softmax'"):
        ModelConfig.from_dict(load("deepseek-v3.json") | {"scoring_func": "softmax"})
