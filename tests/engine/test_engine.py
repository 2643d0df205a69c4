"""KV-pool sizing of the model runner (pure functions: budget and bytes per token -> token slots)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import mlaserve
from mlaserve.config import ModelConfig
from mlaserve.engine.engine import kv_pool_tokens
from mlaserve.kvcache.pool import MLAKVPool, kv_bytes_per_token

V3 = ModelConfig.from_dict(json.loads((Path(mlaserve.__file__).parent / "tools" / "configs" /
                                       "deepseek-v3.json").read_text()))


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_kv_cache_doubles_the_tokens_of_the_same_memory(fp8):
    layers = V3.num_hidden_layers + 1                                       # + the MTP layer
    bf16 = kv_bytes_per_token(layers, V3.kv_cache_dim, torch.bfloat16)
    assert bf16 == layers * 1152 and kv_bytes_per_token(layers, V3.kv_cache_dim, fp8) == layers * 576
    budget = 37.5 * 2**30                                                   # what is left of an H100 after weights
    tokens_bf16 = kv_pool_tokens(budget, bf16)
    tokens_fp8 = kv_pool_tokens(budget, kv_bytes_per_token(layers, V3.kv_cache_dim, fp8))
    assert tokens_fp8 in (2 * tokens_bf16, 2 * tokens_bf16 + 1) and tokens_bf16 == int(budget // bf16)


def test_pool_reports_the_bytes_it_sizes_with():
    pool = MLAKVPool(8, 3, 32, 8, torch.float8_e4m3fn)
    assert pool.bytes_per_token() == kv_bytes_per_token(3, 40, torch.float8_e4m3fn) == 120
    assert pool.buffers[0].element_size() == 1


def test_too_small_a_budget_says_what_to_do():
    with pytest.raises(RuntimeError, match="--mem-fraction-static"):
        kv_pool_tokens(100 * 576, 576)                                    # 100 tokens: fewer than 256
