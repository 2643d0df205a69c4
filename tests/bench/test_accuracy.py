"""bench accuracy: the teacher-forced driver (one process, and tp / ep / DP-attention ranks over gloo), and the
shipped demo model's held-out bits per byte on the CPU."""
from __future__ import annotations

import pytest
import tokenizers
import torch

from mlaserve.bench.accuracy import MODES, Mode, format_table, run_mode, run_modes, selected_modes, summarise
from mlaserve.demo import DEMO_DIR
from mlaserve.tools import corpus

FP32 = MODES[0]
# Measured on the CPU (2026-11-24, pip 25.x/26.x sources): 1.25 .. 1.30 bits/byte on these 4 windows of 256
# tokens (the first files of pip, short context); 0.995 over all of pip with 1024-token windows on the GPU.
MAX_BITS_PER_BYTE = 1.5


def _heldout(n: int, length: int):
    path = str(DEMO_DIR)
    tok = tokenizers.Tokenizer.from_file(f"{path}/tokenizer.json")
    wins = corpus.heldout_windows(tok, length, n)
    return path, wins, torch.from_numpy(corpus.token_bytes(tok)[wins[:, 1:]])


def test_shipped_demo_model_heldout_bits_per_byte(one_thread):
    path, wins, weights = _heldout(4, 256)
    assert wins.shape == (4, 256)
    row = summarise(FP32, run_mode(path, FP32, wins, 255, {"device": "cpu"}), None, weights)
    assert row.bits_per_byte < MAX_BITS_PER_BYTE, row


def test_decode_steps_score_like_the_prefill(one_thread):
    """Teacher-forced decode through the KV cache gives the prefill's log-probs (fp32), and the table says so."""
    path, wins, weights = _heldout(2, 24)
    full = run_mode(path, FP32, wins, 23, {"device": "cpu"})
    stepped = run_mode(path, FP32, wins, 17, {"device": "cpu"})
    assert (full.logprobs - stepped.logprobs).abs().max() < 1e-4
    bf16 = Mode("bf16", {"dtype": "bfloat16", "disable_cuda_graph": True}, 0.02)
    rows = [summarise(FP32, full, None, weights), summarise(bf16, stepped, full, weights)]
    assert rows[0].agreement == 1.0 and rows[1].agreement == 1.0 and abs(rows[1].rel) < 1e-6
    assert "| bf16 | " in format_table(rows, 46, int(weights.sum()))
    # four text tokens a step through the multi-query decode (the speculative verify path): the same log-probs
    verify = Mode("fp32 verify", FP32.flags, 0.0, verify_tokens=4)
    multi = run_mode(path, verify, wins, 9, {"device": "cpu"})
    assert (full.logprobs - multi.logprobs).abs().max() < 1e-4


def test_parallel_modes_score_like_one_process(one_thread):
    """tp 2, tp 2 + ep 2 and DP attention (with and without ep 2) on two gloo ranks give the single process's fp32
    log-probs and greedy tokens, and their rows pass. Three windows: the DP groups take two and one, so the MoE
    gathers unequal token counts."""
    path, wins, weights = _heldout(3, 24)
    ref = run_mode(path, FP32, wins, 17, {"device": "cpu"})
    parallel = [m for m in MODES if m.world > 1]
    assert {m.name for m in parallel} >= {"fp32, tp 2", "fp32, tp 2 + ep 2", "fp32, tp 2 dp 2 dp-attention"}
    for dp in (1, 2):                                  # one set of ranks per layout
        modes = [m for m in parallel if m.dp == dp]
        for mode, got in zip(modes, run_modes([(path, m) for m in modes], wins, 17, {"device": "cpu"})):
            assert (got.logprobs - ref.logprobs).abs().max() < 1e-4, mode.name
            assert torch.equal(got.greedy, ref.greedy), mode.name
            row = summarise(mode, got, ref, weights)
            assert row.ok and row.agreement == 1.0, row


def test_modes_on_the_cpu_skip_cuda_graphs_and_keep_the_reference():
    cpu = selected_modes(None, gpus=0)
    assert cpu[0] == FP32 and not any(m.gpu_only for m in cpu)
    assert [m.name for m in selected_modes(["bf16"], gpus=0)] == ["fp32", "bf16"]
    assert len(selected_modes(None, gpus=2)) == len(MODES)


def test_parallel_modes_are_selected_by_name_and_need_gpus_only_on_a_gpu():
    tp2 = ["fp32", "fp32, tp 2"]
    assert [m.name for m in selected_modes(["fp32, tp 2"], gpus=0)] == tp2
    assert [m.name for m in selected_modes(["fp32, tp 2"], gpus=2)] == tp2
    assert [m.name for m in selected_modes(["fp32, tp 2"], gpus=1)] == ["fp32"]      # one GPU: no second rank
    with pytest.raises(ValueError, match="unknown mode 'tp2'.*fp32, tp 2 dp 2 dp-attention"):
        selected_modes(["tp2"], gpus=0)
