"""`mlaserve bench serving` against the live demo server: every backend completes every request and the
--output-file JSON has every metric."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlaserve.bench import serving

NUM_PROMPTS, OUTPUT_LEN = 4, 6
STAT_KEYS = [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2e_latency") for s in ("mean", "median", "std", "p99")]
METRIC_KEYS = ["duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
               "input_throughput", "output_throughput", "total_throughput", "concurrency", "errors", *STAT_KEYS]


@pytest.mark.parametrize("backend", ["openai-chat", "openai", "mlaserve"])
def test_bench_serving_against_the_demo_server(server, tmp_path: Path, backend: str, capsys):
    out = tmp_path / "bench.jsonl"
    rc = serving.main(["--base-url", server.url, "--backend", backend, "--api-key", server.api_key,
                       "--num-prompts", str(NUM_PROMPTS), "--random-input-len", "24",
                       "--random-output-len", str(OUTPUT_LEN), "--random-range-ratio", "1",
                       "--request-rate", "inf", "--warmup-requests", "1", "--disable-tqdm",
                       "--tokenizer", str(server.model_path), "--output-file", str(out)])
    assert rc == 0
    (line,) = out.read_text().splitlines()
    rec = json.loads(line)
    missing = [k for k in METRIC_KEYS if k not in rec]
    assert not missing, f"missing metrics: {missing}"
    assert (rec["completed"], rec["failed"], rec["errors"]) == (NUM_PROMPTS, 0, [])
    assert rec["model"] == "mlaserve-demo"
    assert rec["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN      # ignore_eos: exact lengths
    assert rec["total_input_tokens"] >= NUM_PROMPTS * 24               # the chat template / BOS add a few
    for k in STAT_KEYS:
        assert rec[k] is not None and rec[k] >= 0, k
    assert 0 < rec["mean_ttft_ms"] <= rec["mean_e2e_latency_ms"]
    assert "serving benchmark" in capsys.readouterr().out
