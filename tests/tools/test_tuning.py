"""The tuners' shared parts (CPU): parallel pre-compilation bookkeeping, the search loop, pruned spaces."""
from __future__ import annotations

import math

from mlaserve.bench.kernel_cases.fused_moe import MODELS
from mlaserve.tools import tune_fp8_gemm, tune_fused_moe
from mlaserve.tools.tuning import best_config, precompile


def test_precompile_counts_failed_jobs_in_workers_and_in_process() -> None:
    # math.sqrt(-1) raises: one failed job, whether run in two spawned workers or here
    assert precompile(math.sqrt, [4.0, -1.0, 9.0], processes=2) == 1
    assert precompile(math.sqrt, [4.0, -1.0], processes=0) == 1
    assert precompile(math.sqrt, []) == 0


def test_best_config_skips_candidates_that_raise() -> None:
    def timer(cfg: dict) -> float:
        if cfg["n"] == 1:
            raise RuntimeError("out of resources")
        return 10.0 / cfg["n"]
    cfg, ms = best_config([{"n": 1}, {"n": 2}, {"n": 5}], timer)
    assert cfg == {"n": 5} and ms == 2.0


def test_fused_moe_space_is_pruned_by_token_count() -> None:
    v2, v3 = MODELS
    for s in (v2, v3):
        for tokens in (1, 64, 256, 4096):
            space = list(tune_fused_moe.search_space(tokens, s))
            assert space, (s.name, tokens)
            elt = 1 if s.fp8 else 2
            for c in space:
                smem = (c["BLOCK_SIZE_M"] + c["BLOCK_SIZE_N"]) * c["BLOCK_SIZE_K"] * elt * c["num_stages"]
                assert smem <= tune_fused_moe.SMEM_BYTES
                assert not c.get("FUSE_QUANT") or tokens <= 256
    assert {c["BLOCK_SIZE_M"] for c in tune_fused_moe.search_space(4096, v2)} == {64, 128}   # 384 rows per expert


def test_fp8_gemm_split_k_only_while_tiles_leave_sms_idle() -> None:
    for m in (1, 16, 64):
        for c in tune_fp8_gemm.search_space(m, 7168, 16384):
            tiles = -(-m // c["BLOCK_M"]) * -(-7168 // c["BLOCK_N"])
            assert c["SPLIT_K"] == 1 or tiles < 2 * tune_fp8_gemm.NUM_SMS
